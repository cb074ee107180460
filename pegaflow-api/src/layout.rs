//! One registered layer's block layout: where each block's segments live inside the layer's
//! registered memory, with every bound checked once at registration.
//!
//! Addressing follows PegaFlow (`pegaflow-behavior.md` §2.3): segment `s` of block `b` starts at
//! `b * block_stride + s * kv_stride` from the layer's block 0.
//! - *Contiguous* (`segments == 1`, or `kv_stride == bytes_per_block`): one range of
//!   `segments * bytes_per_block` bytes per block; the implicit block stride is that extent.
//! - *Split* (`segments == 2`, `kv_stride > bytes_per_block`): K at `b * stride`, V at
//!   `b * stride + kv_stride`; the implicit block stride is `bytes_per_block` (vLLM's KV-first
//!   `[2, num_blocks, ...]` tensor).
//!
//! An explicit block stride (native registrations) replaces the implicit one.

/// Why a layer's layout was refused. Every variant names the offending values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A size that must be positive was zero.
    #[error("{0} must be > 0")]
    Zero(&'static str),
    /// `segments` was neither 1 nor 2.
    #[error("segments must be 1 or 2, got {0}")]
    Segments(u32),
    /// The K-to-V distance does not fit the segment count.
    #[error("kv_stride_bytes {kv_stride} is invalid for {segments} segment(s) of {segment} bytes")]
    KvStride {
        /// kv_stride_bytes.
        kv_stride: u64,
        /// bytes_per_block.
        segment: u64,
        /// segments.
        segments: u32,
    },
    /// The explicit block stride is smaller than one block's extent, or segments overlap.
    #[error("block_stride_bytes {stride} makes blocks overlap (block extent {extent} bytes)")]
    Overlap {
        /// The block stride.
        stride: u64,
        /// The bytes one block spans.
        extent: u64,
    },
    /// Address arithmetic overflowed u64.
    #[error("layout arithmetic overflows")]
    Overflow,
    /// The last addressed byte lies past the registered memory.
    #[error("layout needs {needed} bytes but the registered memory holds {available}")]
    OutOfBounds {
        /// Bytes the layout addresses.
        needed: u64,
        /// Bytes registered.
        available: u64,
    },
}

/// A byte range relative to a layer's block 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentRange {
    /// Offset in bytes from the layer's block 0.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A validated per-layer layout. Construct it with [`KvLayout::new`]; every block id below
/// `num_blocks` then addresses only bytes inside `[0, span_bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    num_blocks: u64,
    segment_bytes: u64,
    segments: u32,
    kv_stride_bytes: u64,
    block_stride_bytes: u64,
    contiguous: bool,
}

impl KvLayout {
    /// Validates a layout against `available_bytes` of registered memory.
    ///
    /// `bytes_per_block` is ONE segment (K alone for split layouts), as on the wire.
    /// `block_stride_bytes` is `None` for the implicit stride (the Python path).
    pub fn new(
        num_blocks: u64,
        bytes_per_block: u64,
        segments: u32,
        kv_stride_bytes: u64,
        block_stride_bytes: Option<u64>,
        available_bytes: u64,
    ) -> Result<Self, LayoutError> {
        if num_blocks == 0 {
            return Err(LayoutError::Zero("num_blocks"));
        }
        if bytes_per_block == 0 {
            return Err(LayoutError::Zero("bytes_per_block"));
        }
        if !(1..=2).contains(&segments) {
            return Err(LayoutError::Segments(segments));
        }
        let kv_err = LayoutError::KvStride {
            kv_stride: kv_stride_bytes,
            segment: bytes_per_block,
            segments,
        };
        let contiguous = if segments == 1 {
            // kv_stride is meaningless with one segment; PegaFlow accepts 0 or the segment size.
            if kv_stride_bytes != 0 && kv_stride_bytes != bytes_per_block {
                return Err(kv_err);
            }
            true
        } else if kv_stride_bytes < bytes_per_block {
            return Err(kv_err);
        } else {
            kv_stride_bytes == bytes_per_block
        };
        let extent = if contiguous {
            bytes_per_block
                .checked_mul(segments as u64)
                .ok_or(LayoutError::Overflow)?
        } else {
            bytes_per_block
        };
        let stride = block_stride_bytes.unwrap_or(extent);
        if stride == 0 {
            return Err(LayoutError::Zero("block_stride_bytes"));
        }
        if stride < extent {
            return Err(LayoutError::Overlap { stride, extent });
        }
        let last_block = (num_blocks - 1)
            .checked_mul(stride)
            .ok_or(LayoutError::Overflow)?;
        if !contiguous {
            // V segments must not overlap any K segment: either V sits inside each block's
            // stride gap, or all V segments lie after the last K segment.
            let k_end = last_block
                .checked_add(bytes_per_block)
                .ok_or(LayoutError::Overflow)?;
            let inside_gap = kv_stride_bytes
                .checked_add(bytes_per_block)
                .is_some_and(|e| e <= stride);
            if !inside_gap && kv_stride_bytes < k_end {
                return Err(LayoutError::Overlap {
                    stride: kv_stride_bytes,
                    extent: k_end,
                });
            }
        }
        let needed = if contiguous {
            last_block.checked_add(extent)
        } else {
            last_block
                .checked_add(kv_stride_bytes)
                .and_then(|v| v.checked_add(bytes_per_block))
        }
        .ok_or(LayoutError::Overflow)?;
        if needed > available_bytes {
            return Err(LayoutError::OutOfBounds {
                needed,
                available: available_bytes,
            });
        }
        Ok(Self {
            num_blocks,
            segment_bytes: bytes_per_block,
            segments,
            kv_stride_bytes,
            block_stride_bytes: stride,
            contiguous,
        })
    }

    /// Number of blocks the layer holds.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes of one segment.
    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Segments per block (1 or 2).
    pub fn segments(&self) -> u32 {
        self.segments
    }

    /// Byte distance from a block's K segment to its V segment (0 with one segment).
    pub fn kv_stride_bytes(&self) -> u64 {
        self.kv_stride_bytes
    }

    /// Byte distance from block `b` to block `b + 1`.
    pub fn block_stride_bytes(&self) -> u64 {
        self.block_stride_bytes
    }

    /// Whether a block is one contiguous range in device memory.
    pub fn is_contiguous(&self) -> bool {
        self.contiguous
    }

    /// Bytes one block occupies in host storage: all its segments, packed.
    pub fn block_bytes(&self) -> u64 {
        self.segment_bytes * self.segments as u64
    }

    /// The device-side ranges of `block_id`, in host-storage order (K then V), merged into one
    /// range when contiguous. `None` when `block_id >= num_blocks`.
    pub fn ranges(&self, block_id: u64) -> Option<impl Iterator<Item = SegmentRange> + '_> {
        if block_id >= self.num_blocks {
            return None;
        }
        let base = block_id * self.block_stride_bytes;
        let (count, len) = if self.contiguous {
            (1, self.block_bytes())
        } else {
            (self.segments as u64, self.segment_bytes)
        };
        Some((0..count).map(move |s| SegmentRange {
            offset: base + s * self.kv_stride_bytes,
            len,
        }))
    }

    /// Whether two layers store identically shaped blocks (same segment size and count, so a
    /// block saved through one can be loaded through the other).
    pub fn same_geometry(&self, other: &KvLayout) -> bool {
        self.segment_bytes == other.segment_bytes
            && self.segments == other.segments
            && self.contiguous == other.contiguous
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_two_segments_is_one_range() {
        let l = KvLayout::new(4, 100, 2, 100, None, 800).unwrap();
        assert!(l.is_contiguous());
        let r: Vec<_> = l.ranges(3).unwrap().collect();
        assert_eq!(
            r,
            vec![SegmentRange {
                offset: 600,
                len: 200
            }]
        );
        assert!(l.ranges(4).is_none());
    }

    #[test]
    fn split_kv_first_layout() {
        // [2, 4 blocks, 64 bytes]: kv_stride = 4 * 64.
        let l = KvLayout::new(4, 64, 2, 256, None, 512).unwrap();
        assert!(!l.is_contiguous());
        let r: Vec<_> = l.ranges(1).unwrap().collect();
        assert_eq!(
            r,
            vec![
                SegmentRange {
                    offset: 64,
                    len: 64
                },
                SegmentRange {
                    offset: 320,
                    len: 64
                }
            ]
        );
        assert_eq!(l.block_bytes(), 128);
    }

    #[test]
    fn rejects_bad_layouts() {
        assert_eq!(
            KvLayout::new(0, 1, 1, 0, None, 10),
            Err(LayoutError::Zero("num_blocks"))
        );
        assert!(matches!(
            KvLayout::new(1, 8, 3, 8, None, 100),
            Err(LayoutError::Segments(3))
        ));
        assert!(matches!(
            KvLayout::new(1, 8, 2, 0, None, 100),
            Err(LayoutError::KvStride { .. })
        ));
        assert!(matches!(
            KvLayout::new(1, 8, 1, 16, None, 100),
            Err(LayoutError::KvStride { .. })
        ));
        // Split with V overlapping later K blocks.
        assert!(matches!(
            KvLayout::new(4, 64, 2, 128, None, 1024),
            Err(LayoutError::Overlap { .. })
        ));
        // One byte short.
        assert_eq!(
            KvLayout::new(4, 64, 2, 256, None, 511),
            Err(LayoutError::OutOfBounds {
                needed: 512,
                available: 511
            })
        );
        assert_eq!(
            KvLayout::new(u64::MAX, 2, 1, 0, None, u64::MAX),
            Err(LayoutError::Overflow)
        );
        assert!(matches!(
            KvLayout::new(2, 64, 2, 64, Some(100), 1000),
            Err(LayoutError::Overlap { .. })
        ));
    }

    #[test]
    fn explicit_stride_interleaved_split() {
        // K at 0, V at 64, stride 256: V sits in each block's gap.
        let l = KvLayout::new(3, 64, 2, 64 + 32, Some(256), 3 * 256).unwrap();
        let r: Vec<_> = l.ranges(2).unwrap().collect();
        assert_eq!(r[0].offset, 512);
        assert_eq!(r[1].offset, 512 + 96);
    }
}
