//! End to end on a GPU through the real server binary (a separate process, since CUDA refuses
//! to open an IPC handle in the process that exported it): this test plays the vLLM worker —
//! it allocates one KV-first tensor per layer, exports each the way torch does (it builds the
//! `CudaIPCWrapper` pickle itself), registers over gRPC with the published client's version,
//! saves, poisons, loads into other block ids through a load-state word, and compares bytes.
//!
//! Opt-in: every test is `#[ignore]`d; run with `PEGAFLOW_GPU_TESTS=1`,
//! `PEGAFLOW_SERVER_BIN=/path/to/pegaflow-server` and `-- --include-ignored`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pegaflow_api::client::{single_group_load, EngineClient, LoadCompletion, QueryOutcome};
use pegaflow_api::load_state::LoadState;
use pegaflow_proto as pb;
use pegaflow_transport_cuda::driver;
use pegaflow_transport_cuda::testing::DeviceBuffer;
use pegaflow_transport_cuda::wrapper::{encode_wrapper, parse_wrapper};

const LAYERS: usize = 4;
const NB: usize = 64;
const SEG: usize = 32 << 10;

fn enabled() -> Option<String> {
    if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() != Ok("1") {
        pegaflow_tests::skip!("set PEGAFLOW_GPU_TESTS=1 and PEGAFLOW_SERVER_BIN on a CUDA machine");
        return None;
    }
    Some(std::env::var("PEGAFLOW_SERVER_BIN").expect("PEGAFLOW_SERVER_BIN"))
}

struct Server {
    child: Child,
    endpoint: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn start_server(bin: &str) -> Server {
    let (g, h) = (free_port(), free_port());
    let child = Command::new(bin)
        .args([
            "--addr",
            &format!("127.0.0.1:{g}"),
            "--http-addr",
            &format!("127.0.0.1:{h}"),
            "--pool-size",
            "2gb",
        ])
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn server");
    let endpoint = format!("http://127.0.0.1:{g}");
    let t = Instant::now();
    loop {
        if let Ok(mut c) = EngineClient::connect(&endpoint).await {
            if c.health().await.is_ok() {
                break;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Server { child, endpoint }
}

fn golden() -> Vec<u8> {
    let hexs = include_str!("../testdata/wrapper_default.pickle.hex").trim();
    (0..hexs.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hexs[i..i + 2], 16).unwrap())
        .collect()
}

/// One worker's KV cache: a `[2, NB, SEG]` bf16-like tensor per layer.
struct Kv {
    layers: Vec<DeviceBuffer>,
}

fn content(hash: &[u8], layer: usize, seg: usize) -> Vec<u8> {
    let mut x = 0xcbf2_9ce4_8422_2325u64 ^ ((layer as u64) << 40) ^ ((seg as u64) << 56);
    for &b in hash {
        x = (x ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    (0..SEG)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u8) ^ (i as u8)
        })
        .collect()
}

impl Kv {
    fn new() -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| DeviceBuffer::new(0, 2 * NB * SEG).unwrap())
                .collect(),
        }
    }

    fn fill(&self, b: usize, hash: &[u8]) {
        for (l, buf) in self.layers.iter().enumerate() {
            for s in 0..2 {
                buf.upload(s * NB * SEG + b * SEG, &content(hash, l, s))
                    .unwrap();
            }
        }
    }

    fn holds(&self, b: usize, hash: &[u8]) -> bool {
        self.layers.iter().enumerate().all(|(l, buf)| {
            (0..2).all(|s| {
                let mut got = vec![0u8; SEG];
                buf.download(s * NB * SEG + b * SEG, &mut got).unwrap();
                got == content(hash, l, s)
            })
        })
    }

    fn poison(&self) {
        for b in &self.layers {
            b.fill(0xA5).unwrap();
        }
    }

    fn register_request(
        &self,
        id: &str,
        tp_rank: u32,
        tp_size: u32,
        device_id: i32,
        mode: pb::TransferMode,
    ) -> pb::RegisterContextRequest {
        let uuid = driver().unwrap().devices()[0].uuid.clone();
        let g = golden();
        let wrappers = self
            .layers
            .iter()
            .map(|b| {
                let mut w = parse_wrapper(&g).unwrap();
                w.raw_handle = [&[2u8, b'c'][..], &b.ipc_handle().unwrap()[..]].concat();
                w.device_uuid = uuid.clone();
                w.storage_offset_bytes = 0;
                w.storage_size_bytes = (2 * NB * SEG) as u64;
                w.storage_offset = 0;
                w.event_sync_required = false;
                w.shape = vec![2, NB as u64, (SEG / 2) as u64];
                w.stride = vec![(NB * SEG / 2) as i64, (SEG / 2) as i64, 1];
                encode_wrapper(&w)
            })
            .collect();
        pb::RegisterContextRequest {
            instance_id: id.into(),
            namespace: "gpu-e2e".into(),
            tp_rank,
            tp_size,
            world_size: tp_size,
            device_id,
            layer_names: (0..LAYERS)
                .map(|l| format!("model.layers.{l}.attn"))
                .collect(),
            wrapper_bytes: wrappers,
            num_blocks: vec![NB as u64; LAYERS],
            bytes_per_block: vec![SEG as u64; LAYERS],
            kv_stride_bytes: vec![(NB * SEG) as u64; LAYERS],
            segments: vec![2; LAYERS],
            client_version: pb::PUBLISHED_CLIENT_VERSION.into(),
            transfer_mode: mode as i32,
            ..Default::default()
        }
    }
}

fn names() -> Vec<String> {
    (0..LAYERS)
        .map(|l| format!("model.layers.{l}.attn"))
        .collect()
}

fn hashes(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("{tag}-{i}").into_bytes()).collect()
}

async fn save(
    c: &mut EngineClient,
    id: &str,
    tp_rank: u32,
    device_id: i32,
    ids: &[u32],
    hs: &[Vec<u8>],
) -> Result<(), pegaflow_api::ApiError> {
    let saves = names()
        .into_iter()
        .map(|n| (n, ids.to_vec(), hs.to_vec()))
        .collect();
    c.save(id, tp_rank, 0, device_id, saves).await
}

async fn load(
    c: &mut EngineClient,
    id: &str,
    tp_rank: u32,
    device_id: i32,
    lease: &[u8],
    targets: &[u32],
) -> i64 {
    let state = LoadState::create().unwrap();
    let req = single_group_load(
        id,
        tp_rank,
        device_id,
        names(),
        lease,
        targets.iter().map(|&b| Some(b)),
        LoadCompletion::StateWord(state.name()),
    );
    c.load(req).await.unwrap();
    state.wait(Duration::from_secs(30))
}

fn ready(q: QueryOutcome) -> (u64, Vec<u8>) {
    match q {
        QueryOutcome::Ready {
            num_hit_blocks,
            lease,
            ..
        } => (num_hit_blocks, lease),
        QueryOutcome::Loading => panic!("Loading"),
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn ipc_registration_roundtrips_byte_exact_in_both_modes() {
    let Some(bin) = enabled() else { return };
    rt().block_on(async {
        let srv = start_server(&bin).await;
        for (id, mode) in [
            ("direct", pb::TransferMode::Direct),
            ("kernel", pb::TransferMode::Kernel),
        ] {
            let kv = Kv::new();
            let mut c = EngineClient::connect(&srv.endpoint).await.unwrap();
            c.register(kv.register_request(id, 0, 1, 0, mode))
                .await
                .unwrap();
            let hs = hashes(id, 32);
            for (i, h) in hs.iter().enumerate() {
                kv.fill(i, h);
            }
            save(&mut c, id, 0, 0, &(0..32).collect::<Vec<_>>(), &hs)
                .await
                .unwrap();
            // Answered once its device memory was read, the Save's blocks are hits for the
            // next query (which waits for the copy's end if it must).
            let (n, lease) = ready(c.query(id, hs.clone(), "q").await.unwrap());
            assert_eq!(n, 32);
            kv.poison();
            let targets: Vec<u32> = (0..32).map(|i| 63 - i).collect();
            assert_eq!(load(&mut c, id, 0, 0, &lease, &targets).await, 1);
            for (i, h) in hs.iter().enumerate() {
                assert!(kv.holds(63 - i, h), "{id}: block {i}");
            }
            c.unregister(id).await.unwrap();
        }
    });
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn tp2_on_one_gpu_needs_both_ranks() {
    let Some(bin) = enabled() else { return };
    rt().block_on(async {
        let srv = start_server(&bin).await;
        let ranks = [Kv::new(), Kv::new()];
        let mut c = EngineClient::connect(&srv.endpoint).await.unwrap();
        for (r, kv) in ranks.iter().enumerate() {
            c.register(kv.register_request("tp2", r as u32, 2, r as i32, pb::TransferMode::Kernel))
                .await
                .unwrap();
        }
        let hs = hashes("tp2", 8);
        let ids: Vec<u32> = (0..8).collect();
        for (r, kv) in ranks.iter().enumerate() {
            for (i, h) in hs.iter().enumerate() {
                kv.fill(i, &[h.as_slice(), &[r as u8]].concat());
            }
        }
        save(&mut c, "tp2", 0, 0, &ids, &hs).await.unwrap();
        let (n, _) = ready(c.query("tp2", hs.clone(), "a").await.unwrap());
        assert_eq!(n, 0, "one rank alone gives no hit");
        save(&mut c, "tp2", 1, 1, &ids, &hs).await.unwrap();
        let (n, lease) = ready(c.query("tp2", hs.clone(), "b").await.unwrap());
        assert_eq!(n, 8);
        for (r, kv) in ranks.iter().enumerate() {
            kv.poison();
            let t: Vec<u32> = (20..28).collect();
            assert_eq!(load(&mut c, "tp2", r as u32, r as i32, &lease, &t).await, 1);
            for (i, h) in hs.iter().enumerate() {
                assert!(
                    kv.holds(20 + i, &[h.as_slice(), &[r as u8]].concat()),
                    "rank {r} block {i}"
                );
            }
        }
    });
}

/// The child half of the killed-client test: registers with a Session open, then saves in a
/// loop until it is killed.
#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn killed_client_child() {
    let Ok(endpoint) = std::env::var("PEGAFLOW_KILL_CHILD_ENDPOINT") else {
        return;
    };
    rt().block_on(async {
        let kv = Kv::new();
        let mut c = EngineClient::connect(&endpoint).await.unwrap();
        let _session = c.session("victim", "gpu-e2e", 1, 1).await.unwrap();
        c.register(kv.register_request("victim", 0, 1, 0, pb::TransferMode::Kernel))
            .await
            .unwrap();
        println!("READY");
        for round in 0.. {
            let hs = hashes(&format!("victim-{round}"), 16);
            for (i, h) in hs.iter().enumerate() {
                kv.fill(i, h);
            }
            if save(&mut c, "victim", 0, 0, &(0..16).collect::<Vec<_>>(), &hs)
                .await
                .is_ok()
            {
                // The parent checks the last round that answered: the first may be evicted
                // by now (the pool holds ~500 rounds).
                println!("SAVED {round}");
            }
        }
    });
}

#[test]
#[ignore = "GPU test: run with PEGAFLOW_GPU_TESTS=1 on a CUDA machine and --include-ignored"]
fn a_client_killed_mid_save_leaves_a_healthy_server_and_no_stale_bytes() {
    let Some(bin) = enabled() else { return };
    rt().block_on(async {
        let srv = start_server(&bin).await;
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "--include-ignored",
                "killed_client_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("PEGAFLOW_KILL_CHILD_ENDPOINT", &srv.endpoint)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::BufRead;
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let t = Instant::now();
        loop {
            let l = lines.next().expect("child output").unwrap();
            if l.contains("READY") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(60));
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        child.kill().unwrap();
        child.wait().unwrap();
        // The last round whose Save answered before the kill.
        let last = lines
            .map_while(Result::ok)
            .filter_map(|l| {
                l.strip_prefix("SAVED ")
                    .and_then(|r| r.trim().parse::<u64>().ok())
            })
            .last()
            .expect("the victim saved at least one round");
        // The server survives and the instance is cleaned up by the session's end.
        let mut c = EngineClient::connect(&srv.endpoint).await.unwrap();
        let t = Instant::now();
        loop {
            c.health().await.expect("server alive");
            match c.unregister("victim").await {
                Err(e) if e.to_string().contains("not found") => break,
                _ => {}
            }
            assert!(t.elapsed() < Duration::from_secs(5), "instance not cleaned");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A new worker in the namespace loads whatever sealed: every byte is the content of its hash.
        let kv = Kv::new();
        c.register(kv.register_request("heir", 0, 1, 0, pb::TransferMode::Kernel))
            .await
            .unwrap();
        let hs = hashes(&format!("victim-{last}"), 16);
        let (n, lease) = ready(c.query("heir", hs.clone(), "h").await.unwrap());
        assert_eq!(
            n, 16,
            "the victim's last answered round (round {last}) is sealed"
        );
        kv.poison();
        let t: Vec<u32> = (30..30 + n as u32).collect();
        assert_eq!(load(&mut c, "heir", 0, 0, &lease, &t).await, 1);
        for (i, h) in hs.iter().take(n as usize).enumerate() {
            assert!(kv.holds(30 + i, h), "block {i} holds its hash's bytes");
        }
    });
}
