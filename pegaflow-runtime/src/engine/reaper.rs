//! The reaper: a dedicated OS thread that drops released registrations (and anything else
//! whose drop may block on a device), so unmapping never runs on the async executor
//! (DESIGN.md §6.6) and always runs after the engine fenced and drained the memory.

use std::any::Any;

use tokio::sync::oneshot;

type Job = (Box<dyn Any + Send>, Option<oneshot::Sender<()>>);

/// Handle to the reaper thread.
#[derive(Debug, Clone)]
pub struct Reaper {
    tx: std::sync::mpsc::SyncSender<Job>,
}

impl Reaper {
    /// Starts the thread (named `registry-reaper`), with a queue of `depth` items.
    pub fn start(depth: usize) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(depth);
        std::thread::Builder::new()
            .name("registry-reaper".into())
            .spawn(move || {
                while let Ok((item, done)) = rx.recv() {
                    // A release that panics (a driver wrapper gone wrong) must not take the
                    // reaper, and every later release, down: the other items of a worker's
                    // teardown are still dropped (a Vec drops its remaining elements while
                    // unwinding), and the next job runs.
                    let r =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(item)));
                    if r.is_err() {
                        tracing::error!("a release on the reaper thread panicked");
                    }
                    if let Some(d) = done {
                        let _ = d.send(());
                    }
                }
            })
            .expect("spawn reaper thread");
        Self { tx }
    }

    /// Drops `item` on the reaper thread and waits until it has been dropped.
    pub async fn release<T: Send + 'static>(&self, item: T) {
        let (d, w) = oneshot::channel();
        let tx = self.tx.clone();
        let job: Job = (Box::new(item), Some(d));
        // The queue is bounded: sending may block briefly, so do it off the executor.
        let sent = tokio::task::spawn_blocking(move || tx.send(job).is_ok())
            .await
            .unwrap_or(false);
        if sent {
            let _ = w.await;
        }
    }

    /// Drops `item` on the reaper thread without waiting (from synchronous code).
    pub fn release_detached<T: Send + 'static>(&self, item: T) {
        let _ = self.tx.send((Box::new(item), None));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    struct Counted(Arc<AtomicUsize>, bool);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
            if self.1 {
                panic!("release failed");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_release_does_not_stop_the_others() {
        let reaper = Reaper::start(4);
        let n = Arc::new(AtomicUsize::new(0));
        // The third of five allocations fails to release: the other four still go.
        let items: Vec<Counted> = (0..5).map(|i| Counted(n.clone(), i == 2)).collect();
        reaper.release(items).await;
        assert_eq!(n.load(Ordering::SeqCst), 5);
        // And the reaper is still there for the next teardown.
        reaper.release(Counted(n.clone(), false)).await;
        assert_eq!(n.load(Ordering::SeqCst), 6);
    }
}
