//! The `redis` directory against a real `redis-server` (started by each test on a free
//! loopback port in a temporary directory, `pegaflow_tests::redis`): the shared conformance
//! suite, split batches, owner-checked removal, takeover after expiry, native expiry, a
//! frozen (SIGSTOP), down, killed, restarted, flushed or reloaded Redis, a lost heartbeat
//! answer. Each test reports itself skipped and returns where `redis-server` is not installed
//! (`.ci/run` installs it). `throughput` (ignored) prints figures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_directory::redis_dir::{RedisConfig, RedisDirectory};
use pegaflow_plugin::{Directory, DirectoryError, NodeId, NodePrefix};
use pegaflow_tests::directory_suite::{
    fields_past_their_bounds_are_invalid, run_all, DirectoryFixture,
};
use pegaflow_tests::redis::RedisServer;

fn h(i: u32) -> Vec<u8> {
    let mut v = b"redis-test-".to_vec();
    v.extend_from_slice(&i.to_be_bytes());
    v
}

fn hashes(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

fn np(node: &NodeId, prefix_len: u32) -> NodePrefix {
    NodePrefix {
        node: node.addr.clone(),
        prefix_len,
    }
}

/// A unique key prefix per directory, so directories on one server start empty.
fn fresh_prefix() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "test:{}:{}:",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn config(url: &str) -> RedisConfig {
    RedisConfig {
        url: url.to_string(),
        key_prefix: fresh_prefix(),
        stale_after_secs: 2,
        ttl_minutes: 5,
        timeout_ms: 250,
        ..RedisConfig::default()
    }
}

fn open(cfg: RedisConfig) -> RedisDirectory {
    RedisDirectory::connect(cfg).expect("a valid config")
}

/// Retries `f` every 50 ms until it answers Ok, for up to 10 s.
async fn until_ok<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, DirectoryError>>,
{
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => {
                assert!(
                    Instant::now() < end,
                    "{what}: still failing after 10 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

struct Fixture {
    url: String,
}

impl DirectoryFixture for Fixture {
    fn open(&self) -> Arc<dyn Directory> {
        let cfg = RedisConfig {
            // The large-batch case sends 40 scripts of 1024 hashes; a debug build on a
            // loaded 2-core machine needs more than the production default per answer.
            timeout_ms: 250,
            ..config(&self.url)
        };
        Arc::new(open(cfg))
    }
    fn stale_after(&self) -> Duration {
        Duration::from_secs(2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite() {
    let Some(redis) = RedisServer::start("conformance_suite") else {
        return;
    };
    let f = Fixture { url: redis.url() };
    run_all(&f).await;
    fields_past_their_bounds_are_invalid(&f).await;
}

#[tokio::test]
async fn insert_query_remove_resync_unregister() {
    let Some(redis) = RedisServer::start("insert_query_remove_resync_unregister") else {
        return;
    };
    let d = open(config(&redis.url()));
    assert_eq!(d.kind(), "redis");
    let a = NodeId::new_session("10.0.0.1:50055");
    let b = NodeId::new_session("10.0.0.2:50055");
    assert!(d.heartbeat(&a).await.unwrap().state_lost);
    assert!(!d.heartbeat(&a).await.unwrap().state_lost);
    assert!(d.heartbeat(&b).await.unwrap().state_lost);

    let got = d.insert(&a, "ns", &hashes(0..4)).await.unwrap();
    assert_eq!(got.inserted, 4);
    assert!(got.reclaimable.is_empty());
    d.insert(&b, "ns", &hashes(0..2)).await.unwrap();
    // The cover plan: a's run from h0 is the longest and covers all that is held.
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&a, 4)]
    );
    assert!(d
        .query_prefix("other", &hashes(0..6), None)
        .await
        .unwrap()
        .is_empty());
    assert!(matches!(
        d.query_prefix("ns", &[], None).await,
        Err(DirectoryError::Invalid(_))
    ));

    // a: h0 h2 h3, b: h0 h1: b takes h0..h2, a goes on with h2..h4.
    assert_eq!(d.remove(&a, "ns", &hashes(1..2)).await.unwrap(), 1);
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&b, 2), np(&a, 2)]
    );
    // Nobody holds h1 any more (Redis deleted the emptied key); a tie at h0 goes to the
    // smaller address.
    assert_eq!(d.remove(&b, "ns", &hashes(1..2)).await.unwrap(), 1);
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&a, 1)]
    );

    // Resync: 3 entries left of a (h0, h2, h3); hidden at once, node still registered.
    assert_eq!(d.resync(&a).await.unwrap(), 3);
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&b, 1)]
    );
    assert!(!d.heartbeat(&a).await.unwrap().state_lost);
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&a, 3)]
    );

    // Unregister answers what the session owned, then the session is unknown.
    assert_eq!(d.unregister(&a).await.unwrap(), 3);
    assert!(matches!(
        d.unregister(&a).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert!(matches!(
        d.insert(&a, "ns", &hashes(0..1)).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert!(matches!(
        d.resync(&a).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert_eq!(
        d.query_prefix("ns", &hashes(0..6), None).await.unwrap(),
        vec![np(&b, 1)]
    );
    assert!(matches!(
        d.heartbeat(&NodeId {
            addr: String::new(),
            session: "s".into()
        })
        .await,
        Err(DirectoryError::Invalid(_))
    ));
}

/// Batches longer than `script_batch` are split into pipelined scripts: counts,
/// reclaimable positions and cover plans (runs joined across script boundaries) come out as
/// for one script.
#[tokio::test]
async fn batches_split_across_scripts() {
    let Some(redis) = RedisServer::start("batches_split_across_scripts") else {
        return;
    };
    let d = open(RedisConfig {
        script_batch: 7,
        ..config(&redis.url())
    });
    let nodes: Vec<NodeId> = (0..3)
        .map(|i| NodeId::new_session(format!("10.0.1.{i}:1")))
        .collect();
    for n in &nodes {
        d.heartbeat(n).await.unwrap();
    }
    let all = hashes(0..50);
    d.insert(&nodes[0], "ns", &all).await.unwrap();
    d.insert(&nodes[1], "ns", &all[..30]).await.unwrap();
    let third = d.insert(&nodes[2], "ns", &all[..20]).await.unwrap();
    assert_eq!(third.inserted, 20);
    assert_eq!(third.reclaimable, all[..20].to_vec(), "in batch order");
    assert_eq!(
        d.query_prefix("ns", &all, None).await.unwrap(),
        vec![np(&nodes[0], 50)]
    );
    // A gap in node 0's run exactly at a script boundary (14 = 2 × 7): node 1 takes
    // h0..h30, node 0 the rest of its run (h30..h50).
    assert_eq!(d.remove(&nodes[0], "ns", &all[14..15]).await.unwrap(), 1);
    assert_eq!(
        d.query_prefix("ns", &all, None).await.unwrap(),
        vec![np(&nodes[1], 30), np(&nodes[0], 20)]
    );
    // Nobody holds h35: the plan stops there, in the sixth script.
    assert_eq!(d.remove(&nodes[0], "ns", &all[35..36]).await.unwrap(), 1);
    assert_eq!(
        d.query_prefix("ns", &all, None).await.unwrap(),
        vec![np(&nodes[1], 30), np(&nodes[0], 5)]
    );
    assert_eq!(d.remove(&nodes[0], "ns", &all).await.unwrap(), 48);
    // Duplicates in one batch count once as new.
    let dup = vec![h(100), h(100)];
    assert_eq!(d.insert(&nodes[0], "ns", &dup).await.unwrap().inserted, 2);
    assert_eq!(d.remove(&nodes[0], "ns", &dup).await.unwrap(), 1);
}

/// A session removes only its own ownership: another node's entry stays, and another
/// session of the same address is refused while the holder is live; once it took the
/// address over, the old session's entries are invisible and not counted as its removals.
#[tokio::test]
async fn removal_is_owner_checked_and_takeover_waits_for_expiry() {
    let Some(redis) = RedisServer::start("removal_is_owner_checked_and_takeover_waits_for_expiry")
    else {
        return;
    };
    let d = open(RedisConfig {
        stale_after_secs: 1,
        ..config(&redis.url())
    });
    let a = NodeId::new_session("10.0.2.1:1");
    let other = NodeId::new_session("10.0.2.2:1");
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&other).await.unwrap();
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert_eq!(d.remove(&other, "ns", &hashes(0..3)).await.unwrap(), 0);

    let b = NodeId::new_session(a.addr.clone());
    assert!(matches!(
        d.heartbeat(&b).await,
        Err(DirectoryError::SessionConflict(_))
    ));
    assert!(matches!(
        d.remove(&b, "ns", &hashes(0..3)).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert!(matches!(
        d.insert(&b, "ns", &hashes(0..3)).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );

    // An insert touches the node like a heartbeat; then silence past the stale interval.
    tokio::time::sleep(Duration::from_millis(600)).await;
    d.insert(&a, "ns", &hashes(3..4)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        matches!(
            d.heartbeat(&b).await,
            Err(DirectoryError::SessionConflict(_))
        ),
        "the insert 600 ms ago kept a live"
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(d
        .query_prefix("ns", &hashes(0..3), None)
        .await
        .unwrap()
        .is_empty());
    assert!(d.heartbeat(&b).await.unwrap().state_lost);
    assert_eq!(d.remove(&b, "ns", &hashes(0..3)).await.unwrap(), 0);
    assert!(matches!(
        d.heartbeat(&a).await,
        Err(DirectoryError::SessionConflict(_))
    ));
    d.insert(&b, "ns", &hashes(0..2)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&b, 2)]
    );
}

/// Every kind of call on `d`, each checked to answer `Unavailable` within `bound`.
async fn all_calls_unavailable(d: &RedisDirectory, node: &NodeId, bound: Duration) {
    macro_rules! check {
        ($what:literal, $call:expr) => {{
            let t = Instant::now();
            let r = $call.await;
            let took = t.elapsed();
            assert!(
                matches!(r, Err(DirectoryError::Unavailable(_))),
                "{}: want Unavailable, got {r:?}",
                $what
            );
            assert!(took < bound, "{}: answered after {took:?}", $what);
        }};
    }
    check!("heartbeat", d.heartbeat(node));
    check!("insert", d.insert(node, "ns", &hashes(0..3)));
    check!("remove", d.remove(node, "ns", &hashes(0..1)));
    check!("query", d.query_prefix("ns", &hashes(0..3), None));
    check!("resync", d.resync(node));
    check!("unregister", d.unregister(node));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_redis_answers_unavailable_within_the_timeout() {
    let Some(redis) = RedisServer::start("frozen_redis_answers_unavailable_within_the_timeout")
    else {
        return;
    };
    let cfg = RedisConfig {
        stale_after_secs: 30,
        timeout_ms: 200,
        ..config(&redis.url())
    };
    let bound = 5 * cfg.timeout();
    let d = Arc::new(open(cfg));
    let a = NodeId::new_session("10.0.3.1:1");
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();

    redis.freeze();
    all_calls_unavailable(&d, &a, bound).await;
    // Many calls at once: none waits for another past its own timeout.
    let t = Instant::now();
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let d = d.clone();
            tokio::spawn(async move { d.query_prefix("ns", &hashes(0..3), None).await })
        })
        .collect();
    for c in calls {
        assert!(matches!(
            c.await.unwrap(),
            Err(DirectoryError::Unavailable(_))
        ));
    }
    assert!(
        t.elapsed() < bound,
        "16 concurrent queries took {:?}",
        t.elapsed()
    );
    // A second round, on a connection made while Redis is frozen.
    all_calls_unavailable(&d, &a, bound).await;

    redis.thaw();
    let hb = until_ok("heartbeat after SIGCONT", || d.heartbeat(&a)).await;
    assert!(!hb.state_lost, "a frozen Redis keeps its data");
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );
}

#[tokio::test]
async fn redis_down_at_start_then_killed_and_restarted() {
    let Some(mut redis) = RedisServer::start("redis_down_at_start_then_killed_and_restarted")
    else {
        return;
    };
    redis.kill();
    // The server starts without Redis; calls answer Unavailable quickly.
    let cfg = config(&redis.url());
    let bound = 5 * cfg.timeout();
    let d = open(cfg);
    let a = NodeId::new_session("10.0.4.1:1");
    all_calls_unavailable(&d, &a, bound).await;

    redis.restart();
    let hb = until_ok("heartbeat once Redis is up", || d.heartbeat(&a)).await;
    assert!(hb.state_lost);
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();

    // Killed: Unavailable; restarted empty: the next heartbeat says state was lost, and
    // inserting again works.
    redis.kill();
    all_calls_unavailable(&d, &a, bound).await;
    redis.restart();
    let hb = until_ok("heartbeat after the restart", || d.heartbeat(&a)).await;
    assert!(hb.state_lost, "an empty Redis lost the node's entries");
    assert!(d
        .query_prefix("ns", &hashes(0..3), None)
        .await
        .unwrap()
        .is_empty());
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );
}

#[tokio::test]
async fn flushall_is_seen_at_the_next_heartbeat() {
    let Some(redis) = RedisServer::start("flushall_is_seen_at_the_next_heartbeat") else {
        return;
    };
    let d = open(config(&redis.url()));
    let a = NodeId::new_session("10.0.5.1:1");
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert!(redis.command(&["FLUSHALL"]).contains("OK"));
    assert!(matches!(
        d.insert(&a, "ns", &hashes(0..3)).await,
        Err(DirectoryError::UnknownNode(_))
    ));
    assert!(d.heartbeat(&a).await.unwrap().state_lost);
    assert!(!d.heartbeat(&a).await.unwrap().state_lost);
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );
    // SCRIPT FLUSH: the scripts are loaded again on NOSCRIPT.
    assert!(redis.command(&["SCRIPT", "FLUSH"]).contains("OK"));
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );
}

/// A restart that reloads the data (SAVE, then a new process on the same directory):
/// the node record comes back, but the new `run_id` makes the next heartbeat answer
/// `state_lost` and hide the reloaded entries until the node inserts again.
#[tokio::test]
async fn restart_with_data_kept_is_seen_through_the_run_id() {
    let Some(mut redis) = RedisServer::start("restart_with_data_kept_is_seen_through_the_run_id")
    else {
        return;
    };
    let d = open(config(&redis.url()));
    let a = NodeId::new_session("10.0.6.1:1");
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert!(redis.command(&["SAVE"]).contains("OK"));
    redis.restart();
    assert!(
        redis.command(&["DBSIZE"]).contains(":5"),
        "the data was reloaded"
    );
    // The connection the directory held died with the old process: the call finds it
    // dead, connects again and succeeds.
    let hb = d
        .heartbeat(&a)
        .await
        .expect("the first heartbeat after the restart");
    assert!(hb.state_lost, "a new Redis process is a loss of state");
    assert!(d
        .query_prefix("ns", &hashes(0..3), None)
        .await
        .unwrap()
        .is_empty());
    assert!(!d.heartbeat(&a).await.unwrap().state_lost);
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns", &hashes(0..3), None).await.unwrap(),
        vec![np(&a, 3)]
    );
}

/// The caps: `max_nodes` counts live node records (an unregistered or expired one frees
/// its place), `max_blocks_per_node` the record's entries, and a refused insert spread over
/// several scripts keeps nothing, the scripts that ran before and after the refusing one
/// included. Field bounds answer `Invalid` before Redis is asked.
#[tokio::test]
async fn caps_and_field_bounds() {
    let Some(redis) = RedisServer::start("caps_and_field_bounds") else {
        return;
    };
    let cfg = RedisConfig {
        max_nodes: 2,
        max_blocks_per_node: 1500,
        script_batch: 512,
        ..config(&redis.url())
    };
    let d = open(cfg);
    let (a, b, c) = (
        NodeId::new_session("10.0.9.1:1"),
        NodeId::new_session("10.0.9.2:1"),
        NodeId::new_session("10.0.9.3:1"),
    );
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&b).await.unwrap();
    match d.heartbeat(&c).await {
        Err(DirectoryError::LimitReached { limit, message }) => {
            assert_eq!(limit, "max_nodes");
            assert!(
                message.contains("2 live nodes; the limit is 2"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    d.heartbeat(&a).await.unwrap();

    assert_eq!(
        d.insert(&a, "ns", &hashes(0..1000)).await.unwrap().inserted,
        1000
    );
    // Scripts of 512: the first adds 312, the second would pass 1500 and is refused, the
    // third (176 new) fits again; all of it is taken back.
    match d.insert(&a, "ns", &hashes(800..2000)).await {
        Err(DirectoryError::LimitReached { limit, message }) => {
            assert_eq!(limit, "max_blocks_per_node");
            assert!(message.contains("the limit is 1500"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        d.query_prefix("ns", &hashes(0..2000), None).await.unwrap(),
        vec![np(&a, 1000)]
    );
    assert!(d
        .query_prefix("ns", &hashes(1000..2000), None)
        .await
        .unwrap()
        .is_empty());
    // Re-inserting owned entries is no growth; 500 more fit exactly.
    d.insert(&a, "ns", &hashes(0..1000)).await.unwrap();
    d.insert(&a, "ns", &hashes(1000..1500)).await.unwrap();
    assert!(d.insert(&a, "ns", &hashes(1500..1501)).await.is_err());

    let invalid = |r: Result<(), DirectoryError>, what: &str| match r {
        Err(DirectoryError::Invalid(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{what}: {other:?}"),
    };
    invalid(
        d.heartbeat(&NodeId::new_session("n".repeat(257)))
            .await
            .map(drop),
        "node is 257 bytes",
    );
    invalid(
        d.insert(&a, "ns", &[vec![]]).await.map(drop),
        "block_hashes[0] is empty",
    );
    invalid(
        d.insert(&a, &"n".repeat(1025), &hashes(0..1))
            .await
            .map(drop),
        "namespace is 1025 bytes",
    );
    invalid(
        d.query_prefix("ns", &[vec![0; 1025]], None).await.map(drop),
        "block_hashes[0] is 1025 bytes",
    );
    invalid(
        d.query_prefix("ns", &hashes(0..1), Some(&"x".repeat(300)))
            .await
            .map(drop),
        "exclude_node is 300 bytes",
    );

    // An unregistered node frees its place; so does one that went stale.
    d.unregister(&b).await.unwrap();
    d.heartbeat(&c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    d.heartbeat(&c).await.unwrap();
    d.heartbeat(&NodeId::new_session("10.0.9.4:1"))
        .await
        .unwrap();
}

/// Block keys carry the TTL, node records the stale interval, as native expiry.
#[tokio::test]
async fn keys_carry_native_expiry() {
    let Some(redis) = RedisServer::start("keys_carry_native_expiry") else {
        return;
    };
    let cfg = config(&redis.url());
    let prefix = cfg.key_prefix.clone();
    let d = open(cfg);
    let a = NodeId::new_session("10.0.7.1:1");
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns", &[vec![0xab, 0x01]]).await.unwrap();
    let node_ttl = redis.command(&["PTTL", &format!("{prefix}node:{}", a.addr)]);
    let ms: i64 = node_ttl.trim().trim_start_matches(':').parse().unwrap();
    assert!(ms > 0 && ms <= 2000, "node record PTTL {ms}");
    let block_ttl = redis.command(&["TTL", &format!("{prefix}b:ns:ab01")]);
    let s: i64 = block_ttl.trim().trim_start_matches(':').parse().unwrap();
    assert!(s > 290 && s <= 300, "block key TTL {s}");
}

/// Figures for the record (`cargo test -p pegaflow-directory --test redis -- --ignored
/// --nocapture`): 200k inserts in batches of 16,384, 300 queries of 64 hashes.
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn throughput() {
    let Some(redis) = RedisServer::start("throughput") else {
        return;
    };
    let d = open(RedisConfig {
        timeout_ms: 1000,
        ..config(&redis.url())
    });
    let a = NodeId::new_session("10.0.8.1:1");
    let b = NodeId::new_session("10.0.8.2:1");
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&b).await.unwrap();
    let all: Vec<Vec<u8>> = (0..200_000u32)
        .map(|i| {
            let mut v = vec![0u8; 32];
            v[..4].copy_from_slice(&i.to_be_bytes());
            v
        })
        .collect();
    let t = Instant::now();
    let mut worst = Duration::ZERO;
    for c in all.chunks(16_384) {
        let t1 = Instant::now();
        d.insert(&a, "ns", c).await.unwrap();
        worst = worst.max(t1.elapsed());
    }
    let took = t.elapsed();
    println!(
        "insert: {:.0} hashes/s, worst batch of 16384: {worst:?}",
        all.len() as f64 / took.as_secs_f64()
    );
    d.heartbeat(&b).await.unwrap();
    for c in all[..100_000].chunks(16_384) {
        d.insert(&b, "ns", c).await.unwrap();
    }
    d.heartbeat(&a).await.unwrap();
    let mut lat = Vec::new();
    for q in 0..300 {
        let start = (q * 641) % 190_000;
        let t1 = Instant::now();
        let r = d
            .query_prefix("ns", &all[start..start + 64], None)
            .await
            .unwrap();
        lat.push(t1.elapsed());
        assert_eq!(r[0].prefix_len, 64);
    }
    lat.sort();
    println!(
        "query of 64: p50 {:?}, p99 {:?}",
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
    let info = redis.command(&["INFO", "memory"]);
    let used = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap_or("?");
    println!("used_memory after 200k keys (2 owners on half): {used} bytes");
    let stats = redis.command(&["INFO", "commandstats"]);
    for l in stats.lines().filter(|l| l.contains("evalsha")) {
        println!("{l}");
    }
}

/// A heartbeat that re-created the node record after a flush, but whose answer was lost
/// (Redis frozen past the timeout, then woken: the script ran, nobody heard), does not hide
/// the loss: the next heartbeat still answers `state_lost`.
#[tokio::test]
async fn a_lost_heartbeat_answer_is_told_again() {
    let Some(redis) = RedisServer::start("a_lost_heartbeat_answer_is_told_again") else {
        return;
    };
    let cfg = config(&redis.url());
    let node_key = format!("{}node:", cfg.key_prefix);
    let d = open(cfg);
    let a = NodeId::new_session("10.0.9.1:1");
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns", &hashes(0..3)).await.unwrap();
    assert!(redis.command(&["FLUSHALL"]).contains("OK"));
    redis.freeze();
    assert!(matches!(
        d.heartbeat(&a).await,
        Err(DirectoryError::Unavailable(_))
    ));
    redis.thaw();
    let key = format!("{node_key}{}", a.addr);
    let end = Instant::now() + Duration::from_secs(2);
    while !redis.command(&["EXISTS", &key]).contains(":1") && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !redis.command(&["EXISTS", &key]).contains(":1") {
        println!("note: Redis dropped the frozen heartbeat; the next one re-creates the record");
    }
    let hb = until_ok("heartbeat after SIGCONT", || d.heartbeat(&a)).await;
    assert!(hb.state_lost, "the flush must still be reported");
    assert!(!d.heartbeat(&a).await.unwrap().state_lost);
}
