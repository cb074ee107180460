//! QueryPrefetch latency and throughput against hashes per query and index size.
//!
//! An in-process server (embedded default pipeline) with one host-memfd instance; the index is
//! filled with 512-byte blocks (1 layer, K and V of 256 B) through Save. Every query asks for a
//! random list of resident hashes, so it walks (and touches) all of them and mints a lease;
//! the lease is released outside the timed part. Two paths:
//! - `query_engine`: `Engine::query` called directly (index walk, LRU touch, lease mint);
//! - `query_grpc`: the QueryPrefetch RPC through the Rust client on loopback.
//!
//! Run: `cargo bench -p pegaflow-bench --bench query`.

mod common;

use std::time::{Duration, Instant};

use common::{hash, lease_of, lease_of_client, runtime, Fixture};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};

const SLOTS: usize = 4096;
const INDEX_SIZES: [u64; 4] = [1_000, 10_000, 100_000, 1_000_000];
const HASHES: [usize; 6] = [1, 4, 16, 64, 256, 1024];

/// Saves blocks `from..to` (hash = index) in batches of the cache's size.
fn fill(rt: &tokio::runtime::Runtime, fx: &Fixture, from: u64, to: u64) {
    let ids: Vec<u32> = (0..SLOTS as u32).collect();
    let mut i = from;
    while i < to {
        let n = ((to - i) as usize).min(SLOTS);
        let hashes: Vec<Vec<u8>> = (i..i + n as u64).map(hash).collect();
        rt.block_on(fx.engine().save(fx.save_request(&ids[..n], &hashes)))
            .expect("save");
        i += n as u64;
    }
}

/// `count` random query lists of `n` resident hashes (of the first `size`).
fn queries(size: u64, n: usize, count: usize) -> Vec<Vec<Vec<u8>>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(size ^ n as u64);
    (0..count)
        .map(|_| (0..n).map(|_| hash(rng.random_range(0..size))).collect())
        .collect()
}

fn bench_engine(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    fx: &Fixture,
    group: &str,
    id: BenchmarkId,
    qs: &[Vec<Vec<u8>>],
) {
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(qs[0].len() as u64));
    g.bench_function(id, |b| {
        let mut k = 0usize;
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let req = fx.query_request(&qs[k % qs.len()]);
                    k += 1;
                    let t = Instant::now();
                    let r = fx.engine().query(req).await.expect("query");
                    total += t.elapsed();
                    let (n, lease) = lease_of(r);
                    assert!(n > 0);
                    fx.engine().release(&lease).expect("release");
                }
                total
            })
        })
    });
    g.finish();
}

fn query_benches(c: &mut Criterion) {
    let rt = runtime();
    let fx = rt.block_on(Fixture::new(640 << 20, 1, SLOTS, 256));
    let mut filled = 0;
    for &size in &INDEX_SIZES {
        fill(&rt, &fx, filled, size);
        filled = size;
        let qs = queries(size, 64, 512);
        bench_engine(
            c,
            &rt,
            &fx,
            "query_engine/64_hashes",
            BenchmarkId::new("index_blocks", size),
            &qs,
        );
    }
    for &n in &HASHES {
        let qs = queries(filled, n, 256);
        bench_engine(
            c,
            &rt,
            &fx,
            "query_engine/index_1M",
            BenchmarkId::new("hashes", n),
            &qs,
        );
    }
    let mut client = fx.client.clone();
    for &n in &HASHES {
        let qs = queries(filled, n, 256);
        let mut g = c.benchmark_group("query_grpc/index_1M");
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("hashes", n), |b| {
            let mut k = 0usize;
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let h = qs[k % qs.len()].clone();
                        k += 1;
                        let t = Instant::now();
                        let r = client.query(&fx.instance, h, "bench").await.expect("query");
                        total += t.elapsed();
                        let (_, lease) = lease_of_client(r);
                        client.release(&lease).await.expect("release");
                    }
                    total
                })
            })
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = query_benches
}
criterion_main!(benches);
