//! The conformance suites instantiated for this crate's backends: the transport suite for the
//! `cuda` transport over device memory, the registrar suite for `cuda-vmm` (native VMM
//! allocations on the side channel) and `cuda-ipc` (the Python client's pickles).
//!
//! GPU cases are opt-in (`PEGAFLOW_GPU_TESTS=1` on a CUDA machine, as `tests/gpu.rs`): the
//! `cuda` transport's cases are `#[ignore]`d (run them with `-- --include-ignored`); the
//! registrar cases that need a GPU report themselves skipped (`pegaflow_tests::skip!`) and return. What needs no GPU runs everywhere: the
//! registrars' refusals (bounds, discarded descriptors, wrong carriers, malformed pickles)
//! are decided before any driver call. The `cuda-ipc` imports themselves need memory exported
//! by another process (CUDA refuses to open a handle of its own process), so the suite's
//! import cases skip for it even on a GPU; `tests/gpu.rs` covers them with a child process.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use pegaflow_api::vmm::VmmAllocation;
use pegaflow_api::TransferMode;
use pegaflow_fd_channel::FdChannel;
use pegaflow_plugin::{
    transport_factory, CopyBatch, CopyOp, Direction, LayerRegion, MemorySpace, Registrar,
    RegistrationPayload, RuntimeContext, Transport,
};
use pegaflow_tests::registrar_suite::{ClientMemory, RegistrarMaker};
use pegaflow_tests::transport_suite::{TestMemory, TransportMaker};
use pegaflow_transport_cuda::testing::DeviceBuffer;
use pegaflow_transport_cuda::{cuda_space, driver, CudaIpcRegistrar, CudaVmmRegistrar};

const GPU_OFF: &str = "set PEGAFLOW_GPU_TESTS=1 on a CUDA machine to run the GPU tests";

fn gpu() -> Result<(), String> {
    if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() == Ok("1") {
        Ok(())
    } else {
        Err(GPU_OFF.into())
    }
}

/// Device memory on GPU 0 as the transport suite's registration side.
struct DeviceMemory(DeviceBuffer);

impl TestMemory for DeviceMemory {
    fn space(&self) -> MemorySpace {
        cuda_space(0)
    }
    fn addr(&self) -> u64 {
        self.0.ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn write(&self, offset: usize, src: &[u8]) {
        self.0.upload(offset, src).expect("upload");
    }
    fn read(&self, offset: usize, dst: &mut [u8]) {
        self.0.download(offset, dst).expect("download");
    }
}

fn device_memory(len: usize) -> Arc<dyn TestMemory> {
    let buf = DeviceBuffer::new(0, len).expect("PEGAFLOW_GPU_TESTS=1 but no device memory");
    // cuMemAlloc memory is not zeroed.
    buf.fill(0).expect("memset");
    Arc::new(DeviceMemory(buf))
}

fn cuda_transport() -> Arc<dyn Transport> {
    let f = transport_factory("cuda").expect("the cuda transport is linked");
    (f.build)(&toml::Table::new(), &RuntimeContext::default()).expect("the cuda transport builds")
}

mod cuda {
    use super::*;

    const MAKER: TransportMaker = TransportMaker {
        make: cuda_transport,
        memory: device_memory,
        available: gpu,
    };

    pegaflow_tests::transport_conformance_tests!(
        ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored",
        MAKER
    );
}

/// A VMM allocation as the registrar suite's client memory.
struct VmmClient(VmmAllocation);

impl ClientMemory for VmmClient {
    fn len_bytes(&self) -> u64 {
        self.0.len() as u64
    }
    fn fd(&self) -> BorrowedFd<'_> {
        self.0.fd()
    }
    fn write(&self, offset: u64, src: &[u8]) {
        self.0.upload(offset as usize, src).expect("upload");
    }
}

/// Reads a region of device memory through the server's mapping, with the `cuda` transport.
fn read_device(region: LayerRegion, offset: u64, len: usize) -> BoxFuture<'static, Vec<u8>> {
    static READER: OnceLock<Arc<dyn Transport>> = OnceLock::new();
    let t = READER.get_or_init(cuda_transport).clone();
    Box::pin(async move {
        assert!(offset + len as u64 <= region.len, "read outside the region");
        let mut out = vec![0u8; len];
        let batch = CopyBatch {
            location: region.memory.location(),
            direction: Direction::ToHost,
            mode: TransferMode::Direct,
            ops: vec![CopyOp {
                device_addr: region.memory.base_addr() + region.offset + offset,
                host_addr: out.as_mut_ptr() as usize,
                len,
            }],
        };
        t.copy(batch).await.expect("read through the mapping");
        out
    })
}

mod cuda_vmm {
    use super::*;

    fn make(channel: Option<Arc<FdChannel>>, fd_timeout: Duration) -> Arc<dyn Registrar> {
        Arc::new(CudaVmmRegistrar::new(
            channel.map(|c| c as Arc<dyn pegaflow_plugin::SideChannel>),
            fd_timeout,
            None,
        ))
    }

    fn client(_name: &str, device_id: i32, len: u64) -> Result<Box<dyn ClientMemory>, String> {
        gpu()?;
        let a = VmmAllocation::new(device_id, len as usize)
            .expect("PEGAFLOW_GPU_TESTS=1 but no VMM allocation");
        Ok(Box::new(VmmClient(a)))
    }

    const MAKER: RegistrarMaker = RegistrarMaker {
        make,
        client,
        read: read_device,
        live_mappings: pegaflow_transport_cuda::vmm::live_mappings_of,
        device_ids: &[0],
        malformed: pegaflow_tests::registrar_suite::no_extra_malformed,
    };

    pegaflow_tests::registrar_conformance_tests!(MAKER);
}

mod cuda_ipc {
    use super::*;

    fn make(_channel: Option<Arc<FdChannel>>, _fd_timeout: Duration) -> Arc<dyn Registrar> {
        Arc::new(CudaIpcRegistrar::new(None))
    }

    fn client(_name: &str, _device_id: i32, _len: u64) -> Result<Box<dyn ClientMemory>, String> {
        Err("cuda-ipc imports memory exported by another process (tests/gpu.rs covers them)".into())
    }

    fn unreachable_read(_: LayerRegion, _: u64, _: usize) -> BoxFuture<'static, Vec<u8>> {
        panic!("cuda-ipc has no client memory in this suite: no region to read")
    }

    /// IPC mappings open in this process (only this module's cases could open one here).
    fn open_ipc_mappings(_instance_id: &str) -> usize {
        driver()
            .ok()
            .and_then(|d| d.registry().ok())
            .map_or(0, |r| r.open_mappings())
    }

    fn golden(name: &str) -> Vec<u8> {
        let p = format!("{}/testdata/{name}.pickle.hex", env!("CARGO_MANIFEST_DIR"));
        let s = std::fs::read_to_string(p).expect("golden pickle");
        let s = s.trim();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Pickles the registrar refuses before any driver call: torch's expandable-segments
    /// wrapper, a valid layer followed by a truncated one, a pickle cut in half.
    fn malformed() -> Vec<RegistrationPayload> {
        let good = golden("wrapper_default");
        vec![
            RegistrationPayload::LayerBlobs(vec![golden("wrapper_expandable")]),
            RegistrationPayload::LayerBlobs(vec![good.clone(), good[..good.len() - 9].to_vec()]),
            RegistrationPayload::LayerBlobs(vec![good[..good.len() / 2].to_vec()]),
        ]
    }

    const MAKER: RegistrarMaker = RegistrarMaker {
        make,
        client,
        read: unreachable_read,
        live_mappings: open_ipc_mappings,
        device_ids: &[0],
        malformed,
    };

    pegaflow_tests::registrar_conformance_tests!(MAKER);
}
