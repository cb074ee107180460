//! The replay: N clients, each a registered single-worker instance with a host-memfd KV
//! cache, take the trace's requests in timestamp order and, per request, QueryPrefetch its
//! hash prefix, Load the hits into their cache (waiting on the load-state word) and check
//! every loaded byte — or Release the lease when the request does not load — then Save the
//! blocks after the hit prefix.
//!
//! Each client runs on its own OS thread (content generation and checking are CPU work that
//! must not stall the async executor the in-process server runs on) and drives its RPCs with
//! `Handle::block_on`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pegaflow_api::client::{single_group_load, EngineClient, LoadCompletion, QueryOutcome};
use pegaflow_api::load_state::{LoadState, LOAD_PENDING, LOAD_SUCCESS};
use pegaflow_proto as pb;
use tokio::runtime::Handle;

use crate::content;
use crate::latency::LatencyStats;
use crate::model::BlockGeometry;
use crate::prom::ServerCounters;
use crate::report::{
    Divergence, GeometryReport, InfiniteReport, LatencyReport, LruCheck, Report, ServerReport,
    SimReport, Throughput, Verification,
};
use crate::server::{layer_name, side_channel_of, InProcessServer, KvCache};
use crate::sim::{self, releases};
use crate::trace::{self, TraceRequest};

/// Byte written over load targets before each load, so a load that copies nothing (or only
/// part) cannot pass the check on bytes left over from an earlier request.
const POISON: u8 = 0xA5;

/// Longest wait for one load's completion word.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// What to replay against and how.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The trace file (for the report).
    pub trace_path: PathBuf,
    /// Block geometry.
    pub geometry: BlockGeometry,
    /// DRAM tier capacity in bytes: the in-process server's, and the simulation's.
    pub capacity: u64,
    /// Concurrent clients.
    pub clients: usize,
    /// Replay this many times faster than the trace's timestamps; `None` = as fast as possible.
    pub speedup: Option<f64>,
    /// Blocks per layer of each client's KV cache (load targets and save sources, reused
    /// round-robin).
    pub gpu_blocks: usize,
    /// Every this-many-th request releases its lease instead of loading (0 = never).
    pub release_every: u32,
    /// Cache namespace of the clients.
    pub namespace: String,
    /// A running server (`http://host:port`); `None` = start one in-process.
    pub endpoint: Option<String>,
    /// `host:port` of the running server's HTTP endpoint, to read its counters.
    pub metrics_addr: Option<String>,
    /// Draw a progress bar.
    pub progress: bool,
    /// The in-process server's `[store] evict_ahead_percent` (0 = off, the default: the
    /// exact LRU check needs it off). Above 0 the server keeps up to that share of its pool
    /// free ahead of Saves, so its hit count is reported next to the simulation's, not
    /// checked. Ignored with [`ReplayOptions::endpoint`].
    pub evict_ahead_percent: u8,
}

/// One replayed request, as the client saw it.
#[derive(Debug, Clone, Copy, Default)]
struct Record {
    index: usize,
    hits: u32,
    loaded: bool,
    released: bool,
    save_sent: u32,
    save_rejected: bool,
    query_us: f64,
    /// Whether the first answer was Loading.
    loading: bool,
    load_us: Option<f64>,
    release_us: Option<f64>,
    save_us: Option<f64>,
    verified_bytes: u64,
}

/// State shared by the client threads.
struct Shared<'a> {
    trace: &'a [TraceRequest],
    next: AtomicUsize,
    stop: AtomicBool,
    start: Instant,
    opts: &'a ReplayOptions,
    progress: ProgressBar,
    hit_blocks: AtomicU64,
    blocks: AtomicU64,
}

/// One client: its instance, connection, KV cache and load-state word.
struct Client {
    instance_id: String,
    rpc: EngineClient,
    kv: KvCache,
    state: LoadState,
    cursor: usize,
    /// The first refused save: request index and the server's message.
    first_rejection: Option<(usize, String)>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Client {
    /// The next `n` cache blocks, round-robin.
    fn take_slots(&mut self, n: usize) -> Vec<u32> {
        let nb = self.kv.num_blocks();
        let v = (0..n).map(|j| ((self.cursor + j) % nb) as u32).collect();
        self.cursor = (self.cursor + n) % nb;
        v
    }

    fn load_request(&self, lease: &[u8], targets: &[u32]) -> pb::LoadRequest {
        single_group_load(
            &self.instance_id,
            0,
            0,
            (0..self.kv.layers()).map(layer_name).collect(),
            lease,
            targets.iter().map(|&b| Some(b)),
            LoadCompletion::StateWord(self.state.name()),
        )
    }

    /// Waits for the load-state word to leave 0; returns the final state.
    fn wait_load(&self) -> i64 {
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = self.state.get();
            if s != LOAD_PENDING || t0.elapsed() > LOAD_TIMEOUT {
                return s;
            }
            if spins < 64 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Replays request `index`.
    fn replay_one(
        &mut self,
        rt: &Handle,
        index: usize,
        r: &TraceRequest,
        release_every: u32,
    ) -> anyhow::Result<Record> {
        let mut rec = Record {
            index,
            ..Record::default()
        };
        let hashes: Vec<Vec<u8>> = r
            .hash_ids
            .iter()
            .map(|h| h.to_le_bytes().to_vec())
            .collect();
        let req_id = format!("replay-{index}");
        let t = Instant::now();
        let mut tries = 0;
        let (hits, lease) = loop {
            match rt
                .block_on(self.rpc.query(&self.instance_id, hashes.clone(), &req_id))
                .with_context(|| format!("request {index}: QueryPrefetch"))?
            {
                QueryOutcome::Ready {
                    num_hit_blocks,
                    lease,
                    ..
                } => break (num_hit_blocks as usize, lease),
                QueryOutcome::Loading if tries < 10_000 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_micros(100));
                }
                QueryOutcome::Loading => {
                    anyhow::bail!("request {index}: the server kept answering Loading")
                }
            }
        };
        rec.query_us = us(t.elapsed());
        rec.loading = tries > 0;
        if hits > hashes.len() {
            anyhow::bail!(
                "request {index}: {hits} hits reported for {} hashes",
                hashes.len()
            );
        }
        rec.hits = hits as u32;
        let slots = self.take_slots(hashes.len());
        let (layers, seg) = (self.kv.layers(), self.kv.segment_bytes());
        if hits > 0 {
            if releases(index, release_every) {
                let t = Instant::now();
                rt.block_on(self.rpc.release(&lease))
                    .with_context(|| format!("request {index}: Release"))?;
                rec.release_us = Some(us(t.elapsed()));
                rec.released = true;
            } else {
                let targets = &slots[..hits];
                for &b in targets {
                    for l in 0..layers {
                        for s in 0..2 {
                            self.kv.segment_mut(l, b as usize, s).fill(POISON);
                        }
                    }
                }
                self.state.set(LOAD_PENDING);
                let req = self.load_request(&lease, targets);
                let t = Instant::now();
                rt.block_on(self.rpc.load(req))
                    .with_context(|| format!("request {index}: Load of {hits} blocks"))?;
                let st = self.wait_load();
                rec.load_us = Some(us(t.elapsed()));
                if st != LOAD_SUCCESS {
                    anyhow::bail!(
                        "request {index}: the load of {hits} blocks ended in state {st} (1 = success{})",
                        if st == LOAD_PENDING { ", still pending after the timeout" } else { "" }
                    );
                }
                for (j, &b) in targets.iter().enumerate() {
                    let h = r.hash_ids[j];
                    for l in 0..layers {
                        for s in 0..2 {
                            let got = self.kv.segment(l, b as usize, s);
                            if let Some(off) =
                                content::verify(got, content::seed(h, l as u32, s as u32))
                            {
                                anyhow::bail!(
                                    "WRONG BYTES: request {index} (timestamp {} ms), block {j} (hash id {h}) \
                                     loaded into cache block {b}: layer {l} segment {} differs at byte {off} of {seg} \
                                     (got {:#04x})",
                                    r.timestamp,
                                    if s == 0 { "K" } else { "V" },
                                    got[off]
                                );
                            }
                        }
                    }
                    rec.verified_bytes += (2 * layers * seg) as u64;
                }
                rec.loaded = true;
            }
        }
        let rest = &r.hash_ids[hits..];
        if !rest.is_empty() {
            let ids = &slots[hits..];
            for (&h, &b) in rest.iter().zip(ids) {
                for l in 0..layers {
                    for s in 0..2 {
                        content::fill(
                            self.kv.segment_mut(l, b as usize, s),
                            content::seed(h, l as u32, s as u32),
                        );
                    }
                }
            }
            let saves = (0..layers)
                .map(|l| (layer_name(l), ids.to_vec(), hashes[hits..].to_vec()))
                .collect();
            let t = Instant::now();
            let res = rt.block_on(self.rpc.save(&self.instance_id, 0, 0, 0, saves));
            rec.save_us = Some(us(t.elapsed()));
            rec.save_sent = rest.len() as u32;
            match res {
                Ok(()) => {}
                Err(e) if e.code() == Some(tonic::Code::ResourceExhausted) => {
                    rec.save_rejected = true;
                    self.first_rejection.get_or_insert((index, e.to_string()));
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("request {index}: Save of {} blocks", rest.len()))
                }
            }
        }
        Ok(rec)
    }
}

/// The loop of one client thread: take the next request, wait for its time, replay it.
fn client_loop(client: &mut Client, sh: &Shared<'_>, rt: &Handle) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    while !sh.stop.load(Ordering::Relaxed) {
        let i = sh.next.fetch_add(1, Ordering::Relaxed);
        let Some(r) = sh.trace.get(i) else { break };
        if let Some(speed) = sh.opts.speedup {
            let at = sh.start + Duration::from_secs_f64(r.timestamp as f64 / 1e3 / speed);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
        }
        let rec = client.replay_one(rt, i, r, sh.opts.release_every)?;
        let hb = sh.hit_blocks.fetch_add(rec.hits as u64, Ordering::Relaxed) + rec.hits as u64;
        let b = sh
            .blocks
            .fetch_add(r.hash_ids.len() as u64, Ordering::Relaxed)
            + r.hash_ids.len() as u64;
        if i.is_multiple_of(64) {
            sh.progress
                .set_message(format!("block hit rate {:.2}%", 100.0 * sim::ratio(hb, b)));
        }
        sh.progress.inc(1);
        out.push(rec);
    }
    Ok(out)
}

fn stats_of(recs: &[Record], f: impl Fn(&Record) -> Option<f64>) -> LatencyStats {
    let mut v: Vec<f64> = recs.iter().filter_map(f).collect();
    LatencyStats::of(&mut v)
}

/// Replays `trace` as `opts` says and returns the report (with the simulation's prediction
/// and the LRU check). Fails on a wrong byte, a failed load or an unexpected RPC error.
pub fn run(
    rt: &tokio::runtime::Runtime,
    trace: &[TraceRequest],
    opts: &ReplayOptions,
) -> anyhow::Result<Report> {
    anyhow::ensure!(opts.clients >= 1, "--clients must be at least 1");
    let g = opts.geometry;
    let tstats = trace::stats(trace);
    anyhow::ensure!(
        tstats.max_request_blocks as usize <= opts.gpu_blocks,
        "a request of the trace has {} blocks but each client's cache holds {} (raise --gpu-blocks)",
        tstats.max_request_blocks,
        opts.gpu_blocks
    );
    // The server: in-process, or the one at --endpoint. In-process, evict-ahead is off unless
    // asked for: it keeps up to one Save's worth of the pool free, at moments the exact LRU
    // simulation of the whole capacity cannot model.
    let server = match &opts.endpoint {
        None => Some(rt.block_on(InProcessServer::start_with(
            opts.capacity,
            Some(opts.evict_ahead_percent),
        ))?),
        Some(_) => None,
    };
    let endpoint = match (&server, &opts.endpoint) {
        (Some(s), _) => s.endpoint(),
        (None, Some(e)) => e.clone(),
        (None, None) => unreachable!("one of the two is set"),
    };
    let mut probe = rt
        .block_on(EngineClient::connect(&endpoint))
        .with_context(|| format!("cannot connect to {endpoint}"))?;
    let socket = match &server {
        Some(s) => s.socket().to_path_buf(),
        None => rt.block_on(side_channel_of(&mut probe, &endpoint))?,
    };
    let counters_before = match (&server, &opts.metrics_addr) {
        (Some(s), _) => Some(ServerCounters::of_engine(s.engine())),
        (None, Some(a)) => Some(ServerCounters::scrape(a)?),
        (None, None) => None,
    };
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let mut clients = Vec::with_capacity(opts.clients);
    for c in 0..opts.clients {
        let kv = KvCache::new(g.layers(), opts.gpu_blocks, g.segment_bytes())?;
        let mut rpc = rt.block_on(EngineClient::connect(&endpoint))?;
        let instance_id = format!("replay-{}-{c}", &run_id[..12]);
        rt.block_on(kv.register(&mut rpc, &socket, &instance_id, &opts.namespace))?;
        clients.push(Client {
            instance_id,
            rpc,
            kv,
            state: LoadState::create().context("cannot create a load-state word in /dev/shm")?,
            cursor: 0,
            first_rejection: None,
        });
    }
    let progress = if opts.progress {
        let p = ProgressBar::new(trace.len() as u64);
        p.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:36}] {pos}/{len} requests ({rate}, eta {eta}) {msg}",
            )
            .expect("valid template")
            .with_key(
                "rate",
                |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.0} req/s", s.per_sec());
                },
            )
            .progress_chars("=> "),
        );
        p
    } else {
        ProgressBar::hidden()
    };
    let shared = Shared {
        trace,
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        start: Instant::now(),
        opts,
        progress,
        hit_blocks: AtomicU64::new(0),
        blocks: AtomicU64::new(0),
    };
    let handle = rt.handle().clone();
    let t0 = Instant::now();
    let results: Vec<anyhow::Result<Vec<Record>>> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter_mut()
            .map(|c| {
                let sh = &shared;
                let rt = handle.clone();
                s.spawn(move || {
                    let r = client_loop(c, sh, &rt);
                    if r.is_err() {
                        sh.stop.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let wall = t0.elapsed();
    shared.progress.finish_and_clear();
    let mut recs = Vec::with_capacity(trace.len());
    let mut first_err = None;
    for r in results {
        match r {
            Ok(v) => recs.extend(v),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let counters = match (&server, &opts.metrics_addr) {
        (Some(s), _) => Some(ServerCounters::of_engine(s.engine())),
        (None, Some(a)) => Some(ServerCounters::scrape(a)?),
        (None, None) => None,
    }
    .zip(counters_before)
    .map(|(after, before)| after.since(&before));
    let first_rejection = clients
        .iter()
        .filter_map(|c| c.first_rejection.clone())
        .min_by_key(|(i, _)| *i)
        .map(|(i, m)| format!("request {i}: {m}"));
    for c in &mut clients {
        let id = c.instance_id.clone();
        if let Err(e) = rt.block_on(c.rpc.unregister(&id)) {
            eprintln!("warning: unregister {id}: {e}");
        }
    }
    drop(clients);
    if let Some(s) = server {
        rt.block_on(s.shutdown());
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    recs.sort_by_key(|r| r.index);
    anyhow::ensure!(
        recs.len() == trace.len(),
        "only {} of {} requests were replayed",
        recs.len(),
        trace.len()
    );

    // The offline prediction and the check.
    let simu = sim::simulate(trace, opts.capacity, g.block_bytes(), opts.release_every);
    let bb = g.block_bytes();
    let hit_blocks: u64 = recs.iter().map(|r| r.hits as u64).sum();
    let hit_tokens: u64 = recs
        .iter()
        .map(|r| trace[r.index].prefix_tokens(r.hits as usize))
        .sum();
    let loaded_blocks: u64 = recs
        .iter()
        .filter(|r| r.loaded)
        .map(|r| r.hits as u64)
        .sum();
    let released: u64 = recs.iter().filter(|r| r.released).count() as u64;
    let released_blocks: u64 = recs
        .iter()
        .filter(|r| r.released)
        .map(|r| r.hits as u64)
        .sum();
    let save_sent: u64 = recs.iter().map(|r| r.save_sent as u64).sum();
    let save_rejected = recs.iter().filter(|r| r.save_rejected).count() as u64;
    let verified: u64 = recs.iter().map(|r| r.verified_bytes).sum();
    let bytes_loaded = loaded_blocks * bb;
    let bytes_saved = counters.map_or(save_sent * bb, |c| c.save_bytes);
    let lat = LatencyReport {
        query: stats_of(&recs, |r| Some(r.query_us)),
        loading: stats_of(&recs, |r| r.loading.then_some(r.query_us)),
        load: stats_of(&recs, |r| r.load_us),
        release: stats_of(&recs, |r| r.release_us),
        save: stats_of(&recs, |r| r.save_us),
    };
    let ahead = opts.endpoint.is_none() && opts.evict_ahead_percent > 0;
    let sequential = opts.clients == 1 && !ahead;
    let divergence = recs
        .iter()
        .zip(&simu.steps)
        .find(|(r, s)| r.hits != s.hits)
        .map(|(r, s)| Divergence {
            request: r.index as u64,
            timestamp_ms: trace[r.index].timestamp,
            blocks: trace[r.index].hash_ids.len() as u64,
            server_hits: r.hits as u64,
            simulated_hits: s.hits as u64,
        });
    let holds = hit_blocks == simu.totals.hit_blocks && divergence.is_none();
    let mut notes = Vec::new();
    if ahead {
        notes.push(format!(
            "evict-ahead at {} % of the pool: the server frees blocks before the simulation would, so the hit count is reported, not checked",
            opts.evict_ahead_percent
        ));
    }
    if opts.clients > 1 {
        notes.push(format!(
            "{} concurrent clients: the server's request order is not the trace order, so the hit count is reported, not checked",
            opts.clients
        ));
    }
    if opts.endpoint.is_some() {
        notes.push(format!(
            "external server: the check assumes it started empty, with a DRAM tier of exactly {} bytes and nothing else using it",
            opts.capacity
        ));
    }
    if let Some(c) = counters {
        if sequential
            && (c.evictions != simu.totals.evicted_blocks
                || c.insertions != simu.totals.inserted_blocks)
        {
            notes.push(format!(
                "server evicted {} / inserted {} blocks, the simulation {} / {}",
                c.evictions, c.insertions, simu.totals.evicted_blocks, simu.totals.inserted_blocks
            ));
        }
    }
    let lru = LruCheck {
        checked: sequential,
        holds: sequential.then_some(holds),
        server_hit_blocks: hit_blocks,
        simulated_hit_blocks: simu.totals.hit_blocks,
        first_divergence: if sequential { divergence } else { None },
        notes,
    };
    let wall_s = wall.as_secs_f64();
    let gb = |bytes: u64, secs: f64| {
        if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    };
    Ok(Report {
        trace: opts.trace_path.display().to_string(),
        mode: if opts.endpoint.is_some() {
            "endpoint".into()
        } else {
            "in-process".into()
        },
        endpoint,
        namespace: opts.namespace.clone(),
        clients: opts.clients as u64,
        speedup: opts.speedup,
        release_every: opts.release_every,
        capacity_bytes: simu.capacity,
        capacity_blocks: simu.capacity / simu.footprint,
        geometry: GeometryReport::of(&g),
        requests: tstats.requests,
        blocks: tstats.blocks,
        unique_blocks: tstats.unique_blocks,
        tokens: tstats.tokens,
        wall_seconds: wall_s,
        server: ServerReport {
            hit_blocks,
            block_hit_rate: sim::ratio(hit_blocks, tstats.blocks),
            hit_tokens,
            token_hit_rate: sim::ratio(hit_tokens, tstats.tokens),
            loaded_blocks,
            released_leases: released,
            released_blocks,
            save_sent_blocks: save_sent,
            save_rejected,
            first_save_rejection: first_rejection,
            inserted_blocks: counters.map(|c| c.insertions),
            evictions: counters.map(|c| c.evictions),
            bytes_loaded,
            bytes_saved,
            bytes_saved_source: if counters.is_some() {
                "server".into()
            } else {
                "client (upper bound)".into()
            },
        },
        simulation: SimReport {
            hit_blocks: simu.totals.hit_blocks,
            block_hit_rate: simu.totals.block_hit_rate(),
            hit_tokens: simu.totals.hit_tokens,
            token_hit_rate: simu.totals.token_hit_rate(),
            loaded_blocks: simu.totals.loaded_blocks,
            inserted_blocks: simu.totals.inserted_blocks,
            evictions: simu.totals.evicted_blocks,
            rejected_saves: simu.totals.rejected_saves,
            bytes_loaded: simu.totals.loaded_blocks * bb,
            bytes_saved: simu.totals.inserted_blocks * bb,
        },
        infinite_cache: InfiniteReport {
            hit_blocks: tstats.infinite_hit_blocks,
            block_hit_rate: sim::ratio(tstats.infinite_hit_blocks, tstats.blocks),
            token_hit_rate: sim::ratio(tstats.infinite_hit_tokens, tstats.tokens),
            capacity_needed_bytes: tstats.unique_blocks * simu.footprint,
        },
        throughput: Throughput {
            requests_per_s: tstats.requests as f64 / wall_s.max(1e-9),
            load_gbps: gb(bytes_loaded, lat.load.total_s),
            save_gbps: gb(bytes_saved, lat.save.total_s),
            moved_gbps_wall: gb(bytes_loaded + bytes_saved, wall_s),
        },
        latency: lat,
        verification: Verification {
            blocks: loaded_blocks,
            bytes: verified,
            ok: verified == bytes_loaded,
        },
        lru_check: lru,
    })
}
