//! The SSD tier: an in-memory index over append-only segment logs in one or more
//! directories, written through the I/O engine.
//!
//! Owns: the index (key → record location; a key is indexed only after the write of its
//! record completed in full), the segment table (free, open, sealed; FIFO or read-heat
//! eviction of whole segments), the write streams (one open segment each; one write in
//! flight per segment, so that a crash tears at most the tail of each log), and each path's
//! standing ([`status`]: errors in a row, failed writes in a row, out of service, `/health`).
//! Writing is in [`write`], reading in [`read`], the rebuild at start in [`recover`].
//!
//! Must never: index a record before its write completed, serve bytes that fail the
//! record's identity or checksum checks (a refused record's bytes never reach DRAM, a Load or
//! a peer: the get fails and the stack indexes nothing), let a slow or failing device block
//! or fail a Save (the tier stack calls it from its demotion worker, and every error here is
//! a typed [`TierError`]), or run file I/O on the async executor (data I/O goes through the
//! engine's threads; opening and preallocating files, `statvfs` and `stat` through
//! `spawn_blocking` or the watch thread).

mod read;
mod recover;
mod status;
mod write;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::{Recovered, Tier, TierCapabilities, TierError, TierGet, TierPut};
use tokio::sync::Semaphore;

use crate::dir::Dir;
use crate::format::{RecordHeader, SummaryEntry};
use crate::io::IoEngine;
use crate::metrics::SsdMetrics;
use crate::ratelog::LogLimit;
use crate::SsdSettings;

/// Where a record lies.
#[derive(Debug, Clone)]
struct Loc {
    dir: usize,
    slot: u32,
    generation: u64,
    /// Offset of the record from the start of its segment.
    offset: u64,
    /// Bytes of the record on disk.
    len: u64,
    shape: BlockShape,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegState {
    Free,
    Open,
    Sealed,
}

#[derive(Debug)]
struct SegMeta {
    state: SegState,
    generation: u64,
    keys: Vec<BlockKey>,
    bytes: u64,
    reads: u64,
}

impl SegMeta {
    fn free() -> Self {
        Self {
            state: SegState::Free,
            generation: 0,
            keys: Vec::new(),
            bytes: 0,
            reads: 0,
        }
    }
}

struct State {
    index: HashMap<BlockKey, Loc>,
    segs: Vec<Vec<SegMeta>>,
    used: u64,
}

struct OpenSeg {
    dir: usize,
    slot: u32,
    generation: u64,
    file: Arc<File>,
    base: u64,
    pos: u64,
    entries: Vec<SummaryEntry>,
    summary_bytes: usize,
}

#[derive(Default)]
struct Stream {
    open: Option<OpenSeg>,
}

/// The SSD tier (a handle: clones share one tier).
#[derive(Clone)]
pub struct SsdTier {
    inner: Arc<Inner>,
}

impl std::ops::Deref for SsdTier {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}

/// The tier's state behind its handle.
pub struct Inner {
    settings: SsdSettings,
    dirs: Vec<Dir>,
    engine: Arc<dyn IoEngine>,
    state: Mutex<State>,
    streams: Vec<tokio::sync::Mutex<Stream>>,
    next_stream: AtomicUsize,
    write_permits: Semaphore,
    read_permits: Semaphore,
    pending_puts: AtomicUsize,
    pending_gets: AtomicUsize,
    next_generation: AtomicU64,
    next_seq: AtomicU64,
    metrics: SsdMetrics,
    health: HealthBoard,
    /// Each path's standing (same order as `dirs`).
    status: Vec<status::DirStatus>,
    /// Records refused when read: one WARN line per interval.
    corrupt_log: LogLimit,
    read_bw: AtomicU64,
    write_bw: AtomicU64,
    /// Dropped with the tier: ends the watch thread.
    _watch: Option<std::sync::mpsc::Sender<()>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier")
            .field(
                "dirs",
                &self.dirs.iter().map(|d| &d.path).collect::<Vec<_>>(),
            )
            .field("engine", &self.engine.name())
            .finish()
    }
}

fn unavailable(what: &str, e: &io::Error) -> TierError {
    TierError::Unavailable(format!("SSD {what}: {e}"))
}

struct ChunkItem {
    key: BlockKey,
    block: Arc<SealedBlock>,
    header: RecordHeader,
    rec_len: u64,
}

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl SsdTier {
    /// A tier over opened directories and a started engine; call [`Tier::recover`] before
    /// use (a fresh store recovers nothing).
    pub fn new(
        settings: SsdSettings,
        dirs: Vec<Dir>,
        engine: Arc<dyn IoEngine>,
        metrics: SsdMetrics,
        health: HealthBoard,
    ) -> Self {
        let inner = Arc::new_cyclic(|weak| {
            let mut t = Inner::new(settings, dirs, engine, metrics, health);
            t._watch = status::start_watch(weak.clone());
            t
        });
        Self { inner }
    }

    /// Checks now what the watch thread checks every few seconds: that each path still names
    /// the store this process locked (a path that does not leaves service), and whether a
    /// path that had no room for another segment file has room again.
    pub fn check_paths(&self) {
        self.inner.check_paths();
    }
}

impl Inner {
    fn new(
        settings: SsdSettings,
        dirs: Vec<Dir>,
        engine: Arc<dyn IoEngine>,
        metrics: SsdMetrics,
        health: HealthBoard,
    ) -> Self {
        let streams_n = settings.streams.max(1);
        let n_dirs = dirs.len();
        let segs = dirs
            .iter()
            .map(|d| (0..d.slots).map(|_| SegMeta::free()).collect())
            .collect();
        metrics.io_engine.with_label_values(&[engine.name()]).set(1);
        let t = Self {
            streams: (0..streams_n)
                .map(|_| tokio::sync::Mutex::new(Stream::default()))
                .collect(),
            next_stream: AtomicUsize::new(0),
            write_permits: Semaphore::new(settings.write_inflight.max(1)),
            read_permits: Semaphore::new(settings.prefetch_inflight.max(1)),
            pending_puts: AtomicUsize::new(0),
            pending_gets: AtomicUsize::new(0),
            next_generation: AtomicU64::new(1),
            next_seq: AtomicU64::new(1),
            state: Mutex::new(State {
                index: HashMap::new(),
                segs,
                used: 0,
            }),
            settings,
            dirs,
            engine,
            status: (0..n_dirs).map(|_| status::DirStatus::default()).collect(),
            corrupt_log: LogLimit::new(crate::ratelog::EVERY),
            metrics,
            health,
            read_bw: AtomicU64::new(0),
            write_bw: AtomicU64::new(0),
            _watch: None,
        };
        t.update_gauges();
        for d in 0..t.dirs.len() {
            t.report_health(d);
        }
        t
    }

    /// The I/O engine's name.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// The directories (paths, alignment, geometry).
    pub fn dirs(&self) -> &[Dir] {
        &self.dirs
    }

    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.state.lock().index.len()
    }

    /// Whether no block is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn same_record(a: &Loc, b: &Loc) -> bool {
    a.dir == b.dir && a.slot == b.slot && a.generation == b.generation && a.offset == b.offset
}

#[async_trait]
impl Tier for SsdTier {
    fn kind(&self) -> &'static str {
        "ssd"
    }

    fn capabilities(&self) -> TierCapabilities {
        TierCapabilities {
            persistent: true,
            remote: false,
            read_bytes_per_sec: self.read_bw.load(Ordering::Relaxed),
            write_bytes_per_sec: self.write_bw.load(Ordering::Relaxed),
            write_through: self.settings.write_through,
        }
    }

    fn capacity_bytes(&self) -> u64 {
        self.dirs
            .iter()
            .filter(|d| !d.degraded.load(Ordering::Relaxed))
            .map(|d| d.capacity())
            .sum()
    }

    fn used_bytes(&self) -> u64 {
        self.state.lock().used
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        let st = self.state.lock();
        Ok(keys
            .iter()
            .map_while(|k| st.index.get(k).map(|l| l.shape.clone()))
            .collect())
    }

    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        let n = blocks.len();
        if self.settings.write_none {
            return vec![Err(TierError::Full("SSD admission is \"never\"".into())); n];
        }
        if self.pending_puts.fetch_add(1, Ordering::AcqRel) >= self.settings.write_queue_depth {
            self.pending_puts.fetch_sub(1, Ordering::AcqRel);
            self.metrics.write_queue_full.inc();
            return vec![Err(TierError::Unavailable("SSD write queue full".into())); n];
        }
        let _done = Decrement(&self.pending_puts);
        self.metrics
            .write_queue_pending
            .set(self.pending_puts.load(Ordering::Relaxed) as i64);
        let mut results: Vec<Option<Result<(), TierError>>> = vec![None; n];
        // Chunks of consecutive records, each at most `write_chunk` bytes (or one record).
        let mut chunks: Vec<(Vec<usize>, Vec<ChunkItem>)> = Vec::new();
        let mut cur: (Vec<usize>, Vec<ChunkItem>, u64) = (Vec::new(), Vec::new(), 0);
        let align = self.dirs.iter().map(|d| d.align).max().unwrap_or(4096);
        // A chunk never outgrows a quarter of the smallest segment (small stores).
        let chunk_cap = self
            .dirs
            .iter()
            .map(|d| d.segment_size / 4)
            .min()
            .unwrap_or(u64::MAX)
            .min(self.settings.write_chunk);
        {
            let st = self.state.lock();
            for (i, p) in blocks.into_iter().enumerate() {
                if st.index.contains_key(&p.key) {
                    results[i] = Some(Ok(()));
                    continue;
                }
                let header = RecordHeader {
                    generation: 0,
                    seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
                    key: p.key.clone(),
                    shape: p.block.shape(),
                };
                let rec_len = header.record_len(align);
                if cur.2 > 0 && cur.2 + rec_len > chunk_cap {
                    let (a, b, _) = std::mem::take(&mut cur);
                    chunks.push((a, b));
                }
                cur.0.push(i);
                cur.1.push(ChunkItem {
                    key: p.key,
                    block: p.block,
                    header,
                    rec_len,
                });
                cur.2 += rec_len;
            }
        }
        if !cur.0.is_empty() {
            chunks.push((cur.0, cur.1));
        }
        // Each chunk runs as its own task: a dropped put future never cancels a write
        // half-way (the segment's append point and index stay consistent with the disk).
        let tasks: Vec<_> = chunks
            .into_iter()
            .map(|(idx, items)| {
                let me = self.inner.clone();
                tokio::spawn(async move {
                    let r = me.write_chunk(items).await;
                    // Let go of the tier before the put returns (a caller that drops the
                    // tier next finds it released: its directory locks with it).
                    drop(me);
                    (idx, r)
                })
            })
            .collect();
        for t in futures::future::join_all(tasks).await {
            match t {
                Ok((idx, rs)) => {
                    for (i, r) in idx.into_iter().zip(rs) {
                        results[i] = Some(r);
                    }
                }
                Err(e) => tracing::error!(error = %e, "SSD write task failed"),
            }
        }
        let results: Vec<Result<(), TierError>> = results
            .into_iter()
            .map(|r| r.unwrap_or(Err(TierError::Unavailable("no result".into()))))
            .collect();
        let failed = results.iter().filter(|r| r.is_err()).count() as u64;
        self.metrics.write_failures.inc_by(failed);
        self.metrics
            .write_queue_pending
            .set(self.pending_puts.load(Ordering::Relaxed) as i64 - 1);
        results
    }

    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        let n = reads.len();
        if self.pending_gets.fetch_add(1, Ordering::AcqRel) >= self.settings.prefetch_queue_depth {
            self.pending_gets.fetch_sub(1, Ordering::AcqRel);
            self.metrics.prefetch_queue_full.inc();
            return vec![Err(TierError::Unavailable("SSD prefetch queue full".into())); n];
        }
        let _done = Decrement(&self.pending_gets);
        let futs = reads.into_iter().map(|r| {
            let me = self.inner.clone();
            async move { me.read_one(r).await }
        });
        futures::future::join_all(futs).await
    }

    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        // The records stay until their segment is evicted (a restart may find them again:
        // content-addressed, they hold the same bytes).
        let mut st = self.state.lock();
        Ok(keys
            .iter()
            .filter(|k| st.index.remove(*k).is_some())
            .count() as u64)
    }

    async fn recover(&self) -> Result<Recovered, TierError> {
        Ok(self.inner.recover_all().await)
    }

    async fn flush(&self) -> Result<(), TierError> {
        let files: Vec<Arc<File>> = self.dirs.iter().flat_map(|d| d.open_files()).collect();
        let r = tokio::task::spawn_blocking(move || {
            for f in files {
                crate::device::sync_data(&f)?;
            }
            Ok::<(), io::Error>(())
        })
        .await
        .map_err(|e| TierError::Unavailable(format!("SSD sync thread: {e}")))?;
        r.map_err(|e| {
            self.metrics.error("sync", &e);
            unavailable("fdatasync", &e)
        })
    }
}

/// Holds a gauge one higher while alive.
struct GaugeGuard<'a>(&'a prometheus::IntGauge);

impl<'a> GaugeGuard<'a> {
    fn new(g: &'a prometheus::IntGauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

struct Decrement<'a>(&'a AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
