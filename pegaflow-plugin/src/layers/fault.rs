//! Fault-injecting wrappers around a [`Tier`] or a [`Transport`], for tests of failure paths.
//!
//! Cross-cutting concerns wrap a backend rather than live in every backend (docs/ARCHITECTURE.md §2):
//! [`FaultyTier`] and [`FaultyTransport`] forward every call to the backend they wrap, except
//! that a shared [`FaultControl`] can make chosen calls fail — the next N, or every k-th — and
//! can delay copies (to model a slow or wedged GPU for cancellation and teardown tests). The
//! control counts calls and injected failures so a test can assert what the engine did.
//!
//! Owns: the injection decisions and the counters. Must never: alter bytes, report an injected
//! failure as success, or change the wrapped backend's accounting (an injected allocation
//! failure allocates nothing; an injected copy failure copies nothing unless
//! [`FaultControl::set_fail_after_inner`] asks for a late failure). Not for production
//! pipelines: nothing registers these as plugin kinds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::block::{BlockKey, BlockShape};
use crate::buffer::HostBuffer;
use crate::{
    CopyBatch, HostPool, HostRegion, MemorySpace, OpParts, Recovered, Tier, TierCapabilities,
    TierError, TierGet, TierPut, Transport, TransportError,
};

/// A shared switchboard of faults; clone the `Arc` into the test and into one or more wrappers.
///
/// Every gated operation (one [`Tier::allocate`] or [`Tier::allocate_batch`] call, one
/// [`Transport::copy`] call) counts as one call. A call fails when either rule fires:
/// - *fail next*: a budget of N failures, consumed one per call until 0;
/// - *fail every k-th*: the call whose 1-based number (see [`FaultControl::calls`]) is a
///   multiple of k fails (k = 0 disables the rule).
///
/// All settings are atomics: they can be changed while operations run on other threads.
#[derive(Debug, Default)]
pub struct FaultControl {
    fail_next: AtomicU64,
    fail_every: AtomicU64,
    delay_nanos: AtomicU64,
    fail_after_inner: AtomicBool,
    calls: AtomicU64,
    injected: AtomicU64,
}

impl FaultControl {
    /// A control with no faults armed.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Makes the next `n` gated calls fail (replacing any remaining budget; 0 disarms).
    pub fn fail_next(&self, n: u64) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Makes every `k`-th gated call fail, counted over the control's whole life (see
    /// [`FaultControl::calls`]); `k = 0` disables the rule.
    pub fn fail_every(&self, k: u64) {
        self.fail_every.store(k, Ordering::SeqCst);
    }

    /// Delays every [`FaultyTransport::copy`] by `delay` before it runs or fails (an async
    /// `tokio::time::sleep`, so dropping the future during the delay cancels it before any
    /// byte moves). `Duration::ZERO` removes the delay. Saturates at about 584 years.
    pub fn set_delay(&self, delay: Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.delay_nanos.store(nanos, Ordering::SeqCst);
    }

    /// When `true`, an injected copy failure first runs the wrapped copy and then reports
    /// failure: models a transfer that moved (some) bytes before the error surfaced, so tests
    /// can check that such bytes are never served. Allocations are unaffected.
    pub fn set_fail_after_inner(&self, on: bool) {
        self.fail_after_inner.store(on, Ordering::SeqCst);
    }

    /// Disarms every fault and removes the delay; the counters are kept.
    pub fn clear(&self) {
        self.fail_next.store(0, Ordering::SeqCst);
        self.fail_every.store(0, Ordering::SeqCst);
        self.delay_nanos.store(0, Ordering::SeqCst);
        self.fail_after_inner.store(false, Ordering::SeqCst);
    }

    /// The copy delay currently set.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::SeqCst))
    }

    /// Gated calls seen so far (failed or not).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Calls failed by injection so far.
    pub fn injected_failures(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// Failures still budgeted by [`FaultControl::fail_next`].
    pub fn pending_failures(&self) -> u64 {
        self.fail_next.load(Ordering::SeqCst)
    }

    /// Counts one call and decides whether it fails.
    fn on_call(&self) -> bool {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let budget = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
            .is_ok();
        let k = self.fail_every.load(Ordering::SeqCst);
        let fail = budget || (k > 0 && n.is_multiple_of(k));
        if fail {
            self.injected.fetch_add(1, Ordering::SeqCst);
        }
        fail
    }
}

/// A [`HostPool`] that forwards to `inner` but fails allocations as its [`FaultControl`] says.
///
/// An injected failure returns `None` from [`HostPool::allocate_batch`] without touching the
/// inner pool (so its used bytes do not change), exactly as a full pool would. Everything
/// else is the inner pool's.
pub struct FaultyPool {
    inner: Arc<dyn HostPool>,
    control: Arc<FaultControl>,
}

impl std::fmt::Debug for FaultyPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyPool")
            .field("inner", &self.inner.kind())
            .field("control", &self.control)
            .finish()
    }
}

impl FaultyPool {
    /// Wraps `inner` with a fresh control.
    pub fn new(inner: Arc<dyn HostPool>) -> Self {
        Self::with_control(inner, FaultControl::new())
    }

    /// Wraps `inner`, driven by `control` (which may be shared with other wrappers).
    pub fn with_control(inner: Arc<dyn HostPool>, control: Arc<FaultControl>) -> Self {
        Self { inner, control }
    }

    /// The control driving this wrapper.
    pub fn control(&self) -> Arc<FaultControl> {
        self.control.clone()
    }

    /// The wrapped pool.
    pub fn inner(&self) -> &Arc<dyn HostPool> {
        &self.inner
    }
}

impl HostPool for FaultyPool {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn metric_label(&self) -> &'static str {
        self.inner.metric_label()
    }

    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }

    fn free_bytes(&self) -> u64 {
        self.inner.free_bytes()
    }

    fn footprint_bytes(&self, len: usize) -> u64 {
        self.inner.footprint_bytes(len)
    }

    fn allocate_batch(&self, lens: &[usize], align: usize) -> Option<Vec<HostBuffer>> {
        if self.control.on_call() {
            return None;
        }
        self.inner.allocate_batch(lens, align)
    }

    fn regions(&self) -> Vec<HostRegion> {
        self.inner.regions()
    }

    fn trim(&self) {
        self.inner.trim();
    }
}

/// A key-addressed [`Tier`] that forwards to `inner` but fails operations as its
/// [`FaultControl`] says: each lookup, put, get, remove and flush call is one gated call; an
/// injected failure returns [`TierError::Unavailable`] (for every block of a batch) without
/// calling the inner tier, so nothing is written and no byte lands in a destination.
pub struct FaultyTier {
    inner: Arc<dyn Tier>,
    control: Arc<FaultControl>,
}

impl std::fmt::Debug for FaultyTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyTier")
            .field("inner", &self.inner.kind())
            .field("control", &self.control)
            .finish()
    }
}

impl FaultyTier {
    /// Wraps `inner` with a fresh control.
    pub fn new(inner: Arc<dyn Tier>) -> Self {
        Self::with_control(inner, FaultControl::new())
    }

    /// Wraps `inner`, driven by `control`.
    pub fn with_control(inner: Arc<dyn Tier>, control: Arc<FaultControl>) -> Self {
        Self { inner, control }
    }

    /// The control driving this wrapper.
    pub fn control(&self) -> Arc<FaultControl> {
        self.control.clone()
    }

    /// The wrapped tier.
    pub fn inner(&self) -> &Arc<dyn Tier> {
        &self.inner
    }

    async fn gate(&self, op: &str) -> Result<(), TierError> {
        let fail = self.control.on_call();
        let delay = self.control.delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if fail {
            Err(TierError::Unavailable(format!(
                "injected fault: {op} failed"
            )))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl Tier for FaultyTier {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn capabilities(&self) -> TierCapabilities {
        self.inner.capabilities()
    }

    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError> {
        self.gate("lookup").await?;
        self.inner.lookup(keys).await
    }

    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>> {
        match self.gate("put").await {
            Ok(()) => self.inner.put(blocks).await,
            Err(e) => vec![Err(e); blocks.len()],
        }
    }

    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>> {
        match self.gate("get").await {
            Ok(()) => self.inner.get(reads).await,
            Err(e) => vec![Err(e); reads.len()],
        }
    }

    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError> {
        self.gate("remove").await?;
        self.inner.remove(keys).await
    }

    async fn flush(&self) -> Result<(), TierError> {
        self.gate("flush").await?;
        self.inner.flush().await
    }

    async fn recover(&self) -> Result<Recovered, TierError> {
        self.inner.recover().await
    }
}

/// A [`Transport`] that forwards to `inner` but delays and fails copies as its
/// [`FaultControl`] says.
///
/// Each [`Transport::copy`] first sleeps for [`FaultControl::delay`] (if set), then either
/// runs the inner copy or returns a [`TransportError`] naming the injection (after running
/// the inner copy when [`FaultControl::set_fail_after_inner`] is on).
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    control: Arc<FaultControl>,
}

impl std::fmt::Debug for FaultyTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyTransport")
            .field("inner", &self.inner.kind())
            .field("control", &self.control)
            .finish()
    }
}

impl FaultyTransport {
    /// Wraps `inner` with a fresh control (get it with [`FaultyTransport::control`]).
    pub fn new(inner: Arc<dyn Transport>) -> Self {
        Self::with_control(inner, FaultControl::new())
    }

    /// Wraps `inner`, driven by `control` (which may be shared with other wrappers).
    pub fn with_control(inner: Arc<dyn Transport>, control: Arc<FaultControl>) -> Self {
        Self { inner, control }
    }

    /// The control driving this wrapper.
    pub fn control(&self) -> Arc<FaultControl> {
        self.control.clone()
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &Arc<dyn Transport> {
        &self.inner
    }
}

#[async_trait]
impl Transport for FaultyTransport {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn can_address(&self, space: MemorySpace) -> bool {
        self.inner.can_address(space)
    }

    fn install_host_memory(&self, regions: &[HostRegion]) -> Result<(), TransportError> {
        self.inner.install_host_memory(regions)
    }

    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        let fail = self.control.on_call();
        let delay = self.control.delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if !fail {
            return self.inner.copy(batch).await;
        }
        let ops = batch.ops.len();
        if self.control.fail_after_inner.load(Ordering::SeqCst) {
            // The inner result is discarded: the failure is what this call reports.
            let _ = self.inner.copy(batch).await;
            return Err(TransportError(format!(
                "injected fault: copy of {ops} ops failed after the transfer ran"
            )));
        }
        Err(TransportError(format!(
            "injected fault: copy of {ops} ops failed"
        )))
    }

    /// Gathers the parts and runs them as one [`Transport::copy`] (faults count calls, not
    /// parts).
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    use parking_lot::Mutex;
    use pegaflow_api::TransferMode;

    use crate::buffer::{Extent, HostMemory};
    use crate::{CopyOp, Direction};

    /// A heap-backed pool: each allocation is its own boxed slice.
    #[derive(Default)]
    struct HeapTier {
        mem: Arc<HeapMemory>,
    }

    #[derive(Default)]
    struct HeapMemory {
        used: AtomicUsize,
        live: Mutex<Vec<(usize, Box<[u8]>)>>,
    }

    impl HostMemory for HeapMemory {
        fn release(&self, extents: &[Extent]) {
            let mut live = self.live.lock();
            for e in extents {
                live.retain(|(a, _)| *a != e.addr);
                self.used.fetch_sub(e.len, Ordering::SeqCst);
            }
        }
    }

    impl HeapTier {
        fn allocate(&self, len: usize) -> Option<HostBuffer> {
            self.allocate_batch(&[len], 1)?.pop()
        }
    }

    impl HostPool for HeapTier {
        fn kind(&self) -> &'static str {
            "heap"
        }
        fn metric_label(&self) -> &'static str {
            "heap"
        }
        fn capacity_bytes(&self) -> u64 {
            1 << 20
        }
        fn used_bytes(&self) -> u64 {
            self.mem.used.load(Ordering::SeqCst) as u64
        }
        fn free_bytes(&self) -> u64 {
            self.capacity_bytes() - self.used_bytes()
        }
        fn footprint_bytes(&self, len: usize) -> u64 {
            len as u64
        }
        fn regions(&self) -> Vec<HostRegion> {
            vec![HostRegion {
                addr: 4096,
                len: 8192,
                owner: self.mem.clone(),
            }]
        }
        fn trim(&self) {}
        fn allocate_batch(&self, lens: &[usize], _align: usize) -> Option<Vec<HostBuffer>> {
            Some(lens.iter().map(|&l| self.one(l)).collect())
        }
    }

    impl HeapTier {
        fn one(&self, len: usize) -> HostBuffer {
            let mut b = vec![0u8; len].into_boxed_slice();
            let addr = b.as_mut_ptr() as usize;
            self.mem.live.lock().push((addr, b));
            self.mem.used.fetch_add(len, Ordering::SeqCst);
            HostBuffer::new(vec![Extent { addr, len }], self.mem.clone())
        }
    }

    /// A host-memory transport: copies with `ptr::copy`, counts batches.
    #[derive(Default)]
    struct MemcpyTransport {
        batches: AtomicUsize,
    }

    #[async_trait]
    impl Transport for MemcpyTransport {
        fn kind(&self) -> &'static str {
            "test-memcpy"
        }
        fn can_address(&self, space: MemorySpace) -> bool {
            space.is_host()
        }
        fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
            Ok(())
        }
        async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
            for op in &batch.ops {
                let (src, dst) = match batch.direction {
                    Direction::ToHost => (op.device_addr as usize, op.host_addr),
                    Direction::ToDevice => (op.host_addr, op.device_addr as usize),
                };
                // SAFETY: the tests build ops over live, disjoint buffers of `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, op.len) };
            }
            self.batches.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
            let batch = parts.gather(batch).await?;
            self.copy(batch).await
        }
    }

    fn one(p: &dyn HostPool, len: usize) -> Option<HostBuffer> {
        p.allocate_batch(&[len], 1)?.pop()
    }

    fn batch(src: &[u8], dst: &HostBuffer) -> CopyBatch {
        CopyBatch {
            location: MemorySpace::HOST,
            direction: Direction::ToHost,
            mode: TransferMode::default(),
            ops: vec![CopyOp {
                device_addr: src.as_ptr() as u64,
                host_addr: dst.extents()[0].addr,
                len: src.len(),
            }],
        }
    }

    #[test]
    fn tier_fail_next_then_recovers() {
        let tier = FaultyPool::new(Arc::new(HeapTier::default()));
        let c = tier.control();
        c.fail_next(2);
        assert_eq!(c.pending_failures(), 2);
        assert!(one(&tier, 10).is_none());
        assert!(tier.allocate_batch(&[1, 2], 1).is_none());
        assert_eq!(
            tier.used_bytes(),
            0,
            "an injected failure allocates nothing"
        );
        let b = one(&tier, 10).expect("budget spent");
        assert_eq!(b.len(), 10);
        assert_eq!(tier.used_bytes(), 10);
        assert_eq!(c.calls(), 3);
        assert_eq!(c.injected_failures(), 2);
        assert_eq!(c.pending_failures(), 0);
        drop(b);
        assert_eq!(tier.used_bytes(), 0);
    }

    #[test]
    fn tier_fail_every_kth() {
        let tier = FaultyPool::new(Arc::new(HeapTier::default()));
        let c = tier.control();
        c.fail_every(3);
        let got: Vec<bool> = (0..9).map(|_| one(&tier, 4).is_some()).collect();
        assert_eq!(
            got,
            [true, true, false, true, true, false, true, true, false]
        );
        assert_eq!(c.injected_failures(), 3);
        c.clear();
        assert!((0..6).all(|_| one(&tier, 4).is_some()));
        assert_eq!(c.calls(), 15);
    }

    #[test]
    fn tier_forwards_everything_else() {
        let inner: Arc<dyn HostPool> = Arc::new(HeapTier::default());
        let tier = FaultyPool::new(inner.clone());
        assert_eq!(tier.kind(), "heap");
        assert_eq!(tier.metric_label(), inner.metric_label());
        assert_eq!(tier.capacity_bytes(), 1 << 20);
        assert_eq!(tier.free_bytes(), 1 << 20);
        assert_eq!(tier.footprint_bytes(7), 7);
        assert_eq!(tier.regions(), inner.regions());
        tier.trim();
        assert_eq!(tier.inner().kind(), "heap");
        assert!(format!("{tier:?}").contains("heap"));
    }

    #[test]
    fn shared_control_drives_several_wrappers() {
        let c = FaultControl::new();
        let a = FaultyPool::with_control(Arc::new(HeapTier::default()), c.clone());
        let b = FaultyPool::with_control(Arc::new(HeapTier::default()), c.clone());
        c.fail_next(1);
        assert!(one(&a, 1).is_none());
        assert!(one(&b, 1).is_some());
        assert_eq!(c.calls(), 2);
    }

    #[tokio::test]
    async fn transport_fails_then_copies() {
        let inner = Arc::new(MemcpyTransport::default());
        let t = FaultyTransport::new(inner.clone());
        let c = t.control();
        assert_eq!(t.kind(), "test-memcpy");
        assert!(t.can_address(MemorySpace::HOST));
        assert!(!t.can_address(MemorySpace::new("gpu", 0)));
        let tier = HeapTier::default();
        let dst = tier.allocate(64).unwrap();
        let src: Vec<u8> = (0..64).collect();

        c.fail_next(1);
        let err = t.copy(batch(&src, &dst)).await.unwrap_err();
        assert!(err.0.contains("injected"), "{err}");
        assert_eq!(inner.batches.load(Ordering::SeqCst), 0, "nothing copied");
        let mut out = vec![0xFFu8; 64];
        dst.read_at(0, &mut out);
        assert_eq!(out, vec![0u8; 64]);

        t.copy(batch(&src, &dst)).await.unwrap();
        dst.read_at(0, &mut out);
        assert_eq!(out, src);
        assert_eq!(c.calls(), 2);
        assert_eq!(c.injected_failures(), 1);
    }

    #[tokio::test]
    async fn transport_late_failure_runs_the_copy_but_reports_failure() {
        let inner = Arc::new(MemcpyTransport::default());
        let t = FaultyTransport::new(inner.clone());
        let c = t.control();
        c.set_fail_after_inner(true);
        c.fail_every(2);
        let tier = HeapTier::default();
        let dst = tier.allocate(16).unwrap();
        let src = [7u8; 16];
        assert!(t.copy(batch(&src, &dst)).await.is_ok());
        let err = t.copy(batch(&src, &dst)).await.unwrap_err();
        assert!(err.0.contains("after the transfer ran"), "{err}");
        assert_eq!(inner.batches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn transport_delay_is_applied() {
        let t = FaultyTransport::new(Arc::new(MemcpyTransport::default()));
        let c = t.control();
        c.set_delay(Duration::from_millis(30));
        assert_eq!(c.delay(), Duration::from_millis(30));
        let tier = HeapTier::default();
        let dst = tier.allocate(8).unwrap();
        let src = [1u8; 8];
        let start = Instant::now();
        t.copy(batch(&src, &dst)).await.unwrap();
        // A lower bound only: the sleep cannot end early.
        assert!(start.elapsed() >= Duration::from_millis(30));
        c.clear();
        assert_eq!(c.delay(), Duration::ZERO);
    }

    #[tokio::test]
    async fn delayed_copy_cancelled_before_any_byte_moves() {
        let inner = Arc::new(MemcpyTransport::default());
        let t = FaultyTransport::new(inner.clone());
        t.control().set_delay(Duration::from_secs(3600));
        let tier = HeapTier::default();
        let dst = tier.allocate(8).unwrap();
        let src = [9u8; 8];
        let r = tokio::time::timeout(Duration::from_millis(20), t.copy(batch(&src, &dst))).await;
        assert!(r.is_err(), "the copy is still sleeping");
        assert_eq!(inner.batches.load(Ordering::SeqCst), 0);
        let mut out = [0xFFu8; 8];
        dst.read_at(0, &mut out);
        assert_eq!(out, [0u8; 8]);
        assert_eq!(t.control().calls(), 1);
    }

    #[test]
    fn huge_delay_saturates() {
        let c = FaultControl::new();
        c.set_delay(Duration::MAX);
        assert_eq!(c.delay(), Duration::from_nanos(u64::MAX));
    }
}
