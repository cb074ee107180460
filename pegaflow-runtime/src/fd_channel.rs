//! The fd side channel: a Unix stream socket on which native clients hand the server one
//! descriptor per registration (a CUDA VMM export or a host memfd), keyed by
//! `instance_id \0 device_id` (`native-clients.md` §1.4 and §3.2).
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
//! Bounds (DESIGN.md §6.4): at most [`FdChannelLimits::max_connections`] connections are
//! served at once (others are closed on arrival), a connection that stays silent for
//! [`FdChannelLimits::receive_timeout`] is closed, at most [`FdChannelLimits::max_pending`]
//! descriptors wait to be taken, and each waits at most [`FdChannelLimits::pending_ttl`].
//! Every descriptor the kernel hands us is owned ([`OwnedFd`]) from the moment `recvmsg`
//! returns, so whatever path a message takes, surplus or rejected descriptors are closed.
//!
//! Socket permissions: the socket is created with `fchmod(0600)` *before* `bind`, which Linux
//! applies to the inode that `bind` creates (masked by the umask), so there is no window in
//! which the path is connectable by other users, and the process-wide umask is never touched
//! (changing it would race with every other thread creating files). After `bind` the mode is
//! checked and, should a kernel not honour the early `fchmod`, set to 0600 with `chmod`.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use nix::sys::stat::Mode;
use parking_lot::Mutex;
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

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

/// The listen backlog of the socket.
const LISTEN_BACKLOG: i32 = 128;

/// Pause after a failed `accept` (e.g. `EMFILE`), so a persistent error does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Bytes of control space: room for `MAX_RECEIVED_FDS` descriptors in one `SCM_RIGHTS` message.
// SAFETY: CMSG_SPACE is pure arithmetic on its argument.
const CONTROL_BYTES: usize =
    unsafe { libc::CMSG_SPACE((MAX_RECEIVED_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;

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

/// State shared by the channel handle and its tasks; the tasks hold it weakly.
#[derive(Debug)]
struct Shared {
    limits: FdChannelLimits,
    pending: Mutex<HashMap<Key, PendingFd>>,
    arrived: Notify,
    counters: Counters,
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
            let mut map = self.pending.lock();
            self.purge_locked(&mut map, Instant::now())
        };
        self.log_expired(expired);
    }

    /// Purges expired entries, then removes and returns the descriptor under `key`.
    fn remove(&self, key: &Key) -> Option<OwnedFd> {
        let (expired, found) = {
            let mut map = self.pending.lock();
            let expired = self.purge_locked(&mut map, Instant::now());
            let found = map.remove(key);
            self.counters
                .pending
                .store(map.len() as u64, Ordering::Relaxed);
            (expired, found)
        };
        self.log_expired(expired);
        found.map(|p| {
            bump(&self.counters.delivered);
            p.fd
        })
    }

    /// Files a well-formed message's descriptor, or rejects it (closing it); returns the
    /// acknowledgement byte of the outcome.
    fn insert(&self, key: Key, fd: OwnedFd) -> u8 {
        let now = Instant::now();
        let (expired, outcome) = {
            let mut map = self.pending.lock();
            let expired = self.purge_locked(&mut map, now);
            let outcome = if map.len() >= self.limits.max_pending {
                Err(fd)
            } else if map.contains_key(&key) {
                Ok(Some(fd))
            } else {
                map.insert(key.clone(), PendingFd { fd, arrived: now });
                self.counters
                    .pending
                    .store(map.len() as u64, Ordering::Relaxed);
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
                ACK_FILED
            }
            Ok(Some(duplicate)) => {
                drop(duplicate);
                bump(&self.counters.rejected_duplicate);
                warn!(
                    instance_id = %instance_id,
                    device_id,
                    "fd side channel: a descriptor is already pending for this key; closing the new one"
                );
                ACK_DUPLICATE
            }
            Err(surplus) => {
                drop(surplus);
                bump(&self.counters.rejected_capacity);
                warn!(
                    instance_id = %instance_id,
                    device_id,
                    max_pending = self.limits.max_pending,
                    "fd side channel: too many descriptors pending; closing the new one"
                );
                ACK_CAPACITY
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

/// The (device, inode) pair that identifies the socket file we created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    fn of(m: &std::fs::Metadata) -> Self {
        Self {
            dev: m.dev(),
            ino: m.ino(),
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
        let listener = match UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                remove_socket_if_ours(path, identity);
                return Err(e);
            }
        };
        let shared = Arc::new(Shared {
            limits: limits.clone(),
            pending: Mutex::new(HashMap::new()),
            arrived: Notify::new(),
            counters: Counters::default(),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        let accept_task = tokio::spawn(accept_loop(
            listener,
            Arc::downgrade(&shared),
            limits,
            shutdown_rx,
        ));
        info!(path = %path.display(), "fd side channel listening");
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            identity,
            shared,
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

    /// Closes every descriptor pending for `(instance_id, device_id)` (the v1 one and those of
    /// every allocation index of a v2 registration), without waiting; returns whether there
    /// was one. A registration that fails calls this so that no descriptor of it outlives
    /// the failure and the client can resend under the same key at once (the first pending
    /// descriptor would otherwise block a resend until it expires).
    pub fn discard(&self, instance_id: &str, device_id: i32) -> bool {
        let removed: Vec<PendingFd> = {
            let mut map = self.shared.pending.lock();
            let keys: Vec<Key> = map
                .keys()
                .filter(|k| k.0 == instance_id && k.1 == device_id)
                .cloned()
                .collect();
            let removed = keys.iter().filter_map(|k| map.remove(k)).collect();
            self.shared
                .counters
                .pending
                .store(map.len() as u64, Ordering::Relaxed);
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
        self.shared.pending.lock().len()
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

fn io_context(e: impl Into<io::Error>, what: impl std::fmt::Display) -> io::Error {
    let e: io::Error = e.into();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Creates the socket's missing parent directories, owner-only (mode 0700: the socket hands
/// out memory of every registering process), as `/run/pegaflow` on a fresh host. An existing
/// directory is left as it is.
fn create_parent(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    if parent.exists() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot create the side channel's directory {}: {e}",
                    parent.display()
                ),
            )
        })?;
    info!(dir = %parent.display(), "created the side channel's directory (mode 0700)");
    Ok(())
}

/// Creates, binds (replacing a stale socket) and listens; returns the listening socket and
/// the identity of the socket file.
fn bind_socket(path: &Path) -> io::Result<(OwnedFd, FileIdentity)> {
    let shown = path.display();
    let addr = UnixAddr::new(path)
        .map_err(|e| io_context(e, format_args!("fd side channel path {shown}")))?;
    let sock = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| io_context(e, "fd side channel: socket"))?;
    // Linux creates the socket inode with this mode (masked by the umask) at bind time.
    nix::sys::stat::fchmod(&sock, Mode::from_bits_truncate(0o600))
        .map_err(|e| io_context(e, "fd side channel: fchmod socket"))?;
    match socket::bind(sock.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::EADDRINUSE) => {
            clear_stale_socket(path)?;
            socket::bind(sock.as_raw_fd(), &addr)
                .map_err(|e| io_context(e, format_args!("bind fd side channel at {shown}")))?;
        }
        Err(e) => {
            return Err(io_context(
                e,
                format_args!("bind fd side channel at {shown}"),
            ))
        }
    }
    // The file is ours from here: remove it again on any later failure.
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| io_context(e, format_args!("stat fd side channel {shown}")))?;
    let identity = FileIdentity::of(&meta);
    let finish = || -> io::Result<()> {
        if meta.permissions().mode() & 0o777 != 0o600 {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io_context(e, format_args!("chmod 0600 {shown}")))?;
        }
        let backlog = Backlog::new(LISTEN_BACKLOG).map_err(io::Error::from)?;
        socket::listen(&sock, backlog)
            .map_err(|e| io_context(e, format_args!("listen on {shown}")))?;
        Ok(())
    };
    if let Err(e) = finish() {
        remove_socket_if_ours(path, identity);
        return Err(e);
    }
    Ok((sock, identity))
}

/// What connecting to an existing socket file showed.
enum Probe {
    /// Something accepts (or queues) connections there.
    Live,
    /// Nobody listens (`ECONNREFUSED`), or the file vanished.
    Stale,
}

fn probe_socket(path: &Path) -> io::Result<Probe> {
    let shown = path.display();
    let addr = UnixAddr::new(path)
        .map_err(|e| io_context(e, format_args!("fd side channel path {shown}")))?;
    let probe = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| io_context(e, "fd side channel: probe socket"))?;
    match socket::connect(probe.as_raw_fd(), &addr) {
        // A full backlog answers EAGAIN to a non-blocking connect: still a live listener.
        Ok(()) | Err(Errno::EAGAIN) | Err(Errno::EINPROGRESS) => Ok(Probe::Live),
        Err(Errno::ECONNREFUSED) | Err(Errno::ENOENT) => Ok(Probe::Stale),
        Err(e) => Err(io_context(
            e,
            format_args!("fd side channel: probing the existing socket {shown}"),
        )),
    }
}

/// Called when `bind` found `path` taken: removes it if it is a stale socket that did not
/// change while we looked; otherwise fails and leaves it alone.
fn clear_stale_socket(path: &Path) -> io::Result<()> {
    let shown = path.display();
    let before = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_context(e, format_args!("stat {shown}"))),
    };
    if !before.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "fd side channel path {shown} exists and is not a socket; refusing to replace it"
            ),
        ));
    }
    match probe_socket(path)? {
        Probe::Live => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "fd side channel path {shown} has a live listener (another server is running?)"
            ),
        )),
        Probe::Stale => {
            let after = match std::fs::symlink_metadata(path) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(io_context(e, format_args!("stat {shown}"))),
            };
            if FileIdentity::of(&after) != FileIdentity::of(&before)
                || !after.file_type().is_socket()
            {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("fd side channel path {shown} changed while probing it; refusing to replace it"),
                ));
            }
            match std::fs::remove_file(path) {
                Ok(()) => {
                    info!(path = %shown, "fd side channel: removed a stale socket");
                    Ok(())
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_context(e, format_args!("remove stale socket {shown}"))),
            }
        }
    }
}

/// Removes `path` only if it is still the socket file we created.
fn remove_socket_if_ours(path: &Path, identity: FileIdentity) {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() && FileIdentity::of(&m) == identity => {
            match std::fs::remove_file(path) {
                Ok(()) => debug!(path = %shown, "fd side channel: socket removed"),
                Err(e) => {
                    warn!(path = %shown, error = %e, "fd side channel: could not remove the socket")
                }
            }
        }
        Ok(_) => warn!(
            path = %shown,
            "fd side channel: the path was replaced since bind; leaving it in place"
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            debug!(path = %shown, "fd side channel: socket already removed")
        }
        Err(e) => warn!(path = %shown, error = %e, "fd side channel: could not stat the socket"),
    }
}

/// Resolves once the channel is shutting down (the flag is set or the handle is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&stop| stop).await;
}

fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

async fn accept_loop(
    listener: UnixListener,
    shared: Weak<Shared>,
    limits: FdChannelLimits,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let handler_shutdown = shutdown.clone();
    let mut sweep = tokio::time::interval(sweep_period(limits.pending_ttl));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            _ = sweep.tick() => {
                let Some(s) = shared.upgrade() else { break };
                s.purge_expired();
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let Some(s) = shared.upgrade() else { break };
                    match Arc::clone(&slots).try_acquire_owned() {
                        Ok(permit) => {
                            s.counters.connections_open.fetch_add(1, Ordering::Relaxed);
                            tokio::spawn(handle_connection(
                                stream,
                                Arc::downgrade(&s),
                                limits.receive_timeout,
                                handler_shutdown.clone(),
                                permit,
                            ));
                        }
                        Err(_) => {
                            drop(stream);
                            bump(&s.counters.connections_dropped);
                            warn!(
                                max_connections = limits.max_connections,
                                "fd side channel: all connection slots busy; closing a new connection"
                            );
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "fd side channel: accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
            },
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

async fn handle_connection(
    stream: UnixStream,
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
    // until its socket is closed.
    let stream = stream;
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
                let ack = shared.insert(key, fd);
                if v2 {
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

/// Why a message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedMessage {
    /// The kernel truncated the payload (`MSG_TRUNC`) or the control data (`MSG_CTRUNC`).
    #[error("message truncated (payload or control data larger than the receive buffers)")]
    Truncated,
    /// A control message other than `SCM_RIGHTS`, or one with an impossible length.
    #[error("unexpected control message (only one SCM_RIGHTS is allowed)")]
    UnexpectedControl,
    /// Not exactly one descriptor.
    #[error("expected exactly one descriptor, got {0}")]
    FdCount(usize),
    /// The payload exceeds [`MAX_KEY_PAYLOAD`] bytes.
    #[error("payload longer than {MAX_KEY_PAYLOAD} bytes")]
    Oversized,
    /// No NUL between instance id and device id.
    #[error("payload has no NUL between instance id and device id")]
    NoSeparator,
    /// The instance id is not 1-128 bytes of `[A-Za-z0-9_-]`.
    #[error("instance id {0:?} is not 1-128 characters of [A-Za-z0-9_-]")]
    UnsafeInstanceId(String),
    /// The device id is not a decimal i32.
    #[error("device id {0:?} is not a decimal 32-bit integer")]
    BadDeviceId(String),
    /// The allocation index of a v2 message is not a decimal integer below
    /// [`crate::decode::MAX_NATIVE_ALLOCATIONS`].
    #[error("allocation index {0:?} is not a decimal integer below the most allocations one registration names")]
    BadAllocationIndex(String),
}

/// One `recvmsg` worth of data: everything is owned, so dropping it closes every descriptor.
struct RawMessage {
    payload: Vec<u8>,
    flags: libc::c_int,
    fds: Vec<OwnedFd>,
    unexpected_control: bool,
}

impl RawMessage {
    /// Nothing arrived: the sender closed the connection without sending.
    fn is_empty(&self) -> bool {
        self.payload.is_empty()
            && self.fds.is_empty()
            && !self.unexpected_control
            && self.flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) == 0
    }

    /// Validates the message and parses its key; on error every descriptor is closed.
    fn into_key(mut self) -> Result<(Key, OwnedFd), MalformedMessage> {
        if self.flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(MalformedMessage::Truncated);
        }
        if self.unexpected_control {
            return Err(MalformedMessage::UnexpectedControl);
        }
        if self.fds.len() != 1 {
            return Err(MalformedMessage::FdCount(self.fds.len()));
        }
        if self.payload.len() > MAX_KEY_PAYLOAD {
            return Err(MalformedMessage::Oversized);
        }
        let key = parse_key(&self.payload)?;
        let fd = self.fds.pop().ok_or(MalformedMessage::FdCount(0))?;
        Ok((key, fd))
    }
}

/// Parses `instance_id \0 device_id [\0...]` (v1) or `instance_id \0 device_id \0 index
/// [\0...]` (native registration v2).
fn parse_key(payload: &[u8]) -> Result<Key, MalformedMessage> {
    let nul = payload
        .iter()
        .position(|&b| b == 0)
        .ok_or(MalformedMessage::NoSeparator)?;
    let (id, rest) = (&payload[..nul], &payload[nul + 1..]);
    let instance_id = match std::str::from_utf8(id) {
        Ok(s) if pegaflow_api::is_side_channel_safe_id(s) => s.to_owned(),
        _ => {
            return Err(MalformedMessage::UnsafeInstanceId(
                String::from_utf8_lossy(id).into_owned(),
            ))
        }
    };
    let end = rest.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let rest = &rest[..end];
    let (device, index) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let device_id = std::str::from_utf8(device)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
        .and_then(|s| s.parse::<i32>().ok())
        .ok_or_else(|| {
            MalformedMessage::BadDeviceId(String::from_utf8_lossy(device).into_owned())
        })?;
    let index = match index {
        None => None,
        Some(ix) => Some(
            std::str::from_utf8(ix)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u32>().ok())
                .filter(|&i| (i as usize) < crate::decode::MAX_NATIVE_ALLOCATIONS)
                .ok_or_else(|| {
                    MalformedMessage::BadAllocationIndex(String::from_utf8_lossy(ix).into_owned())
                })?,
        ),
    };
    Ok((instance_id, device_id, index))
}

/// Waits for the connection to become readable and performs the one `recvmsg`.
async fn receive_message(stream: &UnixStream) -> io::Result<RawMessage> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || recv_with_fds(stream.as_raw_fd())) {
            Ok(m) => return Ok(m),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
}

/// One non-blocking `recvmsg` with `MSG_CMSG_CLOEXEC`, a payload buffer one byte larger than
/// [`MAX_KEY_PAYLOAD`] (a stream socket never reports `MSG_TRUNC`, so the extra byte is what
/// detects an oversized payload) and control space for [`MAX_RECEIVED_FDS`] descriptors.
/// Every descriptor in every `SCM_RIGHTS` control message becomes an [`OwnedFd`] before this
/// returns.
fn recv_with_fds(sock: RawFd) -> io::Result<RawMessage> {
    let mut payload = [0u8; MAX_KEY_PAYLOAD + 1];
    // u64 words keep the control buffer aligned for `cmsghdr`.
    let mut control = [0u64; CONTROL_BYTES.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is a plain C struct; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CONTROL_BYTES as _;
    // SAFETY: msg points at live buffers of the stated sizes for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let mut unexpected_control = false;
    let control_start = control.as_ptr() as usize;
    let control_len = (msg.msg_controllen as usize).min(CONTROL_BYTES);
    // SAFETY: CMSG_LEN is pure arithmetic.
    let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
    // SAFETY: msg's control pointer and length describe the buffer the kernel filled.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR only return headers that start inside the
        // control buffer with room for a full header; the buffer is aligned for cmsghdr.
        let hdr = unsafe { &*cmsg };
        let offset = cmsg as usize - control_start;
        let len = hdr.cmsg_len as usize;
        if len < header_len || offset + len > control_len {
            // The kernel never writes this; stop walking rather than read past the data.
            unexpected_control = true;
            break;
        }
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            let count = (len - header_len) / std::mem::size_of::<RawFd>();
            // SAFETY: the data of this header lies inside the control buffer (checked above).
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: i < count keeps the read inside this header's data; the data may be
                // unaligned for RawFd in principle, hence read_unaligned.
                let raw = unsafe { std::ptr::read_unaligned(data.add(i)) };
                if raw >= 0 {
                    // SAFETY: the kernel just installed this descriptor in our table for us;
                    // nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        } else {
            unexpected_control = true;
        }
        // SAFETY: msg and cmsg describe the control buffer as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(RawMessage {
        payload: payload[..n as usize].to_vec(),
        flags: msg.msg_flags,
        fds,
        unexpected_control,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;
    use std::os::fd::{AsFd, BorrowedFd};
    use std::os::unix::net::UnixStream as StdUnixStream;

    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

    fn limits() -> FdChannelLimits {
        FdChannelLimits {
            max_connections: 8,
            max_pending: 16,
            pending_ttl: Duration::from_secs(60),
            receive_timeout: Duration::from_millis(200),
        }
    }

    fn sock_path(dir: &tempfile::TempDir) -> PathBuf {
        dir.path().join("fd.sock")
    }

    /// A pipe: (read end, write end), both non-blocking. Sending the write end and dropping
    /// ours lets the read end observe whether the server still holds a copy: EOF means
    /// every copy is closed.
    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: fds has room for the two descriptors pipe2 writes.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        assert_eq!(rc, 0, "pipe2: {}", io::Error::last_os_error());
        // SAFETY: pipe2 succeeded; both descriptors are new and ours.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    /// Whether every write end of the pipe is closed (read returns EOF).
    fn write_end_closed(read_end: &OwnedFd) -> bool {
        let mut b = [0u8; 8];
        match nix::unistd::read(read_end, &mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(Errno::EAGAIN) => false,
            Err(e) => panic!("read pipe: {e}"),
        }
    }

    async fn assert_eventually_closed(read_end: &OwnedFd, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !write_end_closed(read_end) {
            assert!(
                Instant::now() < deadline,
                "{what}: the server kept (leaked) the descriptor"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn wait_stats(ch: &FdChannel, what: &str, pred: impl Fn(&FdChannelStats) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = ch.stats();
            if pred(&s) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: stats never matched: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn send_raw(path: &Path, payload: &[u8], fds: &[RawFd]) {
        let s = StdUnixStream::connect(path).expect("connect");
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
        sendmsg::<()>(
            s.as_raw_fd(),
            &[IoSlice::new(payload)],
            cmsgs,
            MsgFlags::empty(),
            None,
        )
        .expect("sendmsg");
    }

    fn send(path: &Path, id: &str, dev: i32, fd: BorrowedFd<'_>) {
        pegaflow_api::fd::send_fd(path, id, dev, fd).expect("send_fd");
    }

    fn same_file(a: &OwnedFd, b: &OwnedFd) -> bool {
        let sa = nix::sys::stat::fstat(a).expect("fstat");
        let sb = nix::sys::stat::fstat(b).expect("fstat");
        (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    }

    #[tokio::test]
    async fn missing_parent_directories_are_created_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/pegaflow/fd.sock");
        let ch = FdChannel::bind(&path, limits())
            .await
            .expect("bind creates the directory");
        let mode = std::fs::metadata(dir.path().join("run/pegaflow"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "the directory is owner-only");
        assert!(path.exists());
        drop(ch);
    }

    #[tokio::test]
    async fn fd_channel_delivers_fd_sent_before_take() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let (_r, w) = pipe();
        send(&path, "inst-a_1", 3, w.as_fd());
        wait_stats(&ch, "accepted", |s| s.accepted == 1 && s.pending == 1).await;
        assert_eq!(ch.pending(), 1);
        let got = ch
            .take("inst-a_1", 3, Duration::from_secs(2))
            .await
            .expect("fd");
        assert!(same_file(&got, &w));
        let s = ch.stats();
        assert_eq!((s.delivered, s.pending), (1, 0));
        // Taken once: gone.
        assert!(ch
            .take("inst-a_1", 3, Duration::from_millis(20))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn fd_channel_take_waits_for_a_later_fd() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let (_r, w) = pipe();
        let w2 = w.try_clone().unwrap();
        let p = path.clone();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            tokio::task::spawn_blocking(move || send(&p, "late", 0, w2.as_fd()))
                .await
                .unwrap();
        });
        let started = Instant::now();
        let got = ch
            .take("late", 0, Duration::from_secs(5))
            .await
            .expect("fd");
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(same_file(&got, &w));
        sender.await.unwrap();
        // A different device id is a different key.
        assert!(ch
            .take("late", 1, Duration::from_millis(30))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn fd_channel_duplicate_key_keeps_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let (_r1, w1) = pipe();
        let (r2, w2) = pipe();
        send(&path, "dup", 0, w1.as_fd());
        wait_stats(&ch, "first", |s| s.accepted == 1).await;
        send(&path, "dup", 0, w2.as_fd());
        wait_stats(&ch, "second", |s| s.rejected_duplicate == 1).await;
        drop(w2);
        assert_eventually_closed(&r2, "duplicate").await;
        let got = ch.take("dup", 0, Duration::from_secs(1)).await.expect("fd");
        assert!(same_file(&got, &w1));
    }

    #[tokio::test]
    async fn fd_channel_rejects_malformed_messages_without_leaking() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let mut expected_malformed = 0;

        // No descriptor at all.
        send_raw(&path, b"nofd\x000", &[]);
        expected_malformed += 1;
        wait_stats(&ch, "no fd", |s| s.rejected_malformed == expected_malformed).await;

        // Two descriptors: both closed.
        let (ra, wa) = pipe();
        let (rb, wb) = pipe();
        send_raw(&path, b"two\x000", &[wa.as_raw_fd(), wb.as_raw_fd()]);
        drop((wa, wb));
        expected_malformed += 1;
        wait_stats(&ch, "two fds", |s| {
            s.rejected_malformed == expected_malformed
        })
        .await;
        assert_eventually_closed(&ra, "two fds (first)").await;
        assert_eventually_closed(&rb, "two fds (second)").await;

        // Payloads that must be rejected, each with one descriptor.
        let oversized = {
            let mut p = b"big\x00".to_vec();
            p.resize(300, b'0');
            p
        };
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("no NUL", b"inst0".to_vec()),
            ("oversized", oversized),
            ("unsafe instance id", b"bad id!\x000".to_vec()),
            ("empty instance id", b"\x000".to_vec()),
            ("non-UTF-8 instance id", b"\xff\xfe\x000".to_vec()),
            ("bad device id", b"inst\x00abc".to_vec()),
            ("empty device id", b"inst\x00".to_vec()),
            ("device id overflows i32", b"inst\x0099999999999".to_vec()),
            ("device id with a space", b"inst\x00 1".to_vec()),
        ];
        for (what, payload) in cases {
            let (r, w) = pipe();
            send_raw(&path, &payload, &[w.as_raw_fd()]);
            drop(w);
            expected_malformed += 1;
            wait_stats(&ch, what, |s| s.rejected_malformed == expected_malformed).await;
            assert_eventually_closed(&r, what).await;
        }
        let s = ch.stats();
        assert_eq!((s.accepted, s.pending), (0, 0), "{s:?}");

        // A well-formed message with trailing NULs and a negative device still parses.
        let (_r, w) = pipe();
        send_raw(&path, b"ok-1\x00-2\x00\x00", &[w.as_raw_fd()]);
        assert!(ch.take("ok-1", -2, Duration::from_secs(2)).await.is_some());
        // Exactly MAX_KEY_PAYLOAD bytes is accepted.
        let mut max = vec![b'm'; 128];
        max.push(0);
        max.resize(MAX_KEY_PAYLOAD, b'0');
        max[MAX_KEY_PAYLOAD - 1] = b'7';
        send_raw(&path, &max, &[w.as_raw_fd()]);
        let id = "m".repeat(128);
        assert!(ch.take(&id, 7, Duration::from_secs(2)).await.is_some());
    }

    #[tokio::test]
    async fn fd_channel_drops_silent_and_empty_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        // Connect and close without sending.
        drop(StdUnixStream::connect(&path).unwrap());
        wait_stats(&ch, "empty", |s| s.connections_dropped == 1).await;
        // Connect and stay silent past the receive timeout: the server closes it.
        let silent = StdUnixStream::connect(&path).unwrap();
        wait_stats(&ch, "silent", |s| {
            s.connections_dropped == 2 && s.connections_open == 0
        })
        .await;
        let mut b = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &silent, &mut b).unwrap(),
            0,
            "server closed it"
        );
        assert_eq!(ch.stats().rejected_malformed, 0);
    }

    #[tokio::test]
    async fn fd_channel_untaken_fd_expires() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let lim = FdChannelLimits {
            pending_ttl: Duration::from_millis(150),
            ..limits()
        };
        let ch = FdChannel::bind(&path, lim).await.unwrap();
        let (r, w) = pipe();
        send(&path, "nobody", 0, w.as_fd());
        drop(w);
        wait_stats(&ch, "accepted", |s| s.accepted == 1).await;
        assert_eventually_closed(&r, "expired").await;
        let s = ch.stats();
        assert_eq!((s.expired, s.pending), (1, 0), "{s:?}");
        assert!(ch
            .take("nobody", 0, Duration::from_millis(20))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn fd_channel_closes_every_fd_of_an_overfull_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        // More descriptors than the control buffer holds: the kernel truncates (MSG_CTRUNC),
        // and every descriptor that did arrive must be closed.
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..MAX_RECEIVED_FDS + 4).map(|_| pipe()).collect();
        let raw: Vec<RawFd> = pipes.iter().map(|(_, w)| w.as_raw_fd()).collect();
        send_raw(&path, b"many\x000", &raw);
        let reads: Vec<OwnedFd> = pipes.into_iter().map(|(r, _w)| r).collect();
        wait_stats(&ch, "overfull", |s| s.rejected_malformed == 1).await;
        for (i, r) in reads.iter().enumerate() {
            assert_eventually_closed(r, &format!("overfull message, fd {i}")).await;
        }
        assert_eq!(ch.pending(), 0);
    }

    #[tokio::test]
    async fn fd_channel_discard_closes_a_pending_fd() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        assert!(!ch.discard("gone", 0));
        let (r, w) = pipe();
        send(&path, "gone", 0, w.as_fd());
        drop(w);
        wait_stats(&ch, "accepted", |s| s.accepted == 1).await;
        assert!(ch.discard("gone", 0));
        assert_eventually_closed(&r, "discarded").await;
        let s = ch.stats();
        assert_eq!((s.discarded, s.pending), (1, 0));
        // The key is free again: a resend is accepted, not a duplicate.
        let (_r2, w2) = pipe();
        send(&path, "gone", 0, w2.as_fd());
        assert!(ch.take("gone", 0, Duration::from_secs(2)).await.is_some());
        assert_eq!(ch.stats().rejected_duplicate, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fd_channel_v2_allocation_keys_are_distinct_and_discarded_together() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..3).map(|_| pipe()).collect();
        // Allocations 0..2 of one v2 registration, and a v1 descriptor under the same
        // (instance, device): four keys, none a duplicate of another.
        for (i, (_, w)) in pipes.iter().enumerate() {
            pegaflow_api::fd::send_allocation_fd(&path, "v2", 3, i as u32, w.as_fd()).unwrap();
        }
        let (r1, w1) = pipe();
        send(&path, "v2", 3, w1.as_fd());
        drop(w1);
        wait_stats(&ch, "accepted", |s| s.accepted == 4).await;
        assert_eq!(ch.stats().rejected_duplicate, 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        let got = ch.take_allocation("v2", 3, 1, deadline).await.unwrap();
        assert!(
            same_file(&got, &pipes[1].1),
            "index 1 gets allocation 1's fd"
        );
        // Another registration's index never matches: nothing under ("v2", 4, 0).
        let soon = tokio::time::Instant::now() + Duration::from_millis(50);
        assert!(ch.take_allocation("v2", 4, 0, soon).await.is_none());
        // A second descriptor for a pending key is refused, and the sender is told.
        let (_rd, wd) = pipe();
        let e = pegaflow_api::fd::send_allocation_fd(&path, "v2", 3, 0, wd.as_fd()).unwrap_err();
        assert!(
            matches!(&e, pegaflow_api::ApiError::Rejected { message, .. } if message.contains("already pending")),
            "{e}"
        );
        // Discard closes every remaining descriptor of (v2, 3): allocations 0 and 2 and v1.
        let pipes: Vec<OwnedFd> = pipes.into_iter().map(|(r, _)| r).collect();
        assert!(ch.discard("v2", 3));
        assert_eq!(ch.pending(), 0);
        assert_eq!(ch.stats().discarded, 3);
        assert_eventually_closed(&r1, "v1 key").await;
        assert_eventually_closed(&pipes[0], "allocation 0").await;
        assert_eventually_closed(&pipes[2], "allocation 2").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fd_channel_concurrent_takers_get_their_own_fds() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..8).map(|_| pipe()).collect();
        let takers: Vec<_> = (0..8)
            .map(|dev| {
                let ch = Arc::clone(&ch);
                tokio::spawn(async move { ch.take("multi", dev, Duration::from_secs(5)).await })
            })
            .collect();
        for (dev, (_, w)) in pipes.iter().enumerate().rev() {
            let (p, w) = (path.clone(), w.try_clone().unwrap());
            tokio::task::spawn_blocking(move || send(&p, "multi", dev as i32, w.as_fd()))
                .await
                .unwrap();
        }
        for (dev, t) in takers.into_iter().enumerate() {
            let got = t.await.unwrap().expect("fd");
            assert!(same_file(&got, &pipes[dev].1), "device {dev}");
        }
        assert_eq!(ch.stats().delivered, 8);
    }

    #[tokio::test]
    async fn fd_channel_rejects_over_max_pending() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let lim = FdChannelLimits {
            max_pending: 2,
            ..limits()
        };
        let ch = FdChannel::bind(&path, lim).await.unwrap();
        let (_r, w) = pipe();
        send(&path, "a", 0, w.as_fd());
        send(&path, "b", 0, w.as_fd());
        wait_stats(&ch, "two", |s| s.accepted == 2).await;
        let (r3, w3) = pipe();
        send(&path, "c", 0, w3.as_fd());
        drop(w3);
        wait_stats(&ch, "third", |s| s.rejected_capacity == 1).await;
        assert_eventually_closed(&r3, "over capacity").await;
        assert!(ch.take("a", 0, Duration::from_secs(1)).await.is_some());
        assert!(ch.take("b", 0, Duration::from_secs(1)).await.is_some());
        assert!(ch.take("c", 0, Duration::from_millis(20)).await.is_none());
    }

    #[tokio::test]
    async fn fd_channel_closes_connections_over_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let lim = FdChannelLimits {
            max_connections: 1,
            receive_timeout: Duration::from_secs(10),
            ..limits()
        };
        let ch = FdChannel::bind(&path, lim).await.unwrap();
        let busy = StdUnixStream::connect(&path).unwrap();
        wait_stats(&ch, "busy", |s| s.connections_open == 1).await;
        let (r, w) = pipe();
        send(&path, "excess", 0, w.as_fd());
        drop(w);
        wait_stats(&ch, "excess", |s| s.connections_dropped == 1).await;
        assert_eventually_closed(&r, "excess connection").await;
        drop(busy);
        wait_stats(&ch, "freed", |s| s.connections_open == 0).await;
        let (_r, w) = pipe();
        send(&path, "after", 0, w.as_fd());
        assert!(ch.take("after", 0, Duration::from_secs(2)).await.is_some());
    }

    #[tokio::test]
    async fn fd_channel_drop_closes_pending_fds_and_unlinks() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let (r, w) = pipe();
        send(&path, "left", 0, w.as_fd());
        drop(w);
        wait_stats(&ch, "accepted", |s| s.accepted == 1).await;
        drop(ch);
        assert_eventually_closed(&r, "pending at drop").await;
        assert!(!path.exists(), "socket removed on drop");
    }

    #[tokio::test]
    async fn fd_channel_socket_mode_is_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let _ch = FdChannel::bind(&path, limits()).await.unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
    }

    #[tokio::test]
    async fn fd_channel_replaces_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        // A listener that went away without removing its file.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        let (_r, w) = pipe();
        send(&path, "fresh", 0, w.as_fd());
        assert!(ch.take("fresh", 0, Duration::from_secs(2)).await.is_some());
    }

    #[tokio::test]
    async fn fd_channel_refuses_live_listener() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        let first = FdChannel::bind(&path, limits()).await.unwrap();
        let err = FdChannel::bind(&path, limits()).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        // The first channel still owns and serves the path.
        let (_r, w) = pipe();
        send(&path, "still", 0, w.as_fd());
        assert!(first
            .take("still", 0, Duration::from_secs(2))
            .await
            .is_some());
        // A foreign live listener is refused too.
        let other = dir.path().join("other.sock");
        let _l = std::os::unix::net::UnixListener::bind(&other).unwrap();
        let err = FdChannel::bind(&other, limits()).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        assert!(other.exists());
    }

    #[tokio::test]
    async fn fd_channel_keeps_non_socket_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        std::fs::write(&path, b"keep me").unwrap();
        let err = FdChannel::bind(&path, limits()).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
        // A symlink to a stale socket is not followed or removed either.
        let target = dir.path().join("target.sock");
        drop(std::os::unix::net::UnixListener::bind(&target).unwrap());
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(FdChannel::bind(&link, limits()).await.is_err());
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[tokio::test]
    async fn fd_channel_drop_leaves_a_replaced_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        // Replaced by a regular file.
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"someone else's").unwrap();
        drop(ch);
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
        std::fs::remove_file(&path).unwrap();
        // Replaced by another socket.
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        std::fs::remove_file(&path).unwrap();
        let _other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(ch);
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket());
        // Unchanged: removed.
        std::fs::remove_file(&path).unwrap();
        let ch = FdChannel::bind(&path, limits()).await.unwrap();
        drop(ch);
        assert!(std::fs::symlink_metadata(&path).is_err());
    }

    #[tokio::test]
    async fn fd_channel_rejects_bad_limits() {
        let dir = tempfile::tempdir().unwrap();
        let path = sock_path(&dir);
        for lim in [
            FdChannelLimits {
                max_connections: 0,
                ..limits()
            },
            FdChannelLimits {
                max_pending: 0,
                ..limits()
            },
            FdChannelLimits {
                pending_ttl: Duration::ZERO,
                ..limits()
            },
            FdChannelLimits {
                receive_timeout: Duration::ZERO,
                ..limits()
            },
        ] {
            let err = FdChannel::bind(&path, lim).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        assert!(!path.exists());
    }

    #[test]
    fn fd_channel_parse_key() {
        assert_eq!(parse_key(b"a\x001"), Ok(("a".to_owned(), 1, None)));
        assert_eq!(
            parse_key(b"a-b_C9\x00-7\x00\x00"),
            Ok(("a-b_C9".to_owned(), -7, None))
        );
        // Native registration v2: a third field, the allocation index.
        assert_eq!(
            parse_key(b"a\x001\x0098"),
            Ok(("a".to_owned(), 1, Some(98)))
        );
        assert_eq!(
            parse_key(b"a\x001\x000\x00"),
            Ok(("a".to_owned(), 1, Some(0)))
        );
        for bad in [
            &b"a\x001\x00-1"[..],
            b"a\x001\x00x",
            b"a\x001\x002\x003",
            b"a\x001\x00\x002",
            b"a\x001\x004294967296",
            // The most allocations a registration may name bounds the index too.
            b"a\x001\x001024",
        ] {
            assert!(
                matches!(parse_key(bad), Err(MalformedMessage::BadAllocationIndex(_))),
                "{bad:?}"
            );
        }
        assert_eq!(parse_key(b"a1"), Err(MalformedMessage::NoSeparator));
        assert!(matches!(
            parse_key(b"a\x00x"),
            Err(MalformedMessage::BadDeviceId(_))
        ));
        assert!(matches!(
            parse_key(b"a\x00+1"),
            Err(MalformedMessage::BadDeviceId(_))
        ));
        assert!(matches!(
            parse_key(b"a.b\x001"),
            Err(MalformedMessage::UnsafeInstanceId(_))
        ));
        let long = [vec![b'x'; 129], b"\x000".to_vec()].concat();
        assert!(matches!(
            parse_key(&long),
            Err(MalformedMessage::UnsafeInstanceId(_))
        ));
    }
}
