//! An exact offline model of the server's DRAM tier under LRU eviction, to predict the hit
//! count a replay must see.
//!
//! It follows the server's rules (pegaflow-runtime `engine/{index,save,query}.rs` and the
//! `dram` tier):
//! - capacity is rounded down to the 512-byte granule; a block's footprint is its bytes (all
//!   layers of the single worker) rounded up to the granule;
//! - a query walks the hashes in order, touches each resident one (most recently used) and
//!   stops at the first miss;
//! - a save plans the blocks that are not resident (checked before any eviction; a resident
//!   one is skipped without a touch; a hash repeated in one save counts once), allocates all
//!   of them at once — refused outright when they exceed the capacity, otherwise evicting the
//!   least recently used blocks until the free bytes cover them — and then inserts them in
//!   request order as the most recently used;
//! - nothing is pinned at save time (the replay waits for each load before saving), so the
//!   globally least recently used block is always the one evicted.

use std::collections::HashMap;

use crate::trace::TraceRequest;

/// The DRAM tier's allocation granule in bytes.
pub const GRANULE: u64 = pegaflow_tier_dram::GRANULE as u64;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// What one save did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SaveOutcome {
    /// Blocks inserted.
    pub inserted: u64,
    /// Blocks evicted to make room.
    pub evicted: u64,
    /// The save asked for more than the whole capacity and was refused (nothing changed).
    pub rejected: bool,
}

/// The LRU model: resident hashes in recency order with their byte accounting.
#[derive(Debug, Clone)]
pub struct LruSim {
    capacity: u64,
    footprint: u64,
    used: u64,
    map: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Least recently used.
    head: u32,
    /// Most recently used.
    tail: u32,
}

impl LruSim {
    /// A model of a tier of `capacity_bytes` holding blocks of `block_bytes`.
    pub fn new(capacity_bytes: u64, block_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes / GRANULE * GRANULE,
            footprint: block_bytes.div_ceil(GRANULE) * GRANULE,
            used: 0,
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Capacity in bytes after rounding down to the granule.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Footprint of one block in bytes.
    pub fn footprint(&self) -> u64 {
        self.footprint
    }

    /// Bytes in use.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Resident blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is resident.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `hash` is resident (no recency change).
    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Resident hashes, least recently used first.
    pub fn lru_order(&self) -> Vec<u64> {
        let mut v = Vec::with_capacity(self.map.len());
        let mut i = self.head;
        while i != NIL {
            v.push(self.nodes[i as usize].hash);
            i = self.nodes[i as usize].next;
        }
        v
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_back(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.nodes[self.tail as usize].next = i;
        }
        self.tail = i;
    }

    /// A prefix query: touches the resident prefix of `hashes` in order; returns its length.
    pub fn query(&mut self, hashes: &[u64]) -> usize {
        let mut n = 0;
        for h in hashes {
            let Some(&i) = self.map.get(h) else { break };
            self.unlink(i);
            self.push_back(i);
            n += 1;
        }
        n
    }

    fn evict_one(&mut self) -> bool {
        let i = self.head;
        if i == NIL {
            return false;
        }
        self.unlink(i);
        let h = self.nodes[i as usize].hash;
        self.map.remove(&h);
        self.free.push(i);
        self.used -= self.footprint;
        true
    }

    /// A save of `hashes` (see the module doc).
    pub fn save(&mut self, hashes: &[u64]) -> SaveOutcome {
        let mut plan: Vec<u64> = Vec::with_capacity(hashes.len());
        for &h in hashes {
            if !self.map.contains_key(&h) && !plan.contains(&h) {
                plan.push(h);
            }
        }
        let mut out = SaveOutcome::default();
        if plan.is_empty() {
            return out;
        }
        let need = plan.len() as u64 * self.footprint;
        if need > self.capacity {
            out.rejected = true;
            return out;
        }
        while self.capacity - self.used < need {
            if !self.evict_one() {
                break;
            }
            out.evicted += 1;
        }
        for h in plan {
            let node = Node {
                hash: h,
                prev: NIL,
                next: NIL,
            };
            let i = match self.free.pop() {
                Some(i) => {
                    self.nodes[i as usize] = node;
                    i
                }
                None => {
                    self.nodes.push(node);
                    (self.nodes.len() - 1) as u32
                }
            };
            self.push_back(i);
            self.map.insert(h, i);
            self.used += self.footprint;
            out.inserted += 1;
        }
        out
    }
}

/// Whether request `index` releases its lease instead of loading (when it has hits): every
/// `release_every`-th request (the last of each group of `release_every`); 0 = never.
pub fn releases(index: usize, release_every: u32) -> bool {
    release_every > 0 && index % release_every as usize == release_every as usize - 1
}

/// The model's prediction for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStep {
    /// Blocks hit by the query.
    pub hits: u32,
    /// Blocks the following save inserted.
    pub inserted: u32,
    /// Blocks that save evicted.
    pub evicted: u32,
    /// The save was refused (larger than the capacity).
    pub rejected: bool,
}

/// Totals of a simulated replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimTotals {
    /// Requests.
    pub requests: u64,
    /// Blocks queried.
    pub blocks: u64,
    /// Prompt tokens.
    pub tokens: u64,
    /// Blocks hit.
    pub hit_blocks: u64,
    /// Tokens covered by hit blocks.
    pub hit_tokens: u64,
    /// Blocks loaded (hits of requests that do not release).
    pub loaded_blocks: u64,
    /// Requests that released their lease instead of loading.
    pub released_leases: u64,
    /// Blocks the saves asked for (everything after each hit prefix).
    pub save_requested_blocks: u64,
    /// Blocks inserted.
    pub inserted_blocks: u64,
    /// Blocks evicted.
    pub evicted_blocks: u64,
    /// Saves refused for exceeding the capacity.
    pub rejected_saves: u64,
}

impl SimTotals {
    /// Hit blocks / queried blocks.
    pub fn block_hit_rate(&self) -> f64 {
        ratio(self.hit_blocks, self.blocks)
    }

    /// Hit tokens / prompt tokens.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens, self.tokens)
    }
}

/// `a / b`, 0 when `b` is 0.
pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A simulated replay: per-request predictions and totals.
#[derive(Debug, Clone)]
pub struct Simulation {
    /// Capacity after rounding, in bytes.
    pub capacity: u64,
    /// Footprint of one block, in bytes.
    pub footprint: u64,
    /// One step per request, in replay order.
    pub steps: Vec<SimStep>,
    /// Totals.
    pub totals: SimTotals,
}

/// Replays `trace` sequentially through an [`LruSim`] of `capacity_bytes`: per request, a
/// query of its hashes, then (unless [`releases`] says so, a load of the hits, which does
/// not change the model) a save of the hashes after the hit prefix.
pub fn simulate(
    trace: &[TraceRequest],
    capacity_bytes: u64,
    block_bytes: u64,
    release_every: u32,
) -> Simulation {
    let mut sim = LruSim::new(capacity_bytes, block_bytes);
    let mut t = SimTotals::default();
    let mut steps = Vec::with_capacity(trace.len());
    for (i, r) in trace.iter().enumerate() {
        let hits = sim.query(&r.hash_ids);
        let rest = &r.hash_ids[hits..];
        let s = sim.save(rest);
        t.requests += 1;
        t.blocks += r.hash_ids.len() as u64;
        t.tokens += r.total_tokens();
        t.hit_blocks += hits as u64;
        t.hit_tokens += r.prefix_tokens(hits);
        if hits > 0 {
            if releases(i, release_every) {
                t.released_leases += 1;
            } else {
                t.loaded_blocks += hits as u64;
            }
        }
        t.save_requested_blocks += rest.len() as u64;
        t.inserted_blocks += s.inserted;
        t.evicted_blocks += s.evicted;
        t.rejected_saves += u64::from(s.rejected);
        steps.push(SimStep {
            hits: hits as u32,
            inserted: s.inserted as u32,
            evicted: s.evicted as u32,
            rejected: s.rejected,
        });
    }
    Simulation {
        capacity: sim.capacity(),
        footprint: sim.footprint(),
        steps,
        totals: t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ts: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: ts,
            input_length: ids.len() as u64 * 512,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn granule_rounding() {
        let s = LruSim::new(10_000, 1000);
        assert_eq!(s.capacity(), 9728);
        assert_eq!(s.footprint(), 1024);
        let s = LruSim::new(511, 1);
        assert_eq!(s.capacity(), 0);
        assert_eq!(s.footprint(), 512);
    }

    #[test]
    fn query_touches_the_prefix_only() {
        let mut s = LruSim::new(10 * 512, 512);
        assert_eq!(s.save(&[1, 2, 3, 4]).inserted, 4);
        assert_eq!(s.lru_order(), vec![1, 2, 3, 4]);
        // 3 is resident but after the miss 9: untouched.
        assert_eq!(s.query(&[2, 1, 9, 3]), 2);
        assert_eq!(s.lru_order(), vec![3, 4, 2, 1]);
    }

    #[test]
    fn save_skips_resident_without_touch_and_evicts_lru_first() {
        let mut s = LruSim::new(4 * 512, 512);
        s.save(&[1, 2, 3, 4]);
        // 1 is resident: skipped (no touch); 5, 6 need 2 blocks: evict 1 and 2, the oldest.
        let o = s.save(&[1, 5, 5, 6]);
        assert_eq!(
            o,
            SaveOutcome {
                inserted: 2,
                evicted: 2,
                rejected: false
            }
        );
        assert_eq!(s.lru_order(), vec![3, 4, 5, 6]);
        assert!(
            !s.contains(1),
            "the skipped block was evicted by the same save"
        );
        // Larger than the whole capacity: refused, nothing changes.
        let o = s.save(&[7, 8, 9, 10, 11]);
        assert!(o.rejected);
        assert_eq!(s.lru_order(), vec![3, 4, 5, 6]);
        assert_eq!(s.used(), 4 * 512);
    }

    #[test]
    fn allocation_is_all_at_once() {
        // Capacity 3 blocks, holding [1, 2]; saving [3, 4] needs 2 free: evicts only 1
        // (after which 2 are free), not 2.
        let mut s = LruSim::new(3 * 512, 512);
        s.save(&[1, 2]);
        let o = s.save(&[3, 4]);
        assert_eq!(o.evicted, 1);
        assert_eq!(s.lru_order(), vec![2, 3, 4]);
    }

    /// A plainly written reference: a Vec in LRU order.
    fn reference(trace: &[TraceRequest], cap_blocks: usize) -> Vec<u32> {
        let mut lru: Vec<u64> = Vec::new();
        let mut out = Vec::new();
        for r in trace {
            let mut hits = 0;
            for h in &r.hash_ids {
                match lru.iter().position(|x| x == h) {
                    Some(p) => {
                        let x = lru.remove(p);
                        lru.push(x);
                        hits += 1;
                    }
                    None => break,
                }
            }
            let mut plan: Vec<u64> = Vec::new();
            for h in &r.hash_ids[hits..] {
                if !lru.contains(h) && !plan.contains(h) {
                    plan.push(*h);
                }
            }
            if plan.len() <= cap_blocks {
                while cap_blocks - lru.len() < plan.len() {
                    lru.remove(0);
                }
                lru.extend(plan);
            }
            out.push(hits as u32);
        }
        out
    }

    #[test]
    fn matches_a_plain_reference_on_random_prefix_workloads() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..20 {
            // Conversations: each turn extends an earlier one's prefix with fresh ids.
            let mut convs: Vec<Vec<u64>> = Vec::new();
            let mut next_id = 0u64;
            let mut trace = Vec::new();
            for t in 0..400 {
                let ids = if !convs.is_empty() && rng.random_bool(0.6) {
                    let c = rng.random_range(0..convs.len());
                    let keep = rng.random_range(0..=convs[c].len());
                    let mut ids = convs[c][..keep].to_vec();
                    for _ in 0..rng.random_range(1..6) {
                        ids.push(next_id);
                        next_id += 1;
                    }
                    ids
                } else {
                    (0..rng.random_range(1..12))
                        .map(|_| {
                            next_id += 1;
                            next_id - 1
                        })
                        .collect()
                };
                convs.push(ids.clone());
                trace.push(req(t, &ids));
            }
            let cap_blocks = 5 + round * 3;
            let block = 1000u64; // footprint 1024
            let sim = simulate(&trace, cap_blocks as u64 * 1024 + 100, block, 0);
            let want = reference(&trace, cap_blocks);
            let got: Vec<u32> = sim.steps.iter().map(|s| s.hits).collect();
            assert_eq!(got, want, "round {round}");
        }
    }

    #[test]
    fn totals_and_release_rule() {
        let t = vec![req(0, &[1, 2]), req(1, &[1, 2, 3]), req(2, &[1, 4])];
        let s = simulate(&t, 1 << 20, 512, 2);
        assert_eq!(s.totals.hit_blocks, 3);
        assert_eq!(s.totals.blocks, 7);
        assert_eq!(s.totals.inserted_blocks, 4);
        // Request 1 (index 1) releases; request 2 loads its 1 hit.
        assert_eq!(s.totals.released_leases, 1);
        assert_eq!(s.totals.loaded_blocks, 1);
        assert!(releases(1, 2) && !releases(0, 2) && !releases(5, 0));
        // Infinite capacity equals the trace's infinite-cache figure.
        let st = crate::trace::stats(&t);
        assert_eq!(s.totals.hit_blocks, st.infinite_hit_blocks);
    }
}
