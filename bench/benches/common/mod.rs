//! A registered single-worker instance on an in-process server, for the benchmarks.

#![allow(dead_code)]

use std::sync::Arc;

use pegaflow_api::client::{single_group_load, EngineClient, LoadCompletion, QueryOutcome};
use pegaflow_bench::server::{layer_name, InProcessServer, KvCache};
use pegaflow_proto as pb;
use pegaflow_runtime::decode;
use pegaflow_runtime::engine::command::{QueryAnswer, QueryCommand, SaveCommand};
use pegaflow_runtime::engine::Engine;

/// The server binary's heap allocator (its default `mimalloc` feature), so that the benches
/// measure the per-block heap work as the server does it.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An in-process server with one registered host-memfd instance.
pub struct Fixture {
    pub server: InProcessServer,
    pub client: EngineClient,
    pub kv: KvCache,
    pub instance: String,
}

impl Fixture {
    /// A server with a DRAM tier of `capacity` and an instance whose cache has `layers`
    /// layers of `num_blocks` blocks of two `segment_bytes` segments.
    pub async fn new(
        capacity: u64,
        layers: usize,
        num_blocks: usize,
        segment_bytes: usize,
    ) -> Self {
        let server = InProcessServer::start(capacity)
            .await
            .expect("server starts");
        let mut client = EngineClient::connect(&server.endpoint())
            .await
            .expect("connect");
        let kv = KvCache::new(layers, num_blocks, segment_bytes).expect("kv cache");
        let instance = format!("bench-{}", uuid_like());
        kv.register(&mut client, server.socket(), &instance, "bench")
            .await
            .expect("register");
        Self {
            server,
            client,
            kv,
            instance,
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        self.server.engine()
    }

    /// The Save command of cache blocks `ids` (every layer) under `hashes`, decoded from its
    /// wire request as the service does.
    pub fn save_request(&self, ids: &[u32], hashes: &[Vec<u8>]) -> SaveCommand {
        decode::save(pb::SaveRequest {
            instance_id: self.instance.clone(),
            tp_rank: 0,
            pp_rank: 0,
            device_id: 0,
            saves: (0..self.kv.layers())
                .map(|l| pb::SaveLayer {
                    layer_name: layer_name(l),
                    block_ids: ids.to_vec(),
                    block_hashes: hashes.to_vec().into(),
                })
                .collect(),
        })
        .expect("a well-formed save")
    }

    /// The Query command of `hashes`.
    pub fn query_request(&self, hashes: &[Vec<u8>]) -> QueryCommand {
        decode::query(pb::QueryRequest {
            instance_id: self.instance.clone(),
            block_hashes: hashes.to_vec(),
            req_id: "bench".into(),
            wait_for_full_prefix: false,
            group_id: 0,
        })
        .expect("a well-formed query")
    }

    /// The Load request of `lease` into cache blocks `targets`, returning when copied.
    pub fn load_request(&self, lease: &[u8], targets: &[u32]) -> pb::LoadRequest {
        single_group_load(
            &self.instance,
            0,
            0,
            (0..self.kv.layers()).map(layer_name).collect(),
            lease,
            targets.iter().map(|&b| Some(b)),
            LoadCompletion::Wait,
        )
    }
}

/// The lease of a Ready answer from the engine.
pub fn lease_of(r: QueryAnswer) -> (u64, Vec<u8>) {
    match r {
        QueryAnswer::Ready {
            num_hit_blocks,
            lease,
            ..
        } => (
            num_hit_blocks,
            lease.map(|l| l.to_vec()).unwrap_or_default(),
        ),
        QueryAnswer::Loading => panic!("unexpected Loading"),
    }
}

/// The lease of a Ready answer from the client.
pub fn lease_of_client(r: QueryOutcome) -> (u64, Vec<u8>) {
    match r {
        QueryOutcome::Ready {
            num_hit_blocks,
            lease,
            ..
        } => (num_hit_blocks, lease),
        QueryOutcome::Loading => panic!("unexpected Loading"),
    }
}

/// 8-byte little-endian hash of `i`.
pub fn hash(i: u64) -> Vec<u8> {
    i.to_le_bytes().to_vec()
}

fn uuid_like() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    )
}

/// A runtime like the server's.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}
