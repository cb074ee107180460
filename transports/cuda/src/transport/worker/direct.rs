//! The direct path: one `cuMemcpy*Async` per merged range of a batch, spread over the copy
//! streams (range `i` on stream `i % staging_buffers`).
//!
//! Owns nothing but that loop. Must never: let one copy cross a pinned registration's start
//! (ranges are split at them), or address host memory other than through the batch's own
//! host ranges.

use std::ffi::c_void;

use cudarc::driver::sys;
use pegaflow_plugin::{CopyOp, Direction};

use super::Worker;
use crate::driver::{check, CudaError};
use crate::plan::{merge_ops, split_at_boundaries};

impl Worker {
    /// Enqueues `ops` as one copy per merged range (split at pinned-range starts), range `i` on
    /// stream `i % streams`. Returns the copies enqueued.
    pub(super) fn direct(&mut self, ops: &[CopyOp]) -> Result<usize, CudaError> {
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
}
