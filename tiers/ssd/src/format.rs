//! The on-disk format (version 2), little-endian throughout. Every structure carries a magic
//! and a CRC-32C (Castagnoli) of its bytes; nothing is trusted that fails either.
//!
//! Per directory: a superblock (`superblock`, one alignment unit), an owner lock, and
//! segment files of `segment_size` bytes (`segment-NNNNNN.dat`); a store in one file holds
//! the superblock in its first MiB and the segments after it. A segment is:
//!
//! ```text
//! [segment header: 1 alignment unit]
//! [record][record]...            append-only, each record a whole number of alignment units
//! [summary]                      sealed segments: every record's offset and header
//! ...
//! [footer: last alignment unit]  sealed segments: where the summary is
//! ```
//!
//! A record is `header | payload | trailer` padded with zeros to the alignment. The header
//! names the block (namespace, group, hash), its slot layout and payload length, the
//! segment's generation and a store-wide sequence number, and carries its own CRC-32C (so
//! that recovery can walk headers without reading payloads). The trailer holds the
//! **record checksum**: one CRC-32C over the record's place (store id, segment slot, offset
//! in the segment), then the header's bytes (all but its own CRC), then the payload
//! ([`RecordPlace::seed`] and [`record_crc`]). A payload is therefore bound to the header that names it and to the
//! place it was written to: a payload and trailer copied over another record (a misdirected
//! or lost write, an offset bug), a whole record copied to another offset or segment, or a
//! stale record of an earlier generation of the same slot never verifies. A new segment in
//! a reused slot has a higher generation, so stale records behind its append point never
//! parse as its own.
//!
//! Version 1 (before the record checksum covered the header and the place: its trailer held
//! the payload's CRC alone) is not read: a store of version 1 is refused at start with a
//! message that says so ([`FormatError::Version`]), never read under the version-2 rule and
//! never overwritten.

use pegaflow_plugin::block::{BlockKey, BlockShape};

/// Superblock magic.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"PFSSDSB\x01";
/// Segment header magic.
pub const SEGMENT_MAGIC: [u8; 8] = *b"PFSSDSG\x01";
/// Footer magic.
pub const FOOTER_MAGIC: [u8; 8] = *b"PFSSDFT\x01";
/// Record header magic.
pub const RECORD_MAGIC: u32 = 0x5046_5243;
/// Record trailer magic.
pub const TRAILER_MAGIC: u32 = 0x5046_4e44;
/// Summary magic.
pub const SUMMARY_MAGIC: u32 = 0x5046_534d;
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// Domain tag at the start of every record checksum (so that no other structure's bytes
/// can produce one).
const RECORD_CRC_TAG: &[u8; 8] = b"PFSSDRC2";
/// Bytes of a record trailer.
pub const TRAILER_BYTES: usize = 8;
/// Fixed part of a record header (before namespace, hash and slot lengths; without crc).
pub const HEADER_FIXED: usize = 4 + 4 + 8 + 8 + 4 + 2 + 2 + 4 + 8;

/// Why bytes did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Not this structure (wrong magic), or shorter than it says.
    #[error("not a {0}")]
    NotThis(&'static str),
    /// The checksum does not match.
    #[error("{0} checksum mismatch")]
    Checksum(&'static str),
    /// A version this build does not read (version 1: its records' checksums do not bind
    /// the payload to the header and place; a later version: written by a newer build).
    #[error(
        "on-disk format version {0} (this build reads and writes version {FORMAT_VERSION} only)"
    )]
    Version(u32),
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: u64, align: u64) -> u64 {
    (n + align - 1) & !(align - 1)
}

struct W(Vec<u8>);

impl W {
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn crc(mut self) -> Vec<u8> {
        let c = crc32c::crc32c(&self.0);
        self.u32(c);
        self.0
    }
}

struct R<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> R<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Self {
        Self { b, at: 0, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or(FormatError::NotThis(self.what))?;
        self.at += n;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Checks the crc that follows the bytes read so far.
    fn check_crc(&mut self) -> Result<(), FormatError> {
        let body = &self.b[..self.at];
        let c = self.u32()?;
        if crc32c::crc32c(body) != c {
            return Err(FormatError::Checksum(self.what));
        }
        Ok(())
    }
}

/// The directory's (or file's) identity and geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Alignment of every offset and length, bytes.
    pub align: u32,
    /// Bytes per segment.
    pub segment_size: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// Random identity: segments of another store never parse as this one's.
    pub store_id: u64,
}

impl Superblock {
    /// Encoded (unpadded).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(SUPERBLOCK_MAGIC.to_vec());
        w.u32(FORMAT_VERSION);
        w.u32(self.align);
        w.u64(self.segment_size);
        w.u64(self.created_unix);
        w.u64(self.store_id);
        w.crc()
    }

    /// Parses a superblock.
    ///
    /// # Errors
    /// Wrong magic, version or checksum.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut r = R::new(b, "superblock");
        if r.take(8)? != SUPERBLOCK_MAGIC {
            return Err(FormatError::NotThis("superblock"));
        }
        let v = r.u32()?;
        let align = r.u32()?;
        let segment_size = r.u64()?;
        let created_unix = r.u64()?;
        let store_id = r.u64()?;
        r.check_crc()?;
        if v != FORMAT_VERSION {
            return Err(FormatError::Version(v));
        }
        Ok(Self {
            align,
            segment_size,
            created_unix,
            store_id,
        })
    }
}

/// The first alignment unit of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The store it belongs to.
    pub store_id: u64,
    /// Slot number in its directory.
    pub slot: u32,
    /// Store-wide generation (higher = newer); records carry it.
    pub generation: u64,
}

impl SegmentHeader {
    /// Encoded (unpadded).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(SEGMENT_MAGIC.to_vec());
        w.u64(self.store_id);
        w.u32(self.slot);
        w.u64(self.generation);
        w.crc()
    }

    /// Parses a segment header.
    ///
    /// # Errors
    /// Wrong magic or checksum.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut r = R::new(b, "segment header");
        if r.take(8)? != SEGMENT_MAGIC {
            return Err(FormatError::NotThis("segment header"));
        }
        let store_id = r.u64()?;
        let slot = r.u32()?;
        let generation = r.u64()?;
        r.check_crc()?;
        Ok(Self {
            store_id,
            slot,
            generation,
        })
    }
}

/// The header of one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    /// The segment's generation.
    pub generation: u64,
    /// Store-wide sequence number (later writes of a key win at recovery).
    pub seq: u64,
    /// The block's key.
    pub key: BlockKey,
    /// The block's slot lengths.
    pub shape: BlockShape,
}

impl RecordHeader {
    /// Payload bytes (all slots).
    pub fn payload_len(&self) -> u64 {
        self.shape.len_bytes()
    }

    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_FIXED + self.key.namespace.len() + self.key.hash.len() + 8 * self.shape.slots() + 4
    }

    /// Bytes of the whole record on disk (header, payload, trailer, padding).
    pub fn record_len(&self, align: u64) -> u64 {
        align_up(
            (self.encoded_len() + TRAILER_BYTES) as u64 + self.payload_len(),
            align,
        )
    }

    /// Encoded.
    ///
    /// # Panics
    /// A namespace or hash longer than 65,535 bytes (the engine caps hashes at 1 KiB).
    pub fn encode(&self) -> Vec<u8> {
        let ns = self.key.namespace.as_bytes();
        let mut w = W(Vec::with_capacity(self.encoded_len()));
        w.u32(RECORD_MAGIC);
        w.u32(self.encoded_len() as u32);
        w.u64(self.generation);
        w.u64(self.seq);
        w.u32(self.key.group);
        w.u16(u16::try_from(ns.len()).expect("namespace length"));
        w.u16(u16::try_from(self.key.hash.len()).expect("hash length"));
        w.u32(self.shape.slots() as u32);
        w.u64(self.payload_len());
        w.0.extend_from_slice(ns);
        w.0.extend_from_slice(&self.key.hash);
        for &l in self.shape.slot_lens.iter() {
            w.u64(l);
        }
        w.crc()
    }

    /// The header length a record starting with `b` declares (`b` holds at least 8 bytes).
    ///
    /// # Errors
    /// Not a record header.
    pub fn declared_len(b: &[u8]) -> Result<usize, FormatError> {
        let mut r = R::new(b, "record header");
        if r.u32()? != RECORD_MAGIC {
            return Err(FormatError::NotThis("record header"));
        }
        Ok(r.u32()? as usize)
    }

    /// Parses a header at the start of `b`.
    ///
    /// # Errors
    /// Wrong magic, too short, inconsistent lengths, or a checksum mismatch.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut r = R::new(b, "record header");
        if r.u32()? != RECORD_MAGIC {
            return Err(FormatError::NotThis("record header"));
        }
        let len = r.u32()? as usize;
        let generation = r.u64()?;
        let seq = r.u64()?;
        let group = r.u32()?;
        let ns_len = r.u16()? as usize;
        let hash_len = r.u16()? as usize;
        let slots = r.u32()? as usize;
        let payload = r.u64()?;
        if len != HEADER_FIXED + ns_len + hash_len + 8 * slots + 4 || b.len() < len {
            return Err(FormatError::NotThis("record header"));
        }
        let ns = r.take(ns_len)?;
        let hash = r.take(hash_len)?;
        let mut lens = Vec::with_capacity(slots);
        for _ in 0..slots {
            lens.push(r.u64()?);
        }
        r.check_crc()?;
        let namespace =
            std::str::from_utf8(ns).map_err(|_| FormatError::NotThis("record header"))?;
        if lens.iter().sum::<u64>() != payload {
            return Err(FormatError::NotThis("record header"));
        }
        Ok(Self {
            generation,
            seq,
            key: BlockKey {
                namespace: namespace.into(),
                group,
                hash: hash.into(),
            },
            shape: BlockShape::new(lens),
        })
    }
}

/// Where a record lies: what its checksum binds it to besides its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPlace {
    /// The store's identity (from the superblock).
    pub store_id: u64,
    /// The segment slot in its directory (or file).
    pub slot: u32,
    /// Offset of the record from the start of its segment, bytes.
    pub offset: u64,
}

impl RecordPlace {
    /// The record checksum's state after the place and the encoded header `header` (as on
    /// disk, its own CRC included): continue it over the payload with
    /// `crc32c::crc32c_append`, then compare with (or write) the trailer.
    ///
    /// The header's own CRC stays out of the record checksum: a CRC-32C run over bytes that
    /// end in their own CRC-32C reaches the same state whatever those bytes are (the CRC
    /// residue), which would make every header of one length bind alike.
    pub fn seed(&self, header: &[u8]) -> u32 {
        let mut p = [0u8; 28];
        p[..8].copy_from_slice(RECORD_CRC_TAG);
        p[8..16].copy_from_slice(&self.store_id.to_le_bytes());
        p[16..20].copy_from_slice(&self.slot.to_le_bytes());
        p[20..28].copy_from_slice(&self.offset.to_le_bytes());
        let body = &header[..header.len().saturating_sub(4)];
        crc32c::crc32c_append(crc32c::crc32c(&p), body)
    }
}

/// The record checksum of a whole record: place, header (without its own CRC), payload.
pub fn record_crc(place: &RecordPlace, header: &[u8], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(place.seed(header), payload)
}

/// Encodes a record trailer for a record checksum.
pub fn trailer(record_crc: u32) -> [u8; TRAILER_BYTES] {
    let mut t = [0u8; TRAILER_BYTES];
    t[..4].copy_from_slice(&record_crc.to_le_bytes());
    t[4..].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
    t
}

/// Checks a trailer against the record checksum.
pub fn trailer_ok(t: &[u8], record_crc: u32) -> bool {
    t.len() >= TRAILER_BYTES
        && t[..4] == record_crc.to_le_bytes()
        && t[4..8] == TRAILER_MAGIC.to_le_bytes()
}

/// One summary entry: a record's offset in its segment and its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryEntry {
    /// Offset of the record from the start of the segment, bytes.
    pub offset: u64,
    /// Its header.
    pub header: RecordHeader,
}

/// Encodes a sealed segment's summary.
pub fn encode_summary(generation: u64, entries: &[SummaryEntry]) -> Vec<u8> {
    let mut w = W(Vec::new());
    w.u32(SUMMARY_MAGIC);
    w.u64(generation);
    w.u32(entries.len() as u32);
    for e in entries {
        w.u64(e.offset);
        w.0.extend_from_slice(&e.header.encode());
    }
    w.crc()
}

/// Bytes one entry adds to a summary.
pub fn summary_entry_len(h: &RecordHeader) -> usize {
    8 + h.encoded_len()
}

/// Fixed bytes of a summary (magic, generation, count, crc).
pub const SUMMARY_FIXED: usize = 4 + 8 + 4 + 4;

/// Parses a summary of `generation`.
///
/// # Errors
/// Wrong magic, generation or checksum, or an entry that does not parse.
pub fn decode_summary(b: &[u8], generation: u64) -> Result<Vec<SummaryEntry>, FormatError> {
    let mut r = R::new(b, "summary");
    if r.u32()? != SUMMARY_MAGIC {
        return Err(FormatError::NotThis("summary"));
    }
    if r.u64()? != generation {
        return Err(FormatError::NotThis("summary"));
    }
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(1 << 20));
    for _ in 0..n {
        let offset = r.u64()?;
        let rest = &b[r.at..];
        let len = RecordHeader::declared_len(rest)?;
        let header = RecordHeader::decode(rest)?;
        r.take(len)?;
        out.push(SummaryEntry { offset, header });
    }
    r.check_crc()?;
    Ok(out)
}

/// The last alignment unit of a sealed segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    /// The segment's generation.
    pub generation: u64,
    /// Offset of the summary from the start of the segment.
    pub summary_offset: u64,
    /// Bytes of the summary.
    pub summary_len: u64,
}

impl Footer {
    /// Encoded (unpadded).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(FOOTER_MAGIC.to_vec());
        w.u64(self.generation);
        w.u64(self.summary_offset);
        w.u64(self.summary_len);
        w.crc()
    }

    /// Parses a footer.
    ///
    /// # Errors
    /// Wrong magic or checksum.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut r = R::new(b, "footer");
        if r.take(8)? != FOOTER_MAGIC {
            return Err(FormatError::NotThis("footer"));
        }
        let generation = r.u64()?;
        let summary_offset = r.u64()?;
        let summary_len = r.u64()?;
        r.check_crc()?;
        Ok(Self {
            generation,
            summary_offset,
            summary_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(slots: usize) -> RecordHeader {
        RecordHeader {
            generation: 7,
            seq: 42,
            key: BlockKey {
                namespace: "ns".into(),
                group: 0,
                hash: vec![1, 2, 3].into(),
            },
            shape: BlockShape::new((0..slots as u64).map(|i| 100 + i).collect::<Vec<_>>()),
        }
    }

    #[test]
    fn every_structure_round_trips_and_any_flipped_bit_is_refused() {
        let h = header(1500);
        let e = h.encode();
        assert_eq!(e.len(), h.encoded_len());
        assert_eq!(RecordHeader::decode(&e).unwrap(), h);
        for i in [0, 9, 20, e.len() / 2, e.len() - 1] {
            let mut bad = e.clone();
            bad[i] ^= 0x10;
            assert!(RecordHeader::decode(&bad).is_err(), "bit at {i}");
        }
        assert!(RecordHeader::decode(&e[..e.len() - 1]).is_err());
        let sb = Superblock {
            align: 4096,
            segment_size: 1 << 28,
            created_unix: 1,
            store_id: 9,
        };
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
        let sh = SegmentHeader {
            store_id: 9,
            slot: 3,
            generation: 5,
        };
        assert_eq!(SegmentHeader::decode(&sh.encode()).unwrap(), sh);
        let f = Footer {
            generation: 5,
            summary_offset: 4096,
            summary_len: 100,
        };
        let mut fe = f.encode();
        assert_eq!(Footer::decode(&fe).unwrap(), f);
        fe[10] ^= 1;
        assert_eq!(Footer::decode(&fe), Err(FormatError::Checksum("footer")));
        let entries = vec![
            SummaryEntry {
                offset: 4096,
                header: header(2),
            },
            SummaryEntry {
                offset: 8192,
                header: header(3),
            },
        ];
        let s = encode_summary(5, &entries);
        assert_eq!(
            s.len(),
            SUMMARY_FIXED
                + entries
                    .iter()
                    .map(|e| summary_entry_len(&e.header))
                    .sum::<usize>()
        );
        assert_eq!(decode_summary(&s, 5).unwrap(), entries);
        assert!(decode_summary(&s, 6).is_err());
        assert!(trailer_ok(&trailer(77), 77));
        assert!(!trailer_ok(&trailer(77), 78));
    }
}
