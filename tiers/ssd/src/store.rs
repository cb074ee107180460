//! The SSD tier: an in-memory index over append-only segment logs in one or more
//! directories, written through the I/O engine.
//!
//! Owns: the index (key → record location; a key is indexed only after the write of its
//! record completed in full), the segment table (free, open, sealed; FIFO or read-heat
//! eviction of whole segments), the write streams (one open segment each; one write in
//! flight per segment, so that a crash tears at most the tail of each log), and the
//! per-directory error count that takes a failing directory out of service.
//!
//! Must never: index a record before its write completed, serve bytes that fail the
//! record's identity or checksum checks, let a slow or failing device block or fail a
//! Save (the tier stack calls it from its demotion worker, and every error here is a
//! typed [`TierError`]), or run file I/O on the async executor (data I/O goes through the
//! engine's threads; opening and preallocating files through `spawn_blocking`).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_runtime::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_runtime::health::{HealthBoard, HealthState};
use pegaflow_runtime::{Recovered, Tier, TierCapabilities, TierError, TierGet, TierPut};
use tokio::sync::Semaphore;

use crate::dir::Dir;
use crate::format::{
    align_up, decode_summary, encode_summary, summary_entry_len, trailer, Footer, RecordHeader,
    SegmentHeader, SummaryEntry, SUMMARY_FIXED, TRAILER_BYTES,
};
use crate::io::{read_vec, IoEngine};
use crate::metrics::SsdMetrics;
use crate::{Eviction, SsdSettings};

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
    read_bw: AtomicU64,
    write_bw: AtomicU64,
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
        Self {
            inner: Arc::new(Inner::new(settings, dirs, engine, metrics, health)),
        }
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
            metrics,
            health,
            read_bw: AtomicU64::new(0),
            write_bw: AtomicU64::new(0),
        };
        t.update_gauges();
        for d in &t.dirs {
            t.report_health(d, None);
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

    fn report_health(&self, d: &Dir, why: Option<&str>) {
        let detail = format!(
            "io={}; direct={}; align={} ({}); {} segments of {}",
            self.engine.name(),
            d.direct,
            d.align,
            d.align_source,
            d.slots,
            bytesize::ByteSize::b(d.segment_size)
        );
        match why {
            None => self.health.report(
                &format!("ssd {}", d.path.display()),
                HealthState::Ok,
                detail,
            ),
            Some(w) => self.health.report(
                &format!("ssd {}", d.path.display()),
                HealthState::Degraded,
                format!("out of service: {w}; {detail}"),
            ),
        }
    }

    fn update_gauges(&self) {
        let used = self.state.lock().used;
        self.metrics.used_bytes.set(used as i64);
        let cap: u64 = self
            .dirs
            .iter()
            .filter(|d| !d.degraded.load(Ordering::Relaxed))
            .map(|d| d.capacity())
            .sum();
        self.metrics.capacity_bytes.set(cap as i64);
        self.metrics.degraded_dirs.set(
            self.dirs
                .iter()
                .filter(|d| d.degraded.load(Ordering::Relaxed))
                .count() as i64,
        );
    }

    /// Counts an I/O error against directory `d`; past `max_errors` in a row the directory
    /// leaves service: its blocks are forgotten, nothing more is written to it.
    fn dir_error(&self, d: usize, op: &str, e: &io::Error) {
        self.metrics.error(op, e);
        let dir = &self.dirs[d];
        let n = dir.errors.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(path = %dir.path.display(), op, error = %e, errors_in_a_row = n, "SSD I/O error");
        if n >= self.settings.max_errors && !dir.degraded.swap(true, Ordering::Relaxed) {
            let why = format!("{n} I/O errors in a row, the last: {op}: {e}");
            tracing::error!(path = %dir.path.display(), "SSD directory taken out of service: {why}");
            {
                let mut st = self.state.lock();
                let st = &mut *st;
                for (slot, m) in st.segs[d].iter_mut().enumerate() {
                    if m.state == SegState::Free {
                        continue;
                    }
                    for k in m.keys.drain(..) {
                        if st
                            .index
                            .get(&k)
                            .is_some_and(|l| l.dir == d && l.slot == slot as u32)
                        {
                            st.index.remove(&k);
                        }
                    }
                    st.used -= m.bytes;
                    *m = SegMeta::free();
                    self.metrics
                        .segment_evictions
                        .with_label_values(&["degraded"])
                        .inc();
                }
            }
            self.report_health(dir, Some(&why));
            self.update_gauges();
        }
    }

    fn dir_ok(&self, d: usize) {
        self.dirs[d].errors.store(0, Ordering::Relaxed);
    }

    /// Forgets segment `(d, slot)` (its records leave the index) and frees its slot.
    fn evict_segment(&self, st: &mut State, d: usize, slot: u32, reason: &str) {
        let m = &mut st.segs[d][slot as usize];
        let keys = std::mem::take(&mut m.keys);
        let gen = m.generation;
        st.used -= m.bytes;
        *m = SegMeta::free();
        for k in keys {
            if st
                .index
                .get(&k)
                .is_some_and(|l| l.dir == d && l.slot == slot && l.generation == gen)
            {
                st.index.remove(&k);
            }
        }
        self.metrics
            .segment_evictions
            .with_label_values(&[reason])
            .inc();
    }

    /// The sealed segment to evict next in `d` (or any directory when `d` is `None`).
    fn victim(
        &self,
        st: &State,
        d: Option<usize>,
        skip: Option<(usize, u32)>,
    ) -> Option<(usize, u32)> {
        let mut best: Option<((u64, u64), usize, u32)> = None;
        for (di, segs) in st.segs.iter().enumerate() {
            if d.is_some_and(|x| x != di) || self.dirs[di].degraded.load(Ordering::Relaxed) {
                continue;
            }
            for (s, m) in segs.iter().enumerate() {
                if m.state != SegState::Sealed || skip == Some((di, s as u32)) {
                    continue;
                }
                let rank = match self.settings.eviction {
                    Eviction::Fifo => (m.generation, 0),
                    // Fewest reads per byte first, then the oldest.
                    Eviction::Heat => (m.reads * (1 << 20) / m.bytes.max(1), m.generation),
                };
                if best.as_ref().is_none_or(|b| rank < b.0) {
                    best = Some((rank, di, s as u32));
                }
            }
        }
        best.map(|(_, d, s)| (d, s))
    }

    /// Picks a slot for a new segment: the directory in service with the most free slots
    /// (striping by free space), else the eviction victim.
    fn claim_slot(&self) -> Option<(usize, u32)> {
        let mut st = self.state.lock();
        let mut best: Option<(usize, usize)> = None;
        for (di, segs) in st.segs.iter().enumerate() {
            if self.dirs[di].degraded.load(Ordering::Relaxed) {
                continue;
            }
            let free = segs.iter().filter(|m| m.state == SegState::Free).count();
            if free > 0 && best.is_none_or(|b| free > b.1) {
                best = Some((di, free));
            }
        }
        let (d, slot) = match best {
            Some((d, _)) => {
                // A slot whose file is already preallocated first (no fallocate, no ENOSPC).
                let dir = &self.dirs[d];
                let free: Vec<usize> = st.segs[d]
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.state == SegState::Free)
                    .map(|(i, _)| i)
                    .collect();
                let s = free
                    .iter()
                    .copied()
                    .find(|&i| dir.has_file(i as u32))
                    .or(free.first().copied())? as u32;
                (d, s)
            }
            None => {
                let (d, s) = self.victim(&st, None, None)?;
                self.evict_segment(&mut st, d, s, "capacity");
                (d, s)
            }
        };
        st.segs[d][slot as usize].state = SegState::Open;
        Some((d, slot))
    }

    /// Opens a new segment for a stream: claims a slot, makes sure its file exists and is
    /// preallocated (ENOSPC/EDQUOT: the oldest segment of that directory is evicted and its
    /// slot used instead, once), writes the segment header.
    async fn open_segment(self: &Arc<Self>) -> Result<OpenSeg, TierError> {
        let (d, mut slot) = self
            .claim_slot()
            .ok_or_else(|| TierError::Full("no SSD directory in service".into()))?;
        let mut retried = false;
        let (file, base) = loop {
            let me = self.clone();
            let r = tokio::task::spawn_blocking(move || me.dirs[d].slot_file(slot, true))
                .await
                .map_err(|e| TierError::Unavailable(format!("SSD open thread: {e}")))?;
            match r {
                Ok(x) => break x,
                Err(e) if crate::device::is_no_space(&e) && !retried => {
                    retried = true;
                    self.metrics.error("preallocate", &e);
                    let mut st = self.state.lock();
                    st.segs[d][slot as usize].state = SegState::Free;
                    match self.victim(&st, Some(d), None) {
                        Some((_, s)) => {
                            self.evict_segment(&mut st, d, s, "enospc");
                            st.segs[d][s as usize].state = SegState::Open;
                            slot = s;
                        }
                        None => {
                            return Err(TierError::Full(format!(
                                "SSD {}: no space for a new segment: {e}",
                                self.dirs[d].path.display()
                            )))
                        }
                    }
                }
                Err(e) => {
                    self.state.lock().segs[d][slot as usize].state = SegState::Free;
                    self.dir_error(d, "preallocate", &e);
                    return Err(if crate::device::is_no_space(&e) {
                        TierError::Full(format!("SSD: {e}"))
                    } else {
                        unavailable("segment file", &e)
                    });
                }
            }
        };
        let dir = &self.dirs[d];
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let h = SegmentHeader {
            store_id: dir.store_id,
            slot,
            generation,
        }
        .encode();
        let align = dir.align as usize;
        let r = self
            .engine
            .write(
                file.clone(),
                base,
                align,
                Box::new(move |b| {
                    b.fill(0);
                    b[..h.len()].copy_from_slice(&h);
                }),
            )
            .await;
        if let Err(e) = r {
            self.state.lock().segs[d][slot as usize].state = SegState::Free;
            self.dir_error(d, "write", &e);
            return Err(unavailable("segment header write", &e));
        }
        {
            let mut st = self.state.lock();
            let m = &mut st.segs[d][slot as usize];
            m.generation = generation;
            m.state = SegState::Open;
        }
        Ok(OpenSeg {
            dir: d,
            slot,
            generation,
            file,
            base,
            pos: dir.align,
            entries: Vec::new(),
            summary_bytes: SUMMARY_FIXED,
        })
    }

    /// Seals a stream's segment: writes its summary and footer (best effort: a segment
    /// without them is scanned at recovery) and marks it sealed.
    async fn seal(&self, seg: OpenSeg) {
        let dir = &self.dirs[seg.dir];
        let align = dir.align;
        let summary = encode_summary(seg.generation, &seg.entries);
        let slen = summary.len() as u64;
        let footer = Footer {
            generation: seg.generation,
            summary_offset: seg.pos,
            summary_len: slen,
        }
        .encode();
        let padded = align_up(slen, align) as usize;
        let ok = seg.pos + padded as u64 + align <= dir.segment_size;
        if ok && !seg.entries.is_empty() {
            let r = self
                .engine
                .write(
                    seg.file.clone(),
                    seg.base + seg.pos,
                    padded,
                    Box::new(move |b| {
                        b[..summary.len()].copy_from_slice(&summary);
                        b[summary.len()..].fill(0);
                    }),
                )
                .await;
            let r = match r {
                Ok(()) => {
                    self.engine
                        .write(
                            seg.file.clone(),
                            seg.base + dir.segment_size - align,
                            align as usize,
                            Box::new(move |b| {
                                b.fill(0);
                                b[..footer.len()].copy_from_slice(&footer);
                            }),
                        )
                        .await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                self.metrics.error("write", &e);
                tracing::debug!(error = %e, "SSD segment summary not written; recovery will scan the segment");
            }
        }
        let mut st = self.state.lock();
        let m = &mut st.segs[seg.dir][seg.slot as usize];
        if m.generation == seg.generation && m.state == SegState::Open {
            m.state = SegState::Sealed;
        }
    }

    /// Writes one chunk of records (at most `write_chunk` bytes, or one record) through a
    /// stream, sequentially after the stream's last write; indexes the records once the
    /// write completed.
    async fn write_chunk(
        self: &Arc<Self>,
        mut items: Vec<ChunkItem>,
    ) -> Vec<Result<(), TierError>> {
        let n = items.len();
        let _permit = match self.write_permits.acquire().await {
            Ok(p) => p,
            Err(_) => return vec![Err(TierError::Unavailable("SSD tier stopped".into())); n],
        };
        let _inflight = GaugeGuard::new(&self.metrics.write_inflight);
        // A stream: try each without waiting, else wait for the next in turn.
        // A free stream, preferring one with an open segment (a stream opens a segment only
        // when the others are busy: no more segments in use than writes need).
        let start = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let mut guard = None;
        let mut idle = None;
        for i in 0..self.streams.len() {
            if let Ok(g) = self.streams[(start + i) % self.streams.len()].try_lock() {
                if g.open.is_some() {
                    guard = Some(g);
                    break;
                }
                if idle.is_none() {
                    idle = Some(g);
                }
            }
        }
        let guard = guard.or(idle);
        let mut stream = match guard {
            Some(g) => g,
            None => self.streams[start % self.streams.len()].lock().await,
        };
        let mut retried_nospace = false;
        loop {
            // Room in the open segment (records padded to its directory's alignment, their
            // summary entries, the footer)?
            let sum_add: usize = items.iter().map(|i| summary_entry_len(&i.header)).sum();
            let total_in =
                |dir: &Dir| -> u64 { items.iter().map(|i| i.header.record_len(dir.align)).sum() };
            let fits = |s: &OpenSeg, dir: &Dir| {
                s.pos
                    + total_in(dir)
                    + align_up((s.summary_bytes + sum_add) as u64, dir.align)
                    + dir.align
                    <= dir.segment_size
            };
            let need_new = match &stream.open {
                Some(s) => {
                    let dir = &self.dirs[s.dir];
                    !fits(s, dir) || dir.degraded.load(Ordering::Relaxed)
                }
                None => true,
            };
            if need_new {
                if let Some(old) = stream.open.take() {
                    self.seal(old).await;
                }
                match self.open_segment().await {
                    Ok(s) => {
                        let dir = &self.dirs[s.dir];
                        if !fits(&s, dir) {
                            // Larger than an empty segment: never fits.
                            let total = total_in(dir);
                            stream.open = Some(s);
                            return vec![
                                Err(TierError::Full(format!(
                                    "{total} bytes of records do not fit in a {}-byte SSD segment",
                                    dir.segment_size
                                )));
                                n
                            ];
                        }
                        stream.open = Some(s);
                    }
                    Err(e) => return vec![Err(e); n],
                }
            }
            let seg = stream.open.as_mut().expect("an open segment");
            let d = seg.dir;
            let align = self.dirs[d].align;
            for it in items.iter_mut() {
                it.header.generation = seg.generation;
                it.rec_len = it.header.record_len(align);
            }
            let total: u64 = items.iter().map(|i| i.rec_len).sum();
            // Lay the records out and encode them on the I/O thread.
            let mut layout = Vec::with_capacity(items.len());
            let mut off = 0u64;
            for it in &items {
                layout.push((off, it.header.encode(), it.block.clone(), it.rec_len));
                off += it.rec_len;
            }
            let at = seg.pos;
            let fill_layout = layout.clone();
            let t0 = Instant::now();
            let r = self
                .engine
                .write(
                    seg.file.clone(),
                    seg.base + at,
                    total as usize,
                    Box::new(move |b| encode_records(b, &fill_layout)),
                )
                .await;
            match r {
                Ok(()) => {
                    self.dir_ok(d);
                    let secs = t0.elapsed().as_secs_f64();
                    if secs > 0.0 && total >= (1 << 20) {
                        self.write_bw
                            .store((total as f64 / secs) as u64, Ordering::Relaxed);
                    }
                    seg.pos += total;
                    let (slot, gen) = (seg.slot, seg.generation);
                    for (it, (o, _, _, len)) in items.iter().zip(&layout) {
                        seg.summary_bytes += summary_entry_len(&it.header);
                        seg.entries.push(SummaryEntry {
                            offset: at + o,
                            header: it.header.clone(),
                        });
                        let _ = len;
                    }
                    let indexed = {
                        let mut st = self.state.lock();
                        let st = &mut *st;
                        let m = &mut st.segs[d][slot as usize];
                        let live = m.generation == gen && m.state != SegState::Free;
                        if live {
                            for (it, (o, _, _, len)) in items.iter().zip(&layout) {
                                m.keys.push(it.key.clone());
                                m.bytes += len;
                                st.used += len;
                                st.index.insert(
                                    it.key.clone(),
                                    Loc {
                                        dir: d,
                                        slot,
                                        generation: gen,
                                        offset: at + o,
                                        len: *len,
                                        shape: it.header.shape.clone(),
                                    },
                                );
                            }
                        }
                        live
                    };
                    if !indexed {
                        // The directory left service (or the segment was evicted) while the
                        // write ran: nothing of it is served, so nothing is acknowledged.
                        return vec![
                            Err(TierError::Unavailable(
                                "SSD segment left service during the write".into()
                            ));
                            n
                        ];
                    }
                    self.metrics.write_bytes.inc_by(total);
                    if secs > 0.0 {
                        self.metrics.write_throughput.observe(total as f64 / secs);
                    }
                    self.metrics
                        .blocks
                        .with_label_values(&["write"])
                        .inc_by(n as u64);
                    self.update_gauges();
                    return vec![Ok(()); n];
                }
                Err(e) => {
                    // Whatever part of the chunk reached the disk is garbage after the
                    // segment's last good record: close the segment so that no later record
                    // follows it.
                    let old = stream.open.take().expect("an open segment");
                    let closed = (old.dir, old.slot);
                    self.seal(old).await;
                    if crate::device::is_no_space(&e) && !retried_nospace {
                        retried_nospace = true;
                        self.metrics.error("write", &e);
                        // Room from the oldest segment (not the one just closed: it holds
                        // the newest blocks), then once more in a fresh segment.
                        let mut st = self.state.lock();
                        if let Some((vd, s)) = self.victim(&st, Some(d), Some(closed)) {
                            self.evict_segment(&mut st, vd, s, "enospc");
                        }
                        continue;
                    }
                    self.dir_error(d, "write", &e);
                    let err = if crate::device::is_no_space(&e) {
                        TierError::Full(format!("SSD: {e}"))
                    } else {
                        unavailable("write", &e)
                    };
                    return vec![Err(err); n];
                }
            }
        }
    }

    /// Reads one record into its destination, checking it is the record the index names.
    async fn read_one(&self, r: TierGet) -> Result<(), TierError> {
        let loc = {
            let st = self.state.lock();
            st.index.get(&r.key).cloned()
        }
        .ok_or(TierError::NotFound)?;
        if loc.shape != r.shape {
            return Err(TierError::Corrupt(
                "stored slot layout differs from the requested one".into(),
            ));
        }
        let need = loc.shape.len_bytes() as usize;
        if r.dest.len() < need {
            return Err(TierError::Corrupt(format!(
                "destination of {} bytes for a {need}-byte block",
                r.dest.len()
            )));
        }
        let _permit = self
            .read_permits
            .acquire()
            .await
            .map_err(|_| TierError::Unavailable("SSD tier stopped".into()))?;
        let _inflight = GaugeGuard::new(&self.metrics.prefetch_inflight);
        let dir = &self.dirs[loc.dir];
        if dir.degraded.load(Ordering::Relaxed) {
            return Err(TierError::Unavailable(format!(
                "SSD {} is out of service",
                dir.path.display()
            )));
        }
        let (file, base) = dir
            .slot_file(loc.slot, false)
            .map_err(|e| unavailable("segment file", &e))?;
        let key = r.key.clone();
        let gen = loc.generation;
        let shape = loc.shape.clone();
        let dest = r.dest.clone();
        let t0 = Instant::now();
        let res = self
            .engine
            .read(
                file,
                base + loc.offset,
                loc.len as usize,
                Box::new(move |b| crate::verify::check_record(b, &key, gen, &shape, &*dest)),
            )
            .await;
        match res {
            Ok(Ok(())) => {
                self.dir_ok(loc.dir);
                let secs = t0.elapsed().as_secs_f64();
                self.metrics.read_seconds.observe(secs);
                if secs > 0.0 && loc.len >= (1 << 20) {
                    self.read_bw
                        .store((loc.len as f64 / secs) as u64, Ordering::Relaxed);
                }
                self.metrics.prefetch_bytes.inc_by(loc.len);
                self.metrics.prefetch_success.inc();
                if secs > 0.0 {
                    self.metrics
                        .prefetch_throughput
                        .observe(loc.len as f64 / secs);
                }
                self.metrics.blocks.with_label_values(&["read"]).inc();
                let mut st = self.state.lock();
                let m = &mut st.segs[loc.dir][loc.slot as usize];
                if m.generation == loc.generation {
                    m.reads += 1;
                }
                Ok(())
            }
            Ok(Err(why)) => {
                {
                    // The segment was evicted (and perhaps reused) while the read waited: a
                    // miss, not a corrupt record.
                    let st = self.state.lock();
                    let m = &st.segs[loc.dir][loc.slot as usize];
                    if m.generation != loc.generation || m.state == SegState::Free {
                        return Err(TierError::NotFound);
                    }
                }
                self.metrics.corrupt_records.inc();
                self.metrics.prefetch_failures.inc();
                tracing::warn!(path = %dir.path.display(), slot = loc.slot, offset = loc.offset, why, "SSD record failed its checks; dropped");
                let mut st = self.state.lock();
                if st.index.get(&r.key).is_some_and(|l| same_record(l, &loc)) {
                    st.index.remove(&r.key);
                }
                Err(TierError::Corrupt(why))
            }
            Err(e) => {
                self.metrics.prefetch_failures.inc();
                // An unreadable record is dropped (a bad sector is not asked for again); the
                // directory's error count decides whether the whole path leaves service.
                {
                    let mut st = self.state.lock();
                    if st.index.get(&r.key).is_some_and(|l| same_record(l, &loc)) {
                        st.index.remove(&r.key);
                    }
                }
                self.dir_error(loc.dir, "read", &e);
                Err(unavailable("read", &e))
            }
        }
    }

    /// Rebuilds the index of directory `d` from its segments: summaries of sealed
    /// segments, a header scan (payloads verified) of segments without one.
    async fn recover_dir(&self, d: usize) -> (Vec<(u32, u64, Vec<SummaryEntry>, bool)>, u64) {
        let dir = &self.dirs[d];
        let align = dir.align;
        let mut out = Vec::new();
        let mut dropped = 0u64;
        for slot in 0..dir.slots {
            let (file, base) = match dir.slot_file(slot, false) {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    // Its records are not indexed now; the slot may be reused.
                    self.metrics.error("recover", &e);
                    tracing::warn!(path = %dir.path.display(), slot, error = %e, "SSD segment cannot be opened at recovery; its blocks are not served");
                    continue;
                }
            };
            let hb = match read_vec(&*self.engine, file.clone(), base, align as usize).await {
                Ok(b) => b,
                Err(e) => {
                    self.metrics.error("recover", &e);
                    tracing::warn!(path = %dir.path.display(), slot, error = %e, "SSD segment header unreadable at recovery; its blocks are not served");
                    continue;
                }
            };
            let Ok(sh) = SegmentHeader::decode(&hb) else {
                continue;
            };
            if sh.store_id != dir.store_id || sh.slot != slot {
                continue;
            }
            let gen = sh.generation;
            let from_summary = async {
                let fb = read_vec(
                    &*self.engine,
                    file.clone(),
                    base + dir.segment_size - align,
                    align as usize,
                )
                .await
                .ok()?;
                let f = Footer::decode(&fb).ok()?;
                if f.generation != gen || f.summary_offset + f.summary_len > dir.segment_size {
                    return None;
                }
                let sb = read_vec(
                    &*self.engine,
                    file.clone(),
                    base + f.summary_offset,
                    align_up(f.summary_len, align) as usize,
                )
                .await
                .ok()?;
                decode_summary(&sb[..f.summary_len as usize], gen).ok()
            }
            .await;
            match from_summary {
                Some(entries) => out.push((slot, gen, entries, true)),
                None => {
                    let (entries, bad) = self.scan_segment(dir, &file, base, gen).await;
                    dropped += bad;
                    out.push((slot, gen, entries, false));
                }
            }
        }
        (out, dropped)
    }

    /// Scans a segment without a summary (it was open at a crash): record headers from the
    /// start, until one does not parse as this generation's. Writes to one segment are
    /// sequential (a chunk starts only once the previous one completed), so only the records
    /// of its last chunk can be torn by a crash: the payloads in the last
    /// `max(write_chunk, 16 MiB)` bytes are read and verified, and a record that fails is
    /// dropped (a torn write leaves a whole header whose payload fails). A record torn by a
    /// device that reported success is caught when it is read. Returns the good records and
    /// how many were dropped.
    async fn scan_segment(
        &self,
        dir: &Dir,
        file: &Arc<File>,
        base: u64,
        gen: u64,
    ) -> (Vec<SummaryEntry>, u64) {
        let align = dir.align;
        let end = dir.segment_size - align;
        let mut pos = align;
        let mut found = Vec::new();
        let mut dropped = 0;
        while pos + align <= end {
            let first = (64u64 << 10).min(end - pos) as usize;
            let Ok(b) = read_vec(&*self.engine, file.clone(), base + pos, first).await else {
                break;
            };
            let Ok(hlen) = RecordHeader::declared_len(&b) else {
                break;
            };
            let hb = if hlen > b.len() {
                let l = align_up(hlen as u64, align).min(end - pos) as usize;
                match read_vec(&*self.engine, file.clone(), base + pos, l).await {
                    Ok(x) => x,
                    Err(_) => break,
                }
            } else {
                b
            };
            let h = match RecordHeader::decode(&hb) {
                Ok(h) if h.generation == gen => h,
                Ok(_) => break,
                Err(_) => {
                    dropped += 1;
                    break;
                }
            };
            let len = h.record_len(align);
            if pos + len > end {
                dropped += 1;
                break;
            }
            found.push((pos, len, h));
            pos += len;
        }
        let window = self.settings.write_chunk.max(16 << 20);
        let tail_from = pos.saturating_sub(window);
        let mut out = Vec::with_capacity(found.len());
        for (at, len, h) in found {
            if at + len > tail_from {
                let key = h.key.clone();
                let shape = h.shape.clone();
                let ok = self
                    .engine
                    .read(
                        file.clone(),
                        base + at,
                        len as usize,
                        Box::new(move |b| {
                            crate::verify::check_record(
                                b,
                                &key,
                                gen,
                                &shape,
                                &crate::verify::Discard,
                            )
                        }),
                    )
                    .await;
                if !matches!(ok, Ok(Ok(()))) {
                    dropped += 1;
                    continue;
                }
            }
            out.push(SummaryEntry {
                offset: at,
                header: h,
            });
        }
        (out, dropped)
    }
}

fn same_record(a: &Loc, b: &Loc) -> bool {
    a.dir == b.dir && a.slot == b.slot && a.generation == b.generation && a.offset == b.offset
}

/// Encodes records into a staging buffer: `(offset, header bytes, block, record length)`.
fn encode_records(b: &mut [u8], layout: &[(u64, Vec<u8>, Arc<SealedBlock>, u64)]) {
    for (off, header, block, rec_len) in layout {
        let start = *off as usize;
        let rec = &mut b[start..start + *rec_len as usize];
        rec[..header.len()].copy_from_slice(header);
        let mut at = header.len();
        let mut crc = 0u32;
        for s in block.slots.iter() {
            let dst = &mut rec[at..at + s.len];
            s.buf.read_at(s.offset, dst);
            crc = crc32c::crc32c_append(crc, dst);
            at += s.len;
        }
        rec[at..at + TRAILER_BYTES].copy_from_slice(&trailer(crc));
        at += TRAILER_BYTES;
        rec[at..].fill(0);
    }
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

    async fn recover(&self) -> Result<Recovered, TierError> {
        let t0 = Instant::now();
        let mut per_dir = Vec::new();
        for d in 0..self.dirs.len() {
            per_dir.push(self.recover_dir(d));
        }
        let found = futures::future::join_all(per_dir).await;
        let mut rec = Recovered::default();
        let mut max_gen = 0u64;
        let mut max_seq = 0u64;
        let mut unsummarised = Vec::new();
        {
            let mut st = self.state.lock();
            let st = &mut *st;
            let mut seqs: HashMap<BlockKey, u64> = HashMap::new();
            for (d, (segs, dropped)) in found.into_iter().enumerate() {
                rec.dropped += dropped;
                let align = self.dirs[d].align;
                for (slot, gen, entries, summarised) in segs {
                    max_gen = max_gen.max(gen);
                    let m = &mut st.segs[d][slot as usize];
                    m.state = SegState::Sealed;
                    m.generation = gen;
                    for e in &entries {
                        let len = e.header.record_len(align);
                        max_seq = max_seq.max(e.header.seq);
                        m.bytes += len;
                        st.used += len;
                        m.keys.push(e.header.key.clone());
                        let newer = seqs.get(&e.header.key).is_none_or(|&s| e.header.seq > s);
                        if newer {
                            seqs.insert(e.header.key.clone(), e.header.seq);
                            st.index.insert(
                                e.header.key.clone(),
                                Loc {
                                    dir: d,
                                    slot,
                                    generation: gen,
                                    offset: e.offset,
                                    len,
                                    shape: e.header.shape.clone(),
                                },
                            );
                        }
                    }
                    if !summarised {
                        unsummarised.push((d, slot, gen, entries));
                    }
                }
            }
            rec.blocks = st.index.len() as u64;
            rec.bytes = st.index.values().map(|l| l.shape.len_bytes()).sum();
        }
        self.next_generation.store(max_gen + 1, Ordering::Relaxed);
        self.next_seq.store(max_seq + 1, Ordering::Relaxed);
        // Write the missing summaries (the segments open at the crash) so that the next
        // start reads them at once; no record is appended to them any more.
        for (d, slot, gen, entries) in unsummarised {
            let dir = &self.dirs[d];
            if let Ok((file, base)) = dir.slot_file(slot, false) {
                let pos = entries
                    .last()
                    .map_or(dir.align, |e| e.offset + e.header.record_len(dir.align));
                let summary_bytes = SUMMARY_FIXED
                    + entries
                        .iter()
                        .map(|e| summary_entry_len(&e.header))
                        .sum::<usize>();
                self.seal(OpenSeg {
                    dir: d,
                    slot,
                    generation: gen,
                    file,
                    base,
                    pos,
                    entries,
                    summary_bytes,
                })
                .await;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        self.metrics.recovery_seconds.set(secs);
        self.metrics.recovered_blocks.set(rec.blocks as i64);
        self.metrics.recovery_dropped.set(rec.dropped as i64);
        self.update_gauges();
        tracing::info!(
            blocks = rec.blocks,
            bytes = rec.bytes,
            dropped = rec.dropped,
            seconds = secs,
            "SSD index rebuilt"
        );
        Ok(rec)
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
