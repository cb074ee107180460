//! The `memcpy` transport: CPU copies between host registrations and host buffers.

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_plugin::{
    parse_settings, CopyBatch, CopyOp, Direction, HostRegion, MemorySpace, OpParts, RuntimeContext,
    Transport, TransportError,
};
use serde::{Deserialize, Serialize};

use crate::stream;

/// Most threads one batch is split across unless `threads` says otherwise.
pub const DEFAULT_THREADS: usize = 4;

/// Batches of at least this many bytes are split across threads unless `parallel_threshold`
/// says otherwise (32 MiB). One thread copying from memory not in the cache is bound by its
/// own loads' latency: on the development VM a 32 MiB Save of 8 KiB blocks copied in 4.5–6.4 ms
/// on one thread and 2.7–2.9 ms on two (docs/benchmarks/log/query-and-shm.md §4).
pub const DEFAULT_PARALLEL_THRESHOLD: usize = 32 << 20;

/// Smallest share of a batch worth a thread of its own, in bytes (16 MiB).
const MIN_BYTES_PER_THREAD: usize = 16 << 20;

/// Most threads the `threads` option accepts.
const MAX_THREADS: usize = 64;

/// Which copies write their destination with streaming (non-temporal) stores, bypassing the
/// cache (the `streaming_stores` option; `stream.rs` says why).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamingStores {
    /// Every copy goes through the cache.
    Off,
    /// Saves only (into the landing tier's buffers, which nobody reads until a later Load);
    /// Loads go through the cache, for a CPU engine that reads what it loaded at once.
    Saves,
    /// Saves and Loads (the default). A Load's destination is the client's memory, usually
    /// far larger than the cache: on the development VM an 8 KiB-block Load of 32 MiB took
    /// 3.7–4.3 ms with streaming stores against 6.8 ms through the cache (docs/benchmarks/log/query-and-shm.md §4).
    #[default]
    All,
}

impl StreamingStores {
    fn applies_to(self, direction: Direction) -> bool {
        match self {
            Self::Off => false,
            Self::Saves => direction == Direction::ToHost,
            Self::All => true,
        }
    }
}

/// Copies with the CPU (kind `memcpy`); addresses host memory only.
///
/// [`Transport::copy`] runs the whole batch on a blocking thread (splitting batches of at
/// least `parallel_threshold` bytes over up to `threads` scoped threads) and completes once
/// every byte has moved.
#[derive(Debug, Clone)]
pub struct MemcpyTransport {
    threads: usize,
    parallel_threshold: usize,
    streaming: StreamingStores,
}

impl Default for MemcpyTransport {
    fn default() -> Self {
        Self::new(DEFAULT_THREADS, DEFAULT_PARALLEL_THRESHOLD)
    }
}

impl MemcpyTransport {
    /// A transport splitting batches of at least `parallel_threshold` bytes over at most
    /// `threads` threads (`threads` 0 is taken as 1).
    pub fn new(threads: usize, parallel_threshold: usize) -> Self {
        Self {
            threads: threads.max(1),
            parallel_threshold,
            streaming: StreamingStores::default(),
        }
    }

    /// The same transport with `streaming` deciding which copies use streaming stores.
    pub fn with_streaming_stores(mut self, streaming: StreamingStores) -> Self {
        self.streaming = streaming;
        self
    }
}

/// A `memcpy` transport's settings: what its `[[transport]]` table deserialises into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemcpyConfig {
    /// Most threads one large batch is split across, 1 to 64.
    pub threads: usize,
    /// Batches of at least this many bytes are split across threads (a size string or bytes).
    #[serde(with = "pegaflow_plugin::units::size")]
    pub parallel_threshold: usize,
    /// Which copies write with streaming stores: `"all"` (default), `"saves"` or `"off"`.
    pub streaming_stores: StreamingStores,
}

impl Default for MemcpyConfig {
    fn default() -> Self {
        Self {
            threads: DEFAULT_THREADS,
            parallel_threshold: DEFAULT_PARALLEL_THRESHOLD,
            streaming_stores: StreamingStores::default(),
        }
    }
}

/// Reads and range-checks the pipeline table (the factory's settings check and `build`).
///
/// # Errors
/// An unknown key, a wrong type, `threads` outside `1..=MAX_THREADS`.
pub(crate) fn checked_config(table: &toml::Table) -> anyhow::Result<MemcpyConfig> {
    let c: MemcpyConfig = parse_settings("memcpy transport", table)?;
    if !(1..=MAX_THREADS).contains(&c.threads) {
        anyhow::bail!(
            "memcpy transport: threads must be an integer from 1 to {MAX_THREADS}, got {}",
            c.threads
        );
    }
    Ok(c)
}

/// Builds the transport from its pipeline table ([`MemcpyConfig`]).
pub(crate) fn build(
    table: &toml::Table,
    _ctx: &RuntimeContext,
) -> anyhow::Result<Arc<dyn Transport>> {
    let c = checked_config(table)?;
    Ok(Arc::new(
        MemcpyTransport::new(c.threads, c.parallel_threshold)
            .with_streaming_stores(c.streaming_stores),
    ))
}

/// One copy with its direction resolved: `len` bytes from `src` to `dst` (addresses).
#[derive(Debug, Clone, Copy)]
struct Move {
    src: usize,
    dst: usize,
    len: usize,
}

impl Move {
    fn of(op: &CopyOp, direction: Direction) -> Result<Self, TransportError> {
        let device = usize::try_from(op.device_addr).map_err(|_| {
            TransportError(format!(
                "memcpy: address {:#x} is not a host address",
                op.device_addr
            ))
        })?;
        let ends = device
            .checked_add(op.len)
            .zip(op.host_addr.checked_add(op.len));
        if ends.is_none() || (op.len > 0 && (device == 0 || op.host_addr == 0)) {
            return Err(TransportError(format!(
                "memcpy: invalid copy of {} bytes between {device:#x} and {:#x}",
                op.len, op.host_addr
            )));
        }
        Ok(match direction {
            Direction::ToHost => Move {
                src: device,
                dst: op.host_addr,
                len: op.len,
            },
            Direction::ToDevice => Move {
                src: op.host_addr,
                dst: device,
                len: op.len,
            },
        })
    }

    /// Performs the copy, with streaming stores when `streaming` (the thread then runs
    /// [`stream::fence`] once its moves are done: [`run_all`]).
    ///
    /// The caller guarantees `src..src+len` is readable and `dst..dst+len` writable for the
    /// duration (the engine validated the addresses against the registration and a live host
    /// buffer, and keeps both alive until the batch completes: `Transport` contract).
    fn run(self, streaming: bool) {
        if self.len == 0 {
            return;
        }
        let overlap = self.src < self.dst + self.len && self.dst < self.src + self.len;
        if overlap {
            // SAFETY: see above; `copy` tolerates overlapping ranges.
            unsafe { std::ptr::copy(self.src as *const u8, self.dst as *mut u8, self.len) }
        } else if streaming {
            // SAFETY: see above; the ranges were just checked to be disjoint, and `run_all`
            // fences on this thread before the batch completes.
            unsafe { stream::copy(self.src as *const u8, self.dst as *mut u8, self.len) }
        } else {
            // SAFETY: see above; the ranges were just checked to be disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(self.src as *const u8, self.dst as *mut u8, self.len)
            }
        }
    }
}

/// Runs `moves` on this thread; after streaming stores, fences them so that the batch's
/// completion, published after this returns, orders after every byte.
fn run_all(moves: Vec<Move>, streaming: bool) {
    for m in moves {
        m.run(streaming);
    }
    if streaming {
        stream::fence();
    }
}

/// Splits `moves` into at most `parts` lists of roughly equal byte counts, cutting moves
/// where needed.
fn partition(moves: &[Move], total: usize, parts: usize) -> Vec<Vec<Move>> {
    let share = total.div_ceil(parts);
    let mut out: Vec<Vec<Move>> = vec![Vec::new()];
    let mut room = share;
    for m in moves {
        let mut m = *m;
        while m.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let take = m.len.min(room);
            if let Some(last) = out.last_mut() {
                last.push(Move {
                    src: m.src,
                    dst: m.dst,
                    len: take,
                });
            }
            m = Move {
                src: m.src + take,
                dst: m.dst + take,
                len: m.len - take,
            };
            room -= take;
        }
    }
    out
}

/// Runs every move, on up to `threads` threads when the batch is large.
fn run_moves(moves: Vec<Move>, threads: usize, parallel_threshold: usize, streaming: bool) {
    let total: usize = moves.iter().map(|m| m.len).sum();
    let parts = if total >= parallel_threshold {
        threads.min(total / MIN_BYTES_PER_THREAD).max(1)
    } else {
        1
    };
    if parts <= 1 {
        run_all(moves, streaming);
        return;
    }
    let chunks = partition(&moves, total, parts);
    std::thread::scope(|s| {
        let mut chunks = chunks.into_iter();
        let mine = chunks.next();
        for chunk in chunks {
            s.spawn(move || run_all(chunk, streaming));
        }
        if let Some(chunk) = mine {
            run_all(chunk, streaming);
        }
    });
}

#[async_trait]
impl Transport for MemcpyTransport {
    fn kind(&self) -> &'static str {
        "memcpy"
    }

    fn can_address(&self, space: MemorySpace) -> bool {
        space.is_host()
    }

    fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
        // Host memory needs no registration for memcpy.
        Ok(())
    }

    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        if !batch.location.is_host() {
            return Err(TransportError(format!(
                "the memcpy transport cannot address {:?} memory",
                batch.location
            )));
        }
        let moves = batch
            .ops
            .iter()
            .map(|op| Move::of(op, batch.direction))
            .collect::<Result<Vec<_>, _>>()?;
        if moves.iter().all(|m| m.len == 0) {
            return Ok(());
        }
        let (threads, threshold) = (self.threads, self.parallel_threshold);
        let streaming = self.streaming.applies_to(batch.direction);
        tokio::task::spawn_blocking(move || run_moves(moves, threads, threshold, streaming))
            .await
            .map_err(|e| TransportError(format!("memcpy copy thread failed: {e}")))
    }

    /// Gathers the parts first: the copy threads split the whole batch by bytes.
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pegaflow_api::TransferMode;
    use pegaflow_plugin::{Extent, HostBuffer, HostMemory};

    struct NoRelease;
    impl HostMemory for NoRelease {
        fn release(&self, _: &[Extent]) {}
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
            .collect()
    }

    /// A host buffer over three unequal extents of the given vectors.
    fn buffer(parts: &mut [Vec<u8>]) -> HostBuffer {
        let extents = parts
            .iter_mut()
            .map(|p| Extent {
                addr: p.as_mut_ptr() as usize,
                len: p.len(),
            })
            .collect();
        HostBuffer::new(extents, Arc::new(NoRelease))
    }

    /// Ops copying `device[dev_off..dev_off+len]` to/from `buf[buf_off..buf_off+len]`, one op
    /// per physical piece of the buffer range.
    fn ops(
        device: usize,
        dev_off: usize,
        buf: &HostBuffer,
        buf_off: usize,
        len: usize,
    ) -> Vec<CopyOp> {
        let mut done = 0;
        buf.pieces(buf_off, len)
            .map(|p| {
                let op = CopyOp {
                    device_addr: (device + dev_off + done) as u64,
                    host_addr: p.addr,
                    len: p.len,
                };
                done += p.len;
                op
            })
            .collect()
    }

    fn batch(direction: Direction, ops: Vec<CopyOp>) -> CopyBatch {
        CopyBatch {
            location: MemorySpace::HOST,
            direction,
            mode: TransferMode::Direct,
            ops,
        }
    }

    async fn round_trip(t: &MemcpyTransport, extent_lens: [usize; 3]) {
        let total: usize = extent_lens.iter().sum();
        let device = pattern(total + 100, 0x5A);
        let mut parts: Vec<Vec<u8>> = extent_lens.iter().map(|&n| vec![0u8; n]).collect();
        let buf = buffer(&mut parts);
        // Save: device[100..] → the whole buffer, crossing both extent boundaries.
        t.copy(batch(
            Direction::ToHost,
            ops(device.as_ptr() as usize, 100, &buf, 0, total),
        ))
        .await
        .unwrap();
        let mut got = vec![0u8; total];
        buf.read_at(0, &mut got);
        assert_eq!(got, device[100..], "ToHost");
        // Load: a range crossing the first boundary → a second device array.
        let mut device2 = vec![0u8; total];
        let (off, len) = (extent_lens[0] - 7, extent_lens[1] + 14);
        t.copy(batch(
            Direction::ToDevice,
            ops(device2.as_mut_ptr() as usize, 3, &buf, off, len),
        ))
        .await
        .unwrap();
        assert_eq!(
            device2[3..3 + len],
            device[100 + off..100 + off + len],
            "ToDevice"
        );
        assert!(device2[..3].iter().all(|&b| b == 0));
        assert!(device2[3 + len..].iter().all(|&b| b == 0));
    }

    const EVERY_STREAMING: [StreamingStores; 3] = [
        StreamingStores::Off,
        StreamingStores::Saves,
        StreamingStores::All,
    ];

    #[tokio::test]
    async fn copies_both_ways_across_extents() {
        for s in EVERY_STREAMING {
            let t = MemcpyTransport::default().with_streaming_stores(s);
            round_trip(&t, [4096 + 3, 100, 9000]).await;
        }
    }

    #[tokio::test]
    async fn large_batches_split_across_threads() {
        // A low threshold forces the threaded path on a modest batch.
        for s in EVERY_STREAMING {
            let t = MemcpyTransport::new(4, 1 << 20).with_streaming_stores(s);
            let mib = 1 << 20;
            round_trip(&t, [10 * mib + 5, 7 * mib, 16 * mib + 1]).await;
        }
    }

    #[test]
    fn streaming_stores_apply_to_the_configured_directions() {
        use Direction::{ToDevice, ToHost};
        let on = |s: StreamingStores| (s.applies_to(ToHost), s.applies_to(ToDevice));
        assert_eq!(on(StreamingStores::Off), (false, false));
        assert_eq!(on(StreamingStores::Saves), (true, false));
        assert_eq!(on(StreamingStores::All), (true, true));
        assert_eq!(
            MemcpyConfig::default().streaming_stores,
            StreamingStores::All
        );
    }

    #[test]
    fn partition_covers_every_byte_once() {
        let moves = vec![
            Move {
                src: 1000,
                dst: 50_000,
                len: 10,
            },
            Move {
                src: 2000,
                dst: 60_000,
                len: 25,
            },
            Move {
                src: 3000,
                dst: 70_000,
                len: 1,
            },
        ];
        for parts in 1..=8 {
            let chunks = partition(&moves, 36, parts);
            assert!(chunks.len() <= parts, "{parts}: {}", chunks.len());
            let flat: Vec<(usize, usize)> = chunks
                .iter()
                .flatten()
                .flat_map(|m| (0..m.len).map(move |i| (m.src + i, m.dst + i)))
                .collect();
            let want: Vec<(usize, usize)> = moves
                .iter()
                .flat_map(|m| (0..m.len).map(move |i| (m.src + i, m.dst + i)))
                .collect();
            assert_eq!(flat, want);
        }
    }

    #[tokio::test]
    async fn refuses_device_memory_and_bad_ops() {
        let t = MemcpyTransport::default();
        assert!(t.can_address(MemorySpace::HOST));
        assert!(!t.can_address(MemorySpace::new("gpu", 0)));
        let mut b = batch(Direction::ToHost, vec![]);
        b.location = MemorySpace::new("gpu", 0);
        assert!(t.copy(b).await.is_err());
        let wrap = CopyOp {
            device_addr: u64::MAX - 2,
            host_addr: 4096,
            len: 16,
        };
        assert!(t.copy(batch(Direction::ToHost, vec![wrap])).await.is_err());
        // Empty batches and zero-length ops succeed without touching memory.
        assert!(t.copy(batch(Direction::ToDevice, vec![])).await.is_ok());
        let zero = CopyOp {
            device_addr: 8,
            host_addr: 8,
            len: 0,
        };
        assert!(t.copy(batch(Direction::ToDevice, vec![zero])).await.is_ok());
    }

    #[test]
    fn options_are_checked() {
        let ctx = RuntimeContext::default();
        let table = |s: &str| -> toml::Table { toml::from_str(s).unwrap() };
        assert!(build(&table("threads = 2\nparallel_threshold = \"16mb\""), &ctx).is_ok());
        assert!(build(&table("threads = 0"), &ctx).is_err());
        assert!(build(&table("parallel_threshold = \"lots\""), &ctx).is_err());
        assert!(build(&table("thread = 2"), &ctx).is_err());
        for ok in ["off", "saves", "all"] {
            let t = format!("streaming_stores = \"{ok}\"");
            assert_eq!(
                checked_config(&table(&t)).unwrap().streaming_stores,
                toml::Value::String(ok.into()).try_into().unwrap(),
            );
        }
        assert!(build(&table("streaming_stores = \"sometimes\""), &ctx).is_err());
        let f = pegaflow_plugin::transport_factory("memcpy").unwrap();
        assert_eq!(
            (f.build)(&toml::Table::new(), &ctx).unwrap().kind(),
            "memcpy"
        );
    }
}
