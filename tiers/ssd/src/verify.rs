//! Checking a record read back: it must parse as the record the index named (same key,
//! generation and slot layout) and its trailer must match the record checksum over its place,
//! its header's bytes and its payload ([`crate::format::RecordPlace`]). The payload goes to a
//! [`PayloadSink`] as it is checked; a refused record's partial copy is the caller's to
//! discard (the tier never indexes or reports it).

use pegaflow_plugin::block::{BlockKey, BlockShape};

use crate::format::{trailer_ok, RecordHeader, RecordPlace, TRAILER_BYTES};

/// Where a checked payload's bytes go.
pub trait PayloadSink {
    /// Receives `bytes` at `offset` of the payload.
    fn put(&self, offset: usize, bytes: &[u8]);
}

impl PayloadSink for pegaflow_plugin::HostBuffer {
    fn put(&self, offset: usize, bytes: &[u8]) {
        self.write_at(offset, bytes);
    }
}

/// A sink that keeps nothing (recovery's payload verification).
#[derive(Debug)]
pub struct Discard;

impl PayloadSink for Discard {
    fn put(&self, _: usize, _: &[u8]) {}
}

/// Why a record read back was refused. [`Refused::why`] is the `why` label of
/// `pegaflow_ssd_corrupt_records_total`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The bytes at the record's place do not parse as a record header (wrong magic,
    /// inconsistent lengths, header checksum).
    #[error("no record header where the index has one: {0}")]
    Header(String),
    /// A whole record, but not the one the index names: another block, generation or slot
    /// layout.
    #[error("{0}")]
    Identity(String),
    /// The record checksum fails: the payload (or trailer) is not the one written with this
    /// header at this place — a misdirected or lost write, a torn write, rotten bytes.
    #[error("record checksum mismatch (payload not written with this header at this place)")]
    Checksum,
    /// Fewer bytes than the header declares.
    #[error("{0}")]
    Short(&'static str),
}

impl Refused {
    /// `header`, `identity`, `checksum` or `short`.
    pub fn why(&self) -> &'static str {
        match self {
            Self::Header(_) => "header",
            Self::Identity(_) => "identity",
            Self::Checksum => "checksum",
            Self::Short(_) => "short",
        }
    }
}

/// What the index expects of the record at a place.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// The block's key.
    pub key: &'a BlockKey,
    /// The generation of the segment the record was written to.
    pub generation: u64,
    /// The block's slot lengths.
    pub shape: &'a BlockShape,
    /// Where the record was written.
    pub place: RecordPlace,
}

/// Checks the record at the start of `b` against `expect`, copying its payload to `sink`.
/// A failed check may leave part of the sink written (the caller discards it).
///
/// # Errors
/// Why the record is refused.
pub fn check_record(
    b: &[u8],
    expect: &Expected<'_>,
    sink: &dyn PayloadSink,
) -> Result<(), Refused> {
    let h = RecordHeader::decode(b).map_err(|e| Refused::Header(e.to_string()))?;
    if h.generation != expect.generation {
        return Err(Refused::Identity(format!(
            "record of generation {} where {} was written",
            h.generation, expect.generation
        )));
    }
    if h.key != *expect.key {
        return Err(Refused::Identity("record of another block".into()));
    }
    if h.shape != *expect.shape {
        return Err(Refused::Identity("record of another slot layout".into()));
    }
    let start = h.encoded_len();
    let len = h.payload_len() as usize;
    let Some(payload) = b.get(start..start + len) else {
        return Err(Refused::Short("record shorter than its payload"));
    };
    let Some(t) = b.get(start + len..start + len + TRAILER_BYTES) else {
        return Err(Refused::Short("record without its trailer"));
    };
    // Copy in pieces, checksumming each piece while it is hot in cache.
    const PIECE: usize = 1 << 20;
    let mut crc = expect.place.seed(&b[..start]);
    let mut at = 0;
    while at < len {
        let n = PIECE.min(len - at);
        let p = &payload[at..at + n];
        crc = crc32c::crc32c_append(crc, p);
        sink.put(at, p);
        at += n;
    }
    if !trailer_ok(t, crc) {
        return Err(Refused::Checksum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The binding at the byte level: records encoded at their places, then every kind of
    //! misplaced bytes the tier-level test (`tests/misplaced.rs`) makes on disk.

    use super::*;
    use crate::format::{align_up, record_crc, trailer};
    use proptest::prelude::*;

    const ALIGN: u64 = 512;

    struct Rec {
        key: BlockKey,
        shape: BlockShape,
        generation: u64,
        place: RecordPlace,
        bytes: Vec<u8>,
        hlen: usize,
    }

    fn encode(id: u64, generation: u64, seq: u64, slot: u32, offset: u64, payload: &[u8]) -> Rec {
        let key = BlockKey {
            namespace: "ns".into(),
            group: 0,
            hash: id.to_le_bytes().to_vec().into(),
        };
        let shape = BlockShape::new(vec![payload.len() as u64]);
        let h = RecordHeader {
            generation,
            seq,
            key: key.clone(),
            shape: shape.clone(),
        };
        let hb = h.encode();
        let place = RecordPlace {
            store_id: 7,
            slot,
            offset,
        };
        let mut bytes = hb.clone();
        bytes.extend_from_slice(payload);
        bytes.extend_from_slice(&trailer(record_crc(&place, &hb, payload)));
        bytes.resize(h.record_len(ALIGN) as usize, 0);
        Rec {
            key,
            shape,
            generation,
            place,
            hlen: hb.len(),
            bytes,
        }
    }

    fn check(r: &Rec, bytes: &[u8]) -> Result<(), Refused> {
        check_record(
            bytes,
            &Expected {
                key: &r.key,
                generation: r.generation,
                shape: &r.shape,
                place: r.place,
            },
            &Discard,
        )
    }

    /// Payload and trailer of `src` over `dst`'s (same payload length).
    fn payload_over(dst: &Rec, src: &Rec) -> Vec<u8> {
        let mut out = dst.bytes.clone();
        let n = src.bytes.len() - src.hlen;
        out[dst.hlen..dst.hlen + n].copy_from_slice(&src.bytes[src.hlen..]);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the payloads (equal ones included), a record checks only at the place
        /// and under the header it was written with.
        #[test]
        fn misplaced_bytes_never_verify(
            len in 1usize..3000,
            fill_a in any::<u8>(),
            fill_b in any::<u8>(),
            slot_a in 0u32..4,
            slot_b in 0u32..4,
            off_a in 1u64..64,
            off_b in 1u64..64,
            gen in 2u64..100,
        ) {
            let pa: Vec<u8> = (0..len).map(|i| fill_a.wrapping_add(i as u8)).collect();
            let pb: Vec<u8> = (0..len).map(|i| fill_b.wrapping_add((i * 3) as u8)).collect();
            let a = encode(1, gen, 10, slot_a, off_a * ALIGN, &pa);
            let b = encode(2, gen, 11, slot_b, off_b * ALIGN, &pb);
            prop_assert_eq!(check(&a, &a.bytes), Ok(()));
            prop_assert_eq!(check(&b, &b.bytes), Ok(()));
            // Another record's payload and trailer, same size (any segment, any offset).
            prop_assert_eq!(check(&b, &payload_over(&b, &a)), Err(Refused::Checksum));
            prop_assert_eq!(check(&a, &payload_over(&a, &b)), Err(Refused::Checksum));
            // The same block's whole record, read at another place (offset or segment).
            if (slot_a, off_a) != (slot_b, off_b) {
                let moved = Rec { place: b.place, ..encode(1, gen, 10, slot_a, off_a * ALIGN, &pa) };
                prop_assert_eq!(check(&moved, &a.bytes), Err(Refused::Checksum));
            }
            // A stale record of an earlier generation of the same slot and offset: its whole
            // record fails identity; its payload and trailer under the live header fail the
            // checksum, even with identical payload bytes.
            let stale = encode(1, gen - 1, 3, slot_a, off_a * ALIGN, &pa);
            prop_assert!(matches!(check(&a, &stale.bytes), Err(Refused::Identity(_))));
            prop_assert_eq!(check(&a, &payload_over(&a, &stale)), Err(Refused::Checksum));
            // Another block's whole record where this one is expected: identity.
            prop_assert!(matches!(check(&a, &b.bytes), Err(Refused::Identity(_))));
            prop_assert_eq!(align_up(a.bytes.len() as u64, ALIGN), a.bytes.len() as u64);
        }
    }
}
