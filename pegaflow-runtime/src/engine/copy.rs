//! A Save's or Load's one copy batch, planned in parts while the transport already moves the
//! first ones ([`Transport::copy_parts`]).
//!
//! Owns the copy's future from its start to its end. Must never: drop the future (and with it
//! the buffers and the registration it keeps) before it completed, whatever happens to the
//! RPC or to the planning meanwhile; or let a part cross a block.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use futures::FutureExt;

use crate::error::{EngineError, EngineResult};
use crate::plugin::{
    op_parts, CopyBatch, CopyOp, NearEnd, OpPartSender, SourceRead, Transport, TransportError,
};

/// The first part of a batch holds about this many bytes; each next one doubles, up to
/// [`PART_MAX_BYTES`]: the transport starts after a few microseconds of planning, and a
/// 4 GiB Load is handed over in ~20 parts.
pub(super) const PART_FIRST_BYTES: u64 = 8 << 20;
/// The largest part, in bytes.
pub(super) const PART_MAX_BYTES: u64 = 256 << 20;

type CopyFuture = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send>>;

/// A copy started by [`start_copy`]: its future, polled once. Finish it with
/// [`StartedCopy::wait`]; dropped unfinished (the planning panicked, or the wait was
/// cancelled), it is spawned to run to completion, so the buffers and the registration it
/// keeps outlive every byte in flight.
pub(super) struct StartedCopy {
    fut: Option<CopyFuture>,
    /// The first poll's result, when the transport finished (or failed) at once.
    ready: Option<Result<(), TransportError>>,
}

impl StartedCopy {
    /// Waits for the copy on the caller's task: its end wakes this task directly, with no
    /// task in between. Cancelling the wait cannot cut the copy short: the dropped
    /// `StartedCopy` spawns what is left of it ([`Drop`]), which keeps the buffers and the
    /// registration until its end.
    ///
    /// # Errors
    /// `Internal`: the transport failed the batch, or panicked.
    pub(super) async fn wait(mut self) -> EngineResult<()> {
        let r = match self.ready.take() {
            Some(r) => {
                self.fut = None;
                r
            }
            None => {
                let fut = self
                    .fut
                    .as_mut()
                    .expect("a started copy has a future or a result");
                let r = AssertUnwindSafe(fut).catch_unwind().await;
                // Done, or panicked: then its state and what it kept are dropped here, as a
                // panicking task's would be.
                self.fut = None;
                r.map_err(|_| EngineError::internal("copy failed: the transport panicked"))?
            }
        };
        r.map_err(|e| EngineError::internal(format!("copy failed: {e}")))
    }
}

impl Drop for StartedCopy {
    fn drop(&mut self) {
        if let Some(fut) = self.fut.take() {
            if self.ready.is_none() {
                tokio::spawn(fut);
            }
        }
    }
}

/// Starts `batch` (its ops empty: they come through the returned feed) on `transport`,
/// keeping `keep` until the copy ends. The future is polled once here, on the caller's task:
/// a spawned task would only start once the caller yields, which is after its planning, and
/// the point is that the transport has the batch while the ops are still being built.
pub(super) async fn start_copy<K: Send + 'static>(
    transport: Arc<dyn Transport>,
    batch: CopyBatch,
    keep: K,
) -> (PartFeed, StartedCopy) {
    let (tx, parts) = op_parts();
    let copy = async move {
        let r = transport.copy_parts(batch, parts).await;
        drop(keep);
        r
    };
    // The RPC's listeners, if any, go with the future into the task that waits.
    let copy: CopyFuture = match SourceRead::current() {
        Some(read) => Box::pin(read.scope(copy)),
        None => Box::pin(copy),
    };
    let mut fut: CopyFuture = match NearEnd::current() {
        Some(near) => Box::pin(near.scope(copy)),
        None => copy,
    };
    let ready = std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(r) => Poll::Ready(Some(r)),
        Poll::Pending => Poll::Ready(None),
    })
    .await;
    (
        PartFeed::new(tx),
        StartedCopy {
            fut: Some(fut),
            ready,
        },
    )
}

/// The ops of one started copy, built block by block and handed over in parts that end at
/// block boundaries ([`PART_FIRST_BYTES`] doubling up to [`PART_MAX_BYTES`]).
pub(super) struct PartFeed {
    tx: OpPartSender,
    ops: Vec<CopyOp>,
    /// Bytes of the blocks in `ops`, as the planner counts them.
    pending: u64,
    /// The part is handed over once `pending` reaches this.
    due: u64,
}

impl PartFeed {
    fn new(tx: OpPartSender) -> Self {
        Self {
            tx,
            ops: Vec::new(),
            pending: 0,
            due: PART_FIRST_BYTES,
        }
    }

    /// The part being built: append one block's ops, then call [`PartFeed::block_done`].
    pub(super) fn ops(&mut self) -> &mut Vec<CopyOp> {
        &mut self.ops
    }

    /// Notes one block's ops (`bytes`) complete; hands the part over when it is due.
    pub(super) fn block_done(&mut self, bytes: u64) {
        self.pending += bytes;
        if self.pending >= self.due {
            self.cut();
            self.due = (self.due * 2).min(PART_MAX_BYTES);
        }
    }

    fn cut(&mut self) {
        // The next part is about twice this one: reserve for that.
        let next = Vec::with_capacity(self.ops.len().saturating_mul(2).max(16));
        let part = std::mem::replace(&mut self.ops, next);
        self.tx.send(part);
        self.pending = 0;
    }

    /// Hands the last part over and ends the batch. Returns the bytes of all its ops.
    pub(super) fn finish(mut self) -> u64 {
        if !self.ops.is_empty() {
            self.cut();
        }
        let sent = self.tx.sent_bytes();
        self.tx.finish();
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicBool, Ordering};

    use async_trait::async_trait;
    use parking_lot::Mutex;
    use pegaflow_api::TransferMode;

    use crate::plugin::{Direction, HostRegion, MemorySpace, OpParts};

    /// Records each part as it arrives, and whether the batch ended finished.
    #[derive(Default)]
    struct Recorder {
        parts: Mutex<Vec<Vec<CopyOp>>>,
        failed: AtomicBool,
    }

    #[async_trait]
    impl Transport for Recorder {
        fn kind(&self) -> &'static str {
            "recorder"
        }
        fn can_address(&self, _: MemorySpace) -> bool {
            true
        }
        fn install_host_memory(&self, _: &[HostRegion]) -> Result<(), TransportError> {
            Ok(())
        }
        async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
            self.parts.lock().push(batch.ops);
            Ok(())
        }
        async fn copy_parts(
            &self,
            batch: CopyBatch,
            mut parts: OpParts,
        ) -> Result<(), TransportError> {
            assert!(batch.ops.is_empty());
            loop {
                match parts.next().await {
                    Ok(Some(p)) => self.parts.lock().push(p),
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        self.failed.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                }
            }
        }
    }

    fn batch() -> CopyBatch {
        CopyBatch {
            location: MemorySpace::HOST,
            direction: Direction::ToHost,
            mode: TransferMode::Direct,
            ops: Vec::new(),
        }
    }

    fn op(i: usize, len: usize) -> CopyOp {
        CopyOp {
            device_addr: (i * len) as u64,
            host_addr: i * len,
            len,
        }
    }

    #[tokio::test]
    async fn parts_double_end_at_blocks_and_arrive_in_order() {
        let t = Arc::new(Recorder::default());
        let keep = Arc::new(());
        let (mut feed, copy) = start_copy(t.clone(), batch(), keep.clone()).await;
        // 100 blocks of 2 MiB, two 1 MiB ops each.
        let mb = 1 << 20;
        for b in 0..100 {
            feed.ops().push(op(2 * b, mb));
            feed.ops().push(op(2 * b + 1, mb));
            feed.block_done(2 * mb as u64);
        }
        assert_eq!(feed.finish(), 200 * mb as u64);
        copy.wait().await.unwrap();
        assert_eq!(
            Arc::strong_count(&keep),
            1,
            "the copy released what it kept"
        );
        let parts = t.parts.lock();
        let blocks: Vec<usize> = parts.iter().map(|p| p.len() / 2).collect();
        // 8, 16, 32, 64 MiB, then the remaining 80 MiB.
        assert_eq!(blocks, [4, 8, 16, 32, 40]);
        let all: Vec<CopyOp> = parts.iter().flatten().copied().collect();
        assert_eq!(all, (0..200).map(|i| op(i, mb)).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_panicking_planner_fails_the_copy_and_keeps_the_buffers_until_it_ends() {
        let t = Arc::new(Recorder::default());
        let keep = Arc::new(());
        let weak = Arc::downgrade(&keep);
        let (mut feed, copy) = start_copy(t.clone(), batch(), keep).await;
        feed.ops().push(op(0, 16 << 20));
        feed.block_done(16 << 20);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _feed = feed;
            let _copy = copy;
            panic!("planner bug");
        }));
        assert!(r.is_err());
        // The dropped copy was spawned: it sees the unfinished parts, fails, and only then
        // releases what it kept.
        for _ in 0..1000 {
            if weak.upgrade().is_none() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(weak.upgrade().is_none(), "the copy ran to its end");
        assert!(t.failed.load(Ordering::SeqCst), "an unfinished batch fails");
        assert_eq!(t.parts.lock().len(), 1);
    }

    /// Finishes its batch once `go` is notified, or panics when `panic` is set.
    #[derive(Default)]
    struct Gated {
        go: tokio::sync::Notify,
        panic: bool,
    }

    #[async_trait]
    impl Transport for Gated {
        fn kind(&self) -> &'static str {
            "gated"
        }
        fn can_address(&self, _: MemorySpace) -> bool {
            true
        }
        fn install_host_memory(&self, _: &[HostRegion]) -> Result<(), TransportError> {
            Ok(())
        }
        async fn copy(&self, _: CopyBatch) -> Result<(), TransportError> {
            Ok(())
        }
        async fn copy_parts(&self, _: CopyBatch, mut parts: OpParts) -> Result<(), TransportError> {
            while parts.next().await?.is_some() {}
            assert!(!self.panic, "transport bug");
            self.go.notified().await;
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_cancelled_wait_lets_the_copy_run_to_its_end() {
        let t = Arc::new(Gated::default());
        let keep = Arc::new(());
        let weak = Arc::downgrade(&keep);
        let (mut feed, copy) = start_copy(t.clone(), batch(), keep).await;
        feed.ops().push(op(0, 1 << 20));
        feed.block_done(1 << 20);
        feed.finish();
        // The wait is polled until it waits on the transport, then dropped (a cancelled RPC).
        let waited = tokio::time::timeout(std::time::Duration::from_millis(20), copy.wait()).await;
        assert!(
            waited.is_err(),
            "the copy cannot end before the transport lets it"
        );
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            weak.upgrade().is_some(),
            "what the copy keeps outlives the cancelled wait"
        );
        t.go.notify_one();
        for _ in 0..1000 {
            if weak.upgrade().is_none() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            weak.upgrade().is_none(),
            "the copy ran to its end and let go"
        );
    }

    #[tokio::test]
    async fn a_panicking_transport_fails_the_wait() {
        let t = Arc::new(Gated {
            panic: true,
            ..Gated::default()
        });
        let keep = Arc::new(());
        let weak = Arc::downgrade(&keep);
        let (mut feed, copy) = start_copy(t, batch(), keep).await;
        feed.ops().push(op(0, 1 << 20));
        feed.block_done(1 << 20);
        feed.finish();
        let e = copy.wait().await.unwrap_err();
        assert!(matches!(e, EngineError::Internal(_)), "{e:?}");
        assert!(e.to_string().contains("panicked"), "{e}");
        assert!(
            weak.upgrade().is_none(),
            "the panicked copy's state is dropped"
        );
    }

    #[tokio::test]
    async fn a_gathering_transport_gets_one_batch() {
        struct Gather(Mutex<Vec<usize>>);
        #[async_trait]
        impl Transport for Gather {
            fn kind(&self) -> &'static str {
                "gather"
            }
            fn can_address(&self, _: MemorySpace) -> bool {
                true
            }
            fn install_host_memory(&self, _: &[HostRegion]) -> Result<(), TransportError> {
                Ok(())
            }
            async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
                self.0.lock().push(batch.ops.len());
                Ok(())
            }
            async fn copy_parts(
                &self,
                batch: CopyBatch,
                parts: OpParts,
            ) -> Result<(), TransportError> {
                self.copy(parts.gather(batch).await?).await
            }
        }
        let t = Arc::new(Gather(Mutex::new(Vec::new())));
        let (mut feed, copy) = start_copy(t.clone(), batch(), ()).await;
        for b in 0..40 {
            feed.ops().push(op(b, 1 << 20));
            feed.block_done(1 << 20);
        }
        feed.finish();
        copy.wait().await.unwrap();
        assert_eq!(*t.0.lock(), [40]);
    }
}
