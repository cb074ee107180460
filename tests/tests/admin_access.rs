//! Who may stop or wipe the server: the Shutdown RPC and the destructive HTTP endpoints
//! (`POST /instances/cleanup`, `POST /cache/memory/cleanup`) answer loopback peers by default,
//! only the peers of `[server] admin_allow` (`--admin-allow`) when it is set, and every peer
//! with `any`. Read-only endpoints answer everyone.

use std::time::Duration;

use pegaflow_api::ApiError;
use pegaflow_runtime::config::AdminAllow;
use pegaflow_tests::harness::*;

const SHAPE: KvShape = KvShape {
    layers: 1,
    num_blocks: 4,
    segment_bytes: 512,
};

async fn server(allow: Option<&str>) -> TestServer {
    let allow = allow.map(|a| AdminAllow::parse(a).expect("a valid allow-list"));
    TestServer::start_with(ServerOptions::default(), move |p| {
        if let Some(a) = allow {
            p.server.admin_allow = a;
        }
    })
    .await
}

/// Whether the Shutdown RPC notified the server (waits up to `wait`).
async fn shutdown_requested(srv: &TestServer, wait: Duration) -> bool {
    tokio::time::timeout(wait, srv.handle.shutdown_requested())
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_peers_may_clean_up_and_shut_down_by_default() {
    let srv = server(None).await;
    let a = srv.handle.http_addr;
    let _w = Worker::register(&srv, "adm1", "ns", SHAPE, 0, 1, 0).await;
    let (s, body) = http(a, "POST", "/cache/memory/cleanup").await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = http(a, "POST", "/instances/cleanup?id=adm1").await;
    assert_eq!(s, 200, "{body}");
    assert!(srv.handle.engine.instance_ids().is_empty());
    srv.client()
        .await
        .shutdown()
        .await
        .expect("Shutdown from loopback");
    assert!(shutdown_requested(&srv, Duration::from_secs(5)).await);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_outside_the_allow_list_are_refused() {
    let srv = server(Some("10.0.0.0/8")).await;
    let a = srv.handle.http_addr;
    let _w = Worker::register(&srv, "adm2", "ns", SHAPE, 0, 1, 0).await;
    for path in [
        "/instances/cleanup",
        "/instances/cleanup?id=adm2",
        "/cache/memory/cleanup",
    ] {
        let (s, body) = http(a, "POST", path).await;
        assert_eq!(s, 403, "POST {path} from loopback: {body}");
        assert!(
            body.contains("admin_allow") && body.contains("--admin-allow"),
            "the refusal names the key and the flag: {body}"
        );
    }
    assert_eq!(
        srv.handle.engine.instance_ids(),
        vec!["adm2".to_string()],
        "a refused cleanup removes nothing"
    );
    // Read-only endpoints are unchanged.
    assert_eq!(http(a, "GET", "/health").await, (200, "ok".to_string()));
    let (s, body) = http(a, "GET", "/instances").await;
    assert_eq!(s, 200, "{body}");

    let e = srv.client().await.shutdown().await.unwrap_err();
    match &e {
        ApiError::Rpc { status, .. } => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{e}");
            assert!(
                status.message().contains("admin_allow")
                    && status.message().contains("--admin-allow"),
                "the refusal names the key and the flag: {e}"
            );
        }
        other => panic!("expected PERMISSION_DENIED, got {other}"),
    }
    assert!(
        !shutdown_requested(&srv, Duration::from_millis(300)).await,
        "a refused Shutdown does not stop the server"
    );
    // The server keeps serving.
    srv.client().await.health().await.expect("still serving");
    assert_eq!(srv.handle.engine.instance_ids(), vec!["adm2".to_string()]);
    let (_, m) = http(a, "GET", "/metrics").await;
    assert!(
        m.contains(
            "pegaflow_rpc_requests_total{method=\"shutdown\",status=\"PermissionDenied\"} 1"
        ),
        "{m}"
    );
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_and_listed_loopback_allow() {
    for allow in ["any", "10.0.0.0/8,127.0.0.0/8", "::1/128, 127.0.0.1"] {
        let srv = server(Some(allow)).await;
        let a = srv.handle.http_addr;
        let _w = Worker::register(&srv, "adm3", "ns", SHAPE, 0, 1, 0).await;
        let (s, body) = http(a, "POST", "/instances/cleanup").await;
        assert_eq!(s, 200, "{allow}: {body}");
        assert!(srv.handle.engine.instance_ids().is_empty(), "{allow}");
        let (s, body) = http(a, "POST", "/cache/memory/cleanup").await;
        assert_eq!(s, 200, "{allow}: {body}");
        srv.client()
            .await
            .shutdown()
            .await
            .unwrap_or_else(|e| panic!("{allow}: {e}"));
        assert!(
            shutdown_requested(&srv, Duration::from_secs(5)).await,
            "{allow}"
        );
        srv.shutdown().await;
    }
}
