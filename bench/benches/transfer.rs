//! Save and Load GB/s through the shm path (host memfd <-> DRAM tier, memcpy transport) for
//! blocks of 8 KiB to 2 MiB, next to a plain memcpy of the same bytes.
//!
//! Each block is one layer's K and V halves (split KV-first layout, two ranges of half the
//! block). Every timed operation moves a 32 MiB batch: the memcpy transport's default
//! settings split it over two threads (32 MiB threshold, 16 MiB per thread) and write with
//! streaming stores, while the memcpy baseline is one thread of `copy_from_slice`.
//! - `save/grpc`, `save/engine`: a Save of fresh hashes, through the RPC or `Engine::save`;
//!   the pool is filled first, so each save also evicts the oldest 32 MiB (steady state);
//! - `load/grpc`, `load/engine`: a Load (`wait_for_completion`) of a resident 32 MiB lease;
//!   the QueryPrefetch that mints the lease is not timed;
//! - `memcpy`: `copy_from_slice` of the same blocks between two pre-touched 32 MiB buffers.
//!
//! After each size's benchmarks it prints the per-phase breakdown of 20 more engine Saves and
//! Loads (`phases save 8KiB: …`; `PF_BENCH_PHASE_REPS` sets how many), from the server's
//! `pegaflow_rpc_phase_seconds` series, plus the time to decode the Save request (its protobuf
//! bytes into the wire message, then `decode::save`; outside the engine). Set
//! `PF_BENCH_PHASES_ONLY=1` to skip the criterion groups and print only those.
//!
//! The layout can be changed for the phase breakdown: `PF_BENCH_LAYERS` (default 1) layers per
//! block, `PF_BENCH_SIZES` (comma-separated bytes per layer per block, default the sizes
//! above) and `PF_BENCH_BATCH` (bytes per Save and Load, default 32 MiB); the pool is at least
//! four batches. `PF_BENCH_LAYERS=32 PF_BENCH_SIZES=65536 PF_BENCH_BATCH=536870912` is the GPU
//! bench's Llama-3.1-8B layout in its 256-block Saves (2 MiB blocks), on the host path.
//!
//! Run: `cargo bench -p pegaflow-bench --bench transfer`.

mod common;

use std::time::{Duration, Instant};

use common::{hash, lease_of, lease_of_client, runtime, Fixture};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pegaflow_runtime::metrics::{LoadPhase, Metrics, SavePhase};

const BATCH: usize = 32 << 20;
const SIZES: [usize; 6] = [8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 2 << 20];
const POOL: u64 = 512 << 20;

fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{}MiB", size >> 20)
    } else {
        format!("{}KiB", size >> 10)
    }
}

/// (sum in seconds, count) of every Save and Load phase series.
fn phase_snapshot(m: &Metrics) -> Vec<(f64, u64)> {
    let p = &m.rpc_phases;
    SavePhase::ALL
        .iter()
        .map(|&ph| p.save(ph))
        .chain(LoadPhase::ALL.iter().map(|&ph| p.load(ph)))
        .map(|h| (h.get_sample_sum(), h.get_sample_count()))
        .collect()
}

/// Prints the mean time per RPC of each phase between two snapshots, in µs.
fn print_phases(
    what: &str,
    before: &[(f64, u64)],
    after: &[(f64, u64)],
    decode_us: f64,
    batch: usize,
) {
    let mean = |i: usize| {
        let n = after[i].1 - before[i].1;
        (after[i].0 - before[i].0) / n.max(1) as f64 * 1e6
    };
    let ns = SavePhase::ALL.len();
    let save: Vec<String> = SavePhase::ALL
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{} {:.0}", p.label(), mean(i)))
        .collect();
    let load: Vec<String> = LoadPhase::ALL
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{} {:.0}", p.label(), mean(ns + i)))
        .collect();
    let per = label(batch);
    println!(
        "phases save {what}: decode {decode_us:.0}, {} (µs per {per} Save)",
        save.join(", ")
    );
    println!(
        "phases load {what}: {} (µs per {per} Load)",
        load.join(", ")
    );
}

/// `name` parsed from the environment, or `default`.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn transfer_benches(c: &mut Criterion) {
    let rt = runtime();
    let phases_only = std::env::var_os("PF_BENCH_PHASES_ONLY").is_some();
    let layers: usize = env_or("PF_BENCH_LAYERS", 1);
    let batch: usize = env_or("PF_BENCH_BATCH", BATCH);
    let reps: u32 = env_or("PF_BENCH_PHASE_REPS", 20).max(1);
    let sizes: Vec<usize> = match std::env::var("PF_BENCH_SIZES") {
        Ok(v) => v
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .expect("PF_BENCH_SIZES: bytes, comma-separated")
            })
            .collect(),
        Err(_) => SIZES.to_vec(),
    };
    let pool = POOL.max(4 * batch as u64);
    for &size in &sizes {
        let n = batch / (size * layers);
        assert!(
            n > 0,
            "a batch of {batch} bytes holds no block of {layers} x {size} bytes"
        );
        let fx = rt.block_on(Fixture::new(pool, layers, 2 * n, size / 2));
        let ids: Vec<u32> = (0..n as u32).collect();
        let mut next = 0u64;
        let mut fresh = |k: usize| -> Vec<Vec<u8>> {
            let v = (next..next + k as u64).map(hash).collect();
            next += k as u64;
            v
        };
        // Fill the pool once (pages committed, eviction from here on).
        for _ in 0..(pool as usize / batch + 1) {
            let h = fresh(n);
            rt.block_on(fx.engine().save(fx.save_request(&ids, &h)))
                .expect("save");
        }
        let mut client = fx.client.clone();
        let mut g = c.benchmark_group("save");
        g.throughput(Throughput::Bytes(batch as u64));
        if !phases_only {
            g.bench_function(BenchmarkId::new("grpc", label(size)), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let h = fresh(n);
                        let saves = vec![(pegaflow_bench::server::layer_name(0), ids.clone(), h)];
                        let t = Instant::now();
                        rt.block_on(client.save(&fx.instance, 0, 0, 0, saves))
                            .expect("save");
                        total += t.elapsed();
                    }
                    total
                })
            });
            g.bench_function(BenchmarkId::new("engine", label(size)), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let req = fx.save_request(&ids, &fresh(n));
                        let t = Instant::now();
                        rt.block_on(fx.engine().save(req)).expect("save");
                        total += t.elapsed();
                    }
                    total
                })
            });
        }
        g.finish();

        // A resident batch to load, into the other half of the cache.
        let resident = fresh(n);
        rt.block_on(fx.engine().save(fx.save_request(&ids, &resident)))
            .expect("save");
        let targets: Vec<u32> = (n as u32..2 * n as u32).collect();
        let mut g = c.benchmark_group("load");
        g.throughput(Throughput::Bytes(batch as u64));
        if !phases_only {
            g.bench_function(BenchmarkId::new("grpc", label(size)), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let (hits, lease) = lease_of_client(
                            rt.block_on(client.query(&fx.instance, resident.clone(), "bench"))
                                .expect("query"),
                        );
                        assert_eq!(hits as usize, n, "the batch must stay resident");
                        let req = fx.load_request(&lease, &targets);
                        let t = Instant::now();
                        rt.block_on(client.load(req)).expect("load");
                        total += t.elapsed();
                    }
                    total
                })
            });
            g.bench_function(BenchmarkId::new("engine", label(size)), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let (hits, lease) = lease_of(
                            rt.block_on(fx.engine().query(fx.query_request(&resident)))
                                .expect("query"),
                        );
                        assert_eq!(hits as usize, n, "the batch must stay resident");
                        let req = pegaflow_runtime::decode::load(fx.load_request(&lease, &targets))
                            .expect("a well-formed load");
                        let t = Instant::now();
                        rt.block_on(fx.engine().load(req)).expect("load");
                        total += t.elapsed();
                    }
                    total
                })
            });
        }
        g.finish();

        // The phase breakdown of `reps` engine Saves and Loads, and the Save request's decoding.
        let m = fx.engine().metrics().clone();
        let before = phase_snapshot(&m);
        let mut decode = Duration::ZERO;
        for _ in 0..reps {
            let h = fresh(n);
            let wire = pegaflow_proto::SaveRequest {
                instance_id: fx.instance.clone(),
                tp_rank: 0,
                pp_rank: 0,
                device_id: 0,
                saves: (0..layers)
                    .map(|l| pegaflow_proto::SaveLayer {
                        layer_name: pegaflow_bench::server::layer_name(l),
                        block_ids: ids.clone(),
                        block_hashes: h.clone().into(),
                    })
                    .collect(),
            };
            // The request as it arrives: bytes, decoded (protobuf, then checked) in the timing.
            let bytes = prost::Message::encode_to_vec(&wire);
            let t = Instant::now();
            let wire: pegaflow_proto::SaveRequest =
                prost::Message::decode(&bytes[..]).expect("decodes");
            let req = pegaflow_runtime::decode::save(wire).expect("a well-formed save");
            decode += t.elapsed();
            rt.block_on(fx.engine().save(req)).expect("save");
            let (_, lease) = lease_of(
                rt.block_on(fx.engine().query(fx.query_request(&resident)))
                    .expect("query"),
            );
            let req = pegaflow_runtime::decode::load(fx.load_request(&lease, &targets))
                .expect("a well-formed load");
            rt.block_on(fx.engine().load(req)).expect("load");
        }
        let after = phase_snapshot(&m);
        let what = if layers == 1 {
            label(size)
        } else {
            format!("{layers} layers x {}", label(size))
        };
        print_phases(
            &what,
            &before,
            &after,
            decode.as_secs_f64() / reps as f64 * 1e6,
            batch,
        );
        rt.block_on(fx.server.shutdown());
        if phases_only {
            continue;
        }

        let src = vec![0x5Au8; batch];
        let mut dst = vec![0u8; batch];
        let mut g = c.benchmark_group("memcpy");
        g.throughput(Throughput::Bytes(batch as u64));
        g.bench_function(BenchmarkId::new("plain", label(size)), |b| {
            b.iter(|| {
                for (d, s) in dst.chunks_exact_mut(size).zip(src.chunks_exact(size)) {
                    d.copy_from_slice(s);
                }
                std::hint::black_box(&mut dst);
            })
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = transfer_benches
}
criterion_main!(benches);
