//! The host-DRAM block index: sealed blocks by `(namespace, group, hash)`, with exact LRU order.
//!
//! Owns: the only strong reference to a resident block besides leases and running loads.
//! Must never: evict (or de-index) a block someone else holds — a lease, a load in flight —
//! which is exactly "its `Arc` has more than one strong reference".
//!
//! The map is split into shards, each behind its own mutex, so a query never holds one lock
//! across its whole hash list. Recency is a global counter stamped on every touch; eviction
//! takes the smallest stamp among evictable entries of all shards, so the order is exact LRU.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::block::{BlockKey, KeyRef, SealedBlock};

const SHARDS: usize = 16;

struct Entry {
    block: Arc<SealedBlock>,
    stamp: u64,
    /// A lower tier already holds (or was offered) the block: eviction needs no demotion.
    written_below: bool,
}

#[derive(Default)]
struct Shard {
    map: HashMap<BlockKey, Entry>,
    lru: BTreeMap<u64, BlockKey>,
    /// Stamps of the entries not yet written below DRAM (a subset of `lru`'s keys), so that
    /// write-behind finds the oldest of them without walking past written ones.
    unwritten: BTreeSet<u64>,
}

/// What an eviction removed.
#[derive(Debug)]
pub struct Evicted {
    /// Its key.
    pub key: BlockKey,
    /// The block (dropping it frees its memory unless still referenced).
    pub block: Arc<SealedBlock>,
    /// Whether the block was already written below DRAM (no demotion needed).
    pub written_below: bool,
}

/// The sharded index.
pub struct BlockIndex {
    shards: Vec<Mutex<Shard>>,
    clock: AtomicU64,
    hasher: hashbrown::DefaultHashBuilder,
    resident_bytes: AtomicU64,
    resident_blocks: AtomicU64,
    /// Footprint of resident blocks not yet written below DRAM, in bytes.
    unwritten_bytes: AtomicU64,
}

impl std::fmt::Debug for BlockIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockIndex")
            .field("blocks", &self.resident_blocks())
            .finish()
    }
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            clock: AtomicU64::new(1),
            hasher: hashbrown::DefaultHashBuilder::default(),
            resident_bytes: AtomicU64::new(0),
            resident_blocks: AtomicU64::new(0),
            unwritten_bytes: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &KeyRef<'_>) -> &Mutex<Shard> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// Looks a block up and, when found, marks it most recently used.
    pub fn get_touch(&self, key: KeyRef<'_>) -> Option<Arc<SealedBlock>> {
        let mut s = self.shard(&key).lock();
        let s = &mut *s;
        let (k, e) = s.map.get_key_value_mut(&key)?;
        let stamp = self.tick();
        if let Some(kk) = s.lru.remove(&e.stamp) {
            s.lru.insert(stamp, kk);
        } else {
            s.lru.insert(stamp, k.clone());
        }
        if !e.written_below {
            s.unwritten.remove(&e.stamp);
            s.unwritten.insert(stamp);
        }
        e.stamp = stamp;
        Some(e.block.clone())
    }

    /// Whether a block is resident (no recency change).
    pub fn contains(&self, key: KeyRef<'_>) -> bool {
        self.shard(&key).lock().map.contains_key(&key)
    }

    /// Inserts a sealed block as most recently used. Returns false (and keeps the existing
    /// block) when the key is already resident: content-addressed blocks never overwrite.
    pub fn insert(&self, key: BlockKey, block: Arc<SealedBlock>) -> bool {
        self.insert_marked(key, block, false)
    }

    /// [`BlockIndex::insert`], recording whether a lower tier already holds the block (a
    /// promoted block does).
    pub fn insert_marked(
        &self,
        key: BlockKey,
        block: Arc<SealedBlock>,
        written_below: bool,
    ) -> bool {
        let kr = key.as_ref();
        let shard = self.shard(&kr);
        let mut s = shard.lock();
        if s.map.contains_key(&kr) {
            return false;
        }
        let stamp = self.tick();
        let fp = block.footprint;
        s.lru.insert(stamp, key.clone());
        if !written_below {
            s.unwritten.insert(stamp);
        }
        s.map.insert(
            key,
            Entry {
                block,
                stamp,
                written_below,
            },
        );
        if !written_below {
            self.unwritten_bytes.fetch_add(fp, Ordering::Relaxed);
        }
        self.resident_bytes.fetch_add(fp, Ordering::Relaxed);
        self.resident_blocks.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Removes the least recently used block that nobody else holds. `None` when every
    /// resident block is referenced (leased or loading) or the index is empty.
    pub fn evict_lru(&self) -> Option<Evicted> {
        loop {
            // Find the globally oldest evictable entry.
            let mut best: Option<(u64, usize)> = None;
            for (i, sh) in self.shards.iter().enumerate() {
                let s = sh.lock();
                for (&stamp, key) in s.lru.iter() {
                    if best.is_some_and(|(b, _)| b < stamp) {
                        break;
                    }
                    let e = &s.map[key];
                    if Arc::strong_count(&e.block) == 1 {
                        best = Some((stamp, i));
                        break;
                    }
                }
            }
            let (stamp, i) = best?;
            let mut s = self.shards[i].lock();
            // Re-check under the lock: the entry may have been touched or leased meanwhile.
            let Some(key) = s.lru.get(&stamp).cloned() else {
                continue;
            };
            if Arc::strong_count(&s.map[&key].block) != 1 {
                continue;
            }
            s.lru.remove(&stamp);
            let e = s.map.remove(&key).expect("lru and map agree");
            self.resident_bytes
                .fetch_sub(e.block.footprint, Ordering::Relaxed);
            self.resident_blocks.fetch_sub(1, Ordering::Relaxed);
            if !e.written_below {
                s.unwritten.remove(&stamp);
                self.unwritten_bytes
                    .fetch_sub(e.block.footprint, Ordering::Relaxed);
            }
            return Some(Evicted {
                key,
                block: e.block,
                written_below: e.written_below,
            });
        }
    }

    /// Removes every block (the memory-cleanup endpoint), referenced or not. Referenced blocks
    /// stay allocated until their holders drop them.
    pub fn clear(&self) -> Vec<(BlockKey, Arc<SealedBlock>)> {
        let mut out = Vec::new();
        for sh in &self.shards {
            let mut s = sh.lock();
            s.lru.clear();
            s.unwritten.clear();
            for (k, e) in s.map.drain() {
                out.push((k, e.block));
            }
        }
        let bytes: u64 = out.iter().map(|(_, b)| b.footprint).sum();
        self.resident_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.resident_blocks
            .fetch_sub(out.len() as u64, Ordering::Relaxed);
        self.unwritten_bytes.store(0, Ordering::Relaxed);
        out
    }

    /// Footprint of resident blocks no lower tier holds yet, in bytes.
    pub fn unwritten_bytes(&self) -> u64 {
        self.unwritten_bytes.load(Ordering::Relaxed)
    }

    /// The least recently used resident blocks of storage group `group` not yet written
    /// below DRAM, oldest first, at most `max` of them (write-behind candidates).
    pub fn oldest_unwritten(&self, group: u32, max: usize) -> Vec<(BlockKey, Arc<SealedBlock>)> {
        let mut cands: Vec<(u64, BlockKey, Arc<SealedBlock>)> = Vec::new();
        for sh in &self.shards {
            let s = sh.lock();
            let mut taken = 0;
            for stamp in s.unwritten.iter() {
                if taken == max {
                    break;
                }
                let key = &s.lru[stamp];
                if key.group == group {
                    cands.push((*stamp, key.clone(), s.map[key].block.clone()));
                    taken += 1;
                }
            }
        }
        cands.sort_unstable_by_key(|c| c.0);
        cands.truncate(max);
        cands.into_iter().map(|(_, k, b)| (k, b)).collect()
    }

    /// Records that a lower tier holds `key` now (or refused it for good); false when the key
    /// is no longer resident.
    pub fn mark_written_below(&self, key: &BlockKey) -> bool {
        let kr = key.as_ref();
        let mut s = self.shard(&kr).lock();
        let s = &mut *s;
        match s.map.get_mut(&kr) {
            Some(e) => {
                if !e.written_below {
                    e.written_below = true;
                    s.unwritten.remove(&e.stamp);
                    self.unwritten_bytes
                        .fetch_sub(e.block.footprint, Ordering::Relaxed);
                }
                true
            }
            None => false,
        }
    }

    /// Number of shards the keys are split over (for walking them with
    /// [`BlockIndex::shard_keys`]).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The keys resident in shard `i` (`< shard_count()`; an index beyond yields none), in no
    /// particular order: a snapshot, so a walk over all shards holds one shard's lock at a
    /// time and sees each key at most once.
    pub fn shard_keys(&self, i: usize) -> Vec<BlockKey> {
        match self.shards.get(i) {
            Some(s) => s.lock().map.keys().cloned().collect(),
            None => Vec::new(),
        }
    }

    /// Footprint of resident blocks, in bytes.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes.load(Ordering::Relaxed)
    }

    /// Number of resident blocks.
    pub fn resident_blocks(&self) -> u64 {
        self.resident_blocks.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Instant;

    fn block(fp: u64) -> Arc<SealedBlock> {
        Arc::new(SealedBlock {
            group: 0,
            slots: Box::new([]),
            footprint: fp,
            sealed_at: Instant::now(),
        })
    }

    fn key(ns: &str, h: u8) -> BlockKey {
        BlockKey {
            namespace: ns.into(),
            group: 0,
            hash: vec![h].into(),
        }
    }

    #[test]
    fn lru_order_and_touch() {
        let ix = BlockIndex::new();
        for h in 0..5 {
            assert!(ix.insert(key("a", h), block(10)));
        }
        assert!(!ix.insert(key("a", 0), block(10)), "no overwrite");
        // Touch 0: now 1 is the oldest.
        let r = KeyRef {
            namespace: "a",
            group: 0,
            hash: &[0],
        };
        assert!(ix.get_touch(r).is_some());
        let e = ix.evict_lru().unwrap();
        drop(e);
        assert!(!ix.contains(KeyRef {
            namespace: "a",
            group: 0,
            hash: &[1]
        }));
        assert!(ix.contains(KeyRef {
            namespace: "a",
            group: 0,
            hash: &[0]
        }));
        assert_eq!(ix.resident_blocks(), 4);
        assert_eq!(ix.resident_bytes(), 40);
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let ix = BlockIndex::new();
        ix.insert(key("a", 1), block(1));
        ix.insert(key("a", 2), block(1));
        let held = ix
            .get_touch(KeyRef {
                namespace: "a",
                group: 0,
                hash: &[1],
            })
            .unwrap();
        let held2 = ix
            .get_touch(KeyRef {
                namespace: "a",
                group: 0,
                hash: &[2],
            })
            .unwrap();
        assert!(ix.evict_lru().is_none());
        drop(held2);
        assert!(ix.evict_lru().is_some());
        assert!(ix.contains(KeyRef {
            namespace: "a",
            group: 0,
            hash: &[1]
        }));
        drop(held);
    }

    #[test]
    fn oldest_unwritten_follows_recency_and_skips_written_blocks() {
        let ix = BlockIndex::new();
        for h in 0..4 {
            assert!(ix.insert(key("a", h), block(10)));
        }
        ix.get_touch(KeyRef {
            namespace: "a",
            group: 0,
            hash: &[0],
        });
        assert!(ix.mark_written_below(&key("a", 1)));
        let order: Vec<u8> = ix
            .oldest_unwritten(0, 8)
            .into_iter()
            .map(|(k, _)| k.hash[0])
            .collect();
        assert_eq!(order, vec![2, 3, 0]);
        assert_eq!(ix.unwritten_bytes(), 30);
        assert_eq!(ix.oldest_unwritten(0, 1).len(), 1);
        assert!(ix.oldest_unwritten(1, 8).is_empty());
        while ix.evict_lru().is_some() {}
        assert_eq!(ix.unwritten_bytes(), 0);
        assert!(ix.oldest_unwritten(0, 8).is_empty());
    }

    #[test]
    fn namespaces_and_groups_are_distinct_keys() {
        let ix = BlockIndex::new();
        ix.insert(key("a", 1), block(1));
        assert!(!ix.contains(KeyRef {
            namespace: "b",
            group: 0,
            hash: &[1]
        }));
        assert!(!ix.contains(KeyRef {
            namespace: "a",
            group: 1,
            hash: &[1]
        }));
    }
}
