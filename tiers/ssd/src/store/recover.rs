//! The rebuild at start: each path's segments are read back (a sealed segment's summary in
//! one read; a segment open at a crash by walking its record headers, verifying the payloads
//! of its last chunks), the newest record of each key is indexed, and the summaries missing
//! are written.
//!
//! Must never: index a record that does not parse as its segment's generation, or one of a
//! scanned segment's tail whose record checksum fails (a torn write), or append to a
//! recovered segment.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use pegaflow_plugin::block::BlockKey;
use pegaflow_plugin::Recovered;

use super::{Inner, Loc, OpenSeg, SegState};
use crate::dir::Dir;
use crate::format::{
    align_up, decode_summary, summary_entry_len, Footer, RecordHeader, RecordPlace, SegmentHeader,
    SummaryEntry, SUMMARY_FIXED,
};
use crate::io::read_vec;
use crate::verify::Expected;

impl Inner {
    /// [`pegaflow_plugin::Tier::recover`]: rebuilds the index of every path, writes the
    /// summaries of the segments that were open at a crash, sets the recovery gauges.
    pub(super) async fn recover_all(&self) -> Recovered {
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
        rec
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
                    let (entries, bad) = self.scan_segment(dir, &file, slot, base, gen).await;
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
        slot: u32,
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
                let place = RecordPlace {
                    store_id: dir.store_id,
                    slot,
                    offset: at,
                };
                let ok = self
                    .engine
                    .read(
                        file.clone(),
                        base + at,
                        len as usize,
                        Box::new(move |b| {
                            let expect = Expected {
                                key: &key,
                                generation: gen,
                                shape: &shape,
                                place,
                            };
                            crate::verify::check_record(b, &expect, &crate::verify::Discard)
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
