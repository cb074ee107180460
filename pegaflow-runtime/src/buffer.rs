//! Host buffers handed out by a host-addressable tier (the landing tier): what transports copy
//! into on Save and out of on Load.
//!
//! A [`HostBuffer`] is a list of extents of one tier's memory; its logical bytes are the
//! extents concatenated. A tier may return several extents when its free space is fragmented,
//! so an allocation never fails while enough bytes are free. Dropping the buffer gives the
//! extents back to the tier.

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
}
