//! The socket file of the side channel: its directory, the bind (replacing a stale socket,
//! never a live one or another file), and its removal when the channel drops.
//!
//!
//! Socket permissions: the socket is created with `fchmod(0600)` *before* `bind`, which Linux
//! applies to the inode that `bind` creates (masked by the umask), so there is no window in
//! which the path is connectable by other users, and the process-wide umask is never touched
//! (changing it would race with every other thread creating files). After `bind` the mode is

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use nix::sys::stat::Mode;
use tracing::{debug, info, warn};

/// The listen backlog of the socket.
const LISTEN_BACKLOG: i32 = 128;
/// The (device, inode) pair that identifies the socket file we created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileIdentity {
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
pub(super) fn io_context(e: impl Into<io::Error>, what: impl std::fmt::Display) -> io::Error {
    let e: io::Error = e.into();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Creates the socket's missing parent directories, owner-only (mode 0700: the socket hands
/// out memory of every registering process), as `/run/pegaflow` on a fresh host. An existing
/// directory is left as it is.
pub(super) fn create_parent(path: &Path) -> io::Result<()> {
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
pub(super) fn bind_socket(path: &Path) -> io::Result<(OwnedFd, FileIdentity)> {
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
pub(super) fn remove_socket_if_ours(path: &Path, identity: FileIdentity) {
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
