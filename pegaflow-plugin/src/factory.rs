//! Factories and the registry: what a backend crate submits with `inventory` (one factory
//! per kind, with its settings' schema and the flags that override them), the context a
//! factory builds with, and the lookup that turns a pipeline's `kind` into a factory.
//!
//! Must never: name a backend, or build anything itself (a factory's `build` does, when the
//! runtime calls it).

use std::sync::Arc;

use crate::events::IndexEvents;
use crate::health::HealthBoard;
use crate::metrics::MetricsRegistry;
use crate::side_channel::SideChannel;
use crate::{
    DirectoryFactory, HostPool, LayerFactory, PeerServiceFactory, Registrar, Tier, Transport,
};

/// What a backend's factory gets besides its own settings.
#[derive(Clone, Default)]
pub struct RuntimeContext {
    /// The fd side channel, when configured.
    pub fd_channel: Option<Arc<dyn SideChannel>>,
    /// Device ordinals the operator asked for (`--devices`); `None` = all the driver reports.
    pub devices: Option<Vec<i32>>,
    /// Whether transports place pinned memory and copy threads by NUMA node
    /// (`[server] numa_affinity`; `--disable-numa-affinity` turns it off).
    pub numa_affinity: bool,
    /// Index events (sealed, evicted, demoted, promoted) of this server's tier stack: a
    /// directory client subscribes here when it is built.
    pub index_events: IndexEvents,
    /// The server's metric registry: a backend registers its own families in it (served on
    /// `/metrics`).
    pub metrics: MetricsRegistry,
    /// Component health shown on `/health?verbose=1` (an I/O engine chosen, a degraded
    /// directory).
    pub health: HealthBoard,
}

impl std::fmt::Debug for RuntimeContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeContext")
            .field(
                "fd_channel",
                &self.fd_channel.as_ref().map(|c| c.path().to_path_buf()),
            )
            .field("devices", &self.devices)
            .field("numa_affinity", &self.numa_affinity)
            .finish()
    }
}

/// Help for one setting of a backend or layer, for `--list-plugins`.
#[derive(Debug, Clone, Copy)]
pub struct PluginOption {
    /// Key in the pipeline table (a key of [`ConfigSchema::defaults`]).
    pub name: &'static str,
    /// What it does.
    pub help: &'static str,
}

/// A factory's settings as `--list-plugins` shows them: the defaults come from the backend's
/// serde config struct (its `Default`, serialised by [`defaults_of`]), so they cannot drift
/// from what the backend uses; `options` gives one help line per key.
#[derive(Debug, Clone, Copy)]
pub struct ConfigSchema {
    /// The default settings, as a pipeline table would hold them.
    pub defaults: fn() -> toml::Table,
    /// Checks the values of a pipeline table without building anything (no memory mapped,
    /// no file opened, no connection made): the types, the size strings and the ranges the
    /// backend refuses at build time. `--check-config` and start-up run it, after the keys
    /// were checked against `defaults` and `options`. The `&str` names the entry for messages
    /// (e.g. `"dram tier"`). [`check_parses`] suffices for a backend without range limits.
    pub check: SettingsCheck,
    /// Help per key of `defaults`, in listing order.
    pub options: &'static [PluginOption],
}

/// See [`ConfigSchema::check`].
pub type SettingsCheck = fn(&str, &toml::Table) -> anyhow::Result<()>;

/// A [`SettingsCheck`] that deserialises the table into `T` (as the backend's build does with
/// [`parse_settings`]) and drops it.
///
/// # Errors
/// As [`parse_settings`].
pub fn check_parses<T: serde::de::DeserializeOwned>(
    what: &str,
    table: &toml::Table,
) -> anyhow::Result<()> {
    parse_settings::<T>(what, table).map(drop)
}

/// The [`SettingsCheck`] of a factory without settings: the keys check refuses any key, so
/// nothing is left to check.
fn check_nothing(_what: &str, _table: &toml::Table) -> anyhow::Result<()> {
    Ok(())
}

impl ConfigSchema {
    /// A factory without settings: an empty table is its only valid one.
    pub const NONE: ConfigSchema = ConfigSchema {
        defaults: toml::Table::new,
        check: check_nothing,
        options: &[],
    };

    /// Problems with the documentation: a default key without help, help for a key that is
    /// not a setting, a key documented twice. Empty when the listing is complete; each entry
    /// names the key.
    pub fn doc_problems(&self) -> Vec<String> {
        let defaults = (self.defaults)();
        let mut v = Vec::new();
        for key in defaults.keys() {
            if !self.options.iter().any(|o| o.name == key) {
                v.push(format!("setting {key:?} has no help"));
            }
        }
        for (i, o) in self.options.iter().enumerate() {
            if !defaults.contains_key(o.name) {
                v.push(format!("help for {:?}, which is not a setting", o.name));
            }
            if self.options[..i].iter().any(|p| p.name == o.name) {
                v.push(format!("{:?} is documented twice", o.name));
            }
        }
        v
    }
}

/// `T::default()` serialised into a pipeline table: what [`ConfigSchema::defaults`] returns
/// for a backend whose config struct is `T`.
///
/// # Panics
/// When `T` does not serialise to a TOML table (a struct with named fields does; an
/// `Option` field must be skipped when `None`), which is a bug of the backend that the
/// documentation test of every linked factory catches.
pub fn defaults_of<T: Default + serde::Serialize>() -> toml::Table {
    match toml::Value::try_from(T::default()) {
        Ok(toml::Value::Table(t)) => t,
        Ok(other) => panic!(
            "{}::default() serialises to {other}, not a table",
            std::any::type_name::<T>()
        ),
        Err(e) => panic!(
            "{}::default() does not serialise to TOML: {e}",
            std::any::type_name::<T>()
        ),
    }
}

/// Deserialises a factory's pipeline table into its config struct `T` (which should be
/// `#[serde(deny_unknown_fields)]`, with defaults from `#[serde(default)]`). A `kind` key
/// (the entry's name, present when a whole pipeline entry is passed) is not a setting and is
/// skipped.
///
/// # Errors
/// The table does not fit `T`; the message starts with `what` (e.g. `"dram tier"`) and
/// names the bad key (for an unknown key, serde lists the valid ones), on one line, e.g.
/// "dram tier: invalid type: string \"two\", expected usize in \`shards\`".
pub fn parse_settings<T: serde::de::DeserializeOwned>(
    what: &str,
    table: &toml::Table,
) -> anyhow::Result<T> {
    let mut t = table.clone();
    t.remove("kind");
    T::deserialize(toml::Value::Table(t)).map_err(|e| {
        // toml names the key on a line of its own ("...\nin `shards`"): keep one line.
        let msg = e.to_string();
        let msg: Vec<&str> = msg
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        anyhow::anyhow!("{what}: {}", msg.join(" "))
    })
}

/// How a [`FactoryFlag`]'s value is read from the command line and stored in the setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagValue {
    /// A byte size (`30gb`, `512mib`, bytes; see [`crate::units::parse_size`]), stored as
    /// [`crate::units::size`] writes sizes.
    Size,
    /// An integer of at least `min`.
    Integer {
        /// Smallest accepted value.
        min: i64,
    },
    /// `true` or `false` (`--flag` alone means `true`).
    Bool,
    /// Any text, stored as a string.
    Text,
    /// Text, repeatable (`--flag a --flag b`, or `--flag a b`): the values are stored as an
    /// array of strings, in the order given.
    TextList,
}

impl FlagValue {
    /// Parses one command-line value into the TOML value stored in the setting.
    ///
    /// # Errors
    /// The text does not fit the kind (the message says what was expected).
    pub fn parse(self, text: &str) -> Result<toml::Value, String> {
        match self {
            FlagValue::Size => crate::units::parse_size(text)
                .map(crate::units::size::to_value)
                .map_err(|e| e.to_string()),
            FlagValue::Integer { min } => match text.trim().parse::<i64>() {
                Ok(v) if v >= min => Ok(toml::Value::Integer(v)),
                _ => Err(format!("must be an integer >= {min}")),
            },
            FlagValue::Bool => match text {
                "true" => Ok(toml::Value::Boolean(true)),
                "false" => Ok(toml::Value::Boolean(false)),
                _ => Err("must be true or false".into()),
            },
            FlagValue::Text | FlagValue::TextList => Ok(toml::Value::String(text.into())),
        }
    }
}

/// A command-line flag a factory declares: given, its value overrides one setting of the
/// factory's pipeline entry (for a tier, the first `[[tier]]` of the factory's kind; for a
/// transport or registrar, every entry of its kind; for a directory, the `[directory]` table
/// when it is of the factory's kind). The runtime adds every linked factory's
/// flags to the command line, so a backend brings its flags without editing the runtime.
#[derive(Debug, Clone, Copy)]
pub struct FactoryFlag {
    /// Long name without the dashes (`pool-size` for `--pool-size`); unique in the binary.
    pub long: &'static str,
    /// Placeholder of the value in `--help` (`SIZE`).
    pub value_name: &'static str,
    /// Help line for `--help`.
    pub help: &'static str,
    /// Key of the setting it overrides (a key of the factory's [`ConfigSchema::defaults`]).
    pub setting: &'static str,
    /// How the value is parsed.
    pub value: FlagValue,
    /// Given while the pipeline has no entry of the factory's kind, the flag adds one (a
    /// `[[tier]]` appended below the others, default settings) instead of failing: how
    /// `--ssd-cache-path` turns the SSD tier on. A directory flag with it adds the
    /// `[directory]` table when the pipeline has none. Transport and registrar flags ignore it.
    pub adds_entry: bool,
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
    /// Settings with defaults and help.
    pub config: ConfigSchema,
    /// Command-line flags overriding its settings.
    pub flags: &'static [FactoryFlag],
    /// Whether this is the tier a pipeline without `[[tier]]` entries lands on (with its
    /// default settings). At most one linked tier should say so.
    pub default_landing: bool,
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
    /// Settings with defaults and help.
    pub config: ConfigSchema,
    /// Command-line flags overriding its settings.
    pub flags: &'static [FactoryFlag],
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
    /// Settings with defaults and help.
    pub config: ConfigSchema,
    /// Command-line flags overriding its settings.
    pub flags: &'static [FactoryFlag],
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

/// The tier a pipeline without `[[tier]]` entries lands on: the one linked tier factory
/// that declares [`TierFactory::default_landing`].
///
/// # Errors
/// No linked tier declares it, or several do (the message lists them and the linked kinds).
pub fn default_landing_tier() -> anyhow::Result<&'static TierFactory> {
    let mut it = inventory::iter::<TierFactory>().filter(|f| f.default_landing);
    match (it.next(), it.next()) {
        (Some(f), None) => Ok(f),
        (None, _) => anyhow::bail!(
            "no tier linked into this binary is a default landing tier; add a [[tier]] of a landing kind (this binary knows: {})",
            known_tiers()
        ),
        (Some(_), Some(_)) => anyhow::bail!(
            "several linked tiers declare themselves the default landing tier ({}); name one with a [[tier]] entry",
            known(
                inventory::iter::<TierFactory>().filter(|f| f.default_landing),
                |f| f.kind
            )
        ),
    }
}

/// The pipeline section of a factory: where its entries live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// `[[tier]]`.
    Tier,
    /// `[[transport]]`.
    Transport,
    /// `[[registrar]]`.
    Registrar,
    /// `[directory]`.
    Directory,
    /// `[peer]`.
    Peer,
}

impl Section {
    /// The section's word in messages (`tier`, `transport`, `registrar`).
    pub fn noun(self) -> &'static str {
        match self {
            Section::Tier => "tier",
            Section::Transport => "transport",
            Section::Registrar => "registrar",
            Section::Directory => "directory",
            Section::Peer => "peer delegate",
        }
    }
}

/// A flag with the factory that declared it.
#[derive(Debug, Clone, Copy)]
pub struct DeclaredFlag {
    /// The declaring factory's section.
    pub section: Section,
    /// The declaring factory's kind.
    pub kind: &'static str,
    /// The flag.
    pub flag: &'static FactoryFlag,
}

/// Every flag the linked tier, transport, registrar and directory factories declare, in that
/// order.
pub fn declared_flags() -> Vec<DeclaredFlag> {
    let mut v = Vec::new();
    let mut add = |section, kind, flags: &'static [FactoryFlag]| {
        v.extend(flags.iter().map(|flag| DeclaredFlag {
            section,
            kind,
            flag,
        }));
    };
    for f in inventory::iter::<TierFactory>() {
        add(Section::Tier, f.kind, f.flags);
    }
    for f in inventory::iter::<TransportFactory>() {
        add(Section::Transport, f.kind, f.flags);
    }
    for f in inventory::iter::<RegistrarFactory>() {
        add(Section::Registrar, f.kind, f.flags);
    }
    for f in inventory::iter::<DirectoryFactory>() {
        add(Section::Directory, f.kind, f.flags);
    }
    for f in inventory::iter::<PeerServiceFactory>() {
        add(Section::Peer, f.kind, f.flags);
    }
    v
}

struct Row {
    name: &'static str,
    summary: &'static str,
    note: &'static str,
    config: ConfigSchema,
    flags: &'static [FactoryFlag],
}

fn rows() -> Vec<(&'static str, Vec<Row>)> {
    let row = |name, summary, config, flags| Row {
        name,
        summary,
        note: "",
        config,
        flags,
    };
    let mut sections = vec![
        (
            "tiers",
            inventory::iter::<TierFactory>()
                .map(|f| Row {
                    note: if f.default_landing {
                        " (the default landing tier)"
                    } else {
                        ""
                    },
                    ..row(f.kind, f.summary, f.config, f.flags)
                })
                .collect::<Vec<_>>(),
        ),
        (
            "transports",
            inventory::iter::<TransportFactory>()
                .map(|f| row(f.kind, f.summary, f.config, f.flags))
                .collect(),
        ),
        (
            "registrars",
            inventory::iter::<RegistrarFactory>()
                .map(|f| row(f.kind, f.summary, f.config, f.flags))
                .collect(),
        ),
        (
            "peer delegates ([peer] kind = ...: the server-to-server RPCs)",
            inventory::iter::<PeerServiceFactory>()
                .map(|f| row(f.kind, f.summary, f.config, f.flags))
                .collect(),
        ),
        (
            "directories ([directory] kind = ...: the cross-node block directory)",
            inventory::iter::<DirectoryFactory>()
                .map(|f| row(f.kind, f.summary, f.config, f.flags))
                .collect(),
        ),
        (
            "layers (layers = [...] on a [[tier]] or [[transport]] entry)",
            inventory::iter::<LayerFactory>()
                .map(|f| row(f.name, f.summary, f.config, &[]))
                .collect(),
        ),
    ];
    for (_, rows) in &mut sections {
        rows.sort_by_key(|r| r.name);
    }
    sections
}

/// Documentation problems of every linked factory and layer: a setting without help, help
/// or a flag for a key that is not a setting, a flag declared twice. Each entry names the
/// factory; empty when `--list-plugins` documents everything. Backend crates call it from a
/// test, so their listing cannot drift from their config structs.
pub fn doc_problems() -> Vec<String> {
    let mut v = Vec::new();
    for (section, rows) in rows() {
        for r in rows {
            let defaults = (r.config.defaults)();
            v.extend(
                r.config
                    .doc_problems()
                    .into_iter()
                    .map(|p| format!("{section} {:?}: {p}", r.name)),
            );
            for f in r.flags {
                if !defaults.contains_key(f.setting) {
                    v.push(format!(
                        "{section} {:?}: --{} sets {:?}, which is not a setting",
                        r.name, f.long, f.setting
                    ));
                }
            }
        }
    }
    let flags = declared_flags();
    for (i, a) in flags.iter().enumerate() {
        if let Some(b) = flags[..i].iter().find(|b| b.flag.long == a.flag.long) {
            v.push(format!(
                "--{} is declared by {} {:?} and {} {:?}",
                a.flag.long,
                b.section.noun(),
                b.kind,
                a.section.noun(),
                a.kind
            ));
        }
    }
    v
}

/// A human-readable listing of every linked plugin kind with its settings (`key = default
/// help`, the defaults rendered from the backend's config struct) and the flags it declares.
pub fn describe_plugins() -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for (title, rows) in rows() {
        let _ = writeln!(s, "{title}:");
        for r in rows {
            let _ = writeln!(s, "  {:<12} {}{}", r.name, r.summary, r.note);
            let mut defaults = (r.config.defaults)();
            for o in r.config.options {
                match defaults.remove(o.name) {
                    Some(d) => {
                        let _ = writeln!(s, "      {} = {d}    {}", o.name, o.help);
                    }
                    None => {
                        let _ = writeln!(s, "      {}    {}", o.name, o.help);
                    }
                }
            }
            for (k, d) in defaults {
                let _ = writeln!(s, "      {k} = {d}");
            }
            for f in r.flags {
                let _ = writeln!(
                    s,
                    "      --{} <{}> sets {}",
                    f.long, f.value_name, f.setting
                );
            }
        }
    }
    s
}
