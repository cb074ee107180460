//! The registrar conformance suite: written once, instantiated for every registrar (the
//! `host-memfd` registrar, and the `cuda-vmm` and `cuda-ipc` registrars with their GPU cases
//! gated) (DESIGN.md §9).
//!
//! Owns: generic async checks of the [`Registrar`] contract over a real fd side channel
//! (a fresh [`FdChannel`] per case), each a `pub async fn(&RegistrarMaker)`, and the
//! [`registrar_conformance_tests!`](crate::registrar_conformance_tests) macro that turns them
//! into one `#[tokio::test]` per case for a maker.
//!
//! Must never: depend on a registrar's kind (only on what it declares: its payload carrier),
//! assert on elapsed time (deadlines only guard against hangs), or count a case that cannot run here as passed: cases that need a
//! real import report themselves skipped ([`crate::skip!`]) and return when the maker has no client memory here
//! (no GPU, say), and side-channel cases do the same for a per-layer-blob registrar.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use pegaflow_fd_channel::{FdChannel, FdChannelLimits};
use pegaflow_plugin::{
    ImportRequest, LayerRegion, NativeView, PayloadCarrier, Registrar, RegistrarError,
    RegistrationPayload,
};

use crate::pool_suite::pattern;

/// Memory a client hands over on the side channel: its descriptor and a way to set its
/// bytes from the client's side.
pub trait ClientMemory: Send + Sync {
    /// The allocation's size, as the client states it (`alloc_size`).
    fn len_bytes(&self) -> u64;
    /// The descriptor to send.
    fn fd(&self) -> BorrowedFd<'_>;
    /// Writes `src` at `offset`, from the client's side.
    fn write(&self, offset: u64, src: &[u8]);
}

/// Allocates client memory: `(name, device_id, len)` → at least `len` bytes named `name` on
/// device `device_id`, or `Err(why)` when imports cannot run here.
pub type ClientAlloc = fn(&str, i32, u64) -> Result<Box<dyn ClientMemory>, String>;

/// How a suite case gets its registrar and the client memory it imports.
pub struct RegistrarMaker {
    /// Builds the registrar taking descriptors from `channel` (`None`: no side channel is
    /// configured), waiting up to `fd_timeout` for each.
    pub make: fn(channel: Option<Arc<FdChannel>>, fd_timeout: Duration) -> Arc<dyn Registrar>,
    /// Allocates at least `len` bytes of client memory named `name` on device `device_id`;
    /// `Err(why)` when imports cannot run here (the cases needing one print why and skip).
    pub client: ClientAlloc,
    /// Reads `len` bytes at `offset` of a region, through the server's mapping.
    pub read: fn(region: LayerRegion, offset: u64, len: usize) -> BoxFuture<'static, Vec<u8>>,
    /// Mappings the registrar holds now for `instance_id` (released ones no longer count).
    pub live_mappings: fn(instance_id: &str) -> usize,
    /// Device ids imports may use (different keys of concurrent imports spread over them).
    pub device_ids: &'static [i32],
    /// Payloads of the registrar's own carrier that must be refused as Invalid, beyond the
    /// suite's generic ones (e.g. a pickle the registrar cannot import).
    pub malformed: fn() -> Vec<RegistrationPayload>,
}

/// Nothing beyond the suite's generic malformed payloads.
pub fn no_extra_malformed() -> Vec<RegistrationPayload> {
    Vec::new()
}

/// Mappings of memfds named `name` in this process (lines of `/proc/self/maps`): what a
/// host-memfd maker reports as live when its client memory is not mapped by the client.
pub fn memfd_mappings(name: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let needle = format!("/memfd:{name} ");
    maps.lines()
        .filter(|l| format!("{l} ").contains(&needle))
        .count()
}

/// A memfd of `len` bytes named `name` that nobody maps (written with `pwrite`).
pub fn unmapped_memfd(name: &str, len: u64) -> OwnedFd {
    let cname = std::ffi::CString::new(name).expect("no NUL in the name");
    let fd = nix::sys::memfd::memfd_create(
        cname.as_c_str(),
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )
    .expect("memfd_create");
    nix::unistd::ftruncate(&fd, len as libc::off_t).expect("ftruncate");
    fd
}

/// Host client memory: an [`unmapped_memfd`] (so every mapping of it is the server's).
#[derive(Debug)]
pub struct MemfdClient {
    fd: OwnedFd,
    len: u64,
}

impl MemfdClient {
    /// A memfd of `len` bytes named `name`.
    pub fn new(name: &str, len: u64) -> Self {
        Self {
            fd: unmapped_memfd(name, len),
            len,
        }
    }
}

impl ClientMemory for MemfdClient {
    fn len_bytes(&self) -> u64 {
        self.len
    }
    fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    fn write(&self, offset: u64, src: &[u8]) {
        let n = nix::sys::uio::pwrite(&self.fd, src, offset as libc::off_t).expect("pwrite");
        assert_eq!(n, src.len(), "short pwrite");
    }
}

/// Reads a host region through its mapping (for host registrars).
pub fn read_host(region: LayerRegion, offset: u64, len: usize) -> BoxFuture<'static, Vec<u8>> {
    Box::pin(async move {
        assert!(offset + len as u64 <= region.len, "read outside the region");
        let at = region.memory.base_addr() + region.offset + offset;
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside the region, which `region` keeps mapped.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), len) };
        out
    })
}

/// A fresh side channel in a temporary directory.
struct Channel {
    _dir: tempfile::TempDir,
    ch: Arc<FdChannel>,
}

async fn channel() -> Channel {
    let dir = tempfile::tempdir().expect("temp dir");
    let ch = FdChannel::bind(&dir.path().join("fd.sock"), FdChannelLimits::default())
        .await
        .expect("bind the side channel");
    Channel { _dir: dir, ch }
}

fn side_channel_kind(r: &dyn Registrar) -> Option<i32> {
    match r.scheme().carrier {
        PayloadCarrier::SideChannel { memory_kind } => Some(memory_kind),
        PayloadCarrier::LayerBlobs => None,
    }
}

/// The registrar's side-channel `memory_kind`, or `None` after printing why the case skips.
fn side_channel_only(r: &dyn Registrar) -> Option<i32> {
    let k = side_channel_kind(r);
    if k.is_none() {
        crate::skip!(
            "{} imports {}, not a descriptor on the side channel",
            r.kind(),
            r.scheme().carrier
        );
    }
    k
}

fn client_or_skip(
    m: &RegistrarMaker,
    name: &str,
    device_id: i32,
    len: u64,
) -> Option<Box<dyn ClientMemory>> {
    match (m.client)(name, device_id, len) {
        Ok(c) => Some(c),
        Err(why) => {
            crate::skip!("{why}");
            None
        }
    }
}

fn send(path: &Path, instance: &str, device_id: i32, fd: BorrowedFd<'_>) {
    pegaflow_api::fd::send_fd(path, instance, device_id, fd).expect("send on the side channel");
}

/// Waits until the channel holds `n` pending descriptors (a deadline guards a lost message).
async fn wait_pending(ch: &FdChannel, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ch.pending() != n {
        assert!(
            std::time::Instant::now() < deadline,
            "the channel never held {n} descriptors (holds {}; {:?})",
            ch.pending(),
            ch.stats()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until the registrar holds no mapping for `instance` (released, possibly on another
/// thread); a deadline guards a leak.
async fn wait_released(m: &RegistrarMaker, instance: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while (m.live_mappings)(instance) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} mapping(s) of {instance} never released",
            (m.live_mappings)(instance)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn request(
    instance: &str,
    device_id: i32,
    kind: i32,
    alloc: u64,
    views: Vec<NativeView>,
) -> ImportRequest {
    ImportRequest {
        instance_id: instance.into(),
        device_id,
        payload: RegistrationPayload::SideChannel {
            memory_kind: kind,
            alloc_size: alloc,
            views,
        },
    }
}

fn view(offset: u64, size: u64) -> NativeView {
    NativeView {
        offset_bytes: offset,
        size_bytes: size,
        block_stride_bytes: 4096,
    }
}

fn expect_invalid(what: &str, r: Result<Vec<LayerRegion>, RegistrarError>) {
    match r {
        Err(RegistrarError::Invalid(_)) => {}
        Err(e) => panic!("{what}: expected Invalid, got {e:?}"),
        Ok(regions) => panic!("{what}: expected Invalid, got {} regions", regions.len()),
    }
}

/// Out-of-bounds and degenerate descriptions are Invalid and map nothing. Side channel: views
/// past the allocation, offset + size overflowing, zero sizes and strides, no views and a zero
/// `alloc_size`, each with a descriptor pending that the refusal closes. Per-layer blobs: no
/// layers, empty and garbage blobs, and the maker's own malformed payloads.
pub async fn bounds_and_malformed_payloads_are_invalid(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_millis(500));
    let instance = "suite-bounds";
    let dev = m.device_ids[0];
    let mut cases: Vec<(&str, RegistrationPayload)> = Vec::new();
    let kind = side_channel_kind(&*r);
    if let Some(kind) = kind {
        let alloc = 1u64 << 20;
        let side = |a: u64, views: Vec<NativeView>| RegistrationPayload::SideChannel {
            memory_kind: kind,
            alloc_size: a,
            views,
        };
        let stride0 = NativeView {
            offset_bytes: 0,
            size_bytes: 64,
            block_stride_bytes: 0,
        };
        cases.push((
            "a view past the end",
            side(alloc, vec![view(0, 1024), view(alloc - 100, 200)]),
        ));
        cases.push((
            "a view starting at the end",
            side(alloc, vec![view(alloc, 1)]),
        ));
        cases.push((
            "offset + size overflowing",
            side(alloc, vec![view(u64::MAX, 2)]),
        ));
        cases.push((
            "offset + size overflowing by far",
            side(alloc, vec![view(u64::MAX - 10, u64::MAX - 10)]),
        ));
        cases.push(("a zero size", side(alloc, vec![view(0, 0)])));
        cases.push(("a zero stride", side(alloc, vec![stride0])));
        cases.push(("no views", side(alloc, vec![])));
        cases.push(("a zero alloc_size", side(0, vec![view(0, 1)])));
    } else {
        cases.push(("no layers", RegistrationPayload::LayerBlobs(vec![])));
        cases.push((
            "an empty blob",
            RegistrationPayload::LayerBlobs(vec![vec![]]),
        ));
        cases.push((
            "garbage blobs",
            RegistrationPayload::LayerBlobs(vec![b"not a pickle".to_vec(), vec![0x80, 0x05, 0xff]]),
        ));
    }
    let extra = (m.malformed)();
    let extra_cases: Vec<(String, RegistrationPayload)> = extra
        .into_iter()
        .enumerate()
        .map(|(i, p)| (format!("the maker's malformed payload {i}"), p))
        .collect();
    let mut discarded = c.ch.stats().discarded;
    let all = cases
        .into_iter()
        .map(|(w, p)| (w.to_string(), p))
        .chain(extra_cases);
    for (what, payload) in all {
        let side = matches!(payload, RegistrationPayload::SideChannel { .. });
        if side {
            let decoy = unmapped_memfd(instance, 1 << 20);
            send(c.ch.path(), instance, dev, decoy.as_fd());
            wait_pending(&c.ch, 1).await;
        }
        let req = ImportRequest {
            instance_id: instance.into(),
            device_id: dev,
            payload,
        };
        expect_invalid(&what, r.import(req).await);
        assert_eq!(
            (m.live_mappings)(instance),
            0,
            "{what}: something was mapped"
        );
        if side {
            assert_eq!(c.ch.pending(), 0, "{what}: the pending descriptor was kept");
            discarded += 1;
            assert_eq!(c.ch.stats().discarded, discarded, "{what}");
        }
    }
    assert_eq!(c.ch.stats().rejected_duplicate, 0);
}

/// A refused registration discards the descriptor pending for its key, so the client can
/// resend under the same key at once (not a duplicate) and import it.
pub async fn refusal_discards_the_pending_descriptor(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_secs(5));
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    let (instance, dev) = ("suite-resend", m.device_ids[0]);
    let first = unmapped_memfd(instance, 1 << 20);
    send(c.ch.path(), instance, dev, first.as_fd());
    wait_pending(&c.ch, 1).await;
    let bad = request(
        instance,
        dev,
        kind,
        1 << 20,
        vec![view(0, 4096), view(1 << 20, 1)],
    );
    expect_invalid("a view past the end", r.import(bad).await);
    assert_eq!(
        c.ch.pending(),
        0,
        "the refused registration's descriptor is closed"
    );
    assert_eq!(c.ch.stats().discarded, 1);
    // The resend is accepted at once, not rejected as a duplicate.
    // The refusal part ran; without client memory only the import after the resend is left
    // out (a part, not the whole test).
    let mem = match (m.client)(instance, dev, 1 << 20) {
        Ok(mem) => mem,
        Err(why) => {
            let again = unmapped_memfd(instance, 1 << 20);
            send(c.ch.path(), instance, dev, again.as_fd());
            wait_pending(&c.ch, 1).await;
            assert_eq!(c.ch.stats().rejected_duplicate, 0);
            crate::skip_part!("the import after the resend: {why}");
            return;
        }
    };
    let len = mem.len_bytes();
    mem.write(0, &pattern(5, len as usize));
    send(c.ch.path(), instance, dev, mem.fd());
    wait_pending(&c.ch, 1).await;
    assert_eq!(
        c.ch.stats().rejected_duplicate,
        0,
        "the resend is not a duplicate"
    );
    let regions = r
        .import(request(instance, dev, kind, len, vec![view(4096, 8192)]))
        .await
        .expect("the resent registration imports");
    assert_eq!(regions.len(), 1);
    let got = (m.read)(regions[0].clone(), 0, 8192).await;
    assert!(
        got == pattern(5, len as usize)[4096..4096 + 8192],
        "the resent memory's bytes"
    );
    assert_eq!(c.ch.pending(), 0);
    drop(regions);
    wait_released(m, instance).await;
}

/// Without a side channel, a side-channel registration is a Precondition failure.
pub async fn no_side_channel_is_a_precondition(m: &RegistrarMaker) {
    let r = (m.make)(None, Duration::from_millis(100));
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    match r
        .import(request(
            "suite-nochannel",
            m.device_ids[0],
            kind,
            1 << 20,
            vec![view(0, 4096)],
        ))
        .await
    {
        Err(RegistrarError::Precondition(_)) => {}
        other => panic!("expected Precondition, got {other:?}"),
    }
}

/// With no descriptor sent, the import gives up with a Precondition failure (a watchdog far
/// above the configured timeout turns a registrar that ignores it into a failure, not a
/// hang); a descriptor sent while the import waits is taken and imported.
pub async fn missing_descriptor_is_precondition_within_the_timeout(m: &RegistrarMaker) {
    let c = channel().await;
    let timeout = Duration::from_millis(200);
    let r = (m.make)(Some(c.ch.clone()), timeout);
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    let instance = "suite-nofd";
    let dev = m.device_ids[0];
    // A registrar that refuses before waiting (no driver, say) cannot show the wait.
    let Some(mem) = client_or_skip(m, instance, dev, 1 << 20) else {
        return;
    };
    let req = || request(instance, dev, kind, mem.len_bytes(), vec![view(0, 4096)]);
    let watchdog = timeout + Duration::from_secs(30);
    match tokio::time::timeout(watchdog, r.import(req())).await {
        Ok(Err(RegistrarError::Precondition(_))) => {}
        Ok(other) => panic!("expected Precondition, got {other:?}"),
        Err(_) => panic!("the import ignored its {timeout:?} descriptor timeout"),
    }
    assert_eq!((m.live_mappings)(instance), 0);

    // A late descriptor, sent while the import waits (its timeout is long), is taken.
    let r = (m.make)(Some(c.ch.clone()), Duration::from_secs(30));
    mem.write(0, &pattern(9, 4096));
    let import = tokio::spawn({
        let r = r.clone();
        let req = req();
        async move { r.import(req).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    send(c.ch.path(), instance, dev, mem.fd());
    let regions = import
        .await
        .expect("import task")
        .expect("a descriptor sent while the import waits is taken");
    assert!((m.read)(regions[0].clone(), 0, 4096).await == pattern(9, 4096));
    drop(regions);
    wait_released(m, instance).await;
}

/// Released regions unmap without the async executor: dropped on a plain thread outside any
/// runtime (as the engine's reaper thread drops them), and dropped inside a single-threaded
/// runtime whose timer must still fire afterwards, the mapping is released either way.
pub async fn release_does_not_need_the_executor(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_secs(5));
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    let instance = "suite-release";
    let dev = m.device_ids[0];
    for how in ["a plain thread", "a current-thread runtime"] {
        let Some(mem) = client_or_skip(m, instance, dev, 1 << 20) else {
            return;
        };
        send(c.ch.path(), instance, dev, mem.fd());
        wait_pending(&c.ch, 1).await;
        let regions = r
            .import(request(
                instance,
                dev,
                kind,
                mem.len_bytes(),
                vec![view(0, 4096), view(8192, 4096)],
            ))
            .await
            .expect("import");
        assert_eq!((m.live_mappings)(instance), 1, "one mapping for the import");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let dropper = if how == "a plain thread" {
            std::thread::spawn(move || {
                drop(regions);
                let _ = tx.send(());
            })
        } else {
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let tick = tokio::spawn(tokio::time::sleep(Duration::from_millis(5)));
                    drop(regions);
                    tick.await.expect("the timer task");
                });
                let _ = tx.send(());
            })
        };
        // A watchdog, not a measurement: a release that wedges fails here instead of hanging.
        let done = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(30)))
            .await
            .expect("the waiting thread");
        assert!(done.is_ok(), "dropping the regions on {how} never finished");
        dropper.join().expect("the dropping thread did not panic");
        wait_released(m, instance).await;
    }
}

/// Imports for different (instance, device) keys run concurrently; each maps its own client's
/// memory with the right bytes in every layer region, and releases it when dropped.
pub async fn concurrent_imports_map_the_right_bytes(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_secs(5));
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    // Six distinct keys: two devices per instance where the maker has several, else one
    // instance per key.
    let n = m.device_ids.len();
    let keys_unique: Vec<(String, i32)> = (0..6)
        .map(|k| {
            let inst = if n == 1 { k } else { k / 2 };
            (format!("suite-conc-{inst}"), m.device_ids[k % n])
        })
        .collect();
    for (i, a) in keys_unique.iter().enumerate() {
        assert!(!keys_unique[..i].contains(a), "keys are distinct");
    }
    let mut mems = Vec::new();
    for (i, (inst, dev)) in keys_unique.iter().enumerate() {
        let Some(mem) = client_or_skip(m, inst, *dev, 1 << 20) else {
            return;
        };
        mem.write(0, &pattern(100 + i as u64, mem.len_bytes() as usize));
        send(c.ch.path(), inst, *dev, mem.fd());
        mems.push(mem);
    }
    wait_pending(&c.ch, keys_unique.len()).await;
    let views = vec![
        view(0, 4096),
        view(65_536 + 3, 10_000),
        view(300_000, 200_000),
    ];
    let mut tasks = Vec::new();
    for ((inst, dev), mem) in keys_unique.iter().zip(&mems) {
        let (r, inst, dev, views) = (r.clone(), inst.clone(), *dev, views.clone());
        let alloc = mem.len_bytes();
        tasks.push(tokio::spawn(async move {
            r.import(request(&inst, dev, kind, alloc, views)).await
        }));
    }
    let mut all = Vec::new();
    for (i, h) in tasks.into_iter().enumerate() {
        let regions = h
            .await
            .expect("import task")
            .unwrap_or_else(|e| panic!("import {i} ({:?}): {e}", keys_unique[i]));
        assert_eq!(regions.len(), views.len(), "one region per view");
        let len = mems[i].len_bytes() as usize;
        let want = pattern(100 + i as u64, len);
        for (reg, v) in regions.iter().zip(&views) {
            assert!(
                Arc::ptr_eq(&reg.memory, &regions[0].memory),
                "one mapping per import"
            );
            assert_eq!((reg.offset, reg.len), (v.offset_bytes, v.size_bytes));
            assert!(reg.memory.len_bytes() >= mems[i].len_bytes());
            let got = (m.read)(reg.clone(), 0, v.size_bytes as usize).await;
            let at = v.offset_bytes as usize;
            assert!(
                got == want[at..at + v.size_bytes as usize],
                "import {i}: the region at {at} maps another memory's bytes"
            );
        }
        all.push(regions);
    }
    let mut bases: Vec<u64> = all.iter().map(|r| r[0].memory.base_addr()).collect();
    bases.sort_unstable();
    bases.dedup();
    assert_eq!(bases.len(), all.len(), "every import has its own mapping");
    assert_eq!(c.ch.pending(), 0, "every descriptor was taken");
    drop(all);
    for (inst, _) in &keys_unique {
        wait_released(m, inst).await;
    }
}

/// A payload of another carrier (or another side-channel `memory_kind`), or an instance id
/// the side channel cannot carry, is refused as Invalid.
pub async fn wrong_payload_carrier_is_invalid(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_millis(200));
    let dev = m.device_ids[0];
    match side_channel_kind(&*r) {
        Some(kind) => {
            let blobs = ImportRequest {
                instance_id: "suite-carrier".into(),
                device_id: dev,
                payload: RegistrationPayload::LayerBlobs(vec![vec![1, 2, 3]]),
            };
            expect_invalid("per-layer blobs", r.import(blobs).await);
            let other = request(
                "suite-carrier",
                dev,
                kind + 1000,
                1 << 20,
                vec![view(0, 4096)],
            );
            expect_invalid("another memory_kind", r.import(other).await);
            let unsafe_id = request("not safe/id", dev, kind, 1 << 20, vec![view(0, 4096)]);
            expect_invalid("an unsafe instance id", r.import(unsafe_id).await);
        }
        None => {
            for k in [1, 2, 1000] {
                let side = request("suite-carrier", dev, k, 1 << 20, vec![view(0, 4096)]);
                expect_invalid("a side-channel payload", r.import(side).await);
            }
        }
    }
    assert_eq!((m.live_mappings)("suite-carrier"), 0);
}

/// A side-channel payload of another `memory_kind` is refused and, like every refusal after
/// the channel check (`NativeImport::check`'s contract), closes the descriptor pending for
/// its key.
pub async fn wrong_memory_kind_discards_the_pending_descriptor(m: &RegistrarMaker) {
    let c = channel().await;
    let r = (m.make)(Some(c.ch.clone()), Duration::from_millis(200));
    let Some(kind) = side_channel_only(&*r) else {
        return;
    };
    let (instance, dev) = ("suite-kind", m.device_ids[0]);
    let decoy = unmapped_memfd(instance, 1 << 20);
    send(c.ch.path(), instance, dev, decoy.as_fd());
    wait_pending(&c.ch, 1).await;
    let other = request(instance, dev, kind + 1000, 1 << 20, vec![view(0, 4096)]);
    expect_invalid("another memory_kind", r.import(other).await);
    assert_eq!(
        c.ch.pending(),
        0,
        "the refused registration's descriptor is closed"
    );
}

/// One `#[tokio::test]` per case of this suite, each with a fresh registrar and side channel
/// from `$maker` (a [`RegistrarMaker`] expression). Invoke it inside a module per registrar.
#[macro_export]
macro_rules! registrar_conformance_tests {
    ($maker:expr) => {
        $crate::registrar_conformance_tests!(@cases $maker;
            bounds_and_malformed_payloads_are_invalid,
            refusal_discards_the_pending_descriptor,
            no_side_channel_is_a_precondition,
            missing_descriptor_is_precondition_within_the_timeout,
            release_does_not_need_the_executor,
            concurrent_imports_map_the_right_bytes,
            wrong_payload_carrier_is_invalid,
            wrong_memory_kind_discards_the_pending_descriptor,
        );
    };
    (@cases $maker:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::registrar_suite::$case(&$maker).await;
            }
        )*
    };
}
