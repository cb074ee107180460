//! Registrations racing each other and teardowns: an instance never gets more workers than its
//! world size, a worker never joins a sealed topology, a registration importing while its
//! instance is torn down is refused and released, and a registration waiting for its fd never
//! stalls the teardown of another instance.

use std::time::Duration;

use pegaflow_proto as pb;
use pegaflow_tests::harness::*;
use tonic::Code;

const SMALL: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

/// Sends a registration whose memfd is withheld: its import waits on the side channel.
async fn pending(
    srv: &TestServer,
    kv: &KvCache,
    id: &str,
    tp_rank: u32,
    tp_size: u32,
    device: i32,
) -> tokio::task::JoinHandle<Result<(), pegaflow_api::ApiError>> {
    let req = kv
        .registration(id, "ns", tp_rank, tp_size, device)
        .to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64);
    let mut c = srv.client().await;
    let h = tokio::spawn(async move { c.register(req).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_instance_refuses_more_workers_even_while_one_is_importing() {
    let srv = TestServer::start(ServerOptions::default()).await;
    // world_size 1: device 1 reserves the only place and waits for its memfd.
    let kv1 = KvCache::new(SMALL);
    let first = pending(&srv, &kv1, "race", 0, 1, 1).await;
    // Device 0 is refused: the instance's one worker is already registering.
    let kv0 = KvCache::new(SMALL);
    let mut c = srv.client().await;
    let e = c
        .register_host_memfd(
            &srv.socket,
            &kv0.registration("race", "ns", 0, 1, 0),
            &kv0.mem,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("already fully registered"), "{e}");
    // Device 1's memfd arrives: it registers, alone.
    pegaflow_api::fd::send_fd(&srv.socket, "race", 1, kv1.mem.fd()).unwrap();
    first.await.unwrap().unwrap();
    let mut w = Worker {
        instance_id: "race".into(),
        tp_rank: 0,
        device_id: 1,
        kv: kv1,
        client: srv.client().await,
    };
    let h = vec![hash_of("race", 0)];
    w.kv.fill(0, &h[0]);
    w.save(&[0], &h).await.unwrap();
    let (n, lease) = ready(w.client.query("race", h.clone(), "q").await.unwrap());
    assert_eq!(n, 1);
    w.kv.poison(3, 0);
    assert_eq!(w.load(&lease, &[3]).await.unwrap(), 1);
    assert!(w.kv.holds(3, &h[0]));
    // Device 0 still cannot join the sealed instance.
    let e = c
        .register_host_memfd(
            &srv.socket,
            &kv0.registration("race", "ns", 0, 1, 0),
            &kv0.mem,
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already fully registered"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_registration_importing_during_teardown_is_refused_and_released() {
    let srv = TestServer::start(ServerOptions::default()).await;
    // TP=2: rank 0 registers, rank 1 is importing when the instance is unregistered.
    let r0 = Worker::register(&srv, "torn", "ns", SMALL, 0, 2, 0).await;
    let kv1 = KvCache::new(SMALL);
    let late = pending(&srv, &kv1, "torn", 1, 2, 1).await;
    let mut c = srv.client().await;
    c.unregister("torn").await.unwrap();
    pegaflow_api::fd::send_fd(&srv.socket, "torn", 1, kv1.mem.fd()).unwrap();
    let e = late.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(
        e.to_string()
            .contains("unregistered while device 1 was registering"),
        "{e}"
    );
    assert!(srv.handle.engine.instance_ids().is_empty());
    drop(r0);
    // The id is free again.
    Worker::register(&srv, "torn", "ns", SMALL, 0, 1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_registration_waiting_for_its_fd_does_not_stall_other_teardowns() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut other = Worker::register(&srv, "other", "ns", SMALL, 0, 1, 0).await;
    let kv = KvCache::new(SMALL);
    let _slow = pending(&srv, &kv, "slow", 0, 1, 0).await;
    let r = tokio::time::timeout(Duration::from_secs(2), other.client.unregister("other")).await;
    assert!(
        r.is_ok(),
        "an unrelated unregister waited on a pending registration"
    );
    r.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_hashes_and_repeated_leases_are_refused() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = Worker::register(&srv, "lim", "ns", SMALL, 0, 1, 0).await;
    let e = w.save(&[0], &[vec![7u8; 1025]]).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert_eq!(srv.handle.engine.index().resident_blocks(), 0);
    let h = vec![hash_of("lim", 0)];
    w.save(&[0], &h).await.unwrap();
    let (_, lease) = ready(w.client.query("lim", h.clone(), "q").await.unwrap());
    let state = pegaflow_api::load_state::LoadState::create().unwrap();
    let mut req = w.load_request(&state, &lease, &[Some(1)]);
    req.loads.push(req.loads[0].clone());
    let e = w.client.load(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    // Nothing was consumed: the lease still loads once.
    assert_eq!(w.load(&lease, &[1]).await.unwrap(), 1);
}
