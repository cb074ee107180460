//! Background pinning of the landing tier's host memory (`cuMemHostRegister` with
//! `PORTABLE | DEVICEMAP`), so the server answers before a large pool is pinned.
//!
//! Owns: splitting the tier's backing ranges into chunks of at most [`MAX_PIN_CHUNK`] bytes,
//! registering them from a few parallel `cuda-pin-N` threads, publishing each chunk's state
//! ([`PinState`]) for the copy workers, and unregistering every registered chunk when the
//! [`PinSet`] is dropped (on a `cuda-unpin` thread, keeping the tier alive until then).
//!
//! Must never: block the caller of [`PinSet::start`] while registering, report a chunk as
//! pinned before its registration returned, or unregister a chunk while a copy may use it (the
//! set is dropped only after every worker that holds it has stopped).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use parking_lot::{Condvar, Mutex};

use crate::driver::{check, Driver};

/// Largest range registered by one `cuMemHostRegister` call.
pub const MAX_PIN_CHUNK: usize = 64 << 30;
/// Chunk sizes are multiples of this (so chunk boundaries stay page- and huge-page-aligned).
pub const PIN_ALIGN: usize = 2 << 20;

/// Where a chunk's registration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinState {
    /// Not registered yet; copies use the pageable-safe staged path.
    Pending,
    /// Registered by us with `PORTABLE | DEVICEMAP`.
    Pinned,
    /// Registered by someone else before us (usable for DMA, not for the mapped path).
    Foreign,
    /// Registration failed or was cancelled; copies use the pageable-safe path.
    Failed,
}

impl PinState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => PinState::Pinned,
            2 => PinState::Foreign,
            3 => PinState::Failed,
            _ => PinState::Pending,
        }
    }
    fn to_u8(self) -> u8 {
        match self {
            PinState::Pending => 0,
            PinState::Pinned => 1,
            PinState::Foreign => 2,
            PinState::Failed => 3,
        }
    }
}

/// One registered (or to-be-registered) host range.
#[derive(Debug)]
pub struct PinChunk {
    /// Host address of the first byte.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
    state: AtomicU8,
}

impl PinChunk {
    /// The chunk's current state.
    pub fn state(&self) -> PinState {
        PinState::from_u8(self.state.load(Ordering::Acquire))
    }
}

/// Splits `ranges` into chunks of at most `max_chunk` bytes (a multiple of [`PIN_ALIGN`] unless
/// a range is smaller), sized so that `threads` threads get similar work.
pub fn split_ranges(
    ranges: &[(usize, usize)],
    max_chunk: usize,
    threads: usize,
) -> Vec<(usize, usize)> {
    let total: usize = ranges.iter().map(|r| r.1).sum();
    let per_thread = total.div_ceil(threads.max(1));
    let chunk = per_thread
        .div_ceil(PIN_ALIGN)
        .max(1)
        .saturating_mul(PIN_ALIGN)
        .min(max_chunk.max(PIN_ALIGN) / PIN_ALIGN * PIN_ALIGN);
    let mut out = Vec::new();
    for &(addr, len) in ranges {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(chunk);
            out.push((addr + off, n));
            off += n;
        }
    }
    out.sort_unstable();
    out
}

/// The landing tier's chunks and their registration progress.
pub struct PinSet {
    chunks: Vec<PinChunk>,
    done: Mutex<usize>,
    all_done: Condvar,
    cancel: AtomicBool,
    pinned_bytes: AtomicUsize,
    ordinal: i32,
    driver: &'static Driver,
    tier: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for PinSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinSet")
            .field("chunks", &self.chunks.len())
            .field("pinned_bytes", &self.pinned_bytes.load(Ordering::Relaxed))
            .finish()
    }
}

impl PinSet {
    /// Starts registering `ranges` (host address, bytes) from `threads` background threads,
    /// in `ordinal`'s primary context (registrations are `PORTABLE`, so every context sees
    /// them). Returns at once. `tier` is kept alive until every chunk is unregistered. The
    /// threads run on `cpus` when given (the GPUs' NUMA node, so that pages first faulted by
    /// the registration land there even where no memory policy steers them).
    pub fn start(
        driver: &'static Driver,
        ordinal: i32,
        ranges: &[(usize, usize)],
        max_chunk: usize,
        threads: usize,
        tier: Option<Arc<dyn std::any::Any + Send + Sync>>,
        cpus: Vec<usize>,
    ) -> Arc<PinSet> {
        let threads = threads.max(1);
        let chunks: Vec<PinChunk> = split_ranges(ranges, max_chunk, threads)
            .into_iter()
            .map(|(addr, len)| PinChunk {
                addr,
                len,
                state: AtomicU8::new(0),
            })
            .collect();
        let set = Arc::new(PinSet {
            chunks,
            done: Mutex::new(0),
            all_done: Condvar::new(),
            cancel: AtomicBool::new(false),
            pinned_bytes: AtomicUsize::new(0),
            ordinal,
            driver,
            tier,
        });
        if set.chunks.is_empty() {
            return set;
        }
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let total: usize = set.chunks.iter().map(|c| c.len).sum();
        let mut spawned = 0;
        for t in 0..threads.min(set.chunks.len()) {
            let set = set.clone();
            let next = next.clone();
            let cpus = cpus.clone();
            match std::thread::Builder::new()
                .name(format!("cuda-pin-{t}"))
                .spawn(move || {
                    if let Err(e) = crate::host_numa::run_on_cpus(&cpus) {
                        tracing::warn!("cuda-pin-{t}: cannot run on the GPUs' NUMA node: {e}");
                    }
                    set.pin_loop(&next, started, total)
                }) {
                Ok(_) => spawned += 1,
                Err(e) => tracing::error!("cannot spawn a cuda-pin thread: {e}"),
            }
        }
        // If no thread could be spawned, nothing ever finishes: mark everything failed.
        if spawned == 0 {
            for c in &set.chunks {
                c.state.store(PinState::Failed.to_u8(), Ordering::Release);
            }
            *set.done.lock() = set.chunks.len();
        }
        set
    }

    fn pin_loop(&self, next: &AtomicUsize, started: Instant, total: usize) {
        let bound = self.driver.bind(self.ordinal);
        loop {
            let i = next.fetch_add(1, Ordering::AcqRel);
            let Some(c) = self.chunks.get(i) else { break };
            let state = match &bound {
                _ if self.cancel.load(Ordering::Acquire) => PinState::Failed,
                Err(e) => {
                    tracing::warn!("cannot pin host memory: {e}");
                    PinState::Failed
                }
                Ok(()) => {
                    // SAFETY: the chunk lies inside the tier's backing ranges, which stay mapped
                    // while `self.tier` is held (until after unregistration).
                    let r = unsafe {
                        sys::cuMemHostRegister_v2(
                            c.addr as *mut std::ffi::c_void,
                            c.len,
                            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                        )
                    };
                    match r {
                        sys::CUresult::CUDA_SUCCESS => {
                            self.pinned_bytes.fetch_add(c.len, Ordering::AcqRel);
                            PinState::Pinned
                        }
                        sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
                            PinState::Foreign
                        }
                        other => {
                            tracing::warn!(
                                addr = c.addr,
                                len = c.len,
                                "cuMemHostRegister failed: {other:?}; this range is copied \
                                 through the slower pageable path"
                            );
                            PinState::Failed
                        }
                    }
                }
            };
            c.state.store(state.to_u8(), Ordering::Release);
            let mut done = self.done.lock();
            *done += 1;
            if *done == self.chunks.len() {
                tracing::info!(
                    bytes = total,
                    pinned = self.pinned_bytes.load(Ordering::Acquire),
                    secs = started.elapsed().as_secs_f64(),
                    "landing tier pinned"
                );
                self.all_done.notify_all();
            }
        }
    }

    /// The chunks, sorted by address.
    pub fn chunks(&self) -> &[PinChunk] {
        &self.chunks
    }

    /// Addresses where chunks begin (sorted): host copies must not cross them.
    pub fn boundaries(&self) -> Vec<usize> {
        self.chunks.iter().map(|c| c.addr).collect()
    }

    /// The index of the chunk holding all of `[addr, addr + len)`, if any.
    pub fn find(&self, addr: usize, len: usize) -> Option<usize> {
        let i = self
            .chunks
            .partition_point(|c| c.addr <= addr)
            .checked_sub(1)?;
        let c = &self.chunks[i];
        (addr + len <= c.addr + c.len).then_some(i)
    }

    /// Bytes registered so far.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned_bytes.load(Ordering::Acquire)
    }

    /// Whether every chunk has been tried.
    pub fn is_done(&self) -> bool {
        *self.done.lock() == self.chunks.len()
    }

    /// Waits until every chunk has been tried, at most `timeout`; returns whether they were.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut done = self.done.lock();
        while *done < self.chunks.len() {
            if self.all_done.wait_until(&mut done, deadline).timed_out() {
                return *done == self.chunks.len();
            }
        }
        true
    }

    /// Asks the pin threads to stop after the chunk they are registering.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }
}

impl Drop for PinSet {
    fn drop(&mut self) {
        let pinned: Vec<(usize, usize)> = self
            .chunks
            .iter()
            .filter(|c| c.state() == PinState::Pinned)
            .map(|c| (c.addr, c.len))
            .collect();
        if pinned.is_empty() {
            return;
        }
        let driver = self.driver;
        let ordinal = self.ordinal;
        let tier = self.tier.take();
        // Unregistering many GiB takes a while: never on the dropping (maybe executor) thread.
        let r = std::thread::Builder::new()
            .name("cuda-unpin".into())
            .spawn(move || {
                if driver.bind(ordinal).is_ok() {
                    for (addr, _) in pinned {
                        // SAFETY: the range was registered by this set and no copy uses it any
                        // more (every worker holding the set has stopped).
                        let r = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
                        if let Err(e) = check(r, "cuMemHostUnregister") {
                            tracing::warn!("{e}");
                        }
                    }
                }
                drop(tier);
            });
        if let Err(e) = r {
            tracing::error!("cannot spawn the cuda-unpin thread: {e}; host memory stays pinned");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_respects_limits() {
        let g = 1usize << 30;
        let r = split_ranges(&[(0, 40 * g)], MAX_PIN_CHUNK, 8);
        assert_eq!(r.len(), 8);
        assert!(r.iter().all(|c| c.1 == 5 * g));
        let r = split_ranges(&[(0, 200 * g)], MAX_PIN_CHUNK, 1);
        assert_eq!(r.len(), 4);
        assert!(r.iter().all(|c| c.1 <= MAX_PIN_CHUNK));
        assert_eq!(r.iter().map(|c| c.1).sum::<usize>(), 200 * g);
        let r = split_ranges(&[(4096, 3 << 20), (1 << 40, 5)], MAX_PIN_CHUNK, 4);
        assert_eq!(r.iter().map(|c| c.1).sum::<usize>(), (3 << 20) + 5);
        assert!(r.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
    }
}
