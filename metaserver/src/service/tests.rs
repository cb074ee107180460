//! The service's unit tests: PegaFlow's answers, the bounds, and large calls kept off the
//! async workers.

use std::time::Duration;

use async_trait::async_trait;
use pegaflow_directory::memory::{MemoryConfig, MemoryDirectory};
use pegaflow_plugin::{HeartbeatAnswer, InsertAnswer, NodePrefix};

use super::*;

fn service() -> Arc<MetaService> {
    Arc::new(MetaService::new(
        Arc::new(MemoryDirectory::new(&MemoryConfig::default())),
        Arc::new(Metrics::new(true)),
    ))
}

async fn call<Req: Message, Resp: Message + Default>(
    s: &Arc<MetaService>,
    method: Method,
    req: Req,
) -> Result<Resp, Status> {
    let answer = s.handle(method, req.encode_to_vec().into(), None).await?;
    Ok(Resp::decode(answer).expect("an answer that decodes"))
}

#[test]
fn node_ids_are_uuids_in_any_form_and_fields_are_bounded() {
    let id = "b49483d3-55ab-4378-a3e1-db19516ed766";
    for form in [
        id.to_string(),
        id.to_uppercase(),
        id.replace('-', ""),
        format!("urn:uuid:{id}"),
        format!("{{{id}}}"),
    ] {
        assert_eq!(node_of("n:1", &form).unwrap().session, id, "{form}");
    }
    let e = node_of("n:1", "").unwrap_err();
    assert_eq!(e.field, "node_id");
    assert!(e.message.starts_with("invalid node_id: "), "{}", e.message);
    assert_eq!(node_of("", id).unwrap_err().message, "node cannot be empty");
    let e = node_of(&"n".repeat(1 << 20), id).unwrap_err();
    assert_eq!(
        (e.field, e.message.as_str()),
        ("node", "node is 1048576 bytes; the limit is 256 bytes")
    );
    let e = node_of("n:1", &"i".repeat(300)).unwrap_err();
    assert_eq!(e.message, "node_id is 300 bytes; the limit is 256 bytes");
    let e = node_of(&"n".repeat(300), "").unwrap_err();
    assert_eq!(
        e.field, "node",
        "an oversized node is told before an empty id"
    );
}

#[test]
fn errors_map_to_pegaflows_codes() {
    let s = status_of(&DirectoryError::UnknownNode("a".into()));
    assert_eq!(
        (s.code(), s.message()),
        (tonic::Code::FailedPrecondition, "unknown node")
    );
    let s = status_of(&DirectoryError::SessionConflict("a".into()));
    assert_eq!(
        (s.code(), s.message()),
        (tonic::Code::FailedPrecondition, "stale node session")
    );
    assert_eq!(
        status_of(&DirectoryError::Unavailable("down".into())).code(),
        tonic::Code::Unavailable
    );
    assert_eq!(
        status_of(&DirectoryError::Invalid("x".into())).code(),
        tonic::Code::InvalidArgument
    );
    let s = status_of(&DirectoryError::LimitReached {
        limit: "max_nodes",
        message: "the directory has 3 registered nodes; the limit is 3".into(),
    });
    assert_eq!(s.code(), tonic::Code::ResourceExhausted);
    assert!(s.message().contains("the limit is 3"));
}

#[tokio::test]
async fn empty_batches_answer_a_status_not_an_error() {
    let s = service();
    let r: InsertBlockHashesResponse = call(
        &s,
        Method::Insert,
        InsertBlockHashesRequest {
            namespace: "ns".into(),
            block_hashes: vec![],
            node: "n:1".into(),
            node_id: "not even a uuid".into(),
        },
    )
    .await
    .unwrap();
    assert_eq!(r.status, empty_status());
    let r: RemoveBlockHashesResponse =
        call(&s, Method::Remove, RemoveBlockHashesRequest::default())
            .await
            .unwrap();
    assert_eq!(r.status, empty_status());
    let e = call::<_, QueryPrefixBlocksResponse>(
        &s,
        Method::Query,
        QueryPrefixBlocksRequest::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, EMPTY_HASHES)
    );
}

#[tokio::test]
async fn a_round_trip() {
    let s = service();
    let id = uuid::Uuid::new_v4().to_string();
    let hb: HeartbeatNodeResponse = call(
        &s,
        Method::Heartbeat,
        HeartbeatNodeRequest {
            node: "10.0.0.1:50055".into(),
            node_id: id.to_uppercase(),
        },
    )
    .await
    .unwrap();
    assert_eq!(hb.stale_after_secs, 30);
    let ins: InsertBlockHashesResponse = call(
        &s,
        Method::Insert,
        InsertBlockHashesRequest {
            namespace: "ns".into(),
            block_hashes: vec![vec![1], vec![2]],
            node: "10.0.0.1:50055".into(),
            node_id: id.replace('-', ""),
        },
    )
    .await
    .unwrap();
    assert_eq!((ins.status, ins.inserted_count), (ok_status(), 2));
    let q: QueryPrefixBlocksResponse = call(
        &s,
        Method::Query,
        QueryPrefixBlocksRequest {
            namespace: "ns".into(),
            block_hashes: vec![vec![1], vec![2], vec![3]],
            exclude_node: String::new(),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        q.nodes,
        vec![NodePrefixResult {
            node: "10.0.0.1:50055".into(),
            prefix_len: 2
        }]
    );
    let un: UnregisterNodeResponse = call(
        &s,
        Method::Unregister,
        UnregisterNodeRequest {
            node: "10.0.0.1:50055".into(),
            node_id: id.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(un.removed_owners, 2);
    let e = call::<_, UnregisterNodeResponse>(
        &s,
        Method::Unregister,
        UnregisterNodeRequest {
            node: "10.0.0.1:50055".into(),
            node_id: id,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.message(), "unknown node");
    assert!(s.metrics.render().contains(
        "pegaflow_metaserver_rpc_requests_total{method=\"unregister_node\",status=\"The system is not in a state required for the operation's execution\"} 1"
    ));
}

#[tokio::test]
async fn bodies_that_do_not_decode_are_invalid_argument() {
    let s = service();
    for m in Method::ALL {
        let e = s
            .handle(m, Bytes::from_static(&[0xff; 9]), None)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{m:?}");
        assert!(
            e.message()
                .starts_with(&format!("undecodable {} request: ", m.label())),
            "{}",
            e.message()
        );
    }
    assert!(s.metrics.render().contains(
        "pegaflow_metaserver_invalid_requests_total{field=\"body\",method=\"heartbeat_node\"} 1"
    ));
}

/// A directory whose query holds its thread until a heartbeat arrives (at most 10 s): a
/// query run on the only async worker keeps the heartbeat out and times out.
struct Blocking {
    heartbeat_seen: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
    wait: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

#[async_trait]
impl Directory for Blocking {
    fn kind(&self) -> &'static str {
        "blocking"
    }
    async fn heartbeat(&self, _: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        let _ = self.heartbeat_seen.lock().unwrap().send(());
        Ok(HeartbeatAnswer {
            stale_after: Duration::from_secs(30),
            state_lost: false,
        })
    }
    async fn insert(
        &self,
        _: &NodeId,
        _: &str,
        _: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        Ok(InsertAnswer::default())
    }
    async fn remove(&self, _: &NodeId, _: &str, _: &[Vec<u8>]) -> Result<u64, DirectoryError> {
        Ok(0)
    }
    async fn query_prefix(
        &self,
        _: &str,
        hashes: &[Vec<u8>],
        _: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        // Blocks the thread, as a long walk does.
        match self
            .wait
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(10))
        {
            Ok(()) => Ok(vec![NodePrefix {
                node: "10.0.0.1:1".into(),
                prefix_len: hashes.len() as u32,
            }]),
            Err(_) => Err(DirectoryError::Unavailable(
                "no heartbeat came while the query ran".into(),
            )),
        }
    }
    async fn unregister(&self, _: &NodeId) -> Result<u64, DirectoryError> {
        Ok(0)
    }
    async fn resync(&self, _: &NodeId) -> Result<u64, DirectoryError> {
        Ok(0)
    }
}

/// One async worker: a large query that ran on it would keep the heartbeat from being
/// served until the query gave up.
#[tokio::test(flavor = "current_thread")]
async fn large_calls_run_off_the_async_workers() {
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = Arc::new(Blocking {
        heartbeat_seen: std::sync::Mutex::new(tx),
        wait: std::sync::Mutex::new(rx),
    });
    let s = Arc::new(MetaService::new(dir, Arc::new(Metrics::new(false))));
    let hashes: Vec<Vec<u8>> = (0..4096u32).map(|i| i.to_be_bytes().repeat(8)).collect();
    let big = QueryPrefixBlocksRequest {
        namespace: "ns".into(),
        block_hashes: hashes,
        exclude_node: String::new(),
    };
    assert!(big.encoded_len() > INLINE_BODY_BYTES);
    let q = {
        let s = s.clone();
        tokio::spawn(
            async move { call::<_, QueryPrefixBlocksResponse>(&s, Method::Query, big).await },
        )
    };
    tokio::task::yield_now().await;
    let t = Instant::now();
    let _: HeartbeatNodeResponse = call(
        &s,
        Method::Heartbeat,
        HeartbeatNodeRequest {
            node: "10.0.0.1:1".into(),
            node_id: uuid::Uuid::new_v4().to_string(),
        },
    )
    .await
    .unwrap();
    let answer = q.await.unwrap().expect("the query saw the heartbeat");
    assert_eq!(answer.nodes[0].prefix_len, 4096);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the heartbeat waited for the query"
    );
    assert!(s
        .metrics
        .render()
        .contains("pegaflow_metaserver_large_requests_total{method=\"query_prefix_blocks\"} 1"));
}

#[tokio::test]
async fn too_many_waiting_large_requests_answer_busy() {
    let (tx, rx) = std::sync::mpsc::channel();
    let keep = tx.clone();
    let dir = Arc::new(Blocking {
        heartbeat_seen: std::sync::Mutex::new(tx),
        wait: std::sync::Mutex::new(rx),
    });
    let s = Arc::new(MetaService::with_heavy_limits(
        dir,
        Arc::new(Metrics::new(false)),
        1,
        200 << 10,
    ));
    let big = || QueryPrefixBlocksRequest {
        namespace: "ns".into(),
        block_hashes: (0..4096u32).map(|i| i.to_be_bytes().repeat(8)).collect(),
        exclude_node: String::new(),
    };
    // One runs (blocked), one waits (about 150 KB), the third does not fit.
    let running = {
        let s = s.clone();
        let req = big();
        tokio::spawn(
            async move { call::<_, QueryPrefixBlocksResponse>(&s, Method::Query, req).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = {
        let s = s.clone();
        let req = big();
        tokio::spawn(
            async move { call::<_, QueryPrefixBlocksResponse>(&s, Method::Query, req).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let e = call::<_, QueryPrefixBlocksResponse>(&s, Method::Query, big())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    assert!(e.message().contains("busy"), "{}", e.message());
    keep.send(()).unwrap();
    keep.send(()).unwrap();
    running.await.unwrap().unwrap();
    waiting.await.unwrap().unwrap();
    assert!(s
        .metrics
        .render()
        .contains("pegaflow_metaserver_limit_refusals_total{limit=\"busy\"} 1"));
}
