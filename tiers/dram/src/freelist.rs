//! Free-extent bookkeeping of one shard of the DRAM pool.
//!
//! Owns: the set of free byte ranges of one shard, indexed twice — by offset (for coalescing
//! neighbours on release) and by `(len, offset)` (for best-fit and largest-first search) — and
//! the count of free bytes. Offsets are bytes from the start of the pool's mapping.
//!
//! Ranges released by buffers are first queued ([`FreeList::defer`]: no tree work per buffer)
//! and merged in one sorted pass ([`FreeList::settle`]) before anything searches the trees, or
//! once [`PENDING_MAX`] are queued: blocks freed together (an eviction batch) were usually
//! allocated together, so they coalesce into a few ranges first. Queued bytes count as free.
//!
//! Must never: hand out a range twice, keep two adjacent free ranges uncoalesced once settled,
//! or accept a returned range that overlaps a free one (that would be a double free; it is
//! refused, at once or when the queue is settled, and counted in [`FreeList::take_refused`]).

use std::collections::{BTreeMap, BTreeSet};

/// Released ranges queued before they are merged into the trees.
pub(crate) const PENDING_MAX: usize = 1024;

/// The free ranges of one shard.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// offset -> len.
    by_offset: BTreeMap<usize, usize>,
    /// (len, offset).
    by_size: BTreeSet<(usize, usize)>,
    /// Sum of all free lengths, in bytes (queued ones included).
    free: usize,
    /// Released `(offset, len)` ranges not yet merged into the trees.
    pending: Vec<(usize, usize)>,
    /// Bytes of queued ranges refused when settled (double frees), not yet reported.
    refused: usize,
}

/// A returned range overlapped memory that is already free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overlap;

impl FreeList {
    /// A free list holding the single range `[offset, offset + len)` (nothing when `len == 0`).
    pub(crate) fn new(offset: usize, len: usize) -> Self {
        let mut f = Self::default();
        if len > 0 {
            f.insert_raw(offset, len);
        }
        f
    }

    /// Free bytes.
    pub(crate) fn free_bytes(&self) -> usize {
        self.free
    }

    /// Number of free ranges (after settling the queue).
    pub(crate) fn extent_count(&mut self) -> usize {
        self.settle();
        self.by_offset.len()
    }

    /// Length of the largest free range, in bytes (0 when full; after settling the queue).
    pub(crate) fn largest(&mut self) -> usize {
        self.settle();
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Free ranges `(offset, len)` in offset order (after settling the queue).
    pub(crate) fn ranges(&mut self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.settle();
        self.by_offset.iter().map(|(&o, &l)| (o, l))
    }

    /// Queues `[offset, offset + len)` to be returned to the free set (counted free at once);
    /// the trees take it at the next [`FreeList::settle`], which runs by itself once
    /// [`PENDING_MAX`] ranges wait.
    pub(crate) fn defer(&mut self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        self.pending.push((offset, len));
        self.free += len;
        if self.pending.len() >= PENDING_MAX {
            self.settle();
        }
    }

    /// Bytes refused as double frees while settling since the last call (they had been
    /// counted free when queued, and are not).
    pub(crate) fn take_refused(&mut self) -> usize {
        std::mem::take(&mut self.refused)
    }

    /// Merges the queued ranges into the trees: sorted, adjacent ones joined first, so a
    /// batch of neighbouring buffers costs one tree update. A queued range overlapping a free
    /// one, or another queued one, is refused (a double free) and counted.
    pub(crate) fn settle(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut p = std::mem::take(&mut self.pending);
        p.sort_unstable_by_key(|r| r.0);
        // Un-count them: give_back counts what it accepts.
        self.free -= p.iter().map(|r| r.1).sum::<usize>();
        let mut i = 0;
        while i < p.len() {
            let (start, mut end) = (p[i].0, p[i].0 + p[i].1);
            let mut j = i + 1;
            let mut clean = true;
            while j < p.len() && p[j].0 <= end {
                if p[j].0 < end {
                    // Queued twice: a double free.
                    self.refused += p[j].1;
                    p[j].1 = 0;
                    clean = false;
                } else {
                    end += p[j].1;
                }
                j += 1;
            }
            if !clean || self.give_back(start, end - start).is_err() {
                // Piece by piece, so that only what overlaps is refused.
                for &(o, l) in &p[i..j] {
                    if l > 0 && self.give_back(o, l).is_err() {
                        self.refused += l;
                    }
                }
            }
            i = j;
        }
        p.clear();
        self.pending = p;
    }

    /// Whether `[offset, offset + len)` lies entirely inside one free range (after settling
    /// the queue).
    pub(crate) fn contains(&mut self, offset: usize, len: usize) -> bool {
        self.settle();
        self.by_offset
            .range(..=offset)
            .next_back()
            .is_some_and(|(&o, &l)| o + l >= offset + len)
    }

    fn insert_raw(&mut self, offset: usize, len: usize) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free += len;
    }

    fn remove_raw(&mut self, offset: usize, len: usize) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free -= len;
    }

    /// Takes `len` bytes from the start of the smallest free range that holds them and
    /// returns their offset; `None` when no single range is large enough.
    pub(crate) fn take_best_fit(&mut self, len: usize) -> Option<usize> {
        self.settle();
        let &(have, offset) = self.by_size.range((len, 0)..).next()?;
        self.remove_raw(offset, have);
        if have > len {
            self.insert_raw(offset + len, have - len);
        }
        Some(offset)
    }

    /// Takes up to `len` bytes, largest ranges first, appending the `(offset, len)` pieces to
    /// `out` (only the last piece taken may be a part of its range; the rest of that range
    /// stays free). Returns the bytes taken: `len`, or all free bytes if fewer.
    pub(crate) fn take_largest_first(
        &mut self,
        len: usize,
        out: &mut Vec<(usize, usize)>,
    ) -> usize {
        self.settle();
        let mut taken = 0;
        while taken < len {
            let Some(&(have, offset)) = self.by_size.last() else {
                break;
            };
            let take = have.min(len - taken);
            self.remove_raw(offset, have);
            if have > take {
                self.insert_raw(offset + take, have - take);
            }
            out.push((offset, take));
            taken += take;
        }
        taken
    }

    /// Returns `[offset, offset + len)` to the free set, merging it with free neighbours.
    /// Refuses (changing nothing) a range that overlaps a free range.
    pub(crate) fn give_back(&mut self, offset: usize, len: usize) -> Result<(), Overlap> {
        if len == 0 {
            return Ok(());
        }
        self.settle();
        let end = offset + len;
        let prev = self
            .by_offset
            .range(..=offset)
            .next_back()
            .map(|(&o, &l)| (o, l));
        if prev.is_some_and(|(o, l)| o + l > offset) {
            return Err(Overlap);
        }
        let next = self.by_offset.range(offset..).next().map(|(&o, &l)| (o, l));
        if next.is_some_and(|(o, _)| o < end) {
            return Err(Overlap);
        }
        let (mut start, mut stop) = (offset, end);
        if let Some((o, l)) = prev.filter(|&(o, l)| o + l == offset) {
            self.remove_raw(o, l);
            start = o;
        }
        if let Some((o, l)) = next.filter(|&(o, _)| o == end) {
            self.remove_raw(o, l);
            stop = o + l;
        }
        self.insert_raw(start, stop - start);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_picks_smallest_that_fits() {
        let mut f = FreeList::new(0, 10_000);
        let a = f.take_best_fit(1000).unwrap();
        let b = f.take_best_fit(500).unwrap();
        let _c = f.take_best_fit(2000).unwrap();
        f.give_back(a, 1000).unwrap();
        // Free: [0,1000) and [3500,10000); a 600-byte request goes to the 1000-byte hole.
        assert_eq!(f.take_best_fit(600), Some(0));
        assert_eq!(b, 1000);
        assert_eq!(f.free_bytes(), 10_000 - 600 - 500 - 2000);
    }

    #[test]
    fn coalesces_both_sides() {
        let mut f = FreeList::new(0, 3000);
        let a = f.take_best_fit(1000).unwrap();
        let b = f.take_best_fit(1000).unwrap();
        let c = f.take_best_fit(1000).unwrap();
        assert_eq!(f.extent_count(), 0);
        f.give_back(a, 1000).unwrap();
        f.give_back(c, 1000).unwrap();
        assert_eq!(f.extent_count(), 2);
        f.give_back(b, 1000).unwrap();
        assert_eq!(f.extent_count(), 1);
        assert_eq!(f.largest(), 3000);
        assert_eq!(f.ranges().collect::<Vec<_>>(), vec![(0, 3000)]);
    }

    #[test]
    fn refuses_double_free() {
        let mut f = FreeList::new(0, 4096);
        let a = f.take_best_fit(1024).unwrap();
        f.give_back(a, 1024).unwrap();
        assert_eq!(f.give_back(a, 1024), Err(Overlap));
        assert_eq!(f.give_back(512, 512), Err(Overlap));
        assert_eq!(f.free_bytes(), 4096);
    }

    #[test]
    fn largest_first_gathers() {
        let mut f = FreeList::new(0, 8192);
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(f.take_best_fit(1024).unwrap());
        }
        // Free every other 1 KiB block: four holes of 1 KiB.
        for o in held.iter().step_by(2) {
            f.give_back(*o, 1024).unwrap();
        }
        let mut out = Vec::new();
        assert_eq!(f.take_largest_first(3072, &mut out), 3072);
        assert_eq!(out.len(), 3);
        assert_eq!(f.free_bytes(), 1024);
        let mut out = Vec::new();
        assert_eq!(f.take_largest_first(4096, &mut out), 1024);
        assert_eq!(f.free_bytes(), 0);
    }

    #[test]
    fn deferred_ranges_coalesce_count_free_and_refuse_double_frees() {
        let mut f = FreeList::new(0, 8192);
        let held: Vec<usize> = (0..8).map(|_| f.take_best_fit(1024).unwrap()).collect();
        assert_eq!(f.free_bytes(), 0);
        // Released in a shuffled order: counted free at once, merged into one range.
        for &i in &[3, 1, 0, 2] {
            f.defer(held[i], 1024);
        }
        assert_eq!(f.free_bytes(), 4096);
        assert_eq!(f.extent_count(), 1);
        assert_eq!(f.largest(), 4096);
        // A double free among queued ranges, and one of an already free range.
        f.defer(held[5], 1024);
        f.defer(held[5], 1024);
        f.defer(held[0], 1024);
        assert_eq!(f.free_bytes(), 4096 + 3 * 1024);
        f.settle();
        assert_eq!(f.take_refused(), 2048);
        assert_eq!(f.take_refused(), 0);
        assert_eq!(f.free_bytes(), 5120);
        assert_eq!(
            f.ranges().collect::<Vec<_>>(),
            vec![(0, 4096), (5120, 1024)]
        );
        // Searches see queued ranges: 4096..5120 joins both neighbours.
        f.defer(held[4], 1024);
        assert_eq!(f.take_best_fit(6144), Some(0));
        assert_eq!(f.free_bytes(), 0);
        // The queue settles by itself when full.
        let mut g = FreeList::new(0, PENDING_MAX * 2 * 512);
        let offs: Vec<usize> = (0..PENDING_MAX * 2)
            .map(|_| g.take_best_fit(512).unwrap())
            .collect();
        for o in offs.iter().step_by(2) {
            g.defer(*o, 512);
        }
        assert!(g.pending.len() < PENDING_MAX);
        assert_eq!(g.free_bytes(), PENDING_MAX * 512);
    }

    #[test]
    fn contains_checks_one_range() {
        let mut f = FreeList::new(4096, 4096);
        assert!(f.contains(4096, 4096));
        assert!(f.contains(5000, 100));
        assert!(!f.contains(0, 4097));
        assert!(!f.contains(8000, 200));
    }
}
