//! One batch through a worker: [`Worker::start`] takes a job and enqueues its batch
//! ([`Worker::enqueue`]: the path, chosen by [`Worker::choose`], then every part as it arrives),
//! and [`Worker::finish`] waits for its end, logs it (the `copy batch` debug line) and answers.
//!
//! Owns: the batch's tally and report, and the catch of a panic while enqueueing or waiting.
//! Must never: answer before the batch's work ended (whatever failed, what was enqueued is
//! waited for first), or leave a caller waiting on a batch's near end that will never come
//! (its signals are dropped after the answer).

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use pegaflow_api::TransferMode;
use pegaflow_plugin::{CopyBatch, CopyOp, OpParts, TransportError};
use tokio::sync::{mpsc, oneshot};

use super::{Job, Worker};
use crate::driver::CudaError;
use crate::plan::merged_stats;
use crate::transport::config::{KernelPath, Policy, MAX_STREAMS};
use crate::transport::report::{CopyPath, CopyReport};

/// What a batch's ops came to, over its parts (for the debug line and the report).
#[derive(Default)]
pub(super) struct Tally {
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
pub(super) fn next_part(
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

/// A batch whose ops the worker has enqueued ([`Worker::start`]) and whose end it has not
/// waited for yet ([`Worker::finish`]).
pub(super) struct Started {
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

impl Worker {
    /// Enqueues `job`'s batch ([`Worker::enqueue`]), catching a panic (what was enqueued is
    /// still waited for by [`Worker::finish`]). `overlapped`: the previous batch is still in
    /// flight.
    pub(super) fn start(&mut self, job: Job, overlapped: bool) -> Started {
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
        (self.marks.enqueued, self.marks.since_mark) = ([0; MAX_STREAMS], [0; MAX_STREAMS]);
        self.marks.placed.clear();
        if overlapped {
            // The running batch may still sleep on a mark of its set: record ours in the other.
            std::mem::swap(&mut self.marks.events, &mut self.marks.spare);
        } else {
            // Every earlier batch ended: no staging memory is being copied out.
            self.gathers.done_recorded = false;
            let free = self.staging.ring.drain(..).map(|(.., ev)| ev);
            self.staging.ring_free.extend(free);
            self.staging.ring_at = (0, 0);
        }
        self.gathers.read_recorded = false;
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
    pub(super) fn finish(&mut self, s: Started, rx: &mut mpsc::Receiver<Job>) {
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
            slept_us = self.marks.slept.as_micros() as u64,
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
}
