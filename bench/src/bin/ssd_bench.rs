//! `pegaflow-ssd-bench`: the SSD tier's write and read bandwidth and its recovery time,
//! against `dd` with O_DIRECT on the same directory in the same run.
//!
//! Writes `--total` bytes of blocks of `--block` bytes (`--slots` slots each, scattered
//! host buffers) in put batches of `--batch` blocks (as the demotion worker sends them),
//! flushes, reopens the directory and rebuilds the index (recovery), reads every block
//! back in get batches (as promotions do) checking a sample byte-exact, then runs
//! `dd if=/dev/zero of=DIR/dd.bench bs=8M oflag=direct` and `dd ... iflag=direct` over the
//! same number of bytes. Prints one JSON line per phase.
//!
//! ```text
//! pegaflow-ssd-bench --dir /nvme/bench --total 8gb --block 2mb --io auto
//! ```

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::units::parse_size;
use pegaflow_plugin::{Extent, HostBuffer, HostMemory, Tier, TierGet, TierPut};
use pegaflow_tier_ssd::{IoChoice, SsdConfig};

#[derive(Parser, Debug)]
#[command(about = "SSD tier bandwidth and recovery time, against dd O_DIRECT on the same disk")]
struct Args {
    /// Directory to benchmark in (created; removed afterwards unless --keep).
    #[arg(long)]
    dir: std::path::PathBuf,
    /// Bytes to write and read.
    #[arg(long, default_value = "4gb", value_parser = parse_size_arg)]
    total: u64,
    /// Bytes per block.
    #[arg(long, default_value = "2mb", value_parser = parse_size_arg)]
    block: u64,
    /// Slots per block (the block's bytes split evenly).
    #[arg(long, default_value_t = 64)]
    slots: u64,
    /// Blocks per put / get batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// I/O engine: auto, uring, posix.
    #[arg(long, default_value = "auto")]
    io: String,
    /// Writes in flight.
    #[arg(long, default_value_t = 4)]
    write_inflight: usize,
    /// Reads in flight.
    #[arg(long, default_value_t = 16)]
    prefetch_inflight: usize,
    /// I/O threads.
    #[arg(long, default_value_t = 4)]
    io_threads: usize,
    /// Skip the dd comparison.
    #[arg(long)]
    no_dd: bool,
    /// Keep the directory.
    #[arg(long)]
    keep: bool,
    /// First block key (a second run with --keep and a new range overwrites reused segments).
    #[arg(long, default_value_t = 0)]
    first_key: u64,
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// Owns the heap allocations behind the bench's host buffers.
#[derive(Debug)]
struct Heap {
    _bufs: Vec<Box<[u8]>>,
}

impl HostMemory for Heap {
    fn release(&self, _extents: &[Extent]) {}
}

fn buffer(len: usize, fill: u8) -> HostBuffer {
    let mut b = vec![fill; len].into_boxed_slice();
    let e = Extent {
        addr: b.as_mut_ptr() as usize,
        len,
    };
    let mem = Arc::new(Heap { _bufs: vec![b] });
    HostBuffer::new(vec![e], mem)
}

fn key_of(i: u64) -> BlockKey {
    BlockKey {
        namespace: "bench".into(),
        group: 0,
        hash: i.to_le_bytes().to_vec().into(),
    }
}

fn dd(args: &[String]) -> Option<f64> {
    let out = Command::new("dd").args(args).output().ok()?;
    let err = String::from_utf8_lossy(&out.stderr);
    // "... bytes (...) copied, 1.234 s, 2.1 GB/s"
    let line = err.lines().find(|l| l.contains("copied"))?;
    let bytes: f64 = line.split_whitespace().next()?.parse().ok()?;
    let secs: f64 = line
        .split(", ")
        .find(|p| p.trim_end().ends_with(" s"))?
        .trim()
        .trim_end_matches(" s")
        .parse()
        .ok()?;
    Some(bytes / secs / 1e9)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let io = match a.io.as_str() {
        "auto" => IoChoice::Auto,
        "uring" => IoChoice::Uring,
        "posix" => IoChoice::Posix,
        o => anyhow::bail!("--io {o}: auto, uring or posix"),
    };
    std::fs::create_dir_all(&a.dir)?;
    let store = a.dir.join("ssd");
    let cfg = SsdConfig {
        paths: vec![store.clone()],
        capacity: a.total + a.total / 4 + (1 << 30),
        io,
        write_inflight: a.write_inflight,
        prefetch_inflight: a.prefetch_inflight,
        prefetch_queue_depth: 64,
        io_threads: a.io_threads,
        ..SsdConfig::default()
    };
    let n = a.total / a.block;
    let slot = a.block / a.slots;
    let shape = BlockShape::new(vec![slot; a.slots as usize]);
    let block_bytes = shape.len_bytes();
    let rt = tokio::runtime::Runtime::new()?;
    let reg = prometheus::Registry::new();
    rt.block_on(async {
        let t = pegaflow_tier_ssd::open(&cfg, &reg, &HealthBoard::default())?;
        t.recover().await?;
        println!(
            "{{\"phase\":\"setup\",\"engine\":\"{}\",\"align\":{},\"direct\":{},\"blocks\":{n},\"block_bytes\":{block_bytes}}}",
            t.engine_name(),
            t.dirs()[0].align,
            t.dirs()[0].direct
        );
        // One set of source blocks, reused under fresh keys (content does not matter for
        // bandwidth; a sample is checked on the way back).
        let sources: Vec<Arc<SealedBlock>> = (0..a.batch)
            .map(|i| {
                let buf = Arc::new(buffer(block_bytes as usize, i as u8));
                Arc::new(SealedBlock::from_buffer(0, &shape, buf, block_bytes))
            })
            .collect();
        let t0 = Instant::now();
        let mut written = 0u64;
        let mut i = 0u64;
        while i < n {
            let m = (n - i).min(a.batch as u64);
            let puts: Vec<TierPut> = (0..m)
                .map(|j| TierPut {
                    key: key_of(a.first_key + i + j),
                    block: sources[j as usize].clone(),
                })
                .collect();
            for r in t.put(puts).await {
                if r.is_ok() {
                    written += 1;
                }
            }
            i += m;
        }
        t.flush().await?;
        let ws = t0.elapsed().as_secs_f64();
        println!(
            "{{\"phase\":\"write\",\"blocks\":{written},\"seconds\":{ws:.3},\"gbps\":{:.3}}}",
            (written * block_bytes) as f64 / ws / 1e9
        );
        drop(t);
        let t1 = Instant::now();
        let t = pegaflow_tier_ssd::open(&cfg, &prometheus::Registry::new(), &HealthBoard::default())?;
        let rec = t.recover().await?;
        let rs = t1.elapsed().as_secs_f64();
        println!(
            "{{\"phase\":\"recover\",\"blocks\":{},\"gib\":{:.3},\"seconds\":{rs:.4},\"seconds_per_tib\":{:.3}}}",
            rec.blocks,
            rec.bytes as f64 / (1u64 << 30) as f64,
            rs / (rec.bytes.max(1) as f64 / (1u64 << 40) as f64)
        );
        let dests: Vec<Arc<HostBuffer>> = (0..a.batch)
            .map(|_| Arc::new(buffer(block_bytes as usize, 0xEE)))
            .collect();
        let t2 = Instant::now();
        let mut read = 0u64;
        let mut exact = true;
        let mut i = 0u64;
        while i < n {
            let m = (n - i).min(a.batch as u64);
            let gets: Vec<TierGet> = (0..m)
                .map(|j| TierGet {
                    key: key_of(a.first_key + i + j),
                    shape: shape.clone(),
                    dest: dests[j as usize].clone(),
                })
                .collect();
            for (j, r) in t.get(gets).await.iter().enumerate() {
                if r.is_ok() {
                    read += 1;
                    if (i + j as u64).is_multiple_of(97) {
                        let mut b = vec![0u8; 4096];
                        dests[j].read_at(0, &mut b);
                        exact &= b.iter().all(|&x| x == j as u8);
                    }
                }
            }
            i += m;
        }
        let rds = t2.elapsed().as_secs_f64();
        println!(
            "{{\"phase\":\"read\",\"blocks\":{read},\"seconds\":{rds:.3},\"gbps\":{:.3},\"sample_exact\":{exact}}}",
            (read * block_bytes) as f64 / rds / 1e9
        );
        anyhow::Ok(())
    })?;
    if !a.no_dd {
        let f = a.dir.join("dd.bench");
        let count = (a.total / (8 << 20)).max(1);
        let w = dd(&[
            "if=/dev/zero".into(),
            format!("of={}", f.display()),
            "bs=8M".into(),
            format!("count={count}"),
            "oflag=direct".into(),
            "conv=fsync".into(),
        ]);
        let r = dd(&[
            format!("if={}", f.display()),
            "of=/dev/null".into(),
            "bs=8M".into(),
            "iflag=direct".into(),
        ]);
        let _ = std::fs::remove_file(&f);
        println!(
            "{{\"phase\":\"dd\",\"write_gbps\":{},\"read_gbps\":{}}}",
            w.map_or("null".into(), |v| format!("{v:.3}")),
            r.map_or("null".into(), |v| format!("{v:.3}"))
        );
    }
    if !a.keep {
        let _ = std::fs::remove_dir_all(&store);
    }
    Ok(())
}
