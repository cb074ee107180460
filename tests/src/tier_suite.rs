//! The key-addressed tier conformance suite: written once, instantiated for every tier below
//! host DRAM (in-tree tiers, the examples' tier, and each of them under the `fault` and
//! `metrics` layers), gated by the capabilities a tier declares (DESIGN.md §9).
//!
//! Owns: generic async checks of the [`Tier`] contract, each a `pub async fn(&TierMaker)`,
//! and the [`block_tier_conformance_tests!`](crate::block_tier_conformance_tests) macro that
//! turns them into one `#[tokio::test]` per case for a maker.
//!
//! Must never: depend on a tier's kind, its eviction order or its rounding (only on what the
//! trait promises: a key is visible only after a successful put; a get yields exactly the
//! bytes put; lookups stop at the first key not held; an injected failure is never reported
//! as success), time anything, or leave state between cases (each case makes a fresh tier).

use std::path::Path;
use std::sync::Arc;

use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::layers::fault::FaultyTier;
use pegaflow_plugin::{Extent, HostBuffer, HostMemory, Tier, TierError, TierGet, TierPut};

use crate::pool_suite::{pattern, Rng};

/// Builds a tier able to hold about `capacity_bytes` bytes, keeping whatever it persists
/// under `dir` (a fresh temporary directory per case; calling the maker again with the same
/// `dir` reopens a persistent tier).
pub struct TierMaker {
    /// The constructor.
    pub make: fn(capacity_bytes: u64, dir: &Path) -> Arc<dyn Tier>,
}

/// Heap memory for test buffers (freed when the last buffer is dropped).
#[derive(Debug)]
struct HeapMem(parking_lot::Mutex<Vec<(usize, Box<[u8]>)>>);

impl HostMemory for HeapMem {
    fn release(&self, extents: &[Extent]) {
        let mut v = self.0.lock();
        for e in extents {
            v.retain(|(a, _)| *a != e.addr);
        }
    }
}

/// A host buffer of `len` bytes on the heap, in `pieces` extents (to exercise scattered
/// destinations and sources).
pub fn heap_buffer(len: usize, pieces: usize) -> HostBuffer {
    let mem = Arc::new(HeapMem(parking_lot::Mutex::new(Vec::new())));
    let pieces = pieces.clamp(1, len.max(1));
    let mut extents = Vec::new();
    let mut left = len;
    for i in 0..pieces {
        let l = if i + 1 == pieces { left } else { len / pieces };
        let mut b = vec![0u8; l.max(1)].into_boxed_slice();
        let addr = b.as_mut_ptr() as usize;
        mem.0.lock().push((addr, b));
        extents.push(Extent { addr, len: l });
        left -= l;
    }
    HostBuffer::new(extents, mem)
}

/// A key in namespace `ns` for block number `i`.
pub fn key(ns: &str, i: u64) -> BlockKey {
    BlockKey {
        namespace: ns.into(),
        group: 0,
        hash: i.to_le_bytes().to_vec().into(),
    }
}

/// A sealed block for `id` with the given slot lengths, filled with [`pattern`]`(id)`.
pub fn block(id: u64, slot_lens: &[u64]) -> Arc<SealedBlock> {
    let shape = BlockShape::new(slot_lens.to_vec());
    let len = shape.len_bytes() as usize;
    let buf = heap_buffer(len, 1 + (id as usize % 3));
    buf.write_at(0, &pattern(id, len));
    Arc::new(SealedBlock::from_buffer(
        0,
        &shape,
        Arc::new(buf),
        len as u64,
    ))
}

fn put_of(id: u64, slot_lens: &[u64]) -> TierPut {
    TierPut {
        key: key("ns", id),
        block: block(id, slot_lens),
    }
}

fn get_of(k: BlockKey, shape: BlockShape) -> (TierGet, Arc<HostBuffer>) {
    let dest = Arc::new(heap_buffer(shape.len_bytes() as usize, 2));
    (
        TierGet {
            key: k,
            shape,
            dest: dest.clone(),
        },
        dest,
    )
}

fn holds(buf: &HostBuffer, id: u64, len: usize) -> bool {
    let mut got = vec![0u8; len];
    buf.read_at(0, &mut got);
    got == pattern(id, len)
}

fn fresh(m: &TierMaker, capacity: u64) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    ((m.make)(capacity, dir.path()), dir)
}

/// Puts, then lookups in prefix order and gets with exact bytes, over several slot layouts.
pub async fn put_lookup_get_roundtrip(m: &TierMaker) {
    let (t, _dir) = fresh(m, 64 << 20);
    let layouts: [&[u64]; 3] = [&[4096], &[1024, 1024, 2048], &[512; 8]];
    let puts: Vec<TierPut> = (0..12u64)
        .map(|i| put_of(i, layouts[i as usize % 3]))
        .collect();
    let shapes: Vec<BlockShape> = puts.iter().map(|p| p.block.shape()).collect();
    for r in t.put(puts).await {
        r.expect("put succeeds");
    }
    let keys: Vec<BlockKey> = (0..12).map(|i| key("ns", i)).collect();
    let found = t.lookup(&keys).await.expect("lookup");
    assert_eq!(found, shapes, "every key held, in order, with its shape");
    let (reads, dests): (Vec<_>, Vec<_>) = keys
        .iter()
        .zip(&shapes)
        .map(|(k, s)| get_of(k.clone(), s.clone()))
        .unzip();
    for r in t.get(reads).await {
        r.expect("get succeeds");
    }
    for (i, (d, s)) in dests.iter().zip(&shapes).enumerate() {
        assert!(
            holds(d, i as u64, s.len_bytes() as usize),
            "block {i} bytes exact"
        );
    }
    assert!(t.used_bytes() > 0 && t.used_bytes() <= t.capacity_bytes());
}

/// A lookup stops at the first key the tier does not hold; another namespace or group is
/// another key.
pub async fn lookup_stops_at_first_missing_key(m: &TierMaker) {
    let (t, _dir) = fresh(m, 16 << 20);
    let puts = vec![put_of(0, &[1000]), put_of(1, &[1000]), put_of(3, &[1000])];
    for r in t.put(puts).await {
        r.unwrap();
    }
    let keys: Vec<BlockKey> = (0..4).map(|i| key("ns", i)).collect();
    assert_eq!(t.lookup(&keys).await.unwrap().len(), 2);
    assert_eq!(t.lookup(&keys[2..]).await.unwrap().len(), 0);
    assert_eq!(t.lookup(&keys[3..]).await.unwrap().len(), 1);
    assert!(t.lookup(&[key("other", 0)]).await.unwrap().is_empty());
    let mut g1 = key("ns", 0);
    g1.group = 1;
    assert!(t.lookup(&[g1]).await.unwrap().is_empty());
    assert!(t.lookup(&[]).await.unwrap().is_empty());
}

/// A second put of a held key succeeds and does not change its bytes.
pub async fn put_of_a_held_key_changes_nothing(m: &TierMaker) {
    let (t, _dir) = fresh(m, 16 << 20);
    t.put(vec![put_of(5, &[2048])]).await[0].clone().unwrap();
    let used = t.used_bytes();
    // Same key, other bytes: content-addressed blocks never change.
    let other = TierPut {
        key: key("ns", 5),
        block: block(6, &[2048]),
    };
    t.put(vec![other]).await[0].clone().unwrap();
    assert_eq!(t.used_bytes(), used);
    let (r, d) = get_of(key("ns", 5), BlockShape::new(vec![2048]));
    t.get(vec![r]).await[0].clone().unwrap();
    assert!(holds(&d, 5, 2048), "the first put's bytes stay");
}

/// Remove drops held keys (and counts them); a get of a missing key is NotFound and writes
/// nothing.
pub async fn remove_and_missing_get(m: &TierMaker) {
    let (t, _dir) = fresh(m, 16 << 20);
    for r in t.put((0..4).map(|i| put_of(i, &[700])).collect()).await {
        r.unwrap();
    }
    let removed = t.remove(&[key("ns", 1), key("ns", 9)]).await.unwrap();
    assert_eq!(removed, 1);
    let keys: Vec<BlockKey> = (0..4).map(|i| key("ns", i)).collect();
    assert_eq!(t.lookup(&keys).await.unwrap().len(), 1);
    let (r, d) = get_of(key("ns", 1), BlockShape::new(vec![700]));
    let res = t.get(vec![r]).await;
    assert!(
        matches!(res[0], Err(TierError::NotFound)),
        "missing key: {res:?}"
    );
    let mut got = vec![0xAAu8; 700];
    d.read_at(0, &mut got);
    assert!(got.iter().all(|&b| b == 0), "nothing written for a miss");
    t.flush().await.expect("flush");
}

/// Filling past capacity never reports a wrong byte: each put either succeeds or fails
/// with Full, used bytes stay within capacity, and every block the tier still reports is
/// exact.
pub async fn full_tier_never_serves_wrong_bytes(m: &TierMaker) {
    let cap = 1 << 20;
    let (t, _dir) = fresh(m, cap);
    let block_len = 64 << 10;
    let n = 3 * cap / block_len;
    let mut ok = 0;
    for i in 0..n {
        match &t.put(vec![put_of(i, &[block_len])]).await[0] {
            Ok(()) => ok += 1,
            Err(TierError::Full(_)) => {}
            Err(e) => panic!("put {i}: unexpected error {e}"),
        }
        assert!(t.used_bytes() <= t.capacity_bytes());
    }
    assert!(ok > 0, "some puts fit");
    let mut held = 0;
    for i in 0..n {
        let k = key("ns", i);
        let Some(shape) = t.lookup(std::slice::from_ref(&k)).await.unwrap().pop() else {
            continue;
        };
        let (r, d) = get_of(k, shape);
        if t.get(vec![r]).await[0].is_ok() {
            assert!(holds(&d, i, block_len as usize), "block {i} exact");
            held += 1;
        }
    }
    assert!(held > 0 && held as u64 * block_len <= cap);
}

/// Puts and gets from several tasks at once, with eviction under way: every get that
/// succeeds is exact.
pub async fn concurrent_puts_and_gets_stay_exact(m: &TierMaker) {
    let (t, _dir) = fresh(m, 2 << 20);
    let mut tasks = Vec::new();
    for w in 0..4u64 {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(w);
            let mut exact = 0;
            for round in 0..40u64 {
                let id = w * 1000 + round;
                let len = rng.range(1, 64 << 10) as u64;
                let _ = t.put(vec![put_of(id, &[len])]).await;
                let probe = w * 1000 + rng.range(0, round as usize) as u64;
                let k = key("ns", probe);
                if let Some(shape) = t.lookup(std::slice::from_ref(&k)).await.unwrap().pop() {
                    let len = shape.len_bytes() as usize;
                    let (r, d) = get_of(k, shape);
                    if t.get(vec![r]).await[0].is_ok() {
                        assert!(holds(&d, probe, len), "block {probe} exact");
                        exact += 1;
                    }
                }
            }
            exact
        }));
    }
    let mut exact = 0;
    for h in tasks {
        exact += h.await.expect("task");
    }
    assert!(exact > 0, "some reads found their block");
    assert!(t.used_bytes() <= t.capacity_bytes());
}

/// Under the `fault` layer: an injected put failure leaves the key invisible, an injected
/// get failure is reported as a failure (never success), and the tier works once cleared.
pub async fn injected_faults_are_never_success(m: &TierMaker) {
    let (inner, _dir) = fresh(m, 16 << 20);
    let t = FaultyTier::new(inner.clone());
    let c = t.control();
    assert_eq!(t.kind(), inner.kind());
    assert_eq!(t.capabilities(), inner.capabilities());
    c.fail_next(1);
    let r = t.put(vec![put_of(1, &[4096]), put_of(2, &[4096])]).await;
    assert!(r.iter().all(|r| r.is_err()), "{r:?}");
    assert!(inner.lookup(&[key("ns", 1)]).await.unwrap().is_empty());
    for r in t.put(vec![put_of(1, &[4096])]).await {
        r.unwrap();
    }
    c.fail_next(1);
    let (r, _d) = get_of(key("ns", 1), BlockShape::new(vec![4096]));
    assert!(t.get(vec![r]).await[0].is_err());
    c.fail_next(1);
    assert!(t.lookup(&[key("ns", 1)]).await.is_err());
    c.clear();
    let (r, d) = get_of(key("ns", 1), BlockShape::new(vec![4096]));
    t.get(vec![r]).await[0].clone().unwrap();
    assert!(holds(&d, 1, 4096));
    assert_eq!(c.injected_failures(), 3);
}

/// A dropped get or put future leaves memory safe: the tier releases the buffers it was
/// handed once its own work ends, and keeps serving.
pub async fn dropped_futures_leave_memory_safe(m: &TierMaker) {
    let (t, _dir) = fresh(m, 16 << 20);
    for r in t.put(vec![put_of(1, &[256 << 10])]).await {
        r.unwrap();
    }
    let (r, dest) = get_of(key("ns", 1), BlockShape::new(vec![256 << 10]));
    drop(t.get(vec![r]));
    let src = block(2, &[256 << 10]);
    drop(t.put(vec![TierPut {
        key: key("ns", 2),
        block: src.clone(),
    }]));
    // Whatever the tier started must let go of the buffers eventually.
    for _ in 0..200 {
        if Arc::strong_count(&dest) == 1 && Arc::strong_count(&src) == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        Arc::strong_count(&dest),
        1,
        "the tier let go of the destination"
    );
    assert_eq!(Arc::strong_count(&src), 1, "the tier let go of the source");
    let (r, d) = get_of(key("ns", 1), BlockShape::new(vec![256 << 10]));
    t.get(vec![r]).await[0].clone().unwrap();
    assert!(holds(&d, 1, 256 << 10));
}

/// Persistent tiers only (instantiated with `block_tier_conformance_tests!(maker,
/// persistent)`): the tier declares itself persistent, and what was put and flushed is found
/// again, exact, after reopening the same directory.
pub async fn persistent_tiers_recover(m: &TierMaker) {
    let dir = tempfile::tempdir().unwrap();
    let t = (m.make)(16 << 20, dir.path());
    assert!(
        t.capabilities().persistent,
        "tier {} is instantiated as persistent but does not declare it",
        t.kind()
    );
    for r in t
        .put((0..5).map(|i| put_of(i, &[3000, 1000])).collect())
        .await
    {
        r.unwrap();
    }
    t.flush().await.unwrap();
    drop(t);
    let t = (m.make)(16 << 20, dir.path());
    let rec = t.recover().await.expect("recover");
    assert_eq!(rec.blocks, 5);
    let keys: Vec<BlockKey> = (0..5).map(|i| key("ns", i)).collect();
    let shapes = t.lookup(&keys).await.unwrap();
    assert_eq!(shapes.len(), 5);
    for (i, s) in shapes.into_iter().enumerate() {
        let (r, d) = get_of(keys[i].clone(), s);
        t.get(vec![r]).await[0].clone().unwrap();
        assert!(holds(&d, i as u64, 4000));
    }
}

/// One `#[tokio::test]` per case of this suite, each with a fresh tier from `$maker` (a
/// [`TierMaker`] expression). Invoke it inside a module per tier; add `, persistent` for a
/// tier that declares itself persistent (adds the recovery case).
#[macro_export]
macro_rules! block_tier_conformance_tests {
    ($maker:expr, persistent) => {
        $crate::block_tier_conformance_tests!($maker);
        $crate::block_tier_conformance_tests!(@cases $maker; persistent_tiers_recover);
    };
    ($maker:expr) => {
        $crate::block_tier_conformance_tests!(@cases $maker;
            put_lookup_get_roundtrip,
            lookup_stops_at_first_missing_key,
            put_of_a_held_key_changes_nothing,
            remove_and_missing_get,
            full_tier_never_serves_wrong_bytes,
            concurrent_puts_and_gets_stay_exact,
            injected_faults_are_never_success,
            dropped_futures_leave_memory_safe,
        );
    };
    (@cases $maker:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::tier_suite::$case(&$maker).await;
            }
        )*
    };
}
