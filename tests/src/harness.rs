//! A real server in-process (real gRPC on loopback, a real Unix side channel) and a host-memfd
//! KV cache fixture, for end-to-end tests of the whole data path without a GPU.

use std::path::PathBuf;
use std::sync::Arc;

use pegaflow_api::client::{
    single_group_load, EngineClient, LoadCompletion, NativeLayer, NativeRegistration,
};
use pegaflow_api::load_state::LoadState;
use pegaflow_api::memfd::HostMemfd;
use pegaflow_proto as pb;
use pegaflow_runtime::config::{FdChannelConfig, PipelineConfig};
use pegaflow_runtime::ServerHandle;

// Link the in-tree backends so their factories register.
use pegaflow_tier_dram as _;
use pegaflow_transport_shm as _;

/// Runs a host-memory batch with plain copies: what the test transports do once they let a
/// copy through.
///
/// # Safety
/// Every op's two ranges are live, disjoint memory of `len` bytes, as the engine guarantees a
/// transport until its copy future completes.
pub unsafe fn memcpy_ops(batch: &pegaflow_plugin::CopyBatch) {
    for op in &batch.ops {
        let (src, dst) = match batch.direction {
            pegaflow_plugin::Direction::ToHost => (op.device_addr as usize, op.host_addr),
            pegaflow_plugin::Direction::ToDevice => (op.host_addr, op.device_addr as usize),
        };
        // SAFETY: as the caller promises.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, op.len) };
    }
}

/// A running test server with its temp dir (holding the side-channel socket).
pub struct TestServer {
    /// The server.
    pub handle: ServerHandle,
    /// Side-channel socket path.
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
}

/// Options of a test server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// DRAM tier capacity in bytes.
    pub capacity_bytes: u64,
    /// Lease TTL in seconds.
    pub lease_ttl_secs: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            capacity_bytes: 64 << 20,
            lease_ttl_secs: 600,
        }
    }
}

impl TestServer {
    /// Starts a server on ephemeral loopback ports with a side channel in a temp dir.
    pub async fn start(opts: ServerOptions) -> Self {
        Self::start_with(opts, |_| {}).await
    }

    /// Like [`TestServer::start`], letting `edit` change the pipeline before start-up.
    pub async fn start_with(opts: ServerOptions, edit: impl FnOnce(&mut PipelineConfig)) -> Self {
        Self::try_start_with(opts, edit)
            .await
            .expect("server starts")
    }

    /// Like [`TestServer::start_with`], returning start-up failures instead of panicking.
    ///
    /// # Errors
    /// Whatever [`pegaflow_runtime::start`] refuses (a bad pipeline, a tier that cannot open).
    pub async fn try_start_with(
        opts: ServerOptions,
        edit: impl FnOnce(&mut PipelineConfig),
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("fd.sock");
        let mut p = PipelineConfig::embedded_default();
        p.server.addr = "127.0.0.1:0".into();
        p.server.http_addr = "127.0.0.1:0".into();
        p.server.enable_prometheus = true;
        p.fd_channel = Some(FdChannelConfig {
            path: socket.clone(),
        });
        p.engine.lease_ttl_secs = opts.lease_ttl_secs;
        p.tiers[0].settings.insert(
            "capacity".into(),
            toml::Value::Integer(opts.capacity_bytes as i64),
        );
        edit(&mut p);
        let handle = pegaflow_runtime::start(p).await?;
        Ok(Self {
            handle,
            socket,
            _dir: dir,
        })
    }

    /// Stops the server ([`ServerHandle::shutdown`]) and removes its temp dir.
    pub async fn shutdown(self) {
        self.handle.shutdown().await;
    }

    /// Wraps a server started elsewhere (e.g. from a shipped pipeline) whose side channel is at
    /// `socket` inside `dir`.
    pub fn from_handle(handle: ServerHandle, socket: PathBuf, dir: tempfile::TempDir) -> Self {
        Self {
            handle,
            socket,
            _dir: dir,
        }
    }

    /// A connected client.
    pub async fn client(&self) -> EngineClient {
        EngineClient::connect(&self.handle.endpoint())
            .await
            .expect("connect")
    }

    /// `http://host:port` of the HTTP endpoints.
    pub fn http(&self) -> String {
        format!("http://{}", self.handle.http_addr)
    }
}

/// The shape of a test KV cache: `layers` KV-first tensors `[2, num_blocks, segment_bytes]`
/// in one memfd (split layout: kv_stride = num_blocks * segment_bytes).
#[derive(Debug, Clone, Copy)]
pub struct KvShape {
    /// Layers.
    pub layers: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Bytes of one segment (K or V) of one block.
    pub segment_bytes: usize,
}

impl KvShape {
    /// Bytes of one layer's tensor.
    pub fn layer_bytes(&self) -> usize {
        2 * self.num_blocks * self.segment_bytes
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> usize {
        self.layers * self.layer_bytes()
    }

    /// Name of layer `l`.
    pub fn layer_name(l: usize) -> String {
        format!("model.layers.{l}.self_attn.attn")
    }

    /// Offset of segment `s` of block `b` of layer `l` in the memfd.
    pub fn offset(&self, l: usize, b: usize, s: usize) -> usize {
        l * self.layer_bytes() + s * self.num_blocks * self.segment_bytes + b * self.segment_bytes
    }
}

/// How a test cache places the K and V segments of a block inside each layer's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvArrangement {
    /// KV-first `[2, num_blocks, segment_bytes]`: K and V of a block are `num_blocks *
    /// segment_bytes` apart, registered as `segments: 2` (what [`KvShape::offset`] addresses).
    #[default]
    Split,
    /// Block-first `[num_blocks, 2, segment_bytes]`: a block's K and V are adjacent, one range
    /// of `2 * segment_bytes`, registered as `segments: 1`.
    Contiguous,
}

/// A worker's host-memfd KV cache.
pub struct KvCache {
    /// The memory.
    pub mem: HostMemfd,
    /// Its shape.
    pub shape: KvShape,
    /// Where K and V of a block live in each layer (split unless built otherwise).
    pub arrangement: KvArrangement,
}

/// Deterministic content of (hash, layer, segment): what a saved block must hold.
pub fn pattern(hash: &[u8], layer: usize, seg: usize, len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ ((layer as u64) << 32) ^ ((seg as u64) << 48);
    for &b in hash {
        x = (x ^ b as u64).wrapping_mul(0x100_0000_01B3);
    }
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u8) ^ (i as u8)
        })
        .collect()
}

/// Hash bytes for test block `i` of a sequence tagged `tag`.
pub fn hash_of(tag: &str, i: usize) -> Vec<u8> {
    format!("{tag}-{i:08}").into_bytes()
}

impl KvCache {
    /// A zeroed cache.
    pub fn new(shape: KvShape) -> Self {
        Self::with_arrangement(shape, KvArrangement::Split)
    }

    /// A zeroed cache whose layers are laid out as `arrangement` says.
    pub fn with_arrangement(shape: KvShape, arrangement: KvArrangement) -> Self {
        Self {
            mem: HostMemfd::new("test-kv", shape.total_bytes()).expect("memfd"),
            shape,
            arrangement,
        }
    }

    /// Offset of segment `s` (0 = K, 1 = V) of block `b` of layer `l` in the memfd.
    pub fn segment_offset(&self, l: usize, b: usize, s: usize) -> usize {
        match self.arrangement {
            KvArrangement::Split => self.shape.offset(l, b, s),
            KvArrangement::Contiguous => {
                let seg = self.shape.segment_bytes;
                l * self.shape.layer_bytes() + b * 2 * seg + s * seg
            }
        }
    }

    /// Writes the pattern of `hash` into device block `b` of every layer.
    pub fn fill(&mut self, b: usize, hash: &[u8]) {
        for l in 0..self.shape.layers {
            for s in 0..2 {
                let o = self.segment_offset(l, b, s);
                let p = pattern(hash, l, s, self.shape.segment_bytes);
                self.mem.as_mut_slice()[o..o + p.len()].copy_from_slice(&p);
            }
        }
    }

    /// Overwrites device block `b` of every layer with `byte`.
    pub fn poison(&mut self, b: usize, byte: u8) {
        for l in 0..self.shape.layers {
            for s in 0..2 {
                let o = self.segment_offset(l, b, s);
                self.mem.as_mut_slice()[o..o + self.shape.segment_bytes].fill(byte);
            }
        }
    }

    /// Whether device block `b` holds exactly the pattern of `hash` in every layer.
    pub fn holds(&self, b: usize, hash: &[u8]) -> bool {
        (0..self.shape.layers).all(|l| {
            (0..2).all(|s| {
                let o = self.segment_offset(l, b, s);
                self.mem.as_slice()[o..o + self.shape.segment_bytes]
                    == pattern(hash, l, s, self.shape.segment_bytes)[..]
            })
        })
    }

    /// Whether device block `b` is `byte` everywhere.
    pub fn is_filled_with(&self, b: usize, byte: u8) -> bool {
        (0..self.shape.layers).all(|l| {
            (0..2).all(|s| {
                let o = self.segment_offset(l, b, s);
                self.mem.as_slice()[o..o + self.shape.segment_bytes]
                    .iter()
                    .all(|&x| x == byte)
            })
        })
    }

    /// The native registration of this cache for one worker.
    pub fn registration(
        &self,
        instance_id: &str,
        namespace: &str,
        tp_rank: u32,
        tp_size: u32,
        device_id: i32,
    ) -> NativeRegistration {
        let s = self.shape;
        NativeRegistration {
            instance_id: instance_id.into(),
            namespace: namespace.into(),
            tp_rank,
            tp_size,
            world_size: tp_size,
            pp_rank: 0,
            device_id,
            layers: (0..s.layers)
                .map(|l| match self.arrangement {
                    KvArrangement::Split => NativeLayer {
                        name: KvShape::layer_name(l),
                        num_blocks: s.num_blocks as u64,
                        bytes_per_block: s.segment_bytes as u64,
                        segments: 2,
                        kv_stride_bytes: (s.num_blocks * s.segment_bytes) as u64,
                        offset_bytes: (l * s.layer_bytes()) as u64,
                        block_stride_bytes: s.segment_bytes as u64,
                    },
                    KvArrangement::Contiguous => NativeLayer {
                        name: KvShape::layer_name(l),
                        num_blocks: s.num_blocks as u64,
                        bytes_per_block: (2 * s.segment_bytes) as u64,
                        segments: 1,
                        kv_stride_bytes: 0,
                        offset_bytes: (l * s.layer_bytes()) as u64,
                        block_stride_bytes: (2 * s.segment_bytes) as u64,
                    },
                })
                .collect(),
            layer_group_ids: vec![],
            page_first: false,
        }
    }
}

/// A registered single-worker instance with its cache.
pub struct Worker {
    /// Instance id.
    pub instance_id: String,
    /// TP rank.
    pub tp_rank: u32,
    /// Device id.
    pub device_id: i32,
    /// The cache.
    pub kv: KvCache,
    /// Its client.
    pub client: EngineClient,
}

impl Worker {
    /// Registers a fresh cache of `shape` for (`instance_id`, `tp_rank`, `device_id`).
    pub async fn register(
        server: &TestServer,
        instance_id: &str,
        namespace: &str,
        shape: KvShape,
        tp_rank: u32,
        tp_size: u32,
        device_id: i32,
    ) -> Self {
        let kv = KvCache::new(shape);
        let mut client = server.client().await;
        client
            .register_host_memfd(
                &server.socket,
                &kv.registration(instance_id, namespace, tp_rank, tp_size, device_id),
                &kv.mem,
            )
            .await
            .expect("register");
        Self {
            instance_id: instance_id.into(),
            tp_rank,
            device_id,
            kv,
            client,
        }
    }

    /// Registers a fresh cache with a registration the caller shaped (groups, page-first).
    pub async fn register_with(
        server: &TestServer,
        shape: KvShape,
        reg: NativeRegistration,
    ) -> Result<Self, pegaflow_api::ApiError> {
        Self::register_cache(server, KvCache::new(shape), reg).await
    }

    /// Registers the given cache (any [`KvArrangement`]) with a registration the caller
    /// shaped, typically `kv.registration(..)` with edits.
    pub async fn register_cache(
        server: &TestServer,
        kv: KvCache,
        reg: NativeRegistration,
    ) -> Result<Self, pegaflow_api::ApiError> {
        let mut client = server.client().await;
        client
            .register_host_memfd(&server.socket, &reg, &kv.mem)
            .await?;
        Ok(Self {
            instance_id: reg.instance_id.clone(),
            tp_rank: reg.tp_rank,
            device_id: reg.device_id,
            kv,
            client,
        })
    }

    /// Saves device blocks `ids` of the given layers under `hashes`.
    pub async fn save_layers(
        &mut self,
        layers: &[usize],
        ids: &[u32],
        hashes: &[Vec<u8>],
    ) -> Result<(), pegaflow_api::ApiError> {
        let saves = layers
            .iter()
            .map(|&l| (KvShape::layer_name(l), ids.to_vec(), hashes.to_vec()))
            .collect();
        self.client
            .save(&self.instance_id, self.tp_rank, 0, self.device_id, saves)
            .await
    }

    /// Saves device blocks `ids` of every layer under `hashes`.
    pub async fn save(
        &mut self,
        ids: &[u32],
        hashes: &[Vec<u8>],
    ) -> Result<(), pegaflow_api::ApiError> {
        let saves = (0..self.kv.shape.layers)
            .map(|l| (KvShape::layer_name(l), ids.to_vec(), hashes.to_vec()))
            .collect();
        self.client
            .save(&self.instance_id, self.tp_rank, 0, self.device_id, saves)
            .await
    }

    /// The Load request of `lease` into `targets` (one group of every layer).
    pub fn load_request(
        &self,
        state: &LoadState,
        lease: &[u8],
        targets: &[Option<u32>],
    ) -> pb::LoadRequest {
        single_group_load(
            &self.instance_id,
            self.tp_rank,
            self.device_id,
            (0..self.kv.shape.layers).map(KvShape::layer_name).collect(),
            lease,
            targets.iter().copied(),
            LoadCompletion::StateWord(state.name()),
        )
    }

    /// Loads `lease` into `targets` and waits for the load state; returns the final state.
    pub async fn load(
        &mut self,
        lease: &[u8],
        targets: &[u32],
    ) -> Result<i64, pegaflow_api::ApiError> {
        let state = LoadState::create().expect("load state");
        let t: Vec<Option<u32>> = targets.iter().map(|&b| Some(b)).collect();
        let req = self.load_request(&state, lease, &t);
        self.client.load(req).await?;
        Ok(wait_state(&state).await)
    }
}

/// Waits (≤ 10 s) for a load state to leave 0 and returns it.
pub async fn wait_state(state: &LoadState) -> i64 {
    for _ in 0..10_000 {
        let s = state.get();
        if s != 0 {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    state.get()
}

/// The hit count and lease of a Ready answer (panics on Loading).
pub fn ready(q: pegaflow_api::client::QueryOutcome) -> (u64, Vec<u8>) {
    match q {
        pegaflow_api::client::QueryOutcome::Ready {
            num_hit_blocks,
            lease,
            ..
        } => (num_hit_blocks, lease),
        pegaflow_api::client::QueryOutcome::Loading => panic!("unexpected Loading"),
    }
}

/// Shared pointer alias for tests that move workers across tasks.
pub type Shared<T> = Arc<tokio::sync::Mutex<T>>;

/// A minimal HTTP/1.1 request to the server's HTTP endpoints: `(status, body)`.
pub async fn http(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect http");
    let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}
