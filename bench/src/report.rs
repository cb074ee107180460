//! The replay report: serializable to JSON, printable as a table.

use std::fmt::Write as _;

use serde::Serialize;

use crate::latency::{human_us, LatencyStats};
use crate::model::{human_bytes, BlockGeometry};

/// The block geometry, as reported.
#[derive(Debug, Clone, Serialize)]
pub struct GeometryReport {
    /// Model preset.
    pub model: String,
    /// Layers.
    pub layers: u64,
    /// Bytes of one K or V segment of one block in one layer.
    pub segment_bytes: u64,
    /// Bytes of one block (all layers, K and V).
    pub block_bytes: u64,
    /// Bytes of the unscaled 512-token block.
    pub real_block_bytes: u64,
    /// Divisor applied to the real block.
    pub scale: u64,
    /// Tokens' worth of KV stored per 512-token block.
    pub stored_tokens: u64,
    /// One line describing all of the above.
    pub description: String,
}

impl GeometryReport {
    /// The report of `g`.
    pub fn of(g: &BlockGeometry) -> Self {
        Self {
            model: g.model.name.into(),
            layers: g.model.layers as u64,
            segment_bytes: g.segment_bytes() as u64,
            block_bytes: g.block_bytes(),
            real_block_bytes: g.real_block_bytes(),
            scale: g.scale as u64,
            stored_tokens: g.stored_tokens(),
            description: g.to_string(),
        }
    }
}

/// What the server did, as the clients (and its counters) saw it.
#[derive(Debug, Clone, Serialize)]
pub struct ServerReport {
    /// Blocks hit by the queries.
    pub hit_blocks: u64,
    /// Hit blocks / queried blocks.
    pub block_hit_rate: f64,
    /// Tokens covered by the hits.
    pub hit_tokens: u64,
    /// Hit tokens / prompt tokens.
    pub token_hit_rate: f64,
    /// Blocks loaded and checked.
    pub loaded_blocks: u64,
    /// Leases released instead of loaded.
    pub released_leases: u64,
    /// Blocks of those leases.
    pub released_blocks: u64,
    /// Blocks the clients asked to save (the server skips resident ones).
    pub save_sent_blocks: u64,
    /// Saves refused with RESOURCE_EXHAUSTED.
    pub save_rejected: u64,
    /// The first refusal's request and message.
    pub first_save_rejection: Option<String>,
    /// Blocks the server inserted (its counter; absent when unreadable).
    pub inserted_blocks: Option<u64>,
    /// Blocks the server evicted (its counter; absent when unreadable).
    pub evictions: Option<u64>,
    /// Bytes loaded.
    pub bytes_loaded: u64,
    /// Bytes saved.
    pub bytes_saved: u64,
    /// Where `bytes_saved` comes from.
    pub bytes_saved_source: String,
}

/// What the offline LRU simulation predicts.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// Blocks hit.
    pub hit_blocks: u64,
    /// Hit blocks / queried blocks.
    pub block_hit_rate: f64,
    /// Tokens covered by the hits.
    pub hit_tokens: u64,
    /// Hit tokens / prompt tokens.
    pub token_hit_rate: f64,
    /// Blocks loaded.
    pub loaded_blocks: u64,
    /// Blocks inserted.
    pub inserted_blocks: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Saves refused for exceeding the capacity.
    pub rejected_saves: u64,
    /// Bytes loaded.
    pub bytes_loaded: u64,
    /// Bytes saved.
    pub bytes_saved: u64,
}

/// An infinite cache on the same trace.
#[derive(Debug, Clone, Serialize)]
pub struct InfiniteReport {
    /// Blocks hit.
    pub hit_blocks: u64,
    /// Hit blocks / queried blocks.
    pub block_hit_rate: f64,
    /// Hit tokens / prompt tokens.
    pub token_hit_rate: f64,
    /// Footprint of every distinct block: the capacity at which nothing is evicted.
    pub capacity_needed_bytes: u64,
}

/// Throughput figures (GB = 10^9 bytes).
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Requests per second of wall time.
    pub requests_per_s: f64,
    /// Bytes loaded / summed Load latency (RPC sent to completion word set).
    pub load_gbps: f64,
    /// Bytes saved / summed Save latency.
    pub save_gbps: f64,
    /// (Bytes loaded + saved) / wall time, including the clients' content generation and
    /// checking.
    pub moved_gbps_wall: f64,
}

/// Latency of each RPC as the client measured it.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyReport {
    /// QueryPrefetch (until Ready, re-polls included).
    pub query: LatencyStats,
    /// The queries answered Loading first: from the first QueryPrefetch until Ready (the
    /// promotion from the tiers below DRAM as the client sees it).
    pub loading: LatencyStats,
    /// Load: from sending the RPC until the completion word reads success.
    pub load: LatencyStats,
    /// Release.
    pub release: LatencyStats,
    /// Save (returns once the blocks are copied and sealed).
    pub save: LatencyStats,
}

/// The byte check of loaded blocks.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    /// Blocks checked.
    pub blocks: u64,
    /// Bytes checked.
    pub bytes: u64,
    /// Every loaded byte matched (a mismatch aborts the replay, so a report says true).
    pub ok: bool,
}

/// The first request whose hit count differs from the simulation's.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Divergence {
    /// Request index in replay (timestamp) order.
    pub request: u64,
    /// Its timestamp.
    pub timestamp_ms: u64,
    /// Its blocks.
    pub blocks: u64,
    /// Hits the server answered.
    pub server_hits: u64,
    /// Hits the simulation predicted.
    pub simulated_hits: u64,
}

/// Server hit count against the exact LRU simulation.
#[derive(Debug, Clone, Serialize)]
pub struct LruCheck {
    /// Whether the check applies (one client, so the order is the trace's).
    pub checked: bool,
    /// Whether every request's hit count equals the simulation's (absent when not checked).
    pub holds: Option<bool>,
    /// Server's hit blocks.
    pub server_hit_blocks: u64,
    /// Simulation's hit blocks.
    pub simulated_hit_blocks: u64,
    /// The first request that differs.
    pub first_divergence: Option<Divergence>,
    /// Caveats.
    pub notes: Vec<String>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Trace file.
    pub trace: String,
    /// `in-process` or `endpoint`.
    pub mode: String,
    /// gRPC endpoint used.
    pub endpoint: String,
    /// Cache namespace.
    pub namespace: String,
    /// Concurrent clients.
    pub clients: u64,
    /// Time-scale factor (absent: as fast as possible).
    pub speedup: Option<f64>,
    /// Every this-many-th request releases instead of loading (0 = never).
    pub release_every: u32,
    /// DRAM capacity in bytes (after rounding to the granule).
    pub capacity_bytes: u64,
    /// Blocks that fit.
    pub capacity_blocks: u64,
    /// Block geometry.
    pub geometry: GeometryReport,
    /// Requests replayed.
    pub requests: u64,
    /// Blocks queried.
    pub blocks: u64,
    /// Distinct blocks of the trace.
    pub unique_blocks: u64,
    /// Prompt tokens.
    pub tokens: u64,
    /// Wall time of the replay (setup excluded).
    pub wall_seconds: f64,
    /// The server.
    pub server: ServerReport,
    /// The exact LRU simulation.
    pub simulation: SimReport,
    /// An infinite cache.
    pub infinite_cache: InfiniteReport,
    /// Throughput.
    pub throughput: Throughput,
    /// RPC latency.
    pub latency: LatencyReport,
    /// Byte check.
    pub verification: Verification,
    /// LRU check.
    pub lru_check: LruCheck,
}

fn pct(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "n/a".into(), |x| x.to_string())
}

impl Report {
    /// Whether the run passed: bytes checked and, where it applies, the LRU check held.
    pub fn passed(&self) -> bool {
        self.verification.ok && self.lru_check.holds != Some(false)
    }

    /// The report as a plain-text table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let w = &mut s;
        let _ = writeln!(
            w,
            "pegaflow-replay — {} ({} mode, {})",
            self.trace, self.mode, self.endpoint
        );
        let _ = writeln!(w, "block: {}", self.geometry.description);
        let _ = writeln!(
            w,
            "DRAM capacity: {} ({} blocks); clients: {}; pace: {}; release every {}th request with hits",
            human_bytes(self.capacity_bytes),
            self.capacity_blocks,
            self.clients,
            self.speedup
                .map_or_else(|| "as fast as possible".into(), |x| format!("{x}x trace time")),
            self.release_every
        );
        let _ = writeln!(
            w,
            "requests: {}   blocks: {} ({} distinct)   prompt tokens: {}   wall: {:.1} s ({:.0} req/s)",
            self.requests, self.blocks, self.unique_blocks, self.tokens, self.wall_seconds, self.throughput.requests_per_s
        );
        let _ = writeln!(w);
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "", "server", "LRU simulation", "infinite cache"
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "hit blocks",
            self.server.hit_blocks,
            self.simulation.hit_blocks,
            self.infinite_cache.hit_blocks
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "block hit rate",
            pct(self.server.block_hit_rate),
            pct(self.simulation.block_hit_rate),
            pct(self.infinite_cache.block_hit_rate)
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "token hit rate",
            pct(self.server.token_hit_rate),
            pct(self.simulation.token_hit_rate),
            pct(self.infinite_cache.token_hit_rate)
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "blocks loaded", self.server.loaded_blocks, self.simulation.loaded_blocks, ""
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "blocks inserted",
            opt(self.server.inserted_blocks),
            self.simulation.inserted_blocks,
            ""
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "evictions",
            opt(self.server.evictions),
            self.simulation.evictions,
            0
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "bytes loaded",
            human_bytes(self.server.bytes_loaded),
            human_bytes(self.simulation.bytes_loaded),
            ""
        );
        let _ = writeln!(
            w,
            "{:<26} {:>16} {:>16} {:>16}",
            "bytes saved",
            human_bytes(self.server.bytes_saved),
            human_bytes(self.simulation.bytes_saved),
            ""
        );
        let _ = writeln!(
            w,
            "leases released: {} ({} blocks); saves refused: {}; capacity for no eviction: {}",
            self.server.released_leases,
            self.server.released_blocks,
            self.server.save_rejected,
            human_bytes(self.infinite_cache.capacity_needed_bytes)
        );
        if let Some(m) = &self.server.first_save_rejection {
            let _ = writeln!(w, "first refused save: {m}");
        }
        let _ = writeln!(w);
        let _ = writeln!(
            w,
            "{:<10} {:>8} {:>11} {:>11} {:>11} {:>11}",
            "RPC", "count", "mean", "p50", "p99", "max"
        );
        for (name, l) in [
            ("Query", &self.latency.query),
            ("Loading", &self.latency.loading),
            ("Load", &self.latency.load),
            ("Release", &self.latency.release),
            ("Save", &self.latency.save),
        ] {
            let _ = writeln!(
                w,
                "{:<10} {:>8} {:>11} {:>11} {:>11} {:>11}",
                name,
                l.count,
                human_us(l.mean_us),
                human_us(l.p50_us),
                human_us(l.p99_us),
                human_us(l.max_us)
            );
        }
        let _ = writeln!(
            w,
            "throughput: Load {:.2} GB/s, Save {:.2} GB/s (bytes / summed RPC time); {:.2} GB/s moved over wall time",
            self.throughput.load_gbps, self.throughput.save_gbps, self.throughput.moved_gbps_wall
        );
        let _ = writeln!(w);
        let _ = writeln!(
            w,
            "byte check: {} blocks, {} checked — {}",
            self.verification.blocks,
            human_bytes(self.verification.bytes),
            if self.verification.ok {
                "every byte correct"
            } else {
                "MISMATCH"
            }
        );
        let verdict = match self.lru_check.holds {
            Some(true) => "HOLDS (every request's hit count equals the simulation's)".to_string(),
            Some(false) => match &self.lru_check.first_divergence {
                Some(d) => format!(
                    "FAILS: first at request {} (t = {} ms, {} blocks): server hit {}, simulation {}",
                    d.request, d.timestamp_ms, d.blocks, d.server_hits, d.simulated_hits
                ),
                None => "FAILS".into(),
            },
            None => "not checked".into(),
        };
        let _ = writeln!(
            w,
            "LRU check: server {} hit blocks, simulation {}: {verdict}",
            self.lru_check.server_hit_blocks, self.lru_check.simulated_hit_blocks
        );
        for n in &self.lru_check.notes {
            let _ = writeln!(w, "  note: {n}");
        }
        s
    }
}
