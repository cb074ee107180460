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
//! Bounded: at most [`MAX_PENDING_SEALS`] jobs, holding at most [`MAX_PENDING_HASHES`] hash
//! entries of their requests (a job keeps its request, whose drop leaves the Save's path too),
//! wait at once; a Save reserves its place before it allocates, and waits while there is none
//! (each job's buffers are already counted in the pool). Gauge `pegaflow_seal_queue_jobs`. A
//! job that panics is logged, counted in `pegaflow_seal_failures_total` and counted as run, so
//! no barrier waits forever.
//!
//! The barrier is global: a query waits for every pending seal, of every instance (at most
//! 64 jobs of ~0.5 ms each; in steady state the seal of a Save has finished before the client's
//! next request arrives).
//!
//! Must never: run two jobs at once or out of order (a block's slots from two Saves are
//! merged in submission order), or let a barrier return before the seals it waits for ran.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Weak};

use parking_lot::{Condvar, Mutex};

use super::Engine;
use crate::metrics::Metrics;

/// Seal jobs that may wait at once before a Save waits for the queue.
pub const MAX_PENDING_SEALS: u32 = 64;

/// Hash entries (one per layer and block id of a request) that the pending jobs may hold at
/// once; a request with more takes the whole budget.
pub const MAX_PENDING_HASHES: u32 = 1 << 20;

/// A unit of work for the seal thread.
pub(super) type SealJob = Box<dyn FnOnce(&Engine) + Send>;

/// Submission and completion counts, shared with the thread.
struct State {
    /// Jobs submitted so far.
    submitted: AtomicU64,
    /// Jobs run so far (in order, so every job numbered ≤ `done` has run).
    done: AtomicU64,
    /// Guards the sleep of blocking waiters on `cv`; counts the [`SealHold`]s that hold the
    /// thread back.
    lock: Mutex<usize>,
    cv: Condvar,
    /// `done`, for async waiters.
    watch: tokio::sync::watch::Sender<u64>,
}

/// The engine's seal queue and its thread (see the module doc).
pub(super) struct SealQueue {
    tx: Mutex<mpsc::Sender<SealJob>>,
    state: Arc<State>,
    /// Places in the queue ([`MAX_PENDING_SEALS`]).
    jobs: Arc<tokio::sync::Semaphore>,
    /// Hash entries the queued requests hold ([`MAX_PENDING_HASHES`]).
    hashes: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
}

/// A Save's place in the seal queue, reserved before it allocates; given back once its job
/// ran (or when the Save fails before submitting one).
pub(super) struct SealPlace {
    _job: tokio::sync::OwnedSemaphorePermit,
    _hashes: tokio::sync::OwnedSemaphorePermit,
}

impl SealQueue {
    /// Starts the `pegaflow-seal` thread. It holds `engine` weakly and ends when the queue
    /// is dropped with the engine.
    pub(super) fn start(engine: Weak<Engine>, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = mpsc::channel::<SealJob>();
        let state = Arc::new(State {
            submitted: AtomicU64::new(0),
            done: AtomicU64::new(0),
            lock: Mutex::new(0),
            cv: Condvar::new(),
            watch: tokio::sync::watch::channel(0).0,
        });
        let st = state.clone();
        let m = metrics.clone();
        std::thread::Builder::new()
            .name("pegaflow-seal".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    {
                        let mut held = st.lock.lock();
                        while *held > 0 {
                            st.cv.wait(&mut held);
                        }
                    }
                    if let Some(e) = engine.upgrade() {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&e)));
                        if r.is_err() {
                            m.seal_failures.inc();
                            tracing::error!(
                                "a seal job panicked: the blocks of an answered Save were not indexed"
                            );
                        }
                    }
                    let n = {
                        let _g = st.lock.lock();
                        st.done.fetch_add(1, Ordering::AcqRel) + 1
                    };
                    st.cv.notify_all();
                    st.watch.send_replace(n);
                    let left = st.submitted.load(Ordering::Acquire).saturating_sub(n);
                    m.seal_queue_jobs.set(left as i64);
                }
            })
            .expect("spawn the seal thread");
        Self {
            tx: Mutex::new(tx),
            state,
            jobs: Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_SEALS as usize)),
            hashes: Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HASHES as usize)),
            metrics,
        }
    }

    /// Reserves a place for a job whose request holds `hashes` hash entries, waiting while
    /// the queue is full.
    pub(super) async fn reserve(&self, hashes: usize) -> SealPlace {
        let n = u32::try_from(hashes)
            .unwrap_or(u32::MAX)
            .clamp(1, MAX_PENDING_HASHES);
        // The semaphores are never closed.
        let job = self.jobs.clone().acquire_owned().await.expect("open");
        let hashes = self
            .hashes
            .clone()
            .acquire_many_owned(n)
            .await
            .expect("open");
        SealPlace {
            _job: job,
            _hashes: hashes,
        }
    }

    /// Queues `job`, which holds its [`SealPlace`] until it has run.
    pub(super) fn submit(&self, job: SealJob) {
        let tx = self.tx.lock();
        let n = self.state.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        if tx.send(job).is_err() {
            // The thread is gone (it only ends with the queue): count the job as run.
            self.state.done.fetch_add(1, Ordering::AcqRel);
        }
        let left = n.saturating_sub(self.state.done.load(Ordering::Acquire));
        self.metrics.seal_queue_jobs.set(left as i64);
    }

    /// Jobs run so far.
    pub(super) fn done(&self) -> u64 {
        self.state.done.load(Ordering::Acquire)
    }

    /// Whether any submitted job has not run yet.
    pub(super) fn pending(&self) -> bool {
        self.state.done.load(Ordering::Acquire) < self.state.submitted.load(Ordering::Acquire)
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
        *self.state.lock.lock() += 1;
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
        *self.state.lock.lock() -= 1;
        self.state.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue whose thread never sees an engine (the weak reference is empty), so jobs
    /// are counted as run without running: enough to test the counting and the barriers.
    fn queue() -> Arc<SealQueue> {
        Arc::new(SealQueue::start(Weak::new(), Arc::new(Metrics::new())))
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
    async fn a_save_waits_for_a_place_while_the_queue_is_full() {
        let q = queue();
        let held = q.hold();
        let submit = |q: &Arc<SealQueue>, place: SealPlace| {
            q.submit(Box::new(move |_| drop(place)));
        };
        for _ in 0..MAX_PENDING_SEALS {
            let p = tokio::time::timeout(std::time::Duration::from_secs(5), q.reserve(10))
                .await
                .expect("a place below the bound");
            submit(&q, p);
        }
        assert_eq!(q.metrics.seal_queue_jobs.get(), MAX_PENDING_SEALS as i64);
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.reserve(10).await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "a full queue has no place");
        drop(held);
        // The thread of this queue runs no job (no engine), but dropping a job gives its
        // place back all the same.
        let p = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("a place once the jobs ran")
            .unwrap();
        drop(p);
        q.settle().await;
        assert_eq!(q.metrics.seal_queue_jobs.get(), 0);
    }

    #[tokio::test]
    async fn requests_holding_the_whole_hash_budget_wait_for_each_other() {
        let q = queue();
        let held = q.hold();
        // A request larger than the budget takes all of it.
        let big = q.reserve(usize::MAX).await;
        q.submit(Box::new(move |_| drop(big)));
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.reserve(1).await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no hash entries left");
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("entries given back once the job ran")
            .unwrap();
    }

    #[tokio::test]
    async fn two_holds_release_the_thread_only_when_both_are_gone() {
        let q = queue();
        let (a, b) = (q.hold(), q.hold());
        q.submit(Box::new(|_| ()));
        drop(a);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(q.pending(), "one hold still holds");
        drop(b);
        tokio::time::timeout(std::time::Duration::from_secs(5), q.settle())
            .await
            .expect("run once both holds are gone");
    }
}
