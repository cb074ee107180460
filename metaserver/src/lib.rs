//! `pegaflow-metaserver`: the cross-node block directory as a service, PegaFlow's MetaServer
//! gRPC protocol (`pegaflow.MetaServer`, `engine-wire.md` §11) with PegaFlow's flags, over any
//! [`pegaflow_plugin::Directory`] backend:
//! - the in-memory directory ([`pegaflow_directory::memory::MemoryDirectory`], the default),
//!   swept every `--sweep-interval-secs`, with PegaFlow's store gauges on `/metrics`;
//! - the Redis directory (`--redis URL`, [`pegaflow_directory::redis_dir::RedisDirectory`]):
//!   the service keeps no state, so several MetaServer processes can share one Redis.
//!
//! Owns: the gRPC service ([`grpc`], over the pass-through [`codec`]), request validation,
//! the offloading of large requests and the mapping of refusals to gRPC codes ([`service`]),
//! the metrics ([`metrics`]), `/health` and `/metrics` ([`http`]), rate-limited logging
//! ([`throttle`]), the command line ([`cli`]) and the process lifecycle ([`server`]). Must
//! never keep directory state of its own (everything a call answers comes from the
//! backend), log a client string longer than 64 characters whole, or run a large request on
//! an async worker.

pub mod cli;
pub mod codec;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod server;
pub mod service;
pub mod throttle;

use std::process::ExitCode;

/// The binary's entry point: parses and checks the flags (exit status 2 on a usage error,
/// as clap), installs the logger, serves until SIGINT or SIGTERM. Exit status 0 after a
/// clean shutdown, 1 when the server cannot start (a port in use, a bad Redis URL).
pub fn main() -> ExitCode {
    let settings = cli::parse();
    if let Err(e) = server::init_logging(&settings.log_level) {
        eprintln!("error: {e:#}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("metaserver")
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(server::run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
