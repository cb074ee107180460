//! The host-pool conformance suite: written once, instantiated per landing pool (DESIGN.md §9).
//!
//! Owns: generic checks every [`HostPool`] must pass, each a `pub fn(PoolMaker)`, and the
//! [`pool_conformance_tests!`](crate::pool_conformance_tests) macro that turns them into one
//! `#[test]` per case for a given maker. A tier crate's test file is one line:
//! `pegaflow_tests::pool_conformance_tests!(my_maker);` inside a module.
//!
//! Must never: depend on a particular tier's rounding, layout or kind name (only on what the
//! [`HostPool`] trait promises), time anything, or leave buffers alive between cases.
//!
//! Extending: the cases below exercise the allocate-style operations of host-addressable
//! tiers and are skipped (returning early) for tiers that are not. When the trait grows
//! put/get/remove (SSD), add `pub fn` cases here and one line each to the macro.

use std::sync::Arc;

use pegaflow_plugin::layers::fault::FaultyPool;
use pegaflow_plugin::{HostBuffer, HostPool};

/// Builds a fresh, empty tier able to hold about `capacity_bytes` bytes (the tier may round
/// the capacity down; the suite reads [`HostPool::capacity_bytes`]).
pub type PoolMaker = fn(capacity_bytes: u64) -> Arc<dyn HostPool>;

/// A small deterministic generator (xorshift64*), so failures reproduce.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (any value).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

/// `len` bytes that differ between ids and between positions.
pub fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(id ^ 0xA5A5_5A5A);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Fills `buf` with [`pattern`]`(id)`.
pub fn fill(buf: &HostBuffer, id: u64) {
    buf.write_at(0, &pattern(id, buf.len()));
}

/// Whether `buf` still holds [`pattern`]`(id)`.
pub fn holds(buf: &HostBuffer, id: u64) -> bool {
    let mut got = vec![0u8; buf.len()];
    buf.read_at(0, &mut got);
    got == pattern(id, buf.len())
}

/// One buffer of `len` bytes from a pool.
pub trait AllocOne {
    /// [`HostPool::allocate_batch`] of one entry, no alignment constraint.
    fn alloc_one(&self, len: usize) -> Option<HostBuffer>;
}

impl<P: HostPool + ?Sized> AllocOne for P {
    fn alloc_one(&self, len: usize) -> Option<HostBuffer> {
        self.allocate_batch(&[len], 1)?.pop()
    }
}

/// The pool under test (every host pool is host-addressable, so no case is skipped).
fn host_tier(make: PoolMaker, capacity: u64) -> Option<Arc<dyn HostPool>> {
    Some(make(capacity))
}

fn free_bytes(t: &dyn HostPool) -> u64 {
    t.capacity_bytes() - t.used_bytes()
}

/// The largest length whose footprint fits in `bytes`.
fn largest_len_within(t: &dyn HostPool, bytes: u64) -> usize {
    let mut len = usize::try_from(bytes).expect("fits usize");
    while len > 0 && t.footprint_bytes(len) > bytes {
        len -= 1;
    }
    len
}

/// Capacity is reported, starts empty, and `used_bytes` moves by exactly the footprint of
/// each allocation and back on drop.
pub fn capacity_and_used_accounting(make: PoolMaker) {
    let Some(t) = host_tier(make, 1 << 20) else {
        return;
    };
    let cap = t.capacity_bytes();
    assert!(cap > 0 && cap <= 1 << 20, "capacity {cap}");
    assert_eq!(t.used_bytes(), 0, "a fresh tier is empty");
    let mut expect = 0;
    let mut bufs = Vec::new();
    for len in [1usize, 100, 511, 512, 513, 4096, 10_000, 65_537] {
        let fp = t.footprint_bytes(len);
        assert!(fp >= len as u64, "footprint {fp} below length {len}");
        let b = t.alloc_one(len).expect("room");
        assert_eq!(b.len(), len, "buffer length is exactly the request");
        assert_eq!(b.extents().iter().map(|e| e.len).sum::<usize>(), len);
        expect += fp;
        assert_eq!(t.used_bytes(), expect);
        bufs.push((b, fp));
    }
    while let Some((b, fp)) = bufs.pop() {
        drop(b);
        expect -= fp;
        assert_eq!(t.used_bytes(), expect);
    }
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.capacity_bytes(), cap, "capacity does not drift");
}

/// Filling the tier ends in `None` only when the footprint no longer fits; a free makes
/// room again; a request above capacity fails without changing anything.
pub fn exhaustion_returns_none_then_succeeds_after_free(make: PoolMaker) {
    let Some(t) = host_tier(make, 256 << 10) else {
        return;
    };
    let cap = t.capacity_bytes();
    let len = 4096;
    let fp = t.footprint_bytes(len);
    let mut bufs = Vec::new();
    loop {
        match t.alloc_one(len) {
            Some(b) => bufs.push(b),
            None => break,
        }
        assert!(
            bufs.len() as u64 <= cap / fp + 1,
            "more allocated than fits"
        );
    }
    assert!(
        free_bytes(&*t) < fp,
        "None while {} bytes free",
        free_bytes(&*t)
    );
    assert!(t.used_bytes() <= cap);
    let used = t.used_bytes();
    assert!(t.alloc_one(len).is_none(), "still full");
    assert!(
        t.allocate_batch(&[len], 1).is_none(),
        "batch on a full tier"
    );
    assert_eq!(t.used_bytes(), used, "failed allocations change nothing");
    bufs.pop();
    let b = t.alloc_one(len).expect("room after a free");
    assert_eq!(b.len(), len);
    drop((b, bufs));
    assert_eq!(t.used_bytes(), 0);
    let over = usize::try_from(cap).expect("fits") + 1;
    assert!(t.alloc_one(over).is_none(), "above capacity");
    assert_eq!(t.used_bytes(), 0);
}

/// Mixed sizes, freed in a checkerboard, leave many small holes; an allocation of all the
/// free bytes still succeeds and every byte lands.
pub fn fragmentation_does_not_fail_allocation(make: PoolMaker) {
    let Some(t) = host_tier(make, 512 << 10) else {
        return;
    };
    let mut rng = Rng::new(7);
    let mut bufs: Vec<Option<(HostBuffer, u64)>> = Vec::new();
    let mut id = 0;
    while let Some(b) = t.alloc_one(rng.range(1, 9000)) {
        fill(&b, id);
        bufs.push(Some((b, id)));
        id += 1;
    }
    for slot in bufs.iter_mut().step_by(2) {
        *slot = None;
    }
    let free = free_bytes(&*t);
    let len = largest_len_within(&*t, free);
    assert!(len > 0);
    let big = t
        .alloc_one(len)
        .unwrap_or_else(|| panic!("fragmentation failed a {len}-byte allocation with {free} free"));
    assert_eq!(big.len(), len);
    fill(&big, u64::MAX);
    assert!(holds(&big, u64::MAX));
    for (b, id) in bufs.iter().flatten() {
        assert!(
            holds(b, *id),
            "buffer {id} damaged by the gathered allocation"
        );
    }
    drop(big);
    bufs.clear();
    assert_eq!(t.used_bytes(), 0);
    // After everything is free, one allocation of (nearly) the whole capacity succeeds.
    let all = largest_len_within(&*t, t.capacity_bytes());
    assert!(
        t.alloc_one(all).is_some(),
        "free space did not come back whole"
    );
}

/// Bytes written to one buffer never appear in another, across many live buffers of mixed
/// sizes, including after frees and reuse.
pub fn bytes_never_leak_between_buffers(make: PoolMaker) {
    let Some(t) = host_tier(make, 1 << 20) else {
        return;
    };
    let mut rng = Rng::new(11);
    let mut live: Vec<(HostBuffer, u64)> = Vec::new();
    for id in 0..400u64 {
        if !live.is_empty() && rng.range(0, 2) == 0 {
            let i = rng.range(0, live.len() - 1);
            let (b, bid) = live.swap_remove(i);
            assert!(holds(&b, bid), "buffer {bid} damaged before free");
        }
        if let Some(b) = t.alloc_one(rng.range(1, 20_000)) {
            fill(&b, id);
            live.push((b, id));
        }
        for (b, bid) in &live {
            assert!(holds(b, *bid), "buffer {bid} damaged after allocating {id}");
        }
    }
    let mut ranges: Vec<(usize, usize)> = live
        .iter()
        .flat_map(|(b, _)| b.extents().iter().map(|e| (e.addr, e.addr + e.len)))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[0].1 <= w[1].0, "extents overlap: {w:?}");
    }
    let backing: Vec<(usize, usize)> = t.regions().iter().map(|r| r.range()).collect();
    if !backing.is_empty() {
        for &(s, e) in &ranges {
            assert!(
                backing.iter().any(|&(a, l)| s >= a && e <= a + l),
                "extent outside the backing ranges"
            );
        }
    }
}

/// `allocate_batch` returns one buffer per length, accounts each footprint, and is all or
/// nothing.
pub fn batch_allocation_is_all_or_nothing(make: PoolMaker) {
    let Some(t) = host_tier(make, 256 << 10) else {
        return;
    };
    let lens = [4096, 1, 0, 777, 8192];
    let fp: u64 = lens.iter().map(|&l| t.footprint_bytes(l)).sum();
    let bufs = t.allocate_batch(&lens, 1).expect("room");
    assert_eq!(bufs.iter().map(HostBuffer::len).collect::<Vec<_>>(), lens);
    assert_eq!(t.used_bytes(), fp);
    for (i, b) in bufs.iter().enumerate() {
        fill(b, i as u64);
    }
    for (i, b) in bufs.iter().enumerate() {
        assert!(holds(b, i as u64));
    }
    drop(bufs);
    assert_eq!(t.used_bytes(), 0);
    let half = usize::try_from(t.capacity_bytes() / 2).expect("fits");
    let held = t.alloc_one(half).expect("room");
    let used = t.used_bytes();
    assert!(t
        .allocate_batch(&[half / 2, half / 2, half / 2], 1)
        .is_none());
    assert_eq!(t.used_bytes(), used, "a failed batch allocates nothing");
    drop(held);
    assert_eq!(t.used_bytes(), 0);
}

/// Buffers stay valid after the last handle to the tier is dropped.
pub fn buffers_outlive_the_tier(make: PoolMaker) {
    let Some(t) = host_tier(make, 256 << 10) else {
        return;
    };
    let b = t.alloc_one(10_000).expect("room");
    fill(&b, 3);
    drop(t);
    assert!(holds(&b, 3));
    fill(&b, 4);
    assert!(holds(&b, 4));
}

/// Eight threads allocate, write, verify and free concurrently; nothing overlaps and the
/// tier ends empty.
pub fn concurrent_allocate_write_verify_free(make: PoolMaker) {
    const THREADS: u64 = 8;
    const ROUNDS: usize = 150;
    const MAX_LEN: usize = 64 << 10;
    const HELD: usize = 4;
    let Some(t) = host_tier(make, 4 << 20) else {
        return;
    };
    std::thread::scope(|s| {
        for th in 0..THREADS {
            let t = t.clone();
            s.spawn(move || {
                let mut rng = Rng::new(th + 100);
                let mut held: Vec<(HostBuffer, u64)> = Vec::new();
                for round in 0..ROUNDS {
                    let id = th << 32 | round as u64;
                    let b = t
                        .alloc_one(rng.range(1, MAX_LEN))
                        .expect("capacity exceeds what all threads hold");
                    fill(&b, id);
                    held.push((b, id));
                    std::thread::yield_now();
                    for (b, bid) in &held {
                        assert!(holds(b, *bid), "thread {th}: buffer {bid} damaged");
                    }
                    if held.len() >= HELD {
                        held.swap_remove(rng.range(0, held.len() - 1));
                    }
                }
            });
        }
    });
    assert_eq!(t.used_bytes(), 0, "every buffer was returned");
    let all = largest_len_within(&*t, t.capacity_bytes());
    assert!(t.alloc_one(all).is_some(), "free space came back whole");
}

/// A [`FaultyPool`] around the tier fails exactly the allocations it is told to, changes
/// no accounting when it does, and forwards everything else.
pub fn faulty_pool_drives_failures(make: PoolMaker) {
    let Some(inner) = host_tier(make, 256 << 10) else {
        return;
    };
    let t = FaultyPool::new(inner.clone());
    let c = t.control();
    assert_eq!(t.kind(), inner.kind());
    assert_eq!(t.metric_label(), inner.metric_label());
    assert_eq!(t.capacity_bytes(), inner.capacity_bytes());
    assert_eq!(t.free_bytes(), inner.free_bytes());
    assert_eq!(t.regions(), inner.regions());

    c.fail_next(2);
    assert!(t.alloc_one(100).is_none());
    assert!(t.allocate_batch(&[100, 200], 1).is_none());
    assert_eq!(t.used_bytes(), 0, "injected failures allocate nothing");
    let a = t.alloc_one(100).expect("budget spent");
    assert_eq!(t.used_bytes(), t.footprint_bytes(100));
    assert_eq!(inner.used_bytes(), t.used_bytes());

    c.fail_every(3);
    let calls_before = c.calls();
    let results: Vec<bool> = (0..6).map(|_| t.alloc_one(64).is_some()).collect();
    let failed = results.iter().filter(|ok| !**ok).count();
    assert_eq!(failed, 2, "every third call fails: {results:?}");
    assert_eq!(c.calls(), calls_before + 6);
    assert_eq!(c.injected_failures(), 4);

    c.clear();
    let b = t.alloc_one(5000).expect("faults cleared");
    fill(&b, 1);
    assert!(holds(&b, 1));
    drop((a, b));
    assert_eq!(inner.used_bytes(), 0);
}

/// One `#[test]` per conformance case, each calling the case with `$maker`
/// (a [`PoolMaker`](crate::pool_suite::PoolMaker)). Invoke it inside a module per tier.
#[macro_export]
macro_rules! pool_conformance_tests {
    ($maker:expr) => {
        $crate::pool_conformance_tests!(@cases $maker;
            capacity_and_used_accounting,
            exhaustion_returns_none_then_succeeds_after_free,
            fragmentation_does_not_fail_allocation,
            bytes_never_leak_between_buffers,
            batch_allocation_is_all_or_nothing,
            buffers_outlive_the_tier,
            concurrent_allocate_write_verify_free,
            faulty_pool_drives_failures,
        );
    };
    (@cases $maker:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::pool_suite::$case($maker);
            }
        )*
    };
}
