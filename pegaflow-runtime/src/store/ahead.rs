//! Evict-ahead: one thread keeps part of the host pool free before a Save needs it.
//!
//! Without it, a Save into a full pool evicts on its own path what its blocks take: with 8 KiB
//! blocks that is 4,096 evictions per 32 MiB Save, about a quarter of the Save's engine work on
//! this project's VM (docs/benchmarks/log/query-and-shm.md §4). With it, each allocation records its size and,
//! when the pool's free bytes fall below the target, wakes the thread, which evicts least
//! recently used unreferenced blocks (the same walk and the same demotion as an allocation's
//! own eviction) until the free bytes, plus the bytes waiting in the demotion queue (freed once
//! written), reach the target again. An allocation that still finds too little free memory
//! (the thread is behind, or it asks for more than the target) evicts the rest itself, as
//! before.
//!
//! The target is the largest recent allocation, in bytes (each allocation decays the recorded
//! peak by a sixteenth before comparing), capped at `evict_ahead_percent` of the pool: the
//! cache gives up about one Save's worth of memory, not a fixed share.
//!
//! Owns: the thread, its wake flag and the recorded peak.
//! Must never: free more than the target (a block larger than the bytes still missing stays),
//! evict a referenced block (the index's own rule), hold the index's locks for more than a
//! small batch ([`AHEAD_BATCH`] blocks), or keep the stack alive (the thread holds a `Weak`
//! and upgrades it only for one round).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::TierStack;

/// Blocks per eviction round under the index's locks: a query or a seal waits for at most
/// one such batch (~64 × 0.2 µs).
pub(super) const AHEAD_BATCH: usize = 64;

#[derive(Default)]
struct Shared {
    /// Set by a waker, taken by the thread: one more round is wanted.
    wanted: AtomicBool,
    stop: AtomicBool,
    /// The decaying peak allocation, in bytes.
    peak: AtomicU64,
}

/// The evict-ahead thread and its target.
pub(super) struct EvictAhead {
    shared: Arc<Shared>,
    thread: std::thread::Thread,
    /// Taken by [`EvictAhead::join`].
    handle: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// `evict_ahead_percent` of the pool, in bytes.
    cap: u64,
}

impl EvictAhead {
    /// Starts the thread (`pegaflow-evict`), parked until the first wake; `cap` is the most
    /// it keeps free, in bytes.
    ///
    /// # Errors
    /// The thread cannot be created.
    pub(super) fn start(stack: Weak<TierStack>, cap: u64) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name("pegaflow-evict".into())
            .spawn(move || run(&sh, &stack))?;
        Ok(Self {
            shared,
            thread: handle.thread().clone(),
            handle: parking_lot::Mutex::new(Some(handle)),
            cap,
        })
    }

    /// [`EvictAhead::start`], or `None` with a warning when the thread cannot be created
    /// (the server then runs without it: every Save into a full pool evicts on its own path).
    pub(super) fn start_or_warn(stack: Weak<TierStack>, cap: u64) -> Option<Self> {
        Self::start(stack, cap)
            .inspect(|_| {
                tracing::info!(
                    max_free_bytes = cap,
                    "evict-ahead on: a thread keeps the largest recent allocation's bytes free, \
                     up to max_free_bytes ([store] evict_ahead_percent of the pool)"
                );
            })
            .inspect_err(|e| {
                tracing::warn!(
                    error = %e,
                    "cannot start the evict-ahead thread: every Save into a full pool evicts \
                     on its own path"
                );
            })
            .ok()
    }

    /// Records an allocation of `bytes` (footprints summed) in the decaying peak.
    pub(super) fn note_allocation(&self, bytes: u64) {
        // Not a read-modify-write: two allocations at once may lose one's record, which only
        // makes the target a Save smaller for a while.
        let p = self.shared.peak.load(Ordering::Relaxed);
        let next = bytes.max(p - p / 16);
        if next != p {
            self.shared.peak.store(next, Ordering::Relaxed);
        }
    }

    /// The bytes to keep free now: the recorded peak, capped.
    pub(super) fn target(&self) -> u64 {
        self.shared.peak.load(Ordering::Relaxed).min(self.cap)
    }

    /// Asks the thread for a round (one syscall when it sleeps, none when a round is already
    /// wanted).
    pub(super) fn wake(&self) {
        if !self.shared.wanted.swap(true, Ordering::AcqRel) {
            self.thread.unpark();
        }
    }

    /// Asks the thread to exit: it evicts nothing more once it sees this (a round checks
    /// between batches).
    pub(super) fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.thread.unpark();
    }

    /// Whether the thread has exited (after [`EvictAhead::join`], or on its own).
    #[cfg(test)]
    pub(super) fn exited(&self) -> bool {
        self.handle.lock().as_ref().is_none_or(|h| h.is_finished())
    }

    /// Whether [`EvictAhead::stop`] was called.
    pub(super) fn stopped(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Waits for the thread to exit after [`EvictAhead::stop`] (at most one batch of
    /// evictions), polling without blocking the executor.
    pub(super) async fn join(&self) {
        let Some(h) = self.handle.lock().take() else {
            return;
        };
        while !h.is_finished() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        if h.join().is_err() {
            tracing::error!("the evict-ahead thread panicked");
        }
    }
}

impl Drop for EvictAhead {
    /// Stops the thread without waiting: the last reference to the stack may be dropped on
    /// the thread itself.
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(sh: &Shared, stack: &Weak<TierStack>) {
    loop {
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        if !sh.wanted.swap(false, Ordering::AcqRel) {
            std::thread::park();
            continue;
        }
        let Some(stack) = stack.upgrade() else {
            return;
        };
        stack.evict_ahead_round();
    }
}
