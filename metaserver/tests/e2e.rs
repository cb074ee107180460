//! End to end: our `pegaflow-metaserver` binary on free ports, driven with the generated
//! tonic client: the in-memory backend (RPCs, sweep, `/metrics`, `/health`), and two
//! processes sharing one Redis (`--redis`, skipped without `redis-server`).

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pegaflow_proto::meta_server_client::MetaServerClient;
use pegaflow_proto::{
    HeartbeatNodeRequest, InsertBlockHashesRequest, NodePrefixResult, QueryPrefixBlocksRequest,
    RemoveBlockHashesRequest, UnregisterNodeRequest,
};
use tonic::transport::Channel;

fn h(i: u32) -> Vec<u8> {
    let mut v = b"e2e-block-".to_vec();
    v.extend_from_slice(&i.to_be_bytes());
    v
}

fn hs(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

fn session() -> String {
    uuid::Uuid::new_v4().to_string()
}

async fn heartbeat(
    c: &mut MetaServerClient<Channel>,
    node: &str,
    id: &str,
) -> Result<u64, tonic::Status> {
    c.heartbeat_node(HeartbeatNodeRequest {
        node: node.into(),
        node_id: id.into(),
    })
    .await
    .map(|r| r.into_inner().stale_after_secs)
}

async fn insert(
    c: &mut MetaServerClient<Channel>,
    node: &str,
    id: &str,
    ns: &str,
    hashes: Vec<Vec<u8>>,
) -> Result<(u64, Vec<Vec<u8>>), tonic::Status> {
    c.insert_block_hashes(InsertBlockHashesRequest {
        namespace: ns.into(),
        block_hashes: hashes,
        node: node.into(),
        node_id: id.into(),
    })
    .await
    .map(|r| {
        let r = r.into_inner();
        assert!(r.status.as_ref().is_some_and(|s| s.ok), "{r:?}");
        (r.inserted_count, r.reclaimable_hashes)
    })
}

async fn query(
    c: &mut MetaServerClient<Channel>,
    ns: &str,
    hashes: Vec<Vec<u8>>,
) -> Result<Vec<(String, u32)>, tonic::Status> {
    c.query_prefix_blocks(QueryPrefixBlocksRequest {
        namespace: ns.into(),
        block_hashes: hashes,
        exclude_node: String::new(),
    })
    .await
    .map(|r| {
        r.into_inner()
            .nodes
            .into_iter()
            .map(|NodePrefixResult { node, prefix_len }| (node, prefix_len))
            .collect()
    })
}

fn metric(text: &str, series: &str) -> f64 {
    let s = common::samples(text, "pegaflow_metaserver");
    let (name, labels) = series
        .split_once('{')
        .map_or((series, ""), |(n, l)| (n, l.trim_end_matches('}')));
    *s.get(&(name.to_string(), labels.to_string()))
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend_end_to_end() {
    let s = common::Server::start(
        &common::our_binary(),
        &[
            "--node-stale-secs",
            "1",
            "--ttl-minutes",
            "1",
            "--sweep-interval-secs",
            "1",
            "--log-level",
            "debug",
        ],
    );
    let mut c = s.client().await;
    let (a, b, d) = ("10.0.0.1:50055", "10.0.0.2:50055", "10.0.0.3:50055");
    let (sa, sb, sd) = (session(), session(), session());
    assert_eq!(heartbeat(&mut c, a, &sa).await.unwrap(), 1);
    heartbeat(&mut c, b, &sb).await.unwrap();
    heartbeat(&mut c, d, &sd).await.unwrap();

    // 20,000 hashes in one RPC; b and d hold shorter runs.
    let (n, rec) = insert(&mut c, a, &sa, "ns", hs(0..20_000)).await.unwrap();
    assert_eq!((n, rec.len()), (20_000, 0));
    insert(&mut c, b, &sb, "ns", hs(0..10)).await.unwrap();
    let (_, rec) = insert(&mut c, d, &sd, "ns", [h(0), h(1), h(15)].into())
        .await
        .unwrap();
    assert_eq!(rec, vec![h(0), h(1)], "three live owners");
    // a's run covers everything: the shorter runs do not show.
    assert_eq!(
        query(&mut c, "ns", hs(0..30)).await.unwrap(),
        vec![(a.into(), 30)]
    );
    assert_eq!(
        query(&mut c, "ns", hs(0..20_001)).await.unwrap(),
        vec![(a.into(), 20_000)]
    );
    // A plan of several segments: b for h0..h9, then d for h10..h11.
    insert(&mut c, b, &sb, "mix", hs(0..10)).await.unwrap();
    insert(&mut c, d, &sd, "mix", hs(5..12)).await.unwrap();
    assert_eq!(
        query(&mut c, "mix", hs(0..15)).await.unwrap(),
        vec![(b.into(), 10), (d.into(), 2)]
    );
    assert!(query(&mut c, "other", hs(0..3)).await.unwrap().is_empty());
    let e = query(&mut c, "ns", vec![]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    // Owner-checked removal.
    let r = c
        .remove_block_hashes(RemoveBlockHashesRequest {
            namespace: "ns".into(),
            block_hashes: hs(0..20),
            node: b.into(),
            node_id: sb.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.removed_count, 10);
    let e = insert(&mut c, b, &session(), "ns", hs(0..1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::FailedPrecondition, "stale node session")
    );

    let (code, body) = common::http_get(&s.http, "/health");
    assert_eq!((code, body.as_str()), (200, "ok"));
    let (code, text) = common::http_get(&s.http, "/metrics");
    assert_eq!(code, 200);
    // ns: 20,000 keys, d's 3 more owners; mix: 12 keys, 17 owners (h5..h9 twice).
    assert_eq!(metric(&text, "pegaflow_metaserver_store_entries"), 20_012.0);
    assert_eq!(metric(&text, "pegaflow_metaserver_block_owners"), 20_020.0);
    assert_eq!(
        metric(&text, "pegaflow_metaserver_block_redundancy{owners=\"2\"}"),
        8.0
    );
    assert_eq!(
        metric(&text, "pegaflow_metaserver_nodes{state=\"active\"}"),
        3.0
    );
    assert_eq!(
        metric(
            &text,
            "pegaflow_metaserver_rpc_requests_total{method=\"insert_block_hashes\",status=\"ok\"}"
        ),
        5.0
    );

    // d goes stale and is taken over: its old records are swept within a couple of seconds.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert!(
        query(&mut c, "ns", hs(0..3)).await.unwrap().is_empty(),
        "all stale"
    );
    let sd2 = session();
    heartbeat(&mut c, d, &sd2).await.unwrap();
    heartbeat(&mut c, a, &sa).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = common::http_get(&s.http, "/metrics");
        if metric(&text, "pegaflow_metaserver_sweep_removed_owners_total") >= 10.0 {
            // d's 3 + 7 records under its old session are gone; b's 10 in mix stay.
            assert_eq!(metric(&text, "pegaflow_metaserver_block_owners"), 20_010.0);
            break;
        }
        assert!(Instant::now() < deadline, "no sweep:\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        query(&mut c, "ns", hs(0..3)).await.unwrap(),
        vec![(a.into(), 3)]
    );
    let r = c
        .unregister_node(UnregisterNodeRequest {
            node: a.into(),
            node_id: sa.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.removed_owners, 20_000);
    assert!(s.log_text().contains("directory sweep"), "{}", s.log_text());
}

/// A throw-away `redis-server` on a free port, killed on drop.
struct Redis {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Option<Redis> {
        let bin = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())?;
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_port();
        let child = Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Redis {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            _dir: dir,
        })
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_metaservers_share_one_redis() {
    let Some(mut redis) = Redis::start() else {
        pegaflow_test_skip::skip!("redis-server not found");
        return;
    };
    let prefix = format!("e2e:{}:", uuid::Uuid::new_v4().simple());
    let args = [
        "--redis",
        redis.url.as_str(),
        "--redis-key-prefix",
        prefix.as_str(),
        "--redis-timeout-ms",
        "500",
        "--node-stale-secs",
        "2",
    ];
    let one = common::Server::start(&common::our_binary(), &args);
    let two = common::Server::start(&common::our_binary(), &args);
    let (mut c1, mut c2) = (one.client().await, two.client().await);
    let (a, b) = ("10.0.1.1:50055", "10.0.1.2:50055");
    let (sa, sb) = (session(), session());
    assert_eq!(heartbeat(&mut c1, a, &sa).await.unwrap(), 2);
    heartbeat(&mut c2, b, &sb).await.unwrap();
    // The address is held: the other process refuses a second session too.
    let e = heartbeat(&mut c2, a, &session()).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::FailedPrecondition, "stale node session")
    );
    insert(&mut c1, a, &sa, "ns", hs(0..5)).await.unwrap();
    insert(&mut c2, b, &sb, "ns", hs(3..8)).await.unwrap();
    for c in [&mut c1, &mut c2] {
        assert_eq!(
            query(c, "ns", hs(0..10)).await.unwrap(),
            vec![(a.into(), 5), (b.into(), 3)]
        );
    }
    let e = insert(&mut c2, "10.0.1.9:1", &session(), "ns", hs(0..1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::FailedPrecondition, "unknown node")
    );
    // Large requests run on a blocking thread, talking to Redis from there.
    let (n, _) = insert(&mut c1, a, &sa, "big", hs(0..6000)).await.unwrap();
    assert_eq!(n, 6000);
    assert_eq!(
        query(&mut c2, "big", hs(0..6001)).await.unwrap(),
        vec![(a.into(), 6000)]
    );
    let (_, text) = common::http_get(&two.http, "/metrics");
    assert!(
        text.contains("pegaflow_metaserver_large_requests_total{method=\"query_prefix_blocks\"} 1"),
        "{text}"
    );

    let (code, body) = common::http_get(&two.http, "/health");
    assert_eq!((code, body.as_str()), (200, "ok"));
    let (_, text) = common::http_get(&one.http, "/metrics");
    assert!(
        text.contains("pegaflow_metaserver_rpc_requests_total"),
        "{text}"
    );
    assert!(
        !text.contains("pegaflow_metaserver_store_entries"),
        "{text}"
    );

    // Redis goes away: calls answer UNAVAILABLE, /health 503 with the reason.
    let _ = redis.child.kill();
    let _ = redis.child.wait();
    let e = query(&mut c1, "ns", hs(0..2)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let (code, body) = common::http_get(&one.http, "/health");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("redis"), "{body}");
}
