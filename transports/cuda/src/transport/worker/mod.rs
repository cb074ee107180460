//! A copy worker: one thread per (device, direction) that runs the batches of its queue.

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use pegaflow_api::TransferMode;
use pegaflow_runtime::{CopyBatch, CopyOp, Direction, OpParts, TransportError};
use tokio::sync::{mpsc, oneshot};

use super::config::{
    CudaTransportConfig, KernelPath, Policy, Wait, DESC_PAGE_START, MARKS_START_BYTES, MAX_STREAMS,
    POLL_LIMIT,
};
use super::descriptors::DescPages;
use super::events::{
    event_done, new_event, new_stream, poll_event, poll_event_with, record, wait_event,
};
use super::kernel::{dev_alloc, dev_free, DevBuf, Kernel};
use super::progress::{BatchSignals, ReadListener};
use super::report::{CopyPath, CopyReport};
use crate::driver::{check, CudaError, Driver};
use crate::pin::{PinSet, PinState};
use crate::plan::{
    merge_ops, merged_stats, push_descs, split_at_boundaries, Desc, HostOrder, StagedPlan,
    STAGING_ALIGN,
};

/// A batch on its way to its worker, with what the worker answers through.
pub(in crate::transport) struct Job {
    pub(in crate::transport) batch: CopyBatch,
    /// The batch's later ops, when the engine hands them over while it plans
    /// ([`pegaflow_runtime::Transport::copy_parts`]).
    pub(in crate::transport) parts: Option<OpParts>,
    pub(in crate::transport) reply: oneshot::Sender<Result<CopyReport, TransportError>>,
    /// Told when the worker starts polling for the batch's end (after the last part is
    /// enqueued: at [`Wait::Tail`]'s tail; under [`Wait::Spin`] at once, or once a queued
    /// batch was started behind it); dropped unsent
    /// when the batch fails before that (after its reply), and unused under [`Wait::Sleep`].
    /// The caller then polls `reply` on its own task, yielding, for up to [`POLL_LIMIT`], so
    /// the runtime thread that carries the answer on is awake when the copy ends instead of
    /// being woken by the worker after it.
    pub(in crate::transport) near_end: oneshot::Sender<()>,
    /// The operation's source-read listener, for a device → host batch whose caller has
    /// one: fired once the batch's staged gathers have read all of its device memory.
    pub(in crate::transport) source_read: Option<ReadListener>,
    /// When `copy` sent it (the debug log's `queued_us`: how long it waited for the worker).
    pub(in crate::transport) sent: std::time::Instant,
}

/// The body of a worker thread: binds the device, then runs the jobs of `rx` until every
/// sender is gone (a worker that cannot start answers each job with its error).
pub(in crate::transport) fn worker_main(
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

/// What a batch's ops came to, over its parts (for the debug line and the report).
#[derive(Default)]
struct Tally {
    ops: usize,
    bytes: u64,
    parts: usize,
}

impl Tally {
    fn add(&mut self, ops: &[CopyOp]) {
        self.ops += ops.len();
        self.bytes += ops.iter().map(|o| o.len as u64).sum::<u64>();
        self.parts += 1;
    }
}

/// The next part of a batch, counted in `tally`; `None` when there are no parts or the
/// sender finished.
fn next_part(
    parts: &mut Option<&mut OpParts>,
    tally: &mut Tally,
) -> Result<Option<Vec<CopyOp>>, CudaError> {
    let Some(p) = parts.as_deref_mut() else {
        return Ok(None);
    };
    let part = p.blocking_next().map_err(|e| CudaError(e.0))?;
    if let Some(ops) = &part {
        tally.add(ops);
    }
    Ok(part)
}

/// A staged run's progress across the parts of one batch.
struct StagedRun<'a> {
    boundaries: &'a [usize],
    bases: &'a [u64],
    /// Chunks of the plan issued so far.
    issued: usize,
    submissions: usize,
}

/// A batch whose ops the worker has enqueued ([`Worker::start`]) and whose end it has not
/// waited for yet ([`Worker::finish`]).
struct Started {
    /// Kept until the answer (the engine's feed may still send to a batch that failed).
    _parts: Option<OpParts>,
    reply: oneshot::Sender<Result<CopyReport, TransportError>>,
    path: CopyPath,
    tally: Tally,
    /// The submissions enqueued, or what failed (what was enqueued is still waited for).
    enqueued: Result<usize, CudaError>,
    overlapped: bool,
    queued_us: u64,
    t0: std::time::Instant,
    enqueue_time: Duration,
}

struct Worker {
    ordinal: i32,
    dir: Direction,
    cfg: CudaTransportConfig,
    pins: Option<Arc<PinSet>>,
    /// `staging_buffers` streams; chunk `i` of a staged batch runs on stream `i % len`.
    streams: Vec<sys::CUstream>,
    done: Vec<sys::CUevent>,
    /// One event per stream made without `CU_EVENT_BLOCKING_SYNC`, polled by [`Wait::Tail`]
    /// and [`Wait::Spin`].
    polled: Vec<sys::CUevent>,
    /// [`Wait::Tail`]'s marks of the running batch: (stream, bytes enqueued on that stream up
    /// to the mark, index in `mark_events`), in enqueue order.
    marks: Vec<(usize, u64, usize)>,
    /// Events (`CU_EVENT_BLOCKING_SYNC`) for the marks, created as batches need them and
    /// reused by later batches (re-recording an event after its batch synchronised is safe).
    mark_events: Vec<sys::CUevent>,
    /// The other set of mark events: a batch started behind the running one swaps the two
    /// sets, so that its marks never re-record the event the running batch sleeps on.
    mark_spare: Vec<sys::CUevent>,
    /// The running batch's [`Job::near_end`] (sent, or dropped, by [`Worker::sync`]) and
    /// [`Job::source_read`].
    signals: BatchSignals,
    /// Bytes the running batch enqueued on each stream, and since that stream's last mark.
    enqueued: [u64; MAX_STREAMS],
    since_mark: [u64; MAX_STREAMS],
    /// How long the last [`Worker::sync`] slept on marks (for the batch's debug line).
    slept: Duration,
    /// Whether [`Worker::sync`] recorded every end of the running batch (each stream's and
    /// the gather stream's), so that a batch may start behind it ([`Worker::start_ahead`]).
    ends_recorded: bool,
    uploaded: sys::CUevent,
    /// The copy kernel (none: it failed to load, and every batch takes the direct path).
    kernel: Option<Kernel>,
    /// Device → host workers with the copy kernel: the stream every gather kernel of a
    /// staged batch runs on, so that a gather never waits behind an earlier chunk's pinned
    /// copy (null otherwise). Chunk `i`'s pinned copies run on `streams[i % len]` after its
    /// gather (an event), and a gather into staging memory still being copied out waits for
    /// that copy (events: [`Worker::ring`]).
    gather: sys::CUstream,
    /// The staged device → host chunks whose pinned copies may still read their staging
    /// memory: (buffer, offset, end, the event after the copies), oldest first. Chunks are
    /// placed one after the other through the buffers, wrapping around, across batches while
    /// they overlap ([`Worker::ahead`]); cleared when a batch starts after the previous ones
    /// ended.
    ring: std::collections::VecDeque<(usize, u64, u64, sys::CUevent)>,
    /// Where the next chunk goes: (buffer, offset).
    ring_at: (usize, u64),
    /// Every event made for `ring` and the gathers (destroyed with the worker), and those of
    /// them free: an event goes back once a stream's wait on it is enqueued (a later record
    /// does not change what that wait waits for) or its ring entry is dropped.
    ring_events: Vec<sys::CUevent>,
    ring_free: Vec<sys::CUevent>,
    /// Recorded on `gather` after a batch's last gather, when `source_read` is set; polled
    /// then slept on (`CU_EVENT_BLOCKING_SYNC`) by [`Worker::sync`].
    read_event: sys::CUevent,
    read_recorded: bool,
    /// Recorded on `gather` with the streams' ends in [`Worker::sync`], to see the gathers'
    /// errors without waiting for a later batch's gathers, and to tell when the running
    /// batch's gathers are done ([`Worker::gathers_done`]).
    gather_done: sys::CUevent,
    /// `gather_done` is recorded after the running batch's last gather (set in
    /// [`Worker::sync`] before it polls, false when that record failed; cleared when a batch
    /// starts after the previous end).
    gather_done_recorded: bool,
    /// A device → host batch started while the running one still copies ([`Worker::sync`]
    /// takes it from the queue before it waits, and while it polls), to be finished next.
    ahead: Option<Started>,
    /// One staging buffer per stream.
    staging: Option<Vec<DevBuf>>,
    staging_failed: bool,
    desc_dev: Option<DevBuf>,
    desc_host: (*mut c_void, usize),
    mapped: Vec<Option<u64>>,
    plan: StagedPlan,
    descs: Vec<Desc>,
    /// Host-mapped pinned pages the staged path's kernels read their descriptors from. Nothing
    /// is rewritten before the batch synchronised, or (a batch started behind the running one,
    /// with one page) before the running batch's gathers completed ([`Worker::gathers_done`]).
    desc_pages: DescPages,
    /// Scratch of the host-order sort fallback.
    order: Vec<usize>,
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
        let mapped = pins
            .as_ref()
            .map(|p| vec![None; p.chunks().len()])
            .unwrap_or_default();
        // Built empty and filled in place: when a creation fails, dropping the half-built
        // worker destroys what was made so far (a worker that fails to start leaks nothing).
        let mut w = Self {
            ordinal,
            dir,
            cfg,
            pins,
            streams: Vec::with_capacity(n),
            done: Vec::with_capacity(n),
            polled: Vec::with_capacity(n),
            marks: Vec::new(),
            signals: BatchSignals::NONE,
            gather: std::ptr::null_mut(),
            ring: std::collections::VecDeque::new(),
            ring_at: (0, 0),
            ring_events: Vec::new(),
            ring_free: Vec::new(),
            read_event: std::ptr::null_mut(),
            read_recorded: false,
            gather_done: std::ptr::null_mut(),
            gather_done_recorded: false,
            ahead: None,
            mark_events: Vec::new(),
            mark_spare: Vec::new(),
            enqueued: [0; MAX_STREAMS],
            since_mark: [0; MAX_STREAMS],
            slept: Duration::ZERO,
            ends_recorded: false,
            uploaded: std::ptr::null_mut(),
            kernel: None,
            staging: None,
            staging_failed: false,
            desc_dev: None,
            desc_host: (std::ptr::null_mut(), 0),
            mapped,
            plan: StagedPlan::default(),
            descs: Vec::new(),
            desc_pages: DescPages::new(),
            order: Vec::new(),
            prepared: false,
            started: std::time::Instant::now(),
        };
        for _ in 0..n {
            w.streams.push(new_stream()?);
        }
        for _ in 0..n {
            w.done.push(new_event(true)?);
            w.polled.push(new_event(false)?);
        }
        w.uploaded = new_event(false)?;
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
                    w.gather = new_stream()?;
                    w.read_event = new_event(true)?;
                    w.gather_done = new_event(false)?;
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
                        for ev in [&mut w.read_event, &mut w.gather_done] {
                            if !ev.is_null() {
                                let _ = sys::cuEventDestroy_v2(std::mem::replace(
                                    ev,
                                    std::ptr::null_mut(),
                                ));
                            }
                        }
                        if !w.gather.is_null() {
                            let _ = sys::cuStreamDestroy_v2(std::mem::replace(
                                &mut w.gather,
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
        if self.staging.is_some() && self.desc_pages.is_empty() {
            match self.desc_pages.add(DESC_PAGE_START) {
                Ok(()) => {}
                Err(e) => {
                    tracing::debug!(ordinal = self.ordinal, "no descriptor page ahead: {}", e.0)
                }
            }
        }
        if self.cfg.wait == Wait::Tail {
            let marks = (MARKS_START_BYTES / self.cfg.mark_bytes.max(1)).min(4096) as usize;
            // The spare set only serves batches started behind another: as large then.
            let spare = if self.may_overlap() { marks } else { 0 };
            for (set, want) in [
                (&mut self.mark_events, marks),
                (&mut self.mark_spare, spare),
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

    /// Notes `bytes` more enqueued on stream `k`; under [`Wait::Tail`] records a mark on it
    /// once `mark_bytes` accumulated on it since its last one. A mark is only an
    /// optimisation: one that cannot be made is skipped (and logged).
    fn note_enqueued(&mut self, bytes: u64, k: usize) {
        self.enqueued[k] += bytes;
        self.since_mark[k] += bytes;
        if self.cfg.wait != Wait::Tail || self.since_mark[k] < self.cfg.mark_bytes {
            return;
        }
        self.since_mark[k] = 0;
        let m = self.marks.len();
        if m == self.mark_events.len() {
            match new_event(true) {
                Ok(e) => self.mark_events.push(e),
                Err(e) => {
                    tracing::debug!(ordinal = self.ordinal, "no wait mark: {}", e.0);
                    return;
                }
            }
        }
        match record(self.mark_events[m], self.streams[k]) {
            Ok(()) => self.marks.push((k, self.enqueued[k], m)),
            Err(e) => tracing::debug!(ordinal = self.ordinal, "no wait mark: {}", e.0),
        }
    }

    /// Waits for everything the running batch enqueued, as `cfg.wait` says. Under
    /// [`Wait::Tail`] and [`Wait::Spin`], when [`Worker::can_overlap`] allows, a batch already
    /// queued on `rx` is started behind the running one ([`Worker::ahead`]) before the wait, and
    /// one that arrives while the worker polls for the end is started then: the copy engine
    /// goes from one batch to the next without the worker's wake-up, answer and planning in
    /// between. Every stream's end is recorded before that (no batch starts ahead when a
    /// record failed), so this waits for the running batch's own work only.
    fn sync(&mut self, rx: &mut mpsc::Receiver<Job>) -> Result<(), CudaError> {
        self.slept = Duration::ZERO;
        self.ends_recorded = false;
        // The batch's device memory is read long before its end: tell the listener first
        // (before a batch started ahead records the read event again).
        if let Some(read) = self.signals.source_read.take() {
            if std::mem::take(&mut self.read_recorded) {
                let done = if self.cfg.wait == Wait::Sleep {
                    wait_event(self.read_event).is_ok()
                } else {
                    match poll_event(self.read_event, POLL_LIMIT) {
                        Ok(true) => true,
                        Ok(false) => wait_event(self.read_event).is_ok(),
                        Err(_) => false,
                    }
                };
                if done {
                    read.fire();
                }
            }
        }
        // How long each stream's end is polled before sleeping on it (None: not at all), and
        // under Tail the marks to sleep on first: per stream, the last one at least
        // `tail_bytes` before that stream's end (none for a stream with less). The copy
        // engine may run the streams' copies in any order (a batch whose gathers all ended
        // early has every chunk ready at once), so the worker sleeps until every stream is in
        // its tail: whichever runs last, it still has `tail_bytes` to copy when its mark fires.
        let near_end = self.signals.near_end.take();
        let n = self.streams.len();
        let mut sleep_on = [None; MAX_STREAMS];
        let poll: Option<Duration> = match self.cfg.wait {
            // The caller does not wait on `near_end` under Sleep (`CudaTransport::submit`).
            Wait::Sleep => None,
            Wait::Spin => Some(Duration::MAX),
            Wait::Tail => {
                let tail = self.cfg.tail_bytes;
                for &(k, at, m) in self.marks.iter() {
                    if at + tail <= self.enqueued[k] {
                        sleep_on[k] = Some(self.mark_events[m]);
                    }
                }
                Some(POLL_LIMIT)
            }
        };
        self.marks.clear();
        // Every stream's end first: a batch started ahead goes after these records.
        let mut recorded = [false; MAX_STREAMS];
        for (k, rec) in recorded.iter_mut().enumerate().take(n) {
            let (polled, done, stream) = (self.polled[k], self.done[k], self.streams[k]);
            *rec =
                (poll.is_none() || record(polled, stream).is_ok()) && record(done, stream).is_ok();
        }
        let gather_recorded =
            !self.gather.is_null() && record(self.gather_done, self.gather).is_ok();
        self.gather_done_recorded = gather_recorded;
        self.ends_recorded =
            recorded.iter().take(n).all(|&r| r) && (self.gather.is_null() || gather_recorded);
        if poll.is_some() && self.may_overlap() && !rx.is_empty() && self.copying(n) {
            // A batch that is already queued need not wait for the tail. (Not when this one
            // has ended: the new batch would count as overlapped, and this one's answer wait
            // for its enqueue.)
            self.start_ahead(rx);
        }
        // Sleep through all but the tail (a batch started ahead recorded its marks in the other
        // set). A failure here is seen again below.
        let slept = std::time::Instant::now();
        for ev in sleep_on.iter().take(n).flatten() {
            let _ = wait_event(*ev);
        }
        self.slept = slept.elapsed();
        if poll.is_some() {
            // The caller starts polling for the answer too (`CudaTransport::submit`).
            if let Some(tx) = near_end {
                let _ = tx.send(());
            }
        }
        let mut first = Ok(());
        for (k, &rec) in recorded.iter().enumerate().take(n) {
            let (polled, done) = (self.polled[k], self.done[k]);
            let r = if rec {
                match poll {
                    Some(limit) => match self.poll_end(polled, limit, rx) {
                        Ok(true) => Ok(()),
                        Ok(false) | Err(_) => wait_event(done),
                    },
                    None => wait_event(done),
                }
            } else {
                Err(CudaError("no end recorded".into()))
            };
            let r = r.or_else(|_| {
                // SAFETY: a stream of this worker's context (current); the fallback when
                // recording or waiting failed (it also waits for a batch started ahead).
                check(
                    unsafe { sys::cuStreamSynchronize(self.streams[k]) },
                    "cuStreamSynchronize",
                )
            });
            if first.is_ok() {
                first = r;
            }
        }
        if !self.gather.is_null() {
            // Done by now (every copy waited for its gather); checked for its errors.
            let r = if gather_recorded {
                wait_event(self.gather_done)
            } else {
                // SAFETY: a stream of this worker's context (current).
                check(
                    unsafe { sys::cuStreamSynchronize(self.gather) },
                    "cuStreamSynchronize",
                )
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// [`poll_event`] for a stream's end that, between queries, starts a batch arriving on
    /// `rx` behind the running one ([`Worker::start_ahead`]).
    fn poll_end(
        &mut self,
        ev: sys::CUevent,
        limit: Duration,
        rx: &mut mpsc::Receiver<Job>,
    ) -> Result<bool, CudaError> {
        poll_event_with(ev, limit, || self.start_ahead(rx))
    }

    /// Starts the batch queued on `rx`, if any, behind the running one, when none was started
    /// ahead yet, every end of the running batch was recorded ([`Worker::ends_recorded`]:
    /// otherwise its wait falls back to synchronising whole streams, which would take in the
    /// new batch's work) and [`Worker::can_overlap`] allows (one at a time).
    fn start_ahead(&mut self, rx: &mut mpsc::Receiver<Job>) {
        // The queue first: `can_overlap` may query an event, once per poll otherwise.
        if self.ahead.is_none() && self.ends_recorded && !rx.is_empty() && self.can_overlap() {
            if let Ok(job) = rx.try_recv() {
                let started = self.start(job, true);
                self.ahead = Some(started);
            }
        }
    }

    /// Whether any of the first `n` streams' polled end (recorded by [`Worker::sync`]) has not
    /// fired yet: the running batch still copies. A failed query counts as still copying.
    fn copying(&self, n: usize) -> bool {
        self.polled.iter().take(n).any(|&ev| !event_done(ev))
    }

    /// Whether this worker's batches can ever start behind one another: `overlap` on, device
    /// → host, and not under `kernel_path = "mapped"` (whose one descriptor buffer each batch
    /// rewrites).
    fn may_overlap(&self) -> bool {
        self.cfg.overlap
            && self.dir == Direction::ToHost
            && self.cfg.kernel_path == KernelPath::Staged
    }

    /// Whether a batch may start while the running one is still in flight:
    /// [`Worker::may_overlap`], and either the running batch's gathers are done while
    /// there is one descriptor page (nothing reads it any more: the new batch writes its
    /// descriptors from the page's start, [`Worker::gathers_done`]) or at least half of the
    /// descriptor page is left, so that the new batch seldom adds a page (one larger than
    /// that does; a batch that starts after every earlier one ended rewinds the page, or folds
    /// the pages into one).
    fn can_overlap(&self) -> bool {
        self.may_overlap()
            && (self.desc_pages.half_free()
                || (self.desc_pages.page_count() <= 1 && self.gathers_done()))
    }

    /// Whether every gather kernel of the running batch has completed (`gather_done`, recorded
    /// after them on the gather stream, has fired): its descriptors are read by nothing any
    /// more. False without a gather stream or before [`Worker::sync`] recorded the event.
    fn gathers_done(&self) -> bool {
        self.gather_done_recorded && !self.gather.is_null() && event_done(self.gather_done)
    }

    /// Waits for all work on every stream of the worker, whatever batch it belongs to: the
    /// fallback after a panic, and at drop.
    fn sync_everything(&mut self) {
        for s in self.streams.iter().chain([&self.gather]) {
            if !s.is_null() {
                // SAFETY: a stream of this worker's context (current on its thread).
                let _ = unsafe { sys::cuStreamSynchronize(*s) };
            }
        }
    }

    /// Enqueues `job`'s batch ([`Worker::enqueue`]), catching a panic (what was enqueued is
    /// still waited for by [`Worker::finish`]). `overlapped`: the previous batch is still in
    /// flight.
    fn start(&mut self, job: Job, overlapped: bool) -> Started {
        let Job {
            batch,
            mut parts,
            reply,
            near_end,
            source_read,
            sent,
        } = job;
        let queued_us = sent.elapsed().as_micros() as u64;
        self.signals.near_end = Some(near_end);
        self.signals.source_read = source_read;
        let t0 = std::time::Instant::now();
        let mut tally = Tally::default();
        let (path, enqueued) = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.enqueue(batch, parts.as_mut(), overlapped, &mut tally)
        }))
        .unwrap_or_else(|_| {
            (
                CopyPath::Empty,
                Err(CudaError("the cuda copy worker panicked".into())),
            )
        });
        Started {
            _parts: parts,
            reply,
            path,
            tally,
            enqueued,
            overlapped,
            queued_us,
            t0,
            enqueue_time: t0.elapsed(),
        }
    }

    /// Enqueues one batch: its own ops, then each part of `parts` as it arrives (the path is
    /// chosen on the first non-empty ops). `overlapped`: the previous batch is still in
    /// flight, so the staging ring and the descriptor page go on from where it left them.
    /// Returns the path and the submissions enqueued, or what failed.
    fn enqueue(
        &mut self,
        batch: CopyBatch,
        mut parts: Option<&mut OpParts>,
        overlapped: bool,
        tally: &mut Tally,
    ) -> (CopyPath, Result<usize, CudaError>) {
        (self.enqueued, self.since_mark) = ([0; MAX_STREAMS], [0; MAX_STREAMS]);
        self.marks.clear();
        if overlapped {
            // The running batch may still sleep on a mark of its set: record ours in the other.
            std::mem::swap(&mut self.mark_events, &mut self.mark_spare);
        } else {
            // Every earlier batch ended: no staging memory is being copied out.
            self.gather_done_recorded = false;
            let free = self.ring.drain(..).map(|(.., ev)| ev);
            self.ring_free.extend(free);
            self.ring_at = (0, 0);
        }
        self.read_recorded = false;
        let mut first = batch.ops;
        if first.is_empty() {
            match next_part(&mut parts, &mut Tally::default()) {
                Ok(p) => first = p.unwrap_or_default(),
                Err(e) => return (CopyPath::Empty, Err(e)),
            }
        }
        if self.cfg.kernel_path == KernelPath::Mapped {
            // The mapped path needs every op to decide: gather the parts first.
            loop {
                match next_part(&mut parts, &mut Tally::default()) {
                    Ok(Some(more)) => first.extend_from_slice(&more),
                    Ok(None) => break,
                    Err(e) => return (CopyPath::Empty, Err(e)),
                }
            }
        }
        tally.add(&first);
        let path = self.choose(batch.mode, &first);
        let r = match path {
            CopyPath::Direct | CopyPath::Empty => self.direct(&first).and_then(|mut n| {
                while let Some(ops) = next_part(&mut parts, tally)? {
                    n += self.direct(&ops)?;
                }
                Ok(n)
            }),
            CopyPath::Staged => self.staged(&first, &mut parts, tally, overlapped),
            CopyPath::Mapped => self.mapped_copy(&first),
        };
        (path, r)
    }

    /// Waits for `s`'s end (a batch arriving meanwhile may start behind it:
    /// [`Worker::sync`]), logs it and answers.
    fn finish(&mut self, s: Started, rx: &mut mpsc::Receiver<Job>) {
        // Always wait for what was enqueued, success or not: the host buffers and the mapping
        // may be released as soon as we answer.
        let synced =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.sync(rx))).unwrap_or_else(|_| {
                self.sync_everything();
                Err(CudaError("the cuda copy worker panicked".into()))
            });
        let Started {
            reply,
            path,
            tally,
            enqueued,
            overlapped,
            queued_us,
            t0,
            enqueue_time,
            ..
        } = s;
        tracing::debug!(
            ordinal = self.ordinal,
            dir = ?self.dir,
            ?path,
            ops = tally.ops,
            parts = tally.parts,
            bytes = tally.bytes,
            overlapped,
            queued_us,
            // When the batch started, in µs since the worker started: with `total_us`, when
            // the copy engine had a batch of this worker in flight.
            at_us = t0.saturating_duration_since(self.started).as_micros() as u64,
            enqueue_us = enqueue_time.as_micros() as u64,
            // Of total_us, asleep on the batch's marks (under wait = "tail").
            slept_us = self.slept.as_micros() as u64,
            total_us = t0.elapsed().as_micros() as u64,
            submissions = enqueued.as_ref().copied().unwrap_or(0),
            "copy batch"
        );
        let r = enqueued
            .and_then(|submissions| {
                synced.map(|()| CopyReport {
                    path,
                    bytes: tally.bytes,
                    submissions,
                    overlapped,
                })
            })
            .map_err(|e| TransportError(format!("GPU {}: {e}", self.ordinal)));
        let _ = reply.send(r);
        if self.ahead.is_none() {
            // A batch that failed before its wait never sent `near_end`: dropping it now
            // (after the reply, so the caller finds the answer ready) wakes a caller still
            // waiting on it. (With a batch started ahead, both are that batch's.)
            self.signals.near_end = None;
            self.signals.source_read = None;
        }
    }

    /// The path for a batch of `mode` whose first ops are `ops`.
    fn choose(&mut self, mode: TransferMode, ops: &[CopyOp]) -> CopyPath {
        let want_kernel = match self.cfg.policy {
            Policy::Direct => false,
            Policy::Kernel => true,
            Policy::Hint => mode == TransferMode::Kernel,
            Policy::Auto => {
                let (n, total) = merged_stats(ops);
                n > 2 && total / (n as u64) < self.cfg.direct_min_bytes
            }
        };
        if !want_kernel || self.kernel.is_none() {
            return CopyPath::Direct;
        }
        if self.cfg.kernel_path == KernelPath::Mapped && self.all_mapped(ops) {
            return CopyPath::Mapped;
        }
        if self.ensure_staging() {
            CopyPath::Staged
        } else {
            CopyPath::Direct
        }
    }

    fn all_mapped(&self, ops: &[CopyOp]) -> bool {
        let Some(p) = &self.pins else { return false };
        ops.iter().filter(|o| o.len > 0).all(|o| {
            let mut h = o.host_addr;
            let end = o.host_addr + o.len;
            while h < end {
                let Some(i) = p.find(h, 1) else { return false };
                let c = &p.chunks()[i];
                if c.state() != PinState::Pinned {
                    return false;
                }
                h = c.addr + c.len;
            }
            true
        })
    }

    fn ensure_staging(&mut self) -> bool {
        if self.staging.is_some() {
            return true;
        }
        if self.staging_failed {
            return false;
        }
        let len = self.cfg.staging_chunk as usize;
        let mut bufs = Vec::with_capacity(self.streams.len());
        for _ in 0..self.streams.len() {
            match dev_alloc(len) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    for b in &bufs {
                        dev_free(b);
                    }
                    tracing::warn!(
                        ordinal = self.ordinal,
                        "no device memory for {} staging buffers ({len} bytes each): {}; using \
                         direct copies",
                        self.streams.len(),
                        e.0
                    );
                    self.staging_failed = true;
                    return false;
                }
            }
        }
        self.staging = Some(bufs);
        true
    }

    fn direct(&mut self, ops: &[CopyOp]) -> Result<usize, CudaError> {
        let mut merged = merge_ops(ops);
        if let Some(p) = &self.pins {
            // A transfer must stay inside one registration: split at pinned-range starts.
            let mut split = Vec::with_capacity(merged.len());
            split_at_boundaries(&merged, &p.boundaries(), &mut split);
            merged = split;
        }
        for (i, op) in merged.iter().enumerate() {
            let s = self.streams[i % self.streams.len()];
            // SAFETY: the engine keeps the device mapping and the host buffer alive and
            // validated until this batch completes; run() synchronises before answering.
            let r = unsafe {
                match self.dir {
                    Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(
                        op.host_addr as *mut c_void,
                        op.device_addr,
                        op.len,
                        s,
                    ),
                    Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(
                        op.device_addr,
                        op.host_addr as *const c_void,
                        op.len,
                        s,
                    ),
                }
            };
            check(r, "cuMemcpyAsync")?;
            self.note_enqueued(op.len as u64, i % self.streams.len());
        }
        Ok(merged.len())
    }

    /// Copies `descs` into the device descriptor buffer (through a pinned host buffer), on
    /// stream 0; every other stream waits for it.
    fn upload(&mut self, descs: &[Desc]) -> Result<u64, CudaError> {
        let bytes = std::mem::size_of_val(descs);
        if self.desc_host.1 < bytes {
            if !self.desc_host.0.is_null() {
                // SAFETY: allocated by cuMemAllocHost below; the last batch using it synced.
                let _ = unsafe { sys::cuMemFreeHost(self.desc_host.0) };
                self.desc_host = (std::ptr::null_mut(), 0);
            }
            let cap = bytes.next_power_of_two().max(64 << 10);
            let mut p: *mut c_void = std::ptr::null_mut();
            check(
                // SAFETY: out-pointer to a live local; the context is current.
                unsafe { sys::cuMemAllocHost_v2(&mut p, cap) },
                "cuMemAllocHost",
            )?;
            self.desc_host = (p, cap);
        }
        if self.desc_dev.as_ref().is_none_or(|d| d.len < bytes) {
            if let Some(d) = self.desc_dev.take() {
                dev_free(&d);
            }
            self.desc_dev = Some(dev_alloc(bytes.next_power_of_two().max(64 << 10))?);
        }
        let dev = self.desc_dev.as_ref().map(|d| d.ptr).unwrap_or(0);
        // SAFETY: desc_host holds at least `bytes` bytes and no copy reads it (last batch
        // synced); Desc is plain old data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                descs.as_ptr().cast::<u8>(),
                self.desc_host.0.cast::<u8>(),
                bytes,
            )
        };
        check(
            // SAFETY: both buffers hold `bytes` bytes; stream 0 orders the later launches.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dev, self.desc_host.0, bytes, self.streams[0]) },
            "cuMemcpyHtoDAsync (descriptors)",
        )?;
        check(
            // SAFETY: event and streams of this context.
            unsafe { sys::cuEventRecord(self.uploaded, self.streams[0]) },
            "cuEventRecord",
        )?;
        for s in &self.streams[1..] {
            check(
                // SAFETY: as above.
                unsafe { sys::cuStreamWaitEvent(*s, self.uploaded, 0) },
                "cuStreamWaitEvent",
            )?;
        }
        Ok(dev)
    }

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

    /// The staged path, streamed: ops are taken in host-address order ([`HostOrder`]) and
    /// each staging chunk is issued (kernel and pinned copies on stream `i % buffers`) as soon
    /// as the planner closes it, so the copy engine starts after the first chunk is planned
    /// rather than after the whole batch. Returns the submissions enqueued.
    /// The staged path: `first`, then every part of `parts`, planned into one run of
    /// staging chunks, each chunk issued as soon as it is closed. Ops are taken in host order
    /// within each part.
    fn staged(
        &mut self,
        first: &[CopyOp],
        parts: &mut Option<&mut OpParts>,
        tally: &mut Tally,
        overlapped: bool,
    ) -> Result<usize, CudaError> {
        let boundaries = self
            .pins
            .as_ref()
            .map(|p| p.boundaries())
            .unwrap_or_default();
        let bases: Vec<u64> = match &self.staging {
            Some(bufs) => bufs.iter().map(|b| b.ptr).collect(),
            None => return Err(CudaError("no staging buffers".into())),
        };
        if !overlapped {
            self.desc_pages.reset()?;
        } else if self.desc_pages.page_count() <= 1 && self.gathers_done() {
            // Started behind the running batch, whose gathers are done: no kernel reads the
            // page any more, so this batch's descriptors go from its start. (Several pages
            // are folded only after an end: freeing pinned memory may wait for the device.)
            self.desc_pages.rewind();
        }
        // Reused buffers: steady-state planning allocates nothing.
        let mut plan = std::mem::take(&mut self.plan);
        let mut order = std::mem::take(&mut self.order);
        plan.begin_ramped(self.cfg.first_chunk_bytes);
        let mut run = StagedRun {
            boundaries: &boundaries,
            bases: &bases,
            issued: 0,
            submissions: 0,
        };
        let mut r = self.stage_ops(&mut plan, &mut order, &mut run, first);
        while r.is_ok() {
            match next_part(parts, tally) {
                Ok(Some(ops)) => r = self.stage_ops(&mut plan, &mut order, &mut run, &ops),
                Ok(None) => break,
                Err(e) => r = Err(e),
            }
        }
        if r.is_ok() {
            plan.finish();
            r = self.issue_closed(&plan, &mut run);
        }
        if r.is_ok() && self.signals.source_read.is_some() && !self.gather.is_null() {
            // After the last gather: every byte of the batch's device memory has been read.
            // Without the mark, the answer waits for the batch's end.
            self.read_recorded = record(self.read_event, self.gather).is_ok();
        }
        self.plan = plan;
        self.order = order;
        r.map(|()| run.submissions)
    }

    /// Places `ops` (in host order) into `plan` and issues every chunk that closes.
    fn stage_ops(
        &mut self,
        plan: &mut StagedPlan,
        order: &mut Vec<usize>,
        run: &mut StagedRun<'_>,
        ops: &[CopyOp],
    ) -> Result<(), CudaError> {
        let chunk = self.cfg.staging_chunk;
        for i in HostOrder::new(ops, order) {
            plan.push(&ops[i], chunk, run.boundaries);
            self.issue_closed(plan, run)?;
        }
        Ok(())
    }

    /// Issues the closed chunks of `plan` not issued yet.
    fn issue_closed(
        &mut self,
        plan: &StagedPlan,
        run: &mut StagedRun<'_>,
    ) -> Result<(), CudaError> {
        while run.issued < plan.chunks.len() {
            let i = run.issued;
            run.issued += 1;
            run.submissions += self.issue_chunk(plan, i, run.bases)?;
        }
        Ok(())
    }

    /// Enqueues closed chunk `i` of `plan`: its descriptors into the descriptor pages, then
    /// on stream `i % buffers` the gather kernel and the pinned copies (to the host) or the
    /// pinned copies and the scatter kernel (to the device).
    fn issue_chunk(
        &mut self,
        plan: &StagedPlan,
        i: usize,
        bases: &[u64],
    ) -> Result<usize, CudaError> {
        let c = &plan.chunks[i];
        let s = self.streams[i % self.streams.len()];
        let ring = self.dir == Direction::ToHost && !self.gather.is_null();
        let base = if ring {
            self.ring_place(c.used, bases)?
        } else {
            bases[i % bases.len()]
        };
        let mut descs = std::mem::take(&mut self.descs);
        descs.clear();
        for p in &plan.pieces[c.pieces.clone()] {
            match self.dir {
                Direction::ToHost => {
                    push_descs(&mut descs, p.device_addr, base + p.staging_off, p.len)
                }
                Direction::ToDevice => {
                    push_descs(&mut descs, base + p.staging_off, p.device_addr, p.len)
                }
            }
        }
        let dev = self.desc_pages.stage(&descs);
        let count = descs.len();
        self.descs = descs;
        let dev = dev?;
        if ring {
            // The gather on its own stream, then this chunk's copies after it.
            self.launch(dev, 0, count, self.gather)?;
            let gathered = self.ring_event()?;
            record(gathered, self.gather)?;
            check(
                // SAFETY: stream and event of this worker's context (current on its thread).
                unsafe { sys::cuStreamWaitEvent(s, gathered, 0) },
                "cuStreamWaitEvent",
            )?;
            // The wait is enqueued: recording the event again cannot change it.
            self.ring_free.push(gathered);
        } else if self.dir == Direction::ToHost {
            self.launch(dev, 0, count, s)?;
        }
        for hc in &plan.host_copies[c.host_copies.clone()] {
            // SAFETY: the staging buffer holds `staging_off + len` bytes (plan bound); the
            // host range lies in a live buffer; the stream orders this after the gather
            // (ToHost) or before the scatter (ToDevice), and before the buffer's next use.
            let r = unsafe {
                match self.dir {
                    Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(
                        hc.host_addr as *mut c_void,
                        base + hc.staging_off,
                        hc.len,
                        s,
                    ),
                    Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(
                        base + hc.staging_off,
                        hc.host_addr as *const c_void,
                        hc.len,
                        s,
                    ),
                }
            };
            check(r, "cuMemcpyAsync (staging)")?;
            // Per copy, so that a stream's last mark can fall inside its last chunk.
            self.note_enqueued(hc.len as u64, i % self.streams.len());
        }
        if self.dir == Direction::ToDevice {
            self.launch(dev, 0, count, s)?;
        }
        if ring {
            // The staging memory is free again once these copies are done.
            let copied = self.ring_event()?;
            record(copied, s)?;
            let (b, end) = self.ring_at;
            self.ring
                .push_back((b, end - round_up(c.used), end, copied));
        }
        Ok(c.host_copies.len() + 1)
    }

    /// Where in the staging buffers the next chunk of a device → host batch goes (`used`
    /// bytes): after the previous one in the same buffer, or at the start of the next buffer
    /// when it does not fit. Makes the gather stream wait for the pinned copies still reading
    /// that memory. Returns its device address.
    fn ring_place(&mut self, used: u64, bases: &[u64]) -> Result<u64, CudaError> {
        let len = round_up(used);
        let (mut b, mut off) = self.ring_at;
        if off + len > self.cfg.staging_chunk && off > 0 {
            (b, off) = ((b + 1) % bases.len(), 0);
        }
        let end = off + len;
        // Chunks are placed in order around the ring, so what overlaps is the oldest; once
        // the in-order gather stream waits for one copy, every later gather is after it too.
        let mut i = 0;
        while i < self.ring.len() {
            let (rb, ro, re, ev) = self.ring[i];
            if rb == b && ro < end && off < re {
                check(
                    // SAFETY: stream and event of this worker's context (current on its thread).
                    unsafe { sys::cuStreamWaitEvent(self.gather, ev, 0) },
                    "cuStreamWaitEvent",
                )?;
                self.ring.remove(i);
                self.ring_free.push(ev);
            } else {
                i += 1;
            }
        }
        self.ring_at = (b, end);
        Ok(bases[b] + off)
    }

    /// A free event for the ring or a gather (made when none is free: the ring holds as many
    /// as there are chunks whose copies no gather has waited for yet).
    fn ring_event(&mut self) -> Result<sys::CUevent, CudaError> {
        if let Some(e) = self.ring_free.pop() {
            return Ok(e);
        }
        let e = new_event(false)?;
        self.ring_events.push(e);
        Ok(e)
    }

    /// The device pointer of pinned chunk `i` in this worker's context (looked up once).
    fn mapped_base(&mut self, i: usize) -> Result<u64, CudaError> {
        if let Some(b) = self.mapped[i] {
            return Ok(b);
        }
        let p = self
            .pins
            .as_ref()
            .ok_or_else(|| CudaError("nothing pinned".into()))?;
        let c = &p.chunks()[i];
        let mut d: sys::CUdeviceptr = 0;
        check(
            // SAFETY: out-pointer to a live local; the chunk is registered with DEVICEMAP.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, c.addr as *mut c_void, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        self.mapped[i] = Some(d);
        Ok(d)
    }

    fn mapped_copy(&mut self, ops: &[CopyOp]) -> Result<usize, CudaError> {
        let pins = self
            .pins
            .clone()
            .ok_or_else(|| CudaError("nothing pinned".into()))?;
        let mut descs = Vec::new();
        for o in ops.iter().filter(|o| o.len > 0) {
            // Split at pinned-chunk boundaries: each part has its own mapped base.
            let mut done = 0usize;
            while done < o.len {
                let h = o.host_addr + done;
                let i = pins
                    .find(h, 1)
                    .ok_or_else(|| CudaError(format!("host address {h:#x} is not pinned")))?;
                let c = &pins.chunks()[i];
                let n = (o.len - done).min(c.addr + c.len - h);
                let mh = self.mapped_base(i)? + (h - c.addr) as u64;
                let d = o.device_addr + done as u64;
                match self.dir {
                    Direction::ToHost => push_descs(&mut descs, d, mh, n as u64),
                    Direction::ToDevice => push_descs(&mut descs, mh, d, n as u64),
                }
                done += n;
            }
        }
        let r = self
            .upload(&descs)
            .and_then(|dev| self.launch(dev, 0, descs.len(), self.streams[0]));
        self.descs = descs;
        r.map(|()| 1)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Whatever is still enqueued (a worker whose start failed midway has nothing).
        self.sync_everything();
        // SAFETY: everything below was created by this worker in its context (current on this
        // thread) and nothing is in flight after sync_everything().
        unsafe {
            if let Some(s) = self.staging.take() {
                for b in &s {
                    dev_free(b);
                }
            }
            if let Some(d) = self.desc_dev.take() {
                dev_free(&d);
            }
            if !self.desc_host.0.is_null() {
                let _ = sys::cuMemFreeHost(self.desc_host.0);
            }
            self.desc_pages.free_all();
            for e in self
                .done
                .iter()
                .chain(&self.polled)
                .chain(&self.mark_events)
                .chain(&self.mark_spare)
                .chain(&self.ring_events)
                .chain([&self.uploaded, &self.read_event, &self.gather_done])
                .filter(|e| !e.is_null())
            {
                let _ = sys::cuEventDestroy_v2(*e);
            }
            for s in self.streams.iter().chain([&self.gather]) {
                if !s.is_null() {
                    let _ = sys::cuStreamDestroy_v2(*s);
                }
            }
        }
    }
}

/// `n` rounded up to [`STAGING_ALIGN`]: where the next staging chunk may start, so that its
/// offsets keep their alignment.
fn round_up(n: u64) -> u64 {
    n.div_ceil(STAGING_ALIGN) * STAGING_ALIGN
}
