//! The native client SDK (`pegaflow_api::native`) end to end over a host memfd, and the native
//! rules of the server: CUDA-VMM-kind registrations are one GPU only and their loads must wait
//! for completion (driven here by a probe registrar that imports heap memory as that kind).

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_api::client::NativeLayer;
use pegaflow_api::memfd::HostMemfd;
use pegaflow_api::native::NativeEngine;
use pegaflow_plugin::*;
use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_runtime::*;
use pegaflow_tests::harness::*;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 3,
    num_blocks: 16,
    segment_bytes: 512,
};

fn layers() -> Vec<NativeLayer> {
    let kv = KvCache::new(SHAPE);
    kv.registration("x", "ns", 0, 1, 0).layers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_client_roundtrip_over_a_host_memfd() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut kv = KvCache::new(SHAPE);
    let hs: Vec<Vec<u8>> = (0..5).map(|i| hash_of("nat", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        kv.fill(i, h);
    }
    let conn = NativeEngine::connect(&srv.handle.endpoint(), "native-ns")
        .await
        .unwrap();
    assert_eq!(
        conn.socket_path(),
        srv.socket.as_path(),
        "the side channel is found through Health"
    );
    let mut eng = conn
        .register("cpu-engine", 0, &kv.mem, layers())
        .await
        .unwrap();
    assert!(
        eng.instance_id().starts_with("cpu-engine-")
            && eng.instance_id().len() == "cpu-engine-".len() + 32
    );
    let names: Vec<String> = (0..SHAPE.layers).map(KvShape::layer_name).collect();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    eng.save(&names, &[0, 1, 2, 3, 4], &hs).await.unwrap();
    eng.flush().await.unwrap();
    let (n, lease) = eng.query(hs.clone(), "r").await.unwrap();
    assert_eq!(n, 5);
    for b in 0..16 {
        kv.poison(b, 0x42);
    }
    // The load returns when the bytes are in place: no load-state word.
    eng.load(&names, &lease, &[11, 12, 13, 14, 15])
        .await
        .unwrap();
    for (i, h) in hs.iter().enumerate() {
        assert!(kv.holds(11 + i, h), "block {i}");
    }
    // The lease was consumed: releasing it now is an error, never a silent success.
    let e = eng.release(&lease).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    let id = eng.instance_id().to_string();
    eng.unregister().await.unwrap();
    assert!(!srv.handle.engine.instance_ids().contains(&id));
    // A second attempt gets a fresh id.
    let kv2 = HostMemfd::new("again", SHAPE.total_bytes()).unwrap();
    let conn = NativeEngine::connect(&srv.handle.endpoint(), "native-ns")
        .await
        .unwrap();
    let eng2 = conn
        .register("cpu-engine", 0, &kv2, layers())
        .await
        .unwrap();
    assert_ne!(eng2.instance_id(), id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_fails_when_the_side_channel_is_off() {
    let srv = TestServer::start_with(ServerOptions::default(), |p| p.fd_channel = None).await;
    let e = NativeEngine::connect(&srv.handle.endpoint(), "ns")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("--fd-socket-path"), "{e}");
}

/// Heap memory imported as if it were a CUDA VMM allocation (location Host, so the memcpy
/// transport reaches it): exercises the engine's native-VMM rules without a GPU.
struct FakeVmm(Vec<u8>);
impl Registration for FakeVmm {
    fn location(&self) -> MemorySpace {
        MemorySpace::HOST
    }
    fn base_addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn len_bytes(&self) -> u64 {
        self.0.len() as u64
    }
    fn describe(&self) -> String {
        "fake vmm".into()
    }
}
struct FakeVmmRegistrar;
#[async_trait]
impl Registrar for FakeVmmRegistrar {
    fn kind(&self) -> &'static str {
        "fake-vmm"
    }
    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "probe",
            carrier: PayloadCarrier::SideChannel { memory_kind: 2 },
        }
    }
    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits {
            completion_by_rpc_only: true,
            max_world_size: Some(1),
        }
    }
    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let RegistrationPayload::SideChannel {
            alloc_size, views, ..
        } = req.payload
        else {
            return Err(RegistrarError::Invalid("native only".into()));
        };
        let m: Arc<dyn Registration> = Arc::new(FakeVmm(vec![0; alloc_size as usize]));
        Ok(views
            .iter()
            .map(|v| LayerRegion {
                memory: m.clone(),
                offset: v.offset_bytes,
                len: v.size_bytes,
            })
            .collect())
    }
}
inventory::submit! {
    RegistrarFactory { kind: "fake-vmm", summary: "test", config: pegaflow_plugin::ConfigSchema::NONE, flags: &[], build: |_, _| Ok(Arc::new(FakeVmmRegistrar)) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmm_registrations_are_single_gpu_and_load_synchronously() {
    let srv = TestServer::start_with(ServerOptions::default(), |p| {
        p.registrars = Some(vec![PluginConfig {
            layers: vec![],
            kind: "fake-vmm".into(),
            settings: toml::Table::new(),
        }]);
    })
    .await;
    let kv = KvCache::new(SHAPE);
    let mut c = srv.client().await;
    // Several GPUs for one native VMM instance: refused before anything is imported.
    let mut req = kv
        .registration("vmm-tp2", "ns", 0, 2, 0)
        .to_request(pb::MemoryKind::CudaVmm, kv.mem.len() as u64);
    req.world_size = 2;
    let e = c.register(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("at most 1 worker"), "{e}");
    // One GPU: fine.
    let req = kv
        .registration("vmm", "ns", 0, 1, 0)
        .to_request(pb::MemoryKind::CudaVmm, kv.mem.len() as u64);
    c.register(req).await.unwrap();
    let hs = vec![hash_of("vmm", 0)];
    let names: Vec<String> = (0..SHAPE.layers).map(KvShape::layer_name).collect();
    c.save(
        "vmm",
        0,
        0,
        0,
        names
            .iter()
            .map(|n| (n.clone(), vec![0], hs.clone()))
            .collect(),
    )
    .await
    .unwrap();
    let (n, lease) = ready(c.query("vmm", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 1);
    // A load through the load-state word is refused for native VMM instances.
    let state = pegaflow_api::load_state::LoadState::create().unwrap();
    let mut load = pb::LoadRequest {
        instance_id: "vmm".into(),
        tp_rank: 0,
        device_id: 0,
        load_state_shm: state.name().into(),
        groups: vec![pb::LoadGroup {
            layer_names: names.clone(),
        }],
        loads: vec![pb::LeaseLoad {
            lease: lease.clone(),
            block_ids_by_group: vec![pb::LoadBlockIds {
                targets: vec![pb::LoadBlockTarget {
                    target: Some(pb::load_block_target::Target::BlockId(3)),
                }],
            }],
        }],
        wait_for_completion: false,
    };
    let e = c.load(load.clone()).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("wait_for_completion"), "{e}");
    // wait_for_completion with a load-state name is contradictory.
    load.wait_for_completion = true;
    let e = c.load(load.clone()).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    load.load_state_shm.clear();
    c.load(load).await.unwrap();
}
