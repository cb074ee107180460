//! End-to-end: three servers share one Redis-backed directory (a real `redis-server` on
//! loopback). Each advertises what its DRAM holds and sees the others' blocks in prefix
//! queries; an evicted block is withdrawn; a frozen or dead Redis never stalls a Save or a
//! QueryPrefetch, and queries answer "local only" meanwhile; after a FLUSHALL or a restart of
//! Redis every server re-advertises what it holds; a server that shuts down leaves the
//! directory. A `pegaflow-metaserver` over the same Redis answers the MetaServer's
//! `QueryPrefixBlocks` with every server's blocks. Skips (reported by `pegaflow_tests::skip!`) where
//! `redis-server` is not installed (and the MetaServer part where the binary is not built).

use std::future::Future;
use std::time::{Duration, Instant};

use pegaflow_plugin::NodePrefix;
use pegaflow_runtime::cluster::DirectoryConfig;
use pegaflow_runtime::store::TierStack;
use pegaflow_tests::harness::*;
use pegaflow_tests::redis::RedisServer;
// Link the directory backends so their factories register.
use pegaflow_directory as _;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 64,
    segment_bytes: 4096,
};
/// Bytes of one block over all layers.
const BLOCK: u64 = (SHAPE.layers * 2 * SHAPE.segment_bytes) as u64;
const NS: &str = "e2e-directory";

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| hash_of(tag, i)).collect()
}

/// A server whose `[directory]` is the Redis at `url` under `prefix`, stale after 2 s, with
/// room for `dram_blocks` blocks.
async fn start(url: &str, prefix: &str, dram_blocks: u64) -> TestServer {
    TestServer::start_with(
        ServerOptions {
            capacity_bytes: dram_blocks * BLOCK,
            ..Default::default()
        },
        |p| {
            let mut d = DirectoryConfig::of_kind("redis");
            d.call_timeout_ms = 500;
            d.query_timeout_ms = 300;
            for (k, v) in [
                ("url", toml::Value::String(url.into())),
                ("key_prefix", toml::Value::String(prefix.into())),
                ("stale_after_secs", toml::Value::Integer(2)),
                ("timeout_ms", toml::Value::Integer(200)),
            ] {
                d.settings.insert(k.into(), v);
            }
            p.directory = Some(d);
        },
    )
    .await
}

async fn worker(srv: &TestServer, id: &str) -> Worker {
    Worker::register(srv, id, NS, SHAPE, 0, 1, 0).await
}

/// Saves `hs` from device blocks 0.. in batches of 8.
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

/// The cover plan `srv`'s directory client answers for `hs` (the other servers' blocks).
async fn seen_from(srv: &TestServer, hs: &[Vec<u8>]) -> Vec<NodePrefix> {
    srv.handle
        .directory
        .as_ref()
        .expect("a directory is configured")
        .query_prefix(NS, 0, hs)
        .await
}

/// Polls `check` every 50 ms for up to `within`; panics with `what` if it never holds.
async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < end, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn addr(srv: &TestServer) -> String {
    srv.handle.directory.as_ref().unwrap().node().addr.clone()
}

fn one(node: &TestServer, n: u32) -> Vec<NodePrefix> {
    vec![NodePrefix {
        node: addr(node),
        prefix_len: n,
    }]
}

/// Fails if `f` does not finish within `limit` (a hang, not a speed measurement).
async fn bounded<T>(limit: Duration, what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Our `pegaflow-metaserver` over the Redis at `url` under `prefix`, on a free port, killed
/// when dropped; `None` (reported skipped) when the binary is not built.
struct MetaServer(std::process::Child, u16);

impl MetaServer {
    fn start(url: &str, prefix: &str) -> Option<Self> {
        let bin = std::env::var("PEGAFLOW_METASERVER_BIN")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../target/debug/pegaflow-metaserver")
            });
        if !bin.is_file() {
            pegaflow_tests::skip!("QueryPrefixBlocks through pegaflow-metaserver: {} is not built (cargo build --workspace)", bin.display());
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new(&bin)
            .args(["--addr", &format!("127.0.0.1:{port}")])
            .args(["--http-addr", &format!("127.0.0.1:{http}")])
            .args(["--redis", url, "--redis-key-prefix", prefix])
            .args(["--log-level", "warn"])
            .spawn()
            .expect("start pegaflow-metaserver");
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < end, "pegaflow-metaserver did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Self(child, port))
    }

    /// `QueryPrefixBlocks` over gRPC: the plan as (node, length) pairs.
    async fn query(&self, hs: &[Vec<u8>]) -> Vec<(String, u32)> {
        let mut c = pegaflow_proto::meta_server_client::MetaServerClient::connect(format!(
            "http://127.0.0.1:{}",
            self.1
        ))
        .await
        .expect("connect to pegaflow-metaserver");
        c.query_prefix_blocks(pegaflow_proto::QueryPrefixBlocksRequest {
            namespace: NS.into(),
            block_hashes: hs.to_vec(),
            exclude_node: String::new(),
        })
        .await
        .expect("QueryPrefixBlocks")
        .into_inner()
        .nodes
        .into_iter()
        .map(|n| (n.node, n.prefix_len))
        .collect()
    }
}

impl Drop for MetaServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn resident(store: &TierStack, h: &[u8]) -> bool {
    store.contains(pegaflow_plugin::block::KeyRef {
        namespace: NS,
        group: 0,
        hash: h,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_servers_share_one_redis_directory() {
    let Some(mut redis) = RedisServer::start("three_servers_share_one_redis_directory") else {
        return;
    };
    let url = redis.url();
    let prefix = format!("e2e-{}:", std::process::id());
    let servers = [
        start(&url, &prefix, 64).await,
        start(&url, &prefix, 64).await,
        start(&url, &prefix, 64).await,
    ];
    let tags = ["a", "b", "c"];
    let mut workers = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        let mut w = worker(s, &format!("inst-{}", tags[i])).await;
        save(&mut w, &hashes(tags[i], 16)).await;
        workers.push(w);
    }
    // Everyone sees everyone else's blocks; its own are excluded from its queries.
    for (i, s) in servers.iter().enumerate() {
        for (j, other) in servers.iter().enumerate() {
            let hs = hashes(tags[j], 16);
            let want = if i == j { vec![] } else { one(other, 16) };
            eventually(
                Duration::from_secs(10),
                &format!("server {i} sees server {j}'s 16 blocks"),
                || {
                    let hs = hs.clone();
                    let want = want.clone();
                    async move { seen_from(s, &hs).await == want }
                },
            )
            .await;
        }
    }

    // The MetaServer protocol over the same Redis: QueryPrefixBlocks lists each server's
    // blocks; a plan across two servers' runs has two segments.
    if let Some(ms) = MetaServer::start(&url, &prefix) {
        for (j, other) in servers.iter().enumerate() {
            assert_eq!(
                ms.query(&hashes(tags[j], 16)).await,
                vec![(addr(other), 16)],
                "QueryPrefixBlocks lists server {j}'s blocks"
            );
        }
        let mut mixed = hashes("a", 16);
        mixed.extend(hashes("b", 16));
        // b's hashes are not a continuation of a's in any server, but the plan only needs
        // each hash held: a covers the first 16, b the next 16.
        assert_eq!(
            ms.query(&mixed).await,
            vec![(addr(&servers[0]), 16), (addr(&servers[1]), 16)]
        );
    }

    // Server a saves three times its DRAM: what it evicted is withdrawn, what it holds stays.
    let many = hashes("a-many", 192);
    save(&mut workers[0], &many).await;
    let store_a = servers[0].handle.engine.store().clone();
    eventually(
        Duration::from_secs(10),
        "the directory lists server a exactly for what a's DRAM holds",
        || {
            let many = many.clone();
            let store_a = store_a.clone();
            let b = &servers[1];
            let a_addr = addr(&servers[0]);
            async move {
                for h in &many {
                    let listed = seen_from(b, std::slice::from_ref(h))
                        .await
                        .iter()
                        .any(|p| p.node == a_addr);
                    if listed != resident(&store_a, h) {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;

    // Redis frozen: Saves and QueryPrefetches go on, directory queries answer local only.
    redis.freeze();
    for (i, w) in workers.iter_mut().enumerate() {
        let hs = hashes(&format!("frozen-{i}"), 8);
        bounded(
            Duration::from_secs(10),
            "a Save while Redis is frozen",
            save(w, &hs),
        )
        .await;
        let q = bounded(
            Duration::from_secs(10),
            "a QueryPrefetch while Redis is frozen",
            w.client.query(&w.instance_id, hs.clone(), "frozen"),
        )
        .await
        .expect("query");
        assert_eq!(ready(q).0, 8, "the local blocks are found");
    }
    let q = bounded(
        Duration::from_secs(5),
        "a directory query while Redis is frozen",
        seen_from(&servers[1], &hashes("c", 16)),
    )
    .await;
    assert!(q.is_empty(), "a frozen directory answers nothing elsewhere");
    redis.thaw();
    for (j, other) in servers.iter().enumerate() {
        let hs = hashes(&format!("frozen-{j}"), 8);
        let observer = &servers[(j + 1) % 3];
        eventually(
            Duration::from_secs(15),
            &format!("blocks saved while Redis was frozen are advertised by server {j}"),
            || {
                let hs = hs.clone();
                let want = one(other, 8);
                async move { seen_from(observer, &hs).await == want }
            },
        )
        .await;
    }

    // FLUSHALL: every server notices at its next heartbeat and re-advertises.
    assert!(redis.command(&["FLUSHALL"]).contains("OK"));
    for (j, other) in servers.iter().enumerate().skip(1) {
        let observer = &servers[0];
        eventually(
            Duration::from_secs(15),
            &format!("server {j} re-advertises after FLUSHALL"),
            || {
                let hs = hashes(tags[j], 16);
                let want = one(other, 16);
                async move { seen_from(observer, &hs).await == want }
            },
        )
        .await;
    }

    // Redis killed: Saves and queries go on; restarted empty: re-advertised again.
    redis.kill();
    let mut w = workers.remove(1);
    bounded(
        Duration::from_secs(10),
        "a Save while Redis is down",
        save(&mut w, &hashes("down", 8)),
    )
    .await;
    assert!(seen_from(&servers[0], &hashes("b", 16)).await.is_empty());
    redis.restart();
    eventually(
        Duration::from_secs(15),
        "server b re-advertises after Redis restarted empty",
        || async { seen_from(&servers[0], &hashes("down", 8)).await == one(&servers[1], 8) },
    )
    .await;
    workers.insert(1, w);

    // A server that shuts down leaves the directory at once.
    drop(workers);
    let [a, b, c] = servers;
    let c_hashes = hashes("c", 16);
    eventually(Duration::from_secs(15), "server c is listed", || async {
        seen_from(&a, &c_hashes).await == one(&c, 16)
    })
    .await;
    c.shutdown().await;
    assert!(
        seen_from(&a, &c_hashes).await.is_empty(),
        "a server that shut down is no longer listed"
    );
    assert!(seen_from(&b, &c_hashes).await.is_empty());
    a.shutdown().await;
    b.shutdown().await;
}
