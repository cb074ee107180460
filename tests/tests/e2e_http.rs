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

/// The whole response (status line, headers, body) of `GET path`.
async fn raw_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf).into_owned()
}

/// `GET /health` is exactly `ok` (200) as PegaFlow's, whatever is degraded (issue 46: it used to
/// answer `degraded` plus a line per component, which probes comparing the body took for a
/// failure); the state travels in `x-pegaflow-health`; `?verbose=1` shows every component
/// (each tier, the peer path, the side channel, gRPC) with its state and reason; an unhealthy
/// component makes the probe answer 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_exactly_ok_and_the_detail_is_verbose() {
    use pegaflow_plugin::health::HealthState;
    let srv = TestServer::start(ServerOptions::default()).await;
    let a = srv.handle.http_addr;
    let detail = http(a, "GET", "/health?verbose=1").await;
    assert_eq!(detail.0, 200);
    let lines: Vec<&str> = detail.1.lines().collect();
    assert_eq!(lines[0], "ok", "{}", detail.1);
    for want in [
        "tier dram: ok; landing tier, capacity_bytes=67108864",
        "peer: ok; none",
        "grpc: ok; serving on 127.0.0.1:",
        "fd channel: ok; listening at ",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(want)),
            "{want:?} in\n{}",
            detail.1
        );
    }
    srv.handle.health.report(
        "ssd /nvme9",
        HealthState::Degraded,
        "out of service: 8 write errors",
    );
    assert_eq!(http(a, "GET", "/health").await, (200, "ok".to_string()));
    let raw = raw_get(a, "/health").await;
    assert!(
        raw.lines()
            .any(|l| l == "x-pegaflow-health: degraded\r" || l == "x-pegaflow-health: degraded"),
        "{raw}"
    );
    let (status, body) = http(a, "GET", "/health?verbose=1").await;
    assert_eq!(status, 200);
    assert!(
        body.starts_with("degraded\n")
            && body.contains("\nssd /nvme9: degraded; out of service: 8 write errors"),
        "{body}"
    );
    srv.handle.health.report(
        "grpc",
        HealthState::Unhealthy,
        "the gRPC server stopped: test",
    );
    let (status, body) = http(a, "GET", "/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.starts_with("unhealthy\n")
            && body.contains("grpc: unhealthy; the gRPC server stopped"),
        "{body}"
    );
}

/// Without `enable_prometheus`, `/metrics` is 404 as in PegaFlow, with a body that names the
/// flag (it used to be an empty 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_off_says_how_to_turn_them_on() {
    let srv = TestServer::start_with(ServerOptions::default(), |p| {
        p.server.enable_prometheus = false;
    })
    .await;
    let (status, body) = http(srv.handle.http_addr, "GET", "/metrics").await;
    assert_eq!(status, 404);
    assert_eq!(body.lines().count(), 1, "{body}");
    assert!(body.contains("--enable-prometheus"), "{body}");
    assert_eq!(
        http(srv.handle.http_addr, "GET", "/health").await,
        (200, "ok".to_string())
    );
}

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
