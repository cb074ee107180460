//! A flood of idle TCP connections to the gRPC port: the server holds `max_connections` of
//! them and accepts-and-closes the rest (counted), `/health` keeps answering, a new client
//! works again as soon as the flood ends, and no descriptor leaks. The descriptor count is
//! process-wide, so this binary holds exactly one test.

use std::time::{Duration, Instant};

use pegaflow_api::client::EngineClient;
use pegaflow_tests::harness::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const CAP: usize = 64;
const FLOOD: usize = 200;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// The value of the sample `name{listener="grpc"}` in `/metrics`.
async fn grpc_sample(srv: &TestServer, name: &str) -> i64 {
    let (s, m) = http(srv.handle.http_addr, "GET", "/metrics").await;
    assert_eq!(s, 200, "{m}");
    let prefix = format!("{name}{{listener=\"grpc\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{m}"))
        .trim()
        .parse()
        .unwrap()
}

/// Polls `/metrics` (≤ 10 s) until `name{listener="grpc"}` satisfies `ok`; returns the value.
async fn wait_sample(srv: &TestServer, name: &str, ok: impl Fn(i64) -> bool) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = grpc_sample(srv, name).await;
        if ok(v) || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn health_rpc(endpoint: &str) -> Result<(), String> {
    let mut c = EngineClient::connect(endpoint)
        .await
        .map_err(|e| e.to_string())?;
    c.health().await.map(drop).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_is_capped_and_health_keeps_answering() {
    let srv = TestServer::start_with(ServerOptions::default(), |p| {
        p.server.max_connections = Some(CAP);
    })
    .await;
    let endpoint = srv.handle.endpoint();
    // One client before the flood: the server works, and its descriptors are in the baseline.
    health_rpc(&endpoint)
        .await
        .expect("a client before the flood");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fds_before = open_fds();

    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        flood.push(
            TcpStream::connect(srv.handle.grpc_addr)
                .await
                .expect("connect"),
        );
    }
    let open = wait_sample(&srv, "pegaflow_connections_open", |v| v == CAP as i64).await;
    assert_eq!(
        open, CAP as i64,
        "the server holds max_connections of the flood"
    );
    let refused = wait_sample(&srv, "pegaflow_connections_refused_total", |v| {
        v >= (FLOOD - CAP) as i64
    })
    .await;
    assert!(
        refused >= (FLOOD - CAP) as i64,
        "connections beyond the cap are refused and counted: {refused}"
    );

    // /health answers while the gRPC port is flooded.
    for _ in 0..5 {
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            http(srv.handle.http_addr, "GET", "/health"),
        )
        .await
        .expect("/health answers during the flood");
        assert_eq!(r, (200, "ok".to_string()));
    }

    // A connection beyond the cap is closed at once (not left in the kernel backlog).
    let mut extra = TcpStream::connect(srv.handle.grpc_addr)
        .await
        .expect("connect");
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut buf))
        .await
        .expect("a connection beyond the cap is closed, not left waiting");
    assert!(
        matches!(r, Ok(0) | Err(_)),
        "a connection beyond the cap reads EOF or a reset: {r:?}"
    );
    drop(extra);
    // So is a gRPC client.
    let r = tokio::time::timeout(Duration::from_secs(10), health_rpc(&endpoint))
        .await
        .expect("a gRPC client beyond the cap fails, it does not hang");
    assert!(r.is_err(), "a gRPC client beyond the cap is refused");

    // The flood ends: a new client works at once.
    drop(flood);
    let t0 = Instant::now();
    loop {
        match health_rpc(&endpoint).await {
            Ok(()) => break,
            Err(e) if t0.elapsed() < Duration::from_secs(2) => {
                eprintln!("client after the flood, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("no client works 2 s after the flood ended: {e}"),
        }
    }

    // Every held connection is released and no descriptor leaks.
    let open = wait_sample(&srv, "pegaflow_connections_open", |v| v == 0).await;
    assert_eq!(open, 0, "every flood connection released its slot");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut fds_after = open_fds();
    while fds_after > fds_before + 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        fds_after = open_fds();
    }
    assert!(
        fds_after <= fds_before + 4,
        "descriptors leaked: {fds_before} before the flood, {fds_after} after"
    );
    srv.shutdown().await;
}
