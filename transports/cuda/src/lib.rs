//! `pegaflow-transport-cuda`: the CUDA backends of the KV-cache server.
//!
//! - registrar kind `cuda-ipc` ([`CudaIpcRegistrar`]): imports the published Python client's
//!   pickled `CudaIPCWrapper`s ([`wrapper`]) as CUDA IPC mappings whose regions live in the
//!   [`CUDA_DOMAIN`] memory space ([`cuda_space`]);
//! - registrar kind `cuda-vmm` ([`CudaVmmRegistrar`]): imports a native engine's CUDA VMM
//!   allocation, sent as a POSIX fd on the side channel, and maps it (fence → drain → unmap on
//!   the `cuda-registry` thread);
//! - transport kind `cuda` ([`CudaTransport`]): moves Save/Load batches between that memory
//!   and the landing tier's host buffers, pinning the host memory the runtime installs in the
//!   background.
//!
//! The CUDA driver (libcuda) is loaded at run time through cudarc: this crate builds and its
//! unit tests run on machines without CUDA. Every entry point checks the driver first
//! ([`driver::driver`]) and fails with "CUDA driver not available: ..." instead of panicking;
//! the server keeps serving without it. Cargo features `cuda-13` (default) and `cuda-12` pick
//! the driver API generation (exactly one per build).
//!
//! Owns nothing outside CUDA: it never decides what is cached (the engine does), never
//! validates block ids (the engine does, against the regions this crate returns), and never
//! runs a CUDA call on an async executor thread.
//!
//! GPU tests are opt-in (`PEGAFLOW_GPU_TESTS=1`, see `tests/gpu.rs`); `examples/cuda_bench.rs`
//! measures copy bandwidth on the Llama-8B bench layout.

#![warn(missing_docs)]

pub mod driver;
pub mod host_numa;
pub mod pickle;
pub mod pin;
pub mod plan;
pub mod registrar;
pub mod testing;
pub mod transport;
pub mod vmm;
pub mod wrapper;

pub use driver::{driver, CudaError, DeviceInfo, Driver};

use pegaflow_plugin::MemorySpace;

/// The memory-space domain of CUDA device memory this crate declares: registrations of its
/// registrars live there, and its transport addresses it. The ordinal is the CUDA device
/// ordinal in this process.
pub const CUDA_DOMAIN: &str = "cuda";

/// The memory space of CUDA device `ordinal`.
pub const fn cuda_space(ordinal: i32) -> MemorySpace {
    MemorySpace::new(CUDA_DOMAIN, ordinal)
}
pub use registrar::{CudaIpcConfig, CudaIpcRegistrar, IpcMapping};
pub use transport::{
    CopyPath, CopyReport, CudaTransport, CudaTransportConfig, KernelPath, Policy, Wait,
};
pub use vmm::{CudaVmmConfig, CudaVmmRegistrar};
pub use wrapper::{parse_wrapper, CudaIpcWrapper, MemHandle, WrapperError};
