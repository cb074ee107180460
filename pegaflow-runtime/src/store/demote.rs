//! Demotion: blocks leave host DRAM for the first lower tier, written by one worker task.
//!
//! Two paths. Write-behind (the usual one): once blocks that no lower tier holds fill more
//! than `write_behind_percent` of the pool, or more than the queue's bound, the worker writes
//! the oldest of them below while they stay in DRAM and marks them written; evicting such a
//! block later frees its memory at once, with no I/O on the Save's path. The queue (the
//! fallback): a block evicted before write-behind reached it is queued, bounded in bytes; its
//! memory is freed once written.
//!
//! Why the queue's bound caps write-behind's threshold: a Save needs its memory at once, so a
//! block it evicts is either written already (freed at once), queued (freed once written), or
//! dropped. A Save that evicts more unwritten blocks than the queue holds must drop the rest,
//! however idle the device is then. Writing behind while nothing is queued (the device has
//! no demotion to do) until the unwritten blocks fit the queue spends that idle time instead:
//! a later Save, however large, finds the blocks it evicts written or room for them in the
//! queue, while the device kept up.
//!
//! Owns: the queue (oldest first), the map of blocks queued or being written (so that a query
//! finds them and takes them back into DRAM without I/O), and the byte count they hold.
//! Must never: block the caller (enqueue is a few map operations under one mutex), grow past
//! its byte bound, drop a newer block while an older one is still only queued (a full queue
//! sheds its oldest queued blocks first), or free a block's memory while its write runs (the
//! worker holds the `Arc` until the tier's put returned).

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use hashbrown::HashMap;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::{IndexEventKind, TierStack};
use crate::block::{BlockKey, KeyRef, SealedBlock};
use crate::plugin::{Tier, TierPut};

#[derive(Default)]
struct State {
    /// Keys queued and not yet taken by the worker, oldest first.
    queue: VecDeque<BlockKey>,
    /// Every block queued or being written.
    blocks: HashMap<BlockKey, Arc<SealedBlock>>,
    /// Footprint of `blocks`, in bytes.
    bytes: u64,
    /// Blocks the worker is writing now.
    writing: usize,
    stopped: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Notify,
    idle: Notify,
    cap_bytes: u64,
    batch: usize,
    tier: Arc<dyn Tier>,
    stack: Weak<TierStack>,
}

/// The demotion queue and its worker.
pub(super) struct Demoter {
    shared: Arc<Shared>,
    worker: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Demoter {
    /// Starts the worker on the current tokio runtime.
    pub(super) fn start(
        stack: Weak<TierStack>,
        tier: Arc<dyn Tier>,
        cap_bytes: u64,
        batch: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Notify::new(),
            idle: Notify::new(),
            cap_bytes,
            batch,
            tier,
            stack,
        });
        let handle = tokio::spawn(worker(shared.clone()));
        Self {
            shared,
            worker: Mutex::new(Some(handle)),
        }
    }

    fn count(&self, outcome: &str, n: u64) {
        if let Some(s) = self.shared.stack.upgrade() {
            s.metrics
                .tier_demotions
                .with_label_values(&[self.shared.tier.kind(), outcome])
                .inc_by(n);
        }
    }

    fn gauges(&self, st: &State) {
        if let Some(s) = self.shared.stack.upgrade() {
            s.metrics
                .tier_demotion_queue_blocks
                .set(st.blocks.len() as i64);
            s.metrics.tier_demotion_queue_bytes.set(st.bytes as i64);
        }
    }

    /// Queues an evicted block. When its footprint does not fit, the oldest queued blocks
    /// are shed first; when it still does not fit (the rest is being written, or the block
    /// alone exceeds the bound), this block is dropped. Returns the footprint bytes dropped
    /// here (shed blocks, this block when it is not queued): memory freed now rather than
    /// once a write ends.
    pub(super) fn enqueue(&self, key: BlockKey, block: Arc<SealedBlock>) -> u64 {
        let fp = block.footprint;
        let mut shed = Vec::new();
        let mut dropped = false;
        {
            let mut st = self.shared.state.lock();
            if st.stopped || st.blocks.contains_key(&key) {
                return fp;
            }
            while st.bytes + fp > self.shared.cap_bytes {
                let Some(old) = st.queue.pop_front() else {
                    break;
                };
                if let Some(b) = st.blocks.remove(&old) {
                    st.bytes -= b.footprint;
                    shed.push(b);
                }
            }
            if st.bytes + fp > self.shared.cap_bytes {
                dropped = true;
            } else {
                st.bytes += fp;
                st.queue.push_back(key.clone());
                st.blocks.insert(key, block);
            }
            self.gauges(&st);
        }
        let n = shed.len() as u64 + u64::from(dropped);
        if n > 0 {
            self.count("dropped_queue_full", n);
        }
        self.shared.work.notify_one();
        shed.iter().map(|b| b.footprint).sum::<u64>() + if dropped { fp } else { 0 }
    }

    /// Wakes the worker (after a seal: write-behind may have work).
    pub(super) fn kick(&self) {
        self.shared.work.notify_one();
    }

    /// Footprint of the blocks queued or being written, in bytes: memory that is freed once
    /// their writes end.
    pub(super) fn pending_bytes(&self) -> u64 {
        self.shared.state.lock().bytes
    }

    /// A block queued or being written under `key`.
    pub(super) fn pending(&self, key: KeyRef<'_>) -> Option<Arc<SealedBlock>> {
        self.shared.state.lock().blocks.get(&key).cloned()
    }

    /// Drops the oldest queued block (memory pressure). False when none is queued.
    pub(super) fn shed_oldest(&self) -> bool {
        let b = {
            let mut st = self.shared.state.lock();
            let Some(k) = st.queue.pop_front() else {
                return false;
            };
            let b = st.blocks.remove(&k);
            if let Some(b) = &b {
                st.bytes -= b.footprint;
            }
            self.gauges(&st);
            b
        };
        drop(b);
        self.count("dropped_pressure", 1);
        true
    }

    /// Drops every queued block (the cleanup endpoint); writes in progress finish.
    pub(super) fn clear_pending(&self) {
        let mut shed = Vec::new();
        {
            let mut st = self.shared.state.lock();
            while let Some(k) = st.queue.pop_front() {
                if let Some(b) = st.blocks.remove(&k) {
                    st.bytes -= b.footprint;
                    shed.push(b);
                }
            }
            self.gauges(&st);
        }
        if !shed.is_empty() {
            self.count("dropped_cleanup", shed.len() as u64);
        }
    }

    /// Waits until nothing is queued or being written.
    pub(super) async fn drain(&self) {
        loop {
            let idle = self.shared.idle.notified();
            {
                let st = self.shared.state.lock();
                if (st.blocks.is_empty() && st.writing == 0) || st.stopped {
                    return;
                }
            }
            idle.await;
        }
    }

    /// Stops the worker; queued blocks are dropped (counted).
    pub(super) fn stop(&self) {
        let n = {
            let mut st = self.shared.state.lock();
            st.stopped = true;
            let n = st.queue.len();
            while let Some(k) = st.queue.pop_front() {
                if let Some(b) = st.blocks.remove(&k) {
                    st.bytes -= b.footprint;
                }
            }
            n
        };
        if n > 0 {
            self.count("dropped_shutdown", n as u64);
        }
        self.shared.work.notify_one();
        self.shared.idle.notify_waiters();
    }
}

impl Demoter {
    /// Waits for the worker to end (after [`Demoter::stop`]): its write in flight completes
    /// and it lets go of the tier, so a tier that holds a lock (an SSD directory) is free
    /// again once this returns.
    pub(super) async fn join(&self) {
        let h = self.worker.lock().take();
        if let Some(h) = h {
            let _ = h.await;
        }
    }
}

impl Drop for Demoter {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn worker(sh: Arc<Shared>) {
    loop {
        let work = sh.work.notified();
        let batch: Vec<TierPut> = {
            let mut st = sh.state.lock();
            if st.stopped {
                return;
            }
            let mut batch = Vec::new();
            while batch.len() < sh.batch {
                let Some(k) = st.queue.pop_front() else {
                    break;
                };
                if let Some(b) = st.blocks.get(&k) {
                    batch.push(TierPut {
                        key: k,
                        block: b.clone(),
                    });
                }
            }
            st.writing = batch.len();
            batch
        };
        if !batch.is_empty() {
            write_queued(&sh, batch).await;
            sh.idle.notify_waiters();
            continue;
        }
        if write_behind(&sh).await {
            continue;
        }
        sh.idle.notify_waiters();
        work.await;
    }
}

/// Writes evicted blocks taken from the queue, then frees them (drops the queue's `Arc`s).
async fn write_queued(sh: &Shared, batch: Vec<TierPut>) {
    let keys: Vec<BlockKey> = batch.iter().map(|p| p.key.clone()).collect();
    let results = sh.tier.put(batch).await;
    let stack = sh.stack.upgrade();
    let mut freed = Vec::with_capacity(keys.len());
    {
        let mut st = sh.state.lock();
        for k in &keys {
            if let Some(b) = st.blocks.remove(k) {
                st.bytes -= b.footprint;
                freed.push(b);
            }
        }
        st.writing = 0;
        if let Some(s) = &stack {
            s.metrics
                .tier_demotion_queue_blocks
                .set(st.blocks.len() as i64);
            s.metrics.tier_demotion_queue_bytes.set(st.bytes as i64);
        }
    }
    {
        // Their memory goes back together (one pool lock per shard, not one per block).
        let _batch = crate::buffer::ReleaseBatch::open();
        drop(freed);
    }
    if let Some(s) = &stack {
        count_results(sh, s, &keys, &results);
    }
}

/// One write-behind round: when the blocks no lower tier holds exceed the stack's threshold,
/// writes the oldest of them (enough to get below it, at most a batch) and marks them
/// written. True when it wrote something (the worker loops again).
async fn write_behind(sh: &Shared) -> bool {
    let Some(stack) = sh.stack.upgrade() else {
        return false;
    };
    let excess = stack
        .index
        .unwritten_bytes()
        .saturating_sub(write_behind_target(sh, &stack));
    if excess == 0 {
        return false;
    }
    // Only the blocks that cover the excess are referenced while their write runs.
    let cands = stack.index.oldest_unwritten_covering(0, sh.batch, excess);
    if cands.is_empty() {
        return false;
    }
    let keys: Vec<BlockKey> = cands.iter().map(|(k, _)| k.clone()).collect();
    let puts: Vec<TierPut> = cands
        .into_iter()
        .map(|(key, block)| TierPut { key, block })
        .collect();
    sh.state.lock().writing = keys.len();
    let results = sh.tier.put(puts).await;
    sh.state.lock().writing = 0;
    // Marked whatever the outcome: a block the tier refused (full, not admitted) is not
    // offered again; at eviction it is dropped.
    for k in &keys {
        stack.index.mark_written_below(k);
    }
    count_results(sh, &stack, &keys, &results);
    true
}

/// The unwritten bytes write-behind leaves in DRAM: the stack's threshold
/// (`write_behind_percent` of the pool), at most the queue's bound (module doc);
/// `write_behind_percent = 100` keeps write-behind off.
fn write_behind_target(sh: &Shared, stack: &TierStack) -> u64 {
    let t = stack.write_behind_bytes();
    if stack.config.write_behind_percent >= 100 {
        t
    } else {
        t.min(sh.cap_bytes)
    }
}

fn count_results(
    sh: &Shared,
    stack: &TierStack,
    keys: &[BlockKey],
    results: &[Result<(), crate::plugin::TierError>],
) {
    let (mut ok, mut failed) = (0u64, 0u64);
    for (i, k) in keys.iter().enumerate() {
        match results.get(i) {
            Some(Ok(())) => {
                ok += 1;
                stack.emit(IndexEventKind::Demoted(0), k);
            }
            Some(Err(e)) => {
                failed += 1;
                tracing::debug!(tier = sh.tier.kind(), error = %e, "demotion failed");
            }
            None => failed += 1,
        }
    }
    let c = &stack.metrics.tier_demotions;
    if ok > 0 {
        c.with_label_values(&[sh.tier.kind(), "written"]).inc_by(ok);
    }
    if failed > 0 {
        c.with_label_values(&[sh.tier.kind(), "failed"])
            .inc_by(failed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::super::tests::{key, GatedTier, HeapPool};
    use super::super::{IndexEvents, StoreConfig, TierStack};
    use crate::block::{BlockShape, SealedBlock};
    use crate::metrics::Metrics;
    use crate::plugin::Tier;

    /// A Save evicting more than the demotion queue holds, into a pool whose unwritten blocks
    /// the device had time to write, drops nothing: write-behind wrote them while the queue
    /// was empty. (Before, write-behind stopped at 75 % of the pool and such a Save dropped
    /// what the queue could not take.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_larger_than_the_queue_drops_nothing_an_idle_device_could_write() {
        let tier = Arc::new(GatedTier::default());
        tier.open.add_permits(1 << 20);
        let metrics = Arc::new(Metrics::new());
        // 64 blocks of 1 KiB; the queue holds 16 KiB (a quarter of the pool).
        let stack = TierStack::new(
            HeapPool::new(64 << 10),
            vec![tier.clone() as Arc<dyn Tier>],
            StoreConfig {
                evict_ahead_percent: 0,
                ..StoreConfig::default()
            },
            metrics.clone(),
            IndexEvents::default(),
        );
        let save = |first: u8, n: u8| {
            let bufs = stack.allocate(&vec![1024; n as usize]).expect("allocates");
            for (buf, i) in bufs.into_iter().zip(first..) {
                let fp = buf.len() as u64;
                let shape = BlockShape::new(vec![1024]);
                let block = Arc::new(SealedBlock::from_buffer(0, &shape, Arc::new(buf), fp));
                assert!(stack.insert_sealed(key(i), block));
            }
        };
        for i in 0..8u8 {
            save(i * 8, 8);
        }
        // The device is idle: wait until the worker has written all it will.
        let t0 = Instant::now();
        let mut last = (usize::MAX, Instant::now());
        loop {
            let n = tier.stored.lock().len();
            if n != last.0 {
                last = (n, Instant::now());
            } else if last.1.elapsed() > Duration::from_millis(200) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the worker never settled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // One Save of half the pool (twice what the queue holds).
        save(64, 32);
        let dropped: u64 = ["dropped_queue_full", "dropped_pressure"]
            .iter()
            .map(|o| {
                metrics
                    .tier_demotions
                    .with_label_values(&["test-gated", o])
                    .get()
            })
            .sum();
        assert_eq!(
            dropped,
            0,
            "unwritten blocks left for the Save: {} bytes",
            stack.index.unwritten_bytes()
        );
        stack.flush().await;
        let stored = tier.stored.lock().clone();
        for i in 0..96u8 {
            assert!(
                stack.index.contains(key(i).as_ref()) || stored.contains(&key(i)),
                "block {i} was lost"
            );
        }
    }
}
