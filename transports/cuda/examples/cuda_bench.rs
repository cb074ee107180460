//! Copy bandwidth of the `cuda` transport on the Llama-8B bench layout (the one of
//! `shared/bench/pf_bench.py`): `--layers` KV tensors `[2, gpu_blocks, 16, 8, 128]` bf16 (32 KiB
//! segments, K/V split), `--blocks` blocks saved in Save batches of `--batch` blocks, one
//! contiguous 2 MiB host buffer per block holding all layers, scattered GPU block ids. Prints one
//! JSON line per path with save (D2H) and load (H2D) GB/s, and optionally checks every byte.
//!
//! Run on a GPU machine: `cuda_bench [--paths staged,mapped,direct,auto,bus] [--reps 3]
//! [--verify] [--staging-mb 16] [--blocks-per-sm 8] [--pin-gib 0] [--pin-threads 1,8]
//! [--inflight 1] [--overlap] [--wait tail|sleep|spin] [--first-chunk-mb 2]
//! [--staging-buffers 2]`.
//!
//! `--inflight N` keeps up to N batches submitted at once (a Save stream as the server sees it
//! when each Save is answered before its copy ends: the next batch waits in the worker's queue,
//! or with `--overlap` starts behind the previous one); 1 awaits each batch before the next.
//! Path `bus` is the reference: the same bytes in one batch of one large copy per layer
//! (`2 × blocks × 32 KiB` each, contiguous on both sides), what one large pinned copy moves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};

use pegaflow_api::TransferMode;
use pegaflow_plugin::{CopyBatch, CopyOp, Direction, RuntimeContext, Transport};
use pegaflow_transport_cuda::testing::{DeviceBuffer, HostArena};
use pegaflow_transport_cuda::{
    driver, CopyPath, CudaTransport, CudaTransportConfig, KernelPath, Policy, Wait,
};

const SEG: usize = 32 << 10;

struct Args {
    layers: usize,
    gpu_blocks: usize,
    blocks: usize,
    batch: usize,
    reps: usize,
    paths: Vec<String>,
    staging_mb: u64,
    verify: bool,
    pin_gib: usize,
    pin_threads: Vec<usize>,
    blocks_per_sm: u32,
    inflight: usize,
    overlap: bool,
    wait: Wait,
    first_chunk_mb: u64,
    staging_buffers: usize,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        layers: 32,
        gpu_blocks: 4096,
        blocks: 2048,
        batch: 256,
        reps: 3,
        paths: vec!["staged".into(), "mapped".into(), "direct".into()],
        staging_mb: 16,
        verify: false,
        pin_gib: 0,
        pin_threads: vec![8],
        blocks_per_sm: CudaTransportConfig::default().blocks_per_sm,
        inflight: 1,
        overlap: false,
        wait: CudaTransportConfig::default().wait,
        first_chunk_mb: CudaTransportConfig::default().first_chunk_bytes >> 20,
        staging_buffers: CudaTransportConfig::default().staging_buffers,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{k} needs a value"))
        };
        match k.as_str() {
            "--layers" => a.layers = v()?.parse()?,
            "--gpu-blocks" => a.gpu_blocks = v()?.parse()?,
            "--blocks" => a.blocks = v()?.parse()?,
            "--batch" => a.batch = v()?.parse()?,
            "--reps" => a.reps = v()?.parse()?,
            "--paths" => a.paths = v()?.split(',').map(String::from).collect(),
            "--staging-mb" => a.staging_mb = v()?.parse()?,
            "--pin-gib" => a.pin_gib = v()?.parse()?,
            "--pin-threads" => {
                a.pin_threads = v()?
                    .split(',')
                    .map(|s| s.parse())
                    .collect::<Result<_, _>>()?
            }
            "--blocks-per-sm" => a.blocks_per_sm = v()?.parse()?,
            "--verify" => a.verify = true,
            "--inflight" => a.inflight = v()?.parse()?,
            "--overlap" => a.overlap = true,
            "--first-chunk-mb" => a.first_chunk_mb = v()?.parse()?,
            "--staging-buffers" => a.staging_buffers = v()?.parse()?,
            "--wait" => {
                a.wait = match v()?.as_str() {
                    "tail" => Wait::Tail,
                    "sleep" => Wait::Sleep,
                    "spin" => Wait::Spin,
                    w => anyhow::bail!("unknown wait {w} (tail, sleep or spin)"),
                }
            }
            _ => anyhow::bail!("unknown argument {k}"),
        }
    }
    anyhow::ensure!(a.blocks <= a.gpu_blocks && a.batch > 0 && a.layers > 0 && a.inflight > 0);
    Ok(a)
}

fn xorshift_fill(seed: u64, b: &mut [u8]) {
    let mut x = seed | 1;
    for c in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = x.to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let drv = driver().map_err(|e| anyhow::anyhow!("{e}"))?;
    let dev0 = &drv.devices()[0];
    println!(
        "{{\"device\":\"{}\",\"uuid\":\"{}\",\"driver\":{},\"sms\":{}}}",
        dev0.name,
        dev0.uuid,
        drv.version(),
        dev0.sm_count
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    if a.pin_gib > 0 {
        for &threads in &a.pin_threads {
            let arena = Arc::new(HostArena::new(a.pin_gib << 30)?);
            let ctx = RuntimeContext::default();
            let cfg = CudaTransportConfig {
                pin_threads: threads,
                ..Default::default()
            };
            let t0 = Instant::now();
            let t = CudaTransport::new(cfg, &ctx);
            t.install_host_memory(&arena.regions()).unwrap();
            let returned = t0.elapsed().as_secs_f64();
            let ok = t.wait_pinned(Duration::from_secs(300));
            let secs = t0.elapsed().as_secs_f64();
            let pinned = t.pins().map(|p| p.pinned_bytes()).unwrap_or(0);
            println!(
                "{{\"pin_gib\":{},\"threads\":{threads},\"new_returned_s\":{returned:.4},\"pinned_s\":{secs:.2},\"done\":{ok},\"pinned_bytes\":{pinned}}}",
                a.pin_gib
            );
            drop(t);
            drop(arena);
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    // Device layers with random contents (generated in parallel), and their host images.
    let layer_bytes = 2 * a.gpu_blocks * SEG;
    let mut images: Vec<Vec<u8>> = (0..a.layers).map(|_| vec![0u8; layer_bytes]).collect();
    std::thread::scope(|s| {
        for (l, img) in images.iter_mut().enumerate() {
            s.spawn(move || xorshift_fill(0x1234_5678 + l as u64 * 7919, img));
        }
    });
    let layers: Vec<DeviceBuffer> = images
        .iter()
        .map(|img| {
            let d = DeviceBuffer::new(0, layer_bytes)?;
            d.upload(0, img)?;
            Ok(d)
        })
        .collect::<Result<_, pegaflow_transport_cuda::CudaError>>()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Scattered GPU block ids: save from `src`, load into `dst`.
    let mut perm: Vec<usize> = (0..a.gpu_blocks).collect();
    let mut x = 0x9e37_79b9u64;
    for i in (1..perm.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        perm.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let src: Vec<usize> = perm[..a.blocks].to_vec();
    let dst: Vec<usize> = perm[a.gpu_blocks - a.blocks..].to_vec();
    let block_host = a.layers * 2 * SEG;
    let total = (a.blocks * block_host) as f64;

    for path in &a.paths {
        let (policy, kernel_path) = match path.as_str() {
            "staged" => (Policy::Kernel, KernelPath::Staged),
            "mapped" => (Policy::Kernel, KernelPath::Mapped),
            "direct" => (Policy::Direct, KernelPath::Staged),
            "auto" => (Policy::Auto, KernelPath::Staged),
            "bus" => (Policy::Direct, KernelPath::Staged),
            p => anyhow::bail!("unknown path {p}"),
        };
        let arena = Arc::new(HostArena::new(a.blocks * block_host)?);
        let ctx = RuntimeContext::default();
        let cfg = CudaTransportConfig {
            policy,
            kernel_path,
            staging_chunk: a.staging_mb << 20,
            blocks_per_sm: a.blocks_per_sm,
            overlap: a.overlap,
            wait: a.wait,
            first_chunk_bytes: a.first_chunk_mb << 20,
            staging_buffers: a.staging_buffers,
            ..Default::default()
        };
        let t0 = Instant::now();
        let t = CudaTransport::new(cfg, &ctx);
        t.install_host_memory(&arena.regions()).unwrap();
        t.wait_pinned(Duration::from_secs(300));
        let pin_s = t0.elapsed().as_secs_f64();
        let ops_for = |first: usize, ids: &[usize]| -> Vec<CopyOp> {
            let mut ops = Vec::with_capacity(a.batch * a.layers * 2);
            for (k, &gb) in ids.iter().enumerate() {
                let host = arena.addr() + (first + k) * block_host;
                for (l, layer) in layers.iter().enumerate() {
                    for s in 0..2 {
                        ops.push(CopyOp {
                            device_addr: layer.ptr() + ((s * a.gpu_blocks + gb) * SEG) as u64,
                            host_addr: host + (l * 2 + s) * SEG,
                            len: SEG,
                        });
                    }
                }
            }
            ops
        };
        let bus = path == "bus";
        // `bus`: one op per layer, `2 × blocks` segments of it, contiguous on both sides.
        let bus_ops = || -> Vec<CopyOp> {
            let len = 2 * a.blocks * SEG;
            (0..a.layers)
                .map(|l| CopyOp {
                    device_addr: layers[l].ptr(),
                    host_addr: arena.addr() + l * len,
                    len,
                })
                .collect()
        };
        // Returns GB/s, the path the last batch ran, and per batch whether it started behind
        // the previous one's copy ('o') or after its end ('.').
        let run =
            |direction: Direction, ids: &[usize]| -> anyhow::Result<(f64, CopyPath, String)> {
                let batches: Vec<Vec<CopyOp>> = if bus {
                    vec![bus_ops()]
                } else {
                    (0..a.blocks)
                        .step_by(a.batch)
                        .map(|first| ops_for(first, &ids[first..(first + a.batch).min(a.blocks)]))
                        .collect()
                };
                let t0 = Instant::now();
                let reports: Vec<_> = rt
                    .block_on(
                        futures::stream::iter(batches)
                            .map(|ops| {
                                t.copy_with_report(CopyBatch {
                                    location: pegaflow_transport_cuda::cuda_space(0),
                                    direction,
                                    mode: TransferMode::Kernel,
                                    ops,
                                })
                            })
                            .buffered(a.inflight)
                            .try_collect(),
                    )
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let secs = t0.elapsed().as_secs_f64();
                let last = reports.last().map_or(CopyPath::Empty, |r| r.path);
                let pattern = reports
                    .iter()
                    .map(|r| if r.overlapped { 'o' } else { '.' })
                    .collect();
                Ok((total / secs / 1e9, last, pattern))
            };
        let mut saves = Vec::new();
        let mut loads = Vec::new();
        let mut ran = CopyPath::Empty;
        let mut overlapped = 0;
        let mut pattern = String::new();
        for _ in 0..a.reps.max(1) {
            let (g, p, o) = run(Direction::ToHost, &src)?;
            saves.push(g);
            ran = p;
            overlapped += o.chars().filter(|&c| c == 'o').count();
            pattern = o;
            let (g, _, _) = run(Direction::ToDevice, &dst)?;
            loads.push(g);
        }
        let mut exact = serde_free_bool(None);
        if a.verify && !bus {
            exact = serde_free_bool(Some(verify(&a, &arena, &layers, &images, &src, &dst)?));
        }
        saves.sort_by(f64::total_cmp);
        loads.sort_by(f64::total_cmp);
        println!(
            "{{\"path\":\"{path}\",\"ran\":\"{ran:?}\",\"bytes\":{total},\"reps\":{},\"save_gbps_median\":{:.1},\"save_gbps_best\":{:.1},\"load_gbps_median\":{:.1},\"load_gbps_best\":{:.1},\"pin_s\":{pin_s:.2},\"staging_mb\":{},\"blocks_per_sm\":{},\"batch\":{},\"inflight\":{},\"overlap\":{},\"wait\":\"{:?}\",\"first_chunk_mb\":{},\"staging_buffers\":{},\"save_batches_overlapped\":{overlapped},\"last_save_pattern\":\"{pattern}\",\"byte_exact\":{exact}}}",
            saves.len(),
            saves[saves.len() / 2],
            saves[saves.len() - 1],
            loads[loads.len() / 2],
            loads[loads.len() - 1],
            a.staging_mb,
            a.blocks_per_sm,
            if bus { a.blocks } else { a.batch },
            a.inflight,
            a.overlap,
            a.wait,
            a.first_chunk_mb,
            a.staging_buffers,
        );
        drop(t);
        drop(arena);
    }
    Ok(())
}

fn serde_free_bool(v: Option<bool>) -> &'static str {
    match v {
        None => "null",
        Some(true) => "true",
        Some(false) => "false",
    }
}

/// Host blocks hold the `src` GPU blocks; after the loads, the `dst` GPU blocks hold the host
/// blocks; every other GPU block still holds its original bytes.
fn verify(
    a: &Args,
    arena: &HostArena,
    layers: &[DeviceBuffer],
    images: &[Vec<u8>],
    src: &[usize],
    dst: &[usize],
) -> anyhow::Result<bool> {
    // SAFETY: no copy is in flight.
    let host = unsafe { arena.bytes() };
    let block_host = a.layers * 2 * SEG;
    let mut ok = true;
    for (k, &gb) in src.iter().enumerate() {
        for (l, img) in images.iter().enumerate() {
            for s in 0..2 {
                let h = k * block_host + (l * 2 + s) * SEG;
                let d = (s * a.gpu_blocks + gb) * SEG;
                ok &= host[h..h + SEG] == img[d..d + SEG];
            }
        }
    }
    let mut is_dst = vec![None; a.gpu_blocks];
    for (k, &gb) in dst.iter().enumerate() {
        is_dst[gb] = Some(k);
    }
    let mut back = vec![0u8; 2 * a.gpu_blocks * SEG];
    for (l, layer) in layers.iter().enumerate() {
        layer
            .download(0, &mut back)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for (gb, slot) in is_dst.iter().enumerate() {
            for s in 0..2 {
                let d = (s * a.gpu_blocks + gb) * SEG;
                let want = match slot {
                    Some(k) => {
                        let h = k * block_host + (l * 2 + s) * SEG;
                        &host[h..h + SEG]
                    }
                    None => &images[l][d..d + SEG],
                };
                ok &= back[d..d + SEG] == *want;
            }
        }
        // Restore the layer for the next path.
        layer
            .upload(0, &images[l])
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(ok)
}
