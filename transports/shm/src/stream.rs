//! Copies with non-temporal ("streaming") stores: the destination's cache lines are written
//! straight to memory through the write-combining buffers instead of being read into the
//! cache first and evicted later.
//!
//! A Save writes blocks into the DRAM tier that nobody reads until a later Load, usually far
//! later; a cached copy spends half its memory traffic reading each destination line before
//! overwriting it (read for ownership) and then evicts useful lines. On the development VM a
//! copy of 8 KiB blocks into a 512 MiB pool ran at 14–16 GB/s with streaming stores against
//! 6–8 GB/s with the C library's `memcpy` (docs/benchmarks/log/query-and-shm.md §4).
//!
//! Streaming stores are weakly ordered: the thread that issued them must run [`fence`]
//! before anything it publishes afterwards (the batch's completion) can be relied on to see
//! the bytes.

/// Copies shorter than this many bytes go through the cache (`copy_nonoverlapping`): their
/// head and tail would be most of the work.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const STREAM_MIN: usize = 256;

/// Copies `len` bytes from `src` to `dst` with streaming stores for every whole 64-byte line
/// of the destination, ordinary stores for the unaligned head and tail. On targets without
/// SSE2 streaming stores it is a plain `copy_nonoverlapping`.
///
/// # Safety
/// `src..src+len` must be readable, `dst..dst+len` writable, and the two ranges must not
/// overlap, for the duration of the call. The caller runs [`fence`] on the same thread
/// before publishing that the copy is done.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if len >= STREAM_MIN {
            // SAFETY: forwarded from the caller.
            unsafe { copy_x86_64(src, dst, len) };
            return;
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Orders every streaming store this thread issued before its later stores (an `sfence`);
/// a no-op where [`copy`] issues none.
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE is part of the x86_64 baseline).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// How far ahead of the line being copied the source is prefetched, in bytes. The hardware
/// prefetcher stops at each 4 KiB page, and a block's range is often one page: without this a
/// copy of 4 KiB ranges from memory not in the cache ran at 5.4–5.8 GB/s on the development VM,
/// with it at 8.0–8.4 (512 bytes: 5.3–7.6, 2 KiB: 6.6–8.8). It reaches past the range's end
/// into what is usually the next block's source; a prefetch never faults.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 1024;

#[cfg(target_arch = "x86_64")]
unsafe fn copy_x86_64(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_prefetch, _mm_stream_si128, _MM_HINT_T0,
    };
    const LINE: usize = 64;
    // Head: up to the destination's next line boundary, through the cache.
    let head = (dst as usize).next_multiple_of(LINE) - dst as usize;
    let head = head.min(len);
    // SAFETY: within the caller's ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let lines = (len - head) / LINE;
    // SAFETY: `head <= len`, so both offsets stay within the caller's ranges.
    let (mut s, mut d) = unsafe { (src.add(head), dst.add(head)) };
    for _ in 0..lines {
        // SAFETY: `d` is 64-byte aligned (so each 16-byte store is aligned, as
        // `_mm_stream_si128` requires) and `s..s+64`, `d..d+64` lie within the caller's
        // ranges; SSE2 is part of the x86_64 baseline; loads may be unaligned.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(PREFETCH_AHEAD).cast::<i8>());
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            s = s.add(LINE);
            d = d.add(LINE);
        }
    }
    let tail = len - head - lines * LINE;
    // SAFETY: the last `tail` bytes of the caller's ranges.
    unsafe { std::ptr::copy_nonoverlapping(s, d, tail) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + 7) as u8).collect()
    }

    proptest! {
        /// Every byte of the range arrives and nothing outside it is written, for any
        /// alignment of either side and any length (short copies, heads, whole lines, tails).
        #[test]
        fn copies_exactly_the_range(src_off in 0usize..130, dst_off in 0usize..130, len in 0usize..3000) {
            let src = pattern(src_off + len + 64);
            let mut dst = vec![0xEEu8; dst_off + len + 64];
            // SAFETY: both ranges lie inside their vectors, which do not overlap.
            unsafe { copy(src.as_ptr().add(src_off), dst.as_mut_ptr().add(dst_off), len) };
            fence();
            prop_assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
            prop_assert!(dst[..dst_off].iter().all(|&b| b == 0xEE));
            prop_assert!(dst[dst_off + len..].iter().all(|&b| b == 0xEE));
        }
    }
}
