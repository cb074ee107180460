//! Layers: cross-cutting behaviour (metrics, fault injection, admission) that wraps any tier
//! or transport, named per pipeline entry (`layers = ["metrics", "fault"]`) and registered
//! through `inventory` like backends.
//!
//! A layer wraps the backend it is given and returns a backend of the same trait; the first
//! name in the list is the innermost wrapper. Because the backend traits have no default
//! methods, a layer forwards every call explicitly.

use std::sync::Arc;

use crate::factory::ConfigSchema;
use crate::metrics::MetricsRegistry;
use crate::tier::Tier;
use crate::transport::Transport;

/// What a layer's constructor gets besides its settings and the backend it wraps.
#[derive(Clone)]
pub struct LayerContext {
    /// The server's metric registry (a layer that counts registers its families here).
    pub metrics: MetricsRegistry,
    /// The pipeline kind of the wrapped backend (for labels and messages).
    pub wrapped_kind: &'static str,
}

impl std::fmt::Debug for LayerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerContext")
            .field("wrapped_kind", &self.wrapped_kind)
            .finish()
    }
}

/// Wraps a tier: `(inner, settings, context)`.
pub type TierLayerBuild =
    fn(Arc<dyn Tier>, &toml::Table, &LayerContext) -> anyhow::Result<Arc<dyn Tier>>;
/// Wraps a transport: `(inner, settings, context)`.
pub type TransportLayerBuild =
    fn(Arc<dyn Transport>, &toml::Table, &LayerContext) -> anyhow::Result<Arc<dyn Transport>>;

/// A layer kind a linked crate provides. A layer wraps tiers, transports, or both.
#[derive(Debug)]
pub struct LayerFactory {
    /// Name used in `layers = [...]`.
    pub name: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
    /// Settings with defaults and help (given as `{ kind = "<name>", option = value }` in
    /// the list).
    pub config: ConfigSchema,
    /// Wraps a block tier, when the layer applies to tiers.
    pub wrap_tier: Option<TierLayerBuild>,
    /// Wraps a transport, when the layer applies to transports.
    pub wrap_transport: Option<TransportLayerBuild>,
}

inventory::collect!(LayerFactory);

/// Layer names linked into this binary, sorted, comma-separated.
pub fn known_layers() -> String {
    crate::factory::known(inventory::iter::<LayerFactory>(), |f| f.name)
}

/// The layer factory for `name`, or an error listing the layers this binary knows.
pub fn layer_factory(name: &str) -> anyhow::Result<&'static LayerFactory> {
    inventory::iter::<LayerFactory>()
        .find(|f| f.name == name)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown layer {name:?}; this binary knows: {}",
                known_layers()
            )
        })
}

/// One entry of a `layers = [...]` list: a name, or a table `{ kind = "name", ... }` with
/// the layer's settings.
pub fn parse_layer_entry(v: &toml::Value) -> anyhow::Result<(String, toml::Table)> {
    match v {
        toml::Value::String(s) => Ok((s.clone(), toml::Table::new())),
        toml::Value::Table(t) => {
            let mut t = t.clone();
            let kind = match t.remove("kind") {
                Some(toml::Value::String(s)) => s,
                _ => anyhow::bail!("a layer table needs kind = \"<layer name>\", got {v}"),
            };
            Ok((kind, t))
        }
        other => anyhow::bail!(
            "layers entries are names or {{ kind = \"name\", ... }} tables, got {other}"
        ),
    }
}

/// Wraps `tier` in the layers of `list` (innermost first).
///
/// # Errors
/// An unknown layer, a layer that does not apply to tiers, or a layer's own settings error.
pub fn wrap_tier(
    mut tier: Arc<dyn Tier>,
    list: &[toml::Value],
    metrics: &MetricsRegistry,
) -> anyhow::Result<Arc<dyn Tier>> {
    for v in list {
        let (name, settings) = parse_layer_entry(v)?;
        let f = layer_factory(&name)?;
        let Some(build) = f.wrap_tier else {
            anyhow::bail!("layer {name:?} does not apply to tiers");
        };
        let ctx = LayerContext {
            metrics: metrics.clone(),
            wrapped_kind: tier.kind(),
        };
        tier =
            build(tier, &settings, &ctx).map_err(|e| anyhow::anyhow!("layer {name:?}: {e:#}"))?;
    }
    Ok(tier)
}

/// Wraps `transport` in the layers of `list` (innermost first).
///
/// # Errors
/// As [`wrap_tier`], for transports.
pub fn wrap_transport(
    mut transport: Arc<dyn Transport>,
    list: &[toml::Value],
    metrics: &MetricsRegistry,
) -> anyhow::Result<Arc<dyn Transport>> {
    for v in list {
        let (name, settings) = parse_layer_entry(v)?;
        let f = layer_factory(&name)?;
        let Some(build) = f.wrap_transport else {
            anyhow::bail!("layer {name:?} does not apply to transports");
        };
        let ctx = LayerContext {
            metrics: metrics.clone(),
            wrapped_kind: transport.kind(),
        };
        transport = build(transport, &settings, &ctx)
            .map_err(|e| anyhow::anyhow!("layer {name:?}: {e:#}"))?;
    }
    Ok(transport)
}
