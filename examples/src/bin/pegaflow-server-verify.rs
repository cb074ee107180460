//! A server binary built by a third party: the runtime, the in-tree backends it wants, and its
//! own backend crate (`pegaflow_examples`, kind `memcpy-verify`).
//!
//! `cargo run -p pegaflow-examples --bin pegaflow-server-verify -- --config examples/pipelines/verify.toml`

use clap::Parser;
use pegaflow_runtime::config::Cli;

use pegaflow_examples as _;
use pegaflow_tier_dram as _;
use pegaflow_transport_shm as _;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.list_plugins {
        print!("{}", pegaflow_runtime::plugin::describe_plugins());
        return Ok(());
    }
    let pipeline = cli.pipeline()?;
    pegaflow_runtime::init_logging(&pipeline.server.log_level)?;
    tokio::runtime::Runtime::new()?.block_on(pegaflow_runtime::run(pipeline))
}
