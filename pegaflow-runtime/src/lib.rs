//! `pegaflow-runtime`: the runtime of the KV-cache server.
//!
//! It owns the pipeline and CLI ([`config`]), the engine (instances, leases, save/load
//! orchestration: [`engine`]), the tier stack ([`store`]: the block index, sealing, eviction,
//! demotion, promotion), the gRPC and HTTP services, the directory publisher ([`cluster`])
//! and the server's own metric families. The contract backends implement lives in
//! `pegaflow-plugin`; the runtime depends on no backend: backends register through
//! `inventory`, and a binary links them and calls [`main`].

pub mod cluster;
pub mod config;
pub mod decode;
pub mod engine;
pub mod entry;
pub mod error;
pub mod metrics;
pub mod store;

// The contract's modules under the paths the runtime's own code uses.
pub(crate) use pegaflow_fd_channel as fd_channel;
pub(crate) use pegaflow_plugin as plugin;
pub(crate) use pegaflow_plugin::{block, buffer, health};

pub mod http;
pub mod server;
pub mod service;

pub use entry::main;
pub use server::{build_pipeline, init_logging, run, start, BuiltPipeline, ServerHandle};
