//! The one entry point every server binary calls: ours (`pegaflow-server`) and a third
//! party's, so that every build has the same flags, the same `--list-plugins` and
//! `--print-config`, and the same exit codes.
//!
//! A binary links the backend crates it wants (`use some_backend as _;`, so that their
//! `inventory` registrations survive linking) and calls [`main`]:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     pegaflow_runtime::main()
//! }
//! ```
//!
//! Exit codes: 0 after a clean shutdown (or after `--help`, `--version`, `--list-plugins`,
//! `--print-config`, a passing `--check-config`); 2 ([`CONFIG_ERROR`]) for a command line or
//! pipeline the server refuses (unknown flag, bad value, invalid TOML, an unknown log level,
//! an address that does not resolve, an unknown kind or backend setting, a flag of a part
//! this build lacks); 1 when the server fails at start-up (a port taken, a tier that cannot
//! be built) or while running.

use std::process::ExitCode;

use clap::Parser;

use crate::config::Cli;

/// The exit status of every configuration error (a flag, the pipeline file, a backend's
/// settings, a log level, an address): 2, as clap exits for a usage error.
pub const CONFIG_ERROR: u8 = 2;

/// Parses the command line, then lists the plugins, prints the pipeline, or runs the server
/// until SIGINT, SIGTERM or the Shutdown RPC. See the module doc for exit codes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let bin = std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "pegaflow-server".into());
    if cli.flags.list_plugins {
        print!("{}", crate::plugin::describe_plugins());
        return ExitCode::SUCCESS;
    }
    let pipeline = match cli.pipeline() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{bin}: {e:#}");
            return ExitCode::from(CONFIG_ERROR);
        }
    };
    // Every configuration error exits CONFIG_ERROR; start-up checks what it can before
    // binding anything, so a typo'd key or an unresolvable address is one too.
    if let Err(e) = pipeline.check() {
        eprintln!("{bin}: {e:#}");
        return ExitCode::from(CONFIG_ERROR);
    }
    if cli.flags.check_config {
        print!("{}", pipeline.describe());
        return ExitCode::SUCCESS;
    }
    if cli.flags.print_config {
        print!("{}", pipeline.to_toml());
        return ExitCode::SUCCESS;
    }
    if let Err(e) = crate::init_logging(&pipeline.server.log_level) {
        eprintln!("{bin}: {e:#}");
        return ExitCode::from(CONFIG_ERROR);
    }
    for note in cli.notes() {
        tracing::info!("{note}");
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("pegaflow-rt")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{bin}: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(crate::run(pipeline)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("{bin}: {e:#}");
            ExitCode::from(1)
        }
    }
}
