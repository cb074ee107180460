//! The hash table of one index shard: 32 bits of a key's hash and its slab slot, in one
//! 8-byte word per bucket, found by linear probing.
//!
//! Why not a general-purpose map: a lookup in a 1M-block index is a cache miss on the table
//! and another on the slab entry it points to. Here the bucket a key starts probing at is
//! known from its hash alone ([`SlotTable::prefetch`]), so a batch of lookups can have all
//! their table lines on the way before the first is read, and the probe reads one line (no
//! separate control bytes). Entries carry the 32 bits their bucket derives from, so growing
//! and deleting (backward shift) never read the slab. The hashes come from the index's
//! hasher, seeded at random per process, so clients choosing their block hashes cannot aim
//! them at one probe run.
//!
//! Owns nothing but the words. Must never: hold one slot twice, or lose an entry when
//! another is removed (removal shifts the rest of its run back).

/// An empty bucket (its slot half is the slab's "no entry").
const EMPTY: u64 = u64::MAX;

/// The table grows once entries would fill more than this fraction of the buckets (1/2:
/// linear probing then reads ~1.5 buckets for a hit and ~2.5 for a miss, one cache line
/// nearly always).
const MAX_LOAD_NUM: usize = 1;
const MAX_LOAD_DEN: usize = 2;

/// Buckets of the first allocation.
const MIN_BUCKETS: usize = 16;

/// The 32 bits of a key's 64-bit hash that the table keeps (the top half; the shard takes
/// its bits from the low half).
fn frag(tag: u64) -> u32 {
    (tag >> 32) as u32
}

/// Open-addressing table of (hash fragment, slot) words.
#[derive(Default)]
pub(super) struct SlotTable {
    /// `(frag << 32) | slot` per bucket, [`EMPTY`] if none; a power of two long (or empty).
    words: Box<[u64]>,
    /// Occupied buckets.
    len: usize,
}

impl SlotTable {
    /// Number of entries.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The bucket where probing for `frag` starts: the top bits of a multiplicative mix of
    /// the fragment (Fibonacci hashing), so that fragments alike in their top bits spread too.
    /// Only called on a table of at least [`MIN_BUCKETS`] buckets.
    fn home(&self, frag: u32) -> usize {
        let bits = self.words.len().trailing_zeros();
        ((frag.wrapping_mul(0x9E37_79B9) as u64) << 32 >> (64 - bits)) as usize
    }

    /// Prefetches the line where a lookup of `tag` starts (a hint; nothing is read).
    pub(super) fn prefetch(&self, tag: u64) {
        if !self.words.is_empty() {
            super::index::prefetch(self.words.as_ptr().wrapping_add(self.home(frag(tag))));
        }
    }

    /// The first slot, in probe order, whose fragment is `tag`'s and for which `eq` holds.
    pub(super) fn find(&self, tag: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.position(tag, eq).map(|b| self.words[b] as u32)
    }

    /// The first slot whose fragment is `tag`'s, without verifying it (a candidate).
    pub(super) fn candidate(&self, tag: u64) -> Option<u32> {
        self.find(tag, |_| true)
    }

    /// The bucket holding the first entry of `tag`'s fragment for which `eq` holds.
    pub(super) fn position(&self, tag: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.words.is_empty() {
            return None;
        }
        let f = frag(tag);
        let mask = self.words.len() - 1;
        let mut b = self.home(f);
        loop {
            let w = self.words[b];
            if w == EMPTY {
                return None;
            }
            if (w >> 32) as u32 == f && eq(w as u32) {
                return Some(b);
            }
            b = (b + 1) & mask;
        }
    }

    /// Adds `slot` under `tag` (the caller knows the slot is not in the table yet).
    pub(super) fn insert(&mut self, tag: u64, slot: u32) {
        if (self.len + 1) * MAX_LOAD_DEN > self.words.len() * MAX_LOAD_NUM {
            self.grow();
        }
        self.place(((frag(tag) as u64) << 32) | slot as u64);
        self.len += 1;
    }

    /// Puts a word in the first empty bucket of its run.
    fn place(&mut self, w: u64) {
        let mask = self.words.len() - 1;
        let mut b = self.home((w >> 32) as u32);
        while self.words[b] != EMPTY {
            b = (b + 1) & mask;
        }
        self.words[b] = w;
    }

    fn grow(&mut self) {
        let n = (self.words.len() * 2).max(MIN_BUCKETS);
        let old = std::mem::replace(&mut self.words, vec![EMPTY; n].into_boxed_slice());
        for w in old.iter().copied().filter(|&w| w != EMPTY) {
            self.place(w);
        }
    }

    /// The slot in bucket `b`, if any.
    pub(super) fn slot_at(&self, b: usize) -> Option<u32> {
        self.words
            .get(b)
            .filter(|&&w| w != EMPTY)
            .map(|&w| w as u32)
    }

    /// Empties bucket `b` (occupied), moving later entries of its run back so that every
    /// entry stays reachable from its home bucket. Entries may change buckets.
    pub(super) fn remove_at(&mut self, b: usize) {
        debug_assert!(self.words[b] != EMPTY, "removing an empty bucket");
        let mask = self.words.len() - 1;
        let mut hole = b;
        let mut j = b;
        loop {
            j = (j + 1) & mask;
            let w = self.words[j];
            if w == EMPTY {
                break;
            }
            let h = self.home((w >> 32) as u32);
            // The entry at j may fill the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.words[hole] = w;
                hole = j;
            }
        }
        self.words[hole] = EMPTY;
        self.len -= 1;
    }

    /// Removes every entry (keeps the buckets).
    pub(super) fn clear(&mut self) {
        self.words.fill(EMPTY);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A tag whose fragment is `f` (the low half is unused by the table).
    fn tag(f: u32) -> u64 {
        (f as u64) << 32 | 0xdead
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Remove(usize),
    }

    proptest! {
        /// Against a map of slot → fragment: after any sequence of inserts (fragments from a
        /// small set, so runs collide and wrap) and removals, every present slot is found
        /// under its fragment, no removed slot is, and the count agrees.
        #[test]
        fn lookups_agree_with_a_map_after_inserts_and_removals(
            ops in proptest::collection::vec(
                prop_oneof![
                    (0u32..24).prop_map(Op::Insert),
                    (0usize..64).prop_map(Op::Remove),
                ],
                1..400,
            )
        ) {
            let mut t = SlotTable::default();
            let mut model: HashMap<u32, u32> = HashMap::new();
            let mut next = 0u32;
            for op in ops {
                match op {
                    Op::Insert(f) => {
                        t.insert(tag(f), next);
                        model.insert(next, f);
                        next += 1;
                    }
                    Op::Remove(k) => {
                        let mut present: Vec<u32> = model.keys().copied().collect();
                        if present.is_empty() {
                            continue;
                        }
                        present.sort_unstable();
                        let slot = present[k % present.len()];
                        let f = model.remove(&slot).unwrap();
                        let b = t.position(tag(f), |s| s == slot).expect("present slot found");
                        prop_assert_eq!(t.slot_at(b), Some(slot));
                        t.remove_at(b);
                    }
                }
                prop_assert_eq!(t.len(), model.len());
            }
            for (&slot, &f) in &model {
                prop_assert_eq!(t.find(tag(f), |s| s == slot), Some(slot));
            }
            for slot in 0..next {
                if !model.contains_key(&slot) {
                    for f in 0..24 {
                        prop_assert_eq!(t.find(tag(f), |s| s == slot), None);
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_table_finds_nothing_and_grows_on_first_insert() {
        let mut t = SlotTable::default();
        assert_eq!(t.candidate(tag(7)), None);
        t.prefetch(tag(7));
        t.insert(tag(7), 3);
        assert_eq!(t.candidate(tag(7)), Some(3));
        assert_eq!(t.candidate(tag(8)), None);
        t.clear();
        assert_eq!(t.len(), 0);
        assert_eq!(t.candidate(tag(7)), None);
    }

    #[test]
    fn growing_keeps_every_entry() {
        let mut t = SlotTable::default();
        for i in 0..10_000u32 {
            t.insert(tag(i.wrapping_mul(2_654_435_761)), i);
        }
        assert!(t.words.len() >= 20_000, "load stays at most one half");
        for i in 0..10_000u32 {
            assert_eq!(
                t.find(tag(i.wrapping_mul(2_654_435_761)), |s| s == i),
                Some(i)
            );
        }
    }
}
