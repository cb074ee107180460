//! `pegaflow-replay`: replays the Mooncake conversation trace through a pegaflow server and
//! reports hit rate, bytes and latency, checked against an exact LRU simulation.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use pegaflow_bench::model::{human_bytes, BlockGeometry, ModelPreset, PRESETS};
use pegaflow_bench::replay::{self, ReplayOptions};
use pegaflow_bench::sweep::{self, ReplayPoint};
use pegaflow_bench::trace::{self, TraceRequest};
use pegaflow_plugin::units::parse_size;

/// The server binary's heap allocator (its default `mimalloc` feature), for an in-process
/// server that allocates as `pegaflow-server` does.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// A comma-separated list of sizes (may be empty).
#[derive(Debug, Clone)]
struct SizeList(Vec<u64>);

fn sizes_arg(s: &str) -> Result<SizeList, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(size_arg)
        .collect::<Result<Vec<_>, _>>()
        .map(SizeList)
}

fn model_arg(s: &str) -> Result<ModelPreset, String> {
    ModelPreset::find(s).ok_or_else(|| {
        format!(
            "unknown model {s:?}; known: {}",
            PRESETS
                .iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// Options shared by the replay and the sweep.
#[derive(Debug, Clone, Args)]
struct Common {
    /// The trace (JSONL). [default: bench/data/mooncake_conversation_trace.jsonl, else
    /// ../shared/traces/ beside the workspace]
    #[arg(long, value_name = "PATH")]
    trace: Option<PathBuf>,
    /// Replay only the first N requests (in timestamp order).
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Model whose KV layout gives the block geometry (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b).
    #[arg(long, value_name = "NAME", default_value = "llama-3.1-8b", value_parser = model_arg)]
    model: ModelPreset,
    /// Divide the model's 512-token block by this (keep 512/SCALE tokens of KV per block);
    /// 1 = real size. The default makes Llama-3.1-8B's 64 MiB block 512 KiB.
    #[arg(long, value_name = "N", default_value_t = 128)]
    scale: u32,
    /// Every N-th request that hits releases its lease instead of loading (a scheduler
    /// dropping the request after the lookup); 0 = every hit is loaded.
    #[arg(long, value_name = "N", default_value_t = 20)]
    release_every: u32,
    /// Blocks per layer in each client's KV cache (load targets and save sources, reused
    /// round-robin); must hold the largest request.
    #[arg(long, value_name = "N", default_value_t = 512)]
    gpu_blocks: usize,
    /// Cache namespace of the replaying instances.
    #[arg(long, value_name = "NS", default_value = "pegaflow-replay")]
    namespace: String,
    /// Do not draw progress bars.
    #[arg(long)]
    no_progress: bool,
}

/// Replay the Mooncake conversation trace through a pegaflow server.
#[derive(Debug, Parser)]
#[command(
    name = "pegaflow-replay",
    version,
    args_conflicts_with_subcommands = true,
    about = "Replay the Mooncake conversation trace through a pegaflow KV-cache server",
    long_about = "Replay the Mooncake conversation trace (12,031 requests of production chat \
        traffic) through a pegaflow KV-cache server, and report hit rate, bytes and latency.\n\n\
        Per request, in timestamp order: QueryPrefetch its block hashes, Load the hit prefix \
        into a host-memfd KV cache and check every loaded byte (each hash id maps to \
        deterministic content), or Release the lease when the request does not load, then \
        Save the blocks after the hit prefix.\n\n\
        With no arguments it starts a server in-process (embedded default pipeline, DRAM tier \
        of --capacity, evict-ahead off unless --evict-ahead-percent) and replays the whole shipped trace with one client. \
        Its hit count must equal that of an exact offline LRU simulation of the same capacity, \
        request by request; the run fails (exit 2) when it does not, and (exit 1) on any wrong \
        byte. A server at --endpoint passes that check only with `[store] evict_ahead_percent = \
        0`: evict-ahead keeps up to one Save's worth of its pool free.\n\n\
        `pegaflow-replay sweep` runs the simulation over many capacities (and real replays at a \
        few) and writes a CSV and a PNG chart."
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    /// DRAM tier capacity (kb, mb, gb: binary units). In-process: the server's pool size;
    /// with --endpoint: the running server's pool size, for the simulation.
    #[arg(long, value_name = "SIZE", default_value = "4gb", value_parser = size_arg)]
    capacity: u64,
    /// Concurrent replaying clients (instances). With more than one, the server's order is
    /// not the trace's, so the LRU check is reported but not enforced.
    #[arg(long, value_name = "N", default_value_t = 1)]
    clients: usize,
    /// Replay at this many times the trace's pace (1 = real time, about an hour); default:
    /// as fast as possible.
    #[arg(long, value_name = "X")]
    speedup: Option<f64>,
    /// The in-process server's evict-ahead share of its pool, 0 to 50 ([store]
    /// evict_ahead_percent; the server binary's default is 10). 0 (default) keeps the exact
    /// LRU check; above 0 the hit count is reported next to the simulation's, not checked.
    #[arg(long, value_name = "PERCENT", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=50), conflicts_with = "endpoint")]
    evict_ahead_percent: u8,
    /// Replay against a running server (http://host:port) instead of starting one; it needs
    /// --fd-socket-path (the socket is read from its Health answer).
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// With --endpoint: the server's HTTP address (host:port), to read its eviction and byte
    /// counters from /metrics.
    #[arg(long, value_name = "HOST:PORT", requires = "endpoint")]
    metrics_addr: Option<String>,
    /// Where to write the JSON report ("-" = stdout). [default:
    /// target/pegaflow-replay/report-<UTC time>.json in the workspace, a new file per run]
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Hit rate and bytes moved against DRAM capacity: the exact LRU simulation at many
    /// capacities, real in-process replays at a few; writes a CSV and a PNG chart.
    Sweep(SweepArgs),
}

#[derive(Debug, Args)]
struct SweepArgs {
    #[command(flatten)]
    common: Common,
    /// Capacities to simulate, comma-separated (the capacity that holds every distinct block
    /// is added).
    #[arg(
        long,
        value_name = "LIST",
        default_value = "256mb,512mb,1gb,1536mb,2gb,3gb,4gb,6gb,8gb,12gb,16gb,24gb,32gb,48gb,64gb",
        value_parser = sizes_arg
    )]
    capacities: SizeList,
    /// Capacities at which to also replay through an in-process server (each a full replay,
    /// checked against the simulation); empty = none.
    #[arg(long, value_name = "LIST", default_value = "1gb,4gb", value_parser = sizes_arg)]
    replay_at: SizeList,
    /// Folder for capacity-sweep.csv and capacity-sweep.png. [default:
    /// target/pegaflow-replay/sweep-<UTC time>/ in the workspace, a new folder per run; the
    /// committed figures in bench/results are rewritten only when named here]
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
}

fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// `target/pegaflow-replay` of the workspace (or of `CARGO_TARGET_DIR`): where runs write
/// their outputs by default, so that no run overwrites a tracked file or an earlier run's.
fn output_root() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target"));
    target.join("pegaflow-replay")
}

fn default_json() -> PathBuf {
    output_root().join(format!("report-{}.json", utc_stamp(SystemTime::now())))
}

/// `t` as a compact UTC time for file names, e.g. `20261201T175500Z`.
fn utc_stamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (the proleptic Gregorian calendar, in 400-year
    // eras of 146,097 days).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3_600,
        rem / 60 % 60,
        rem % 60
    )
}

fn load_trace(c: &Common) -> anyhow::Result<(PathBuf, Vec<TraceRequest>)> {
    let path = match &c.trace {
        Some(p) => p.clone(),
        None => trace::default_path()?,
    };
    let mut t = trace::load(&path)?;
    if let Some(n) = c.requests {
        t.truncate(n);
    }
    anyhow::ensure!(
        !t.is_empty(),
        "the trace {} has no requests",
        path.display()
    );
    Ok((path, t))
}

fn options(c: &Common, path: &Path, capacity: u64) -> anyhow::Result<ReplayOptions> {
    Ok(ReplayOptions {
        trace_path: path.to_path_buf(),
        geometry: BlockGeometry::new(c.model, c.scale)?,
        capacity,
        clients: 1,
        speedup: None,
        gpu_blocks: c.gpu_blocks,
        release_every: c.release_every,
        namespace: c.namespace.clone(),
        endpoint: None,
        metrics_addr: None,
        progress: !c.no_progress,
        evict_ahead_percent: 0,
    })
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    if path.as_os_str() == "-" {
        println!("{text}");
        return Ok(());
    }
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    std::fs::write(path, text + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("JSON report: {}", path.display());
    Ok(())
}

fn run_replay(cli: &Cli, rt: &tokio::runtime::Runtime) -> anyhow::Result<bool> {
    let (path, trace) = load_trace(&cli.common)?;
    let mut opts = options(&cli.common, &path, cli.capacity)?;
    opts.clients = cli.clients;
    opts.evict_ahead_percent = cli.evict_ahead_percent;
    opts.speedup = cli.speedup;
    opts.endpoint = cli.endpoint.clone();
    opts.metrics_addr = cli.metrics_addr.clone();
    if let Some(s) = opts.speedup {
        anyhow::ensure!(s.is_finite() && s > 0.0, "--speedup must be > 0");
    }
    eprintln!(
        "replaying {} requests of {} with {} client(s) against {} (block {}, DRAM {})",
        trace.len(),
        path.display(),
        opts.clients,
        opts.endpoint.as_deref().unwrap_or("an in-process server"),
        human_bytes(opts.geometry.block_bytes()),
        human_bytes(opts.capacity),
    );
    let report = replay::run(rt, &trace, &opts)?;
    println!("{}", report.table());
    write_json(cli.json.as_deref().unwrap_or(&default_json()), &report)?;
    Ok(report.passed())
}

fn run_sweep(a: &SweepArgs, rt: &tokio::runtime::Runtime) -> anyhow::Result<bool> {
    let (path, trace) = load_trace(&a.common)?;
    let opts = options(&a.common, &path, 0)?;
    let g = opts.geometry;
    let stats = trace::stats(&trace);
    let fp = g.block_bytes().div_ceil(pegaflow_bench::sim::GRANULE) * pegaflow_bench::sim::GRANULE;
    let mut caps = a.capacities.0.clone();
    caps.push(stats.unique_blocks * fp);
    caps.extend(a.replay_at.0.iter().copied());
    let t0 = std::time::Instant::now();
    let mut rows = sweep::simulate_all(&trace, &caps, g.block_bytes(), a.common.release_every);
    eprintln!(
        "simulated {} capacities in {:.1} s",
        rows.len(),
        t0.elapsed().as_secs_f64()
    );
    let mut ok = true;
    for &c in &a.replay_at.0 {
        let mut o = opts.clone();
        o.capacity = c;
        eprintln!(
            "replaying {} requests at DRAM {}",
            trace.len(),
            human_bytes(c)
        );
        let r = replay::run(rt, &trace, &o)?;
        println!("{}", r.table());
        ok &= r.passed();
        let cap = r.capacity_bytes;
        if let Some(row) = rows.iter_mut().find(|x| x.capacity_bytes == cap) {
            row.replay = Some(ReplayPoint {
                block_hit_rate: r.server.block_hit_rate,
                token_hit_rate: r.server.token_hit_rate,
                hit_blocks: r.server.hit_blocks,
                evictions: r.server.evictions,
                bytes_saved: r.server.bytes_saved,
                bytes_loaded: r.server.bytes_loaded,
                wall_s: r.wall_seconds,
                lru_holds: r.lru_check.holds,
            });
        }
    }
    let dir = a
        .out_dir
        .clone()
        .unwrap_or_else(|| output_root().join(format!("sweep-{}", utc_stamp(SystemTime::now()))));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let csv = dir.join("capacity-sweep.csv");
    let png = dir.join("capacity-sweep.png");
    sweep::write_csv(&csv, &rows, g.block_bytes())?;
    let subtitle = format!(
        "{} requests, {} blocks ({} distinct); block = {} (Llama-style layout scaled 1/{}: {} real); release every {}th hit request",
        stats.requests,
        stats.blocks,
        stats.unique_blocks,
        human_bytes(g.block_bytes()),
        g.scale,
        human_bytes(g.real_block_bytes()),
        a.common.release_every
    );
    sweep::draw_chart(&png, &rows, &stats, g.block_bytes(), &subtitle)?;
    println!(
        "{:>12} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "capacity", "blocks", "block hit", "token hit", "evictions", "saved", "loaded"
    );
    for r in &rows {
        println!(
            "{:>12} {:>10} {:>11.2}% {:>11.2}% {:>12} {:>12} {:>12}{}",
            human_bytes(r.capacity_bytes),
            r.capacity_blocks,
            100.0 * r.sim.block_hit_rate(),
            100.0 * r.sim.token_hit_rate(),
            r.sim.evicted_blocks,
            human_bytes(r.sim.inserted_blocks * g.block_bytes()),
            human_bytes(r.sim.loaded_blocks * g.block_bytes()),
            match r.replay {
                Some(p) => format!(
                    "   replay: {:.2}% ({})",
                    100.0 * p.block_hit_rate,
                    match p.lru_holds {
                        Some(true) => "LRU check holds",
                        Some(false) => "LRU check FAILS",
                        None => "not checked",
                    }
                ),
                None => String::new(),
            }
        );
    }
    println!("wrote {} and {}", csv.display(), png.display());
    Ok(ok)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match &cli.cmd {
        Some(Cmd::Sweep(a)) => run_sweep(a, &rt),
        None => run_replay(&cli, &rt),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("error: the server's hit count differs from the exact LRU simulation (see the report)");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn utc_stamps_name_the_civil_time() {
        let at = |s: u64| utc_stamp(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "19700101T000000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.
        assert_eq!(at(951_827_696), "20000229T123456Z");
        // 2026-12-01 17:55:00.
        assert_eq!(at(1_796_147_700), "20261201T175500Z");
    }

    #[test]
    fn default_outputs_stay_out_of_tracked_folders() {
        let json = default_json();
        assert!(json.starts_with(output_root()), "{}", json.display());
        assert!(!json.starts_with(Path::new(env!("CARGO_MANIFEST_DIR")).join("results")));
    }
}
