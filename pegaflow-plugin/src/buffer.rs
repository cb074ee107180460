//! Host buffers handed out by a host-addressable tier (the landing tier): what transports copy
//! into on Save and out of on Load.
//!
//! A [`HostBuffer`] is a list of extents of one tier's memory; its logical bytes are the
//! extents concatenated. A tier may return several extents when its free space is fragmented,
//! so an allocation never fails while enough bytes are free. Dropping the buffer gives the
//! extents back to the tier.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// One physically contiguous piece of host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Start address (host virtual address).
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The memory a [`HostBuffer`] came from; it takes the extents back on drop.
pub trait HostMemory: Send + Sync {
    /// Returns `extents` (exactly as handed out) to the free pool.
    fn release(&self, extents: &[Extent]);

    /// Returns many buffers at once, each of `extents` the only extent of one buffer (what a
    /// [`ReleaseBatch`] collects). The default releases them one by one; a memory that takes a
    /// lock per release overrides it to take each lock once.
    fn release_many(&self, extents: &[Extent]) {
        for e in extents {
            self.release(std::slice::from_ref(e));
        }
    }
}

/// Extents of buffers dropped on this thread while a [`ReleaseBatch`] is open.
#[derive(Default)]
struct Deferred {
    /// Open batches on this thread (they nest).
    open: u32,
    /// The memory the collected extents go back to (one at a time: a buffer of another
    /// memory sends the collected ones back first).
    owner: Option<Arc<dyn HostMemory>>,
    extents: Vec<Extent>,
}

thread_local! {
    static DEFERRED: RefCell<Deferred> = RefCell::new(Deferred::default());
}

/// While open, the single-extent [`HostBuffer`]s dropped on this thread give their memory
/// back together, in one [`HostMemory::release_many`] call when the last open batch closes
/// (or, for what was collected so far, when a buffer of another memory is dropped), instead
/// of one release each. For a caller that drops many buffers in a row (an eviction batch: 256
/// blocks of 8 KiB would otherwise take the pool's lock 256 times). Not `Send`: it belongs to
/// the thread that opened it.
///
/// Hazards: memory counts as free only once the batch closes, so nothing that waits for free
/// memory (an allocation that evicts) may run inside one ([`ReleaseBatch::is_open`]); and a
/// batch that is leaked (`mem::forget`) defers every later release on its thread for good.
pub struct ReleaseBatch {
    _thread: PhantomData<*const ()>,
}

impl ReleaseBatch {
    /// Opens a batch on the current thread. During the thread's teardown it defers nothing.
    pub fn open() -> Self {
        let _ = DEFERRED.try_with(|d| d.borrow_mut().open += 1);
        Self {
            _thread: PhantomData,
        }
    }

    /// Whether a batch is open on the current thread.
    pub fn is_open() -> bool {
        DEFERRED
            .try_with(|d| d.try_borrow().is_ok_and(|d| d.open > 0))
            .unwrap_or(false)
    }
}

/// Entries of the collected list kept allocated for a thread's next batch.
const KEPT_EXTENTS: usize = 4096;

impl Drop for ReleaseBatch {
    fn drop(&mut self) {
        let taken = DEFERRED.try_with(|d| {
            let mut d = d.borrow_mut();
            // Not counted when opened during teardown.
            if d.open == 0 {
                return None;
            }
            d.open -= 1;
            if d.open > 0 {
                return None;
            }
            let owner = d.owner.take()?;
            Some((owner, std::mem::take(&mut d.extents)))
        });
        if let Ok(Some((owner, extents))) = taken {
            owner.release_many(&extents);
            // The list's allocation is kept for the thread's next batch (up to a bound), in
            // place of the empty one the take above left.
            if extents.capacity() <= KEPT_EXTENTS {
                let mut extents = extents;
                extents.clear();
                let _ = DEFERRED.try_with(|d| {
                    let mut d = d.borrow_mut();
                    if d.extents.is_empty() {
                        d.extents = extents;
                    }
                });
            }
        }
    }
}

/// Collects `e` into the thread's open batch; false when none is open (or the thread is
/// shutting down), and the caller releases it itself.
fn defer_release(owner: &Arc<dyn HostMemory>, e: Extent) -> bool {
    let flushed = DEFERRED.try_with(|d| {
        let Ok(mut d) = d.try_borrow_mut() else {
            return None;
        };
        if d.open == 0 {
            return None;
        }
        let mut flushed = None;
        match &d.owner {
            Some(o) if Arc::ptr_eq(o, owner) => {}
            _ => {
                let old = d.owner.replace(owner.clone());
                let extents = std::mem::take(&mut d.extents);
                flushed = old.map(|o| (o, extents));
            }
        }
        d.extents.push(e);
        Some(flushed)
    });
    match flushed {
        Ok(Some(flushed)) => {
            if let Some((o, extents)) = flushed {
                o.release_many(&extents);
            }
            true
        }
        _ => false,
    }
}

/// A host allocation of `len()` bytes, possibly spread over several extents.
pub struct HostBuffer {
    extents: Extents,
    len: usize,
    owner: Arc<dyn HostMemory>,
}

/// A buffer's extents: the usual single extent inline (no allocation of its own: a Save of
/// 4,096 small blocks makes and later frees 4,096 buffers), several on the heap.
enum Extents {
    One(Extent),
    Many(Box<[Extent]>),
}

impl Extents {
    fn as_slice(&self) -> &[Extent] {
        match self {
            Self::One(e) => std::slice::from_ref(e),
            Self::Many(v) => v,
        }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("extents", &self.extents.as_slice().len())
            .finish()
    }
}

impl HostBuffer {
    /// Wraps extents owned by `owner`. The caller (a tier) guarantees the extents are valid,
    /// writable, disjoint from every other live buffer, and stay so until `owner.release`.
    pub fn new(extents: Vec<Extent>, owner: Arc<dyn HostMemory>) -> Self {
        let len = extents.iter().map(|e| e.len).sum();
        let extents = match extents[..] {
            [e] => Extents::One(e),
            _ => Extents::Many(extents.into_boxed_slice()),
        };
        Self {
            extents,
            len,
            owner,
        }
    }

    /// [`HostBuffer::new`] of one extent, without allocating a list for it.
    pub fn single(extent: Extent, owner: Arc<dyn HostMemory>) -> Self {
        Self {
            len: extent.len,
            extents: Extents::One(extent),
            owner,
        }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The extents, in logical order.
    pub fn extents(&self) -> &[Extent] {
        self.extents.as_slice()
    }

    /// The physical pieces of the logical range `[offset, offset + len)`, in order.
    /// Panics if the range exceeds the buffer (callers compute ranges from validated layouts).
    pub fn pieces(&self, offset: usize, len: usize) -> Pieces<'_> {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "range {offset}+{len} outside a {} byte buffer",
            self.len
        );
        Pieces {
            extents: self.extents.as_slice(),
            idx: 0,
            skip: offset,
            left: len,
        }
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) {
        let mut done = 0;
        for p in self.pieces(offset, src.len()) {
            // SAFETY: the piece lies inside an extent this buffer exclusively owns.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(done), p.addr as *mut u8, p.len)
            };
            done += p.len;
        }
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        let mut done = 0;
        for p in self.pieces(offset, dst.len()) {
            // SAFETY: the piece lies inside an extent this buffer exclusively owns.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    p.addr as *const u8,
                    dst.as_mut_ptr().add(done),
                    p.len,
                )
            };
            done += p.len;
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Extents::One(e) = self.extents {
            if defer_release(&self.owner, e) {
                return;
            }
        }
        self.owner.release(self.extents.as_slice());
    }
}

/// Iterator over the physical pieces of a logical range of a [`HostBuffer`].
#[derive(Debug)]
pub struct Pieces<'a> {
    extents: &'a [Extent],
    idx: usize,
    skip: usize,
    left: usize,
}

impl Iterator for Pieces<'_> {
    type Item = Extent;

    fn next(&mut self) -> Option<Extent> {
        while self.left > 0 && self.idx < self.extents.len() {
            let e = self.extents[self.idx];
            self.idx += 1;
            if self.skip >= e.len {
                self.skip -= e.len;
                continue;
            }
            let take = (e.len - self.skip).min(self.left);
            let out = Extent {
                addr: e.addr + self.skip,
                len: take,
            };
            self.skip = 0;
            self.left -= take;
            return Some(out);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Leak;
    impl HostMemory for Leak {
        fn release(&self, _: &[Extent]) {}
    }

    #[test]
    fn pieces_cross_extents() {
        let mut a = vec![0u8; 10];
        let mut b = vec![0u8; 10];
        let buf = HostBuffer::new(
            vec![
                Extent {
                    addr: a.as_mut_ptr() as usize,
                    len: 10,
                },
                Extent {
                    addr: b.as_mut_ptr() as usize,
                    len: 10,
                },
            ],
            Arc::new(Leak),
        );
        let src: Vec<u8> = (0..12).collect();
        buf.write_at(4, &src);
        let mut out = vec![0u8; 12];
        buf.read_at(4, &mut out);
        assert_eq!(out, src);
        assert_eq!(&a[4..], &src[..6]);
        assert_eq!(&b[..6], &src[6..]);
        assert_eq!(buf.pieces(9, 2).count(), 2);
        assert_eq!(buf.pieces(10, 10).count(), 1);
    }

    /// Records every call: `(which, extents)`, `which` 1 for `release`, 2 for `release_many`.
    #[derive(Default)]
    struct Calls(parking_lot::Mutex<Vec<(u8, Vec<usize>)>>);
    impl HostMemory for Calls {
        fn release(&self, extents: &[Extent]) {
            let addrs = extents.iter().map(|e| e.addr).collect();
            self.0.lock().push((1, addrs));
        }
        fn release_many(&self, extents: &[Extent]) {
            let addrs = extents.iter().map(|e| e.addr).collect();
            self.0.lock().push((2, addrs));
        }
    }

    fn one(addr: usize, owner: &Arc<Calls>) -> HostBuffer {
        HostBuffer::new(vec![Extent { addr, len: 8 }], owner.clone())
    }

    fn calls(m: &Calls) -> Vec<(u8, Vec<usize>)> {
        std::mem::take(&mut *m.0.lock())
    }

    #[test]
    fn a_release_batch_gives_single_extent_buffers_back_together_when_it_closes() {
        let m = Arc::new(Calls::default());
        // No batch: released at once.
        drop(one(0x100, &m));
        assert_eq!(calls(&m), vec![(1, vec![0x100])]);
        {
            let _outer = ReleaseBatch::open();
            drop(one(0x200, &m));
            {
                let _inner = ReleaseBatch::open();
                drop(one(0x300, &m));
            }
            // Nested: nothing goes back before the outermost batch closes.
            assert!(calls(&m).is_empty());
            // A buffer of several extents is released at once, by itself.
            drop(HostBuffer::new(
                vec![
                    Extent {
                        addr: 0x400,
                        len: 8,
                    },
                    Extent {
                        addr: 0x500,
                        len: 8,
                    },
                ],
                m.clone(),
            ));
            assert_eq!(calls(&m), vec![(1, vec![0x400, 0x500])]);
            drop(one(0x600, &m));
        }
        assert_eq!(calls(&m), vec![(2, vec![0x200, 0x300, 0x600])]);
        // Closed: back to one release per buffer.
        drop(one(0x700, &m));
        assert_eq!(calls(&m), vec![(1, vec![0x700])]);
    }

    #[test]
    fn a_release_batch_sends_each_memorys_extents_back_to_it() {
        let (a, b) = (Arc::new(Calls::default()), Arc::new(Calls::default()));
        {
            let _batch = ReleaseBatch::open();
            drop(one(0x10, &a));
            drop(one(0x20, &a));
            // Another memory's buffer: what was collected for the first goes back first.
            drop(one(0x30, &b));
            assert_eq!(calls(&a), vec![(2, vec![0x10, 0x20])]);
            drop(one(0x40, &a));
            assert_eq!(calls(&b), vec![(2, vec![0x30])]);
        }
        assert_eq!(calls(&a), vec![(2, vec![0x40])]);
        assert!(calls(&b).is_empty());
    }

    #[test]
    fn the_default_release_many_releases_each_extent_as_its_own_buffer() {
        struct Each(parking_lot::Mutex<Vec<usize>>);
        impl HostMemory for Each {
            fn release(&self, extents: &[Extent]) {
                assert_eq!(extents.len(), 1);
                self.0.lock().push(extents[0].addr);
            }
        }
        let m = Arc::new(Each(parking_lot::Mutex::new(Vec::new())));
        {
            let _batch = ReleaseBatch::open();
            for addr in [1, 2, 3] {
                drop(HostBuffer::new(vec![Extent { addr, len: 1 }], m.clone()));
            }
            assert!(m.0.lock().is_empty());
        }
        assert_eq!(*m.0.lock(), vec![1, 2, 3]);
    }
}
