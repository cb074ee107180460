//! The server's directory client (`[directory]`, the publisher of `pegaflow_runtime::cluster`)
//! against an in-process directory that can be taken down, and can lose its state, at will:
//! what DRAM holds is advertised and nothing else (an evicted block is withdrawn); a directory
//! that is down delays but loses nothing; one that lost its state is refilled by a backfill;
//! a pending queue too small for the removals forces a resync instead of leaving stale
//! entries; entries lost behind the server's back come back with the periodic refresh;
//! shutdown unregisters the node.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{
    directory_factory, ConfigSchema, Directory, DirectoryError, DirectoryFactory, HeartbeatAnswer,
    InsertAnswer, NodeId, NodePrefix, RuntimeContext,
};
use pegaflow_runtime::cluster::DirectoryConfig;
use pegaflow_tests::harness::*;
// Link the directory backends (the in-memory one is the inner store here).
use pegaflow_directory as _;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 64,
    segment_bytes: 4096,
};
const BLOCK: u64 = (SHAPE.layers * 2 * SHAPE.segment_bytes) as u64;
const NS: &str = "publisher";
const NODE: &str = "10.20.30.40:50055";

/// A directory whose store can be swapped for an empty one (a restart) and that can answer
/// `Unavailable` to everything (down).
struct Flaky {
    inner: Mutex<Arc<dyn Directory>>,
    down: AtomicBool,
    unregisters: AtomicU64,
}

impl Flaky {
    fn fresh_inner() -> Arc<dyn Directory> {
        let mut t = toml::Table::new();
        t.insert("stale_after_secs".into(), toml::Value::Integer(2));
        (directory_factory("memory")
            .expect("memory directory linked")
            .build)(&t, &RuntimeContext::default())
        .expect("memory directory")
    }
    fn inner(&self) -> Result<Arc<dyn Directory>, DirectoryError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(DirectoryError::Unavailable("taken down by the test".into()));
        }
        Ok(self.inner.lock().clone())
    }
    fn restart(&self) {
        *self.inner.lock() = Self::fresh_inner();
    }
}

#[async_trait]
impl Directory for Flaky {
    fn kind(&self) -> &'static str {
        "test-flaky"
    }
    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        self.inner()?.heartbeat(node).await
    }
    async fn insert(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        self.inner()?.insert(node, namespace, hashes).await
    }
    async fn remove(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        self.inner()?.remove(node, namespace, hashes).await
    }
    async fn query_prefix(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        self.inner()?.query_prefix(namespace, hashes, exclude).await
    }
    async fn unregister(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        self.unregisters.fetch_add(1, Ordering::SeqCst);
        self.inner()?.unregister(node).await
    }
    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        self.inner()?.resync(node).await
    }
}

fn flaky() -> &'static Arc<Flaky> {
    static F: OnceLock<Arc<Flaky>> = OnceLock::new();
    F.get_or_init(|| {
        Arc::new(Flaky {
            inner: Mutex::new(Flaky::fresh_inner()),
            down: AtomicBool::new(false),
            unregisters: AtomicU64::new(0),
        })
    })
}

inventory::submit! {
    DirectoryFactory {
        kind: "test-flaky",
        summary: "the publisher test's directory (shared, can be taken down)",
        config: ConfigSchema::NONE,
        flags: &[],
        build: |_, _| Ok(flaky().clone() as Arc<dyn Directory>),
    }
}

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| hash_of(tag, i)).collect()
}

async fn save(w: &mut Worker, hs: &[Vec<u8>]) {
    for (c, chunk) in hs.chunks(8).enumerate() {
        let ids: Vec<u32> = (0..chunk.len())
            .map(|j| ((c * 8 + j) % SHAPE.num_blocks) as u32)
            .collect();
        for (&b, h) in ids.iter().zip(chunk) {
            w.kv.fill(b as usize, h);
        }
        w.save(&ids, chunk).await.expect("save");
    }
}

/// Whether the directory (read directly, not through the server) lists this node for `h`.
async fn listed(h: &[u8]) -> bool {
    let d = flaky().inner.lock().clone();
    d.query_prefix(NS, &[h.to_vec()], None)
        .await
        .expect("query")
        .iter()
        .any(|p| p.node == NODE)
}

fn resident(srv: &TestServer, h: &[u8]) -> bool {
    srv.handle
        .engine
        .store()
        .contains(pegaflow_plugin::block::KeyRef {
            namespace: NS,
            group: 0,
            hash: h,
        })
}

/// Waits (≤ `secs`) until the directory lists the node for exactly the resident ones of `hs`,
/// and at least `min_listed` of them.
async fn listed_iff_resident(srv: &TestServer, hs: &[Vec<u8>], min_listed: usize, secs: u64) {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        let mut ok = true;
        let mut n = 0;
        for h in hs {
            let l = listed(h).await;
            n += l as usize;
            if l != resident(srv, h) {
                ok = false;
                break;
            }
        }
        if ok && n >= min_listed {
            return;
        }
        assert!(
            Instant::now() < end,
            "after {secs} s the directory still differs from DRAM ({n} listed so far)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn metric(srv: &TestServer, name: &str) -> u64 {
    let text = srv.handle.engine.metrics().render();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_lists_what_dram_holds_through_outages_restarts_and_overflow() {
    let srv = TestServer::start_with(
        ServerOptions {
            capacity_bytes: 16 * BLOCK,
            ..Default::default()
        },
        |p| {
            let mut d = DirectoryConfig::of_kind("test-flaky");
            d.advertise_addr = Some(NODE.into());
            d.call_timeout_ms = 500;
            d.queue_depth = 4;
            d.refresh_secs = 2;
            p.directory = Some(d);
        },
    )
    .await;
    let mut w = Worker::register(&srv, "inst", NS, SHAPE, 0, 1, 0).await;

    // Saved blocks are advertised; an evicted one is withdrawn.
    let first = hashes("first", 8);
    save(&mut w, &first).await;
    listed_iff_resident(&srv, &first, 8, 10).await;
    let more = hashes("more", 24);
    save(&mut w, &more).await;
    let all: Vec<Vec<u8>> = first.iter().chain(&more).cloned().collect();
    listed_iff_resident(&srv, &all, 8, 10).await;
    assert!(
        all.iter().any(|h| !resident(&srv, h)),
        "the test must evict something"
    );

    // Down: the server queries "local only" at once; saves go on; back up, the directory
    // catches up (the 4-hash queue overflowed with removals: a resync, not stale entries).
    flaky().down.store(true, Ordering::SeqCst);
    let during = hashes("during", 24);
    save(&mut w, &during).await;
    let dir = srv.handle.directory.as_ref().expect("directory client");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!dir.is_up(), "a failed heartbeat marks the directory down");
    assert!(dir.query_prefix(NS, 0, &during).await.is_empty());
    flaky().down.store(false, Ordering::SeqCst);
    let all: Vec<Vec<u8>> = all.iter().chain(&during).cloned().collect();
    listed_iff_resident(&srv, &all, 8, 15).await;
    assert!(
        metric(&srv, "pegaflow_metaserver_removal_queue_full_total") > 0,
        "removals overflowed the 4-hash queue"
    );
    assert!(
        metric(
            &srv,
            "pegaflow_directory_resyncs_total{reason=\"removals_dropped\"}"
        ) > 0
    );

    // The directory restarts empty: the next heartbeat finds the state lost and a backfill
    // lists DRAM again.
    flaky().restart();
    listed_iff_resident(&srv, &all, 8, 15).await;
    assert!(metric(&srv, "pegaflow_metaserver_session_resets_total") > 0);
    assert!(metric(&srv, "pegaflow_directory_backfill_blocks_total") > 0);

    // Entries dropped behind the server's back (as a backend's expiry would): the periodic
    // refresh inserts them again.
    let node = dir.node().clone();
    let inner = flaky().inner.lock().clone();
    inner
        .resync(&node)
        .await
        .expect("forget the node's entries");
    listed_iff_resident(&srv, &all, 8, 10).await;
    assert!(metric(&srv, "pegaflow_directory_resyncs_total{reason=\"refresh\"}") > 0);

    // Shutdown leaves the directory.
    srv.shutdown().await;
    assert!(flaky().unregisters.load(Ordering::SeqCst) >= 1);
    for h in &all {
        assert!(!listed(h).await, "nothing stays listed after shutdown");
    }
}
