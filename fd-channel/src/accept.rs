//! Accepting connections: the accept loop, the numbering of connections, and the handler that
//! reads a connection's one message and files its descriptor.
//!
//! Every accepted connection gets a sequence number, assigned in the same step as the
//! `accept` (under one lock), so that "accepted before" is exact: [`Acceptor::accept_queued`]
//! takes in every connection queued on the socket at that moment and answers the next
//! number, and every connection a client had opened by then has a smaller one. A refusal
//! uses it to close descriptors its client sent before the refused RPC but the server had not
//! read yet (see [`super::FdChannel::discard`]). A connection counts as live from its
//! accept until its handler has filed (or refused) its message.
//!
//! Must never: block (every `accept` is non-blocking; the lock is held for the syscalls
//! only), or serve more than `max_connections` connections at once (one more is closed on
//! arrival).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{self, SockFlag};
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use super::message::receive_message;
use super::{bump, Shared, ACCEPT_ERROR_PAUSE};

/// The listening socket and what a handler needs; shared by the accept loop and the channel
/// handle (which drains the queue before a discard).
pub(super) struct Acceptor {
    listener: AsyncFd<std::os::unix::net::UnixListener>,
    /// The next connection's sequence number. Held across each `accept`, so that a number
    /// is never handed out after a later connection's.
    next_seq: Mutex<u64>,
    slots: Arc<Semaphore>,
    max_connections: usize,
    shared: Weak<Shared>,
    receive_timeout: Duration,
    shutdown: watch::Receiver<bool>,
    runtime: tokio::runtime::Handle,
}

impl Acceptor {
    /// Wraps a listening, non-blocking socket. Must be called inside a tokio runtime.
    pub(super) fn new(
        listener: std::os::unix::net::UnixListener,
        shared: Weak<Shared>,
        max_connections: usize,
        receive_timeout: Duration,
        shutdown: watch::Receiver<bool>,
    ) -> io::Result<Self> {
        // Read-readiness only: a listening socket is never written.
        // SAFETY: the listener owns its descriptor, which stays open and the same for as long
        // as the `AsyncFd` holds the listener (it closes with it).
        let listener = unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Self {
            listener,
            next_seq: Mutex::new(0),
            slots: Arc::new(Semaphore::new(max_connections)),
            max_connections,
            shared,
            receive_timeout,
            shutdown,
            runtime: tokio::runtime::Handle::current(),
        })
    }

    /// Accepts every connection queued on the socket now, without waiting, each numbered and
    /// handed to a handler task (or closed when every slot is busy). Returns the next sequence
    /// number, which every connection accepted so far is below, and the error that stopped
    /// accepting early, if any (e.g. `EMFILE`: the rest stay queued).
    pub(super) fn accept_queued(&self) -> (u64, Option<io::Error>) {
        let mut next = self.next_seq.lock();
        loop {
            match socket::accept4(
                self.listener.get_ref().as_raw_fd(),
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            ) {
                Ok(raw) => {
                    // SAFETY: accept4 just returned this descriptor; nothing else owns it.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    let seq = *next;
                    *next += 1;
                    self.start(fd, seq);
                }
                Err(Errno::EAGAIN) => return (*next, None),
                // A connection reset before it was accepted, or a signal: go on.
                Err(Errno::EINTR) | Err(Errno::ECONNABORTED) => {}
                Err(e) => return (*next, Some(io::Error::from(e))),
            }
        }
    }

    /// Hands connection `seq` to a handler, marking it live; closes it when every slot is
    /// busy or the channel is gone. Called with `next_seq` held.
    fn start(&self, fd: OwnedFd, seq: u64) {
        let Some(s) = self.shared.upgrade() else {
            return;
        };
        let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() else {
            drop(fd);
            bump(&s.counters.connections_dropped);
            warn!(
                max_connections = self.max_connections,
                "fd side channel: all connection slots busy; closing a new connection"
            );
            return;
        };
        let stream = {
            let _rt = self.runtime.enter();
            UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                bump(&s.counters.connections_dropped);
                warn!(error = %e, "fd side channel: cannot register a connection; closed");
                return;
            }
        };
        s.counters.connections_open.fetch_add(1, Ordering::Relaxed);
        s.live.lock().insert(seq);
        self.runtime.spawn(handle_connection(
            stream,
            seq,
            Arc::downgrade(&s),
            self.receive_timeout,
            self.shutdown.clone(),
            permit,
        ));
    }
}

/// Resolves once the channel is shutting down (the flag is set or the handle is gone).
pub(super) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&stop| stop).await;
}

fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Accepts until the channel shuts down, and closes expired descriptors on a sweep.
pub(super) async fn accept_loop(
    acceptor: Arc<Acceptor>,
    pending_ttl: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut sweep = tokio::time::interval(sweep_period(pending_ttl));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            _ = sweep.tick() => {
                let Some(s) = acceptor.shared.upgrade() else { break };
                s.purge_expired();
            }
            ready = acceptor.listener.readable() => {
                let failed = match ready {
                    Ok(mut guard) => match acceptor.accept_queued() {
                        // Drained to EAGAIN: wait for the next connection.
                        (_, None) => {
                            guard.clear_ready();
                            None
                        }
                        (_, Some(e)) => Some(e),
                    },
                    Err(e) => Some(e),
                };
                if let Some(e) = failed {
                    warn!(error = %e, "fd side channel: accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
            }
        }
    }
    debug!("fd side channel: accept loop stopped");
}

/// Decrements the open-connection gauge when a handler ends, however it ends.
struct OpenConnection {
    shared: Weak<Shared>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.counters.connections_open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Marks connection `seq` no longer live when its handler ends, however it ends: after its
/// message was filed or refused (so a discard never misses it), before its socket closes.
struct Live {
    shared: Weak<Shared>,
    seq: u64,
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.live.lock().remove(&self.seq);
        }
    }
}

async fn handle_connection(
    stream: UnixStream,
    seq: u64,
    shared: Weak<Shared>,
    receive_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
    permit: OwnedSemaphorePermit,
) {
    let _open = OpenConnection {
        shared: shared.clone(),
        _permit: permit,
    };
    // Declared after the gauge's guard, so dropped before it: the gauge counts a connection
    // until its socket is closed. The live mark goes before the socket closes.
    let stream = stream;
    let _live = Live {
        shared: shared.clone(),
        seq,
    };
    let outcome = tokio::select! {
        // The channel is closing: drop the connection without touching the map.
        _ = stopped(&mut shutdown) => return,
        r = tokio::time::timeout(receive_timeout, receive_message(&stream)) => r,
    };
    let Some(shared) = shared.upgrade() else {
        return;
    };
    match outcome {
        Err(_) => {
            bump(&shared.counters.connections_dropped);
            warn!(
                timeout_secs = receive_timeout.as_secs_f64(),
                "fd side channel: connection sent nothing in time; closed"
            );
        }
        Ok(Err(e)) => {
            bump(&shared.counters.connections_dropped);
            warn!(error = %e, "fd side channel: receiving a message failed; connection closed");
        }
        Ok(Ok(msg)) if msg.is_empty() => {
            bump(&shared.counters.connections_dropped);
            debug!("fd side channel: sender closed the connection without a message");
        }
        Ok(Ok(msg)) => match msg.into_key() {
            Ok((key, fd)) => {
                let v2 = key.2.is_some();
                // `None`: the descriptor belonged to a refused registration and was closed;
                // a v2 sender gets no acknowledgement (nothing was filed).
                let ack = shared.insert(key, fd, seq);
                if let (true, Some(ack)) = (v2, ack) {
                    // The socket's send buffer is empty: one byte never blocks. A sender that
                    // left already just misses it.
                    let _ = stream.try_write(&[ack]);
                }
            }
            Err(reason) => {
                bump(&shared.counters.rejected_malformed);
                warn!(%reason, "fd side channel: rejected a message; its descriptors were closed");
            }
        },
    }
}
