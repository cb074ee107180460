//! What a batch reports when it is done ([`CopyReport`]): the path that moved it
//! ([`CopyPath`]), its bytes and submissions, and whether it started behind the previous batch.
//!
//! Owns these two public types only. Must never: report a path or a byte count that did not run.

/// What actually ran for a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPath {
    /// Nothing to do.
    Empty,
    /// One copy per merged range.
    Direct,
    /// Gather/scatter kernel + staging buffer.
    Staged,
    /// Kernel over mapped pinned host memory.
    Mapped,
}

/// A finished batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyReport {
    /// The path taken.
    pub path: CopyPath,
    /// Bytes moved.
    pub bytes: u64,
    /// Copies and kernel launches enqueued.
    pub submissions: usize,
    /// Whether the worker started the batch while its previous batch was still copying, so
    /// that the copy engine went from one to the other with no gap (with `overlap` on,
    /// device → host batches under [`Wait::Tail`](super::Wait::Tail) and [`Wait::Spin`](super::Wait::Spin): a batch that is queued
    /// when the worker starts waiting for the previous one's end, or arrives while it polls
    /// for it, is enqueued behind it while that one still copies).
    pub overlapped: bool,
}
