//! Blocks as the store and the tiers see them: the key `(namespace, group, hash)`, a sealed
//! block's slots in host buffers, and its shape (slot lengths).
//!
//! Owns nothing but vocabulary. A [`SealedBlock`] is immutable once built: its slot bytes are
//! never written again, so any number of readers (loads, demotions, peers) may read it while
//! they hold an `Arc`. Dropping the last `Arc` frees its host buffers.

use std::sync::Arc;
use std::time::Instant;

use hashbrown::Equivalent;

use crate::buffer::{Extent, HostBuffer};

/// An owned block key: a block is shared only between instances of one namespace, and every
/// storage group has its own key space.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// Cache namespace.
    pub namespace: Arc<str>,
    /// Storage group (0 for non-hybrid models).
    pub group: u32,
    /// The engine's content hash (opaque bytes, at most 1 KiB).
    pub hash: Box<[u8]>,
}

/// A borrowed key, hashing exactly like [`BlockKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyRef<'a> {
    /// Cache namespace.
    pub namespace: &'a str,
    /// Storage group.
    pub group: u32,
    /// The hash.
    pub hash: &'a [u8],
}

impl Equivalent<BlockKey> for KeyRef<'_> {
    fn equivalent(&self, key: &BlockKey) -> bool {
        self.group == key.group && *self.namespace == *key.namespace && self.hash == &*key.hash
    }
}

// `Hash` of BlockKey (Arc<str>, u32, Box<[u8]>) and KeyRef (&str, u32, &[u8]) feed the hasher
// the same sequence, so the derived impls agree, as `Equivalent` requires.

impl BlockKey {
    /// The borrowed form.
    pub fn as_ref(&self) -> KeyRef<'_> {
        KeyRef {
            namespace: &self.namespace,
            group: self.group,
            hash: &self.hash,
        }
    }
}

impl KeyRef<'_> {
    /// The owned form.
    pub fn to_owned(self) -> BlockKey {
        BlockKey {
            namespace: self.namespace.into(),
            group: self.group,
            hash: self.hash.into(),
        }
    }
}

/// One stored slot of a sealed block: `len` bytes at `offset` in `buf`.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The host buffer holding the bytes (shared by the slots of one block's save).
    pub buf: Arc<HostBuffer>,
    /// Offset in `buf`, in bytes.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The shape of a block: the length in bytes of each of its slots, in slot order. Two blocks
/// under one key always have the same shape unless two instances of different layouts share
/// a namespace; loads check it against the loading instance's topology.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockShape {
    /// Bytes per slot, in slot order.
    pub slot_lens: Arc<[u64]>,
}

impl BlockShape {
    /// A shape of the given slot lengths (bytes).
    pub fn new(slot_lens: impl Into<Arc<[u64]>>) -> Self {
        Self {
            slot_lens: slot_lens.into(),
        }
    }

    /// Total bytes of the block (all slots).
    pub fn len_bytes(&self) -> u64 {
        self.slot_lens.iter().sum()
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slot_lens.len()
    }
}

/// A sealed block's slots, in slot index order. Up to [`INLINE_SLOTS`] live inside the
/// block's own allocation (an 8 KiB block of one layer has one or two), so sealing such a
/// block allocates once and evicting it frees once and touches one less cache line; longer
/// lists (a block of many layers) are on the heap as before. Build one with `collect()` or
/// `SlotList::from_vec`.
pub type SlotList = smallvec::SmallVec<[Slot; INLINE_SLOTS]>;

/// How many slots a [`SlotList`] holds inline (48 bytes of slots on 64-bit targets).
pub const INLINE_SLOTS: usize = 2;

/// An immutable, complete block: every slot of its group saved.
#[derive(Debug)]
pub struct SealedBlock {
    /// The storage group the block belongs to.
    pub group: u32,
    /// Slots by slot index.
    pub slots: SlotList,
    /// Host-pool bytes the block occupies (after the pool's rounding).
    pub footprint: u64,
    /// When it was sealed (or promoted into host memory).
    pub sealed_at: Instant,
}

impl SealedBlock {
    /// The block's shape.
    pub fn shape(&self) -> BlockShape {
        BlockShape::new(
            self.slots
                .iter()
                .map(|s| s.len as u64)
                .collect::<Vec<u64>>(),
        )
    }

    /// Total bytes of all slots.
    pub fn len_bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.len as u64).sum()
    }

    /// The host pieces holding the block's bytes, slots concatenated in slot order: what a
    /// tier writes (an iovec list). Valid while the caller holds the block.
    pub fn pieces(&self) -> Vec<Extent> {
        let mut out = Vec::with_capacity(self.slots.len());
        for s in self.slots.iter() {
            out.extend(s.buf.pieces(s.offset, s.len));
        }
        out
    }

    /// Copies the block's bytes (slots concatenated) into `dst`, which must be exactly
    /// [`SealedBlock::len_bytes`] long.
    ///
    /// # Panics
    /// When `dst` has another length.
    pub fn read_all(&self, dst: &mut [u8]) {
        assert_eq!(dst.len() as u64, self.len_bytes(), "destination length");
        let mut at = 0;
        for s in self.slots.iter() {
            s.buf.read_at(s.offset, &mut dst[at..at + s.len]);
            at += s.len;
        }
    }

    /// A block of `shape` whose slots lie back to back in `buf` (a block read from a lower
    /// tier into one host buffer).
    ///
    /// # Panics
    /// When `buf` is shorter than the shape.
    pub fn from_buffer(
        group: u32,
        shape: &BlockShape,
        buf: Arc<HostBuffer>,
        footprint: u64,
    ) -> Self {
        assert!(
            buf.len() as u64 >= shape.len_bytes(),
            "buffer too short for the shape"
        );
        let mut off = 0usize;
        let slots = shape
            .slot_lens
            .iter()
            .map(|&l| {
                let s = Slot {
                    buf: buf.clone(),
                    offset: off,
                    len: l as usize,
                };
                off += l as usize;
                s
            })
            .collect();
        Self {
            group,
            slots,
            footprint,
            sealed_at: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::HostMemory;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts releases; the bytes belong to the test.
    #[derive(Default)]
    struct Count(AtomicUsize);
    impl HostMemory for Count {
        fn release(&self, _: &[Extent]) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Slot lists at, below and above the inline capacity read back in slot order, report
    /// their shape, and give their one buffer back exactly once when the block goes.
    #[test]
    fn blocks_of_inline_and_spilled_slot_lists_read_back_and_release_once() {
        for lens in [vec![7u64], vec![5, 9], vec![3, 1, 4, 1, 5]] {
            let shape = BlockShape::new(lens.clone());
            let total = shape.len_bytes() as usize;
            let mut bytes: Vec<u8> = (0..total as u8).map(|i| i.wrapping_mul(31)).collect();
            let mem = Arc::new(Count::default());
            let buf = Arc::new(HostBuffer::new(
                vec![Extent {
                    addr: bytes.as_mut_ptr() as usize,
                    len: total,
                }],
                mem.clone(),
            ));
            let block = SealedBlock::from_buffer(3, &shape, buf, 64);
            assert_eq!(block.slots.spilled(), lens.len() > INLINE_SLOTS);
            assert_eq!(block.shape(), shape);
            assert_eq!(block.len_bytes(), total as u64);
            let mut out = vec![0u8; total];
            block.read_all(&mut out);
            assert_eq!(out, bytes);
            let pieces = block.pieces();
            assert_eq!(pieces.len(), lens.len());
            assert_eq!(pieces[lens.len() - 1].len as u64, lens[lens.len() - 1]);
            assert_eq!(mem.0.load(Ordering::SeqCst), 0);
            drop(block);
            assert_eq!(mem.0.load(Ordering::SeqCst), 1, "slots {lens:?}");
        }
    }
}
