//! How a copy worker waits for the end of a batch ([`Worker::sync`]), as `wait` says
//! ([`Wait`]): the end events of each stream ([`StreamEnds`]), the marks [`Wait::Tail`] records
//! on the way and sleeps on ([`TailMarks`]), polling the end, and firing the source-read
//! listener after the last gather.
//!
//! Owns: recording and waiting on the running batch's end events. Must never: report a batch
//! done before every stream's own work for it ended (a failed record or wait falls back to
//! synchronising the whole stream), re-record a mark event the running batch may still sleep
//! on (a batch started ahead marks in the other set), or poll a stream's end past its limit
//! unless `wait = "spin"`.

use std::time::Duration;

use cudarc::driver::sys;
use tokio::sync::mpsc;

use super::{Job, Worker};
use crate::driver::{check, CudaError};
use crate::transport::config::{Wait, MAX_STREAMS, POLL_LIMIT};
use crate::transport::events::{
    event_done, new_event, poll_event, poll_event_with, record, wait_event,
};

/// The end events of each copy stream, recorded by [`Worker::sync`] after the running batch's
/// work.
pub(super) struct StreamEnds {
    /// One event per stream (`CU_EVENT_BLOCKING_SYNC`), slept on.
    pub(super) done: Vec<sys::CUevent>,
    /// One event per stream made without `CU_EVENT_BLOCKING_SYNC`, polled by [`Wait::Tail`]
    /// and [`Wait::Spin`].
    pub(super) polled: Vec<sys::CUevent>,
    /// Whether [`Worker::sync`] recorded every end of the running batch (each stream's and
    /// the gather stream's), so that a batch may start behind it ([`Worker::start_ahead`]).
    pub(super) recorded: bool,
}

impl StreamEnds {
    /// No events yet, room for `n` streams'.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            done: Vec::with_capacity(n),
            polled: Vec::with_capacity(n),
            recorded: false,
        }
    }
}

/// [`Wait::Tail`]'s marks: events recorded on a stream each time `mark_bytes` more were
/// enqueued on it, so that the worker sleeps until every stream is in its tail.
pub(super) struct TailMarks {
    /// The running batch's marks: (stream, bytes enqueued on that stream up to the mark, index
    /// in `events`), in enqueue order.
    pub(super) placed: Vec<(usize, u64, usize)>,
    /// Events (`CU_EVENT_BLOCKING_SYNC`) for the marks, created as batches need them and
    /// reused by later batches (re-recording an event after its batch synchronised is safe).
    pub(super) events: Vec<sys::CUevent>,
    /// The other set of mark events: a batch started behind the running one swaps the two
    /// sets, so that its marks never re-record the event the running batch sleeps on.
    pub(super) spare: Vec<sys::CUevent>,
    /// Bytes the running batch enqueued on each stream, and since that stream's last mark.
    pub(super) enqueued: [u64; MAX_STREAMS],
    pub(super) since_mark: [u64; MAX_STREAMS],
    /// How long the last [`Worker::sync`] slept on marks (for the batch's debug line).
    pub(super) slept: Duration,
}

impl TailMarks {
    /// No marks, no events yet.
    pub(super) const fn new() -> Self {
        Self {
            placed: Vec::new(),
            events: Vec::new(),
            spare: Vec::new(),
            enqueued: [0; MAX_STREAMS],
            since_mark: [0; MAX_STREAMS],
            slept: Duration::ZERO,
        }
    }
}

impl Worker {
    /// Notes `bytes` more enqueued on stream `k`; under [`Wait::Tail`] records a mark on it
    /// once `mark_bytes` accumulated on it since its last one. A mark is only an
    /// optimisation: one that cannot be made is skipped (and logged).
    pub(super) fn note_enqueued(&mut self, bytes: u64, k: usize) {
        self.marks.enqueued[k] += bytes;
        self.marks.since_mark[k] += bytes;
        if self.cfg.wait != Wait::Tail || self.marks.since_mark[k] < self.cfg.mark_bytes {
            return;
        }
        self.marks.since_mark[k] = 0;
        let m = self.marks.placed.len();
        if m == self.marks.events.len() {
            match new_event(true) {
                Ok(e) => self.marks.events.push(e),
                Err(e) => {
                    tracing::debug!(ordinal = self.ordinal, "no wait mark: {}", e.0);
                    return;
                }
            }
        }
        match record(self.marks.events[m], self.streams[k]) {
            Ok(()) => self.marks.placed.push((k, self.marks.enqueued[k], m)),
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
    pub(super) fn sync(&mut self, rx: &mut mpsc::Receiver<Job>) -> Result<(), CudaError> {
        self.marks.slept = Duration::ZERO;
        self.ends.recorded = false;
        // The batch's device memory is read long before its end: tell the listener first
        // (before a batch started ahead records the read event again).
        self.fire_source_read();
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
                for &(k, at, m) in self.marks.placed.iter() {
                    if at + tail <= self.marks.enqueued[k] {
                        sleep_on[k] = Some(self.marks.events[m]);
                    }
                }
                Some(POLL_LIMIT)
            }
        };
        self.marks.placed.clear();
        // Every stream's end first: a batch started ahead goes after these records.
        let mut recorded = [false; MAX_STREAMS];
        for (k, rec) in recorded.iter_mut().enumerate().take(n) {
            let (polled, done, stream) = (self.ends.polled[k], self.ends.done[k], self.streams[k]);
            *rec =
                (poll.is_none() || record(polled, stream).is_ok()) && record(done, stream).is_ok();
        }
        let gather_recorded = !self.gathers.stream.is_null()
            && record(self.gathers.done, self.gathers.stream).is_ok();
        self.gathers.done_recorded = gather_recorded;
        self.ends.recorded = recorded.iter().take(n).all(|&r| r)
            && (self.gathers.stream.is_null() || gather_recorded);
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
        self.marks.slept = slept.elapsed();
        if poll.is_some() {
            // The caller starts polling for the answer too (`CudaTransport::submit`).
            if let Some(tx) = near_end {
                let _ = tx.send(());
            }
        }
        let mut first = Ok(());
        for (k, &rec) in recorded.iter().enumerate().take(n) {
            let (polled, done) = (self.ends.polled[k], self.ends.done[k]);
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
        if !self.gathers.stream.is_null() {
            // Done by now (every copy waited for its gather); checked for its errors.
            let r = if gather_recorded {
                wait_event(self.gathers.done)
            } else {
                // SAFETY: a stream of this worker's context (current).
                check(
                    unsafe { sys::cuStreamSynchronize(self.gathers.stream) },
                    "cuStreamSynchronize",
                )
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Fires the running batch's source-read listener once its last gather has completed
    /// (`read_event`, recorded after it on the gather stream by [`Worker::staged`]): slept on
    /// under [`Wait::Sleep`], otherwise polled for up to [`POLL_LIMIT`] and then slept on. No
    /// listener, no recorded event, or a failed wait: nothing fires (the caller then answers
    /// at the batch's end).
    fn fire_source_read(&mut self) {
        if let Some(read) = self.signals.source_read.take() {
            if std::mem::take(&mut self.gathers.read_recorded) {
                let done = if self.cfg.wait == Wait::Sleep {
                    wait_event(self.gathers.read_event).is_ok()
                } else {
                    match poll_event(self.gathers.read_event, POLL_LIMIT) {
                        Ok(true) => true,
                        Ok(false) => wait_event(self.gathers.read_event).is_ok(),
                        Err(_) => false,
                    }
                };
                if done {
                    read.fire();
                }
            }
        }
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

    /// Whether any of the first `n` streams' polled end (recorded by [`Worker::sync`]) has not
    /// fired yet: the running batch still copies. A failed query counts as still copying.
    fn copying(&self, n: usize) -> bool {
        self.ends.polled.iter().take(n).any(|&ev| !event_done(ev))
    }

    /// Waits for all work on every stream of the worker, whatever batch it belongs to: the
    /// fallback after a panic, and at drop.
    pub(super) fn sync_everything(&mut self) {
        for s in self.streams.iter().chain([&self.gathers.stream]) {
            if !s.is_null() {
                // SAFETY: a stream of this worker's context (current on its thread).
                let _ = unsafe { sys::cuStreamSynchronize(*s) };
            }
        }
    }
}
