//! Configuration: the TOML pipeline (with an embedded default, so the server runs with no
//! file) and the command line, whose flags carry PegaFlow's names and defaults and override
//! the matching pipeline settings.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::plugin::{RegistrarFactory, TransportFactory};

mod cli;
mod preflight;
#[cfg(test)]
mod tests;

pub use cli::{Cli, Flags, GivenFlag, MIN_BARE_SIZE};

/// The pipeline the server runs when no `--config` is given. Tiers, registrars and
/// transports are omitted: the tier is the linked default landing tier with its default
/// settings ([`crate::plugin::TierFactory::default_landing`], filled in by
/// [`PipelineConfig::from_toml`]), the registrars and transports are every kind linked into
/// this binary, with default settings.
pub const DEFAULT_PIPELINE: &str = r#"
[server]
addr = "127.0.0.1:50055"
http_addr = "0.0.0.0:9091"
log_level = "info"
enable_prometheus = false

[engine]
lease_ttl_secs = 600
"#;

pub use pegaflow_plugin::units::{parse_size, size};

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
    /// Whether `/metrics` is served. Off by default, as PegaFlow's `--enable-prometheus`
    /// switch is; `/health` and the admin routes are served either way.
    #[serde(default)]
    pub enable_prometheus: bool,
    /// Whether Python (pickled CUDA IPC) registrations are accepted (`--python-registry`);
    /// false leaves only native registrars.
    #[serde(default = "default_true")]
    pub python_registry: bool,
    /// CUDA device ordinals to serve; absent = every device the driver reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<i32>>,
    /// gRPC connections open at once (`--max-connections`); one more is accepted and closed
    /// at once. Absent = derived at start-up from the open-file limit
    /// ([`default_max_connections`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// HTTP connections open at once; one more is accepted and closed at once. Kept apart
    /// from the gRPC connections, so `/health` answers while the gRPC port is flooded.
    #[serde(default = "default_max_http_connections")]
    pub max_http_connections: usize,
    /// Peers that may call the Shutdown RPC, `POST /instances/cleanup` and
    /// `POST /cache/memory/cleanup` (`--admin-allow`): `"loopback"`, `"any"`, or CIDRs.
    #[serde(default)]
    pub admin_allow: AdminAllow,
    /// Place pinned host memory and copy threads on the NUMA node of the GPUs a transport
    /// serves (docs/OPERATIONS.md §NUMA). `--disable-numa-affinity` sets it false. On a
    /// machine with one node it changes nothing.
    #[serde(default = "default_true")]
    pub numa_affinity: bool,
    /// Send a Save's response headers as soon as its copy nears its end (a transport's
    /// [`crate::plugin::signal_near_end`]: the `cuda` transport under `wait = "tail"`, from
    /// the batch's last ~16 MiB, ~0.3 ms, or one staging chunk more), and its
    /// answer when the copy ends, so that the client's threads, asleep through the copy, are
    /// awake by then. Default true; false sends the headers with the answer. On the H200
    /// machine the published client saw its answer ~150 µs sooner after a 10 ms Save
    /// (docs/benchmarks/log/cuda.md §13). A Save that fails after its headers carries its error in the
    /// trailers, as any gRPC status after a response's headers.
    #[serde(default = "default_true")]
    pub save_headers_early: bool,
    /// Answer a Save as soon as its transport has read all of its device memory (a
    /// transport's [`crate::plugin::SourceRead`]: the `cuda` transport's staged path, once the
    /// last gather kernel has copied the blocks into its device staging buffers), while the
    /// bytes still travel to host memory; the Save then ends in its own task (copy, seal).
    /// The client may reuse its device memory from the answer on, as after a Save answered
    /// at its copy's end; the blocks become queryable when sealed, as before (a Save's OK
    /// never meant queryable). A copy that fails after the answer stores none of its blocks
    /// and is logged and counted in `pegaflow_save_late_failures_total`. A Flush still waits
    /// for such Saves. Default true; false answers at the copy's end (PegaFlow's order).
    /// Saves with a deadline (`grpc-timeout`) are answered at the end.
    #[serde(default = "default_true")]
    pub save_answer_early: bool,
}

/// Descriptors [`default_max_connections`] leaves for everything but gRPC connections, on top
/// of the HTTP connections and the side channel's: files, sockets and pipes of the tiers,
/// transports and the directory client.
pub const FD_RESERVE: u64 = 1024;

/// The gRPC connection cap when `max_connections` is not set: the open-file limit, less the
/// descriptors open at start-up, less [`FD_RESERVE`] and `other_fds` (the HTTP connections and
/// the side channel's connections and pending descriptors), between 64 and 65,536. An
/// unlimited limit (`None`) gives 65,536.
pub fn default_max_connections(nofile: Option<u64>, open_fds: u64, other_fds: u64) -> usize {
    const FLOOR: u64 = 64;
    const CEILING: u64 = 65_536;
    let v = nofile.map_or(CEILING, |n| {
        n.saturating_sub(open_fds + FD_RESERVE + other_fds)
    });
    v.clamp(FLOOR, CEILING) as usize
}

fn default_max_http_connections() -> usize {
    256
}

/// Who may call the destructive admin operations (the Shutdown RPC, `POST /instances/cleanup`,
/// `POST /cache/memory/cleanup`): every peer (`any`), loopback peers (`loopback`, the
/// default), peers in listed networks (`10.0.0.0/8`, `fd00::/8`, a bare address), or a mix
/// (`loopback,10.1.0.0/16`). Written in a pipeline as one string (entries separated by
/// commas) or a list of strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "AdminAllowText", into = "AdminAllowText")]
pub struct AdminAllow {
    entries: Vec<AdminPeers>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdminPeers {
    Any,
    Loopback,
    Net(std::net::IpAddr, u8),
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum AdminAllowText {
    One(String),
    Many(Vec<String>),
}

impl TryFrom<AdminAllowText> for AdminAllow {
    type Error = String;
    fn try_from(t: AdminAllowText) -> Result<Self, String> {
        let text = match t {
            AdminAllowText::One(s) => s,
            AdminAllowText::Many(v) => v.join(","),
        };
        Self::parse(&text).map_err(|e| e.to_string())
    }
}

impl From<AdminAllow> for AdminAllowText {
    fn from(a: AdminAllow) -> Self {
        match a.entries.as_slice() {
            [one] => Self::One(one.to_string()),
            many => Self::Many(many.iter().map(|e| e.to_string()).collect()),
        }
    }
}

impl AdminPeers {
    fn parse(e: &str) -> anyhow::Result<Self> {
        match e.to_ascii_lowercase().as_str() {
            "any" => return Ok(Self::Any),
            "loopback" => return Ok(Self::Loopback),
            _ => {}
        }
        let (ip, len) = match e.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (e, None),
        };
        let ip: std::net::IpAddr = ip.parse().with_context(|| {
            format!("admin_allow: {e:?} is not `any`, `loopback`, an address or ADDR/LEN")
        })?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => match l.parse::<u8>() {
                Ok(l) if l <= max => l,
                _ => bail!("admin_allow: {e:?}: the prefix length must be 0..={max}"),
            },
        };
        Ok(Self::Net(ip, len))
    }
}

impl std::fmt::Display for AdminPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Any => f.write_str("any"),
            Self::Loopback => f.write_str("loopback"),
            Self::Net(ip, len) => write!(f, "{ip}/{len}"),
        }
    }
}

impl std::fmt::Display for AdminAllow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl Default for AdminAllow {
    fn default() -> Self {
        Self {
            entries: vec![AdminPeers::Loopback],
        }
    }
}

impl AdminAllow {
    /// Every peer.
    pub fn any() -> Self {
        Self {
            entries: vec![AdminPeers::Any],
        }
    }

    /// Parses comma-separated entries: `any`, `loopback`, `ADDR/LEN` or a bare address.
    ///
    /// # Errors
    /// No entry, or an entry that is none of these (a prefix longer than the address).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let entries = text
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(AdminPeers::parse)
            .collect::<anyhow::Result<Vec<_>>>()?;
        if entries.is_empty() {
            bail!("admin_allow is empty: give `loopback` (the default), `any`, or CIDRs");
        }
        Ok(Self { entries })
    }

    /// Whether `peer` may call the admin operations; an unknown peer only under `any`.
    pub fn permits(&self, peer: Option<std::net::IpAddr>) -> bool {
        use std::net::IpAddr;
        let peer = peer.map(|p| p.to_canonical());
        self.entries.iter().any(|e| match (e, peer) {
            (AdminPeers::Any, _) => true,
            (_, None) => false,
            (AdminPeers::Loopback, Some(p)) => p.is_loopback(),
            (AdminPeers::Net(IpAddr::V4(net), len), Some(IpAddr::V4(p))) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
                u32::from(*net) & mask == u32::from(p) & mask
            }
            (AdminPeers::Net(IpAddr::V6(net), len), Some(IpAddr::V6(p))) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(*len)).unwrap_or(0);
                u128::from(*net) & mask == u128::from(p) & mask
            }
            (AdminPeers::Net(..), Some(_)) => false,
        })
    }
}

impl ServerConfig {
    /// Checks the connection caps.
    ///
    /// # Errors
    /// A cap of 0.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.max_connections == Some(0) {
            bail!("[server] max_connections (--max-connections) must be at least 1");
        }
        if self.max_http_connections == 0 {
            bail!("[server] max_http_connections must be at least 1");
        }
        Ok(())
    }
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
            enable_prometheus: false,
            python_registry: true,
            devices: None,
            max_connections: None,
            max_http_connections: default_max_http_connections(),
            admin_allow: AdminAllow::default(),
            numa_affinity: true,
            save_headers_early: true,
            save_answer_early: true,
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
    /// `[directory]`: the cross-node block directory; absent = this node shares nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub directory: Option<crate::cluster::DirectoryConfig>,
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
    /// Parses a pipeline from TOML text. Without a `[[tier]]`, the pipeline gets the linked
    /// default landing tier with its default settings (when exactly one linked tier declares
    /// itself so; otherwise the tiers stay empty and building the pipeline says why).
    ///
    /// # Errors
    /// Invalid TOML or an unknown key (outside the backends' own tables).
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        let mut c: Self = toml::from_str(text).context("invalid pipeline TOML")?;
        if c.tiers.is_empty() {
            if let Ok(f) = crate::plugin::default_landing_tier() {
                c.tiers.push(PluginConfig {
                    kind: f.kind.into(),
                    layers: Vec::new(),
                    settings: (f.config.defaults)(),
                });
            }
        }
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

    /// The gRPC address: a literal `IP:port`, or a `host:port` resolved to its first
    /// address (logged).
    pub fn grpc_addr(&self) -> anyhow::Result<SocketAddr> {
        resolve_addr("addr", &self.server.addr)
    }

    /// The HTTP address, as [`Self::grpc_addr`].
    pub fn http_addr(&self) -> anyhow::Result<SocketAddr> {
        resolve_addr("http_addr", &self.server.http_addr)
    }

    /// Checks what start-up would refuse without binding a port or building a backend: the
    /// addresses (resolved), every kind and layer name, and every key of every backend's
    /// table against the keys its factory knows (its defaults and documented options), then
    /// the values through each factory's [`crate::plugin::ConfigSchema::check`] (types, sizes,
    /// ranges; nothing is opened or connected).
    ///
    /// # Errors
    /// The first problem found, naming the entry and the key.
    pub fn check(&self) -> anyhow::Result<()> {
        use crate::plugin::{
            directory_factory, layer_factory, parse_layer_entry, peer_service_factory,
            registrar_factory, tier_factory, transport_factory,
        };
        self.server.validate()?;
        self.store.validate()?;
        validate_log_level(&self.server.log_level)?;
        self.grpc_addr()?;
        self.http_addr()?;
        if self.tiers.is_empty() {
            bail!(
                "the pipeline has no tier; add a [[tier]] of a landing kind (this binary knows: {})",
                crate::plugin::known_tiers()
            );
        }
        let check_layers = |what: &str, layers: &[toml::Value]| -> anyhow::Result<()> {
            for l in layers {
                let (name, settings) = parse_layer_entry(l).with_context(|| what.to_string())?;
                let f = layer_factory(&name).with_context(|| what.to_string())?;
                check_keys(&format!("{what}: layer {name:?}"), &f.config, &settings)?;
            }
            Ok(())
        };
        for t in &self.tiers {
            let f = tier_factory(&t.kind)?;
            let what = format!("{} tier", t.kind);
            check_keys(&what, &f.config, &t.settings)?;
            check_layers(&what, &t.layers)?;
        }
        for t in self.transports.iter().flatten() {
            let f = transport_factory(&t.kind)?;
            let what = format!("{} transport", t.kind);
            check_keys(&what, &f.config, &t.settings)?;
            check_layers(&what, &t.layers)?;
        }
        for r in self.registrars.iter().flatten() {
            let f = registrar_factory(&r.kind)?;
            check_keys(&format!("{} registrar", r.kind), &f.config, &r.settings)?;
        }
        if let Some(d) = &self.directory {
            let f = directory_factory(&d.kind)?;
            check_keys(&format!("{} directory", d.kind), &f.config, &d.settings)?;
            d.validate()?;
        }
        if let Some(p) = &self.peer {
            let f = peer_service_factory(&p.kind)?;
            check_keys(&format!("{} peer delegate", p.kind), &f.config, &p.settings)?;
        }
        Ok(())
    }

    /// What will run, as `--check-config` prints it below its headline
    /// ([`Self::render_check`]): the addresses and the backends, in order.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let entry = |e: &PluginConfig| {
            let mut s = e.kind.clone();
            if !e.layers.is_empty() {
                let names: Vec<String> = e
                    .layers
                    .iter()
                    .map(|l| {
                        crate::plugin::parse_layer_entry(l).map_or_else(|_| "?".into(), |(n, _)| n)
                    })
                    .collect();
                let _ = write!(s, " (layers: {})", names.join(", "));
            }
            s
        };
        let list = |l: &Option<Vec<PluginConfig>>, linked: Vec<&str>| match l {
            Some(l) if l.is_empty() => "none".to_string(),
            Some(l) => l.iter().map(entry).collect::<Vec<_>>().join(", "),
            None => format!("{} (every linked kind)", linked.join(", ")),
        };
        let mut o = String::new();
        let _ = writeln!(o, "  grpc addr:   {}", self.server.addr);
        let _ = writeln!(o, "  http addr:   {}", self.server.http_addr);
        let _ = writeln!(o, "  log level:   {}", self.server.log_level);
        let _ = writeln!(
            o,
            "  tiers:       {}",
            self.tiers
                .iter()
                .map(entry)
                .collect::<Vec<_>>()
                .join(" -> ")
        );
        let _ = writeln!(
            o,
            "  transports:  {}",
            list(
                &self.transports,
                inventory::iter::<TransportFactory>()
                    .map(|f| f.kind)
                    .collect()
            )
        );
        let _ = writeln!(
            o,
            "  registrars:  {}{}",
            list(
                &self.registrars,
                inventory::iter::<RegistrarFactory>()
                    .map(|f| f.kind)
                    .collect()
            ),
            if self.server.python_registry {
                ""
            } else {
                " (python_registry = false: those of Python registrations are left out)"
            }
        );
        let _ = writeln!(
            o,
            "  fd channel:  {}",
            self.fd_channel
                .as_ref()
                .map_or_else(|| "off".into(), |c| c.path.display().to_string())
        );
        let _ = writeln!(
            o,
            "  directory:   {}",
            self.directory.as_ref().map_or("none", |d| d.kind.as_str())
        );
        let _ = writeln!(
            o,
            "  peer:        {}",
            self.peer.as_ref().map_or("none", |p| p.kind.as_str())
        );
        o
    }
}

/// Refuses a key of `table` (a backend's settings) that the backend's [`ConfigSchema`]
/// neither defaults nor documents, listing the valid keys; then runs the backend's
/// [`ConfigSchema::check`] on the values.
fn check_keys(
    what: &str,
    schema: &crate::plugin::ConfigSchema,
    table: &toml::Table,
) -> anyhow::Result<()> {
    let defaults = (schema.defaults)();
    let known = |k: &str| defaults.contains_key(k) || schema.options.iter().any(|o| o.name == k);
    if let Some(k) = table.keys().find(|k| k.as_str() != "kind" && !known(k)) {
        let mut valid: Vec<&str> = defaults.keys().map(String::as_str).collect();
        for o in schema.options {
            if !valid.contains(&o.name) {
                valid.push(o.name);
            }
        }
        if valid.is_empty() {
            bail!("{what}: unknown setting `{k}`: it takes no settings");
        }
        bail!(
            "{what}: unknown setting `{k}`, expected one of: {}",
            valid.join(", ")
        );
    }
    (schema.check)(what, table)
}

/// `text` as a socket address: a literal `IP:port`, or a `host:port` resolved with the
/// system resolver, taking the first address (logged at INFO).
///
/// # Errors
/// No port, or a host name that does not resolve.
pub fn resolve_addr(what: &str, text: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    if text
        .rsplit_once(':')
        .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        bail!("invalid {what} {text:?}: expected host:port (an IP address or a host name, and a port)");
    }
    let all: Vec<SocketAddr> = text
        .to_socket_addrs()
        .with_context(|| format!("invalid {what} {text:?}: cannot resolve the host name"))?
        .collect();
    // IPv4 first: `localhost` often resolves to ::1 before 127.0.0.1, and clients configured
    // with 127.0.0.1 would then find nothing listening.
    let first = all
        .iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .with_context(|| format!("invalid {what} {text:?}: the host name has no address"))?;
    tracing::info!("{what} {text} resolves to {first}; using it");
    Ok(first)
}

/// The log levels `--log-level` accepts on their own (any case).
pub const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// Checks a `--log-level` / `log_level` value: a level of [`LOG_LEVELS`] (any case), or a
/// tracing filter of comma-separated directives, each a level or `TARGET=LEVEL`
/// (`pegaflow_runtime=debug,info`). A bare word that is no level (`verbose`), which the
/// tracing filter would read as a target name, and so log nothing, is refused.
///
/// # Errors
/// A directive that is neither, with the accepted forms.
pub fn validate_log_level(text: &str) -> anyhow::Result<()> {
    let is_level = |l: &str| LOG_LEVELS.iter().any(|v| v.eq_ignore_ascii_case(l.trim()));
    let bad = |why: String| {
        anyhow::anyhow!(
            "invalid log level {text:?}: {why}; accepted: error, warn, info, debug, trace, off (any case), or a tracing filter directive like `pegaflow_runtime=debug,info`"
        )
    };
    if text.trim().is_empty() {
        return Err(bad("it is empty".into()));
    }
    for d in text.split(',') {
        let d = d.trim();
        if d.is_empty() {
            return Err(bad("an empty directive".into()));
        }
        match d.rsplit_once('=') {
            None if is_level(d) => {}
            None => return Err(bad(format!("{d:?} is not a level"))),
            Some((target, level)) => {
                if target.trim().is_empty() || !is_level(level) {
                    return Err(bad(format!(
                        "directive {d:?} must be TARGET=LEVEL with a level of error, warn, info, debug, trace or off"
                    )));
                }
            }
        }
    }
    tracing_subscriber::EnvFilter::try_new(text).map_err(|e| bad(e.to_string()))?;
    Ok(())
}
