//! Native registration v2 (`0.25.1+native-v2`) end to end over host memfds: a GLM5.2-shaped
//! registration (99 arenas in 99 allocations, two block sizes, one namespace) saved, queried
//! and loaded into other block ids byte-exact; a failed import at allocation k of 99 leaks no
//! descriptor and no mapping and leaves no instance; the revision gate both ways; eight
//! rank-local instances over one shared client.

use pegaflow_api::client::NativeRegistration;
use pegaflow_api::memfd::HostMemfd;
use pegaflow_api::native::NativeEngine;
use pegaflow_api::registration::{Client, NativeAllocation, RegistrationBuilder};
use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_tests::harness::*;
use tonic::Code;

/// GLM5.2: 78 MLA arenas of 41,984-byte blocks and 21 index-K sidecars of 8,448 bytes.
const MLA_LAYERS: usize = 78;
const IDXK_LAYERS: usize = 21;
const MLA_BLOCK: usize = 64 * 656;
const IDXK_BLOCK: usize = 64 * (128 + 4);
/// Blocks per arena in these tests.
const BLOCKS: usize = 8;

/// One arena: its name, block size and memfd.
struct Arena {
    name: String,
    block: usize,
    mem: HostMemfd,
}

/// The 99 arenas of one GLM5.2 rank (names as OpenInfer's `glm52.L<n>.mla` /
/// `glm52.L<n>.idxk`), each its own memfd of `blocks` blocks.
fn glm52_arenas(tag: &str, blocks: usize) -> Vec<Arena> {
    let mut v = Vec::new();
    for n in 0..MLA_LAYERS {
        v.push(Arena {
            name: format!("glm52.L{n}.mla"),
            block: MLA_BLOCK,
            mem: HostMemfd::new(&format!("{tag}-mla{n}"), blocks * MLA_BLOCK).unwrap(),
        });
        if n % 3 == 0 && n / 3 < IDXK_LAYERS {
            v.push(Arena {
                name: format!("glm52.L{n}.idxk"),
                block: IDXK_BLOCK,
                mem: HostMemfd::new(&format!("{tag}-idx{n}"), blocks * IDXK_BLOCK).unwrap(),
            });
        }
    }
    v
}

fn builder(arenas: &[Arena], blocks: usize) -> RegistrationBuilder<'_> {
    let mut b = RegistrationBuilder::new(0);
    for a in arenas {
        let id = b.allocation(&a.mem);
        b.contiguous_tensor(&a.name, id, 0, blocks as u64, a.block as u64);
    }
    b
}

fn fill(arenas: &mut [Arena], block: usize, hash: &[u8]) {
    for (i, a) in arenas.iter_mut().enumerate() {
        let bytes = pattern(hash, i, 0, a.block);
        a.mem.as_mut_slice()[block * a.block..(block + 1) * a.block].copy_from_slice(&bytes);
    }
}

fn holds(arenas: &[Arena], block: usize, hash: &[u8]) -> bool {
    arenas.iter().enumerate().all(|(i, a)| {
        a.mem.as_slice()[block * a.block..(block + 1) * a.block] == pattern(hash, i, 0, a.block)[..]
    })
}

fn is_filled_with(arenas: &[Arena], block: usize, byte: u8) -> bool {
    arenas.iter().all(|a| {
        a.mem.as_slice()[block * a.block..(block + 1) * a.block]
            .iter()
            .all(|&b| b == byte)
    })
}

/// The tests of this file run one at a time: the leak test counts this process's descriptors
/// and memfd mappings, which the others would change under it.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Descriptors open in this process: number -> what it points at.
fn open_fds() -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| {
            let target = std::fs::read_link(e.path())
                .map(|t| t.display().to_string())
                .unwrap_or_else(|_| "?".into());
            (e.file_name().to_string_lossy().into_owned(), target)
        })
        .collect()
}

/// Waits (30 s at most) until no more descriptors are open than in `before`; the panic names
/// the descriptors opened since, so that a failure says what stayed open.
async fn wait_fds_closed(what: &str, before: &std::collections::BTreeMap<String, String>) {
    wait_until(
        || {
            let now = open_fds();
            let new: Vec<String> = now
                .iter()
                .filter(|(fd, t)| before.get(*fd) != Some(t))
                .map(|(fd, t)| format!("{fd} -> {t}"))
                .collect();
            format!(
                "{what}: {} descriptors open against {} before; new or changed: {new:?}",
                now.len(),
                before.len()
            )
        },
        || open_fds().len() <= before.len(),
    )
    .await
}

/// memfd mappings in this process (the test's own and the server's).
fn memfd_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .count()
}

async fn wait_for(what: &str, pred: impl FnMut() -> bool) {
    wait_until(|| what.to_string(), pred).await
}

/// Polls `pred` every 10 ms for at most 30 s (a loaded CI machine takes seconds to tear down
/// a server's connections and runtime); the panic message is `what()`, made at the end.
async fn wait_until(what: impl FnOnce() -> String, mut pred: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !pred() {
        if std::time::Instant::now() >= deadline {
            panic!("{}", what());
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

fn pending(srv: &TestServer) -> usize {
    srv.handle.fd_channel.as_ref().unwrap().pending()
}

/// A server whose host-memfd registrar waits `secs` for each descriptor.
async fn server_with_fd_timeout(secs: f64) -> TestServer {
    TestServer::start_with(
        ServerOptions {
            capacity_bytes: 128 << 20,
            ..ServerOptions::default()
        },
        |p| {
            let mut t = toml::Table::new();
            t.insert("fd_timeout_secs".into(), toml::Value::Float(secs));
            p.registrars = Some(vec![PluginConfig {
                layers: vec![],
                kind: "host-memfd".into(),
                settings: t,
            }]);
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glm52_shaped_registration_roundtrips_byte_exact() {
    let _serial = SERIAL.lock().await;
    let srv = server_with_fd_timeout(10.0).await;
    let mut arenas = glm52_arenas("glm", BLOCKS);
    assert_eq!(arenas.len(), MLA_LAYERS + IDXK_LAYERS);
    let per_block: usize = arenas.iter().map(|a| a.block).sum();
    assert_eq!(per_block, 3_452_160, "one logical GLM5.2 block per rank");
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("glm52", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        fill(&mut arenas, 1 + i, h);
    }
    let client = Client::connect(&srv.handle.endpoint()).await.unwrap();
    assert_eq!(client.socket_path(), Some(srv.socket.as_path()));
    let b = builder(&arenas, BLOCKS);
    let mut inst = client
        .register(
            "glm52-rank0",
            "openinfer-glm52-t-l78-p64-mla656-idxk132",
            &b,
        )
        .await
        .unwrap();
    assert!(inst.instance_id().starts_with("glm52-rank0-"));
    assert_eq!(pending(&srv), 0, "every allocation's fd was taken");

    inst.save(&[1, 2, 3], &hs).await.unwrap();
    inst.flush().await.unwrap();
    let (n, lease) = inst.query(hs.clone(), "q").await.unwrap();
    assert_eq!(n, 3);
    for b in 4..BLOCKS {
        for a in arenas.iter_mut() {
            a.mem.as_mut_slice()[b * a.block..(b + 1) * a.block].fill(0x5A);
        }
    }
    inst.load(&lease, &[5, 6, 7]).await.unwrap();
    for (i, h) in hs.iter().enumerate() {
        assert!(holds(&arenas, 5 + i, h), "block {} in every arena", 5 + i);
        assert!(holds(&arenas, 1 + i, h), "the source is untouched");
    }
    assert!(is_filled_with(&arenas, 4, 0x5A), "block 4 was not written");

    // All arenas of a block id travel together: a Save or a Load naming fewer is refused
    // before any copy, and nothing partial becomes queryable.
    let id = inst.instance_id().to_string();
    let mut raw = client.rpc();
    let h9 = vec![hash_of("partial", 9)];
    let e = raw
        .save(
            &id,
            0,
            0,
            0,
            vec![(arenas[0].name.clone(), vec![0], h9.clone())],
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("all 99 layers"), "{e}");
    inst.flush().await.unwrap();
    let (n, _) = inst.query(h9, "q9").await.unwrap();
    assert_eq!(n, 0, "a partly saved block is never sealed");
    let (n, lease) = inst.query(hs[..1].to_vec(), "q2").await.unwrap();
    assert_eq!(n, 1);
    let only_mla: Vec<String> = arenas
        .iter()
        .filter(|a| a.name.ends_with(".mla"))
        .map(|a| a.name.clone())
        .collect();
    let e = raw
        .load(pegaflow_api::client::single_group_load(
            &id,
            0,
            0,
            only_mla,
            &lease,
            [Some(4)],
            pegaflow_api::client::LoadCompletion::Wait,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(
        is_filled_with(&arenas, 4, 0x5A),
        "a refused load wrote nothing"
    );
    // Every arena named, but split over two load groups that send the block to different
    // destinations: refused too, before any copy.
    let (mla, idxk): (Vec<String>, Vec<String>) = arenas
        .iter()
        .map(|a| a.name.clone())
        .partition(|n| n.ends_with(".mla"));
    let targets = |b: Option<u32>| pb::LoadBlockIds {
        targets: vec![pb::LoadBlockTarget {
            target: b.map(pb::load_block_target::Target::BlockId),
        }],
    };
    let split = pb::LoadRequest {
        instance_id: id.clone(),
        tp_rank: 0,
        device_id: 0,
        load_state_shm: String::new(),
        groups: vec![
            pb::LoadGroup { layer_names: mla },
            pb::LoadGroup { layer_names: idxk },
        ],
        loads: vec![pb::LeaseLoad {
            lease: lease.clone(),
            // The MLA pages to block 4, their sidecars skipped.
            block_ids_by_group: vec![targets(Some(4)), targets(None)],
        }],
        wait_for_completion: true,
    };
    let e = raw.load(split).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("same destination"), "{e}");
    assert!(
        is_filled_with(&arenas, 4, 0x5A),
        "a refused split load wrote nothing"
    );
    inst.unregister().await.unwrap();
    assert!(!srv.handle.engine.instance_ids().contains(&id));
}

/// Reports the size of a real allocation but hands over another (smaller) memfd: the server
/// must notice when it maps allocation k.
struct Shrunk<'a> {
    claimed: u64,
    real: &'a HostMemfd,
}

impl NativeAllocation for Shrunk<'_> {
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::HostMemfd
    }
    fn size_bytes(&self) -> u64 {
        self.claimed
    }
    fn export_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.real.fd())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_import_at_allocation_k_leaks_nothing() {
    let _serial = SERIAL.lock().await;
    let srv = server_with_fd_timeout(0.5).await;
    let arenas = glm52_arenas("fail", 2);
    let small = HostMemfd::new("small", 4096).unwrap();
    let client = Client::connect(&srv.handle.endpoint()).await.unwrap();
    let fds_before = open_fds();
    let maps_before = memfd_mappings();

    // (a) Allocation 57's memfd is smaller than stated: allocations 0..56 were mapped when
    // it fails, and must all be unmapped again.
    let k = 57;
    let shrunk = Shrunk {
        claimed: arenas[k].mem.len() as u64,
        real: &small,
    };
    let mut b = RegistrationBuilder::new(0);
    for (i, a) in arenas.iter().enumerate() {
        let id = if i == k {
            b.allocation(&shrunk)
        } else {
            b.allocation(&a.mem)
        };
        b.contiguous_tensor(&a.name, id, 0, 2, a.block as u64);
    }
    let e = client.register("fail-a", "ns", &b).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains(&format!("allocation {k}")), "{e}");
    assert!(srv.handle.engine.instance_ids().is_empty(), "no instance");
    assert_eq!(pending(&srv), 0);
    wait_fds_closed("the server's descriptors are closed", &fds_before).await;
    wait_for("the server's mappings are gone", || {
        memfd_mappings() <= maps_before
    })
    .await;

    // (b) Allocation 40's descriptor never arrives: the registration fails after the fd
    // timeout, and the 39 descriptors already taken and the 58 sent after it are closed.
    let mut rpc = client.rpc();
    let b = builder(&arenas, 2);
    let id = pegaflow_api::native::fresh_instance_id("fail-b");
    for (i, a) in arenas.iter().enumerate() {
        if i != 40 {
            pegaflow_api::fd::send_allocation_fd(&srv.socket, &id, 0, i as u32, a.mem.fd())
                .unwrap();
        }
    }
    wait_for("98 descriptors pending", || pending(&srv) == 98).await;
    let e = rpc.register(b.to_request(&id, "ns")).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("allocation 40 of 99"), "{e}");
    assert!(srv.handle.engine.instance_ids().is_empty());
    assert_eq!(
        pending(&srv),
        0,
        "the descriptors after the gap were discarded"
    );
    wait_fds_closed("descriptors closed", &fds_before).await;
    wait_for("no mapping left", || memfd_mappings() <= maps_before).await;

    // (c) A view past its allocation (bypassing the client's check) is refused before any
    // import, and the descriptors sent for it are discarded.
    let mut req =
        builder(&arenas, 2).to_request(&pegaflow_api::native::fresh_instance_id("fail-c"), "ns");
    req.native_kv_tensors[98].offset_bytes = 1;
    for (i, a) in arenas.iter().enumerate() {
        pegaflow_api::fd::send_allocation_fd(
            &srv.socket,
            &req.instance_id,
            0,
            i as u32,
            a.mem.fd(),
        )
        .unwrap();
    }
    wait_for("99 descriptors pending", || pending(&srv) == 99).await;
    let e = rpc.register(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("exceeds allocation 98"), "{e}");
    assert_eq!(pending(&srv), 0);
    wait_fds_closed("descriptors closed", &fds_before).await;

    // The same memory registers fine afterwards.
    let inst = client
        .register("fail-ok", "ns", &builder(&arenas, 2))
        .await
        .unwrap();
    inst.unregister().await.unwrap();
    wait_for("mappings released after unregister", || {
        memfd_mappings() <= maps_before
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_revision_gate_refuses_a_mismatch_both_ways() {
    let _serial = SERIAL.lock().await;
    let srv = server_with_fd_timeout(2.0).await;
    let arenas = glm52_arenas("rev", 2);
    let client = Client::connect(&srv.handle.endpoint()).await.unwrap();
    let mut rpc = client.rpc();

    // A v2 body under the v1 tag: refused naming both revisions, its fds discarded.
    let id = pegaflow_api::native::fresh_instance_id("rev-a");
    let mut req = builder(&arenas, 2).to_request(&id, "ns");
    req.client_version = pb::NATIVE_CLIENT_VERSION.into();
    for (i, a) in arenas.iter().enumerate() {
        pegaflow_api::fd::send_allocation_fd(&srv.socket, &id, 0, i as u32, a.mem.fd()).unwrap();
    }
    wait_for("99 pending", || pending(&srv) == 99).await;
    let e = rpc.register(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("revision mismatch")
            && m.contains("0.25.1+native-v1")
            && m.contains("0.25.1+native-v2"),
        "{m}"
    );
    assert_eq!(pending(&srv), 0);

    // A v1 body (one allocation, native_alloc_size) under the v2 tag.
    let kv = KvCache::new(KvShape {
        layers: 2,
        num_blocks: 4,
        segment_bytes: 256,
    });
    let v1: NativeRegistration = kv.registration("rev-b", "ns", 0, 1, 0);
    let mut req = v1.to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64);
    req.client_version = pb::NATIVE_V2_CLIENT_VERSION.into();
    pegaflow_api::fd::send_fd(&srv.socket, "rev-b", 0, kv.mem.fd()).unwrap();
    wait_for("1 pending", || pending(&srv) == 1).await;
    let e = rpc.register(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("revision mismatch")
            && m.contains("0.25.1+native-v1")
            && m.contains("0.25.1+native-v2"),
        "{m}"
    );
    assert_eq!(pending(&srv), 0);

    // A revision this server does not know: the version gate names client and server.
    let mut req = builder(&arenas, 2).to_request("rev-c", "ns");
    req.client_version = "0.25.1+native-v3".into();
    let e = rpc.register(req).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    assert!(
        e.to_string()
            .contains("client=0.25.1+native-v3 server=0.25.1"),
        "{e}"
    );
    assert!(srv.handle.engine.instance_ids().is_empty());

    // v1 native clients keep working next to v2 ones, unchanged.
    let mut kv = KvCache::new(KvShape {
        layers: 2,
        num_blocks: 4,
        segment_bytes: 256,
    });
    let h = vec![hash_of("v1", 0)];
    kv.fill(0, &h[0]);
    let mut eng = NativeEngine::connect(&srv.handle.endpoint(), "ns")
        .await
        .unwrap()
        .register(
            "v1-engine",
            0,
            &kv.mem,
            kv.registration("x", "ns", 0, 1, 0).layers,
        )
        .await
        .unwrap();
    let names: Vec<String> = (0..2).map(KvShape::layer_name).collect();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    eng.save(&names, &[0], &h).await.unwrap();
    eng.flush().await.unwrap();
    let (n, lease) = eng.query(h.clone(), "v1").await.unwrap();
    assert_eq!(n, 1);
    eng.load(&names, &lease, &[3]).await.unwrap();
    assert!(kv.holds(3, &h[0]));
    eng.unregister().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_rank_local_instances_share_one_client() {
    let _serial = SERIAL.lock().await;
    let srv = server_with_fd_timeout(10.0).await;
    let client = Client::connect(&srv.handle.endpoint()).await.unwrap();
    const RANKS: usize = 8;
    const NS: &str = "openinfer-glm52-8r";
    // 12 arenas per rank (9 MLA, 3 index-K), each its own memfd.
    let mut ranks: Vec<Vec<Arena>> = (0..RANKS)
        .map(|r| {
            let mut a = glm52_arenas(&format!("r{r}"), 4);
            a.truncate(12);
            a
        })
        .collect();
    for (r, arenas) in ranks.iter_mut().enumerate() {
        fill(arenas, 0, &hash_of(&format!("rank{r}"), 0));
    }
    let ranks = std::sync::Arc::new(ranks);
    let mut tasks = Vec::new();
    for r in 0..RANKS {
        let client = client.clone();
        let ranks = ranks.clone();
        tasks.push(tokio::spawn(async move {
            let b = builder(&ranks[r], 4);
            let mut inst = client
                .register(&format!("glm52-rank{r}"), NS, &b)
                .await
                .unwrap();
            let h = vec![hash_of(&format!("rank{r}"), 0)];
            inst.save(&[0], &h).await.unwrap();
            inst
        }));
    }
    let mut insts = Vec::new();
    for t in tasks {
        insts.push(t.await.unwrap());
    }
    let ids: std::collections::HashSet<String> =
        insts.iter().map(|i| i.instance_id().to_string()).collect();
    assert_eq!(ids.len(), RANKS, "each instance has its own fresh id");
    assert_eq!(srv.handle.engine.instance_ids().len(), RANKS);
    assert_eq!(pending(&srv), 0);
    // Same namespace and layout: rank r restores what rank r+1 saved, into block 3.
    for (r, inst) in insts.iter_mut().enumerate() {
        let h = vec![hash_of(&format!("rank{}", (r + 1) % RANKS), 0)];
        inst.flush().await.unwrap();
        let (n, lease) = inst.query(h, &format!("q{r}")).await.unwrap();
        assert_eq!(n, 1, "rank {r}");
        inst.load(&lease, &[3]).await.unwrap();
    }
    for r in 0..RANKS {
        let want = hash_of(&format!("rank{}", (r + 1) % RANKS), 0);
        // Rank r's arena i holds pattern(want, i): the layouts agree arena by arena.
        assert!(holds(&ranks[r], 3, &want), "rank {r} block 3");
    }
    // Unregistering one rank leaves the others serving.
    let mut it = insts.into_iter();
    it.next().unwrap().unregister().await.unwrap();
    assert_eq!(srv.handle.engine.instance_ids().len(), RANKS - 1);
    for mut inst in it {
        match inst
            .query(vec![hash_of("rank0", 0)], "after")
            .await
            .unwrap()
        {
            (1, lease) => inst.release(&lease).await.unwrap(),
            other => panic!("{other:?}"),
        }
        inst.unregister().await.unwrap();
    }
    assert!(srv.handle.engine.instance_ids().is_empty());
}

/// Save and load GB/s of one layout over `reps` rounds of `count` fresh blocks: (best save,
/// median save, best load, median load).
async fn bench_layout(
    client: &Client,
    tag: &str,
    reg: &RegistrationBuilder<'_>,
    blocks: usize,
    count: usize,
    reps: usize,
) -> (f64, f64, f64, f64) {
    let mut inst = client
        .register(tag, &format!("bench-{tag}"), reg)
        .await
        .unwrap();
    let bytes = (count * (MLA_LAYERS * MLA_BLOCK + IDXK_LAYERS * IDXK_BLOCK)) as f64;
    let (mut saves, mut loads) = (Vec::new(), Vec::new());
    for r in 0..reps {
        let hs: Vec<Vec<u8>> = (0..count)
            .map(|i| hash_of(&format!("{tag}-{r}"), i))
            .collect();
        let ids: Vec<u32> = (0..count as u32).collect();
        let t0 = std::time::Instant::now();
        inst.save(&ids, &hs).await.unwrap();
        saves.push(bytes / t0.elapsed().as_secs_f64() / 1e9);
        inst.flush().await.unwrap();
        let (n, lease) = inst.query(hs, "b").await.unwrap();
        assert_eq!(n as usize, count);
        let targets: Vec<u32> = (blocks - count..blocks).map(|b| b as u32).collect();
        let t0 = std::time::Instant::now();
        inst.load(&lease, &targets).await.unwrap();
        loads.push(bytes / t0.elapsed().as_secs_f64() / 1e9);
    }
    inst.unregister().await.unwrap();
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (v[v.len() - 1], v[v.len() / 2])
    };
    let (sb, sm) = stats(&mut saves);
    let (lb, lm) = stats(&mut loads);
    (sb, sm, lb, lm)
}

/// The CPU (memfd) figure of docs/BENCHMARKS.md "Native registration v2": Save/Load GB/s of
/// the GLM5.2 rank layout (99 memfds) against the same bytes in one fused memfd (the same 99
/// tensors back to back, and one tensor of 3,452,160 B per block). A measurement, not a check:
/// `cargo test --release -p pegaflow-tests --test native_v2 -- --ignored --nocapture bench`
/// (`PEGAFLOW_V2_BENCH_BLOCKS` blocks per Save/Load, default 32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run by hand with --release --ignored --nocapture"]
async fn bench_glm52_layout_against_one_fused_memfd() {
    let _serial = SERIAL.lock().await;
    let count: usize = std::env::var("PEGAFLOW_V2_BENCH_BLOCKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32);
    let blocks = 2 * count;
    let reps = 5;
    let srv = TestServer::start(ServerOptions {
        capacity_bytes: (3 * count * 3_452_160) as u64 + (64 << 20),
        ..ServerOptions::default()
    })
    .await;
    let client = Client::connect(&srv.handle.endpoint()).await.unwrap();
    let per_block = MLA_LAYERS * MLA_BLOCK + IDXK_LAYERS * IDXK_BLOCK;
    let fused = HostMemfd::new("fused", blocks * per_block).unwrap();
    // Warm-up, not measured: fill the lazily committed DRAM pool once (4 rounds of `count`
    // blocks > its capacity), so that no layout pays the pool's first-touch page faults.
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    b.contiguous_tensor("page", a, 0, blocks as u64, per_block as u64);
    bench_layout(&client, "warmup", &b, blocks, count, 4).await;
    let mut rows = Vec::new();
    let arenas = glm52_arenas("bench", blocks);
    rows.push((
        "99 arenas, 99 memfds",
        bench_layout(
            &client,
            "split",
            &builder(&arenas, blocks),
            blocks,
            count,
            reps,
        )
        .await,
    ));
    drop(arenas);
    let layout: Vec<(String, usize)> = glm52_arenas("names", 1)
        .into_iter()
        .map(|a| (a.name, a.block))
        .collect();
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    let mut off = 0u64;
    for (name, block) in &layout {
        b.contiguous_tensor(name, a, off, blocks as u64, *block as u64);
        off += (blocks * block) as u64;
    }
    rows.push((
        "99 arenas, one fused memfd",
        bench_layout(&client, "fused", &b, blocks, count, reps).await,
    ));
    let mut b = RegistrationBuilder::new(0);
    let a = b.allocation(&fused);
    b.contiguous_tensor("page", a, 0, blocks as u64, per_block as u64);
    rows.push((
        "1 tensor of 3,452,160 B/block, one memfd",
        bench_layout(&client, "page", &b, blocks, count, reps).await,
    ));
    println!(
        "\nGLM5.2 rank layout over host memfds, {count} blocks x {per_block} B = {:.1} MiB per Save/Load, {reps} rounds:",
        (count * per_block) as f64 / (1 << 20) as f64
    );
    println!("| layout | save GB/s best / median | load GB/s best / median |");
    println!("|---|---|---|");
    for (name, (sb, sm, lb, lm)) in rows {
        println!("| {name} | {sb:.2} / {sm:.2} | {lb:.2} / {lm:.2} |");
    }
}
