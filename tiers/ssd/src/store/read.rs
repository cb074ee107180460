//! Reading one block back: the record the index names is read whole and checked on the I/O
//! thread ([`crate::verify::check_record`]) while its payload is copied into the
//! destination; the get succeeds only when every check passed.
//!
//! Must never: report success for a record that failed a check (its partial copy stays in a
//! buffer the stack discards), count a segment evicted under a waiting read as corrupt, or
//! let a failing read of one segment cost more than that segment.

use std::sync::atomic::Ordering;
use std::time::Instant;

use pegaflow_plugin::{TierError, TierGet};

use super::{same_record, unavailable, GaugeGuard, Inner, SegState};
use crate::format::RecordPlace;
use crate::verify::Expected;

impl Inner {
    /// Reads one record into its destination, checking it is the record the index names.
    pub(super) async fn read_one(&self, r: TierGet) -> Result<(), TierError> {
        let loc = {
            let st = self.state.lock();
            st.index.get(&r.key).cloned()
        }
        .ok_or(TierError::NotFound)?;
        if loc.shape != r.shape {
            return Err(TierError::Corrupt(
                "stored slot layout differs from the requested one".into(),
            ));
        }
        let need = loc.shape.len_bytes() as usize;
        if r.dest.len() < need {
            return Err(TierError::Corrupt(format!(
                "destination of {} bytes for a {need}-byte block",
                r.dest.len()
            )));
        }
        let _permit = self
            .read_permits
            .acquire()
            .await
            .map_err(|_| TierError::Unavailable("SSD tier stopped".into()))?;
        let _inflight = GaugeGuard::new(&self.metrics.prefetch_inflight);
        let dir = &self.dirs[loc.dir];
        if dir.degraded.load(Ordering::Relaxed) {
            return Err(TierError::Unavailable(format!(
                "SSD {} is out of service",
                dir.path.display()
            )));
        }
        let (file, base) = dir
            .slot_file(loc.slot, false)
            .map_err(|e| unavailable("segment file", &e))?;
        let key = r.key.clone();
        let gen = loc.generation;
        let shape = loc.shape.clone();
        let place = RecordPlace {
            store_id: dir.store_id,
            slot: loc.slot,
            offset: loc.offset,
        };
        let dest = r.dest.clone();
        let t0 = Instant::now();
        let res = self
            .engine
            .read(
                file,
                base + loc.offset,
                loc.len as usize,
                Box::new(move |b| {
                    let expect = Expected {
                        key: &key,
                        generation: gen,
                        shape: &shape,
                        place,
                    };
                    crate::verify::check_record(b, &expect, &*dest)
                }),
            )
            .await;
        match res {
            Ok(Ok(())) => {
                self.read_succeeded(loc.dir);
                let secs = t0.elapsed().as_secs_f64();
                self.metrics.read_seconds.observe(secs);
                if secs > 0.0 && loc.len >= (1 << 20) {
                    self.read_bw
                        .store((loc.len as f64 / secs) as u64, Ordering::Relaxed);
                }
                self.metrics.prefetch_bytes.inc_by(loc.len);
                self.metrics.prefetch_success.inc();
                if secs > 0.0 {
                    self.metrics
                        .prefetch_throughput
                        .observe(loc.len as f64 / secs);
                }
                self.metrics.blocks.with_label_values(&["read"]).inc();
                let mut st = self.state.lock();
                let m = &mut st.segs[loc.dir][loc.slot as usize];
                if m.generation == loc.generation {
                    m.reads += 1;
                }
                Ok(())
            }
            Ok(Err(refused)) => {
                {
                    // The segment was evicted (and perhaps reused) while the read waited: a
                    // miss, not a corrupt record.
                    let st = self.state.lock();
                    let m = &st.segs[loc.dir][loc.slot as usize];
                    if m.generation != loc.generation || m.state == SegState::Free {
                        return Err(TierError::NotFound);
                    }
                }
                let why = refused.why();
                self.metrics.corrupt_records.with_label_values(&[why]).inc();
                self.metrics.prefetch_failures.inc();
                if let Some(held_back) = self.corrupt_log.allow() {
                    tracing::warn!(
                        path = %dir.path.display(),
                        slot = loc.slot,
                        offset = loc.offset,
                        why,
                        detail = %refused,
                        lines_held_back = held_back,
                        "SSD record failed its checks: dropped, never served"
                    );
                }
                let mut st = self.state.lock();
                if st.index.get(&r.key).is_some_and(|l| same_record(l, &loc)) {
                    st.index.remove(&r.key);
                }
                Err(TierError::Corrupt(refused.to_string()))
            }
            Err(e) => {
                self.metrics.prefetch_failures.inc();
                // An unreadable record takes its segment's records with it (a truncated or
                // damaged file is not asked for again record by record); the path's error
                // count decides whether the whole path leaves service.
                self.read_failed(loc.dir, loc.slot, loc.generation, &e);
                Err(unavailable("read", &e))
            }
        }
    }
}
