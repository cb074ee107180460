//! Shared by the peer-fetch tests: `pegaflow-server` processes with a Redis-backed directory
//! and the `tcp` peer delegate, host-memfd workers registered with them over their side
//! channel, and the query/load helpers the tests use.
//!
//! The server binary is `target/debug/pegaflow-server` (or `$PEGAFLOW_SERVER_BIN`);
//! `scripts/test.sh` builds it first. Without it (or without `redis-server`) a test reports
//! itself skipped (`pegaflow_tests::skip!`) and returns.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pegaflow_api::client::{EngineClient, QueryOutcome};
use pegaflow_tests::harness::{KvCache, KvShape, Worker};

/// The namespace every peer test saves under.
pub const NS: &str = "peer-fetch";

/// The server binary, or `None` after reporting `test` skipped.
pub fn server_bin(test: &str) -> Option<PathBuf> {
    let bin = std::env::var_os("PEGAFLOW_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/pegaflow-server")
        });
    if bin.is_file() {
        Some(bin)
    } else {
        pegaflow_tests::skip!(
            "{test}: no server binary at {} (cargo build --bin pegaflow-server, or set PEGAFLOW_SERVER_BIN)",
            bin.display()
        );
        None
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// How a node is started.
#[derive(Debug, Clone)]
pub struct NodeOpts {
    /// DRAM pool bytes.
    pub pool_bytes: u64,
    /// The Redis URL and key prefix of the directory; `None`: no `[directory]`.
    pub directory: Option<(String, String)>,
    /// Directory staleness (seconds).
    pub stale_after_secs: u64,
    /// Extra `[peer]` settings (TOML lines); `None`: no `[peer]`.
    pub peer: Option<String>,
    /// `[store] promote_deadline_ms`.
    pub promote_deadline_ms: u64,
    /// `[store] evict_ahead_percent` (the server's default, 10, unless a test asserts that
    /// nothing is evicted and wants no reserve kept free either).
    pub evict_ahead_percent: u8,
    /// The IP the server binds and advertises.
    pub ip: String,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// More pipeline TOML, appended (e.g. a `[[tier]]` below DRAM).
    pub extra_toml: String,
}

impl Default for NodeOpts {
    fn default() -> Self {
        Self {
            pool_bytes: 64 << 20,
            directory: None,
            stale_after_secs: 30,
            peer: Some(String::new()),
            promote_deadline_ms: 4000,
            evict_ahead_percent: 10,
            ip: "127.0.0.1".into(),
            netns: None,
            extra_toml: String::new(),
        }
    }
}

/// A running `pegaflow-server` process, killed when dropped.
pub struct Node {
    /// Name in messages.
    pub name: String,
    child: Option<Child>,
    bin: PathBuf,
    cfg: PathBuf,
    /// gRPC port.
    pub grpc: u16,
    /// HTTP port.
    pub http: u16,
    /// The IP it binds.
    pub ip: String,
    /// The network namespace it runs in.
    pub netns: Option<String>,
    /// Side-channel socket.
    pub socket: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Node {
    /// Starts a node and waits (≤ 20 s) until `/health?verbose=1` says `ok` (the directory
    /// reached, when there is one).
    ///
    /// A port [`free_port`] handed out can be taken before the server binds it (tests run
    /// in parallel): a node that exits at start saying the address is in use is started
    /// again on fresh ports, at most 5 times.
    pub fn start(bin: &Path, name: &str, o: &NodeOpts) -> Self {
        for attempt in 1.. {
            let mut node = Self::configure(bin, name, o);
            node.spawn();
            match node.wait_healthy(Duration::from_secs(20)) {
                Ok(()) => return node,
                Err(()) if attempt < 5 && node.log_tail().contains("Address already in use") => {
                    eprintln!("{name}: a port was taken before the server bound it; retrying");
                }
                Err(()) => panic!("{name} exited at start; log:\n{}", node.log_tail()),
            }
        }
        unreachable!()
    }

    /// The node's directory, pipeline (on two fresh ports) and log path; not started.
    fn configure(bin: &Path, name: &str, o: &NodeOpts) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("fd.sock");
        let (grpc, http) = (free_port(), free_port());
        let mut toml = format!(
            "[server]\naddr = \"{ip}:{grpc}\"\nhttp_addr = \"{ip}:{http}\"\nenable_prometheus = true\nlog_level = \"warn\"\n\n[fd_channel]\npath = \"{sock}\"\n\n[store]\npromote_deadline_ms = {pd}\nevict_ahead_percent = {ea}\n\n[[tier]]\nkind = \"dram\"\ncapacity = {pool}\n\n[[registrar]]\nkind = \"host-memfd\"\n\n[[transport]]\nkind = \"memcpy\"\n",
            ip = o.ip,
            sock = socket.display(),
            pd = o.promote_deadline_ms,
            ea = o.evict_ahead_percent,
            pool = o.pool_bytes,
        );
        if let Some((url, prefix)) = &o.directory {
            toml.push_str(&format!(
                "\n[directory]\nkind = \"redis\"\nurl = \"{url}\"\nkey_prefix = \"{prefix}\"\nstale_after_secs = {}\ntimeout_ms = 300\ncall_timeout_ms = 600\nquery_timeout_ms = 300\n",
                o.stale_after_secs
            ));
        }
        if let Some(extra) = &o.peer {
            toml.push_str(&format!(
                "\n[peer]\nkind = \"tcp\"\ndata_addr = \"{}:0\"\n{extra}\n",
                o.ip
            ));
        }
        toml.push_str(
            &o.extra_toml
                .replace("{dir}", &dir.path().display().to_string()),
        );
        let cfg = dir.path().join("pipeline.toml");
        std::fs::write(&cfg, &toml).expect("write pipeline");
        let log = dir.path().join("server.log");
        Self {
            name: name.into(),
            child: None,
            bin: bin.to_path_buf(),
            cfg,
            grpc,
            http,
            ip: o.ip.clone(),
            netns: o.netns.clone(),
            socket,
            log,
            _dir: dir,
        }
    }

    fn spawn(&mut self) {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        cmd.arg("--config")
            .arg(&self.cfg)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out);
        self.child = Some(cmd.spawn().expect("spawn pegaflow-server"));
    }

    /// Kills it and starts it again on the same addresses and pipeline (its DRAM is
    /// empty, its data port a new one), waiting until healthy (≤ 20 s: its directory
    /// session waits for the old one to go stale).
    pub fn restart(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.socket);
        self.spawn();
        if self.wait_healthy(Duration::from_secs(20)).is_err() {
            panic!("{} exited at restart; log:\n{}", self.name, self.log_tail());
        }
    }

    /// Waits until `/health?verbose=1` says `ok` on its first line (every component ok, the
    /// directory reached); `Err` if the process exited first (reaped); panics with the log
    /// after `within`.
    fn wait_healthy(&mut self, within: Duration) -> Result<(), ()> {
        let end = Instant::now() + within;
        loop {
            if let Some(body) = self.get("/health?verbose=1") {
                if body.lines().next() == Some("ok") {
                    return Ok(());
                }
            }
            if let Some(c) = self.child.as_mut() {
                if c.try_wait().ok().flatten().is_some() {
                    self.child = None;
                    return Err(());
                }
            }
            assert!(
                Instant::now() < end,
                "{} did not become healthy within {within:?}; log:\n{}",
                self.name,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its whole log (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last 4 KiB of its log.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut at = s.len().saturating_sub(4096);
        while !s.is_char_boundary(at) {
            at += 1;
        }
        s[at..].to_string()
    }

    /// `ip:port` of its gRPC service (its directory identity).
    pub fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.grpc)
    }

    /// `http://ip:port` of its gRPC service.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// `POST path` on its HTTP port (blocking); the body, `None` when unreachable.
    pub fn post(&self, path: &str) -> Option<String> {
        in_netns(self.netns.as_deref(), || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect((self.ip.as_str(), self.http)).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            write!(
                s,
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .ok()?;
            let mut out = String::new();
            s.read_to_string(&mut out).ok()?;
            out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
        })
    }

    /// The body of `GET path` on its HTTP port (blocking, 2 s), `None` when unreachable.
    /// From inside its network namespace, when it has one.
    pub fn get(&self, path: &str) -> Option<String> {
        in_netns(self.netns.as_deref(), || self.get_here(path))
    }

    fn get_here(&self, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(
            &format!("{}:{}", self.ip, self.http).parse().ok()?,
            Duration::from_secs(2),
        )
        .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
    }

    /// The value of metric `name` whose labels include `labels` (`k="v"` pairs), summed;
    /// 0 when absent.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = self.get("/metrics").unwrap_or_default();
        metric_in(&text, name, labels)
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Sends `sig`.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        if let Some(c) = &self.child {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
        }
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
        self.kill();
    }
}

/// The sum of metric `name`'s samples whose labels include `labels`.
pub fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, val) = l.rsplit_once(' ')?;
            let (n, lab) = match key.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (key, ""),
            };
            if n != name {
                return None;
            }
            let ok = labels
                .iter()
                .all(|(k, v)| lab.split(',').any(|p| p == format!("{k}=\"{v}\"")));
            ok.then(|| val.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// A worker of instance `id` registered with `node` over its side channel.
pub async fn worker(node: &Node, id: &str, shape: KvShape) -> Worker {
    let kv = KvCache::new(shape);
    let mut client = EngineClient::connect(&node.endpoint())
        .await
        .expect("connect");
    client
        .register_host_memfd(&node.socket, &kv.registration(id, NS, 0, 1, 0), &kv.mem)
        .await
        .expect("register");
    Worker {
        instance_id: id.into(),
        tp_rank: 0,
        device_id: 0,
        kv,
        client,
    }
}

/// Hashes `tag/0..n`.
pub fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| pegaflow_tests::harness::hash_of(tag, i))
        .collect()
}

/// Fills device blocks `first..first+hs.len()` with the hashes' patterns and saves them.
pub async fn save(w: &mut Worker, first: usize, hs: &[Vec<u8>]) {
    let ids: Vec<u32> = (first..first + hs.len()).map(|b| b as u32).collect();
    for (&b, h) in ids.iter().zip(hs) {
        w.kv.fill(b as usize, h);
    }
    for (c, (ids, hs)) in ids.chunks(16).zip(hs.chunks(16)).enumerate() {
        w.save(ids, hs)
            .await
            .unwrap_or_else(|e| panic!("save chunk {c}: {e}"));
    }
}

/// What one query settled to.
#[derive(Debug)]
pub struct Settled {
    /// Hits.
    pub hits: u64,
    /// The lease (empty for a miss).
    pub lease: Vec<u8>,
    /// How many answers were Loading first.
    pub loading: usize,
    /// From the first query to Ready.
    pub took: Duration,
}

/// Polls QueryPrefetch with one `req_id` (every 10 ms, as a connector re-polls) until it
/// answers Ready; panics after `limit`.
pub async fn settle(w: &mut Worker, hs: &[Vec<u8>], req_id: &str, limit: Duration) -> Settled {
    let t0 = Instant::now();
    let mut loading = 0;
    loop {
        match w
            .client
            .query(&w.instance_id, hs.to_vec(), req_id)
            .await
            .expect("query")
        {
            QueryOutcome::Loading => {
                loading += 1;
                assert!(
                    t0.elapsed() < limit,
                    "query {req_id} still Loading after {limit:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            QueryOutcome::Ready {
                num_hit_blocks,
                lease,
                ..
            } => {
                return Settled {
                    hits: num_hit_blocks,
                    lease,
                    loading,
                    took: t0.elapsed(),
                }
            }
        }
    }
}

/// Queries with fresh req_ids until a query hits `want` blocks (the directory needs a moment
/// to list a fresh save); returns that answer. Leases of shorter answers are released.
pub async fn settle_all(w: &mut Worker, hs: &[Vec<u8>], want: u64, within: Duration) -> Settled {
    let t0 = Instant::now();
    for round in 0.. {
        let s = settle(w, hs, &format!("want-{want}-{round}"), within).await;
        if s.hits == want {
            return s;
        }
        if !s.lease.is_empty() {
            let _ = w.client.release(&s.lease).await;
        }
        assert!(
            t0.elapsed() < within,
            "no query hit {want} blocks within {within:?} (last: {s:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unreachable!()
}

/// Loads `lease` into device blocks `first..first+hs.len()` (poisoned first) and checks
/// every byte against the hashes' patterns.
pub async fn load_exact(w: &mut Worker, lease: &[u8], first: usize, hs: &[Vec<u8>]) {
    let targets: Vec<u32> = (first..first + hs.len()).map(|b| b as u32).collect();
    for &b in &targets {
        w.kv.poison(b as usize, 0xEE);
    }
    let state = w.load(lease, &targets).await.expect("load");
    assert_eq!(state, 1, "the load completed");
    for (i, h) in hs.iter().enumerate() {
        assert!(
            w.kv.holds(first + i, h),
            "device block {} holds exactly block {i}'s bytes",
            first + i
        );
    }
}

/// Polls `f` every 5 ms until it holds; the time it took, or `None` after `within`.
pub async fn within(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    loop {
        if f() {
            return Some(t0.elapsed());
        }
        if t0.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `f` on a thread that joined network namespace `ns` (`/run/netns/<ns>`, made by
/// `ip netns add`); on this thread when `ns` is `None`. Sockets `f` opens live in `ns`.
///
/// # Panics
/// When the namespace cannot be joined.
pub fn in_netns<T: Send>(ns: Option<&str>, f: impl FnOnce() -> T + Send) -> T {
    let Some(ns) = ns else {
        return f();
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let fd = std::fs::File::open(format!("/run/netns/{ns}"))
                .unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
            use std::os::fd::AsRawFd;
            // SAFETY: setns on a valid namespace descriptor affects only this thread.
            let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {ns}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("netns thread")
    })
}

/// Runs the future `f` to completion on a fresh current-thread runtime inside network
/// namespace `ns` (see [`in_netns`]).
pub fn block_on_in_netns<T: Send>(
    ns: Option<&str>,
    f: impl std::future::Future<Output = T> + Send,
) -> T {
    in_netns(ns, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f)
    })
}

/// A client of the Redis directory at `redis_url` under `prefix` (the key prefix the nodes of
/// one test share, `pf:{prefix}:`).
pub fn redis_directory(
    redis_url: &str,
    prefix: &str,
) -> std::sync::Arc<dyn pegaflow_plugin::Directory> {
    let mut settings = toml::Table::new();
    settings.insert("url".into(), redis_url.into());
    settings.insert("key_prefix".into(), format!("pf:{prefix}:").into());
    (pegaflow_plugin::directory_factory("redis").unwrap().build)(
        &settings,
        &pegaflow_plugin::RuntimeContext::default(),
    )
    .expect("a redis directory client")
}

/// Waits (≤ 10 s) until that directory lists `node` as the one holder of all of `hs`.
pub async fn wait_listed_in(redis_url: &str, prefix: &str, node: &Node, hs: &[Vec<u8>]) {
    let dir = redis_directory(redis_url, prefix);
    let t0 = Instant::now();
    loop {
        let plan = dir.query_prefix(NS, hs, None).await.unwrap_or_default();
        if plan.len() == 1 && plan[0].node == node.addr() && plan[0].prefix_len as usize == hs.len()
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the directory does not list {} for the run: {plan:?}",
            node.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 2 layers × 64 blocks × 4 KiB segments: 16 KiB per block.
pub const SMALL: KvShape = KvShape {
    layers: 2,
    num_blocks: 64,
    segment_bytes: 4096,
};

/// 4 layers × 64 blocks × 256 KiB segments: 2 MiB per block, 128 MiB for all 64 (a
/// transfer long enough to be interrupted).
pub const BIG: KvShape = KvShape {
    layers: 4,
    num_blocks: 64,
    segment_bytes: 256 << 10,
};

/// What a multi-node test needs: the server binary and a Redis for the directory. Each test
/// file adds its own `opts` (the `[peer]` it runs).
pub struct Env {
    /// The server binary.
    pub bin: PathBuf,
    /// The directory's Redis.
    pub redis: pegaflow_tests::redis::RedisServer,
}

/// The environment of `test`, or `None` (with the reason printed) where the binary or
/// `redis-server` is missing.
pub fn env(test: &str) -> Option<Env> {
    let bin = server_bin(test)?;
    let redis = pegaflow_tests::redis::RedisServer::start(test)?;
    Some(Env { bin, redis })
}

/// Waits (≤ 10 s) until the directory under `prefix` lists `node` for all of `hs`.
pub async fn wait_listed(env: &Env, prefix: &str, node: &Node, hs: &[Vec<u8>]) {
    wait_listed_in(&env.redis.url(), prefix, node, hs).await
}
