//! End-to-end: a replay of the first part of the shipped trace through a real in-process
//! server (gRPC, side channel, host memfd, memcpy transport), with tiny blocks and a small
//! DRAM tier so that eviction runs constantly. Every loaded byte is checked and, with one
//! client, every request's hit count must equal the exact LRU simulation's.

use pegaflow_bench::model::{BlockGeometry, ModelPreset};
use pegaflow_bench::replay::{self, ReplayOptions};
use pegaflow_bench::server::InProcessServer;
use pegaflow_bench::trace;

/// 4 layers x 2 x 1 head x 64 dim x 2 B x 4 tokens: 512 B segments, 4 KiB blocks.
const TINY: ModelPreset = ModelPreset {
    name: "tiny-test",
    layers: 4,
    kv_heads: 1,
    head_dim: 64,
    dtype_bytes: 2,
};

fn options(capacity: u64) -> ReplayOptions {
    ReplayOptions {
        trace_path: trace::default_path().unwrap(),
        geometry: BlockGeometry::new(TINY, 128).unwrap(),
        capacity,
        clients: 1,
        speedup: None,
        gpu_blocks: 256,
        release_every: 7,
        namespace: "replay-test".into(),
        endpoint: None,
        metrics_addr: None,
        progress: false,
        evict_ahead_percent: 0,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn head(n: usize) -> Vec<trace::TraceRequest> {
    let mut t = trace::load(&trace::default_path().unwrap()).unwrap();
    t.truncate(n);
    t
}

#[test]
fn sequential_replay_matches_the_lru_simulation_exactly() {
    let rt = runtime();
    let t = head(1500);
    // 300 blocks of 4 KiB plus a little (rounded down to the 512-byte granule).
    let o = options(300 * 4096 + 700);
    let r = replay::run(&rt, &t, &o).unwrap();
    assert_eq!(r.requests, 1500);
    assert_eq!(r.capacity_bytes, 300 * 4096 + 512);
    assert!(
        r.server.evictions.unwrap() > 10_000,
        "eviction must be exercised"
    );
    assert!(r.server.hit_blocks > 0 && r.server.loaded_blocks > 0);
    assert!(
        r.server.released_leases > 0,
        "the Release path must be exercised"
    );
    assert!(r.server.block_hit_rate < r.infinite_cache.block_hit_rate);
    assert_eq!(r.lru_check.holds, Some(true), "{}", r.table());
    // Each with the whole report, and the Saves refused first: a count that differs says
    // which request's Save the server refused where the simulation did not (or the reverse).
    let why = || {
        format!(
            "{}\nsaves refused: server {} (first: {:?}), simulation {}",
            r.table(),
            r.server.save_rejected,
            r.server.first_save_rejection,
            r.simulation.rejected_saves
        )
    };
    assert_eq!(r.server.hit_blocks, r.simulation.hit_blocks, "{}", why());
    assert_eq!(
        r.server.save_rejected,
        r.simulation.rejected_saves,
        "{}",
        why()
    );
    assert_eq!(
        r.server.evictions,
        Some(r.simulation.evictions),
        "{}",
        why()
    );
    assert_eq!(
        r.server.inserted_blocks,
        Some(r.simulation.inserted_blocks),
        "{}",
        why()
    );
    assert!(r.verification.ok);
    assert_eq!(r.verification.bytes, r.server.loaded_blocks * 4096);
    assert_eq!(r.latency.query.count, 1500);
    assert!(r.passed());
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["lru_check"]["holds"], true);
    assert!(r.table().contains("HOLDS"));
}

#[test]
fn concurrent_clients_replay_byte_exact() {
    let rt = runtime();
    let t = head(600);
    let mut o = options(200 * 4096);
    o.clients = 3;
    let r = replay::run(&rt, &t, &o).unwrap();
    assert_eq!(r.requests, 600);
    assert!(r.server.loaded_blocks > 0);
    assert!(r.verification.ok);
    assert_eq!(
        r.lru_check.holds, None,
        "not checked with concurrent clients"
    );
    assert!(r.passed());
}

#[test]
fn endpoint_mode_reads_the_socket_from_health() {
    let rt = runtime();
    // Evict-ahead off, as the LRU check asks of a server at --endpoint.
    let server = rt
        .block_on(InProcessServer::start_with(400 * 4096, Some(0)))
        .unwrap();
    let t = head(300);
    let mut o = options(400 * 4096);
    o.endpoint = Some(server.endpoint());
    let r = replay::run(&rt, &t, &o).unwrap();
    assert_eq!(r.mode, "endpoint");
    assert_eq!(r.lru_check.holds, Some(true), "{}", r.table());
    assert_eq!(r.server.evictions, None, "no metrics address given");
    rt.block_on(server.shutdown());
}

#[test]
fn time_scaled_replay_paces_requests() {
    let rt = runtime();
    // The first 40 requests span a few seconds of trace time; at 20x they take a fraction.
    let t = head(40);
    let span_ms = t.last().unwrap().timestamp - t[0].timestamp;
    let mut o = options(1 << 20);
    o.speedup = Some(20.0);
    let r = replay::run(&rt, &t, &o).unwrap();
    assert!(
        r.wall_seconds >= span_ms as f64 / 1e3 / 20.0 * 0.9,
        "{} s for a {span_ms} ms span",
        r.wall_seconds
    );
    assert_eq!(r.lru_check.holds, Some(true));
}

/// With evict-ahead on (the server's default), eviction runs on its own thread while the
/// replay saves and loads through gRPC: every loaded byte stays exact, and the Saves find
/// their memory free instead of evicting for themselves.
#[test]
fn replay_with_evict_ahead_on_loads_every_byte_exact() {
    let rt = runtime();
    let server = rt
        .block_on(InProcessServer::start_with(300 * 4096 + 512, Some(10)))
        .unwrap();
    let t = head(1500);
    let mut o = options(300 * 4096 + 512);
    o.endpoint = Some(server.endpoint());
    let r = replay::run(&rt, &t, &o).unwrap();
    assert!(r.verification.ok, "{}", r.table());
    assert!(r.server.hit_blocks > 0 && r.server.loaded_blocks > 0);
    let m = server.engine().metrics();
    assert!(
        m.cache_evictions_ahead.get() > 1_000,
        "evict-ahead ran: {}",
        m.cache_evictions_ahead.get()
    );
    assert!(
        m.cache_evictions_ahead.get() > m.cache_evictions_inline.get(),
        "ahead {} inline {}",
        m.cache_evictions_ahead.get(),
        m.cache_evictions_inline.get()
    );
    rt.block_on(server.shutdown());
}

/// `--evict-ahead-percent` on the in-process server: the replay still checks every byte, and
/// reports its hit count next to the simulation's instead of failing on the difference
/// (evict-ahead frees blocks before the simulation would).
#[test]
fn in_process_evict_ahead_is_reported_not_checked() {
    let rt = runtime();
    let t = head(600);
    let mut o = options(200 * 4096);
    o.evict_ahead_percent = 10;
    let r = replay::run(&rt, &t, &o).unwrap();
    assert!(r.verification.ok, "{}", r.table());
    assert!(r.server.loaded_blocks > 0);
    assert_eq!(r.lru_check.holds, None, "{}", r.table());
    assert!(
        r.lru_check
            .notes
            .iter()
            .any(|n| n.contains("evict-ahead at 10 %")),
        "{:?}",
        r.lru_check.notes
    );
    assert!(r.passed());
}
