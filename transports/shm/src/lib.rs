//! `pegaflow-transport-shm`: the host shared memory backend of the KV-cache server.
//!
//! It owns two plugin kinds:
//! - the `host-memfd` [registrar](HostMemfdRegistrar): imports a client's host KV memory that
//!   arrives as a memfd on the fd side channel, maps it shared into the server and hands out
//!   bounds-checked per-layer regions;
//! - the `memcpy` [transport](MemcpyTransport): moves bytes between such host registrations
//!   and the landing tier's host buffers with plain CPU copies on blocking threads.
//!
//! It must never: touch memory that is not host memory (it refuses CUDA locations), block the
//! async executor (mapping and copying run on blocking threads), hand out a region that
//! reaches past what was mapped, or keep a descriptor it does not need (the memfd is closed
//! once mapped; the mapping lives exactly as long as its registration).
//!
//! Link it into a server binary with `use pegaflow_transport_shm as _;` so `inventory` keeps
//! its factories.

mod memcpy;
mod registrar;

pub use memcpy::{MemcpyTransport, DEFAULT_PARALLEL_THRESHOLD, DEFAULT_THREADS};
pub use registrar::{HostMemfdRegistrar, DEFAULT_FD_TIMEOUT};

use pegaflow_runtime::{PluginOption, RegistrarFactory, TransportFactory};

inventory::submit! {
    RegistrarFactory {
        kind: "host-memfd",
        summary: "host memory a client shares as a memfd on the fd side channel (needs --fd-socket-path)",
        options: &[
            PluginOption {
                name: "fd_timeout_secs",
                default: "10",
                help: "seconds a registration waits for its memfd on the fd side channel",
            },
            PluginOption {
                name: "require_shrink_seal",
                default: "false",
                help: "refuse memfds the server cannot seal against shrinking (a client that shrinks a mapped memfd crashes the server with SIGBUS)",
            },
        ],
        build: registrar::build,
    }
}

inventory::submit! {
    TransportFactory {
        kind: "memcpy",
        summary: "CPU copies between host registrations (host-memfd) and host buffers",
        options: &[
            PluginOption {
                name: "threads",
                default: "4",
                help: "most threads one large batch is split across",
            },
            PluginOption {
                name: "parallel_threshold",
                default: "\"64mb\"",
                help: "batches at least this large are split across threads",
            },
        ],
        build: memcpy::build,
    }
}

/// Fails on keys of a plugin table that the plugin does not know (typos would otherwise be
/// silently ignored).
fn reject_unknown_keys(kind: &str, table: &toml::Table, known: &[&str]) -> anyhow::Result<()> {
    if let Some(k) = table.keys().find(|k| !known.contains(&k.as_str())) {
        anyhow::bail!(
            "{kind}: unknown option {k:?} (known options: {})",
            known.join(", ")
        );
    }
    Ok(())
}
