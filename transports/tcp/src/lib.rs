//! `pegaflow-transport-tcp`: cross-node block fetch over TCP (`[peer] kind = "tcp"`).
//!
//! Two halves, one per role a node plays:
//! - **Source** ([`TcpPeer`] as the [`PeerService`], [`serve`], [`locks`]): answers
//!   `QueryBlocksForTransfer` with the found blocks' slot locations in this node's pool,
//!   locked under a fresh session id (a lease: renewed by reads, released by
//!   `ReleaseTransferLock`, at once when the requester's last data connection closes, after
//!   `lock_lease_ms` without data, and never later than `transfer_lock_timeout_secs`);
//!   answers `RdmaHandshake` with its data port; serves reads on the data port with
//!   `writev` from the pool, each range checked against the session's locked slots.
//! - **Requester** ([`fetch`], [`client`]): the peer rung of the tier stack. It locks a run
//!   on the holder the directory names, pulls it over a few connections straight into
//!   DRAM buffers, releases, and hands the blocks to the stack, all under one deadline; a
//!   holder that failed is suspect for `suspect_secs`.
//!
//! PegaFlow's `--transfer-lock-timeout-secs` is this factory's flag; `--peer-data-addr`
//! turns the delegate on with its data port. The data path is a [`PeerDataPath`]: an RDMA
//! backend replaces [`client::TcpDataPath`] and keeps the rest.

pub mod burst_log;
pub mod client;
pub mod conns;
pub mod fetch;
pub mod locks;
pub mod metrics;
pub mod serve;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pegaflow_plugin::block::KeyRef;
use pegaflow_plugin::BlockHost;
use pegaflow_plugin::{
    defaults_of, parse_settings, ConfigSchema, FactoryFlag, FlagValue, PeerFetcher, PeerService,
    PeerServiceFactory, PluginOption, RuntimeContext,
};
use pegaflow_proto as pb;
use serde::{Deserialize, Serialize};

use crate::locks::{Locked, Locks};
use crate::metrics::PeerMetrics;

/// The `[peer] kind = "tcp"` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TcpPeerConfig {
    /// Address the data port listens on (`--peer-data-addr`); port 0 picks a free one. Peers
    /// learn the port from the handshake and reach it at the host they reach gRPC at.
    #[serde(default = "default_data_addr")]
    pub data_addr: String,
    /// Whether this node fetches from peers (the peer rung of its tier stack; needs a
    /// `[directory]`). False: it only serves.
    #[serde(default = "default_true")]
    pub fetch: bool,
    /// Connections per peer (a fetch splits its bytes over them).
    #[serde(default = "default_connections")]
    pub connections_per_peer: usize,
    /// A transfer session's lease in milliseconds: it ends this long after its last read
    /// unless released first (a frozen requester pins blocks this long at most).
    #[serde(default = "default_lease_ms")]
    pub lock_lease_ms: u64,
    /// The longest a transfer session lives, renewed or not, in seconds
    /// (`--transfer-lock-timeout-secs`, PegaFlow's 120).
    #[serde(default = "default_lock_cap")]
    pub transfer_lock_timeout_secs: u64,
    /// Blocks locked for peers at once, at most (QueryBlocksForTransfer beyond it answers
    /// RESOURCE_EXHAUSTED).
    #[serde(default = "default_max_locked")]
    pub max_locked_blocks: usize,
    /// Data-port connections at once, at most. When full, a connection from an address
    /// holding fewer connections than the busiest address evicts that address's connection
    /// idle longest (never one carrying a live fetch); else it is refused.
    #[serde(default = "default_max_conns")]
    pub max_data_connections: usize,
    /// Data-port connections at once from one IP address, at most (requesters sharing an
    /// address share it).
    #[serde(default = "default_max_conns_per_address")]
    pub max_data_connections_per_address: usize,
    /// Greeted data-port connections at once of one requester id (one requesting server
    /// process), at most. At least `connections_per_peer`.
    #[serde(default = "default_max_conns_per_requester")]
    pub max_data_connections_per_requester: usize,
    /// A greeted data-port connection with no read for this long is closed, in seconds,
    /// unless its requester holds a transfer lock here (a fetch between lock and release).
    #[serde(default = "default_data_idle_timeout_secs")]
    pub data_idle_timeout_secs: u64,
    /// Longest wait for one socket operation on the data port, in milliseconds (a
    /// requester that stops reading loses its connection after it).
    #[serde(default = "default_io_timeout_ms")]
    pub io_timeout_ms: u64,
    /// Longest fetch (handshake, lock, pull, release), in milliseconds; also bounded by the
    /// promotion deadline (`[store] promote_deadline_ms`).
    #[serde(default = "default_fetch_timeout_ms")]
    pub fetch_timeout_ms: u64,
    /// Longest wait for a connection to a peer, in milliseconds.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long a peer that failed or timed out is skipped, in seconds.
    #[serde(default = "default_suspect_secs")]
    pub suspect_secs: u64,
    /// How long a peer that answered it does not hold an advertised block (a stale
    /// directory entry) is not asked for that continuation again, in seconds.
    #[serde(default = "default_stale_secs")]
    pub stale_secs: u64,
    /// Bytes one fetch reads at most.
    #[serde(default = "default_max_fetch_bytes")]
    pub max_fetch_bytes: u64,
    /// The NUMA node reported for this pool's slots (`numa_node` in the answer); -1 =
    /// unknown. Requesters ignore it for placement.
    #[serde(default = "default_numa")]
    pub numa_node: i32,
}

fn default_data_addr() -> String {
    "0.0.0.0:0".into()
}
/// Default: `true`. Shared with the other data paths over these locks and this fetcher.
pub fn default_true() -> bool {
    true
}
fn default_connections() -> usize {
    4
}
fn default_lease_ms() -> u64 {
    5_000
}
/// Default: the longest a transfer lock lives, in seconds (PegaFlow's 120). Shared with the other data paths over these locks and this fetcher.
pub fn default_lock_cap() -> u64 {
    120
}
/// Default: blocks locked for peers at once, at most. Shared with the other data paths over these locks and this fetcher.
pub fn default_max_locked() -> usize {
    1 << 20
}
/// Default: data connections at once, at most. Shared with the other data paths over these locks and this fetcher.
pub fn default_max_conns() -> usize {
    1024
}
fn default_max_conns_per_address() -> usize {
    256
}
fn default_max_conns_per_requester() -> usize {
    128
}
fn default_data_idle_timeout_secs() -> u64 {
    30
}
fn default_io_timeout_ms() -> u64 {
    2_000
}
/// Default: the longest fetch, in milliseconds. Shared with the other data paths over these locks and this fetcher.
pub fn default_fetch_timeout_ms() -> u64 {
    3_000
}
/// Default: the longest wait for a connection to a peer, in milliseconds. Shared with the other data paths over these locks and this fetcher.
pub fn default_connect_timeout_ms() -> u64 {
    500
}
/// Default: how long a failed peer is skipped, in seconds. Shared with the other data paths over these locks and this fetcher.
pub fn default_suspect_secs() -> u64 {
    30
}
/// Default: how long a peer that denied an advertised run is not asked for it again, in seconds. Shared with the other data paths over these locks and this fetcher.
pub fn default_stale_secs() -> u64 {
    10
}
/// Default: the most bytes one fetch reads. Shared with the other data paths over these locks and this fetcher.
pub fn default_max_fetch_bytes() -> u64 {
    4 << 30
}
/// Default: the NUMA node reported for locked slots (-1: unknown). Shared with the other data paths over these locks and this fetcher.
pub fn default_numa() -> i32 {
    -1
}

impl Default for TcpPeerConfig {
    fn default() -> Self {
        Self {
            data_addr: default_data_addr(),
            fetch: true,
            connections_per_peer: default_connections(),
            lock_lease_ms: default_lease_ms(),
            transfer_lock_timeout_secs: default_lock_cap(),
            max_locked_blocks: default_max_locked(),
            max_data_connections: default_max_conns(),
            max_data_connections_per_address: default_max_conns_per_address(),
            max_data_connections_per_requester: default_max_conns_per_requester(),
            data_idle_timeout_secs: default_data_idle_timeout_secs(),
            io_timeout_ms: default_io_timeout_ms(),
            fetch_timeout_ms: default_fetch_timeout_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            suspect_secs: default_suspect_secs(),
            stale_secs: default_stale_secs(),
            max_fetch_bytes: default_max_fetch_bytes(),
            numa_node: default_numa(),
        }
    }
}

impl TcpPeerConfig {
    /// Refuses values out of range (`what` names the entry).
    ///
    /// # Errors
    /// A zero lease or cap, a connection count outside 1..=64, a zero connection cap or
    /// idle timeout, a per-requester cap below `connections_per_peer`, a data address that
    /// does not parse as `host:port`.
    pub fn check(&self, what: &str) -> anyhow::Result<()> {
        if self.transfer_lock_timeout_secs == 0 || self.lock_lease_ms == 0 {
            anyhow::bail!("{what}: transfer_lock_timeout_secs and lock_lease_ms must be > 0");
        }
        if self.connections_per_peer == 0 || self.connections_per_peer > 64 {
            anyhow::bail!("{what}: connections_per_peer must be 1..=64");
        }
        if self.fetch_timeout_ms == 0 || self.io_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            anyhow::bail!(
                "{what}: fetch_timeout_ms, io_timeout_ms and connect_timeout_ms must be > 0"
            );
        }
        if self.max_data_connections == 0
            || self.max_data_connections_per_address == 0
            || self.data_idle_timeout_secs == 0
        {
            anyhow::bail!(
                "{what}: max_data_connections, max_data_connections_per_address and data_idle_timeout_secs must be > 0"
            );
        }
        if self.max_data_connections_per_requester < self.connections_per_peer {
            anyhow::bail!(
                "{what}: max_data_connections_per_requester ({}) is below connections_per_peer ({}): a requester configured like this node could not open its connections",
                self.max_data_connections_per_requester,
                self.connections_per_peer
            );
        }
        if !self.data_addr.contains(':') {
            anyhow::bail!(
                "{what}: data_addr {:?} is not host:port (e.g. 0.0.0.0:50060)",
                self.data_addr
            );
        }
        Ok(())
    }
}

impl TcpPeerConfig {
    /// The data port's settings these settings give (log lines at most every
    /// [`serve::LOG_EVERY`]).
    pub fn serve_limits(&self) -> serve::ServeLimits {
        serve::ServeLimits {
            max_connections: self.max_data_connections,
            max_per_address: self.max_data_connections_per_address,
            max_per_requester: self.max_data_connections_per_requester,
            io_timeout: Duration::from_millis(self.io_timeout_ms),
            idle_timeout: Duration::from_secs(self.data_idle_timeout_secs),
            max_read_bytes: self.max_fetch_bytes,
            log_every: serve::LOG_EVERY,
        }
    }
}

/// The `tcp` peer delegate: serves the three RPCs and the data port, and fetches.
pub struct TcpPeer {
    config: TcpPeerConfig,
    locks: Arc<Locks>,
    data_port: u16,
    fetcher: Option<Arc<fetch::Fetcher>>,
}

impl std::fmt::Debug for TcpPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpPeer")
            .field("data_port", &self.data_port)
            .finish()
    }
}

impl TcpPeer {
    /// The bound data port.
    pub fn data_port(&self) -> u16 {
        self.data_port
    }
}

/// A slot as the wire describes it: its first piece as K and its second (if any) as V; a
/// slot spread over more pieces cannot be described (`None`).
fn slot_info(
    s: &pegaflow_plugin::block::Slot,
    numa_node: i32,
    pieces: &mut Vec<(u64, u64)>,
) -> Option<pb::TransferSlotInfo> {
    let mut it = s.buf.pieces(s.offset, s.len);
    let k = it.next()?;
    let v = it.next();
    if it.next().is_some() {
        return None;
    }
    pieces.push((k.addr as u64, k.len as u64));
    if let Some(v) = v {
        pieces.push((v.addr as u64, v.len as u64));
    }
    Some(pb::TransferSlotInfo {
        k_ptr: k.addr as u64,
        k_size: k.len as u64,
        v_ptr: v.map_or(0, |v| v.addr as u64),
        v_size: v.map_or(0, |v| v.len as u64),
        numa_node,
    })
}

/// QueryBlocksForTransfer on the holder, for any data path that serves from the pool with
/// these locks: the prefix of the requested blocks this node holds in DRAM (stopping at the
/// first it does not hold, or whose slot the wire cannot describe), locked in `locks` under
/// a fresh session, with their slots' pool addresses; `numa_node` is reported per slot.
///
/// # Errors
/// RESOURCE_EXHAUSTED when `max_locked_blocks` are locked already.
pub fn lock_for_transfer(
    locks: &Locks,
    numa_node: i32,
    store: &Arc<dyn BlockHost>,
    req: pb::QueryBlocksForTransferRequest,
) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status> {
    let mut blocks = Vec::new();
    let mut infos = Vec::new();
    let mut pieces = Vec::new();
    // Only the prefix up to the first block this node cannot serve: the requester uses no
    // more than that, and locking blocks past a gap would pin them for nothing.
    for h in &req.block_hashes {
        let Some(b) = store.get_touch(KeyRef {
            namespace: &req.namespace,
            group: 0,
            hash: h,
        }) else {
            break;
        };
        let mut p = Vec::new();
        let slots: Option<Vec<_>> = b
            .slots
            .iter()
            .map(|s| slot_info(s, numa_node, &mut p))
            .collect();
        let Some(slots) = slots else { break };
        pieces.extend(p);
        infos.push(pb::TransferBlockInfo {
            block_hash: h.clone(),
            slots,
        });
        blocks.push(b);
    }
    let lease = locks.lease_secs();
    if blocks.is_empty() {
        return Ok(pb::QueryBlocksForTransferResponse {
            status: ok(),
            blocks: Vec::new(),
            transfer_session_id: String::new(),
            lock_timeout_secs: lease,
        });
    }
    let session = locks
        .lock(&req.requester_id, Locked::new(blocks, pieces))
        .map_err(|e| tonic::Status::resource_exhausted(e.to_string()))?;
    Ok(pb::QueryBlocksForTransferResponse {
        status: ok(),
        blocks: infos,
        transfer_session_id: session,
        lock_timeout_secs: lease,
    })
}

/// ReleaseTransferLock on the holder: ends the session in `locks`; success with the number
/// of blocks it held (0 for an unknown or already ended session).
pub fn release_lock(
    locks: &Locks,
    req: pb::ReleaseTransferLockRequest,
) -> pb::ReleaseTransferLockResponse {
    let n = locks.release(&req.transfer_session_id);
    pb::ReleaseTransferLockResponse {
        status: ok(),
        released_blocks: n as u64,
    }
}

/// Runs `locks`' sweeper (expired leases and caps) every [`Locks::sweep_every`] until the
/// table is dropped.
pub fn spawn_sweeper(locks: &Arc<Locks>) {
    let every = locks.sweep_every();
    let locks = Arc::downgrade(locks);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            match locks.upgrade() {
                Some(l) => l.sweep(),
                None => return,
            }
        }
    });
}

/// A status-bearing answer's `ok` status.
pub fn ok() -> Option<pb::ResponseStatus> {
    Some(pb::ResponseStatus {
        ok: true,
        message: String::new(),
    })
}

#[async_trait]
impl PeerService for TcpPeer {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    async fn query_blocks_for_transfer(
        &self,
        store: &Arc<dyn BlockHost>,
        req: pb::QueryBlocksForTransferRequest,
    ) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status> {
        lock_for_transfer(&self.locks, self.config.numa_node, store, req)
    }

    async fn release_transfer_lock(
        &self,
        _store: &Arc<dyn BlockHost>,
        req: pb::ReleaseTransferLockRequest,
    ) -> Result<pb::ReleaseTransferLockResponse, tonic::Status> {
        Ok(release_lock(&self.locks, req))
    }

    async fn rdma_handshake(
        &self,
        _store: &Arc<dyn BlockHost>,
        req: pb::RdmaHandshakeRequest,
    ) -> Result<pb::RdmaHandshakeResponse, tonic::Status> {
        if !req
            .handshake_metadata
            .starts_with(fetch::HANDSHAKE.as_bytes())
        {
            return Err(tonic::Status::failed_precondition(format!(
                "this server moves peer data over TCP (handshake {:?}); RDMA is not built in",
                fetch::HANDSHAKE
            )));
        }
        Ok(pb::RdmaHandshakeResponse {
            status: ok(),
            handshake_metadata: format!("{} port={}", fetch::HANDSHAKE, self.data_port)
                .into_bytes(),
        })
    }

    fn fetcher(&self) -> Option<Arc<dyn PeerFetcher>> {
        self.fetcher
            .as_ref()
            .map(|f| f.clone() as Arc<dyn PeerFetcher>)
    }
}

fn build(t: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn PeerService>> {
    let c: TcpPeerConfig = parse_settings("tcp peer", t)?;
    c.check("tcp peer")?;
    let metrics = PeerMetrics::new(ctx.metrics.registry());
    let std_listener = std::net::TcpListener::bind(&c.data_addr).map_err(|e| {
        anyhow::anyhow!(
            "tcp peer: cannot listen on {} (data_addr): {e}",
            c.data_addr
        )
    })?;
    std_listener.set_nonblocking(true)?;
    let data_port = std_listener.local_addr()?.port();
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    let locks = Arc::new(Locks::new(
        Duration::from_millis(c.lock_lease_ms),
        Duration::from_secs(c.transfer_lock_timeout_secs),
        c.max_locked_blocks,
        metrics.clone(),
    ));
    let limits = c.serve_limits();
    tokio::spawn(serve::serve(
        listener,
        locks.clone(),
        limits,
        metrics.clone(),
    ));
    spawn_sweeper(&locks);
    let fetcher = c.fetch.then(|| {
        let id = format!("pegaflow-tcp-{}", uuid::Uuid::new_v4());
        let data = Arc::new(client::TcpDataPath::new(
            id.clone(),
            c.connections_per_peer,
            Duration::from_millis(c.connect_timeout_ms),
        ));
        Arc::new(fetch::Fetcher::new(
            id,
            data,
            fetch::FetchLimits {
                fetch_timeout: Duration::from_millis(c.fetch_timeout_ms),
                connect_timeout: Duration::from_millis(c.connect_timeout_ms),
                suspect_for: Duration::from_secs(c.suspect_secs),
                stale_for: Duration::from_secs(c.stale_secs),
                max_fetch_bytes: c.max_fetch_bytes,
            },
            metrics.clone(),
        ))
    });
    tracing::info!(data_addr = %c.data_addr, data_port, fetch = c.fetch, "tcp peer delegate: data port listening");
    Ok(Arc::new(TcpPeer {
        config: c,
        locks,
        data_port,
        fetcher,
    }))
}

inventory::submit! {
    PeerServiceFactory {
        kind: "tcp",
        summary: "cross-node block fetch over TCP: serves QueryBlocksForTransfer / ReleaseTransferLock / RdmaHandshake with leased locks and a data port, and fetches from peers the directory names",
        config: ConfigSchema {
            defaults: defaults_of::<TcpPeerConfig>,
            check: |w, t| parse_settings::<TcpPeerConfig>(w, t)?.check(w),
            options: &[
                PluginOption { name: "data_addr", help: "address the data port listens on (port 0: any free port; peers learn it in the handshake)" },
                PluginOption { name: "fetch", help: "whether this node fetches from peers (needs a [directory]); false: serve only" },
                PluginOption { name: "connections_per_peer", help: "data connections per peer (1..=64)" },
                PluginOption { name: "lock_lease_ms", help: "a transfer lock's lease in ms: it ends this long after its last read unless released" },
                PluginOption { name: "transfer_lock_timeout_secs", help: "the longest a transfer lock lives, in seconds (PegaFlow's --transfer-lock-timeout-secs)" },
                PluginOption { name: "max_locked_blocks", help: "blocks locked for peers at once, at most" },
                PluginOption { name: "max_data_connections", help: "data-port connections at once, at most; when full, a requester holding fewer evicts the busiest address's connection idle longest (never one carrying a fetch), else it is refused" },
                PluginOption { name: "max_data_connections_per_address", help: "data-port connections at once from one IP address, at most" },
                PluginOption { name: "max_data_connections_per_requester", help: "greeted data-port connections at once of one requester (one server process), at most; at least connections_per_peer" },
                PluginOption { name: "data_idle_timeout_secs", help: "a greeted data-port connection with no read for this long is closed, unless its requester holds a transfer lock here, in seconds" },
                PluginOption { name: "io_timeout_ms", help: "longest wait for one data-port socket operation, in ms" },
                PluginOption { name: "fetch_timeout_ms", help: "longest fetch from a peer (lock, pull, release), in ms" },
                PluginOption { name: "connect_timeout_ms", help: "longest wait for a connection to a peer, in ms" },
                PluginOption { name: "suspect_secs", help: "how long a peer that failed or timed out is skipped, in seconds" },
                PluginOption { name: "stale_secs", help: "how long a peer that denied holding an advertised block is not asked for that run again, in seconds" },
                PluginOption { name: "max_fetch_bytes", help: "bytes one fetch reads at most" },
                PluginOption { name: "numa_node", help: "NUMA node reported for this pool's slots (-1 = unknown); requesters ignore it" },
            ],
        },
        // --peer-data-addr first: it adds the [peer] the other flag then sets.
        flags: &[
            FactoryFlag {
                long: "peer-data-addr",
                value_name: "HOST:PORT",
                help: "Serve and fetch blocks across nodes over TCP, with the data port on this address (adds [peer] kind \"tcp\"; fetching needs a directory, e.g. --metaserver-addr)",
                setting: "data_addr",
                value: FlagValue::Text,
                adds_entry: true,
            },
            FactoryFlag {
                long: "transfer-lock-timeout-secs",
                value_name: "SECS",
                help: "The longest a transfer lock taken by a peer lives, in seconds (PegaFlow's flag; the [peer] kind \"tcp\" setting transfer_lock_timeout_secs) [default: 120]",
                setting: "transfer_lock_timeout_secs",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
        ],
        build,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_listing_documents_every_setting() {
        let problems = pegaflow_plugin::doc_problems();
        let ours: Vec<_> = problems.iter().filter(|p| p.contains("\"tcp\"")).collect();
        assert!(ours.is_empty(), "{ours:?}");
    }
}

#[cfg(test)]
mod check_tests {
    #[test]
    fn out_of_range_settings_are_refused_without_building() {
        let f = pegaflow_plugin::peer_service_factory("tcp").unwrap();
        let mut t = toml::Table::new();
        t.insert("connections_per_peer".into(), 0.into());
        assert!((f.config.check)("tcp peer", &t).is_err());
        for (k, v) in [
            ("max_data_connections_per_address", 0),
            ("data_idle_timeout_secs", 0),
            ("max_data_connections_per_requester", 3),
        ] {
            let mut t = toml::Table::new();
            t.insert(k.into(), v.into());
            assert!((f.config.check)("tcp peer", &t).is_err(), "{k} = {v}");
        }
        let mut t = toml::Table::new();
        t.insert("data_addr".into(), "bogus".into());
        assert!((f.config.check)("tcp peer", &t).is_err());
        assert!((f.config.check)("tcp peer", &toml::Table::new()).is_ok());
    }
}
