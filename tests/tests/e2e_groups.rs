//! Hybrid cache groups (`layer_group_ids`: prefix semantics for group 0, membership for
//! groups > 0, all-or-nothing with `wait_for_full_prefix`) and page-first layouts.

use pegaflow_api::client::QueryOutcome;
use pegaflow_api::load_state::LoadState;
use pegaflow_proto as pb;
use pegaflow_tests::harness::*;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 4,
    num_blocks: 16,
    segment_bytes: 512,
};

fn layer_holds(kv: &KvCache, l: usize, b: usize, hash: &[u8]) -> bool {
    (0..2).all(|s| {
        let o = kv.shape.offset(l, b, s);
        kv.mem.as_slice()[o..o + kv.shape.segment_bytes]
            == pattern(hash, l, s, kv.shape.segment_bytes)[..]
    })
}

fn layer_is(kv: &KvCache, l: usize, b: usize, byte: u8) -> bool {
    (0..2).all(|s| {
        let o = kv.shape.offset(l, b, s);
        kv.mem.as_slice()[o..o + kv.shape.segment_bytes]
            .iter()
            .all(|&x| x == byte)
    })
}

fn targets(v: &[Option<u32>]) -> pb::LoadBlockIds {
    pb::LoadBlockIds {
        targets: v
            .iter()
            .map(|t| pb::LoadBlockTarget {
                target: t.map(pb::load_block_target::Target::BlockId),
            })
            .collect(),
    }
}

async fn hybrid(srv: &TestServer, id: &str) -> Worker {
    let kv = KvCache::new(SHAPE);
    let mut reg = kv.registration(id, "hy", 0, 1, 0);
    reg.layer_group_ids = vec![0, 0, 1, 1];
    drop(kv);
    Worker::register_with(srv, SHAPE, reg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recurrent_group_seals_final_block_save() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = hybrid(&srv, "hyb").await;
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("hy", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    w.kv.fill(5, b"checkpoint");
    // Attention saves blocks 0..2; the recurrent group saves only block 2's checkpoint.
    w.save_layers(&[0, 1], &[0, 1, 2], &hs).await.unwrap();
    w.save_layers(&[2, 3], &[5], &hs[2..]).await.unwrap();
    // Prefix (group 0) is unaffected by the recurrent group: 3 hits.
    let (n, lease0) = ready(w.client.query("hyb", hs.clone(), "p").await.unwrap());
    assert_eq!(n, 3);
    // Membership of group 1: only position 2, despite the same hashes.
    let q = w
        .client
        .query_full("hyb", hs.clone(), "m", false, 1)
        .await
        .unwrap();
    let QueryOutcome::Ready {
        num_hit_blocks,
        lease: lease1,
        hit_positions,
    } = q
    else {
        panic!()
    };
    assert_eq!((num_hit_blocks, hit_positions.as_slice()), (1, &[2u32][..]));
    assert_eq!(lease1.len(), 16);
    // A two-lease, two-group load: attention into 10..12, the checkpoint into 7 only.
    for b in 0..16 {
        w.kv.poison(b, 0x11);
    }
    let names = |ls: &[usize]| pb::LoadGroup {
        layer_names: ls.iter().map(|&l| KvShape::layer_name(l)).collect(),
    };
    let state = LoadState::create().unwrap();
    let req = pb::LoadRequest {
        instance_id: "hyb".into(),
        tp_rank: 0,
        device_id: 0,
        load_state_shm: state.name().into(),
        groups: vec![names(&[0, 1]), names(&[2, 3])],
        loads: vec![
            pb::LeaseLoad {
                lease: lease0,
                block_ids_by_group: vec![
                    targets(&[Some(10), Some(11), Some(12)]),
                    targets(&[None, None, None]),
                ],
            },
            pb::LeaseLoad {
                lease: lease1,
                block_ids_by_group: vec![targets(&[None]), targets(&[Some(7)])],
            },
        ],
        wait_for_completion: false,
    };
    w.client.load(req).await.unwrap();
    assert_eq!(wait_state(&state).await, 1);
    for (i, h) in hs.iter().enumerate() {
        assert!(layer_holds(&w.kv, 0, 10 + i, h) && layer_holds(&w.kv, 1, 10 + i, h));
        assert!(layer_is(&w.kv, 2, 10 + i, 0x11) && layer_is(&w.kv, 3, 10 + i, 0x11));
    }
    assert!(layer_holds(&w.kv, 2, 7, b"checkpoint") && layer_holds(&w.kv, 3, 7, b"checkpoint"));
    assert!(layer_is(&w.kv, 0, 7, 0x11) && layer_is(&w.kv, 1, 7, 0x11));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recurrent_membership_fetch_is_all_or_nothing() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = hybrid(&srv, "aon").await;
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("aon", i)).collect();
    w.save_layers(&[0, 1], &[0, 1, 2], &hs).await.unwrap();
    w.save_layers(&[2, 3], &[2], &hs[2..]).await.unwrap();
    // The full want-set present → Ready with every position, in order.
    let q = w
        .client
        .query_full("aon", hs[2..].to_vec(), "a", true, 1)
        .await
        .unwrap();
    assert!(
        matches!(q, QueryOutcome::Ready { num_hit_blocks: 1, ref hit_positions, ref lease } if hit_positions == &[0] && lease.len() == 16),
        "{q:?}"
    );
    // A set with an absent member → a miss without a lease.
    let q = w
        .client
        .query_full("aon", hs[1..].to_vec(), "b", true, 1)
        .await
        .unwrap();
    assert_eq!(
        q,
        QueryOutcome::Ready {
            num_hit_blocks: 0,
            lease: vec![],
            hit_positions: vec![]
        }
    );
    // An attention-only hash never satisfies the recurrent set.
    let q = w
        .client
        .query_full("aon", hs[..1].to_vec(), "c", true, 1)
        .await
        .unwrap();
    assert_eq!(
        q,
        QueryOutcome::Ready {
            num_hit_blocks: 0,
            lease: vec![],
            hit_positions: vec![]
        }
    );
    // Without wait_for_full_prefix, membership answers per position.
    let q = w
        .client
        .query_full("aon", hs.clone(), "d", false, 1)
        .await
        .unwrap();
    assert!(
        matches!(q, QueryOutcome::Ready { num_hit_blocks: 1, ref hit_positions, .. } if hit_positions == &[2])
    );
    // Unknown group → error, not "all miss".
    let e = w
        .client
        .query_full("aon", hs.clone(), "e", false, 7)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument));
    // Mixing storage groups in one load group is refused.
    let (_, lease) = ready(w.client.query("aon", hs.clone(), "f").await.unwrap());
    let state = LoadState::create().unwrap();
    let req = pb::LoadRequest {
        instance_id: "aon".into(),
        tp_rank: 0,
        device_id: 0,
        load_state_shm: state.name().into(),
        groups: vec![pb::LoadGroup {
            layer_names: vec![KvShape::layer_name(0), KvShape::layer_name(2)],
        }],
        loads: vec![pb::LeaseLoad {
            lease,
            block_ids_by_group: vec![targets(&[Some(1), Some(2), Some(3)])],
        }],
        wait_for_completion: false,
    };
    let e = w.client.load(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert_eq!(state.get(), -1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_groups_are_refused() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let kv = KvCache::new(SHAPE);
    let mut reg = kv.registration("sparse", "ns", 0, 1, 0);
    reg.layer_group_ids = vec![0, 0, 2, 2];
    let e = Worker::register_with(&srv, SHAPE, reg).await.err().unwrap();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("dense"), "{e}");
    assert!(srv.handle.engine.instance_ids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_first_roundtrip_and_partial_save_rejected() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let kv = KvCache::new(SHAPE);
    let mut reg = kv.registration("pf", "pf-ns", 0, 1, 0);
    reg.page_first = true;
    drop(kv);
    let mut w = Worker::register_with(&srv, SHAPE, reg).await.unwrap();
    let hs: Vec<Vec<u8>> = (0..4).map(|i| hash_of("pf", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    // A save of a subset of the shard's layers is refused and does not seal.
    let e = w
        .save_layers(&[0, 1], &[0, 1, 2, 3], &hs)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let (n, _) = ready(w.client.query("pf", hs.clone(), "a").await.unwrap());
    assert_eq!(n, 0);
    w.save(&[0, 1, 2, 3], &hs).await.unwrap();
    let (n, lease) = ready(w.client.query("pf", hs.clone(), "b").await.unwrap());
    assert_eq!(n, 4);
    for b in 0..16 {
        w.kv.poison(b, 0);
    }
    assert_eq!(w.load(&lease, &[12, 13, 14, 15]).await.unwrap(), 1);
    for (i, h) in hs.iter().enumerate() {
        assert!(w.kv.holds(12 + i, h), "page of block {i}");
    }
    // One page per block: 4 layers x 2 x 512 bytes each.
    assert_eq!(srv.handle.engine.index().resident_bytes(), 4 * 4 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_first_replicas_seal_from_one_rank() {
    // MLA-style: both TP ranks register the same layers (replicas): one shard, one page per
    // block, and a block saved by either rank serves both.
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut ws = Vec::new();
    for r in 0..2u32 {
        let kv = KvCache::new(SHAPE);
        let mut reg = kv.registration("mla", "mla-ns", r, 2, r as i32);
        reg.page_first = true;
        drop(kv);
        ws.push(Worker::register_with(&srv, SHAPE, reg).await.unwrap());
    }
    let h = vec![hash_of("mla", 0), hash_of("mla", 1)];
    ws[0].kv.fill(0, &h[0]);
    ws[1].kv.fill(1, &h[1]);
    ws[0].save(&[0], &h[..1]).await.unwrap();
    ws[1].save(&[1], &h[1..]).await.unwrap();
    let (n, lease) = ready(ws[0].client.query("mla", h.clone(), "q").await.unwrap());
    assert_eq!(n, 2);
    for w in ws.iter_mut() {
        assert_eq!(w.load(&lease, &[8, 9]).await.unwrap(), 1);
        assert!(w.kv.holds(8, &h[0]) && w.kv.holds(9, &h[1]));
    }
}
