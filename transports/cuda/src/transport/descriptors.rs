//! The staged path's kernel descriptors: host-mapped pinned pages (zero-copy) the gather and
//! scatter kernels read their [`Desc`]s from, so a chunk is launched as soon as it is planned,
//! with no upload ordered before it.
//!
//! Owns: the pages and the cursor where a batch's next descriptors go. A batch appends to the
//! last page and adds a page (twice as large) when it is full; a batch that starts after every
//! earlier one ended begins by folding several pages into one large enough for all of them
//! ([`DescPages::reset`]). Must never: rewrite descriptors a kernel may still read — that is
//! the caller's promise, kept by calling [`DescPages::reset`] or [`DescPages::rewind`] only
//! after the previous batch synchronised, or after the running batch's gathers (the only
//! readers) completed — nor free a page before then.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{check, CudaError};
use crate::plan::Desc;

/// A host-mapped pinned page of kernel descriptors.
struct DescPage {
    host: *mut c_void,
    dev: u64,
    cap: usize,
}

/// A copy worker's descriptor pages (see the module's doc).
pub(super) struct DescPages {
    pages: Vec<DescPage>,
    /// (page, byte offset) where the running batch's next descriptors go.
    cursor: (usize, usize),
}

impl DescPages {
    /// No page yet (the first is made by [`DescPages::add`] or by the first batch).
    pub(super) const fn new() -> Self {
        Self {
            pages: Vec::new(),
            cursor: (0, 0),
        }
    }

    /// Whether there is no page yet.
    pub(super) fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// How many pages there are.
    pub(super) fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Adds a page of `cap` bytes (a worker's page ahead of its batches).
    pub(super) fn add(&mut self, cap: usize) -> Result<(), CudaError> {
        self.pages.push(alloc_desc_page(cap)?);
        Ok(())
    }

    /// Whether a batch started now would seldom add a page: there is none yet, or the cursor
    /// is on the last page and at least half of it is left.
    pub(super) fn half_free(&self) -> bool {
        let (page, off) = self.cursor;
        self.pages
            .get(page)
            .is_none_or(|p| page + 1 == self.pages.len() && off <= p.cap / 2)
    }

    /// The next descriptors go from the start of the first page (nothing reads it any more).
    pub(super) fn rewind(&mut self) {
        self.cursor = (0, 0);
    }

    /// Starts a batch's descriptor pages: after the previous batch synchronised, nothing
    /// reads them; several pages are folded into one as large as all of them together.
    pub(super) fn reset(&mut self) -> Result<(), CudaError> {
        if self.pages.len() > 1 {
            let want: usize = self.pages.iter().map(|p| p.cap).sum();
            for p in self.pages.drain(..) {
                free_desc_page(&p);
            }
            self.pages.push(alloc_desc_page(want.next_power_of_two())?);
        }
        self.cursor = (0, 0);
        Ok(())
    }

    /// Copies `descs` into the running batch's descriptor pages (a new page when the last
    /// one is full) and answers their device address.
    pub(super) fn stage(&mut self, descs: &[Desc]) -> Result<u64, CudaError> {
        let bytes = std::mem::size_of_val(descs);
        let (mut page, mut off) = self.cursor;
        // Pages are only appended within a batch: the cursor is on the last one, or there is
        // none yet.
        if self.pages.get(page).is_none_or(|p| p.cap - off < bytes) {
            let last = self.pages.last().map_or(0, |p| p.cap);
            let cap = bytes.next_power_of_two().max(last * 2).max(256 << 10);
            self.pages.push(alloc_desc_page(cap)?);
            (page, off) = (self.pages.len() - 1, 0);
        }
        let p = &self.pages[page];
        // SAFETY: the page holds `cap - off >= bytes` bytes from `off`, and no kernel of this
        // batch reads that part (each chunk gets its own range; earlier batches synchronised,
        // or their gathers, the only readers, completed: `Worker::gathers_done`);
        // Desc is plain old data. The writes precede the launch that reads them in program
        // order, and the launch makes them visible to the device.
        unsafe {
            std::ptr::copy_nonoverlapping(
                descs.as_ptr().cast::<u8>(),
                p.host.cast::<u8>().add(off),
                bytes,
            )
        };
        let dev = p.dev + off as u64;
        // Keep every chunk's descriptors 16-byte aligned.
        self.cursor = (page, (off + bytes).next_multiple_of(16));
        Ok(dev)
    }

    /// Frees every page (the worker's drop: nothing is in flight).
    pub(super) fn free_all(&mut self) {
        for p in self.pages.drain(..) {
            free_desc_page(&p);
        }
    }
}

/// A pinned, device-mapped host page of `cap` bytes for kernel descriptors.
fn alloc_desc_page(cap: usize) -> Result<DescPage, CudaError> {
    let mut host: *mut c_void = std::ptr::null_mut();
    check(
        // SAFETY: out-pointer to a live local; the caller's thread has a current context.
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                cap,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        },
        "cuMemHostAlloc (descriptors)",
    )?;
    let mut dev: sys::CUdeviceptr = 0;
    let r = check(
        // SAFETY: `host` was just allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) },
        "cuMemHostGetDevicePointer (descriptors)",
    );
    if let Err(e) = r {
        // SAFETY: allocated above, unused.
        let _ = unsafe { sys::cuMemFreeHost(host) };
        return Err(e);
    }
    Ok(DescPage { host, dev, cap })
}

fn free_desc_page(p: &DescPage) {
    // SAFETY: allocated by alloc_desc_page in the current context; the batch that used it
    // synchronised.
    let _ = unsafe { sys::cuMemFreeHost(p.host) };
}
