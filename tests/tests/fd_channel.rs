//! The fd side channel under hostile input, end to end: every descriptor a bad, duplicate,
//! excess, silent or expired message brings in is closed, counted by the number of entries in
//! `/proc/self/fd`. The count is process-wide, so this binary holds exactly one test.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use pegaflow_api::memfd::HostMemfd;
use pegaflow_fd_channel::{FdChannel, FdChannelLimits, FdChannelStats, MAX_RECEIVED_FDS};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

fn memfd() -> OwnedFd {
    let m = nix::sys::memfd::memfd_create(c"leak-probe", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .expect("memfd_create");
    nix::unistd::ftruncate(&m, 4096).expect("ftruncate");
    m
}

fn send_raw(path: &Path, payload: &[u8], fds: &[RawFd]) -> nix::Result<usize> {
    let s = UnixStream::connect(path).expect("connect");
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(payload)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
}

/// Sends `payload` with `count` fresh memfds, closing our copies.
fn send_new(path: &Path, payload: &[u8], count: usize) {
    let fds: Vec<OwnedFd> = (0..count).map(|_| memfd()).collect();
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    send_raw(path, payload, &raw).expect("sendmsg");
}

async fn wait_stats(ch: &FdChannel, what: &str, pred: impl Fn(&FdChannelStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_leaks_no_descriptor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("fd.sock");
    let ttl = Duration::from_secs(1);
    let ch = FdChannel::bind(
        &path,
        FdChannelLimits {
            max_connections: 4,
            max_pending: 3,
            pending_ttl: ttl,
            receive_timeout: Duration::from_millis(200),
        },
    )
    .await
    .expect("bind");

    // Warm up every code path once (runtime threads, timers) before the baseline.
    let warm = HostMemfd::new("warm", 4096).expect("memfd");
    pegaflow_api::fd::send_fd(&path, "warm", 0, warm.fd()).expect("send");
    drop(
        ch.take("warm", 0, Duration::from_secs(5))
            .await
            .expect("warm-up fd"),
    );
    drop(warm);
    // The warm-up's connection closes on the channel's side a moment later: the baseline is
    // taken once it has (counted in before, it made a later count look one short).
    wait_stats(&ch, "warm-up closed", |s| s.connections_open == 0).await;
    let baseline = open_fds();

    // Malformed messages.
    let oversized = [b"big\x00".as_slice(), &[b'1'; 400]].concat();
    let malformed: Vec<(&[u8], usize)> = vec![
        (b"nofd\x000", 0),
        (b"two\x000", 2),
        (b"many\x000", MAX_RECEIVED_FDS + 8),
        (b"nonul0", 1),
        (&oversized, 1),
        (b"bad id\x000", 1),
        (b"inst\x00zero", 1),
        (b"inst\x00", 1),
    ];
    for (i, (payload, count)) in malformed.iter().enumerate() {
        send_new(&path, payload, *count);
        wait_stats(&ch, "malformed", |s| s.rejected_malformed == i as u64 + 1).await;
    }

    // Duplicates and capacity: two pending, a duplicate, a third (the cap), then a fourth.
    for id in ["a", "b"] {
        send_new(&path, format!("{id}\x000").as_bytes(), 1);
    }
    wait_stats(&ch, "pending", |s| s.accepted == 1 + 2).await;
    send_new(&path, b"a\x000", 1);
    wait_stats(&ch, "duplicate", |s| s.rejected_duplicate == 1).await;
    send_new(&path, b"c\x000", 1);
    wait_stats(&ch, "third", |s| s.accepted == 1 + 3).await;
    send_new(&path, b"d\x000", 1);
    wait_stats(&ch, "capacity", |s| s.rejected_capacity == 1).await;
    // One is taken and closed; the other two expire untaken.
    drop(ch.take("a", 0, Duration::from_secs(5)).await.expect("a"));
    wait_stats(&ch, "expired", |s| s.expired == 2 && s.pending == 0).await;

    // Connections that send nothing: closed at once, and silent past the receive timeout.
    drop(UnixStream::connect(&path).expect("connect"));
    wait_stats(&ch, "empty", |s| {
        s.connections_dropped == 1 && s.connections_open == 0
    })
    .await;
    let silent: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(&path).expect("connect"))
        .collect();
    // Over the connection cap while the silent ones hold every slot.
    wait_stats(&ch, "slots busy", |s| s.connections_open == 4).await;
    // The server may close it before the message is written (EPIPE): nothing is sent then.
    let excess = memfd();
    let _ = send_raw(&path, b"excess\x000", &[excess.as_raw_fd()]);
    drop(excess);
    wait_stats(&ch, "dropped", |s| {
        s.connections_dropped == 2 + 4 && s.connections_open == 0
    })
    .await;
    drop(silent);

    // A registrar-like consumer: take one and drop it.
    let m = HostMemfd::new("real", 4096).expect("memfd");
    pegaflow_api::fd::send_fd(&path, "real", 1, m.fd()).expect("send");
    let got = ch
        .take("real", 1, Duration::from_secs(5))
        .await
        .expect("real fd");
    assert!(nix::sys::stat::fstat(got.as_fd()).is_ok());
    drop(got);
    drop(m);

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // A leak shows as more entries than before; a runtime's own descriptor closing
        // meanwhile may leave fewer.
        let now = open_fds();
        if now <= baseline {
            if now < baseline {
                eprintln!("note: {now} descriptors open, {baseline} at the baseline");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "descriptor leak: {now} open, {baseline} before; stats {:?}",
            ch.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = ch.stats();
    assert_eq!(s.rejected_malformed, malformed.len() as u64, "{s:?}");
    assert_eq!((s.delivered, s.pending), (3, 0), "{s:?}");

    // Dropping the channel releases the listener and removes the socket.
    drop(ch);
    assert!(!path.exists());
}
