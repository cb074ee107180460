//! End-to-end through the SSD tier (kind `ssd`) below a small host DRAM tier, over real gRPC
//! and the host-memfd side channel: blocks saved past DRAM's capacity are demoted to the SSD,
//! a query of the evicted prefix is answered `Loading` while they are promoted back, then
//! `Ready` with every hit, and a load into poisoned blocks is byte-exact. Covered for three
//! KV layouts (contiguous `segments: 1`, split K/V `segments: 2`, page-first) and across a
//! server restart on the same SSD directory.

use std::path::Path;
use std::time::{Duration, Instant};

use pegaflow_api::client::QueryOutcome;
use pegaflow_api::load_state::LOAD_SUCCESS;
use pegaflow_plugin::block::{BlockKey, BlockShape};
use pegaflow_runtime::config::PluginConfig;
use pegaflow_tests::harness::*;
// Link the SSD tier so its factory registers.
use pegaflow_tier_ssd as _;

/// 4 layers x 2 segments x 4 KiB: one block is 32 KiB over all layers.
const SHAPE: KvShape = KvShape {
    layers: 4,
    num_blocks: 64,
    segment_bytes: 4096,
};
/// Bytes of one block over all layers (also one page-first page).
const BLOCK: u64 = (SHAPE.layers * 2 * SHAPE.segment_bytes) as u64;
/// DRAM holds this many blocks.
const DRAM_BLOCKS: usize = 32;
/// Blocks saved: four times what DRAM holds.
const SAVED: usize = 4 * DRAM_BLOCKS;
/// Blocks per Save.
const BATCH: usize = 4;
/// The evicted prefix read back from the SSD (fits DRAM next to what stays pinned).
const PREFIX: usize = 16;
/// Where the prefix is loaded to (disjoint from 0..PREFIX).
const TARGET0: usize = 40;

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| hash_of(tag, i)).collect()
}

fn ssd_tier(path: &Path) -> PluginConfig {
    let mut settings = toml::Table::new();
    settings.insert(
        "paths".into(),
        toml::Value::Array(vec![toml::Value::String(path.display().to_string())]),
    );
    settings.insert("capacity".into(), toml::Value::String("64mb".into()));
    settings.insert("admission".into(), toml::Value::String("always".into()));
    settings.insert("reserve".into(), toml::Value::Integer(0));
    PluginConfig {
        kind: "ssd".into(),
        layers: vec![],
        settings,
    }
}

/// A server with `DRAM_BLOCKS` blocks of DRAM over an SSD tier in `ssd_dir`.
async fn try_start(ssd_dir: &Path) -> anyhow::Result<TestServer> {
    TestServer::try_start_with(
        ServerOptions {
            capacity_bytes: DRAM_BLOCKS as u64 * BLOCK,
            ..Default::default()
        },
        |p| p.tiers.push(ssd_tier(ssd_dir)),
    )
    .await
}

async fn start(ssd_dir: &Path) -> TestServer {
    match try_start(ssd_dir).await {
        Ok(s) => s,
        Err(e) => panic!("server with an SSD tier starts: {e:#}"),
    }
}

/// Registers one worker (TP 1) whose cache is laid out as `arrangement`, page-first or not.
async fn register(
    srv: &TestServer,
    id: &str,
    ns: &str,
    arrangement: KvArrangement,
    page_first: bool,
) -> Worker {
    let kv = KvCache::with_arrangement(SHAPE, arrangement);
    let mut reg = kv.registration(id, ns, 0, 1, 0);
    reg.page_first = page_first;
    Worker::register_cache(srv, kv, reg)
        .await
        .expect("register")
}

/// Waits (≤ 10 s) until no evicted block waits for its SSD write and write-behind has caught
/// up (unwritten blocks at most 75 % of DRAM, its threshold); panics otherwise. Saving faster
/// than the device writes makes the demotion queue shed its oldest blocks by design
/// (docs/TIERS.md §2); these tests model a device that keeps up, so that every evicted block
/// must reach the SSD.
async fn demotions_idle(srv: &TestServer) {
    let m = srv.handle.engine.metrics();
    let idx = srv.handle.engine.index();
    let threshold = DRAM_BLOCKS as u64 * BLOCK / 100 * 75;
    let end = Instant::now() + Duration::from_secs(10);
    while m.tier_demotion_queue_blocks.get() != 0 || idx.unwritten_bytes() > threshold {
        assert!(
            Instant::now() < end,
            "demotion queue still holds {} blocks ({} bytes unwritten) after 10 s",
            m.tier_demotion_queue_blocks.get(),
            idx.unwritten_bytes()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Saves `hs` (block `i` from device block `i % num_blocks`) in batches of `BATCH`, letting
/// each batch's demotions finish before the next. A full demotion queue sheds its oldest
/// blocks by design; here it is empty before every save, and a save needs room for `BATCH`
/// blocks, half of the queue's bound (a quarter of DRAM: 8 blocks), so no evicted block
/// should be dropped on its way to the SSD.
async fn save_all(srv: &TestServer, w: &mut Worker, hs: &[Vec<u8>]) {
    for (c, chunk) in hs.chunks(BATCH).enumerate() {
        let ids: Vec<u32> = (0..chunk.len())
            .map(|j| ((c * BATCH + j) % SHAPE.num_blocks) as u32)
            .collect();
        for (&b, h) in ids.iter().zip(chunk) {
            w.kv.fill(b as usize, h);
        }
        w.save(&ids, chunk).await.expect("save");
        demotions_idle(srv).await;
    }
}

/// The SSD tier's own lookup of each of `hs` (block by block): the record's slot layout, or
/// `None` where it holds no such block.
async fn ssd_lookup(srv: &TestServer, ns: &str, hs: &[Vec<u8>]) -> Vec<Option<BlockShape>> {
    let tiers = srv.handle.engine.store().lower_tiers();
    assert_eq!(tiers.len(), 1, "one tier below DRAM");
    assert_eq!(tiers[0].kind(), "ssd");
    let mut found = Vec::new();
    for h in hs {
        let key = BlockKey {
            namespace: ns.into(),
            group: 0,
            hash: h.clone().into(),
        };
        found.push(tiers[0].lookup(&[key]).await.expect("ssd lookup").pop());
    }
    found
}

/// The server's SSD and demotion metrics (for failure messages).
async fn tier_metrics(srv: &TestServer) -> String {
    let (_, body) = http(srv.handle.http_addr, "GET", "/metrics").await;
    body.lines()
        .filter(|l| {
            (l.starts_with("pegaflow_ssd_") || l.starts_with("pegaflow_tier_"))
                && !l.contains("_bucket")
                && !l.ends_with(" 0")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Asserts the SSD tier holds every block of `hs`, each stored with the slot layout `shape`.
async fn assert_on_ssd(srv: &TestServer, ns: &str, hs: &[Vec<u8>], shape: &BlockShape, what: &str) {
    let found = ssd_lookup(srv, ns, hs).await;
    let missing: Vec<usize> = (0..hs.len()).filter(|&i| found[i].is_none()).collect();
    if !missing.is_empty() {
        panic!(
            "{what}: the SSD tier lacks blocks {missing:?} of the first {}; metrics:\n{}",
            hs.len(),
            tier_metrics(srv).await
        );
    }
    for (i, f) in found.iter().enumerate() {
        assert_eq!(
            f.as_ref(),
            Some(shape),
            "{what}: slot layout of block {i} on the SSD"
        );
    }
}

/// The slot layout a block of this test has in host DRAM and on the SSD: one slot of every
/// layer's K and V (8 KiB each), or with page-first one page of all layers (32 KiB).
fn block_shape(page_first: bool) -> BlockShape {
    if page_first {
        BlockShape::new(vec![BLOCK])
    } else {
        BlockShape::new(vec![BLOCK / SHAPE.layers as u64; SHAPE.layers])
    }
}

/// Polls a query with one req_id and the same hashes until Ready (≤ 15 s): the number of
/// Loading answers seen first, the hit count and the lease.
async fn poll_ready(w: &mut Worker, hs: &[Vec<u8>], req_id: &str) -> (usize, u64, Vec<u8>) {
    let end = Instant::now() + Duration::from_secs(15);
    let mut loading = 0usize;
    loop {
        let q = w
            .client
            .query(&w.instance_id, hs.to_vec(), req_id)
            .await
            .expect("query");
        match q {
            QueryOutcome::Loading => loading += 1,
            QueryOutcome::Ready {
                num_hit_blocks,
                lease,
                ..
            } => return (loading, num_hit_blocks, lease),
        }
        assert!(
            Instant::now() < end,
            "query {req_id} still Loading after {loading} polls"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Reads the evicted prefix `hs` back through Loading → Ready and loads it into poisoned
/// blocks `TARGET0..`: every byte must be exact and nothing else written.
async fn read_back_prefix(w: &mut Worker, hs: &[Vec<u8>], req_id: &str, what: &str) {
    let (loading, n, lease) = poll_ready(w, hs, req_id).await;
    assert!(
        loading >= 1,
        "{what}: the evicted prefix was answered Ready at once ({n} hits): it did not come from the SSD"
    );
    assert_eq!(
        n,
        hs.len() as u64,
        "{what}: hits after {loading} Loading answers"
    );
    assert_eq!(lease.len(), 16, "{what}: lease");
    for b in 0..SHAPE.num_blocks {
        w.kv.poison(b, 0xA5);
    }
    let targets: Vec<u32> = (0..hs.len()).map(|i| (TARGET0 + i) as u32).collect();
    assert_eq!(
        w.load(&lease, &targets).await.expect("load"),
        LOAD_SUCCESS,
        "{what}: load state"
    );
    for (i, h) in hs.iter().enumerate() {
        assert!(
            w.kv.holds(TARGET0 + i, h),
            "{what}: block {i} loaded into {} is not byte-exact",
            TARGET0 + i
        );
    }
    for b in (0..SHAPE.num_blocks).filter(|b| !(TARGET0..TARGET0 + hs.len()).contains(b)) {
        assert!(
            w.kv.is_filled_with(b, 0xA5),
            "{what}: block {b} was not a target but changed"
        );
    }
}

/// Saves 4x DRAM's capacity, checks the oldest blocks left DRAM for the SSD and the newest
/// stayed in DRAM, then reads the evicted prefix back byte-exact.
async fn roundtrip(arrangement: KvArrangement, page_first: bool, tag: &str) {
    let ssd = tempfile::tempdir().expect("ssd dir");
    let srv = start(ssd.path()).await;
    let ns = format!("ns-{tag}");
    let mut w = register(&srv, tag, &ns, arrangement, page_first).await;
    let hs = hashes(tag, SAVED);
    save_all(&srv, &mut w, &hs).await;
    let resident = srv.handle.engine.index().resident_blocks();
    assert!(
        resident <= DRAM_BLOCKS as u64,
        "{tag}: {resident} blocks resident in a DRAM of {DRAM_BLOCKS}"
    );
    assert_on_ssd(&srv, &ns, &hs[..PREFIX], &block_shape(page_first), tag).await;
    // The newest blocks are still in DRAM: Ready at once, no promotion.
    let tail = hs[SAVED - BATCH..].to_vec();
    let q = w
        .client
        .query(tag, tail.clone(), &format!("{tag}-tail"))
        .await
        .expect("query tail");
    let (n, lease) = ready(q);
    assert_eq!(n, BATCH as u64, "{tag}: the newest blocks hit in DRAM");
    w.client.release(&lease).await.expect("release");
    read_back_prefix(&mut w, &hs[..PREFIX], &format!("{tag}-prefix"), tag).await;
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_layout_round_trips_through_the_ssd() {
    roundtrip(KvArrangement::Contiguous, false, "contig").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_kv_layout_round_trips_through_the_ssd() {
    roundtrip(KvArrangement::Split, false, "split").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_first_layout_round_trips_through_the_ssd() {
    roundtrip(KvArrangement::Split, true, "pagefirst").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_blocks_survive_a_restart_on_the_same_ssd_directory() {
    let ssd = tempfile::tempdir().expect("ssd dir");
    let tag = "restart";
    let ns = "ns-restart";
    let hs = hashes(tag, SAVED);
    {
        let srv = start(ssd.path()).await;
        let mut w = register(&srv, tag, ns, KvArrangement::Split, false).await;
        save_all(&srv, &mut w, &hs).await;
        assert_on_ssd(
            &srv,
            ns,
            &hs[..PREFIX],
            &block_shape(false),
            "before the restart",
        )
        .await;
        drop(w);
        srv.shutdown().await;
    }
    // A new server on the same SSD directory (a fresh socket dir), DRAM empty.
    let srv = start(ssd.path()).await;
    assert_eq!(srv.handle.engine.index().resident_blocks(), 0);
    let mut w = register(&srv, tag, ns, KvArrangement::Split, false).await;
    assert_on_ssd(
        &srv,
        ns,
        &hs[..PREFIX],
        &block_shape(false),
        "after the restart",
    )
    .await;
    read_back_prefix(&mut w, &hs[..PREFIX], "after-restart", "restart").await;
    srv.shutdown().await;
}
