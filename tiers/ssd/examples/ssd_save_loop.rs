//! A child process for the SSD tier's crash tests: opens the tier on a directory and puts
//! blocks in a loop, printing `acked ID` once each put returned success (so the parent knows
//! which blocks were acknowledged when it SIGKILLs this process), or prints the I/O engine
//! the tier chose and exits (`--engine`).
//!
//! ```text
//! ssd_save_loop DIR FIRST_ID SEED [--posix] [--deny-io-uring] [--engine]
//! ```
//!
//! `--deny-io-uring` installs a seccomp filter that answers `io_uring_setup` with EPERM
//! before the tier starts (as Docker's default profile does), to drive the fallback.

use std::io::Write;

use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::{Tier, TierPut};
use pegaflow_tests::pool_suite::{pattern, Rng};
use pegaflow_tests::tier_suite::heap_buffer;
use pegaflow_tier_ssd::{IoChoice, SsdConfig};

/// Capacity of the crash tests' store (nothing is evicted over their 20 runs).
pub const CRASH_CAPACITY: u64 = 2 << 30;
/// Segment size of the crash tests' store.
pub const CRASH_SEGMENT: u64 = 8 << 20;
/// Blocks one run puts at most (then it waits to be killed).
pub const MAX_BLOCKS: u64 = 600;

/// The slot lengths of block `id` (deterministic: the parent recomputes them).
pub fn slot_lens(id: u64) -> Vec<u64> {
    let mut r = Rng::new(id);
    let slots = r.range(1, 6);
    (0..slots).map(|_| r.range(512, 48 << 10) as u64).collect()
}

#[cfg(target_os = "linux")]
fn deny_io_uring() {
    // A classic-BPF seccomp program: io_uring_setup (425 on x86_64 and aarch64) → EPERM,
    // everything else allowed.
    const NR: u32 = 425;
    let filter = [
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: 0, // offsetof(struct seccomp_data, nr)
        },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: NR,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32),
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with valid arguments; `prog` outlives the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog
            ),
            0,
            "seccomp filter"
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let first: u64 = args[2].parse().unwrap();
    let seed: u64 = args[3].parse().unwrap();
    let flag = |f: &str| args.iter().any(|a| a == f);
    #[cfg(target_os = "linux")]
    if flag("--deny-io-uring") {
        deny_io_uring();
    }
    let cfg = SsdConfig {
        paths: vec![dir],
        capacity: CRASH_CAPACITY,
        segment_size: CRASH_SEGMENT,
        reserve: 0,
        io: if flag("--posix") {
            IoChoice::Posix
        } else {
            IoChoice::Auto
        },
        write_chunk: 256 << 10,
        io_threads: 2,
        ..SsdConfig::default()
    };
    let health = HealthBoard::default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let t = pegaflow_tier_ssd::open(&cfg, &prometheus::Registry::new(), &health).unwrap();
        t.recover().await.unwrap();
        let mut out = std::io::stdout().lock();
        if flag("--engine") {
            writeln!(out, "engine {}", t.engine_name()).unwrap();
            writeln!(out, "health {}", health.render().replace('\n', " | ")).unwrap();
            return;
        }
        writeln!(out, "ready").unwrap();
        out.flush().unwrap();
        let mut rng = Rng::new(seed);
        let mut id = first;
        while id < first + MAX_BLOCKS {
            // Batches of 1..4 blocks, as the demotion worker sends them.
            let n = rng.range(1, 5) as u64;
            let puts: Vec<TierPut> = (id..id + n)
                .map(|i| {
                    let shape = BlockShape::new(slot_lens(i));
                    let len = shape.len_bytes() as usize;
                    let buf = heap_buffer(len, 1 + (i as usize % 3));
                    buf.write_at(0, &pattern(i, len));
                    TierPut {
                        key: BlockKey {
                            namespace: "crash".into(),
                            group: 0,
                            hash: i.to_le_bytes().to_vec().into(),
                        },
                        block: std::sync::Arc::new(SealedBlock::from_buffer(
                            0,
                            &shape,
                            std::sync::Arc::new(buf),
                            len as u64,
                        )),
                    }
                })
                .collect();
            writeln!(out, "trying {}", id + n - 1).unwrap();
            out.flush().unwrap();
            let rs = t.put(puts).await;
            for (i, r) in rs.iter().enumerate() {
                if r.is_ok() {
                    writeln!(out, "acked {}", id + i as u64).unwrap();
                }
            }
            out.flush().unwrap();
            id += n;
        }
        writeln!(out, "done").unwrap();
        out.flush().unwrap();
        std::future::pending::<()>().await;
    });
}
