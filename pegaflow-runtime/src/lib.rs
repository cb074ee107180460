//! `pegaflow-runtime`: the plugin runtime of the KV-cache server.
//!
//! It owns the plugin contract ([`plugin`]), the pipeline and CLI ([`config`]), the engine
//! (instances, sealing, the block index, leases, eviction, save/load orchestration:
//! [`engine`]), the gRPC and HTTP services, the fd side channel and the metrics. It depends on
//! no backend: backends depend on it and register through `inventory`.

pub mod block;
pub mod buffer;
pub mod cluster;
pub mod config;
pub mod decode;
pub mod engine;
pub mod entry;
pub mod error;
pub mod fault;
pub mod fd_channel;
pub mod health;
pub mod layers;
pub mod metrics;
pub mod numa;
pub mod plugin;
pub mod store;

pub use buffer::{Extent, HostBuffer, HostMemory, ReleaseBatch};
pub use plugin::*;

pub mod http;
pub mod server;
pub mod service;

pub use entry::main;
pub use server::{build_pipeline, init_logging, run, start, BuiltPipeline, ServerHandle};
