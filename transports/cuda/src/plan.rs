//! Copy planning: turns a batch of [`CopyOp`]s into what the GPU worker issues, without touching
//! a GPU, so every plan can be checked byte-exact on the CPU.
//!
//! Owns: merging adjacent ops for the direct path ([`merge_ops`]); splitting ops into kernel
//! descriptors of bounded size ([`Desc`], [`MAX_DESC_BYTES`]); and the staged plan
//! ([`StagedPlan`]) that packs ops, sorted by host address, into staging chunks so that each
//! host run becomes one large pinned copy, with the staging layout mirroring the host layout
//! modulo [`STAGING_ALIGN`] (so aligned ops stay aligned for 16-byte vector copies), and no
//! host copy crossing a pinned-range boundary.
//!
//! Must never: drop, duplicate or reorder bytes within an op (a plan moves exactly the bytes
//! the ops name), or produce a staging offset past the chunk size.

use pegaflow_plugin::CopyOp;

/// Largest descriptor, in bytes: bigger ops are split so thread blocks share the work.
pub const MAX_DESC_BYTES: u64 = 64 << 10;
/// Staging offsets mirror host addresses modulo this many bytes.
pub const STAGING_ALIGN: u64 = 256;

/// One kernel copy: `len` bytes from `src` to `dst` (device-visible addresses).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Merges ops that continue the previous one on both sides, in the given order.
pub fn merge_ops(ops: &[CopyOp]) -> Vec<CopyOp> {
    let mut out: Vec<CopyOp> = Vec::with_capacity(ops.len());
    for op in ops.iter().filter(|o| o.len > 0) {
        if let Some(last) = out.last_mut() {
            if last.device_addr + last.len as u64 == op.device_addr
                && last.host_addr + last.len == op.host_addr
            {
                last.len += op.len;
                continue;
            }
        }
        out.push(*op);
    }
    out
}

/// Appends `len` bytes from `src` to `dst` as descriptors of at most [`MAX_DESC_BYTES`].
pub fn push_descs(out: &mut Vec<Desc>, src: u64, dst: u64, len: u64) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_DESC_BYTES);
        out.push(Desc {
            src: src + done,
            dst: dst + done,
            len: n,
        });
        done += n;
    }
}

/// Splits ops so that none crosses an address in `boundaries` (sorted ascending: where
/// separately pinned host ranges begin); a copy engine transfer must stay inside one
/// registration. Appends the pieces to `out` in order.
pub fn split_at_boundaries(ops: &[CopyOp], boundaries: &[usize], out: &mut Vec<CopyOp>) {
    for op in ops {
        let mut done = 0usize;
        let end = op.host_addr + op.len;
        let mut next = boundaries.partition_point(|&b| b <= op.host_addr);
        while done < op.len {
            let h = op.host_addr + done;
            let stop = boundaries
                .get(next)
                .copied()
                .filter(|&b| b < end)
                .unwrap_or(end);
            out.push(CopyOp {
                device_addr: op.device_addr + done as u64,
                host_addr: h,
                len: stop - h,
            });
            done = stop - op.host_addr;
            next += 1;
        }
    }
}

/// Number of ranges and total bytes `ops` make once merged as [`merge_ops`] would (no
/// allocation).
pub fn merged_stats(ops: &[CopyOp]) -> (usize, u64) {
    let mut n = 0usize;
    let mut total = 0u64;
    let mut end: Option<(u64, usize)> = None;
    for op in ops.iter().filter(|o| o.len > 0) {
        total += op.len as u64;
        if end != Some((op.device_addr, op.host_addr)) {
            n += 1;
        }
        end = Some((op.device_addr + op.len as u64, op.host_addr + op.len));
    }
    (n, total)
}

/// A piece of an op placed in a staging buffer: `len` bytes of device memory at
/// `device_addr` ↔ `staging_off` in the chunk's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPiece {
    /// Device address.
    pub device_addr: u64,
    /// Offset in the staging buffer.
    pub staging_off: u64,
    /// Bytes.
    pub len: u64,
}

/// One pinned copy between a staging buffer and host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCopy {
    /// Offset in the staging buffer.
    pub staging_off: u64,
    /// Host address.
    pub host_addr: usize,
    /// Bytes.
    pub len: usize,
}

/// What one staging buffer holds in one round: index ranges into [`StagedPlan::pieces`] and
/// [`StagedPlan::host_copies`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSpan {
    /// Device ↔ staging pieces (the gather or scatter kernel's work).
    pub pieces: std::ops::Range<usize>,
    /// Staging ↔ host copies (the copy engine's work), each contiguous on both sides.
    pub host_copies: std::ops::Range<usize>,
    /// Bytes of the buffer used, padding included.
    pub used: u64,
}

/// A staged plan: ops packed into staging chunks of at most `chunk` bytes. Its vectors are
/// reused from batch to batch (a worker keeps one), so planning allocates nothing in steady
/// state.
#[derive(Debug, Default, Clone)]
pub struct StagedPlan {
    /// Every piece, chunk after chunk.
    pub pieces: Vec<StagedPiece>,
    /// Every host copy, chunk after chunk.
    pub host_copies: Vec<HostCopy>,
    /// The chunks, in order; a worker runs chunk `i` on staging buffer `i % buffers`.
    pub chunks: Vec<ChunkSpan>,
    order: Vec<usize>,
    /// The first chunk's limit; each later chunk's doubles, up to the plan's chunk size.
    ramp: u64,
    used: u64,
    chunk_pieces: usize,
    chunk_copies: usize,
}

impl StagedPlan {
    /// Plans `ops` into chunks of at most `chunk` bytes, replacing the previous plan.
    ///
    /// Ops are taken in host-address order ([`HostOrder`]); consecutive ops that continue
    /// each other in host memory share one host copy; a host copy never crosses an address in
    /// `boundaries` (sorted ascending: where separately pinned ranges begin); staging offsets
    /// equal host addresses modulo [`STAGING_ALIGN`]. `chunk` must be at least 2 ×
    /// [`STAGING_ALIGN`].
    pub fn build(&mut self, ops: &[CopyOp], chunk: u64, boundaries: &[usize]) {
        self.begin();
        let mut scratch = std::mem::take(&mut self.order);
        for i in HostOrder::new(ops, &mut scratch) {
            self.push(&ops[i], chunk, boundaries);
        }
        self.order = scratch;
        self.finish();
    }

    /// Starts a new plan (what [`StagedPlan::build`] does in one call, step by step, so that a
    /// worker can issue each chunk as soon as it is closed): `begin`, then [`StagedPlan::push`]
    /// every op in host-address order, then [`StagedPlan::finish`]. After each `push`,
    /// `chunks` holds the chunks closed so far; a closed chunk never changes again.
    pub fn begin(&mut self) {
        self.begin_ramped(u64::MAX);
    }

    /// Like [`StagedPlan::begin`], with chunks that start small and double: chunk `i` holds
    /// at most `min(chunk, first << i)` bytes, so that the first copy starts after a short
    /// gather (or the first scatter after a short copy) and the pipeline fills at once, while
    /// later chunks are large. `first` below 2 × [`STAGING_ALIGN`] is raised to it.
    pub fn begin_ramped(&mut self, first: u64) {
        self.ramp = first.max(2 * STAGING_ALIGN);
        self.pieces.clear();
        self.host_copies.clear();
        self.chunks.clear();
        self.used = 0;
        self.chunk_pieces = 0;
        self.chunk_copies = 0;
    }

    /// Places one op (the next in host-address order) into the plan begun by
    /// [`StagedPlan::begin`]; may close chunks.
    pub fn push(&mut self, op: &CopyOp, chunk: u64, boundaries: &[usize]) {
        debug_assert!(chunk >= 2 * STAGING_ALIGN);
        self.place(op, chunk, boundaries);
    }

    /// Closes the last, partly filled chunk, if any.
    pub fn finish(&mut self) {
        if self.pieces.len() > self.chunk_pieces {
            self.close_chunk();
        }
    }

    fn close_chunk(&mut self) {
        self.chunks.push(ChunkSpan {
            pieces: self.chunk_pieces..self.pieces.len(),
            host_copies: self.chunk_copies..self.host_copies.len(),
            used: self.used,
        });
        self.chunk_pieces = self.pieces.len();
        self.chunk_copies = self.host_copies.len();
    }

    /// The byte limit of the chunk being filled: `chunk`, or less early in a ramp.
    fn limit(&self, chunk: u64) -> u64 {
        if self.ramp == 0 {
            return chunk;
        }
        let shift = self.chunks.len().min(63) as u32;
        chunk.min(self.ramp.saturating_mul(1u64 << shift))
    }

    fn place(&mut self, op: &CopyOp, max_chunk: u64, boundaries: &[usize]) {
        let mut h = op.host_addr;
        let mut d = op.device_addr;
        let mut left = op.len as u64;
        while left > 0 {
            let chunk = self.limit(max_chunk);
            // Continue the chunk's last host copy when this piece follows it in host memory
            // and no pinned-range boundary starts here.
            let continues = self.host_copies.len() > self.chunk_copies
                && self.host_copies.last().is_some_and(|c| {
                    c.host_addr + c.len == h
                        && c.staging_off + c.len as u64 == self.used
                        && boundaries.binary_search(&h).is_err()
                });
            if !continues {
                let pad = (h as u64).wrapping_sub(self.used) % STAGING_ALIGN;
                if self.used + pad >= chunk {
                    self.close_chunk();
                    self.used = h as u64 % STAGING_ALIGN;
                } else {
                    self.used += pad;
                }
            }
            if self.used >= chunk {
                self.close_chunk();
                self.used = h as u64 % STAGING_ALIGN;
                continue;
            }
            let mut take = left.min(chunk - self.used);
            // Stop at the next pinned-range boundary after h.
            let next = boundaries.partition_point(|&b| b <= h);
            if let Some(&b) = boundaries.get(next) {
                take = take.min((b - h) as u64);
            }
            self.pieces.push(StagedPiece {
                device_addr: d,
                staging_off: self.used,
                len: take,
            });
            match self.host_copies.last_mut() {
                Some(c) if continues => c.len += take as usize,
                _ => self.host_copies.push(HostCopy {
                    staging_off: self.used,
                    host_addr: h,
                    len: take as usize,
                }),
            }
            self.used += take;
            h += take as usize;
            d += take;
            left -= take;
        }
    }
}

/// Most ascending runs [`HostOrder`] merges lazily; more are sorted up front.
pub const MAX_MERGED_RUNS: usize = 256;

/// The indices of a batch's ops in ascending host-address order (ties in index order),
/// produced lazily so that planning can issue the first chunks before it has seen the last
/// op:
/// - ops already in host order (a Save of fresh blocks) are taken as they are;
/// - ops made of up to [`MAX_MERGED_RUNS`] ascending runs (a Load lists each block's layers
///   in host order, so its runs are where one block's buffer lies below the last one's) are
///   merged with a heap, `O(log runs)` per op;
/// - anything else is sorted once, up front.
pub enum HostOrder<'a> {
    /// `0..n`, already in order.
    Sorted(std::ops::Range<usize>),
    /// A k-way merge of ascending runs.
    Merge {
        /// The ops.
        ops: &'a [CopyOp],
        /// Per run: its next index and its end.
        runs: Vec<(usize, usize)>,
        /// The next op of every run not yet drained: (host address, run).
        heap: std::collections::BinaryHeap<std::cmp::Reverse<(usize, usize)>>,
    },
    /// Sorted indices, drained in order.
    Indices(std::vec::Drain<'a, usize>),
}

impl<'a> HostOrder<'a> {
    /// The order of `ops`; `scratch` holds the sorted indices of the fallback.
    pub fn new(ops: &'a [CopyOp], scratch: &'a mut Vec<usize>) -> Self {
        let mut runs = Vec::new();
        let mut start = 0;
        for i in 1..ops.len() {
            if ops[i].host_addr < ops[i - 1].host_addr {
                runs.push((start, i));
                start = i;
                if runs.len() >= MAX_MERGED_RUNS {
                    break;
                }
            }
        }
        if runs.is_empty() {
            return HostOrder::Sorted(0..ops.len());
        }
        // Fewer than MAX_MERGED_RUNS descents seen: the last run ends at the end.
        if runs.len() < MAX_MERGED_RUNS {
            runs.push((start, ops.len()));
            let heap = runs
                .iter()
                .enumerate()
                .filter(|(_, r)| r.0 < r.1)
                .map(|(k, r)| std::cmp::Reverse((ops[r.0].host_addr, k)))
                .collect();
            return HostOrder::Merge { ops, runs, heap };
        }
        scratch.clear();
        scratch.extend(0..ops.len());
        scratch.sort_by_key(|&i| ops[i].host_addr);
        HostOrder::Indices(scratch.drain(..))
    }
}

impl Iterator for HostOrder<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match self {
            HostOrder::Sorted(r) => r.next(),
            HostOrder::Indices(d) => d.next(),
            HostOrder::Merge { ops, runs, heap } => {
                let std::cmp::Reverse((_, k)) = heap.pop()?;
                let (next, end) = &mut runs[k];
                let i = *next;
                *next += 1;
                if *next < *end {
                    heap.push(std::cmp::Reverse((ops[*next].host_addr, k)));
                }
                Some(i)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op(device_addr: u64, host_addr: usize, len: usize) -> CopyOp {
        CopyOp {
            device_addr,
            host_addr,
            len,
        }
    }

    #[test]
    fn merge_adjacent() {
        let ops = [
            op(0, 100, 10),
            op(10, 110, 5),
            op(20, 115, 5),
            op(25, 120, 0),
        ];
        assert_eq!(merge_ops(&ops), vec![op(0, 100, 15), op(20, 115, 5)]);
    }

    #[test]
    fn boundary_splits() {
        let mut out = Vec::new();
        split_at_boundaries(
            &[op(1000, 90, 30), op(0, 200, 10)],
            &[100, 110, 205, 300],
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                op(1000, 90, 10),
                op(1010, 100, 10),
                op(1020, 110, 10),
                op(0, 200, 5),
                op(5, 205, 5)
            ]
        );
        out.clear();
        split_at_boundaries(&[op(0, 100, 10)], &[100, 110], &mut out);
        assert_eq!(out, vec![op(0, 100, 10)]);
    }

    #[test]
    fn descs_split() {
        let mut v = Vec::new();
        push_descs(&mut v, 0, 1000, MAX_DESC_BYTES * 2 + 3);
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[2],
            Desc {
                src: 2 * MAX_DESC_BYTES,
                dst: 1000 + 2 * MAX_DESC_BYTES,
                len: 3
            }
        );
    }

    #[test]
    fn bench_layout_becomes_few_large_copies() {
        // 4 blocks x 32 layers x 2 segments of 32 KiB, host per block contiguous 2 MiB.
        let seg = 32 << 10;
        let mut ops = Vec::new();
        for b in 0..4usize {
            for l in 0..32u64 {
                for s in 0..2u64 {
                    ops.push(op(
                        (l << 30) + s * (1 << 28) + (b as u64 * 7) * seg as u64,
                        (1 << 40) + b * (2 << 20) + (l as usize * 2 + s as usize) * seg,
                        seg,
                    ));
                }
            }
        }
        let mut plan = StagedPlan::default();
        plan.build(&ops, 4 << 20, &[]);
        assert_eq!(plan.chunks.len(), 2);
        for c in &plan.chunks {
            assert_eq!(c.host_copies.len(), 1);
            assert_eq!(plan.host_copies[c.host_copies.start].len, 4 << 20);
            assert_eq!(c.pieces.len(), 128);
        }
        assert_eq!(merged_stats(&ops), (256, 8 << 20));
        // Reuse gives the same plan.
        let again = plan.clone();
        plan.build(&ops, 4 << 20, &[]);
        assert_eq!(plan.chunks, again.chunks);
    }

    /// Runs a staged plan on CPU memories and checks it moves exactly what the ops name.
    fn simulate(ops: &[CopyOp], chunk: u64, boundaries: &[usize], dev_len: usize, host_len: usize) {
        let dev: Vec<u8> = (0..dev_len).map(|i| (i * 7 + 3) as u8).collect();
        let mut plan = StagedPlan::default();
        // Plan something else first: a reused plan must not keep stale state.
        plan.build(&ops[..ops.len() / 2], chunk, &[]);
        plan.build(ops, chunk, boundaries);
        check_plan(&plan, ops, chunk, boundaries, &dev, host_len);
        // The same streamed with a ramp (as the worker plans), from the smallest chunk.
        plan.begin_ramped(0);
        let mut scratch = Vec::new();
        for i in HostOrder::new(ops, &mut scratch) {
            plan.push(&ops[i], chunk, boundaries);
        }
        plan.finish();
        check_plan(&plan, ops, chunk, boundaries, &dev, host_len);
    }

    /// Runs `plan` both ways on CPU memories: ToHost must give the ops' bytes in host memory,
    /// ToDevice must bring them back to the device side.
    fn check_plan(
        plan: &StagedPlan,
        ops: &[CopyOp],
        chunk: u64,
        boundaries: &[usize],
        dev: &[u8],
        host_len: usize,
    ) {
        let dev_len = dev.len();
        // ToHost through staging.
        let mut host = vec![0u8; host_len];
        let mut expect = vec![0u8; host_len];
        for o in ops {
            expect[o.host_addr..o.host_addr + o.len]
                .copy_from_slice(&dev[o.device_addr as usize..o.device_addr as usize + o.len]);
        }
        let mut dev_back = vec![0u8; dev_len];
        for c in &plan.chunks {
            assert!(c.used <= chunk);
            let mut staging = vec![0u8; chunk as usize];
            for p in &plan.pieces[c.pieces.clone()] {
                assert!(p.staging_off + p.len <= chunk);
                let (s, d) = (p.staging_off as usize, p.device_addr as usize);
                staging[s..s + p.len as usize].copy_from_slice(&dev[d..d + p.len as usize]);
            }
            for hc in &plan.host_copies[c.host_copies.clone()] {
                assert_eq!(
                    hc.staging_off % STAGING_ALIGN,
                    hc.host_addr as u64 % STAGING_ALIGN
                );
                for &b in boundaries {
                    assert!(
                        !(hc.host_addr < b && b < hc.host_addr + hc.len),
                        "crosses {b}"
                    );
                }
                let s = hc.staging_off as usize;
                host[hc.host_addr..hc.host_addr + hc.len].copy_from_slice(&staging[s..s + hc.len]);
            }
            // ToDevice through the same plan.
            let mut staging2 = vec![0u8; chunk as usize];
            for hc in &plan.host_copies[c.host_copies.clone()] {
                let s = hc.staging_off as usize;
                staging2[s..s + hc.len]
                    .copy_from_slice(&expect[hc.host_addr..hc.host_addr + hc.len]);
            }
            for p in &plan.pieces[c.pieces.clone()] {
                let (s, d) = (p.staging_off as usize, p.device_addr as usize);
                dev_back[d..d + p.len as usize].copy_from_slice(&staging2[s..s + p.len as usize]);
            }
        }
        assert_eq!(host, expect);
        let mut dev_expect = vec![0u8; dev_len];
        for o in ops {
            let d = o.device_addr as usize;
            dev_expect[d..d + o.len].copy_from_slice(&expect[o.host_addr..o.host_addr + o.len]);
        }
        assert_eq!(dev_back, dev_expect);
    }

    proptest! {
        #[test]
        fn staged_plans_are_byte_exact(
            lens in proptest::collection::vec(1usize..5000, 1..40),
            gaps in proptest::collection::vec(0usize..600, 40),
            perm_seed in any::<u64>(),
            chunk_k in 1u64..20,
            bounds in proptest::collection::vec(0usize..120_000, 0..4),
        ) {
            // Disjoint host ranges with random gaps, disjoint device ranges in a shuffled order.
            let mut ops = Vec::new();
            let mut h = 17usize;
            let mut d_slots: Vec<usize> = (0..lens.len()).collect();
            let mut x = perm_seed | 1;
            for i in (1..d_slots.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                d_slots.swap(i, (x % (i as u64 + 1)) as usize);
            }
            for (i, &len) in lens.iter().enumerate() {
                ops.push(op((d_slots[i] * 5000 + (i % 3) * 16) as u64, h, len));
                h += len + gaps[i];
            }
            let mut b = bounds;
            b.sort_unstable();
            b.dedup();
            simulate(&ops, chunk_k * 512, &b, lens.len() * 5000 + 64, h + 16);
            // The same ops listed out of host order (interleaved runs, as a Load lists them
            // layer by layer) plan to the same bytes.
            let stride = (perm_seed % 5 + 2) as usize;
            let mut shuffled = Vec::new();
            for start in 0..stride {
                shuffled.extend(ops.iter().skip(start).step_by(stride).copied());
            }
            simulate(&shuffled, chunk_k * 512, &b, lens.len() * 5000 + 64, h + 16);
        }

        #[test]
        fn host_order_is_a_stable_sort(
            hosts in proptest::collection::vec(0usize..400, 0..1200),
            runs in 1usize..400,
        ) {
            // `runs` interleaved ascending runs (more than MAX_MERGED_RUNS takes the sort).
            let mut ops: Vec<CopyOp> = Vec::new();
            let mut sorted = hosts.clone();
            sorted.sort_unstable();
            for r in 0..runs {
                ops.extend(sorted.iter().skip(r).step_by(runs).map(|&h| op(0, h, 1)));
            }
            let mut scratch = Vec::new();
            let got: Vec<usize> = HostOrder::new(&ops, &mut scratch).collect();
            let mut want: Vec<usize> = (0..ops.len()).collect();
            want.sort_by_key(|&i| ops[i].host_addr);
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn ramped_chunks_double_up_to_the_chunk_size() {
        // 60 MiB of contiguous 32 KiB ops: chunks of 1, 2, 4, 8, 16, 16, 13 MiB.
        let seg = 32usize << 10;
        let ops: Vec<CopyOp> = (0..(60 * 32))
            .map(|i| op((i as u64 * 7 % 1920) * seg as u64, (1 << 40) + i * seg, seg))
            .collect();
        let mut plan = StagedPlan::default();
        plan.begin_ramped(1 << 20);
        for o in &ops {
            plan.push(o, 16 << 20, &[]);
        }
        plan.finish();
        let sizes: Vec<u64> = plan.chunks.iter().map(|c| c.used >> 20).collect();
        assert_eq!(sizes, vec![1, 2, 4, 8, 16, 16, 13]);
        for c in &plan.chunks {
            assert_eq!(
                c.host_copies.len(),
                1,
                "contiguous host memory: one copy per chunk"
            );
        }
    }

    #[test]
    fn host_order_takes_the_cheap_path_it_can() {
        let asc: Vec<CopyOp> = (0..10).map(|i| op(0, i * 8, 8)).collect();
        let mut scratch = Vec::new();
        assert!(matches!(
            HostOrder::new(&asc, &mut scratch),
            HostOrder::Sorted(_)
        ));
        // Two layers of five blocks each: two runs, merged.
        let layers: Vec<CopyOp> = (0..2)
            .flat_map(|l| (0..5).map(move |b| op(0, b * 64 + l * 8, 8)))
            .collect();
        assert!(matches!(
            HostOrder::new(&layers, &mut scratch),
            HostOrder::Merge { .. }
        ));
        let order: Vec<usize> = HostOrder::new(&layers, &mut scratch).collect();
        assert_eq!(order, vec![0, 5, 1, 6, 2, 7, 3, 8, 4, 9]);
        // A descending list has one run per op: sorted up front.
        let desc: Vec<CopyOp> = (0..(MAX_MERGED_RUNS + 5))
            .rev()
            .map(|i| op(0, i * 8, 8))
            .collect();
        assert!(matches!(
            HostOrder::new(&desc, &mut scratch),
            HostOrder::Indices(_)
        ));
    }
}
