//! The plugin contract: the [`HostPool`], [`Tier`], [`Transport`] and [`Registrar`] traits,
//! the [`LayerFactory`] wrappers, the factories a backend crate submits with `inventory`, and
//! the lookup that turns a pipeline's `kind` into a built backend.
//!
//! The runtime never names a backend: it branches on what backends declare
//! ([`TierCapabilities`], [`Transport::can_address`] over open [`MemorySpace`]s,
//! [`Registrar::scheme`] and [`Registrar::traits`]). A backend crate registers itself with
//! `inventory::submit! { TierFactory { .. } }` (or the transport/registrar/layer equivalent)
//! and is linked into a server binary; nothing in this crate changes.

mod layer;
mod peer;
mod pool;
mod registrar;
mod tier;
mod transport;

use std::sync::Arc;

pub use layer::{
    known_layers, layer_factory, parse_layer_entry, wrap_tier, wrap_transport, LayerContext,
    LayerFactory, TierLayerBuild, TransportLayerBuild,
};
pub use peer::{
    known_peer_services, peer_service_factory, PeerService, PeerServiceBuild, PeerServiceFactory,
};
pub use pool::{HostPool, HostRegion};
pub use registrar::{
    ImportRequest, LayerRegion, NativeImport, NativeView, PayloadCarrier, PayloadScheme, Registrar,
    RegistrarError, RegistrarTraits, Registration, RegistrationPayload,
};
pub use tier::{Recovered, Tier, TierCapabilities, TierError, TierGet, TierPut};
pub use transport::{CopyBatch, CopyOp, Direction, MemorySpace, Transport, TransportError};

use crate::fd_channel::FdChannel;

/// What a backend's factory gets besides its own settings.
#[derive(Clone, Default)]
pub struct RuntimeContext {
    /// The fd side channel, when configured.
    pub fd_channel: Option<Arc<FdChannel>>,
    /// Device ordinals the operator asked for (`--devices`); `None` = all the driver reports.
    pub devices: Option<Vec<i32>>,
    /// Index events (sealed, evicted, demoted, promoted) of this server's tier stack: a
    /// directory client subscribes here when it is built.
    pub index_events: crate::store::IndexEvents,
}

impl std::fmt::Debug for RuntimeContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeContext")
            .field(
                "fd_channel",
                &self.fd_channel.as_ref().map(|c| c.path().to_path_buf()),
            )
            .field("devices", &self.devices)
            .finish()
    }
}

/// A documented option of a backend, for `--list-plugins`.
#[derive(Debug, Clone, Copy)]
pub struct PluginOption {
    /// Key in the pipeline table.
    pub name: &'static str,
    /// Default value, as TOML.
    pub default: &'static str,
    /// What it does.
    pub help: &'static str,
}

/// What a `[[tier]]` factory builds: the landing pool (host DRAM, the first entry) or a
/// key-addressed tier below it.
#[derive(Clone)]
pub enum BuiltTier {
    /// The landing tier's host pool.
    Landing(Arc<dyn HostPool>),
    /// A key-addressed tier below host DRAM.
    Block(Arc<dyn Tier>),
}

impl std::fmt::Debug for BuiltTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BuiltTier::Landing(p) => write!(f, "Landing({})", p.kind()),
            BuiltTier::Block(t) => write!(f, "Block({})", t.kind()),
        }
    }
}

/// Builds a tier from its pipeline table (the `[[tier]]` entry without `kind` and `layers`).
pub type TierBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<BuiltTier>;
/// Builds a transport from its pipeline table.
pub type TransportBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Transport>>;
/// Builds a registrar from its pipeline table.
pub type RegistrarBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Registrar>>;

/// A tier kind a linked backend provides.
#[derive(Debug)]
pub struct TierFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: TierBuild,
}

/// A transport kind a linked backend provides.
#[derive(Debug)]
pub struct TransportFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: TransportBuild,
}

/// A registrar kind a linked backend provides.
#[derive(Debug)]
pub struct RegistrarFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: RegistrarBuild,
}

inventory::collect!(TierFactory);
inventory::collect!(TransportFactory);
inventory::collect!(RegistrarFactory);

pub(crate) fn known<T>(it: impl Iterator<Item = T>, name: impl Fn(&T) -> &'static str) -> String {
    let mut v: Vec<&str> = it.map(|f| name(&f)).collect();
    v.sort_unstable();
    v.dedup();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// Tier kinds linked into this binary, sorted, comma-separated.
pub fn known_tiers() -> String {
    known(inventory::iter::<TierFactory>(), |f| f.kind)
}
/// Transport kinds linked into this binary.
pub fn known_transports() -> String {
    known(inventory::iter::<TransportFactory>(), |f| f.kind)
}
/// Registrar kinds linked into this binary.
pub fn known_registrars() -> String {
    known(inventory::iter::<RegistrarFactory>(), |f| f.kind)
}

/// The tier factory for `kind`, or an error listing the kinds this binary knows.
pub fn tier_factory(kind: &str) -> anyhow::Result<&'static TierFactory> {
    inventory::iter::<TierFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown tier kind {kind:?}; this binary knows: {}",
                known_tiers()
            )
        })
}

/// The transport factory for `kind`, or an error listing the kinds this binary knows.
pub fn transport_factory(kind: &str) -> anyhow::Result<&'static TransportFactory> {
    inventory::iter::<TransportFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown transport kind {kind:?}; this binary knows: {}",
                known_transports()
            )
        })
}

/// The registrar factory for `kind`, or an error listing the kinds this binary knows.
pub fn registrar_factory(kind: &str) -> anyhow::Result<&'static RegistrarFactory> {
    inventory::iter::<RegistrarFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown registrar kind {kind:?}; this binary knows: {}",
                known_registrars()
            )
        })
}

/// A human-readable listing of every linked plugin kind with its options and defaults.
pub fn describe_plugins() -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut section =
        |title: &str, rows: Vec<(&'static str, &'static str, &'static [PluginOption])>| {
            let _ = writeln!(s, "{title}:");
            let mut rows = rows;
            rows.sort_by_key(|r| r.0);
            for (kind, summary, opts) in rows {
                let _ = writeln!(s, "  {kind:<12} {summary}");
                for o in opts {
                    let _ = writeln!(s, "      {} = {}    {}", o.name, o.default, o.help);
                }
            }
        };
    section(
        "tiers",
        inventory::iter::<TierFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "transports",
        inventory::iter::<TransportFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "registrars",
        inventory::iter::<RegistrarFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "peer delegates ([peer] kind = ...: the server-to-server RPCs)",
        inventory::iter::<PeerServiceFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "layers (layers = [...] on a [[tier]] or [[transport]] entry)",
        inventory::iter::<LayerFactory>()
            .map(|f| (f.name, f.summary, f.options))
            .collect(),
    );
    s
}
