//! A copy worker: one thread per (device, direction), with its own primary-context binding,
//! `staging_buffers` copy streams and staging buffers, descriptor pages and the copy kernel. It
//! takes the batches of its queue one at a time (or, with `overlap`, starts the next behind
//! the running one), chooses a path per batch ([`CopyPath`](crate::transport::CopyPath)), enqueues it, waits for its end and
//! answers.
//!
//! The worker is one type, [`Worker`]; its methods are split by concern over this module
//! (the thread's loop and queue, start-up, preparing ahead, drop) and its children: [`batch`]
//! (one batch: start, enqueue, the path choice, finish and answer), [`direct`] (one copy per
//! range), [`staged`] (gather/scatter kernel and staging ring), [`mapped`] (kernel over mapped
//! pinned memory), [`wait`] (the end of a batch: end events, tail marks, polling) and
//! [`overlap`] (starting a batch behind the running one). Each child keeps the fields of its
//! concern in a struct of its own, held inline by [`Worker`].
//!
//! Owns: every CUDA object the worker makes (destroyed by its drop, after waiting for
//! whatever is still enqueued). Must never: run on the async executor (it is a thread of its
//! own, blocking on its queue), answer a batch before every byte of it moved (an error in the
//! middle still waits for what was enqueued, then reports the error), or let a panic leave
//! work in flight unanswered (a panic while enqueueing or waiting is caught, everything is
//! waited for, and the batch fails).

mod batch;
mod direct;
mod mapped;
mod overlap;
mod staged;
mod wait;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use pegaflow_plugin::{CopyBatch, Direction, OpParts, TransportError};
use tokio::sync::{mpsc, oneshot};

use super::config::{CudaTransportConfig, Wait, DESC_PAGE_START, MARKS_START_BYTES, MAX_STREAMS};
use super::descriptors::DescPages;
use super::events::{new_event, new_stream};
use super::kernel::{dev_free, Kernel};
use super::progress::{BatchSignals, ReadListener};
use super::report::CopyReport;
use crate::driver::{CudaError, Driver};
use crate::pin::PinSet;
use batch::Started;
use mapped::MappedPath;
use staged::{GatherStream, PlanScratch, Staging};
use wait::{StreamEnds, TailMarks};

/// A batch on its way to its worker, with what the worker answers through.
pub(super) struct Job {
    pub(super) batch: CopyBatch,
    /// The batch's later ops, when the engine hands them over while it plans
    /// ([`pegaflow_plugin::Transport::copy_parts`]).
    pub(super) parts: Option<OpParts>,
    pub(super) reply: oneshot::Sender<Result<CopyReport, TransportError>>,
    /// Told when the worker starts polling for the batch's end (after the last part is
    /// enqueued: at [`Wait::Tail`]'s tail; under [`Wait::Spin`] at once, or once a queued
    /// batch was started behind it); dropped unsent
    /// when the batch fails before that (after its reply), and unused under [`Wait::Sleep`].
    /// The caller then polls `reply` on its own task, yielding, for up to [`POLL_LIMIT`](super::POLL_LIMIT), so
    /// the runtime thread that carries the answer on is awake when the copy ends instead of
    /// being woken by the worker after it.
    pub(super) near_end: oneshot::Sender<()>,
    /// The operation's source-read listener, for a device → host batch whose caller has
    /// one: fired once the batch's staged gathers have read all of its device memory.
    pub(super) source_read: Option<ReadListener>,
    /// When `copy` sent it (the debug log's `queued_us`: how long it waited for the worker).
    pub(super) sent: std::time::Instant,
}

/// The body of a worker thread: binds the device, then runs the jobs of `rx` until every
/// sender is gone (a worker that cannot start answers each job with its error).
pub(super) fn worker_main(
    drv: &'static Driver,
    ordinal: i32,
    dir: Direction,
    cfg: CudaTransportConfig,
    pins: Option<Arc<PinSet>>,
    mut rx: mpsc::Receiver<Job>,
) {
    let mut w = match Worker::new(drv, ordinal, dir, cfg, pins) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(ordinal, "cuda copy worker failed to start: {e}");
            while let Some(job) = rx.blocking_recv() {
                let _ = job.reply.send(Err(TransportError(format!(
                    "cuda copy worker of GPU {ordinal}: {e}"
                ))));
            }
            return;
        }
    };
    let idle_poll = Duration::from_micros(w.cfg.idle_poll_us);
    loop {
        // A batch started while the previous one copied comes first; it is finished next.
        let started = match w.ahead.take() {
            Some(s) => s,
            None => match next_job_preparing(&mut w, &mut rx, idle_poll) {
                Some(job) => w.start(job, false),
                None => break,
            },
        };
        w.finish(started, &mut rx);
    }
}

/// [`next_job`] for a worker that has not run [`Worker::prepare`] yet: while no job waits,
/// it checks every 250 µs whether the pool's pinning is over (or there is none), and then
/// prepares (a job that comes meanwhile waits at most that long for the worker); after
/// [`PREPARE_AFTER`] it prepares anyway (a pinning that was cancelled or never ends).
fn next_job_preparing(
    w: &mut Worker,
    rx: &mut mpsc::Receiver<Job>,
    idle_poll: Duration,
) -> Option<Job> {
    while !w.prepared {
        match rx.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return None,
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
        let pinned = w.pins.as_ref().is_none_or(|p| p.is_done());
        if pinned || w.started.elapsed() >= PREPARE_AFTER {
            w.prepare();
        } else {
            std::thread::sleep(Duration::from_micros(250));
        }
    }
    next_job(rx, idle_poll)
}

/// [`next_job_preparing`] prepares a worker at the latest this long after it started: 120 s.
const PREPARE_AFTER: Duration = Duration::from_secs(120);

/// The worker's next job: polled for up to `idle_poll` (0: not at all), then slept on; `None`
/// once every sender is gone.
fn next_job(rx: &mut mpsc::Receiver<Job>, idle_poll: Duration) -> Option<Job> {
    if !idle_poll.is_zero() {
        let until = std::time::Instant::now() + idle_poll;
        loop {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
                Err(mpsc::error::TryRecvError::Empty) if std::time::Instant::now() < until => {
                    std::hint::spin_loop();
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
            }
        }
    }
    rx.blocking_recv()
}

/// A copy worker's state. The fields of each concern are grouped in a struct of the child
/// module that owns that concern; they are held inline, so reaching one costs what reaching a
/// field of the worker did.
struct Worker {
    ordinal: i32,
    dir: Direction,
    cfg: CudaTransportConfig,
    pins: Option<Arc<PinSet>>,
    /// `staging_buffers` streams; chunk `i` of a staged batch runs on stream `i % len`.
    streams: Vec<sys::CUstream>,
    /// The copy kernel (none: it failed to load, and every batch takes the direct path).
    kernel: Option<Kernel>,
    /// Each stream's end events ([`wait`]).
    ends: StreamEnds,
    /// [`Wait::Tail`]'s marks and the per-stream byte counts behind them ([`wait`]).
    marks: TailMarks,
    /// The running batch's [`Job::near_end`] (sent, or dropped, by [`Worker::sync`]) and
    /// [`Job::source_read`].
    signals: BatchSignals,
    /// The gather stream of a device → host worker and its events ([`staged`]).
    gathers: GatherStream,
    /// The staging buffers and the ring of chunks through them ([`staged`]).
    staging: Staging,
    /// Host-mapped pinned pages the staged path's kernels read their descriptors from. Nothing
    /// is rewritten before the batch synchronised, or (a batch started behind the running one,
    /// with one page) before the running batch's gathers completed ([`Worker::gathers_done`]).
    desc_pages: DescPages,
    /// What the mapped path keeps between batches ([`mapped`]).
    mapped: MappedPath,
    /// Buffers the planning reuses ([`staged`]).
    scratch: PlanScratch,
    /// A device → host batch started while the running one still copies ([`Worker::sync`]
    /// takes it from the queue before it waits, and while it polls), to be finished next
    /// ([`overlap`]).
    ahead: Option<Started>,
    /// Whether [`Worker::prepare`] ran.
    prepared: bool,
    /// When the worker started ([`next_job_preparing`] prepares at the latest
    /// [`PREPARE_AFTER`] later).
    started: std::time::Instant,
}

impl Worker {
    fn new(
        drv: &'static Driver,
        ordinal: i32,
        dir: Direction,
        cfg: CudaTransportConfig,
        pins: Option<Arc<PinSet>>,
    ) -> Result<Self, CudaError> {
        drv.bind(ordinal)?;
        let sm = drv.device(ordinal).map(|d| d.sm_count).unwrap_or(1);
        let n = cfg.staging_buffers.clamp(2, MAX_STREAMS);
        let mapped = MappedPath::new(pins.as_ref().map_or(0, |p| p.chunks().len()));
        // Built empty and filled in place: when a creation fails, dropping the half-built
        // worker destroys what was made so far (a worker that fails to start leaks nothing).
        let mut w = Self {
            ordinal,
            dir,
            cfg,
            pins,
            streams: Vec::with_capacity(n),
            kernel: None,
            ends: StreamEnds::with_capacity(n),
            marks: TailMarks::new(),
            signals: BatchSignals::NONE,
            gathers: GatherStream::NONE,
            staging: Staging::new(),
            desc_pages: DescPages::new(),
            mapped,
            scratch: PlanScratch::default(),
            ahead: None,
            prepared: false,
            started: std::time::Instant::now(),
        };
        for _ in 0..n {
            w.streams.push(new_stream()?);
        }
        for _ in 0..n {
            w.ends.done.push(new_event(true)?);
            w.ends.polled.push(new_event(false)?);
        }
        w.mapped.uploaded = new_event(false)?;
        w.kernel = match Kernel::load(sm.saturating_mul(w.cfg.blocks_per_sm).max(1)) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(ordinal, "copy kernel unavailable, using direct copies: {e}");
                None
            }
        };
        if w.kernel.is_some() {
            // Allocate the staging buffers up front rather than on the first batch.
            w.ensure_staging();
            if dir == Direction::ToHost {
                // Without them, gathers run on the copy streams and the source-read signal
                // never fires (Saves are answered at their end).
                let made = (|| -> Result<(), CudaError> {
                    w.gathers.stream = new_stream()?;
                    w.gathers.read_event = new_event(true)?;
                    w.gathers.done = new_event(false)?;
                    Ok(())
                })();
                if let Err(e) = made {
                    tracing::warn!(
                        ordinal,
                        "no gather stream for the device to host worker ({}); Saves are answered when copied",
                        e.0
                    );
                    // SAFETY: made just now in this worker's context, never used.
                    unsafe {
                        for ev in [&mut w.gathers.read_event, &mut w.gathers.done] {
                            if !ev.is_null() {
                                let _ = sys::cuEventDestroy_v2(std::mem::replace(
                                    ev,
                                    std::ptr::null_mut(),
                                ));
                            }
                        }
                        if !w.gathers.stream.is_null() {
                            let _ = sys::cuStreamDestroy_v2(std::mem::replace(
                                &mut w.gathers.stream,
                                std::ptr::null_mut(),
                            ));
                        }
                    }
                }
            }
        }
        Ok(w)
    }

    /// What the worker's batches would otherwise allocate while they run: one descriptor page
    /// of [`DESC_PAGE_START`] bytes (with the staging buffers) and, under [`Wait::Tail`], the
    /// mark events of a [`MARKS_START_BYTES`] batch. Called once, by [`next_job_preparing`],
    /// when the worker is idle and the pool's pinning is over, so that these driver calls
    /// never wait behind the pinning or delay a batch. A failure is logged; the batches then
    /// allocate as they go.
    fn prepare(&mut self) {
        self.prepared = true;
        if self.staging.bufs.is_some() && self.desc_pages.is_empty() {
            if let Err(e) = self.desc_pages.add(DESC_PAGE_START) {
                tracing::debug!(ordinal = self.ordinal, "no descriptor page ahead: {}", e.0)
            }
        }
        if self.cfg.wait == Wait::Tail {
            let marks = (MARKS_START_BYTES / self.cfg.mark_bytes.max(1)).min(4096) as usize;
            // The spare set only serves batches started behind another: as large then.
            let spare = if self.may_overlap() { marks } else { 0 };
            for (set, want) in [
                (&mut self.marks.events, marks),
                (&mut self.marks.spare, spare),
            ] {
                while set.len() < want {
                    match new_event(true) {
                        Ok(e) => set.push(e),
                        Err(e) => {
                            tracing::debug!(
                                ordinal = self.ordinal,
                                "fewer wait marks ahead: {}",
                                e.0
                            );
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Launches the copy kernel over `count` descriptors from index `first` at `descs_dev`, on
    /// `stream` ([`Kernel::launch`]); an error when the kernel failed to load.
    fn launch(
        &self,
        descs_dev: u64,
        first: usize,
        count: usize,
        stream: sys::CUstream,
    ) -> Result<(), CudaError> {
        let Some(k) = &self.kernel else {
            return Err(CudaError("copy kernel unavailable".into()));
        };
        k.launch(descs_dev, first, count, stream)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Whatever is still enqueued (a worker whose start failed midway has nothing).
        self.sync_everything();
        // SAFETY: everything below was created by this worker in its context (current on this
        // thread) and nothing is in flight after sync_everything().
        unsafe {
            if let Some(s) = self.staging.bufs.take() {
                for b in &s {
                    dev_free(b);
                }
            }
            if let Some(d) = self.mapped.desc_dev.take() {
                dev_free(&d);
            }
            if !self.mapped.desc_host.0.is_null() {
                let _ = sys::cuMemFreeHost(self.mapped.desc_host.0);
            }
            self.desc_pages.free_all();
            for e in self
                .ends
                .done
                .iter()
                .chain(&self.ends.polled)
                .chain(&self.marks.events)
                .chain(&self.marks.spare)
                .chain(&self.staging.ring_events)
                .chain([
                    &self.mapped.uploaded,
                    &self.gathers.read_event,
                    &self.gathers.done,
                ])
                .filter(|e| !e.is_null())
            {
                let _ = sys::cuEventDestroy_v2(*e);
            }
            for s in self.streams.iter().chain([&self.gathers.stream]) {
                if !s.is_null() {
                    let _ = sys::cuStreamDestroy_v2(*s);
                }
            }
        }
    }
}
