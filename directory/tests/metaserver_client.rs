//! The `metaserver` directory (a MetaServer gRPC client) against real MetaServer processes:
//! the conformance suite over our `pegaflow-metaserver` and over PegaFlow's own (from the
//! published wheel), restart detection through the canary, and a frozen MetaServer answering
//! `Unavailable` within the deadline. Each part reports itself skipped (`pegaflow_tests::skip!`) when its binary is
//! missing: ours is built by `cargo build --workspace`, PegaFlow's by `scripts/python-venv.sh`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_directory::metaserver::{MetaServerConfig, MetaServerDirectory};
use pegaflow_plugin::{Directory, DirectoryError, NodeId};
use pegaflow_tests::directory_suite::{
    fields_past_their_bounds_are_invalid, run_all, DirectoryFixture,
};

const STALE_SECS: u64 = 2;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Our binary: `$PEGAFLOW_METASERVER_BIN`, else the workspace's debug build.
fn ours() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("PEGAFLOW_METASERVER_BIN") {
        return Some(PathBuf::from(p));
    }
    let p = workspace().join("target/debug/pegaflow-metaserver");
    p.is_file().then_some(p)
}

/// PegaFlow's binary: `$PEGAFLOW_PY_METASERVER`, else the one in the repository's `.venv`.
fn pegaflows() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("PEGAFLOW_PY_METASERVER") {
        return Some(PathBuf::from(p));
    }
    let lib = workspace().join(".venv/lib");
    std::fs::read_dir(lib)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| {
            e.path()
                .join("site-packages/pegaflow/pegaflow-metaserver-py")
        })
        .find(|p| p.is_file())
}

/// Two distinct free loopback ports (both bound at once, then released).
fn free_ports() -> (u16, u16) {
    let bind = || std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let (a, b) = (bind(), bind());
    let port = |l: &std::net::TcpListener| l.local_addr().expect("bound").port();
    (port(&a), port(&b))
}

/// A MetaServer process on free loopback ports, killed when dropped.
struct MetaServerProcess {
    child: Child,
    bin: PathBuf,
    port: u16,
    http_port: u16,
}

impl MetaServerProcess {
    /// Starts `bin` on free ports. A port released by [`free_ports`] can be taken by another
    /// test's process before the MetaServer binds it; the MetaServer then exits, and the
    /// start is retried on new ports (up to five times).
    fn start(bin: PathBuf) -> Self {
        for _ in 0..5 {
            let (port, http_port) = free_ports();
            let child = Self::spawn(&bin, port, http_port);
            let mut p = Self {
                child,
                bin: bin.clone(),
                port,
                http_port,
            };
            if p.wait_listening() {
                return p;
            }
        }
        panic!("{} exited at start five times", bin.display())
    }

    fn spawn(bin: &Path, port: u16, http_port: u16) -> Child {
        Command::new(bin)
            .args(["--addr", &format!("127.0.0.1:{port}")])
            .args(["--http-addr", &format!("127.0.0.1:{http_port}")])
            .args(["--node-stale-secs", &STALE_SECS.to_string()])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
    }

    /// Waits until the port accepts connections and the process is still running 200 ms
    /// later (a listener on the port may be another process's); false when the process
    /// exited (it could not bind).
    fn wait_listening(&mut self) -> bool {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if self.child.try_wait().ok().flatten().is_some() {
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                std::thread::sleep(Duration::from_millis(200));
                return self.child.try_wait().ok().flatten().is_none();
            }
            assert!(
                Instant::now() < end,
                "{} did not listen in 20 s",
                self.bin.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(&self.bin, self.port, self.http_port);
        assert!(
            self.wait_listening(),
            "{} exited when restarted on port {}",
            self.bin.display(),
            self.port
        );
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig);
    }

    fn client(&self, timeout_ms: u64) -> MetaServerDirectory {
        MetaServerDirectory::new(&MetaServerConfig {
            addr: format!("127.0.0.1:{}", self.port),
            timeout_ms,
        })
        .expect("client")
    }
}

impl Drop for MetaServerProcess {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Fixture<'a>(&'a MetaServerProcess);

impl DirectoryFixture for Fixture<'_> {
    fn open(&self) -> Arc<dyn Directory> {
        Arc::new(self.0.client(2_000))
    }
    fn stale_after(&self) -> Duration {
        Duration::from_secs(STALE_SECS)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_over_our_metaserver() {
    let Some(bin) = ours() else {
        pegaflow_tests::skip!(
            "target/debug/pegaflow-metaserver is not built (cargo build --workspace)"
        );
        return;
    };
    let p = MetaServerProcess::start(bin);
    run_all(&Fixture(&p)).await;
    fields_past_their_bounds_are_invalid(&Fixture(&p)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_over_pegaflows_metaserver() {
    let Some(bin) = pegaflows() else {
        pegaflow_tests::skip!("PegaFlow's metaserver not found (run scripts/python-venv.sh)");
        return;
    };
    let p = MetaServerProcess::start(bin);
    run_all(&Fixture(&p)).await;
}

/// Both MetaServers: a restart loses the node's entries, and the next heartbeat says so
/// (through the canary), although the MetaServer itself re-creates the node silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metaserver_restart_is_reported_as_lost_state() {
    let bins: Vec<PathBuf> = [ours(), pegaflows()].into_iter().flatten().collect();
    if bins.is_empty() {
        pegaflow_tests::skip!("no MetaServer binary found");
        return;
    }
    for bin in bins {
        let mut p = MetaServerProcess::start(bin.clone());
        let d = p.client(2_000);
        let n = NodeId::new_session("10.1.1.1:50055");
        assert!(d.heartbeat(&n).await.unwrap().state_lost);
        d.insert(&n, "ns", &[b"h0".to_vec()]).await.unwrap();
        assert!(
            !d.heartbeat(&n).await.unwrap().state_lost,
            "{}",
            bin.display()
        );
        p.restart();
        // The client's channel reconnects; the first calls after a restart may fail.
        let mut answer = None;
        for _ in 0..50 {
            match d.heartbeat(&n).await {
                Ok(a) => {
                    answer = Some(a);
                    break;
                }
                Err(DirectoryError::Unavailable(_)) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("{}: heartbeat after restart: {e}", bin.display()),
            }
        }
        let a = answer.expect("a heartbeat succeeds after the restart");
        assert!(a.state_lost, "{}: restart detected", bin.display());
        assert!(!d.heartbeat(&n).await.unwrap().state_lost);
    }
}

/// A frozen MetaServer (SIGSTOP): every call answers `Unavailable` instead of hanging; after
/// SIGCONT calls work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_metaserver_answers_unavailable() {
    let Some(bin) = ours() else {
        pegaflow_tests::skip!("target/debug/pegaflow-metaserver is not built");
        return;
    };
    let p = MetaServerProcess::start(bin);
    let d = p.client(300);
    let n = NodeId::new_session("10.1.1.2:50055");
    d.heartbeat(&n).await.unwrap();
    p.signal(nix::sys::signal::Signal::SIGSTOP);
    let hs = vec![b"h".to_vec()];
    let calls: Vec<(&str, Result<(), DirectoryError>)> = vec![
        ("heartbeat", d.heartbeat(&n).await.map(|_| ())),
        ("insert", d.insert(&n, "ns", &hs).await.map(|_| ())),
        ("remove", d.remove(&n, "ns", &hs).await.map(|_| ())),
        ("query", d.query_prefix("ns", &hs, None).await.map(|_| ())),
    ];
    for (what, r) in calls {
        assert!(
            matches!(r, Err(DirectoryError::Unavailable(_))),
            "{what} on a frozen MetaServer: {r:?}"
        );
    }
    p.signal(nix::sys::signal::Signal::SIGCONT);
    d.heartbeat(&n).await.expect("works again after SIGCONT");
}
