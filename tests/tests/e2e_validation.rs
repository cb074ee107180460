//! Every bad input of engine-wire.md §5 is rejected with the right code before any copy, and
//! changes nothing; block ids past the registration never reach memory.

use pegaflow_api::load_state::LoadState;
use pegaflow_proto as pb;
use pegaflow_tests::harness::*;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

fn base_register() -> pb::RegisterContextRequest {
    pb::RegisterContextRequest {
        instance_id: "bad".into(),
        namespace: "ns".into(),
        tp_rank: 0,
        tp_size: 1,
        world_size: 1,
        device_id: 0,
        layer_names: vec!["L".into()],
        wrapper_bytes: vec![b"W".to_vec()],
        num_blocks: vec![10],
        bytes_per_block: vec![20],
        kv_stride_bytes: vec![0],
        segments: vec![1],
        client_version: pb::PUBLISHED_CLIENT_VERSION.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_registrations_are_rejected_with_the_published_codes() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut c = srv.client().await;
    type Mutate = fn(&mut pb::RegisterContextRequest);
    let cases: Vec<(&str, Mutate, Code, &str)> = vec![
        (
            "negative device",
            |r| r.device_id = -1,
            Code::InvalidArgument,
            "device_id",
        ),
        (
            "tp_size 0",
            |r| r.tp_size = 0,
            Code::InvalidArgument,
            "tp_size",
        ),
        (
            "world_size 0",
            |r| r.world_size = 0,
            Code::InvalidArgument,
            "world_size",
        ),
        (
            "tp_rank >= tp_size",
            |r| r.tp_rank = 1,
            Code::InvalidArgument,
            "tp_rank",
        ),
        (
            "list mismatch",
            |r| r.layer_names.push("M".into()),
            Code::InvalidArgument,
            "entries",
        ),
        (
            "no layers",
            |r| {
                r.layer_names.clear();
                r.wrapper_bytes.clear();
                r.num_blocks.clear();
                r.bytes_per_block.clear();
                r.kv_stride_bytes.clear();
                r.segments.clear();
            },
            Code::InvalidArgument,
            "at least one layer",
        ),
        (
            "group ids mismatch",
            |r| r.layer_group_ids = vec![0, 1],
            Code::InvalidArgument,
            "layer_group_ids",
        ),
        (
            "duplicate layer",
            |r| {
                r.layer_names = vec!["L".into(), "L".into()];
                r.wrapper_bytes = vec![vec![1], vec![2]];
                r.num_blocks = vec![1, 1];
                r.bytes_per_block = vec![1, 1];
                r.kv_stride_bytes = vec![0, 0];
                r.segments = vec![1, 1];
            },
            Code::InvalidArgument,
            "duplicate layer",
        ),
        (
            "unknown version",
            |r| r.client_version = "0.26.0".into(),
            Code::FailedPrecondition,
            "client=0.26.0 server=0.25.1",
        ),
        (
            "missing version",
            |r| r.client_version.clear(),
            Code::FailedPrecondition,
            "client=<missing>",
        ),
        (
            "native fields from the Python version",
            |r| r.memory_kind = 1,
            Code::FailedPrecondition,
            "native wire revision",
        ),
        (
            "unknown transfer mode",
            |r| r.transfer_mode = 7,
            Code::InvalidArgument,
            "transfer_mode",
        ),
        (
            "page_first with groups",
            |r| {
                r.page_first = true;
                r.layer_group_ids = vec![1];
            },
            Code::InvalidArgument,
            "page_first",
        ),
    ];
    for (name, mutate, code, needle) in cases {
        let mut r = base_register();
        mutate(&mut r);
        let e = c.register(r).await.unwrap_err();
        assert_eq!(e.code(), Some(code), "{name}: {e}");
        assert!(e.to_string().contains(needle), "{name}: {e}");
    }
    // A CUDA-IPC registration on a server without a cuda-ipc registrar: a clear INTERNAL.
    let e = c.register(base_register()).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::Internal), "{e}");
    assert!(e.to_string().contains("wrapper_bytes"), "{e}");
    // Nothing was registered, and the server keeps serving.
    assert!(srv.handle.engine.instance_ids().is_empty());
    c.health().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_layouts_out_of_bounds_are_refused() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let kv = KvCache::new(SHAPE);
    let mut c = srv.client().await;
    // The last layer's view reaches one byte past the memfd.
    let mut reg = kv.registration("oob", "ns", 0, 1, 0);
    reg.layers[1].offset_bytes += 1;
    let e = c
        .register_host_memfd(&srv.socket, &reg, &kv.mem)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    // num_blocks larger than the view.
    let mut reg = kv.registration("oob", "ns", 0, 1, 0);
    reg.layers[0].num_blocks += 1;
    let req = reg.to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64);
    let mut req2 = req.clone();
    req2.native_kv_tensors[0].size_bytes = SHAPE.layer_bytes() as u64; // claims the old span
    pegaflow_api::fd::send_fd(&srv.socket, "oob", 0, kv.mem.fd()).unwrap();
    let e = c.register(req2).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("layer"), "{e}");
    // The fd of a failed registration was discarded, so a correct retry works at once.
    let good = kv.registration("oob", "ns", 0, 1, 0);
    c.register_host_memfd(&srv.socket, &good, &kv.mem)
        .await
        .unwrap();
    assert_eq!(srv.handle.engine.instance_ids(), vec!["oob".to_string()]);
    // The same device twice.
    let e = c
        .register_host_memfd(&srv.socket, &good, &kv.mem)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("already"), "{e}");
}

/// Every refused registration closes the descriptor its client sent on the side channel at
/// once (issue 41), whatever the reason: refusals decided while decoding (answered before the
/// server has read the descriptor the client sent just before: without the fix about half of
/// them stayed pending for the 60 s TTL) and refusals by the instance's state (without the fix,
/// all of them stayed). The gauge `pegaflow_fd_channel_pending` ends at 0 and a correct
/// registration under a refused key succeeds at once (no duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_registrations_close_their_descriptors() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let ch = srv.handle.fd_channel.clone().unwrap();
    let kv = KvCache::new(SHAPE);
    let mut c = srv.client().await;
    type Mutate = fn(&mut pb::RegisterContextRequest);
    let decode_refusals: [(&str, Mutate); 4] = [
        ("duplicate layer name", |r| {
            r.layer_names[1] = r.layer_names[0].clone()
        }),
        ("bad version", |r| r.client_version = "0.24.0".into()),
        ("both payload kinds", |r| {
            r.wrapper_bytes = vec![b"W".to_vec(); r.layer_names.len()]
        }),
        ("native fields dropped", |r| {
            r.memory_kind = 0;
            r.native_kv_tensors.clear();
            r.native_alloc_size = 0;
        }),
    ];
    let mut refused = 0;
    for round in 0..25 {
        for (what, mutate) in &decode_refusals {
            let id = format!("dec-{round}-{}", what.replace(' ', "-"));
            let mut req = kv
                .registration(&id, "ns", 0, 1, 0)
                .to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64);
            mutate(&mut req);
            pegaflow_api::fd::send_fd(&srv.socket, &id, 0, kv.mem.fd()).unwrap();
            let e = c.register(req).await.unwrap_err();
            assert!(
                matches!(
                    e.code(),
                    Some(Code::InvalidArgument | Code::FailedPrecondition)
                ),
                "{what}: {e}"
            );
            refused += 1;
        }
    }
    // Refusals by the instance's state: the device already registered, another topology,
    // another namespace, an instance already complete.
    let good = kv.registration("st", "ns", 0, 1, 0);
    c.register_host_memfd(&srv.socket, &good, &kv.mem)
        .await
        .unwrap();
    let state_refusals = [
        ("device already registered", good.clone(), "already exists"),
        (
            "topology mismatch",
            kv.registration("st", "ns", 0, 2, 1),
            "topology mismatch",
        ),
        (
            "namespace mismatch",
            kv.registration("st", "other", 0, 1, 1),
            "namespace",
        ),
        (
            "instance complete",
            kv.registration("st", "ns", 0, 1, 1),
            "fully registered",
        ),
    ];
    for (what, reg, needle) in state_refusals {
        let e = c
            .register_host_memfd(&srv.socket, &reg, &kv.mem)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(Code::FailedPrecondition), "{what}: {e}");
        assert!(e.to_string().contains(needle), "{what}: {e}");
        refused += 1;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while ch.stats().discarded < refused {
        assert!(
            std::time::Instant::now() < deadline,
            "{refused} refusals, {:?}",
            ch.stats()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let s = ch.stats();
    assert_eq!((s.pending, s.discarded), (0, refused), "{s:?}");
    assert_eq!(ch.pending(), 0);
    let (_, metrics) = http(srv.handle.http_addr, "GET", "/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l == "pegaflow_fd_channel_pending 0"),
        "{metrics}"
    );
    // A refused key is free at once: the corrected registration succeeds.
    c.register_host_memfd(
        &srv.socket,
        &kv.registration("dec-0-bad-version", "ns", 0, 1, 0),
        &kv.mem,
    )
    .await
    .unwrap();
    assert_eq!(ch.stats().rejected_duplicate, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_saves_and_loads_change_nothing() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let mut w = Worker::register(&srv, "v", "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..4).map(|i| hash_of("v", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    let layer = KvShape::layer_name(0);
    let save = |layer: &str, ids: Vec<u32>, hashes: Vec<Vec<u8>>| pb::SaveRequest {
        instance_id: "v".into(),
        tp_rank: 0,
        device_id: 0,
        pp_rank: 0,
        saves: vec![pb::SaveLayer {
            layer_name: layer.into(),
            block_ids: ids,
            block_hashes: hashes.into(),
        }],
    };
    let cases: Vec<(&str, pb::SaveRequest, Code)> = vec![
        (
            "ids/hashes mismatch",
            save(&layer, vec![0, 1], hs[..1].to_vec()),
            Code::InvalidArgument,
        ),
        (
            "block id past the registration",
            save(&layer, vec![8], hs[..1].to_vec()),
            Code::InvalidArgument,
        ),
        (
            "block id u32::MAX",
            save(&layer, vec![u32::MAX], hs[..1].to_vec()),
            Code::InvalidArgument,
        ),
        (
            "unknown layer",
            save("nope", vec![0], hs[..1].to_vec()),
            Code::InvalidArgument,
        ),
        (
            "negative device",
            pb::SaveRequest {
                device_id: -3,
                ..save(&layer, vec![0], hs[..1].to_vec())
            },
            Code::InvalidArgument,
        ),
        (
            "unknown device",
            pb::SaveRequest {
                device_id: 5,
                ..save(&layer, vec![0], hs[..1].to_vec())
            },
            Code::FailedPrecondition,
        ),
        (
            "pp_rank mismatch",
            pb::SaveRequest {
                pp_rank: 1,
                ..save(&layer, vec![0], hs[..1].to_vec())
            },
            Code::InvalidArgument,
        ),
        (
            "unknown instance",
            pb::SaveRequest {
                instance_id: "zz".into(),
                ..save(&layer, vec![0], hs[..1].to_vec())
            },
            Code::FailedPrecondition,
        ),
    ];
    for (name, req, code) in cases {
        let e = w.client.raw().save(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{name}: {e:?}");
    }
    assert_eq!(
        srv.handle.engine.index().resident_blocks(),
        0,
        "nothing saved"
    );
    assert_eq!(
        srv.handle.engine.pool().used_bytes(),
        0,
        "nothing allocated"
    );
    // pp_rank mismatch names the device and the pp_rank.
    let e = w
        .client
        .raw()
        .save(pb::SaveRequest {
            pp_rank: 1,
            ..save(&layer, vec![0], hs[..1].to_vec())
        })
        .await
        .unwrap_err();
    assert!(
        e.message().contains("device_id 0") && e.message().contains("pp_rank 1"),
        "{e:?}"
    );

    // A good save, then loads that must not touch memory.
    w.save(&[0, 1, 2, 3], &hs).await.unwrap();
    let (n, lease) = ready(w.client.query("v", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 4);
    for b in 0..8 {
        w.kv.poison(b, 0xEE);
    }
    let names: Vec<String> = (0..SHAPE.layers).map(KvShape::layer_name).collect();
    let target = |b: Option<u32>| pb::LoadBlockTarget {
        target: b.map(pb::load_block_target::Target::BlockId),
    };
    let load = |state: &LoadState,
                lease: Vec<u8>,
                targets: Vec<Option<u32>>,
                names: Vec<String>| pb::LoadRequest {
        instance_id: "v".into(),
        tp_rank: 0,
        device_id: 0,
        load_state_shm: state.name().into(),
        groups: vec![pb::LoadGroup { layer_names: names }],
        loads: vec![pb::LeaseLoad {
            lease,
            block_ids_by_group: vec![pb::LoadBlockIds {
                targets: targets.into_iter().map(target).collect(),
            }],
        }],
        wait_for_completion: false,
    };
    let some = |v: &[u32]| v.iter().map(|&b| Some(b)).collect::<Vec<_>>();
    type LoadCase = (&'static str, Vec<u8>, Vec<Option<u32>>, Vec<String>, Code);
    let cases: Vec<LoadCase> = vec![
        (
            "target past the registration",
            lease.clone(),
            some(&[0, 1, 2, 8]),
            names.clone(),
            Code::InvalidArgument,
        ),
        (
            "count mismatch",
            lease.clone(),
            some(&[0, 1]),
            names.clone(),
            Code::InvalidArgument,
        ),
        (
            "lease of 15 bytes",
            lease[..15].to_vec(),
            some(&[0, 1, 2, 3]),
            names.clone(),
            Code::InvalidArgument,
        ),
        (
            "empty lease",
            vec![],
            some(&[0, 1, 2, 3]),
            names.clone(),
            Code::InvalidArgument,
        ),
        (
            "unknown lease",
            vec![7; 16],
            some(&[0, 1, 2, 3]),
            names.clone(),
            Code::FailedPrecondition,
        ),
        (
            "unknown layer",
            lease.clone(),
            some(&[0, 1, 2, 3]),
            vec!["nope".into()],
            Code::InvalidArgument,
        ),
        (
            "duplicate layer",
            lease.clone(),
            some(&[0, 1, 2, 3]),
            vec![names[0].clone(), names[0].clone()],
            Code::InvalidArgument,
        ),
    ];
    for (name, l, t, n, code) in cases {
        let state = LoadState::create().unwrap();
        let e = w
            .client
            .raw()
            .load(load(&state, l, t, n))
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{name}: {e:?}");
        if name == "target past the registration" {
            assert!(
                e.message()
                    .contains("destination block id 8 out of range for layer"),
                "{name}: {e:?}"
            );
        }
        assert_eq!(state.get(), -1, "{name}: the load state reports failure");
    }
    for b in 0..8 {
        assert!(
            w.kv.is_filled_with(b, 0xEE),
            "block {b} untouched by rejected loads"
        );
    }
    // A load state that is missing, or is no load-state object, is the client's mistake
    // (FAILED_PRECONDITION, INVALID_ARGUMENT; never INTERNAL), and nothing is consumed: the
    // lease still loads after both.
    let short = format!("pega_load_short_{}", std::process::id());
    std::fs::write(format!("/dev/shm/{short}"), [0u8; 4]).unwrap();
    let zeroed = format!("pega_load_zeroed_{}", std::process::id());
    std::fs::write(format!("/dev/shm/{zeroed}"), [0u8; 32]).unwrap();
    for (name, code, needle) in [
        (
            "pega_load_missing",
            Code::FailedPrecondition,
            "does not exist",
        ),
        (
            short.as_str(),
            Code::InvalidArgument,
            "expected at least 32",
        ),
        (zeroed.as_str(), Code::InvalidArgument, "invalid offset"),
    ] {
        let mut bad = load(
            &LoadState::create().unwrap(),
            lease.clone(),
            some(&[0, 1, 2, 3]),
            names.clone(),
        );
        bad.load_state_shm = name.into();
        let e = w.client.raw().load(bad).await.unwrap_err();
        assert_eq!(e.code(), code, "{name}: {e:?}");
        assert!(e.message().contains(needle), "{name}: {e:?}");
    }
    let _ = std::fs::remove_file(format!("/dev/shm/{short}"));
    let _ = std::fs::remove_file(format!("/dev/shm/{zeroed}"));
    // Absent targets are skipped and differ from block 0.
    let state = LoadState::create().unwrap();
    w.client
        .raw()
        .load(load(
            &state,
            lease.clone(),
            vec![None, Some(0), None, Some(5)],
            names.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(wait_state(&state).await, 1);
    assert!(w.kv.holds(0, &hs[1]));
    assert!(w.kv.holds(5, &hs[3]));
    for b in [1, 2, 3, 4, 6, 7] {
        assert!(w.kv.is_filled_with(b, 0xEE), "block {b}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_python_and_native_registrations_are_refused() {
    let srv = TestServer::start(ServerOptions::default()).await;
    let shape = KvShape {
        layers: 1,
        num_blocks: 10,
        segment_bytes: 20,
    };
    // A native instance of two workers; a Python registration joins under its id.
    let _w = Worker::register(&srv, "mix", "ns", shape, 0, 2, 0).await;
    let mut c = srv.client().await;
    let mut py = base_register();
    py.instance_id = "mix".into();
    py.tp_size = 2;
    py.world_size = 2;
    py.tp_rank = 1;
    py.device_id = 1;
    let e = c.register(py).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("cannot mix"), "{e}");
    // A live native id cannot be registered again (a fresh id per attempt is the rule).
    let kv = KvCache::new(shape);
    let e = c
        .register_host_memfd(&srv.socket, &kv.registration("mix", "ns", 0, 2, 0), &kv.mem)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    // A different topology under the same id is a topology mismatch.
    let e = c
        .register_host_memfd(&srv.socket, &kv.registration("mix", "ns", 0, 1, 3), &kv.mem)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("topology mismatch"), "{e}");
}
