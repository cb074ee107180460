//! An in-process server on the embedded default pipeline (real gRPC on loopback, a real Unix
//! side channel), and the host-memfd KV cache a replaying client registers with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use pegaflow_api::client::{EngineClient, NativeLayer, NativeRegistration};
use pegaflow_api::memfd::HostMemfd;
use pegaflow_runtime::config::{FdChannelConfig, PipelineConfig};
use pegaflow_runtime::engine::Engine;
use pegaflow_runtime::ServerHandle;

// Link the in-tree backends so their factories register with `inventory`.
use pegaflow_tier_dram as _;
use pegaflow_transport_shm as _;

/// A server running in this process, with the temp dir holding its side-channel socket.
pub struct InProcessServer {
    handle: ServerHandle,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for InProcessServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessServer")
            .field("grpc", &self.handle.grpc_addr)
            .field("socket", &self.socket)
            .finish()
    }
}

impl InProcessServer {
    /// Starts the embedded default pipeline with a DRAM tier of `capacity_bytes`, gRPC and
    /// HTTP on ephemeral loopback ports and the fd side channel in a fresh temp dir. Must be
    /// called inside a tokio runtime. `PF_BENCH_EVICT_AHEAD_PERCENT` (0–50), when set,
    /// replaces `[store] evict_ahead_percent` (default 10), for an A/B of evict-ahead.
    ///
    /// # Errors
    /// A bad `PF_BENCH_EVICT_AHEAD_PERCENT`, or the server cannot start.
    pub async fn start(capacity_bytes: u64) -> anyhow::Result<Self> {
        let evict_ahead = match std::env::var("PF_BENCH_EVICT_AHEAD_PERCENT") {
            Ok(v) => Some(
                v.parse()
                    .with_context(|| format!("PF_BENCH_EVICT_AHEAD_PERCENT={v:?} is not 0-50"))?,
            ),
            Err(_) => None,
        };
        Self::start_with(capacity_bytes, evict_ahead).await
    }

    /// [`InProcessServer::start`] with `[store] evict_ahead_percent` set to `evict_ahead`
    /// (`None`: the default; `Some(0)`: off, so that the pool holds exactly what an LRU
    /// cache of its capacity holds).
    ///
    /// # Errors
    /// A percentage above 50, or the server cannot start.
    pub async fn start_with(capacity_bytes: u64, evict_ahead: Option<u8>) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("pegaflow-replay-")
            .tempdir()
            .context("cannot create a temp dir for the side-channel socket")?;
        let socket = dir.path().join("fd.sock");
        let mut p = PipelineConfig::embedded_default();
        p.server.addr = "127.0.0.1:0".into();
        p.server.http_addr = "127.0.0.1:0".into();
        p.server.enable_prometheus = true;
        p.fd_channel = Some(FdChannelConfig {
            path: socket.clone(),
        });
        let tier = p
            .tiers
            .iter_mut()
            .find(|t| t.kind == "dram")
            .context("the embedded default pipeline has no dram tier")?;
        if let Some(v) = evict_ahead {
            p.store.evict_ahead_percent = v;
            p.store.validate()?;
        }
        let cap = i64::try_from(capacity_bytes).context("capacity too large")?;
        tier.settings
            .insert("capacity".into(), toml::Value::Integer(cap));
        let handle = pegaflow_runtime::start(p)
            .await
            .context("cannot start the in-process server")?;
        Ok(Self {
            handle,
            socket,
            _dir: dir,
        })
    }

    /// `http://127.0.0.1:port` of the gRPC service.
    pub fn endpoint(&self) -> String {
        self.handle.endpoint()
    }

    /// The side-channel socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The engine (for its metrics and index).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.handle.engine
    }

    /// Stops serving.
    pub async fn shutdown(self) {
        self.handle.shutdown().await;
    }
}

/// Name of layer `l` (vLLM's attention layer naming).
pub fn layer_name(l: usize) -> String {
    format!("model.layers.{l}.self_attn.attn")
}

/// A worker's KV cache in a host memfd: `layers` KV-first tensors
/// `[2, num_blocks, segment_bytes]` one after the other (split K/V layout, as vLLM's
/// FlashAttention backend allocates it).
pub struct KvCache {
    mem: HostMemfd,
    layers: usize,
    num_blocks: usize,
    segment_bytes: usize,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layers", &self.layers)
            .field("num_blocks", &self.num_blocks)
            .field("segment_bytes", &self.segment_bytes)
            .finish()
    }
}

impl KvCache {
    /// A zeroed cache of `layers` × `num_blocks` blocks of 2 segments of `segment_bytes`.
    pub fn new(layers: usize, num_blocks: usize, segment_bytes: usize) -> anyhow::Result<Self> {
        let total = layers
            .checked_mul(num_blocks)
            .and_then(|v| v.checked_mul(2 * segment_bytes))
            .filter(|&v| v > 0)
            .context("KV cache size is zero or overflows")?;
        let mem = HostMemfd::new("pegaflow-replay-kv", total)
            .with_context(|| format!("cannot create a {total}-byte memfd"))?;
        Ok(Self {
            mem,
            layers,
            num_blocks,
            segment_bytes,
        })
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of one segment.
    pub fn segment_bytes(&self) -> usize {
        self.segment_bytes
    }

    /// Bytes of one layer's tensor.
    pub fn layer_bytes(&self) -> usize {
        2 * self.num_blocks * self.segment_bytes
    }

    /// Offset of segment `seg` of block `block` of layer `layer` in the memfd.
    pub fn offset(&self, layer: usize, block: usize, seg: usize) -> usize {
        layer * self.layer_bytes()
            + seg * self.num_blocks * self.segment_bytes
            + block * self.segment_bytes
    }

    /// Segment `seg` of block `block` of layer `layer`.
    pub fn segment(&self, layer: usize, block: usize, seg: usize) -> &[u8] {
        let o = self.offset(layer, block, seg);
        &self.mem.as_slice()[o..o + self.segment_bytes]
    }

    /// Segment `seg` of block `block` of layer `layer`, writable.
    pub fn segment_mut(&mut self, layer: usize, block: usize, seg: usize) -> &mut [u8] {
        let o = self.offset(layer, block, seg);
        let n = self.segment_bytes;
        &mut self.mem.as_mut_slice()[o..o + n]
    }

    /// The memfd.
    pub fn memfd(&self) -> &HostMemfd {
        &self.mem
    }

    /// The native registration of this cache as the single worker (tp = world = 1) of
    /// `instance_id` in `namespace`.
    pub fn registration(&self, instance_id: &str, namespace: &str) -> NativeRegistration {
        NativeRegistration {
            instance_id: instance_id.into(),
            namespace: namespace.into(),
            tp_rank: 0,
            tp_size: 1,
            world_size: 1,
            pp_rank: 0,
            device_id: 0,
            layers: (0..self.layers)
                .map(|l| NativeLayer {
                    name: layer_name(l),
                    num_blocks: self.num_blocks as u64,
                    bytes_per_block: self.segment_bytes as u64,
                    segments: 2,
                    kv_stride_bytes: (self.num_blocks * self.segment_bytes) as u64,
                    offset_bytes: (l * self.layer_bytes()) as u64,
                    block_stride_bytes: self.segment_bytes as u64,
                })
                .collect(),
            layer_group_ids: vec![],
            page_first: false,
        }
    }

    /// Registers this cache with the server at `client`, sending the memfd on the side
    /// channel at `socket`.
    pub async fn register(
        &self,
        client: &mut EngineClient,
        socket: &Path,
        instance_id: &str,
        namespace: &str,
    ) -> anyhow::Result<()> {
        client
            .register_host_memfd(
                socket,
                &self.registration(instance_id, namespace),
                &self.mem,
            )
            .await
            .with_context(|| format!("cannot register instance {instance_id}"))
    }
}

/// The side-channel socket of a running server, from its Health answer.
pub async fn side_channel_of(client: &mut EngineClient, endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = client
        .health()
        .await
        .with_context(|| format!("Health of {endpoint} failed"))?;
    if path.is_empty() {
        anyhow::bail!(
            "the server at {endpoint} has no fd side channel; start it with --fd-socket-path PATH \
             (host-memfd registration needs it)"
        );
    }
    Ok(PathBuf::from(path))
}
