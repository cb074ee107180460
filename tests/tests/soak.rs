//! Soak: several client processes (`examples/soak_client.rs`) save, query, load and release
//! with byte checks over a shared key space, under eviction (the DRAM tier holds a fraction of
//! the keys), while the test SIGKILLs one of them at random points and starts a new one. At
//! the end every client is gone, and the server's instances, leases, open fds and pool bytes
//! (after a memory cleanup) are back to their baselines; RSS is reported (and bounded
//! loosely). Runs `PEGAFLOW_SOAK_SECS` seconds (default 20 in CI; longer by hand).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_tests::harness::*;
use pegaflow_tests::pool_suite::Rng;

/// Bytes of one soak block (2 layers × K and V × 4 KiB, as `soak_client` registers).
const BLOCK: u64 = 2 * 2 * 4096;
const CLIENTS: usize = 4;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

struct Client {
    child: Child,
    id: String,
    /// Rounds this client verified (its Session is open once it has one).
    rounds: Arc<AtomicU64>,
}

fn spawn(bin: &PathBuf, srv: &TestServer, n: u64, rounds: Arc<AtomicU64>) -> Client {
    let id = format!("soak-{n}");
    let mut child = Command::new(bin)
        .arg(srv.handle.endpoint())
        .arg(&srv.socket)
        .arg(&id)
        .arg(n.to_string())
        .arg("1000000")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn soak_client");
    let out = child.stdout.take().unwrap();
    let mine = Arc::new(AtomicU64::new(0));
    let counted = mine.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            match line {
                Ok(l) if l.starts_with("round ") => {
                    rounds.fetch_add(1, Ordering::Relaxed);
                    counted.fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    Client {
        child,
        id,
        rounds: mine,
    }
}

/// Polls `check` every 20 ms for up to `secs`.
async fn within(secs: u64, what: &str, check: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < end, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_killed_at_random_leave_nothing_behind() {
    let secs: u64 = std::env::var("PEGAFLOW_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let bin = pegaflow_tests::example_bin("soak_client");
    // DRAM for 96 blocks: the 256 shared keys do not fit, so saves evict.
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: 96 * BLOCK,
        ..Default::default()
    })
    .await;
    let e = srv.handle.engine.clone();
    let (fds0, rss0) = (open_fds(), rss_bytes());
    let rounds = Arc::new(AtomicU64::new(0));
    let mut next = 0u64;
    let mut clients: Vec<Client> = (0..CLIENTS)
        .map(|_| {
            next += 1;
            spawn(&bin, &srv, next, rounds.clone())
        })
        .collect();
    let mut r = Rng::new(0x50a6);
    let mut kills = 0;
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(r.range(200, 1500) as u64)).await;
        // A client that exited by itself must have exited cleanly (3 = corruption).
        for c in &mut clients {
            if let Ok(Some(st)) = c.child.try_wait() {
                assert_ne!(st.code(), Some(3), "{} saw corrupt bytes", c.id);
                panic!("{} exited on its own: {st:?}", c.id);
            }
        }
        let i = r.range(0, CLIENTS - 1);
        // Only a client that verified a round: one killed while its registration RPC is in
        // flight can have the registration land after its Session's cleanup, leaving an
        // instance no stream will end (the server keeps registrations without a Session, as
        // PegaFlow does: workers register under their scheduler's Session;
        // POST /instances/cleanup removes them).
        if clients[i].rounds.load(Ordering::Relaxed) == 0 {
            continue;
        }
        let _ = clients[i].child.kill();
        let _ = clients[i].child.wait();
        kills += 1;
        next += 1;
        clients[i] = spawn(&bin, &srv, next, rounds.clone());
    }
    // The last ones killed too, once their Sessions are open (see above).
    within(10, "every client has its Session open", || {
        clients.iter().all(|c| c.rounds.load(Ordering::Relaxed) > 0)
    })
    .await;
    for c in &mut clients {
        if let Ok(Some(st)) = c.child.try_wait() {
            assert_ne!(st.code(), Some(3), "{} saw corrupt bytes", c.id);
        }
        let _ = c.child.kill();
        let _ = c.child.wait();
    }
    let rounds = rounds.load(Ordering::Relaxed);
    assert!(rounds > 0, "the clients completed verified rounds");

    // Every session ended: instances and their leases go; a memory cleanup empties the pool
    // (blocks a killed writer left half-saved included).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !e.instance_ids().is_empty() {
        assert!(
            Instant::now() < deadline,
            "instances still registered 10 s after their clients died: {:?} (killed: {kills})",
            e.instance_ids()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    within(10, "every lease released", || e.leases().is_empty()).await;
    let cleaned = e.cleanup_memory();
    within(10, "pool bytes back to 0 after the cleanup", || {
        e.pool().used_bytes() == 0
    })
    .await;
    within(10, "open fds back to the baseline", || {
        open_fds() <= fds0 + 4
    })
    .await;
    let rss1 = rss_bytes();
    println!(
        "soak: {secs} s, {CLIENTS} clients, {kills} SIGKILLed, {rounds} verified rounds; \
         open fds {fds0} → {}; RSS {} → {} MiB; cleanup {cleaned:?}",
        open_fds(),
        rss0 >> 20,
        rss1 >> 20
    );
    assert!(
        rss1 < rss0 + (256 << 20),
        "RSS grew from {} to {} MiB",
        rss0 >> 20,
        rss1 >> 20
    );
    srv.shutdown().await;
}
