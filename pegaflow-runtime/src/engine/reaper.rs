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
                    drop(item);
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
