//! `pegaflow-transport-rdma`: cross-node block fetch by one-sided RDMA READ.
//!
//! Two pipeline kinds share everything but the NIC backend:
//! - `[peer] kind = "rdma"` (cargo feature `ibverbs`, the server's `rdma`, in its default
//!   build): real NICs through libibverbs, opened at run time ([`ibverbs`]). NICs named
//!   (`--nics`, PegaFlow's flag) that cannot be opened, for want of the library or the
//!   device, fail start-up naming what is missing, as a bad NIC fails PegaFlow's; with none
//!   named (every device) a machine without RDMA serves locally and reports RDMA
//!   unavailable (log and `/health`). Never a panic. `--qps-per-peer` is its other flag.
//! - `[peer] kind = "rdma-emu"` (always built): the same protocol through the in-tree
//!   emulator ([`emu`]): what CI runs, with injectable faults.
//!
//! The holder side is the tcp crate's: QueryBlocksForTransfer locks blocks in its lease
//! table ([`pegaflow_transport_tcp::locks`]), ReleaseTransferLock releases them; the
//! handshake pairs NICs and connects queue pairs ([`path::Engine::answer`]). The requester
//! side is the tcp crate's fetcher over this crate's data path ([`path::Engine`]), which
//! also does the handshake; because the holder's CPU sees none of the reads, the fetcher
//! keeps a pull's bytes only once the holder has confirmed that the lock outlived it.
//!
//! Must never: free a fetch buffer while a READ may still write into it (see [`path`]),
//! or let a peer make this node read outside the ranges its answer locked and its NIC
//! registered.

pub mod codec;
pub mod emu;
#[cfg(feature = "ibverbs")]
pub mod ibverbs;
pub mod path;
pub mod verbs;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::BlockHost;
use pegaflow_plugin::{
    parse_settings, ConfigSchema, PeerDataPath, PeerFetcher, PeerService, PeerServiceFactory,
    PluginOption, RuntimeContext,
};
use pegaflow_proto as pb;
use pegaflow_transport_tcp::fetch::{FetchLimits, Fetcher};
use pegaflow_transport_tcp::locks::Locks;
use pegaflow_transport_tcp::metrics::PeerMetrics;
use serde::{Deserialize, Serialize};

use crate::path::{Engine, PathLimits, RdmaMetrics};
use crate::verbs::Nic;

/// The `[peer] kind = "rdma"` table; `kind = "rdma-emu"` takes the same keys plus an
/// `emu` table ([`emu::EmuSettings`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RdmaPeerConfig {
    /// NICs to use, by device name (`--nics`; an entry may hold several, separated by commas
    /// or spaces); empty: every device (the emulator: one, `emu0`). Counts may differ between
    /// nodes. Named NICs that cannot be opened fail start-up (`rdma`).
    #[serde(default)]
    pub nics: Vec<String>,
    /// Reliable-connected queue pairs per local NIC per peer (`--qps-per-peer`).
    #[serde(default = "default_qps")]
    pub qps_per_peer: usize,
    /// Whether this node fetches (needs a `[directory]`). False: it only serves.
    #[serde(default = "pegaflow_transport_tcp::default_true")]
    pub fetch: bool,
    /// A transfer lock's lease in milliseconds. One-sided reads do not renew it, so it
    /// should exceed the requesters' `fetch_timeout_ms`.
    #[serde(default = "default_lease_ms")]
    pub lock_lease_ms: u64,
    /// The longest a transfer lock lives, in seconds.
    #[serde(default = "pegaflow_transport_tcp::default_lock_cap")]
    pub transfer_lock_timeout_secs: u64,
    /// Blocks locked for peers at once, at most.
    #[serde(default = "pegaflow_transport_tcp::default_max_locked")]
    pub max_locked_blocks: usize,
    /// Requester connections held at once (one per requester), at most.
    #[serde(default = "pegaflow_transport_tcp::default_max_conns")]
    pub max_connections: usize,
    /// Longest fetch (handshake, lock, pull, release), in milliseconds.
    #[serde(default = "pegaflow_transport_tcp::default_fetch_timeout_ms")]
    pub fetch_timeout_ms: u64,
    /// Longest wait for a gRPC connection to a peer, in milliseconds.
    #[serde(default = "pegaflow_transport_tcp::default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long a failed peer is skipped, in seconds.
    #[serde(default = "pegaflow_transport_tcp::default_suspect_secs")]
    pub suspect_secs: u64,
    /// How long a peer that denied holding an advertised block is not asked for that run.
    #[serde(default = "pegaflow_transport_tcp::default_stale_secs")]
    pub stale_secs: u64,
    /// Bytes one fetch reads at most.
    #[serde(default = "pegaflow_transport_tcp::default_max_fetch_bytes")]
    pub max_fetch_bytes: u64,
    /// NUMA node reported for this pool's slots (-1 = unknown).
    #[serde(default = "pegaflow_transport_tcp::default_numa")]
    pub numa_node: i32,
    /// Bytes one READ work request moves at most.
    #[serde(default = "default_max_wr_bytes")]
    pub max_wr_bytes: u64,
    /// Every how many READs of a queue pair one is signalled (the last always is).
    #[serde(default = "default_signal_every")]
    pub signal_every: usize,
    /// GID table index for RoCEv2 ports (`rdma` only; InfiniBand ports use the LID).
    #[serde(default = "default_gid_index")]
    pub gid_index: u32,
}

fn default_qps() -> usize {
    2
}
fn default_lease_ms() -> u64 {
    10_000
}
fn default_max_wr_bytes() -> u64 {
    1 << 20
}
fn default_signal_every() -> usize {
    16
}
fn default_gid_index() -> u32 {
    3
}

impl Default for RdmaPeerConfig {
    fn default() -> Self {
        Self {
            nics: Vec::new(),
            qps_per_peer: default_qps(),
            fetch: true,
            lock_lease_ms: default_lease_ms(),
            transfer_lock_timeout_secs: pegaflow_transport_tcp::default_lock_cap(),
            max_locked_blocks: pegaflow_transport_tcp::default_max_locked(),
            max_connections: pegaflow_transport_tcp::default_max_conns(),
            fetch_timeout_ms: pegaflow_transport_tcp::default_fetch_timeout_ms(),
            connect_timeout_ms: pegaflow_transport_tcp::default_connect_timeout_ms(),
            suspect_secs: pegaflow_transport_tcp::default_suspect_secs(),
            stale_secs: pegaflow_transport_tcp::default_stale_secs(),
            max_fetch_bytes: pegaflow_transport_tcp::default_max_fetch_bytes(),
            numa_node: pegaflow_transport_tcp::default_numa(),
            max_wr_bytes: default_max_wr_bytes(),
            signal_every: default_signal_every(),
            gid_index: default_gid_index(),
        }
    }
}

impl RdmaPeerConfig {
    /// Refuses values out of range (`what` names the entry).
    ///
    /// # Errors
    /// `qps_per_peer` outside 1..=64, more than 16 NICs, `max_wr_bytes` outside
    /// 4 KiB..=1 GiB, `signal_every` outside 1..=1024, a zero lease, cap or timeout.
    pub fn check(&self, what: &str) -> anyhow::Result<()> {
        if self.qps_per_peer == 0 || self.qps_per_peer > 64 {
            anyhow::bail!("{what}: qps_per_peer must be 1..=64");
        }
        let names = self
            .nic_names()
            .map_err(|e| anyhow::anyhow!("{what}: nics (--nics): {e}"))?;
        if names.len() > codec::MAX_NICS {
            anyhow::bail!("{what}: at most {} NICs", codec::MAX_NICS);
        }
        if !(4096..=1 << 30).contains(&self.max_wr_bytes) {
            anyhow::bail!("{what}: max_wr_bytes must be 4096..=1073741824");
        }
        if self.signal_every == 0 || self.signal_every > 1024 {
            anyhow::bail!("{what}: signal_every must be 1..=1024");
        }
        if self.transfer_lock_timeout_secs == 0
            || self.lock_lease_ms == 0
            || self.fetch_timeout_ms == 0
            || self.connect_timeout_ms == 0
            || self.max_connections == 0
        {
            anyhow::bail!(
                "{what}: lock_lease_ms, transfer_lock_timeout_secs, fetch_timeout_ms, connect_timeout_ms and max_connections must be > 0"
            );
        }
        Ok(())
    }

    fn limits(&self) -> PathLimits {
        PathLimits {
            qps_per_peer: self.qps_per_peer,
            max_wr_bytes: self.max_wr_bytes,
            signal_every: self.signal_every,
            max_holder_connections: self.max_connections,
        }
    }

    /// `nics` as device names: each entry split at commas and whitespace and trimmed, as
    /// PegaFlow reads `--nics` (`--nics mlx5_0,mlx5_1`, `--nics "mlx5_0 mlx5_1"`,
    /// `--nics mlx5_0 mlx5_1`).
    ///
    /// # Errors
    /// An empty name (an empty entry, or nothing between two commas), as PegaFlow refuses it.
    pub fn nic_names(&self) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for entry in &self.nics {
            for part in entry.split(',') {
                let names: Vec<&str> = part.split_whitespace().collect();
                if names.is_empty() {
                    return Err(format!(
                        "an empty NIC name in {entry:?} (names are separated by commas or spaces)"
                    ));
                }
                out.extend(names.into_iter().map(str::to_owned));
            }
        }
        Ok(out)
    }
}

/// Parses a `kind = "rdma-emu"` table: the common keys and the `emu` table.
///
/// # Errors
/// An unknown key or a value of the wrong type.
pub fn parse_emu(
    what: &str,
    t: &toml::Table,
) -> anyhow::Result<(RdmaPeerConfig, emu::EmuSettings)> {
    let mut t = t.clone();
    let e = t.remove("emu");
    let c: RdmaPeerConfig = parse_settings(what, &t)?;
    let e = match e {
        None => emu::EmuSettings::default(),
        Some(toml::Value::Table(e)) => parse_settings(&format!("{what}: emu"), &e)?,
        Some(other) => anyhow::bail!("{what}: emu must be a table, got {other}"),
    };
    e.link_layer()
        .map_err(|err| anyhow::anyhow!("{what}: {err}"))?;
    Ok((c, e))
}

fn emu_defaults() -> toml::Table {
    let mut t = pegaflow_plugin::defaults_of::<RdmaPeerConfig>();
    t.insert(
        "emu".into(),
        toml::Value::try_from(emu::EmuSettings::default()).expect("emu settings serialise"),
    );
    t
}

/// The holder's tables as the emulator's fabric sees them: a fabric connection is the
/// requester's data connection. Its last one closing releases the requester's locks at
/// once and drops its queue pairs.
struct LockPeers {
    locks: Arc<Locks>,
    engine: std::sync::OnceLock<std::sync::Weak<Engine>>,
    open: parking_lot::Mutex<std::collections::HashMap<Arc<str>, usize>>,
}

impl emu::FabricPeers for LockPeers {
    fn connected(&self, requester: &Arc<str>) {
        self.locks.connected(requester);
        *self.open.lock().entry(requester.clone()).or_insert(0) += 1;
    }
    fn disconnected(&self, requester: &Arc<str>) {
        let n = self.locks.disconnected(requester);
        if n > 0 {
            tracing::debug!(requester = %requester, sessions = n, "rdma-emu: requester gone; its transfer locks are released");
        }
        let last = {
            let mut open = self.open.lock();
            let left = open.get_mut(requester).map(|c| {
                *c -= 1;
                *c
            });
            if left == Some(0) {
                open.remove(requester);
            }
            left == Some(0)
        };
        if last {
            if let Some(e) = self.engine.get().and_then(std::sync::Weak::upgrade) {
                e.forget_requester(requester);
            }
        }
    }
}

/// The requesting side: the tcp crate's fetcher over the RDMA data path, registering the
/// landing pool on the NICs before the first fetch.
pub struct RdmaFetcher {
    inner: Fetcher,
    engine: Arc<Engine>,
}

impl std::fmt::Debug for RdmaFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaFetcher")
            .field("engine", &self.engine)
            .finish()
    }
}

#[async_trait]
impl PeerFetcher for RdmaFetcher {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn skip(&self, node: &str, first_hash: &[u8]) -> Option<&'static str> {
        self.inner.skip(node, first_hash)
    }

    async fn fetch(
        &self,
        stack: &Arc<dyn BlockHost>,
        node: &str,
        keys: &[BlockKey],
        expect: Option<&BlockShape>,
        deadline: Instant,
    ) -> Vec<Arc<SealedBlock>> {
        if let Err(e) = self.engine.register_pool_async(stack.pool()).await {
            tracing::warn!(error = %e, "rdma: cannot register the pool; not fetching from peers");
            return Vec::new();
        }
        self.inner.fetch(stack, node, keys, expect, deadline).await
    }
}

/// The `rdma` / `rdma-emu` peer delegate.
pub struct RdmaPeer {
    kind: &'static str,
    config: RdmaPeerConfig,
    locks: Arc<Locks>,
    /// `Err`: RDMA unavailable on this machine (the reason); the RPCs say so.
    engine: Result<Arc<Engine>, String>,
    fetcher: Option<Arc<RdmaFetcher>>,
    _fabric: Option<emu::FabricServer>,
}

impl std::fmt::Debug for RdmaPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaPeer")
            .field("kind", &self.kind)
            .field("available", &self.engine.is_ok())
            .finish()
    }
}

impl RdmaPeer {
    fn engine(&self) -> Result<&Arc<Engine>, tonic::Status> {
        self.engine.as_ref().map_err(|why| {
            tonic::Status::failed_precondition(format!("RDMA unavailable on this node: {why}"))
        })
    }
}

#[async_trait]
impl PeerService for RdmaPeer {
    fn kind(&self) -> &'static str {
        self.kind
    }

    async fn query_blocks_for_transfer(
        &self,
        store: &Arc<dyn BlockHost>,
        req: pb::QueryBlocksForTransferRequest,
    ) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status> {
        self.engine()?;
        pegaflow_transport_tcp::lock_for_transfer(&self.locks, self.config.numa_node, store, req)
    }

    async fn release_transfer_lock(
        &self,
        _store: &Arc<dyn BlockHost>,
        req: pb::ReleaseTransferLockRequest,
    ) -> Result<pb::ReleaseTransferLockResponse, tonic::Status> {
        Ok(pegaflow_transport_tcp::release_lock(&self.locks, req))
    }

    async fn rdma_handshake(
        &self,
        store: &Arc<dyn BlockHost>,
        req: pb::RdmaHandshakeRequest,
    ) -> Result<pb::RdmaHandshakeResponse, tonic::Status> {
        let engine = self.engine()?.clone();
        let offer = codec::Meta::decode(&req.handshake_metadata).map_err(|e| {
            tonic::Status::failed_precondition(format!(
                "this server moves peer data by RDMA ({}): {e}",
                self.kind
            ))
        })?;
        engine
            .register_pool_async(store.pool())
            .await
            .map_err(|e| tonic::Status::internal(format!("cannot register the pool: {e}")))?;
        let requester = req.requester_id.clone();
        // Queue pair setup may block on the device: off the async workers.
        let answer = tokio::task::spawn_blocking(move || engine.answer(&requester, &offer))
            .await
            .map_err(|e| tonic::Status::internal(format!("handshake task: {e}")))?
            .map_err(|e| tonic::Status::internal(format!("RDMA handshake: {e}")))?;
        Ok(pb::RdmaHandshakeResponse {
            status: pegaflow_transport_tcp::ok(),
            handshake_metadata: answer.encode(),
        })
    }

    fn fetcher(&self) -> Option<Arc<dyn PeerFetcher>> {
        self.fetcher
            .as_ref()
            .map(|f| f.clone() as Arc<dyn PeerFetcher>)
    }
}

/// What a kind's builder hands [`assemble`].
struct Parts {
    kind: &'static str,
    config: RdmaPeerConfig,
    requester_id: String,
    /// The NICs, or why RDMA is unavailable.
    nics: Result<Vec<Arc<dyn Nic>>, String>,
    /// The emulator's fabric socket and its key-mismatch fault.
    fabric: Option<(emu::FabricServer, bool)>,
    locks: Arc<Locks>,
    metrics: PeerMetrics,
}

/// Builds the delegate over `nics` (or, `Err`, RDMA unavailable for that reason).
fn assemble(p: Parts, ctx: &RuntimeContext) -> anyhow::Result<Arc<RdmaPeer>> {
    let Parts {
        kind,
        config: c,
        requester_id,
        nics,
        fabric,
        locks,
        metrics,
    } = p;
    let rmetrics = RdmaMetrics::new(ctx.metrics.registry());
    let (fabric_path, wrong_rkey, fabric) = match fabric {
        Some((f, wrong)) => (f.path().display().to_string(), wrong, Some(f)),
        None => (String::new(), false, None),
    };
    let engine = match nics {
        Ok(nics) => Ok(Engine::new(
            kind,
            nics,
            c.limits(),
            fabric_path,
            wrong_rkey,
            rmetrics,
        )?),
        Err(why) => Err(why),
    };
    let fetcher = match (&engine, c.fetch) {
        (Ok(engine), true) => {
            let inner = Fetcher::new(
                requester_id,
                engine.clone() as Arc<dyn PeerDataPath>,
                FetchLimits {
                    fetch_timeout: Duration::from_millis(c.fetch_timeout_ms),
                    connect_timeout: Duration::from_millis(c.connect_timeout_ms),
                    suspect_for: Duration::from_secs(c.suspect_secs),
                    stale_for: Duration::from_secs(c.stale_secs),
                    max_fetch_bytes: c.max_fetch_bytes,
                },
                metrics,
            )
            .with_handshake(engine.clone());
            Some(Arc::new(RdmaFetcher {
                inner,
                engine: engine.clone(),
            }))
        }
        _ => None,
    };
    match &engine {
        Ok(e) => {
            let names: Vec<_> = e.nics().iter().map(|n| n.caps().name.clone()).collect();
            tracing::info!(kind, nics = ?names, qps_per_peer = c.qps_per_peer, fetch = c.fetch, "rdma peer delegate ready");
        }
        Err(why) => {
            tracing::warn!(kind, reason = %why, "RDMA unavailable: this node serves locally and neither serves nor fetches peer blocks");
            ctx.health.report(
                &format!("peer {kind}"),
                pegaflow_plugin::health::HealthState::Degraded,
                format!("RDMA unavailable: {why}"),
            );
        }
    }
    Ok(Arc::new(RdmaPeer {
        kind,
        config: c,
        locks,
        engine,
        fetcher,
        _fabric: fabric,
    }))
}

fn new_locks(c: &RdmaPeerConfig, metrics: &PeerMetrics) -> Arc<Locks> {
    let locks = Arc::new(Locks::new(
        Duration::from_millis(c.lock_lease_ms),
        Duration::from_secs(c.transfer_lock_timeout_secs),
        c.max_locked_blocks,
        metrics.clone(),
    ));
    pegaflow_transport_tcp::spawn_sweeper(&locks);
    locks
}

fn build_emu(t: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn PeerService>> {
    let (c, e) = parse_emu("rdma-emu peer", t)?;
    c.check("rdma-emu peer")?;
    let metrics = PeerMetrics::new(ctx.metrics.registry());
    let locks = new_locks(&c, &metrics);
    let id = format!("pegaflow-rdma-{}", uuid::Uuid::new_v4());
    let mut names = c
        .nic_names()
        .map_err(|e| anyhow::anyhow!("rdma-emu peer: {e}"))?;
    if names.is_empty() {
        names.push("emu0".into());
    }
    let nics = emu::open(&names, &id, &e)?;
    let dir = if e.socket_dir.is_empty() {
        std::env::temp_dir()
    } else {
        e.socket_dir.clone().into()
    };
    let peers = Arc::new(LockPeers {
        locks: locks.clone(),
        engine: std::sync::OnceLock::new(),
        open: parking_lot::Mutex::new(std::collections::HashMap::new()),
    });
    let fabric = emu::FabricServer::start(&dir, nics.clone(), peers.clone(), c.max_connections)?;
    tracing::warn!(
        socket = %fabric.path().display(),
        "rdma-emu is a test transport: a process of this user that reaches its socket can read this server's memory; use kind = \"rdma\" or \"tcp\" between real nodes"
    );
    let nics: Vec<Arc<dyn Nic>> = nics.into_iter().map(|n| n as Arc<dyn Nic>).collect();
    let peer = assemble(
        Parts {
            kind: "rdma-emu",
            config: c,
            requester_id: id,
            nics: Ok(nics),
            fabric: Some((fabric, e.fault_wrong_rkey)),
            locks,
            metrics,
        },
        ctx,
    )?;
    if let Ok(engine) = &peer.engine {
        let _ = peers.engine.set(Arc::downgrade(engine));
    }
    Ok(peer)
}

/// The options both kinds document.
macro_rules! common_options {
    ($($extra:expr),* $(,)?) => {
        &[
            PluginOption { name: "nics", help: "NICs to use by device name, separated by commas or spaces (the rdma kind's --nics; named ones that cannot be opened fail start-up); empty: every device (rdma-emu: one, emu0); counts may differ between nodes" },
            PluginOption { name: "qps_per_peer", help: "queue pairs per local NIC per peer (the rdma kind's --qps-per-peer, 1..=64)" },
            PluginOption { name: "fetch", help: "whether this node fetches from peers (needs a [directory]); false: serve only" },
            PluginOption { name: "lock_lease_ms", help: "a transfer lock's lease in ms (one-sided reads do not renew it: keep it above the requesters' fetch_timeout_ms)" },
            PluginOption { name: "transfer_lock_timeout_secs", help: "the longest a transfer lock lives, in seconds" },
            PluginOption { name: "max_locked_blocks", help: "blocks locked for peers at once, at most" },
            PluginOption { name: "max_connections", help: "requester connections held at once (one per requester), at most" },
            PluginOption { name: "fetch_timeout_ms", help: "longest fetch from a peer (handshake, lock, pull, release), in ms" },
            PluginOption { name: "connect_timeout_ms", help: "longest wait for a gRPC connection to a peer, in ms" },
            PluginOption { name: "suspect_secs", help: "how long a peer that failed or timed out is skipped, in seconds" },
            PluginOption { name: "stale_secs", help: "how long a peer that denied holding an advertised block is not asked for that run again, in seconds" },
            PluginOption { name: "max_fetch_bytes", help: "bytes one fetch reads at most" },
            PluginOption { name: "numa_node", help: "NUMA node reported for this pool's slots (-1 = unknown); requesters ignore it" },
            PluginOption { name: "max_wr_bytes", help: "bytes one READ work request moves at most (4 KiB..=1 GiB)" },
            PluginOption { name: "signal_every", help: "every how many READs of a queue pair one is signalled; the last always is (1..=1024)" },
            PluginOption { name: "gid_index", help: "GID table index on RoCEv2 ports (rdma only; InfiniBand uses the LID)" },
            $($extra),*
        ]
    };
}

inventory::submit! {
    PeerServiceFactory {
        kind: "rdma-emu",
        summary: "cross-node block fetch by one-sided READ through the in-tree RDMA emulator (no hardware: the holder's pool read through a descriptor passed over a Unix socket, rkey- and bounds-checked, with injectable faults); the rdma kind's protocol, for tests",
        config: ConfigSchema {
            defaults: emu_defaults,
            check: |w, t| parse_emu(w, t)?.0.check(w),
            options: common_options![
                PluginOption { name: "emu", help: "the emulator's table: link (\"roce\" or \"ib\"), nic_numa_nodes, socket_dir, and faults: fault_completion_error_after, fault_revoke_after, fault_late_after with fault_late_completion_ms, fault_wrong_rkey (all off by default)" },
            ],
        },
        flags: &[],
        build: build_emu,
    }
}

#[cfg(feature = "ibverbs")]
fn build_verbs(t: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn PeerService>> {
    let c: RdmaPeerConfig = parse_settings("rdma peer", t)?;
    c.check("rdma peer")?;
    let metrics = PeerMetrics::new(ctx.metrics.registry());
    let locks = new_locks(&c, &metrics);
    let id = format!("pegaflow-rdma-{}", uuid::Uuid::new_v4());
    let names = c
        .nic_names()
        .map_err(|e| anyhow::anyhow!("rdma peer: {e}"))?;
    let nics = ibverbs::open(&names, c.gid_index as u8)
        .map(|v| v.into_iter().map(|n| n as Arc<dyn Nic>).collect())
        .map_err(|e| match e {
            verbs::VerbsError::Unavailable(why) => why,
            other => other.to_string(),
        });
    // NICs named (`--nics`, as PegaFlow's deployments pass it): one that cannot be opened
    // fails start-up, as a bad NIC fails PegaFlow's. Without names ("every device"), a
    // machine without RDMA serves locally and reports RDMA unavailable.
    if let (false, Err(why)) = (names.is_empty(), &nics) {
        anyhow::bail!(
            "rdma peer: cannot open the NICs {names:?} (--nics): {why}. NICs named must open (`ibv_devices` lists this machine's); leave --nics out to serve without RDMA"
        );
    }
    assemble(
        Parts {
            kind: "rdma",
            config: c,
            requester_id: id,
            nics,
            fabric: None,
            locks,
            metrics,
        },
        ctx,
    )
    .map(|p| p as Arc<dyn PeerService>)
}

#[cfg(feature = "ibverbs")]
inventory::submit! {
    PeerServiceFactory {
        kind: "rdma",
        summary: "cross-node block fetch by one-sided RDMA READ from the holder's registered pool (libibverbs, loaded at run time: NICs named that cannot be opened fail start-up; with none named, a machine without RDMA serves locally and reports RDMA unavailable)",
        config: ConfigSchema {
            defaults: pegaflow_plugin::defaults_of::<RdmaPeerConfig>,
            check: |w, t| parse_settings::<RdmaPeerConfig>(w, t)?.check(w),
            options: common_options![],
        },
        flags: &[
            pegaflow_plugin::FactoryFlag {
                long: "nics",
                value_name: "NIC",
                help: "RDMA NICs for cross-node fetch, by device name, separated by commas or spaces (PegaFlow's flag; adds [peer] kind \"rdma\"; start-up fails when one cannot be opened, e.g. without libibverbs; fetching needs a directory, e.g. --metaserver-addr)",
                setting: "nics",
                value: pegaflow_plugin::FlagValue::TextList,
                adds_entry: true,
            },
            pegaflow_plugin::FactoryFlag {
                long: "qps-per-peer",
                value_name: "N",
                help: "RDMA queue pairs per NIC per peer (PegaFlow's flag; the [peer] kind \"rdma\" setting qps_per_peer) [default: 2]",
                setting: "qps_per_peer",
                value: pegaflow_plugin::FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
        ],
        build: build_verbs,
    }
}

#[cfg(test)]
mod tests;
