//! The host-DRAM block index: sealed blocks by `(namespace, group, hash)`, in LRU order.
//!
//! Owns: the only strong reference to a resident block besides leases and running loads.
//! Must never: evict (or de-index) a block someone else holds — a lease, a load in flight —
//! which is exactly "its `Arc` has more than one strong reference".
//!
//! The map is split into shards, each behind its own mutex, so a query never holds one lock
//! across its whole hash list; the batched calls ([`BlockIndex::touch_prefix`],
//! [`BlockIndex::contains_many`], [`BlockIndex::insert_many`]) take each shard's lock once per
//! batch rather than once per hash. Inside a shard, entries live in a slab and are threaded on
//! two intrusive doubly linked lists (every entry, most recently used first; and the entries
//! not yet written below DRAM, in the same order), so a lookup, a touch, an insertion and a
//! removal are O(1): no ordered map is re-stamped on a touch. A shard finds a key's slab
//! entry through its own open-addressing table ([`super::slot_table`]): one 8-byte word per
//! entry, whose line a batch prefetches for all its hashes before it probes any.
//!
//! Recency is a global counter: every touch or insertion takes a stamp, and a shard's list is
//! ordered by stamp. Eviction takes the oldest evictable entry of each shard (walking past
//! referenced ones from the tail) and removes the one with the smallest stamp of all shards,
//! so for operations that do not overlap in time the order is exact LRU. A batched touch takes
//! its stamps in request order (hash `i` of a query is touched before hash `i + 1`); two
//! batches running at once on one shard may interleave there in the order they took its lock.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::slot_table::SlotTable;
use crate::block::{BlockKey, KeyRef, SealedBlock};

/// Number of shards (a power of two).
const SHARDS: usize = 16;

/// The shard of a key is taken from these bits of its hash: disjoint from the top half,
/// which the shard's table keeps per entry and probes by.
const SHARD_SHIFT: u32 = 0;

/// "No entry" in the slab links.
const NIL: u32 = u32::MAX;

/// Hashes up to this many bytes are stored inside the entry (no separate allocation, no
/// extra cache miss when a lookup compares them).
const INLINE_HASH: usize = 32;

/// The bytes of an entry's hash.
enum HashBytes {
    Inline { len: u8, bytes: [u8; INLINE_HASH] },
    Heap(Box<[u8]>),
}

impl HashBytes {
    fn new(h: &[u8]) -> Self {
        if h.len() <= INLINE_HASH {
            let mut bytes = [0u8; INLINE_HASH];
            bytes[..h.len()].copy_from_slice(h);
            Self::Inline {
                len: h.len() as u8,
                bytes,
            }
        } else {
            Self::Heap(h.into())
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..*len as usize],
            Self::Heap(b) => b,
        }
    }
}

/// One resident block: two cache lines, laid out so that what a touch and an eviction read
/// and write of an entry — its links, stamp, block and key fields but the hash bytes — is in
/// the first line. Relinking an entry between its neighbours then touches one line of each
/// neighbour, and a lookup two lines of the entry it verifies.
#[repr(C, align(64))]
struct Node {
    /// The key's full hash (also the hash table's hash).
    tag: u64,
    /// LRU list: `prev` is the next more recent entry, `next` the next older one.
    prev: u32,
    next: u32,
    /// Recency: larger is more recent.
    stamp: u64,
    block: Arc<SealedBlock>,
    group: u32,
    /// A lower tier already holds (or was offered) the block: eviction needs no demotion.
    written_below: bool,
    /// The unwritten list (only while `!written_below`), same direction.
    uprev: u32,
    unext: u32,
    namespace: Arc<str>,
    /// Second line.
    hash: HashBytes,
}

// The first line holds everything but the hash bytes (64-bit targets).
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::offset_of!(Node, hash) == 64);
    assert!(std::mem::size_of::<Option<Node>>() == 128);
};

/// The two intrusive lists every shard threads through its nodes.
#[derive(Debug, Clone, Copy)]
enum List {
    /// Every entry, by recency.
    Lru,
    /// The entries not yet written below DRAM, by recency.
    Unwritten,
}

impl Node {
    /// This node's (prev, next) links in `list`.
    fn links(&mut self, list: List) -> (&mut u32, &mut u32) {
        match list {
            List::Lru => (&mut self.prev, &mut self.next),
            List::Unwritten => (&mut self.uprev, &mut self.unext),
        }
    }

    fn matches(&self, key: &KeyRef<'_>) -> bool {
        self.group == key.group
            && self.hash.as_slice() == key.hash
            && (std::ptr::eq(self.namespace.as_ptr(), key.namespace.as_ptr())
                && self.namespace.len() == key.namespace.len()
                || *self.namespace == *key.namespace)
    }

    fn key(&self) -> BlockKey {
        BlockKey {
            namespace: self.namespace.clone(),
            group: self.group,
            hash: self.hash.as_slice().into(),
        }
    }

    fn evictable(&self) -> bool {
        Arc::strong_count(&self.block) == 1
    }
}

/// One shard: a hash table of (slab index, hash fragment), the slab, and the two lists' ends.
struct Shard {
    table: SlotTable,
    nodes: Vec<Option<Node>>,
    free: Vec<u32>,
    /// Most and least recently used entries.
    head: u32,
    tail: u32,
    /// Most and least recently used entries not yet written below DRAM.
    uhead: u32,
    utail: u32,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            table: SlotTable::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            uhead: NIL,
            utail: NIL,
        }
    }
}

impl Shard {
    fn node(&self, i: u32) -> &Node {
        self.nodes[i as usize]
            .as_ref()
            .expect("linked slot holds a node")
    }

    fn node_mut(&mut self, i: u32) -> &mut Node {
        self.nodes[i as usize]
            .as_mut()
            .expect("linked slot holds a node")
    }

    fn find(&self, tag: u64, key: &KeyRef<'_>) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(tag, |i| {
            nodes[i as usize]
                .as_ref()
                .is_some_and(|n| n.tag == tag && n.matches(key))
        })
    }

    /// The first entry whose hash fragment matches `tag`'s, without reading the slab: the
    /// key's entry unless another key shares the top 32 bits of its hash (the caller verifies).
    fn candidate(&self, tag: u64) -> Option<u32> {
        self.table.candidate(tag)
    }

    /// Prefetches both cache lines of slot `i` (a hint; `i` may be [`NIL`]).
    fn prefetch_node(&self, i: u32) {
        if i != NIL {
            let p = self.nodes.as_ptr().wrapping_add(i as usize).cast::<u8>();
            prefetch(p);
            prefetch(p.wrapping_add(64));
        }
    }

    /// Prefetches the table line of each of the positions `ps` (their hashes in `tags`), so
    /// that a batch's lookups in this shard wait for their misses together.
    fn prefetch_tables(&self, ps: &[u32], tags: &[u64]) {
        for &p in ps {
            self.table.prefetch(tags[p as usize]);
        }
    }

    /// Prefetches the first cache line of slot `i` (its links and stamp: what relinking a
    /// neighbour writes); a hint, `i` may be [`NIL`].
    fn prefetch_links(&self, i: u32) {
        if i != NIL {
            prefetch(self.nodes.as_ptr().wrapping_add(i as usize));
        }
    }

    /// Puts entry `i` at the front (most recent end) of `list`.
    fn push_front(&mut self, list: List, i: u32) {
        let old = *self.ends(list).0;
        {
            let (prev, next) = self.node_mut(i).links(list);
            *prev = NIL;
            *next = old;
        }
        if old == NIL {
            *self.ends(list).1 = i;
        } else {
            *self.node_mut(old).links(list).0 = i;
        }
        *self.ends(list).0 = i;
    }

    /// Takes entry `i` out of `list`.
    fn remove_from(&mut self, list: List, i: u32) {
        let (p, nx) = {
            let (prev, next) = self.node_mut(i).links(list);
            (*prev, *next)
        };
        if p == NIL {
            *self.ends(list).0 = nx;
        } else {
            *self.node_mut(p).links(list).1 = nx;
        }
        if nx == NIL {
            *self.ends(list).1 = p;
        } else {
            *self.node_mut(nx).links(list).0 = p;
        }
    }

    /// `list`'s (head, tail).
    fn ends(&mut self, list: List) -> (&mut u32, &mut u32) {
        match list {
            List::Lru => (&mut self.head, &mut self.tail),
            List::Unwritten => (&mut self.uhead, &mut self.utail),
        }
    }

    fn link_front(&mut self, i: u32) {
        self.push_front(List::Lru, i);
    }

    fn unlink(&mut self, i: u32) {
        self.remove_from(List::Lru, i);
    }

    fn ulink_front(&mut self, i: u32) {
        self.push_front(List::Unwritten, i);
    }

    fn uunlink(&mut self, i: u32) {
        self.remove_from(List::Unwritten, i);
    }

    /// Marks entry `i` most recently used with `stamp`.
    fn touch(&mut self, i: u32, stamp: u64) {
        let n = self.node_mut(i);
        n.stamp = stamp;
        let unwritten = !n.written_below;
        if self.head != i {
            self.unlink(i);
            self.link_front(i);
        }
        if unwritten && self.uhead != i {
            self.uunlink(i);
            self.ulink_front(i);
        }
    }

    /// Adds a node (whose key is not resident) as most recently used; returns its slot.
    fn add(&mut self, node: Node) -> u32 {
        let tag = node.tag;
        let unwritten = !node.written_below;
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                i
            }
            None => {
                let i = u32::try_from(self.nodes.len()).expect("fewer than 2^32 blocks per shard");
                assert!(i != NIL, "fewer than 2^32 - 1 blocks per shard");
                self.nodes.push(Some(node));
                i
            }
        };
        self.table.insert(tag, i);
        self.link_front(i);
        if unwritten {
            self.ulink_front(i);
        }
        i
    }

    /// Removes entry `i` from the table, the lists and the slab.
    fn remove(&mut self, i: u32) -> Node {
        self.remove_at(i, None)
    }

    /// [`Shard::remove`] given where the table holds `i` (`bucket`, from
    /// `SlotTable::position`, checked here; looked up again when it is `None` or stale).
    fn remove_at(&mut self, i: u32, bucket: Option<usize>) -> Node {
        let (tag, unwritten) = {
            let n = self.node(i);
            (n.tag, !n.written_below)
        };
        let b = bucket
            .filter(|&b| self.table.slot_at(b) == Some(i))
            .or_else(|| self.table.position(tag, |j| j == i));
        if let Some(b) = b {
            self.table.remove_at(b);
        }
        self.unlink(i);
        if unwritten {
            self.uunlink(i);
        }
        self.free.push(i);
        self.nodes[i as usize].take().expect("slot held a node")
    }

    /// From entry `i` towards more recent ones (`i` included), the first evictable entry.
    fn evictable_from(&self, mut i: u32) -> Option<u32> {
        while i != NIL {
            let n = self.node(i);
            if n.evictable() {
                return Some(i);
            }
            i = n.prev;
        }
        None
    }

    fn clear(&mut self) -> Vec<Node> {
        self.table.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.uhead = NIL;
        self.utail = NIL;
        self.nodes.drain(..).flatten().collect()
    }
}

/// A block for [`BlockIndex::insert_many`]: `(group, hash, block, written_below)`.
pub type NewBlock<'a> = (u32, &'a [u8], Arc<SealedBlock>, bool);

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

impl From<Node> for Evicted {
    fn from(n: Node) -> Self {
        Self {
            key: n.key(),
            written_below: n.written_below,
            block: n.block,
        }
    }
}

/// Prefetches the cache line at `p` (a hint: any address is allowed, nothing is read).
#[inline(always)]
pub(super) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of the x86_64 baseline; a prefetch reads nothing and cannot
        // fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches the first two cache lines of a block's shared allocation (its reference counts
/// and the block's fields).
fn prefetch_block(b: &Arc<SealedBlock>) {
    // A guess at the layout (std does not promise it): the two counts just before the data,
    // in the same allocation. A wrong address only wastes the hint.
    let p = Arc::as_ptr(b).cast::<u8>().wrapping_sub(16);
    prefetch(p);
    prefetch(p.wrapping_add(64));
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

/// Positions of a batch of keys grouped by shard (a counting sort over the shard index).
struct ByShard {
    /// Positions, shard by shard.
    order: Vec<u32>,
    /// `order[starts[s]..starts[s + 1]]` are the positions of shard `s`.
    starts: [u32; SHARDS + 1],
}

impl ByShard {
    fn new(tags: &[u64]) -> Self {
        let mut starts = [0u32; SHARDS + 1];
        for &t in tags {
            starts[shard_of(t) + 1] += 1;
        }
        for s in 0..SHARDS {
            starts[s + 1] += starts[s];
        }
        let mut fill = starts;
        let mut order = vec![0u32; tags.len()];
        for (p, &t) in tags.iter().enumerate() {
            let s = shard_of(t);
            order[fill[s] as usize] = p as u32;
            fill[s] += 1;
        }
        Self { order, starts }
    }

    fn of(&self, s: usize) -> &[u32] {
        &self.order[self.starts[s] as usize..self.starts[s + 1] as usize]
    }
}

fn kref<'a>(namespace: &'a str, group: u32, hash: &'a [u8]) -> KeyRef<'a> {
    KeyRef {
        namespace,
        group,
        hash,
    }
}

fn shard_of(tag: u64) -> usize {
    (tag >> SHARD_SHIFT) as usize & (SHARDS - 1)
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

    fn tag(&self, key: &KeyRef<'_>) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, tag: u64) -> MutexGuard<'_, Shard> {
        self.shards[shard_of(tag)].lock()
    }

    /// `n` consecutive stamps.
    fn ticks(&self, n: u64) -> u64 {
        self.clock.fetch_add(n, Ordering::Relaxed)
    }

    /// Looks a block up and, when found, marks it most recently used.
    pub fn get_touch(&self, key: KeyRef<'_>) -> Option<Arc<SealedBlock>> {
        let tag = self.tag(&key);
        let mut s = self.shard(tag);
        let i = s.find(tag, &key)?;
        let stamp = self.ticks(1);
        s.touch(i, stamp);
        Some(s.node(i).block.clone())
    }

    /// The longest prefix of `hashes` (under `namespace` and `group`) that is resident, each
    /// block marked most recently used in request order (the first hash touched first). Takes
    /// each shard's lock at most four times per call (a prefetch stage, two lookup stages,
    /// then a touch pass over the prefix), whatever the number of hashes; allocates only per
    /// call, not per hash.
    pub fn touch_prefix(
        &self,
        namespace: &str,
        group: u32,
        hashes: &[Vec<u8>],
    ) -> Vec<Arc<SealedBlock>> {
        if hashes.is_empty() {
            return Vec::new();
        }
        let key = |h| kref(namespace, group, h);
        let tags: Vec<u64> = hashes.iter().map(|h| self.tag(&key(h))).collect();
        let by = ByShard::new(&tags);
        // Pass 1: find every hash (no recency change); the prefix ends at the first miss. In
        // two stages over all the shards, so that the cache misses of different hashes
        // overlap: every hash's table entry first (prefetching its candidate slot), then,
        // once every shard's candidates are on their way, the keys compared (prefetching what
        // the touch pass needs: the block's counts, the LRU neighbours). A candidate found in
        // the first stage is only a hint: the second re-reads it under the lock.
        let mut found = vec![NIL; hashes.len()];
        // Stage 0: every hash's table line on its way (with more than one hash).
        if hashes.len() > 1 {
            for s in 0..SHARDS {
                let ps = by.of(s);
                if !ps.is_empty() {
                    self.shards[s].lock().prefetch_tables(ps, &tags);
                }
            }
        }
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.is_empty() {
                continue;
            }
            let sh = self.shards[s].lock();
            for &p in ps {
                let p = p as usize;
                let c = sh.candidate(tags[p]).unwrap_or(NIL);
                sh.prefetch_node(c);
                found[p] = c;
            }
        }
        let mut prefix = hashes.len();
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.first().is_none_or(|&p| p as usize >= prefix) {
                continue;
            }
            let sh = self.shards[s].lock();
            for &p in ps {
                let p = p as usize;
                if p >= prefix {
                    // Positions ascend within a shard: the rest lies beyond the prefix.
                    break;
                }
                let k = key(&hashes[p]);
                let mut i = found[p];
                let hit = sh
                    .nodes
                    .get(i as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|n| n.tag == tags[p] && n.matches(&k));
                if !hit {
                    // No candidate, another key with the same hash fragment, or the table
                    // changed since the first stage: the full lookup.
                    i = sh.find(tags[p], &k).unwrap_or(NIL);
                }
                found[p] = i;
                if i == NIL {
                    prefix = p;
                    break;
                }
                let n = sh.node(i);
                // The touch pass clones the `Arc` (counts 16 bytes before the data) and
                // relinks the entry between its neighbours.
                prefetch(Arc::as_ptr(&n.block).cast::<u8>().wrapping_sub(16));
                sh.prefetch_links(n.prev);
                sh.prefetch_links(n.next);
            }
        }
        if prefix == 0 {
            return Vec::new();
        }
        // Pass 2: touch the prefix, stamps in request order.
        let base = self.ticks(prefix as u64);
        let mut out: Vec<Option<Arc<SealedBlock>>> = vec![None; prefix];
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.first().is_none_or(|&p| p as usize >= prefix) {
                continue;
            }
            let mut sh = self.shards[s].lock();
            for &p in ps {
                let p = p as usize;
                if p >= prefix {
                    break;
                }
                let i = found[p];
                // Evicted (and its slot perhaps reused) between the passes: the prefix ends
                // there.
                let still = sh
                    .nodes
                    .get(i as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|n| n.tag == tags[p] && n.matches(&key(&hashes[p])));
                if !still {
                    continue;
                }
                sh.touch(i, base + p as u64);
                out[p] = Some(sh.node(i).block.clone());
            }
        }
        out.into_iter().map_while(|b| b).collect()
    }

    /// Each of `hashes` (under `namespace` and `group`) that is resident, marked most recently
    /// used in request order; `None` for the others. Each shard's lock is taken once.
    pub fn touch_each(
        &self,
        namespace: &str,
        group: u32,
        hashes: &[Vec<u8>],
    ) -> Vec<Option<Arc<SealedBlock>>> {
        let key = |h| kref(namespace, group, h);
        let tags: Vec<u64> = hashes.iter().map(|h| self.tag(&key(h))).collect();
        let by = ByShard::new(&tags);
        let base = self.ticks(hashes.len() as u64);
        let mut out: Vec<Option<Arc<SealedBlock>>> = vec![None; hashes.len()];
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.is_empty() {
                continue;
            }
            let mut sh = self.shards[s].lock();
            sh.prefetch_tables(ps, &tags);
            for &p in ps {
                let p = p as usize;
                if let Some(i) = sh.find(tags[p], &key(&hashes[p])) {
                    sh.touch(i, base + p as u64);
                    out[p] = Some(sh.node(i).block.clone());
                }
            }
        }
        out
    }

    /// Whether a block is resident (no recency change).
    pub fn contains(&self, key: KeyRef<'_>) -> bool {
        let tag = self.tag(&key);
        self.shard(tag).find(tag, &key).is_some()
    }

    /// For each of `hashes` (under `namespace` and `group`), whether it is resident (no
    /// recency change). Each shard's lock is taken once.
    pub fn contains_many(&self, namespace: &str, group: u32, hashes: &[&[u8]]) -> Vec<bool> {
        let key = |h| kref(namespace, group, h);
        let tags: Vec<u64> = hashes.iter().map(|h| self.tag(&key(h))).collect();
        let by = ByShard::new(&tags);
        let mut out = vec![false; hashes.len()];
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.is_empty() {
                continue;
            }
            let sh = self.shards[s].lock();
            sh.prefetch_tables(ps, &tags);
            for &p in ps {
                let p = p as usize;
                out[p] = sh.find(tags[p], &key(hashes[p])).is_some();
            }
        }
        out
    }

    /// Inserts a sealed block as most recently used. Returns false (and keeps the existing
    /// block) when the key is already resident: content-addressed blocks never overwrite.
    pub fn insert(&self, key: BlockKey, block: Arc<SealedBlock>) -> bool {
        self.insert_marked(key, block, false)
    }

    /// A node for `key` (whose namespace is `namespace`, shared, not copied).
    fn node_of(
        &self,
        tag: u64,
        namespace: &Arc<str>,
        key: KeyRef<'_>,
        block: Arc<SealedBlock>,
        written: bool,
    ) -> Node {
        Node {
            tag,
            block,
            stamp: 0,
            prev: NIL,
            next: NIL,
            uprev: NIL,
            unext: NIL,
            group: key.group,
            written_below: written,
            hash: HashBytes::new(key.hash),
            namespace: namespace.clone(),
        }
    }

    fn count_in(&self, fp: u64, written_below: bool) {
        if !written_below {
            self.unwritten_bytes.fetch_add(fp, Ordering::Relaxed);
        }
        self.resident_bytes.fetch_add(fp, Ordering::Relaxed);
        self.resident_blocks.fetch_add(1, Ordering::Relaxed);
    }

    fn count_out(&self, n: &Node) {
        let fp = n.block.footprint;
        self.resident_bytes.fetch_sub(fp, Ordering::Relaxed);
        self.resident_blocks.fetch_sub(1, Ordering::Relaxed);
        if !n.written_below {
            self.unwritten_bytes.fetch_sub(fp, Ordering::Relaxed);
        }
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
        let tag = self.tag(&kr);
        let mut s = self.shard(tag);
        if s.find(tag, &kr).is_some() {
            return false;
        }
        let fp = block.footprint;
        let mut node = self.node_of(tag, &key.namespace, kr, block, written_below);
        node.stamp = self.ticks(1);
        s.add(node);
        drop(s);
        self.count_in(fp, written_below);
        true
    }

    /// Inserts sealed blocks under `namespace`, each as most recently used in list order
    /// (the last one newest): `(group, hash, block, written_below)`. Each shard's lock is
    /// taken once. Returns, per entry, whether it was inserted (false: the key was resident
    /// already, or appears earlier in the list; the existing block is kept).
    pub fn insert_many(&self, namespace: &Arc<str>, blocks: Vec<NewBlock<'_>>) -> Vec<bool> {
        let tags: Vec<u64> = blocks
            .iter()
            .map(|(g, h, _, _)| {
                self.tag(&KeyRef {
                    namespace,
                    group: *g,
                    hash: h,
                })
            })
            .collect();
        let by = ByShard::new(&tags);
        let base = self.ticks(blocks.len() as u64);
        let mut out = vec![false; blocks.len()];
        let mut slots: Vec<Option<NewBlock<'_>>> = blocks.into_iter().map(Some).collect();
        let (mut bytes, mut unwritten, mut count) = (0u64, 0u64, 0u64);
        for s in 0..SHARDS {
            let ps = by.of(s);
            if ps.is_empty() {
                continue;
            }
            let mut sh = self.shards[s].lock();
            sh.prefetch_tables(ps, &tags);
            for &p in ps {
                let p = p as usize;
                let Some((group, hash, block, written)) = slots[p].take() else {
                    continue;
                };
                let kr = KeyRef {
                    namespace,
                    group,
                    hash,
                };
                if sh.find(tags[p], &kr).is_some() {
                    continue;
                }
                let fp = block.footprint;
                let mut node = self.node_of(tags[p], namespace, kr, block, written);
                node.stamp = base + p as u64;
                sh.add(node);
                out[p] = true;
                bytes += fp;
                count += 1;
                if !written {
                    unwritten += fp;
                }
            }
        }
        self.resident_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.resident_blocks.fetch_add(count, Ordering::Relaxed);
        self.unwritten_bytes.fetch_add(unwritten, Ordering::Relaxed);
        out
    }

    /// Removes the least recently used block that nobody else holds. `None` when every
    /// resident block is referenced (leased or loading) or the index is empty.
    pub fn evict_lru(&self) -> Option<Evicted> {
        loop {
            // Find the globally oldest evictable entry: (stamp, shard, slot).
            let mut best: Option<(u64, usize, u32)> = None;
            for (si, sh) in self.shards.iter().enumerate() {
                let s = sh.lock();
                let mut i = s.tail;
                while i != NIL {
                    let n = s.node(i);
                    if best.is_some_and(|(b, _, _)| b < n.stamp) {
                        break;
                    }
                    if n.evictable() {
                        best = Some((n.stamp, si, i));
                        break;
                    }
                    i = n.prev;
                }
            }
            let (stamp, si, i) = best?;
            let mut s = self.shards[si].lock();
            // Re-check under the lock: the entry may have been touched, leased or replaced.
            let ok = s
                .nodes
                .get(i as usize)
                .and_then(Option::as_ref)
                .is_some_and(|n| n.stamp == stamp && n.evictable());
            if !ok {
                continue;
            }
            let n = s.remove(i);
            drop(s);
            self.count_out(&n);
            return Some(n.into());
        }
    }

    /// Removes least recently used unreferenced blocks, in LRU order over all shards, until
    /// their footprints sum to at least `min_bytes` or `max_blocks` were removed (or none is
    /// left). Holds every shard's lock for the batch, so keep `max_blocks` modest (a few
    /// hundred): the caller loops for more.
    pub fn evict_lru_batch(&self, min_bytes: u64, max_blocks: usize) -> Vec<Evicted> {
        self.evict_lru_batch_keyed(min_bytes, max_blocks, true)
    }

    /// [`BlockIndex::evict_lru_batch`]; with `keys` false the returned keys keep their
    /// namespace and group but an empty hash (nothing is allocated for them), for a caller
    /// that only frees the blocks.
    pub fn evict_lru_batch_keyed(
        &self,
        min_bytes: u64,
        max_blocks: usize,
        keys: bool,
    ) -> Vec<Evicted> {
        self.evict_lru_between(min_bytes, u64::MAX, max_blocks, keys)
    }

    /// [`BlockIndex::evict_lru_batch_keyed`] that also never takes a block whose footprint
    /// would bring the batch's sum above `max_bytes`: the walk stops at the first such block
    /// (LRU order is kept; no younger, smaller block is taken in its place). With `min_bytes`
    /// equal to `max_bytes` it frees at most that many bytes, and nothing when the oldest
    /// evictable block alone is larger (evict-ahead's budget).
    pub fn evict_lru_within(&self, max_bytes: u64, max_blocks: usize, keys: bool) -> Vec<Evicted> {
        self.evict_lru_between(max_bytes, max_bytes, max_blocks, keys)
    }

    fn evict_lru_between(
        &self,
        min_bytes: u64,
        max_bytes: u64,
        max_blocks: usize,
        keys: bool,
    ) -> Vec<Evicted> {
        if max_blocks == 0 {
            return Vec::new();
        }
        let mut guards: Vec<MutexGuard<'_, Shard>> = self.shards.iter().map(|s| s.lock()).collect();
        // Each shard's oldest evictable entry, with its stamp: (stamp, slot), u64::MAX if none.
        // Two entries ahead are prefetched, so that by a shard's next turn (the other shards'
        // turns in between) the next candidate's node and its block's reference count (read by
        // `evictable`, in the same lines as its footprint) have arrived: the entry after the
        // candidate was prefetched on the previous turn, so its node is read now for its block
        // and for the entry after it.
        let head_of = |g: &Shard, from: u32| match g.evictable_from(from) {
            Some(i) => {
                let n = g.node(i);
                if n.prev != NIL {
                    let next = g.node(n.prev);
                    prefetch_block(&next.block);
                    g.prefetch_node(next.prev);
                }
                (n.stamp, i)
            }
            None => (u64::MAX, NIL),
        };
        let mut cur: Vec<(u64, u32)> = guards.iter().map(|g| head_of(g, g.tail)).collect();
        let mut freed = 0u64;
        // Three passes, so that the cache misses of one block's table entry do not wait for
        // the previous block's: choose the victims in LRU order (list walks only), find their
        // table buckets (independent lookups), then take them out.
        let mut victims: Vec<(usize, u32)> = Vec::with_capacity(max_blocks.min(1024));
        while freed < min_bytes && victims.len() < max_blocks {
            let (si, &(stamp, i)) = cur
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| c.0)
                .expect("there are shards");
            if stamp == u64::MAX {
                break;
            }
            let g = &guards[si];
            let n = g.node(i);
            if freed.saturating_add(n.block.footprint) > max_bytes {
                break;
            }
            freed += n.block.footprint;
            let newer = n.prev;
            victims.push((si, i));
            cur[si] = head_of(g, newer);
        }
        // Removing an entry may move later entries of its probe run back a bucket, so a bucket
        // found here can be stale by its turn: `remove_at` checks it and looks up again.
        for &(si, i) in &victims {
            let g = &guards[si];
            g.table.prefetch(g.node(i).tag);
        }
        let buckets: Vec<Option<usize>> = victims
            .iter()
            .map(|&(si, i)| {
                let g = &guards[si];
                g.table.position(g.node(i).tag, |j| j == i)
            })
            .collect();
        // Only moves under the locks: the keys are built (and heap hashes freed) after.
        let mut out: Vec<Node> = Vec::with_capacity(victims.len());
        let mut unwritten = 0u64;
        for (&(si, i), b) in victims.iter().zip(buckets) {
            let n = guards[si].remove_at(i, b);
            if !n.written_below {
                unwritten += n.block.footprint;
            }
            out.push(n);
        }
        drop(guards);
        self.resident_bytes.fetch_sub(freed, Ordering::Relaxed);
        self.resident_blocks
            .fetch_sub(out.len() as u64, Ordering::Relaxed);
        self.unwritten_bytes.fetch_sub(unwritten, Ordering::Relaxed);
        if keys {
            return out.into_iter().map(Evicted::from).collect();
        }
        out.into_iter()
            .map(|n| Evicted {
                key: BlockKey {
                    namespace: n.namespace,
                    group: n.group,
                    hash: Box::default(),
                },
                block: n.block,
                written_below: n.written_below,
            })
            .collect()
    }

    /// Removes every block (the memory-cleanup endpoint), referenced or not. Referenced blocks
    /// stay allocated until their holders drop them.
    pub fn clear(&self) -> Vec<(BlockKey, Arc<SealedBlock>)> {
        let mut out = Vec::new();
        for sh in &self.shards {
            let nodes = sh.lock().clear();
            out.extend(nodes.into_iter().map(|n| (n.key(), n.block)));
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
        self.oldest_unwritten_covering(group, max, u64::MAX)
    }

    /// [`BlockIndex::oldest_unwritten`] that stops once the blocks taken reach `min_bytes` of
    /// footprint (the block that crosses it included). Only the blocks returned are
    /// referenced: the candidates are chosen by stamp and slot first, so that a concurrent
    /// eviction never finds the other old blocks held (it would skip them and evict younger
    /// ones). A chosen block evicted between the two looks is left out.
    pub fn oldest_unwritten_covering(
        &self,
        group: u32,
        max: usize,
        min_bytes: u64,
    ) -> Vec<(BlockKey, Arc<SealedBlock>)> {
        // (stamp, shard, slot, footprint) of each shard's oldest `max`.
        let mut cands: Vec<(u64, usize, u32, u64)> = Vec::new();
        for (si, sh) in self.shards.iter().enumerate() {
            let s = sh.lock();
            let mut taken = 0;
            let mut i = s.utail;
            while i != NIL && taken < max {
                let n = s.node(i);
                if n.group == group {
                    cands.push((n.stamp, si, i, n.block.footprint));
                    taken += 1;
                }
                i = n.uprev;
            }
        }
        cands.sort_unstable_by_key(|c| c.0);
        let mut sum = 0u64;
        let mut take = 0;
        for c in cands.iter().take(max) {
            if sum >= min_bytes {
                break;
            }
            sum = sum.saturating_add(c.3);
            take += 1;
        }
        cands.truncate(take);
        // Referenced now, one shard lock per chosen block (at most `max`, write-behind's
        // batch: not a hot path).
        cands
            .into_iter()
            .filter_map(|(stamp, si, slot, _)| {
                let s = self.shards[si].lock();
                let n = s.nodes.get(slot as usize)?.as_ref()?;
                (n.stamp == stamp && n.group == group && !n.written_below)
                    .then(|| (n.key(), n.block.clone()))
            })
            .collect()
    }

    /// Records that a lower tier holds `key` now (or refused it for good); false when the key
    /// is no longer resident.
    pub fn mark_written_below(&self, key: &BlockKey) -> bool {
        let kr = key.as_ref();
        let tag = self.tag(&kr);
        let mut s = self.shard(tag);
        let Some(i) = s.find(tag, &kr) else {
            return false;
        };
        if !s.node(i).written_below {
            s.uunlink(i);
            let n = s.node_mut(i);
            n.written_below = true;
            let fp = n.block.footprint;
            self.unwritten_bytes.fetch_sub(fp, Ordering::Relaxed);
        }
        true
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
            Some(s) => s.lock().nodes.iter().flatten().map(Node::key).collect(),
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
            slots: Default::default(),
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

    fn kr(h: &[u8]) -> KeyRef<'_> {
        KeyRef {
            namespace: "a",
            group: 0,
            hash: h,
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
        assert!(ix.evict_lru_batch(u64::MAX, 100).is_empty());
        drop(held2);
        assert!(ix.evict_lru().is_some());
        assert!(ix.contains(KeyRef {
            namespace: "a",
            group: 0,
            hash: &[1]
        }));
        drop(held);
    }

    /// The write-behind candidates that cover a byte count: only those are referenced, so
    /// an eviction at the same moment still takes the oldest of the others.
    #[test]
    fn oldest_unwritten_covering_references_only_what_it_returns() {
        let ix = BlockIndex::new();
        for h in 0..40 {
            assert!(ix.insert(key("a", h), block(10)));
        }
        let got = ix.oldest_unwritten_covering(0, 64, 25);
        let order: Vec<u8> = got.iter().map(|(k, _)| k.hash[0]).collect();
        assert_eq!(order, vec![0, 1, 2], "until 25 bytes are covered");
        // Held as a write holds them: the next oldest are still evictable, in order.
        let next: Vec<u8> = ix
            .evict_lru_batch(20, 100)
            .into_iter()
            .map(|e| e.key.hash[0])
            .collect();
        assert_eq!(next, vec![3, 4]);
        drop(got);
        assert_eq!(ix.oldest_unwritten_covering(0, 2, u64::MAX).len(), 2);
        assert_eq!(ix.oldest_unwritten_covering(0, 64, 0).len(), 0);
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
        assert!(
            ix.mark_written_below(&key("a", 1)),
            "marking twice is harmless"
        );
        let order: Vec<u8> = ix
            .oldest_unwritten(0, 8)
            .into_iter()
            .map(|(k, _)| k.hash[0])
            .collect();
        assert_eq!(order, vec![2, 3, 0]);
        assert_eq!(ix.unwritten_bytes(), 30);
        assert_eq!(ix.oldest_unwritten(0, 1).len(), 1);
        assert!(ix.oldest_unwritten(1, 8).is_empty());
        // A touch of the written block changes nothing in the unwritten order.
        ix.get_touch(kr(&[1]));
        ix.get_touch(kr(&[2]));
        let order: Vec<u8> = ix
            .oldest_unwritten(0, 8)
            .into_iter()
            .map(|(k, _)| k.hash[0])
            .collect();
        assert_eq!(order, vec![3, 0, 2]);
        while ix.evict_lru().is_some() {}
        assert_eq!(ix.unwritten_bytes(), 0);
        assert!(ix.oldest_unwritten(0, 8).is_empty());
        assert!(!ix.mark_written_below(&key("a", 1)));
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

    #[test]
    fn long_hashes_are_stored_and_compared_whole() {
        let ix = BlockIndex::new();
        let long: Vec<u8> = (0..200u8).collect();
        let mut other = long.clone();
        other[199] ^= 1;
        let k = BlockKey {
            namespace: "a".into(),
            group: 0,
            hash: long.clone().into(),
        };
        assert!(ix.insert(k.clone(), block(1)));
        assert!(ix.contains(kr(&long)));
        assert!(!ix.contains(kr(&other)));
        assert!(!ix.contains(kr(&long[..32])));
        assert_eq!(ix.shard_keys_all(), vec![k]);
    }

    #[test]
    fn touch_prefix_stops_at_the_first_miss_and_touches_only_the_prefix() {
        let ix = BlockIndex::new();
        for h in 0..6 {
            ix.insert(key("a", h), block(1));
        }
        // 0, 1, 2 resident, 9 missing, 3 resident beyond the miss.
        let hashes: Vec<Vec<u8>> = vec![vec![0], vec![1], vec![2], vec![9], vec![3]];
        let hits = ix.touch_prefix("a", 0, &hashes);
        assert_eq!(hits.len(), 3);
        drop(hits);
        // LRU now: 3, 4, 5 (untouched, oldest first), then 0, 1, 2 in request order.
        let order: Vec<u8> = std::iter::from_fn(|| ix.evict_lru().map(|e| e.key.hash[0])).collect();
        assert_eq!(order, vec![3, 4, 5, 0, 1, 2]);
        assert!(ix.touch_prefix("a", 0, &hashes).is_empty());
        assert!(ix.touch_prefix("a", 0, &[]).is_empty());
    }

    #[test]
    fn touch_each_touches_every_hit_in_request_order() {
        let ix = BlockIndex::new();
        for h in 0..4 {
            ix.insert(key("a", h), block(1));
        }
        let hashes: Vec<Vec<u8>> = vec![vec![2], vec![9], vec![0]];
        let got: Vec<bool> = ix
            .touch_each("a", 0, &hashes)
            .iter()
            .map(Option::is_some)
            .collect();
        assert_eq!(got, vec![true, false, true]);
        assert!(ix.touch_each("b", 0, &hashes).iter().all(Option::is_none));
        let order: Vec<u8> = std::iter::from_fn(|| ix.evict_lru().map(|e| e.key.hash[0])).collect();
        assert_eq!(order, vec![1, 3, 2, 0]);
    }

    #[test]
    fn batch_calls_agree_with_single_ones() {
        let ix = BlockIndex::new();
        let ns: Arc<str> = "a".into();
        let hashes: Vec<Vec<u8>> = (0..100u8).map(|h| vec![h, 7]).collect();
        let ins: Vec<(u32, &[u8], Arc<SealedBlock>, bool)> = hashes
            .iter()
            .map(|h| (0, h.as_slice(), block(2), h[0] % 2 == 0))
            .chain(std::iter::once((0, hashes[0].as_slice(), block(2), false)))
            .collect();
        let done = ix.insert_many(&ns, ins);
        assert!(done[..100].iter().all(|&d| d));
        assert!(!done[100], "a repeat in one batch keeps the first");
        assert_eq!(ix.resident_blocks(), 100);
        assert_eq!(ix.resident_bytes(), 200);
        assert_eq!(ix.unwritten_bytes(), 100);
        let probe: Vec<&[u8]> = vec![&hashes[3], &[1, 2, 3], &hashes[99]];
        assert_eq!(ix.contains_many("a", 0, &probe), vec![true, false, true]);
        assert_eq!(ix.contains_many("a", 1, &probe), vec![false; 3]);
        // Inserted in list order: the first is the oldest.
        let first = ix.evict_lru_batch(5, 1000);
        let got: Vec<u8> = first.iter().map(|e| e.key.hash[0]).collect();
        assert_eq!(got, vec![0, 1, 2], "stops once 5 bytes are freed");
        assert!(first[0].written_below && !first[1].written_below);
        assert_eq!(
            ix.evict_lru_batch(u64::MAX, 10).len(),
            10,
            "at most max_blocks"
        );
        assert_eq!(ix.resident_blocks(), 87);
        assert_eq!(ix.unwritten_bytes(), 87 / 2 * 2 + 2);
        // Within a budget: 3 bytes take one 2-byte block and stop (the next would make 4).
        let within = ix.evict_lru_within(3, 1000, true);
        let got: Vec<u8> = within.iter().map(|e| e.key.hash[0]).collect();
        assert_eq!(got, vec![13]);
        assert!(
            ix.evict_lru_within(1, 1000, true).is_empty(),
            "a 2-byte block exceeds 1"
        );
        ix.clear();
        assert_eq!(ix.resident_blocks(), 0);
        assert_eq!(ix.resident_bytes(), 0);
        assert_eq!(ix.unwritten_bytes(), 0);
    }

    impl BlockIndex {
        fn shard_keys_all(&self) -> Vec<BlockKey> {
            (0..self.shard_count())
                .flat_map(|i| self.shard_keys(i))
                .collect()
        }
    }

    mod model {
        //! The index against a plain model: a list of keys in LRU order (oldest first), with
        //! a held flag and a written flag each.

        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Insert(u8, bool),
            Touch(u8),
            Prefix(Vec<u8>),
            Hold(u8),
            Unhold(u8),
            Evict,
            EvictBatch(u8, u8),
            EvictWithin(u8, u8),
            MarkWritten(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            let k = 0u8..24;
            prop_oneof![
                4 => (k.clone(), any::<bool>()).prop_map(|(k, w)| Op::Insert(k, w)),
                3 => k.clone().prop_map(Op::Touch),
                2 => proptest::collection::vec(0u8..24, 0..6).prop_map(Op::Prefix),
                1 => k.clone().prop_map(Op::Hold),
                1 => k.clone().prop_map(Op::Unhold),
                2 => Just(Op::Evict),
                1 => (0u8..40, 1u8..6).prop_map(|(b, m)| Op::EvictBatch(b, m)),
                1 => (0u8..12, 1u8..6).prop_map(|(b, m)| Op::EvictWithin(b, m)),
                1 => k.prop_map(Op::MarkWritten),
            ]
        }

        struct Model {
            /// (key, footprint, written), oldest first.
            lru: Vec<(u8, u64, bool)>,
        }

        impl Model {
            fn pos(&self, k: u8) -> Option<usize> {
                self.lru.iter().position(|e| e.0 == k)
            }
            fn touch(&mut self, k: u8) -> bool {
                match self.pos(k) {
                    Some(p) => {
                        let e = self.lru.remove(p);
                        self.lru.push(e);
                        true
                    }
                    None => false,
                }
            }
        }

        type Held = std::collections::HashMap<u8, Arc<SealedBlock>>;

        fn fp(k: u8) -> u64 {
            u64::from(k % 5) + 1
        }

        proptest! {
            #[test]
            fn index_matches_an_lru_list(ops in proptest::collection::vec(op(), 1..120)) {
                let ix = BlockIndex::new();
                let mut m = Model { lru: Vec::new() };
                let mut held: Held = Default::default();
                let evictable = |m: &Model, held: &Held| {
                    m.lru.iter().position(|e| !held.contains_key(&e.0))
                };
                // The model's batch eviction: oldest unheld first until `min_bytes` are freed
                // or `max` taken; the walk stops at the first block that would bring the sum
                // above `max_bytes`, even when a younger one would fit (LRU order).
                let evict_model = |m: &mut Model, held: &Held, min_bytes: u64, max_bytes: u64, max: usize| {
                    let mut want = Vec::new();
                    let mut freed = 0;
                    while freed < min_bytes && want.len() < max {
                        let Some(p) = evictable(m, held) else { break };
                        if freed + m.lru[p].1 > max_bytes {
                            break;
                        }
                        let e = m.lru.remove(p);
                        freed += e.1;
                        want.push(e.0);
                    }
                    want
                };
                for o in ops {
                    match o {
                        Op::Insert(k, w) => {
                            let fresh = m.pos(k).is_none();
                            prop_assert_eq!(ix.insert_marked(key("a", k), block(fp(k)), w), fresh);
                            if fresh {
                                m.lru.push((k, fp(k), w));
                            }
                        }
                        Op::Touch(k) => {
                            prop_assert_eq!(ix.get_touch(kr(&[k])).is_some(), m.touch(k));
                        }
                        Op::Prefix(ks) => {
                            let hashes: Vec<Vec<u8>> = ks.iter().map(|&k| vec![k]).collect();
                            let got = ix.touch_prefix("a", 0, &hashes).len();
                            let mut want = 0;
                            for &k in &ks {
                                if !m.touch(k) {
                                    break;
                                }
                                want += 1;
                            }
                            prop_assert_eq!(got, want);
                        }
                        Op::Hold(k) => {
                            // Holding is what a lease does: a reference, with a touch.
                            if let Some(b) = ix.get_touch(kr(&[k])) {
                                m.touch(k);
                                held.insert(k, b);
                            }
                        }
                        Op::Unhold(k) => {
                            held.remove(&k);
                        }
                        Op::Evict => {
                            let want = evictable(&m, &held).map(|p| m.lru.remove(p));
                            let got = ix.evict_lru();
                            prop_assert_eq!(
                                got.as_ref().map(|e| (e.key.hash[0], e.written_below)),
                                want.map(|e| (e.0, e.2))
                            );
                        }
                        Op::EvictBatch(bytes, max) => {
                            let got: Vec<u8> = ix
                                .evict_lru_batch(u64::from(bytes), usize::from(max))
                                .into_iter()
                                .map(|e| e.key.hash[0])
                                .collect();
                            let want =
                                evict_model(&mut m, &held, u64::from(bytes), u64::MAX, usize::from(max));
                            prop_assert_eq!(got, want);
                        }
                        Op::EvictWithin(bytes, max) => {
                            let got: Vec<u8> = ix
                                .evict_lru_within(u64::from(bytes), usize::from(max), true)
                                .into_iter()
                                .map(|e| e.key.hash[0])
                                .collect();
                            let b = u64::from(bytes);
                            let want = evict_model(&mut m, &held, b, b, usize::from(max));
                            prop_assert_eq!(got, want);
                        }
                        Op::MarkWritten(k) => {
                            let present = m.pos(k);
                            prop_assert_eq!(ix.mark_written_below(&key("a", k)), present.is_some());
                            if let Some(p) = present {
                                m.lru[p].2 = true;
                            }
                        }
                    }
                    prop_assert_eq!(ix.resident_blocks(), m.lru.len() as u64);
                    prop_assert_eq!(ix.resident_bytes(), m.lru.iter().map(|e| e.1).sum::<u64>());
                    let unwritten: Vec<u8> = m.lru.iter().filter(|e| !e.2).map(|e| e.0).collect();
                    prop_assert_eq!(
                        ix.unwritten_bytes(),
                        m.lru.iter().filter(|e| !e.2).map(|e| e.1).sum::<u64>()
                    );
                    let got: Vec<u8> = ix
                        .oldest_unwritten(0, 100)
                        .into_iter()
                        .map(|(k, _)| k.hash[0])
                        .collect();
                    prop_assert_eq!(got, unwritten);
                }
            }
        }
    }
}
