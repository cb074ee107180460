//! The MetaServer's input bounds, end to end against our binary: oversized and empty fields
//! answer INVALID_ARGUMENT naming the field and the limit and store nothing; a client string
//! never reaches the log whole (at most 64 characters of it) and refusals are logged, rate
//! limited; bodies that do not decode (sent as raw HTTP/2 frames) answer INVALID_ARGUMENT;
//! a prefix query whose plan alternates between two nodes answers a cut plan that any client
//! can decode; the caps on nodes and on one node's entries answer RESOURCE_EXHAUSTED with the
//! figures; and million-hash queries from two clients leave a third client's heartbeats and
//! small queries prompt (their latencies are printed, not asserted).

mod common;

use std::time::{Duration, Instant};

use pegaflow_proto::meta_server_client::MetaServerClient;
use pegaflow_proto::{
    HeartbeatNodeRequest, InsertBlockHashesRequest, QueryPrefixBlocksRequest,
    QueryPrefixBlocksResponse, RemoveBlockHashesRequest, UnregisterNodeRequest,
};
use tonic::transport::Channel;

/// 1 MiB.
const MIB: usize = 1 << 20;

/// The filler of oversized strings: the log must never hold a run of 65 of them.
const FILLER: char = 'Z';

fn big(n: usize) -> String {
    std::iter::repeat_n(FILLER, n).collect()
}

fn session() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn h(i: u32) -> Vec<u8> {
    let mut v = [0u8; 32];
    v[..4].copy_from_slice(&i.to_be_bytes());
    v[28..].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    v.to_vec()
}

fn hs(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

async fn heartbeat(
    c: &mut MetaServerClient<Channel>,
    node: &str,
    id: &str,
) -> Result<(), tonic::Status> {
    c.heartbeat_node(HeartbeatNodeRequest {
        node: node.into(),
        node_id: id.into(),
    })
    .await
    .map(drop)
}

async fn insert(
    c: &mut MetaServerClient<Channel>,
    node: &str,
    id: &str,
    ns: &str,
    hashes: Vec<Vec<u8>>,
) -> Result<u64, tonic::Status> {
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
        r.inserted_count
    })
}

async fn query(
    c: &mut MetaServerClient<Channel>,
    ns: &str,
    hashes: Vec<Vec<u8>>,
    exclude: &str,
) -> Result<Vec<(String, u32)>, tonic::Status> {
    c.query_prefix_blocks(QueryPrefixBlocksRequest {
        namespace: ns.into(),
        block_hashes: hashes,
        exclude_node: exclude.into(),
    })
    .await
    .map(|r| {
        r.into_inner()
            .nodes
            .into_iter()
            .map(|n| (n.node, n.prefix_len))
            .collect()
    })
}

/// A client that accepts answers up to the protocol's 64 MiB.
async fn big_client(s: &common::Server) -> MetaServerClient<Channel> {
    s.client()
        .await
        .max_decoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES)
}

fn metric(s: &common::Server, series: &str) -> f64 {
    let (_, text) = common::http_get(&s.http, "/metrics");
    let all = common::samples(&text, "pegaflow_metaserver");
    let (name, labels) = series
        .split_once('{')
        .map_or((series, ""), |(n, l)| (n, l.trim_end_matches('}')));
    let mut labels: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    labels.sort();
    all.get(&(name.to_string(), labels.join(",")))
        .copied()
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

/// Asserts `r` is INVALID_ARGUMENT whose message contains every one of `want`, and is short
/// (no client string echoed beyond a short prefix).
fn assert_invalid<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>, want: &[&str]) {
    let e = r.expect_err(what);
    assert_eq!(
        e.code(),
        tonic::Code::InvalidArgument,
        "{what}: {}",
        e.message()
    );
    for w in want {
        assert!(
            e.message().contains(w),
            "{what}: {:?} lacks {w:?}",
            e.message()
        );
    }
    assert!(
        e.message().len() < 200,
        "{what}: a {}-byte message",
        e.message().len()
    );
}

/// The longest run of [`FILLER`] in `text`.
fn longest_filler_run(text: &str) -> usize {
    let (mut best, mut run) = (0, 0);
    for c in text.chars() {
        run = if c == FILLER { run + 1 } else { 0 };
        best = best.max(run);
    }
    best
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_empty_fields_are_refused_naming_the_field_and_the_limit() {
    let s = common::Server::start(&common::our_binary(), &[]);
    let mut c = big_client(&s).await;
    let (node, id) = ("10.0.0.1:50055", session());

    assert_invalid(
        "1 MiB node",
        heartbeat(&mut c, &big(MIB), &id).await,
        &["node is 1048576 bytes", "the limit is 256 bytes"],
    );
    assert_invalid(
        "1 MiB node_id",
        heartbeat(&mut c, node, &big(MIB)).await,
        &["node_id is 1048576 bytes", "the limit is 256 bytes"],
    );
    // The largest accepted address (256 bytes) registers.
    heartbeat(&mut c, &big(256), &session()).await.unwrap();
    assert_invalid(
        "257-byte node",
        heartbeat(&mut c, &big(257), &session()).await,
        &["node is 257 bytes"],
    );
    heartbeat(&mut c, node, &id).await.unwrap();

    assert_invalid(
        "1 MiB namespace",
        insert(&mut c, node, &id, &big(MIB), hs(0..1)).await,
        &["namespace is 1048576 bytes", "the limit is 1024 bytes"],
    );
    assert_invalid(
        "1 MiB hash",
        insert(&mut c, node, &id, "ns", vec![h(0), vec![7; MIB]]).await,
        &[
            "block_hashes[1] is 1048576 bytes",
            "the limit is 1024 bytes",
        ],
    );
    assert_invalid(
        "0-byte hash",
        insert(&mut c, node, &id, "ns", vec![h(0), h(1), vec![]]).await,
        &["block_hashes[2] is empty", "1 to 1024 bytes"],
    );
    let r = c
        .remove_block_hashes(RemoveBlockHashesRequest {
            namespace: "ns".into(),
            block_hashes: vec![vec![]],
            node: node.into(),
            node_id: id.clone(),
        })
        .await;
    assert_invalid("0-byte hash removed", r, &["block_hashes[0] is empty"]);
    assert_invalid(
        "1 MiB exclude_node",
        query(&mut c, "ns", hs(0..3), &big(MIB)).await,
        &["exclude_node is 1048576 bytes", "the limit is 256 bytes"],
    );
    assert_invalid(
        "1 MiB namespace queried",
        query(&mut c, &big(MIB), hs(0..3), "").await,
        &["namespace is 1048576 bytes"],
    );
    assert_invalid(
        "0-byte hash queried",
        query(&mut c, "ns", vec![h(0), vec![]], "").await,
        &["block_hashes[1] is empty"],
    );
    assert_invalid(
        "2^20 + 1 hashes",
        query(&mut c, "ns", vec![vec![1u8]; (1 << 20) + 1], "").await,
        &["block_hashes has 1048577 entries", "the limit is 1048576"],
    );
    let r = c
        .unregister_node(UnregisterNodeRequest {
            node: big(MIB),
            node_id: id.clone(),
        })
        .await;
    assert_invalid("1 MiB node unregistered", r, &["node is 1048576 bytes"]);

    // Nothing was stored by the refused inserts; the node is still served.
    assert_eq!(metric(&s, "pegaflow_metaserver_store_entries"), 0.0);
    assert_eq!(insert(&mut c, node, &id, "ns", hs(0..2)).await.unwrap(), 2);
    assert_eq!(
        query(&mut c, "ns", hs(0..3), "").await.unwrap(),
        vec![(node.to_string(), 2)]
    );
    assert!(
        metric(
            &s,
            "pegaflow_metaserver_invalid_requests_total{method=\"insert_block_hashes\",field=\"block_hashes\"}"
        ) >= 2.0
    );

    // A burst of refusals: logged, at most 64 characters of the value, rate limited.
    for _ in 0..200 {
        let _ = heartbeat(&mut c, &big(4096), &session()).await;
    }
    let log = s.log_text();
    assert!(
        longest_filler_run(&log) <= 64,
        "a client string longer than 64 characters reached the log ({} in a row)",
        longest_filler_run(&log)
    );
    let refusals = log
        .lines()
        .filter(|l| l.contains("refused") && l.contains("heartbeat_node"))
        .count();
    assert!(
        (1..=20).contains(&refusals),
        "{refusals} refusal lines for 200+ refusals:\n{log}"
    );
}

/// One gRPC request over a fresh HTTP/2 connection with `body` as the raw request body
/// (frames included), answering (grpc-status, grpc-message) from the headers or trailers.
async fn raw_grpc(addr: &str, path: &str, body: Vec<u8>) -> (i32, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.expect("h2 ready");
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut stream) = client.send_request(req, body.is_empty()).expect("send");
    if !body.is_empty() {
        stream.send_data(body.into(), true).expect("send data");
    }
    let resp = resp.await.expect("response");
    let (parts, mut recv) = resp.into_parts();
    let headers = if parts.headers.contains_key("grpc-status") {
        parts.headers
    } else {
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.expect("data");
            let _ = recv.flow_control().release_capacity(chunk.len());
        }
        recv.trailers().await.expect("trailers").expect("trailers")
    };
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("grpc-status");
    let message = headers
        .get("grpc-message")
        .map(|v| percent_decode(v.as_bytes()))
        .unwrap_or_default();
    (code, message)
}

fn percent_decode(b: &[u8]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&String::from_utf8_lossy(&b[i + 1..i + 3]), 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A gRPC frame: compression flag, big-endian length, payload.
fn frame(flag: u8, declared_len: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![flag];
    v.extend_from_slice(&declared_len.to_be_bytes());
    v.extend_from_slice(payload);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_do_not_decode_are_invalid_argument() {
    let s = common::Server::start(&common::our_binary(), &[]);
    let methods = [
        "HeartbeatNode",
        "UnregisterNode",
        "InsertBlockHashes",
        "RemoveBlockHashes",
        "QueryPrefixBlocks",
    ];
    // Field 31 with wire type 7: no such wire type.
    let garbage = [0xffu8; 12];
    // Field 1 (a string) holding bytes that are not UTF-8.
    let not_utf8 = [0x0a, 0x02, 0xff, 0xfe];
    for m in methods {
        let path = format!("/pegaflow.MetaServer/{m}");
        let cases: [(&str, Vec<u8>); 5] = [
            ("garbage", frame(0, garbage.len() as u32, &garbage)),
            ("not UTF-8", frame(0, not_utf8.len() as u32, &not_utf8)),
            ("no message", Vec::new()),
            ("truncated frame", frame(0, 100, &[0x0a, 0x01])),
            ("compressed without an encoding", frame(1, 0, &[])),
        ];
        for (what, body) in cases {
            let (code, msg) = raw_grpc(&s.grpc, &path, body).await;
            assert_eq!(
                code,
                tonic::Code::InvalidArgument as i32,
                "{m} {what}: {code} {msg:?}"
            );
            assert!(!msg.is_empty(), "{m} {what}: no message");
        }
    }
    // A well-formed heartbeat still works, on a raw connection too.
    let body = {
        use prost::Message;
        HeartbeatNodeRequest {
            node: "10.0.0.9:1".into(),
            node_id: session(),
        }
        .encode_to_vec()
    };
    let (code, msg) = raw_grpc(
        &s.grpc,
        "/pegaflow.MetaServer/HeartbeatNode",
        frame(0, body.len() as u32, &body),
    )
    .await;
    assert_eq!(code, 0, "{msg}");
    let (code, _) = raw_grpc(&s.grpc, "/pegaflow.MetaServer/PullBackupPlan", Vec::new()).await;
    assert_eq!(code, tonic::Code::Unimplemented as i32);
    assert_eq!(
        metric(
            &s,
            "pegaflow_metaserver_invalid_requests_total{method=\"query_prefix_blocks\",field=\"body\"}"
        ),
        5.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_alternating_between_two_nodes_is_cut_not_refused() {
    let s = common::Server::start(&common::our_binary(), &[]);
    // The default client: answers up to tonic's default 4 MiB.
    let mut c = s.client().await;
    let a = format!("10.0.0.1:{}", "1".repeat(256 - 9));
    let b = format!("10.0.0.2:{}", "2".repeat(256 - 9));
    let (sa, sb) = (session(), session());
    heartbeat(&mut c, &a, &sa).await.unwrap();
    heartbeat(&mut c, &b, &sb).await.unwrap();
    let n = 20_000u32;
    insert(&mut c, &a, &sa, "alt", (0..n).step_by(2).map(h).collect())
        .await
        .unwrap();
    insert(&mut c, &b, &sb, "alt", (1..n).step_by(2).map(h).collect())
        .await
        .unwrap();
    // The whole plan would be 20,000 segments of 256-byte addresses (over 5 MB).
    let plan = query(&mut c, "alt", hs(0..n), "")
        .await
        .expect("a cut plan");
    assert_eq!(plan.len(), 4096, "the plan is cut at 4096 segments");
    for (i, (node, len)) in plan.iter().enumerate() {
        assert_eq!(*len, 1);
        assert_eq!(node, if i % 2 == 0 { &a } else { &b });
    }
    assert_eq!(
        metric(&s, "pegaflow_metaserver_query_answers_cut_total"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_and_entry_caps_answer_resource_exhausted() {
    let s = common::Server::start(
        &common::our_binary(),
        &["--max-nodes", "2", "--max-blocks-per-node", "1000"],
    );
    let mut c = s.client().await;
    let (a, b) = ("10.0.0.1:1", "10.0.0.2:1");
    let (sa, sb) = (session(), session());
    heartbeat(&mut c, a, &sa).await.unwrap();
    heartbeat(&mut c, b, &sb).await.unwrap();
    let e = heartbeat(&mut c, "10.0.0.3:1", &session())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("2 registered nodes") && e.message().contains("max_nodes"),
        "{}",
        e.message()
    );
    // A registered node's heartbeat is no new node.
    heartbeat(&mut c, a, &sa).await.unwrap();

    assert_eq!(insert(&mut c, a, &sa, "ns", hs(0..900)).await.unwrap(), 900);
    let e = insert(&mut c, a, &sa, "ns", hs(900..1200))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("1000") && e.message().contains("max_blocks_per_node"),
        "{}",
        e.message()
    );
    // Nothing of the refused batch was kept; re-inserting what it holds is no growth.
    assert_eq!(
        query(&mut c, "ns", hs(0..1200), "").await.unwrap(),
        vec![(a.to_string(), 900)]
    );
    assert_eq!(insert(&mut c, a, &sa, "ns", hs(0..900)).await.unwrap(), 900);
    assert_eq!(
        insert(&mut c, a, &sa, "ns", hs(900..1000)).await.unwrap(),
        100
    );
    // Another node has its own quota; an unregistered node frees a place.
    assert_eq!(
        insert(&mut c, b, &sb, "ns", hs(0..1000)).await.unwrap(),
        1000
    );
    c.unregister_node(UnregisterNodeRequest {
        node: b.into(),
        node_id: sb,
    })
    .await
    .unwrap();
    heartbeat(&mut c, "10.0.0.3:1", &session()).await.unwrap();
    assert_eq!(
        metric(
            &s,
            "pegaflow_metaserver_limit_refusals_total{limit=\"max_nodes\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &s,
            "pegaflow_metaserver_limit_refusals_total{limit=\"max_blocks_per_node\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&s, "pegaflow_metaserver_limit{limit=\"max_nodes\"}"),
        2.0
    );
}

/// Percentile `p` (0–100) of `v` (sorted here).
fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() - 1) as f64 * p / 100.0).round() as usize;
    v[i]
}

/// Sends a query already encoded (a million hashes are encoded once, not per call).
#[derive(Clone, Copy, Default)]
struct PreEncoded;

struct BytesEncoder;

impl tonic::codec::Encoder for BytesEncoder {
    type Item = prost::bytes::Bytes;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Self::Item,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Self::Error> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Codec for PreEncoded {
    type Encode = prost::bytes::Bytes;
    type Decode = QueryPrefixBlocksResponse;
    type Encoder = BytesEncoder;
    type Decoder = tonic_prost::ProstDecoder<QueryPrefixBlocksResponse>;
    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }
    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

/// One QueryPrefixBlocks with the pre-encoded request `body`.
async fn query_encoded(
    g: &mut tonic::client::Grpc<Channel>,
    body: prost::bytes::Bytes,
) -> Result<Vec<(String, u32)>, tonic::Status> {
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/pegaflow.MetaServer/QueryPrefixBlocks");
    let r = g.unary(tonic::Request::new(body), path, PreEncoded).await?;
    Ok(r.into_inner()
        .nodes
        .into_iter()
        .map(|n| (n.node, n.prefix_len))
        .collect())
}

/// Two clients send million-hash queries back to back while a third heartbeats and asks
/// small queries every 20 ms: every answer is right; the third client's latencies are
/// printed (a benchmark's business to judge, not this test's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_hash_queries_with_concurrent_heartbeats() {
    use prost::Message;
    let s = common::Server::start(&common::our_binary(), &[]);
    let mut c = big_client(&s).await;
    let (a, sa) = ("10.0.0.1:50055", session());
    heartbeat(&mut c, a, &sa).await.unwrap();
    let n = 1u32 << 20;
    let all = hs(0..n);
    for chunk in all.chunks(1 << 16) {
        insert(&mut c, a, &sa, "big", chunk.to_vec()).await.unwrap();
    }
    let body = prost::bytes::Bytes::from(
        QueryPrefixBlocksRequest {
            namespace: "big".into(),
            block_hashes: all,
            exclude_node: String::new(),
        }
        .encode_to_vec(),
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut heavy = Vec::new();
    for _ in 0..2 {
        let ch = Channel::from_shared(format!("http://{}", s.grpc))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        let mut g = tonic::client::Grpc::new(ch)
            .max_decoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES);
        let (body, stop) = (body.clone(), stop.clone());
        heavy.push(tokio::spawn(async move {
            let mut done = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let plan = query_encoded(&mut g, body.clone())
                    .await
                    .expect("a million-hash query");
                assert_eq!(plan, vec![("10.0.0.1:50055".to_string(), n)]);
                done += 1;
            }
            done
        }));
    }
    let mut light = s.client().await;
    let (mut beats, mut small) = (Vec::new(), Vec::new());
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        let t = Instant::now();
        heartbeat(&mut light, a, &sa).await.expect("heartbeat");
        beats.push(t.elapsed());
        let t = Instant::now();
        let plan = query(&mut light, "big", hs(0..3), "").await.expect("query");
        small.push(t.elapsed());
        assert_eq!(plan, vec![(a.to_string(), 3)]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut big_queries = 0;
    for t in heavy {
        big_queries += t.await.expect("heavy client");
    }
    let over = small
        .iter()
        .filter(|d| **d > Duration::from_millis(100))
        .count();
    println!(
        "FIGURES: {big_queries} million-hash queries in 15 s from 2 clients; heartbeats \
         n={} p50={:?} p99={:?} max={:?}; 3-hash queries n={} p50={:?} p99={:?} max={:?}, \
         {:.1} % over 100 ms",
        beats.len(),
        percentile(&mut beats, 50.0),
        percentile(&mut beats, 99.0),
        percentile(&mut beats, 100.0),
        small.len(),
        percentile(&mut small, 50.0),
        percentile(&mut small, 99.0),
        percentile(&mut small, 100.0),
        100.0 * over as f64 / small.len().max(1) as f64,
    );
    assert!(big_queries > 0, "no million-hash query was answered");
}
