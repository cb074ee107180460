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
//! Connections are admitted by the [`ConnTable`] (caps per address, per requester and in
//! all; a full port evicts an idle connection of the busiest address for a requester that
//! holds fewer). A greeted connection with no request for `idle_timeout` is closed unless
//! its requester holds a transfer lock. Refusals and evictions are counted per reason and
//! logged at most once per `log_every`, each line with the counts since the last
//! ([`BurstLog`]).
//!
//! Must never: send a byte outside a locked slot, block the executor (all socket I/O is
//! async), let a requester that stopped reading hold a connection task forever (every
//! write has `io_timeout`), close a connection that carries a live fetch for idleness, or
//! write a log line per refused connection.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::burst_log::{Burst, BurstLog};
use crate::conns::{Admitted, ConnLimits, ConnTable, Refusal};
use crate::locks::Locks;
use crate::metrics::PeerMetrics;
use crate::wire::{self, Op, Status};

/// At most one log line about refused or evicted connections per this, each with the
/// counts since the previous line (as the gRPC listeners' refusal lines).
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Settings of the data port's server side.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections at once, at most.
    pub max_connections: usize,
    /// Connections at once from one IP address, at most.
    pub max_per_address: usize,
    /// Greeted connections at once of one requester id, at most.
    pub max_per_requester: usize,
    /// Longest wait for one socket write (or for the rest of a request once its header came,
    /// or for the hello).
    pub io_timeout: Duration,
    /// A greeted connection with no request for this long is closed, unless its requester
    /// holds a transfer lock (then it waits another period).
    pub idle_timeout: Duration,
    /// Bytes one read request may ask for, at most.
    pub max_read_bytes: u64,
    /// At most one log line per this about refused or evicted connections (and one about
    /// failing accepts), each with the counts since the previous line.
    pub log_every: Duration,
}

impl ServeLimits {
    /// The connection caps.
    pub fn conn_limits(&self) -> ConnLimits {
        ConnLimits {
            max: self.max_connections,
            per_address: self.max_per_address,
            per_requester: self.max_per_requester,
        }
    }
}

/// What every connection task shares.
struct Shared {
    locks: Arc<Locks>,
    table: ConnTable,
    limits: ServeLimits,
    metrics: PeerMetrics,
    /// Refusals (by reason) and evictions, with the latest peer.
    pressure: BurstLog<SocketAddr>,
}

impl Shared {
    fn refused(&self, why: Refusal, peer: SocketAddr, now: Instant) {
        self.metrics
            .data_connections_refused
            .with_label_values(&[why.label()])
            .inc();
        if let Some(b) = self.pressure.record(why.label(), peer, now) {
            log_pressure(&b, &self.limits);
        }
    }
}

/// Why a connection task ended.
enum End {
    /// The requester closed it, or it broke.
    Closed,
    /// Refused at the requester's cap.
    Refused,
    /// No request for `idle_timeout`, and no transfer lock held.
    Idle,
    /// Evicted for a newcomer (counted when evicted).
    Evicted,
}

/// Accepts connections on `listener` until the process ends.
pub async fn serve(
    listener: TcpListener,
    locks: Arc<Locks>,
    limits: ServeLimits,
    metrics: PeerMetrics,
) {
    let sh = Arc::new(Shared {
        table: ConnTable::new(limits.conn_limits(), locks.clone(), metrics.clone()),
        locks,
        limits,
        metrics,
        pressure: BurstLog::new(limits.log_every),
    });
    let accept_errors = BurstLog::<String>::new(limits.log_every);
    // Reports the tail of a burst once its line is due (at most a quarter period late).
    let mut tick = tokio::time::interval((limits.log_every / 4).max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = tick.tick() => {
                let now = Instant::now();
                if let Some(b) = sh.pressure.flush(now) {
                    log_pressure(&b, &sh.limits);
                }
                if let Some(b) = accept_errors.flush(now) {
                    log_accept_errors(&b);
                }
                continue;
            }
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                if let Some(b) = accept_errors.record("accept", e.to_string(), Instant::now()) {
                    log_accept_errors(&b);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let now = Instant::now();
        let admitted = match sh.table.admit(peer.ip(), now) {
            Ok(a) => a,
            Err(why) => {
                refuse_on_arrival(&stream, why, &sh.limits);
                sh.refused(why, peer, now);
                continue;
            }
        };
        if admitted.made_room {
            sh.metrics
                .data_connections_closed
                .with_label_values(&["evicted"])
                .inc();
            if let Some(b) = sh.pressure.record("evicted", peer, now) {
                log_pressure(&b, &sh.limits);
            }
        }
        let _ = stream.set_nodelay(true);
        set_keepalive(&stream);
        let sh = sh.clone();
        tokio::spawn(async move {
            let id = admitted.id;
            let end = connection(stream, peer, &admitted, &sh).await;
            sh.table.close(id);
            match end {
                Ok(End::Idle) => {
                    sh.metrics
                        .data_connections_closed
                        .with_label_values(&["idle"])
                        .inc();
                    tracing::debug!(%peer, "peer data connection idle; closed");
                }
                Ok(End::Evicted) => {
                    tracing::debug!(%peer, "peer data connection evicted for a new requester")
                }
                Ok(End::Closed | End::Refused) => {}
                Err(e) => tracing::debug!(%peer, error = %e, "peer data connection ended"),
            }
        });
    }
}

/// Tells a connection refused on arrival why (best effort, without waiting: a `Busy`
/// answer in place of the hello's), before it is closed.
fn refuse_on_arrival(stream: &TcpStream, why: Refusal, limits: &ServeLimits) {
    let msg = why.message(&limits.conn_limits());
    let m = &msg.as_bytes()[..msg.len().min(wire::MAX_MESSAGE_BYTES)];
    let mut v = wire::response_header(Status::Busy, 0, m.len() as u64).to_vec();
    v.extend_from_slice(m);
    let _ = stream.try_write(&v);
}

fn log_pressure(b: &Burst<SocketAddr>, limits: &ServeLimits) {
    let evicted = b.count("evicted");
    tracing::warn!(
        refused = b.total() - evicted,
        evicted,
        by_reason = %b.by_label(),
        over_ms = b.over.as_millis() as u64,
        last_peer = %b.last.map_or_else(String::new, |p| p.to_string()),
        max_data_connections = limits.max_connections,
        per_address = limits.max_per_address,
        per_requester = limits.max_per_requester,
        "peer data port: connections refused or evicted at the connection caps (one line per burst, counting every one since the previous line)"
    );
}

fn log_accept_errors(b: &Burst<String>) {
    tracing::warn!(
        failures = b.total(),
        over_ms = b.over.as_millis() as u64,
        last_error = b.last.as_deref().unwrap_or(""),
        "peer data port: accept failed; retrying every 100 ms (one line per burst)"
    );
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

/// The first byte of the next frame; `None` at end of stream. Cancel-safe.
async fn first_byte(s: &mut TcpStream) -> std::io::Result<Option<u8>> {
    let mut b = [0u8; 1];
    match s.read(&mut b).await? {
        0 => Ok(None),
        _ => Ok(Some(b[0])),
    }
}

/// The rest of a frame whose first byte came: its op and body, within `wait`.
async fn rest_of_frame(
    s: &mut TcpStream,
    first: u8,
    wait: Duration,
) -> std::io::Result<(u8, Vec<u8>)> {
    tokio::time::timeout(wait, async {
        let mut h = [0u8; wire::REQ_HEADER];
        h[0] = first;
        s.read_exact(&mut h[1..]).await?;
        let (op, len) = wire::parse_request_header(&h).map_err(std::io::Error::other)?;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).await?;
        Ok::<_, std::io::Error>((op, body))
    })
    .await
    .map_err(|_| std::io::Error::other("request timed out"))?
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
    peer: SocketAddr,
    adm: &Admitted,
    sh: &Shared,
) -> std::io::Result<End> {
    let limits = sh.limits;
    // Hello first, within io_timeout (an evicted connection stops waiting for it).
    let hello = tokio::select! {
        _ = adm.evicted.notified() => return Ok(End::Evicted),
        r = tokio::time::timeout(limits.io_timeout, async {
            match first_byte(&mut s).await? {
                None => Ok(None),
                Some(b) => rest_of_frame(&mut s, b, limits.io_timeout).await.map(Some),
            }
        }) => r.map_err(|_| std::io::Error::other("no hello in time"))??,
    };
    let Some((op, body)) = hello else {
        return Ok(End::Closed);
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
    match sh.table.greet(adm.id, &requester) {
        Ok(true) => {}
        Ok(false) => return Ok(End::Evicted),
        Err(why) => {
            sh.refused(why, peer, Instant::now());
            let msg = why.message(&limits.conn_limits());
            let _ = respond_error(&mut s, Status::Busy, 0, &msg, limits.io_timeout).await;
            return Ok(End::Refused);
        }
    }
    sh.locks.connected(&requester);
    let _greeted = Greeted {
        locks: &sh.locks,
        requester: requester.clone(),
    };
    tokio::time::timeout(
        limits.io_timeout,
        s.write_all(&wire::response_header(Status::Ok, 0, 0)),
    )
    .await
    .map_err(|_| std::io::Error::other("write timed out"))??;
    // Only a read that was served restarts the idle clock: refused reads (an unknown
    // session, a range out of bounds) carry no fetch.
    let mut idle_until = tokio::time::Instant::now() + limits.idle_timeout;
    loop {
        let next = tokio::select! {
            _ = adm.evicted.notified() => return Ok(End::Evicted),
            r = tokio::time::timeout_at(idle_until, first_byte(&mut s)) => r,
        };
        let first = match next {
            // A requester between its lock and its release keeps its connections: closing
            // its last one would release the lock under its fetch.
            Err(_) if sh.locks.has_sessions(&requester) => {
                idle_until = tokio::time::Instant::now() + limits.idle_timeout;
                continue;
            }
            Err(_) => return Ok(End::Idle),
            Ok(Ok(None)) => return Ok(End::Closed),
            Ok(Ok(Some(b))) => b,
            Ok(Err(e)) => return Err(e),
        };
        if !sh.table.begin(adm.id) {
            return Ok(End::Evicted);
        }
        let r = request(&mut s, first, sh).await;
        let served = matches!(r, Ok(true));
        sh.table.end(adm.id, served.then(Instant::now));
        if served {
            idle_until = tokio::time::Instant::now() + limits.idle_timeout;
        }
        r?;
    }
}

/// Answers one request whose first byte came: `true` when it was served (bytes sent),
/// `false` when refused with an answer. `Err` ends the connection.
async fn request(s: &mut TcpStream, first: u8, sh: &Shared) -> std::io::Result<bool> {
    let (locks, limits, metrics) = (&sh.locks, sh.limits, &sh.metrics);
    let (op, body) = rest_of_frame(s, first, limits.io_timeout).await?;
    let outcome = |o: &str| metrics.serve_requests.with_label_values(&[o]).inc();
    if op != Op::Read as u8 {
        outcome("bad_request");
        respond_error(s, Status::BadRequest, 0, "unknown op", limits.io_timeout).await?;
        return Err(std::io::Error::other("unknown op"));
    }
    let req = match wire::decode_read(&body) {
        Ok(r) => r,
        Err(e) => {
            outcome("bad_request");
            respond_error(s, Status::BadRequest, 0, &e, limits.io_timeout).await?;
            return Err(std::io::Error::other(e));
        }
    };
    let Some(locked) = locks.touch(&req.session) else {
        outcome("no_session");
        return respond_error(
            s,
            Status::NoSession,
            req.seq,
            "unknown or expired transfer session",
            limits.io_timeout,
        )
        .await
        .map(|()| false);
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
        return respond_error(s, Status::OutOfBounds, req.seq, &msg, limits.io_timeout)
            .await
            .map(|()| false);
    }
    if total > limits.max_read_bytes {
        outcome("bad_request");
        let msg = format!(
            "a read of {total} bytes exceeds the limit of {}",
            limits.max_read_bytes
        );
        return respond_error(s, Status::BadRequest, req.seq, &msg, limits.io_timeout)
            .await
            .map(|()| false);
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
    let r = unsafe { write_all_vectored(s, &parts, limits.io_timeout, renew) }.await;
    drop(locked);
    match r {
        Ok(()) => {
            outcome("ok");
            metrics.serve_bytes.inc_by(total);
            Ok(true)
        }
        Err(e) => {
            outcome("write_failed");
            Err(e)
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
