//! The side channel's unit tests.

use super::message::parse_key;
use super::*;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};

use nix::errno::Errno;
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

/// A refusal decided before the server read the descriptor its client sent first (issue 41:
/// the connection still queued on the socket) closes that descriptor when it arrives; a
/// resend on a connection opened after the refusal is filed as usual. The test runtime has
/// one thread and nothing awaits between the sends and the discard, so the accept loop has
/// run for neither connection when `discard` is called.
#[tokio::test]
async fn fd_channel_discard_closes_a_descriptor_still_on_its_way() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock_path(&dir);
    let ch = FdChannel::bind(&path, limits()).await.unwrap();
    // v1 and a v2 allocation of the refused registration, and another device's descriptor.
    let (r1, w1) = pipe();
    send(&path, "late", 0, w1.as_fd());
    drop(w1);
    let (r2, w2) = pipe();
    let v2 = std::thread::spawn({
        let path = path.clone();
        move || pegaflow_api::fd::send_allocation_fd(&path, "late", 0, 1, w2.as_fd())
    });
    let (_r3, w3) = pipe();
    send(&path, "late", 1, w3.as_fd());
    // The v2 sender waits for its acknowledgement: give its sendmsg time to complete.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(ch.pending(), 0, "nothing has been read yet");
    assert!(!ch.discard("late", 0), "nothing was pending at the refusal");
    // The resend, on a connection opened after the refusal.
    let (_r4, w4) = pipe();
    send(&path, "late", 0, w4.as_fd());
    assert_eventually_closed(&r1, "the v1 descriptor of the refused registration").await;
    assert_eventually_closed(&r2, "its v2 descriptor").await;
    wait_stats(&ch, "one filed for device 1 and the resend", |s| {
        s.accepted == 2 && s.discarded == 2
    })
    .await;
    let e = tokio::task::spawn_blocking(move || v2.join().unwrap())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, pegaflow_api::ApiError::Io { source, .. } if source.kind() == io::ErrorKind::UnexpectedEof),
        "a v2 sender of a discarded descriptor gets no acknowledgement: {e}"
    );
    assert_eq!(ch.stats().rejected_duplicate, 0);
    let got = ch.take("late", 0, Duration::from_secs(2)).await.unwrap();
    assert!(same_file(&got, &w4), "the resend is what a retry takes");
    assert!(ch.take("late", 1, Duration::from_secs(2)).await.is_some());
    assert_eq!(ch.pending(), 0);
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
