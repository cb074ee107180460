//! The staged path: a gather (device → host) or scatter (host → device) kernel between the
//! batch's device ranges and contiguous device staging buffers, and one large pinned copy per
//! host run, chunk by chunk as the planner closes them ([`crate::plan::StagedPlan`]).
//!
//! Device → host, every gather runs on a stream of its own ([`GatherStream`]) so that it
//! never waits behind an earlier chunk's pinned copy; chunks are placed one after the other
//! through the staging buffers, wrapping around ([`Staging`]'s ring), and a gather into memory
//! still being copied out waits for that copy. Host → device, chunk `i` uses buffer and stream
//! `i % staging_buffers`.
//!
//! Owns: the staging buffers, the ring and its events, the gather stream and its events, and
//! the planner's reused buffers. Must never: gather into staging memory whose pinned copy may
//! still read it, issue a pinned copy before its chunk's gather (or a scatter before its
//! copy), or let one copy cross a pinned registration's start. It is pageable-safe: host
//! memory that is not pinned yet is copied by the driver's staging.

use std::collections::VecDeque;
use std::ffi::c_void;

use cudarc::driver::sys;
use pegaflow_plugin::{CopyOp, Direction, OpParts};

use super::batch::{next_part, Tally};
use super::Worker;
use crate::driver::{check, CudaError};
use crate::plan::{push_descs, Desc, HostOrder, StagedPlan, STAGING_ALIGN};
use crate::transport::events::{new_event, record};
use crate::transport::kernel::{dev_alloc, dev_free, DevBuf};

/// The staging buffers and, device → host, the ring of chunks placed through them.
pub(super) struct Staging {
    /// One staging buffer per stream (none: not allocated yet, or `failed`).
    pub(super) bufs: Option<Vec<DevBuf>>,
    /// The allocation failed once: batches take the direct path.
    pub(super) failed: bool,
    /// The staged device → host chunks whose pinned copies may still read their staging
    /// memory: (buffer, offset, end, the event after the copies), oldest first. Chunks are
    /// placed one after the other through the buffers, wrapping around, across batches while
    /// they overlap ([`Worker::ahead`]); cleared when a batch starts after the previous ones
    /// ended.
    pub(super) ring: VecDeque<(usize, u64, u64, sys::CUevent)>,
    /// Where the next chunk goes: (buffer, offset).
    pub(super) ring_at: (usize, u64),
    /// Every event made for `ring` and the gathers (destroyed with the worker), and those of
    /// them free: an event goes back once a stream's wait on it is enqueued (a later record
    /// does not change what that wait waits for) or its ring entry is dropped.
    pub(super) ring_events: Vec<sys::CUevent>,
    pub(super) ring_free: Vec<sys::CUevent>,
}

impl Staging {
    /// No buffers yet ([`Worker::ensure_staging`] allocates them).
    pub(super) const fn new() -> Self {
        Self {
            bufs: None,
            failed: false,
            ring: VecDeque::new(),
            ring_at: (0, 0),
            ring_events: Vec::new(),
            ring_free: Vec::new(),
        }
    }
}

/// Device → host workers with the copy kernel: the stream every gather kernel of a staged
/// batch runs on, and its events (all null otherwise). Chunk `i`'s pinned copies run on
/// `streams[i % len]` after its gather (an event), and a gather into staging memory still
/// being copied out waits for that copy ([`Staging`]'s ring).
pub(super) struct GatherStream {
    pub(super) stream: sys::CUstream,
    /// Recorded on `stream` after a batch's last gather, when the batch has a source-read
    /// listener; polled then slept on (`CU_EVENT_BLOCKING_SYNC`) by [`Worker::sync`].
    pub(super) read_event: sys::CUevent,
    pub(super) read_recorded: bool,
    /// Recorded on `stream` with the streams' ends in [`Worker::sync`], to see the gathers'
    /// errors without waiting for a later batch's gathers, and to tell when the running
    /// batch's gathers are done ([`Worker::gathers_done`]).
    pub(super) done: sys::CUevent,
    /// `done` is recorded after the running batch's last gather (set in [`Worker::sync`]
    /// before it polls, false when that record failed; cleared when a batch starts after the
    /// previous end).
    pub(super) done_recorded: bool,
}

impl GatherStream {
    /// No gather stream (made by [`Worker::new`] for a device → host worker with the kernel).
    pub(super) const NONE: Self = Self {
        stream: std::ptr::null_mut(),
        read_event: std::ptr::null_mut(),
        read_recorded: false,
        done: std::ptr::null_mut(),
        done_recorded: false,
    };
}

/// Buffers a batch's planning reuses, so that steady-state planning allocates nothing.
#[derive(Default)]
pub(super) struct PlanScratch {
    pub(super) plan: StagedPlan,
    /// A chunk's descriptors (also the mapped path's, kept for their capacity).
    pub(super) descs: Vec<Desc>,
    /// Scratch of the host-order sort fallback.
    pub(super) order: Vec<usize>,
}

/// A staged run's progress across the parts of one batch.
struct StagedRun<'a> {
    boundaries: &'a [usize],
    bases: &'a [u64],
    /// Chunks of the plan issued so far.
    issued: usize,
    submissions: usize,
}

impl Worker {
    /// Allocates the staging buffers (one of `staging_chunk` bytes per stream) unless they
    /// exist; true when they do. A failure is logged once, and the batches take the direct
    /// path from then on.
    pub(super) fn ensure_staging(&mut self) -> bool {
        if self.staging.bufs.is_some() {
            return true;
        }
        if self.staging.failed {
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
                    self.staging.failed = true;
                    return false;
                }
            }
        }
        self.staging.bufs = Some(bufs);
        true
    }

    /// The staged path, streamed: `first`, then every part of `parts`, planned into one run of
    /// staging chunks, ops taken in host-address order ([`HostOrder`]) within each part; each
    /// chunk is issued (kernel and pinned copies on stream `i % buffers`) as soon as the
    /// planner closes it, so the copy engine starts after the first chunk is planned rather
    /// than after the whole batch. Returns the submissions enqueued.
    pub(super) fn staged(
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
        let bases: Vec<u64> = match &self.staging.bufs {
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
        let mut plan = std::mem::take(&mut self.scratch.plan);
        let mut order = std::mem::take(&mut self.scratch.order);
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
        if r.is_ok() && self.signals.source_read.is_some() && !self.gathers.stream.is_null() {
            // After the last gather: every byte of the batch's device memory has been read.
            // Without the mark, the answer waits for the batch's end.
            self.gathers.read_recorded =
                record(self.gathers.read_event, self.gathers.stream).is_ok();
        }
        self.scratch.plan = plan;
        self.scratch.order = order;
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
        let ring = self.dir == Direction::ToHost && !self.gathers.stream.is_null();
        let base = if ring {
            self.ring_place(c.used, bases)?
        } else {
            bases[i % bases.len()]
        };
        let mut descs = std::mem::take(&mut self.scratch.descs);
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
        self.scratch.descs = descs;
        let dev = dev?;
        if ring {
            // The gather on its own stream, then this chunk's copies after it.
            self.launch(dev, 0, count, self.gathers.stream)?;
            let gathered = self.ring_event()?;
            record(gathered, self.gathers.stream)?;
            check(
                // SAFETY: stream and event of this worker's context (current on its thread).
                unsafe { sys::cuStreamWaitEvent(s, gathered, 0) },
                "cuStreamWaitEvent",
            )?;
            // The wait is enqueued: recording the event again cannot change it.
            self.staging.ring_free.push(gathered);
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
            let (b, end) = self.staging.ring_at;
            self.staging
                .ring
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
        let (mut b, mut off) = self.staging.ring_at;
        if off + len > self.cfg.staging_chunk && off > 0 {
            (b, off) = ((b + 1) % bases.len(), 0);
        }
        let end = off + len;
        // Chunks are placed in order around the ring, so what overlaps is the oldest; once
        // the in-order gather stream waits for one copy, every later gather is after it too.
        let mut i = 0;
        while i < self.staging.ring.len() {
            let (rb, ro, re, ev) = self.staging.ring[i];
            if rb == b && ro < end && off < re {
                check(
                    // SAFETY: stream and event of this worker's context (current on its thread).
                    unsafe { sys::cuStreamWaitEvent(self.gathers.stream, ev, 0) },
                    "cuStreamWaitEvent",
                )?;
                self.staging.ring.remove(i);
                self.staging.ring_free.push(ev);
            } else {
                i += 1;
            }
        }
        self.staging.ring_at = (b, end);
        Ok(bases[b] + off)
    }

    /// A free event for the ring or a gather (made when none is free: the ring holds as many
    /// as there are chunks whose copies no gather has waited for yet).
    fn ring_event(&mut self) -> Result<sys::CUevent, CudaError> {
        if let Some(e) = self.staging.ring_free.pop() {
            return Ok(e);
        }
        let e = new_event(false)?;
        self.staging.ring_events.push(e);
        Ok(e)
    }
}

/// `n` rounded up to [`STAGING_ALIGN`]: where the next staging chunk may start, so that its
/// offsets keep their alignment.
fn round_up(n: u64) -> u64 {
    n.div_ceil(STAGING_ALIGN) * STAGING_ALIGN
}
