//! The data path end to end in one process over the emulator: a holder engine with its
//! fabric socket, a requester engine, real memory on both sides; bytes, selective
//! signalling, every injected fault, drain-before-free ordering, cancellation, and a
//! simultaneous mutual handshake.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{Extent, HostBuffer, HostMemory, HostRegion, PeerDataError, PeerDataPath};
use pegaflow_plugin::{PeerRead, RemoteRange};
use pegaflow_transport_tcp::fetch::{Exchange, Handshake};

use crate::codec::Meta;
use crate::emu::{self, EmuSettings, FabricPeers, FabricServer};
use crate::path::{Engine, PathLimits, RdmaMetrics};
use crate::verbs::{Nic, QpPeer, QpState, ReadWr, WcStatus};

/// Page-aligned memory that stays mapped for the whole test binary.
fn memory(len: usize, fill: impl Fn(usize) -> u8) -> &'static mut [u8] {
    let v: Vec<u8> = (0..len).map(fill).collect();
    Box::leak(v.into_boxed_slice())
}

fn region(m: &[u8]) -> HostRegion {
    HostRegion {
        addr: m.as_ptr() as usize,
        len: m.len(),
        owner: Arc::new(()),
    }
}

#[derive(Default)]
struct Peers(AtomicUsize);

impl FabricPeers for Peers {
    fn connected(&self, _: &Arc<str>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn disconnected(&self, _: &Arc<str>) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Records when a destination's memory was given back.
#[derive(Default)]
struct Released(Mutex<Option<Instant>>);

impl HostMemory for Released {
    fn release(&self, _: &[Extent]) {
        *self.0.lock() = Some(Instant::now());
    }
}

struct Node {
    engine: Arc<Engine>,
    _fabric: FabricServer,
    peers: Arc<Peers>,
    mem: &'static mut [u8],
    id: String,
}

fn limits(qps: usize) -> PathLimits {
    PathLimits {
        qps_per_peer: qps,
        max_wr_bytes: 4096,
        signal_every: 4,
        max_holder_connections: 8,
    }
}

fn node(name: &str, nics: usize, qps: usize, s: &EmuSettings, fill: u8) -> Node {
    let id = format!("{name}-{}", uuid::Uuid::new_v4());
    let names: Vec<String> = (0..nics).map(|i| format!("{name}{i}")).collect();
    let nics = emu::open(&names, &id, s).unwrap();
    let peers = Arc::new(Peers::default());
    let dir = std::env::temp_dir();
    let fabric = FabricServer::start(&dir, nics.clone(), peers.clone(), 8).unwrap();
    let metrics = RdmaMetrics::new(&prometheus::Registry::new());
    let nics: Vec<Arc<dyn Nic>> = nics.into_iter().map(|n| n as Arc<dyn Nic>).collect();
    let engine = Engine::new(
        "rdma-emu",
        nics,
        limits(qps),
        fabric.path().display().to_string(),
        s.fault_wrong_rkey,
        metrics,
    )
    .unwrap();
    let mem = memory(1 << 20, |i| (i as u8).wrapping_mul(7).wrapping_add(fill));
    engine.register_regions(vec![region(mem)]).unwrap();
    Node {
        engine,
        _fabric: fabric,
        peers,
        mem,
        id,
    }
}

/// The handshake RPC, straight into the holder's engine.
struct Direct<'a> {
    holder: &'a Engine,
    requester: String,
}

#[async_trait]
impl Exchange for Direct<'_> {
    async fn exchange(&mut self, metadata: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
        let offer = Meta::decode(&metadata).map_err(|e| tonic::Status::invalid_argument(e.0))?;
        let a = self
            .holder
            .answer(&self.requester, &offer)
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        Ok(a.encode())
    }
}

async fn connect(req: &Node, holder: &Node) -> String {
    let mut rpc = Direct {
        holder: &holder.engine,
        requester: req.id.clone(),
    };
    req.engine
        .handshake(
            "holder:1",
            &mut rpc,
            Instant::now() + Duration::from_secs(5),
        )
        .await
        .unwrap()
}

/// A destination of `len` bytes at `off` in `req`'s registered memory, with a release
/// recorder.
fn dest(req: &Node, off: usize, len: usize) -> (Arc<HostBuffer>, Arc<Released>) {
    let rel = Arc::new(Released::default());
    let b = HostBuffer::new(
        vec![Extent {
            addr: req.mem.as_ptr() as usize + off,
            len,
        }],
        rel.clone(),
    );
    (Arc::new(b), rel)
}

fn read(dest: &Arc<HostBuffer>, holder: &Node, at: usize, len: usize) -> PeerRead {
    PeerRead {
        dest: dest.clone(),
        dest_offset: 0,
        ranges: vec![RemoteRange {
            addr: holder.mem.as_ptr() as u64 + at as u64,
            len: len as u64,
        }],
    }
}

fn settings() -> EmuSettings {
    EmuSettings::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_lands_byte_exact_over_several_nics_and_queue_pairs() {
    let holder = node("h", 1, 1, &settings(), 3);
    let req = node("r", 2, 2, &settings(), 100);
    let ep = connect(&req, &holder).await;
    // The holder counts a link once it has handed over its descriptor.
    assert!(
        until(|| holder.peers.0.load(Ordering::SeqCst) == 2).await,
        "one fabric link per requester NIC"
    );
    req.engine
        .connect(&ep, Instant::now() + Duration::from_secs(1))
        .await
        .unwrap();
    // Two destinations, 100 KiB each, from two places in the holder's memory.
    let (d1, _) = dest(&req, 0, 100 << 10);
    let (d2, _) = dest(&req, 200 << 10, 100 << 10);
    let reads = vec![
        read(&d1, &holder, 4096 * 3 + 5, 100 << 10),
        read(&d2, &holder, 500 << 10, 100 << 10),
    ];
    req.engine
        .pull(&ep, "s", reads, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    let got = &req.mem[..100 << 10];
    assert_eq!(got, &holder.mem[4096 * 3 + 5..][..100 << 10]);
    assert_eq!(
        &req.mem[200 << 10..300 << 10],
        &holder.mem[500 << 10..600 << 10]
    );
    // 200 KiB in 4 KiB READs over 4 queue pairs, every 4th signalled (and the last).
    let m = req.engine.metrics();
    assert_eq!(m.wrs_posted.get(), 50);
    let ok = m.completions.with_label_values(&["success"]).get();
    assert!(
        ok > 0 && ok < 50,
        "selective signalling: {ok} of 50 completions"
    );
    assert_eq!(m.draining_bytes.get(), 0);
}

/// Waits until `f`, ≤ 5 s.
async fn until(f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f()
}

/// Runs a failing pull with `req`'s faults; returns the error, the destination's release
/// time and when the pull returned.
async fn failing_pull(
    req: &Node,
    holder: &Node,
    deadline_ms: u64,
) -> (PeerDataError, Arc<Released>, Instant) {
    let ep = connect(req, holder).await;
    let (d, rel) = dest(req, 0, 64 << 10);
    let r = read(&d, holder, 0, 64 << 10);
    drop(d);
    let e = req
        .engine
        .pull(
            &ep,
            "s",
            vec![r],
            Instant::now() + Duration::from_millis(deadline_ms),
        )
        .await
        .unwrap_err();
    let returned = Instant::now();
    // The broken connection is never used again.
    assert!(req
        .engine
        .connect(&ep, Instant::now() + Duration::from_secs(1))
        .await
        .is_err());
    (e, rel, returned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_mismatch_fails_the_pull_and_frees_only_after_the_drain() {
    let holder = node(
        "h",
        1,
        1,
        &EmuSettings {
            fault_wrong_rkey: true,
            ..settings()
        },
        1,
    );
    let req = node("r", 1, 2, &settings(), 2);
    let (e, rel, _) = failing_pull(&req, &holder, 2000).await;
    assert!(matches!(e, PeerDataError::Refused(_)), "{e:?}");
    let m = req.engine.metrics();
    assert!(
        until(|| rel.0.lock().is_some()).await,
        "freed after the drain"
    );
    assert!(until(|| m.draining_bytes.get() == 0).await);
    assert_eq!(m.drains.with_label_values(&["drained"]).get(), 1);
    assert!(m.completions.with_label_values(&["remote_access"]).get() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_error_after_n_operations_fails_and_drains() {
    let holder = node("h", 1, 1, &settings(), 1);
    let req = node(
        "r",
        1,
        1,
        &EmuSettings {
            fault_completion_error_after: 5,
            ..settings()
        },
        2,
    );
    let (e, rel, _) = failing_pull(&req, &holder, 2000).await;
    assert!(matches!(e, PeerDataError::Unreachable(_)), "{e:?}");
    let m = req.engine.metrics();
    assert!(until(|| rel.0.lock().is_some()).await);
    assert!(until(|| m.draining_bytes.get() == 0).await);
    assert!(m.completions.with_label_values(&["other"]).get() >= 1);
    assert!(
        m.completions.with_label_values(&["flushed"]).get() >= 1,
        "the READs behind the error and the marker are flushed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_mapping_is_a_dead_peer() {
    let holder = node("h", 1, 1, &settings(), 1);
    let req = node(
        "r",
        1,
        1,
        &EmuSettings {
            fault_revoke_after: 3,
            ..settings()
        },
        2,
    );
    let (e, rel, _) = failing_pull(&req, &holder, 2000).await;
    assert!(matches!(e, PeerDataError::Unreachable(_)), "{e:?}");
    assert!(until(|| rel.0.lock().is_some()).await);
    let m = req.engine.metrics();
    assert!(m.completions.with_label_values(&["retry_exceeded"]).get() >= 1);
    assert!(until(|| m.draining_bytes.get() == 0).await);
}

/// The drain-before-free ordering: a READ that completes 1 s late (its copy lands
/// late too) after a 50 ms deadline. The pull returns at the deadline; the buffer is held
/// until the late READ and the marker behind it complete, then freed; nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_completion_after_the_deadline_is_drained_before_the_buffer_is_freed() {
    let holder = node("h", 1, 1, &settings(), 9);
    let req = node(
        "r",
        1,
        1,
        &EmuSettings {
            fault_late_after: 2,
            fault_late_completion_ms: 1000,
            ..settings()
        },
        0,
    );
    let t0 = Instant::now();
    let (e, rel, returned) = failing_pull(&req, &holder, 50).await;
    assert_eq!(e, PeerDataError::Timeout);
    assert!(
        returned - t0 < Duration::from_millis(700),
        "the pull returns by its deadline: {:?}",
        returned - t0
    );
    let m = req.engine.metrics();
    assert_eq!(m.draining_bytes.get(), 64 << 10, "held while draining");
    assert!(
        rel.0.lock().is_none(),
        "not freed before the late READ ended"
    );
    assert!(until(|| rel.0.lock().is_some()).await);
    let freed = rel.0.lock().unwrap();
    assert!(
        freed - t0 >= Duration::from_millis(1000),
        "freed only after the late completion: {:?}",
        freed - t0
    );
    // The late READ did land (into memory that was still held).
    assert_eq!(&req.mem[4096..8192], &holder.mem[4096..8192]);
    assert!(until(|| m.draining_bytes.get() == 0).await);
    assert_eq!(m.drains.with_label_values(&["drained"]).get(), 1);
}

/// A pull future dropped mid-flight (the fetcher's own deadline) drains the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_pull_drains_before_freeing() {
    let holder = node("h", 1, 1, &settings(), 9);
    let req = node(
        "r",
        1,
        1,
        &EmuSettings {
            fault_late_after: 1,
            fault_late_completion_ms: 1000,
            ..settings()
        },
        0,
    );
    let ep = connect(&req, &holder).await;
    let (d, rel) = dest(&req, 0, 16 << 10);
    let r = read(&d, &holder, 0, 16 << 10);
    drop(d);
    let f = req
        .engine
        .pull(&ep, "s", vec![r], Instant::now() + Duration::from_secs(10));
    assert!(tokio::time::timeout(Duration::from_millis(30), f)
        .await
        .is_err());
    assert!(rel.0.lock().is_none(), "held: the READ is still running");
    assert!(until(|| rel.0.lock().is_some()).await);
    assert!(until(|| req.engine.metrics().draining_bytes.get() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_outside_the_holders_regions_are_refused_before_posting() {
    let holder = node("h", 1, 1, &settings(), 1);
    let req = node("r", 1, 1, &settings(), 2);
    let ep = connect(&req, &holder).await;
    let (d, _) = dest(&req, 0, 8192);
    let mut r = read(&d, &holder, 0, 8192);
    r.ranges[0].addr = holder.mem.as_ptr() as u64 + (1 << 20) - 4096;
    let e = req
        .engine
        .pull(&ep, "s", vec![r], Instant::now() + Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(e, PeerDataError::Refused(_)), "{e:?}");
    assert_eq!(req.engine.metrics().wrs_posted.get(), 0);
}

/// Two nodes handshake with each other at the same moment, several times: every
/// connection comes up, each pull lands, nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_mutual_handshakes_are_independent() {
    let a = node("a", 2, 2, &settings(), 11);
    let b = node("b", 1, 2, &settings(), 22);
    for _ in 0..5 {
        let (ea, eb) = tokio::join!(connect(&a, &b), connect(&b, &a));
        let (da, _) = dest(&a, 512 << 10, 8192);
        let (db, _) = dest(&b, 512 << 10, 8192);
        let (ra, rb) = (read(&da, &b, 0, 8192), read(&db, &a, 0, 8192));
        let dl = Instant::now() + Duration::from_secs(5);
        let (x, y) = tokio::join!(
            a.engine.pull(&ea, "s", vec![ra], dl),
            b.engine.pull(&eb, "s", vec![rb], dl)
        );
        x.unwrap();
        y.unwrap();
    }
    assert_eq!(&a.mem[512 << 10..][..8192], &b.mem[..8192]);
    assert_eq!(&b.mem[512 << 10..][..8192], &a.mem[..8192]);
}

/// InfiniBand addressing (LIDs) works like RoCE's (GIDs); a requester whose NICs share no
/// link layer with the holder's is refused at the handshake, before anything is locked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infiniband_lids_work_and_link_layers_must_match() {
    let ib = EmuSettings {
        link: "ib".into(),
        ..settings()
    };
    let holder = node("h", 1, 1, &ib, 7);
    let req = node("r", 1, 2, &ib, 8);
    let ep = connect(&req, &holder).await;
    let (d, _) = dest(&req, 0, 8192);
    req.engine
        .pull(
            &ep,
            "s",
            vec![read(&d, &holder, 4096, 8192)],
            Instant::now() + Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(&req.mem[..8192], &holder.mem[4096..][..8192]);

    let roce = node("x", 1, 1, &settings(), 9);
    let mut rpc = Direct {
        holder: &holder.engine,
        requester: roce.id.clone(),
    };
    let e = roce
        .engine
        .handshake(
            "holder:1",
            &mut rpc,
            Instant::now() + Duration::from_secs(5),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, pegaflow_transport_tcp::fetch::HandshakeError::Refused(m) if m.contains("paired none")),
        "{e:?}"
    );
}

/// Two fetches from one requester handshaking with one holder at the same moment: both
/// connections stay usable (neither replaces the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_handshakes_to_one_holder_keep_both_connections() {
    let holder = node("h", 1, 1, &settings(), 5);
    let req = node("r", 1, 1, &settings(), 6);
    let (e1, e2) = tokio::join!(connect(&req, &holder), connect(&req, &holder));
    assert_ne!(e1, e2);
    for (i, ep) in [e1, e2].iter().enumerate() {
        let (d, _) = dest(&req, i * 8192, 8192);
        let r = read(&d, &holder, 8192 * (i + 1), 8192);
        req.engine
            .pull(ep, "s", vec![r], Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            &req.mem[i * 8192..][..8192],
            &holder.mem[8192 * (i + 1)..][..8192]
        );
    }
}

/// The emulated queue pair follows the verbs state machine: no post before RTS, an
/// errored queue pair flushes in order.
#[test]
fn emulated_queue_pairs_follow_the_state_machine() {
    let nic = emu::open(&["x0".into()], "t", &settings())
        .unwrap()
        .remove(0);
    let qp = nic.create_qp().unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    let wr = |id, signaled| ReadWr {
        wr_id: id,
        local_addr: 0,
        lkey: 0,
        remote_addr: 0,
        rkey: 0,
        len: 8,
        signaled,
    };
    // SAFETY: refused posts and flushed WRs touch no memory.
    assert!(unsafe { qp.post_read(&[wr(1, true)]) }.is_err(), "Reset");
    qp.to_init().unwrap();
    // SAFETY: a refused post touches no memory.
    assert!(unsafe { qp.post_read(&[wr(1, true)]) }.is_err(), "Init");
    assert!(qp.to_rts().is_err(), "Init -> RTS skips RTR");
    let peer = QpPeer {
        qpn: 5,
        psn: 6,
        lid: 0,
        gid: [1; 16],
        link: crate::verbs::LinkLayer::Ethernet,
        mtu: 5,
        fabric: String::new(),
    };
    qp.to_rtr(&peer).unwrap();
    qp.to_rts().unwrap();
    qp.to_error().unwrap();
    // SAFETY: WRs posted in Error are flushed without touching memory.
    unsafe { qp.post_read(&[wr(1, false), wr(2, false), wr(3, true)]) }.unwrap();
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(5);
    while out.len() < 3 && Instant::now() < end {
        nic.poll(&mut out, 8, Duration::from_millis(50));
    }
    let ids: Vec<_> = out.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        ids,
        vec![
            (1, WcStatus::Flushed),
            (2, WcStatus::Flushed),
            (3, WcStatus::Flushed)
        ],
        "flushed WRs complete signalled or not, in order"
    );
}

#[test]
fn settings_are_checked_and_documented() {
    let problems = pegaflow_plugin::doc_problems();
    let ours: Vec<_> = problems.iter().filter(|p| p.contains("\"rdma")).collect();
    assert!(ours.is_empty(), "{ours:?}");
    let f = pegaflow_plugin::peer_service_factory("rdma-emu").unwrap();
    assert!((f.config.check)("p", &toml::Table::new()).is_ok());
    let t: toml::Table = toml::from_str("qps_per_peer = 0").unwrap();
    assert!((f.config.check)("p", &t).is_err());
    let t: toml::Table = toml::from_str("[emu]\nlink = \"fddi\"").unwrap();
    assert!((f.config.check)("p", &t).is_err());
    let t: toml::Table = toml::from_str("[emu]\nbogus = 1").unwrap();
    assert!((f.config.check)("p", &t).is_err());
    let t: toml::Table = toml::from_str("[emu]\nlink = \"ib\"\nfault_wrong_rkey = true").unwrap();
    assert!((f.config.check)("p", &t).is_ok());
}

/// `nics` reads as PegaFlow's `--nics`: names separated by commas and/or spaces, trimmed, in
/// one entry or several; an empty name is an error (it used to be dropped silently).
#[test]
fn nic_names_split_at_commas_and_spaces_and_refuse_empty_names() {
    let names = |v: &[&str]| {
        crate::RdmaPeerConfig {
            nics: v.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
        .nic_names()
    };
    let want = |v: &[&str]| Ok(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    assert_eq!(names(&[]), want(&[]), "none named: every device");
    assert_eq!(names(&["mlx5_0,mlx5_1"]), want(&["mlx5_0", "mlx5_1"]));
    assert_eq!(names(&["mlx5_0 mlx5_1"]), want(&["mlx5_0", "mlx5_1"]));
    assert_eq!(names(&[" mlx5_0 , mlx5_1 "]), want(&["mlx5_0", "mlx5_1"]));
    assert_eq!(
        names(&["mlx5_0", "mlx5_1,mlx5_2"]),
        want(&["mlx5_0", "mlx5_1", "mlx5_2"])
    );
    for bad in [
        &[""][..],
        &["mlx5_0,"],
        &["mlx5_0,,mlx5_1"],
        &["mlx5_0", " "],
    ] {
        let e = names(bad).unwrap_err();
        assert!(e.contains("an empty NIC name"), "{bad:?}: {e}");
    }
    let f = pegaflow_plugin::peer_service_factory("rdma-emu").unwrap();
    let t: toml::Table = toml::from_str("nics = [\"emu0,\"]").unwrap();
    let e = (f.config.check)("p", &t).unwrap_err().to_string();
    assert!(e.contains("empty NIC name"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_contiguous_on_both_sides_are_coalesced_into_few_reads() {
    let holder = node("h", 1, 1, &settings(), 7);
    let req = node("r", 1, 2, &settings(), 200);
    let ep = connect(&req, &holder).await;
    req.engine
        .connect(&ep, Instant::now() + Duration::from_secs(1))
        .await
        .unwrap();
    // 64 KiB in 64 ranges of 1 KiB, contiguous in the holder and landing contiguously here
    // (a block's per-layer slots): 16 READs of max_wr_bytes (4 KiB), not 64.
    let (d, _) = dest(&req, 0, 64 << 10);
    let base = holder.mem.as_ptr() as u64 + 8192;
    let contiguous = PeerRead {
        dest: d.clone(),
        dest_offset: 0,
        ranges: (0..64)
            .map(|i| RemoteRange {
                addr: base + i * 1024,
                len: 1024,
            })
            .collect(),
    };
    // Two ranges that are not adjacent in the holder stay two READs.
    let (d2, _) = dest(&req, 128 << 10, 2048);
    let apart = PeerRead {
        dest: d2,
        dest_offset: 0,
        ranges: vec![
            RemoteRange {
                addr: base + (200 << 10),
                len: 1024,
            },
            RemoteRange {
                addr: base + (300 << 10),
                len: 1024,
            },
        ],
    };
    req.engine
        .pull(
            &ep,
            "s",
            vec![contiguous, apart],
            Instant::now() + Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(&req.mem[..64 << 10], &holder.mem[8192..8192 + (64 << 10)]);
    let off = 8192 + (200 << 10);
    assert_eq!(
        &req.mem[128 << 10..(128 << 10) + 1024],
        &holder.mem[off..off + 1024]
    );
    let off = 8192 + (300 << 10);
    assert_eq!(
        &req.mem[(128 << 10) + 1024..(128 << 10) + 2048],
        &holder.mem[off..off + 1024]
    );
    assert_eq!(req.engine.metrics().wrs_posted.get(), 16 + 2);
}

#[test]
fn another_user_cannot_reach_the_fabric_socket() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        pegaflow_test_skip::skip!("running a process as another user needs root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // A world-readable parent, as /tmp is: only the fabric's own directory protects it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = FabricServer::start(dir.path(), Vec::new(), Arc::new(Peers::default()), 4).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(f.path()), 0o600);
    assert_eq!(mode(f.path().parent().unwrap()), 0o700);
    let probe = "import socket, sys\n\
                 s = socket.socket(socket.AF_UNIX)\n\
                 try:\n    s.connect(sys.argv[1]); print('connected')\n\
                 except OSError as e:\n    print('refused', e.errno)\n";
    let out = match std::process::Command::new("python3")
        .arg("-c")
        .arg(probe)
        .arg(f.path())
        .uid(65534)
        .gid(65534)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            pegaflow_test_skip::skip!("cannot run python3 as nobody: {e}");
            return;
        }
    };
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with("refused"),
        "another user reached the socket: {said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = f.path().to_path_buf();
    drop(f);
    assert!(
        !path.exists() && !path.parent().unwrap().exists(),
        "socket and directory removed"
    );
}
