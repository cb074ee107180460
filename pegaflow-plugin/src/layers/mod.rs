//! The layers every binary links, registered through `inventory` like any backend's:
//!
//! - `metrics` (tiers and transports): counts every call by outcome, its duration and the
//!   bytes it moved (`pegaflow_tier_ops_total`, `pegaflow_tier_op_duration_seconds`,
//!   `pegaflow_tier_op_bytes_total`; for transports the `pegaflow_transport_*` families);
//! - `fault` (tiers and transports): injects failures and delays from its settings
//!   (`fail_every`, `fail_next`, `delay_ms`), for staging and tests (see [`fault`]);
//! - `admission` (tiers): a second-sighting filter before a tier's writes: a block is
//!   written only when its key was seen before (an earlier put attempt, or a lookup that
//!   missed it), so blocks used once never cost a write (SSD lifespan). Rejections count in
//!   `pegaflow_cache_block_admission_rejections_total`.
//!
//! Each forwards every trait method explicitly (the traits have no default methods), and
//! owns its metric families ([`TierOpMetrics`], [`TransportBatchMetrics`],
//! [`AdmissionMetrics`]), shared by every instance through [`MetricsRegistry::shared`].

pub mod fault;

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

use crate::block::{BlockKey, BlockShape};
use crate::metrics::MetricsRegistry;
use crate::{
    check_parses, defaults_of, parse_settings, ConfigSchema, CopyBatch, HostRegion, LayerContext,
    LayerFactory, MemorySpace, OpParts, PluginOption, Recovered, Tier, TierCapabilities, TierError,
    TierGet, TierPut, Transport, TransportError,
};
use fault::{FaultControl, FaultyTier, FaultyTransport};

/// The `metrics` layer's settings: none.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsLayerConfig {}

fn outcome<T>(r: &Result<T, TierError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(TierError::Full(_)) => "full",
        Err(TierError::Unavailable(_)) => "unavailable",
        Err(TierError::Corrupt(_)) => "corrupt",
        Err(TierError::NotFound) => "not_found",
    }
}

fn exp_buckets(start: f64, factor: f64, n: usize) -> Vec<f64> {
    prometheus::exponential_buckets(start, factor, n).expect("valid buckets")
}

/// Registers `m` in `r` and returns it.
///
/// # Panics
/// When the family is invalid or its name is registered already (a bug: each family has one
/// owner, and shared ones are built once by [`MetricsRegistry::shared`]).
fn reg<M: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    m: prometheus::Result<M>,
) -> M {
    let m = m.expect("valid metric family");
    r.register(Box::new(m.clone()))
        .expect("a metric family registered once");
    m
}

/// The `metrics` layer's families for tiers, shared by every metered tier.
#[derive(Clone)]
pub struct TierOpMetrics {
    /// `pegaflow_tier_ops_total{tier,op,outcome}`: operations by tier, op and outcome.
    pub ops: IntCounterVec,
    /// `pegaflow_tier_op_duration_seconds{tier,op}`.
    pub duration: HistogramVec,
    /// `pegaflow_tier_op_bytes_total{tier,op}`: bytes put and got.
    pub bytes: IntCounterVec,
}

impl TierOpMetrics {
    /// The families in `m` (registered the first time).
    pub fn of(m: &MetricsRegistry) -> Self {
        m.shared(|r| Self {
            ops: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_tier_ops_total",
                        "Lower-tier operations by tier, op and outcome",
                    ),
                    &["tier", "op", "outcome"],
                ),
            ),
            duration: reg(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "pegaflow_tier_op_duration_seconds",
                        "Lower-tier operation duration",
                    )
                    .buckets(exp_buckets(1e-5, 4.0, 12)),
                    &["tier", "op"],
                ),
            ),
            bytes: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_tier_op_bytes_total",
                        "Bytes written (put) and read (get) by lower tiers",
                    ),
                    &["tier", "op"],
                ),
            ),
        })
    }
}

/// The `metrics` layer's families for transports, shared by every metered transport.
#[derive(Clone)]
pub struct TransportBatchMetrics {
    /// `pegaflow_transport_batches_total{transport,direction,outcome}`.
    pub batches: IntCounterVec,
    /// `pegaflow_transport_bytes_total{transport,direction}`: bytes of successful batches.
    pub bytes: IntCounterVec,
    /// `pegaflow_transport_batch_duration_seconds{transport,direction}`.
    pub duration: HistogramVec,
}

impl TransportBatchMetrics {
    /// The families in `m` (registered the first time).
    pub fn of(m: &MetricsRegistry) -> Self {
        m.shared(|r| Self {
            batches: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_transport_batches_total",
                        "Copy batches by transport, direction and outcome (metrics layer)",
                    ),
                    &["transport", "direction", "outcome"],
                ),
            ),
            bytes: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_transport_bytes_total",
                        "Bytes moved by successful copy batches (metrics layer)",
                    ),
                    &["transport", "direction"],
                ),
            ),
            duration: reg(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "pegaflow_transport_batch_duration_seconds",
                        "Copy batch duration (metrics layer)",
                    )
                    .buckets(exp_buckets(1e-5, 4.0, 12)),
                    &["transport", "direction"],
                ),
            ),
        })
    }
}

/// The `admission` layer's families. `pegaflow_cache_block_admission_rejections_total` is
/// PegaFlow's name (its TinyLFU admission counts there), so the runtime registers these up
/// front: a dashboard finds the family at 0 when no tier has the layer.
#[derive(Clone)]
pub struct AdmissionMetrics {
    /// Blocks an admission filter kept out of a tier.
    pub rejections: IntCounter,
    /// Blocks an admission filter let through to its tier (this server's own).
    pub admissions: IntCounter,
}

impl AdmissionMetrics {
    /// The families in `m` (registered the first time).
    pub fn of(m: &MetricsRegistry) -> Self {
        m.shared(|r| Self {
            rejections: reg(
                r,
                IntCounter::new(
                    "pegaflow_cache_block_admission_rejections_total",
                    "Blocks an admission filter kept out of a tier",
                ),
            ),
            admissions: reg(
                r,
                IntCounter::new(
                    "pegaflow_cache_block_admissions_total",
                    "Blocks an admission filter let through to a tier",
                ),
            ),
        })
    }
}

/// The `metrics` layer around a tier.
pub struct MeteredTier {
    inner: Arc<dyn Tier>,
    m: TierOpMetrics,
}

impl MeteredTier {
    /// Wraps `inner`, counting into the [`TierOpMetrics`] of `ctx.metrics`.
    pub fn new(inner: Arc<dyn Tier>, ctx: LayerContext) -> Self {
        Self {
            inner,
            m: TierOpMetrics::of(&ctx.metrics),
        }
    }

    /// One batch of `op` (`put` or `get`): each block's outcome, the batch's duration (as
    /// `<op>_batch`) and the bytes of the blocks that succeeded.
    fn record_batch(&self, op: &str, t0: Instant, lens: &[u64], results: &[Result<(), TierError>]) {
        let k = self.inner.kind();
        let m = &self.m;
        for r in results {
            m.ops.with_label_values(&[k, op, outcome(r)]).inc();
        }
        let bytes: u64 = results
            .iter()
            .zip(lens)
            .filter(|(r, _)| r.is_ok())
            .map(|(_, l)| l)
            .sum();
        self.record(&format!("{op}_batch"), "ok", t0);
        if bytes > 0 {
            m.bytes.with_label_values(&[k, op]).inc_by(bytes);
        }
    }

    /// One call of `op`: its outcome and duration.
    fn record(&self, op: &str, outcome: &str, t0: Instant) {
        let m = &self.m;
        let k = self.inner.kind();
        m.ops.with_label_values(&[k, op, outcome]).inc();
        m.duration
            .with_label_values(&[k, op])
            .observe(t0.elapsed().as_secs_f64());
    }
}

#[async_trait]
impl Tier for MeteredTier {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn capabilities(&self) -> TierCapabilities {
        self.inner.capabilities()
    }
    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }
    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        let t0 = Instant::now();
        let r = self.inner.lookup(keys).await;
        self.record("lookup", outcome(&r), t0);
        r
    }
    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        let t0 = Instant::now();
        let lens: Vec<u64> = blocks.iter().map(|b| b.block.len_bytes()).collect();
        let r = self.inner.put(blocks).await;
        self.record_batch("put", t0, &lens, &r);
        r
    }
    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        let t0 = Instant::now();
        let lens: Vec<u64> = reads.iter().map(|g| g.shape.len_bytes()).collect();
        let r = self.inner.get(reads).await;
        self.record_batch("get", t0, &lens, &r);
        r
    }
    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        let t0 = Instant::now();
        let r = self.inner.remove(keys).await;
        self.record("remove", outcome(&r), t0);
        r
    }
    async fn flush(&self) -> Result<(), TierError> {
        let t0 = Instant::now();
        let r = self.inner.flush().await;
        self.record("flush", outcome(&r), t0);
        r
    }
    async fn recover(&self) -> Result<Recovered, TierError> {
        let t0 = Instant::now();
        let r = self.inner.recover().await;
        self.record("recover", outcome(&r), t0);
        r
    }
}

/// The `metrics` layer around a transport.
pub struct MeteredTransport {
    inner: Arc<dyn Transport>,
    m: TransportBatchMetrics,
}

#[async_trait]
impl Transport for MeteredTransport {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn can_address(&self, space: MemorySpace) -> bool {
        self.inner.can_address(space)
    }
    fn install_host_memory(&self, regions: &[HostRegion]) -> Result<(), TransportError> {
        self.inner.install_host_memory(regions)
    }
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        let (dir, bytes) = (batch.direction, batch_bytes(&batch));
        let t0 = Instant::now();
        let r = self.inner.copy(batch).await;
        self.record(dir, bytes, t0, &r);
        r
    }
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let (dir, head) = (batch.direction, batch_bytes(&batch));
        let tally = parts.tally();
        let t0 = Instant::now();
        let r = self.inner.copy_parts(batch, parts).await;
        self.record(dir, head + tally.bytes(), t0, &r);
        r
    }
}

fn batch_bytes(batch: &CopyBatch) -> u64 {
    batch.ops.iter().map(|o| o.len as u64).sum()
}

impl MeteredTransport {
    /// Counts one finished batch of `bytes` begun at `t0`.
    fn record(
        &self,
        dir: crate::Direction,
        bytes: u64,
        t0: Instant,
        r: &Result<(), TransportError>,
    ) {
        let dir = match dir {
            crate::Direction::ToHost => "d2h",
            crate::Direction::ToDevice => "h2d",
        };
        let k = self.inner.kind();
        let m = &self.m;
        m.batches
            .with_label_values(&[k, dir, if r.is_ok() { "ok" } else { "failed" }])
            .inc();
        m.duration
            .with_label_values(&[k, dir])
            .observe(t0.elapsed().as_secs_f64());
        if r.is_ok() {
            m.bytes.with_label_values(&[k, dir]).inc_by(bytes);
        }
    }
}

fn metrics_tier(
    inner: Arc<dyn Tier>,
    t: &toml::Table,
    ctx: &LayerContext,
) -> anyhow::Result<Arc<dyn Tier>> {
    let _: MetricsLayerConfig = parse_settings("metrics layer", t)?;
    Ok(Arc::new(MeteredTier::new(inner, ctx.clone())))
}

fn metrics_transport(
    inner: Arc<dyn Transport>,
    t: &toml::Table,
    ctx: &LayerContext,
) -> anyhow::Result<Arc<dyn Transport>> {
    let _: MetricsLayerConfig = parse_settings("metrics layer", t)?;
    Ok(Arc::new(MeteredTransport {
        inner,
        m: TransportBatchMetrics::of(&ctx.metrics),
    }))
}

/// The `fault` layer's settings.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FaultLayerConfig {
    /// Every k-th gated call fails (0 = never).
    #[serde(default)]
    pub fail_every: u64,
    /// The first n gated calls fail.
    #[serde(default)]
    pub fail_next: u64,
    /// Every gated call waits this long first, in milliseconds.
    #[serde(default)]
    pub delay_ms: u64,
}

impl FaultLayerConfig {
    fn control(&self) -> Arc<FaultControl> {
        let c = FaultControl::new();
        c.fail_every(self.fail_every);
        c.fail_next(self.fail_next);
        c.set_delay(Duration::from_millis(self.delay_ms));
        c
    }
}

fn fault_tier(
    inner: Arc<dyn Tier>,
    t: &toml::Table,
    _ctx: &LayerContext,
) -> anyhow::Result<Arc<dyn Tier>> {
    let cfg: FaultLayerConfig = parse_settings("fault layer", t)?;
    tracing::warn!(
        tier = inner.kind(),
        ?cfg,
        "fault injection layer active on a tier"
    );
    Ok(Arc::new(FaultyTier::with_control(inner, cfg.control())))
}

fn fault_transport(
    inner: Arc<dyn Transport>,
    t: &toml::Table,
    _ctx: &LayerContext,
) -> anyhow::Result<Arc<dyn Transport>> {
    let cfg: FaultLayerConfig = parse_settings("fault layer", t)?;
    tracing::warn!(
        transport = inner.kind(),
        ?cfg,
        "fault injection layer active on a transport"
    );
    Ok(Arc::new(FaultyTransport::with_control(
        inner,
        cfg.control(),
    )))
}

/// The `admission` layer's settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Keys remembered as seen once; when full, the memory is cleared (a new window starts).
    #[serde(default = "default_window")]
    pub window_keys: usize,
}

fn default_window() -> usize {
    1 << 20
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            window_keys: default_window(),
        }
    }
}

/// The `admission` layer: writes a block to the tier only on its second sighting.
pub struct AdmissionTier {
    inner: Arc<dyn Tier>,
    seen: Mutex<HashSet<u64>>,
    window: usize,
    hasher: hashbrown::DefaultHashBuilder,
    m: AdmissionMetrics,
}

impl AdmissionTier {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Tier>, config: &AdmissionConfig, ctx: LayerContext) -> Self {
        Self {
            inner,
            seen: Mutex::new(HashSet::new()),
            window: config.window_keys.max(1),
            hasher: hashbrown::DefaultHashBuilder::default(),
            m: AdmissionMetrics::of(&ctx.metrics),
        }
    }

    fn fingerprint(&self, k: &BlockKey) -> u64 {
        self.hasher.hash_one(k)
    }

    /// Records a sighting; true when the key had been seen before.
    fn sight(&self, k: &BlockKey) -> bool {
        let f = self.fingerprint(k);
        let mut s = self.seen.lock();
        if s.remove(&f) {
            return true;
        }
        if s.len() >= self.window {
            s.clear();
        }
        s.insert(f);
        false
    }

    /// Records that the key was wanted (a lookup missed it) without consuming an earlier
    /// sighting: however often a block is asked for before it is saved, its first put is
    /// its second sighting.
    fn note(&self, k: &BlockKey) {
        let f = self.fingerprint(k);
        let mut s = self.seen.lock();
        if s.len() >= self.window && !s.contains(&f) {
            s.clear();
        }
        s.insert(f);
    }
}

#[async_trait]
impl Tier for AdmissionTier {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn capabilities(&self) -> TierCapabilities {
        self.inner.capabilities()
    }
    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }
    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        let r = self.inner.lookup(keys).await?;
        // Every key past the held prefix was wanted and missing: each counts as a sighting
        // (a client queries a request's blocks before it saves them, so a block saved after
        // a miss is admitted when it is demoted; one saved blindly waits for a second save).
        for k in keys.iter().skip(r.len()) {
            self.note(k);
        }
        Ok(r)
    }
    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        let mut admitted = Vec::new();
        let mut slots = Vec::with_capacity(blocks.len());
        for b in blocks {
            if self.sight(&b.key) {
                slots.push(Some(admitted.len()));
                admitted.push(b);
            } else {
                slots.push(None);
            }
        }
        let rejected = slots.iter().filter(|s| s.is_none()).count() as u64;
        if !admitted.is_empty() {
            self.m.admissions.inc_by(admitted.len() as u64);
        }
        if rejected > 0 {
            self.m.rejections.inc_by(rejected);
        }
        let results = if admitted.is_empty() {
            Vec::new()
        } else {
            self.inner.put(admitted).await
        };
        slots
            .into_iter()
            .map(|s| match s {
                Some(i) => results
                    .get(i)
                    .cloned()
                    .unwrap_or(Err(TierError::Unavailable("no result".into()))),
                None => Err(TierError::Full(
                    "not admitted: first sighting of this block (admission layer)".into(),
                )),
            })
            .collect()
    }
    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        self.inner.get(reads).await
    }
    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        self.inner.remove(keys).await
    }
    async fn flush(&self) -> Result<(), TierError> {
        self.inner.flush().await
    }
    async fn recover(&self) -> Result<Recovered, TierError> {
        self.inner.recover().await
    }
}

fn admission_tier(
    inner: Arc<dyn Tier>,
    t: &toml::Table,
    ctx: &LayerContext,
) -> anyhow::Result<Arc<dyn Tier>> {
    let cfg: AdmissionConfig = parse_settings("admission layer", t)?;
    Ok(Arc::new(AdmissionTier::new(inner, &cfg, ctx.clone())))
}

inventory::submit! {
    LayerFactory {
        name: "metrics",
        summary: "counts every call by outcome, its duration and bytes (pegaflow_tier_*, pegaflow_transport_*)",
        config: ConfigSchema {
            defaults: defaults_of::<MetricsLayerConfig>,
            check: check_parses::<MetricsLayerConfig>,
            options: &[],
        },
        wrap_tier: Some(metrics_tier),
        wrap_transport: Some(metrics_transport),
    }
}

inventory::submit! {
    LayerFactory {
        name: "fault",
        summary: "injects failures and delays (staging and tests; never in production)",
        config: ConfigSchema {
            defaults: defaults_of::<FaultLayerConfig>,
            check: check_parses::<FaultLayerConfig>,
            options: &[
                PluginOption { name: "fail_every", help: "every k-th call fails (0 = never)" },
                PluginOption { name: "fail_next", help: "the first n calls fail" },
                PluginOption { name: "delay_ms", help: "each call waits this long first (milliseconds)" },
            ],
        },
        wrap_tier: Some(fault_tier),
        wrap_transport: Some(fault_transport),
    }
}

inventory::submit! {
    LayerFactory {
        name: "admission",
        summary: "writes a block to the tier only on its second sighting (put or missed lookup); --enable-lfu-admission adds it to every lower tier",
        config: ConfigSchema {
            defaults: defaults_of::<AdmissionConfig>,
            check: check_parses::<AdmissionConfig>,
            options: &[
                PluginOption { name: "window_keys", help: "keys remembered as seen once before the memory is cleared" },
            ],
        },
        wrap_tier: Some(admission_tier),
        wrap_transport: None,
    }
}
