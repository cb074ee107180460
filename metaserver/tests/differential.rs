//! THE differential test: one RPC script run step by step against our `pegaflow-metaserver`
//! and PegaFlow 0.25.1's `pegaflow-metaserver-py` (both started with the same flags on
//! their own free ports), comparing every answer field by field (response fields, gRPC
//! codes and messages), then the `/metrics` samples the two export.
//!
//! PegaFlow's binary: `$PEGAFLOW_PY_METASERVER`, else the one `scripts/python-venv.sh`
//! installs in the workspace's `.venv`; without it the test reports itself skipped (`scripts/test.sh` counts it so).
//!
//! Differences allowed, each marked at its step ([`Check::SameCode`], [`Check::Differs`]):
//! - **The wording of a bad `node_id`**: both answer INVALID_ARGUMENT `invalid node_id: <the
//!   uuid crate's parse error>`; the crate's wording differs between its versions.
//! - **An empty `node`**: PegaFlow registers `""` as an address; we answer INVALID_ARGUMENT
//!   `node cannot be empty` (the `Directory` contract refuses an empty address).
//! - Metrics: PegaFlow's OpenTelemetry `otel_scope_name` label and `target_info` family are
//!   not compared, nor the histogram buckets and sums (timings); its sweep counters appear only
//!   after its first sweep (none runs here), ours from the start; the families of our bounds
//!   ([`OUR_FAMILIES`]) have no PegaFlow counterpart.
//!
//! Beyond agreeing with PegaFlow, some answers must also be what we expect ourselves (so
//! that a change on both sides does not go unnoticed): the `must` list.

mod common;

use std::time::Duration;

use pegaflow_proto::meta_server_client::MetaServerClient;
use pegaflow_proto::{
    HeartbeatNodeRequest, InsertBlockHashesRequest, QueryPrefixBlocksRequest,
    RemoveBlockHashesRequest, UnregisterNodeRequest,
};
use tonic::transport::Channel;

/// One answer, as compared.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Heartbeat {
        stale_after_secs: u64,
    },
    Unregister {
        removed_owners: u64,
    },
    Insert {
        ok: bool,
        message: String,
        inserted: u64,
        reclaimable: Vec<Vec<u8>>,
    },
    Remove {
        ok: bool,
        message: String,
        removed: u64,
    },
    Query(Vec<(String, u32)>),
    Error {
        code: tonic::Code,
        message: String,
    },
}

impl From<tonic::Status> for Answer {
    fn from(s: tonic::Status) -> Self {
        Answer::Error {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

enum Call {
    Heartbeat(String, String),
    Unregister(String, String),
    Insert(String, Vec<Vec<u8>>, String, String),
    Remove(String, Vec<Vec<u8>>, String, String),
    Query(String, Vec<Vec<u8>>),
    /// A query with `exclude_node` (0.25.1's field 3).
    QueryExcluding(String, Vec<Vec<u8>>, String),
}

enum Check {
    /// Every field equal.
    Exact,
    /// An error with the same code, and messages that both start with the prefix (the rest
    /// is the `uuid` crate's wording, which changed between its versions: PegaFlow's says
    /// `invalid length: expected length 32 for simple format, found 0`, ours `invalid
    /// length: found 0`).
    SameCode(&'static str),
    /// A difference kept on purpose: each side must give its own answer.
    Differs {
        ours: Answer,
        pegaflow: Answer,
        why: &'static str,
    },
}

enum Step {
    Call(&'static str, Call, Check),
    Sleep(Duration),
    CompareMetrics(&'static str),
}

async fn call(c: &mut MetaServerClient<Channel>, call: &Call) -> Answer {
    match call {
        Call::Heartbeat(node, id) => c
            .heartbeat_node(HeartbeatNodeRequest {
                node: node.clone(),
                node_id: id.clone(),
            })
            .await
            .map_or_else(Answer::from, |r| Answer::Heartbeat {
                stale_after_secs: r.into_inner().stale_after_secs,
            }),
        Call::Unregister(node, id) => c
            .unregister_node(UnregisterNodeRequest {
                node: node.clone(),
                node_id: id.clone(),
            })
            .await
            .map_or_else(Answer::from, |r| Answer::Unregister {
                removed_owners: r.into_inner().removed_owners,
            }),
        Call::Insert(ns, hashes, node, id) => c
            .insert_block_hashes(InsertBlockHashesRequest {
                namespace: ns.clone(),
                block_hashes: hashes.clone(),
                node: node.clone(),
                node_id: id.clone(),
            })
            .await
            .map_or_else(Answer::from, |r| {
                let r = r.into_inner();
                let s = r.status.unwrap_or_default();
                Answer::Insert {
                    ok: s.ok,
                    message: s.message,
                    inserted: r.inserted_count,
                    reclaimable: r.reclaimable_hashes,
                }
            }),
        Call::Remove(ns, hashes, node, id) => c
            .remove_block_hashes(RemoveBlockHashesRequest {
                namespace: ns.clone(),
                block_hashes: hashes.clone(),
                node: node.clone(),
                node_id: id.clone(),
            })
            .await
            .map_or_else(Answer::from, |r| {
                let r = r.into_inner();
                let s = r.status.unwrap_or_default();
                Answer::Remove {
                    ok: s.ok,
                    message: s.message,
                    removed: r.removed_count,
                }
            }),
        Call::Query(ns, hashes) | Call::QueryExcluding(ns, hashes, _) => c
            .query_prefix_blocks(QueryPrefixBlocksRequest {
                namespace: ns.clone(),
                block_hashes: hashes.clone(),
                exclude_node: match call {
                    Call::QueryExcluding(_, _, x) => x.clone(),
                    _ => String::new(),
                },
            })
            .await
            .map_or_else(Answer::from, |r| {
                Answer::Query(
                    r.into_inner()
                        .nodes
                        .into_iter()
                        .map(|n| (n.node, n.prefix_len))
                        .collect(),
                )
            }),
    }
}

fn h(i: u32) -> Vec<u8> {
    format!("diff-block-{i:03}").into_bytes()
}

fn hs(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

fn hb(stale: u64) -> Answer {
    Answer::Heartbeat {
        stale_after_secs: stale,
    }
}

fn inserted(n: u64, reclaimable: Vec<Vec<u8>>) -> Answer {
    Answer::Insert {
        ok: true,
        message: String::new(),
        inserted: n,
        reclaimable,
    }
}

fn q(v: &[(&str, u32)]) -> Vec<(String, u32)> {
    v.iter().map(|(n, l)| (n.to_string(), *l)).collect()
}

/// The gauges and counters both export, compared exactly (durations only by count).
/// Families our MetaServer exports beyond PegaFlow's (its bounds: `src/metrics.rs`).
const OUR_FAMILIES: [&str; 7] = [
    "pegaflow_metaserver_invalid_requests_total",
    "pegaflow_metaserver_limit_refusals_total",
    "pegaflow_metaserver_limit",
    "pegaflow_metaserver_query_answers_cut_total",
    "pegaflow_metaserver_large_requests_total",
    "pegaflow_metaserver_large_requests_waiting_bytes",
    "pegaflow_metaserver_store_bytes",
];

fn comparable(text: &str) -> std::collections::BTreeMap<(String, String), f64> {
    common::samples(text, "pegaflow_metaserver_")
        .into_iter()
        .filter(|((name, _), _)| {
            !name.contains("_sweep_removed_")
                && !name.ends_with("_bucket")
                && !name.ends_with("_sum")
                && !OUR_FAMILIES.contains(&name.as_str())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_metaserver_answers_as_pegaflows() {
    let Some(theirs_bin) = common::pegaflow_binary() else {
        pegaflow_test_skip::skip!("PegaFlow's metaserver not found (run scripts/python-venv.sh)");
        return;
    };
    let flags = [
        "--node-stale-secs",
        "2",
        "--ttl-minutes",
        "1",
        "--sweep-interval-secs",
        "600",
        "--min-reclaimable-owner-count",
        "3",
    ];
    let ours = common::Server::start(&common::our_binary(), &flags);
    let theirs = common::Server::start(&theirs_bin, &flags);
    let mut co = ours.client().await;
    let mut ct = theirs.client().await;

    let (a, b, c, d) = (
        "10.0.0.1:50055".to_string(),
        "10.0.0.2:50055".to_string(),
        "10.0.0.3:50055".to_string(),
        "10.0.0.4:50055".to_string(),
    );
    let id = || uuid::Uuid::new_v4().to_string();
    let (sa1, sa2, sb1, sc1, sc2, sd1) = (id(), id(), id(), id(), id(), id());
    let fp = |m: &str| Answer::Error {
        code: tonic::Code::FailedPrecondition,
        message: m.into(),
    };
    use Call::*;
    use Check::*;
    let steps: Vec<Step> = vec![
        Step::Call("register A", Heartbeat(a.clone(), sa1.clone()), Exact),
        Step::Call("refresh A", Heartbeat(a.clone(), sa1.clone()), Exact),
        Step::Call(
            "second live session for A",
            Heartbeat(a.clone(), sa2.clone()),
            Exact,
        ),
        Step::Call("register B", Heartbeat(b.clone(), sb1.clone()), Exact),
        Step::Call("register C", Heartbeat(c.clone(), sc1.clone()), Exact),
        Step::Call(
            "empty node_id",
            Heartbeat(d.clone(), String::new()),
            SameCode("invalid node_id: invalid length"),
        ),
        Step::Call(
            "node_id not a UUID",
            Heartbeat(d.clone(), "node-1".into()),
            SameCode("invalid node_id: invalid character"),
        ),
        Step::Call(
            "A inserts h0..h5",
            Insert("ns1".into(), hs(0..6), a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "A inserts again",
            Insert("ns1".into(), hs(0..6), a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "B inserts h0,h1,h3",
            Insert("ns1".into(), vec![h(0), h(1), h(3)], b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "C inserts h0..h2: 3 owners of h0,h1",
            Insert("ns1".into(), hs(0..3), c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "C inserts in ns2",
            Insert("ns2".into(), vec![h(0)], c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "upper-case session",
            Insert("ns1".into(), vec![h(7)], a.clone(), sa1.to_uppercase()),
            Exact,
        ),
        Step::Call(
            "simple-form session",
            Insert("ns1".into(), vec![h(8)], a.clone(), sa1.replace('-', "")),
            Exact,
        ),
        Step::Call(
            "braced session",
            Insert("ns1".into(), vec![h(8)], a.clone(), format!("{{{sa1}}}")),
            Exact,
        ),
        Step::Call(
            "urn session",
            Insert(
                "ns1".into(),
                vec![h(8)],
                a.clone(),
                format!("urn:uuid:{sa1}"),
            ),
            Exact,
        ),
        Step::Call("refresh A", Heartbeat(a.clone(), sa1.clone()), Exact),
        Step::Call("refresh B", Heartbeat(b.clone(), sb1.clone()), Exact),
        Step::Call("refresh C", Heartbeat(c.clone(), sc1.clone()), Exact),
        Step::Call("query ns1 h0..h6", Query("ns1".into(), hs(0..7)), Exact),
        Step::Call("query ns1 h1..h6", Query("ns1".into(), hs(1..7)), Exact),
        Step::Call("query ns2", Query("ns2".into(), hs(0..3)), Exact),
        Step::Call(
            "query a hash nobody holds",
            Query("ns2".into(), vec![h(9)]),
            Exact,
        ),
        Step::Call("empty query", Query("ns1".into(), vec![]), Exact),
        Step::Call("empty namespace", Query(String::new(), vec![h(0)]), Exact),
        Step::Call(
            "insert by an unknown node",
            Insert("ns1".into(), vec![h(0)], d.clone(), sd1.clone()),
            Exact,
        ),
        Step::Call(
            "insert by a non-holding session",
            Insert("ns1".into(), vec![h(0)], a.clone(), sa2.clone()),
            Exact,
        ),
        Step::Call(
            "insert without hashes",
            Insert("ns1".into(), vec![], a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "remove without hashes",
            Remove("ns1".into(), vec![], a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "insert with a bad node_id",
            Insert("ns1".into(), vec![h(0)], a.clone(), "zz".into()),
            SameCode("invalid node_id: invalid character"),
        ),
        Step::Call(
            "remove by a non-holding session",
            Remove("ns1".into(), vec![h(0)], a.clone(), sa2.clone()),
            Exact,
        ),
        Step::Call(
            "B removes a hash it does not own",
            Remove("ns1".into(), vec![h(4)], b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "A removes h1 (and h9, never held)",
            Remove("ns1".into(), vec![h(1), h(9)], a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "query after the removal",
            Query("ns1".into(), hs(0..7)),
            Exact,
        ),
        Step::Call(
            "unregister by a non-holding session",
            Unregister(a.clone(), sa2.clone()),
            Exact,
        ),
        Step::Call(
            "unregister an unknown node",
            Unregister(d.clone(), sd1.clone()),
            Exact,
        ),
        Step::Call("unregister B", Unregister(b.clone(), sb1.clone()), Exact),
        Step::Call(
            "unregister B again",
            Unregister(b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "insert after unregister",
            Insert("ns1".into(), vec![h(0)], b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call("query without B", Query("ns1".into(), hs(0..7)), Exact),
        Step::Call(
            "B registers again",
            Heartbeat(b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "B re-inserts h0: third live owner",
            Insert("ns1".into(), vec![h(0)], b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "C removes h2 twice in one batch",
            Remove("ns1".into(), vec![h(2), h(2)], c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "A inserts two runs in `plan`",
            Insert(
                "plan".into(),
                vec![h(0), h(1), h(2), h(5), h(6), h(7)],
                a.clone(),
                sa1.clone(),
            ),
            Exact,
        ),
        Step::Call(
            "B inserts the gap between them",
            Insert("plan".into(), vec![h(3), h(4)], b.clone(), sb1.clone()),
            Exact,
        ),
        Step::Call(
            "C ties with A's first run",
            Insert("plan".into(), hs(0..3), c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "a plan of three segments",
            Query("plan".into(), hs(0..10)),
            Exact,
        ),
        Step::Call(
            "a plan starting mid-way",
            Query("plan".into(), hs(4..10)),
            Exact,
        ),
        Step::Call(
            "a plan without A (exclude_node)",
            QueryExcluding("plan".into(), hs(0..10), a.clone()),
            Exact,
        ),
        Step::Call(
            "a plan excluding an unknown node",
            QueryExcluding("plan".into(), hs(0..10), "10.255.0.1:1".into()),
            Exact,
        ),
        Step::CompareMetrics("before the nodes go stale"),
        Step::Sleep(Duration::from_millis(3200)),
        Step::Call(
            "query while every node is stale",
            Query("ns1".into(), hs(0..7)),
            Exact,
        ),
        Step::Call(
            "a stale session still inserts (and is refreshed)",
            Insert("ns1".into(), vec![h(9)], a.clone(), sa1.clone()),
            Exact,
        ),
        Step::Call(
            "no takeover of the refreshed A",
            Heartbeat(a.clone(), sa2.clone()),
            Exact,
        ),
        Step::Call(
            "takeover of stale C",
            Heartbeat(c.clone(), sc2.clone()),
            Exact,
        ),
        Step::Call(
            "the replaced session inserts",
            Insert("ns1".into(), vec![h(5)], c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "the replaced session removes",
            Remove("ns1".into(), vec![h(0)], c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "the replaced session heartbeats",
            Heartbeat(c.clone(), sc1.clone()),
            Exact,
        ),
        Step::Call(
            "query after the takeover",
            Query("ns1".into(), hs(0..7)),
            Exact,
        ),
        Step::Call(
            "the new session of C inserts h0",
            Insert("ns1".into(), vec![h(0)], c.clone(), sc2.clone()),
            Exact,
        ),
        Step::CompareMetrics("after the takeover"),
        Step::Call(
            "unregister C (the replaced session's records too)",
            Unregister(c.clone(), sc2.clone()),
            Exact,
        ),
        Step::Call("unregister A", Unregister(a.clone(), sa1.clone()), Exact),
        Step::CompareMetrics("at the end"),
        Step::Call(
            "empty node",
            Heartbeat(String::new(), sd1.clone()),
            Differs {
                ours: Answer::Error {
                    code: tonic::Code::InvalidArgument,
                    message: "node cannot be empty".into(),
                },
                pegaflow: hb(2),
                why:
                    "an empty address can never be fetched from; the Directory contract refuses it",
            },
        ),
    ];

    // Expectations of our own, beyond agreeing with PegaFlow (so that a change on both
    // sides does not go unnoticed).
    let must = [
        ("second live session for A", fp("stale node session")),
        (
            "C inserts h0..h2: 3 owners of h0,h1",
            inserted(3, vec![h(0), h(1)]),
        ),
        ("insert by an unknown node", fp("unknown node")),
        ("unregister B", Answer::Unregister { removed_owners: 3 }),
        ("B re-inserts h0: third live owner", inserted(1, vec![h(0)])),
        ("takeover of stale C", hb(2)),
        ("the replaced session inserts", fp("stale node session")),
        (
            "unregister C (the replaced session's records too)",
            Answer::Unregister { removed_owners: 6 },
        ),
        ("unregister A", Answer::Unregister { removed_owners: 14 }),
        // Cover plans: C for h0..h2, then A, whose run from h3 is the longest, for h3..h5.
        ("query ns1 h0..h6", Answer::Query(q(&[(&a, 6)]))),
        ("query ns1 h1..h6", Answer::Query(q(&[(&a, 5)]))),
        ("query ns2", Answer::Query(q(&[(&c, 1)]))),
        (
            "query after the removal",
            Answer::Query(q(&[(&c, 3), (&a, 3)])),
        ),
        ("query without B", Answer::Query(q(&[(&c, 3), (&a, 3)]))),
        ("query after the takeover", Answer::Query(q(&[(&a, 1)]))),
        // A and C tie on h0..h2: the smaller address; A serves two segments.
        (
            "a plan of three segments",
            Answer::Query(q(&[(&a, 3), (&b, 2), (&a, 3)])),
        ),
        // Without A, C takes h0..h2, B h3..h4, and nobody else holds h5.
        (
            "a plan without A (exclude_node)",
            Answer::Query(q(&[(&c, 3), (&b, 2)])),
        ),
        (
            "a plan starting mid-way",
            Answer::Query(q(&[(&b, 1), (&a, 3)])),
        ),
    ];

    let mut failures = Vec::new();
    for step in &steps {
        match step {
            Step::Sleep(d) => tokio::time::sleep(*d).await,
            Step::CompareMetrics(when) => {
                let (co_code, mo) = common::http_get(&ours.http, "/metrics");
                let (ct_code, mt) = common::http_get(&theirs.http, "/metrics");
                assert_eq!((co_code, ct_code), (200, 200));
                let (mo, mt) = (comparable(&mo), comparable(&mt));
                for family in [
                    "pegaflow_metaserver_store_entries",
                    "pegaflow_metaserver_rpc_requests_total",
                ] {
                    assert!(
                        mt.keys().any(|(n, _)| n == family),
                        "PegaFlow exports no {family}: {mt:?}"
                    );
                }
                if mo != mt {
                    failures.push(format!(
                        "metrics {when}:\n  ours:     {mo:?}\n  pegaflow: {mt:?}"
                    ));
                }
            }
            Step::Call(name, c, check) => {
                let o = call(&mut co, c).await;
                let t = call(&mut ct, c).await;
                println!("{name}:\n  ours:     {o:?}\n  pegaflow: {t:?}");
                let ok = match check {
                    Exact => o == t,
                    SameCode(prefix) => match (&o, &t) {
                        (
                            Answer::Error { code, message },
                            Answer::Error {
                                code: tc,
                                message: tm,
                            },
                        ) => code == tc && message.starts_with(prefix) && tm.starts_with(prefix),
                        _ => false,
                    },
                    Differs {
                        ours,
                        pegaflow,
                        why,
                    } => {
                        println!("  (allowed difference: {why})");
                        &o == ours && &t == pegaflow
                    }
                };
                if !ok {
                    failures.push(format!("{name}:\n  ours:     {o:?}\n  pegaflow: {t:?}"));
                }
                if let Some((_, want)) = must.iter().find(|(n, _)| n == name) {
                    if &o != want {
                        failures.push(format!("{name}: ours {o:?}, expected {want:?}"));
                    }
                }
            }
        }
    }
    for s in [&ours, &theirs] {
        let (code, body) = common::http_get(&s.http, "/health");
        assert_eq!((code, body.trim()), (200, "ok"), "{}", s.grpc);
    }
    assert!(
        failures.is_empty(),
        "{} difference(s) from PegaFlow:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The sweep, on both: a replaced session's records are dropped by the next sweep (the TTL
/// rule, a minute at least, is left to the unit tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_drops_a_replaced_sessions_records_as_pegaflows() {
    let Some(theirs_bin) = common::pegaflow_binary() else {
        pegaflow_test_skip::skip!("PegaFlow's metaserver not found (run scripts/python-venv.sh)");
        return;
    };
    let flags = [
        "--node-stale-secs",
        "1",
        "--ttl-minutes",
        "1",
        "--sweep-interval-secs",
        "1",
    ];
    let ours = common::Server::start(&common::our_binary(), &flags);
    let theirs = common::Server::start(&theirs_bin, &flags);
    let node = "10.0.0.7:50055".to_string();
    let (old, new) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let mut clients = [ours.client().await, theirs.client().await];
    for c in clients.iter_mut() {
        let a = call(c, &Call::Heartbeat(node.clone(), old.clone())).await;
        assert_eq!(a, hb(1));
        let a = call(
            c,
            &Call::Insert("ns".into(), hs(0..2), node.clone(), old.clone()),
        )
        .await;
        assert_eq!(a, inserted(2, vec![]));
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    for c in clients.iter_mut() {
        assert_eq!(
            call(c, &Call::Heartbeat(node.clone(), new.clone())).await,
            hb(1)
        );
        let a = call(
            c,
            &Call::Insert("ns".into(), hs(5..6), node.clone(), new.clone()),
        )
        .await;
        assert_eq!(a, inserted(1, vec![]));
    }
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let pick = |text: &str| {
        common::samples(text, "pegaflow_metaserver_")
            .into_iter()
            .filter(|((n, _), _)| {
                n.contains("_sweep_removed_")
                    || n.ends_with("_store_entries")
                    || n.ends_with("_block_owners")
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let mo = pick(&common::http_get(&ours.http, "/metrics").1);
    let mt = pick(&common::http_get(&theirs.http, "/metrics").1);
    assert_eq!(mo, mt, "ours vs PegaFlow's after the sweeps");
    let get = |m: &std::collections::BTreeMap<(String, String), f64>, n: &str| {
        m.get(&(n.to_string(), String::new())).copied()
    };
    assert_eq!(
        get(&mo, "pegaflow_metaserver_sweep_removed_owners_total"),
        Some(2.0)
    );
    assert_eq!(
        get(&mo, "pegaflow_metaserver_sweep_removed_keys_total"),
        Some(2.0)
    );
    assert_eq!(get(&mo, "pegaflow_metaserver_store_entries"), Some(1.0));
}
