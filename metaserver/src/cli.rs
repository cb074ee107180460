//! The command line: PegaFlow 0.25.1's `pegaflow-metaserver` flags (same names, defaults and
//! environment variables), plus `--redis*` for the shared Redis backend. [`parse`] checks
//! them as PegaFlow does and exits with status 2 and a message on a usage error; where
//! PegaFlow exits 1 for a bad value (`--ttl-minutes 0`) or accepts one it cannot honour
//! (`--log-level bogus`, decode backup), this binary refuses with status 2.

use std::net::SocketAddr;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use pegaflow_directory::limits::Caps;

const ABOUT: &str = "pegaflow-metaserver: the cross-node block directory of pegaflow-server nodes (PegaFlow's MetaServer gRPC protocol)";

const LONG_ABOUT: &str = "\
pegaflow-metaserver: the cross-node block directory of pegaflow-server nodes, speaking \
PegaFlow's MetaServer gRPC protocol (pegaflow.MetaServer).

Nodes heartbeat under their address and a session id, advertise the block hashes they hold, \
and ask which nodes hold the longest prefix of a request's hashes. The directory is kept in \
this process's memory (the default; swept every --sweep-interval-secs) or in a Redis shared \
by several MetaServer processes (--redis).

Bounds: every field is checked with pegaflow-server's limits (addresses and session ids up \
to 256 bytes, namespaces up to 1 KiB, block hashes of 1 B to 1 KiB, up to 1,048,576 hashes a \
request; INVALID_ARGUMENT otherwise), and the caps below answer RESOURCE_EXHAUSTED. Their \
defaults come from this machine's memory M (the lower of MemTotal and the cgroup limit): a \
store of M/2, M/2 / 16 MiB nodes (64 to 65536), and an eighth of the store per node in \
192-byte entries.

HTTP: GET /health answers `ok` (503 with the reason while the Redis backend is unreachable); \
GET /metrics serves Prometheus text with PegaFlow's pegaflow_metaserver_* families and ours.";

/// A size in bytes, given as `1073741824`, `12GiB`, `500 MB`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    /// Exact, in the largest binary unit that divides it (`12GiB`, `12083MiB`, `1000B`),
    /// so that it parses back to the same value.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        match UNITS
            .iter()
            .find(|(u, _)| self.0 >= *u && self.0.is_multiple_of(*u))
        {
            Some((u, name)) => write!(f, "{}{name}", self.0 / u),
            None => write!(f, "{}B", self.0),
        }
    }
}

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.trim()
            .parse::<bytesize::ByteSize>()
            .map(|b| Size(b.as_u64()))
            .map_err(|e| format!("{e} (a size such as 1073741824, 12GiB or 500MB)"))
    }
}

/// The flags. See `--help` for what each does.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pegaflow-metaserver",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    max_term_width = 100
)]
pub struct Args {
    /// gRPC address to bind (`ip:port`). Nodes reach the MetaServer service here.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50056")]
    pub addr: SocketAddr,

    /// HTTP address to bind for GET /health and GET /metrics (Prometheus).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9092")]
    pub http_addr: SocketAddr,

    /// Log verbosity: trace, debug, info, warn, error or off (or tracing directives such as
    /// `info,pegaflow_metaserver=debug`).
    #[arg(long, value_name = "LEVEL", default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,

    /// Seconds without a heartbeat (or insert/remove) after which a node is hidden from
    /// query answers and its address may be taken over by a new session. Also answered to
    /// nodes as `stale_after_secs` (they heartbeat at half of it). Must be > 0.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub node_stale_secs: u64,

    /// Minutes without any activity of a node after which the lifecycle sweep forgets the
    /// node and every block it advertised (a live node's blocks never expire by age). Must be
    /// positive and at least --node-stale-secs. With --redis: the lifetime of a block entry
    /// after its last insert.
    #[arg(long, value_name = "MINUTES", default_value_t = 120)]
    pub ttl_minutes: u64,

    /// Seconds between lifecycle sweeps of the in-memory directory (nodes past the TTL, the
    /// entries of replaced sessions, keys left without owners). Must be > 0. Unused with
    /// --redis (Redis expires keys itself).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub sweep_interval_secs: u64,

    /// Live owners (the inserting node included) from which a newly inserted block hash is
    /// answered as reclaimable, so the inserting node may drop its copy first. At least 2.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 3,
        env = "PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT"
    )]
    pub min_reclaimable_owner_count: u32,

    /// PegaFlow's decode-node backup planning. Not implemented by this MetaServer: giving it
    /// refuses to start.
    #[arg(long, env = "PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP")]
    pub enable_decode_backup: bool,

    /// PegaFlow's delay before an idle node becomes a backup target (PegaFlow's default 180).
    /// Decode backup is not implemented here: giving it refuses to start.
    #[arg(long, value_name = "SECS")]
    pub backup_target_delay_secs: Option<u64>,

    /// Keep the directory in this Redis (or Valkey) instead of in memory, e.g.
    /// `redis://10.0.0.5:6379/0`: every MetaServer pointed at the same Redis and key prefix
    /// serves the same directory. The server starts while Redis is down; calls then answer
    /// UNAVAILABLE and /health 503 until it is up.
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,

    /// Prefix of every Redis key the directory writes (several directories can share one
    /// Redis under different prefixes). Needs --redis.
    #[arg(
        long,
        value_name = "PREFIX",
        default_value = "pegaflow:dir:",
        requires = "redis"
    )]
    pub redis_key_prefix: String,

    /// Milliseconds one directory call may wait on Redis (connecting included) before it
    /// answers UNAVAILABLE. Needs --redis.
    #[arg(long, value_name = "MS", default_value_t = 250, requires = "redis")]
    pub redis_timeout_ms: u64,

    /// Registered nodes (live or stale) at most: the heartbeat of one more new address
    /// answers RESOURCE_EXHAUSTED until a node unregisters or stays silent for
    /// --ttl-minutes. Default: the store budget / 16 MiB, within 64..=65536 (this machine's
    /// figure shown). With --redis, live node records count (a stale one has expired), for
    /// every MetaServer sharing the Redis.
    #[arg(long, value_name = "N", default_value_t = Caps::defaults().max_nodes)]
    pub max_nodes: u64,

    /// Block entries one node session may own: an insert that would pass it answers
    /// RESOURCE_EXHAUSTED and keeps nothing of its batch. Default: an eighth of the store
    /// budget in 192-byte entries (a 32-byte hash each), at least 65536 (this machine's
    /// figure shown). With --redis, counted in the node's record.
    #[arg(long, value_name = "N", default_value_t = Caps::defaults().max_blocks_per_node)]
    pub max_blocks_per_node: u64,

    /// Estimated memory the in-memory store may take (entries and namespaces, e.g. 8GiB):
    /// an insert past it answers RESOURCE_EXHAUSTED and keeps nothing of its batch. Default:
    /// half of this machine's memory (shown). Unused with --redis (bound Redis with its
    /// maxmemory).
    #[arg(long, value_name = "SIZE", default_value_t = Size(Caps::defaults().max_store_bytes))]
    pub max_store_bytes: Size,
}

/// The levels `--log-level` accepts (case-insensitive).
pub const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

fn is_level(s: &str) -> bool {
    LOG_LEVELS.iter().any(|l| l.eq_ignore_ascii_case(s.trim()))
}

/// Accepts a level, or comma-separated directives each a level or `target=level` (so that
/// a typo such as `bogus`, which tracing would read as a target name, is refused).
fn parse_log_level(s: &str) -> Result<String, String> {
    let ok = !s.trim().is_empty()
        && s.split(',').all(|part| match part.split_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(part),
        })
        && tracing_subscriber::EnvFilter::try_new(s.to_ascii_lowercase()).is_ok();
    if ok {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(format!(
            "expected one of {} (or directives such as info,pegaflow_metaserver=debug)",
            LOG_LEVELS.join(", ")
        ))
    }
}

impl Args {
    /// The checks PegaFlow makes after parsing, and ours. Returns the message of the first
    /// failure.
    ///
    /// # Errors
    /// `--node-stale-secs`, `--ttl-minutes` or `--sweep-interval-secs` is 0, the TTL is
    /// shorter than the stale interval, `--min-reclaimable-owner-count` < 2, decode backup
    /// asked for, `--redis-timeout-ms`, `--max-nodes` or `--max-blocks-per-node` is 0, or
    /// `--max-store-bytes` is under 1 MiB.
    pub fn check(&self) -> Result<(), String> {
        if self.enable_decode_backup || self.backup_target_delay_secs.is_some() {
            return Err(
                "decode backup (--enable-decode-backup, --backup-target-delay-secs) \
                        is not implemented by this MetaServer; start it without these flags \
                        (and without PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP)"
                    .into(),
            );
        }
        if self.node_stale_secs == 0 {
            return Err("--node-stale-secs must be greater than 0 \
                        (0 would hide every node from queries)"
                .into());
        }
        if self.ttl_minutes == 0 {
            return Err("--ttl-minutes must be greater than 0".into());
        }
        if self.ttl_minutes.saturating_mul(60) < self.node_stale_secs {
            return Err(format!(
                "--ttl-minutes ({}) must be >= --node-stale-secs ({}) (the TTL in seconds is {})",
                self.ttl_minutes,
                self.node_stale_secs,
                self.ttl_minutes.saturating_mul(60)
            ));
        }
        if self.sweep_interval_secs == 0 {
            return Err("--sweep-interval-secs must be greater than 0".into());
        }
        if self.min_reclaimable_owner_count < 2 {
            return Err("--min-reclaimable-owner-count must be at least 2".into());
        }
        if self.redis.is_some() && self.redis_timeout_ms == 0 {
            return Err("--redis-timeout-ms must be greater than 0".into());
        }
        if self.max_nodes == 0 {
            return Err("--max-nodes must be greater than 0".into());
        }
        if self.max_blocks_per_node == 0 {
            return Err("--max-blocks-per-node must be greater than 0".into());
        }
        if self.max_store_bytes.0 < 1 << 20 {
            return Err(format!(
                "--max-store-bytes ({}) must be at least 1 MiB",
                self.max_store_bytes
            ));
        }
        Ok(())
    }

    /// The caps the flags set.
    pub fn caps(&self) -> Caps {
        Caps {
            max_nodes: self.max_nodes,
            max_blocks_per_node: self.max_blocks_per_node,
            max_store_bytes: self.max_store_bytes.0,
        }
    }
}

/// Parses the process's arguments and checks them; on a usage error prints it (with
/// clap's usage line) and exits with status 2.
pub fn parse() -> Args {
    let args = Args::parse();
    if let Err(msg) = args.check() {
        Args::command()
            .error(ErrorKind::ValueValidation, msg)
            .exit();
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("pegaflow-metaserver").chain(v.iter().copied()))
    }

    #[test]
    fn defaults_are_pegaflows() {
        let a = args(&[]).unwrap();
        assert_eq!(a.addr.to_string(), "127.0.0.1:50056");
        assert_eq!(a.http_addr.to_string(), "0.0.0.0:9092");
        assert_eq!(a.log_level, "info");
        assert_eq!(
            (a.node_stale_secs, a.ttl_minutes, a.sweep_interval_secs),
            (30, 120, 600)
        );
        assert_eq!(a.min_reclaimable_owner_count, 3);
        assert!(!a.enable_decode_backup && a.backup_target_delay_secs.is_none());
        assert!(a.redis.is_none());
        assert_eq!(a.caps(), Caps::defaults());
        a.check().unwrap();
        Args::command().debug_assert();
    }

    #[test]
    fn log_levels() {
        for ok in [
            "info",
            "DEBUG",
            "warn",
            "off",
            "info,h2=warn",
            "pegaflow_metaserver=trace",
        ] {
            assert!(parse_log_level(ok).is_ok(), "{ok}");
        }
        for bad in ["bogus", "", "info,", "=info", "info=loud", "verbose"] {
            assert!(parse_log_level(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checks() {
        let e = |v: &[&str]| args(v).unwrap().check().unwrap_err();
        assert!(e(&["--ttl-minutes", "0"]).contains("--ttl-minutes"));
        assert!(e(&["--ttl-minutes", "1", "--node-stale-secs", "61"]).contains(">="));
        args(&["--ttl-minutes", "1", "--node-stale-secs", "60"])
            .unwrap()
            .check()
            .unwrap();
        assert!(e(&["--sweep-interval-secs", "0"]).contains("sweep"));
        assert!(e(&["--node-stale-secs", "0"]).contains("stale"));
        assert!(e(&["--min-reclaimable-owner-count", "1"]).contains("at least 2"));
        assert!(e(&["--enable-decode-backup"]).contains("not implemented"));
        assert!(e(&["--backup-target-delay-secs", "180"]).contains("not implemented"));
        assert!(
            args(&["--redis-key-prefix", "x:"]).is_err(),
            "needs --redis"
        );
        let r = args(&[
            "--redis",
            "redis://127.0.0.1:1",
            "--redis-timeout-ms",
            "100",
        ])
        .unwrap();
        r.check().unwrap();
        assert!(e(&["--max-nodes", "0"]).contains("--max-nodes"));
        assert!(e(&["--max-blocks-per-node", "0"]).contains("--max-blocks-per-node"));
        assert!(e(&["--max-store-bytes", "1000"]).contains("at least 1 MiB"));
        let c = args(&[
            "--max-nodes",
            "5",
            "--max-blocks-per-node",
            "100",
            "--max-store-bytes",
            "2GiB",
        ])
        .unwrap();
        c.check().unwrap();
        assert_eq!(
            c.caps(),
            Caps {
                max_nodes: 5,
                max_blocks_per_node: 100,
                max_store_bytes: 2 << 30
            }
        );
        assert!(args(&["--max-store-bytes", "lots"]).is_err());
        for (v, shown) in [
            (3u64 << 30, "3GiB"),
            (12_083 << 20, "12083MiB"),
            (1000, "1000B"),
            (5 << 40, "5TiB"),
        ] {
            assert_eq!(Size(v).to_string(), shown);
            assert_eq!(shown.parse::<Size>().unwrap(), Size(v));
        }
    }
}
