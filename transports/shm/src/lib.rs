//! `pegaflow-transport-shm`: the host shared memory backend of the KV-cache server.
//!
//! It owns two plugin kinds:
//! - the `host-memfd` [registrar](HostMemfdRegistrar): imports a client's host KV memory that
//!   arrives as a memfd on the fd side channel, maps it shared into the server and hands out
//!   bounds-checked per-layer regions;
//! - the `memcpy` [transport](MemcpyTransport): moves bytes between such host registrations
//!   and the landing tier's host buffers with CPU copies on blocking threads (streaming stores
//!   by default, `stream.rs`).
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
mod stream;

pub use memcpy::{
    MemcpyConfig, MemcpyTransport, StreamingStores, DEFAULT_PARALLEL_THRESHOLD, DEFAULT_THREADS,
};
pub use registrar::{HostMemfdConfig, HostMemfdRegistrar, DEFAULT_FD_TIMEOUT};

use pegaflow_plugin::{
    defaults_of, ConfigSchema, PluginOption, RegistrarFactory, TransportFactory,
};

inventory::submit! {
    RegistrarFactory {
        kind: "host-memfd",
        summary: "host memory a client shares as a memfd on the fd side channel (needs --fd-socket-path)",
        config: ConfigSchema {
            defaults: defaults_of::<HostMemfdConfig>,
            check: |_, t| registrar::checked_config(t).map(drop),
            options: &[
                PluginOption {
                    name: "fd_timeout_secs",
                    help: "seconds a registration waits for its memfd on the fd side channel",
                },
                PluginOption {
                    name: "require_shrink_seal",
                    help: "refuse memfds the server cannot seal against shrinking (a client that shrinks a mapped memfd crashes the server with SIGBUS)",
                },
            ],
        },
        flags: &[],
        build: registrar::build,
    }
}

inventory::submit! {
    TransportFactory {
        kind: "memcpy",
        summary: "CPU copies between host registrations (host-memfd) and host buffers",
        config: ConfigSchema {
            defaults: defaults_of::<MemcpyConfig>,
            check: |_, t| memcpy::checked_config(t).map(drop),
            options: &[
                PluginOption {
                    name: "threads",
                    help: "most threads one large batch is split across",
                },
                PluginOption {
                    name: "parallel_threshold",
                    help: "batches at least this large are split across threads",
                },
                PluginOption {
                    name: "streaming_stores",
                    help: "which copies bypass the cache with streaming stores: all (default), saves, off",
                },
            ],
        },
        flags: &[],
        build: memcpy::build,
    }
}
