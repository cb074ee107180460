//! The transport conformance suite: written once, instantiated for every transport (the
//! in-tree `memcpy` and `cuda` transports, the examples' `memcpy-verify`, and `memcpy` under
//! the `fault` and `metrics` layers) (DESIGN.md §9).
//!
//! Owns: generic async checks of the [`Transport`] contract, each a
//! `pub async fn(&TransportMaker)`, the test memory they copy between ([`TestMemory`] for the
//! registration side, [`Arena`] for host buffers, installed into the transport as the runtime
//! installs the landing pool's regions), and the
//! [`transport_conformance_tests!`](crate::transport_conformance_tests) macro that turns them
//! into one `#[tokio::test]` per case for a maker.
//!
//! Must never: depend on a transport's kind or its copy path (only on what the trait
//! promises: a batch that succeeds moved exactly its bytes, in the stated direction, and no
//! other byte; a failure is never reported as success; a dropped copy future leaves the
//! transport usable), time anything, free memory a copy might still touch (a copy future
//! dropped before completion leaks its memory on purpose), or leave state between cases
//! (each case makes a fresh transport and fresh memory).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use parking_lot::Mutex;
use pegaflow_api::TransferMode;
use pegaflow_plugin::layers::fault::FaultyTransport;
use pegaflow_plugin::{
    CopyBatch, CopyOp, Direction, Extent, HostBuffer, HostMemory, HostRegion, MemorySpace,
    Transport,
};

use crate::pool_suite::{pattern, Rng};

/// The registration side of a copy: memory of one [`MemorySpace`] that the transport under
/// test addresses, with a way for the suite to set and inspect its bytes outside any copy.
pub trait TestMemory: Send + Sync {
    /// Where the memory lives (the batch's `location`).
    fn space(&self) -> MemorySpace;
    /// The address of byte 0, as the transport addresses it (`CopyOp::device_addr`).
    fn addr(&self) -> u64;
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether the memory holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `src` to byte `offset` (no copy of the transport may be running on it).
    fn write(&self, offset: usize, src: &[u8]);
    /// Copies the bytes at `offset` into `dst` (no copy may be writing into it).
    fn read(&self, offset: usize, dst: &mut [u8]);
}

/// An anonymous, page-aligned private mapping of `len` bytes (zero-filled); unmapped on drop.
#[derive(Debug)]
struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            p != libc::MAP_FAILED,
            "mmap of {len} bytes: {}",
            std::io::Error::last_os_error()
        );
        Self {
            addr: p as usize,
            len,
        }
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "{offset}+{len} outside a {}-byte mapping",
            self.len
        );
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in new(); its owner guarantees no copy still uses it.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len.max(1)) };
    }
}

/// Host memory posing as a registration (what the `host-memfd` registrar hands a host
/// transport): a private anonymous mapping in [`MemorySpace::HOST`].
#[derive(Debug)]
pub struct HostTestMemory(Mapping);

impl HostTestMemory {
    /// `len` zeroed bytes, as the suite's memory handle.
    pub fn alloc(len: usize) -> Arc<dyn TestMemory> {
        Arc::new(Self(Mapping::new(len)))
    }
}

impl TestMemory for HostTestMemory {
    fn space(&self) -> MemorySpace {
        MemorySpace::HOST
    }
    fn addr(&self) -> u64 {
        self.0.addr as u64
    }
    fn len(&self) -> usize {
        self.0.len
    }
    fn write(&self, offset: usize, src: &[u8]) {
        self.0.check(offset, src.len());
        // SAFETY: the range is inside the live mapping; the caller excludes concurrent copies.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (self.0.addr + offset) as *mut u8,
                src.len(),
            )
        };
    }
    fn read(&self, offset: usize, dst: &mut [u8]) {
        self.0.check(offset, dst.len());
        // SAFETY: the range is inside the live mapping; the caller excludes concurrent writers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.0.addr + offset) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
    }
}

/// Host memory posing as the landing pool: one mapping, published as a [`HostRegion`] and
/// installed into the transport, from which the suite carves [`HostBuffer`]s (a bump
/// allocator: released extents are never reused, so a late write can only land in memory no
/// other buffer uses).
#[derive(Debug)]
pub struct Arena {
    map: Mapping,
    next: Mutex<usize>,
}

/// Alignment of every extent the arena hands out.
const EXTENT_ALIGN: usize = 64;

impl Arena {
    /// An arena of `len` bytes.
    pub fn new(len: usize) -> Arc<Self> {
        Arc::new(Self {
            map: Mapping::new(len),
            next: Mutex::new(0),
        })
    }

    /// The arena as the host memory the runtime installs into a transport.
    pub fn regions(self: &Arc<Self>) -> Vec<HostRegion> {
        vec![HostRegion {
            addr: self.map.addr,
            len: self.map.len,
            owner: self.clone(),
        }]
    }

    /// A buffer of the given extent lengths. With `adjacent`, each extent starts where the
    /// previous one ends (as a pool's contiguous run); otherwise a gap separates them. Panics
    /// when the arena is exhausted.
    pub fn buffer(self: &Arc<Self>, extent_lens: &[usize], adjacent: bool) -> HostBuffer {
        let mut next = self.next.lock();
        let mut at = next.next_multiple_of(EXTENT_ALIGN);
        let mut extents = Vec::with_capacity(extent_lens.len());
        for &len in extent_lens {
            extents.push(Extent {
                addr: self.map.addr + at,
                len,
            });
            at += len;
            if !adjacent {
                at = (at + EXTENT_ALIGN).next_multiple_of(EXTENT_ALIGN);
            }
        }
        assert!(
            at <= self.map.len,
            "arena of {} bytes exhausted",
            self.map.len
        );
        *next = at;
        HostBuffer::new(extents, self.clone())
    }

    /// A buffer of `len` bytes in `pieces` unequal, separated extents.
    pub fn scattered(self: &Arc<Self>, len: usize, pieces: usize) -> HostBuffer {
        self.buffer(&split(len, pieces), false)
    }
}

impl HostMemory for Arena {
    fn release(&self, _extents: &[Extent]) {}
}

/// `len` split into `pieces` unequal, non-empty parts (fewer when `len` is small).
fn split(len: usize, pieces: usize) -> Vec<usize> {
    let pieces = pieces.clamp(1, len.max(1));
    let mut out = Vec::with_capacity(pieces);
    let mut left = len;
    for i in 0..pieces {
        let rest = pieces - i;
        let l = if rest == 1 {
            left
        } else {
            // Shares of 1, 2, 3, ... parts of the rest, so that no two extents are equal.
            (left * (i % 3 + 1) / (rest + 2)).clamp(1, left - (rest - 1))
        };
        out.push(l);
        left -= l;
    }
    out
}

/// How a suite case gets its transport and the memory it copies.
pub struct TransportMaker {
    /// Builds a fresh transport (the suite installs its host memory).
    pub make: fn() -> Arc<dyn Transport>,
    /// Allocates `len` zeroed bytes of the memory the transport copies to and from.
    pub memory: fn(len: usize) -> Arc<dyn TestMemory>,
    /// `Err(why)` when the cases cannot run here (no GPU, say): each reports
    /// itself skipped ([`crate::skip!`]) and returns.
    pub available: fn() -> Result<(), String>,
}

impl TransportMaker {
    /// A maker for a host-addressable transport, tested with [`HostTestMemory`].
    pub const fn host(make: fn() -> Arc<dyn Transport>) -> Self {
        Self {
            make,
            memory: HostTestMemory::alloc,
            available: always,
        }
    }
}

fn always() -> Result<(), String> {
    Ok(())
}

/// Bytes of the arena each case installs.
const ARENA_BYTES: usize = 48 << 20;

/// A fresh transport with a fresh arena installed, or `None` (after printing why) when the
/// maker cannot run here.
struct Rig {
    t: Arc<dyn Transport>,
    arena: Arc<Arena>,
    memory: fn(usize) -> Arc<dyn TestMemory>,
}

fn rig(m: &TransportMaker) -> Option<Rig> {
    if let Err(why) = (m.available)() {
        crate::skip!("{why}");
        return None;
    }
    let t = (m.make)();
    let arena = Arena::new(ARENA_BYTES);
    t.install_host_memory(&arena.regions())
        .expect("install_host_memory accepts the host memory");
    Some(Rig {
        t,
        arena,
        memory: m.memory,
    })
}

/// One copy between the memory and a buffer, in logical terms: `len` bytes at `mem_off` of
/// the memory and at `buf_off` of the buffer.
#[derive(Debug, Clone, Copy)]
struct Seg {
    mem_off: usize,
    buf_off: usize,
    len: usize,
}

/// The ops of `segs`: one per physical piece of each segment's buffer range (as the engine
/// builds them), zero-length segments kept as one zero-length op.
fn ops_of(mem: &dyn TestMemory, buf: &HostBuffer, segs: &[Seg]) -> Vec<CopyOp> {
    let mut ops = Vec::new();
    for s in segs {
        if s.len == 0 {
            // A real address inside the buffer, so a transport that touches it anyway
            // touches nothing it does not own.
            let host_addr = if s.buf_off < buf.len() {
                buf.pieces(s.buf_off, 1).next().map_or(0, |p| p.addr)
            } else {
                buf.extents()[0].addr
            };
            ops.push(CopyOp {
                device_addr: mem.addr() + s.mem_off as u64,
                host_addr,
                len: 0,
            });
            continue;
        }
        let mut done = 0;
        for p in buf.pieces(s.buf_off, s.len) {
            ops.push(CopyOp {
                device_addr: mem.addr() + (s.mem_off + done) as u64,
                host_addr: p.addr,
                len: p.len,
            });
            done += p.len;
        }
    }
    ops
}

fn batch(
    mem: &dyn TestMemory,
    direction: Direction,
    mode: TransferMode,
    ops: Vec<CopyOp>,
) -> CopyBatch {
    CopyBatch {
        location: mem.space(),
        direction,
        mode,
        ops,
    }
}

fn mem_bytes(mem: &dyn TestMemory) -> Vec<u8> {
    let mut v = vec![0u8; mem.len()];
    mem.read(0, &mut v);
    v
}

fn buf_bytes(buf: &HostBuffer) -> Vec<u8> {
    let mut v = vec![0u8; buf.len()];
    buf.read_at(0, &mut v);
    v
}

/// What the memory and the buffer must hold after `segs` moved in `direction`, starting from
/// `mem` and `buf`.
fn expect(direction: Direction, segs: &[Seg], mem: &[u8], buf: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let (mut m, mut b) = (mem.to_vec(), buf.to_vec());
    for s in segs {
        match direction {
            Direction::ToHost => {
                b[s.buf_off..s.buf_off + s.len].copy_from_slice(&mem[s.mem_off..s.mem_off + s.len])
            }
            Direction::ToDevice => {
                m[s.mem_off..s.mem_off + s.len].copy_from_slice(&buf[s.buf_off..s.buf_off + s.len])
            }
        }
    }
    (m, b)
}

/// Fills both sides with distinct patterns (`seed`), runs `segs` in `direction` and checks
/// that exactly those bytes moved.
async fn run_and_check(
    t: &dyn Transport,
    mem: &dyn TestMemory,
    buf: &HostBuffer,
    direction: Direction,
    mode: TransferMode,
    segs: &[Seg],
    seed: u64,
) {
    mem.write(0, &pattern(seed, mem.len()));
    buf.write_at(0, &pattern(seed ^ 0xFFFF, buf.len()));
    let (m0, b0) = (mem_bytes(mem), buf_bytes(buf));
    t.copy(batch(mem, direction, mode, ops_of(mem, buf, segs)))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{direction:?} {mode:?} copy of {} segments: {e}",
                segs.len()
            )
        });
    let (want_m, want_b) = expect(direction, segs, &m0, &b0);
    assert_bytes("registration", &mem_bytes(mem), &want_m, direction, mode);
    assert_bytes("host buffer", &buf_bytes(buf), &want_b, direction, mode);
}

fn assert_bytes(side: &str, got: &[u8], want: &[u8], direction: Direction, mode: TransferMode) {
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{direction:?} {mode:?}: {side} byte {i} is {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
    assert_eq!(got.len(), want.len());
}

const MODES: [TransferMode; 2] = [TransferMode::Direct, TransferMode::Kernel];
const DIRECTIONS: [Direction; 2] = [Direction::ToHost, Direction::ToDevice];

/// Bytes land exactly, in both directions and both transfer modes: segments of 1 byte to
/// 1 MiB at odd offsets, between the memory and a buffer of several extents; no byte outside
/// the segments changes on either side.
pub async fn bytes_exact_both_directions(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mem = (r.memory)(4 << 20);
    let buf = r.arena.scattered(3 << 20, 5);
    let segs = [
        Seg {
            mem_off: 0,
            buf_off: 0,
            len: 1,
        },
        Seg {
            mem_off: 4097,
            buf_off: 3,
            len: 4095,
        },
        Seg {
            mem_off: 1 << 20,
            buf_off: 70_001,
            len: (64 << 10) + 3,
        },
        Seg {
            mem_off: (2 << 20) + 5,
            buf_off: (1 << 20) + 9,
            len: 1 << 20,
        },
        Seg {
            mem_off: 300_000,
            buf_off: (3 << 20) - 100,
            len: 100,
        },
    ];
    let mut seed = 1;
    for mode in MODES {
        for direction in DIRECTIONS {
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &segs, seed).await;
            seed += 1;
        }
    }
}

/// Empty batches and zero-length ops succeed and move nothing; zero-length ops between real
/// ones do not disturb them.
pub async fn zero_length_ops_and_batches(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mem = (r.memory)(1 << 20);
    let buf = r.arena.scattered(256 << 10, 3);
    for mode in MODES {
        for direction in DIRECTIONS {
            mem.write(0, &pattern(7, mem.len()));
            buf.write_at(0, &pattern(8, buf.len()));
            let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
            r.t.copy(batch(&*mem, direction, mode, vec![]))
                .await
                .expect("an empty batch succeeds");
            let zeros = [
                Seg {
                    mem_off: 0,
                    buf_off: 0,
                    len: 0,
                },
                Seg {
                    mem_off: 1000,
                    buf_off: 5000,
                    len: 0,
                },
                Seg {
                    mem_off: mem.len() - 1,
                    buf_off: buf.len() - 1,
                    len: 0,
                },
            ];
            r.t.copy(batch(&*mem, direction, mode, ops_of(&*mem, &buf, &zeros)))
                .await
                .expect("a batch of zero-length ops succeeds");
            assert!(
                mem_bytes(&*mem) == m0,
                "{direction:?} {mode:?}: memory changed"
            );
            assert!(
                buf_bytes(&buf) == b0,
                "{direction:?} {mode:?}: buffer changed"
            );
            let mixed = [
                Seg {
                    mem_off: 10,
                    buf_off: 10,
                    len: 0,
                },
                Seg {
                    mem_off: 100,
                    buf_off: 200,
                    len: 5000,
                },
                Seg {
                    mem_off: 9000,
                    buf_off: 9000,
                    len: 0,
                },
                Seg {
                    mem_off: 20_000,
                    buf_off: 100_000,
                    len: 77,
                },
                Seg {
                    mem_off: 30_000,
                    buf_off: 150_000,
                    len: 0,
                },
            ];
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &mixed, 9).await;
        }
    }
}

/// Adjacent ops (contiguous on both sides, as the engine submits before merging) and the one
/// merged op covering them move the same bytes; an op may also cover two adjacent extents of
/// a buffer in one piece.
pub async fn adjacent_and_merged_ops(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mem = (r.memory)(2 << 20);
    // Four adjacent extents: one contiguous run of host memory.
    let lens = [4096, 8192 + 7, 1000, 50_000];
    let total: usize = lens.iter().sum();
    let buf = r.arena.buffer(&lens, true);
    let base = buf.extents()[0].addr;
    assert!(
        buf.extents()
            .windows(2)
            .all(|w| w[0].addr + w[0].len == w[1].addr),
        "the arena made adjacent extents"
    );
    for mode in MODES {
        for direction in DIRECTIONS {
            // 1) One op per extent, all adjacent on both sides.
            let per_extent: Vec<CopyOp> = buf
                .extents()
                .iter()
                .map(|e| CopyOp {
                    device_addr: mem.addr() + 4096 + (e.addr - base) as u64,
                    host_addr: e.addr,
                    len: e.len,
                })
                .collect();
            // 2) One merged op over the whole run (spanning the four extents).
            let merged = vec![CopyOp {
                device_addr: mem.addr() + 4096,
                host_addr: base,
                len: total,
            }];
            // 3) Many adjacent 512-byte slices of the same run.
            let slices: Vec<CopyOp> = (0..total.div_ceil(512))
                .map(|i| CopyOp {
                    device_addr: mem.addr() + 4096 + (i * 512) as u64,
                    host_addr: base + i * 512,
                    len: 512.min(total - i * 512),
                })
                .collect();
            let seg = [Seg {
                mem_off: 4096,
                buf_off: 0,
                len: total,
            }];
            for (k, ops) in [per_extent, merged, slices].into_iter().enumerate() {
                let seed = 100 + k as u64;
                mem.write(0, &pattern(seed, mem.len()));
                buf.write_at(0, &pattern(seed ^ 0xFFFF, buf.len()));
                let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
                r.t.copy(batch(&*mem, direction, mode, ops))
                    .await
                    .unwrap_or_else(|e| panic!("variant {k} {direction:?} {mode:?}: {e}"));
                let (want_m, want_b) = expect(direction, &seg, &m0, &b0);
                assert_bytes("registration", &mem_bytes(&*mem), &want_m, direction, mode);
                assert_bytes("host buffer", &buf_bytes(&buf), &want_b, direction, mode);
            }
        }
    }
}

/// Thousands of small ops (1 to 100 bytes) scattered over the memory in a shuffled order
/// land exactly, in both directions.
pub async fn many_small_ops(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    const SLOT: usize = 128;
    const N: usize = 3000;
    let mem = (r.memory)(N * SLOT);
    let buf = r.arena.scattered(N * SLOT, 9);
    let mut rng = Rng::new(42);
    let mut perm: Vec<usize> = (0..N).collect();
    for i in (1..N).rev() {
        perm.swap(i, rng.range(0, i));
    }
    let segs: Vec<Seg> = (0..N)
        .map(|k| Seg {
            mem_off: perm[k] * SLOT + rng.range(0, 20),
            buf_off: k * SLOT + rng.range(0, 20),
            len: rng.range(1, 100),
        })
        .collect();
    let mut seed = 200;
    for mode in MODES {
        for direction in DIRECTIONS {
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &segs, seed).await;
            seed += 1;
        }
    }
}

/// Ranges whose host side spans several extents (split at every extent boundary, starting
/// and ending mid-extent, one of them over all seven extents) land exactly.
pub async fn host_side_spans_several_extents(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mem = (r.memory)(1 << 20);
    let lens = [3, 4093, 1, 65_536, 777, 12_345, 100_000];
    let total: usize = lens.iter().sum();
    let buf = r.arena.buffer(&lens, false);
    assert_eq!(buf.extents().len(), lens.len());
    let segs = [
        // Everything, every boundary.
        Seg {
            mem_off: 11,
            buf_off: 0,
            len: total,
        },
    ];
    let partial = [
        // From inside extent 1 to inside extent 3.
        Seg {
            mem_off: 500_000,
            buf_off: 100,
            len: 4096 + 10,
        },
        // From inside extent 4 to inside extent 6.
        Seg {
            mem_off: 300_001,
            buf_off: 3 + 4093 + 1 + 65_536 + 700,
            len: 77 + 12_345 + 50,
        },
    ];
    // Exactly the one-byte extent.
    let one = [Seg {
        mem_off: 999_000,
        buf_off: 4096,
        len: 1,
    }];
    let mut seed = 300;
    for mode in MODES {
        for direction in DIRECTIONS {
            let ops = ops_of(&*mem, &buf, &segs);
            assert_eq!(ops.len(), lens.len(), "one op per extent");
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &segs, seed).await;
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &partial, seed + 1).await;
            run_and_check(&*r.t, &*mem, &buf, direction, mode, &one, seed + 2).await;
            seed += 3;
        }
    }
}

/// Batches submitted from several tasks at once, each on its own memory and buffer, all
/// land exactly.
pub async fn concurrent_batches_from_several_tasks(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mut tasks = Vec::new();
    for w in 0..6u64 {
        let t = r.t.clone();
        let mem = (r.memory)(512 << 10);
        let buf = r.arena.scattered(384 << 10, 2 + w as usize);
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(w + 1);
            for round in 0..8u64 {
                // Up to 8 disjoint segments in 64 KiB slots of both sides.
                let n = rng.range(1, 6);
                let segs: Vec<Seg> = (0..n)
                    .map(|k| Seg {
                        mem_off: (k + 2) * (64 << 10) + rng.range(0, 100),
                        buf_off: k * (64 << 10) + rng.range(0, 100),
                        len: rng.range(1, 60 << 10),
                    })
                    .collect();
                let direction = DIRECTIONS[(round % 2) as usize];
                let mode = MODES[(rng.next_u64() % 2) as usize];
                run_and_check(&*t, &*mem, &buf, direction, mode, &segs, w * 100 + round).await;
            }
            8usize
        }));
    }
    let mut rounds = 0;
    for h in tasks {
        rounds += h.await.expect("a copying task panicked");
    }
    assert_eq!(rounds, 6 * 8, "every round of every task ran");
}

/// Under [`FaultyTransport`]: an injected failure is reported as a failure and (injected
/// before the copy) moves nothing; a late failure (the copy ran, then failed:
/// `set_fail_after_inner`) is still a failure; every k-th failure is counted; the transport
/// copies exactly once cleared.
pub async fn injected_failures_are_never_success(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let inner = r.t.clone();
    let t = FaultyTransport::new(inner.clone());
    let c = t.control();
    assert_eq!(t.kind(), inner.kind());
    let mem = (r.memory)(1 << 20);
    assert_eq!(t.can_address(mem.space()), inner.can_address(mem.space()));
    let buf = r.arena.scattered(256 << 10, 3);
    let segs = [
        Seg {
            mem_off: 100,
            buf_off: 0,
            len: 100_000,
        },
        Seg {
            mem_off: 500_000,
            buf_off: 150_000,
            len: 3,
        },
    ];
    for direction in DIRECTIONS {
        mem.write(0, &pattern(1, mem.len()));
        buf.write_at(0, &pattern(2, buf.len()));
        let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
        c.fail_next(1);
        let res = t
            .copy(batch(
                &*mem,
                direction,
                TransferMode::Kernel,
                ops_of(&*mem, &buf, &segs),
            ))
            .await;
        assert!(
            res.is_err(),
            "{direction:?}: an injected failure reported as success"
        );
        assert!(
            mem_bytes(&*mem) == m0 && buf_bytes(&buf) == b0,
            "{direction:?}: bytes moved"
        );

        // A late failure: the bytes may have moved, the batch still failed.
        c.set_fail_after_inner(true);
        c.fail_next(1);
        let res = t
            .copy(batch(
                &*mem,
                direction,
                TransferMode::Direct,
                ops_of(&*mem, &buf, &segs),
            ))
            .await;
        assert!(
            res.is_err(),
            "{direction:?}: a late failure reported as success"
        );
        c.clear();
        run_and_check(&t, &*mem, &buf, direction, TransferMode::Direct, &segs, 3).await;
    }
    c.fail_every(2);
    let mut failed = 0;
    for i in 0..6u64 {
        let direction = DIRECTIONS[(i % 2) as usize];
        mem.write(0, &pattern(10 + i, mem.len()));
        buf.write_at(0, &pattern(20 + i, buf.len()));
        let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
        match t
            .copy(batch(
                &*mem,
                direction,
                TransferMode::Direct,
                ops_of(&*mem, &buf, &segs),
            ))
            .await
        {
            Ok(()) => {
                let (want_m, want_b) = expect(direction, &segs, &m0, &b0);
                assert_bytes(
                    "registration",
                    &mem_bytes(&*mem),
                    &want_m,
                    direction,
                    TransferMode::Direct,
                );
                assert_bytes(
                    "host buffer",
                    &buf_bytes(&buf),
                    &want_b,
                    direction,
                    TransferMode::Direct,
                );
            }
            Err(_) => failed += 1,
        }
    }
    // Calls 7 to 12 of the control's life: 8, 10 and 12 fail.
    assert_eq!(failed, 3, "every second call failed");
    assert_eq!(c.injected_failures(), 4 + 3);
}

/// A copy future dropped before it completes leaves memory safe: dropped mid-delay (under
/// [`FaultyTransport::control`]'s `set_delay`) no byte has moved and the memory stays
/// usable; dropped after its first poll on the bare transport (the copy may still be
/// running: its memory is leaked on purpose, never freed under it), the transport keeps
/// copying exactly.
pub async fn dropped_copy_future_leaves_memory_safe(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let t = FaultyTransport::new(r.t.clone());
    let c = t.control();
    let mem = (r.memory)(1 << 20);
    let buf = r.arena.scattered(512 << 10, 4);
    let segs = [Seg {
        mem_off: 1000,
        buf_off: 10,
        len: 400_000,
    }];
    for direction in DIRECTIONS {
        mem.write(0, &pattern(31, mem.len()));
        buf.write_at(0, &pattern(32, buf.len()));
        let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
        c.set_delay(Duration::from_secs(3600));
        let fut = t.copy(batch(
            &*mem,
            direction,
            TransferMode::Kernel,
            ops_of(&*mem, &buf, &segs),
        ));
        let r1 = tokio::time::timeout(Duration::from_millis(20), fut).await;
        assert!(r1.is_err(), "{direction:?}: the copy is still in its delay");
        assert!(
            mem_bytes(&*mem) == m0,
            "{direction:?}: memory touched by a dropped copy"
        );
        assert!(
            buf_bytes(&buf) == b0,
            "{direction:?}: buffer touched by a dropped copy"
        );
        c.clear();
        run_and_check(&t, &*mem, &buf, direction, TransferMode::Kernel, &segs, 33).await;
    }
    assert_eq!(c.calls(), 4);

    // The bare transport: poll once, drop, keep the memory alive for good.
    for direction in DIRECTIONS {
        let lost_mem = (r.memory)(1 << 20);
        let lost_buf = r.arena.scattered(512 << 10, 4);
        lost_mem.write(0, &pattern(41, lost_mem.len()));
        lost_buf.write_at(0, &pattern(42, lost_buf.len()));
        let ops = ops_of(&*lost_mem, &lost_buf, &segs);
        let first_poll =
            r.t.copy(batch(&*lost_mem, direction, TransferMode::Kernel, ops))
                .now_or_never();
        if let Some(res) = first_poll {
            res.expect("a copy that completed at its first poll succeeded");
        }
        std::mem::forget(lost_buf);
        std::mem::forget(lost_mem);
        run_and_check(
            &*r.t,
            &*mem,
            &buf,
            direction,
            TransferMode::Kernel,
            &segs,
            43,
        )
        .await;
    }
}

/// `can_address` holds for the test memory's space and not for a space no backend declares;
/// the host memory installs; a batch for a space the transport cannot address fails and moves
/// nothing.
pub async fn can_address_and_install_host_memory(m: &TransportMaker) {
    let Some(r) = rig(m) else { return };
    let mem = (r.memory)(64 << 10);
    assert!(
        r.t.can_address(mem.space()),
        "{} cannot address its own test memory ({})",
        r.t.kind(),
        mem.space()
    );
    let nowhere = MemorySpace::new("pegaflow-suite-nowhere", 3);
    assert!(!r.t.can_address(nowhere), "{} claims {nowhere}", r.t.kind());
    // A second arena, installed into a second transport: accepted too.
    let t2 = (m.make)();
    let arena2 = Arena::new(1 << 20);
    t2.install_host_memory(&arena2.regions())
        .expect("install_host_memory accepts the host memory");
    assert!(t2.can_address(mem.space()));

    let buf = r.arena.scattered(32 << 10, 2);
    let segs = [Seg {
        mem_off: 0,
        buf_off: 0,
        len: 20_000,
    }];
    for direction in DIRECTIONS {
        mem.write(0, &pattern(51, mem.len()));
        buf.write_at(0, &pattern(52, buf.len()));
        let (m0, b0) = (mem_bytes(&*mem), buf_bytes(&buf));
        let mut b = batch(
            &*mem,
            direction,
            TransferMode::Direct,
            ops_of(&*mem, &buf, &segs),
        );
        b.location = nowhere;
        assert!(
            r.t.copy(b).await.is_err(),
            "{direction:?}: a batch for {nowhere} reported as success"
        );
        assert!(
            mem_bytes(&*mem) == m0 && buf_bytes(&buf) == b0,
            "{direction:?}: bytes moved"
        );
    }
}

/// One `#[tokio::test]` per case of this suite, each with a fresh transport from `$maker` (a
/// [`TransportMaker`] expression). Invoke it inside a module per transport.
#[macro_export]
macro_rules! transport_conformance_tests {
    ($maker:expr) => {
        $crate::transport_conformance_tests!(@list [] $maker);
    };
    // Every case `#[ignore]`d with `why` (hardware the cases need, e.g. a GPU): shown as
    // ignored rather than passed where it is absent; `-- --include-ignored` runs them.
    (ignore = $why:literal, $maker:expr) => {
        $crate::transport_conformance_tests!(@list [ignore = $why] $maker);
    };
    (@list $attrs:tt $maker:expr) => {
        $crate::transport_conformance_tests!(@cases $attrs $maker;
            bytes_exact_both_directions,
            zero_length_ops_and_batches,
            adjacent_and_merged_ops,
            many_small_ops,
            host_side_spans_several_extents,
            concurrent_batches_from_several_tasks,
            injected_failures_are_never_success,
            dropped_copy_future_leaves_memory_safe,
            can_address_and_install_host_memory,
        );
    };
    (@cases $attrs:tt $maker:expr; $($case:ident),* $(,)?) => {
        $(
            $crate::transport_conformance_tests!(@one $attrs $maker, $case);
        )*
    };
    (@one [$($attr:meta)?] $maker:expr, $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])?
        async fn $case() {
            $crate::transport_suite::$case(&$maker).await;
        }
    };
}
