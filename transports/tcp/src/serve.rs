//! The data port (source side): accepts requesters' connections and answers their reads
//! with `writev` straight from the pool.
//!
//! One task per connection, one request at a time per connection (a requester opens several
//! connections to read in parallel). The first frame must be a hello naming the requester;
//! from then on the connection counts for that requester in the lock table, and closing its
//! last connection releases its sessions. Each read is checked against the session's locked
//! slot pieces before a byte is sent; the session's [`crate::locks::Locked`] `Arc` is held
//! for the whole write.
//!
//! Must never: send a byte outside a locked slot, block the executor (all socket I/O is
//! async), or let a requester that stopped reading hold a connection task forever (every
//! write has `io_timeout`; a connection idle longer than `idle_timeout` is closed).

use std::io::IoSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::locks::Locks;
use crate::metrics::PeerMetrics;
use crate::wire::{self, Op, Status};

/// Settings of the data port's server side.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections at once, at most.
    pub max_connections: usize,
    /// Longest wait for one socket write (or for the rest of a request once its header came).
    pub io_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Bytes one read request may ask for, at most.
    pub max_read_bytes: u64,
}

/// Accepts connections on `listener` until the process ends.
pub async fn serve(
    listener: TcpListener,
    locks: Arc<Locks>,
    limits: ServeLimits,
    metrics: PeerMetrics,
) {
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "peer data port: accept failed; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if open.load(Ordering::Acquire) >= limits.max_connections {
            metrics.data_connections_refused.inc();
            tracing::warn!(%peer, max = limits.max_connections, "peer data port: connection refused at max_data_connections");
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        set_keepalive(&stream);
        open.fetch_add(1, Ordering::AcqRel);
        metrics.data_connections.inc();
        let (locks, metrics, open) = (locks.clone(), metrics.clone(), open.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &locks, limits, &metrics).await {
                tracing::debug!(%peer, error = %e, "peer data connection ended");
            }
            open.fetch_sub(1, Ordering::AcqRel);
            metrics.data_connections.dec();
        });
    }
}

/// TCP keepalive (probes after 10 s idle, every 5 s, 3 unanswered): a requester whose
/// host vanished without a FIN is noticed, and its sessions released, within ~25 s even
/// where its lease were longer.
fn set_keepalive(stream: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = setsockopt(stream, sockopt::KeepAlive, &true);
    let _ = setsockopt(stream, sockopt::TcpKeepIdle, &10);
    let _ = setsockopt(stream, sockopt::TcpKeepInterval, &5);
    let _ = setsockopt(stream, sockopt::TcpKeepCount, &3);
}

/// Closes the requester's connection count when the connection task ends, however.
struct Greeted<'a> {
    locks: &'a Locks,
    requester: Arc<str>,
}

impl Drop for Greeted<'_> {
    fn drop(&mut self) {
        let n = self.locks.disconnected(&self.requester);
        if n > 0 {
            tracing::debug!(requester = %self.requester, sessions = n, "requester gone; its transfer locks are released");
        }
    }
}

async fn read_frame(
    s: &mut TcpStream,
    first_byte_wait: Duration,
    rest_wait: Duration,
) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut h = [0u8; wire::REQ_HEADER];
    match tokio::time::timeout(first_byte_wait, s.read(&mut h[..1])).await {
        Err(_) => return Err(std::io::Error::other("idle timeout")),
        Ok(Ok(0)) => return Ok(None),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
    }
    let body = tokio::time::timeout(rest_wait, async {
        s.read_exact(&mut h[1..]).await?;
        let (op, len) = wire::parse_request_header(&h).map_err(std::io::Error::other)?;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).await?;
        Ok::<_, std::io::Error>((op, body))
    })
    .await
    .map_err(|_| std::io::Error::other("request timed out"))??;
    Ok(Some(body))
}

async fn respond_error(
    s: &mut TcpStream,
    status: Status,
    seq: u64,
    msg: &str,
    io_timeout: Duration,
) -> std::io::Result<()> {
    let m = &msg.as_bytes()[..msg.len().min(wire::MAX_MESSAGE_BYTES)];
    let mut v = wire::response_header(status, seq, m.len() as u64).to_vec();
    v.extend_from_slice(m);
    tokio::time::timeout(io_timeout, s.write_all(&v))
        .await
        .map_err(|_| std::io::Error::other("write timed out"))?
}

async fn connection(
    mut s: TcpStream,
    locks: &Locks,
    limits: ServeLimits,
    metrics: &PeerMetrics,
) -> std::io::Result<()> {
    // Hello first.
    let Some((op, body)) = read_frame(&mut s, limits.io_timeout, limits.io_timeout).await? else {
        return Ok(());
    };
    if op != Op::Hello as u8 || body.is_empty() || body.len() > wire::MAX_ID_BYTES {
        let _ = respond_error(
            &mut s,
            Status::BadRequest,
            0,
            "the first frame must be a hello naming the requester",
            limits.io_timeout,
        )
        .await;
        return Err(std::io::Error::other("no hello"));
    }
    let requester: Arc<str> = String::from_utf8_lossy(&body).into();
    locks.connected(&requester);
    let _greeted = Greeted {
        locks,
        requester: requester.clone(),
    };
    tokio::time::timeout(
        limits.io_timeout,
        s.write_all(&wire::response_header(Status::Ok, 0, 0)),
    )
    .await
    .map_err(|_| std::io::Error::other("write timed out"))??;
    let outcome = |o: &str| metrics.serve_requests.with_label_values(&[o]).inc();
    loop {
        let Some((op, body)) = read_frame(&mut s, limits.idle_timeout, limits.io_timeout).await?
        else {
            return Ok(());
        };
        if op != Op::Read as u8 {
            outcome("bad_request");
            respond_error(
                &mut s,
                Status::BadRequest,
                0,
                "unknown op",
                limits.io_timeout,
            )
            .await?;
            return Err(std::io::Error::other("unknown op"));
        }
        let req = match wire::decode_read(&body) {
            Ok(r) => r,
            Err(e) => {
                outcome("bad_request");
                respond_error(&mut s, Status::BadRequest, 0, &e, limits.io_timeout).await?;
                return Err(std::io::Error::other(e));
            }
        };
        let Some(locked) = locks.touch(&req.session) else {
            outcome("no_session");
            respond_error(
                &mut s,
                Status::NoSession,
                req.seq,
                "unknown or expired transfer session",
                limits.io_timeout,
            )
            .await?;
            continue;
        };
        let mut total = 0u64;
        let mut bad = None;
        for r in &req.ranges {
            if !locked.covers(*r) {
                bad = Some(*r);
                break;
            }
            total = total.saturating_add(r.len);
        }
        if let Some(r) = bad {
            outcome("out_of_bounds");
            let msg = format!(
                "range {:#x}+{} lies outside the session's locked slots",
                r.addr, r.len
            );
            respond_error(
                &mut s,
                Status::OutOfBounds,
                req.seq,
                &msg,
                limits.io_timeout,
            )
            .await?;
            continue;
        }
        if total > limits.max_read_bytes {
            outcome("bad_request");
            let msg = format!(
                "a read of {total} bytes exceeds the limit of {}",
                limits.max_read_bytes
            );
            respond_error(&mut s, Status::BadRequest, req.seq, &msg, limits.io_timeout).await?;
            continue;
        }
        let header = wire::response_header(Status::Ok, req.seq, total);
        let mut parts: Vec<(usize, usize)> = Vec::with_capacity(req.ranges.len() + 1);
        parts.push((header.as_ptr() as usize, header.len()));
        parts.extend(req.ranges.iter().map(|r| (r.addr as usize, r.len as usize)));
        // Every writev that moves bytes renews the session's lease: a transfer longer than
        // the lease keeps its lock while data flows.
        let renew = || {
            locks.touch(&req.session);
        };
        // SAFETY: every range lies inside a slot piece of a block `locked` holds (checked
        // above); `locked` lives until the write below has ended; sealed blocks are never
        // written again, so reading them while others read is sound. The header lives on
        // this frame.
        let r = unsafe { write_all_vectored(&mut s, &parts, limits.io_timeout, renew) }.await;
        drop(locked);
        match r {
            Ok(()) => {
                outcome("ok");
                metrics.serve_bytes.inc_by(total);
            }
            Err(e) => {
                outcome("write_failed");
                return Err(e);
            }
        }
    }
}

/// Writes the `(addr, len)` pieces in order with `writev`, at most 512 iovecs per call,
/// each call bounded by `io_timeout`; `progress` runs after each call that moved bytes.
///
/// # Safety
/// Every piece must be readable memory that stays valid and unchanged until the returned
/// future completes or is dropped.
async unsafe fn write_all_vectored(
    s: &mut TcpStream,
    parts: &[(usize, usize)],
    io_timeout: Duration,
    progress: impl Fn(),
) -> std::io::Result<()> {
    const MAX_IOV: usize = 512;
    let mut idx = 0usize;
    let mut skip = 0usize;
    while idx < parts.len() {
        if parts[idx].1 == skip {
            idx += 1;
            skip = 0;
            continue;
        }
        let slices: Vec<IoSlice<'_>> = parts[idx..]
            .iter()
            .take(MAX_IOV)
            .enumerate()
            .filter(|(_, &(_, len))| len > 0)
            .map(|(i, &(addr, len))| {
                let off = if i == 0 { skip } else { 0 };
                // SAFETY: the caller guarantees the piece is valid for reads.
                IoSlice::new(unsafe {
                    std::slice::from_raw_parts((addr + off) as *const u8, len - off)
                })
            })
            .collect();
        let mut n = tokio::time::timeout(io_timeout, s.write_vectored(&slices))
            .await
            .map_err(|_| std::io::Error::other("write timed out"))??;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        progress();
        while n > 0 && idx < parts.len() {
            let left = parts[idx].1 - skip;
            if n >= left {
                n -= left;
                idx += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
    }
    Ok(())
}
