//! The command line: the runtime's own flags ([`Flags`], PegaFlow's names and defaults), the
//! flags every linked factory declares, PegaFlow's flags of parts this build lacks (refused
//! naming the part), and how they apply on top of the pipeline ([`Cli::pipeline`]).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;

use super::{
    parse_size, validate_log_level, AdminAllow, FdChannelConfig, PipelineConfig, PluginConfig,
};
use crate::plugin::{
    declared_flags, peer_service_factory, DeclaredFlag, DefaultPeerPath, FlagValue,
    RegistrarFactory, Section, TransportFactory,
};

/// The smallest size a size flag takes as a bare number of bytes: a bare `30` is far more
/// likely `30gb` with the unit forgotten than a 30-byte pool.
pub const MIN_BARE_SIZE: u64 = 1 << 20;

/// Refuses a bare number below [`MIN_BARE_SIZE`] for a size flag, suggesting a unit.
fn check_bare_size(long: &str, value: FlagValue, text: &str) -> anyhow::Result<()> {
    let t = text.trim();
    if value != FlagValue::Size || t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(());
    }
    match t.parse::<u64>() {
        Ok(n) if n < MIN_BARE_SIZE => bail!(
            "--{long} {t}: {n} bytes is smaller than a block; did you mean {t}gb? (give a unit: kb, mb, gb, tb; a bare number is bytes and must be at least {MIN_BARE_SIZE})"
        ),
        _ => Ok(()),
    }
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// The runtime's own flags of `pegaflow-server`'s command line (without those the linked
/// factories declare; [`Cli`] adds them). Flags keep `pegaflow-server`'s names and defaults; a
/// flag given on the command line overrides the pipeline file.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pegaflow-server",
    version,
    about = "Node-local KV-cache storage server for LLM inference (PegaFlow-compatible gRPC)",
    long_about = "Node-local KV-cache storage server for LLM inference.\n\n\
        Inference engines register their KV memory, save blocks keyed by content hash, ask which \
        prefix of a request is cached and load those blocks back. Speaks PegaFlow's Engine gRPC \
        protocol, so the published vLLM connector (pegaflow-llm) works unchanged.\n\n\
        With no --config the embedded default pipeline runs: the default landing tier of this \
        binary with its defaults (a host-DRAM pool of --pool-size in pegaflow-server) and \
        every registrar and transport linked into this binary (see --list-plugins)."
)]
pub struct Flags {
    /// Pipeline file (TOML). Flags given on the command line override its settings.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print every linked tier, transport and registrar kind with its options, then exit.
    #[arg(long)]
    pub list_plugins: bool,
    /// Print the effective pipeline (file + flags) as TOML, then exit; a pipeline
    /// `--check-config` refuses is refused here too.
    #[arg(long)]
    pub print_config: bool,
    /// Check the pipeline (file + flags): addresses, every kind, layer and backend setting;
    /// then the start-up checks that need no side effect (ports free, the side channel's and
    /// the SSD paths' directories creatable, huge pages available), listing what only
    /// start-up can find. Prints what will run, then exits: 0 when start-up would pass these
    /// checks, 2 for a configuration error, 1 when start-up would fail. Creates, maps and
    /// connects nothing.
    #[arg(long)]
    pub check_config: bool,

    /// gRPC listen address; also the node identity advertised to peers. [default: 127.0.0.1:50055]
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// CUDA devices to serve, comma-separated ordinals. [default: all the driver reports]
    #[arg(long, value_name = "LIST")]
    pub devices: Option<String>,
    /// Typical block size hint for the allocator, in bytes (must be > 0).
    #[arg(long, value_name = "BYTES", value_parser = parse_size_arg)]
    pub hint_value_size: Option<u64>,
    /// Admission before writes to tiers below DRAM: adds the `admission` layer (a block is
    /// written only on its second sighting) to every lower tier of the pipeline. Needs a
    /// tier below DRAM.
    #[arg(long)]
    pub enable_lfu_admission: bool,
    /// Do not place the pinned pool and the copy threads on the GPUs' NUMA node (by default
    /// the CUDA transport prefers the pool's pages on its GPUs' node, interleaved over the
    /// nodes when its GPUs span several, and runs each GPU's copy threads on that GPU's node;
    /// a one-node machine has nothing to place). Sets `[server] numa_affinity = false`.
    #[arg(long)]
    pub disable_numa_affinity: bool,
    /// HTTP listen address for /health, /metrics and the admin endpoints. [default: 0.0.0.0:9091]
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    /// Serve Prometheus metrics on /metrics (off unless given, as in PegaFlow). The bare flag
    /// turns it on; `--enable-prometheus false` turns it off where a pipeline turns it on.
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
    /// Blocks all running promotions read from the tiers below DRAM at most, together (the
    /// `[store]` setting `max_promote_blocks`). [default: 800]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_prefetch_blocks: Option<u64>,
    /// Trace sampling rate, 0..=1. [default: 1.0]
    #[arg(long, value_name = "RATE")]
    pub trace_sample_rate: Option<f64>,
    /// One host allocation per block instead of one per batch.
    #[arg(long)]
    pub blockwise_alloc: bool,
    /// Hashes the cross-node directory client keeps pending, netted per block, at most (the
    /// `[directory]` setting `queue_depth`; PegaFlow counts batches here). Needs a directory
    /// (--metaserver-addr or a [directory] table). [default: 65536]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub metaserver_queue_depth: Option<u64>,
    /// HyperLogLog windows for the miss-cardinality metrics. [default: 15m,1h,1d]
    #[arg(long, value_name = "LIST")]
    pub metric_hll_windows: Option<String>,
    /// HyperLogLog bucket bits (4..=18). [default: 16]
    #[arg(long, value_name = "BITS")]
    pub metric_hll_bucket_bits: Option<u8>,
    /// Unix socket of the fd side channel for native (memfd / CUDA VMM) registrations.
    /// Empty disables it. [default: disabled]
    #[arg(long, value_name = "PATH")]
    pub fd_socket_path: Option<PathBuf>,
    /// Accept Python (pickled CUDA IPC) registrations. This server parses them without Python.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub python_registry: Option<bool>,
    /// gRPC connections open at once; one more is accepted and closed at once (counted in
    /// pegaflow_connections_refused_total). [default: the open-file limit less the
    /// descriptors open at start-up and a reserve, between 64 and 65536]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Peers that may call the Shutdown RPC, POST /instances/cleanup and POST
    /// /cache/memory/cleanup: `loopback`, `any`, or comma-separated CIDRs (`10.0.0.0/8`,
    /// `loopback,fd00::/8`). Others get PERMISSION_DENIED / 403. [default: loopback]
    #[arg(long, value_name = "LIST", value_parser = parse_admin_allow_arg)]
    pub admin_allow: Option<AdminAllow>,
}

fn parse_admin_allow_arg(s: &str) -> Result<AdminAllow, String> {
    AdminAllow::parse(s).map_err(|e| e.to_string())
}

/// A factory-declared flag given on the command line, with its parsed value.
#[derive(Debug, Clone)]
pub struct GivenFlag {
    /// The flag and the factory that declared it.
    pub declared: DeclaredFlag,
    /// The value, as the flag's [`crate::plugin::FlagValue`] parsed it.
    pub value: toml::Value,
    /// The text given on the command line (the last occurrence).
    pub text: String,
}

/// `pegaflow-server`'s whole command line: the runtime's [`Flags`] plus the flags every
/// linked factory declares ([`crate::plugin::FactoryFlag`]), so `--help` lists both and
/// `Cli::parse()` reads both.
///
/// # Panics
/// Building the command ([`clap::CommandFactory::command`], which every parse does) panics
/// when a declared flag's name is taken (by a runtime flag or an earlier declaration): two
/// linked crates disagree about a flag, a bug of the binary's composition.
#[derive(Debug, Clone)]
pub struct Cli {
    /// The runtime's own flags.
    pub flags: Flags,
    /// The factory-declared flags that were given, in declaration order.
    pub factory_flags: Vec<GivenFlag>,
    /// PegaFlow flags given that no linked factory declares (start-up refuses them, naming
    /// what each needs).
    pub placeholders: Vec<&'static str>,
}

/// PegaFlow's flags of parts a backend brings (an SSD tier, a cross-node transport, a pool
/// on huge pages), with what each needs. A flag no linked factory declares stays on the
/// command line as a placeholder, so that an existing deployment script gets "this flag
/// needs X, and none is linked" rather than "unexpected argument"; a linked factory that
/// declares the flag ([`crate::plugin::FactoryFlag`]) takes the name over. The third column
/// is PegaFlow 0.25.1's default, shown in `--help` (the flag-parity test compares it).
const PLACEHOLDER_FLAGS: &[(&str, &str, Option<&str>)] = &[
    ("ssd-cache-path", LOWER_TIER, None),
    ("ssd-cache-capacity", LOWER_TIER, Some("512gb")),
    ("ssd-cache-shards", LOWER_TIER, Some("1")),
    ("ssd-write-queue-depth", LOWER_TIER, Some("8")),
    ("ssd-prefetch-queue-depth", LOWER_TIER, Some("2")),
    ("ssd-write-inflight", LOWER_TIER, Some("2")),
    ("ssd-prefetch-inflight", LOWER_TIER, Some("16")),
    ("nics", TRANSPORT, None),
    ("qps-per-peer", TRANSPORT, Some("2")),
    ("transfer-lock-timeout-secs", TRANSPORT, Some("120")),
    (
        "use-hugepages",
        "a landing tier that declares this flag",
        None,
    ),
    (
        "metaserver-addr",
        "a directory backend that declares this flag (the MetaServer client)",
        None,
    ),
    ("backup-reclaimable-percent", DECODE_BACKUP, Some("10")),
    ("backup-max-candidates", DECODE_BACKUP, Some("16384")),
    ("backup-pull-max-bytes", DECODE_BACKUP, Some("256mb")),
    ("backup-max-bandwidth", DECODE_BACKUP, Some("2gb")),
];
/// PegaFlow 0.25.1's decode backup (idle decode nodes pulling retained blocks of busy ones).
const DECODE_BACKUP: &str = "decode backup (idle decode nodes pulling the blocks of busy ones)";
const LOWER_TIER: &str = "an SSD tier (a tier below the landing tier that declares this flag)";
const TRANSPORT: &str = "a cross-node transport that declares this flag";

fn with_factory_flags(mut cmd: clap::Command) -> clap::Command {
    for d in declared_flags() {
        let f = d.flag;
        if let Some(taken) = cmd.get_arguments().find(|a| a.get_long() == Some(f.long)) {
            panic!(
                "--{} declared by {} {:?} is already a flag of this binary ({})",
                f.long,
                d.section.noun(),
                d.kind,
                taken.get_id()
            );
        }
        let value = f.value;
        let mut arg = clap::Arg::new(f.long)
            .long(f.long)
            .help(f.help)
            .value_name(f.value_name)
            .value_parser(move |text: &str| value.parse(text));
        match value {
            FlagValue::Bool => arg = arg.num_args(0..=1).default_missing_value("true"),
            FlagValue::TextList => arg = arg.num_args(1..).action(clap::ArgAction::Append),
            _ => {}
        }
        cmd = cmd.arg(arg);
    }
    for (long, needs, default) in PLACEHOLDER_FLAGS {
        if cmd.get_arguments().any(|a| a.get_long() == Some(long)) {
            continue;
        }
        let default = default.map_or(String::new(), |d| format!(" [PegaFlow's default: {d}]"));
        cmd = cmd.arg(
            clap::Arg::new(*long)
                .long(*long)
                .help(format!(
                    "[needs {needs}; none is linked] PegaFlow's flag, refused at start-up.{default}"
                ))
                .value_name("VALUE")
                .num_args(0..)
                .action(clap::ArgAction::Append),
        );
    }
    cmd
}

fn given_placeholders(m: &clap::ArgMatches) -> Vec<&'static str> {
    let declared: Vec<&str> = declared_flags().iter().map(|d| d.flag.long).collect();
    PLACEHOLDER_FLAGS
        .iter()
        .filter(|(long, _, _)| !declared.contains(long))
        .filter(|(long, _, _)| {
            m.try_get_raw_occurrences(long)
                .ok()
                .flatten()
                .is_some_and(|mut o| o.next().is_some())
        })
        .map(|(long, _, _)| *long)
        .collect()
}

fn given_factory_flags(m: &clap::ArgMatches) -> Vec<GivenFlag> {
    declared_flags()
        .into_iter()
        .filter_map(|declared| {
            let value = if declared.flag.value == FlagValue::TextList {
                let all: Vec<toml::Value> = m
                    .try_get_many::<toml::Value>(declared.flag.long)
                    .ok()??
                    .cloned()
                    .collect();
                toml::Value::Array(all)
            } else {
                m.try_get_one::<toml::Value>(declared.flag.long)
                    .ok()??
                    .clone()
            };
            let text = m
                .get_raw(declared.flag.long)
                .and_then(|mut v| v.next_back())
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            Some(GivenFlag {
                declared,
                value,
                text,
            })
        })
        .collect()
}

impl clap::CommandFactory for Cli {
    fn command() -> clap::Command {
        with_factory_flags(Flags::command())
    }
    fn command_for_update() -> clap::Command {
        with_factory_flags(Flags::command_for_update())
    }
}

impl clap::FromArgMatches for Cli {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            flags: Flags::from_arg_matches(m)?,
            factory_flags: given_factory_flags(m),
            placeholders: given_placeholders(m),
        })
    }
    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        self.flags.update_from_arg_matches(m)?;
        self.factory_flags.extend(given_factory_flags(m));
        self.placeholders.extend(given_placeholders(m));
        Ok(())
    }
}

impl Parser for Cli {}

/// The settings tables a flag of `d`'s factory applies to: the first `[[tier]]` of its kind,
/// every `[[transport]]` / `[[registrar]]` entry of its kind (an absent list, meaning every
/// linked kind, is written out first), or the `[directory]` when it is of its kind.
fn flag_targets<'p>(p: &'p mut PipelineConfig, d: &DeclaredFlag) -> Vec<&'p mut toml::Table> {
    fn all(
        list: &mut Option<Vec<PluginConfig>>,
        linked: impl Iterator<Item = &'static str>,
    ) -> &mut Vec<PluginConfig> {
        list.get_or_insert_with(|| {
            linked
                .map(|kind| PluginConfig {
                    kind: kind.into(),
                    layers: Vec::new(),
                    settings: toml::Table::new(),
                })
                .collect()
        })
    }
    let kind = d.kind;
    let entries: Vec<&mut PluginConfig> = match d.section {
        Section::Tier => p
            .tiers
            .iter_mut()
            .filter(|t| t.kind == kind)
            .take(1)
            .collect(),
        Section::Transport => all(
            &mut p.transports,
            inventory::iter::<TransportFactory>().map(|f| f.kind),
        )
        .iter_mut()
        .filter(|t| t.kind == kind)
        .collect(),
        Section::Registrar => all(
            &mut p.registrars,
            inventory::iter::<RegistrarFactory>().map(|f| f.kind),
        )
        .iter_mut()
        .filter(|t| t.kind == kind)
        .collect(),
        Section::Directory => {
            return p
                .directory
                .as_mut()
                .filter(|d| d.kind == kind)
                .map(|d| &mut d.settings)
                .into_iter()
                .collect()
        }
        Section::Peer => p.peer.iter_mut().filter(|t| t.kind == kind).collect(),
    };
    entries.into_iter().map(|e| &mut e.settings).collect()
}

impl Cli {
    /// Loads the pipeline (file or embedded default) and applies the flags on top.
    pub fn pipeline(&self) -> anyhow::Result<PipelineConfig> {
        self.pipeline_and_notes().map(|(p, _)| p)
    }

    /// [`Self::pipeline`], and what start-up should log about what the flags added on their
    /// own (the default peer path of a directory flag, [`DefaultPeerPath`]).
    pub fn pipeline_and_notes(&self) -> anyhow::Result<(PipelineConfig, Vec<String>)> {
        let a = &self.flags;
        let mut notes = Vec::new();
        let mut directory_flag = None;
        let mut p = match &a.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read pipeline file {}", path.display()))?;
                PipelineConfig::from_toml(&text)
                    .with_context(|| format!("in pipeline file {}", path.display()))?
            }
            None => PipelineConfig::embedded_default(),
        };
        a.check_unsupported()?;
        if let Some(long) = self.placeholders.first() {
            let needs = PLACEHOLDER_FLAGS
                .iter()
                .find(|(l, _, _)| l == long)
                .map_or("a backend", |(_, n, _)| n);
            bail!("--{long} needs {needs}, and none is linked into this binary");
        }
        if let Some(n) = a.max_prefetch_blocks {
            p.store.max_promote_blocks = n as usize;
        }
        if let Some(v) = &a.addr {
            p.server.addr = v.clone();
        }
        if let Some(v) = &a.http_addr {
            p.server.http_addr = v.clone();
        }
        if let Some(l) = &a.log_level {
            p.server.log_level = l.clone();
        }
        if let Some(e) = a.enable_prometheus {
            p.server.enable_prometheus = e;
        }
        if let Some(n) = a.max_connections {
            p.server.max_connections = Some(n as usize);
        }
        if let Some(list) = &a.admin_allow {
            p.server.admin_allow = list.clone();
        }
        if let Some(d) = &a.devices {
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
        if a.disable_numa_affinity {
            p.server.numa_affinity = false;
        }
        if let Some(path) = &a.fd_socket_path {
            if path.as_os_str().is_empty() {
                p.fd_channel = None;
            } else {
                p.fd_channel = Some(FdChannelConfig { path: path.clone() });
            }
        }
        for g in &self.factory_flags {
            let d = &g.declared;
            check_bare_size(d.flag.long, d.flag.value, &g.text)?;
            if d.flag.adds_entry
                && d.section == Section::Tier
                && !p.tiers.iter().any(|t| t.kind == d.kind)
            {
                p.tiers.push(PluginConfig {
                    kind: d.kind.into(),
                    layers: Vec::new(),
                    settings: toml::Table::new(),
                });
            }
            if d.flag.adds_entry && d.section == Section::Peer && p.peer.is_none() {
                p.peer = Some(PluginConfig {
                    kind: d.kind.into(),
                    layers: Vec::new(),
                    settings: toml::Table::new(),
                });
            }
            if d.flag.adds_entry && d.section == Section::Directory && p.directory.is_none() {
                p.directory = Some(crate::cluster::DirectoryConfig::of_kind(d.kind));
                directory_flag = Some(d.flag.long);
            }
            let targets = flag_targets(&mut p, d);
            if targets.is_empty() {
                if let (Section::Directory, Some(have)) = (d.section, &p.directory) {
                    bail!(
                        "--{} is a setting of the {} directory, and the pipeline's [directory] is of kind {:?}",
                        d.flag.long,
                        d.kind,
                        have.kind
                    );
                }
                bail!(
                    "--{} given but the pipeline has no {} {}",
                    d.flag.long,
                    d.kind,
                    d.section.noun()
                );
            }
            for t in targets {
                t.insert(d.flag.setting.into(), g.value.clone());
            }
        }
        if let Some(n) = a.metaserver_queue_depth {
            match p.directory.as_mut() {
                Some(d) => d.queue_depth = n as usize,
                None => bail!(
                    "--metaserver-queue-depth sets the directory client's queue, and this pipeline has no directory: give --metaserver-addr or a [directory] table"
                ),
            }
        }
        if let Some(d) = &p.directory {
            d.validate()?;
        }
        if let (Some(flag), None) = (directory_flag, &p.peer) {
            notes.push(add_default_peer(&mut p, flag)?);
        }
        if let Some(h) = a.hint_value_size {
            if h == 0 {
                bail!("--hint-value-size must be > 0");
            }
        }
        if let Some(b) = a.python_registry {
            p.server.python_registry = b;
        }
        if a.enable_lfu_admission {
            if p.tiers.len() < 2 {
                bail!(
                    "--enable-lfu-admission filters writes to tiers below DRAM, and this pipeline has none: add a [[tier]] below the landing tier"
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
        p.server.validate()?;
        p.store.validate()?;
        validate_log_level(&p.server.log_level)?;
        Ok((p, notes))
    }

    /// What start-up should log about accepted flags that change nothing in this build (they
    /// ask for what it already does, or turn off what it does not do).
    pub fn notes(&self) -> Vec<String> {
        let a = &self.flags;
        let mut v = Vec::new();
        if a.blockwise_alloc {
            v.push(
                "--blockwise-alloc: host memory is already allocated (and freed) per block".into(),
            );
        }
        if let Some(h) = a.hint_value_size {
            v.push(format!("--hint-value-size {h}: the DRAM allocator uses 512-byte granules whatever the value size; the hint does not change it"));
        }
        v
    }
}

/// Adds the binary's default peer path ([`DefaultPeerPath`]) to a pipeline that `--{flag}` (a
/// directory flag) joined to a cluster with no `[peer]`, listening on the host of `--addr`
/// with port 0; returns the start-up note saying so.
///
/// # Errors
/// The binary names no default peer path, or its kind is not linked: the flag alone would
/// advertise blocks no peer can fetch from here.
fn add_default_peer(p: &mut PipelineConfig, flag: &str) -> anyhow::Result<String> {
    let Some(d) = inventory::iter::<DefaultPeerPath>().next() else {
        bail!(
            "--{flag} lists this node's blocks in the cluster's directory, and nothing would serve them to peers: this binary has no default peer path; give a cross-node transport's flag (--nics for RDMA) or a [peer] table (--list-plugins lists the kinds)"
        );
    };
    peer_service_factory(d.kind).with_context(|| {
        format!(
            "--{flag}: the default peer path {:?} is not linked into this binary",
            d.kind
        )
    })?;
    let host = p
        .server
        .addr
        .rsplit_once(':')
        .map_or(p.server.addr.as_str(), |(h, _)| h);
    let addr = format!("{host}:0");
    let mut settings = toml::Table::new();
    settings.insert(d.addr_setting.into(), toml::Value::String(addr.clone()));
    p.peer = Some(PluginConfig {
        kind: d.kind.into(),
        layers: Vec::new(),
        settings,
    });
    Ok(format!(
        "--{flag} without a peer path (--nics, --{}): peers fetch this node's blocks, and it theirs, over {} with its data port on {addr} (the host of --addr, any free port; peers learn it in the handshake); give --{} to choose it",
        d.addr_flag, d.kind, d.addr_flag
    ))
}

impl Flags {
    /// Flags for parts this build does not have: start-up fails naming the flag and what it
    /// needs, rather than ignoring them.
    fn check_unsupported(&self) -> anyhow::Result<()> {
        // A backend brings a flag by declaring it (`FactoryFlag`); these are PegaFlow's flags
        // of backends no in-tree crate provides yet.
        const OTLP: &str = "an OTLP exporter (scrape /metrics instead)";
        let unsupported = [
            (
                self.metrics_otel_endpoint.is_some(),
                "--metrics-otel-endpoint",
                OTLP,
            ),
            (
                self.metrics_period_secs.is_some(),
                "--metrics-period-secs",
                OTLP,
            ),
            (
                self.metric_hll_windows.is_some() || self.metric_hll_bucket_bits.is_some(),
                "--metric-hll-windows/--metric-hll-bucket-bits",
                "the HyperLogLog miss-cardinality metrics",
            ),
            (
                self.trace_sample_rate.is_some(),
                "--trace-sample-rate",
                "span tracing (fastrace)",
            ),
        ];
        match unsupported.iter().find(|(given, _, _)| *given) {
            Some((_, flag, part)) => {
                bail!("{flag} needs {part}; none is linked into this build of pegaflow-server")
            }
            None => Ok(()),
        }
    }
}
