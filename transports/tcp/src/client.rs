//! The TCP data path (requesting side): [`PeerDataPath`] over a few connections per peer.
//!
//! Connections are greeted (hello with this node's requester id, acknowledged) before the
//! fetcher locks anything on the peer, and kept idle between fetches, so the peer always
//! sees a live connection while it holds locks for this node and drops them when this
//! process dies. A pull splits its ranges over up to `connections_per_peer` connections
//! (balanced by bytes), sends one read request on each and reads the answer straight into
//! the destination buffers' memory.
//!
//! A pooled connection may have been closed by the peer while it sat idle (its idle
//! timeout, or an eviction to make room for another requester). A read that fails on a
//! pooled connection before any byte of its answer arrived is therefore sent again, once,
//! on a fresh connection (reads of a locked session are idempotent), as HTTP clients do
//! with idempotent requests on reused keep-alive connections.
//!
//! Must never: write outside a destination buffer (every read is into the pieces of a
//! range the caller checked against the buffer), keep using a connection after any error
//! or timeout (it is dropped, never pooled), or outlive the deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{PeerDataError, PeerDataPath, PeerRead};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wire::{self, Op, Range, Status};

/// The TCP data path.
pub struct TcpDataPath {
    requester_id: String,
    connections_per_peer: usize,
    connect_timeout: Duration,
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    seq: AtomicU64,
}

impl std::fmt::Debug for TcpDataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpDataPath")
            .field("requester_id", &self.requester_id)
            .field("connections_per_peer", &self.connections_per_peer)
            .finish()
    }
}

fn unreachable(e: impl std::fmt::Display) -> PeerDataError {
    PeerDataError::Unreachable(e.to_string())
}

/// A share's failure, and whether it came before any byte of the answer (the request may
/// then be sent again on a fresh connection when this one was pooled).
struct ShareError {
    error: PeerDataError,
    before_answer: bool,
}

impl ShareError {
    fn before(e: impl std::fmt::Display) -> Self {
        Self {
            error: unreachable(e),
            before_answer: true,
        }
    }
    fn after(error: PeerDataError) -> Self {
        Self {
            error,
            before_answer: false,
        }
    }
}

/// One connection's share of a pull: the ranges it asks for and where each lands.
struct Share {
    ranges: Vec<Range>,
    /// Per range: destination buffer and offset in it.
    dests: Vec<(Arc<pegaflow_plugin::HostBuffer>, usize)>,
    bytes: u64,
}

impl TcpDataPath {
    /// A data path greeting peers as `requester_id`, with at most `connections_per_peer`
    /// connections per peer.
    pub fn new(
        requester_id: String,
        connections_per_peer: usize,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            requester_id,
            connections_per_peer: connections_per_peer.max(1),
            connect_timeout,
            idle: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(1),
        }
    }

    async fn open(&self, endpoint: &str, deadline: Instant) -> Result<TcpStream, PeerDataError> {
        let wait = self
            .connect_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let mut s = tokio::time::timeout(wait, TcpStream::connect(endpoint))
            .await
            .map_err(|_| PeerDataError::Timeout)?
            .map_err(unreachable)?;
        let _ = s.set_nodelay(true);
        let id = self.requester_id.as_bytes();
        let mut hello = wire::request_header(Op::Hello, id.len()).to_vec();
        hello.extend_from_slice(id);
        let ack = async {
            s.write_all(&hello).await?;
            let mut h = [0u8; wire::RESP_HEADER];
            s.read_exact(&mut h).await?;
            Ok::<_, std::io::Error>(h)
        };
        let h = tokio::time::timeout_at(deadline.into(), ack)
            .await
            .map_err(|_| PeerDataError::Timeout)?
            .map_err(unreachable)?;
        match wire::parse_response_header(&h) {
            Ok((Status::Ok, _, 0)) => Ok(s),
            Ok((st, _, len)) => {
                // The source says why (a connection cap it is at, for `Busy`).
                let mut msg = vec![0u8; (len as usize).min(wire::MAX_MESSAGE_BYTES)];
                let _ = tokio::time::timeout_at(deadline.into(), s.read_exact(&mut msg)).await;
                Err(PeerDataError::Refused(format!(
                    "hello answered {st:?}: {}",
                    String::from_utf8_lossy(&msg)
                )))
            }
            Err(e) => Err(PeerDataError::Refused(e)),
        }
    }

    /// Takes `n` connections to `endpoint` (idle ones first, new ones greeted), each with
    /// whether it was pooled.
    async fn take(
        &self,
        endpoint: &str,
        n: usize,
        deadline: Instant,
    ) -> Result<Vec<(TcpStream, bool)>, PeerDataError> {
        let mut got: Vec<(TcpStream, bool)> = {
            let mut idle = self.idle.lock();
            let v = idle.entry(endpoint.to_owned()).or_default();
            // An idle connection the peer closed (it restarted, or dropped us) reads EOF, or
            // an error, at once; one with bytes waiting is out of step. Neither is used.
            v.retain(|c| {
                let mut b = [0u8; 1];
                matches!(c.try_read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            let k = v.len().min(n);
            v.drain(v.len() - k..).map(|c| (c, true)).collect()
        };
        let missing = n - got.len();
        let opened =
            futures::future::join_all((0..missing).map(|_| self.open(endpoint, deadline))).await;
        for o in opened {
            got.push((o?, false));
        }
        Ok(got)
    }

    fn give_back(&self, endpoint: &str, conns: Vec<TcpStream>) {
        let mut idle = self.idle.lock();
        let v = idle.entry(endpoint.to_owned()).or_default();
        for c in conns {
            if v.len() < self.connections_per_peer {
                v.push(c);
            }
        }
    }

    /// Forgets the idle connections to `endpoint` (after a failure).
    pub fn forget(&self, endpoint: &str) {
        self.idle.lock().remove(endpoint);
    }

    async fn run_share(
        &self,
        s: &mut TcpStream,
        session: &str,
        share: &Share,
    ) -> Result<(), ShareError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let req = wire::encode_read(seq, session, &share.ranges);
        s.write_all(&req).await.map_err(ShareError::before)?;
        let mut h = [0u8; wire::RESP_HEADER];
        s.read_exact(&mut h).await.map_err(ShareError::before)?;
        let (status, rseq, len) = wire::parse_response_header(&h)
            .map_err(|e| ShareError::after(PeerDataError::Refused(e)))?;
        if status != Status::Ok {
            let mut msg = vec![0u8; (len as usize).min(wire::MAX_MESSAGE_BYTES)];
            let _ = s.read_exact(&mut msg).await;
            return Err(ShareError::after(PeerDataError::Refused(format!(
                "{status:?}: {}",
                String::from_utf8_lossy(&msg)
            ))));
        }
        if rseq != seq || len != share.bytes {
            return Err(ShareError::after(PeerDataError::Refused(format!(
                "answer for request {rseq} with {len} bytes, expected request {seq} with {}",
                share.bytes
            ))));
        }
        for (r, (dest, off)) in share.ranges.iter().zip(&share.dests) {
            for p in dest.pieces(*off, r.len as usize) {
                // SAFETY: the piece lies inside `dest`, a buffer the fetcher allocated for
                // this pull and shares with nobody until the pull returned; `share` holds
                // the `Arc` while this future exists, and tokio's read writes only during
                // the poll that returns its count, so a dropped future writes nothing more.
                let buf = unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, p.len) };
                s.read_exact(buf)
                    .await
                    .map_err(|e| ShareError::after(unreachable(e)))?;
            }
        }
        Ok(())
    }

    /// Runs `share` on `c`; when `c` was pooled and failed before any byte of the answer
    /// (the peer closed it while it sat idle), once more on a fresh connection. Returns the
    /// connection that served it.
    async fn run_share_or_retry(
        &self,
        endpoint: &str,
        (mut c, pooled): (TcpStream, bool),
        session: &str,
        share: &Share,
        deadline: Instant,
    ) -> Result<TcpStream, PeerDataError> {
        match self.run_share(&mut c, session, share).await {
            Ok(()) => Ok(c),
            Err(e) if pooled && e.before_answer => {
                tracing::debug!(endpoint, error = %e.error, "pooled data connection closed by the peer; reading on a fresh one");
                drop(c);
                let mut c = self.open(endpoint, deadline).await?;
                self.run_share(&mut c, session, share)
                    .await
                    .map_err(|e| e.error)?;
                Ok(c)
            }
            Err(e) => Err(e.error),
        }
    }
}

#[async_trait]
impl PeerDataPath for TcpDataPath {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    async fn connect(&self, endpoint: &str, deadline: Instant) -> Result<(), PeerDataError> {
        let c = self.take(endpoint, 1, deadline).await?;
        self.give_back(endpoint, c.into_iter().map(|(c, _)| c).collect());
        Ok(())
    }

    async fn pull(
        &self,
        endpoint: &str,
        session: &str,
        reads: Vec<PeerRead>,
        deadline: Instant,
    ) -> Result<(), PeerDataError> {
        // Flatten, check against the destinations, split by bytes.
        let mut items: Vec<(Range, Arc<pegaflow_plugin::HostBuffer>, usize)> = Vec::new();
        let mut total = 0u64;
        for r in &reads {
            let mut off = r.dest_offset;
            for rr in &r.ranges {
                if rr.len == 0 {
                    continue;
                }
                let end = off
                    .checked_add(rr.len as usize)
                    .filter(|&e| e <= r.dest.len())
                    .ok_or_else(|| {
                        PeerDataError::Refused("ranges overrun their destination".into())
                    })?;
                items.push((
                    Range {
                        addr: rr.addr,
                        len: rr.len,
                    },
                    r.dest.clone(),
                    off,
                ));
                total += rr.len;
                off = end;
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let n = self.connections_per_peer.min(items.len()).max(1);
        let per = total.div_ceil(n as u64);
        let mut shares: Vec<Share> = Vec::with_capacity(n);
        for (r, d, off) in items {
            let start_new = shares.last().is_none_or(|s| {
                (s.bytes >= per && shares.len() < n) || s.ranges.len() >= wire::MAX_RANGES
            });
            if start_new {
                shares.push(Share {
                    ranges: Vec::new(),
                    dests: Vec::new(),
                    bytes: 0,
                });
            }
            let s = shares.last_mut().expect("pushed");
            s.ranges.push(r);
            s.dests.push((d, off));
            s.bytes += r.len;
        }
        let work = async {
            let conns = self.take(endpoint, shares.len(), deadline).await?;
            let results =
                futures::future::join_all(conns.into_iter().zip(&shares).map(|(c, share)| {
                    self.run_share_or_retry(endpoint, c, session, share, deadline)
                }))
                .await;
            let mut ok = Vec::with_capacity(results.len());
            let mut first_err = None;
            for r in results {
                match r {
                    Ok(c) => ok.push(c),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            match first_err {
                None => {
                    self.give_back(endpoint, ok);
                    Ok(())
                }
                Some(e) => Err(e),
            }
        };
        match tokio::time::timeout_at(deadline.into(), work).await {
            Ok(r) => r,
            Err(_) => Err(PeerDataError::Timeout),
        }
    }
}
