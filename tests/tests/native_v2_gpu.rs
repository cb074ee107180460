//! GPU tests and the bench of native registration v2 (`0.25.1+native-v2`): a GLM5.2-shaped
//! rank (78 MLA arenas of 41,984-byte blocks and 21 index-K sidecars of 8,448 bytes, each its
//! own allocation) registered through `pegaflow_api::registration::Client` against the real
//! server (in-process, loopback, fd side channel in a temp dir, `cuda-vmm` and
//! `cuda-ipc-handle` registrars, `cuda` transport).
//!
//! Opt-in: every test is `#[ignore]`d; run them on a CUDA machine with
//! `PEGAFLOW_GPU_TESTS=1 cargo test --release -p pegaflow-tests --test native_v2_gpu
//! -- --include-ignored --test-threads=1 --nocapture`.
//!
//! CUDA IPC handles cannot be opened by the process that exported them, so the IPC round trip
//! and the killed-client test re-execute this test binary as the client (`*_child` tests, a
//! no-op unless their environment variable names the server's endpoint).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_api::client::EngineClient;
use pegaflow_api::ipc::IpcAllocation;
use pegaflow_api::registration::{Client, NativeAllocation, NativeInstance, RegistrationBuilder};
use pegaflow_api::vmm::VmmAllocation;
use pegaflow_proto as pb;
use pegaflow_runtime::config::{FdChannelConfig, PipelineConfig, PluginConfig};
use pegaflow_runtime::ServerHandle;
use pegaflow_transport_cuda::vmm::live_mappings;

// Link the landing tier so its factory registers (this crate's own kinds are linked by use).
use pegaflow_tier_dram as _;

/// The in-process tests run one at a time (they count the process's live mappings), also
/// without `--test-threads=1`.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn gpu_tests() -> bool {
    if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    pegaflow_tests::skip!("set PEGAFLOW_GPU_TESTS=1 on a CUDA machine to run the GPU tests");
    false
}

const MLA_LAYERS: usize = 78;
const IDXK_LAYERS: usize = 21;
/// 64 tokens × 656 bytes (fp8_ds_mla).
const MLA_BLOCK: usize = 64 * 656;
/// 64 tokens × (128 + 4) bytes.
const IDXK_BLOCK: usize = 64 * (128 + 4);
/// One logical block of one rank, all 99 arenas.
const LOGICAL_BLOCK: usize = MLA_LAYERS * MLA_BLOCK + IDXK_LAYERS * IDXK_BLOCK;

/// The 99 arenas' (name, block bytes), in registration order.
fn glm52_layout() -> Vec<(String, usize)> {
    let mut v = Vec::new();
    for n in 0..MLA_LAYERS {
        v.push((format!("glm52.L{n}.mla"), MLA_BLOCK));
        if n % 3 == 0 && n / 3 < IDXK_LAYERS {
            v.push((format!("glm52.L{n}.idxk"), IDXK_BLOCK));
        }
    }
    v
}

fn hash_of(tag: &str, i: usize) -> Vec<u8> {
    let mut h = format!("{tag}/{i}").into_bytes();
    h.resize(32, b'.');
    h
}

/// The deterministic bytes of `hash`'s block in arena `arena` (`len` bytes).
fn pattern(hash: &[u8], arena: usize, len: usize) -> Vec<u8> {
    let mut s = hash.iter().fold(0xcbf2_9ce4_8422_2325u64, |a, &b| {
        (a ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) ^ (arena as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Device memory a test can write and read back (VMM or IPC).
trait Arena: NativeAllocation {
    fn put(&self, off: usize, src: &[u8]);
    fn get(&self, off: usize, dst: &mut [u8]);
    fn set(&self, v: u8);
}

impl Arena for VmmAllocation {
    fn put(&self, off: usize, src: &[u8]) {
        self.upload(off, src).unwrap()
    }
    fn get(&self, off: usize, dst: &mut [u8]) {
        self.download(off, dst).unwrap()
    }
    fn set(&self, v: u8) {
        self.fill(v).unwrap()
    }
}

impl Arena for IpcAllocation {
    fn put(&self, off: usize, src: &[u8]) {
        self.upload(off, src).unwrap()
    }
    fn get(&self, off: usize, dst: &mut [u8]) {
        self.download(off, dst).unwrap()
    }
    fn set(&self, v: u8) {
        self.fill(v).unwrap()
    }
}

/// One rank's arenas: one allocation per arena.
struct Rank<A: Arena> {
    layout: Vec<(String, usize)>,
    mems: Vec<A>,
    blocks: usize,
}

impl<A: Arena> Rank<A> {
    fn new(blocks: usize, alloc: impl Fn(usize) -> A) -> Self {
        let layout = glm52_layout();
        let mems = layout.iter().map(|(_, b)| alloc(blocks * b)).collect();
        Self {
            layout,
            mems,
            blocks,
        }
    }

    fn builder(&self) -> RegistrationBuilder<'_> {
        let mut b = RegistrationBuilder::new(0);
        for ((name, block), m) in self.layout.iter().zip(&self.mems) {
            let id = b.allocation(m);
            b.contiguous_tensor(name, id, 0, self.blocks as u64, *block as u64);
        }
        b
    }

    fn fill(&self, block: usize, hash: &[u8]) {
        for (i, ((_, len), m)) in self.layout.iter().zip(&self.mems).enumerate() {
            m.put(block * len, &pattern(hash, i, *len));
        }
    }

    fn poison(&self, v: u8) {
        for m in &self.mems {
            m.set(v);
        }
    }

    /// Every arena byte for byte: `poison` except the `(block, hash)` pairs.
    fn assert_image(&self, poison: u8, loaded: &[(usize, Vec<u8>)]) {
        for (i, ((name, len), m)) in self.layout.iter().zip(&self.mems).enumerate() {
            let mut want = vec![poison; self.blocks * len];
            for (b, h) in loaded {
                want[b * len..(b + 1) * len].copy_from_slice(&pattern(h, i, *len));
            }
            let mut got = vec![0u8; want.len()];
            m.get(0, &mut got);
            if let Some(x) = got.iter().zip(&want).position(|(g, w)| g != w) {
                panic!(
                    "arena {name}: byte {x} (block {}) is {:#04x}, expected {:#04x}",
                    x / len,
                    got[x],
                    want[x]
                );
            }
        }
    }
}

struct Server {
    handle: ServerHandle,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(capacity: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut p = PipelineConfig::embedded_default();
        p.server.addr = "127.0.0.1:0".into();
        p.server.http_addr = "127.0.0.1:0".into();
        p.fd_channel = Some(FdChannelConfig {
            path: dir.path().join("fd.sock"),
        });
        p.tiers[0]
            .settings
            .insert("capacity".into(), toml::Value::String(capacity.into()));
        p.registrars = Some(
            ["cuda-vmm", "cuda-ipc-handle"]
                .into_iter()
                .map(|k| PluginConfig {
                    layers: vec![],
                    kind: k.into(),
                    settings: toml::Table::new(),
                })
                .collect(),
        );
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

    /// Waits until no instance is registered and every VMM and IPC mapping is released.
    async fn wait_all_released(&self) -> Duration {
        let t0 = Instant::now();
        let ipc = || {
            pegaflow_transport_cuda::driver()
                .ok()
                .and_then(|d| d.registry().ok())
                .map_or(0, |r| r.open_mappings())
        };
        while !self.handle.engine.instance_ids().is_empty() || live_mappings() != 0 || ipc() != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "not released: instances {:?}, vmm mappings {}, ipc mappings {}",
                self.handle.engine.instance_ids(),
                live_mappings(),
                ipc()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        t0.elapsed()
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Fill blocks 0..count → save → flush → query → poison → load into the last `count` blocks →
/// every arena byte-exact → unregister.
async fn roundtrip<A: Arena>(rank: &Rank<A>, mut inst: NativeInstance, tag: &str, count: usize) {
    let hs: Vec<Vec<u8>> = (0..count).map(|i| hash_of(tag, i)).collect();
    rank.poison(0);
    for (b, h) in hs.iter().enumerate() {
        rank.fill(b, h);
    }
    let ids: Vec<u32> = (0..count as u32).collect();
    let t0 = Instant::now();
    inst.save(&ids, &hs).await.unwrap();
    let save = t0.elapsed();
    inst.flush().await.unwrap();
    let (n, lease) = inst.query(hs.clone(), "rt").await.unwrap();
    assert_eq!(n, count as u64);
    rank.poison(0xA5);
    let targets: Vec<u32> = (rank.blocks - count..rank.blocks)
        .map(|b| b as u32)
        .collect();
    let t0 = Instant::now();
    inst.load(&lease, &targets).await.unwrap();
    let load = t0.elapsed();
    let loaded: Vec<(usize, Vec<u8>)> = targets
        .iter()
        .zip(&hs)
        .map(|(&b, h)| (b as usize, h.clone()))
        .collect();
    rank.assert_image(0xA5, &loaded);
    let bytes = count * LOGICAL_BLOCK;
    eprintln!(
        "[{tag}] {count} blocks x 99 arenas ({:.1} MiB): save {:.2} ms ({:.1} GB/s), load {:.2} ms \
         ({:.1} GB/s), byte-exact",
        bytes as f64 / (1 << 20) as f64,
        save.as_secs_f64() * 1e3,
        gbps(bytes, save),
        load.as_secs_f64() * 1e3,
        gbps(bytes, load)
    );
    inst.unregister().await.unwrap();
}

/// Blocks per arena in the round trips (an MLA arena of 48 blocks fits one 2 MiB granule).
const BLOCKS: usize = 48;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
async fn v2_vmm_glm52_roundtrip_is_byte_exact() {
    if !gpu_tests() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let srv = Server::start("2gb").await;
    let rank = Rank::new(BLOCKS, |bytes| VmmAllocation::new(0, bytes).unwrap());
    let client = Client::connect(&srv.endpoint()).await.unwrap();
    let inst = client
        .register("glm52-rank0", "glm52-v2-vmm", &rank.builder())
        .await
        .unwrap();
    assert_eq!(live_mappings(), 99, "one VMM mapping per allocation");
    roundtrip(&rank, inst, "vmm", 8).await;
    let t = srv.wait_all_released().await;
    eprintln!(
        "[vmm] 99 mappings released {:.1} ms after unregister",
        t.as_secs_f64() * 1e3
    );
    srv.healthy().await;
}

/// States a larger size than the VMM allocation has, for allocation `k`.
struct Overstated<'a>(&'a VmmAllocation, u64);
impl NativeAllocation for Overstated<'_> {
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::CudaVmm
    }
    fn size_bytes(&self) -> u64 {
        self.1
    }
    fn export_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.0.fd())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
async fn v2_vmm_import_failure_at_allocation_k_releases_every_mapping() {
    if !gpu_tests() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let srv = Server::start("1gb").await;
    let rank = Rank::new(BLOCKS, |bytes| VmmAllocation::new(0, bytes).unwrap());
    let k = 61;
    let big = Overstated(&rank.mems[k], rank.mems[k].len() as u64 * 4);
    let mut b = RegistrationBuilder::new(0);
    for (i, ((name, block), m)) in rank.layout.iter().zip(&rank.mems).enumerate() {
        let id = if i == k {
            b.allocation(&big)
        } else {
            b.allocation(m)
        };
        b.contiguous_tensor(name, id, 0, BLOCKS as u64, *block as u64);
    }
    let client = Client::connect(&srv.endpoint()).await.unwrap();
    let e = client
        .register("fail", "glm52-v2-fail", &b)
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&format!("allocation {k}")), "{e}");
    srv.wait_all_released().await;
    assert_eq!(srv.handle.fd_channel.as_ref().unwrap().pending(), 0);
    // The same memory registers and round-trips afterwards.
    let inst = client
        .register("after-fail", "glm52-v2-fail", &rank.builder())
        .await
        .unwrap();
    roundtrip(&rank, inst, "after-fail", 4).await;
    srv.wait_all_released().await;
}

const IPC_CHILD_ENV: &str = "PEGAFLOW_V2_IPC_CHILD";

/// The client half of the IPC round trip: a no-op unless re-executed by the parent.
#[test]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
fn v2_ipc_roundtrip_child() {
    let Ok(endpoint) = std::env::var(IPC_CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let rank = Rank::new(BLOCKS, |bytes| IpcAllocation::new(0, bytes).unwrap());
        let client = Client::connect(&endpoint).await.unwrap();
        let b = rank.builder();
        assert_eq!(b.memory_kind(), Some(pb::MemoryKind::CudaIpc));
        let inst = client
            .register("glm52-ipc", "glm52-v2-ipc", &b)
            .await
            .unwrap();
        println!("\nCHILD_REGISTERED {}", inst.instance_id());
        roundtrip(&rank, inst, "ipc", 8).await;
        println!("\nCHILD_OK");
    });
}

fn spawn_child(test: &str, env: &str, endpoint: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--include-ignored",
            test,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, endpoint)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Reads a child's stdout lines on a thread (the parent's runtime stays free to serve it).
fn lines(child: &mut std::process::Child) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(l) = line else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Kills the child after `secs` unless `done` was set first.
fn watchdog(child: &std::process::Child, secs: u64) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let pid = child.id() as libc::pid_t;
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        if !d.load(Ordering::Acquire) {
            eprintln!("watchdog: killing the child {pid}");
            // SAFETY: plain kill(2) of the child this test spawned.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
async fn v2_ipc_glm52_roundtrip_is_byte_exact() {
    if !gpu_tests() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let srv = Server::start("2gb").await;
    let mut child = spawn_child("v2_ipc_roundtrip_child", IPC_CHILD_ENV, &srv.endpoint());
    let done = watchdog(&child, 180);
    let mut rx = lines(&mut child);
    let mut ok = false;
    while let Some(l) = rx.recv().await {
        eprintln!("child: {l}");
        ok |= l.contains("CHILD_OK");
    }
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    done.store(true, Ordering::Release);
    assert!(status.success() && ok, "the IPC client failed: {status}");
    let t = srv.wait_all_released().await;
    eprintln!(
        "[ipc] every IPC handle closed {:.1} ms after the child finished",
        t.as_secs_f64() * 1e3
    );
    srv.healthy().await;
}

const KILLED_CHILD_ENV: &str = "PEGAFLOW_V2_KILLED_CHILD";
const KILLED_NS: &str = "glm52-v2-killed";
/// Blocks the killed child cycles through.
const RING: usize = 8;

/// The client half of the killed-client test: saves whole GLM blocks until SIGKILLed.
#[test]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
fn v2_killed_client_child() {
    let Ok(endpoint) = std::env::var(KILLED_CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let rank = Rank::new(BLOCKS, |bytes| VmmAllocation::new(0, bytes).unwrap());
        let client = Client::connect(&endpoint).await.unwrap();
        let mut inst = client
            .register("killed", KILLED_NS, &rank.builder())
            .await
            .unwrap();
        println!("\nCHILD_REGISTERED {}", inst.instance_id());
        for k in 0..1_000_000usize {
            let b = k % RING;
            let h = hash_of("killed", k);
            rank.fill(b, &h);
            inst.save(&[b as u32], std::slice::from_ref(&h))
                .await
                .unwrap();
            println!("\nCHILD_SAVED {k}");
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
async fn v2_vmm_killed_client_mid_save_is_cleaned_up_and_serves_no_stale_bytes() {
    if !gpu_tests() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let srv = Server::start("2gb").await;
    let mut child = spawn_child("v2_killed_client_child", KILLED_CHILD_ENV, &srv.endpoint());
    let done = watchdog(&child, 180);
    let mut rx = lines(&mut child);
    let mut last_saved = None;
    while let Some(l) = rx.recv().await {
        if let Some(i) = l.find("CHILD_SAVED ") {
            let k: usize = l[i + "CHILD_SAVED ".len()..].trim().parse().unwrap();
            last_saved = Some(k);
            if k >= 24 {
                break;
            }
        }
    }
    let last_saved = last_saved.expect("the child saved");
    // SIGKILL while the child keeps saving (a Save is in flight or about to be).
    child.kill().unwrap();
    let status = child.wait().unwrap();
    done.store(true, Ordering::Release);
    drop(rx);
    assert!(!status.success());
    let t = srv.wait_all_released().await;
    eprintln!(
        "[killed] child killed after save {last_saved}; instance and 99 mappings released {:.1} ms later",
        t.as_secs_f64() * 1e3
    );
    srv.healthy().await;

    // A new client sees only whole blocks whose every arena holds what its hash was saved with.
    let rank = Rank::new(BLOCKS, |bytes| VmmAllocation::new(0, bytes).unwrap());
    let client = Client::connect(&srv.endpoint()).await.unwrap();
    let mut inst = client
        .register("survivor", KILLED_NS, &rank.builder())
        .await
        .unwrap();
    inst.flush().await.unwrap();
    // The last RING acknowledged saves are still cached (earlier ones too, capacity allows).
    let from = last_saved + 1 - RING.min(last_saved + 1);
    let hs: Vec<Vec<u8>> = (from..last_saved + 16)
        .map(|k| hash_of("killed", k))
        .collect();
    let (n, lease) = inst.query(hs.clone(), "k").await.unwrap();
    let n = n as usize;
    assert!(
        n > last_saved - from,
        "acknowledged saves {from}..={last_saved} must be cached, got {n} hits"
    );
    assert!(n <= BLOCKS);
    rank.poison(0x5A);
    let targets: Vec<u32> = (0..n as u32).collect();
    inst.load(&lease, &targets).await.unwrap();
    let loaded: Vec<(usize, Vec<u8>)> = (0..n).map(|i| (i, hs[i].clone())).collect();
    rank.assert_image(0x5A, &loaded);
    eprintln!("[killed] survivor loaded {n} whole blocks of the dead client, byte-exact");
    inst.unregister().await.unwrap();
    srv.wait_all_released().await;
}

/// Save and load GB/s of one layout: `reps` rounds of `count` fresh blocks (save → flush →
/// query → load into other blocks), best and median of each direction.
async fn bench_layout(
    client: &Client,
    tag: &str,
    reg: &RegistrationBuilder<'_>,
    blocks: usize,
    count: usize,
    reps: usize,
) -> (f64, f64, f64, f64) {
    let mut inst = client
        .register(tag, &format!("bench-{tag}"), reg)
        .await
        .unwrap();
    let bytes = count * LOGICAL_BLOCK;
    let (mut saves, mut loads) = (Vec::new(), Vec::new());
    for r in 0..reps {
        let hs: Vec<Vec<u8>> = (0..count)
            .map(|i| hash_of(&format!("{tag}-{r}"), i))
            .collect();
        let ids: Vec<u32> = (0..count as u32).collect();
        let t0 = Instant::now();
        inst.save(&ids, &hs).await.unwrap();
        saves.push(gbps(bytes, t0.elapsed()));
        inst.flush().await.unwrap();
        let (n, lease) = inst.query(hs, "b").await.unwrap();
        assert_eq!(n as usize, count);
        let targets: Vec<u32> = (blocks - count..blocks).map(|b| b as u32).collect();
        let t0 = Instant::now();
        inst.load(&lease, &targets).await.unwrap();
        loads.push(gbps(bytes, t0.elapsed()));
    }
    inst.unregister().await.unwrap();
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (v[v.len() - 1], v[v.len() / 2])
    };
    let (sb, sm) = stats(&mut saves);
    let (lb, lm) = stats(&mut loads);
    (sb, sm, lb, lm)
}

/// The bench of docs/BENCHMARKS.md: Save/Load GB/s of the GLM5.2 layout (99 arenas, each its
/// own VMM allocation) against the same bytes in one fused VMM allocation (the same 99
/// tensors back to back, and one tensor of 3,452,160 bytes per block).
/// `PEGAFLOW_V2_BENCH_BLOCKS` (default 128) blocks per Save/Load, 5 rounds each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU; run with PEGAFLOW_GPU_TESTS=1 and --include-ignored"]
async fn v2_bench_glm52_layout_against_one_fused_allocation() {
    if !gpu_tests() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let count: usize = std::env::var("PEGAFLOW_V2_BENCH_BLOCKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let blocks = 2 * count;
    let reps = 5;
    let srv = Server::start("16gb").await;
    // Give the pool's background pinning a head start.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let client = Client::connect(&srv.endpoint()).await.unwrap();
    let fused = VmmAllocation::new(0, blocks * LOGICAL_BLOCK).unwrap();
    // Warm-up, not measured: one round trip through every path before the first layout.
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    b.contiguous_tensor("page", a, 0, blocks as u64, LOGICAL_BLOCK as u64);
    bench_layout(&client, "warmup", &b, blocks, count, 2).await;
    let mut rows = Vec::new();

    let rank = Rank::new(blocks, |bytes| VmmAllocation::new(0, bytes).unwrap());
    rows.push((
        "99 arenas, 99 VMM allocations",
        bench_layout(&client, "glm-split", &rank.builder(), blocks, count, reps).await,
    ));
    drop(rank);

    let layout = glm52_layout();
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    let mut off = 0u64;
    for (name, block) in &layout {
        b.contiguous_tensor(name, a, off, blocks as u64, *block as u64);
        off += (blocks * block) as u64;
    }
    rows.push((
        "99 arenas, one fused VMM allocation",
        bench_layout(&client, "glm-fused", &b, blocks, count, reps).await,
    ));
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    b.contiguous_tensor("page", a, 0, blocks as u64, LOGICAL_BLOCK as u64);
    rows.push((
        "1 tensor of 3,452,160 B/block, one VMM allocation",
        bench_layout(&client, "one-page", &b, blocks, count, reps).await,
    ));
    eprintln!(
        "\nGLM5.2 rank layout, {count} blocks x {LOGICAL_BLOCK} B = {:.1} MiB per Save/Load, {reps} rounds:",
        (count * LOGICAL_BLOCK) as f64 / (1 << 20) as f64
    );
    eprintln!("| layout | save GB/s best / median | load GB/s best / median |");
    eprintln!("|---|---|---|");
    for (name, (sb, sm, lb, lm)) in rows {
        eprintln!("| {name} | {sb:.1} / {sm:.1} | {lb:.1} / {lm:.1} |");
    }
    srv.wait_all_released().await;
}
