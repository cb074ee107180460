//! Each path's standing: I/O errors in a row (which take a path out of service), failed
//! writes in a row (which make `/health` say the path cannot write), room for more segment
//! files, and the `/health` line and gauges that show them. Also the watch thread that checks
//! every few seconds that each path still names the store this process locked.
//!
//! Must never: take a path out of service for a full filesystem (ENOSPC forgets nothing: the
//! blocks written stay good), let a repeated failure log more than one line per
//! [`crate::ratelog::EVERY`] per path, or run `stat`/`statvfs` on the async executor.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use parking_lot::Mutex;
use pegaflow_plugin::health::HealthState;

use super::{Inner, SegMeta, SegState, State};
use crate::ratelog::{LogLimit, EVERY};

/// How often the watch thread checks the paths.
const WATCH_EVERY: Duration = Duration::from_secs(5);

/// What `/health` says about one path beyond its geometry.
#[derive(Debug, Default)]
struct Standing {
    /// Why the path left service, once it has.
    out_of_service: Option<String>,
    /// Why the path cannot write (failed writes in a row), while it cannot.
    cannot_write: Option<String>,
}

/// One path's standing and its log limits.
#[derive(Debug)]
pub(super) struct DirStatus {
    standing: Mutex<Standing>,
    /// I/O errors and failed writes.
    io_log: LogLimit,
}

impl Default for DirStatus {
    fn default() -> Self {
        Self {
            standing: Mutex::new(Standing::default()),
            io_log: LogLimit::new(EVERY),
        }
    }
}

/// Starts the watch thread of a tier (ends when the tier is dropped): returns the sender whose
/// drop stops it, or `None` when no thread could be started (logged; the checks then run only
/// when a segment is opened).
pub(super) fn start_watch(tier: Weak<Inner>) -> Option<std::sync::mpsc::Sender<()>> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let r = std::thread::Builder::new()
        .name("pegaflow-ssd-watch".into())
        .spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(WATCH_EVERY)
            {
                let Some(t) = tier.upgrade() else {
                    return;
                };
                t.check_paths();
            }
        });
    match r {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the SSD watch thread; paths are checked when segments open");
            None
        }
    }
}

impl Inner {
    /// Sets (replaces) path `d`'s `/health` line from its geometry and standing.
    pub(super) fn report_health(&self, d: usize) {
        let dir = &self.dirs[d];
        let mut detail = format!(
            "io={}; direct={}; align={} ({}); {} segments of {}",
            self.engine.name(),
            dir.direct,
            dir.align,
            dir.align_source,
            dir.slots,
            bytesize::ByteSize::b(dir.segment_size)
        );
        if let Some(cut) = &dir.start_cut {
            detail.push_str(&format!(
                "; capacity cut to {} of {} configured ({cut})",
                bytesize::ByteSize::b(u64::from(dir.slots) * dir.segment_size),
                bytesize::ByteSize::b(dir.configured_bytes)
            ));
        }
        if dir.no_room.load(Ordering::Relaxed) {
            detail.push_str(&format!(
                "; no room on the filesystem for more segment files: holding {} of {} segments",
                dir.files_held(),
                dir.slots
            ));
        }
        let s = self.status[d].standing.lock();
        let (state, detail) = match (&s.out_of_service, &s.cannot_write) {
            (Some(w), _) => (
                HealthState::Degraded,
                format!("out of service: {w}; {detail}"),
            ),
            (None, Some(w)) => (
                HealthState::Degraded,
                format!("cannot write: {w}; {detail}"),
            ),
            (None, None) => (HealthState::Ok, detail),
        };
        self.health
            .report(&format!("ssd {}", dir.path.display()), state, detail);
    }

    pub(super) fn update_gauges(&self) {
        let used = self.state.lock().used;
        self.metrics.used_bytes.set(used as i64);
        let cap: u64 = self
            .dirs
            .iter()
            .filter(|d| !d.degraded.load(Ordering::Relaxed))
            .map(|d| d.capacity())
            .sum();
        self.metrics.capacity_bytes.set(cap as i64);
        self.metrics.degraded_dirs.set(
            self.dirs
                .iter()
                .filter(|d| d.degraded.load(Ordering::Relaxed))
                .count() as i64,
        );
    }

    /// An I/O error on path `d` (`write`: a write, a preallocation, a segment header):
    /// counted (`pegaflow_ssd_io_errors_total{op,kind}`) and logged (WARN, at most one line
    /// per interval per path). Errors other than ENOSPC count toward `max_errors` in a row,
    /// which take the path out of service; failed writes of any kind count toward
    /// `max_errors` in a row, which make `/health` say the path cannot write until a write
    /// completes.
    pub(super) fn io_failed(&self, d: usize, op: &str, e: &io::Error, write: bool) {
        self.metrics.error(op, e);
        let dir = &self.dirs[d];
        let no_space = crate::device::is_no_space(e);
        let errors = if no_space {
            dir.errors.load(Ordering::Relaxed)
        } else {
            dir.errors.fetch_add(1, Ordering::Relaxed) + 1
        };
        let write_fails = if write {
            dir.write_fails.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            dir.write_fails.load(Ordering::Relaxed)
        };
        if let Some(held_back) = self.status[d].io_log.allow() {
            tracing::warn!(
                path = %dir.path.display(),
                op,
                error = %e,
                errors_in_a_row = errors,
                failed_writes_in_a_row = write_fails,
                lines_held_back = held_back,
                "SSD I/O error"
            );
        }
        let max = self.settings.max_errors;
        if write && write_fails >= max {
            let why = format!("{write_fails} writes failed in a row, the last: {op}: {e}");
            let first = {
                let mut s = self.status[d].standing.lock();
                let first = s.cannot_write.is_none();
                s.cannot_write = Some(why.clone());
                first
            };
            if first {
                tracing::warn!(path = %dir.path.display(), "SSD path cannot write: {why}");
            }
            self.report_health(d);
        }
        if !no_space && errors >= max {
            self.take_out_of_service(
                d,
                &format!("{errors} I/O errors in a row, the last: {op}: {e}"),
            );
        }
    }

    /// A write to path `d` completed: the error counts restart, and a path that could not
    /// write says it can again.
    pub(super) fn write_succeeded(&self, d: usize) {
        let dir = &self.dirs[d];
        dir.errors.store(0, Ordering::Relaxed);
        if dir.write_fails.swap(0, Ordering::Relaxed) == 0 {
            return;
        }
        let was = self.status[d].standing.lock().cannot_write.take();
        if was.is_some() {
            tracing::info!(path = %dir.path.display(), "SSD path writes again");
            self.report_health(d);
        }
    }

    /// A read from path `d` completed.
    pub(super) fn read_succeeded(&self, d: usize) {
        self.dirs[d].errors.store(0, Ordering::Relaxed);
    }

    /// Takes path `d` out of service (once): its blocks are forgotten, nothing more is
    /// written to or read from it, `/health` says why.
    pub(super) fn take_out_of_service(&self, d: usize, why: &str) {
        let dir = &self.dirs[d];
        if dir.degraded.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::error!(path = %dir.path.display(), "SSD path taken out of service: {why}");
        {
            let mut st = self.state.lock();
            let st = &mut *st;
            for (slot, m) in st.segs[d].iter_mut().enumerate() {
                if m.state == SegState::Free {
                    continue;
                }
                for k in m.keys.drain(..) {
                    if st
                        .index
                        .get(&k)
                        .is_some_and(|l| l.dir == d && l.slot == slot as u32)
                    {
                        st.index.remove(&k);
                    }
                }
                st.used -= m.bytes;
                *m = SegMeta::free();
                self.metrics
                    .segment_evictions
                    .with_label_values(&["degraded"])
                    .inc();
            }
        }
        self.status[d].standing.lock().out_of_service = Some(why.to_owned());
        self.report_health(d);
        self.update_gauges();
    }

    /// A read of segment `(d, slot)` of `generation` failed with an I/O error (a damaged or
    /// truncated file, a bad sector): that segment's records leave the index — a sealed
    /// segment is evicted and its file reopened on reuse, an open one keeps its slot until
    /// it is sealed — and the error counts against the path once per segment, so that one
    /// damaged segment never takes the whole path out of service.
    pub(super) fn read_failed(&self, d: usize, slot: u32, generation: u64, e: &io::Error) {
        let dropped =
            {
                let mut st = self.state.lock();
                let st: &mut State = &mut st;
                let m = &mut st.segs[d][slot as usize];
                if m.generation != generation || m.state == SegState::Free {
                    false
                } else if m.state == SegState::Sealed {
                    self.evict_segment(st, d, slot, "read_error");
                    self.dirs[d].forget_file(slot);
                    true
                } else {
                    for k in std::mem::take(&mut m.keys) {
                        if st.index.get(&k).is_some_and(|l| {
                            l.dir == d && l.slot == slot && l.generation == generation
                        }) {
                            st.index.remove(&k);
                        }
                    }
                    self.metrics
                        .segment_evictions
                        .with_label_values(&["read_error"])
                        .inc();
                    true
                }
            };
        if dropped {
            tracing::warn!(
                path = %self.dirs[d].path.display(),
                slot,
                error = %e,
                "SSD segment unreadable: its blocks are dropped, the rest of the path stays in service"
            );
            self.io_failed(d, "read", e, false);
            self.update_gauges();
        } else {
            self.metrics.error("read", e);
        }
    }

    /// Path `d` has no room for another segment file (free space − reserve): from now on it
    /// reuses the files it has. Logged (WARN) when that starts.
    pub(super) fn no_room(&self, d: usize, e: &io::Error) {
        let dir = &self.dirs[d];
        if !dir.no_room.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                path = %dir.path.display(),
                configured = %bytesize::ByteSize::b(dir.configured_bytes),
                effective = %bytesize::ByteSize::b(dir.capacity()),
                "SSD capacity held below the configured figure: {e}; the oldest segments are reused"
            );
            self.report_health(d);
            self.update_gauges();
        }
    }

    /// Path `d` created a segment file (or the watch thread found room): it may grow again.
    pub(super) fn room_again(&self, d: usize) {
        let dir = &self.dirs[d];
        if dir.no_room.swap(false, Ordering::Relaxed) {
            tracing::info!(path = %dir.path.display(), "SSD path has room for more segment files again");
            self.report_health(d);
            self.update_gauges();
        }
    }

    /// The watch thread's round (blocking: `stat`, `statvfs`).
    pub(super) fn check_paths(&self) {
        for d in 0..self.dirs.len() {
            let dir = &self.dirs[d];
            if dir.degraded.load(Ordering::Relaxed) {
                continue;
            }
            if let Err(why) = dir.check_owner() {
                self.take_out_of_service(
                    d,
                    &format!("{why}; its blocks are forgotten and nothing more is written there"),
                );
                continue;
            }
            if dir.no_room.load(Ordering::Relaxed) && dir.room_for_segment().is_ok() {
                self.room_again(d);
            }
        }
    }
}
