//! Input bounds (issue 14): oversized ids and names, undecodable bodies, bad load-state names
//! and empty hashes are answered INVALID_ARGUMENT with a short message, and never cost the
//! client its connection (nor, through its Session, its healthy registration); a dead writer's
//! partly saved blocks are freed with its instance, not after the in-flight TTL.

use std::time::Duration;

use pegaflow_api::client::{single_group_load, EngineClient, LoadCompletion};
use pegaflow_api::load_state::LoadState;
use pegaflow_api::ApiError;
use pegaflow_proto as pb;
use pegaflow_tests::harness::*;
use tonic::codegen::{http, Service};
use tonic::transport::Channel;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

/// Every refusal tested here must come back well inside HTTP/2's header limits.
const MAX_MESSAGE: usize = 1024;

/// The sizes of the issue: past h2's header limit (stream reset), and past the point where
/// the client's whole connection was closed (GOAWAY).
const OVERSIZED: [usize; 2] = [17_000, 1 << 20];

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| hash_of(tag, i)).collect()
}

fn layer_names() -> Vec<String> {
    (0..SHAPE.layers).map(KvShape::layer_name).collect()
}

fn status(e: &ApiError) -> &tonic::Status {
    match e {
        ApiError::Rpc { status, .. } => status,
        other => panic!("expected a gRPC status, got {other}"),
    }
}

/// `e` is INVALID_ARGUMENT (not a transport error), short, and mentions `what`.
#[track_caller]
fn assert_invalid(e: &ApiError, what: &str) {
    let s = status(e);
    assert_eq!(
        s.code(),
        Code::InvalidArgument,
        "{what}: {}",
        &s.message()[..s.message().len().min(300)]
    );
    assert!(
        s.message().len() < MAX_MESSAGE,
        "{what}: a {}-byte message",
        s.message().len()
    );
    assert!(s.message().contains(what), "{what}: {}", s.message());
}

/// The sum over every series of a metric family, from the Prometheus text.
fn metric(srv: &TestServer, name: &str) -> u64 {
    let text = srv.handle.engine.metrics().render();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A registered worker with a Session open on the worker's own channel, as the published
/// client has it (one connection carries the session and the unary calls).
async fn worker_with_session(
    srv: &TestServer,
    id: &str,
) -> (Worker, tonic::Streaming<pb::SessionEvent>) {
    let mut w = Worker::register(srv, id, "ns", SHAPE, 0, 1, 0).await;
    let mut c = w.client.clone();
    let stream = c.session(id, "ns", 1, 1).await.expect("session");
    w.save(&[0, 1], &hashes(id, 2)).await.expect("first save");
    (w, stream)
}

/// The session is still open and the instance still registered and working.
async fn assert_still_healthy(
    srv: &TestServer,
    w: &mut Worker,
    stream: &mut tonic::Streaming<pb::SessionEvent>,
    tag: &str,
) {
    let r = tokio::time::timeout(Duration::from_millis(300), stream.message()).await;
    assert!(r.is_err(), "{tag}: the session stream ended: {r:?}");
    assert!(
        srv.handle.engine.instance_ids().contains(&w.instance_id),
        "{tag}: the healthy instance was unregistered"
    );
    let hs = hashes(&format!("{}-{tag}", w.instance_id), 2);
    w.save(&[2, 3], &hs)
        .await
        .expect("save after the bad requests");
    let id = w.instance_id.clone();
    let (n, lease) = ready(w.client.query(&id, hs, tag).await.expect("query"));
    assert_eq!(n, 2, "{tag}");
    w.client.release(&lease).await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_unknown_instance_ids_are_invalid_argument_and_spare_the_connection() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let (mut w, mut stream) = worker_with_session(&srv, "good").await;
    for n in OVERSIZED {
        let id = "x".repeat(n);
        let c = &mut w.client;
        let e = c
            .save(
                &id,
                0,
                0,
                0,
                vec![(KvShape::layer_name(0), vec![0], hashes("o", 1))],
            )
            .await
            .unwrap_err();
        assert_invalid(&e, "instance_id");
        let e = c.query(&id, hashes("o", 1), "q").await.unwrap_err();
        assert_invalid(&e, "instance_id");
        let e = c.unregister(&id).await.unwrap_err();
        assert_invalid(&e, "instance_id");
        let state = LoadState::create().expect("load state");
        let req = single_group_load(
            &id,
            0,
            0,
            layer_names(),
            &[7; 16],
            [Some(0)],
            LoadCompletion::StateWord(state.name()),
        );
        let e = c.load(req).await.unwrap_err();
        assert_invalid(&e, "instance_id");
        assert_eq!(state.get(), -1, "a refused load still reports -1");
        let e = c.session(&id, "ns", 1, 1).await.unwrap_err();
        assert_invalid(&e, "instance_id");
        assert_still_healthy(&srv, &mut w, &mut stream, &format!("id{n}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_names_of_a_live_instance_are_invalid_argument() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let (mut w, mut stream) = worker_with_session(&srv, "live").await;
    for n in OVERSIZED {
        let big = "L".repeat(n);
        let c = &mut w.client;
        let e = c
            .save(
                "live",
                0,
                0,
                0,
                vec![(big.clone(), vec![0], hashes("o", 1))],
            )
            .await
            .unwrap_err();
        assert_invalid(&e, "layer_name");
        let e = c.query("live", hashes("o", 1), &big).await.unwrap_err();
        assert_invalid(&e, "req_id");
        let state = LoadState::create().expect("load state");
        let req = single_group_load(
            "live",
            0,
            0,
            vec![big.clone()],
            &[7; 16],
            [Some(0)],
            LoadCompletion::StateWord(state.name()),
        );
        let e = c.load(req).await.unwrap_err();
        assert_invalid(&e, "layer_names");
        let e = c.session("live2", &big, 1, 1).await.unwrap_err();
        assert_invalid(&e, "namespace");
        let mut reg = w.kv.registration("big-ns", &big, 0, 1, 1);
        reg.layers[0].name = big.clone();
        let e = c
            .register(reg.to_request(pb::MemoryKind::HostMemfd, w.kv.mem.len() as u64))
            .await
            .unwrap_err();
        assert_invalid(&e, "namespace");
        let e = c
            .raw()
            .query_blocks_for_transfer(pb::QueryBlocksForTransferRequest {
                namespace: big.clone(),
                block_hashes: hashes("o", 1),
                requester_id: "peer".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "peer namespace");
        assert!(e.message().len() < MAX_MESSAGE);
        let e = c
            .raw()
            .release_transfer_lock(pb::ReleaseTransferLockRequest {
                transfer_session_id: big.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "transfer_session_id");
        assert!(e.message().len() < MAX_MESSAGE);
        assert_still_healthy(&srv, &mut w, &mut stream, &format!("name{n}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_at_the_limit_pass_decoding_and_are_echoed_truncated() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut c = srv.client().await;
    let id = "y".repeat(256);
    let e = c.query(&id, hashes("a", 1), "q").await.unwrap_err();
    let s = status(&e);
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert!(s.message().contains("not found"), "{}", s.message());
    assert!(
        s.message().len() < 160,
        "the id is echoed as a short prefix: {}",
        s.message()
    );
    assert!(s.message().contains("256 bytes"), "{}", s.message());
    let e = c
        .query(&"y".repeat(257), hashes("a", 1), "q")
        .await
        .unwrap_err();
    assert_invalid(&e, "256");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_block_hashes_are_invalid_argument() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let (mut w, mut stream) = worker_with_session(&srv, "hashes").await;
    let mut hs = hashes("h", 2);
    hs[1].clear();
    let e = w.save(&[0, 1], &hs).await.unwrap_err();
    assert_invalid(&e, "empty");
    assert!(
        srv.handle.engine.index().resident_blocks() == 2,
        "a refused save changed nothing"
    );
    let e = w.client.query("hashes", hs.clone(), "q").await.unwrap_err();
    assert_invalid(&e, "empty");
    let e = w
        .client
        .query("hashes", vec![vec![1; 1025]], "q")
        .await
        .unwrap_err();
    assert_invalid(&e, "1024");
    let many: Vec<Vec<u8>> = (0..(1u32 << 20) + 1)
        .map(|i| i.to_le_bytes().to_vec())
        .collect();
    let e = w.client.query("hashes", many, "q").await.unwrap_err();
    assert_invalid(&e, "1048576");
    assert_still_healthy(&srv, &mut w, &mut stream, "hashes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_load_state_names_are_invalid_argument() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let (mut w, _stream) = worker_with_session(&srv, "shm").await;
    let long = "p".repeat(256);
    for name in ["", "a/b", "/pega_load_x", ".", "..", "a\0b", long.as_str()] {
        let req = single_group_load(
            "shm",
            0,
            0,
            layer_names(),
            &[7; 16],
            [Some(0)],
            LoadCompletion::StateWord(name),
        );
        let e = w.client.load(req).await.unwrap_err();
        assert_invalid(&e, "load_state_shm");
    }
    // A well-formed name of no object is still the server's attach failure (engine-wire §5).
    let req = single_group_load(
        "shm",
        0,
        0,
        layer_names(),
        &[7; 16],
        [Some(0)],
        LoadCompletion::StateWord("pega_load_does_not_exist"),
    );
    let e = w.client.load(req).await.unwrap_err();
    assert_ne!(e.code(), Some(Code::InvalidArgument), "{e}");
}

/// Sends every request to `path` whatever the client called: a well-formed message of one
/// RPC becomes an undecodable body for another.
#[derive(Clone)]
struct Reroute {
    inner: Channel,
    path: &'static str,
}

impl Service<http::Request<tonic::body::Body>> for Reroute {
    type Response = <Channel as Service<http::Request<tonic::body::Body>>>::Response;
    type Error = <Channel as Service<http::Request<tonic::body::Body>>>::Error;
    type Future = <Channel as Service<http::Request<tonic::body::Body>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, mut req: http::Request<tonic::body::Body>) -> Self::Future {
        let mut parts = req.uri().clone().into_parts();
        parts.path_and_query = Some(http::uri::PathAndQuery::from_static(self.path));
        *req.uri_mut() = http::Uri::from_parts(parts).expect("uri");
        self.inner.call(req)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_bodies_are_invalid_argument_and_counted() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let ch = tonic::transport::Endpoint::from_shared(srv.handle.endpoint())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    // RdmaHandshakeRequest field 2 is bytes: for Save and Load it is a varint field of the
    // wrong wire type, for RegisterContextBatch and Session a namespace that is not UTF-8.
    let cases = [
        ("/pegaflow.Engine/Save", vec![1, 2, 3]),
        ("/pegaflow.Engine/Load", vec![1, 2, 3]),
        ("/pegaflow.Engine/RegisterContextBatch", vec![0xff, 0xfe]),
        ("/pegaflow.Engine/Session", vec![0xff, 0xfe]),
    ];
    for (path, bytes) in &cases {
        let mut raw = pb::engine_client::EngineClient::new(Reroute {
            inner: ch.clone(),
            path,
        });
        let e = raw
            .rdma_handshake(pb::RdmaHandshakeRequest {
                requester_id: String::new(),
                handshake_metadata: bytes.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{path}: {}", e.message());
        assert!(e.message().contains("decode"), "{path}: {}", e.message());
    }
    assert_eq!(
        metric(&srv, "pegaflow_rpc_undecodable_requests_total"),
        cases.len() as u64
    );
    let text = srv.handle.engine.metrics().render();
    assert!(
        text.contains(r#"pegaflow_rpc_requests_total{method="save",status="InvalidArgument"} 1"#),
        "{}",
        text.lines()
            .filter(|l| l.starts_with("pegaflow_rpc_requests_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The channel is fine afterwards.
    let mut c = EngineClient::from_channel(ch);
    c.health().await.expect("health");
}

/// A TP-2 instance whose rank 0 saved and whose rank 1 never did.
async fn half_saved(srv: &TestServer, id: &str, blocks: usize) -> (Worker, Worker) {
    let mut w0 = Worker::register(srv, id, "ns", SHAPE, 0, 2, 0).await;
    let w1 = Worker::register(srv, id, "ns", SHAPE, 1, 2, 1).await;
    let ids: Vec<u32> = (0..blocks as u32).collect();
    w0.save(&ids, &hashes(id, blocks))
        .await
        .expect("rank 0 saves");
    (w0, w1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partly_saved_blocks_are_freed_with_their_instance() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let pool = srv.handle.engine.pool().clone();
    let baseline = pool.used_bytes();
    let cleaned0 = metric(&srv, "pegaflow_inflight_gc_cleaned_total");

    // UnregisterContext.
    let (mut w0, _w1) = half_saved(&srv, "crash-a", 4).await;
    assert!(pool.used_bytes() > baseline, "rank 0's slots are held");
    let (n, _) = ready(
        w0.client
            .query("crash-a", hashes("crash-a", 4), "q")
            .await
            .unwrap(),
    );
    assert_eq!(n, 0, "nothing is sealed without rank 1");
    w0.client.unregister("crash-a").await.expect("unregister");
    assert_eq!(pool.used_bytes(), baseline, "freed at unregistration");
    assert_eq!(metric(&srv, "pegaflow_inflight_bytes"), 0);
    assert_eq!(
        metric(&srv, "pegaflow_inflight_gc_cleaned_total"),
        cleaned0 + 4
    );

    // The Session ends (the client crashed).
    let (w0, _w1) = half_saved(&srv, "crash-b", 3).await;
    assert!(pool.used_bytes() > baseline);
    let mut sc = srv.client().await;
    let stream = sc.session("crash-b", "ns", 2, 2).await.expect("session");
    drop(stream);
    drop(sc);
    // The instance leaves the registry when its teardown starts and its blocks go when the
    // teardown has drained it: both within moments, not after the 300 s in-flight TTL.
    let mut freed = false;
    for _ in 0..200 {
        if srv.handle.engine.instance_ids().is_empty() && pool.used_bytes() == baseline {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        freed,
        "the session's end unregistered the instance and freed its blocks: {} instances, {} bytes used",
        srv.handle.engine.instance_ids().len(),
        pool.used_bytes()
    );
    assert_eq!(
        metric(&srv, "pegaflow_inflight_gc_cleaned_total"),
        cleaned0 + 7
    );
    drop(w0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_another_live_instance_also_wrote_stays_until_it_goes() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let pool = srv.handle.engine.pool().clone();
    let baseline = pool.used_bytes();
    let hs = hashes("shared", 2);
    // Two TP-2 instances of one namespace: A's rank 0 writes layer 0, B's rank 0 layer 1 of
    // the same blocks; neither has all four slots.
    let mut a0 = Worker::register(&srv, "inst-a", "ns", SHAPE, 0, 2, 0).await;
    let _a1 = Worker::register(&srv, "inst-a", "ns", SHAPE, 1, 2, 1).await;
    let mut b0 = Worker::register(&srv, "inst-b", "ns", SHAPE, 0, 2, 0).await;
    let _b1 = Worker::register(&srv, "inst-b", "ns", SHAPE, 1, 2, 1).await;
    a0.save_layers(&[0], &[0, 1], &hs).await.unwrap();
    b0.save_layers(&[1], &[0, 1], &hs).await.unwrap();
    let both = pool.used_bytes();
    assert!(both > baseline);
    a0.client.unregister("inst-a").await.unwrap();
    assert_eq!(
        pool.used_bytes(),
        both,
        "B still needs the blocks A helped write"
    );
    b0.client.unregister("inst-b").await.unwrap();
    assert_eq!(pool.used_bytes(), baseline);
}
