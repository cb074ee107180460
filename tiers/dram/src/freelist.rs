//! Free-extent bookkeeping of one shard of the DRAM pool.
//!
//! Owns: the set of free byte ranges of one shard, indexed twice — by offset (for coalescing
//! neighbours on release) and by `(len, offset)` (for best-fit and largest-first search) — and
//! the count of free bytes. Offsets are bytes from the start of the pool's mapping.
//!
//! Must never: hand out a range twice, keep two adjacent free ranges uncoalesced, or accept a
//! returned range that overlaps a free one (that would be a double free; it is refused).

use std::collections::{BTreeMap, BTreeSet};

/// The free ranges of one shard.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// offset -> len.
    by_offset: BTreeMap<usize, usize>,
    /// (len, offset).
    by_size: BTreeSet<(usize, usize)>,
    /// Sum of all free lengths, in bytes.
    free: usize,
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

    /// Number of free ranges.
    pub(crate) fn extent_count(&self) -> usize {
        self.by_offset.len()
    }

    /// Length of the largest free range, in bytes (0 when full).
    pub(crate) fn largest(&self) -> usize {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Free ranges `(offset, len)` in offset order.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.by_offset.iter().map(|(&o, &l)| (o, l))
    }

    /// Whether `[offset, offset + len)` lies entirely inside one free range.
    pub(crate) fn contains(&self, offset: usize, len: usize) -> bool {
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
    fn contains_checks_one_range() {
        let f = FreeList::new(4096, 4096);
        assert!(f.contains(4096, 4096));
        assert!(f.contains(5000, 100));
        assert!(!f.contains(0, 4097));
        assert!(!f.contains(8000, 200));
    }
}
