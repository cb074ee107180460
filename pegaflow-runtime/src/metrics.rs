//! Prometheus metrics with PegaFlow's names, types and labels (`pegaflow-behavior.md` §8.2,
//! as its Prometheus exporter renders them: counters end in `_total`, durations in
//! `_seconds`), plus this server's own families where it measures more.
//!
//! Invariants a dashboard may rely on: `cache_block_hits_total + cache_block_misses_total` =
//! blocks asked for by group-0 queries; `pool_used_bytes <= pool_capacity_bytes`.

use pegaflow_plugin::layers::AdmissionMetrics;
use pegaflow_plugin::MetricsRegistry;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

/// Every metric family the server exports.
#[derive(Clone)]
pub struct Metrics {
    registry: MetricsRegistry,
    /// Allocatable host-tier bytes.
    pub pool_capacity_bytes: IntGauge,
    /// Allocated host-tier bytes.
    pub pool_used_bytes: IntGauge,
    /// Allocations that failed after eviction.
    pub pool_alloc_failures: IntCounter,
    /// Bytes of blocks saved in part (not yet sealed).
    pub inflight_bytes: IntGauge,
    /// Unsealed blocks dropped after their TTL, or when the instance that wrote them was
    /// unregistered.
    pub inflight_gc_cleaned: IntCounter,
    /// Saves whose seal job panicked on the seal thread (their blocks were never indexed).
    pub seal_failures: IntCounter,
    /// Seal jobs waiting for the seal thread.
    pub seal_queue_jobs: IntGauge,
    /// Footprint of indexed blocks, in bytes.
    pub cache_resident_bytes: IntGauge,
    /// Indexed blocks, by class (`retained`: local saves).
    pub cache_resident_blocks: IntGaugeVec,
    /// Blocks found by group-0 queries.
    pub cache_block_hits: IntCounter,
    /// Blocks asked for by group-0 queries and not found.
    pub cache_block_misses: IntCounter,
    /// Query decisions per block, by tier (`ram`, `ssd`, `rdma`, `miss`).
    pub cache_tier_block_requests: IntCounterVec,
    /// New index entries.
    pub cache_block_insertions: IntCounter,
    /// Blocks removed from the index by pressure or cleanup.
    pub cache_block_evictions: IntCounter,
    /// Evictions by class.
    pub cache_block_evictions_by_class: IntCounterVec,
    /// Blocks removed by cleanup while still referenced (leased or loading).
    pub cache_block_evictions_still_referenced: IntCounter,
    /// Pool bytes actually freed by evictions.
    pub cache_eviction_reclaimed_bytes: IntCounter,
    /// Time from insertion to removal, by reason (`pressure`, `cleanup`).
    pub cache_residence_duration: HistogramVec,
    /// Blocks evicted in the background to keep the evict-ahead reserve free (counted in
    /// `cache_block_evictions` too).
    pub cache_evictions_ahead: IntCounter,
    /// Blocks an allocation evicted on its own path, because the free memory did not cover
    /// it: evict-ahead off or behind, or a request larger than the reserve (counted in
    /// `cache_block_evictions` too).
    pub cache_evictions_inline: IntCounter,
    /// Host bytes evict-ahead keeps free now: the recent largest allocation, capped at
    /// `evict_ahead_percent` of the pool; 0 when off.
    pub cache_evict_ahead_target_bytes: IntGauge,
    /// Bytes copied by Save.
    pub save_bytes: IntCounter,
    /// Save RPC copy duration.
    pub save_duration: Histogram,
    /// Queries that waited for an answered Save's copy past the limit (10 s) and answered
    /// without its blocks (a wedged copy).
    pub query_acked_wait_timeouts: IntCounter,
    /// Saves answered OK once their device memory was read (`[server] save_answer_early`)
    /// that failed afterwards, on the way to host memory: their blocks were not stored.
    pub save_late_failures: IntCounter,
    /// Bytes copied by Load.
    pub load_bytes: IntCounter,
    /// Load copy duration.
    pub load_duration: Histogram,
    /// Loads that failed: refused by validation, or a copy that failed.
    pub load_failures: IntCounter,
    /// RPCs by method and status (`ok` or the gRPC code).
    pub rpc_requests: IntCounterVec,
    /// RPC duration by method and status.
    pub rpc_duration: HistogramVec,
    /// Requests whose body did not decode (answered INVALID_ARGUMENT), by method (this
    /// server).
    pub rpc_undecodable_requests: IntCounterVec,
    /// Live leases (this server).
    pub leases_active: IntGauge,
    /// Leases that expired before they were loaded or released (this server).
    pub leases_expired: IntCounter,
    /// Registered instances (this server).
    pub instances: IntGauge,
    /// Copies that failed, by direction (this server).
    pub transfer_failures: IntCounterVec,
    /// Side-channel events, by kind (this server).
    pub fd_channel_events: IntCounterVec,
    /// Descriptors waiting on the side channel (this server).
    pub fd_channel_pending: IntGauge,
    /// Demotions from host DRAM to a lower tier, by tier and outcome (`written`, `failed`,
    /// `dropped_queue_full`, `dropped_shutdown`) (this server).
    pub tier_demotions: IntCounterVec,
    /// Blocks and bytes waiting in the demotion queue (this server).
    pub tier_demotion_queue_blocks: IntGauge,
    /// Bytes waiting in the demotion queue (this server).
    pub tier_demotion_queue_bytes: IntGauge,
    /// Blocks promoted into host DRAM or not, by tier and outcome (`promoted`, `failed`,
    /// `missing`) (this server).
    pub tier_promotions: IntCounterVec,
    /// Lower-tier lookups whose continuation stopped at a block of another slot layout than
    /// the querying instance's (the layout guard), by tier (this server).
    pub tier_layout_mismatches: IntCounterVec,
    /// Blocks a query did not promote because promotions in flight held the whole
    /// `max_promote_blocks` budget (this server).
    pub tier_promotion_backpressure_blocks: IntCounter,
    /// QueryPrefetch answers by outcome (`ready`, `loading`) (this server).
    pub query_answers: IntCounterVec,
    /// Promotion tasks not yet collected (this server).
    pub promotion_tasks: IntGauge,
    /// Bytes held by each lower tier (this server).
    pub tier_used_bytes: IntGaugeVec,
    /// Index events lost because a subscriber lagged (this server).
    pub index_events_lagged: IntCounter,
    /// Connections open, by listener (`grpc`, `http`) (this server).
    pub connections_open: IntGaugeVec,
    /// Connections accepted and closed at once because their listener's cap was reached, by
    /// listener (`grpc`, `http`) (this server).
    pub connections_refused: IntCounterVec,
    /// Time a Save or a Load spends in each of its phases inside the engine, in seconds, by
    /// `rpc` and `phase` (`pegaflow_rpc_phase_seconds`; this server). See [`SavePhase`] and
    /// [`LoadPhase`] for the phases; the series are resolved once, here.
    pub rpc_phases: RpcPhases,
}

/// The phases of a Save inside the engine, in order (the `phase` label of
/// `pegaflow_rpc_phase_seconds{rpc="save"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavePhase {
    /// Instance lookup, the flush barrier, the worker's gate and ranks, every layer and block
    /// id checked.
    Validate,
    /// One plan entry per block not yet resident (a residency check per hash).
    Plan,
    /// Host buffers from the pool, evicting least recently used blocks under pressure.
    Allocate,
    /// Building the copy ops, handed to the transport in parts while the first ones copy,
    /// and the batched device → host copy to completion.
    Copy,
    /// Sealing the complete blocks and indexing them, on the seal thread after the Save
    /// answered (not part of `total`).
    Seal,
    /// The whole Save in the engine up to its answer (validate + plan + allocate + copy).
    Total,
}

impl SavePhase {
    /// Every phase, in label order.
    pub const ALL: [SavePhase; 6] = [
        Self::Validate,
        Self::Plan,
        Self::Allocate,
        Self::Copy,
        Self::Seal,
        Self::Total,
    ];

    /// The `phase` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Validate => "validate",
            Self::Plan => "plan",
            Self::Allocate => "allocate",
            Self::Copy => "copy",
            Self::Seal => "seal",
            Self::Total => "total",
        }
    }
}

/// The phases of a Load inside the engine, in order (the `phase` label of
/// `pegaflow_rpc_phase_seconds{rpc="load"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadPhase {
    /// Completion word attached, worker, ranks and groups resolved, every lease and target
    /// checked.
    Validate,
    /// The leases consumed (the copy ops are built in the `copy` phase).
    Plan,
    /// Building the copy ops, handed to the transport in parts while the first ones copy,
    /// and the batched host → device copy to completion.
    Copy,
    /// The completion word written.
    Complete,
    /// The whole Load in the engine (for an asynchronous Load, until its copy completes).
    Total,
}

impl LoadPhase {
    /// Every phase, in label order.
    pub const ALL: [LoadPhase; 5] = [
        Self::Validate,
        Self::Plan,
        Self::Copy,
        Self::Complete,
        Self::Total,
    ];

    /// The `phase` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Validate => "validate",
            Self::Plan => "plan",
            Self::Copy => "copy",
            Self::Complete => "complete",
            Self::Total => "total",
        }
    }
}

/// The series of `pegaflow_rpc_phase_seconds`, resolved once so that timing a phase is one
/// `Instant::now()` and one histogram observation (per RPC, never per block).
#[derive(Clone)]
pub struct RpcPhases {
    family: HistogramVec,
    save: Vec<Histogram>,
    load: Vec<Histogram>,
}

impl RpcPhases {
    fn new(family: HistogramVec) -> Self {
        let save = SavePhase::ALL
            .iter()
            .map(|p| family.with_label_values(&["save", p.label()]))
            .collect();
        let load = LoadPhase::ALL
            .iter()
            .map(|p| family.with_label_values(&["load", p.label()]))
            .collect();
        Self { family, save, load }
    }

    /// The series of a Save phase.
    pub fn save(&self, p: SavePhase) -> &Histogram {
        &self.save[p as usize]
    }

    /// The series of a Load phase.
    pub fn load(&self, p: LoadPhase) -> &Histogram {
        &self.load[p as usize]
    }

    /// The family (for tests and dashboards).
    pub fn family(&self) -> &HistogramVec {
        &self.family
    }
}

/// Times consecutive phases of one RPC: each [`PhaseClock::lap`] observes the time since the
/// previous lap (or the start) into a phase's series.
#[derive(Debug, Clone, Copy)]
pub struct PhaseClock {
    start: std::time::Instant,
    last: std::time::Instant,
}

impl PhaseClock {
    /// Starts the clock now.
    pub fn start() -> Self {
        let now = std::time::Instant::now();
        Self {
            start: now,
            last: now,
        }
    }

    /// Observes the seconds since the previous lap into `h` and starts the next phase.
    pub fn lap(&mut self, h: &Histogram) {
        let now = std::time::Instant::now();
        h.observe(now.saturating_duration_since(self.last).as_secs_f64());
        self.last = now;
    }

    /// Observes the seconds since the start into `h`.
    pub fn total(&self, h: &Histogram) {
        h.observe(self.start.elapsed().as_secs_f64());
    }
}

fn exp_buckets(start: f64, factor: f64, n: usize) -> Vec<f64> {
    prometheus::exponential_buckets(start, factor, n).expect("valid buckets")
}

impl Metrics {
    /// Creates and registers every family in a fresh registry.
    pub fn new() -> Self {
        Self::new_in(&MetricsRegistry::new())
    }

    /// Creates and registers the runtime's families in `registry` (the one backends register
    /// theirs in, handed to them in their `RuntimeContext`). The admission layer's families
    /// are registered here too, so that PegaFlow's
    /// `pegaflow_cache_block_admission_rejections_total` is served at 0 without the layer.
    pub fn new_in(registry: &MetricsRegistry) -> Self {
        let _ = AdmissionMetrics::of(registry);
        let prom = registry.registry();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("valid metric");
                prom.register(Box::new(m.clone())).expect("unique metric");
                m
            }};
        }
        let g = |n: &str, h: &str| IntGauge::new(n, h);
        let c = |n: &str, h: &str| IntCounter::new(n, h);
        Self {
            pool_capacity_bytes: reg!(g(
                "pegaflow_pool_capacity_bytes",
                "Allocatable host pool bytes"
            )),
            pool_used_bytes: reg!(g("pegaflow_pool_used_bytes", "Allocated host pool bytes")),
            pool_alloc_failures: reg!(c(
                "pegaflow_pool_alloc_failures_total",
                "Host allocations failing after eviction"
            )),
            inflight_bytes: reg!(g(
                "pegaflow_inflight_bytes",
                "Bytes in blocks not yet sealed"
            )),
            inflight_gc_cleaned: reg!(c(
                "pegaflow_inflight_gc_cleaned_total",
                "Unsealed blocks dropped: stale past the in-flight TTL, or their writer's instance was unregistered"
            )),
            seal_failures: reg!(c(
                "pegaflow_seal_failures_total",
                "Saves whose seal job panicked: answered, but their blocks were never indexed"
            )),
            seal_queue_jobs: reg!(g(
                "pegaflow_seal_queue_jobs",
                "Answered Saves whose blocks wait for the seal thread"
            )),
            cache_resident_bytes: reg!(g(
                "pegaflow_cache_resident_bytes",
                "Footprint of indexed blocks"
            )),
            cache_resident_blocks: reg!(IntGaugeVec::new(
                Opts::new("pegaflow_cache_resident_blocks", "Indexed blocks by class"),
                &["class"]
            )),
            cache_block_hits: reg!(c(
                "pegaflow_cache_block_hits_total",
                "Blocks hit by prefix queries"
            )),
            cache_block_misses: reg!(c(
                "pegaflow_cache_block_misses_total",
                "Blocks missed by prefix queries"
            )),
            cache_tier_block_requests: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_cache_tier_block_requests_total",
                    "Per-block query decisions by tier"
                ),
                &["tier"]
            )),
            cache_block_insertions: reg!(c(
                "pegaflow_cache_block_insertions_total",
                "New index entries"
            )),
            cache_block_evictions: reg!(c(
                "pegaflow_cache_block_evictions_total",
                "Index removals by pressure or cleanup"
            )),
            cache_block_evictions_by_class: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_cache_block_evictions_by_class_total",
                    "Evictions by class"
                ),
                &["class"]
            )),
            cache_block_evictions_still_referenced: reg!(c(
                "pegaflow_cache_block_evictions_still_referenced_total",
                "Blocks removed while still referenced"
            )),
            cache_eviction_reclaimed_bytes: reg!(c(
                "pegaflow_cache_eviction_reclaimed_bytes_total",
                "Pool bytes freed by eviction"
            )),
            cache_residence_duration: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "pegaflow_cache_residence_duration_seconds",
                    "Insert to removal time"
                )
                .buckets(vec![
                    1.0,
                    10.0,
                    60.0,
                    300.0,
                    900.0,
                    3600.0,
                    4.0 * 3600.0,
                    24.0 * 3600.0
                ]),
                &["reason"]
            )),
            cache_evictions_ahead: reg!(c(
                "pegaflow_cache_evictions_ahead_total",
                "Blocks evicted in the background to keep the evict-ahead reserve free"
            )),
            cache_evictions_inline: reg!(c(
                "pegaflow_cache_evictions_inline_total",
                "Blocks an allocation evicted on its own path"
            )),
            cache_evict_ahead_target_bytes: reg!(g(
                "pegaflow_cache_evict_ahead_target_bytes",
                "Host bytes evict-ahead keeps free"
            )),
            save_bytes: reg!(c("pegaflow_save_bytes_total", "Bytes copied by Save")),
            save_duration: reg!(Histogram::with_opts(
                HistogramOpts::new("pegaflow_save_duration_seconds", "Save copy duration")
                    .buckets(exp_buckets(0.0001, 2.0, 18))
            )),
            query_acked_wait_timeouts: reg!(c(
                "pegaflow_query_acked_wait_timeouts_total",
                "Queries that gave up waiting for an answered Save's copy (10 s) and answered without its blocks"
            )),
            save_late_failures: reg!(c(
                "pegaflow_save_late_failures_total",
                "Saves answered when their device memory was read that failed afterwards (blocks not stored)"
            )),
            load_bytes: reg!(c("pegaflow_load_bytes_total", "Bytes copied by Load")),
            load_duration: reg!(Histogram::with_opts(
                HistogramOpts::new("pegaflow_load_duration_seconds", "Load copy duration")
                    .buckets(exp_buckets(0.0001, 2.0, 18))
            )),
            load_failures: reg!(c(
                "pegaflow_load_failures_total",
                "Loads that failed: refused by validation or a failed copy"
            )),
            rpc_requests: reg!(IntCounterVec::new(
                Opts::new("pegaflow_rpc_requests_total", "RPCs by method and status"),
                &["method", "status"]
            )),
            rpc_duration: reg!(HistogramVec::new(
                HistogramOpts::new("pegaflow_rpc_duration_seconds", "RPC duration").buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
                ]),
                &["method", "status"]
            )),
            rpc_undecodable_requests: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_rpc_undecodable_requests_total",
                    "Requests whose body did not decode, answered INVALID_ARGUMENT, by method"
                ),
                &["method"]
            )),
            leases_active: reg!(g("pegaflow_leases_active", "Live query leases")),
            leases_expired: reg!(c(
                "pegaflow_leases_expired_total",
                "Leases that expired unused"
            )),
            instances: reg!(g("pegaflow_instances", "Registered instances")),
            transfer_failures: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_transfer_failures_total",
                    "Failed copies by direction"
                ),
                &["direction"]
            )),
            fd_channel_events: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_fd_channel_events_total",
                    "Side-channel events by kind"
                ),
                &["event"]
            )),
            fd_channel_pending: reg!(g(
                "pegaflow_fd_channel_pending",
                "Descriptors received and not yet taken"
            )),
            tier_demotions: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_tier_demotions_total",
                    "Blocks demoted from host DRAM to a lower tier, by outcome"
                ),
                &["tier", "outcome"]
            )),
            tier_demotion_queue_blocks: reg!(g(
                "pegaflow_tier_demotion_queue_blocks",
                "Blocks waiting to be demoted"
            )),
            tier_demotion_queue_bytes: reg!(g(
                "pegaflow_tier_demotion_queue_bytes",
                "Bytes waiting to be demoted (host memory not yet freed)"
            )),
            tier_promotions: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_tier_promotions_total",
                    "Blocks promoted from a lower tier into host DRAM, by outcome"
                ),
                &["tier", "outcome"]
            )),
            tier_layout_mismatches: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_tier_layout_mismatches_total",
                    "Lower-tier continuations cut at a block of another slot layout than the querying instance's"
                ),
                &["tier"]
            )),
            tier_promotion_backpressure_blocks: reg!(c(
                "pegaflow_tier_promotion_backpressure_blocks_total",
                "Blocks not promoted because promotions in flight held the whole max_promote_blocks budget"
            )),
            query_answers: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_query_answers_total",
                    "QueryPrefetch answers by outcome (ready, loading)"
                ),
                &["outcome"]
            )),
            promotion_tasks: reg!(g(
                "pegaflow_promotion_tasks",
                "Promotion tasks running or waiting for their re-poll"
            )),
            tier_used_bytes: reg!(IntGaugeVec::new(
                Opts::new("pegaflow_tier_used_bytes", "Bytes held by each lower tier"),
                &["tier"]
            )),
            index_events_lagged: reg!(c(
                "pegaflow_index_events_lagged_total",
                "Index events a lagging subscriber missed"
            )),
            connections_open: reg!(IntGaugeVec::new(
                Opts::new("pegaflow_connections_open", "Connections open, by listener"),
                &["listener"]
            )),
            connections_refused: reg!(IntCounterVec::new(
                Opts::new(
                    "pegaflow_connections_refused_total",
                    "Connections closed at once because the listener's cap was reached"
                ),
                &["listener"]
            )),
            rpc_phases: RpcPhases::new(reg!(HistogramVec::new(
                HistogramOpts::new(
                    "pegaflow_rpc_phase_seconds",
                    "Time a Save or Load spends in each phase inside the engine"
                )
                .buckets(exp_buckets(1e-6, 4.0, 12)),
                &["rpc", "phase"]
            ))),
            registry: registry.clone(),
        }
    }

    /// The registry these families are in (every component's).
    pub fn registry(&self) -> &MetricsRegistry {
        &self.registry
    }

    /// Renders every family of the registry in the Prometheus text format.
    pub fn render(&self) -> String {
        self.registry.render()
    }

    /// Records one RPC outcome.
    pub fn observe_rpc(&self, method: &str, status: &str, secs: f64) {
        self.rpc_requests.with_label_values(&[method, status]).inc();
        self.rpc_duration
            .with_label_values(&[method, status])
            .observe(secs);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The label PegaFlow uses for a gRPC code in `status`.
pub fn status_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "Cancelled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}
