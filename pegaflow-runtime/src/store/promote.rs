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

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{IndexEventKind, TierStack};
use crate::block::{BlockKey, BlockShape, SealedBlock};
use crate::plugin::TierGet;

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
        if self.lower.is_empty() {
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
            let mut rest = rest;
            rest.truncate(shapes.len());
            let expect = expect.cloned();
            let reserved = rest.len();
            self.promotions
                .inflight_blocks
                .fetch_add(reserved, Ordering::AcqRel);
            tokio::spawn(async move {
                // Returned to the budget however the task ends (a panic included).
                let _budget = BudgetGuard(&stack.promotions.inflight_blocks, reserved);
                stack.promote(ti, rest, shapes, &task, expect).await;
                *task.finished.lock() = Some(Instant::now());
                task.done.store(true, Ordering::Release);
            });
            return PrefixAnswer::Loading;
        }
        PrefixAnswer::Ready(hits)
    }

    /// Reads `keys` (whose shapes tier `first` reported) into DRAM, falling through to later
    /// tiers for whatever is still missing.
    async fn promote(
        &self,
        first: usize,
        keys: Vec<BlockKey>,
        shapes: Vec<BlockShape>,
        task: &Task,
        expect: Option<BlockShape>,
    ) {
        let mut landed = 0usize;
        let mut shapes = Some(shapes);
        for ti in first..self.lower.len() {
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
