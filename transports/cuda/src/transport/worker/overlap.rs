//! Starting a device → host batch behind the running one (the `overlap` setting): while the
//! worker waits for a batch's end, a batch already queued, or one that arrives while it polls,
//! is enqueued at once ([`Worker::start_ahead`], kept in [`Worker::ahead`]), sharing the
//! staging ring and the descriptor page with it, so the copy engine goes from one Save to the
//! next with no gap.
//!
//! Owns: the decision whether a batch may start ahead. Must never: start one ahead of a batch
//! whose end events were not all recorded (its wait would then synchronise whole streams and
//! take in the new batch's work), start more than one ahead, start one under `kernel_path =
//! "mapped"` or host → device, or let it rewrite descriptors the running batch's kernels may
//! still read.

use pegaflow_plugin::Direction;
use tokio::sync::mpsc;

use super::{Job, Worker};
use crate::transport::config::KernelPath;
use crate::transport::events::event_done;

impl Worker {
    /// Starts the batch queued on `rx`, if any, behind the running one, when none was started
    /// ahead yet, every end of the running batch was recorded (`StreamEnds::recorded`:
    /// otherwise its wait falls back to synchronising whole streams, which would take in the
    /// new batch's work) and [`Worker::can_overlap`] allows (one at a time).
    pub(super) fn start_ahead(&mut self, rx: &mut mpsc::Receiver<Job>) {
        // The queue first: `can_overlap` may query an event, once per poll otherwise.
        if self.ahead.is_none() && self.ends.recorded && !rx.is_empty() && self.can_overlap() {
            if let Ok(job) = rx.try_recv() {
                let started = self.start(job, true);
                self.ahead = Some(started);
            }
        }
    }

    /// Whether this worker's batches can ever start behind one another: `overlap` on, device
    /// → host, and not under `kernel_path = "mapped"` (whose one descriptor buffer each batch
    /// rewrites).
    pub(super) fn may_overlap(&self) -> bool {
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

    /// Whether every gather kernel of the running batch has completed (`GatherStream::done`,
    /// recorded after them on the gather stream, has fired): its descriptors are read by
    /// nothing any more. False without a gather stream or before [`Worker::sync`] recorded the event.
    pub(super) fn gathers_done(&self) -> bool {
        self.gathers.done_recorded
            && !self.gathers.stream.is_null()
            && event_done(self.gathers.done)
    }
}
