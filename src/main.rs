//! `pegaflow-server`: parses the command line, links the in-tree backends chosen by cargo
//! features (their `inventory` registrations), and runs the runtime.

use clap::Parser;
use pegaflow_runtime::config::Cli;

// Link the backends so their factories register (the linker may drop an unreferenced crate).
#[cfg(feature = "dram")]
use pegaflow_tier_dram as _;
#[cfg(any(feature = "cuda-13", feature = "cuda-12"))]
use pegaflow_transport_cuda as _;
#[cfg(feature = "shm")]
use pegaflow_transport_shm as _;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.list_plugins {
        print!("{}", pegaflow_runtime::plugin::describe_plugins());
        return Ok(());
    }
    let pipeline = match cli.pipeline() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("pegaflow-server: {e:#}");
            std::process::exit(2);
        }
    };
    if cli.print_config {
        print!("{}", pipeline.to_toml());
        return Ok(());
    }
    pegaflow_runtime::init_logging(&pipeline.server.log_level)?;
    for note in cli.notes() {
        tracing::info!("{note}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("pegaflow-rt")
        .build()?;
    if let Err(e) = rt.block_on(pegaflow_runtime::run(pipeline)) {
        tracing::error!("{e:#}");
        eprintln!("pegaflow-server: {e:#}");
        std::process::exit(1);
    }
    Ok(())
}
