//! Writing: claiming a slot for a new segment (a free one, else the eviction victim),
//! opening it (owner check, room check, preallocation, segment header), appending chunks of
//! records through the write streams, and sealing a full segment (summary and footer).
//!
//! Must never: index a record before its write completed, append after a failed write in
//! the same segment (the segment is sealed at its last good record), write to a path out of
//! service, or create a segment file the filesystem has no room for above the reserve.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use pegaflow_plugin::block::SealedBlock;
use pegaflow_plugin::TierError;

use super::{unavailable, ChunkItem, GaugeGuard, Inner, Loc, OpenSeg, SegMeta, SegState, State};
use crate::dir::Dir;
use crate::format::{
    align_up, encode_summary, summary_entry_len, trailer, Footer, RecordPlace, SegmentHeader,
    SummaryEntry, SUMMARY_FIXED, TRAILER_BYTES,
};
use crate::Eviction;

/// What [`Inner::claim_slot`] found.
enum Claim {
    /// This slot of this path, now open.
    Slot(usize, u32),
    /// No free slot usable and none to reuse; this path could take one if it had room.
    NoRoom(usize),
    /// Every slot of the paths in service is open for writing.
    Busy,
    /// No path in service.
    NoPath,
}

/// Why a slot's file could not be had.
enum SlotError {
    /// The path no longer names the locked store.
    Owner(String),
    /// Opening or preallocating failed (or no room).
    Io(io::Error),
}

impl Inner {
    /// Forgets segment `(d, slot)` (its records leave the index) and frees its slot.
    pub(super) fn evict_segment(&self, st: &mut State, d: usize, slot: u32, reason: &str) {
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

    /// Picks a slot for a new segment: the directory in service with the most usable free
    /// slots (striping by free space; a directory with no room for more segment files counts
    /// only the free slots whose file it has), else the eviction victim.
    fn claim_slot(&self) -> Claim {
        let mut st = self.state.lock();
        let mut best: Option<(usize, usize)> = None;
        let mut no_room = None;
        let mut in_service = false;
        for (di, segs) in st.segs.iter().enumerate() {
            let dir = &self.dirs[di];
            if dir.degraded.load(Ordering::Relaxed) {
                continue;
            }
            in_service = true;
            let room = !dir.no_room.load(Ordering::Relaxed);
            let mut free = 0;
            for (i, m) in segs.iter().enumerate() {
                if m.state == SegState::Free {
                    if room || dir.has_file(i as u32) {
                        free += 1;
                    } else {
                        no_room.get_or_insert(di);
                    }
                }
            }
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
                let Some(s) = free
                    .iter()
                    .copied()
                    .find(|&i| dir.has_file(i as u32))
                    .or(free.first().copied())
                else {
                    return Claim::NoPath;
                };
                (d, s as u32)
            }
            None => match self.victim(&st, None, None) {
                Some((d, s)) => {
                    self.evict_segment(&mut st, d, s, "capacity");
                    (d, s)
                }
                None => {
                    return match (no_room, in_service) {
                        (Some(d), _) => Claim::NoRoom(d),
                        (None, true) => Claim::Busy,
                        (None, false) => Claim::NoPath,
                    }
                }
            },
        };
        st.segs[d][slot as usize].state = SegState::Open;
        Claim::Slot(d, slot)
    }

    /// A slot for a new segment ([`Inner::claim_slot`]); a path with no room for another
    /// segment file and none to reuse is checked once more (space may have come back) before
    /// the write fails, counted against that path.
    async fn claim_slot_checked(self: &Arc<Self>) -> Result<(usize, u32), TierError> {
        let mut rechecked = false;
        loop {
            match self.claim_slot() {
                Claim::Slot(d, s) => return Ok((d, s)),
                Claim::NoPath => return Err(TierError::Full("no SSD directory in service".into())),
                Claim::Busy => {
                    return Err(TierError::Full(
                        "every SSD segment is open for writing; none to reuse".into(),
                    ))
                }
                Claim::NoRoom(d) => {
                    let me = self.clone();
                    let r = tokio::task::spawn_blocking(move || me.dirs[d].room_for_segment())
                        .await
                        .map_err(|e| TierError::Unavailable(format!("SSD open thread: {e}")))?;
                    match r {
                        Ok(()) if !rechecked => {
                            rechecked = true;
                            self.room_again(d);
                        }
                        Ok(()) => return Err(TierError::Full("no SSD segment to reuse".into())),
                        Err(e) => {
                            let path = self.dirs[d].path.display().to_string();
                            self.io_failed(d, "preallocate", &e, true);
                            return Err(TierError::Full(format!(
                                "SSD {path}: no space for a new segment and none to reuse: {e}"
                            )));
                        }
                    }
                }
            }
        }
    }

    /// Opens a new segment for a stream: claims a slot, checks that the path still names the
    /// store this process locked, makes sure the slot's file exists and is preallocated (no
    /// room — free space minus reserve below a segment — or ENOSPC/EDQUOT: the oldest segment
    /// of that directory is evicted and its slot used instead, once), writes the segment
    /// header.
    async fn open_segment(self: &Arc<Self>) -> Result<OpenSeg, TierError> {
        let (d, mut slot) = self.claim_slot_checked().await?;
        let mut retried = false;
        let (file, base) = loop {
            let me = self.clone();
            let r = tokio::task::spawn_blocking(move || {
                let dir = &me.dirs[d];
                dir.check_owner().map_err(SlotError::Owner)?;
                let had = dir.has_file(slot);
                dir.slot_file(slot, true)
                    .map(|x| (x, !had))
                    .map_err(SlotError::Io)
            })
            .await
            .map_err(|e| TierError::Unavailable(format!("SSD open thread: {e}")))?;
            match r {
                Ok((x, created)) => {
                    if created {
                        self.room_again(d);
                    }
                    break x;
                }
                Err(SlotError::Owner(why)) => {
                    self.state.lock().segs[d][slot as usize].state = SegState::Free;
                    self.take_out_of_service(
                        d,
                        &format!(
                            "{why}; its blocks are forgotten and nothing more is written there"
                        ),
                    );
                    return Err(TierError::Unavailable(format!("SSD: {why}")));
                }
                Err(SlotError::Io(e)) if crate::device::is_no_space(&e) && !retried => {
                    retried = true;
                    if e.raw_os_error().is_none() {
                        // This tier's own accounting (statvfs): not an error, a smaller store.
                        self.no_room(d, &e);
                    } else {
                        // Real ENOSPC: logged and counted; a write that then completes
                        // (in the reused slot) clears the count.
                        self.io_failed(d, "preallocate", &e, true);
                    }
                    let mut st = self.state.lock();
                    st.segs[d][slot as usize].state = SegState::Free;
                    match self.victim(&st, Some(d), None) {
                        Some((_, s)) => {
                            self.evict_segment(&mut st, d, s, "enospc");
                            st.segs[d][s as usize].state = SegState::Open;
                            slot = s;
                        }
                        None => {
                            drop(st);
                            let path = self.dirs[d].path.display().to_string();
                            if e.raw_os_error().is_none() {
                                // (A real ENOSPC was counted above.)
                                self.io_failed(d, "preallocate", &e, true);
                            }
                            return Err(TierError::Full(format!(
                                "SSD {path}: no space for a new segment and none to reuse: {e}"
                            )));
                        }
                    }
                }
                Err(SlotError::Io(e)) => {
                    self.state.lock().segs[d][slot as usize].state = SegState::Free;
                    self.io_failed(d, "preallocate", &e, true);
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
            self.io_failed(d, "write", &e, true);
            return Err(if crate::device::is_no_space(&e) {
                TierError::Full(format!("SSD segment header write: {e}"))
            } else {
                unavailable("segment header write", &e)
            });
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
    pub(super) async fn seal(&self, seg: OpenSeg) {
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
        let ok = seg.pos + padded as u64 + align <= dir.segment_size
            && !dir.degraded.load(Ordering::Relaxed);
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
                // Recovery scans a segment without a summary.
                self.io_failed(seg.dir, "summary", &e, true);
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
    pub(super) async fn write_chunk(
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
            let first = RecordPlace {
                store_id: self.dirs[d].store_id,
                slot: seg.slot,
                offset: at,
            };
            let t0 = Instant::now();
            let r = self
                .engine
                .write(
                    seg.file.clone(),
                    seg.base + at,
                    total as usize,
                    Box::new(move |b| encode_records(b, first, &fill_layout)),
                )
                .await;
            match r {
                Ok(()) => {
                    self.write_succeeded(d);
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
                    self.io_failed(d, "write", &e, true);
                    if crate::device::is_no_space(&e) && !retried_nospace {
                        retried_nospace = true;
                        // Room from the oldest segment (not the one just closed: it holds
                        // the newest blocks), then once more in a fresh segment.
                        let mut st = self.state.lock();
                        if let Some((vd, s)) = self.victim(&st, Some(d), Some(closed)) {
                            self.evict_segment(&mut st, vd, s, "enospc");
                        }
                        continue;
                    }
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
}

/// Encodes records into a staging buffer: `(offset, header bytes, block, record length)`,
/// offsets from the buffer's start, which lies at `first` in its segment. Each trailer holds
/// the record checksum over the record's place, its header and its payload.
fn encode_records(
    b: &mut [u8],
    first: RecordPlace,
    layout: &[(u64, Vec<u8>, Arc<SealedBlock>, u64)],
) {
    for (off, header, block, rec_len) in layout {
        let start = *off as usize;
        let rec = &mut b[start..start + *rec_len as usize];
        rec[..header.len()].copy_from_slice(header);
        let mut at = header.len();
        let place = RecordPlace {
            offset: first.offset + off,
            ..first
        };
        let mut crc = place.seed(header);
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
