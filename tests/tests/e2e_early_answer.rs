//! A Save is answered once its transport has read all of its device memory (`[server]
//! save_answer_early`, on by default, fired through [`SourceRead`]), and ends in its own task:
//! its blocks are sealed when the copy ends, a failure after the answer stores none of them
//! and is counted, and the client may overwrite its memory from the answer on. A probe
//! transport copies a Save's bytes, fires the signal, then holds the copy's end at a gate the
//! test opens (Loads pass at once).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pegaflow_plugin::*;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_runtime::*;
use pegaflow_tests::harness::*;
use tokio::sync::Semaphore;

/// One permit lets one copy end.
static GATE: Semaphore = Semaphore::const_new(0);
/// Whether the probe fires [`SourceRead`] once its bytes are copied.
static SIGNAL: AtomicBool = AtomicBool::new(true);
/// Whether the probe fails its copies at their end (after the gate, having signalled).
static FAIL: AtomicBool = AtomicBool::new(false);

struct ReadGatedTransport;

#[async_trait]
impl Transport for ReadGatedTransport {
    fn kind(&self) -> &'static str {
        "read-gated-memcpy"
    }
    fn can_address(&self, space: MemorySpace) -> bool {
        space.is_host()
    }
    fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
        Ok(())
    }
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        // SAFETY: the engine keeps both sides alive until this future completes.
        unsafe { memcpy_ops(&batch) };
        if batch.direction != Direction::ToHost {
            return Ok(()); // Loads are not held
        }
        // No listener when the server answers at the end (`save_answer_early = false`).
        if let Some(read) = SourceRead::current().filter(|_| SIGNAL.load(Ordering::SeqCst)) {
            read.fire();
            read.fire(); // a second call does nothing
        }
        GATE.acquire().await.expect("gate open").forget();
        if FAIL.load(Ordering::SeqCst) {
            return Err(TransportError(
                "injected: the copy failed after its device memory was read".into(),
            ));
        }
        Ok(())
    }
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

inventory::submit! {
    TransportFactory { kind: "read-gated-memcpy", summary: "test probe", config: pegaflow_plugin::ConfigSchema::NONE, flags: &[], build: |_, _| Ok(Arc::new(ReadGatedTransport)) }
}

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

async fn server(answer_early: bool) -> TestServer {
    TestServer::start_with(ServerOptions::default(), |p| {
        p.server.save_answer_early = answer_early;
        p.transports = Some(vec![PluginConfig {
            layers: vec![],
            kind: "read-gated-memcpy".into(),
            settings: toml::Table::new(),
        }]);
    })
    .await
}

/// Blocks in the index once every ended Save is sealed.
async fn resident(srv: &TestServer) -> u64 {
    srv.handle.engine.settle().await;
    srv.handle.engine.index().resident_blocks()
}

// One test drives every scenario, because the gate and the switches are process-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_is_answered_when_its_device_memory_is_read_and_sealed_at_its_end() {
    let srv = server(true).await;
    let mut w = Worker::register(&srv, "read", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..6).map(|i| hash_of("read", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }

    // 1. The answer (OK) comes while the copy's end is held; nothing is sealed before it.
    tokio::time::timeout(Duration::from_secs(10), w.save(&[0, 1], &hs[..2]))
        .await
        .expect("answered before the copy ended")
        .expect("saved");
    assert_eq!(
        resident(&srv).await,
        0,
        "nothing sealed before the copy ends"
    );
    // The client reuses its memory at once: the saved blocks keep what was read.
    w.kv.poison(0, 0xEE);
    w.kv.poison(1, 0xEE);
    // Read your acknowledged writes: a query that would stop at the answered Save's blocks
    // waits for its end; one for other blocks answers at once.
    let mut c = srv.client().await;
    let (n, _) = ready(
        c.query("read", vec![hash_of("other", 0)], "q0")
            .await
            .unwrap(),
    );
    assert_eq!(n, 0);
    let q = hs[..2].to_vec();
    let query = tokio::spawn(async move { c.query("read", q, "q1").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !query.is_finished(),
        "the query did not wait for the answered Save"
    );
    GATE.add_permits(1);
    let (n, lease) = ready(query.await.unwrap().unwrap());
    assert_eq!(n, 2, "the acknowledged blocks are hits");
    assert_eq!(w.load(&lease, &[6, 7]).await.unwrap(), 1);
    assert!(w.kv.holds(6, &hs[0]) && w.kv.holds(7, &hs[1]));

    // A Flush waits for an answered Save's end and seal.
    w.save(&[5], &hs[5..6]).await.expect("saved");
    let mut c = srv.client().await;
    let flush = tokio::spawn(async move { c.flush().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!flush.is_finished(), "Flush returned before the Save ended");
    GATE.add_permits(1);
    flush.await.unwrap().expect("flushed");
    assert_eq!(
        srv.handle.engine.index().resident_blocks(),
        3,
        "sealed when Flush returns"
    );

    // 2. A copy that fails after the answer: the client saw OK, no block is stored, the
    // failure is counted, and a query waiting for those blocks answers (a miss).
    let metrics = srv.handle.engine.metrics().clone();
    FAIL.store(true, Ordering::SeqCst);
    w.save(&[2, 3], &hs[2..4]).await.expect("answered ok");
    let mut c = srv.client().await;
    let q = hs[2..4].to_vec();
    let query = tokio::spawn(async move { c.query("read", q, "q2").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !query.is_finished(),
        "the query did not wait for the answered Save"
    );
    GATE.add_permits(1);
    let (n, _) = ready(query.await.unwrap().unwrap());
    assert_eq!(n, 0, "the failed Save stored nothing");
    // Counted when the Save's task ends, just after its window closed.
    let mut late = 0;
    for _ in 0..200 {
        late = metrics.save_late_failures.get();
        if late == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(late, 1, "the late failure is counted");
    assert_eq!(
        resident(&srv).await,
        3,
        "none of the failed Save's blocks stored"
    );
    FAIL.store(false, Ordering::SeqCst);

    // 3. A transport that does not signal: the answer waits for the copy's end.
    SIGNAL.store(false, Ordering::SeqCst);
    let _w = answered_only_at_the_gate(w, 4, hs[4].clone()).await;
    assert_eq!(resident(&srv).await, 4);
    SIGNAL.store(true, Ordering::SeqCst);
    assert_eq!(metrics.save_late_failures.get(), 1);
    srv.shutdown().await;

    // 4. Switched off: the answer waits for the copy's end although the transport signals.
    let srv = server(false).await;
    let mut w = Worker::register(&srv, "late", "ns", SHAPE, 0, 1, 0).await;
    w.kv.fill(5, &hs[5]);
    let _w = answered_only_at_the_gate(w, 5, hs[5].clone()).await;
    assert_eq!(resident(&srv).await, 1);
    srv.shutdown().await;
}

/// Saves block `id` of `w` under `hash` and checks that no answer comes before the gate lets
/// its copy end, then that it is OK; gives `w` back.
async fn answered_only_at_the_gate(mut w: Worker, id: u32, hash: Vec<u8>) -> Worker {
    let call = tokio::spawn(async move {
        let r = w.save(&[id], &[hash]).await;
        (w, r)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "no answer before the copy ended");
    GATE.add_permits(1);
    let (w, r) = call.await.unwrap();
    r.expect("saved");
    w
}
