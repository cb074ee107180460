//! The MetaServer's Prometheus families, with PegaFlow's names and labels
//! (`pegaflow-behavior.md` §8, as PegaFlow 0.25.1's Prometheus exporter renders them:
//! counters end in `_total`, the duration in `_seconds`):
//! - always: `pegaflow_metaserver_rpc_requests_total{method,status}` and
//!   `pegaflow_metaserver_rpc_duration_seconds{method,status}` (buckets 0.5 ms – 2 s), where
//!   `method` is the RPC in snake case and `status` is `ok` or, like PegaFlow, the gRPC
//!   code's description (e.g. `Client specified an invalid argument`);
//! - with the in-memory store ([`StoreMetrics`]): `pegaflow_metaserver_store_entries`,
//!   `_block_owners`, `_nodes{state=active|stale}`, `_block_redundancy{owners=1|2|3|>=4}`,
//!   `_block_redundancy_avg` (stored owners, stale and replaced sessions included until the
//!   sweep drops them), and the sweep counters `_sweep_removed_{owners,keys,nodes}_total`.
//!
//! Ours, beyond PegaFlow's (the bounds):
//! - `pegaflow_metaserver_invalid_requests_total{method,field}`: requests refused
//!   INVALID_ARGUMENT for a field past its bound or malformed (`node`, `node_id`,
//!   `namespace`, `block_hashes`, `exclude_node`) or a body that does not decode (`body`);
//! - `pegaflow_metaserver_limit_refusals_total{limit}`: requests refused RESOURCE_EXHAUSTED by
//!   a cap (`max_nodes`, `max_blocks_per_node`, `max_store_bytes`, `busy`);
//! - `pegaflow_metaserver_limit{limit}`: the caps in force;
//! - `pegaflow_metaserver_query_answers_cut_total`: query answers cut at the segment limit;
//! - `pegaflow_metaserver_large_requests_total{method}` and
//!   `pegaflow_metaserver_large_requests_waiting_bytes`: requests run on blocking threads, and
//!   the bodies waiting for one;
//! - with the in-memory store, `pegaflow_metaserver_store_bytes`: its estimated size, what
//!   `max_store_bytes` bounds.
//!
//! Invariants: `block_owners / store_entries = block_redundancy_avg`; the
//! `block_redundancy` buckets sum to `store_entries`. PegaFlow's OpenTelemetry
//! `otel_scope_name` label and `target_info` family are not reproduced.

use std::time::Duration;

use pegaflow_directory::limits::Caps;
use pegaflow_directory::memory::{MemoryStats, SweepCounts};
use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

/// Upper bounds of the RPC duration buckets, in seconds (PegaFlow's).
pub const RPC_BUCKETS_SECS: [f64; 12] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
];

/// Every family the MetaServer exports.
pub struct Metrics {
    registry: Registry,
    /// RPCs handled, by method and status.
    pub rpc_requests: IntCounterVec,
    /// RPC handling time in seconds, by method and status.
    pub rpc_duration: HistogramVec,
    /// Requests refused INVALID_ARGUMENT, by method and field.
    pub invalid_requests: IntCounterVec,
    /// Requests refused RESOURCE_EXHAUSTED, by cap.
    pub limit_refusals: IntCounterVec,
    /// The caps in force.
    pub limits: IntGaugeVec,
    /// Query answers cut at the segment limit.
    pub query_answers_cut: IntCounter,
    /// Requests run on blocking threads, by method.
    pub offloaded: IntCounterVec,
    /// Bytes of large request bodies waiting for a blocking thread.
    pub waiting_bytes: IntGauge,
    /// The in-memory store's families; `None` with a backend that cannot count cheaply.
    pub store: Option<StoreMetrics>,
}

/// The in-memory store's gauges and sweep counters.
pub struct StoreMetrics {
    /// Block keys.
    pub entries: IntGauge,
    /// Owner records over all keys.
    pub owners: IntGauge,
    /// Registered nodes by `state` (`active`, `stale`).
    pub nodes: IntGaugeVec,
    /// Keys by stored owner count (`owners` = `1`, `2`, `3`, `>=4`).
    pub redundancy: IntGaugeVec,
    /// Owners per key on average.
    pub redundancy_avg: Gauge,
    /// Owner records the sweeps dropped.
    pub sweep_removed_owners: IntCounter,
    /// Keys the sweeps dropped.
    pub sweep_removed_keys: IntCounter,
    /// Nodes the sweeps dropped.
    pub sweep_removed_nodes: IntCounter,
    /// Estimated bytes of entries and namespaces.
    pub bytes: IntGauge,
}

/// The `owners` label values of `pegaflow_metaserver_block_redundancy`, by bucket.
const REDUNDANCY_LABELS: [&str; 4] = ["1", "2", "3", ">=4"];

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
    r.register(Box::new(c.clone()))
        .expect("metric families are registered once");
    c
}

impl Metrics {
    /// The families, registered in a fresh registry; the store families only when
    /// `with_store`.
    pub fn new(with_store: bool) -> Self {
        let r = Registry::new();
        let rpc_requests = reg(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "pegaflow_metaserver_rpc_requests_total",
                    "MetaServer RPCs handled, by method and outcome",
                ),
                &["method", "status"],
            )
            .expect("valid metric"),
        );
        let rpc_duration = reg(
            &r,
            HistogramVec::new(
                HistogramOpts::new(
                    "pegaflow_metaserver_rpc_duration_seconds",
                    "MetaServer RPC handling time in seconds",
                )
                .buckets(RPC_BUCKETS_SECS.to_vec()),
                &["method", "status"],
            )
            .expect("valid metric"),
        );
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &r,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let invalid_requests = counter_vec(
            "pegaflow_metaserver_invalid_requests_total",
            "Requests refused INVALID_ARGUMENT, by method and the field at fault (body: it does not decode)",
            &["method", "field"],
        );
        let limit_refusals = counter_vec(
            "pegaflow_metaserver_limit_refusals_total",
            "Requests refused RESOURCE_EXHAUSTED, by the cap reached",
            &["limit"],
        );
        let offloaded = counter_vec(
            "pegaflow_metaserver_large_requests_total",
            "Requests decoded and run on a blocking thread (large bodies, unregistrations), by method",
            &["method"],
        );
        let limits = reg(
            &r,
            IntGaugeVec::new(
                Opts::new("pegaflow_metaserver_limit", "The caps in force, by cap"),
                &["limit"],
            )
            .expect("valid metric"),
        );
        let query_answers_cut = reg(
            &r,
            IntCounter::new(
                "pegaflow_metaserver_query_answers_cut_total",
                "Query answers cut at the segment limit (their holders alternate too often)",
            )
            .expect("valid metric"),
        );
        let waiting_bytes = reg(
            &r,
            IntGauge::new(
                "pegaflow_metaserver_large_requests_waiting_bytes",
                "Bytes of large request bodies waiting for a blocking thread",
            )
            .expect("valid metric"),
        );
        let store = with_store.then(|| {
            let gauge = |name: &str, help: &str| {
                reg(&r, IntGauge::new(name, help).expect("valid metric"))
            };
            let counter = |name: &str, help: &str| {
                reg(&r, IntCounter::new(name, help).expect("valid metric"))
            };
            StoreMetrics {
                entries: gauge(
                    "pegaflow_metaserver_store_entries",
                    "Distinct block keys (namespace, hash) in the directory",
                ),
                owners: gauge(
                    "pegaflow_metaserver_block_owners",
                    "Owner records over all block keys (stale and replaced sessions count until swept)",
                ),
                nodes: reg(
                    &r,
                    IntGaugeVec::new(
                        Opts::new(
                            "pegaflow_metaserver_nodes",
                            "Registered nodes, by whether they heartbeated within the stale interval",
                        ),
                        &["state"],
                    )
                    .expect("valid metric"),
                ),
                redundancy: reg(
                    &r,
                    IntGaugeVec::new(
                        Opts::new(
                            "pegaflow_metaserver_block_redundancy",
                            "Block keys by their number of stored owners",
                        ),
                        &["owners"],
                    )
                    .expect("valid metric"),
                ),
                redundancy_avg: reg(
                    &r,
                    Gauge::new(
                        "pegaflow_metaserver_block_redundancy_avg",
                        "Stored owners per block key on average",
                    )
                    .expect("valid metric"),
                ),
                sweep_removed_owners: counter(
                    "pegaflow_metaserver_sweep_removed_owners_total",
                    "Owner records dropped by lifecycle sweeps",
                ),
                sweep_removed_keys: counter(
                    "pegaflow_metaserver_sweep_removed_keys_total",
                    "Block keys dropped by lifecycle sweeps (no owner left)",
                ),
                sweep_removed_nodes: counter(
                    "pegaflow_metaserver_sweep_removed_nodes_total",
                    "Nodes dropped by lifecycle sweeps (unseen for the TTL)",
                ),
                bytes: gauge(
                    "pegaflow_metaserver_store_bytes",
                    "Estimated bytes of the directory's entries and namespaces (bounded by max_store_bytes)",
                ),
            }
        });
        if let Some(s) = &store {
            for state in ["active", "stale"] {
                s.nodes.with_label_values(&[state]).set(0);
            }
            for l in REDUNDANCY_LABELS {
                s.redundancy.with_label_values(&[l]).set(0);
            }
        }
        for l in [
            "max_nodes",
            "max_blocks_per_node",
            "max_store_bytes",
            "busy",
        ] {
            limit_refusals.with_label_values(&[l]).inc_by(0);
        }
        Self {
            registry: r,
            rpc_requests,
            rpc_duration,
            invalid_requests,
            limit_refusals,
            limits,
            query_answers_cut,
            offloaded,
            waiting_bytes,
            store,
        }
    }

    /// Sets the cap gauges (`max_store_bytes` only where `with_store_bytes`: the in-memory
    /// backend's).
    pub fn set_limits(&self, caps: &Caps, with_store_bytes: bool) {
        let set = |l: &str, v: u64| self.limits.with_label_values(&[l]).set(v as i64);
        set("max_nodes", caps.max_nodes);
        set("max_blocks_per_node", caps.max_blocks_per_node);
        if with_store_bytes {
            set("max_store_bytes", caps.max_store_bytes);
        }
    }

    /// Counts a request refused for `field`.
    pub fn invalid(&self, method: &str, field: &str) {
        self.invalid_requests
            .with_label_values(&[method, field])
            .inc();
    }

    /// Counts a request refused by cap `limit`.
    pub fn limit_refused(&self, limit: &str) {
        self.limit_refusals.with_label_values(&[limit]).inc();
    }

    /// Counts one RPC: `status` is `None` for success, else the gRPC code.
    pub fn observe_rpc(&self, method: &str, code: Option<tonic::Code>, took: Duration) {
        let status = code.map_or("ok", |c| c.description());
        self.rpc_requests.with_label_values(&[method, status]).inc();
        self.rpc_duration
            .with_label_values(&[method, status])
            .observe(took.as_secs_f64());
    }

    /// Sets the store gauges (no-op without the store families).
    pub fn set_store(&self, s: &MemoryStats) {
        let Some(m) = &self.store else { return };
        m.entries.set(s.entries as i64);
        m.owners.set(s.owners as i64);
        m.nodes
            .with_label_values(&["active"])
            .set(s.nodes_active as i64);
        m.nodes
            .with_label_values(&["stale"])
            .set(s.nodes_stale as i64);
        for (l, n) in REDUNDANCY_LABELS.iter().zip(s.redundancy) {
            m.redundancy.with_label_values(&[l]).set(n as i64);
        }
        m.redundancy_avg.set(s.redundancy_avg());
        m.bytes.set(s.bytes as i64);
    }

    /// Adds a sweep's removals to the sweep counters (no-op without the store families).
    pub fn add_sweep(&self, c: &SweepCounts) {
        let Some(m) = &self.store else { return };
        m.sweep_removed_owners.inc_by(c.owners);
        m.sweep_removed_keys.inc_by(c.keys);
        m.sweep_removed_nodes.inc_by(c.nodes);
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!("cannot encode the metrics: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_with_pegaflows_names() {
        let m = Metrics::new(true);
        m.observe_rpc("heartbeat_node", None, Duration::from_micros(30));
        m.observe_rpc(
            "query_prefix_blocks",
            Some(tonic::Code::InvalidArgument),
            Duration::from_micros(3),
        );
        m.set_store(&MemoryStats {
            entries: 2,
            owners: 3,
            nodes_active: 1,
            nodes_stale: 1,
            redundancy: [1, 1, 0, 0],
            bytes: 420,
        });
        m.invalid("insert_block_hashes", "namespace");
        m.limit_refused("max_nodes");
        m.set_limits(&Caps::for_store_bytes(1 << 30), true);
        m.add_sweep(&SweepCounts {
            owners: 4,
            keys: 2,
            nodes: 1,
        });
        let text = m.render();
        for line in [
            "pegaflow_metaserver_rpc_requests_total{method=\"heartbeat_node\",status=\"ok\"} 1",
            "pegaflow_metaserver_rpc_requests_total{method=\"query_prefix_blocks\",status=\"Client specified an invalid argument\"} 1",
            "pegaflow_metaserver_store_entries 2",
            "pegaflow_metaserver_block_owners 3",
            "pegaflow_metaserver_nodes{state=\"stale\"} 1",
            "pegaflow_metaserver_block_redundancy{owners=\">=4\"} 0",
            "pegaflow_metaserver_block_redundancy_avg 1.5",
            "pegaflow_metaserver_sweep_removed_owners_total 4",
            "pegaflow_metaserver_sweep_removed_keys_total 2",
            "pegaflow_metaserver_sweep_removed_nodes_total 1",
            "pegaflow_metaserver_rpc_duration_seconds_bucket{method=\"heartbeat_node\",status=\"ok\",le=\"0.0005\"} 1",
            "pegaflow_metaserver_store_bytes 420",
            "pegaflow_metaserver_invalid_requests_total{field=\"namespace\",method=\"insert_block_hashes\"} 1",
            "pegaflow_metaserver_limit_refusals_total{limit=\"max_nodes\"} 1",
            "pegaflow_metaserver_limit_refusals_total{limit=\"busy\"} 0",
            "pegaflow_metaserver_limit{limit=\"max_nodes\"} 64",
            "pegaflow_metaserver_limit{limit=\"max_store_bytes\"} 1073741824",
            "pegaflow_metaserver_query_answers_cut_total 0",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        let bare = Metrics::new(false).render();
        assert!(!bare.contains("store_entries"));
    }
}
