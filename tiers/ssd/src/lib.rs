//! `pegaflow-tier-ssd`: the SSD tier (kind `ssd`). Blocks evicted from host DRAM are
//! written to local NVMe as self-describing records in append-only segment files, survive a
//! crash or restart of the server, and come back into DRAM when a query asks for them.
//!
//! - **On disk** ([`format`], [`dir`]): per directory an owner lock on the directory itself (a
//!   second server on the same directory fails at start naming the holder's pid), a
//!   superblock, and segment files preallocated with `fallocate`; each record has a
//!   checksummed header (namespace, hash, slot layout, generation, sequence number) and a
//!   trailer whose checksum covers the record's place, its header and its payload, so that a
//!   payload in the wrong place never verifies (format version 2; version 1 is refused);
//!   sealed segments end with a summary of their headers. Alignment comes from the device
//!   (`statx`).
//! - **I/O** ([`io`]): `tokio-uring` rings on dedicated threads with registered buffers, or
//!   `pread`/`pwrite` threads when io_uring is refused (`io = "auto"` picks, logs once, and
//!   shows the engine on `/health` and in `pegaflow_ssd_io_engine`).
//! - **Restart** ([`store`]): the index is rebuilt from summaries, and from a verified scan
//!   of the segments that were open at the crash; torn records are dropped.
//! - **Capacity**: `min(capacity, free space − reserve)` per directory at start (a WARN when
//!   that cuts it), and a new segment file only while `statvfs` shows room above the reserve
//!   (stores on one filesystem share it); whole segments are evicted (FIFO or by read heat);
//!   ENOSPC evicts and retries once; failed writes are logged (rate-limited) and shown on
//!   `/health`; an unreadable segment costs its own blocks; a directory that keeps failing
//!   leaves service while the server keeps serving.
//!
//! PegaFlow's flags keep their names (`--ssd-cache-path`, `--ssd-cache-capacity`, ...): the
//! factory declares them (reference: PegaFlow 0.25.1's SSD cache flags; its defects — files
//! truncated at start, no checksums, 512-byte alignment, one `writev` per block — are what
//! this tier is built not to have).

pub mod device;
pub mod dir;
pub mod format;
pub mod io;
pub mod metrics;
mod preflight;
mod ratelog;
pub mod store;
pub mod verify;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use pegaflow_plugin::health::{HealthBoard, HealthState};
use pegaflow_plugin::layers::{AdmissionConfig, AdmissionTier};
use pegaflow_plugin::LayerContext;
use pegaflow_plugin::{
    defaults_of, parse_settings, BuiltTier, ConfigSchema, FactoryFlag, FlagValue, PluginOption,
    RuntimeContext, Tier, TierFactory,
};
use serde::{Deserialize, Serialize};

pub use io::{IoChoice, IoEngine};
pub use store::SsdTier;

/// Which whole segment leaves first when the tier needs room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// The oldest segment.
    Fifo,
    /// The segment read least per byte (then the oldest).
    Heat,
}

/// Which demoted blocks the tier writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Admission {
    /// A block is written on its second sighting: a query that wanted it and found it
    /// nowhere, or an earlier write attempt (saves the device from single-use blocks).
    SecondSighting,
    /// Every block offered.
    Always,
    /// None: the tier serves what it holds from earlier runs and writes nothing.
    Never,
}

/// The `[[tier]] kind = "ssd"` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SsdConfig {
    /// Cache directories (created when absent; one per device, striped by free space), or
    /// existing regular files (one store per file). `--ssd-cache-path`, repeatable.
    #[serde(default)]
    pub paths: Vec<PathBuf>,
    /// Bytes the tier may hold, over all paths (split evenly; each path gets at most its
    /// free space minus `reserve` at start, logged as a WARN when that cuts it, and creates a
    /// new segment file only while the filesystem has room above `reserve`).
    /// `--ssd-cache-capacity`. Default `512gb`.
    #[serde(default = "default_capacity", with = "pegaflow_plugin::units::size")]
    pub capacity: u64,
    /// Bytes per segment file (the unit of preallocation and eviction; smaller for small
    /// stores). A store keeps the size it was created with. Default `256mb`.
    #[serde(default = "default_segment", with = "pegaflow_plugin::units::size")]
    pub segment_size: u64,
    /// Bytes left free on each filesystem (at most 5 % of it). Default `1gb`.
    #[serde(default = "default_reserve", with = "pegaflow_plugin::units::size")]
    pub reserve: u64,
    /// I/O engine: `auto` (io_uring, pread/pwrite when refused), `uring`, `posix`.
    #[serde(default = "default_io")]
    pub io: IoChoice,
    /// Open data files with O_DIRECT (falls back to the page cache, with a warning, where
    /// the filesystem refuses it). Default true.
    #[serde(default = "default_true")]
    pub direct: bool,
    /// I/O threads (rings or workers). Default 4.
    #[serde(default = "default_io_threads")]
    pub io_threads: usize,
    /// Put batches (from the demotion worker or write-through) in the tier at once; more
    /// are refused and counted (`pegaflow_ssd_write_queue_full_total`); the blocks
    /// stay in DRAM. `--ssd-write-queue-depth`. Default 8.
    #[serde(default = "default_write_queue")]
    pub write_queue_depth: usize,
    /// Writes in flight (each one chunk of records to one open segment; one open segment
    /// per write in flight). `--ssd-write-inflight`. Default 4 (PegaFlow's 2 counts single
    /// blocks; one of these is a chunk of up to `write_chunk` bytes).
    #[serde(default = "default_write_inflight")]
    pub write_inflight: usize,
    /// Get batches (promotions) in the tier at once; more are refused (the promotion falls
    /// through to a miss) and counted. `--ssd-prefetch-queue-depth`. Default 32.
    #[serde(default = "default_prefetch_queue")]
    pub prefetch_queue_depth: usize,
    /// Block reads in flight. `--ssd-prefetch-inflight`. Default 16.
    #[serde(default = "default_prefetch_inflight")]
    pub prefetch_inflight: usize,
    /// Open segments per path (write streams); 0 = one per write in flight.
    /// `--ssd-cache-shards`. Default 0.
    #[serde(default)]
    pub streams_per_path: usize,
    /// Bytes of one write (consecutive records batched into one sequential write).
    /// Default `8mb`.
    #[serde(default = "default_chunk", with = "pegaflow_plugin::units::size")]
    pub write_chunk: u64,
    /// `fifo` or `heat`. Default `fifo`.
    #[serde(default = "default_eviction")]
    pub eviction: Eviction,
    /// `second-sighting`, `always` or `never`. Default `second-sighting` (`always` when
    /// `write_through` is set).
    #[serde(default)]
    pub admission: Option<Admission>,
    /// Write every sealed block at once (not only those leaving DRAM), so that DRAM-resident
    /// blocks survive a restart too. Default false.
    #[serde(default)]
    pub write_through: bool,
    /// I/O errors in a row (ENOSPC not counted) after which a directory leaves service, and
    /// failed writes in a row after which `/health` says it cannot write. Default 8.
    #[serde(default = "default_max_errors")]
    pub max_errors: u32,
}

fn default_capacity() -> u64 {
    512 << 30
}
fn default_segment() -> u64 {
    256 << 20
}
fn default_reserve() -> u64 {
    1 << 30
}
fn default_io() -> IoChoice {
    IoChoice::Auto
}
fn default_true() -> bool {
    true
}
fn default_io_threads() -> usize {
    4
}
fn default_write_queue() -> usize {
    8
}
fn default_write_inflight() -> usize {
    4
}
fn default_prefetch_queue() -> usize {
    32
}
fn default_prefetch_inflight() -> usize {
    16
}
fn default_chunk() -> u64 {
    8 << 20
}
fn default_eviction() -> Eviction {
    Eviction::Fifo
}
fn default_max_errors() -> u32 {
    8
}

impl Default for SsdConfig {
    fn default() -> Self {
        Self {
            paths: Vec::new(),
            capacity: default_capacity(),
            segment_size: default_segment(),
            reserve: default_reserve(),
            io: default_io(),
            direct: true,
            io_threads: default_io_threads(),
            write_queue_depth: default_write_queue(),
            write_inflight: default_write_inflight(),
            prefetch_queue_depth: default_prefetch_queue(),
            prefetch_inflight: default_prefetch_inflight(),
            streams_per_path: 0,
            write_chunk: default_chunk(),
            eviction: default_eviction(),
            admission: None,
            write_through: false,
            max_errors: default_max_errors(),
        }
    }
}

impl SsdConfig {
    /// The admission in force (`admission`, or its default for `write_through`).
    pub fn admission(&self) -> Admission {
        self.admission.unwrap_or(if self.write_through {
            Admission::Always
        } else {
            Admission::SecondSighting
        })
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.paths.is_empty() {
            bail!("ssd tier: no path: set `paths` (or --ssd-cache-path)");
        }
        if self.capacity == 0 {
            bail!("ssd tier: capacity must be > 0");
        }
        for (what, v) in [
            ("io_threads", self.io_threads),
            ("write_queue_depth", self.write_queue_depth),
            ("write_inflight", self.write_inflight),
            ("prefetch_queue_depth", self.prefetch_queue_depth),
            ("prefetch_inflight", self.prefetch_inflight),
        ] {
            if v == 0 {
                bail!("ssd tier: {what} must be > 0");
            }
        }
        if self.write_chunk < (64 << 10) {
            bail!("ssd tier: write_chunk must be at least 64kb");
        }
        let mut seen = std::collections::HashSet::new();
        for p in &self.paths {
            if !seen.insert(p) {
                bail!("ssd tier: path {} is given twice", p.display());
            }
        }
        Ok(())
    }
}

/// What the store runs with, derived from [`SsdConfig`].
#[derive(Debug, Clone, Copy)]
pub struct SsdSettings {
    /// Write streams (open segments) in all.
    pub streams: usize,
    /// Writes in flight.
    pub write_inflight: usize,
    /// Put batches admitted at once.
    pub write_queue_depth: usize,
    /// Reads in flight.
    pub prefetch_inflight: usize,
    /// Get batches admitted at once.
    pub prefetch_queue_depth: usize,
    /// Bytes of one write.
    pub write_chunk: u64,
    /// Eviction order.
    pub eviction: Eviction,
    /// Ask for write-through.
    pub write_through: bool,
    /// Errors in a row before a directory leaves service.
    pub max_errors: u32,
    /// Refuse every put (`admission = "never"`: serve what earlier runs left).
    pub write_none: bool,
}

/// Opens the tier `config` describes with the engine it names; `registry` receives the
/// metric families, `health` the `/health` lines. Call [`Tier::recover`] before use.
///
/// # Errors
/// A bad setting, a path that cannot be used (locked by another server, not ours, no room),
/// or `io = "uring"` refused.
pub fn open(
    config: &SsdConfig,
    registry: &prometheus::Registry,
    health: &HealthBoard,
) -> anyhow::Result<SsdTier> {
    config.check()?;
    raise_open_file_limit();
    let dirs = open_dirs(config)?;
    let (threads, bytes, align) = engine_shape(config, &dirs);
    let (engine, fallback) = io::start(
        config.io,
        io::EngineOptions {
            threads,
            buffers_per_thread: 4,
            buffer_bytes: bytes,
            mem_align: align,
        },
    )?;
    let metrics = metrics::SsdMetrics::new(registry);
    if let Some(why) = &fallback {
        tracing::warn!("SSD tier: {why}");
        metrics.io_fallbacks.inc();
        health.report("ssd io", HealthState::Ok, why.clone());
    }
    Ok(build_tier(config, dirs, engine, metrics, health))
}

/// As [`open`], with a given engine (tests wrap one in [`io::fault::FaultyIo`]).
///
/// # Errors
/// As [`open`].
pub fn open_with_engine(
    config: &SsdConfig,
    engine: Arc<dyn IoEngine>,
    registry: &prometheus::Registry,
    health: &HealthBoard,
) -> anyhow::Result<SsdTier> {
    config.check()?;
    let dirs = open_dirs(config)?;
    let metrics = metrics::SsdMetrics::new(registry);
    Ok(build_tier(config, dirs, engine, metrics, health))
}

/// A directory store keeps one descriptor per segment file open (2,048 per path at the
/// defaults): raise the soft limit on open files to the hard one (systemd's soft default is
/// 1,024), once.
fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    if let Some(max) = l.maximum {
        if l.current.is_some_and(|c| c < max) {
            let r = setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(max),
                    maximum: Some(max),
                },
            );
            tracing::debug!(
                to = max,
                ok = r.is_ok(),
                "raised the open-file limit for the SSD tier"
            );
        }
    }
}

/// Engine options that fit `dirs`: threads, staging-buffer bytes, memory alignment.
pub fn engine_shape(config: &SsdConfig, dirs: &[dir::Dir]) -> (usize, usize, usize) {
    let align = dirs.iter().map(|d| d.mem_align).max().unwrap_or(4096) as usize;
    (
        config.io_threads,
        config.write_chunk as usize,
        align.max(4096),
    )
}

fn open_dirs(config: &SsdConfig) -> anyhow::Result<Vec<dir::Dir>> {
    let per = config.capacity / config.paths.len() as u64;
    config
        .paths
        .iter()
        .map(|p| {
            let d = dir::Dir::open(
                p,
                dir::DirOptions {
                    capacity: per,
                    segment_size: config.segment_size,
                    reserve: config.reserve,
                    direct: config.direct,
                },
            )
            .with_context(|| format!("ssd tier: path {}", p.display()))?;
            tracing::info!(
                path = %p.display(),
                align = d.align,
                align_source = d.align_source,
                direct = d.direct,
                segments = d.slots,
                segment_bytes = d.segment_size,
                "SSD directory opened"
            );
            Ok(d)
        })
        .collect()
}

fn build_tier(
    config: &SsdConfig,
    dirs: Vec<dir::Dir>,
    engine: Arc<dyn IoEngine>,
    metrics: metrics::SsdMetrics,
    health: &HealthBoard,
) -> SsdTier {
    let per_path = if config.streams_per_path > 0 {
        config.streams_per_path
    } else {
        config.write_inflight.div_ceil(dirs.len().max(1))
    };
    let settings = SsdSettings {
        streams: (per_path * dirs.len()).max(1),
        write_inflight: config.write_inflight,
        write_queue_depth: config.write_queue_depth,
        prefetch_inflight: config.prefetch_inflight,
        prefetch_queue_depth: config.prefetch_queue_depth,
        write_chunk: config.write_chunk,
        eviction: config.eviction,
        write_through: config.write_through,
        max_errors: config.max_errors.max(1),
        write_none: config.admission() == Admission::Never,
    };
    SsdTier::new(settings, dirs, engine, metrics, health.clone())
}

/// The admission filter in front of the tier, as configured.
fn with_admission(tier: SsdTier, config: &SsdConfig, ctx: &RuntimeContext) -> Arc<dyn Tier> {
    let inner: Arc<dyn Tier> = Arc::new(tier);
    match config.admission() {
        Admission::Always => inner,
        Admission::SecondSighting => Arc::new(AdmissionTier::new(
            inner,
            &AdmissionConfig::default(),
            LayerContext {
                metrics: ctx.metrics.clone(),
                wrapped_kind: "ssd",
            },
        )),
        // The tier itself refuses every put (`SsdSettings::write_none`).
        Admission::Never => inner,
    }
}

fn build(table: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<BuiltTier> {
    let config: SsdConfig = parse_settings("ssd tier", table)?;
    let tier = open(&config, ctx.metrics.registry(), &ctx.health)?;
    Ok(BuiltTier::Block(with_admission(tier, &config, ctx)))
}

inventory::submit! {
    TierFactory {
        kind: "ssd",
        summary: "local NVMe below DRAM: crash-safe segment logs, io_uring or pread/pwrite, restart recovery",
        config: ConfigSchema {
            defaults: defaults_of::<SsdConfig>,
            check: |w, t| parse_settings::<SsdConfig>(w, t)?.check(),
            options: &[
                PluginOption { name: "paths", help: "cache directories (created when absent) or existing files; one per device" },
                PluginOption { name: "capacity", help: "bytes over all paths; each path gets at most its free space minus reserve" },
                PluginOption { name: "segment_size", help: "bytes per segment file (preallocation and eviction unit)" },
                PluginOption { name: "reserve", help: "bytes left free per filesystem (at most 5 % of it)" },
                PluginOption { name: "io", help: "auto (io_uring, pread/pwrite when refused), uring, posix" },
                PluginOption { name: "direct", help: "O_DIRECT (falls back to the page cache where refused)" },
                PluginOption { name: "io_threads", help: "I/O threads (rings or workers)" },
                PluginOption { name: "write_queue_depth", help: "put batches admitted at once; more are refused and counted" },
                PluginOption { name: "write_inflight", help: "writes in flight (one open segment each)" },
                PluginOption { name: "prefetch_queue_depth", help: "get batches (promotions) admitted at once" },
                PluginOption { name: "prefetch_inflight", help: "block reads in flight" },
                PluginOption { name: "streams_per_path", help: "open segments per path; 0 = one per write in flight" },
                PluginOption { name: "write_chunk", help: "bytes of one sequential write" },
                PluginOption { name: "eviction", help: "fifo or heat (whole segments)" },
                PluginOption { name: "admission", help: "second-sighting (default), always (default with write_through), never" },
                PluginOption { name: "write_through", help: "write every sealed block at once (restart survival of DRAM-resident blocks)" },
                PluginOption { name: "max_errors", help: "I/O errors in a row before a path leaves service (failed writes in a row before /health says it cannot write)" },
            ],
        },
        flags: &[
            FactoryFlag {
                long: "ssd-cache-path",
                value_name: "PATH",
                help: "SSD cache directory (created when absent) or existing file; repeat for several devices. Enables the SSD tier below DRAM; blocks survive restarts. [default: off]",
                setting: "paths",
                value: FlagValue::TextList,
                adds_entry: true,
            },
            FactoryFlag {
                long: "ssd-cache-capacity",
                value_name: "SIZE",
                help: "SSD tier capacity over all paths, capped by free space minus a reserve (at start, with a WARN naming both figures, and at run time). [default: 512gb]",
                setting: "capacity",
                value: FlagValue::Size,
                adds_entry: false,
            },
            FactoryFlag {
                long: "ssd-cache-shards",
                value_name: "N",
                help: "Open segments (write streams) per SSD path; 0 = one per write in flight. [default: 0]",
                setting: "streams_per_path",
                value: FlagValue::Integer { min: 0 },
                adds_entry: false,
            },
            FactoryFlag {
                long: "ssd-write-queue-depth",
                value_name: "N",
                help: "SSD put batches admitted at once; more are dropped (counted), the blocks stay in DRAM. [default: 8]",
                setting: "write_queue_depth",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
            FactoryFlag {
                long: "ssd-prefetch-queue-depth",
                value_name: "N",
                help: "SSD get batches (promotions) admitted at once. [default: 32]",
                setting: "prefetch_queue_depth",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
            FactoryFlag {
                long: "ssd-write-inflight",
                value_name: "N",
                help: "SSD writes in flight (one open segment each). [default: 4]",
                setting: "write_inflight",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
            FactoryFlag {
                long: "ssd-prefetch-inflight",
                value_name: "N",
                help: "SSD block reads in flight. [default: 16]",
                setting: "prefetch_inflight",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
        ],
        default_landing: false,
        build,
    }
}

inventory::submit! {
    pegaflow_plugin::Preflight {
        section: pegaflow_plugin::Section::Tier,
        kind: "ssd",
        check: preflight::preflight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_serialise_and_bad_settings_are_refused() {
        let t = defaults_of::<SsdConfig>();
        assert_eq!(t["capacity"], toml::Value::String("512gb".into()));
        let c: SsdConfig = parse_settings("ssd", &t).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("no path"));
        assert_eq!(c.admission(), Admission::SecondSighting);
        let c = SsdConfig {
            write_through: true,
            ..c
        };
        assert_eq!(c.admission(), Admission::Always);
        let e = parse_settings::<SsdConfig>(
            "ssd",
            &toml::from_str("paths = [\"/x\"]\nbogus = 1").unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bogus"), "{e}");
        let c: SsdConfig =
            parse_settings("ssd", &toml::from_str("paths = [\"/x\", \"/x\"]").unwrap()).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("twice"));
    }
}
