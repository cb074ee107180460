//! The DRAM pool: one anonymous mapping cut into shards, and the allocator over it.
//!
//! Owns: the mapping (unmapped when the last [`HostBuffer`] and the tier are gone), the
//! per-shard free lists, the exact used-byte count, and the translation between extents
//! handed out and the granule-rounded ranges reserved for them.
//!
//! Must never: hand the same byte to two live buffers, hand out a byte outside the mapping,
//! fail an allocation because of fragmentation while a shard (or, as a last resort, the pool)
//! has enough free bytes, or give memory back to the OS (`MADV_DONTNEED`) that a live buffer
//! uses.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pegaflow_plugin::{Extent, HostBuffer, HostMemory};

use crate::freelist::FreeList;

/// Allocation unit in bytes: every allocation's footprint is its length rounded up to this.
pub const GRANULE: usize = 512;

/// Free extents at least this long (bytes) are returned to the OS by `trim`.
pub const TRIM_MIN_EXTENT: usize = 2 << 20;

/// `trim` advises at most this many bytes per lock hold, so allocations are not stalled.
const TRIM_CHUNK: usize = 64 << 20;

/// `len` rounded up to the granule; `None` on overflow.
pub(crate) fn footprint(len: usize) -> Option<usize> {
    len.checked_next_multiple_of(GRANULE)
}

/// Bytes of one huge page as the pool uses them (`MAP_HUGE_2MB` for reserved pages; the
/// transparent huge page size of x86-64 and of arm64 with 4 KiB base pages): the alignment of
/// a mapping backed by huge pages, and the unit `trim` gives back on transparent ones.
pub const HUGE_PAGE: usize = 2 << 20;

/// The system's base page size in bytes (a power of two ≥ [`GRANULE`]; 4 KiB if unknown).
fn base_page() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p.is_power_of_two() && p >= GRANULE)
        .unwrap_or(4096)
}

/// What backs the pool's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backing {
    /// Base pages (4 KiB), committed lazily (`MAP_NORESERVE`).
    Base,
    /// Transparent huge pages: the mapping is aligned to [`HUGE_PAGE`] and advised
    /// `MADV_HUGEPAGE`, so that faults (pinning faults in the whole pool) take 2 MiB pages
    /// where the kernel has them (`/sys/kernel/mm/transparent_hugepage/enabled` of `always`
    /// or `madvise`), base pages otherwise. Committed lazily.
    Transparent,
    /// Reserved 2 MiB huge pages (`MAP_HUGETLB | MAP_HUGE_2MB`, the kernel's 2 MiB huge-page
    /// pool): reserved in full at start-up, so a pool larger than the free huge pages fails
    /// to map instead of faulting later. The length is rounded up to [`HUGE_PAGE`]; `trim`
    /// gives nothing back.
    Reserved,
}

/// An anonymous mapping.
#[derive(Debug)]
struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes read-write, private, anonymous, backed as `backing` says; returns the
    /// mapping and the backing it got (base pages where the kernel refused the huge-page
    /// advice). Base and transparent pages are mapped without reserving swap: the kernel
    /// commits pages on first touch.
    fn anonymous(len: usize, backing: Backing) -> io::Result<(Self, Backing)> {
        match backing {
            Backing::Base => Ok((Self::map(len, libc::MAP_NORESERVE)?, Backing::Base)),
            Backing::Reserved => {
                let len = len.checked_next_multiple_of(HUGE_PAGE).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "length overflows")
                })?;
                // 2 MiB pages whatever the kernel's default huge page size.
                Ok((
                    Self::map(len, libc::MAP_HUGETLB | libc::MAP_HUGE_2MB)?,
                    Backing::Reserved,
                ))
            }
            Backing::Transparent => {
                // Over-map by one huge page and cut the unaligned head and tail away, so
                // every 2 MiB of the pool can be one huge page.
                let over = len.checked_add(HUGE_PAGE).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "length overflows")
                })?;
                let m = Self::map(over, libc::MAP_NORESERVE)?;
                let start = m.addr.next_multiple_of(HUGE_PAGE);
                let (head, end) = (start - m.addr, start + len.next_multiple_of(base_page()));
                std::mem::forget(m);
                // SAFETY: both ranges lie inside the fresh mapping `[m.addr, m.addr + over)`
                // and outside the part kept; nothing refers to them.
                unsafe {
                    if head > 0 {
                        libc::munmap((start - head) as *mut libc::c_void, head);
                    }
                    let tail = start - head + over - end;
                    if tail > 0 {
                        libc::munmap(end as *mut libc::c_void, tail);
                    }
                }
                let kept = Self {
                    addr: start,
                    len: end - start,
                };
                // SAFETY: the range is the mapping just kept.
                let rc = unsafe {
                    libc::madvise(
                        kept.addr as *mut libc::c_void,
                        kept.len,
                        libc::MADV_HUGEPAGE,
                    )
                };
                if rc != 0 {
                    tracing::warn!(
                        err = %io::Error::last_os_error(),
                        "dram tier: madvise(MADV_HUGEPAGE) failed (a kernel without transparent huge pages?): the pool uses base pages"
                    );
                    return Ok((kept, Backing::Base));
                }
                Ok((kept, Backing::Transparent))
            }
        }
    }

    fn map(len: usize, extra_flags: libc::c_int) -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping at a kernel-chosen address aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            addr: p as usize,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range is exactly the mapping created in `anonymous`; the pool (which
        // owns it) is only dropped once no buffer into it is alive.
        let rc = unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        if rc != 0 {
            tracing::error!(
                addr = self.addr,
                len = self.len,
                err = %io::Error::last_os_error(),
                "munmap of the dram pool failed"
            );
        }
    }
}

/// One independently locked sub-pool: `[start, start + len)` of the mapping (offsets).
#[derive(Debug)]
struct Shard {
    start: usize,
    len: usize,
    free: Mutex<FreeList>,
}

impl Shard {
    fn holds(&self, offset: usize, len: usize) -> bool {
        offset >= self.start
            && offset
                .checked_add(len)
                .is_some_and(|e| e <= self.start + self.len)
    }
}

/// The pool behind a [`crate::DramTier`]; also the [`HostMemory`] its buffers return to.
#[derive(Debug)]
pub(crate) struct Pool {
    map: Mapping,
    backing: Backing,
    capacity: usize,
    shards: Box<[Shard]>,
    next_shard: AtomicUsize,
    used: AtomicUsize,
}

impl Pool {
    /// Maps `capacity` bytes (a multiple of [`GRANULE`], > 0) split into `shards` sub-pools
    /// (1 ≤ `shards` ≤ `capacity / GRANULE`).
    pub(crate) fn new(capacity: usize, shards: usize, backing: Backing) -> io::Result<Self> {
        debug_assert!(capacity > 0 && capacity.is_multiple_of(GRANULE));
        debug_assert!(shards >= 1 && shards <= capacity / GRANULE);
        let (map, backing) = Mapping::anonymous(capacity, backing)?;
        let granules = capacity / GRANULE;
        let (per, extra) = (granules / shards, granules % shards);
        let mut start = 0;
        let shards: Box<[Shard]> = (0..shards)
            .map(|i| {
                let len = (per + usize::from(i < extra)) * GRANULE;
                let s = Shard {
                    start,
                    len,
                    free: Mutex::new(FreeList::new(start, len)),
                };
                start += len;
                s
            })
            .collect();
        debug_assert_eq!(start, capacity);
        Ok(Self {
            map,
            backing,
            capacity,
            shards,
            next_shard: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
        })
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// What backs the pool's pages: as configured, or base pages where the kernel refused the
    /// transparent huge-page advice.
    pub(crate) fn pages(&self) -> Backing {
        self.backing
    }

    /// `(addr, len)` of the mapping.
    pub(crate) fn backing(&self) -> (usize, usize) {
        (self.map.addr, self.capacity)
    }

    /// Free bytes per shard (each under its lock; a snapshot).
    pub(crate) fn free_per_shard(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| s.free.lock().free_bytes())
            .collect()
    }

    /// Free ranges per shard.
    pub(crate) fn free_extents_per_shard(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| s.free.lock().extent_count())
            .collect()
    }

    /// The largest free range of any shard, in bytes.
    pub(crate) fn largest_free(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.free.lock().largest())
            .max()
            .unwrap_or(0)
    }

    fn shard_index(&self, offset: usize) -> usize {
        self.shards
            .partition_point(|s| s.start <= offset)
            .saturating_sub(1)
    }

    /// Reserves `total` bytes (a granule multiple) and returns the pieces `(offset, len)`.
    ///
    /// Order of preference: one best-fit range in some shard (round-robin start); several
    /// ranges of one shard, largest first; as a last resort, ranges of several shards.
    /// `None` only when the free bytes of the whole pool are fewer than `total`.
    fn reserve(&self, total: usize) -> Option<Vec<(usize, usize)>> {
        let mut pieces = Vec::new();
        if total == 0 {
            return Some(pieces);
        }
        if total > self.capacity.saturating_sub(self.used()) {
            return None;
        }
        let n = self.shards.len();
        let first = if n == 1 {
            0
        } else {
            self.next_shard.fetch_add(1, Ordering::Relaxed) % n
        };
        let order = (0..n).map(|i| (first + i) % n);
        if n == 1 {
            let mut fl = self.shards[0].free.lock();
            if fl.free_bytes() < total {
                return None;
            }
            match fl.take_best_fit(total) {
                Some(off) => pieces.push((off, total)),
                None => {
                    fl.take_largest_first(total, &mut pieces);
                }
            }
        } else if let Some(off) = order.clone().find_map(|i| {
            let mut fl = self.shards[i].free.lock();
            if fl.free_bytes() < total {
                return None;
            }
            fl.take_best_fit(total)
        }) {
            pieces.push((off, total));
        } else if order.clone().any(|i| {
            let mut fl = self.shards[i].free.lock();
            fl.free_bytes() >= total && fl.take_largest_first(total, &mut pieces) == total
        }) {
            // Gathered inside one shard.
        } else {
            let mut left = total;
            for i in order {
                if left == 0 {
                    break;
                }
                left -= self.shards[i]
                    .free
                    .lock()
                    .take_largest_first(left, &mut pieces);
            }
            if left > 0 {
                // Concurrent allocations took the bytes this one counted on.
                self.unreserve(&pieces);
                return None;
            }
        }
        self.used.fetch_add(total, Ordering::Relaxed);
        Some(pieces)
    }

    /// Gives back pieces that `reserve` took but never handed out (`used` was not counted).
    fn unreserve(&self, pieces: &[(usize, usize)]) {
        for &(off, len) in pieces {
            let shard = &self.shards[self.shard_index(off)];
            if shard.free.lock().give_back(off, len).is_err() {
                tracing::error!(off, len, "dram pool: unreserved range overlaps free memory");
            }
        }
    }

    /// Cuts `pieces` (granule-aligned, in order) into one buffer of `owner` per entry of
    /// `lens`, each reserving `footprint(len)` bytes with its last extent trimmed to `len`.
    fn carve(
        &self,
        pieces: &[(usize, usize)],
        lens: &[usize],
        owner: &Arc<dyn HostMemory>,
    ) -> Vec<HostBuffer> {
        let mut out = Vec::with_capacity(lens.len());
        let (mut pi, mut used_in_piece) = (0, 0);
        for &len in lens {
            let fp = footprint(len).unwrap_or(usize::MAX);
            if let Some(&(off, _)) = pieces
                .get(pi)
                .filter(|&&(_, l)| fp > 0 && l - used_in_piece > fp)
            {
                // The usual case: the buffer fits in what is left of the current piece.
                out.push(HostBuffer::single(
                    Extent {
                        addr: self.map.addr + off + used_in_piece,
                        len,
                    },
                    owner.clone(),
                ));
                used_in_piece += fp;
                continue;
            }
            let mut ext = Vec::with_capacity(1);
            let mut need = fp;
            while need > 0 {
                let (off, plen) = pieces[pi];
                let take = (plen - used_in_piece).min(need);
                ext.push(Extent {
                    addr: self.map.addr + off + used_in_piece,
                    len: take,
                });
                used_in_piece += take;
                need -= take;
                if used_in_piece == plen {
                    pi += 1;
                    used_in_piece = 0;
                }
            }
            if let Some(last) = ext.last_mut() {
                // The last extent holds at least one whole granule, so this stays > 0.
                last.len -= fp - len;
            }
            out.push(HostBuffer::new(ext, owner.clone()));
        }
        out
    }

    /// One buffer per entry of `lens`, all or nothing, carved in order from as few ranges
    /// as the free space allows (one, when a single free range holds the whole batch).
    pub(crate) fn allocate_batch(self: &Arc<Self>, lens: &[usize]) -> Option<Vec<HostBuffer>> {
        let mut total = 0usize;
        for &len in lens {
            total = total.checked_add(footprint(len)?)?;
        }
        let pieces = self.reserve(total)?;
        let owner: Arc<dyn HostMemory> = self.clone();
        Some(self.carve(&pieces, lens, &owner))
    }

    /// One buffer per entry of `lens`, all or nothing, each a single extent whose address is a
    /// multiple of `align` (a power of two above [`GRANULE`]). Each buffer is cut from one
    /// free range with room for the alignment; the unaligned head and tail go straight back.
    /// `None` when no shard has such a range for some buffer (nothing stays allocated).
    pub(crate) fn allocate_aligned(
        self: &Arc<Self>,
        lens: &[usize],
        align: usize,
    ) -> Option<Vec<HostBuffer>> {
        debug_assert!(align.is_power_of_two() && align > GRANULE);
        let owner: Arc<dyn HostMemory> = self.clone();
        let mut out = Vec::with_capacity(lens.len());
        for &len in lens {
            let fp = footprint(len)?;
            let want = fp.checked_add(align - GRANULE)?;
            let mut got = None;
            for shard in self.shards.iter() {
                let mut fl = shard.free.lock();
                if fl.free_bytes() < want {
                    continue;
                }
                let Some(off) = fl.take_best_fit(want) else {
                    continue;
                };
                let addr = self.map.addr + off;
                let aligned = addr.next_multiple_of(align) - self.map.addr;
                let (head, tail) = (aligned - off, want - (aligned - off) - fp);
                if head > 0 && fl.give_back(off, head).is_err() {
                    tracing::error!(off, head, "dram pool: aligned head overlaps free memory");
                }
                if tail > 0 && fl.give_back(aligned + fp, tail).is_err() {
                    tracing::error!(off, tail, "dram pool: aligned tail overlaps free memory");
                }
                got = Some(aligned);
                break;
            }
            let Some(off) = got else {
                // Dropping the buffers made so far gives their ranges back.
                return None;
            };
            self.used.fetch_add(fp, Ordering::Relaxed);
            out.push(HostBuffer::single(
                Extent {
                    addr: self.map.addr + off,
                    len,
                },
                owner.clone(),
            ));
        }
        Some(out)
    }

    /// Checks a returned extent and gives the offset and reserved length it stands for.
    fn reserved_range(&self, e: &Extent) -> Option<(usize, usize)> {
        let off = e.addr.checked_sub(self.map.addr)?;
        let len = footprint(e.len)?;
        let ok = e.len > 0 && off.is_multiple_of(GRANULE) && off.checked_add(len)? <= self.capacity;
        ok.then_some((off, len))
    }

    /// Madvises free ranges of at least [`TRIM_MIN_EXTENT`] bytes away; returns bytes advised
    /// (none on reserved huge pages).
    pub(crate) fn trim(&self) -> u64 {
        // Transparent huge pages go back whole only (a partial one would be split). Reserved
        // ones never: a page given back leaves the start-up reservation, and a later fault
        // could find the kernel's huge-page pool empty (SIGBUS).
        let page = match self.backing {
            Backing::Base => base_page(),
            Backing::Transparent => HUGE_PAGE.max(base_page()),
            Backing::Reserved => return 0,
        };
        let mut advised = 0u64;
        for shard in self.shards.iter() {
            let candidates: Vec<(usize, usize)> = shard
                .free
                .lock()
                .ranges()
                .filter(|&(_, l)| l >= TRIM_MIN_EXTENT)
                .collect();
            for (off, len) in candidates {
                // The mapping is aligned to `page`, so aligned offsets are aligned addresses.
                let mut a = off.next_multiple_of(page);
                let end = (off + len) / page * page;
                while a < end {
                    let c = (end - a).min(TRIM_CHUNK);
                    let mut fl = shard.free.lock();
                    // Re-checked under the lock: the range may have been allocated meanwhile.
                    if fl.contains(a, c) {
                        // SAFETY: `[a, a + c)` lies inside the mapping and inside a free range
                        // while the shard lock is held, so no live buffer can be touched;
                        // MADV_DONTNEED on a private anonymous mapping just drops the pages.
                        let rc = unsafe {
                            libc::madvise(
                                (self.map.addr + a) as *mut libc::c_void,
                                c,
                                libc::MADV_DONTNEED,
                            )
                        };
                        if rc == 0 {
                            advised += c as u64;
                        }
                    }
                    drop(fl);
                    a += c;
                }
            }
        }
        advised
    }
}

impl HostMemory for Pool {
    fn release(&self, extents: &[Extent]) {
        if let [_] = extents {
            // The usual case, a buffer of one extent: queued on its shard's free list.
            self.release_many(extents);
            return;
        }
        let Some(first) = extents.first() else {
            return;
        };
        let mut ranges = Vec::with_capacity(extents.len());
        for e in extents {
            match self.reserved_range(e) {
                Some(r) => ranges.push(r),
                None => tracing::error!(
                    addr = e.addr,
                    len = e.len,
                    "dram pool: released extent is not one of ours; leaked"
                ),
            }
        }
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let home = self.shard_index(first.addr.wrapping_sub(self.map.addr));
        let home_shard = &self.shards[home];
        let mut refused = 0;
        if ranges.iter().all(|&(o, l)| home_shard.holds(o, l)) {
            // The usual case: the whole buffer lives in one shard; one lock.
            let mut fl = home_shard.free.lock();
            for &(o, l) in &ranges {
                if fl.give_back(o, l).is_err() {
                    refused += l;
                }
            }
        } else {
            for &(o, l) in &ranges {
                let shard = &self.shards[self.shard_index(o)];
                if !shard.holds(o, l) || shard.free.lock().give_back(o, l).is_err() {
                    refused += l;
                }
            }
        }
        // Counted down only once the bytes are back on the free lists: `used` may briefly
        // over-report, never under-report, so a caller that sees free bytes can allocate them.
        self.used.fetch_sub(total - refused, Ordering::Relaxed);
        if refused > 0 {
            tracing::error!(
                bytes = refused,
                "dram pool: released extents overlap free memory (double free?); ignored"
            );
        }
    }

    /// Buffers of one extent each, queued on their shards' free lists (merged with their
    /// neighbours in one pass later; counted free at once, and every search settles the
    /// queue first), each shard's lock taken once for its run of extents.
    fn release_many(&self, extents: &[Extent]) {
        if let [e] = extents {
            // One buffer: no list to build.
            if let Some((si, o, l)) = self.shard_range(e) {
                self.queue_free(&[(si, o, l)]);
            }
            return;
        }
        // (shard, offset, reserved length) of each extent that is ours, by shard.
        let mut ranges: Vec<(usize, usize, usize)> =
            extents.iter().filter_map(|e| self.shard_range(e)).collect();
        ranges.sort_unstable_by_key(|r| r.0);
        self.queue_free(&ranges);
    }
}

impl Pool {
    /// The shard and reserved range `(shard, offset, length)` of a released single-extent
    /// buffer; `None` (logged: the memory is leaked, never reused wrongly) when it is not
    /// one of ours or crosses its shard.
    fn shard_range(&self, e: &Extent) -> Option<(usize, usize, usize)> {
        let Some((o, l)) = self.reserved_range(e) else {
            tracing::error!(
                addr = e.addr,
                len = e.len,
                "dram pool: released extent is not one of ours; leaked"
            );
            return None;
        };
        let si = self.shard_index(o);
        if !self.shards[si].holds(o, l) {
            tracing::error!(
                bytes = l,
                "dram pool: released extent crosses its shard; leaked"
            );
            return None;
        }
        Some((si, o, l))
    }

    /// Queues `ranges` (`(shard, offset, length)`, grouped by shard) on their shards' free
    /// lists, each shard's lock taken once per run.
    fn queue_free(&self, ranges: &[(usize, usize, usize)]) {
        let (mut released, mut refused) = (0usize, 0usize);
        for run in ranges.chunk_by(|a, b| a.0 == b.0) {
            let mut fl = self.shards[run[0].0].free.lock();
            for &(_, o, l) in run {
                fl.defer(o, l);
                released += l;
            }
            refused += fl.take_refused();
        }
        // A deferred range is counted free at once; one refused while settling is counted
        // back (it had been counted free when queued, maybe by an earlier call). One net
        // adjustment, so that the count never wraps below zero, even for a moment.
        if released >= refused {
            self.used.fetch_sub(released - refused, Ordering::Relaxed);
        } else {
            self.used.fetch_add(refused - released, Ordering::Relaxed);
        }
        if refused > 0 {
            tracing::error!(
                bytes = refused,
                "dram pool: released extents overlap free memory (double free?); ignored"
            );
        }
    }
}
