//! A server binary built by a third party: the runtime, the in-tree backends it wants, and its
//! own backend crate (`pegaflow_examples`: the `memcpy-verify` transport and the `heap-store`
//! tier). Same flags, `--list-plugins`, `--print-config` and exit codes as `pegaflow-server`.
//!
//! `cargo run -p pegaflow-examples --bin pegaflow-server-verify -- --config examples/pipelines/verify.toml`

use pegaflow_examples as _;
use pegaflow_tier_dram as _;
use pegaflow_transport_shm as _;

fn main() -> std::process::ExitCode {
    pegaflow_runtime::main()
}
