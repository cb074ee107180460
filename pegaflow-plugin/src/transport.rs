//! The transport contract: moving byte ranges between a registration and host buffers.
//!
//! Memory spaces are open identifiers ([`MemorySpace`]) that backends declare: a registrar
//! says which space a registration lives in, a transport says which spaces it can address, and
//! the runtime pairs them without knowing any space but host memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_api::TransferMode;

use crate::pool::HostRegion;

/// Where memory lives: a domain declared by a backend (`"host"` for this process's virtual
/// memory; a device backend declares its own, e.g. one per GPU API) and an ordinal inside it
/// (a device number; 0 for host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemorySpace {
    /// The domain's name, as its backend declares it.
    pub domain: &'static str,
    /// The device ordinal inside the domain (0 for host memory).
    pub ordinal: i32,
}

impl MemorySpace {
    /// Host memory mapped in this process; addresses are host virtual addresses.
    pub const HOST: MemorySpace = MemorySpace {
        domain: "host",
        ordinal: 0,
    };

    /// A space of `domain`, device `ordinal`.
    pub const fn new(domain: &'static str, ordinal: i32) -> Self {
        Self { domain, ordinal }
    }

    /// Whether this is this process's host memory.
    pub fn is_host(&self) -> bool {
        *self == Self::HOST
    }
}

impl std::fmt::Display for MemorySpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_host() {
            f.write_str("host")
        } else {
            write!(f, "{}:{}", self.domain, self.ordinal)
        }
    }
}

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Save (D2H): registered memory → host buffers.
    ToHost,
    /// Load (H2D): host buffers → registered memory.
    ToDevice,
}

/// One contiguous copy between a registration and a host buffer piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Address in the registration's memory (validated by the engine).
    pub device_addr: u64,
    /// Host address inside a live [`crate::HostBuffer`].
    pub host_addr: usize,
    /// Bytes.
    pub len: usize,
}

/// A batch of copies against memory of one space, in one direction.
#[derive(Debug, Clone)]
pub struct CopyBatch {
    /// Where the registration side lives.
    pub location: MemorySpace,
    /// Which way.
    pub direction: Direction,
    /// The instance's requested mode (a hint; a transport may ignore it).
    pub mode: TransferMode,
    /// The copies; the engine merges adjacent ones before submitting.
    pub ops: Vec<CopyOp>,
}

/// Why a copy failed. A failed copy is never reported as success.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

/// The sending half of a batch's later ops ([`Transport::copy_parts`]): the engine plans a
/// large copy in parts and hands each over as soon as it is built, so that the transport
/// starts moving bytes while the rest is planned. Made by [`op_parts`].
///
/// [`OpPartSender::finish`] ends the batch. Dropped without it (the planning failed or
/// panicked), the receiving side reports the batch as failed once it has waited for what it
/// already submitted.
#[derive(Debug)]
pub struct OpPartSender {
    tx: tokio::sync::mpsc::UnboundedSender<PartMsg>,
    tally: Arc<AtomicU64>,
}

/// The receiving half: the parts, in order, as a transport takes them. See
/// [`Transport::copy_parts`].
#[derive(Debug)]
pub struct OpParts {
    rx: tokio::sync::mpsc::UnboundedReceiver<PartMsg>,
    tally: Arc<AtomicU64>,
    ended: bool,
}

#[derive(Debug)]
enum PartMsg {
    Part(Vec<CopyOp>),
    End,
}

/// A channel for one batch's parts: the engine keeps the sender, the transport gets the
/// parts. Unbounded: the engine builds a batch's ops at least an order of magnitude faster
/// than any transport moves their bytes, and holds them all in memory either way.
pub fn op_parts() -> (OpPartSender, OpParts) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let tally = Arc::new(AtomicU64::new(0));
    (
        OpPartSender {
            tx,
            tally: tally.clone(),
        },
        OpParts {
            rx,
            tally,
            ended: false,
        },
    )
}

impl OpPartSender {
    /// Hands `ops` over as the batch's next part (an empty list is skipped). A part the
    /// transport no longer takes (it failed the batch and dropped its side) is discarded:
    /// the failure is what the copy's future reports.
    pub fn send(&self, ops: Vec<CopyOp>) {
        if ops.is_empty() {
            return;
        }
        let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
        self.tally.fetch_add(bytes, Ordering::Relaxed);
        let _ = self.tx.send(PartMsg::Part(ops));
    }

    /// Bytes of the parts sent so far.
    pub fn sent_bytes(&self) -> u64 {
        self.tally.load(Ordering::Relaxed)
    }

    /// Ends the batch: the transport has every op.
    pub fn finish(self) {
        let _ = self.tx.send(PartMsg::End);
    }
}

/// The failure an [`OpParts`] reports for a sender dropped without [`OpPartSender::finish`].
fn unfinished() -> TransportError {
    TransportError("the batch's ops ended before their last part (its planning failed)".into())
}

impl OpParts {
    /// The next part; `Ok(None)` once the sender finished (and on every call after that).
    ///
    /// # Errors
    /// The sender was dropped without finishing: the batch is incomplete and must fail.
    pub async fn next(&mut self) -> Result<Option<Vec<CopyOp>>, TransportError> {
        if self.ended {
            return Ok(None);
        }
        let m = self.rx.recv().await;
        self.take(m)
    }

    /// [`OpParts::next`] for a transport's own thread: blocks until the next part comes.
    /// Must not be called from an async context (it panics there, as
    /// `tokio::sync::mpsc::UnboundedReceiver::blocking_recv` does).
    ///
    /// # Errors
    /// As [`OpParts::next`].
    pub fn blocking_next(&mut self) -> Result<Option<Vec<CopyOp>>, TransportError> {
        if self.ended {
            return Ok(None);
        }
        let m = self.rx.blocking_recv();
        self.take(m)
    }

    fn take(&mut self, m: Option<PartMsg>) -> Result<Option<Vec<CopyOp>>, TransportError> {
        match m {
            Some(PartMsg::Part(ops)) => Ok(Some(ops)),
            Some(PartMsg::End) => {
                self.ended = true;
                Ok(None)
            }
            None => Err(unfinished()),
        }
    }

    /// Appends every remaining part to `batch.ops` and answers the whole batch: what a
    /// transport that needs all ops before it starts does in [`Transport::copy_parts`].
    ///
    /// # Errors
    /// As [`OpParts::next`]; nothing of the batch has moved then.
    pub async fn gather(mut self, mut batch: CopyBatch) -> Result<CopyBatch, TransportError> {
        while let Some(part) = self.next().await? {
            if batch.ops.is_empty() {
                batch.ops = part;
            } else {
                batch.ops.extend_from_slice(&part);
            }
        }
        Ok(batch)
    }

    /// A handle on the bytes sent as parts so far (the ops of the batch itself not counted),
    /// for a layer that wraps a transport and reports the batch's size once it is done.
    pub fn tally(&self) -> PartTally {
        PartTally(self.tally.clone())
    }
}

/// Bytes sent as parts of one batch so far (see [`OpParts::tally`]).
#[derive(Debug, Clone)]
pub struct PartTally(Arc<AtomicU64>);

impl PartTally {
    /// Bytes in the parts sent so far; final once the batch's copy has completed.
    pub fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Moves bytes between registrations and host buffers.
///
/// Contract: the future returned by [`Transport::copy`] or [`Transport::copy_parts`]
/// completes only once every byte of the batch has moved (or failed); the engine keeps the
/// registration and the host buffers alive until then and always drives the future to
/// completion. No default methods: a layer that wraps a transport forwards every call.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The pipeline kind, e.g. `memcpy`.
    fn kind(&self) -> &'static str;
    /// Whether this transport can reach memory in `space`.
    fn can_address(&self, space: MemorySpace) -> bool;
    /// Host memory the runtime installs before serving: every region the landing pool and
    /// the tiers publish. A device transport registers (pins) them, possibly in the
    /// background; a transport that needs nothing returns `Ok(())`. Called once per region
    /// set, before the first copy.
    ///
    /// # Errors
    /// A registration the transport cannot start (the server then fails start-up).
    fn install_host_memory(&self, regions: &[HostRegion]) -> Result<(), TransportError>;
    /// Runs the batch.
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError>;
    /// Runs one batch whose ops come in parts: `batch.ops` (possibly empty), then every part
    /// `parts` yields until the sender finishes, as one batch with one completion. The engine
    /// plans a large Save's or Load's ops while the first parts already copy; a transport
    /// that can start on the first part does (the `cuda` transport), one that cannot gathers
    /// them first ([`OpParts::gather`]) and runs [`Transport::copy`].
    ///
    /// # Errors
    /// As [`Transport::copy`]; and when the sender is dropped without finishing, after
    /// waiting for whatever of the batch was already submitted.
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError>;
}

/// A one-shot signal shared by clones: fired at most once, from any thread, it runs its
/// action (by default: resolve the receiver [`OnceSignal::new`] returned, which errs once every
/// clone is dropped unfired).
#[derive(Clone)]
struct OnceSignal(Arc<parking_lot::Mutex<Option<SignalAction>>>);

/// What a [`OnceSignal`] does when fired.
type SignalAction = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for OnceSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceSignal")
            .field("fired", &self.0.lock().is_none())
            .finish()
    }
}

impl OnceSignal {
    fn new() -> (Self, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (
            Self::with_action(move || {
                let _ = tx.send(());
            }),
            rx,
        )
    }

    fn with_action(action: impl FnOnce() + Send + 'static) -> Self {
        Self(Arc::new(parking_lot::Mutex::new(Some(Box::new(action)))))
    }

    fn fire(&self) {
        // Taken under the lock, run outside it.
        let action = self.0.lock().take();
        if let Some(action) = action {
            action();
        }
    }
}

/// Who hears that the copy batch of the current operation is close to its end: the RPC layer
/// sends a Save's response headers then, so that the client's threads are awake when the
/// answer follows (the runtime's `[server] save_headers_early`). Made by
/// [`NearEnd::new`], installed around an operation with [`NearEnd::scope`], fired by the
/// transport through [`signal_near_end`]. Fires at most once; cloning shares the one signal.
#[derive(Debug, Clone)]
pub struct NearEnd(OnceSignal);

tokio::task_local! {
    static NEAR_END: NearEnd;
    static SOURCE_READ: SourceRead;
}

impl NearEnd {
    /// A listener and the receiver that resolves when it fires (or errs once every clone of
    /// the listener is dropped unfired).
    pub fn new() -> (Self, tokio::sync::oneshot::Receiver<()>) {
        let (s, rx) = OnceSignal::new();
        (Self(s), rx)
    }

    /// Runs `fut` with this listener as its task's: [`signal_near_end`] called while `fut`
    /// is polled fires it.
    pub async fn scope<F: std::future::Future>(self, fut: F) -> F::Output {
        NEAR_END.scope(self, fut).await
    }

    /// The listener of the task being polled, if any: an operation that moves its copy into
    /// a task of its own carries it there with [`NearEnd::scope`].
    pub fn current() -> Option<Self> {
        NEAR_END.try_with(Clone::clone).ok()
    }

    fn fire(&self) {
        self.0.fire();
    }
}

/// Who hears that a device → host batch of the current operation has read every byte of its
/// device memory, while bytes of it may still travel to host memory: from then on the
/// client may overwrite its device memory without harm to the copy. The RPC layer answers a
/// Save then (the runtime's `[server] save_answer_early`), and the Save goes on to
/// its end (host bytes, seal) in its own task; a failure after the answer is logged and
/// counted (`pegaflow_save_late_failures_total`), and the Save's blocks are not stored.
///
/// Made by [`SourceRead::new`], installed around an operation with [`SourceRead::scope`];
/// a transport takes it with [`SourceRead::current`] on the task that awaits the batch and
/// fires it with [`SourceRead::fire`], from any thread, only once no byte of the batch will
/// read the device again (the `cuda` transport: after the last gather kernel of a staged
/// batch completed into its device staging buffers). A transport that cannot tell never
/// fires it, and the answer waits for the batch's end. Fires at most once; cloning shares
/// the one signal.
#[derive(Debug, Clone)]
pub struct SourceRead(OnceSignal);

impl SourceRead {
    /// A listener and the receiver that resolves when it fires (or errs once every clone of
    /// the listener is dropped unfired).
    pub fn new() -> (Self, tokio::sync::oneshot::Receiver<()>) {
        let (s, rx) = OnceSignal::new();
        (Self(s), rx)
    }

    /// Runs `fut` with this listener as its task's: [`SourceRead::current`] inside `fut`
    /// returns it.
    pub async fn scope<F: std::future::Future>(self, fut: F) -> F::Output {
        SOURCE_READ.scope(self, fut).await
    }

    /// The listener of the task being polled, if any.
    pub fn current() -> Option<Self> {
        SOURCE_READ.try_with(Clone::clone).ok()
    }

    /// Fires the signal; a second call, or one nobody listens to any more, does nothing.
    pub fn fire(&self) {
        self.0.fire();
    }

    /// A listener that, when fired, runs `first` and then fires `then`: the engine notes a
    /// Save as acknowledged before the RPC layer answers it. Dropped unfired, it drops
    /// `then` unfired.
    pub fn chained(first: impl FnOnce() + Send + 'static, then: SourceRead) -> Self {
        Self(OnceSignal::with_action(move || {
            first();
            then.fire();
        }))
    }
}

/// Called by a transport, on the task that awaits a batch (inside [`Transport::copy`] or
/// [`Transport::copy_parts`]), once the batch's end is about a thread's wake-up away (the
/// `cuda` transport under `wait = "tail"`: when it starts polling the last ~16 MiB, ~0.3 ms
/// at 55 GB/s, or up to one staging chunk or direct copy more). Only a
/// hint: it changes no result, a transport need not call it, and a call with nobody
/// listening, or a second call, does nothing. A batch may still fail after it.
pub fn signal_near_end() {
    let _ = NEAR_END.try_with(NearEnd::fire);
}
