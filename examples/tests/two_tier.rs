//! The tier stack end to end over real gRPC and a real side channel: a two-tier pipeline
//! (`dram` over the third-party `heap-store`) demotes under pressure and promotes on query —
//! QueryPrefetch answers Loading, then Ready, and the loaded bytes are exact; re-polls start
//! no new I/O; a cold query answers Ready(0) at once; a promotion past its deadline answers
//! Ready with what is resident; a tier whose reads fail falls through to the next tier in the
//! same task.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pegaflow_api::client::QueryOutcome;
use pegaflow_api::load_state::LOAD_SUCCESS;
use pegaflow_examples::heap_store::{HeapStore, HeapStoreConfig};
use pegaflow_plugin::block::{BlockKey, BlockShape};
use pegaflow_plugin::{
    BuiltTier, ConfigSchema, Recovered, RuntimeContext, Tier, TierCapabilities, TierError,
    TierFactory, TierGet, TierPut,
};
use pegaflow_runtime::config::PipelineConfig;
use pegaflow_tests::harness::*;

use pegaflow_examples as _;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 64,
    segment_bytes: 512,
};
/// Host bytes of one block (2 layers × K and V × 512 bytes).
const BLOCK: u64 = 2048;

async fn start(pipeline_extra: &str, dram_blocks: u64, lower: &str) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fd.sock");
    let text = format!(
        r#"
[server]
addr = "127.0.0.1:0"
http_addr = "127.0.0.1:0"

[fd_channel]
path = "{}"

{pipeline_extra}

[[tier]]
kind = "dram"
capacity = {}

{lower}

[[registrar]]
kind = "host-memfd"

[[transport]]
kind = "memcpy"
"#,
        socket.display(),
        dram_blocks * BLOCK
    );
    let p = PipelineConfig::from_toml(&text).expect("pipeline");
    let handle = pegaflow_runtime::start(p).await.expect("server starts");
    TestServer::from_handle(handle, socket, dir)
}

/// Saves `n` blocks tagged `tag` from device blocks `first..first+n`.
async fn save_tagged(w: &mut Worker, tag: &str, first: usize, n: usize) -> Vec<Vec<u8>> {
    let hs: Vec<Vec<u8>> = (0..n).map(|i| hash_of(tag, i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(first + i, h);
    }
    let ids: Vec<u32> = (first..first + n).map(|b| b as u32).collect();
    w.save(&ids, &hs).await.unwrap();
    hs
}

/// Fills DRAM past its capacity so that the blocks saved first are evicted (and demoted),
/// letting write-behind catch up after each save (at most 5 s), as it does between the RPCs
/// of a real engine.
async fn push_out(srv: &TestServer, w: &mut Worker, dram_blocks: usize) {
    let threshold = dram_blocks as u64 * BLOCK * 3 / 4;
    for round in 0..(dram_blocks / 8 + 1) {
        save_tagged(w, &format!("filler-{round}"), 8, 8).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while srv.handle.engine.index().unwritten_bytes() > threshold && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn poll_ready(w: &mut Worker, inst: &str, hs: &[Vec<u8>], req: &str) -> (u64, Vec<u8>, u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut loading = 0;
    loop {
        match w.client.query(inst, hs.to_vec(), req).await.unwrap() {
            QueryOutcome::Loading => {
                loading += 1;
                assert!(Instant::now() < deadline, "still Loading after 10 s");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            QueryOutcome::Ready {
                num_hit_blocks,
                lease,
                ..
            } => return (num_hit_blocks, lease, loading),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demoted_blocks_are_promoted_on_query_with_exact_bytes() {
    let lower = "[[tier]]\nkind = \"heap-store\"\ncapacity = \"8mb\"\nlayers = [\"metrics\"]";
    let srv = start("", 32, lower).await;
    let mut events = srv.handle.engine.store().subscribe();
    let mut w = Worker::register(&srv, "tt", "ns", SHAPE, 0, 1, 0).await;
    let hs = save_tagged(&mut w, "first", 0, 8).await;
    push_out(&srv, &mut w, 32).await;
    srv.handle.engine.flush_tiers().await;
    let m = srv.handle.engine.metrics().render();
    assert!(
        metric(
            &m,
            "pegaflow_tier_demotions_total",
            &["outcome=\"written\""]
        ) >= 8.0,
        "{m}"
    );
    // None of the first blocks is in DRAM any more.
    for h in &hs {
        assert!(!srv
            .handle
            .engine
            .index()
            .contains(pegaflow_plugin::block::KeyRef {
                namespace: "ns",
                group: 0,
                hash: h,
            }));
    }
    // Poison the device copies, then query: Loading first, then Ready with all 8.
    for b in 0..8 {
        w.kv.poison(b, 0xEE);
    }
    let first = w.client.query("tt", hs.clone(), "req-1").await.unwrap();
    assert!(
        matches!(first, QueryOutcome::Loading),
        "{first:?} {}",
        srv.handle
            .engine
            .metrics()
            .render()
            .lines()
            .filter(|l| l.contains("tier_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let (n, lease, _) = poll_ready(&mut w, "tt", &hs, "req-1").await;
    assert_eq!(n, 8);
    assert_eq!(
        w.load(&lease, &(40..48).collect::<Vec<u32>>())
            .await
            .unwrap(),
        LOAD_SUCCESS
    );
    for (i, h) in hs.iter().enumerate() {
        assert!(w.kv.holds(40 + i, h), "block {i} loaded exactly");
    }
    // One get batch served the promotion, whatever the number of re-polls.
    let m = srv.handle.engine.metrics().render();
    assert_eq!(
        metric(
            &m,
            "pegaflow_tier_ops_total",
            &["op=\"get\"", "outcome=\"ok\""]
        ) as u64,
        8,
        "{m}"
    );
    assert!(metric(&m, "pegaflow_query_answers_total", &["outcome=\"loading\""]) >= 1.0);
    assert!(
        metric(
            &m,
            "pegaflow_tier_promotions_total",
            &["outcome=\"promoted\""]
        ) >= 8.0
    );
    // The promoted blocks are ordinary DRAM blocks now: a new query hits at once.
    let (n, lease) = ready(w.client.query("tt", hs.clone(), "req-2").await.unwrap());
    assert_eq!(n, 8);
    w.client.release(&lease).await.unwrap();
    // Index events told a subscriber what happened to the first block.
    use pegaflow_plugin::IndexEventKind as K;
    let mut seen = Vec::new();
    while let Ok(e) = events.try_recv() {
        if *e.key.hash == *hs[0] {
            seen.push(e.kind);
        }
    }
    for k in [K::Sealed, K::Demoted(0), K::Evicted, K::Promoted] {
        assert!(seen.contains(&k), "{k:?} missing from {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_query_is_ready_at_once_and_repolls_are_idempotent() {
    let lower = "[[tier]]\nkind = \"heap-store\"\ncapacity = \"8mb\"\nlayers = [\"metrics\"]";
    let srv = start("", 32, lower).await;
    let mut w = Worker::register(&srv, "cold", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..4).map(|i| hash_of("never-saved", i)).collect();
    for _ in 0..3 {
        let (n, lease) = ready(w.client.query("cold", hs.clone(), "r").await.unwrap());
        assert_eq!((n, lease.len()), (0, 0));
    }
    let m = srv.handle.engine.metrics().render();
    assert_eq!(
        metric(&m, "pegaflow_query_answers_total", &["outcome=\"loading\""]),
        0.0
    );
    assert_eq!(metric(&m, "pegaflow_tier_ops_total", &["op=\"get\""]), 0.0);
}

/// A store shared by the two test tiers of `falls_through_to_the_next_tier`: the first
/// fails every get, the second reads the same blocks.
fn shared_store() -> &'static Arc<HeapStore> {
    static S: OnceLock<Arc<HeapStore>> = OnceLock::new();
    S.get_or_init(|| Arc::new(HeapStore::new(HeapStoreConfig::default())))
}

/// A test tier over [`shared_store`]; with `fail_gets`, every get fails as unavailable, and
/// with `slow_get_ms`, every get waits first.
struct TestTier {
    fail_gets: bool,
    slow_get: Duration,
}

#[async_trait]
impl Tier for TestTier {
    fn kind(&self) -> &'static str {
        if self.fail_gets {
            "test-failing"
        } else {
            "test-shared"
        }
    }
    fn capabilities(&self) -> TierCapabilities {
        shared_store().capabilities()
    }
    fn capacity_bytes(&self) -> u64 {
        shared_store().capacity_bytes()
    }
    fn used_bytes(&self) -> u64 {
        shared_store().used_bytes()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        shared_store().lookup(keys).await
    }
    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        shared_store().put(blocks).await
    }
    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        tokio::time::sleep(self.slow_get).await;
        if self.fail_gets {
            return vec![Err(TierError::Unavailable("test: reads fail".into())); reads.len()];
        }
        shared_store().get(reads).await
    }
    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        shared_store().remove(keys).await
    }
    async fn flush(&self) -> Result<(), TierError> {
        shared_store().flush().await
    }
    async fn recover(&self) -> Result<Recovered, TierError> {
        Ok(Recovered::default())
    }
}

fn build_test_tier(t: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<BuiltTier> {
    let fail_gets = t
        .get("fail_gets")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let slow = t
        .get("slow_get_ms")
        .and_then(|v| v.as_integer())
        .unwrap_or(0);
    Ok(BuiltTier::Block(Arc::new(TestTier {
        fail_gets,
        slow_get: Duration::from_millis(slow as u64),
    })))
}

inventory::submit! {
    TierFactory {
        kind: "test-shared-store",
        summary: "test only: a tier over one shared heap store",
        config: ConfigSchema::NONE,
        flags: &[],
        default_landing: false,
        build: build_test_tier,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn falls_through_to_the_next_tier_and_times_out_to_what_is_resident() {
    let lower = "[[tier]]\nkind = \"test-shared-store\"\nfail_gets = true\n\n[[tier]]\nkind = \"test-shared-store\"";
    let srv = start("", 32, lower).await;
    let mut w = Worker::register(&srv, "ft", "ns", SHAPE, 0, 1, 0).await;
    let hs = save_tagged(&mut w, "ladder", 0, 8).await;
    push_out(&srv, &mut w, 32).await;
    srv.handle.engine.flush_tiers().await;
    for b in 0..8 {
        w.kv.poison(b, 0x11);
    }
    let (n, lease, loading) = poll_ready(&mut w, "ft", &hs, "ladder-req").await;
    assert!(loading >= 1, "the promotion was answered Loading first");
    assert_eq!(n, 8, "the second tier served what the first could not");
    assert_eq!(
        w.load(&lease, &(40..48).collect::<Vec<u32>>())
            .await
            .unwrap(),
        LOAD_SUCCESS
    );
    for (i, h) in hs.iter().enumerate() {
        assert!(w.kv.holds(40 + i, h));
    }
    let m = srv.handle.engine.metrics().render();
    assert!(
        metric(
            &m,
            "pegaflow_tier_promotions_total",
            &["tier=\"test-failing\"", "outcome=\"failed\""]
        ) >= 8.0,
        "{m}"
    );
    drop(srv);

    // A promotion slower than its deadline: Loading, then Ready with what is resident (none).
    let lower = "[[tier]]\nkind = \"test-shared-store\"\nslow_get_ms = 3000";
    let srv = start("[store]\npromote_deadline_ms = 200", 32, lower).await;
    let mut w = Worker::register(&srv, "slow", "ns", SHAPE, 0, 1, 0).await;
    let first = w
        .client
        .query("slow", hs.clone(), "slow-req")
        .await
        .unwrap();
    assert!(matches!(first, QueryOutcome::Loading), "{first:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (n, lease) = ready(
        w.client
            .query("slow", hs.clone(), "slow-req")
            .await
            .unwrap(),
    );
    assert_eq!(
        (n, lease.len()),
        (0, 0),
        "past the deadline: what DRAM holds"
    );
}
