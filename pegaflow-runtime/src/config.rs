//! Configuration: the TOML pipeline (with an embedded default, so the server runs with no
//! file) and the command line, whose flags carry PegaFlow's names and defaults and override
//! the matching pipeline settings.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use serde::{Deserialize, Serialize};

use crate::plugin::{
    declared_flags, DeclaredFlag, FlagValue, RegistrarFactory, Section, TransportFactory,
};

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

/// Serde helpers for size settings of a backend's config struct:
/// `#[serde(with = "pegaflow_runtime::config::size")]` on a `u64` or `usize` field accepts a
/// size string (`"30gb"`, as [`parse_size`] reads it) or a byte count, and writes a whole
/// number of kb, mb, gb or tb as such a string (`"30gb"`), any other size as bytes.
pub mod size {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "tb"),
        (1 << 30, "gb"),
        (1 << 20, "mb"),
        (1 << 10, "kb"),
    ];

    /// `bytes` as its shortest exact unit string (`"30gb"`), or `None` when no unit divides it.
    fn with_unit(bytes: u64) -> Option<String> {
        UNITS
            .iter()
            .find(|(u, _)| bytes > 0 && bytes.is_multiple_of(*u))
            .map(|(u, name)| format!("{}{name}", bytes / u))
    }

    /// `bytes` as a pipeline value: a unit string when a unit divides it, else an integer
    /// (a string of digits beyond `i64::MAX`).
    pub fn to_value(bytes: u64) -> toml::Value {
        match (with_unit(bytes), i64::try_from(bytes)) {
            (Some(s), _) => toml::Value::String(s),
            (None, Ok(i)) => toml::Value::Integer(i),
            (None, Err(_)) => toml::Value::String(bytes.to_string()),
        }
    }

    /// Writes a size as [`to_value`] does.
    ///
    /// # Errors
    /// The serializer's own errors, or a value that does not fit `u64`.
    pub fn serialize<S: Serializer, T: Copy + TryInto<u64>>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let bytes: u64 = (*v)
            .try_into()
            .map_err(|_| serde::ser::Error::custom("size does not fit 64 bits"))?;
        match to_value(bytes) {
            toml::Value::Integer(i) => s.serialize_i64(i),
            other => s.serialize_str(other.as_str().unwrap_or_default()),
        }
    }

    /// Reads a size string or a byte count.
    ///
    /// # Errors
    /// Another type, a negative count, a string [`super::parse_size`] refuses, or a size
    /// that does not fit `T`.
    pub fn deserialize<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
        struct Size;
        impl Visitor<'_> for Size {
            type Value = u64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size like \"30gb\" or a byte count")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
                u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: negative")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
                Ok(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
                super::parse_size(v).map_err(E::custom)
            }
        }
        let bytes = d.deserialize_any(Size)?;
        T::try_from(bytes).map_err(|_| de::Error::custom(format!("size {bytes} is too large")))
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

    /// What `--check-config` prints: the backends that will run, in order, and the
    /// addresses.
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
        let _ = writeln!(o, "pipeline is valid");
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
    /// Check the pipeline (file + flags): addresses, every kind, layer and backend setting
    /// key; print the tiers, transports and registrars that will run, then exit (0 when valid,
    /// 2 when not). Binds no port and allocates no pool.
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
        let a = &self.flags;
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
        Ok(p)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::{
        check_parses, defaults_of, BuiltTier, ConfigSchema, FactoryFlag, PluginOption,
        RuntimeContext, TierFactory,
    };
    use clap::CommandFactory;

    /// The settings of the test landing tier below.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct TestPoolConfig {
        #[serde(with = "size")]
        capacity: u64,
        shards: usize,
    }

    impl Default for TestPoolConfig {
        fn default() -> Self {
            Self {
                capacity: 3 << 30,
                shards: 1,
            }
        }
    }

    fn never_built(_: &toml::Table, _: &RuntimeContext) -> anyhow::Result<BuiltTier> {
        bail!("the config tests build no tier")
    }

    // A landing tier declaring the flags the DRAM tier declares in pegaflow-server.
    inventory::submit! {
        TierFactory {
            kind: "test-pool",
            summary: "config tests: a landing tier that is never built",
            config: ConfigSchema {
                defaults: defaults_of::<TestPoolConfig>,
                check: check_parses::<TestPoolConfig>,
                options: &[
                    PluginOption { name: "capacity", help: "bytes" },
                    PluginOption { name: "shards", help: "sub-pools" },
                ],
            },
            flags: &[
                FactoryFlag {
                    long: "pool-size",
                    value_name: "SIZE",
                    help: "Test pool capacity",
                    setting: "capacity",
                    value: FlagValue::Size,
                    adds_entry: false,
                },
                FactoryFlag {
                    long: "pool-shards",
                    value_name: "N",
                    help: "Test pool shards",
                    setting: "shards",
                    value: FlagValue::Integer { min: 1 },
                    adds_entry: false,
                },
            ],
            default_landing: true,
            build: never_built,
        }
    }

    fn capacity(p: &PipelineConfig) -> u64 {
        #[derive(Deserialize)]
        struct Capacity {
            #[serde(with = "size")]
            capacity: u64,
        }
        let c: Capacity = toml::Value::Table(p.tiers[0].settings.clone())
            .try_into()
            .unwrap();
        c.capacity
    }

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
        assert_eq!(capacity(&p), 1 << 30);
        assert_eq!(p.fd_channel.unwrap().path, PathBuf::from("/tmp/x.sock"));
        let p = Cli::parse_from(["pegaflow-server", "--devices", "0, 2"])
            .pipeline()
            .unwrap();
        assert_eq!(p.server.devices, Some(vec![0, 2]));
        assert!(p.server.numa_affinity, "NUMA placement is on by default");
        let cli = Cli::parse_from(["pegaflow-server", "--disable-numa-affinity"]);
        assert!(!cli.pipeline().unwrap().server.numa_affinity);
        assert!(
            !cli.notes().iter().any(|n| n.contains("numa")),
            "the flag does something now: no 'nothing to disable' note"
        );
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
        assert_eq!(capacity(&p), 2 << 30);
    }

    #[test]
    fn unsupported_flags_fail_with_the_missing_part() {
        let e = Cli::parse_from(["pegaflow-server", "--ssd-cache-path", "/x"])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--ssd-cache-path needs an SSD tier")
                && e.contains("none is linked into this binary"),
            "{e}"
        );
        // A placeholder takes any number of values (`--use-hugepages` alone, repeated paths).
        let e = Cli::parse_from(["pegaflow-server", "--use-hugepages"])
            .pipeline()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--use-hugepages needs a landing tier"), "{e}");
        let p = Cli::parse_from(["pegaflow-server", "--max-prefetch-blocks", "64"])
            .pipeline()
            .unwrap();
        assert_eq!(p.store.max_promote_blocks, 64);
        assert!(Cli::try_parse_from(["pegaflow-server", "--max-prefetch-blocks", "0"]).is_err());
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
        assert!(
            e.contains("--nics needs") && e.contains("none is linked"),
            "{e}"
        );
    }

    #[test]
    fn size_settings_read_strings_and_bytes_and_write_units() {
        assert_eq!(size::to_value(30 << 30), toml::Value::String("30gb".into()));
        assert_eq!(
            size::to_value(3 << 19),
            toml::Value::String("1536kb".into())
        );
        assert_eq!(size::to_value(1000), toml::Value::Integer(1000));
        assert_eq!(size::to_value(0), toml::Value::Integer(0));
        let t = toml::Table::try_from(TestPoolConfig::default()).unwrap();
        assert_eq!(t["capacity"], toml::Value::String("3gb".into()));
        let parse = |text: &str| -> Result<TestPoolConfig, String> {
            toml::from_str(text).map_err(|e| e.to_string())
        };
        assert_eq!(parse("capacity = 4096").unwrap().capacity, 4096);
        assert_eq!(parse("capacity = \"1.5kb\"").unwrap().capacity, 1536);
        let e = parse("capacity = -1").unwrap_err();
        assert!(e.contains("negative"), "{e}");
        let e = parse("capacity = \"lots\"").unwrap_err();
        assert!(e.contains("invalid size"), "{e}");
        let e = parse("capacity = true").unwrap_err();
        assert!(e.contains("a size like"), "{e}");
    }

    #[test]
    fn flag_values_parse_into_settings() {
        use toml::Value;
        assert_eq!(
            FlagValue::Size.parse("64mb"),
            Ok(Value::String("64mb".into()))
        );
        assert_eq!(FlagValue::Size.parse("1000"), Ok(Value::Integer(1000)));
        assert!(FlagValue::Size.parse("big").is_err());
        assert_eq!(
            FlagValue::Integer { min: 2 }.parse("2"),
            Ok(Value::Integer(2))
        );
        assert!(FlagValue::Integer { min: 2 }.parse("1").is_err());
        assert_eq!(FlagValue::Bool.parse("false"), Ok(Value::Boolean(false)));
        assert!(FlagValue::Bool.parse("yes").is_err());
        assert_eq!(
            FlagValue::Text.parse("a b"),
            Ok(Value::String("a b".into()))
        );
    }

    #[test]
    fn a_pipeline_without_tiers_gets_the_default_landing_tier() {
        let p = PipelineConfig::from_toml("[server]\naddr = \"127.0.0.1:1\"\n").unwrap();
        assert_eq!(p.tiers.len(), 1);
        assert_eq!(p.tiers[0].kind, "test-pool");
        assert_eq!(p.tiers[0].settings, defaults_of::<TestPoolConfig>());
        let p = PipelineConfig::from_toml("[[tier]]\nkind = \"other\"\n").unwrap();
        assert_eq!(p.tiers.len(), 1, "named tiers are kept as they are");
        assert_eq!(p.tiers[0].kind, "other");
    }

    #[test]
    fn declared_flags_are_on_the_command_line_and_set_their_setting() {
        let help = Cli::command().render_long_help().to_string();
        assert!(
            help.contains("--pool-size <SIZE>") && help.contains("Test pool capacity"),
            "{help}"
        );
        assert!(help.contains("--pool-shards <N>"), "{help}");
        let p = Cli::parse_from([
            "pegaflow-server",
            "--pool-shards",
            "3",
            "--pool-size",
            "2gb",
        ])
        .pipeline()
        .unwrap();
        assert_eq!(p.tiers[0].settings["shards"], toml::Value::Integer(3));
        assert!(
            p.to_toml().contains("capacity = \"2gb\""),
            "{}",
            p.to_toml()
        );
        let e = Cli::try_parse_from(["pegaflow-server", "--pool-shards", "0"]).unwrap_err();
        assert!(e.to_string().contains("must be an integer >= 1"), "{e}");
        let e = Cli::try_parse_from(["pegaflow-server", "--pool-size", "lots"]).unwrap_err();
        assert!(e.to_string().contains("invalid size"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.toml");
        std::fs::write(&f, "[[tier]]\nkind = \"other\"\n").unwrap();
        let e = Cli::parse_from([
            "pegaflow-server",
            "--config",
            f.to_str().unwrap(),
            "--pool-size",
            "1gb",
        ])
        .pipeline()
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "--pool-size given but the pipeline has no test-pool tier"
        );
    }

    #[test]
    fn admin_allow_parses_matches_and_round_trips() {
        let ip = |s: &str| Some(s.parse::<std::net::IpAddr>().unwrap());
        let d = AdminAllow::default();
        assert_eq!(d.to_string(), "loopback");
        assert!(d.permits(ip("127.0.0.1")) && d.permits(ip("127.9.9.9")));
        assert!(d.permits(ip("::1")) && d.permits(ip("::ffff:127.0.0.1")));
        assert!(!d.permits(ip("10.0.0.1")) && !d.permits(None));
        let any = AdminAllow::parse("ANY").unwrap();
        assert_eq!(any, AdminAllow::any());
        assert!(any.permits(ip("8.8.8.8")) && any.permits(None));
        let l = AdminAllow::parse(" 10.0.0.0/8, loopback ,fd00::/8,192.168.1.7").unwrap();
        assert_eq!(l.to_string(), "10.0.0.0/8,loopback,fd00::/8,192.168.1.7/32");
        assert!(l.permits(ip("10.200.3.4")) && l.permits(ip("::ffff:10.1.1.1")));
        assert!(l.permits(ip("fd12::1")) && l.permits(ip("192.168.1.7")));
        assert!(l.permits(ip("127.0.0.1")));
        assert!(!l.permits(ip("11.0.0.1")) && !l.permits(ip("192.168.1.8")));
        assert!(!l.permits(ip("fe80::1")));
        let only = AdminAllow::parse("10.0.0.0/8").unwrap();
        assert!(
            !only.permits(ip("127.0.0.1")),
            "a list without loopback excludes it"
        );
        assert!(AdminAllow::parse("0.0.0.0/0")
            .unwrap()
            .permits(ip("1.2.3.4")));
        for bad in [
            "",
            " , ",
            "10.0.0.0/33",
            "::/129",
            "localhost",
            "10.0.0.0/x",
        ] {
            assert!(AdminAllow::parse(bad).is_err(), "{bad:?}");
        }
        // In a pipeline: a string or a list; printed back as it reads.
        let p =
            PipelineConfig::from_toml("[server]\nadmin_allow = [\"loopback\", \"10.0.0.0/8\"]\n")
                .unwrap();
        assert_eq!(
            p.server.admin_allow,
            AdminAllow::parse("loopback,10.0.0.0/8").unwrap()
        );
        assert!(
            p.to_toml()
                .contains("admin_allow = [\n    \"loopback\",\n    \"10.0.0.0/8\",\n]"),
            "{}",
            p.to_toml()
        );
        let d = PipelineConfig::embedded_default();
        assert!(
            d.to_toml().contains("admin_allow = \"loopback\""),
            "{}",
            d.to_toml()
        );
        assert_eq!(
            PipelineConfig::from_toml(&d.to_toml())
                .unwrap()
                .server
                .admin_allow,
            d.server.admin_allow
        );
        assert!(PipelineConfig::from_toml("[server]\nadmin_allow = \"10.0.0.0/40\"\n").is_err());
        // On the command line.
        let p = Cli::parse_from(["pegaflow-server", "--admin-allow", "any"])
            .pipeline()
            .unwrap();
        assert_eq!(p.server.admin_allow, AdminAllow::any());
        let e = Cli::try_parse_from(["pegaflow-server", "--admin-allow", "nobody"]).unwrap_err();
        assert!(e.to_string().contains("not `any`, `loopback`"), "{e}");
    }

    #[test]
    fn connection_caps() {
        assert_eq!(
            default_max_connections(Some(20_000), 100, 256),
            20_000 - 100 - 1024 - 256
        );
        assert_eq!(default_max_connections(Some(1 << 20), 100, 256), 65_536);
        assert_eq!(default_max_connections(None, 100, 256), 65_536);
        assert_eq!(
            default_max_connections(Some(1024), 30, 256),
            64,
            "the floor"
        );
        let p = Cli::parse_from(["pegaflow-server", "--max-connections", "100"])
            .pipeline()
            .unwrap();
        assert_eq!(p.server.max_connections, Some(100));
        assert_eq!(p.server.max_http_connections, 256);
        assert_eq!(
            Cli::parse_from(["pegaflow-server"])
                .pipeline()
                .unwrap()
                .server
                .max_connections,
            None
        );
        assert!(Cli::try_parse_from(["pegaflow-server", "--max-connections", "0"]).is_err());
        let p = PipelineConfig::from_toml("[server]\nmax_connections = 0\n").unwrap();
        assert!(p.server.validate().is_err());
        let p = PipelineConfig::from_toml("[server]\nmax_http_connections = 0\n").unwrap();
        assert!(p.server.validate().is_err());
    }

    #[test]
    fn unknown_pipeline_keys_are_rejected() {
        assert!(PipelineConfig::from_toml("[server]\nadr = \"x\"\n").is_err());
    }
}
