//! The server-to-server RPCs go to the `[peer]` delegate the pipeline names (an extension
//! point for cross-node backends): without one they answer FAILED_PRECONDITION (release: a
//! no-op success); with a (test) delegate linked, each RPC reaches it together with the tier
//! stack, whose DRAM blocks it can see.

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_plugin::{ConfigSchema, PeerService, PeerServiceFactory, RuntimeContext};
use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_tests::harness::*;
use tonic::Code;

/// Answers QueryBlocksForTransfer with one entry per DRAM-resident hash of the prefix, the
/// session id "test-session", and echoes handshake metadata reversed.
struct EchoPeer;

#[async_trait]
impl PeerService for EchoPeer {
    fn kind(&self) -> &'static str {
        "test-echo"
    }
    async fn query_blocks_for_transfer(
        &self,
        store: &Arc<dyn pegaflow_plugin::BlockHost>,
        req: pb::QueryBlocksForTransferRequest,
    ) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status> {
        // The DRAM prefix of the asked hashes, as the delegate sees this node's host DRAM.
        let hits: Vec<_> = req
            .block_hashes
            .iter()
            .map_while(|h| {
                store.get_touch(pegaflow_plugin::KeyRef {
                    namespace: &req.namespace,
                    group: 0,
                    hash: h,
                })
            })
            .collect();
        Ok(pb::QueryBlocksForTransferResponse {
            status: Some(pb::ResponseStatus {
                ok: true,
                message: String::new(),
            }),
            blocks: req.block_hashes[..hits.len()]
                .iter()
                .map(|h| pb::TransferBlockInfo {
                    block_hash: h.clone(),
                    ..Default::default()
                })
                .collect(),
            transfer_session_id: "test-session".into(),
            lock_timeout_secs: 1,
        })
    }
    async fn release_transfer_lock(
        &self,
        _store: &Arc<dyn pegaflow_plugin::BlockHost>,
        req: pb::ReleaseTransferLockRequest,
    ) -> Result<pb::ReleaseTransferLockResponse, tonic::Status> {
        if req.transfer_session_id != "test-session" {
            return Err(tonic::Status::not_found("no such session"));
        }
        Ok(pb::ReleaseTransferLockResponse {
            status: None,
            released_blocks: 7,
        })
    }
    async fn rdma_handshake(
        &self,
        _store: &Arc<dyn pegaflow_plugin::BlockHost>,
        req: pb::RdmaHandshakeRequest,
    ) -> Result<pb::RdmaHandshakeResponse, tonic::Status> {
        let mut m = req.handshake_metadata;
        m.reverse();
        Ok(pb::RdmaHandshakeResponse {
            status: None,
            handshake_metadata: m,
        })
    }
    fn fetcher(&self) -> Option<Arc<dyn pegaflow_plugin::PeerFetcher>> {
        None
    }
}

fn build(t: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn PeerService>> {
    if let Some(k) = t.keys().next() {
        anyhow::bail!("test-echo takes no settings, got {k:?}");
    }
    Ok(Arc::new(EchoPeer))
}

inventory::submit! {
    PeerServiceFactory {
        kind: "test-echo",
        summary: "test only: echoes the server-to-server RPCs",
        config: ConfigSchema::NONE,
        flags: &[],
        build,
    }
}

async fn raw(srv: &TestServer) -> pb::engine_client::EngineClient<tonic::transport::Channel> {
    pb::engine_client::EngineClient::connect(srv.handle.endpoint())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_peer_the_rpcs_are_not_configured() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut c = raw(&srv).await;
    let e = c
        .query_blocks_for_transfer(pb::QueryBlocksForTransferRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("[peer]"), "{e}");
    let e = c
        .rdma_handshake(pb::RdmaHandshakeRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let r = c
        .release_transfer_lock(pb::ReleaseTransferLockRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.released_blocks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_named_peer_delegate_serves_the_rpcs_with_the_store() {
    let srv = TestServer::start_with(ServerOptions::default(), |p| {
        p.peer = Some(PluginConfig {
            kind: "test-echo".into(),
            layers: vec![],
            settings: toml::Table::new(),
        });
    })
    .await;
    let shape = KvShape {
        layers: 2,
        num_blocks: 8,
        segment_bytes: 512,
    };
    let mut w = Worker::register(&srv, "peer", "ns", shape, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("peer", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    // The Save answers before its blocks are sealed; a peer's query made after it waits for
    // the seal rather than missing them.
    let hold = srv.handle.engine.hold_seals();
    w.save(&[0, 1], &hs[..2]).await.unwrap();
    let mut c = raw(&srv).await;
    let peer_query = {
        let mut c = c.clone();
        let hs = hs.clone();
        tokio::spawn(async move {
            c.query_blocks_for_transfer(pb::QueryBlocksForTransferRequest {
                namespace: "ns".into(),
                block_hashes: hs,
                requester_id: "other-node".into(),
            })
            .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !peer_query.is_finished(),
        "the peer's query waits for the pending seal"
    );
    drop(hold);
    let r = tokio::time::timeout(std::time::Duration::from_secs(10), peer_query)
        .await
        .expect("answered once sealed")
        .unwrap()
        .unwrap()
        .into_inner();
    assert_eq!(
        r.blocks.len(),
        2,
        "the delegate saw the two resident blocks"
    );
    assert_eq!(r.transfer_session_id, "test-session");
    let r = c
        .release_transfer_lock(pb::ReleaseTransferLockRequest {
            transfer_session_id: "test-session".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.released_blocks, 7);
    let e = c
        .release_transfer_lock(pb::ReleaseTransferLockRequest {
            transfer_session_id: "other".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let r = c
        .rdma_handshake(pb::RdmaHandshakeRequest {
            requester_id: "x".into(),
            handshake_metadata: vec![1, 2, 3],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.handshake_metadata, vec![3, 2, 1]);
    assert!(pegaflow_plugin::describe_plugins().contains("test-echo"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_peer_kind_fails_start_up_listing_the_known_kinds() {
    let mut p = pegaflow_runtime::config::PipelineConfig::embedded_default();
    p.server.addr = "127.0.0.1:0".into();
    p.server.http_addr = "127.0.0.1:0".into();
    p.tiers[0]
        .settings
        .insert("capacity".into(), toml::Value::Integer(1 << 20));
    p.peer = Some(PluginConfig {
        kind: "no-such-peer".into(),
        layers: vec![],
        settings: toml::Table::new(),
    });
    let e = pegaflow_runtime::start(p).await.unwrap_err().to_string();
    assert!(
        e.contains("unknown peer kind") && e.contains("test-echo"),
        "{e}"
    );
}
