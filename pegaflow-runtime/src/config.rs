//! Configuration: the TOML pipeline (with an embedded default, so the server runs with no
//! file) and the command line, whose flags carry PegaFlow's names and defaults and override
//! the matching pipeline settings.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use serde::{Deserialize, Serialize};

/// The pipeline the server runs when no `--config` is given. Registrars and transports are
/// omitted, which means "every kind linked into this binary, with default settings".
pub const DEFAULT_PIPELINE: &str = r#"
[server]
addr = "127.0.0.1:50055"
http_addr = "0.0.0.0:9091"
log_level = "info"
enable_prometheus = true

[engine]
lease_ttl_secs = 600

[[tier]]
kind = "dram"
capacity = "30gb"
"#;

/// Parses a byte size: a plain integer (bytes), or a number with a unit. `kb`/`mb`/`gb`/`tb`
/// (PegaFlow's `--pool-size` units) and `k`/`m`/`g`/`t`, `kib`/`mib`/`gib`/`tib` are binary
/// (powers of 1024); case and a space before the unit are ignored. Fractions are allowed
/// (`1.5gb`).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let mult: u64 = match unit {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => bail!("invalid size {s:?}: unknown unit {unit:?} (use kb, mb, gb or tb)"),
    };
    if num.is_empty() {
        bail!("invalid size {s:?}: no number");
    }
    let v: f64 = num.parse().with_context(|| format!("invalid size {s:?}"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        bail!("invalid size {s:?}: out of range");
    }
    Ok(bytes as u64)
}

/// Reads a size setting from a plugin table: a string with units or an integer of bytes.
pub fn size_setting(table: &toml::Table, key: &str) -> anyhow::Result<Option<u64>> {
    match table.get(key) {
        None => Ok(None),
        Some(toml::Value::String(s)) => parse_size(s).map(Some),
        Some(toml::Value::Integer(i)) if *i >= 0 => Ok(Some(*i as u64)),
        Some(v) => bail!("{key} must be a size like \"30gb\" or a byte count, got {v}"),
    }
}

/// `[server]`: addresses and logging.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// gRPC listen address.
    #[serde(default = "default_addr")]
    pub addr: String,
    /// HTTP listen address (health, metrics, admin).
    #[serde(default = "default_http_addr")]
    pub http_addr: String,
    /// Log filter (`info`, `debug`, or a tracing filter directive).
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Whether `/metrics` is served.
    #[serde(default = "default_true")]
    pub enable_prometheus: bool,
    /// Whether Python (pickled CUDA IPC) registrations are accepted (`--python-registry`);
    /// false leaves only native registrars.
    #[serde(default = "default_true")]
    pub python_registry: bool,
    /// CUDA device ordinals to serve; absent = every device the driver reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<i32>>,
}

fn default_addr() -> String {
    "127.0.0.1:50055".into()
}
fn default_http_addr() -> String {
    "0.0.0.0:9091".into()
}
fn default_log_level() -> String {
    "info".into()
}
fn default_true() -> bool {
    true
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            addr: default_addr(),
            http_addr: default_http_addr(),
            log_level: default_log_level(),
            enable_prometheus: true,
            python_registry: true,
            devices: None,
        }
    }
}

/// `[fd_channel]`: the native side channel (absent = disabled).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FdChannelConfig {
    /// Unix socket path.
    pub path: PathBuf,
}

/// `[engine]`: block index, leases and bounds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Lease lifetime in seconds (PegaFlow: 600).
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl_secs: u64,
    /// Live leases one instance may hold; more are refused with RESOURCE_EXHAUSTED.
    #[serde(default = "default_max_leases")]
    pub max_leases_per_instance: usize,
    /// Unsealed (partially saved) blocks older than this are dropped, in seconds (PegaFlow: 300).
    #[serde(default = "default_inflight_ttl")]
    pub inflight_ttl_secs: u64,
    /// Live instances; more registrations are refused with RESOURCE_EXHAUSTED.
    #[serde(default = "default_max_instances")]
    pub max_instances: usize,
}

fn default_lease_ttl() -> u64 {
    600
}
fn default_max_leases() -> usize {
    65_536
}
fn default_inflight_ttl() -> u64 {
    300
}
fn default_max_instances() -> usize {
    1024
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            lease_ttl_secs: default_lease_ttl(),
            max_leases_per_instance: default_max_leases(),
            inflight_ttl_secs: default_inflight_ttl(),
            max_instances: default_max_instances(),
        }
    }
}

/// One `[[tier]]`, `[[transport]]` or `[[registrar]]` entry: its kind and its own settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PluginConfig {
    /// The plugin kind, e.g. `dram`.
    pub kind: String,
    /// Layers wrapping the backend, innermost first: names, or `{ kind = "name", ... }`
    /// tables with the layer's settings (`--list-plugins` lists them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<toml::Value>,
    /// Every other key of the table, handed to the plugin's factory.
    #[serde(flatten)]
    pub settings: toml::Table,
}

/// The whole pipeline.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// `[server]`.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[fd_channel]`; absent = the side channel is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd_channel: Option<FdChannelConfig>,
    /// `[engine]`.
    #[serde(default)]
    pub engine: EngineConfig,
    /// `[store]`: the tier stack (demotion queue, promotion deadline).
    #[serde(default)]
    pub store: crate::store::StoreConfig,
    /// `[peer]`: the delegate serving the server-to-server RPCs; absent = not configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<PluginConfig>,
    /// `[[tier]]` entries, landing tier first.
    #[serde(default, rename = "tier")]
    pub tiers: Vec<PluginConfig>,
    /// `[[transport]]` entries; absent = every linked transport kind.
    #[serde(default, rename = "transport", skip_serializing_if = "Option::is_none")]
    pub transports: Option<Vec<PluginConfig>>,
    /// `[[registrar]]` entries; absent = every linked registrar kind.
    #[serde(default, rename = "registrar", skip_serializing_if = "Option::is_none")]
    pub registrars: Option<Vec<PluginConfig>>,
}

impl PipelineConfig {
    /// Parses a pipeline from TOML text.
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        let c: Self = toml::from_str(text).context("invalid pipeline TOML")?;
        Ok(c)
    }

    /// The embedded default pipeline.
    pub fn embedded_default() -> Self {
        Self::from_toml(DEFAULT_PIPELINE).expect("embedded default pipeline parses")
    }

    /// Renders the pipeline as TOML (for `--print-config`).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }

    /// The gRPC address, parsed.
    pub fn grpc_addr(&self) -> anyhow::Result<SocketAddr> {
        self.server
            .addr
            .parse()
            .with_context(|| format!("invalid addr {:?} (expected host:port)", self.server.addr))
    }

    /// The HTTP address, parsed.
    pub fn http_addr(&self) -> anyhow::Result<SocketAddr> {
        self.server.http_addr.parse().with_context(|| {
            format!(
                "invalid http_addr {:?} (expected host:port)",
                self.server.http_addr
            )
        })
    }
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// `pegaflow-server`'s command line. Flags keep `pegaflow-server`'s names and defaults; a flag
/// given on the command line overrides the pipeline file.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pegaflow-server",
    version,
    about = "Node-local KV-cache storage server for LLM inference (PegaFlow-compatible gRPC)",
    long_about = "Node-local KV-cache storage server for LLM inference.\n\n\
        Inference engines register their KV memory, save blocks keyed by content hash, ask which \
        prefix of a request is cached and load those blocks back. Speaks PegaFlow's Engine gRPC \
        protocol, so the published vLLM connector (pegaflow-llm) works unchanged.\n\n\
        With no --config the embedded default pipeline runs: a host-DRAM tier of --pool-size and \
        every registrar and transport linked into this binary (see --list-plugins)."
)]
pub struct Cli {
    /// Pipeline file (TOML). Flags given on the command line override its settings.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print every linked tier, transport and registrar kind with its options, then exit.
    #[arg(long)]
    pub list_plugins: bool,
    /// Print the effective pipeline (file + flags) as TOML, then exit.
    #[arg(long)]
    pub print_config: bool,

    /// gRPC listen address; also the node identity advertised to peers. [default: 127.0.0.1:50055]
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// CUDA devices to serve, comma-separated ordinals. [default: all the driver reports]
    #[arg(long, value_name = "LIST")]
    pub devices: Option<String>,
    /// Host-DRAM tier capacity; units kb, mb, gb, tb (binary). [default: 30gb]
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub pool_size: Option<u64>,
    /// Typical block size hint for the allocator, in bytes (must be > 0).
    #[arg(long, value_name = "BYTES", value_parser = parse_size_arg)]
    pub hint_value_size: Option<u64>,
    /// Back the pinned pool with huge pages.
    #[arg(long)]
    pub use_hugepages: bool,
    /// Admission before writes to tiers below DRAM: adds the `admission` layer (a block is
    /// written only on its second sighting) to every lower tier of the pipeline. Needs a
    /// tier below DRAM.
    #[arg(long)]
    pub enable_lfu_admission: bool,
    /// Do not place pools and copy threads on the GPU's NUMA node.
    #[arg(long)]
    pub disable_numa_affinity: bool,
    /// HTTP listen address for /health, /metrics and the admin endpoints. [default: 0.0.0.0:9091]
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    /// Serve Prometheus metrics on /metrics. [default: true]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub enable_prometheus: Option<bool>,
    /// OTLP metrics endpoint (gRPC).
    #[arg(long, value_name = "URL")]
    pub metrics_otel_endpoint: Option<String>,
    /// OTLP export period in seconds. [default: 10]
    #[arg(long, value_name = "SECS")]
    pub metrics_period_secs: Option<u64>,
    /// Log level: error, warn, info, debug, trace, or a tracing filter. [default: info]
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// SSD cache file or directory; repeat for several paths. Enables the SSD tier.
    #[arg(long, value_name = "PATH", num_args = 1..)]
    pub ssd_cache_path: Vec<PathBuf>,
    /// SSD tier capacity. [default: 512gb]
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub ssd_cache_capacity: Option<u64>,
    /// SSD shard files per path. [default: 1]
    #[arg(long, value_name = "N")]
    pub ssd_cache_shards: Option<u32>,
    /// SSD write queue depth, in batches. [default: 8]
    #[arg(long, value_name = "N")]
    pub ssd_write_queue_depth: Option<usize>,
    /// SSD prefetch queue depth, in batches. [default: 2]
    #[arg(long, value_name = "N")]
    pub ssd_prefetch_queue_depth: Option<usize>,
    /// Concurrent SSD block writes. [default: 2]
    #[arg(long, value_name = "N")]
    pub ssd_write_inflight: Option<usize>,
    /// Concurrent SSD block reads. [default: 16]
    #[arg(long, value_name = "N")]
    pub ssd_prefetch_inflight: Option<usize>,
    /// Blocks in flight from lower tiers at once. [default: 800]
    #[arg(long, value_name = "N")]
    pub max_prefetch_blocks: Option<usize>,
    /// Trace sampling rate, 0..=1. [default: 1.0]
    #[arg(long, value_name = "RATE")]
    pub trace_sample_rate: Option<f64>,
    /// Sub-pools of the DRAM tier, used round-robin. [default: 1]
    #[arg(long, value_name = "N")]
    pub pool_shards: Option<usize>,
    /// One host allocation per block instead of one per batch.
    #[arg(long)]
    pub blockwise_alloc: bool,
    /// RDMA NICs (comma or space separated). Enables cross-node fetch with --metaserver-addr.
    #[arg(long, value_name = "NICS", num_args = 1..)]
    pub nics: Vec<String>,
    /// RC queue pairs per (local NIC, remote NIC). [default: 2]
    #[arg(long, value_name = "N")]
    pub qps_per_peer: Option<usize>,
    /// MetaServer URL (e.g. http://host:50056) for the cross-node block directory.
    #[arg(long, value_name = "URL")]
    pub metaserver_addr: Option<String>,
    /// MetaServer client queue depth. [default: 4096]
    #[arg(long, value_name = "N")]
    pub metaserver_queue_depth: Option<usize>,
    /// HyperLogLog windows for the miss-cardinality metrics. [default: 15m,1h,1d]
    #[arg(long, value_name = "LIST")]
    pub metric_hll_windows: Option<String>,
    /// HyperLogLog bucket bits (4..=18). [default: 16]
    #[arg(long, value_name = "BITS")]
    pub metric_hll_bucket_bits: Option<u8>,
    /// Seconds before an unreleased cross-node transfer lock expires. [default: 120]
    #[arg(long, value_name = "SECS")]
    pub transfer_lock_timeout_secs: Option<u64>,
    /// Unix socket of the fd side channel for native (memfd / CUDA VMM) registrations.
    /// Empty disables it. [default: disabled]
    #[arg(long, value_name = "PATH")]
    pub fd_socket_path: Option<PathBuf>,
    /// Accept Python (pickled CUDA IPC) registrations. This server parses them without Python.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub python_registry: Option<bool>,
}

impl Cli {
    /// Loads the pipeline (file or embedded default) and applies the flags on top.
    pub fn pipeline(&self) -> anyhow::Result<PipelineConfig> {
        let mut p = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read pipeline file {}", path.display()))?;
                PipelineConfig::from_toml(&text)
                    .with_context(|| format!("in pipeline file {}", path.display()))?
            }
            None => PipelineConfig::embedded_default(),
        };
        self.check_unsupported()?;
        if let Some(a) = &self.addr {
            p.server.addr = a.clone();
        }
        if let Some(a) = &self.http_addr {
            p.server.http_addr = a.clone();
        }
        if let Some(l) = &self.log_level {
            p.server.log_level = l.clone();
        }
        if let Some(e) = self.enable_prometheus {
            p.server.enable_prometheus = e;
        }
        if let Some(d) = &self.devices {
            let list = d
                .split(',')
                .map(|x| x.trim())
                .filter(|x| !x.is_empty())
                .map(|x| {
                    x.parse::<i32>()
                        .ok()
                        .filter(|v| *v >= 0)
                        .with_context(|| format!("--devices: {x:?} is not a device ordinal"))
                })
                .collect::<anyhow::Result<Vec<i32>>>()?;
            if list.is_empty() {
                bail!("--devices needs at least one device ordinal, e.g. --devices 0,1");
            }
            p.server.devices = Some(list);
        }
        if let Some(path) = &self.fd_socket_path {
            if path.as_os_str().is_empty() {
                p.fd_channel = None;
            } else {
                p.fd_channel = Some(FdChannelConfig { path: path.clone() });
            }
        }
        if let Some(size) = self.pool_size {
            let t = p
                .tiers
                .iter_mut()
                .find(|t| t.kind == "dram")
                .context("--pool-size given but the pipeline has no dram tier")?;
            t.settings
                .insert("capacity".into(), toml::Value::Integer(size as i64));
        }
        if let Some(h) = self.hint_value_size {
            if h == 0 {
                bail!("--hint-value-size must be > 0");
            }
        }
        if let Some(n) = self.pool_shards {
            if n == 0 {
                bail!("--pool-shards must be >= 1");
            }
            for t in p.tiers.iter_mut().filter(|t| t.kind == "dram") {
                t.settings
                    .insert("shards".into(), toml::Value::Integer(n as i64));
            }
        }
        if let Some(b) = self.python_registry {
            p.server.python_registry = b;
        }
        if self.enable_lfu_admission {
            if p.tiers.len() < 2 {
                bail!(
                    "--enable-lfu-admission filters writes to tiers below DRAM, and this pipeline has none: add a [[tier]] below the dram tier"
                );
            }
            for t in p.tiers.iter_mut().skip(1) {
                let has = t.layers.iter().any(|l| {
                    crate::plugin::parse_layer_entry(l).is_ok_and(|(n, _)| n == "admission")
                });
                if !has {
                    t.layers.push(toml::Value::String("admission".into()));
                }
            }
        }
        tracing_subscriber::EnvFilter::try_new(&p.server.log_level)
            .map_err(|e| anyhow::anyhow!("invalid log level {:?}: {e}", p.server.log_level))?;
        Ok(p)
    }

    /// What start-up should log about accepted flags that change nothing in this build (they
    /// ask for what it already does, or turn off what it does not do).
    pub fn notes(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.disable_numa_affinity {
            v.push("--disable-numa-affinity: this build places no memory by NUMA node; nothing to disable".into());
        }
        if self.blockwise_alloc {
            v.push(
                "--blockwise-alloc: host memory is already allocated (and freed) per block".into(),
            );
        }
        if let Some(h) = self.hint_value_size {
            v.push(format!("--hint-value-size {h}: the DRAM allocator uses 512-byte granules whatever the value size; the hint does not change it"));
        }
        v
    }

    /// Flags for parts this build does not have: start-up fails naming the missing part,
    /// rather than ignoring them.
    fn check_unsupported(&self) -> anyhow::Result<()> {
        let missing = |flag: &str, part: &str| -> anyhow::Result<()> {
            bail!("{flag} needs {part}, which this build of pegaflow-server does not include")
        };
        if !self.ssd_cache_path.is_empty() {
            missing("--ssd-cache-path", "the SSD tier (tiers/ssd)")?;
        }
        if !self.nics.is_empty() {
            missing("--nics", "the RDMA transport (transports/rdma)")?;
        }
        if self.metaserver_addr.is_some() {
            missing(
                "--metaserver-addr",
                "the MetaServer client (cross-node directory)",
            )?;
        }
        if self.use_hugepages {
            missing("--use-hugepages", "huge-page backing of the DRAM tier")?;
        }
        if self.metrics_otel_endpoint.is_some() {
            missing(
                "--metrics-otel-endpoint",
                "an OTLP exporter (scrape /metrics instead)",
            )?;
        }
        let given = |v: bool, flag: &str, part: &str| -> anyhow::Result<()> {
            if v {
                missing(flag, part)?;
            }
            Ok(())
        };
        let ssd = "the SSD tier (tiers/ssd)";
        given(
            self.ssd_cache_capacity.is_some(),
            "--ssd-cache-capacity",
            ssd,
        )?;
        given(self.ssd_cache_shards.is_some(), "--ssd-cache-shards", ssd)?;
        given(
            self.ssd_write_queue_depth.is_some(),
            "--ssd-write-queue-depth",
            ssd,
        )?;
        given(
            self.ssd_prefetch_queue_depth.is_some(),
            "--ssd-prefetch-queue-depth",
            ssd,
        )?;
        given(
            self.ssd_write_inflight.is_some(),
            "--ssd-write-inflight",
            ssd,
        )?;
        given(
            self.ssd_prefetch_inflight.is_some(),
            "--ssd-prefetch-inflight",
            ssd,
        )?;
        given(
            self.max_prefetch_blocks.is_some(),
            "--max-prefetch-blocks",
            "a lower tier to prefetch from (SSD or RDMA)",
        )?;
        given(
            self.qps_per_peer.is_some(),
            "--qps-per-peer",
            "the RDMA transport (transports/rdma)",
        )?;
        given(
            self.metaserver_queue_depth.is_some(),
            "--metaserver-queue-depth",
            "the MetaServer client (cross-node directory)",
        )?;
        given(
            self.transfer_lock_timeout_secs.is_some(),
            "--transfer-lock-timeout-secs",
            "cross-node transfer (transports/rdma)",
        )?;
        given(
            self.metrics_period_secs.is_some(),
            "--metrics-period-secs",
            "an OTLP exporter (scrape /metrics instead)",
        )?;
        given(
            self.metric_hll_windows.is_some() || self.metric_hll_bucket_bits.is_some(),
            "--metric-hll-windows/--metric-hll-bucket-bits",
            "the HyperLogLog miss-cardinality metrics",
        )?;
        given(
            self.trace_sample_rate.is_some(),
            "--trace-sample-rate",
            "span tracing (fastrace)",
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("30gb").unwrap(), 30 << 30);
        assert_eq!(parse_size("16 MB").unwrap(), 16 << 20);
        assert_eq!(parse_size("1.5kb").unwrap(), 1536);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("gb").is_err());
        assert!(parse_size("-1gb").is_err());
    }

    #[test]
    fn default_pipeline_and_overrides() {
        let cli = Cli::parse_from([
            "pegaflow-server",
            "--addr",
            "127.0.0.1:1",
            "--pool-size",
            "1gb",
            "--fd-socket-path",
            "/tmp/x.sock",
        ]);
        let p = cli.pipeline().unwrap();
        assert_eq!(p.server.addr, "127.0.0.1:1");
        assert_eq!(p.server.http_addr, "0.0.0.0:9091");
        assert_eq!(
            size_setting(&p.tiers[0].settings, "capacity").unwrap(),
            Some(1 << 30)
        );
        assert_eq!(p.fd_channel.unwrap().path, PathBuf::from("/tmp/x.sock"));
        let p = Cli::parse_from(["pegaflow-server", "--devices", "0, 2"])
            .pipeline()
            .unwrap();
        assert_eq!(p.server.devices, Some(vec![0, 2]));
        assert!(Cli::parse_from(["pegaflow-server", "--devices", "x"])
            .pipeline()
            .is_err());
        let d = Cli::parse_from(["pegaflow-server"]).pipeline().unwrap();
        assert!(d.fd_channel.is_none(), "the side channel is off by default");
        assert_eq!(d.server.addr, "127.0.0.1:50055");
    }

    #[test]
    fn file_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.toml");
        std::fs::write(
            &f,
            "[server]\naddr = \"127.0.0.1:7\"\nlog_level = \"debug\"\n[[tier]]\nkind = \"dram\"\ncapacity = \"2gb\"\n",
        )
        .unwrap();
        let cli = Cli::parse_from([
            "pegaflow-server",
            "--config",
            f.to_str().unwrap(),
            "--log-level",
            "warn",
        ]);
        let p = cli.pipeline().unwrap();
        assert_eq!(p.server.addr, "127.0.0.1:7");
        assert_eq!(p.server.log_level, "warn");
        assert_eq!(
            size_setting(&p.tiers[0].settings, "capacity").unwrap(),
            Some(2 << 30)
        );
    }

    #[test]
    fn unsupported_flags_fail_with_the_missing_part() {
        let e = Cli::parse_from(["pegaflow-server", "--ssd-cache-path", "/x"])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(e.contains("SSD tier"), "{e}");
        let e = Cli::parse_from(["pegaflow-server", "--max-prefetch-blocks", "800"])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(e.contains("lower tier"), "{e}");
        let e = Cli::parse_from(["pegaflow-server", "--log-level", "=="])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid log level"), "{e}");
        let p = Cli::parse_from([
            "pegaflow-server",
            "--python-registry",
            "false",
            "--pool-shards",
            "2",
        ])
        .pipeline()
        .unwrap();
        assert!(!p.server.python_registry);
        let e = Cli::parse_from(["pegaflow-server", "--nics", "mlx5_0"])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(e.contains("RDMA"), "{e}");
    }

    #[test]
    fn unknown_pipeline_keys_are_rejected() {
        assert!(PipelineConfig::from_toml("[server]\nadr = \"x\"\n").is_err());
    }
}
