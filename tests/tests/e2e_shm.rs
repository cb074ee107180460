//! End-to-end over real gRPC and a real Unix side channel: host-memfd KV caches saved,
//! queried, poisoned, loaded into other block ids and compared byte for byte.

use std::time::Duration;

use pegaflow_api::load_state::{LoadState, LOAD_SUCCESS};
use pegaflow_tests::harness::*;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 8,
    num_blocks: 64,
    segment_bytes: 1024,
};

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| hash_of(tag, i)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_layer_roundtrip_is_byte_exact() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = Worker::register(&srv, "rt", "ns", SHAPE, 0, 1, 0).await;
    let hs = hashes("rt", 32);
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    let ids: Vec<u32> = (0..32).collect();
    w.save(&ids, &hs).await.unwrap();
    // Queryable as soon as Save returned.
    let (n, lease) = ready(w.client.query("rt", hs.clone(), "r1").await.unwrap());
    assert_eq!(n, 32);
    assert_eq!(lease.len(), 16);
    // Poison the source and load into other block ids (reversed, in the upper half).
    for b in 0..64 {
        w.kv.poison(b, 0xAB);
    }
    let targets: Vec<u32> = (0..32).map(|i| 63 - i).collect();
    assert_eq!(w.load(&lease, &targets).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in hs.iter().enumerate() {
        assert!(w.kv.holds(63 - i, h), "block {i} restored into {}", 63 - i);
    }
    for b in 0..32 {
        assert!(w.kv.is_filled_with(b, 0xAB), "block {b} untouched");
    }
    // The lease was consumed by the only worker.
    let e = w.load(&lease, &targets).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    // Re-saving resident hashes is a no-op and still all hit.
    w.save(&ids, &hs).await.unwrap();
    let (n, lease) = ready(w.client.query("rt", hs.clone(), "r2").await.unwrap());
    assert_eq!(n, 32);
    w.client.release(&lease).await.unwrap();
    assert_eq!(srv.handle.engine.index().resident_blocks(), 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_needs_both_ranks_and_both_load_once() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let shape = KvShape {
        layers: 4,
        num_blocks: 16,
        segment_bytes: 512,
    };
    let mut r0 = Worker::register(&srv, "tp2", "ns", shape, 0, 2, 0).await;
    // Incomplete registration: saves are refused.
    let e = r0.save(&[0], &[hash_of("tp2", 0)]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(
        e.to_string().contains("registration incomplete: 1/2"),
        "{e}"
    );
    let mut r1 = Worker::register(&srv, "tp2", "ns", shape, 1, 2, 1).await;
    let hs = hashes("tp2", 8);
    let ids: Vec<u32> = (0..8).collect();
    for (i, h) in hs.iter().enumerate() {
        r0.kv.fill(i, &[h.as_slice(), b"-r0"].concat());
        r1.kv.fill(i, &[h.as_slice(), b"-r1"].concat());
    }
    r0.save(&ids, &hs).await.unwrap();
    let (n, lease) = ready(r0.client.query("tp2", hs.clone(), "q").await.unwrap());
    assert_eq!(
        (n, lease.is_empty()),
        (0, true),
        "one rank's save alone gives 0 hits"
    );
    r1.save(&ids, &hs).await.unwrap();
    let (n, lease) = ready(r0.client.query("tp2", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 8);
    for b in 0..16 {
        r0.kv.poison(b, 0);
        r1.kv.poison(b, 0);
    }
    let targets: Vec<u32> = (8..16).collect();
    assert_eq!(r0.load(&lease, &targets).await.unwrap(), LOAD_SUCCESS);
    assert_eq!(r1.load(&lease, &targets).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in hs.iter().enumerate() {
        assert!(r0.kv.holds(8 + i, &[h.as_slice(), b"-r0"].concat()));
        assert!(r1.kv.holds(8 + i, &[h.as_slice(), b"-r1"].concat()));
    }
    // One lease serves exactly world_size loads.
    let e = r0.load(&lease, &targets).await.unwrap_err();
    assert!(e.to_string().contains("unknown or expired"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_gap_and_namespace_semantics() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = Worker::register(&srv, "px", "ns-a", SHAPE, 0, 1, 0).await;
    let hs = hashes("px", 5);
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    // 3 of 5 saved → 3 hits.
    w.save(&[0, 1, 2], &hs[..3]).await.unwrap();
    let (n, lease) = ready(w.client.query("px", hs.clone(), "a").await.unwrap());
    assert_eq!(n, 3);
    w.client.release(&lease).await.unwrap();
    // A gap breaks the prefix: h0, h2, h3 cached (h1 not) in a fresh namespace.
    let mut g = Worker::register(&srv, "gap", "ns-gap", SHAPE, 0, 1, 0).await;
    for (i, h) in hs.iter().enumerate() {
        g.kv.fill(i, h);
    }
    g.save(&[0, 2, 3], &[hs[0].clone(), hs[2].clone(), hs[3].clone()])
        .await
        .unwrap();
    let (n, lease) = ready(g.client.query("gap", hs[..4].to_vec(), "b").await.unwrap());
    assert_eq!(n, 1);
    g.client.release(&lease).await.unwrap();
    // First block missing → 0 hits, no lease.
    let (n, lease) = ready(g.client.query("gap", hs[1..].to_vec(), "c").await.unwrap());
    assert_eq!((n, lease.len()), (0, 0));
    // Empty hash list → 0.
    let (n, _) = ready(g.client.query("gap", vec![], "d").await.unwrap());
    assert_eq!(n, 0);
    // Namespace isolation: ns-b sees nothing of ns-a.
    let mut b = Worker::register(&srv, "other-ns", "ns-b", SHAPE, 0, 1, 0).await;
    let (n, _) = ready(b.client.query("other-ns", hs.clone(), "e").await.unwrap());
    assert_eq!(n, 0);
    // The same namespace from another instance shares the blocks.
    let mut c = Worker::register(&srv, "same-ns", "ns-a", SHAPE, 0, 1, 0).await;
    let (n, lease) = ready(c.client.query("same-ns", hs.clone(), "f").await.unwrap());
    assert_eq!(n, 3);
    assert_eq!(c.load(&lease, &[10, 11, 12]).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in hs.iter().take(3).enumerate() {
        assert!(c.kv.holds(10 + i, h));
    }
    // Empty req_id.
    let e = b
        .client
        .query("other-ns", hs.clone(), "")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument));
    assert!(e.to_string().contains("req_id must not be empty"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_bound_released_once_and_expire() {
    let srv = TestServer::start(ServerOptions {
        lease_ttl_secs: 1,
        ..Default::default()
    })
    .await;
    let mut a = Worker::register(&srv, "la", "ns", SHAPE, 0, 1, 0).await;
    let mut b = Worker::register(&srv, "lb", "ns", SHAPE, 0, 1, 0).await;
    let hs = hashes("l", 2);
    a.kv.fill(0, &hs[0]);
    a.kv.fill(1, &hs[1]);
    a.save(&[0, 1], &hs).await.unwrap();
    let (n, lease) = ready(a.client.query("la", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 2);
    // Another instance cannot use the lease; its load state goes negative.
    let state = LoadState::create().unwrap();
    let req = b.load_request(&state, &lease, &[Some(0), Some(1)]);
    let e = b.client.load(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
    assert!(
        e.to_string().contains("query lease belongs to instance la"),
        "{e}"
    );
    assert!(state.get() < 0);
    // Block count mismatch is INVALID_ARGUMENT and leaves the lease usable.
    let state = LoadState::create().unwrap();
    let req = a.load_request(&state, &lease, &[Some(0), Some(1), Some(2), Some(3)]);
    let e = a.client.load(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument));
    assert!(
        e.to_string()
            .contains("query lease block count 2 does not match destination block count 4"),
        "{e}"
    );
    assert!(state.get() < 0);
    // Release twice.
    a.client.release(&lease).await.unwrap();
    let e = a.client.release(&lease).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
    assert!(e.to_string().contains("unknown or expired"));
    // Bad lease bytes.
    let e = a.client.release(&[]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument));
    let e = a.client.release(&[1, 2, 3]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument));
    // Expiry.
    let (_, lease) = ready(a.client.query("la", hs.clone(), "q2").await.unwrap());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let e = a.load(&lease, &[5, 6]).await.unwrap_err();
    assert!(e.to_string().contains("unknown or expired"), "{e}");
    let e = a.client.release(&lease).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_keeps_leased_and_newest_blocks() {
    // One block = 8 layers * 2 * 1 KiB = 16 KiB; capacity for 24 blocks.
    let shape = SHAPE;
    let block = (shape.layers * 2 * shape.segment_bytes) as u64;
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: 24 * block,
        ..Default::default()
    })
    .await;
    let mut w = Worker::register(&srv, "ev", "ns", shape, 0, 1, 0).await;
    let batch = |tag: &str| hashes(tag, 10);
    let (a, b, c) = (batch("A"), batch("B"), batch("C"));
    let ids: Vec<u32> = (0..10).collect();
    for (i, h) in a.iter().enumerate() {
        w.kv.fill(i, h);
    }
    w.save(&ids, &a).await.unwrap();
    let (n, lease_a) = ready(w.client.query("ev", a.clone(), "qa").await.unwrap());
    assert_eq!(n, 10);
    for (i, h) in b.iter().enumerate() {
        w.kv.fill(i, h);
    }
    w.save(&ids, &b).await.unwrap();
    for (i, h) in c.iter().enumerate() {
        w.kv.fill(i, h);
    }
    // C does not fit next to A and B: B (old, unleased) is evicted; A is leased.
    w.save(&ids, &c).await.unwrap();
    let (n, l) = ready(w.client.query("ev", a.clone(), "qa2").await.unwrap());
    assert_eq!(n, 10, "leased blocks stay indexed");
    w.client.release(&l).await.unwrap();
    let (n, _) = ready(w.client.query("ev", b.clone(), "qb").await.unwrap());
    assert_eq!(n, 0, "old unleased blocks are gone");
    let (n, l) = ready(w.client.query("ev", c.clone(), "qc").await.unwrap());
    assert_eq!(n, 10, "the newest saves are kept");
    w.client.release(&l).await.unwrap();
    // The old lease still loads A's bytes.
    for bl in 0..64 {
        w.kv.poison(bl, 0x5A);
    }
    let targets: Vec<u32> = (20..30).collect();
    assert_eq!(w.load(&lease_a, &targets).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in a.iter().enumerate() {
        assert!(w.kv.holds(20 + i, h));
    }
    let used = srv.handle.engine.pool().used_bytes();
    assert!(used <= 24 * block, "used {used}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_larger_than_free_unpinned_memory_fails_cleanly() {
    let block = (SHAPE.layers * 2 * SHAPE.segment_bytes) as u64;
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: 12 * block,
        ..Default::default()
    })
    .await;
    let mut w = Worker::register(&srv, "full", "ns", SHAPE, 0, 1, 0).await;
    let a = hashes("fa", 10);
    w.save(&(0..10).collect::<Vec<_>>(), &a).await.unwrap();
    let (_, lease) = ready(w.client.query("full", a.clone(), "q").await.unwrap());
    // Everything resident is leased: a 10-block save cannot fit.
    let b = hashes("fb", 10);
    let e = w.save(&(0..10).collect::<Vec<_>>(), &b).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
    let (n, _) = ready(w.client.query("full", b.clone(), "q2").await.unwrap());
    assert_eq!(n, 0);
    w.client.release(&lease).await.unwrap();
    w.save(&(0..10).collect::<Vec<_>>(), &b).await.unwrap();
    let (n, _) = ready(w.client.query("full", b.clone(), "q3").await.unwrap());
    assert_eq!(n, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_drop_cleans_the_instance() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = Worker::register(&srv, "sess", "ns", SHAPE, 0, 1, 0).await;
    let hs = hashes("s", 2);
    w.save(&[0, 1], &hs).await.unwrap();
    let (_, lease) = ready(w.client.query("sess", hs.clone(), "q").await.unwrap());
    let mut c2 = srv.client().await;
    let stream = c2.session("sess", "ns", 1, 1).await.unwrap();
    // A newer session supersedes the first: dropping the old one cleans nothing.
    let mut c3 = srv.client().await;
    let stream2 = c3.session("sess", "ns", 1, 1).await.unwrap();
    drop(stream);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(srv.handle.engine.instance_ids(), vec!["sess".to_string()]);
    drop(stream2);
    let mut gone = false;
    for _ in 0..100 {
        if srv.handle.engine.instance_ids().is_empty() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        gone,
        "instance cleaned within a second of the session's end"
    );
    let e = w.client.query("sess", hs.clone(), "q2").await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
    assert!(e.to_string().contains("instance sess not found"), "{e}");
    let e = w.save(&[0], &hs[..1]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
    let state = LoadState::create().unwrap();
    let req = w.load_request(&state, &lease, &[Some(0), Some(1)]);
    let e = w.client.load(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));
    assert!(state.get() < 0, "the load state goes negative");
    // Blocks of the namespace survive the instance.
    assert_eq!(srv.handle.engine.index().resident_blocks(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_hashes_and_per_layer_orders_seal_correctly() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let shape = KvShape {
        layers: 3,
        num_blocks: 8,
        segment_bytes: 256,
    };
    let mut w = Worker::register(&srv, "ord", "ns", shape, 0, 1, 0).await;
    let (h0, h1) = (hash_of("o", 0), hash_of("o", 1));
    w.kv.fill(0, &h0);
    w.kv.fill(1, &h1);
    w.kv.fill(2, b"not-h0");
    // Layer 0 lists h0 twice (block 0 first, then block 2: the first wins); layer 1 lists
    // the blocks in the other order; layer 2 like layer 0.
    let saves = vec![
        (
            KvShape::layer_name(0),
            vec![0, 1, 2],
            vec![h0.clone(), h1.clone(), h0.clone()],
        ),
        (
            KvShape::layer_name(1),
            vec![1, 0],
            vec![h1.clone(), h0.clone()],
        ),
        (
            KvShape::layer_name(2),
            vec![0, 1, 2],
            vec![h0.clone(), h1.clone(), h0.clone()],
        ),
    ];
    w.client.save("ord", 0, 0, 0, saves).await.unwrap();
    let (n, lease) = ready(
        w.client
            .query("ord", vec![h0.clone(), h1.clone()], "q")
            .await
            .unwrap(),
    );
    assert_eq!(n, 2);
    assert_eq!(srv.handle.engine.index().resident_blocks(), 2);
    for b in 0..8 {
        w.kv.poison(b, 0);
    }
    assert_eq!(w.load(&lease, &[5, 6]).await.unwrap(), LOAD_SUCCESS);
    assert!(
        w.kv.holds(5, &h0),
        "h0 restored from block 0 in every layer"
    );
    assert!(w.kv.holds(6, &h1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_saves_under_pressure_never_fail_while_blocks_are_evictable() {
    let shape = KvShape {
        layers: 2,
        num_blocks: 8,
        segment_bytes: 512,
    };
    let block = (shape.layers * 2 * shape.segment_bytes) as u64;
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: 16 * block,
        ..Default::default()
    })
    .await;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let mut w = Worker::register(&srv, &format!("c{t}"), "ns", shape, 0, 1, 0).await;
        tasks.push(tokio::spawn(async move {
            for round in 0..60 {
                let hs = vec![
                    hash_of(&format!("c{t}-{round}"), 0),
                    hash_of(&format!("c{t}-{round}"), 1),
                ];
                w.save(&[0, 1], &hs)
                    .await
                    .expect("evictable blocks make room");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(srv.handle.engine.pool().used_bytes() <= 16 * block);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_answer_before_their_seal_and_queries_wait_for_it() {
    // Capacity for 12 blocks of 16 KiB.
    let block = (SHAPE.layers * 2 * SHAPE.segment_bytes) as u64;
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: 12 * block,
        ..Default::default()
    })
    .await;
    let engine = srv.handle.engine.clone();
    let mut w = Worker::register(&srv, "seal", "ns", SHAPE, 0, 1, 0).await;
    let ids: Vec<u32> = (0..10).collect();
    let fill = |w: &mut Worker, hs: &[Vec<u8>]| {
        for (i, h) in hs.iter().enumerate() {
            w.kv.fill(i, h);
        }
    };
    let a = hashes("sa", 10);
    fill(&mut w, &a);
    let hold = engine.hold_seals();
    // The Save answers with its blocks copied but not yet sealed...
    tokio::time::timeout(Duration::from_secs(10), w.save(&ids, &a))
        .await
        .expect("a Save does not wait for its seal")
        .unwrap();
    // ...and a query made after it waits until they are indexed.
    let mut c = w.client.clone();
    let qa = a.clone();
    let query = tokio::spawn(async move { c.query("seal", qa, "q1").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!query.is_finished(), "the query waits for the pending seal");
    drop(hold);
    let (n, lease) = ready(
        tokio::time::timeout(Duration::from_secs(10), query)
            .await
            .expect("answered once sealed")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(n, 10, "every block of the answered Save is a hit");
    w.client.release(&lease).await.unwrap();

    // B lands unsealed in the pool; C needs B's room, which only a sealed (indexed) block
    // can give back: C's allocation waits for B's seal instead of failing.
    let b = hashes("sb", 10);
    let cc = hashes("sc", 10);
    fill(&mut w, &b);
    let hold = engine.hold_seals();
    w.save(&ids, &b).await.unwrap();
    fill(&mut w, &cc);
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(hold);
    });
    tokio::time::timeout(Duration::from_secs(10), w.save(&ids, &cc))
        .await
        .expect("C's allocation waits for B's seal, then evicts B")
        .unwrap();
    release.await.unwrap();
    let (n, _) = ready(w.client.query("seal", b.clone(), "qb").await.unwrap());
    assert_eq!(n, 0, "B, older, was evicted for C");
    let (n, lease) = ready(w.client.query("seal", cc.clone(), "qc").await.unwrap());
    assert_eq!(n, 10);
    for bl in 0..64 {
        w.kv.poison(bl, 0x3C);
    }
    let targets: Vec<u32> = (30..40).collect();
    assert_eq!(w.load(&lease, &targets).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in cc.iter().enumerate() {
        assert!(w.kv.holds(30 + i, h), "block {i} of C byte-exact");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_cleanup_removes_the_blocks_of_saves_still_waiting_for_their_seal() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let engine = srv.handle.engine.clone();
    let mut w = Worker::register(&srv, "clean", "ns", SHAPE, 0, 1, 0).await;
    let hs = hashes("cl", 10);
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    let hold = engine.hold_seals();
    w.save(&(0..10).collect::<Vec<_>>(), &hs).await.unwrap();
    // The cleanup (POST /cache/memory/cleanup runs it on a blocking thread) waits for the
    // answered Save's seal, then removes its blocks.
    let e2 = engine.clone();
    let cleanup = tokio::task::spawn_blocking(move || e2.cleanup_memory());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !cleanup.is_finished(),
        "the cleanup waits for the pending seal"
    );
    drop(hold);
    let r = tokio::time::timeout(Duration::from_secs(10), cleanup)
        .await
        .expect("done once sealed")
        .unwrap();
    assert_eq!(r.evicted_blocks, 10, "{r:?}");
    let (n, _) = ready(w.client.query("clean", hs.clone(), "q").await.unwrap());
    assert_eq!(
        n, 0,
        "nothing of the Save is left to query after the cleanup"
    );
}
