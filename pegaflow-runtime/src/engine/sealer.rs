//! The seal queue: a Save hands its copied blocks to one thread per engine, which seals and
//! indexes them in submission order, so the Save answers as soon as its copy has finished
//! (sealing 256 blocks of 32 slots takes ~0.5 ms, on the client's critical path before).
//!
//! Read your acknowledged writes (DESIGN.md §6.2) holds through a barrier, [`SealQueue::settle`]:
//! a query, Flush, an unregistration (before it drops the instance's partly saved blocks), an
//! allocation that found nothing to evict, and the read-only views of the index first wait
//! until every seal submitted before them has run. With none pending the barrier is two
//! atomic loads. PegaFlow seals asynchronously too, but without the barrier: there a Save's
//! OK does not mean queryable (`pegaflow-behavior.md` §3).
//!
//! Bounded: at most [`MAX_PENDING_SEALS`] jobs wait; a Save beyond that waits for the queue
//! (each job's buffers are already counted in the pool). A job that panics is logged and
//! counted as run, so no barrier waits forever.
//!
//! Must never: run two jobs at once or out of order (a block's slots from two Saves are
//! merged in submission order), or let a barrier return before the seals it waits for ran.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Weak};

use parking_lot::{Condvar, Mutex};

use super::Engine;

/// Seal jobs that may wait at once before a Save waits for the queue.
pub const MAX_PENDING_SEALS: u64 = 64;

/// A unit of work for the seal thread.
pub(super) type SealJob = Box<dyn FnOnce(&Engine) + Send>;

/// Submission and completion counts, shared with the thread.
struct State {
    /// Jobs submitted so far.
    submitted: AtomicU64,
    /// Jobs run so far (in order, so every job numbered ≤ `done` has run).
    done: AtomicU64,
    /// Guards the sleep of blocking waiters on `cv`; true while a [`SealHold`] holds the
    /// thread back.
    lock: Mutex<bool>,
    cv: Condvar,
    /// `done`, for async waiters.
    watch: tokio::sync::watch::Sender<u64>,
}

/// The engine's seal queue and its thread (see the module doc).
pub(super) struct SealQueue {
    tx: Mutex<mpsc::Sender<SealJob>>,
    state: Arc<State>,
}

impl SealQueue {
    /// Starts the `pegaflow-seal` thread. It holds `engine` weakly and ends when the queue
    /// is dropped with the engine.
    pub(super) fn start(engine: Weak<Engine>) -> Self {
        let (tx, rx) = mpsc::channel::<SealJob>();
        let state = Arc::new(State {
            submitted: AtomicU64::new(0),
            done: AtomicU64::new(0),
            lock: Mutex::new(false),
            cv: Condvar::new(),
            watch: tokio::sync::watch::channel(0).0,
        });
        let st = state.clone();
        std::thread::Builder::new()
            .name("pegaflow-seal".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    {
                        let mut held = st.lock.lock();
                        while *held {
                            st.cv.wait(&mut held);
                        }
                    }
                    if let Some(e) = engine.upgrade() {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&e)));
                        if r.is_err() {
                            tracing::error!("a seal job panicked; its blocks were not indexed");
                        }
                    }
                    let n = {
                        let _g = st.lock.lock();
                        st.done.fetch_add(1, Ordering::AcqRel) + 1
                    };
                    st.cv.notify_all();
                    st.watch.send_replace(n);
                }
            })
            .expect("spawn the seal thread");
        Self {
            tx: Mutex::new(tx),
            state,
        }
    }

    /// Queues `job`. Call [`SealQueue::room`] first to respect the bound.
    pub(super) fn submit(&self, job: SealJob) {
        let tx = self.tx.lock();
        self.state.submitted.fetch_add(1, Ordering::AcqRel);
        if tx.send(job).is_err() {
            // The thread is gone (it only ends with the queue): count the job as run.
            self.state.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Whether any submitted job has not run yet.
    pub(super) fn pending(&self) -> bool {
        self.state.done.load(Ordering::Acquire) < self.state.submitted.load(Ordering::Acquire)
    }

    /// Waits until fewer than [`MAX_PENDING_SEALS`] jobs are pending.
    pub(super) async fn room(&self) {
        let submitted = self.state.submitted.load(Ordering::Acquire);
        self.wait_done(submitted.saturating_sub(MAX_PENDING_SEALS - 1))
            .await;
    }

    /// Waits until every job submitted before this call has run.
    pub(super) async fn settle(&self) {
        self.wait_done(self.state.submitted.load(Ordering::Acquire))
            .await;
    }

    /// [`SealQueue::settle`], blocking the calling thread (never the seal thread itself).
    pub(super) fn settle_blocking(&self) {
        let target = self.state.submitted.load(Ordering::Acquire);
        if self.state.done.load(Ordering::Acquire) >= target {
            return;
        }
        let mut g = self.state.lock.lock();
        while self.state.done.load(Ordering::Acquire) < target {
            self.state.cv.wait(&mut g);
        }
    }

    /// Holds the seal thread back (before its next job) until the guard is dropped.
    pub(super) fn hold(&self) -> SealHold {
        *self.state.lock.lock() = true;
        SealHold {
            state: self.state.clone(),
        }
    }

    async fn wait_done(&self, target: u64) {
        if self.state.done.load(Ordering::Acquire) >= target {
            return;
        }
        let mut rx = self.state.watch.subscribe();
        // The sender lives in `state`, which this queue holds: the wait cannot fail.
        let _ = rx.wait_for(|&d| d >= target).await;
    }
}

/// Keeps the seal thread from running jobs while it lives ([`Engine::hold_seals`]).
#[must_use = "the seal thread runs again when the hold is dropped"]
pub struct SealHold {
    state: Arc<State>,
}

impl Drop for SealHold {
    fn drop(&mut self) {
        *self.state.lock.lock() = false;
        self.state.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue whose thread never sees an engine (the weak reference is empty), so jobs
    /// are counted as run without running: enough to test the counting and the barriers.
    fn queue() -> Arc<SealQueue> {
        Arc::new(SealQueue::start(Weak::new()))
    }

    #[tokio::test]
    async fn settle_returns_only_after_the_submitted_jobs_ran() {
        let q = queue();
        assert!(!q.pending());
        q.settle().await;
        let held = q.hold();
        for _ in 0..3 {
            q.submit(Box::new(|_| ()));
        }
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.settle().await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(q.pending(), "held jobs do not run");
        assert!(!waiter.is_finished(), "settle waits for the pending jobs");
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("settled once the jobs ran")
            .unwrap();
        assert!(!q.pending());
        assert_eq!(q.state.done.load(Ordering::Acquire), 3);
        q.settle_blocking();
    }

    #[tokio::test]
    async fn room_waits_while_the_queue_is_full() {
        let q = queue();
        let held = q.hold();
        for _ in 0..MAX_PENDING_SEALS - 1 {
            q.submit(Box::new(|_| ()));
        }
        // One short of the bound: room at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), q.room())
            .await
            .expect("room below the bound");
        q.submit(Box::new(|_| ()));
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.room().await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "a full queue has no room");
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("room once the jobs ran")
            .unwrap();
    }
}
