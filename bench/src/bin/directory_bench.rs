//! `pegaflow-directory-bench`: the cross-node block directory backends side by side, in one
//! run, and how long a server takes to re-advertise its DRAM after the directory lost it.
//!
//! For each backend — `memory` (in this process), `redis` (a `redis-server` the bench starts
//! on a free port, or `--redis-url`) and `metaserver` (our `pegaflow-metaserver` binary, started
//! by the bench on free ports over its in-memory directory) — it measures:
//! 1. inserts/s: `--keys` 32-byte hashes inserted by one node in batches of `--batch`;
//! 2. prefix query latency: `--queries` queries, one at a time, each of `--query-len`
//!    consecutive inserted hashes at a random offset (p50 / p99 / max);
//! 3. memory per entry: the growth across the inserts of this process's RSS (`memory`), of
//!    Redis's `INFO memory` `used_memory` (`redis`), of the MetaServer process's RSS
//!    (`metaserver`), divided by the keys.
//!
//! Then the backfill phase: an in-process server with `[directory] kind = "redis"` holds
//! `--backfill-blocks` tiny blocks in DRAM (sealed straight into its store, so its publisher
//! advertises them); once the directory lists them all, Redis is flushed (`FLUSHALL`) and the
//! bench times until every block is listed again, at `backfill_blocks_per_sec =
//! --backfill-rate`.
//!
//! A backend that cannot run here (no `redis-server`, no MetaServer binary) is skipped with
//! a note. `--json FILE` writes every figure; `--quick` is the smoke-test size.
//!
//! ```text
//! cargo build --release -p pegaflow-metaserver -p pegaflow-bench --bin pegaflow-directory-bench
//! target/release/pegaflow-directory-bench --json directory.json
//! ```

use std::collections::BTreeSet;
use std::io::{Read, Seek};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use pegaflow_bench::latency::LatencyStats;
use pegaflow_directory::memory::{MemoryConfig, MemoryDirectory};
use pegaflow_directory::metaserver::{MetaServerConfig, MetaServerDirectory};
use pegaflow_directory::redis_dir::{RedisConfig, RedisDirectory};
use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::{Directory, NodeId};
use pegaflow_runtime::cluster::DirectoryConfig;
use pegaflow_runtime::config::{FdChannelConfig, PipelineConfig};
use serde::Serialize;

// Link the in-tree backends the in-process server needs so their factories register.
use pegaflow_tier_dram as _;
use pegaflow_transport_shm as _;

/// Namespace of the backend measurements.
const NS: &str = "bench-directory";
/// Namespace of the backfill phase's blocks.
const BACKFILL_NS: &str = "bench-backfill";
/// Bytes of one backfill block (one DRAM granule).
const TINY_BLOCK: usize = 512;
/// Hashes per query of the "is everything listed" scan (the Redis directory pipelines a
/// script per 1024).
const SCAN_CHUNK: usize = 4096;
const BACKENDS: [&str; 3] = ["memory", "redis", "metaserver"];

#[derive(Parser, Debug)]
#[command(
    name = "pegaflow-directory-bench",
    about = "Cross-node directory backends (memory, redis, metaserver): inserts/s, prefix query latency, memory per entry, and backfill time after a Redis flush"
)]
struct Args {
    /// Keys inserted per backend (32-byte hashes). Default 200000 (20000 with --quick).
    #[arg(long)]
    keys: Option<usize>,
    /// Hashes per insert call.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Prefix queries per backend, sent one at a time.
    #[arg(long, default_value_t = 300)]
    queries: usize,
    /// Consecutive inserted hashes per query.
    #[arg(long, default_value_t = 64)]
    query_len: usize,
    /// Backends to run, comma-separated (memory, redis, metaserver).
    #[arg(long, default_value = "memory,redis,metaserver", value_delimiter = ',')]
    backends: Vec<String>,
    /// An existing Redis to measure (e.g. redis://10.0.0.5:6379/0) instead of a
    /// `redis-server` the bench starts on a free port. Keys go under a per-run prefix and
    /// are deleted afterwards; the backfill phase (which runs FLUSHALL) needs
    /// --allow-flushall on it.
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,
    /// Let the backfill phase FLUSHALL the Redis of --redis-url (it always may on the
    /// bench's own redis-server).
    #[arg(long)]
    allow_flushall: bool,
    /// The `pegaflow-metaserver` binary. Default: target/release/pegaflow-metaserver, then
    /// target/debug/pegaflow-metaserver (relative to the working directory, then to this
    /// workspace).
    #[arg(long, value_name = "PATH")]
    metaserver_bin: Option<PathBuf>,
    /// Blocks the backfill phase's server holds in DRAM. Default 100000 (10000 with
    /// --quick).
    #[arg(long)]
    backfill_blocks: Option<usize>,
    /// The server's `[directory] backfill_blocks_per_sec`.
    #[arg(long, default_value_t = 100_000)]
    backfill_rate: u64,
    /// Skip the backfill phase.
    #[arg(long)]
    no_backfill: bool,
    /// Milliseconds between the backfill phase's "is everything listed yet" polls (each
    /// a prefix query of up to 1024 hashes to the same Redis).
    #[arg(long, default_value_t = 10)]
    scan_interval_ms: u64,
    /// Smoke-test size: 20000 keys, 10000 backfill blocks (unless given).
    #[arg(long)]
    quick: bool,
    /// Seed of the hashes and the query offsets.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Write every figure to this file as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The sizes of a run.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    keys: usize,
    batch: usize,
    queries: usize,
    query_len: usize,
    backfill_blocks: usize,
    backfill_rate: u64,
    scan_interval_ms: u64,
    seed: u64,
}

/// One backend's figures.
#[derive(Debug, Clone, Serialize)]
struct BackendResult {
    backend: String,
    /// Where it ran (in-process, a URL, a pid).
    target: String,
    keys: usize,
    batch: usize,
    insert_s: f64,
    inserts_per_s: f64,
    queries: usize,
    query_len: usize,
    query_p50_ms: f64,
    query_p99_ms: f64,
    query_max_ms: f64,
    query_mean_ms: f64,
    /// Queries whose answer did not cover all `query_len` hashes (should be 0).
    query_short: usize,
    /// What the memory figure measures.
    memory_probe: String,
    memory_before_bytes: Option<u64>,
    memory_after_bytes: Option<u64>,
    bytes_per_entry: Option<f64>,
}

/// A backend that did not run, and why.
#[derive(Debug, Clone, Serialize)]
struct Skipped {
    backend: String,
    reason: String,
}

/// The backfill phase's figures.
#[derive(Debug, Clone, Serialize)]
struct BackfillResult {
    blocks: usize,
    /// `[directory] backfill_blocks_per_sec`.
    configured_rate: u64,
    /// Server start to every block listed (the start-up advertisement).
    initial_advertise_s: f64,
    /// FLUSHALL to the publisher counting the lost state (its next heartbeat).
    detect_s: Option<f64>,
    /// FLUSHALL to the publisher's backfill counter covering every block (the last insert
    /// answered), as seen between polls.
    sent_s: Option<f64>,
    /// FLUSHALL to every block listed again.
    total_s: f64,
    /// Blocks per second from detection to every block listed.
    effective_rate: Option<f64>,
    /// `pegaflow_directory_backfill_blocks_total` growth over the re-advertisement.
    backfill_blocks_sent: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    unix_time: u64,
    machine: Machine,
    plan: Plan,
    results: Vec<BackendResult>,
    skipped: Vec<Skipped>,
    backfill: Option<BackfillResult>,
    backfill_skipped: Option<String>,
}

#[derive(Debug, Serialize)]
struct Machine {
    cpus: usize,
    mem_total_bytes: Option<u64>,
    redis_version: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Hashes and randomness.

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` pseudo-random 32-byte hashes.
fn make_hashes(seed: u64, n: usize) -> Vec<Vec<u8>> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            let mut h = Vec::with_capacity(32);
            for _ in 0..4 {
                h.extend_from_slice(&splitmix(&mut s).to_le_bytes());
            }
            h
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Memory probes.

/// Resident bytes of `pid` (this process when `None`), from `/proc/<pid>/statm`.
fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/statm"),
        None => "/proc/self/statm".to_string(),
    };
    let s = std::fs::read_to_string(path).ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * rustix::param::page_size() as u64)
}

fn mem_total() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The value of `field` in an `INFO` answer.
fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    })
}

/// How a backend's memory is read.
enum MemProbe {
    SelfRss,
    ChildRss(u32),
    RedisUsed(redis::aio::MultiplexedConnection),
}

impl MemProbe {
    fn label(&self) -> String {
        match self {
            MemProbe::SelfRss => "bench process RSS (/proc/self/statm)".into(),
            MemProbe::ChildRss(p) => format!("metaserver RSS (/proc/{p}/statm)"),
            MemProbe::RedisUsed(_) => "redis INFO memory used_memory".into(),
        }
    }

    async fn read(&mut self) -> Option<u64> {
        match self {
            MemProbe::SelfRss => rss_bytes(None),
            MemProbe::ChildRss(p) => rss_bytes(Some(*p)),
            MemProbe::RedisUsed(conn) => {
                let info: String = redis::cmd("INFO")
                    .arg("memory")
                    .query_async(conn)
                    .await
                    .ok()?;
                info_field(&info, "used_memory")?.parse().ok()
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The per-backend measurement.

async fn measure(
    backend: &str,
    target: String,
    dir: &dyn Directory,
    probe: &mut MemProbe,
    hashes: &[Vec<u8>],
    plan: &Plan,
) -> anyhow::Result<BackendResult> {
    let node = NodeId::new_session("127.0.0.1:1");
    dir.heartbeat(&node)
        .await
        .with_context(|| format!("{backend}: first heartbeat"))?;
    // Settle allocator state (and let a child's start-up finish) before the baseline.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = probe.read().await;
    let t0 = Instant::now();
    for chunk in hashes.chunks(plan.batch) {
        dir.insert(&node, NS, chunk)
            .await
            .with_context(|| format!("{backend}: insert"))?;
    }
    let insert_s = t0.elapsed().as_secs_f64();
    let after = probe.read().await;

    let len = plan.query_len.min(hashes.len()).max(1);
    let span = hashes.len() - len + 1;
    let mut rng = plan.seed ^ 0xA5A5_A5A5;
    let mut samples = Vec::with_capacity(plan.queries);
    let mut short = 0usize;
    for _ in 0..plan.queries {
        let off = (splitmix(&mut rng) % span as u64) as usize;
        let q = &hashes[off..off + len];
        let t = Instant::now();
        let plan_answer = dir
            .query_prefix(NS, q, None)
            .await
            .with_context(|| format!("{backend}: query"))?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
        let covered: u64 = plan_answer.iter().map(|p| u64::from(p.prefix_len)).sum();
        if covered != len as u64 || plan_answer.iter().any(|p| p.node != node.addr) {
            short += 1;
        }
    }
    let stats = LatencyStats::of(&mut samples);
    let _ = dir.unregister(&node).await;
    let bytes_per_entry = match (before, after) {
        (Some(b), Some(a)) => Some(a.saturating_sub(b) as f64 / hashes.len().max(1) as f64),
        _ => None,
    };
    Ok(BackendResult {
        backend: backend.into(),
        target,
        keys: hashes.len(),
        batch: plan.batch,
        insert_s,
        inserts_per_s: hashes.len() as f64 / insert_s.max(1e-9),
        queries: plan.queries,
        query_len: len,
        query_p50_ms: stats.p50_us / 1e3,
        query_p99_ms: stats.p99_us / 1e3,
        query_max_ms: stats.max_us / 1e3,
        query_mean_ms: stats.mean_us / 1e3,
        query_short: short,
        memory_probe: probe.label(),
        memory_before_bytes: before,
        memory_after_bytes: after,
        bytes_per_entry,
    })
}

// ---------------------------------------------------------------------------------------
// Processes the bench starts.

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A child process killed (by its pid) when dropped.
struct ChildGuard {
    child: Child,
    log: Option<PathBuf>,
}

impl ChildGuard {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(why)` when it exited, with the tail of its log.
    fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        let tail = self.log.as_deref().map(log_tail).unwrap_or_default();
        Some(format!("exited with {status}{tail}"))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_tail(path: &Path) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(std::io::SeekFrom::Start(len.saturating_sub(2000)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    if s.trim().is_empty() {
        String::new()
    } else {
        format!(": {}", s.trim())
    }
}

/// A `redis-server` the bench started: persistence off, on a free loopback port.
struct OwnRedis {
    _proc: ChildGuard,
    _dir: tempfile::TempDir,
    url: String,
}

async fn start_redis(bin: &Path) -> anyhow::Result<OwnRedis> {
    let dir = tempfile::Builder::new()
        .prefix("pegaflow-dirbench-redis-")
        .tempdir()?;
    let port = free_port()?;
    let log = dir.path().join("redis.log");
    let child = Command::new(bin)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
        ])
        .arg(&log)
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let mut guard = ChildGuard {
        child,
        log: Some(log),
    };
    let url = format!("redis://127.0.0.1:{port}");
    let client = redis::Client::open(url.as_str())?;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(why) = guard.exited() {
            bail!("redis-server {why}");
        }
        if let Ok(mut c) = client.get_multiplexed_async_connection().await {
            if redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .is_ok()
            {
                break;
            }
        }
        if Instant::now() > end {
            bail!("redis-server did not answer PING within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(OwnRedis {
        _proc: guard,
        _dir: dir,
        url,
    })
}

/// Where the Redis of this run is.
enum RedisTarget {
    Own(OwnRedis),
    External(String),
}

impl RedisTarget {
    fn url(&self) -> &str {
        match self {
            RedisTarget::Own(r) => &r.url,
            RedisTarget::External(u) => u,
        }
    }
}

async fn redis_conn(url: &str) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url)?;
    tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .context("no connection to redis within 5 s")?
    .context("cannot connect to redis")
}

/// Deletes every key under `prefix` (SCAN + UNLINK).
async fn delete_prefix(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) {
    let mut cursor: u64 = 0;
    loop {
        let r: redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await;
        let Ok((next, keys)) = r else {
            return;
        };
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> =
                redis::cmd("UNLINK").arg(&keys).query_async(conn).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

fn metaserver_bin(given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = given {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--metaserver-bin {} does not exist", p.display()))
        };
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut tried = Vec::new();
    for base in [PathBuf::from("."), workspace] {
        for profile in ["release", "debug"] {
            let p = base
                .join("target")
                .join(profile)
                .join("pegaflow-metaserver");
            if p.is_file() {
                return Ok(p);
            }
            tried.push(p.display().to_string());
        }
    }
    Err(format!(
        "no pegaflow-metaserver binary ({}); build it with `cargo build --release -p pegaflow-metaserver` or pass --metaserver-bin",
        tried.join(", ")
    ))
}

/// Our MetaServer, started on free loopback ports over its in-memory directory.
struct OwnMetaServer {
    proc: ChildGuard,
    _dir: tempfile::TempDir,
    addr: String,
}

async fn start_metaserver(bin: &Path) -> anyhow::Result<(OwnMetaServer, MetaServerDirectory)> {
    let dir = tempfile::Builder::new()
        .prefix("pegaflow-dirbench-meta-")
        .tempdir()?;
    let log = dir.path().join("metaserver.log");
    let addr = format!("127.0.0.1:{}", free_port()?);
    let http = format!("127.0.0.1:{}", free_port()?);
    let child = Command::new(bin)
        .args(["--addr", &addr, "--http-addr", &http, "--log-level", "warn"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let mut proc = ChildGuard {
        child,
        log: Some(log),
    };
    let client = MetaServerDirectory::new(&MetaServerConfig {
        addr: format!("http://{addr}"),
        timeout_ms: 5_000,
    })?;
    // Ready when a heartbeat of a throw-away node is answered.
    let probe = NodeId::new_session("127.0.0.1:2");
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(why) = proc.exited() {
            bail!("{} {why}", bin.display());
        }
        if client.heartbeat(&probe).await.is_ok() {
            let _ = client.unregister(&probe).await;
            break;
        }
        if Instant::now() > end {
            bail!("{} did not answer a heartbeat within 15 s", bin.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((
        OwnMetaServer {
            proc,
            _dir: dir,
            addr,
        },
        client,
    ))
}

// ---------------------------------------------------------------------------------------
// The backfill phase.

/// One sample of the publisher's counters, from the server's metrics text.
#[derive(Debug, Clone, Copy, Default)]
struct PublisherCounters {
    state_lost: u64,
    backfill_blocks: u64,
    pending: i64,
}

fn metric_value(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name_and_labels)
            .filter(|r| r.starts_with(' '))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
    })
}

fn publisher_counters(h: &pegaflow_runtime::ServerHandle) -> PublisherCounters {
    let text = h.engine.metrics().render();
    PublisherCounters {
        state_lost: metric_value(
            &text,
            "pegaflow_directory_resyncs_total{reason=\"state_lost\"}",
        )
        .unwrap_or(0.0) as u64,
        backfill_blocks: metric_value(&text, "pegaflow_directory_backfill_blocks_total")
            .unwrap_or(0.0) as u64,
        pending: metric_value(&text, "pegaflow_directory_pending_hashes").unwrap_or(0.0) as i64,
    }
}

/// Scans `hashes` (in the order given, chunks of [`SCAN_CHUNK`]) until the directory lists
/// every one, calling `tick` after every query (so counters sampled there are at most one
/// query old, whether the scan waits or keeps pace). Entries are never withdrawn during the scan (nothing is
/// evicted), so a position once confirmed stays confirmed: the scan resumes at the first
/// hash not yet listed.
async fn wait_all_listed(
    dir: &RedisDirectory,
    hashes: &[Vec<u8>],
    deadline: Instant,
    interval: Duration,
    mut tick: impl FnMut(),
) -> anyhow::Result<()> {
    let mut pos = 0usize;
    while pos < hashes.len() {
        let end = (pos + SCAN_CHUNK).min(hashes.len());
        let want = end - pos;
        let covered: usize = match dir.query_prefix(BACKFILL_NS, &hashes[pos..end], None).await {
            Ok(plan) => plan.iter().map(|p| p.prefix_len as usize).sum(),
            Err(_) => 0,
        };
        let covered = covered.min(want);
        pos += covered;
        tick();
        if covered < want {
            if Instant::now() > deadline {
                bail!(
                    "only {pos} of {} blocks listed by the deadline",
                    hashes.len()
                );
            }
            tokio::time::sleep(interval).await;
        }
    }
    Ok(())
}

async fn backfill(url: &str, plan: &Plan) -> anyhow::Result<BackfillResult> {
    let blocks = plan.backfill_blocks;
    let dir = tempfile::Builder::new()
        .prefix("pegaflow-dirbench-srv-")
        .tempdir()?;
    let key_prefix = format!("pegaflow-dirbench:{}:backfill:", std::process::id());
    let mut p = PipelineConfig::embedded_default();
    p.server.addr = "127.0.0.1:0".into();
    p.server.http_addr = "127.0.0.1:0".into();
    p.fd_channel = Some(FdChannelConfig {
        path: dir.path().join("fd.sock"),
    });
    let capacity = (blocks as u64 * TINY_BLOCK as u64 * 2 + (64 << 20)) as i64;
    p.tiers
        .iter_mut()
        .find(|t| t.kind == "dram")
        .context("the embedded default pipeline has no dram tier")?
        .settings
        .insert("capacity".into(), toml::Value::Integer(capacity));
    let mut d = DirectoryConfig::of_kind("redis");
    d.backfill_blocks_per_sec = plan.backfill_rate;
    for (k, v) in [
        ("url", toml::Value::String(url.into())),
        ("key_prefix", toml::Value::String(key_prefix.clone())),
        ("stale_after_secs", toml::Value::Integer(2)),
        ("timeout_ms", toml::Value::Integer(1_000)),
    ] {
        d.settings.insert(k.into(), v);
    }
    p.directory = Some(d);

    let t_start = Instant::now();
    let h = pegaflow_runtime::start(p)
        .await
        .context("cannot start the in-process server")?;
    let result = async {
        let store = h.engine.store().clone();
        let ns: Arc<str> = BACKFILL_NS.into();
        let shape = BlockShape::new(vec![TINY_BLOCK as u64]);
        let hashes = make_hashes(plan.seed ^ 0xBAC0_F111, blocks);
        for hash in &hashes {
            let buf = store
                .allocate(&[TINY_BLOCK])
                .map_err(|e| anyhow::anyhow!("DRAM allocation: {e}"))?
                .pop()
                .context("an allocation answered no buffer")?;
            let fp = buf.len() as u64;
            let block = Arc::new(SealedBlock::from_buffer(0, &shape, Arc::new(buf), fp));
            store.insert_sealed(
                BlockKey {
                    namespace: ns.clone(),
                    group: 0,
                    hash: hash.clone().into_boxed_slice(),
                },
                block,
            );
        }
        let checker = RedisDirectory::connect(RedisConfig {
            url: url.into(),
            key_prefix: key_prefix.clone(),
            stale_after_secs: 2,
            timeout_ms: 5_000,
            ..RedisConfig::default()
        })?;
        let budget = Duration::from_secs(60)
            + Duration::from_secs_f64(5.0 * blocks as f64 / plan.backfill_rate as f64);
        let interval = Duration::from_millis(plan.scan_interval_ms);
        wait_all_listed(&checker, &hashes, Instant::now() + budget, interval, || {})
            .await
            .context("the start-up advertisement")?;
        let initial_advertise_s = t_start.elapsed().as_secs_f64();
        // Let the publisher go idle (a start-up backfill and an events-lagged one may
        // overlap), so the flush starts one clean re-advertisement.
        let mut last = publisher_counters(&h);
        let mut stable_since = Instant::now();
        let quiet_end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < quiet_end {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let c = publisher_counters(&h);
            if c.backfill_blocks != last.backfill_blocks || c.pending != 0 {
                stable_since = Instant::now();
            } else if stable_since.elapsed() >= Duration::from_millis(500) {
                break;
            }
            last = c;
        }

        // The re-advertisement walks DRAM's index one shard at a time, each in its snapshot
        // order: scanning in that order, the scan's frontier follows the publisher's, and the
        // last block is confirmed one query after it is listed (in hash order, nearly every
        // chunk would complete only at the very end, and confirming them all would take
        // ~blocks/1024 queries after the last insert).
        let index = store.index();
        let order: Vec<Vec<u8>> = (0..index.shard_count())
            .flat_map(|i| index.shard_keys(i))
            .filter(|k| &*k.namespace == BACKFILL_NS)
            .map(|k| k.hash.to_vec())
            .collect();
        let order = if order.len() == hashes.len() {
            order
        } else {
            hashes.clone()
        };

        let before = publisher_counters(&h);
        let mut conn = redis_conn(url).await?;
        let t0 = Instant::now();
        redis::cmd("FLUSHALL")
            .query_async::<()>(&mut conn)
            .await
            .context("FLUSHALL")?;
        let mut detect_s = None;
        let mut sent_s = None;
        let sent_all = |c: &PublisherCounters| {
            c.state_lost > before.state_lost
                && c.backfill_blocks >= before.backfill_blocks + blocks as u64
        };
        wait_all_listed(&checker, &order, Instant::now() + budget, interval, || {
            if sent_s.is_some() {
                return;
            }
            let c = publisher_counters(&h);
            if detect_s.is_none() && c.state_lost > before.state_lost {
                detect_s = Some(t0.elapsed().as_secs_f64());
            }
            if sent_all(&c) {
                sent_s = Some(t0.elapsed().as_secs_f64());
            }
        })
        .await
        .context("the re-advertisement after FLUSHALL")?;
        let total_s = t0.elapsed().as_secs_f64();
        let after = publisher_counters(&h);
        if detect_s.is_none() && after.state_lost > before.state_lost {
            detect_s = Some(total_s);
        }
        if sent_s.is_none() && sent_all(&after) {
            sent_s = Some(total_s);
        }
        anyhow::Ok(BackfillResult {
            blocks,
            configured_rate: plan.backfill_rate,
            initial_advertise_s,
            detect_s,
            sent_s,
            total_s,
            effective_rate: detect_s
                .map(|d| blocks as f64 / (total_s - d).max(1e-9))
                .filter(|r| r.is_finite()),
            backfill_blocks_sent: Some(after.backfill_blocks - before.backfill_blocks),
        })
    }
    .await;
    h.shutdown_within(Duration::from_secs(5)).await;
    if let Ok(mut conn) = redis_conn(url).await {
        delete_prefix(&mut conn, &key_prefix).await;
    }
    result
}

// ---------------------------------------------------------------------------------------
// Output.

fn thousands(v: f64) -> String {
    let s = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn print_table(results: &[BackendResult]) {
    println!(
        "{:<11} {:>8} {:>9} {:>12} {:>8} {:>8} {:>8} {:>12}",
        "backend", "keys", "insert s", "inserts/s", "p50 ms", "p99 ms", "max ms", "bytes/entry"
    );
    for r in results {
        println!(
            "{:<11} {:>8} {:>9.3} {:>12} {:>8.3} {:>8.3} {:>8.3} {:>12}",
            r.backend,
            r.keys,
            r.insert_s,
            thousands(r.inserts_per_s),
            r.query_p50_ms,
            r.query_p99_ms,
            r.query_max_ms,
            r.bytes_per_entry
                .map_or_else(|| "n/a".to_string(), |b| format!("{b:.0}")),
        );
    }
}

// ---------------------------------------------------------------------------------------

async fn run(a: Args) -> anyhow::Result<Report> {
    let plan = Plan {
        keys: a.keys.unwrap_or(if a.quick { 20_000 } else { 200_000 }),
        batch: a.batch,
        queries: a.queries,
        query_len: a.query_len,
        backfill_blocks: a
            .backfill_blocks
            .unwrap_or(if a.quick { 10_000 } else { 100_000 }),
        backfill_rate: a.backfill_rate,
        scan_interval_ms: a.scan_interval_ms.max(1),
        seed: a.seed,
    };
    if plan.keys == 0 || plan.batch == 0 || plan.query_len == 0 {
        bail!("--keys, --batch and --query-len must be > 0");
    }
    if plan.backfill_rate == 0 {
        bail!("--backfill-rate must be > 0");
    }
    let wanted: BTreeSet<String> = a.backends.iter().map(|b| b.trim().to_string()).collect();
    if let Some(b) = wanted.iter().find(|b| !BACKENDS.contains(&b.as_str())) {
        bail!("--backends: unknown backend {b:?} (memory, redis, metaserver)");
    }
    let wants = |b: &str| wanted.contains(b);

    // The Redis of this run: needed by the redis backend and the backfill phase.
    let mut redis_note = None;
    let redis = if wants("redis") || !a.no_backfill {
        match &a.redis_url {
            Some(u) => Some(RedisTarget::External(u.clone())),
            None => match on_path("redis-server") {
                Some(bin) => match start_redis(&bin).await {
                    Ok(r) => Some(RedisTarget::Own(r)),
                    Err(e) => {
                        redis_note = Some(format!("cannot start redis-server: {e:#}"));
                        None
                    }
                },
                None => {
                    redis_note = Some(
                        "redis-server is not on PATH (install it, or pass --redis-url)".into(),
                    );
                    None
                }
            },
        }
    } else {
        None
    };
    let mut redis_version = None;
    if let Some(r) = &redis {
        if let Ok(mut c) = redis_conn(r.url()).await {
            if let Ok(info) = redis::cmd("INFO")
                .arg("server")
                .query_async::<String>(&mut c)
                .await
            {
                redis_version = info_field(&info, "redis_version");
            }
        }
    }
    let machine = Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        mem_total_bytes: mem_total(),
        redis_version,
    };
    println!(
        "pegaflow-directory-bench: {} keys in batches of {}, {} queries of {} hashes; {} CPUs, {:.1} GiB",
        plan.keys,
        plan.batch,
        plan.queries,
        plan.query_len,
        machine.cpus,
        machine.mem_total_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64
    );

    let hashes = make_hashes(plan.seed, plan.keys);
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    let mut skip = |backend: &str, reason: String| {
        println!("note: skipping {backend}: {reason}");
        skipped.push(Skipped {
            backend: backend.into(),
            reason,
        });
    };

    if wants("memory") {
        // First, while this process's heap has not grown and shrunk yet.
        let dir = MemoryDirectory::new(&MemoryConfig::default());
        let r = measure(
            "memory",
            "in-process".into(),
            &dir,
            &mut MemProbe::SelfRss,
            &hashes,
            &plan,
        )
        .await?;
        drop(dir);
        results.push(r);
    }

    if wants("redis") {
        match &redis {
            Some(target) => {
                let url = target.url().to_string();
                let key_prefix = format!("pegaflow-dirbench:{}:", std::process::id());
                let r = async {
                    let dir = RedisDirectory::connect(RedisConfig {
                        url: url.clone(),
                        key_prefix: key_prefix.clone(),
                        timeout_ms: 5_000,
                        ..RedisConfig::default()
                    })?;
                    let mut probe = MemProbe::RedisUsed(redis_conn(&url).await?);
                    let r = measure("redis", url.clone(), &dir, &mut probe, &hashes, &plan).await;
                    if let MemProbe::RedisUsed(conn) = &mut probe {
                        delete_prefix(conn, &key_prefix).await;
                    }
                    r
                }
                .await;
                match r {
                    Ok(r) => results.push(r),
                    Err(e) => skip("redis", format!("{e:#}")),
                }
            }
            None => skip("redis", redis_note.clone().unwrap_or_default()),
        }
    }

    if wants("metaserver") {
        match metaserver_bin(a.metaserver_bin.as_deref()) {
            Ok(bin) => {
                let r = async {
                    let (ms, client) = start_metaserver(&bin).await?;
                    let mut probe = MemProbe::ChildRss(ms.proc.pid());
                    let target =
                        format!("{} at {} (pid {})", bin.display(), ms.addr, ms.proc.pid());
                    measure("metaserver", target, &client, &mut probe, &hashes, &plan).await
                }
                .await;
                match r {
                    Ok(r) => results.push(r),
                    Err(e) => skip("metaserver", format!("{e:#}")),
                }
            }
            Err(why) => skip("metaserver", why),
        }
    }
    drop(hashes);

    println!();
    print_table(&results);
    for r in results.iter().filter(|r| r.query_short > 0) {
        println!(
            "warning: {}: {} of {} queries did not cover all {} hashes",
            r.backend, r.query_short, r.queries, r.query_len
        );
    }

    let mut backfill_skipped = None;
    let backfill_result = if a.no_backfill {
        backfill_skipped = Some("--no-backfill".to_string());
        None
    } else {
        match &redis {
            None => {
                backfill_skipped = Some(redis_note.unwrap_or_default());
                None
            }
            Some(RedisTarget::External(_)) if !a.allow_flushall => {
                backfill_skipped = Some(
                    "it runs FLUSHALL, and --redis-url names a Redis the bench did not start (pass --allow-flushall)"
                        .into(),
                );
                None
            }
            Some(target) => match backfill(target.url(), &plan).await {
                Ok(b) => Some(b),
                Err(e) => {
                    backfill_skipped = Some(format!("failed: {e:#}"));
                    None
                }
            },
        }
    };
    println!();
    match (&backfill_result, &backfill_skipped) {
        (Some(b), _) => println!(
            "backfill after FLUSHALL: {} blocks listed again in {:.2} s (lost state seen after {}, all sent after {}, {} blocks/s from detection; configured backfill_blocks_per_sec = {}; start-up advertisement {:.2} s)",
            b.blocks,
            b.total_s,
            b.detect_s.map_or("n/a".into(), |d| format!("{d:.2} s")),
            b.sent_s.map_or("n/a".into(), |d| format!("{d:.2} s")),
            b.effective_rate.map_or("n/a".into(), thousands),
            b.configured_rate,
            b.initial_advertise_s
        ),
        (None, Some(why)) => println!("note: skipping the backfill phase: {why}"),
        (None, None) => {}
    }

    Ok(Report {
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine,
        plan,
        results,
        skipped,
        backfill: backfill_result,
        backfill_skipped,
    })
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let json = a.json.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(run(a))?;
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
