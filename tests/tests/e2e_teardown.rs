//! Fence → drain → unmap, whatever the order of cancellations: a Save or Load whose RPC is
//! cancelled keeps its registration mapped until its copy has ended, and teardown releases the
//! mapping only after every accepted copy finished. Probe plugins record the order of events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::*;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_runtime::*;
use pegaflow_tests::harness::*;
use tonic::Code;

static EVENTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static COPY_DELAY_MS: AtomicU64 = AtomicU64::new(0);

fn event(e: impl Into<String>) {
    EVENTS.lock().push(e.into());
}

/// Host memory from the heap; its drop is the "unmap" event.
struct ProbeRegion {
    mem: Vec<u8>,
    tag: String,
}

impl Registration for ProbeRegion {
    fn location(&self) -> MemorySpace {
        MemorySpace::HOST
    }
    fn base_addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    fn len_bytes(&self) -> u64 {
        self.mem.len() as u64
    }
    fn describe(&self) -> String {
        format!("probe region {}", self.tag)
    }
}

impl Drop for ProbeRegion {
    fn drop(&mut self) {
        event(format!("unmap {}", self.tag));
    }
}

struct ProbeRegistrar;

#[async_trait]
impl Registrar for ProbeRegistrar {
    fn kind(&self) -> &'static str {
        "probe-host"
    }
    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "probe",
            carrier: PayloadCarrier::SideChannel { memory_kind: 1 },
        }
    }
    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits::default()
    }
    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let RegistrationPayload::SideChannel {
            alloc_size, views, ..
        } = req.payload
        else {
            return Err(RegistrarError::Invalid(
                "probe takes native payloads".into(),
            ));
        };
        let mem: Arc<dyn Registration> = Arc::new(ProbeRegion {
            mem: vec![7u8; alloc_size as usize],
            tag: req.instance_id.clone(),
        });
        Ok(views
            .iter()
            .map(|v| LayerRegion {
                memory: mem.clone(),
                offset: v.offset_bytes,
                len: v.size_bytes,
            })
            .collect())
    }
}

struct ProbeTransport;

#[async_trait]
impl Transport for ProbeTransport {
    fn kind(&self) -> &'static str {
        "probe-memcpy"
    }
    fn can_address(&self, space: MemorySpace) -> bool {
        space.is_host()
    }
    fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
        Ok(())
    }
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        event(format!("copy start {:?}", batch.direction));
        tokio::time::sleep(Duration::from_millis(COPY_DELAY_MS.load(Ordering::Relaxed))).await;
        // SAFETY: the engine keeps both sides alive until this future completes.
        unsafe { memcpy_ops(&batch) };
        event(format!("copy end {:?}", batch.direction));
        Ok(())
    }
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

inventory::submit! {
    RegistrarFactory { kind: "probe-host", summary: "test probe", config: pegaflow_plugin::ConfigSchema::NONE, flags: &[], build: |_, _| Ok(Arc::new(ProbeRegistrar)) }
}
inventory::submit! {
    TransportFactory { kind: "probe-memcpy", summary: "test probe", config: pegaflow_plugin::ConfigSchema::NONE, flags: &[], build: |_, _| Ok(Arc::new(ProbeTransport)) }
}

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

async fn probe_server() -> TestServer {
    TestServer::start_with(ServerOptions::default(), |p| {
        p.registrars = Some(vec![PluginConfig {
            layers: vec![],
            kind: "probe-host".into(),
            settings: toml::Table::new(),
        }]);
        p.transports = Some(vec![PluginConfig {
            layers: vec![],
            kind: "probe-memcpy".into(),
            settings: toml::Table::new(),
        }]);
    })
    .await
}

fn position(events: &[String], e: &str) -> usize {
    events
        .iter()
        .position(|x| x == e)
        .unwrap_or_else(|| panic!("no event {e:?} in {events:?}"))
}

// One test drives both scenarios, because the probe's event log and delay are process-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_copies_finish_before_their_mapping_is_released() {
    let srv = probe_server().await;
    let mut w = Worker::register(&srv, "cancel-save", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..4).map(|i| hash_of("c", i)).collect();

    // 1. A Save whose RPC is cancelled mid-copy, then an immediate unregister.
    EVENTS.lock().clear();
    COPY_DELAY_MS.store(400, Ordering::Relaxed);
    let r = tokio::time::timeout(Duration::from_millis(100), w.save(&[0, 1, 2, 3], &hs)).await;
    assert!(r.is_err(), "the client gave up on the save");
    let mut c = srv.client().await;
    c.unregister("cancel-save").await.unwrap();
    let ev = EVENTS.lock().clone();
    assert!(
        position(&ev, "copy end ToHost") < position(&ev, "unmap cancel-save"),
        "unmapped before the cancelled save's copy ended: {ev:?}"
    );
    // The cancelled save still completed and sealed its blocks (cancellation-independent).
    assert_eq!(srv.handle.engine.index().resident_blocks(), 4);
    // New work on the torn-down instance is refused.
    let e = w.save(&[0], &hs[..1]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition));

    // 2. A Load in flight (the RPC returned at once), then unregister: drain waits for it.
    COPY_DELAY_MS.store(0, Ordering::Relaxed);
    let mut w = Worker::register(&srv, "drain-load", "ns", SHAPE, 0, 1, 0).await;
    let (n, lease) = ready(w.client.query("drain-load", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 4);
    EVENTS.lock().clear();
    COPY_DELAY_MS.store(400, Ordering::Relaxed);
    let state = pegaflow_api::load_state::LoadState::create().unwrap();
    let req = w.load_request(&state, &lease, &[Some(4), Some(5), Some(6), Some(7)]);
    w.client.load(req).await.unwrap();
    let mut c = srv.client().await;
    c.unregister("drain-load").await.unwrap();
    let ev = EVENTS.lock().clone();
    assert!(
        position(&ev, "copy end ToDevice") < position(&ev, "unmap drain-load"),
        "unmapped before the accepted load finished: {ev:?}"
    );
    assert_eq!(state.get(), 1, "the drained load completed");

    // 3. A registration under an id still being torn down is refused (native clients mint a
    // fresh id per attempt); once the teardown has released the mapping, the id is free again.
    COPY_DELAY_MS.store(400, Ordering::Relaxed);
    let mut w = Worker::register(&srv, "reuse", "ns", SHAPE, 0, 1, 0).await;
    let hs2: Vec<Vec<u8>> = (0..2).map(|i| hash_of("r", i)).collect();
    let save = tokio::spawn(async move { w.save(&[0, 1], &hs2).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut c = srv.client().await;
    let unreg = tokio::spawn(async move { c.unregister("reuse").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    EVENTS.lock().clear();
    let kv = KvCache::new(SHAPE);
    let mut c2 = srv.client().await;
    let e = c2
        .register_host_memfd(
            &srv.socket,
            &kv.registration("reuse", "ns", 0, 1, 0),
            &kv.mem,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("still being torn down"), "{e}");
    save.await.unwrap().unwrap();
    unreg.await.unwrap().unwrap();
    let again = Worker::register(&srv, "reuse", "ns", SHAPE, 0, 1, 0).await;
    event("registered again");
    let ev = EVENTS.lock().clone();
    assert!(
        position(&ev, "unmap reuse") < position(&ev, "registered again"),
        "a registration crossed the teardown of the same id: {ev:?}"
    );
    drop(again);
}
