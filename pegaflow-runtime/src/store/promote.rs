//! Promotion: a query whose DRAM prefix stops short while a lower tier holds the
//! continuation starts one task that reads the continuation into host DRAM; the query is
//! answered `Loading` until the task ends or its deadline passes.
//!
//! Tasks are keyed by `(namespace, req_id, digest of the hashes)`, which is what the 0.25.1
//! client re-polls with (it resends the same `req_id` and the original hashes at every
//! scheduler step, with no timeout of its own: reference/tiering-and-p2p.md §2). A re-poll
//! looks the task up and starts no I/O. The task walks the ladder: the tier whose lookup
//! found the continuation, then each later tier for whatever is still missing, then gives up
//! (a miss). It pins the DRAM prefix it was started for and the blocks it promoted until the
//! re-poll that collects it, so that what it loaded is still there when the answer is Ready.
//!
//! With a peer rung installed ([`TierStack::set_peer`]: a `[peer]` that fetches and a
//! `[directory]`), the ladder starts one step higher: the directory's cover plan for the
//! continuation (this node excluded) names the node with the longest run from the start,
//! then the nodes of the later segments. The task asks the [`PeerFetcher`] for each
//! segment from its node in turn (up to the first node that is suspect or recently denied
//! holding its segment's first block, and stopping at the first segment that lands short),
//! then falls through to the lower tiers for whatever is still missing, then to a miss, all
//! in the same task and under the same deadline. A fetched block enters the index like any
//! promoted block (the directory publisher advertises it once it is resident).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{IndexEventKind, TierStack};
use crate::block::{BlockKey, BlockShape, SealedBlock};
use crate::plugin::{HolderLookup, PeerFetcher, TierGet};

/// The peer rung of the promotion ladder: who fetches, and the directory that says from
/// where.
pub(super) struct PeerRung {
    fetcher: Arc<dyn PeerFetcher>,
    directory: Arc<dyn HolderLookup>,
}

/// Where a promotion task starts: a run the directory places on another node (fetched
/// first), then the lower tiers from `first_tier` (with the shapes that tier's lookup
/// reported, when the query already looked).
struct Plan {
    /// The directory's segments `(node, run length)`, in hash order.
    peer: Vec<(String, usize)>,
    first_tier: usize,
    shapes: Option<Vec<BlockShape>>,
}

/// The answer to a prefix query of group 0.
#[derive(Debug)]
pub enum PrefixAnswer {
    /// The prefix resident in DRAM now (possibly empty), touched.
    Ready(Vec<Arc<SealedBlock>>),
    /// A lower tier holds the continuation and a promotion is under way: ask again.
    Loading,
}

type TaskKey = (Arc<str>, String, u64);

struct Task {
    deadline: Instant,
    done: AtomicBool,
    finished: Mutex<Option<Instant>>,
    /// The DRAM prefix the task was started for and the blocks it promoted, pinned until the
    /// task is collected.
    pinned: Mutex<Vec<Arc<SealedBlock>>>,
}

/// Promotion tasks by key.
#[derive(Default)]
pub(super) struct Promotions {
    tasks: Mutex<HashMap<TaskKey, Arc<Task>>>,
    /// Blocks being read by running tasks, over all of them (bounded by
    /// `max_promote_blocks`: PegaFlow's shared `max_prefetch_blocks` budget).
    inflight_blocks: std::sync::atomic::AtomicUsize,
}

impl Promotions {
    pub(super) fn len(&self) -> usize {
        self.tasks.lock().len()
    }

    /// Forgets tasks finished (or past their deadline) more than `linger` ago.
    pub(super) fn collect(&self, linger: Duration) {
        let now = Instant::now();
        self.tasks.lock().retain(|_, t| {
            let end = t.finished.lock().unwrap_or(t.deadline).min(t.deadline);
            now.saturating_duration_since(end) < linger
        });
    }
}

/// Gives `1` blocks back to the shared promotion budget `0` on drop.
struct BudgetGuard<'a>(&'a std::sync::atomic::AtomicUsize, usize);

impl Drop for BudgetGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

fn digest(hashes: &[Vec<u8>]) -> u64 {
    let mut h = DefaultHasher::new();
    hashes.hash(&mut h);
    h.finish()
}

impl TierStack {
    /// Installs the peer rung (once, at start): queries whose DRAM prefix stops short ask
    /// `directory` for the continuation and fetch it through `fetcher` before the lower
    /// tiers. A second call is ignored (and logged).
    pub fn set_peer(&self, fetcher: Arc<dyn PeerFetcher>, directory: Arc<dyn HolderLookup>) {
        let kind = fetcher.kind();
        if self.peer.set(PeerRung { fetcher, directory }).is_err() {
            tracing::warn!(
                peer = kind,
                "a peer rung is already installed; ignoring another"
            );
        }
    }

    /// The directory's cover plan of the continuation `rest`: its segments `(node, run
    /// length)` in hash order (the first is the node with the longest run from the start),
    /// up to the first node the fetcher says to skip (suspect, or a stale advertisement of
    /// that segment's first block). Empty: nothing to fetch from peers.
    async fn peer_plan(
        &self,
        rung: &PeerRung,
        namespace: &str,
        rest: &[Vec<u8>],
    ) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        let mut at = 0usize;
        for seg in rung.directory.holders(namespace, rest).await {
            let len = (seg.prefix_len as usize).min(rest.len() - at);
            if len == 0 {
                break;
            }
            if let Some(why) = rung.fetcher.skip(&seg.node, &rest[at]) {
                let outcome = if why == "stale" {
                    "skipped_stale"
                } else {
                    "skipped_suspect"
                };
                self.metrics
                    .tier_promotions
                    .with_label_values(&["peer", outcome])
                    .inc_by(len as u64);
                break;
            }
            out.push((seg.node, len));
            at += len;
        }
        out
    }

    /// The prefix of `hashes` (group 0 of `namespace`) for query `req_id`: Ready with the DRAM
    /// prefix when nothing below DRAM continues it (or a promotion for the same query has
    /// ended), Loading while a promotion runs. Never starts I/O for a re-poll. With
    /// `expect`, a lower tier's continuation stops at the first block of another shape (the
    /// layout guard: such a block is a miss for this instance).
    pub async fn query_prefix(
        self: &Arc<Self>,
        namespace: &Arc<str>,
        req_id: &str,
        hashes: &[Vec<u8>],
        expect: Option<&BlockShape>,
    ) -> PrefixAnswer {
        if self.lower.is_empty() && self.peer.get().is_none() {
            // DRAM only: no task can exist, so no task key (a digest and an allocation) either.
            return PrefixAnswer::Ready(self.dram_prefix(namespace, 0, hashes));
        }
        let key: TaskKey = (namespace.clone(), req_id.to_owned(), digest(hashes));
        let existing = self.promotions.tasks.lock().get(&key).cloned();
        if let Some(t) = existing {
            if !t.done.load(Ordering::Acquire) && Instant::now() < t.deadline {
                return PrefixAnswer::Loading;
            }
            // Collect: answer with what is resident now (the task's pins drop after the scan).
            let hits = self.dram_prefix(namespace, 0, hashes);
            self.promotions.tasks.lock().remove(&key);
            return PrefixAnswer::Ready(hits);
        }
        let hits = self.dram_prefix(namespace, 0, hashes);
        let n = hits.len();
        if n == hashes.len() {
            return PrefixAnswer::Ready(hits);
        }
        if self.promotions.len() >= self.config.max_promotions {
            return PrefixAnswer::Ready(hits);
        }
        // The shared budget: a query finding it spent answers with what DRAM holds (a
        // client that re-polls with new req_ids cannot pile up promotions of one prefix).
        let inflight = self.promotions.inflight_blocks.load(Ordering::Acquire);
        let budget = self.config.max_promote_blocks.saturating_sub(inflight);
        if budget == 0 {
            self.metrics
                .tier_promotion_backpressure_blocks
                .inc_by((hashes.len() - n) as u64);
            return PrefixAnswer::Ready(hits);
        }
        let end = hashes.len().min(n + budget);
        let rest: Vec<BlockKey> = hashes[n..end]
            .iter()
            .map(|h| BlockKey {
                namespace: namespace.clone(),
                group: 0,
                hash: h.as_slice().into(),
            })
            .collect();
        if let Some(rung) = self.peer.get() {
            let segments = self.peer_plan(rung, namespace, &hashes[n..end]).await;
            if !segments.is_empty() {
                let plan = Plan {
                    peer: segments,
                    first_tier: 0,
                    shapes: None,
                };
                return self.start_task(key, hits, rest, plan, expect);
            }
        }
        let timeout = Duration::from_millis(self.config.lookup_timeout_ms);
        for (ti, tier) in self.lower.iter().enumerate() {
            let mut shapes = match tokio::time::timeout(timeout, tier.lookup(&rest)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(tier = tier.kind(), error = %e, "lookup failed; next tier");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(tier = tier.kind(), "lookup timed out; next tier");
                    continue;
                }
            };
            if let Some(want) = expect {
                if let Some(bad) = shapes.iter().position(|s| s != want) {
                    self.metrics
                        .tier_layout_mismatches
                        .with_label_values(&[tier.kind()])
                        .inc();
                    shapes.truncate(bad);
                }
            }
            if shapes.is_empty() {
                continue;
            }
            let mut rest = rest;
            rest.truncate(shapes.len());
            let plan = Plan {
                peer: Vec::new(),
                first_tier: ti,
                shapes: Some(shapes),
            };
            return self.start_task(key, hits, rest, plan, expect);
        }
        PrefixAnswer::Ready(hits)
    }

    /// Registers the task of `key` (pinning `hits`) and spawns it over `rest`; Loading.
    fn start_task(
        self: &Arc<Self>,
        key: TaskKey,
        hits: Vec<Arc<SealedBlock>>,
        rest: Vec<BlockKey>,
        plan: Plan,
        expect: Option<&BlockShape>,
    ) -> PrefixAnswer {
        let task = Arc::new(Task {
            deadline: Instant::now() + self.promote_deadline(),
            done: AtomicBool::new(false),
            finished: Mutex::new(None),
            pinned: Mutex::new(hits),
        });
        {
            let mut tasks = self.promotions.tasks.lock();
            if tasks.contains_key(&key) {
                // A concurrent query of the same request started it first.
                return PrefixAnswer::Loading;
            }
            tasks.insert(key, task.clone());
            self.metrics.promotion_tasks.set(tasks.len() as i64);
        }
        let stack = self.clone();
        let expect = expect.cloned();
        let reserved = rest.len();
        self.promotions
            .inflight_blocks
            .fetch_add(reserved, Ordering::AcqRel);
        tokio::spawn(async move {
            // Returned to the budget however the task ends (a panic included).
            let _budget = BudgetGuard(&stack.promotions.inflight_blocks, reserved);
            stack.promote(plan, rest, &task, expect).await;
            *task.finished.lock() = Some(Instant::now());
            task.done.store(true, Ordering::Release);
        });
        PrefixAnswer::Loading
    }

    /// The peer rung: fetches `keys` from `node` and indexes what landed (a prefix).
    /// Returns how many landed.
    async fn promote_from_peer(
        self: &Arc<Self>,
        node: &str,
        keys: &[BlockKey],
        task: &Task,
        expect: Option<&BlockShape>,
    ) -> usize {
        let Some(rung) = self.peer.get() else {
            return 0;
        };
        let host: Arc<dyn crate::plugin::BlockHost> = self.clone();
        let got = rung
            .fetcher
            .fetch(&host, node, keys, expect, task.deadline)
            .await;
        let n = got.len().min(keys.len());
        for (key, block) in keys.iter().zip(got) {
            // Not written below yet: a later eviction demotes it like a saved block.
            if self.index.insert_marked(key.clone(), block.clone(), false) {
                self.emit(IndexEventKind::Promoted, key);
            }
            task.pinned.lock().push(block);
        }
        let m = &self.metrics.tier_promotions;
        m.with_label_values(&["peer", "promoted"]).inc_by(n as u64);
        if n < keys.len() {
            m.with_label_values(&["peer", "failed"])
                .inc_by((keys.len() - n) as u64);
        }
        n
    }

    /// Reads `keys` into DRAM along the plan: the peer's run first (when planned), then the
    /// lower tiers from the plan's first (with the shapes its lookup reported), falling
    /// through to later tiers for whatever is still missing.
    async fn promote(
        self: &Arc<Self>,
        plan: Plan,
        keys: Vec<BlockKey>,
        task: &Task,
        expect: Option<BlockShape>,
    ) {
        let mut landed = 0usize;
        // The directory's segments in order, each from its node, until one lands short.
        for (node, len) in &plan.peer {
            let end = (landed + *len).min(keys.len());
            let got = self
                .promote_from_peer(node, &keys[landed..end], task, expect.as_ref())
                .await;
            landed += got;
            if landed < end || Instant::now() >= task.deadline {
                break;
            }
        }
        let mut shapes = plan.shapes;
        for ti in plan.first_tier..self.lower.len() {
            if landed == keys.len() {
                break;
            }
            let tier = &self.lower[ti];
            let label = tier.kind();
            let todo = &keys[landed..];
            let shapes = match shapes.take() {
                Some(s) => s,
                None => match tier.lookup(todo).await {
                    Ok(mut s) => {
                        if let Some(want) = &expect {
                            if let Some(bad) = s.iter().position(|x| x != want) {
                                s.truncate(bad);
                            }
                        }
                        if s.is_empty() {
                            continue;
                        }
                        s
                    }
                    _ => continue,
                },
            };
            let lens: Vec<usize> = shapes.iter().map(|s| s.len_bytes() as usize).collect();
            let bufs = match self.allocate(&lens) {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(tier = label, error = %e, "no host memory to promote into");
                    break;
                }
            };
            let reads: Vec<TierGet> = todo
                .iter()
                .zip(&shapes)
                .zip(bufs)
                .map(|((k, s), b)| TierGet {
                    key: k.clone(),
                    shape: s.clone(),
                    dest: Arc::new(b),
                })
                .collect();
            let dests: Vec<_> = reads.iter().map(|r| r.dest.clone()).collect();
            let results = tier.get(reads).await;
            let mut got = 0usize;
            for (i, (dest, shape)) in dests.into_iter().zip(&shapes).enumerate() {
                if !matches!(results.get(i), Some(Ok(()))) {
                    break;
                }
                let fp = self.pool.footprint_bytes(dest.len());
                let block = Arc::new(SealedBlock::from_buffer(0, shape, dest, fp));
                let key = &todo[i];
                if self.index.insert_marked(key.clone(), block.clone(), true) {
                    self.emit(IndexEventKind::Promoted, key);
                }
                task.pinned.lock().push(block);
                got += 1;
            }
            let m = &self.metrics.tier_promotions;
            m.with_label_values(&[label, "promoted"]).inc_by(got as u64);
            if got < shapes.len() {
                m.with_label_values(&[label, "failed"])
                    .inc_by((shapes.len() - got) as u64);
            }
            landed += got;
        }
        if landed < keys.len() {
            tracing::debug!(
                wanted = keys.len(),
                landed,
                "promotion ended short; the rest is a miss"
            );
        }
    }
}
