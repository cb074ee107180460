//! The data port's framing: fixed little-endian headers, bounded bodies.
//!
//! Requester → source, one request at a time per connection:
//! `magic u32 | op u8 | 0 0 0 | body_len u32`, then `body_len` bytes:
//! - [`Op::Hello`] (first frame of a connection, once): the requester id (UTF-8, ≤
//!   [`MAX_ID_BYTES`]). The source acknowledges with an empty OK response, after which the
//!   requester's transfer sessions are bound to the connection: when the requester's last
//!   connection closes, its sessions are released at once. A source at one of its
//!   connection caps answers [`Status::Busy`] with a message instead (also unasked, on
//!   arrival) and closes the connection.
//! - [`Op::Read`]: `seq u64 | session_len u16 | session | n u32 | n × (addr u64, len u64)`.
//!   The source checks that every range lies inside a slot of a block locked under the
//!   session (and renews the session's lease), then answers.
//!
//! Source → requester: `magic u32 | status u8 | 0 0 0 | seq u64 | len u64`, then `len` bytes:
//! the ranges' bytes back to back for [`Status::Ok`], a UTF-8 message (≤ 1 KiB) otherwise.
//!
//! Must never: accept a body longer than [`MAX_BODY_BYTES`] or a message the reader cannot
//! bound before allocating.

/// "PFTD" little-endian.
pub const MAGIC: u32 = u32::from_le_bytes(*b"PFTD");
/// Request header bytes.
pub const REQ_HEADER: usize = 12;
/// Response header bytes.
pub const RESP_HEADER: usize = 24;
/// Largest request body (a read of 65,536 ranges and change).
pub const MAX_BODY_BYTES: usize = 16 + 2 + MAX_ID_BYTES + 4 + MAX_RANGES * 16;
/// Largest requester or session id.
pub const MAX_ID_BYTES: usize = 256;
/// Ranges per read request, at most.
pub const MAX_RANGES: usize = 65_536;
/// Longest error message in a response.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// A request's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Names the requester (first frame).
    Hello = 1,
    /// Reads ranges of a locked session.
    Read = 2,
}

/// A response's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The bytes follow.
    Ok = 0,
    /// The session is unknown or expired.
    NoSession = 1,
    /// A range lies outside the session's locked blocks.
    OutOfBounds = 2,
    /// The request was malformed.
    BadRequest = 3,
    /// The connection was refused at one of the source's connection caps (the message
    /// names it).
    Busy = 4,
}

impl Status {
    /// The status of a wire byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Status::Ok,
            1 => Status::NoSession,
            2 => Status::OutOfBounds,
            3 => Status::BadRequest,
            4 => Status::Busy,
            _ => return None,
        })
    }
}

/// One range of a read request: `len` bytes at `addr` in the source's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Address in the source's address space.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// A decoded read request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// Matches the response to the request.
    pub seq: u64,
    /// The transfer session the ranges are locked under.
    pub session: String,
    /// The ranges, answered back to back in this order.
    pub ranges: Vec<Range>,
}

/// Encodes a request header.
pub fn request_header(op: Op, body_len: usize) -> [u8; REQ_HEADER] {
    let mut h = [0u8; REQ_HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = op as u8;
    h[8..12].copy_from_slice(&(body_len as u32).to_le_bytes());
    h
}

/// Decodes a request header: the op byte and the body length, or why it is refused.
pub fn parse_request_header(h: &[u8; REQ_HEADER]) -> Result<(u8, usize), String> {
    let magic = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    if magic != MAGIC {
        return Err(format!("bad magic {magic:#x}"));
    }
    let len = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
    if len > MAX_BODY_BYTES {
        return Err(format!(
            "body of {len} bytes exceeds the limit of {MAX_BODY_BYTES}"
        ));
    }
    Ok((h[4], len))
}

/// Encodes a whole read request (header and body).
///
/// # Panics
/// When the session id or the range count exceed the wire's bounds (the fetcher checks
/// both before).
pub fn encode_read(seq: u64, session: &str, ranges: &[Range]) -> Vec<u8> {
    assert!(session.len() <= MAX_ID_BYTES && ranges.len() <= MAX_RANGES);
    let body_len = 8 + 2 + session.len() + 4 + ranges.len() * 16;
    let mut v = Vec::with_capacity(REQ_HEADER + body_len);
    v.extend_from_slice(&request_header(Op::Read, body_len));
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(session.len() as u16).to_le_bytes());
    v.extend_from_slice(session.as_bytes());
    v.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for r in ranges {
        v.extend_from_slice(&r.addr.to_le_bytes());
        v.extend_from_slice(&r.len.to_le_bytes());
    }
    v
}

/// Decodes a read request body.
pub fn decode_read(body: &[u8]) -> Result<ReadRequest, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let s = body
            .get(at..at + n)
            .ok_or_else(|| "truncated read request".to_string())?;
        at += n;
        Ok(s)
    };
    let seq = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
    let slen = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes")) as usize;
    if slen > MAX_ID_BYTES {
        return Err(format!("session id of {slen} bytes"));
    }
    let session = std::str::from_utf8(take(slen)?)
        .map_err(|_| "session id is not UTF-8".to_string())?
        .to_owned();
    let n = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
    if n > MAX_RANGES {
        return Err(format!("{n} ranges exceed the limit of {MAX_RANGES}"));
    }
    let mut ranges = Vec::with_capacity(n);
    for _ in 0..n {
        let addr = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        ranges.push(Range { addr, len });
    }
    if at != body.len() {
        return Err("trailing bytes after the ranges".into());
    }
    Ok(ReadRequest {
        seq,
        session,
        ranges,
    })
}

/// Encodes a response header.
pub fn response_header(status: Status, seq: u64, len: u64) -> [u8; RESP_HEADER] {
    let mut h = [0u8; RESP_HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = status as u8;
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

/// Decodes a response header: status, seq, payload length.
pub fn parse_response_header(h: &[u8; RESP_HEADER]) -> Result<(Status, u64, u64), String> {
    let magic = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    if magic != MAGIC {
        return Err(format!("bad magic {magic:#x} in a response"));
    }
    let status = Status::from_u8(h[4]).ok_or_else(|| format!("unknown status {}", h[4]))?;
    let seq = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    Ok((status, seq, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_request_round_trips() {
        let ranges = vec![
            Range { addr: 1, len: 2 },
            Range {
                addr: u64::MAX,
                len: 4096,
            },
        ];
        let v = encode_read(7, "sess", &ranges);
        let h: [u8; REQ_HEADER] = v[..REQ_HEADER].try_into().unwrap();
        let (op, len) = parse_request_header(&h).unwrap();
        assert_eq!(op, Op::Read as u8);
        assert_eq!(len, v.len() - REQ_HEADER);
        let r = decode_read(&v[REQ_HEADER..]).unwrap();
        assert_eq!(r.seq, 7);
        assert_eq!(r.session, "sess");
        assert_eq!(r.ranges, ranges);
    }

    #[test]
    fn malformed_requests_are_refused_before_allocating() {
        let mut h = request_header(Op::Read, 10);
        h[0] ^= 1;
        assert!(parse_request_header(&h).is_err());
        let h = request_header(Op::Read, MAX_BODY_BYTES + 1);
        assert!(parse_request_header(&h).is_err());
        let v = encode_read(1, "s", &[Range { addr: 0, len: 1 }]);
        let body = &v[REQ_HEADER..];
        assert!(decode_read(&body[..body.len() - 1]).is_err());
        let mut long = body.to_vec();
        long.push(0);
        assert!(decode_read(&long).is_err());
        // A range count beyond the bound is refused without reserving for it.
        let mut huge = Vec::new();
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&0u16.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_read(&huge).unwrap_err().contains("limit"));
    }

    #[test]
    fn a_response_header_round_trips() {
        let h = response_header(Status::OutOfBounds, 9, 33);
        assert_eq!(
            parse_response_header(&h).unwrap(),
            (Status::OutOfBounds, 9, 33)
        );
        let mut bad = h;
        bad[4] = 200;
        assert!(parse_response_header(&bad).is_err());
    }
}
