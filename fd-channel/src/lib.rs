//! `pegaflow-fd-channel`: the fd side channel, a Unix stream socket on which native clients
//! hand the server one descriptor per registration (a CUDA VMM export or a host memfd), keyed
//! by `instance_id \0 device_id` (docs/NATIVE.md). [`FdChannel`] is the runtime's
//! [`pegaflow_plugin::SideChannel`]; registrars see only that trait.
//!
//! Protocol: one connection carries one `sendmsg` whose payload is the ASCII instance id, one
//! NUL, then the device id in decimal (trailing NULs are ignored), with exactly one descriptor
//! as `SCM_RIGHTS`. Native registration v2 (several allocations per registration) appends one
//! more NUL and the allocation's index in decimal: `instance_id \0 device_id \0 index`, so
//! every descriptor of a registration has its own key, none equal to a v1 key or to another
//! registration's (instance ids are fresh per registration attempt). A v1 message is never
//! answered. A v2 message is acknowledged: after filing (or refusing) its descriptor the
//! server writes one byte back ([`ACK_FILED`], [`ACK_DUPLICATE`], [`ACK_CAPACITY`]) before it
//! closes the connection, so a v2 client learns at once whether its descriptor is waiting and
//! bounds its own connections; a connection closed without that byte (over the connection
//! cap, malformed, or a server without v2) filed nothing. A rejected message is logged,
//! counted in [`FdChannelStats`] and its descriptors are closed. A registration later
//! collects the descriptor with [`FdChannel::take`] (v2: [`FdChannel::take_allocation`]).
//!
//! Bounds (every queue and connection has one, docs/ARCHITECTURE.md): at most [`FdChannelLimits::max_connections`] connections are
//! served at once (others are closed on arrival), a connection that stays silent for
//! [`FdChannelLimits::receive_timeout`] is closed, at most [`FdChannelLimits::max_pending`]
//! descriptors wait to be taken, and each waits at most [`FdChannelLimits::pending_ttl`].
//! Every descriptor the kernel hands us is owned ([`OwnedFd`]) from the moment `recvmsg`
//! returns, so whatever path a message takes, surplus or rejected descriptors are closed.
//!
//! Submodules: [`socket`] owns the socket file (creating its directory, binding, replacing a
//! stale socket, removing it on drop); [`message`] owns the wire format of one message.

mod accept;
mod message;
mod socket;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{watch, Notify};
use tracing::{debug, info, warn};

use accept::{accept_loop, Acceptor};
pub use message::MalformedMessage;
use socket::{bind_socket, create_parent, remove_socket_if_ours, FileIdentity};

/// Largest accepted payload (`instance_id \0 device_id`), in bytes (PegaFlow's
/// `MAX_KEY_PAYLOAD`). A longer payload is rejected.
pub const MAX_KEY_PAYLOAD: usize = 256;

/// Descriptors the control buffer has room for in one message (PegaFlow's
/// `MAX_RECEIVED_FDS`). All of them are taken and closed when a message carries more than one;
/// beyond this the kernel truncates the control data (`MSG_CTRUNC`) and the message is rejected.
pub const MAX_RECEIVED_FDS: usize = 16;

/// Acknowledgement of a v2 message: its descriptor is filed and waits to be taken.
pub const ACK_FILED: u8 = 0;
/// Acknowledgement of a v2 message: a descriptor is already pending under its key; the new
/// one was closed.
pub const ACK_DUPLICATE: u8 = 1;
/// Acknowledgement of a v2 message: `max_pending` descriptors are pending; it was closed.
pub const ACK_CAPACITY: u8 = 2;
/// Pause after a failed `accept` (e.g. `EMFILE`), so a persistent error does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Bounds of the side channel.
#[derive(Debug, Clone)]
pub struct FdChannelLimits {
    /// Concurrent connection handlers (PegaFlow: 64). Must be at least 1.
    pub max_connections: usize,
    /// Descriptors received but not yet taken (PegaFlow: 1024). Must be at least 1.
    pub max_pending: usize,
    /// How long an untaken descriptor is kept (PegaFlow: 60 s). Must be > 0.
    pub pending_ttl: Duration,
    /// How long a connection may stay silent before it is closed (PegaFlow: 5 s). Must be > 0.
    pub receive_timeout: Duration,
}

impl Default for FdChannelLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_pending: 1024,
            pending_ttl: Duration::from_secs(60),
            receive_timeout: Duration::from_secs(5),
        }
    }
}

impl FdChannelLimits {
    fn validate(&self) -> io::Result<()> {
        let bad = |what: &str| {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fd side channel: {what}"),
            ))
        };
        if self.max_connections == 0 {
            return bad("max_connections must be at least 1");
        }
        if self.max_pending == 0 {
            return bad("max_pending must be at least 1");
        }
        if self.pending_ttl.is_zero() {
            return bad("pending_ttl must be > 0");
        }
        if self.receive_timeout.is_zero() {
            return bad("receive_timeout must be > 0");
        }
        Ok(())
    }
}

/// A snapshot of the side channel's counters (monotonic since bind unless noted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FdChannelStats {
    /// Descriptors received in a well-formed message and stored until taken.
    pub accepted: u64,
    /// Descriptors handed out by [`FdChannel::take`].
    pub delivered: u64,
    /// Messages rejected as malformed (bad payload, wrong descriptor count, truncated or
    /// foreign control data); their descriptors were closed.
    pub rejected_malformed: u64,
    /// Descriptors rejected because one was already pending under the same key (the first
    /// one wins).
    pub rejected_duplicate: u64,
    /// Descriptors rejected because `max_pending` descriptors were already pending.
    pub rejected_capacity: u64,
    /// Connections closed without a message: over the `max_connections` cap, silent past the
    /// receive timeout, closed by the sender before sending, or failed with an I/O error.
    pub connections_dropped: u64,
    /// Descriptors closed because nobody took them within the pending TTL.
    pub expired: u64,
    /// Pending descriptors closed by [`FdChannel::discard`].
    pub discarded: u64,
    /// Descriptors waiting to be taken now (a gauge).
    pub pending: u64,
    /// Connections being served now (a gauge).
    pub connections_open: u64,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    delivered: AtomicU64,
    rejected_malformed: AtomicU64,
    rejected_duplicate: AtomicU64,
    rejected_capacity: AtomicU64,
    connections_dropped: AtomicU64,
    expired: AtomicU64,
    discarded: AtomicU64,
    pending: AtomicU64,
    connections_open: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The key a descriptor is filed under: (instance id, device id, allocation index of a v2
/// message; `None` for a v1 message).
type Key = (String, i32, Option<u32>);

#[derive(Debug)]
struct PendingFd {
    fd: OwnedFd,
    arrived: Instant,
}

/// A refused registration's `(instance, device)`: a descriptor for it arriving on a
/// connection accepted before `horizon` was sent before the refusal was answered, so it
/// belongs to the refused registration (a client sends its descriptor first, then the RPC)
/// and is closed on arrival. Kept while such a connection is live.
#[derive(Debug)]
struct Refused {
    instance_id: String,
    device_id: i32,
    horizon: u64,
}

/// The descriptors waiting to be taken, and the refusals whose descriptors may still arrive.
#[derive(Debug, Default)]
struct Pending {
    map: HashMap<Key, PendingFd>,
    refused: VecDeque<Refused>,
}

impl Pending {
    /// Forgets the refusals no live connection can still bring a descriptor for (`oldest`:
    /// the smallest live connection's number), then those beyond `cap`, oldest first.
    fn prune_refused(&mut self, oldest: Option<u64>, cap: usize) {
        self.refused
            .retain(|r| oldest.is_some_and(|seq| seq < r.horizon));
        while self.refused.len() > cap {
            self.refused.pop_front();
        }
    }
}

/// State shared by the channel handle and its tasks; the tasks hold it weakly.
#[derive(Debug)]
struct Shared {
    limits: FdChannelLimits,
    pending: Mutex<Pending>,
    arrived: Notify,
    counters: Counters,
    /// Connections accepted and not done with their message yet, by sequence number
    /// ([`accept`]). Lock order: `pending`, then `live`.
    live: Mutex<BTreeSet<u64>>,
}

impl Shared {
    /// Removes entries older than the TTL from `map`; returns them so the caller closes them
    /// after releasing the lock.
    fn purge_locked(
        &self,
        map: &mut HashMap<Key, PendingFd>,
        now: Instant,
    ) -> Vec<(Key, PendingFd)> {
        let ttl = self.limits.pending_ttl;
        let expired: Vec<Key> = map
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.arrived) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        let out: Vec<(Key, PendingFd)> = expired
            .into_iter()
            .filter_map(|k| map.remove_entry(&k))
            .collect();
        if !out.is_empty() {
            self.counters
                .expired
                .fetch_add(out.len() as u64, Ordering::Relaxed);
            self.counters
                .pending
                .store(map.len() as u64, Ordering::Relaxed);
        }
        out
    }

    fn log_expired(&self, expired: Vec<(Key, PendingFd)>) {
        for ((instance_id, device_id, _), _) in &expired {
            warn!(
                instance_id = %instance_id,
                device_id,
                ttl_secs = self.limits.pending_ttl.as_secs_f64(),
                "fd side channel: closing a descriptor nobody took within the pending TTL"
            );
        }
        // Dropping closes the descriptors, outside the lock.
        drop(expired);
    }

    /// Closes every descriptor older than the TTL.
    fn purge_expired(&self) {
        let expired = {
            let mut p = self.pending.lock();
            self.purge_locked(&mut p.map, Instant::now())
        };
        self.log_expired(expired);
    }

    /// Purges expired entries, then removes and returns the descriptor under `key`.
    fn remove(&self, key: &Key) -> Option<OwnedFd> {
        let (expired, found) = {
            let mut p = self.pending.lock();
            let expired = self.purge_locked(&mut p.map, Instant::now());
            let found = p.map.remove(key);
            self.counters
                .pending
                .store(p.map.len() as u64, Ordering::Relaxed);
            (expired, found)
        };
        self.log_expired(expired);
        found.map(|p| {
            bump(&self.counters.delivered);
            p.fd
        })
    }

    /// Files a well-formed message's descriptor that arrived on connection `seq`, or rejects it
    /// (closing it); returns the acknowledgement byte of the outcome, `None` when it belonged
    /// to a refused registration (closed, counted as discarded).
    fn insert(&self, key: Key, fd: OwnedFd, seq: u64) -> Option<u8> {
        let now = Instant::now();
        let (expired, outcome) = {
            let mut p = self.pending.lock();
            let expired = self.purge_locked(&mut p.map, now);
            let refused = p
                .refused
                .iter()
                .any(|r| seq < r.horizon && r.instance_id == key.0 && r.device_id == key.1);
            let outcome = if refused {
                Err(Err(fd))
            } else if p.map.len() >= self.limits.max_pending {
                Err(Ok(fd))
            } else if p.map.contains_key(&key) {
                Ok(Some(fd))
            } else {
                p.map.insert(key.clone(), PendingFd { fd, arrived: now });
                self.counters
                    .pending
                    .store(p.map.len() as u64, Ordering::Relaxed);
                Ok(None)
            };
            (expired, outcome)
        };
        self.log_expired(expired);
        let (instance_id, device_id, index) = key;
        match outcome {
            Ok(None) => {
                bump(&self.counters.accepted);
                debug!(instance_id = %instance_id, device_id, ?index, "fd side channel: descriptor received");
                self.arrived.notify_waiters();
                Some(ACK_FILED)
            }
            Ok(Some(duplicate)) => {
                drop(duplicate);
                bump(&self.counters.rejected_duplicate);
                warn!(
                    instance_id = %instance_id,
                    device_id,
                    "fd side channel: a descriptor is already pending for this key; closing the new one"
                );
                Some(ACK_DUPLICATE)
            }
            Err(Ok(surplus)) => {
                drop(surplus);
                bump(&self.counters.rejected_capacity);
                warn!(
                    instance_id = %instance_id,
                    device_id,
                    max_pending = self.limits.max_pending,
                    "fd side channel: too many descriptors pending; closing the new one"
                );
                Some(ACK_CAPACITY)
            }
            Err(Err(late)) => {
                drop(late);
                bump(&self.counters.discarded);
                debug!(instance_id = %instance_id, device_id, ?index, "fd side channel: closed a descriptor of a refused registration that arrived after the refusal");
                None
            }
        }
    }

    fn stats(&self) -> FdChannelStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FdChannelStats {
            accepted: get(&c.accepted),
            delivered: get(&c.delivered),
            rejected_malformed: get(&c.rejected_malformed),
            rejected_duplicate: get(&c.rejected_duplicate),
            rejected_capacity: get(&c.rejected_capacity),
            connections_dropped: get(&c.connections_dropped),
            expired: get(&c.expired),
            discarded: get(&c.discarded),
            pending: get(&c.pending),
            connections_open: get(&c.connections_open),
        }
    }
}
/// The side channel. Shared as `Arc<FdChannel>`; when the last handle drops, the accept loop
/// and every pending receive stop, untaken descriptors are closed, and the socket file is
/// removed if it is still the one this channel created.
pub struct FdChannel {
    path: PathBuf,
    identity: FileIdentity,
    shared: Arc<Shared>,
    acceptor: Arc<Acceptor>,
    shutdown: watch::Sender<bool>,
    accept_task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for FdChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdChannel")
            .field("path", &self.path)
            .field("stats", &self.stats())
            .finish()
    }
}

impl FdChannel {
    /// Binds the socket at `path` (mode 0600) and starts accepting. Must be called inside a
    /// tokio runtime.
    ///
    /// When something already exists at `path`: a file that is not a socket is left alone and
    /// the bind fails (`AlreadyExists`); a socket with a live listener is left alone and the
    /// bind fails (`AddrInUse`); a stale socket (connecting is refused) is removed and
    /// replaced, provided it is still the same file (device, inode) after the probe.
    ///
    /// Errors: invalid `limits` (`InvalidInput`), a path too long for a Unix socket address,
    /// and any error of `socket`, `bind`, `listen` or the stale-socket probe, with the path in
    /// the message.
    pub async fn bind(path: &Path, limits: FdChannelLimits) -> io::Result<Arc<Self>> {
        limits.validate()?;
        create_parent(path)?;
        // Every call below returns without waiting (the probe connects non-blocking), so it
        // runs inline rather than on a blocking thread.
        let (sock, identity) = bind_socket(path)?;
        let listener = std::os::unix::net::UnixListener::from(sock);
        let shared = Arc::new(Shared {
            limits: limits.clone(),
            pending: Mutex::new(Pending::default()),
            arrived: Notify::new(),
            counters: Counters::default(),
            live: Mutex::new(BTreeSet::new()),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        let acceptor = match Acceptor::new(
            listener,
            Arc::downgrade(&shared),
            limits.max_connections,
            limits.receive_timeout,
            shutdown_rx.clone(),
        ) {
            Ok(a) => Arc::new(a),
            Err(e) => {
                remove_socket_if_ours(path, identity);
                return Err(e);
            }
        };
        let accept_task = tokio::spawn(accept_loop(
            acceptor.clone(),
            limits.pending_ttl,
            shutdown_rx,
        ));
        info!(path = %path.display(), "fd side channel listening");
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            identity,
            shared,
            acceptor,
            shutdown,
            accept_task,
        }))
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the descriptor sent for `(instance_id, device_id)`, waiting up to `timeout` for
    /// it to arrive. `None` (with a warning in the log) when none arrived in time. Expired
    /// descriptors are closed first, so a descriptor older than the pending TTL is never
    /// returned.
    pub async fn take(
        &self,
        instance_id: &str,
        device_id: i32,
        timeout: Duration,
    ) -> Option<OwnedFd> {
        let start = tokio::time::Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or_else(|| start + Duration::from_secs(365 * 24 * 3600));
        self.take_key((instance_id.to_owned(), device_id, None), deadline)
            .await
    }

    /// Takes the descriptor of allocation `index` of a native registration v2 of
    /// `(instance_id, device_id)` (sent with the payload `instance_id \0 device_id \0 index`),
    /// waiting until `deadline`. `None` (with a warning) when none arrived in time; expired
    /// descriptors are never returned.
    pub async fn take_allocation(
        &self,
        instance_id: &str,
        device_id: i32,
        index: u32,
        deadline: tokio::time::Instant,
    ) -> Option<OwnedFd> {
        self.take_key((instance_id.to_owned(), device_id, Some(index)), deadline)
            .await
    }

    async fn take_key(&self, key: Key, deadline: tokio::time::Instant) -> Option<OwnedFd> {
        let (instance_id, device_id) = (key.0.as_str(), key.1);
        loop {
            // Register for the wake-up before looking, so an arrival between the look and
            // the wait is not missed.
            let notified = self.shared.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(fd) = self.shared.remove(&key) {
                return Some(fd);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                if let Some(fd) = self.shared.remove(&key) {
                    return Some(fd);
                }
                warn!(
                    instance_id = %instance_id,
                    device_id,
                    allocation_index = ?key.2,
                    path = %self.path.display(),
                    "fd side channel: no descriptor arrived for this key in time"
                );
                return None;
            }
        }
    }

    /// Closes every descriptor sent for `(instance_id, device_id)` (the v1 one and those of
    /// every allocation index of a v2 registration) up to now, without waiting; returns
    /// whether one was pending. A registration that fails calls this so that no descriptor of
    /// it outlives the failure and the client can resend under the same key at once (the first
    /// pending descriptor would otherwise block a resend until it expires).
    ///
    /// "Up to now" includes descriptors still on their way: a client sends its descriptor
    /// before its RPC, and a refusal can be decided before the server has read it (its
    /// connection still queued on the socket, or read by a handler not yet run). Every queued
    /// connection is accepted first; a descriptor for this key that then arrives on any
    /// connection accepted so far is closed on arrival (counted in `discarded`). One sent on
    /// a connection opened later (a resend after the refusal) is filed as usual.
    pub fn discard(&self, instance_id: &str, device_id: i32) -> bool {
        let (horizon, stopped) = self.acceptor.accept_queued();
        if let Some(e) = stopped {
            debug!(error = %e, "fd side channel: accepting queued connections before a discard stopped early");
        }
        let removed: Vec<PendingFd> = {
            let mut p = self.shared.pending.lock();
            let keys: Vec<Key> = p
                .map
                .keys()
                .filter(|k| k.0 == instance_id && k.1 == device_id)
                .cloned()
                .collect();
            let removed = keys.iter().filter_map(|k| p.map.remove(k)).collect();
            self.shared
                .counters
                .pending
                .store(p.map.len() as u64, Ordering::Relaxed);
            let oldest = self.shared.live.lock().first().copied();
            if oldest.is_some_and(|seq| seq < horizon) {
                p.refused.push_back(Refused {
                    instance_id: instance_id.to_owned(),
                    device_id,
                    horizon,
                });
            }
            p.prune_refused(oldest, self.shared.limits.max_pending);
            removed
        };
        let n = removed.len();
        // Dropping closes the descriptors, outside the lock.
        drop(removed);
        if n == 0 {
            return false;
        }
        self.shared
            .counters
            .discarded
            .fetch_add(n as u64, Ordering::Relaxed);
        debug!(instance_id = %instance_id, device_id, count = n, "fd side channel: pending descriptors discarded");
        true
    }

    /// Descriptors received and not yet taken.
    pub fn pending(&self) -> usize {
        self.shared.pending.lock().map.len()
    }

    /// A snapshot of the channel's counters.
    pub fn stats(&self) -> FdChannelStats {
        self.shared.stats()
    }
}

impl Drop for FdChannel {
    fn drop(&mut self) {
        // Wakes every connection handler (they stop without touching the map) and the accept
        // loop; aborting the loop also releases the listening socket promptly.
        self.shutdown.send_replace(true);
        self.accept_task.abort();
        remove_socket_if_ours(&self.path, self.identity);
        // The pending descriptors close when `shared` drops (the tasks hold it weakly).
    }
}

#[async_trait::async_trait]
impl pegaflow_plugin::SideChannel for FdChannel {
    fn path(&self) -> &Path {
        FdChannel::path(self)
    }
    async fn take(&self, instance_id: &str, device_id: i32, timeout: Duration) -> Option<OwnedFd> {
        FdChannel::take(self, instance_id, device_id, timeout).await
    }
    async fn take_allocation(
        &self,
        instance_id: &str,
        device_id: i32,
        index: u32,
        deadline: tokio::time::Instant,
    ) -> Option<OwnedFd> {
        FdChannel::take_allocation(self, instance_id, device_id, index, deadline).await
    }
    fn discard(&self, instance_id: &str, device_id: i32) -> bool {
        FdChannel::discard(self, instance_id, device_id)
    }
}
