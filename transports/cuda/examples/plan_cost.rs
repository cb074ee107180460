//! CPU cost of planning one Save batch of the bench layout (256 blocks x 32 layers x K/V of
//! 32 KiB = 16384 ops) for the staged path: op list, merge statistics, staged plan and
//! kernel descriptors. No GPU needed: `cargo run --release -p pegaflow-transport-cuda
//! --example plan_cost`.

use pegaflow_plugin::CopyOp;
use pegaflow_transport_cuda::plan::*;
use std::time::Instant;
fn main() {
    let seg = 32usize << 10;
    let n = 50;
    let mut plan = StagedPlan::default();
    let mut descs = Vec::new();
    let (mut t_ops, mut t_merge, mut t_plan, mut t_desc) = (0.0, 0.0, 0.0, 0.0);
    for _ in 0..n {
        let t = Instant::now();
        let mut ops = Vec::with_capacity(16384);
        for b in 0..256usize {
            for l in 0..32usize {
                for s in 0..2usize {
                    ops.push(CopyOp {
                        device_addr: ((l << 30) + s * (1 << 28) + b * 7 * seg) as u64,
                        host_addr: (1 << 40) + b * (2 << 20) + (l * 2 + s) * seg,
                        len: seg,
                    });
                }
            }
        }
        t_ops += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let m = merged_stats(&ops);
        t_merge += t.elapsed().as_secs_f64();
        let t = Instant::now();
        plan.build(&ops, 16 << 20, &[]);
        t_plan += t.elapsed().as_secs_f64();
        let t = Instant::now();
        descs.clear();
        for p in &plan.pieces {
            push_descs(&mut descs, p.device_addr, p.staging_off, p.len);
        }
        t_desc += t.elapsed().as_secs_f64();
        std::hint::black_box((m, &descs));
    }
    let k = 1e6 / n as f64;
    println!(
        "ops {:.0}us merge {:.0}us plan {:.0}us desc {:.0}us",
        t_ops * k,
        t_merge * k,
        t_plan * k,
        t_desc * k
    );
}
