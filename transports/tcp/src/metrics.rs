//! The peer fetch's metric families (registered in the server's registry, served on
//! `/metrics`). Invariants: `pegaflow_transfer_locks_held` is the number of blocks locked
//! by live transfer sessions right now (0 when no requester holds anything); every session
//! ends in exactly one `pegaflow_transfer_lock_releases_total{reason}`; every fetch that
//! did not land all it asked for counts once in `pegaflow_peer_fetch_failures_total{reason}`.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The families.
#[derive(Clone)]
pub struct PeerMetrics {
    /// Blocks locked by live transfer sessions (source side).
    pub locks_held: IntGauge,
    /// The same number under PegaFlow's name (`transfer_lock_active`).
    pub lock_active: IntGauge,
    /// Live transfer sessions (source side).
    pub lock_sessions: IntGauge,
    /// Sessions ended, by reason: `released` (ReleaseTransferLock), `disconnect` (the
    /// requester's last data connection closed), `expired` (its lease ran out), `cap`
    /// (`transfer_lock_timeout_secs` reached).
    pub lock_releases: IntCounterVec,
    /// Sessions whose lease ran out or hit the cap (PegaFlow's `transfer_lock_timeouts`).
    pub lock_timeouts: IntCounter,
    /// QueryBlocksForTransfer refused because `max_locked_blocks` were locked already.
    pub lock_refusals: IntCounter,
    /// Open data-port connections (source side), greeted or not.
    pub data_connections: IntGauge,
    /// Of those, greeted ones with no read request in flight.
    pub data_connections_idle: IntGauge,
    /// Data-port connections refused, by reason: `full` (`max_data_connections` held and
    /// none evictable), `per_address` (`max_data_connections_per_address`), `per_requester`
    /// (`max_data_connections_per_requester`).
    pub data_connections_refused: IntCounterVec,
    /// Data-port connections the source closed on its own, by reason: `idle` (no request
    /// for `data_idle_timeout_secs` and no transfer lock held by its requester), `evicted`
    /// (made room for a requester holding fewer connections on a full port).
    pub data_connections_closed: IntCounterVec,
    /// Read requests served on the data port, by outcome: `ok`, `no_session`,
    /// `out_of_bounds`, `bad_request`, `write_failed`.
    pub serve_requests: IntCounterVec,
    /// Bytes sent from the pool on the data port.
    pub serve_bytes: IntCounter,
    /// Blocks fetched from peers into DRAM (requesting side).
    pub fetch_blocks: IntCounter,
    /// Bytes fetched from peers into DRAM.
    pub fetch_bytes: IntCounter,
    /// Fetches that landed less than asked, by reason: `timeout`, `unreachable`,
    /// `handshake`, `refused`, `rpc`, `lock_lost` (a one-sided pull whose lock the holder
    /// no longer held when released), `short` (the peer held fewer blocks than the directory
    /// said: a stale advertisement), `bad_answer` (a slot shape or size the peer answered
    /// that does not fit), `no_memory`.
    pub fetch_failures: IntCounterVec,
    /// Seconds per fetch (lock, pull, release), successful or not.
    pub fetch_duration: Histogram,
    /// Peers marked suspect right now (skipped until their mark expires).
    pub suspect_peers: IntGauge,
}

impl PeerMetrics {
    /// Registers the families in `registry` (an already registered family is reused
    /// unregistered: a second server in one process keeps its own counters).
    pub fn new(registry: &Registry) -> Self {
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            let _ = r.register(Box::new(c.clone()));
            c
        }
        let g = |n: &str, h: &str| reg(registry, IntGauge::new(n, h).expect("metric"));
        let c = |n: &str, h: &str| reg(registry, IntCounter::new(n, h).expect("metric"));
        let cv = |n: &str, h: &str, l: &str| {
            reg(
                registry,
                IntCounterVec::new(Opts::new(n, h), &[l]).expect("metric"),
            )
        };
        Self {
            locks_held: g(
                "pegaflow_transfer_locks_held",
                "Blocks locked by live transfer sessions for peers",
            ),
            lock_active: g(
                "pegaflow_transfer_lock_active",
                "Blocks locked for peers (PegaFlow's name of pegaflow_transfer_locks_held)",
            ),
            lock_sessions: g(
                "pegaflow_transfer_lock_sessions",
                "Live transfer sessions for peers",
            ),
            lock_releases: cv(
                "pegaflow_transfer_lock_releases_total",
                "Transfer sessions ended, by reason (released, disconnect, expired, cap)",
                "reason",
            ),
            lock_timeouts: c(
                "pegaflow_transfer_lock_timeouts_total",
                "Transfer sessions whose lease ran out or reached --transfer-lock-timeout-secs",
            ),
            lock_refusals: c(
                "pegaflow_transfer_lock_refusals_total",
                "QueryBlocksForTransfer refused at max_locked_blocks",
            ),
            data_connections: g(
                "pegaflow_peer_data_connections",
                "Open connections on the peer data port",
            ),
            data_connections_idle: g(
                "pegaflow_peer_data_connections_idle",
                "Greeted peer data-port connections with no read request in flight",
            ),
            data_connections_refused: cv(
                "pegaflow_peer_data_connections_refused_total",
                "Peer data-port connections refused, by reason (full, per_address, per_requester)",
                "reason",
            ),
            data_connections_closed: cv(
                "pegaflow_peer_data_connections_closed_total",
                "Peer data-port connections closed by the source, by reason (idle, evicted)",
                "reason",
            ),
            serve_requests: cv(
                "pegaflow_peer_serve_requests_total",
                "Read requests served on the peer data port, by outcome",
                "outcome",
            ),
            serve_bytes: c(
                "pegaflow_peer_serve_bytes_total",
                "Bytes sent to peers from the pool",
            ),
            fetch_blocks: c(
                "pegaflow_peer_fetch_blocks_total",
                "Blocks fetched from peers into DRAM",
            ),
            fetch_bytes: c(
                "pegaflow_peer_fetch_bytes_total",
                "Bytes fetched from peers into DRAM",
            ),
            fetch_failures: cv(
                "pegaflow_peer_fetch_failures_total",
                "Peer fetches that landed less than asked, by reason",
                "reason",
            ),
            fetch_duration: reg(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "pegaflow_peer_fetch_duration_seconds",
                        "Seconds per peer fetch (lock, pull, release)",
                    )
                    .buckets(vec![0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]),
                )
                .expect("metric"),
            ),
            suspect_peers: g(
                "pegaflow_peer_suspect_nodes",
                "Peers marked suspect after a failed or timed-out fetch",
            ),
        }
    }
}
