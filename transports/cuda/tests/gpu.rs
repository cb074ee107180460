//! GPU tests of the `cuda` transport and the `cuda-ipc` registrar. Opt-in: every test is
//! `#[ignore]`d (shown as ignored where there is no GPU); run them with `PEGAFLOW_GPU_TESTS=1`
//! and `-- --include-ignored` on a machine with a CUDA GPU (without the variable they print
//! why and return).
//!
//! The IPC test needs a second process (CUDA refuses to open a handle exported by the same
//! process): it re-executes this test binary, running only `ipc_export_child` with
//! `PEGAFLOW_IPC_CHILD=1`, which allocates, fills and exports device memory, prints the handle
//! and waits for its stdin to close.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_api::TransferMode;
use pegaflow_plugin::{
    op_parts, CopyBatch, CopyOp, Direction, ImportRequest, Registrar, RegistrarError,
    RegistrationPayload, RuntimeContext, SourceRead, Transport,
};
use pegaflow_transport_cuda::testing::{DeviceBuffer, HostArena};
use pegaflow_transport_cuda::wrapper::{encode_wrapper, parse_wrapper};
use pegaflow_transport_cuda::{
    driver, CopyPath, CopyReport, CudaIpcRegistrar, CudaTransport, CudaTransportConfig, KernelPath,
    Policy, Wait,
};

fn gpu_tests() -> bool {
    if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    pegaflow_tests::skip!("set PEGAFLOW_GPU_TESTS=1 on a CUDA machine to run the GPU tests");
    false
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A two-thread runtime, for tests whose copies run next to another task (a listener, or
/// other copies).
fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const DEV_LEN: usize = 64 << 20;
const SLOT: usize = 64 << 10;

/// Scattered ops: 32 KiB aligned segments (mostly in host-contiguous runs, like a Save batch)
/// plus odd-sized, odd-offset ranges; device ranges disjoint, host ranges disjoint.
fn make_ops(rng: &mut Rng, dev_base: u64, host_base: usize, host_len: usize) -> Vec<CopyOp> {
    let slots = DEV_LEN / SLOT;
    let mut perm: Vec<usize> = (0..slots).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut ops = Vec::new();
    let mut h = 0usize;
    for (k, &slot) in perm.iter().take(600).enumerate() {
        let (off, len) = if k % 5 == 4 {
            (1 + rng.below(100) as usize, 1 + rng.below(40_000) as usize)
        } else {
            (0, 32 << 10)
        };
        if k % 16 == 0 {
            h += rng.below(3) as usize * 4096 + if k % 32 == 0 { 3 } else { 0 };
        }
        if h + len > host_len {
            break;
        }
        ops.push(CopyOp {
            device_addr: dev_base + (slot * SLOT + off) as u64,
            host_addr: host_base + h,
            len,
        });
        h += len;
    }
    ops
}

struct Fixture {
    dev: DeviceBuffer,
    dev_data: Vec<u8>,
    arena: Arc<HostArena>,
    transport: CudaTransport,
}

fn fixture(cfg: CudaTransportConfig, seed: u64) -> Fixture {
    let dev = DeviceBuffer::new(0, DEV_LEN).unwrap();
    let mut dev_data = vec![0u8; DEV_LEN];
    Rng(seed).fill(&mut dev_data);
    dev.upload(0, &dev_data).unwrap();
    let arena = Arc::new(HostArena::new(48 << 20).unwrap());
    let ctx = RuntimeContext::default();
    let transport = CudaTransport::new(cfg, &ctx);
    transport.install_host_memory(&arena.regions()).unwrap();
    assert!(transport.wait_pinned(Duration::from_secs(60)));
    Fixture {
        dev,
        dev_data,
        arena,
        transport,
    }
}

/// Runs `batch` whole (`split` 0) or as `split` parts: the batch's own ops empty, the parts
/// sent from another thread with a pause between them, so the worker waits for parts while
/// the first ones copy.
fn run(f: &Fixture, mut batch: CopyBatch, split: usize) -> CopyReport {
    if split == 0 {
        return block_on(f.transport.copy_with_report(batch)).unwrap();
    }
    let ops = std::mem::take(&mut batch.ops);
    let (tx, parts) = op_parts();
    let per = ops.len().div_ceil(split).max(1);
    let sender = std::thread::spawn(move || {
        for part in ops.chunks(per) {
            tx.send(part.to_vec());
            std::thread::sleep(Duration::from_millis(1));
        }
        tx.finish();
    });
    let rep = block_on(f.transport.copy_parts_with_report(batch, parts)).unwrap();
    sender.join().unwrap();
    rep
}

fn roundtrip(f: &Fixture, ops: &[CopyOp], mode: TransferMode, expect: CopyPath, seed: u64) {
    roundtrip_split(f, ops, mode, expect, seed, 0)
}

fn roundtrip_split(
    f: &Fixture,
    ops: &[CopyOp],
    mode: TransferMode,
    expect: CopyPath,
    seed: u64,
    split: usize,
) {
    let host_base = f.arena.addr();
    // SAFETY: no copy is in flight.
    unsafe { f.arena.bytes_mut() }.fill(0);
    let batch = |direction| CopyBatch {
        location: pegaflow_transport_cuda::cuda_space(0),
        direction,
        mode,
        ops: ops.to_vec(),
    };
    let rep = run(f, batch(Direction::ToHost), split);
    assert_eq!(rep.path, expect, "ToHost path");
    let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
    assert_eq!(rep.bytes, bytes, "ToHost bytes reported");
    // SAFETY: the copy completed.
    let host = unsafe { f.arena.bytes() };
    let mut expect_host = vec![0u8; host.len()];
    for o in ops {
        let d = (o.device_addr - f.dev.ptr()) as usize;
        let h = o.host_addr - host_base;
        expect_host[h..h + o.len].copy_from_slice(&f.dev_data[d..d + o.len]);
    }
    assert!(host == &expect_host[..], "ToHost bytes differ ({expect:?})");

    // Load: new random host bytes into a zeroed device; bytes outside the ops stay zero.
    let mut fresh = vec![0u8; host.len()];
    Rng(seed ^ 0x5555).fill(&mut fresh);
    // SAFETY: no copy is in flight.
    unsafe { f.arena.bytes_mut() }.copy_from_slice(&fresh);
    f.dev.fill(0).unwrap();
    let rep = run(f, batch(Direction::ToDevice), split);
    assert_eq!(rep.path, expect, "ToDevice path");
    assert_eq!(rep.bytes, bytes, "ToDevice bytes reported");
    let mut back = vec![0u8; DEV_LEN];
    f.dev.download(0, &mut back).unwrap();
    let mut expect_dev = vec![0u8; DEV_LEN];
    for o in ops {
        let d = (o.device_addr - f.dev.ptr()) as usize;
        let h = o.host_addr - host_base;
        expect_dev[d..d + o.len].copy_from_slice(&fresh[h..h + o.len]);
    }
    assert!(back == expect_dev, "ToDevice bytes differ ({expect:?})");
    // Restore the device contents for the next round.
    f.dev.upload(0, &f.dev_data).unwrap();
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn transport_roundtrips_byte_exact_on_every_path() {
    if !gpu_tests() {
        return;
    }
    let d = driver().expect("PEGAFLOW_GPU_TESTS=1 but no CUDA driver");
    assert!(!d.devices().is_empty());
    eprintln!("devices: {:?}", d.devices());
    // Every kernel path, and every way of waiting for a batch's end (on the direct path too).
    for (i, (kernel_path, wait)) in [
        (KernelPath::Staged, Wait::Sleep),
        (KernelPath::Mapped, Wait::Sleep),
        (KernelPath::Staged, Wait::Tail),
        (KernelPath::Staged, Wait::Spin),
        (KernelPath::Mapped, Wait::Tail),
    ]
    .into_iter()
    .enumerate()
    {
        eprintln!("{kernel_path:?}, wait {wait:?}");
        let cfg = CudaTransportConfig {
            policy: Policy::Hint,
            kernel_path,
            wait,
            staging_chunk: 1 << 20, // several chunks per batch: exercises double buffering
            pin_chunk: 2 << 20,     // several pinned ranges: exercises boundary splits
            // Marks every MiB and a 2 MiB tail: `tail` sleeps on a mark before it polls, and
            // reuses its mark events from one batch to the next.
            tail_bytes: 2 << 20,
            mark_bytes: 1 << 20,
            ..Default::default()
        };
        let f = fixture(cfg, 42 + i as u64);
        let pins = f.transport.pins().unwrap();
        assert_eq!(pins.pinned_bytes(), 48 << 20);
        let mut rng = Rng(7 + i as u64);
        let ops = make_ops(&mut rng, f.dev.ptr(), f.arena.addr(), f.arena.len());
        assert!(ops.len() > 500);
        let kernel_expect = match kernel_path {
            KernelPath::Staged => CopyPath::Staged,
            KernelPath::Mapped => CopyPath::Mapped,
        };
        roundtrip(
            &f,
            &ops,
            TransferMode::Kernel,
            kernel_expect,
            100 + i as u64,
        );
        roundtrip(
            &f,
            &ops,
            TransferMode::Direct,
            CopyPath::Direct,
            200 + i as u64,
        );
        // One op, and aligned-only ops.
        roundtrip(&f, &ops[..1], TransferMode::Kernel, kernel_expect, 300);
        let aligned: Vec<CopyOp> = ops.iter().copied().filter(|o| o.len == 32 << 10).collect();
        roundtrip(&f, &aligned, TransferMode::Kernel, kernel_expect, 400);
        // The same batches handed over in parts while they copy.
        for (split, seed) in [(2, 500), (7, 600), (ops.len(), 700)] {
            roundtrip_split(&f, &ops, TransferMode::Kernel, kernel_expect, seed, split);
            roundtrip_split(
                &f,
                &ops,
                TransferMode::Direct,
                CopyPath::Direct,
                seed + 1,
                split,
            );
        }
    }
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn a_batch_whose_parts_stop_unfinished_fails_and_the_worker_goes_on() {
    if !gpu_tests() {
        return;
    }
    driver().expect("PEGAFLOW_GPU_TESTS=1 but no CUDA driver");
    let cfg = CudaTransportConfig {
        policy: Policy::Hint,
        staging_chunk: 1 << 20,
        ..Default::default()
    };
    let f = fixture(cfg, 9);
    let mut rng = Rng(11);
    let ops = make_ops(&mut rng, f.dev.ptr(), f.arena.addr(), f.arena.len());
    for mode in [TransferMode::Kernel, TransferMode::Direct] {
        let (tx, parts) = op_parts();
        tx.send(ops[..ops.len() / 2].to_vec());
        drop(tx); // the planner failed: no finish
        let batch = CopyBatch {
            location: pegaflow_transport_cuda::cuda_space(0),
            direction: Direction::ToHost,
            mode,
            ops: Vec::new(),
        };
        let err = block_on(f.transport.copy_parts_with_report(batch, parts)).unwrap_err();
        assert!(err.0.contains("last part"), "{mode:?}: {err}");
    }
    // The worker serves the next batches as before.
    roundtrip(&f, &ops, TransferMode::Kernel, CopyPath::Staged, 800);
    roundtrip_split(&f, &ops, TransferMode::Kernel, CopyPath::Staged, 801, 3);
}

/// A batch that fails before its wait (no part ever sent, or the mapped path's gather cut
/// short) answers its caller at once, under every wait mode: the caller, which waits for the
/// worker's "near the end" signal first, must not be left waiting for a signal never sent.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn a_batch_that_fails_before_its_wait_answers_at_once_in_every_wait_mode() {
    if !gpu_tests() {
        return;
    }
    driver().expect("PEGAFLOW_GPU_TESTS=1 but no CUDA driver");
    for wait in [Wait::Tail, Wait::Spin, Wait::Sleep] {
        for kernel_path in [KernelPath::Staged, KernelPath::Mapped] {
            let cfg = CudaTransportConfig {
                policy: Policy::Hint,
                kernel_path,
                staging_chunk: 1 << 20,
                wait,
                ..Default::default()
            };
            let f = fixture(cfg, 13);
            let mut rng = Rng(17);
            let ops = make_ops(&mut rng, f.dev.ptr(), f.arena.addr(), f.arena.len());
            // No part at all; then (the mapped path gathers every part before it starts) one
            // part and no more.
            for sent in [0, ops.len() / 2] {
                let (tx, parts) = op_parts();
                if sent > 0 {
                    tx.send(ops[..sent].to_vec());
                }
                drop(tx);
                let batch = CopyBatch {
                    location: pegaflow_transport_cuda::cuda_space(0),
                    direction: Direction::ToHost,
                    mode: TransferMode::Kernel,
                    ops: Vec::new(),
                };
                // The timer needs the runtime: made inside the future that block_on runs.
                let r = block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(20),
                        f.transport.copy_parts_with_report(batch, parts),
                    )
                    .await
                });
                let what = format!("{wait:?} {kernel_path:?}, {sent} ops sent");
                let err = r
                    .unwrap_or_else(|_| panic!("{what}: no answer within 20 s"))
                    .unwrap_err();
                assert!(err.0.contains("last part"), "{what}: {err}");
            }
            // The worker serves the next batch.
            let path = match kernel_path {
                KernelPath::Staged => CopyPath::Staged,
                KernelPath::Mapped => CopyPath::Mapped,
            };
            roundtrip(&f, &ops, TransferMode::Kernel, path, 820);
        }
    }
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn unpinned_host_memory_takes_the_pageable_safe_path() {
    if !gpu_tests() {
        return;
    }
    let cfg = CudaTransportConfig {
        policy: Policy::Kernel,
        kernel_path: KernelPath::Mapped,
        staging_chunk: 1 << 20,
        ..Default::default()
    };
    // No landing tier: nothing is pinned; the mapped path must fall back to staging.
    let t = CudaTransport::new(cfg, &RuntimeContext::default());
    let dev = DeviceBuffer::new(0, 4 << 20).unwrap();
    let mut src = vec![0u8; 4 << 20];
    Rng(9).fill(&mut src);
    dev.upload(0, &src).unwrap();
    let mut host = vec![0u8; 3 << 20];
    let ops: Vec<CopyOp> = (0..48)
        .map(|i| CopyOp {
            device_addr: dev.ptr() + (47 - i) as u64 * 65536 + 5,
            host_addr: host.as_mut_ptr() as usize + i * 65536,
            len: 65536 - 9,
        })
        .collect();
    let rep = block_on(t.copy_with_report(CopyBatch {
        location: pegaflow_transport_cuda::cuda_space(0),
        direction: Direction::ToHost,
        mode: TransferMode::Kernel,
        ops: ops.clone(),
    }))
    .unwrap();
    assert_eq!(rep.path, CopyPath::Staged);
    for (i, o) in ops.iter().enumerate() {
        let d = (o.device_addr - dev.ptr()) as usize;
        assert_eq!(&host[i * 65536..i * 65536 + o.len], &src[d..d + o.len]);
    }
    // A device this server does not serve is an error, not a crash.
    let e = block_on(t.copy_with_report(CopyBatch {
        location: pegaflow_transport_cuda::cuda_space(999),
        direction: Direction::ToHost,
        mode: TransferMode::Kernel,
        ops,
    }))
    .unwrap_err();
    assert!(e.0.contains("999"), "{e}");
}

const CHILD_LEN: usize = 8 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) + 7) as u8
}

/// The child half of the IPC test: a no-op unless re-executed by the parent.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn ipc_export_child() {
    if std::env::var("PEGAFLOW_IPC_CHILD").as_deref() != Ok("1") {
        return;
    }
    let d = driver().unwrap();
    let buf = DeviceBuffer::new(0, CHILD_LEN).unwrap();
    let data: Vec<u8> = (0..CHILD_LEN).map(pattern).collect();
    buf.upload(0, &data).unwrap();
    let h = buf.ipc_handle().unwrap();
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    println!("\nIPC_HANDLE {hex} {}", d.devices()[0].uuid);
    std::io::stdout().flush().unwrap();
    // Keep the allocation alive until the parent is done.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(buf);
}

fn wrapper_for(
    handle: &[u8; 64],
    uuid: &str,
    storage_off: u64,
    size: u64,
    elem_off: u64,
) -> Vec<u8> {
    // Start from the real torch pickle and replace the fields, then re-encode as torch would.
    let hexs = include_str!("../testdata/wrapper_default.pickle.hex").trim();
    let golden: Vec<u8> = (0..hexs.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hexs[i..i + 2], 16).unwrap())
        .collect();
    let mut w = parse_wrapper(&golden).unwrap();
    w.raw_handle = [&[2u8, b'c'][..], &handle[..]].concat();
    w.device_uuid = uuid.to_string();
    w.storage_offset_bytes = storage_off;
    w.storage_size_bytes = size;
    w.storage_offset = elem_off;
    w.event_sync_required = false;
    w.shape = vec![size / 2 - elem_off];
    w.stride = vec![1];
    encode_wrapper(&w)
}

fn import(
    r: &CudaIpcRegistrar,
    wrappers: Vec<Vec<u8>>,
) -> Result<Vec<pegaflow_plugin::LayerRegion>, RegistrarError> {
    block_on(r.import(ImportRequest {
        instance_id: "gpu-test".into(),
        device_id: 0,
        payload: RegistrationPayload::LayerBlobs(wrappers),
    }))
}

fn wait_mappings(n: usize) {
    let reg = driver().unwrap().registry().unwrap();
    let t = Instant::now();
    while reg.open_mappings() != n && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(reg.open_mappings(), n);
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn ipc_registrar_maps_another_process_allocation() {
    if !gpu_tests() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "--include-ignored",
            "ipc_export_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PEGAFLOW_IPC_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Watchdog: a wedged child (or parent) must not hang the test run forever.
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let finished = finished.clone();
        let pid = child.id() as libc::pid_t;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(90));
            if !finished.load(std::sync::atomic::Ordering::Acquire) {
                eprintln!("ipc test watchdog: killing the child {pid}");
                // SAFETY: plain kill(2) of the child this test spawned and has not reaped.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        });
    }
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = loop {
        let l = lines
            .next()
            .expect("child exited before exporting")
            .unwrap();
        // libtest prints "test ipc_export_child ... " without a newline before the test runs.
        if let Some(i) = l.find("IPC_HANDLE ") {
            break l[i + "IPC_HANDLE ".len()..].to_string();
        }
    };
    let mut parts = line.split(' ');
    let hex = parts.next().unwrap();
    let uuid = parts.next().unwrap().to_string();
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }

    let r = CudaIpcRegistrar::new(None);
    let half = (CHILD_LEN / 2) as u64;
    // Two layers in one allocation (one open), the first a view 1024 bf16 elements in.
    let regions = import(
        &r,
        vec![
            wrapper_for(&handle, &uuid, 0, half, 1024),
            wrapper_for(&handle, &uuid, half, half, 0),
        ],
    )
    .unwrap();
    wait_mappings(1);
    assert_eq!(regions.len(), 2);
    assert!(Arc::ptr_eq(&regions[0].memory, &regions[1].memory));
    assert_eq!(
        regions[0].memory.location(),
        pegaflow_transport_cuda::cuda_space(0)
    );
    assert!(regions[0].memory.len_bytes() >= CHILD_LEN as u64);
    assert_eq!((regions[0].offset, regions[0].len), (2048, half - 2048));
    assert_eq!((regions[1].offset, regions[1].len), (half, half));

    // Read both layers through the transport and check the child's pattern.
    let t = CudaTransport::new(CudaTransportConfig::default(), &RuntimeContext::default());
    let base = regions[0].memory.base_addr();
    let mut host = vec![0u8; 256 << 10];
    let ops: Vec<CopyOp> = (0..4)
        .map(|i| CopyOp {
            device_addr: base + regions[i % 2].offset + (i as u64) * 65536,
            host_addr: host.as_mut_ptr() as usize + i * 65536,
            len: 65536,
        })
        .collect();
    block_on(t.copy_with_report(CopyBatch {
        location: pegaflow_transport_cuda::cuda_space(0),
        direction: Direction::ToHost,
        mode: TransferMode::Kernel,
        ops: ops.clone(),
    }))
    .unwrap();
    for (i, o) in ops.iter().enumerate() {
        let start = (o.device_addr - base) as usize;
        let want: Vec<u8> = (start..start + o.len).map(pattern).collect();
        assert!(host[i * 65536..(i + 1) * 65536] == want[..], "op {i}");
    }

    // A second registration of the same handle shares the mapping (refcounted).
    let again = import(&r, vec![wrapper_for(&handle, &uuid, 0, half, 0)]).unwrap();
    wait_mappings(1);

    // Unknown device, out-of-bounds storage: clear errors, nothing left open.
    let e = import(
        &r,
        vec![wrapper_for(
            &handle,
            "00000000-1111-2222-3333-444444444444",
            0,
            half,
            0,
        )],
    )
    .unwrap_err();
    assert!(
        matches!(&e, RegistrarError::Precondition(m) if m.contains("00000000-1111-2222-3333-444444444444")),
        "{e}"
    );
    let e = import(&r, vec![wrapper_for(&handle, &uuid, 6 << 20, 4 << 20, 0)]).unwrap_err();
    assert!(
        matches!(&e, RegistrarError::Invalid(m) if m.contains("reaches past")),
        "{e}"
    );
    wait_mappings(1);

    drop(regions);
    wait_mappings(1);
    drop(again);
    wait_mappings(0);

    drop(child.stdin.take());
    let status = child.wait().unwrap();
    finished.store(true, std::sync::atomic::Ordering::Release);
    assert!(status.success());
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn ipc_open_of_an_own_handle_fails_cleanly() {
    if !gpu_tests() {
        return;
    }
    let d = driver().unwrap();
    let buf = DeviceBuffer::new(0, 2 << 20).unwrap();
    let h = buf.ipc_handle().unwrap();
    let r = CudaIpcRegistrar::new(None);
    let e = import(
        &r,
        vec![wrapper_for(&h, &d.devices()[0].uuid, 0, 1 << 20, 0)],
    )
    .unwrap_err();
    assert!(
        matches!(&e, RegistrarError::Failed(m) if m.contains("cuIpcOpenMemHandle")),
        "{e}"
    );
}

/// A device → host batch on the staged path fires the operation's [`SourceRead`] listener once
/// its gathers have read every byte of its device memory, before its pinned copies end: the
/// test overwrites the whole device buffer the moment the listener fires, and the host still
/// receives exactly the bytes from before. With 4 MiB staging the 48 MiB batch wraps the two
/// buffers many times (gathers wait for the copies out of the memory they reuse); with the
/// default 64 MiB it fits in them. The direct path reads the device until its end and never
/// fires.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn the_source_read_signal_comes_only_after_every_device_byte_was_read() {
    if !gpu_tests() {
        return;
    }
    let rt = multi_thread_runtime();
    for (i, (policy, staging_chunk, fires)) in [
        (Policy::Kernel, 4u64 << 20, true),
        (Policy::Kernel, 64 << 20, true),
        (Policy::Direct, 64 << 20, false),
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = CudaTransportConfig {
            policy,
            staging_chunk,
            ..Default::default()
        };
        let f = fixture(cfg, 900 + i as u64);
        // Every 32 KiB device slot of a shuffled subset, into contiguous host memory.
        let seg = 32 << 10;
        let mut slots: Vec<usize> = (0..DEV_LEN / seg).collect();
        let mut rng = Rng(77 + i as u64);
        for k in (1..slots.len()).rev() {
            slots.swap(k, rng.below(k as u64 + 1) as usize);
        }
        let ops: Vec<CopyOp> = slots
            .iter()
            .take(f.arena.len() / seg)
            .enumerate()
            .map(|(k, &s)| CopyOp {
                device_addr: f.dev.ptr() + (s * seg) as u64,
                host_addr: f.arena.addr() + k * seg,
                len: seg,
            })
            .collect();
        // SAFETY: no copy is in flight.
        unsafe { f.arena.bytes_mut() }.fill(0);
        let batch = CopyBatch {
            location: pegaflow_transport_cuda::cuda_space(0),
            direction: Direction::ToHost,
            mode: TransferMode::Kernel,
            ops: ops.clone(),
        };
        let (read, fired) = SourceRead::new();
        let (rep, overwritten) = rt.block_on(async {
            let copy = read.scope(f.transport.copy_with_report(batch));
            let overwrite = async {
                // Fired: the device memory may change from now on.
                let ok = fired.await.is_ok();
                if ok {
                    f.dev.fill(0xA5).unwrap();
                }
                ok
            };
            tokio::join!(copy, overwrite)
        });
        let rep = rep.unwrap();
        let want_path = if fires {
            CopyPath::Staged
        } else {
            CopyPath::Direct
        };
        assert_eq!(rep.path, want_path);
        assert_eq!(overwritten, fires, "{policy:?}, {staging_chunk} B staging");
        // SAFETY: the copy completed.
        let host = unsafe { f.arena.bytes() };
        for (k, o) in ops.iter().enumerate() {
            let d = (o.device_addr - f.dev.ptr()) as usize;
            assert!(
                host[k * seg..(k + 1) * seg] == f.dev_data[d..d + seg],
                "{policy:?}, {staging_chunk} B staging: segment {k} holds other bytes"
            );
        }
        if fires {
            let mut back = vec![0u8; 4096];
            f.dev.download(0, &mut back).unwrap();
            assert!(back.iter().all(|&b| b == 0xA5), "the overwrite happened");
        }
    }
}

/// Device → host batches sent back to back (all queued at once, as a stream of Saves whose
/// answers come before their copies end) are started behind one another while the previous
/// one still copies ([`CopyReport::overlapped`]): their staging chunks go on around the ring
/// where the previous batch left off, and their descriptors after its own. Batches of uneven
/// sizes (160 KiB to 6.25 MiB), every other one in parts, through 4 MiB staging (the larger
/// batches wrap the ring and wait for earlier copies out of the memory they reuse) and
/// through the default 64 MiB, under `wait = "tail"` with a tail shorter than most batches,
/// `"spin"` and the direct path; every host byte is checked, and every staged batch's
/// source-read signal fires. Under `wait = "sleep"`, or with `overlap` off, nothing overlaps.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn back_to_back_device_to_host_batches_overlap_and_stay_byte_exact() {
    if !gpu_tests() {
        return;
    }
    let rt = multi_thread_runtime();
    let small = |wait| CudaTransportConfig {
        overlap: true,
        policy: Policy::Kernel,
        staging_chunk: 4 << 20,
        wait,
        tail_bytes: 1 << 20,
        mark_bytes: 512 << 10,
        ..Default::default()
    };
    let cases = [
        (
            "tail, 4 MiB staging",
            small(Wait::Tail),
            CopyPath::Staged,
            true,
        ),
        (
            "spin, 4 MiB staging, 3 buffers",
            CudaTransportConfig {
                staging_buffers: 3,
                ..small(Wait::Spin)
            },
            CopyPath::Staged,
            true,
        ),
        (
            "tail, 64 MiB staging",
            CudaTransportConfig {
                overlap: true,
                policy: Policy::Kernel,
                ..Default::default()
            },
            CopyPath::Staged,
            true,
        ),
        (
            "direct",
            CudaTransportConfig {
                overlap: true,
                policy: Policy::Direct,
                ..Default::default()
            },
            CopyPath::Direct,
            true,
        ),
        ("sleep", small(Wait::Sleep), CopyPath::Staged, false),
        (
            "tail, overlap off",
            CudaTransportConfig {
                overlap: false,
                ..small(Wait::Tail)
            },
            CopyPath::Staged,
            false,
        ),
    ];
    let seg = 32 << 10;
    for (i, (name, cfg, want_path, overlaps)) in cases.into_iter().enumerate() {
        let f = fixture(cfg, 1200 + i as u64);
        let mut overlapped = 0;
        for round in 0..3u64 {
            // Host windows of uneven sizes (in 32 KiB segments), one batch each, from
            // shuffled device segments; a few segments odd-sized at odd device offsets.
            let mut rng = Rng(31 * (i as u64 + 1) + round);
            let mut batches = Vec::new();
            let mut h = 0usize;
            let sizes = [128usize, 37, 192, 64, 96, 5, 160, 80, 128, 33, 200, 100];
            for &n in &sizes {
                if h + n * seg > f.arena.len() {
                    break;
                }
                let mut ops = Vec::with_capacity(n);
                for k in 0..n {
                    let s = rng.below((DEV_LEN / seg) as u64 - 1) as usize;
                    let (off, len) = if k % 7 == 3 {
                        (
                            1 + rng.below(999) as usize,
                            seg - 1 - rng.below(4096) as usize,
                        )
                    } else {
                        (0, seg)
                    };
                    ops.push(CopyOp {
                        device_addr: f.dev.ptr() + (s * seg + off) as u64,
                        host_addr: f.arena.addr() + h,
                        len,
                    });
                    h += len;
                }
                h = h.next_multiple_of(4096);
                batches.push(ops);
            }
            // SAFETY: no copy is in flight.
            unsafe { f.arena.bytes_mut() }.fill(0);
            // Every other batch comes in three parts from a thread of its own, as a Save's do;
            // each has a source-read listener.
            let mut senders = Vec::new();
            let mut futs = Vec::new();
            for (j, ops) in batches.iter().enumerate() {
                let parts = (j % 2 == 1).then(|| {
                    let (tx, parts) = op_parts();
                    let ops = ops.clone();
                    senders.push(std::thread::spawn(move || {
                        for p in ops.chunks(ops.len().div_ceil(3).max(1)) {
                            tx.send(p.to_vec());
                        }
                        tx.finish();
                    }));
                    parts
                });
                let batch = CopyBatch {
                    location: pegaflow_transport_cuda::cuda_space(0),
                    direction: Direction::ToHost,
                    mode: TransferMode::Kernel,
                    ops: if parts.is_some() {
                        Vec::new()
                    } else {
                        ops.clone()
                    },
                };
                let (read, fired) = SourceRead::new();
                let t = &f.transport;
                futs.push(async move {
                    let r = match parts {
                        Some(p) => read.scope(t.copy_parts_with_report(batch, p)).await,
                        None => read.scope(t.copy_with_report(batch)).await,
                    };
                    (r, fired.await.is_ok())
                });
            }
            let reports = rt.block_on(futures::future::join_all(futs));
            for s in senders {
                s.join().unwrap();
            }
            for (r, fired) in &reports {
                let r = r.as_ref().unwrap();
                assert_eq!(r.path, want_path, "{name}");
                // The staged path reads the device through its gathers and says so.
                assert_eq!(*fired, want_path == CopyPath::Staged, "{name}: source read");
                overlapped += usize::from(r.overlapped);
            }
            // SAFETY: every copy completed.
            let host = unsafe { f.arena.bytes() };
            let mut expect = vec![0u8; host.len()];
            for o in batches.iter().flatten() {
                let d = (o.device_addr - f.dev.ptr()) as usize;
                let h = o.host_addr - f.arena.addr();
                expect[h..h + o.len].copy_from_slice(&f.dev_data[d..d + o.len]);
            }
            if host != &expect[..] {
                let bad = host.iter().zip(&expect).position(|(a, b)| a != b).unwrap();
                panic!("{name}, round {round}: host byte {bad} differs");
            }
        }
        if overlaps {
            assert!(overlapped > 0, "{name}: no batch started behind another");
        } else {
            assert_eq!(overlapped, 0, "{name}: a batch overlapped");
        }
        eprintln!("{name}: {overlapped} of 36 batches started behind the previous one");
    }
}
