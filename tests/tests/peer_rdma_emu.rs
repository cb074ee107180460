//! Peer fetch by one-sided READ through the in-tree RDMA emulator (`[peer] kind =
//! "rdma-emu"`) between `pegaflow-server` processes on one machine, with the directory in a
//! real `redis-server`:
//! - a block saved on one node is loaded byte-exact through another (Loading, then Ready);
//!   the source's locks return to 0 and the requester drained nothing;
//! - the source killed mid-transfer: the query falls through within its deadline, nothing
//!   half-fetched is served, the requester holds no buffer afterwards;
//! - a completion error, a key mismatch and a late completion (after the fetch deadline):
//!   the fetch fails, both servers keep serving, and nothing leaks: the source's locks,
//!   the requester's draining buffers and pool bytes, both processes' descriptors;
//!   after the late completion the next fetch lands;
//! - the source's lock ending during a one-sided pull: the bytes are dropped (lock_lost);
//! - the requester killed with READs in flight: the source's locks and queue pairs go at
//!   once (its fabric sockets close);
//! - two nodes fetching from each other at the same moment (simultaneous mutual
//!   handshakes): both land, neither panics.
//!
//! Skips (reported by `pegaflow_tests::skip!`) without `redis-server` or a built `pegaflow-server`.

mod peer_support;

use std::time::{Duration, Instant};

use peer_support::*;
use pegaflow_tests::harness::KvShape;
// Link the directory backends so their factories register (the throughput measurement asks
// the directory when the source's run is listed).
use pegaflow_directory as _;

impl Env {
    /// Options of a node whose `[peer]` is the emulator with `peer` settings and `emu`
    /// (the `[peer.emu]` table's lines). Unless `peer` sets it, READs are at most 4 KiB
    /// (`max_wr_bytes`): these small blocks then take many READs even after coalescing, so
    /// signalling and the faults armed at the n-th operation are exercised.
    fn opts(&self, prefix: &str, peer: &str, emu: &str) -> NodeOpts {
        let peer = if peer.contains("max_wr_bytes") {
            peer.to_string()
        } else {
            format!("max_wr_bytes = 4096\n{peer}")
        };
        NodeOpts {
            directory: Some((self.redis.url(), format!("pf:{prefix}:"))),
            peer: None,
            extra_toml: format!(
                "\n[peer]\nkind = \"rdma-emu\"\n{peer}\n\n[peer.emu]\nsocket_dir = \"{{dir}}\"\n{emu}\n"
            ),
            ..NodeOpts::default()
        }
    }
}

/// Open descriptors of process `pid`.
fn fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Waits until the descriptor count of `pid` is at most `at_most` (≤ 5 s); the last count.
async fn fds_settle(pid: i32, at_most: usize) -> usize {
    let t0 = Instant::now();
    loop {
        let n = fds(pid);
        if n <= at_most || t0.elapsed() > Duration::from_secs(5) {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_saved_on_one_node_is_loaded_byte_exact_through_another_over_the_emulator() {
    let Some(env) =
        env("a_block_saved_on_one_node_is_loaded_byte_exact_through_another_over_the_emulator")
    else {
        return;
    };
    let o = env.opts("emu-basic", "nics = [\"emu0\", \"emu1\"]", "");
    let a = Node::start(&env.bin, "source", &o);
    let b = Node::start(&env.bin, "requester", &o);
    let mut wa = worker(&a, "inst-a", SMALL).await;
    let mut wb = worker(&b, "inst-b", SMALL).await;
    let hs = hashes("emu-basic", 24);
    save(&mut wa, 0, &hs).await;
    // The save goes in two requests (16 + 8 blocks): a query between their listings would
    // fetch the first 16 alone, then the rest under a second lock.
    wait_listed(&env, "emu-basic", &a, &hs).await;

    let s = settle_all(&mut wb, &hs, 24, Duration::from_secs(15)).await;
    assert!(s.loading > 0, "the fetch was answered Loading first: {s:?}");
    load_exact(&mut wb, &s.lease, 30, &hs).await;

    assert_eq!(b.metric("pegaflow_peer_fetch_blocks_total", &[]), 24.0);
    assert_eq!(
        b.metric(
            "pegaflow_tier_promotions_total",
            &[("tier", "peer"), ("outcome", "promoted")]
        ),
        24.0
    );
    assert!(b.metric("pegaflow_rdma_wrs_posted_total", &[]) >= 24.0);
    assert_eq!(b.metric("pegaflow_rdma_draining_bytes", &[]), 0.0);
    // The lock is released once the pull has landed, and confirmed (one-sided reads).
    let released = within(Duration::from_secs(3), || {
        a.metric("pegaflow_transfer_locks_held", &[]) == 0.0
    })
    .await;
    assert!(released.is_some(), "the source's locks return to 0");
    assert_eq!(
        a.metric(
            "pegaflow_transfer_lock_releases_total",
            &[("reason", "released")]
        ),
        1.0
    );
    assert_eq!(
        b.metric(
            "pegaflow_peer_fetch_failures_total",
            &[("reason", "lock_lost")]
        ),
        0.0
    );
    // A re-query is a DRAM hit on the requester.
    let again = settle(&mut wb, &hs, "again", Duration::from_secs(5)).await;
    assert_eq!((again.hits, again.loading), (24, 0));
}

/// The source is killed while the requester pulls 128 MiB from it: the query settles
/// within the fetch deadline with nothing of the broken pull, what it answers loads
/// byte-exact, and the requester holds no draining buffer afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_killed_mid_transfer_falls_through_within_the_deadline() {
    let Some(env) =
        env("rdma_emu_the_source_killed_mid_transfer_falls_through_within_the_deadline")
    else {
        return;
    };
    // 64 KiB READs: the probe's block of 2 MiB takes 32, the victim's 128 MiB 2,048. The
    // requester's 100th READ lands 2 s late, so the victim's pull is surely running (and
    // its run locked) when the source dies; the deadlines leave room for a loaded machine.
    let peer = "qps_per_peer = 1\nfetch_timeout_ms = 6000\nmax_wr_bytes = 65536";
    let mut o = env.opts("emu-kill", peer, "");
    o.pool_bytes = 320 << 20;
    o.promote_deadline_ms = 8000;
    let mut a = Node::start(&env.bin, "source", &o);
    let mut ob = env.opts(
        "emu-kill",
        peer,
        "fault_late_after = 100\nfault_late_completion_ms = 2000",
    );
    ob.pool_bytes = 320 << 20;
    ob.promote_deadline_ms = 8000;
    let b = Node::start(&env.bin, "requester", &ob);
    let mut wa = worker(&a, "inst-a", BIG).await;
    let mut wb = worker(&b, "inst-b", BIG).await;
    let hs = hashes("emu-kill", 64);
    save(&mut wa, 0, &hs).await;
    // The whole run listed first: the victim's query then surely fetches all of it.
    wait_listed(&env, "emu-kill", &a, &hs).await;
    let probe = settle_all(&mut wb, &hs[..1], 1, Duration::from_secs(15)).await;
    wb.client.release(&probe.lease).await.expect("release");

    let t0 = Instant::now();
    let first = wb
        .client
        .query(&wb.instance_id, hs.clone(), "victim")
        .await
        .expect("query");
    assert!(matches!(first, pegaflow_api::client::QueryOutcome::Loading));
    let locked = within(Duration::from_secs(5), || {
        a.metric("pegaflow_transfer_locks_held", &[]) > 0.0
    })
    .await;
    a.kill();
    let s = settle(&mut wb, &hs, "victim", Duration::from_secs(5)).await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(6000 + 1500),
        "settled within the fetch deadline: {took:?}"
    );
    let failures = b.metric("pegaflow_peer_fetch_failures_total", &[]);
    println!("rdma-emu: source killed mid-pull; answer {} hits after {took:?}; fetch failures {failures}", s.hits);
    assert!(
        locked.is_some(),
        "the source had locked the run before it was killed"
    );
    assert_eq!(
        s.hits, 1,
        "only the probe's block: nothing of the broken pull is kept"
    );
    assert!(failures >= 1.0, "the failed pull is counted");
    load_exact(&mut wb, &s.lease, 0, &hs[..s.hits as usize]).await;
    let drained = within(Duration::from_secs(3), || {
        b.metric("pegaflow_rdma_draining_bytes", &[]) == 0.0
    })
    .await;
    assert!(drained.is_some(), "no buffer left held by a drain");
}

/// The requester is killed while its READs are in flight (one completes 5 s late, so the
/// pull is surely still running): its fabric sockets close, and the source releases its
/// locks at once and drops its queue pairs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requester_killed_mid_transfer_frees_the_sources_locks_at_once() {
    let Some(env) = env("rdma_emu_a_requester_killed_mid_transfer_frees_the_sources_locks_at_once")
    else {
        return;
    };
    let a = Node::start(&env.bin, "source", &env.opts("emu-kill-req", "", ""));
    let mut wa = worker(&a, "inst-a", SMALL).await;
    let hs = hashes("emu-kill-req", 16);
    save(&mut wa, 0, &hs).await;
    wait_listed(&env, "emu-kill-req", &a, &hs).await;
    let qps_before = a.metric("pegaflow_rdma_queue_pairs", &[]);
    let ob = env.opts(
        "emu-kill-req",
        "fetch_timeout_ms = 20000",
        "fault_late_after = 2\nfault_late_completion_ms = 5000",
    );
    let ob = NodeOpts {
        promote_deadline_ms: 20_000,
        ..ob
    };
    let mut b = Node::start(&env.bin, "requester", &ob);
    let mut wb = worker(&b, "inst-b", SMALL).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let q = wb
        .client
        .query(&wb.instance_id, hs.clone(), "doomed")
        .await
        .expect("query");
    assert!(matches!(q, pegaflow_api::client::QueryOutcome::Loading));
    let locked = within(Duration::from_secs(3), || {
        a.metric("pegaflow_transfer_locks_held", &[]) > 0.0
    })
    .await;
    assert!(locked.is_some(), "the requester locked the run");
    assert!(a.metric("pegaflow_rdma_queue_pairs", &[]) > qps_before);
    b.kill();
    let freed = within(Duration::from_secs(3), || {
        a.metric("pegaflow_transfer_locks_held", &[]) == 0.0
            && a.metric("pegaflow_rdma_queue_pairs", &[]) == qps_before
    })
    .await;
    let disconnect = a.metric(
        "pegaflow_transfer_lock_releases_total",
        &[("reason", "disconnect")],
    );
    let freed = freed.expect("the source's locks and queue pairs go");
    println!("rdma-emu: requester killed; the source's locks freed after {freed:?}");
    assert!(freed < Duration::from_secs(1), "at once: {freed:?}");
    assert_eq!(disconnect, 1.0, "ended by the requester's disconnect");
    // The source still serves.
    let s = settle(&mut wa, &hs, "after", Duration::from_secs(5)).await;
    assert_eq!(s.hits, 16);
    load_exact(&mut wa, &s.lease, 20, &hs).await;
}

/// The source's lease ends while the one-sided READs still run (one completes 1 s late,
/// the lease is 300 ms): the requester's confirmed release finds the lock gone and drops
/// the bytes (they may have been freed and reused under the reads); nothing is indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_that_ends_during_a_one_sided_pull_drops_the_bytes() {
    let Some(env) = env("a_lock_that_ends_during_a_one_sided_pull_drops_the_bytes") else {
        return;
    };
    let a = Node::start(
        &env.bin,
        "source",
        &env.opts("emu-lease", "lock_lease_ms = 300", ""),
    );
    let ob = env.opts(
        "emu-lease",
        "fetch_timeout_ms = 8000",
        "fault_late_after = 2\nfault_late_completion_ms = 1000",
    );
    let b = Node::start(
        &env.bin,
        "requester",
        &NodeOpts {
            promote_deadline_ms: 8000,
            ..ob
        },
    );
    let mut wa = worker(&a, "inst-a", SMALL).await;
    let mut wb = worker(&b, "inst-b", SMALL).await;
    let hs = hashes("emu-lease", 8);
    save(&mut wa, 0, &hs).await;
    wait_listed(&env, "emu-lease", &a, &hs).await;
    let s = settle(&mut wb, &hs, "late", Duration::from_secs(10)).await;
    assert!(s.loading > 0, "a fetch was tried");
    assert_eq!(s.hits, 0, "the bytes of a lost lock are not kept");
    assert_eq!(
        b.metric(
            "pegaflow_peer_fetch_failures_total",
            &[("reason", "lock_lost")]
        ),
        1.0
    );
    assert_eq!(
        a.metric(
            "pegaflow_transfer_lock_releases_total",
            &[("reason", "expired")]
        ),
        1.0
    );
    assert_eq!(b.metric("pegaflow_peer_fetch_blocks_total", &[]), 0.0);
}

/// One fault case: the requester's fetch from the source fails (or, `late`, times out);
/// both keep serving and nothing leaks. Returns the two nodes and the workers.
async fn fault_case(
    env: &Env,
    tag: &str,
    src_emu: &str,
    req_emu: &str,
    req_peer: &str,
    late: bool,
) {
    let src = env.opts(tag, "suspect_secs = 1", src_emu);
    let req = env.opts(tag, &format!("suspect_secs = 1\n{req_peer}"), req_emu);
    let a = Node::start(&env.bin, "source", &src);
    let b = Node::start(&env.bin, "requester", &req);
    let mut wa = worker(&a, "inst-a", SMALL).await;
    let mut wb = worker(&b, "inst-b", SMALL).await;
    let local = hashes(&format!("{tag}-local"), 4);
    save(&mut wb, 40, &local).await;
    let hs = hashes(tag, 16);
    save(&mut wa, 0, &hs).await;
    // Let the directory list the source's run before counting anything.
    wait_listed(env, tag, &a, &hs).await;
    let (fa, fb) = (fds(a.pid()), fds(b.pid()));
    let used_before = b.metric("pegaflow_pool_used_bytes", &[]);

    let s = settle(&mut wb, &hs, "faulty", Duration::from_secs(10)).await;
    assert!(s.loading > 0, "{tag}: a fetch was tried");
    assert_eq!(s.hits, 0, "{tag}: the failed fetch serves nothing");
    let failures = b.metric("pegaflow_peer_fetch_failures_total", &[]);
    assert!(failures >= 1.0, "{tag}: counted");
    // Nothing leaked: the source's locks, the requester's draining buffers and pool bytes,
    // both sides' queue pairs (the broken connection is gone on both).
    let ok = within(Duration::from_secs(5), || {
        a.metric("pegaflow_transfer_locks_held", &[]) == 0.0
            && b.metric("pegaflow_rdma_draining_bytes", &[]) == 0.0
            && b.metric("pegaflow_pool_used_bytes", &[]) <= used_before
            && a.metric("pegaflow_rdma_queue_pairs", &[]) == 0.0
            && b.metric("pegaflow_rdma_queue_pairs", &[]) == 0.0
    })
    .await;
    assert!(
        ok.is_some(),
        "{tag}: locks {} draining {} pool {} (was {used_before}) queue pairs {} / {}",
        a.metric("pegaflow_transfer_locks_held", &[]),
        b.metric("pegaflow_rdma_draining_bytes", &[]),
        b.metric("pegaflow_pool_used_bytes", &[]),
        a.metric("pegaflow_rdma_queue_pairs", &[]),
        b.metric("pegaflow_rdma_queue_pairs", &[])
    );
    // Descriptors: at most what they had (the broken connection's socket and memory
    // descriptor closed; a fresh one may be open to replace it).
    let (na, nb) = (fds_settle(a.pid(), fa).await, fds_settle(b.pid(), fb).await);
    println!("{tag}: descriptors source {fa} -> {na}, requester {fb} -> {nb}; failures {failures}");
    assert!(
        na <= fa + 2 && nb <= fb + 2,
        "{tag}: descriptors leak: source {fa} -> {na}, requester {fb} -> {nb}"
    );
    // Both keep serving: local hits on each.
    let mine = settle(&mut wb, &local, "local-b", Duration::from_secs(5)).await;
    assert_eq!(mine.hits, 4, "{tag}: the requester serves its own blocks");
    load_exact(&mut wb, &mine.lease, 50, &local).await;
    let theirs = settle(&mut wa, &hs, "local-a", Duration::from_secs(5)).await;
    assert_eq!(theirs.hits, 16, "{tag}: the source serves its own blocks");
    load_exact(&mut wa, &theirs.lease, 20, &hs).await;
    if late {
        // The late completion was one READ: once the source is no longer suspect, the
        // next fetch lands.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let s = settle_all(&mut wb, &hs, 16, Duration::from_secs(10)).await;
        load_exact(&mut wb, &s.lease, 0, &hs).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_error_leaves_both_serving_with_nothing_leaked() {
    let Some(env) = env("a_completion_error_leaves_both_serving_with_nothing_leaked") else {
        return;
    };
    fault_case(
        &env,
        "emu-cqe",
        "",
        "fault_completion_error_after = 3",
        "",
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_mismatch_leaves_both_serving_with_nothing_leaked() {
    let Some(env) = env("a_key_mismatch_leaves_both_serving_with_nothing_leaked") else {
        return;
    };
    fault_case(&env, "emu-rkey", "fault_wrong_rkey = true", "", "", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_completion_after_the_deadline_leaves_both_serving_with_nothing_leaked() {
    let Some(env) =
        env("a_late_completion_after_the_deadline_leaves_both_serving_with_nothing_leaked")
    else {
        return;
    };
    fault_case(
        &env,
        "emu-late",
        "",
        "fault_late_after = 2\nfault_late_completion_ms = 1500",
        "fetch_timeout_ms = 400",
        true,
    )
    .await;
}

/// Two nodes fetch from each other at the same moment: two handshakes cross, both
/// fetches land byte-exact, neither process panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_mutual_fetches_both_land() {
    let Some(env) = env("rdma_emu_simultaneous_mutual_fetches_both_land") else {
        return;
    };
    let o = env.opts("emu-mutual", "", "");
    let mut a = Node::start(&env.bin, "a", &o);
    let mut b = Node::start(&env.bin, "b", &o);
    let mut wa = worker(&a, "inst-a", SMALL).await;
    let mut wb = worker(&b, "inst-b", SMALL).await;
    let ha = hashes("emu-mutual-a", 8);
    let hb = hashes("emu-mutual-b", 8);
    save(&mut wa, 0, &ha).await;
    save(&mut wb, 0, &hb).await;
    wait_listed(&env, "emu-mutual", &a, &ha).await;
    wait_listed(&env, "emu-mutual", &b, &hb).await;
    let (sa, sb) = tokio::join!(
        settle_all(&mut wa, &hb, 8, Duration::from_secs(15)),
        settle_all(&mut wb, &ha, 8, Duration::from_secs(15))
    );
    load_exact(&mut wa, &sa.lease, 20, &hb).await;
    load_exact(&mut wb, &sb.lease, 20, &ha).await;
    assert!(a.alive() && b.alive(), "neither panicked");
}

/// Throughput of one fetch of 512 MiB (256 blocks of 2 MiB) over the emulator between two
/// processes, by hand: `cargo build --release --bin pegaflow-server`, then
/// `PEGAFLOW_SERVER_BIN=target/release/pegaflow-server cargo test -p pegaflow-tests --test
/// peer_rdma_emu -- --ignored --nocapture rdma_emu_fetch_throughput`. Prints GB/s
/// (docs/benchmarks/log/peer.md §12); asserts only that the bytes are exact. An emulator figure: the
/// copies are `pread`s of the holder's memory on this machine, not a NIC's DMA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand with the release server"]
async fn rdma_emu_fetch_throughput() {
    const SHAPE: KvShape = KvShape {
        layers: 4,
        num_blocks: 256,
        segment_bytes: 256 << 10,
    };
    let Some(env) = env("rdma_emu_fetch_throughput") else {
        return;
    };
    let mut o = env.opts("emu-throughput", "max_wr_bytes = 1048576", "");
    o.pool_bytes = 640 << 20;
    o.promote_deadline_ms = 30_000;
    let a = Node::start(&env.bin, "source", &o);
    for (nics, qps) in [(1usize, 1usize), (1, 2), (2, 2)] {
        let names: Vec<String> = (0..nics).map(|i| format!("\"emu{i}\"")).collect();
        let ob = env.opts(
            "emu-throughput",
            &format!(
                "nics = [{}]\nqps_per_peer = {qps}\nfetch_timeout_ms = 20000\nmax_wr_bytes = 1048576",
                names.join(", ")
            ),
            "",
        );
        let ob = NodeOpts {
            pool_bytes: 640 << 20,
            promote_deadline_ms: 30_000,
            ..ob
        };
        let b = Node::start(&env.bin, "requester", &ob);
        let tag = format!("emu-throughput-{nics}-{qps}");
        let mut wa = worker(&a, &format!("inst-a-{tag}"), SHAPE).await;
        let mut wb = worker(&b, "inst-b", SHAPE).await;
        let hs = hashes(&tag, 256);
        save(&mut wa, 0, &hs).await;
        wait_listed(&env, "emu-throughput", &a, &hs).await;
        let s = settle(&mut wb, &hs, "throughput", Duration::from_secs(30)).await;
        assert_eq!(s.hits, 256);
        let bytes = 256.0 * (SHAPE.layers * 2 * SHAPE.segment_bytes) as f64;
        let fetch = b.metric("pegaflow_peer_fetch_duration_seconds_sum", &[]);
        println!(
            "rdma-emu nics = {nics}, qps_per_peer = {qps}: 512 MiB in {:?} from the first query to Ready ({:.2} GB/s); fetch itself {:.3} s ({:.2} GB/s); {} READs",
            s.took,
            bytes / s.took.as_secs_f64() / 1e9,
            fetch,
            bytes / fetch / 1e9,
            b.metric("pegaflow_rdma_wrs_posted_total", &[])
        );
        load_exact(&mut wb, &s.lease, 0, &hs).await;
    }
}
