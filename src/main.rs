//! `pegaflow-server`: links the in-tree backends chosen by cargo features (their `inventory`
//! registrations) and runs the runtime's one entry point.

// Link the backends so their factories register (the linker may drop an unreferenced crate).
#[cfg(feature = "directory")]
use pegaflow_directory as _;
#[cfg(feature = "dram")]
use pegaflow_tier_dram as _;
#[cfg(feature = "ssd")]
use pegaflow_tier_ssd as _;
#[cfg(any(feature = "cuda-13", feature = "cuda-12"))]
use pegaflow_transport_cuda as _;
#[cfg(feature = "rdma-emu")]
use pegaflow_transport_rdma as _;
#[cfg(feature = "shm")]
use pegaflow_transport_shm as _;
#[cfg(feature = "tcp")]
use pegaflow_transport_tcp as _;

// `--metaserver-addr` without `--nics` or `--peer-data-addr` serves peers over TCP, its data
// port on the host of `--addr` (docs/OPERATIONS.md section 2.1), rather than advertising
// blocks that no peer could fetch from this node.
#[cfg(feature = "tcp")]
inventory::submit! {
    pegaflow_plugin::DefaultPeerPath {
        kind: "tcp",
        addr_setting: "data_addr",
        addr_flag: "peer-data-addr",
    }
}

/// The heap allocator (the `mimalloc` feature, on by default): see Cargo.toml's feature list.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    pegaflow_runtime::main()
}
