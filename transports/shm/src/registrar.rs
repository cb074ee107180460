//! The `host-memfd` registrar: a client's host KV memory, shared as a memfd on the fd side
//! channel and described by per-layer views, mapped shared into the server.
//!
//! This mapping is the one place the server maps memory a client shares with it (CUDA IPC
//! and VMM registrations are device memory the driver maps; the load-state word is written
//! with `pwrite`, never mapped: `pegaflow_api::load_state::LoadStateWriter`). Every copy
//! into or out of a registration touches this mapping, and a shared mapping of a file that
//! shrinks faults (SIGBUS, which kills the server) on the lost pages. So the registrar must
//! never map a memfd that its client can still shrink: it adds `F_SEAL_SHRINK` before it
//! maps, and refuses a memfd on which that seal is not in effect afterwards (one created
//! without `MFD_ALLOW_SEALING`, or whose seals the client sealed first), unless the operator
//! turned `require_shrink_seal` off. The other ways a client can change the memory are
//! harmless: growing it (only the registered length is mapped), punching holes or
//! `MADV_REMOVE` (those pages read back as zeros), `F_SEAL_FUTURE_WRITE` (the mapping exists
//! already; `F_SEAL_WRITE` is refused while it does).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::stat::{fstat, SFlag};
use pegaflow_plugin::{
    parse_settings, ImportRequest, LayerRegion, MemorySpace, NativeImport, NativeImportV2,
    PayloadCarrier, PayloadScheme, Registrar, RegistrarError, RegistrarTraits, Registration,
    RegistrationPayload, RuntimeContext, SideChannel,
};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

/// How long an import waits for the memfd on the side channel unless `fd_timeout_secs` says
/// otherwise.
pub const DEFAULT_FD_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest accepted `fd_timeout_secs`, in seconds (one hour).
const MAX_FD_TIMEOUT_SECS: f64 = 3600.0;

/// The `memory_kind` wire value of host memfd registrations (`MEMORY_KIND_HOST_MEMFD`).
pub const MEMORY_KIND: i32 = pegaflow_proto::MemoryKind::HostMemfd as i32;

/// Imports host memory shared as a memfd (kind `host-memfd`, `memory_kind` [`MEMORY_KIND`]
/// on the side channel).
///
/// Import takes the descriptor sent for `(instance_id, device_id)` on the fd side channel,
/// checks it is a regular file (a memfd) of at least `alloc_size` bytes, seals it against
/// shrinking (refusing it when that seal cannot be in effect, unless `require_shrink_seal` is
/// off), maps `alloc_size` bytes shared read-write, closes the descriptor, and returns one
/// region per view. All the regions share one mapping, unmapped when the last region is
/// dropped.
///
/// Native registration v2 ([`RegistrationPayload::NativeV2`]): one memfd per allocation, sent
/// as allocation `i` of the registration's key; each is checked, sealed and mapped like the
/// v1 memfd (in allocation order, on one blocking thread). When any allocation fails (missing,
/// too small, unsealable), every mapping made so far is unmapped, every descriptor taken is
/// closed and every descriptor still pending for the registration is discarded.
#[derive(Debug)]
pub struct HostMemfdRegistrar {
    channel: Option<Arc<dyn SideChannel>>,
    fd_timeout: Duration,
    require_shrink_seal: bool,
}

impl HostMemfdRegistrar {
    /// A registrar taking descriptors from `channel` (none: every import fails with
    /// [`RegistrarError::Precondition`]), waiting up to `fd_timeout` for each. With
    /// `require_shrink_seal`, memfds that cannot be sealed against shrinking are refused.
    pub fn new(
        channel: Option<Arc<dyn SideChannel>>,
        fd_timeout: Duration,
        require_shrink_seal: bool,
    ) -> Self {
        Self {
            channel,
            fd_timeout,
            require_shrink_seal,
        }
    }
}

/// A `host-memfd` registrar's settings: what its `[[registrar]]` table deserialises into.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostMemfdConfig {
    /// Seconds an import waits for its memfd on the side channel, 0 to 3600 (fractions
    /// allowed).
    pub fd_timeout_secs: f64,
    /// Refuse memfds that cannot be sealed against shrinking (default true). Off, they are
    /// accepted with a warning, and a client that shrinks one while it is mapped crashes the
    /// server with SIGBUS.
    pub require_shrink_seal: bool,
}

impl Default for HostMemfdConfig {
    fn default() -> Self {
        Self {
            fd_timeout_secs: DEFAULT_FD_TIMEOUT.as_secs_f64(),
            require_shrink_seal: true,
        }
    }
}

/// Reads and range-checks the pipeline table (the factory's settings check and `build`).
///
/// # Errors
/// An unknown key, a wrong type, `fd_timeout_secs` not finite or outside
/// `0..=MAX_FD_TIMEOUT_SECS`.
pub(crate) fn checked_config(table: &toml::Table) -> anyhow::Result<HostMemfdConfig> {
    let c: HostMemfdConfig = parse_settings("host-memfd registrar", table)?;
    let secs = c.fd_timeout_secs;
    if !(secs.is_finite() && (0.0..=MAX_FD_TIMEOUT_SECS).contains(&secs)) {
        anyhow::bail!(
            "host-memfd registrar: fd_timeout_secs must be between 0 and {MAX_FD_TIMEOUT_SECS}, got {secs}"
        );
    }
    Ok(c)
}

/// Builds the registrar from its pipeline table ([`HostMemfdConfig`]).
pub(crate) fn build(
    table: &toml::Table,
    ctx: &RuntimeContext,
) -> anyhow::Result<Arc<dyn Registrar>> {
    let c = checked_config(table)?;
    let secs = c.fd_timeout_secs;
    if !c.require_shrink_seal {
        warn!(
            "host-memfd registrar: require_shrink_seal = false: memfds that cannot be sealed \
             against shrinking are accepted, and a client that shrinks one while it is \
             registered crashes the whole server with SIGBUS; turn it off only for trusted \
             clients that cannot create their memfds with MFD_ALLOW_SEALING"
        );
    }
    Ok(Arc::new(HostMemfdRegistrar::new(
        ctx.fd_channel.clone(),
        Duration::from_secs_f64(secs),
        c.require_shrink_seal,
    )))
}

/// A memfd mapped shared into the server; dropping it unmaps.
struct MemfdMapping {
    map: MmapRaw,
    instance_id: String,
    device_id: i32,
}

impl Registration for MemfdMapping {
    fn location(&self) -> MemorySpace {
        MemorySpace::HOST
    }

    fn base_addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }

    fn len_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    fn describe(&self) -> String {
        format!(
            "host memfd of {} bytes for instance {} device {}",
            self.map.len(),
            self.instance_id,
            self.device_id
        )
    }
}

impl Drop for MemfdMapping {
    fn drop(&mut self) {
        debug!(
            instance_id = %self.instance_id,
            device_id = self.device_id,
            len = self.map.len(),
            "host-memfd: unmapping"
        );
    }
}

/// Checks the memfd, seals it against shrinking (refused when the seal is not in effect
/// afterwards, unless `require_shrink_seal` is off), and maps `len` bytes of it.
fn map_memfd(
    fd: OwnedFd,
    len: usize,
    require_shrink_seal: bool,
    who: &str,
) -> Result<MmapRaw, RegistrarError> {
    let st = fstat(fd.as_fd())
        .map_err(|e| RegistrarError::Failed(format!("fstat of the memfd for {who}: {e}")))?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(RegistrarError::Invalid(format!(
            "the descriptor received for {who} is not a memfd (not a regular file)"
        )));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size < len as u64 {
        return Err(RegistrarError::Invalid(format!(
            "the memfd for {who} holds {size} bytes, less than the stated allocation of {len} bytes"
        )));
    }
    // A shared mapping of a file that later shrinks faults (SIGBUS) on access to the lost
    // pages; sealing makes shrinking impossible for everyone, us included. What counts is the
    // seal in effect afterwards: adding it fails (EPERM) on a memfd the client sealed already,
    // with or without F_SEAL_SHRINK, and (EINVAL) on files that take no seals at all.
    let added = fcntl(fd.as_fd(), FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK));
    let sealed = fcntl(fd.as_fd(), FcntlArg::F_GET_SEALS)
        .is_ok_and(|s| SealFlag::from_bits_truncate(s).contains(SealFlag::F_SEAL_SHRINK));
    if !sealed {
        let why = match added {
            Ok(_) => "the seal did not take".to_string(),
            Err(Errno::EPERM) => {
                "it was created without MFD_ALLOW_SEALING, or its seals are sealed".to_string()
            }
            Err(Errno::EINVAL) => "it takes no seals (not a memfd?)".to_string(),
            Err(e) => e.to_string(),
        };
        if require_shrink_seal {
            return Err(RegistrarError::Invalid(format!(
                "the memfd for {who} cannot be sealed against shrinking ({why}); create it \
                 with MFD_ALLOW_SEALING"
            )));
        }
        warn!(
            who,
            why,
            "host-memfd: accepting a memfd that cannot be sealed against shrinking \
             (require_shrink_seal = false); a client that shrinks it while mapped crashes the \
             server (create it with MFD_ALLOW_SEALING)"
        );
    }
    if sealed {
        // The size checked above may predate the seal: a client can shrink the memfd between
        // that fstat and the seal, and the seal then freezes the smaller size. Check again
        // now that it cannot change any more.
        let now = fstat(fd.as_fd())
            .map(|st| u64::try_from(st.st_size).unwrap_or(0))
            .map_err(|e| RegistrarError::Failed(format!("fstat of the memfd for {who}: {e}")))?;
        if now < len as u64 {
            return Err(RegistrarError::Invalid(format!(
                "the memfd for {who} shrank to {now} bytes while it was being sealed, less than the stated allocation of {len} bytes"
            )));
        }
    }
    let map = MmapOptions::new().len(len).map_raw(&fd).map_err(|e| {
        RegistrarError::Failed(format!("mmap of the memfd for {who} ({len} bytes): {e}"))
    })?;
    // The mapping keeps the memory; the descriptor is not needed any more.
    drop(fd);
    Ok(map)
}

#[async_trait]
impl Registrar for HostMemfdRegistrar {
    fn kind(&self) -> &'static str {
        "host-memfd"
    }

    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "host-memfd",
            carrier: PayloadCarrier::SideChannel {
                memory_kind: MEMORY_KIND,
            },
        }
    }

    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits::default()
    }

    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        if matches!(req.payload, RegistrationPayload::NativeV2 { .. }) {
            return self.import_v2(req).await;
        }
        let import = NativeImport::check("host-memfd", MEMORY_KIND, self.channel.as_ref(), req)?;
        let alloc_size = import.alloc_size;
        let len = usize::try_from(alloc_size).map_err(|_| {
            import.refuse(RegistrarError::Invalid(format!(
                "alloc_size {alloc_size} does not fit in memory"
            )))
        })?;
        let fd = import.take_fd("memfd", self.fd_timeout).await?;
        let who = format!(
            "instance {} device {}",
            import.instance_id, import.device_id
        );
        let require_seal = self.require_shrink_seal;
        let map = tokio::task::spawn_blocking(move || map_memfd(fd, len, require_seal, &who))
            .await
            .map_err(|e| RegistrarError::Failed(format!("mapping the memfd failed: {e}")))??;
        let memory: Arc<dyn Registration> = Arc::new(MemfdMapping {
            map,
            instance_id: import.instance_id.clone(),
            device_id: import.device_id,
        });
        debug!(memory = %memory.describe(), layers = import.views.len(), "host-memfd: imported");
        Ok(import.regions(memory))
    }
}

impl HostMemfdRegistrar {
    /// Imports a native registration v2: one memfd per allocation.
    async fn import_v2(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let import =
            NativeImportV2::check("host-memfd", MEMORY_KIND, true, self.channel.as_ref(), req)?;
        let lens = import
            .allocations
            .iter()
            .enumerate()
            .map(|(i, a)| {
                usize::try_from(a.size_bytes).map_err(|_| {
                    RegistrarError::Invalid(format!(
                        "allocation {i}: size_bytes {} does not fit in memory",
                        a.size_bytes
                    ))
                })
            })
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|e| import.refuse(e))?;
        let fds = import.take_fds("memfd", self.fd_timeout).await?;
        let who = format!(
            "instance {} device {}",
            import.instance_id, import.device_id
        );
        let require_seal = self.require_shrink_seal;
        // Map in allocation order; on the first failure the maps made so far are dropped
        // (unmapped) and the descriptors not reached yet close with the iterator.
        let maps = tokio::task::spawn_blocking(move || {
            let mut maps = Vec::with_capacity(lens.len());
            for (i, (fd, len)) in fds.into_iter().zip(lens).enumerate() {
                maps.push(map_memfd(
                    fd,
                    len,
                    require_seal,
                    &format!("{who} allocation {i}"),
                )?);
            }
            Ok::<_, RegistrarError>(maps)
        })
        .await
        .map_err(|e| RegistrarError::Failed(format!("mapping the memfds failed: {e}")))??;
        let memories: Vec<Arc<dyn Registration>> = maps
            .into_iter()
            .map(|map| {
                Arc::new(MemfdMapping {
                    map,
                    instance_id: import.instance_id.clone(),
                    device_id: import.device_id,
                }) as Arc<dyn Registration>
            })
            .collect();
        debug!(
            instance = %import.instance_id,
            allocations = memories.len(),
            layers = import.views.len(),
            "host-memfd: native v2 registration imported"
        );
        import.regions(&memories)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pegaflow_api::memfd::HostMemfd;
    use pegaflow_fd_channel::{FdChannel, FdChannelLimits};
    use pegaflow_plugin::{NativeView, RegistrationPayload};

    struct Fixture {
        _dir: tempfile::TempDir,
        channel: Arc<FdChannel>,
    }

    async fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let channel = FdChannel::bind(&dir.path().join("fd.sock"), FdChannelLimits::default())
            .await
            .unwrap();
        Fixture { _dir: dir, channel }
    }

    fn registrar(f: &Fixture, timeout_secs: f64) -> Arc<dyn Registrar> {
        let mut t = toml::Table::new();
        t.insert("fd_timeout_secs".into(), toml::Value::Float(timeout_secs));
        let ctx = RuntimeContext {
            fd_channel: Some(Arc::clone(&f.channel) as Arc<dyn SideChannel>),
            ..RuntimeContext::default()
        };
        build(&t, &ctx).unwrap()
    }

    fn view(offset: u64, size: u64) -> NativeView {
        NativeView {
            offset_bytes: offset,
            size_bytes: size,
            block_stride_bytes: 64,
        }
    }

    fn request(id: &str, alloc_size: u64, views: Vec<NativeView>) -> ImportRequest {
        ImportRequest {
            instance_id: id.into(),
            device_id: 0,
            payload: RegistrationPayload::SideChannel {
                memory_kind: MEMORY_KIND,
                alloc_size,
                views,
            },
        }
    }

    fn send(f: &Fixture, id: &str, mem: &HostMemfd) {
        pegaflow_api::fd::send_fd(f.channel.path(), id, 0, mem.fd()).unwrap();
    }

    async fn wait_pending(f: &Fixture, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while f.channel.pending() != n {
            assert!(std::time::Instant::now() < deadline, "fd never arrived");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn invalid(r: Result<Vec<LayerRegion>, RegistrarError>) -> String {
        match r {
            Err(RegistrarError::Invalid(m)) => m,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    fn precondition(r: Result<Vec<LayerRegion>, RegistrarError>) -> String {
        match r {
            Err(RegistrarError::Precondition(m)) => m,
            other => panic!("expected Precondition, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn imports_a_memfd_sent_on_the_channel() {
        let f = fixture().await;
        let reg = registrar(&f, 5.0);
        let mut mem = HostMemfd::new("kv", 1 << 20).unwrap();
        for (i, b) in mem.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        send(&f, "cpu-engine-1", &mem);
        let regions = reg
            .import(request(
                "cpu-engine-1",
                1 << 20,
                vec![view(0, 4096), view(4096, 8192)],
            ))
            .await
            .unwrap();
        assert_eq!(regions.len(), 2);
        assert_eq!((regions[1].offset, regions[1].len), (4096, 8192));
        let m = &regions[0].memory;
        assert!(Arc::ptr_eq(m, &regions[1].memory));
        assert_eq!(m.location(), MemorySpace::HOST);
        assert_eq!(m.len_bytes(), 1 << 20);
        assert_eq!(
            m.describe(),
            "host memfd of 1048576 bytes for instance cpu-engine-1 device 0"
        );
        // The server's mapping shares the client's pages, both ways.
        let base = m.base_addr() as *mut u8;
        // SAFETY: base..base+1 MiB is the live mapping held by `regions`.
        unsafe {
            assert_eq!(*base.add(5000), (5000 % 251) as u8);
            *base.add(7) = 0xAB;
        }
        assert_eq!(mem.as_slice()[7], 0xAB);
        assert_eq!(f.channel.pending(), 0);
        drop(regions);
        // The client's memory outlives the server's mapping.
        assert_eq!(mem.as_slice()[7], 0xAB);
    }

    #[tokio::test]
    async fn rejects_views_outside_the_allocation() {
        let f = fixture().await;
        let reg = registrar(&f, 0.2);
        let mem = HostMemfd::new("kv", 4096).unwrap();
        let bad: Vec<(Vec<NativeView>, &str)> = vec![
            (vec![view(0, 1024), view(4000, 200)], "layer 1"),
            (vec![view(u64::MAX, 2)], "layer 0"),
            (vec![view(0, 0)], "size_bytes"),
            (
                vec![NativeView {
                    offset_bytes: 0,
                    size_bytes: 8,
                    block_stride_bytes: 0,
                }],
                "block_stride_bytes",
            ),
            (vec![], "no layer views"),
        ];
        for (views, needle) in bad {
            send(&f, "oob", &mem);
            wait_pending(&f, 1).await;
            let msg = invalid(reg.import(request("oob", 4096, views)).await);
            assert!(msg.contains(needle), "{msg}");
            // The descriptor sent for the failed registration is closed, so the next
            // iteration's resend under the same key is accepted, not a duplicate.
            assert_eq!(f.channel.pending(), 0);
        }
        // alloc_size 0.
        let msg = invalid(reg.import(request("oob", 0, vec![view(0, 1)])).await);
        assert!(msg.contains("alloc_size"), "{msg}");
        assert_eq!(f.channel.stats().rejected_duplicate, 0);
    }

    #[tokio::test]
    async fn rejects_an_undersized_memfd() {
        let f = fixture().await;
        let reg = registrar(&f, 5.0);
        let mem = HostMemfd::new("kv", 4096).unwrap();
        send(&f, "small", &mem);
        let msg = invalid(
            reg.import(request("small", 8192, vec![view(0, 8192)]))
                .await,
        );
        assert!(msg.contains("4096") && msg.contains("8192"), "{msg}");
        assert_eq!(f.channel.pending(), 0);
    }

    #[tokio::test]
    async fn rejects_a_descriptor_that_is_not_a_memfd() {
        let f = fixture().await;
        let reg = registrar(&f, 5.0);
        let (r, _w) = nix::unistd::pipe().unwrap();
        pegaflow_api::fd::send_fd(f.channel.path(), "pipe", 0, r.as_fd()).unwrap();
        let msg = invalid(reg.import(request("pipe", 4096, vec![view(0, 4096)])).await);
        assert!(msg.contains("not a memfd"), "{msg}");
    }

    #[tokio::test]
    async fn missing_fd_is_a_precondition_failure() {
        let f = fixture().await;
        let reg = registrar(&f, 0.1);
        let started = std::time::Instant::now();
        let msg = precondition(
            reg.import(request("absent", 4096, vec![view(0, 4096)]))
                .await,
        );
        assert!(started.elapsed() >= Duration::from_millis(90));
        assert!(
            msg.contains("no memfd") && msg.contains("instance absent device 0"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn no_channel_is_a_precondition_failure() {
        let reg = build(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        let msg = precondition(reg.import(request("x", 4096, vec![view(0, 4096)])).await);
        assert!(msg.contains("--fd-socket-path"), "{msg}");
    }

    #[tokio::test]
    async fn rejects_other_payloads_and_unsafe_ids() {
        let f = fixture().await;
        let reg = registrar(&f, 0.1);
        let wrong = ImportRequest {
            instance_id: "x".into(),
            device_id: 0,
            payload: RegistrationPayload::LayerBlobs(vec![vec![1]]),
        };
        assert!(invalid(reg.import(wrong).await).contains("wrapper_bytes"));
        assert!(
            invalid(reg.import(request("bad id", 64, vec![view(0, 64)])).await)
                .contains("instance id")
        );
    }

    #[tokio::test]
    async fn seals_sealable_memfds_against_shrinking() {
        let f = fixture().await;
        let ctx = RuntimeContext {
            fd_channel: Some(Arc::clone(&f.channel) as Arc<dyn SideChannel>),
            ..RuntimeContext::default()
        };
        let strict = build(&toml::from_str("require_shrink_seal = true").unwrap(), &ctx).unwrap();
        // A memfd created with MFD_ALLOW_SEALING: imported and sealed.
        let fd = nix::sys::memfd::memfd_create(
            c"sealable",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
        )
        .unwrap();
        nix::unistd::ftruncate(&fd, 8192).unwrap();
        pegaflow_api::fd::send_fd(f.channel.path(), "sealed", 0, fd.as_fd()).unwrap();
        let regions = strict
            .import(request("sealed", 8192, vec![view(0, 8192)]))
            .await
            .unwrap();
        let seals = fcntl(fd.as_fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert_ne!(seals & SealFlag::F_SEAL_SHRINK.bits(), 0);
        assert_eq!(nix::unistd::ftruncate(&fd, 4096), Err(Errno::EPERM));
        drop(regions);
        // A memfd without MFD_ALLOW_SEALING is refused by the strict registrar.
        let unsealable =
            nix::sys::memfd::memfd_create(c"unsealable", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .unwrap();
        nix::unistd::ftruncate(&unsealable, 8192).unwrap();
        pegaflow_api::fd::send_fd(f.channel.path(), "unsealed", 0, unsealable.as_fd()).unwrap();
        let msg = invalid(
            strict
                .import(request("unsealed", 8192, vec![view(0, 8192)]))
                .await,
        );
        assert!(msg.contains("MFD_ALLOW_SEALING"), "{msg}");
        assert_eq!(f.channel.pending(), 0);
    }

    /// A memfd of 8192 bytes: sealable or not, and with `seals` already added.
    fn memfd(sealable: bool, seals: SealFlag) -> OwnedFd {
        use nix::sys::memfd::MFdFlags;
        let flags = if sealable {
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING
        } else {
            MFdFlags::MFD_CLOEXEC
        };
        let fd = nix::sys::memfd::memfd_create(c"kv", flags).unwrap();
        nix::unistd::ftruncate(&fd, 8192).unwrap();
        if !seals.is_empty() {
            fcntl(fd.as_fd(), FcntlArg::F_ADD_SEALS(seals)).unwrap();
        }
        fd
    }

    #[tokio::test]
    async fn unsealable_memfds_are_refused_unless_the_operator_opts_out() {
        let f = fixture().await;
        let ctx = RuntimeContext {
            fd_channel: Some(Arc::clone(&f.channel) as Arc<dyn SideChannel>),
            ..RuntimeContext::default()
        };
        let default = build(&toml::Table::new(), &ctx).unwrap();
        let lax = build(
            &toml::from_str("require_shrink_seal = false").unwrap(),
            &ctx,
        )
        .unwrap();
        let import = |reg: &Arc<dyn Registrar>, id: &'static str, fd: &OwnedFd| {
            pegaflow_api::fd::send_fd(f.channel.path(), id, 0, fd.as_fd()).unwrap();
            let reg = Arc::clone(reg);
            async move { reg.import(request(id, 8192, vec![view(0, 8192)])).await }
        };
        // Refused by default: no MFD_ALLOW_SEALING, or the seals sealed without a shrink seal.
        for (id, fd) in [
            ("plain", memfd(false, SealFlag::empty())),
            ("seal-sealed", memfd(true, SealFlag::F_SEAL_SEAL)),
        ] {
            let msg = invalid(import(&default, id, &fd).await);
            assert!(
                msg.contains("cannot be sealed against shrinking")
                    && msg.contains("MFD_ALLOW_SEALING"),
                "{msg}"
            );
        }
        // Sealed against shrinking by the client, seals then sealed: in effect, accepted.
        let pre = memfd(true, SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL);
        assert_eq!(import(&default, "pre-sealed", &pre).await.unwrap().len(), 1);
        // The operator's opt-out accepts an unsealable memfd (with a warning).
        let plain = memfd(false, SealFlag::empty());
        assert_eq!(import(&lax, "lax", &plain).await.unwrap().len(), 1);
        let seals = fcntl(plain.as_fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert_eq!(seals & SealFlag::F_SEAL_SHRINK.bits(), 0);
        assert_eq!(f.channel.pending(), 0);
    }

    #[test]
    fn options_are_checked() {
        assert!(HostMemfdConfig::default().require_shrink_seal);
        let ctx = RuntimeContext::default();
        let table = |s: &str| -> toml::Table { toml::from_str(s).unwrap() };
        assert!(build(&table("fd_timeout_secs = 3"), &ctx).is_ok());
        assert!(build(
            &table("fd_timeout_secs = 0.5\nrequire_shrink_seal = true"),
            &ctx
        )
        .is_ok());
        assert!(build(&table("fd_timeout_secs = -1"), &ctx).is_err());
        assert!(build(&table("fd_timeout_secs = \"10\""), &ctx).is_err());
        assert!(build(&table("fd_timeout = 3"), &ctx).is_err());
        assert!(build(&table("require_shrink_seal = 1"), &ctx).is_err());
    }

    #[test]
    fn the_factory_is_registered() {
        let f = pegaflow_plugin::registrar_factory("host-memfd").unwrap();
        let r = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(r.kind(), "host-memfd");
        assert_eq!(
            r.scheme().carrier,
            PayloadCarrier::SideChannel {
                memory_kind: MEMORY_KIND
            }
        );
    }
}
