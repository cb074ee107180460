//! This server's side of the cross-node directory (`[directory]`): heartbeats, advertising
//! the blocks host DRAM holds, withdrawing them when they leave, backfill after the directory
//! lost its state, unregistering at shutdown, and prefix queries that never wait long.
//!
//! Owns: one publisher task per server. It follows the tier stack's index events (a block
//! sealed or promoted into DRAM is inserted, an evicted one removed) through a bounded map of
//! pending hashes netted per key (the last event wins), sends them in batches of at most
//! `max_batch_hashes`, heartbeats every half stale interval, and re-inserts what DRAM holds
//! at `backfill_blocks_per_sec` when the directory says it lost this node's state (a
//! restart, a flush, a takeover) or when the publisher itself lost track (index events
//! missed, removals dropped from a full queue).
//!
//! Must never: advertise a block DRAM does not hold (an insert is sent only for a key the
//! index holds at send time, and a later eviction's removal is sent after it by the same
//! task), block or fail a Save or a query because the directory is slow or down (index events
//! are a broadcast the tier stack never waits on; queries take at most `query_timeout_ms` and
//! answer "nothing elsewhere" while the directory is unreachable), or drop a removal silently
//! (a removal that cannot be queued forces a resync).
//!
//! The node's identity is `advertise_addr` (default: the gRPC address, PegaFlow's `--addr`)
//! and a fresh session UUID per process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::block::BlockKey;
use crate::health::{HealthBoard, HealthState};
use crate::plugin::{directory_namespace, Directory, DirectoryError, NodeId, NodePrefix};
use crate::store::{IndexEvent, IndexEventKind, TierStack};

/// `[directory]`: which directory backend (`kind` and its own keys) and how this server
/// talks to it (the keys below, read by the runtime).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DirectoryConfig {
    /// The directory backend kind (`--list-plugins` lists them).
    pub kind: String,
    /// The `ip:port` other nodes reach this server's gRPC service at. Default: the server's
    /// `addr` (the bound address when its port is 0). A loopback or unspecified address is
    /// accepted with a warning: peers on other hosts cannot use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_addr: Option<String>,
    /// Hashes waiting to be sent, netted per key, at most. A full queue drops new
    /// insertions (counted) and turns a removal it cannot hold into a resync. Default 65536.
    /// `--metaserver-queue-depth` sets it (PegaFlow counts batches there; this counts hashes).
    #[serde(default = "default_queue_depth")]
    pub queue_depth: usize,
    /// Hashes per insert or remove call, at most (PegaFlow: 16384).
    #[serde(default = "default_max_batch_hashes")]
    pub max_batch_hashes: usize,
    /// Blocks per second re-inserted after the directory lost this node's state.
    #[serde(default = "default_backfill_rate")]
    pub backfill_blocks_per_sec: u64,
    /// Longest wait for one heartbeat, insert, remove or unregister call, in milliseconds.
    #[serde(default = "default_call_timeout_ms")]
    pub call_timeout_ms: u64,
    /// Longest wait for a prefix query, in milliseconds; then the query answers "nothing
    /// elsewhere" (local only).
    #[serde(default = "default_query_timeout_ms")]
    pub query_timeout_ms: u64,
    /// Every this many seconds, everything DRAM holds is inserted again (no forgetting), so
    /// that a backend whose entries expire some time after their last insert (Redis:
    /// `ttl_minutes`) keeps listing blocks that stay resident that long. 0 = never.
    /// Default 1800.
    #[serde(default = "default_refresh_secs")]
    pub refresh_secs: u64,
    /// The backend's own settings (everything else in the table).
    #[serde(flatten)]
    pub settings: toml::Table,
}

fn default_queue_depth() -> usize {
    65_536
}
fn default_max_batch_hashes() -> usize {
    16_384
}
fn default_backfill_rate() -> u64 {
    100_000
}
fn default_call_timeout_ms() -> u64 {
    2_000
}
fn default_query_timeout_ms() -> u64 {
    100
}
fn default_refresh_secs() -> u64 {
    1_800
}

impl DirectoryConfig {
    /// A `[directory]` of `kind` with the runtime's defaults and no backend settings.
    pub fn of_kind(kind: &str) -> Self {
        Self {
            kind: kind.into(),
            advertise_addr: None,
            queue_depth: default_queue_depth(),
            max_batch_hashes: default_max_batch_hashes(),
            backfill_blocks_per_sec: default_backfill_rate(),
            call_timeout_ms: default_call_timeout_ms(),
            query_timeout_ms: default_query_timeout_ms(),
            refresh_secs: default_refresh_secs(),
            settings: toml::Table::new(),
        }
    }

    /// Checks the runtime's keys.
    ///
    /// # Errors
    /// A zero queue depth, batch size, backfill rate or timeout.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (v, key) in [
            (self.queue_depth as u64, "queue_depth"),
            (self.max_batch_hashes as u64, "max_batch_hashes"),
            (self.backfill_blocks_per_sec, "backfill_blocks_per_sec"),
            (self.call_timeout_ms, "call_timeout_ms"),
            (self.query_timeout_ms, "query_timeout_ms"),
        ] {
            if v == 0 {
                anyhow::bail!("[directory] {key} must be > 0");
            }
        }
        Ok(())
    }
}

/// The publisher's metric families: PegaFlow's `pegaflow_metaserver_*` client families (a
/// dashboard built for it keeps working, whatever the backend) and this server's own
/// `pegaflow_directory_*`.
#[derive(Clone)]
struct DirMetrics {
    registration_blocks: IntCounter,
    registration_failures: IntCounter,
    registration_queue_full: IntCounter,
    removal_blocks: IntCounter,
    removal_failures: IntCounter,
    removal_queue_full: IntCounter,
    heartbeat_failures: IntCounter,
    session_resets: IntCounter,
    unregister_failures: IntCounter,
    resyncs: IntCounterVec,
    backfill_blocks: IntCounter,
    pending: IntGauge,
    up: IntGauge,
    queries: IntCounterVec,
    events_lagged: IntCounter,
}

impl DirMetrics {
    fn new(reg: &Registry) -> Self {
        fn c(reg: &Registry, name: &str, help: &str) -> IntCounter {
            let m = IntCounter::new(name, help).expect("metric");
            let _ = reg.register(Box::new(m.clone()));
            m
        }
        fn cv(reg: &Registry, name: &str, help: &str, label: &str) -> IntCounterVec {
            let m = IntCounterVec::new(Opts::new(name, help), &[label]).expect("metric");
            let _ = reg.register(Box::new(m.clone()));
            m
        }
        fn g(reg: &Registry, name: &str, help: &str) -> IntGauge {
            let m = IntGauge::new(name, help).expect("metric");
            let _ = reg.register(Box::new(m.clone()));
            m
        }
        Self {
            registration_blocks: c(reg, "pegaflow_metaserver_registration_blocks_total", "Block hashes inserted into the directory"),
            registration_failures: c(reg, "pegaflow_metaserver_registration_failures_total", "Insert calls that failed (their hashes are retried)"),
            registration_queue_full: c(reg, "pegaflow_metaserver_registration_queue_full_total", "Insertions that found the pending queue full (a backfill re-sends them)"),
            removal_blocks: c(reg, "pegaflow_metaserver_removal_blocks_total", "Block hashes removed from the directory"),
            removal_failures: c(reg, "pegaflow_metaserver_removal_failures_total", "Remove calls that failed (their hashes are retried)"),
            removal_queue_full: c(reg, "pegaflow_metaserver_removal_queue_full_total", "Removals that found the pending queue full (they force a resync)"),
            heartbeat_failures: c(reg, "pegaflow_metaserver_heartbeat_failures_total", "Heartbeats that failed or timed out"),
            session_resets: c(reg, "pegaflow_metaserver_session_resets_total", "Heartbeats after which the directory had lost this node's state"),
            unregister_failures: c(reg, "pegaflow_metaserver_unregister_failures_total", "Unregister calls at shutdown that failed or timed out"),
            resyncs: cv(reg, "pegaflow_directory_resyncs_total", "Re-advertisements of everything DRAM holds, by reason (start, state_lost, events_lagged, removals_dropped, inserts_dropped, refresh)", "reason"),
            backfill_blocks: c(reg, "pegaflow_directory_backfill_blocks_total", "Block hashes re-inserted by backfills"),
            pending: g(reg, "pegaflow_directory_pending_hashes", "Hashes waiting to be sent to the directory"),
            up: g(reg, "pegaflow_directory_up", "1 while the last heartbeat succeeded"),
            queries: cv(reg, "pegaflow_directory_queries_total", "Prefix queries, by outcome (ok, unavailable, timeout, down)", "outcome"),
            events_lagged: c(reg, "pegaflow_index_events_lagged_total", "Index events the publisher missed (it resyncs)"),
        }
    }
}

/// Why the publisher re-advertises everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResyncReason {
    /// The first registration of this session.
    Start,
    /// The directory said it lost this session's entries.
    StateLost,
    /// Index events were missed: what was advertised is unknown.
    EventsLagged,
    /// A removal did not fit the pending queue: an entry may be stale.
    RemovalsDropped,
    /// Insertions did not fit the pending queue: some blocks are not advertised.
    InsertsDropped,
    /// The periodic re-insertion (`refresh_secs`).
    Refresh,
}

impl ResyncReason {
    fn label(self) -> &'static str {
        match self {
            ResyncReason::Start => "start",
            ResyncReason::StateLost => "state_lost",
            ResyncReason::EventsLagged => "events_lagged",
            ResyncReason::RemovalsDropped => "removals_dropped",
            ResyncReason::InsertsDropped => "inserts_dropped",
            ResyncReason::Refresh => "refresh",
        }
    }

    /// The session's entries must be forgotten first: some may name blocks DRAM dropped.
    fn forgets(self) -> bool {
        matches!(
            self,
            ResyncReason::EventsLagged | ResyncReason::RemovalsDropped
        )
    }

    /// Index events until the backfill starts are superseded by it (the directory holds
    /// nothing of the session by then). Not so for dropped insertions: removals must still
    /// be sent.
    fn supersedes_events(self) -> bool {
        !self.adds_only()
    }

    /// Only insertions are missing: nothing is forgotten and removals flow meanwhile.
    fn adds_only(self) -> bool {
        matches!(self, ResyncReason::InsertsDropped | ResyncReason::Refresh)
    }
}

struct Shared {
    dir: Arc<dyn Directory>,
    node: NodeId,
    config: DirectoryConfig,
    metrics: DirMetrics,
    up: AtomicBool,
    stop: Notify,
    stopping: AtomicBool,
    health: HealthBoard,
}

/// The peer rung's question, answered by the directory: which nodes hold the continuation.
#[async_trait::async_trait]
impl crate::plugin::HolderLookup for ClusterDirectory {
    async fn holders(&self, namespace: &str, hashes: &[Vec<u8>]) -> Vec<NodePrefix> {
        self.query_prefix(namespace, 0, hashes).await
    }
}

/// A running directory client: the publisher task and the query side. Cloning shares it.
#[derive(Clone)]
pub struct ClusterDirectory {
    shared: Arc<Shared>,
    task: Arc<parking_lot::Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for ClusterDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterDirectory")
            .field("kind", &self.shared.dir.kind())
            .field("node", &self.shared.node)
            .field("up", &self.is_up())
            .finish()
    }
}

/// The health component name of the directory client on `/health`.
const HEALTH: &str = "directory";

impl ClusterDirectory {
    /// Starts the publisher for `node` over `dir`, following `store`'s index events.
    /// Returns at once: the first heartbeat runs in the task (a directory that is down at
    /// start is retried; the server serves meanwhile).
    pub fn start(
        dir: Arc<dyn Directory>,
        node: NodeId,
        config: DirectoryConfig,
        store: Arc<TierStack>,
        registry: &Registry,
        health: HealthBoard,
    ) -> Self {
        let shared = Arc::new(Shared {
            dir,
            node,
            config,
            metrics: DirMetrics::new(registry),
            up: AtomicBool::new(false),
            stop: Notify::new(),
            stopping: AtomicBool::new(false),
            health,
        });
        shared.health.report(
            HEALTH,
            HealthState::Degraded,
            format!("{} directory: not reached yet", shared.dir.kind()),
        );
        let rx = store.subscribe();
        let worker = Worker {
            shared: shared.clone(),
            store,
            rx,
            pending: HashMap::new(),
            registered: false,
            resync: Some(ResyncReason::Start),
            backfill: None,
            heartbeat_every: Duration::from_secs(1),
            next_heartbeat: Instant::now(),
            backoff: BACKOFF_MIN,
            retry_at: None,
            next_refresh: None,
            doubtful: Default::default(),
            doubtful_since: Instant::now(),
        };
        let task = tokio::spawn(worker.run());
        Self {
            shared,
            task: Arc::new(parking_lot::Mutex::new(Some(task))),
        }
    }

    /// This node's identity in the directory.
    pub fn node(&self) -> &NodeId {
        &self.shared.node
    }

    /// The backend kind.
    pub fn kind(&self) -> &'static str {
        self.shared.dir.kind()
    }

    /// Whether the last heartbeat succeeded.
    pub fn is_up(&self) -> bool {
        self.shared.up.load(Ordering::Relaxed)
    }

    /// The directory's cover plan of the longest prefix of `hashes` the other nodes hold
    /// (segments in hash order; this node is excluded).
    /// Answers within `query_timeout_ms`; while the directory is unreachable, or on any error,
    /// it answers empty ("local only") and counts why in `pegaflow_directory_queries_total`.
    pub async fn query_prefix(
        &self,
        namespace: &str,
        group: u32,
        hashes: &[Vec<u8>],
    ) -> Vec<NodePrefix> {
        let s = &self.shared;
        let outcome = |o: &str| s.metrics.queries.with_label_values(&[o]).inc();
        if hashes.is_empty() {
            return Vec::new();
        }
        if !self.is_up() {
            outcome("down");
            return Vec::new();
        }
        let ns = directory_namespace(namespace, group);
        let wait = Duration::from_millis(s.config.query_timeout_ms);
        match tokio::time::timeout(wait, s.dir.query_prefix(&ns, hashes, Some(&s.node.addr))).await
        {
            Ok(Ok(v)) => {
                outcome("ok");
                v
            }
            Ok(Err(e)) => {
                outcome("unavailable");
                tracing::debug!(error = %e, "directory query failed; answering local only");
                Vec::new()
            }
            Err(_) => {
                outcome("timeout");
                Vec::new()
            }
        }
    }

    /// Stops the publisher and unregisters this node (waiting at most 3 s for the
    /// directory, PegaFlow's bound, after the call in flight). Idempotent.
    pub async fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.stop.notify_one();
        let task = self.task.lock().take();
        if let Some(mut t) = task {
            // The call in flight ends within call_timeout_ms, the unregister within 3 s.
            let bound = Duration::from_millis(self.shared.config.call_timeout_ms)
                + UNREGISTER_TIMEOUT
                + Duration::from_secs(1);
            if tokio::time::timeout(bound, &mut t).await.is_err() {
                tracing::warn!("the directory client did not stop within {bound:?}; leaving without unregistering");
                t.abort();
            }
        }
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const UNREGISTER_TIMEOUT: Duration = Duration::from_secs(3);
/// Index events taken per wake-up before sending (bounds one loop turn).
const DRAIN_PER_TURN: usize = 65_536;

/// A backfill in progress: DRAM's keys, one index shard at a time.
struct Backfill {
    shard: usize,
    keys: Vec<BlockKey>,
    pos: usize,
    next_at: Instant,
}

struct Worker {
    shared: Arc<Shared>,
    store: Arc<TierStack>,
    rx: broadcast::Receiver<IndexEvent>,
    /// Netted pending operations: true = insert, false = remove.
    pending: HashMap<BlockKey, bool>,
    /// The directory has this session registered (a heartbeat succeeded).
    registered: bool,
    /// A full re-advertisement is due, and why.
    resync: Option<ResyncReason>,
    backfill: Option<Backfill>,
    heartbeat_every: Duration,
    next_heartbeat: Instant,
    backoff: Duration,
    /// Pending hashes failed to send: retry at this time.
    retry_at: Option<Instant>,
    /// When the next periodic re-insertion is due (`refresh_secs`).
    next_refresh: Option<Instant>,
    /// Keys whose insert call failed without an answer (a timeout): the directory may still
    /// apply it after a later removal of the key was applied. After the next heartbeat, the
    /// ones DRAM no longer holds are removed again.
    doubtful: std::collections::HashSet<BlockKey>,
    /// When the last doubtful key was noted.
    doubtful_since: Instant,
}

impl Worker {
    async fn run(mut self) {
        loop {
            let wake = self.next_wake();
            tokio::select! {
                biased;
                _ = self.shared.stop.notified() => break,
                r = self.rx.recv() => self.on_event(r),
                _ = tokio::time::sleep_until(wake) => {}
            }
            if self.shared.stopping.load(Ordering::SeqCst) {
                break;
            }
            self.drain_events();
            if Instant::now() >= self.next_heartbeat {
                self.heartbeat().await;
            }
            if !self.registered || !self.shared.up.load(Ordering::Relaxed) {
                continue;
            }
            if self.refresh_due() {
                self.need_resync(ResyncReason::Refresh);
            }
            if let Some(reason) = self.resync.take() {
                self.start_resync(reason).await;
            }
            if self.retry_at.is_none_or(|t| Instant::now() >= t) {
                self.send_pending().await;
            }
            self.backfill_step().await;
        }
        self.unregister().await;
    }

    /// Whether the periodic re-insertion should start now (none is running or due).
    fn refresh_due(&mut self) -> bool {
        let every = self.shared.config.refresh_secs;
        if every == 0 || self.resync.is_some() || self.backfill.is_some() {
            return false;
        }
        let now = Instant::now();
        let next = *self
            .next_refresh
            .get_or_insert(now + Duration::from_secs(every));
        if now < next {
            return false;
        }
        self.next_refresh = Some(now + Duration::from_secs(every));
        true
    }

    fn next_wake(&self) -> Instant {
        let mut t = self.next_heartbeat;
        if let Some(r) = self.next_refresh {
            t = t.min(r);
        }
        // While the directory is unreachable only the heartbeat's retry wakes the task.
        if !self.registered || !self.shared.up.load(Ordering::Relaxed) {
            return t;
        }
        if let Some(b) = &self.backfill {
            t = t.min(b.next_at);
        }
        if !self.pending.is_empty() {
            if let Some(r) = self.retry_at {
                t = t.min(r);
            }
        }
        t
    }

    fn on_event(&mut self, r: Result<IndexEvent, broadcast::error::RecvError>) {
        match r {
            Ok(ev) => self.note(ev),
            Err(broadcast::error::RecvError::Lagged(n)) => {
                self.shared.metrics.events_lagged.inc_by(n);
                tracing::warn!(
                    missed = n,
                    "directory publisher fell behind the index events; re-advertising DRAM"
                );
                self.need_resync(ResyncReason::EventsLagged);
            }
            Err(broadcast::error::RecvError::Closed) => {}
        }
    }

    fn drain_events(&mut self) {
        for _ in 0..DRAIN_PER_TURN {
            match self.rx.try_recv() {
                Ok(ev) => self.note(ev),
                Err(broadcast::error::TryRecvError::Lagged(n)) => {
                    self.on_event(Err(broadcast::error::RecvError::Lagged(n)))
                }
                Err(_) => break,
            }
        }
        self.shared.metrics.pending.set(self.pending.len() as i64);
    }

    fn note(&mut self, ev: IndexEvent) {
        let insert = match ev.kind {
            IndexEventKind::Sealed | IndexEventKind::Promoted => true,
            IndexEventKind::Evicted => false,
            IndexEventKind::Demoted(_) => return,
        };
        // While a backfill that reads DRAM as it is will start, an insertion is superseded
        // (removals are always sent).
        if insert && self.resync.is_some_and(ResyncReason::supersedes_events) {
            return;
        }
        let depth = self.shared.config.queue_depth;
        if self.pending.len() >= depth && !self.pending.contains_key(&ev.key) {
            if insert {
                self.shared.metrics.registration_queue_full.inc();
                self.need_resync(ResyncReason::InsertsDropped);
            } else {
                self.shared.metrics.removal_queue_full.inc();
                self.need_resync(ResyncReason::RemovalsDropped);
            }
            return;
        }
        self.pending.insert(ev.key, insert);
    }

    /// Schedules a re-advertisement; a stronger reason replaces a weaker one.
    fn need_resync(&mut self, reason: ResyncReason) {
        match self.resync {
            None => self.resync = Some(reason),
            Some(r) if r.adds_only() && !reason.adds_only() => self.resync = Some(reason),
            Some(_) => {}
        }
        if reason.supersedes_events() {
            // The backfill re-reads DRAM for insertions; removals are still sent (a directory
            // that only seemed to lose its state must not keep an evicted block).
            self.pending.retain(|_, insert| !*insert);
        }
        self.backfill = None;
    }

    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, DirectoryError>>,
    ) -> Result<T, DirectoryError> {
        let wait = Duration::from_millis(self.shared.config.call_timeout_ms);
        match tokio::time::timeout(wait, f).await {
            Ok(r) => r,
            Err(_) => Err(DirectoryError::Unavailable(format!(
                "no answer within {} ms",
                wait.as_millis()
            ))),
        }
    }

    fn set_up(&self, up: bool, detail: String) {
        let was = self.shared.up.swap(up, Ordering::Relaxed);
        self.shared.metrics.up.set(up as i64);
        let kind = self.shared.dir.kind();
        if up {
            if !was {
                tracing::info!(directory = kind, node = %self.shared.node.addr, "directory reachable");
            }
            self.shared
                .health
                .report(HEALTH, HealthState::Ok, format!("{kind} directory: up"));
        } else {
            if was {
                tracing::warn!(directory = kind, error = %detail, "directory unreachable; queries answer local only until it is back");
            }
            self.shared.health.report(
                HEALTH,
                HealthState::Degraded,
                format!("{kind} directory unreachable: {detail}"),
            );
        }
    }

    async fn heartbeat(&mut self) {
        let s = self.shared.clone();
        match self.call(s.dir.heartbeat(&s.node)).await {
            Ok(a) => {
                self.set_up(true, String::new());
                self.backoff = BACKOFF_MIN;
                self.heartbeat_every = (a.stale_after / 2).max(Duration::from_secs(1));
                self.next_heartbeat = Instant::now() + self.heartbeat_every;
                if a.state_lost {
                    if self.registered {
                        s.metrics.session_resets.inc();
                        tracing::warn!(directory = s.dir.kind(), "the directory lost this node's entries (restart, flush or expiry); re-advertising DRAM");
                        self.need_resync(ResyncReason::StateLost);
                    } else if self.resync.is_none() {
                        self.need_resync(ResyncReason::StateLost);
                    }
                }
                self.registered = true;
                self.recheck_doubtful();
            }
            Err(e) => {
                s.metrics.heartbeat_failures.inc();
                if matches!(e, DirectoryError::SessionConflict(_)) {
                    tracing::error!(node = %s.node.addr, error = %e, "another live server advertises this address; set [directory] advertise_addr to this server's own address");
                }
                self.set_up(false, e.to_string());
                self.next_heartbeat = Instant::now() + self.backoff.min(self.heartbeat_every);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
            }
        }
    }

    async fn start_resync(&mut self, reason: ResyncReason) {
        let s = self.shared.clone();
        if reason.forgets() {
            if let Err(e) = self.call(s.dir.resync(&s.node)).await {
                tracing::warn!(error = %e, "directory resync failed; retrying after the next heartbeat");
                self.resync = Some(reason);
                self.set_up(false, e.to_string());
                return;
            }
        }
        s.metrics.resyncs.with_label_values(&[reason.label()]).inc();
        tracing::info!(
            reason = reason.label(),
            blocks = self.store.index().resident_blocks(),
            "advertising every block DRAM holds"
        );
        if reason.supersedes_events() {
            self.pending.retain(|_, insert| !*insert);
        }
        self.backfill = Some(Backfill {
            shard: 0,
            keys: self.store.index().shard_keys(0),
            pos: 0,
            next_at: Instant::now(),
        });
    }

    /// Sends the pending map: removals first, then insertions of keys DRAM still holds.
    async fn send_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let mut removes: HashMap<String, Vec<BlockKey>> = HashMap::new();
        let mut inserts: HashMap<String, Vec<BlockKey>> = HashMap::new();
        for (k, insert) in pending {
            let ns = directory_namespace(&k.namespace, k.group).into_owned();
            if insert {
                inserts.entry(ns).or_default().push(k);
            } else {
                removes.entry(ns).or_default().push(k);
            }
        }
        let mut failed = false;
        let batches = removes
            .into_iter()
            .map(|(ns, keys)| (ns, keys, false))
            .chain(inserts.into_iter().map(|(ns, keys)| (ns, keys, true)));
        for (ns, keys, insert) in batches {
            if failed {
                // After one failure the rest waits for the retry, unsent.
                for k in keys {
                    self.pending.entry(k).or_insert(insert);
                }
                continue;
            }
            failed = !self.send(&ns, keys, insert, true).await;
        }
        self.shared.metrics.pending.set(self.pending.len() as i64);
        if failed {
            self.retry_at = Some(Instant::now() + self.backoff);
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        } else {
            self.retry_at = None;
        }
    }

    /// One namespace's keys, in batches; stops at the first failed batch (the directory is
    /// unlikely to answer the next one sooner). With `requeue`, the keys not sent go back to
    /// the pending map unless a newer event for the key arrived meanwhile (the backfill
    /// re-reads its own instead). False when a batch failed.
    async fn send(
        &mut self,
        ns: &str,
        mut keys: Vec<BlockKey>,
        insert: bool,
        requeue: bool,
    ) -> bool {
        if insert {
            // The index itself, not the store's lookup: that one would take a block back from
            // the demotion queue (undoing an eviction) just because we looked.
            keys.retain(|k| self.store.index().contains(k.as_ref()));
        }
        let s = self.shared.clone();
        let batch = s.config.max_batch_hashes;
        for (i, chunk) in keys.chunks(batch).enumerate() {
            let hashes: Vec<Vec<u8>> = chunk.iter().map(|k| k.hash.to_vec()).collect();
            let r = if insert {
                self.call(s.dir.insert(&s.node, ns, &hashes))
                    .await
                    .map(|_| ())
            } else {
                self.call(s.dir.remove(&s.node, ns, &hashes))
                    .await
                    .map(|_| ())
            };
            match r {
                Ok(()) if insert => s.metrics.registration_blocks.inc_by(chunk.len() as u64),
                Ok(()) => s.metrics.removal_blocks.inc_by(chunk.len() as u64),
                Err(e) => {
                    if insert {
                        s.metrics.registration_failures.inc();
                    } else {
                        s.metrics.removal_failures.inc();
                    }
                    tracing::debug!(error = %e, hashes = chunk.len(), insert, "directory call failed; will retry");
                    if matches!(e, DirectoryError::UnknownNode(_)) {
                        // The directory forgot us between heartbeats: heartbeat now; it
                        // reports the lost state and a backfill follows.
                        self.next_heartbeat = Instant::now();
                    }
                    if insert && matches!(e, DirectoryError::Unavailable(_)) {
                        self.note_doubtful(chunk);
                    }
                    if requeue {
                        for k in &keys[i * batch..] {
                            self.pending.entry(k.clone()).or_insert(insert);
                        }
                    }
                    return false;
                }
            }
        }
        true
    }

    /// Remembers keys of an unanswered insert (bounded by `queue_depth`; beyond it the
    /// session's entries are forgotten and DRAM re-advertised instead).
    fn note_doubtful(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if self.doubtful.len() >= self.shared.config.queue_depth {
                self.doubtful.clear();
                self.need_resync(ResyncReason::RemovalsDropped);
                return;
            }
            self.doubtful.insert(k.clone());
        }
        self.doubtful_since = Instant::now();
    }

    /// After a heartbeat at least one call timeout after the last unanswered insert: the
    /// doubtful keys DRAM no longer holds are removed again (a late insert may have landed
    /// after their removal).
    fn recheck_doubtful(&mut self) {
        let settle = Duration::from_millis(self.shared.config.call_timeout_ms);
        if self.doubtful.is_empty() || self.doubtful_since.elapsed() < settle {
            return;
        }
        let store = self.store.clone();
        for k in std::mem::take(&mut self.doubtful) {
            if !store.index().contains(k.as_ref()) {
                self.pending.entry(k).or_insert(false);
            }
        }
    }

    /// Re-inserts the next slice of DRAM's keys, at the configured rate.
    async fn backfill_step(&mut self) {
        let Some(mut b) = self.backfill.take() else {
            return;
        };
        if Instant::now() < b.next_at {
            self.backfill = Some(b);
            return;
        }
        let rate = self.shared.config.backfill_blocks_per_sec;
        let chunk = ((rate / 10).max(1) as usize).min(self.shared.config.max_batch_hashes);
        let shards = self.store.index().shard_count();
        while b.pos >= b.keys.len() {
            b.shard += 1;
            if b.shard >= shards {
                tracing::info!("backfill done");
                return;
            }
            b.keys = self.store.index().shard_keys(b.shard);
            b.pos = 0;
        }
        let began = Instant::now();
        let start = b.pos;
        let end = (b.pos + chunk).min(b.keys.len());
        let slice: Vec<BlockKey> = b.keys[start..end].to_vec();
        let mut by_ns: HashMap<String, Vec<BlockKey>> = HashMap::new();
        for k in slice {
            by_ns
                .entry(directory_namespace(&k.namespace, k.group).into_owned())
                .or_default()
                .push(k);
        }
        let n = (end - start) as u64;
        let mut ok = true;
        for (ns, keys) in by_ns {
            // Only keys DRAM still holds are sent; a failed slice is sent again after the
            // backoff (inserting twice is harmless), never parked in the pending map.
            if !self.send(&ns, keys, true, false).await {
                ok = false;
                break;
            }
        }
        if ok {
            b.pos = end;
            self.shared.metrics.backfill_blocks.inc_by(n);
            // Paced from the slice's start: the insert's own time counts toward the rate.
            b.next_at = began + Duration::from_secs_f64(n.max(1) as f64 / rate as f64);
            self.backoff = BACKOFF_MIN;
        } else {
            b.next_at = Instant::now() + self.backoff;
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        }
        self.backfill = Some(b);
    }

    async fn unregister(&mut self) {
        if !self.registered {
            return;
        }
        let s = self.shared.clone();
        match tokio::time::timeout(UNREGISTER_TIMEOUT, s.dir.unregister(&s.node)).await {
            Ok(Ok(n)) => {
                tracing::info!(node = %s.node.addr, entries = n, "unregistered from the directory")
            }
            Ok(Err(e)) => {
                s.metrics.unregister_failures.inc();
                tracing::warn!(error = %e, "directory unregister failed; the entries expire with the node's session");
            }
            Err(_) => {
                s.metrics.unregister_failures.inc();
                tracing::warn!("directory unregister timed out after 3 s; the entries expire with the node's session");
            }
        }
        self.set_up(false, "stopped".into());
    }
}
