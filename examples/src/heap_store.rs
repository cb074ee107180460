//! `heap-store`: a key-addressed tier below host DRAM that keeps blocks in this process's
//! heap, written the way a third party writes a tier (its own config struct, a factory
//! submitted with `inventory`, no edit to the runtime).
//!
//! It is the smallest honest [`Tier`]: blocks are copied in on put and out on get on a
//! blocking thread (never on the async executor), a key is visible only once its put has
//! copied every byte, the oldest blocks are evicted first when a put needs room (or, with
//! `evict = false`, the put fails with [`TierError::Full`]), and `read_bytes_per_sec` /
//! `write_bytes_per_sec` are what the operator declares. Useful to try a two-tier pipeline
//! without a disk, and as a template for a real backend.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::block::{BlockKey, BlockShape};
use pegaflow_plugin::{
    defaults_of, parse_settings, BuiltTier, ConfigSchema, PluginOption, Recovered, RuntimeContext,
    Tier, TierCapabilities, TierError, TierFactory, TierGet, TierPut,
};
use serde::{Deserialize, Serialize};

/// The `[[tier]] kind = "heap-store"` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HeapStoreConfig {
    /// Bytes the store may hold: a size string (`"8gb"`) or a byte count. Default `"1gb"`.
    #[serde(default = "default_capacity", with = "pegaflow_plugin::units::size")]
    pub capacity: u64,
    /// Whether a put that needs room evicts the oldest blocks (true, the default) or fails
    /// with [`TierError::Full`].
    #[serde(default = "default_true")]
    pub evict: bool,
    /// Declared read bandwidth in bytes per second (0 = unknown, the default).
    #[serde(default)]
    pub read_bytes_per_sec: u64,
    /// Declared write bandwidth in bytes per second (0 = unknown, the default).
    #[serde(default)]
    pub write_bytes_per_sec: u64,
}

fn default_capacity() -> u64 {
    1 << 30
}

fn default_true() -> bool {
    true
}

impl Default for HeapStoreConfig {
    fn default() -> Self {
        Self {
            capacity: default_capacity(),
            evict: true,
            read_bytes_per_sec: 0,
            write_bytes_per_sec: 0,
        }
    }
}

struct Stored {
    shape: BlockShape,
    bytes: Arc<[u8]>,
}

#[derive(Default)]
struct State {
    blocks: HashMap<BlockKey, Stored>,
    order: VecDeque<BlockKey>,
    used: u64,
}

/// The heap-backed tier.
pub struct HeapStore {
    config: HeapStoreConfig,
    state: Mutex<State>,
}

impl std::fmt::Debug for HeapStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("HeapStore")
            .field("capacity", &self.config.capacity)
            .field("blocks", &st.blocks.len())
            .field("used", &st.used)
            .finish()
    }
}

impl HeapStore {
    /// An empty store.
    pub fn new(config: HeapStoreConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::default()),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.state.lock().blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes room for `need` bytes, oldest first; false when it cannot (too big, or `evict`
    /// is off and the store is full).
    fn make_room(&self, st: &mut State, need: u64) -> bool {
        if need > self.config.capacity {
            return false;
        }
        while st.used + need > self.config.capacity {
            if !self.config.evict {
                return false;
            }
            let Some(k) = st.order.pop_front() else {
                return false;
            };
            if let Some(old) = st.blocks.remove(&k) {
                st.used -= old.bytes.len() as u64;
            }
        }
        true
    }
}

#[async_trait]
impl Tier for HeapStore {
    fn kind(&self) -> &'static str {
        "heap-store"
    }

    fn capabilities(&self) -> TierCapabilities {
        TierCapabilities {
            persistent: false,
            remote: false,
            read_bytes_per_sec: self.config.read_bytes_per_sec,
            write_bytes_per_sec: self.config.write_bytes_per_sec,
            write_through: false,
        }
    }

    fn capacity_bytes(&self) -> u64 {
        self.config.capacity
    }

    fn used_bytes(&self) -> u64 {
        self.state.lock().used
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        let st = self.state.lock();
        Ok(keys
            .iter()
            .map_while(|k| st.blocks.get(k).map(|s| s.shape.clone()))
            .collect())
    }

    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        // Copy out of the host buffers on a blocking thread; the task owns the `Arc`s, so a
        // dropped future never leaves a copy running into freed memory.
        let copied = tokio::task::spawn_blocking(move || {
            blocks
                .into_iter()
                .map(|p| {
                    let mut bytes = vec![0u8; p.block.len_bytes() as usize];
                    p.block.read_all(&mut bytes);
                    (p.key, p.block.shape(), Arc::<[u8]>::from(bytes))
                })
                .collect::<Vec<_>>()
        })
        .await;
        let Ok(copied) = copied else {
            return vec![Err(TierError::Unavailable("copy thread failed".into()))];
        };
        let mut st = self.state.lock();
        copied
            .into_iter()
            .map(|(key, shape, bytes)| {
                if st.blocks.contains_key(&key) {
                    return Ok(());
                }
                let need = bytes.len() as u64;
                if !self.make_room(&mut st, need) {
                    return Err(TierError::Full(format!(
                        "{need} bytes do not fit in the {}-byte heap store",
                        self.config.capacity
                    )));
                }
                st.used += need;
                st.order.push_back(key.clone());
                st.blocks.insert(key, Stored { shape, bytes });
                Ok(())
            })
            .collect()
    }

    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        let found: Vec<Result<(TierGet, Arc<[u8]>), TierError>> = {
            let st = self.state.lock();
            reads
                .into_iter()
                .map(|r| match st.blocks.get(&r.key) {
                    Some(s) if s.shape == r.shape => Ok((r, s.bytes.clone())),
                    Some(_) => Err(TierError::Corrupt(
                        "stored shape differs from the requested one".into(),
                    )),
                    None => Err(TierError::NotFound),
                })
                .collect()
        };
        let n = found.len();
        let r = tokio::task::spawn_blocking(move || {
            found
                .into_iter()
                .map(|f| {
                    let (r, bytes) = f?;
                    if r.dest.len() < bytes.len() {
                        return Err(TierError::Corrupt(format!(
                            "destination of {} bytes for a {}-byte block",
                            r.dest.len(),
                            bytes.len()
                        )));
                    }
                    r.dest.write_at(0, &bytes);
                    Ok(())
                })
                .collect::<Vec<_>>()
        })
        .await;
        r.unwrap_or_else(|_| vec![Err(TierError::Unavailable("copy thread failed".into())); n])
    }

    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        let mut st = self.state.lock();
        let mut n = 0;
        for k in keys {
            if let Some(s) = st.blocks.remove(k) {
                st.used -= s.bytes.len() as u64;
                st.order.retain(|o| o != k);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn flush(&self) -> Result<(), TierError> {
        // Every completed put is visible at once; nothing is buffered.
        Ok(())
    }

    async fn recover(&self) -> Result<Recovered, TierError> {
        // Heap memory does not survive a restart.
        Ok(Recovered::default())
    }
}

/// Reads and checks the pipeline table (the factory's settings check and `build`).
fn checked_config(table: &toml::Table) -> anyhow::Result<HeapStoreConfig> {
    let config: HeapStoreConfig = parse_settings("heap-store tier", table)?;
    if config.capacity == 0 {
        anyhow::bail!("heap-store tier: capacity must be > 0");
    }
    Ok(config)
}

fn build(table: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<BuiltTier> {
    Ok(BuiltTier::Block(Arc::new(HeapStore::new(checked_config(
        table,
    )?))))
}

inventory::submit! {
    TierFactory {
        kind: "heap-store",
        summary: "key-addressed tier below DRAM in this process's heap, oldest evicted first (a third-party example)",
        config: ConfigSchema {
            defaults: defaults_of::<HeapStoreConfig>,
            check: |_, t| checked_config(t).map(drop),
            options: &[
                PluginOption { name: "capacity", help: "bytes the store may hold (size string or bytes)" },
                PluginOption { name: "evict", help: "evict the oldest blocks when a put needs room (false: the put fails as full)" },
                PluginOption { name: "read_bytes_per_sec", help: "declared read bandwidth (0 = unknown)" },
                PluginOption { name: "write_bytes_per_sec", help: "declared write bandwidth (0 = unknown)" },
            ],
        },
        flags: &[],
        default_landing: false,
        build,
    }
}
