//! The HTTP endpoints with PegaFlow's fields, the metrics families, and responsiveness of
//! `/health`, `/metrics` and gRPC Health while registry operations are wedged.

use std::time::{Duration, Instant};

use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_tests::harness::*;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 512,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_answer_with_pegaflow_fields() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let a = srv.handle.http_addr;
    assert_eq!(http(a, "GET", "/health").await, (200, "ok".to_string()));
    let mut w = Worker::register(&srv, "h1", "ns", SHAPE, 0, 1, 0).await;
    let _w2 = Worker::register(&srv, "h2", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("h", i)).collect();
    w.save(&[0, 1, 2], &hs).await.unwrap();
    let (_, lease) = ready(w.client.query("h1", hs.clone(), "q").await.unwrap());
    let (s, body) = http(a, "GET", "/instances").await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["instances"], serde_json::json!(["h1", "h2"]));
    // Metrics carry PegaFlow's names and labels.
    let (s, m) = http(a, "GET", "/metrics").await;
    assert_eq!(s, 200);
    for needle in [
        "pegaflow_rpc_requests_total{method=\"save\",status=\"ok\"} 1",
        "pegaflow_rpc_duration_seconds_bucket{method=\"query_prefetch\",status=\"ok\"",
        "pegaflow_cache_block_misses_total 0",
        "pegaflow_cache_block_hits_total 3",
        "pegaflow_cache_block_insertions_total 3",
        "pegaflow_save_bytes_total 6144",
        "pegaflow_cache_resident_blocks{class=\"retained\"} 3",
        "pegaflow_pool_capacity_bytes",
        "pegaflow_instances 2",
        "pegaflow_leases_active 1",
        "pegaflow_fd_channel_events_total{event=\"delivered\"} 2",
        "pegaflow_fd_channel_pending 0",
    ] {
        assert!(m.contains(needle), "missing {needle} in\n{m}");
    }
    // Memory cleanup: every block leaves the index; the leased ones stay allocated.
    let (s, body) = http(a, "POST", "/cache/memory/cleanup").await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["evicted_blocks"], 3);
    assert_eq!(v["evicted_bytes"], 3 * 2048);
    assert_eq!(v["still_referenced_blocks"], 3);
    assert_eq!(v["reclaimed_bytes"], 0);
    let (n, _) = ready(w.client.query("h1", hs.clone(), "q2").await.unwrap());
    assert_eq!(n, 0, "new queries miss after a cleanup");
    // The old lease still loads.
    assert_eq!(w.load(&lease, &[4, 5, 6]).await.unwrap(), 1);
    // Instance cleanup by id, unknown id, and all.
    let (s, body) = http(a, "POST", "/instances/cleanup?id=h1").await;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["removed_instances"], serde_json::json!(["h1"]));
    assert_eq!(v["removed_tensors"], 2, "two layers registered");
    let (s, body) = http(a, "POST", "/instances/cleanup?id=h1").await;
    assert_eq!(s, 404);
    assert!(body.contains("not found"), "{body}");
    let (s, body) = http(a, "POST", "/instances/cleanup").await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["removed_instances"], serde_json::json!(["h2"]));
    assert!(srv.handle.engine.instance_ids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_answer_while_the_registry_is_wedged() {
    // Registrations wait (up to 60 s) for side-channel fds that never come: four registry
    // operations wedged on a 2-worker runtime.
    let srv = TestServer::start_with(ServerOptions::default(), |p| {
        let mut t = toml::Table::new();
        t.insert("fd_timeout_secs".into(), toml::Value::Integer(60));
        p.registrars = Some(vec![PluginConfig {
            layers: vec![],
            kind: "host-memfd".into(),
            settings: t,
        }]);
    })
    .await;
    let kv = KvCache::new(SHAPE);
    let mut stuck = Vec::new();
    for i in 0..4 {
        let mut c = srv.client().await;
        let req = kv
            .registration(&format!("wedged-{i}"), "ns", 0, 1, 0)
            .to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64);
        stuck.push(tokio::spawn(async move { c.register(req).await }));
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        stuck.iter().all(|h| !h.is_finished()),
        "the registrations are really wedged"
    );
    let a = srv.handle.http_addr;
    for path in ["/health", "/metrics", "/instances"] {
        let t0 = Instant::now();
        let (s, _) = tokio::time::timeout(Duration::from_secs(2), http(a, "GET", path))
            .await
            .unwrap_or_else(|_| panic!("{path} did not answer within 2 s"));
        assert_eq!(s, 200, "{path}");
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
    let mut c = srv.client().await;
    tokio::time::timeout(Duration::from_secs(2), c.health())
        .await
        .expect("gRPC Health within 2 s")
        .unwrap();
    for h in stuck {
        h.abort();
    }
}
