//! The stream and event calls a copy worker makes: creating them, recording, sleeping on and
//! polling an event. Every call runs on the worker's own thread, whose context (the device's
//! primary context) is current; these are the only waits a worker does on the GPU.
//!
//! Owns nothing: the worker keeps and destroys what these make. Must never: be called from
//! the async executor, or spin without a limit unless the caller asked for it (only
//! [`super::Wait::Spin`] polls without one).

use std::time::Duration;

use cudarc::driver::sys;

use crate::driver::{check, CudaError};

/// A stream of the current context that does not synchronise with the legacy default stream.
pub(super) fn new_stream() -> Result<sys::CUstream, CudaError> {
    let mut s: sys::CUstream = std::ptr::null_mut();
    check(
        // SAFETY: out-pointer to a live local; the caller's context is current.
        unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    )
    .map(|()| s)
}

/// A timing-free event of the current context; `blocking`: a wait on it sleeps
/// (`CU_EVENT_BLOCKING_SYNC`) rather than spins.
pub(super) fn new_event(blocking: bool) -> Result<sys::CUevent, CudaError> {
    let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    if blocking {
        flags |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
    }
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: out-pointer to a live local; the caller's context is current.
    let r = unsafe { sys::cuEventCreate(&mut e, flags) };
    check(r, "cuEventCreate").map(|()| e)
}

/// Records `ev` on `stream`, both of the calling worker's context.
pub(super) fn record(ev: sys::CUevent, stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: the worker created both in its context, which is current on its thread.
    check(unsafe { sys::cuEventRecord(ev, stream) }, "cuEventRecord")
}

/// Sleeps (`CU_EVENT_BLOCKING_SYNC` events) or waits until the work before `ev`'s last record
/// finished.
pub(super) fn wait_event(ev: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: an event of the calling worker's context, which is current on its thread.
    check(unsafe { sys::cuEventSynchronize(ev) }, "cuEventSynchronize")
}

/// Polls `ev` until the work before it finished (true), at most `limit` (false: not done
/// yet), or the query fails. Spins with a pause hint between queries; past 1 ms it also yields
/// to any other runnable thread (which keeps the core busy when there is none: only
/// [`super::Wait::Spin`] polls without a limit).
pub(super) fn poll_event(ev: sys::CUevent, limit: Duration) -> Result<bool, CudaError> {
    poll_event_with(ev, limit, || {})
}

/// One query of `ev` (recorded on a stream of the calling worker's context): true once the
/// work before it finished; false while it runs or when the query fails.
pub(super) fn event_done(ev: sys::CUevent) -> bool {
    // SAFETY: an event of the calling worker's context, which is current on its thread.
    unsafe { sys::cuEventQuery(ev) == sys::CUresult::CUDA_SUCCESS }
}

/// [`poll_event`], running `between` after each query that finds the work unfinished.
pub(super) fn poll_event_with(
    ev: sys::CUevent,
    limit: Duration,
    mut between: impl FnMut(),
) -> Result<bool, CudaError> {
    let start = std::time::Instant::now();
    loop {
        // SAFETY: an event of this worker's context (current), recorded on one of its streams.
        match unsafe { sys::cuEventQuery(ev) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            e => return check(e, "cuEventQuery").map(|()| true),
        }
        let waited = start.elapsed();
        if waited >= limit {
            return Ok(false);
        }
        between();
        if waited > Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
