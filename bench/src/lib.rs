//! `pegaflow-bench`: replay the Mooncake production trace through the KV-cache server and
//! measure it.
//!
//! - [`trace`]: the trace format and its summary figures;
//! - [`model`]: block geometry from a real model's KV layout, scaled to fit the machine;
//! - [`content`]: deterministic block content, so every loaded byte can be checked;
//! - [`sim`]: an exact offline model of the server's LRU DRAM tier, whose hit count a
//!   sequential replay must reproduce;
//! - [`server`]: an in-process server on the embedded default pipeline and the host-memfd KV
//!   cache clients register;
//! - [`replay`]: the replaying clients and the [`report`] they produce;
//! - [`sweep`]: hit rate and bytes moved against capacity, as CSV and a PNG chart.
//!
//! The `pegaflow-replay` binary drives all of it; `benches/` holds the criterion benchmarks.

#![warn(missing_docs)]

pub mod content;
pub mod latency;
pub mod model;
pub mod prom;
pub mod replay;
pub mod report;
pub mod server;
pub mod sim;
pub mod sweep;
pub mod trace;
