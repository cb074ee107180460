//! Checking a record read back: it must parse as the record the index named (same key,
//! generation and slot layout) and its payload must match the trailer's checksum. The
//! payload goes to a [`PayloadSink`] as it is checked.

use pegaflow_runtime::block::{BlockKey, BlockShape};

use crate::format::{trailer_ok, RecordHeader, TRAILER_BYTES};

/// Where a checked payload's bytes go.
pub trait PayloadSink {
    /// Receives `bytes` at `offset` of the payload.
    fn put(&self, offset: usize, bytes: &[u8]);
}

impl PayloadSink for pegaflow_runtime::HostBuffer {
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

/// Checks the record at the start of `b` against what the index expects, copying its payload
/// to `sink`. A failed check may leave part of the sink written (the caller discards it).
///
/// # Errors
/// Why the record is refused (one line).
pub fn check_record(
    b: &[u8],
    key: &BlockKey,
    generation: u64,
    shape: &BlockShape,
    sink: &dyn PayloadSink,
) -> Result<(), String> {
    let h = RecordHeader::decode(b).map_err(|e| e.to_string())?;
    if h.generation != generation {
        return Err(format!(
            "record of generation {} where {generation} was written",
            h.generation
        ));
    }
    if h.key != *key {
        return Err("record of another block".into());
    }
    if h.shape != *shape {
        return Err("record of another slot layout".into());
    }
    let start = h.encoded_len();
    let len = h.payload_len() as usize;
    let Some(payload) = b.get(start..start + len) else {
        return Err("record shorter than its payload".into());
    };
    let Some(t) = b.get(start + len..start + len + TRAILER_BYTES) else {
        return Err("record without its trailer".into());
    };
    // Copy in pieces, checksumming each piece while it is hot in cache.
    const PIECE: usize = 1 << 20;
    let mut crc = 0u32;
    let mut at = 0;
    while at < len {
        let n = PIECE.min(len - at);
        let p = &payload[at..at + n];
        crc = crc32c::crc32c_append(crc, p);
        sink.put(at, p);
        at += n;
    }
    if !trailer_ok(t, crc) {
        return Err("payload checksum mismatch".into());
    }
    Ok(())
}
