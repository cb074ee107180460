//! Cross-node block directory backends (the runtime's [`pegaflow_plugin::Directory`]
//! contract), each registered through `inventory` as a `[directory]` kind:
//! - `memory` ([`memory::MemoryDirectory`]): one process's map, PegaFlow's MetaServer
//!   semantics; what `pegaflow-metaserver` serves by default;
//! - `redis` ([`redis_dir::RedisDirectory`]): a directory shared through one Redis (or
//!   Valkey), with native key expiry and server-side scripts;
//! - `metaserver` ([`metaserver::MetaServerDirectory`]): a client of any PegaFlow-compatible
//!   MetaServer (ours or PegaFlow's `pegaflow-metaserver`).
//!
//! [`limits`] holds the input bounds and caps the backends and `pegaflow-metaserver` share.

pub mod limits;
pub mod memory;
pub mod metaserver;
pub mod redis_dir;
