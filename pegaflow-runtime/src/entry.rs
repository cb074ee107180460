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
//! this build lacks); 1 ([`START_UP_FAILURE`]) when the server fails at start-up (a port
//! taken, a tier that cannot be built) or while running, and when `--check-config`'s start-up
//! checks find such a failure ahead of time (a directory this user cannot create, huge pages
//! the kernel does not have).

use std::process::ExitCode;

use clap::Parser;

use crate::config::Cli;

/// The exit status of every configuration error (a flag, the pipeline file, a backend's
/// settings, a log level, an address): 2, as clap exits for a usage error.
pub const CONFIG_ERROR: u8 = 2;

/// The exit status of a start-up failure (a port taken, a tier that cannot be built), and of a
/// `--check-config` whose start-up checks found one ahead of time: 1.
pub const START_UP_FAILURE: u8 = 1;

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
    let (pipeline, added) = match cli.pipeline_and_notes() {
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
        let report = pipeline.preflight();
        print!("{}", pipeline.render_check(&report));
        return if report.ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(START_UP_FAILURE)
        };
    }
    if cli.flags.print_config {
        print!("{}", pipeline.to_toml());
        return ExitCode::SUCCESS;
    }
    if let Err(e) = crate::init_logging(&pipeline.server.log_level) {
        eprintln!("{bin}: {e:#}");
        return ExitCode::from(CONFIG_ERROR);
    }
    for note in cli.notes().into_iter().chain(added) {
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
            return ExitCode::from(START_UP_FAILURE);
        }
    };
    match rt.block_on(crate::run(pipeline)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("{bin}: {e:#}");
            ExitCode::from(START_UP_FAILURE)
        }
    }
}
