//! The replay buffer and the replay protocol's request and answer frames.
//!
//! Owns the bounded history of published batches and the parsing of a replay request. It
//! never touches a socket and never holds more than `buffer_steps` batches or more than
//! `replay_buffer_bytes` of payload (the newest batch is kept even when it alone is larger).
//!
//! The protocol, as vLLM's publisher speaks it: a requester (a DEALER or REQ socket) sends
//! the first sequence number it wants as 8 bytes, big-endian, behind an empty delimiter
//! frame. The ROUTER answers with one message `[seq (8 bytes, big-endian), payload]` per
//! buffered batch from that number on, in order, then the end marker `[-1 as 8 bytes
//! (ff ff ff ff ff ff ff ff), empty payload]`. A number older than the oldest batch kept
//! gets everything kept (the first answer's number then tells the requester what was
//! lost); a number past the newest gets only the end marker.

use std::collections::VecDeque;

use bytes::Bytes;

/// The end-of-replay sequence frame: -1 as a signed 64-bit big-endian integer.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Published batches kept for replay, oldest first, with consecutive numbers.
#[derive(Debug)]
pub(crate) struct ReplayBuffer {
    entries: VecDeque<(u64, Bytes)>,
    bytes: u64,
    max_batches: usize,
    max_bytes: u64,
}

impl ReplayBuffer {
    pub(crate) fn new(max_batches: usize, max_bytes: u64) -> Self {
        Self {
            entries: VecDeque::with_capacity(max_batches.min(4096)),
            bytes: 0,
            max_batches: max_batches.max(1),
            max_bytes,
        }
    }

    /// Keeps `payload` as batch `seq` (one more than the last pushed), dropping the oldest
    /// batches past either bound.
    pub(crate) fn push(&mut self, seq: u64, payload: Bytes) {
        debug_assert!(self.entries.back().is_none_or(|(s, _)| *s + 1 == seq));
        self.bytes += payload.len() as u64;
        self.entries.push_back((seq, payload));
        while self.entries.len() > self.max_batches
            || (self.bytes > self.max_bytes && self.entries.len() > 1)
        {
            if let Some((_, p)) = self.entries.pop_front() {
                self.bytes -= p.len() as u64;
            }
        }
    }

    /// The batches numbered `start` and later (handles to the same payloads).
    pub(crate) fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let Some(&(first, _)) = self.entries.front() else {
            return Vec::new();
        };
        let skip = usize::try_from(start.saturating_sub(first)).unwrap_or(usize::MAX);
        self.entries.iter().skip(skip).cloned().collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A replay request, parsed from the frames a ROUTER received (identity first).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// The requester's identity frame.
    pub(crate) identity: Bytes,
    /// Whether the requester put an empty delimiter before its payload (REQ always does, a
    /// DEALER may); the answer mirrors it.
    pub(crate) delimited: bool,
    /// The first sequence number wanted, or `None` for a malformed request.
    pub(crate) start: Option<u64>,
}

impl Request {
    /// Parses `[identity, "", seq]` or `[identity, seq]`. Anything else with an identity is
    /// a malformed request (`start` = `None`); without one there is nobody to answer.
    pub(crate) fn parse(frames: Vec<Bytes>) -> Option<Request> {
        let mut it = frames.into_iter();
        let identity = it.next()?;
        let rest: Vec<Bytes> = it.collect();
        let (delimited, body) = match rest.as_slice() {
            [d, body] if d.is_empty() => (true, Some(body)),
            [body] => (false, Some(body)),
            [d, ..] => (d.is_empty(), None),
            [] => (false, None),
        };
        let start = body
            .and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok())
            .map(u64::from_be_bytes);
        Some(Request {
            identity,
            delimited,
            start,
        })
    }

    /// The frames of one answer message to this requester.
    pub(crate) fn answer(&self, seq: [u8; 8], payload: Bytes) -> Vec<Bytes> {
        let mut v = Vec::with_capacity(4);
        v.push(self.identity.clone());
        if self.delimited {
            v.push(Bytes::new());
        }
        v.push(Bytes::copy_from_slice(&seq));
        v.push(payload);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf_with(n: u64, max_batches: usize, max_bytes: u64, size: usize) -> ReplayBuffer {
        let mut b = ReplayBuffer::new(max_batches, max_bytes);
        for s in 0..n {
            b.push(s, Bytes::from(vec![s as u8; size]));
        }
        b
    }

    #[test]
    fn keeps_at_most_buffer_steps_batches() {
        let b = buf_with(25, 10, u64::MAX, 3);
        assert_eq!(b.len(), 10);
        assert_eq!(b.bytes(), 30);
        let seqs: Vec<u64> = b.since(0).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, (15..25).collect::<Vec<_>>());
    }

    #[test]
    fn keeps_at_most_the_byte_bound_but_always_the_newest() {
        let b = buf_with(25, 100, 100, 30);
        assert_eq!(b.len(), 3, "3 x 30 bytes fit under 100, 4 do not");
        assert_eq!(b.bytes(), 90);
        let b = buf_with(3, 100, 10, 30);
        assert_eq!(
            b.len(),
            1,
            "a batch larger than the bound alone is still kept"
        );
        assert_eq!(b.since(0)[0].0, 2);
    }

    #[test]
    fn since_answers_from_the_requested_number() {
        let b = buf_with(25, 10, u64::MAX, 1);
        let seqs = |start| -> Vec<u64> { b.since(start).into_iter().map(|(s, _)| s).collect() };
        assert_eq!(seqs(20), vec![20, 21, 22, 23, 24]);
        assert_eq!(seqs(24), vec![24]);
        assert_eq!(seqs(25), Vec::<u64>::new());
        assert_eq!(seqs(u64::MAX), Vec::<u64>::new());
        assert_eq!(
            seqs(3),
            (15..25).collect::<Vec<_>>(),
            "older than kept: all kept"
        );
        assert_eq!(b.since(20)[0].1.as_ref(), &[20u8]);
        assert!(ReplayBuffer::new(4, 100).since(0).is_empty());
    }

    #[test]
    fn requests_parse_in_both_envelopes() {
        let id = Bytes::from_static(b"peer");
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let r = Request::parse(vec![id.clone(), Bytes::new(), seq.clone()]).unwrap();
        assert_eq!((r.delimited, r.start), (true, Some(7)));
        assert_eq!(
            r.answer(END_SEQ, Bytes::new()),
            vec![
                id.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&END_SEQ),
                Bytes::new()
            ]
        );
        let r = Request::parse(vec![id.clone(), seq.clone()]).unwrap();
        assert_eq!((r.delimited, r.start), (false, Some(7)));
        assert_eq!(r.answer(END_SEQ, Bytes::new()).len(), 3);

        // Malformed: wrong length, extra frames, nothing after the identity.
        let short = Request::parse(vec![id.clone(), Bytes::new(), Bytes::from_static(b"123")]);
        assert_eq!(short.unwrap().start, None);
        let extra = Request::parse(vec![id.clone(), Bytes::new(), seq.clone(), seq]).unwrap();
        assert_eq!((extra.delimited, extra.start), (true, None));
        assert_eq!(Request::parse(vec![id]).unwrap().start, None);
        assert!(Request::parse(vec![]).is_none());
        assert_eq!(END_SEQ, [0xff; 8]);
    }
}
