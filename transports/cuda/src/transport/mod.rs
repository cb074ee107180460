//! The `cuda` transport: moves bytes between CUDA device memory (IPC mappings) and the landing
//! tier's host buffers.
//!
//! Owns: pinning the landing tier in the background ([`crate::pin`]); one worker thread per
//! (device, direction), each with its own primary-context binding, `staging_buffers` streams
//! and staging buffers (two by default), descriptor buffers and the copy kernel; choosing a
//! path per batch ([`CopyPath`]): `Direct` (one `cuMemcpy*Async` per merged range), `Staged`
//! (a gather/scatter kernel into a contiguous device staging buffer, then one large copy per
//! host run, chunk `i` on buffer and stream `i % staging_buffers`) or `Mapped` (the kernel
//! copies straight between device memory and mapped pinned host memory); and completing each
//! batch only after its own work on every stream ended. A device → host batch that is queued
//! when the worker starts waiting for the previous one's end, or arrives while it polls for
//! it, is enqueued behind it (the `overlap` setting, [`CopyReport::overlapped`]), sharing the
//! staging ring and the descriptor page with it, so the copy engine goes from one Save to the
//! next with no gap.
//!
//! Must never: run a CUDA call on the async executor, report a batch as done before every byte
//! moved (an error in the middle still waits for what was enqueued, then reports the error),
//! address host memory through a device pointer it did not get from
//! `cuMemHostGetDevicePointer`, or use the mapped path for a range that is not pinned yet (the
//! staged path is pageable-safe and takes those).
//!
//! Its modules, by concern (each one's first doc comment says what it owns and must never do):
//!
//! | module | what |
//! |---|---|
//! | `config` | the `[[transport]] kind = "cuda"` table ([`CudaTransportConfig`]), [`Policy`], [`KernelPath`], [`Wait`], the fixed sizes ([`TAIL_BYTES`], ...) |
//! | `handle` | [`CudaTransport`]: the checks, the worker queues, `submit` and the caller's poll for the answer, the `Transport` impl and the factory |
//! | `worker` | the copy worker thread: its loop, start-up, `prepare`, drop; `worker/batch.rs` (one batch: start, enqueue, path choice, finish), `worker/direct.rs`, `worker/staged.rs` (kernel + staging ring + gather stream), `worker/mapped.rs`, `worker/wait.rs` (end events, tail marks, polling), `worker/overlap.rs` (a batch started behind the running one) |
//! | `descriptors` | the staged path's host-mapped descriptor pages |
//! | `kernel` | the copy kernel ([`KERNEL_PTX`]): load, launch; device buffers |
//! | `events` | stream and event calls: create, record, sleep on, poll |
//! | `progress` | the only place that touches the runtime's progress API (`SourceRead`, `signal_near_end`) |
//! | `numa` | NUMA placement of the pool's pages and the copy threads |
//! | `report` | [`CopyPath`], [`CopyReport`] |

mod config;
mod descriptors;
mod events;
mod handle;
mod kernel;
mod numa;
mod progress;
mod report;
mod worker;

pub use config::{
    CudaTransportConfig, KernelPath, Policy, Wait, DESC_PAGE_START, MARKS_START_BYTES, MARK_BYTES,
    POLL_LIMIT, TAIL_BYTES,
};
pub use handle::CudaTransport;
pub use kernel::KERNEL_PTX;
pub use report::{CopyPath, CopyReport};
