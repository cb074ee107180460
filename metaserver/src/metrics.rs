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
//! Invariants: `block_owners / store_entries = block_redundancy_avg`; the
//! `block_redundancy` buckets sum to `store_entries`. PegaFlow's OpenTelemetry
//! `otel_scope_name` label and `target_info` family are not reproduced.

use std::time::Duration;

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
        Self {
            registry: r,
            rpc_requests,
            rpc_duration,
            store,
        }
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
        });
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
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        let bare = Metrics::new(false).render();
        assert!(!bare.contains("store_entries"));
    }
}
