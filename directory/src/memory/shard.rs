//! One shard of the in-memory directory's block map: entries `(namespace, hash) → owners`,
//! with the counts the MetaServer's gauges read and the estimated bytes the store budget
//! charges. Owns no lock and no policy: the directory locks a shard and decides.

use std::sync::Arc;

use hashbrown::HashTable;

use crate::limits::{ENTRY_OVERHEAD_BYTES, OWNER_BYTES};

/// One owner of an entry: the node table's slot of its address and the generation of the
/// registration that inserted it (visible while that registration is the slot's live one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Owner {
    pub addr: u32,
    pub gen: u32,
}

/// A block key and its owners (never empty while stored).
pub(super) struct Entry {
    /// The interned namespace: one `Arc` per distinct live namespace, so entries compare
    /// namespaces by pointer.
    pub ns: Arc<str>,
    pub hash: Box<[u8]>,
    pub owners: Vec<Owner>,
}

/// Estimated bytes of an entry with a `hash_len`-byte hash and `owners` owners (0 when it
/// has none: it is not stored).
pub(super) fn entry_bytes(hash_len: usize, owners: usize) -> u64 {
    match owners {
        0 => 0,
        n => ENTRY_OVERHEAD_BYTES + hash_len as u64 + (n as u64 - 1) * OWNER_BYTES,
    }
}

/// The redundancy bucket of a key with `n` owners (`None` for 0).
fn bucket(n: usize) -> Option<usize> {
    match n {
        0 => None,
        1..=3 => Some(n - 1),
        _ => Some(3),
    }
}

/// What a scan over a shard dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Dropped {
    pub owners: u64,
    pub keys: u64,
    /// Estimated bytes freed.
    pub bytes: u64,
}

impl std::ops::AddAssign for Dropped {
    fn add_assign(&mut self, o: Self) {
        self.owners += o.owners;
        self.keys += o.keys;
        self.bytes += o.bytes;
    }
}

#[derive(Default)]
pub(super) struct Shard {
    pub table: HashTable<Entry>,
    /// Owner records over all entries.
    pub owners: u64,
    /// Entries by owner count (1, 2, 3, 4 or more).
    pub by_count: [u64; 4],
}

impl Shard {
    /// Book-keeping for an entry whose owner count went from `before` to `after`.
    pub fn recount(&mut self, before: usize, after: usize) {
        if let Some(b) = bucket(before) {
            self.by_count[b] -= 1;
        }
        if let Some(b) = bucket(after) {
            self.by_count[b] += 1;
        }
        self.owners = self.owners + after as u64 - before as u64;
    }

    /// Drops the owners `drop` selects from every entry, and entries left without owners.
    pub fn retain_owners(&mut self, mut drop: impl FnMut(&Owner) -> bool) -> Dropped {
        let mut d = Dropped::default();
        let mut changes: Vec<(usize, usize)> = Vec::new();
        self.table.retain(|e| {
            let before = e.owners.len();
            e.owners.retain(|o| !drop(o));
            let after = e.owners.len();
            if after != before {
                d.owners += (before - after) as u64;
                d.bytes += entry_bytes(e.hash.len(), before) - entry_bytes(e.hash.len(), after);
                changes.push((before, after));
            }
            if after == 0 {
                d.keys += 1;
                false
            } else {
                true
            }
        });
        for (before, after) in changes {
            self.recount(before, after);
        }
        d
    }
}
