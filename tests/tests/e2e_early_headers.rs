//! A Save's response headers go out when its transport signals the copy's near end
//! (`[server] save_headers_early`, on by default), and its answer, or its error in the
//! trailers, when the copy ends. A probe transport signals, then holds every copy at a gate the
//! test opens, so what the client sees before the copy ends is observable: a raw
//! server-streaming call on the Save path returns at the headers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pegaflow_plugin::*;
use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_runtime::*;
use pegaflow_tests::harness::*;
use tokio::sync::Semaphore;
use tonic::Code;

/// One permit lets one copy through.
static GATE: Semaphore = Semaphore::const_new(0);
/// Whether the probe signals the near end before it waits at the gate.
static SIGNAL: AtomicBool = AtomicBool::new(true);
/// Whether the probe fails its copies (after the gate, having signalled).
static FAIL: AtomicBool = AtomicBool::new(false);

struct GatedTransport;

#[async_trait]
impl Transport for GatedTransport {
    fn kind(&self) -> &'static str {
        "gated-memcpy"
    }
    fn can_address(&self, space: MemorySpace) -> bool {
        space.is_host()
    }
    fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
        Ok(())
    }
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        if SIGNAL.load(Ordering::SeqCst) {
            signal_near_end();
            signal_near_end(); // a second call does nothing
        }
        GATE.acquire().await.expect("gate open").forget();
        if FAIL.load(Ordering::SeqCst) {
            return Err(TransportError(
                "injected: the copy failed at its end".into(),
            ));
        }
        // SAFETY: the engine keeps both sides alive until this future completes.
        unsafe { memcpy_ops(&batch) };
        Ok(())
    }
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

inventory::submit! {
    TransportFactory { kind: "gated-memcpy", summary: "test probe", config: pegaflow_plugin::ConfigSchema::NONE, flags: &[], build: |_, _| Ok(Arc::new(GatedTransport)) }
}

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

async fn gated_server(early: bool) -> TestServer {
    TestServer::start_with(ServerOptions::default(), |p| {
        p.server.save_headers_early = early;
        p.transports = Some(vec![PluginConfig {
            layers: vec![],
            kind: "gated-memcpy".into(),
            settings: toml::Table::new(),
        }]);
    })
    .await
}

fn save_request(w: &Worker, ids: &[u32], hashes: &[Vec<u8>]) -> pb::SaveRequest {
    pb::SaveRequest {
        instance_id: w.instance_id.clone(),
        tp_rank: w.tp_rank,
        pp_rank: 0,
        device_id: w.device_id,
        saves: (0..SHAPE.layers)
            .map(|l| pb::SaveLayer {
                layer_name: KvShape::layer_name(l),
                block_ids: ids.to_vec(),
                block_hashes: hashes.to_vec().into(),
            })
            .collect(),
    }
}

type Streamed = tonic::Response<tonic::codec::Streaming<pb::SaveResponse>>;

/// A Save as a server-streaming call (the same bytes as the unary one): resolves when the
/// response headers arrive; the answer is the stream's one message.
async fn raw_save(
    endpoint: String,
    req: impl tonic::IntoRequest<pb::SaveRequest>,
) -> Result<Streamed, tonic::Status> {
    let channel = tonic::transport::Channel::from_shared(endpoint)
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec = tonic_prost::ProstCodec::<pb::SaveRequest, pb::SaveResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/pegaflow.Engine/Save");
    grpc.server_streaming(req.into_request(), path, codec).await
}

/// Blocks in the index once every answered Save is sealed (sealing follows the answer).
async fn resident(srv: &TestServer) -> u64 {
    srv.handle.engine.settle().await;
    srv.handle.engine.index().resident_blocks()
}

/// Saves counted in `pegaflow_rpc_requests_total{method="save"}` with `status`.
fn saves_counted(srv: &TestServer, status: &str) -> u64 {
    srv.handle
        .engine
        .metrics()
        .rpc_requests
        .with_label_values(&["save", status])
        .get()
}

// One test drives every scenario, because the gate and the switches are process-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_headers_go_out_at_the_copys_near_end_and_the_answer_at_its_end() {
    let srv = gated_server(true).await;
    let mut w = Worker::register(&srv, "early", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..4).map(|i| hash_of("early", i)).collect();

    // 1. The headers arrive while the copy is held; the answer once it is let through.
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        raw_save(srv.handle.endpoint(), save_request(&w, &[0, 1], &hs[..2])),
    )
    .await
    .expect("the headers came before the copy ended")
    .expect("a response");
    assert_eq!(
        resident(&srv).await,
        0,
        "nothing is sealed before the copy ends"
    );
    let mut stream = resp.into_inner();
    GATE.add_permits(1);
    let answer = stream
        .message()
        .await
        .expect("an answer")
        .expect("one message");
    assert!(answer.status.expect("status").ok);
    assert!(stream.message().await.expect("clean trailers").is_none());
    assert_eq!(resident(&srv).await, 2);

    // 2. A copy that fails after the headers: the error is the call's status, and nothing
    // is sealed.
    FAIL.store(true, Ordering::SeqCst);
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        raw_save(srv.handle.endpoint(), save_request(&w, &[2], &hs[2..3])),
    )
    .await
    .expect("the headers came before the copy ended")
    .expect("a response");
    let mut stream = resp.into_inner();
    GATE.add_permits(1);
    let e = stream
        .message()
        .await
        .expect_err("the failed copy's status");
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert!(e.message().contains("injected"), "{e:?}");
    assert_eq!(resident(&srv).await, 2);

    // The same through the SDK's unary client: a failure, then a success.
    GATE.add_permits(1);
    let e = w.save(&[2], &hs[2..3]).await.expect_err("the copy failed");
    assert_eq!(e.code(), Some(Code::Internal), "{e:?}");
    FAIL.store(false, Ordering::SeqCst);
    GATE.add_permits(1);
    w.save(&[2, 3], &hs[2..4]).await.expect("saved");
    assert_eq!(resident(&srv).await, 4);

    // 3. A transport that never signals: the headers wait for the answer.
    SIGNAL.store(false, Ordering::SeqCst);
    let h5 = vec![hash_of("early", 5)];
    let call = tokio::spawn(raw_save(srv.handle.endpoint(), save_request(&w, &[5], &h5)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "no headers before the copy ended");
    GATE.add_permits(1);
    answered_ok(call.await.unwrap()).await;
    assert_eq!(resident(&srv).await, 5);
    SIGNAL.store(true, Ordering::SeqCst);

    // A call with a deadline: no early headers (the deadline would stop at them).
    let h7 = vec![hash_of("early", 7)];
    let mut req = tonic::Request::new(save_request(&w, &[7], &h7));
    req.set_timeout(Duration::from_secs(30));
    let call = tokio::spawn(raw_save(srv.handle.endpoint(), req));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "no headers before the copy ended");
    GATE.add_permits(1);
    answered_ok(call.await.unwrap()).await;
    assert_eq!(resident(&srv).await, 6);

    // A call dropped after its headers: the Save still runs to its end and seals.
    let h6 = vec![hash_of("early", 6)];
    let resp = raw_save(srv.handle.endpoint(), save_request(&w, &[4], &h6))
        .await
        .expect("headers");
    drop(resp);
    GATE.add_permits(1);
    let mut sealed = 0;
    for _ in 0..200 {
        sealed = resident(&srv).await;
        if sealed == 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sealed, 7, "the dropped call's Save completed");
    // Each answered Save counted once: four ok (1, the SDK's success, 3 and the deadline's);
    // 2 and the SDK's failure as Internal. (The dropped call may count as ok once its Save
    // ends, or not at all, as a cancelled unary call would.)
    let ok = saves_counted(&srv, "ok");
    assert!((4..=5).contains(&ok), "{ok}");
    assert_eq!(saves_counted(&srv, "Internal"), 2);

    // A refusal before any copy is still trailers-only with its code.
    let mut bad = save_request(&w, &[0], &hs[..1]);
    bad.instance_id = "nobody".into();
    let e = raw_save(srv.handle.endpoint(), bad)
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    srv.shutdown().await;

    // 4. Switched off: the headers wait for the answer although the transport signals.
    let srv = gated_server(false).await;
    let w = Worker::register(&srv, "late", "ns", SHAPE, 0, 1, 0).await;
    let call = tokio::spawn(raw_save(
        srv.handle.endpoint(),
        save_request(&w, &[0], &hs[..1]),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "no headers before the copy ended");
    GATE.add_permits(1);
    answered_ok(call.await.unwrap()).await;
    assert_eq!(resident(&srv).await, 1);
    srv.shutdown().await;
}

/// Reads the one answer of a call that [`raw_save`] returned, and checks it is ok.
async fn answered_ok(r: Result<Streamed, tonic::Status>) {
    let mut s = r.expect("headers").into_inner();
    let answer = s.message().await.expect("an answer").expect("one message");
    assert!(answer.status.expect("status").ok);
    assert!(s.message().await.expect("clean trailers").is_none());
}
