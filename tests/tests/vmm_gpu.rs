//! GPU tests of the `cuda-vmm` registrar behind the real server (started in-process on
//! loopback ports, with its fd side channel in a temp dir), driven by the native client SDK
//! with a [`VmmAllocation`]. Opt-in: every test is `#[ignore]`d; run
//! them with `PEGAFLOW_GPU_TESTS=1` and `-- --include-ignored` on a machine with a CUDA GPU.
//!
//! The killed-client test re-executes this test binary, running only
//! `vmm_killed_client_child` with `PEGAFLOW_VMM_CHILD=<endpoint>`: the child registers, saves
//! continuously and is SIGKILLed mid-saves.

use std::io::{BufRead, BufReader};
use std::os::fd::BorrowedFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_api::client::{EngineClient, NativeLayer};
use pegaflow_api::native::{ExportableMemory, NativeEngine};
use pegaflow_api::vmm::VmmAllocation;
use pegaflow_proto as pb;
use pegaflow_runtime::config::{FdChannelConfig, PipelineConfig, PluginConfig};
use pegaflow_runtime::ServerHandle;
use pegaflow_transport_cuda::vmm::live_mappings_of;
use tonic::Code;

// Link the landing tier so its factory registers (this crate's own kinds are linked by use).
use pegaflow_tier_dram as _;

fn gpu_tests() -> bool {
    if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    pegaflow_tests::skip!("set PEGAFLOW_GPU_TESTS=1 on a CUDA machine to run the GPU tests");
    false
}

/// Layers of the fused page-first arena (like the Qwen3 native layout: page p holds every
/// layer's K|V for block p; one segment per layer-block).
const LAYERS: usize = 8;
/// Bytes of one layer of one block (K and V together).
const LAYER_BLOCK: usize = 64 << 10;
/// Distance between blocks: one page of every layer.
const PAGE: usize = LAYERS * LAYER_BLOCK;
/// Blocks in the arena.
const BLOCKS: usize = 128;
/// Bytes the arena needs (64 MiB; a multiple of the 2 MiB granularity).
const ARENA: usize = BLOCKS * PAGE;

fn layers() -> Vec<NativeLayer> {
    (0..LAYERS)
        .map(|l| NativeLayer {
            name: layer_name(l),
            num_blocks: BLOCKS as u64,
            bytes_per_block: LAYER_BLOCK as u64,
            segments: 1,
            kv_stride_bytes: 0,
            offset_bytes: (l * LAYER_BLOCK) as u64,
            block_stride_bytes: PAGE as u64,
        })
        .collect()
}

fn layer_name(l: usize) -> String {
    format!("layer{l}")
}

fn names() -> Vec<String> {
    (0..LAYERS).map(layer_name).collect()
}

fn offset(layer: usize, block: usize) -> usize {
    block * PAGE + layer * LAYER_BLOCK
}

fn hash_of(tag: &str, i: usize) -> Vec<u8> {
    let mut h = format!("{tag}/{i}").into_bytes();
    h.resize(32, b'.');
    h
}

/// The deterministic bytes of `hash`'s block in `layer`.
fn pattern(hash: &[u8], layer: usize) -> Vec<u8> {
    let mut s = hash.iter().fold(0xcbf2_9ce4_8422_2325u64, |a, &b| {
        (a ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(LAYER_BLOCK);
    while out.len() < LAYER_BLOCK {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(LAYER_BLOCK);
    out
}

fn fill_block(a: &VmmAllocation, block: usize, hash: &[u8]) {
    for l in 0..LAYERS {
        a.upload(offset(l, block), &pattern(hash, l)).unwrap();
    }
}

/// Downloads the whole arena and compares it byte for byte with `poison` everywhere except
/// the `(target block, hash)` pairs, which must hold their hash's pattern.
fn assert_image(a: &VmmAllocation, poison: u8, loaded: &[(usize, Vec<u8>)]) {
    let mut want = vec![poison; a.len()];
    for (b, h) in loaded {
        for l in 0..LAYERS {
            let o = offset(l, *b);
            want[o..o + LAYER_BLOCK].copy_from_slice(&pattern(h, l));
        }
    }
    let mut got = vec![0u8; a.len()];
    a.download(0, &mut got).unwrap();
    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!(
            "byte {i} (block {}, layer {}) is {:#04x}, expected {:#04x}",
            i / PAGE,
            (i % PAGE) / LAYER_BLOCK,
            got[i],
            want[i]
        );
    }
}

struct Server {
    handle: ServerHandle,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut p = PipelineConfig::embedded_default();
        p.server.addr = "127.0.0.1:0".into();
        p.server.http_addr = "127.0.0.1:0".into();
        p.fd_channel = Some(FdChannelConfig {
            path: dir.path().join("fd.sock"),
        });
        p.tiers[0]
            .settings
            .insert("capacity".into(), toml::Value::String("1gb".into()));
        p.registrars = Some(vec![PluginConfig {
            layers: vec![],
            kind: "cuda-vmm".into(),
            settings: toml::Table::new(),
        }]);
        p.transports = Some(vec![PluginConfig {
            layers: vec![],
            kind: "cuda".into(),
            settings: toml::Table::new(),
        }]);
        let handle = pegaflow_runtime::start(p).await.expect("server starts");
        Self { handle, _dir: dir }
    }

    fn endpoint(&self) -> String {
        self.handle.endpoint()
    }

    async fn healthy(&self) {
        let mut c = EngineClient::connect(&self.endpoint()).await.unwrap();
        assert!(!c.health().await.unwrap().is_empty());
    }

    /// Waits until `id` is gone from the engine and its VMM mapping has been released.
    async fn wait_cleaned(&self, id: &str) -> Duration {
        let t0 = Instant::now();
        while self.handle.engine.instance_ids().iter().any(|x| x == id) || live_mappings_of(id) != 0
        {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "instance {id} not cleaned up"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        t0.elapsed()
    }
}

async fn register(srv: &Server, a: &impl ExportableMemory, base: &str, ns: &str) -> NativeEngine {
    NativeEngine::connect(&srv.endpoint(), ns)
        .await
        .unwrap()
        .register(base, 0, a, layers())
        .await
        .unwrap()
}

fn mbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Register → fill `count` blocks → save → flush → query → poison → load into the last
/// `count` blocks → byte-for-byte check right after the RPC → unregister → mapping released.
async fn roundtrip(srv: &Server, a: &VmmAllocation, tag: &str, count: usize) {
    let mut eng = register(srv, a, tag, "vmm-ns").await;
    let id = eng.instance_id().to_string();
    assert_eq!(live_mappings_of(&id), 1);
    let hs: Vec<Vec<u8>> = (0..count).map(|i| hash_of(tag, i)).collect();
    a.fill(0).unwrap();
    for (b, h) in hs.iter().enumerate() {
        fill_block(a, b, h);
    }
    let names = names();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let ids: Vec<u32> = (0..count as u32).collect();
    let t0 = Instant::now();
    eng.save(&names, &ids, &hs).await.unwrap();
    let save = t0.elapsed();
    eng.flush().await.unwrap();
    let (n, lease) = eng.query(hs.clone(), "rt").await.unwrap();
    assert_eq!(n, count as u64);
    a.fill(0xA5).unwrap();
    let targets: Vec<u32> = (BLOCKS - count..BLOCKS).map(|b| b as u32).collect();
    let t0 = Instant::now();
    eng.load(&names, &lease, &targets).await.unwrap();
    let load = t0.elapsed();
    // Immediately: the load's reply is its completion.
    let loaded: Vec<(usize, Vec<u8>)> = targets
        .iter()
        .zip(&hs)
        .map(|(&b, h)| (b as usize, h.clone()))
        .collect();
    assert_image(a, 0xA5, &loaded);
    let bytes = count * PAGE;
    eprintln!(
        "[{tag}] {count} blocks x {LAYERS} layers ({} MiB): save RPC {:.2} ms ({:.1} GB/s), \
         load RPC {:.2} ms ({:.1} GB/s), byte-exact",
        bytes >> 20,
        save.as_secs_f64() * 1e3,
        mbps(bytes, save),
        load.as_secs_f64() * 1e3,
        mbps(bytes, load)
    );
    eng.unregister().await.unwrap();
    let t = srv.wait_cleaned(&id).await;
    eprintln!(
        "[{tag}] unregistered; mapping released {:.1} ms later",
        t.as_secs_f64() * 1e3
    );
}

/// An allocation that states a different size than it has.
struct Misstated<'a>(&'a VmmAllocation, u64);
impl ExportableMemory for Misstated<'_> {
    fn export_fd(&self) -> BorrowedFd<'_> {
        self.0.fd()
    }
    fn alloc_size(&self) -> u64 {
        self.1
    }
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::CudaVmm
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
async fn vmm_register_save_load_roundtrip_is_byte_exact() {
    if !gpu_tests() {
        return;
    }
    let srv = Server::start().await;
    let a = VmmAllocation::new(0, ARENA).unwrap();
    eprintln!(
        "VMM arena: {a:?}, granularity {} KiB, GPUDirect RDMA capable: {}",
        a.granularity() >> 10,
        a.gpu_direct_rdma_capable()
    );
    assert_eq!(a.len(), ARENA);
    roundtrip(&srv, &a, "rt-small", 4).await;
    roundtrip(&srv, &a, "rt-large", 64).await;

    // Refusals: a stated size larger than the allocation (cuMemMap refuses), one that is not a
    // multiple of the granularity, and a device this server does not have. Nothing stays
    // mapped and the server keeps serving.
    let cases: Vec<(u64, i32, Code, &str)> = vec![
        (
            2 * ARENA as u64,
            0,
            Code::InvalidArgument,
            "smaller than alloc_size",
        ),
        (
            (ARENA - 4096) as u64,
            0,
            Code::InvalidArgument,
            "granularity",
        ),
        (ARENA as u64, 7, Code::FailedPrecondition, "ordinal 7"),
    ];
    for (size, dev, code, needle) in cases {
        let conn = NativeEngine::connect(&srv.endpoint(), "vmm-ns")
            .await
            .unwrap();
        let mut l = layers();
        l.truncate(1);
        let e = conn
            .register("bad", dev, &Misstated(&a, size), l)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(code), "{e}");
        assert!(e.to_string().contains(needle), "{e}");
        eprintln!("refused as expected: {e}");
    }
    let fdc = srv.handle.fd_channel.as_ref().unwrap();
    assert_eq!(fdc.pending(), 0, "refused registrations left an fd pending");
    assert_eq!(pegaflow_transport_cuda::vmm::live_mappings_of("bad"), 0);
    srv.healthy().await;
    roundtrip(&srv, &a, "rt-after", 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
async fn vmm_cancelled_load_then_unregister_keeps_the_server_healthy() {
    if !gpu_tests() {
        return;
    }
    let srv = Server::start().await;
    let a = VmmAllocation::new(0, ARENA).unwrap();
    let hs: Vec<Vec<u8>> = (0..64).map(|i| hash_of("cancel", i)).collect();
    for (b, h) in hs.iter().enumerate() {
        fill_block(&a, b, h);
    }
    let names = names();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let ids: Vec<u32> = (0..64).collect();
    let targets: Vec<u32> = (64..128).collect();
    let load_bytes = &srv.handle.engine.metrics().load_bytes;
    // Each attempt: a fresh registration, a 32 MiB load whose RPC future is dropped after
    // `budget`, then an immediate unregister. The budget adapts until the server is seen to
    // have accepted the load the client gave up on (it counts its bytes once the copy ends).
    let mut budget = Duration::from_micros(50);
    let mut mid_flight = 0;
    for attempt in 0..10 {
        let mut eng = register(&srv, &a, "cancel", "vmm-cancel").await;
        let id = eng.instance_id().to_string();
        if attempt == 0 {
            eng.save(&names, &ids, &hs).await.unwrap();
            eng.flush().await.unwrap();
        }
        let (n, lease) = eng.query(hs.clone(), "c").await.unwrap();
        assert_eq!(n, 64);
        let before = load_bytes.get();
        let used = budget;
        let r = tokio::time::timeout(budget, eng.load(&names, &lease, &targets)).await;
        // Unregister right away: teardown must drain an accepted load before it unmaps.
        eng.unregister().await.unwrap();
        srv.wait_cleaned(&id).await;
        let moved = load_bytes.get() - before;
        let outcome = match (&r, moved) {
            (Err(_), m) if m > 0 => {
                mid_flight += 1;
                budget = budget.mul_f64(0.75);
                "cancelled mid-flight; the server finished the load, then unmapped"
            }
            (Err(_), _) => {
                budget *= 2;
                "cancelled before the server ran it"
            }
            (Ok(x), _) => {
                x.as_ref().unwrap();
                budget /= 2;
                "completed within the budget"
            }
        };
        eprintln!(
            "attempt {attempt}: load future dropped after {used:?}: {outcome} ({moved} bytes)"
        );
        srv.healthy().await;
        if mid_flight >= 2 {
            break;
        }
    }
    assert!(mid_flight >= 1, "never caught a load in flight");
    // A fresh registration round-trips.
    roundtrip(&srv, &a, "after-cancel", 16).await;
}

const CHILD_ENV: &str = "PEGAFLOW_VMM_CHILD";
const KILLED_NS: &str = "vmm-killed";
/// Device blocks the child cycles through: each is refilled with a new hash's pattern before
/// each save, so a save that read stale device bytes would store the wrong content.
const CHILD_RING: usize = 8;

/// The child half of the killed-client test: a no-op unless re-executed by the parent.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn vmm_killed_client_child() {
    let Ok(endpoint) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let a = VmmAllocation::new(0, ARENA).unwrap();
        let mut eng = NativeEngine::connect(&endpoint, KILLED_NS)
            .await
            .unwrap()
            .register("killed", 0, &a, layers())
            .await
            .unwrap();
        println!("\nCHILD_REGISTERED {}", eng.instance_id());
        let names = names();
        let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        for k in 0..1_000_000usize {
            let b = k % CHILD_RING;
            let h = hash_of("killed", k);
            fill_block(&a, b, &h);
            eng.save(&names, &[b as u32], std::slice::from_ref(&h))
                .await
                .unwrap();
            println!("\nCHILD_SAVED {k}");
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
async fn vmm_killed_client_is_cleaned_up_and_leaves_no_stale_bytes() {
    if !gpu_tests() {
        return;
    }
    let srv = Server::start().await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--include-ignored",
            "vmm_killed_client_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, srv.endpoint())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let finished = Arc::new(AtomicBool::new(false));
    {
        let finished = finished.clone();
        let pid = child.id() as libc::pid_t;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(120));
            if !finished.load(Ordering::Acquire) {
                eprintln!("watchdog: killing the child {pid}");
                // SAFETY: plain kill(2) of the child this test spawned.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        });
    }
    let stdout = child.stdout.take().unwrap();
    // Read the child's lines on a thread; the parent's runtime stays free to serve it.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(l) = line else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut id = None;
    let mut last_saved = None;
    while let Some(l) = rx.recv().await {
        if let Some(i) = l.find("CHILD_REGISTERED ") {
            id = Some(l[i + "CHILD_REGISTERED ".len()..].trim().to_string());
        }
        if let Some(i) = l.find("CHILD_SAVED ") {
            let k: usize = l[i + "CHILD_SAVED ".len()..].trim().parse().unwrap();
            last_saved = Some(k);
            if k >= 24 {
                break;
            }
        }
    }
    let id = id.expect("the child registered");
    let last_saved = last_saved.expect("the child saved");
    // SIGKILL while the child keeps saving.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    finished.store(true, Ordering::Release);
    drop(rx);
    assert!(!status.success());
    let t = srv.wait_cleaned(&id).await;
    eprintln!(
        "child {id} killed after save {last_saved}; instance and mapping cleaned {:.1} ms later",
        t.as_secs_f64() * 1e3
    );
    srv.healthy().await;

    // A new client sees only blocks whose bytes are exactly what their hash was saved with.
    let a = VmmAllocation::new(0, ARENA).unwrap();
    let mut eng = register(&srv, &a, "survivor", KILLED_NS).await;
    eng.flush().await.unwrap();
    let hs: Vec<Vec<u8>> = (0..last_saved + 16).map(|k| hash_of("killed", k)).collect();
    let (n, lease) = eng.query(hs.clone(), "k").await.unwrap();
    let n = n as usize;
    assert!(
        n > last_saved,
        "acknowledged saves 0..={last_saved} must be cached, got {n} hits"
    );
    a.fill(0x5A).unwrap();
    let names = names();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let targets: Vec<u32> = (0..n as u32).collect();
    eng.load(&names, &lease, &targets).await.unwrap();
    let loaded: Vec<(usize, Vec<u8>)> = (0..n).map(|i| (i, hs[i].clone())).collect();
    assert_image(&a, 0x5A, &loaded);
    eprintln!("survivor loaded {n} of the dead client's blocks, byte-exact");
    let sid = eng.instance_id().to_string();
    eng.unregister().await.unwrap();
    srv.wait_cleaned(&sid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
async fn vmm_unregister_while_saves_are_in_flight() {
    if !gpu_tests() {
        return;
    }
    let srv = Server::start().await;
    let a = VmmAllocation::new(0, ARENA).unwrap();
    let eng = register(&srv, &a, "inflight", "vmm-inflight").await;
    let id = eng.instance_id().to_string();
    for b in 0..BLOCKS {
        fill_block(&a, b, &hash_of("inflight-src", b));
    }
    const TASKS: usize = 8;
    let oks = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let endpoint = srv.endpoint();
        let id = id.clone();
        let oks = oks.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = EngineClient::connect(&endpoint).await.unwrap();
            let mut results = Vec::new();
            for i in 0..500usize {
                let blocks: Vec<u32> = (0..8).map(|j| (t * 8 + j) as u32).collect();
                let hashes: Vec<Vec<u8>> = (0..8)
                    .map(|j| hash_of(&format!("inflight-{t}-{i}"), j))
                    .collect();
                let saves = (0..LAYERS)
                    .map(|l| (layer_name(l), blocks.clone(), hashes.clone()))
                    .collect();
                let r = c.save(&id, 0, 0, 0, saves).await;
                let failed = r.is_err();
                if !failed {
                    oks.fetch_add(1, Ordering::Relaxed);
                }
                results.push(r.map_err(|e| (e.code(), e.to_string())));
                if failed {
                    break;
                }
            }
            results
        }));
    }
    let t0 = Instant::now();
    while oks.load(Ordering::Relaxed) < 2 * TASKS {
        assert!(t0.elapsed() < Duration::from_secs(30), "saves never ran");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Unregister while the saves keep coming.
    eng.unregister().await.unwrap();
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        for r in t.await.unwrap() {
            match r {
                Ok(()) => ok += 1,
                Err((Some(Code::FailedPrecondition), _)) => refused += 1,
                Err((code, msg)) => panic!("a save failed uncleanly: {code:?} {msg}"),
            }
        }
    }
    eprintln!(
        "saves around the unregister: {ok} succeeded, {refused} refused with FAILED_PRECONDITION"
    );
    assert!(ok >= 2 * TASKS);
    srv.wait_cleaned(&id).await;
    srv.healthy().await;
    roundtrip(&srv, &a, "after-inflight", 16).await;
}
