//! The RDMA emulator: a [`Nic`] and [`QueuePair`]s that run the one-sided protocol between
//! processes on one machine, for tests and machines without RDMA hardware
//! (`[peer] kind = "rdma-emu"`).
//!
//! The fabric: each holder listens on a Unix socket ([`FabricServer`]). A requester's queue
//! pair going to RTR connects there (once per holder and NIC), greets with its requester id
//! and receives, over `SCM_RIGHTS`, a read-only descriptor of the holder's memory
//! (`/proc/self/mem`, opened by the holder itself, so no ptrace permission is involved) and
//! the holder's registered regions with their rkeys: the holder NIC's authoritative
//! protection table. A READ is then done without the holder's CPU, like a NIC's: a worker
//! thread per queue pair takes the posted WRs in order, checks the rkey and the region
//! bounds against that table (else [`WcStatus::RemoteAccess`]), the lkey and bounds of the
//! destination against this NIC's regions ([`WcStatus::LocalProtection`]), copies with
//! `pread` into the destination, and completes into the NIC's completion queue (successes
//! only when signalled; errors always, after which the queue pair is in Error and every
//! later WR completes [`WcStatus::Flushed`], in order).
//!
//! Peer death revokes the mapping: the socket closing (the holder died or dropped the
//! connection) revokes the descriptor, and reads through it after the holder's exit fail
//! anyway (the kernel frees the address space); the READs then complete
//! [`WcStatus::RetryExceeded`], as an RC queue pair's retries would. The holder counts
//! the socket as the requester's data connection in its lock table: a requester that dies
//! releases its transfer locks at once.
//!
//! Why `/proc/self/mem` and not a memfd: the landing tier's pool is an anonymous mapping
//! the DRAM tier owns (with its NUMA placement); sharing it as a memfd would mean
//! re-creating the pool in every build or remapping it under the tier. The descriptor gives
//! the same one-sided semantics with no change to the pool: the requester reads the
//! holder's registered ranges, only those (checked like a NIC checks), and only while the
//! holder lives.
//!
//! Injectable faults ([`Faults`], the `[peer.emu]` table): a completion error after `n`
//! operations; the mapping revoked after `n` operations (peer death); a completion that
//! arrives `ms` late (after the requester's deadline: the copy happens late too, which is
//! what drain-before-free must survive); a wrong rkey advertised by the holder (key
//! mismatch).

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::verbs::{
    Completion, LinkLayer, MemoryRegion, Nic, NicCaps, QpPeer, QpState, QueuePair, ReadWr,
    VerbsError, WcStatus,
};

/// The fabric's greeting, first line of every connection.
const HELLO: &str = "pegaflow-rdma-emu/1";
/// Vendor syndrome of an injected completion error.
pub const INJECTED_SYNDROME: u32 = 0xe1;

/// The emulator's settings (`[peer.emu]`), faults included (all off by default).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EmuSettings {
    /// Link layer the emulated NICs declare: `"roce"` (GID addressing) or `"ib"` (LID).
    #[serde(default = "default_link")]
    pub link: String,
    /// NUMA node of each emulated NIC, by position in `nics` (missing: -1, unknown).
    #[serde(default)]
    pub nic_numa_nodes: Vec<i32>,
    /// Folder of the holder's fabric socket (empty: the system's temporary folder).
    #[serde(default)]
    pub socket_dir: String,
    /// Fault: the `n`-th READ (counted per NIC from 1) and every READ after it complete
    /// with an error (0: off).
    #[serde(default)]
    pub fault_completion_error_after: u64,
    /// Fault: after `n` READs the mapping of every holder is revoked, as if they died (0: off).
    #[serde(default)]
    pub fault_revoke_after: u64,
    /// Fault: the `n`-th READ is copied and completed `fault_late_completion_ms` late (0: off).
    #[serde(default)]
    pub fault_late_after: u64,
    /// How late, in milliseconds.
    #[serde(default)]
    pub fault_late_completion_ms: u64,
    /// Fault (holder side): advertise rkeys that do not match the registered regions.
    #[serde(default)]
    pub fault_wrong_rkey: bool,
}

fn default_link() -> String {
    "roce".into()
}

impl Default for EmuSettings {
    fn default() -> Self {
        Self {
            link: default_link(),
            nic_numa_nodes: Vec::new(),
            socket_dir: String::new(),
            fault_completion_error_after: 0,
            fault_revoke_after: 0,
            fault_late_after: 0,
            fault_late_completion_ms: 0,
            fault_wrong_rkey: false,
        }
    }
}

impl EmuSettings {
    /// The declared link layer.
    ///
    /// # Errors
    /// `link` is neither `roce` nor `ib`.
    pub fn link_layer(&self) -> anyhow::Result<LinkLayer> {
        match self.link.as_str() {
            "roce" => Ok(LinkLayer::Ethernet),
            "ib" => Ok(LinkLayer::Infiniband),
            other => anyhow::bail!("emu.link must be \"roce\" or \"ib\", got {other:?}"),
        }
    }
}

/// The holder's view of a requester's mapping: what the fabric connection hands over.
struct RemoteMem {
    /// Read-only descriptor of the holder's memory; `None` once revoked.
    mem: RwLock<Option<OwnedFd>>,
    /// The holder NIC's regions (authoritative rkeys and bounds).
    mrs: Vec<MemoryRegion>,
    /// Keeps the socket open (its closing tells the holder we are gone).
    _sock: UnixStream,
}

impl RemoteMem {
    fn revoke(&self) {
        self.mem.write().take();
    }
}

impl Drop for RemoteMem {
    fn drop(&mut self) {
        // Ends the watcher's read (it holds a duplicate of the socket) and tells the holder.
        let _ = self._sock.shutdown(std::net::Shutdown::Both);
    }
}

/// The completion queue of one emulated NIC.
#[derive(Default)]
struct Cq {
    q: Mutex<VecDeque<Completion>>,
    cv: Condvar,
}

impl Cq {
    fn push(&self, c: Completion) {
        self.q.lock().push_back(c);
        self.cv.notify_one();
    }
}

/// One emulated NIC (cheap to share: its tables live behind an `Arc` its queue pairs'
/// workers hold too).
pub struct EmuNic {
    s: Arc<Shared>,
}

struct Shared {
    caps: NicCaps,
    requester_id: String,
    settings: EmuSettings,
    mrs: Mutex<Vec<MemoryRegion>>,
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    cq: Arc<Cq>,
    /// Fabric connections to holders, by socket path.
    remotes: Mutex<HashMap<String, Weak<RemoteMem>>>,
    /// READs processed on this NIC (the fault counters' clock).
    ops: AtomicU64,
    /// Strong references to every remote, for the revoke fault.
    live: Mutex<Vec<Weak<RemoteMem>>>,
}

impl std::fmt::Debug for EmuNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuNic")
            .field("name", &self.s.caps.name)
            .finish()
    }
}

impl EmuNic {
    /// NIC `index` named `name`, greeting holders as `requester_id`.
    ///
    /// # Errors
    /// A bad `link` setting.
    pub fn new(
        name: &str,
        index: usize,
        requester_id: &str,
        settings: &EmuSettings,
    ) -> anyhow::Result<Self> {
        let link = settings.link_layer()?;
        // A stable, non-zero address per name: LID on InfiniBand, a link-local GID on RoCE.
        let h = name.bytes().fold(0x811c_9dc5u32, |h, b| {
            (h ^ b as u32).wrapping_mul(0x0100_0193)
        });
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[12..].copy_from_slice(&h.to_be_bytes());
        let caps = NicCaps {
            name: name.to_owned(),
            port: 1,
            link,
            lid: if link == LinkLayer::Infiniband {
                (h as u16 % 0xbfff).max(1)
            } else {
                0
            },
            gid: if link == LinkLayer::Ethernet {
                gid
            } else {
                [0; 16]
            },
            gid_index: if link == LinkLayer::Ethernet { 3 } else { 0 },
            mtu: 5,
            numa_node: settings.nic_numa_nodes.get(index).copied().unwrap_or(-1),
            max_qp_wr: 4096,
            max_msg_bytes: 1 << 30,
        };
        let seed = uuid::Uuid::new_v4().as_u128() as u32;
        Ok(Self {
            s: Arc::new(Shared {
                caps,
                requester_id: requester_id.to_owned(),
                settings: settings.clone(),
                mrs: Mutex::new(Vec::new()),
                next_key: AtomicU32::new(seed | 1),
                next_qpn: AtomicU32::new((seed >> 8) & 0xffff | 0x100),
                cq: Arc::new(Cq::default()),
                remotes: Mutex::new(HashMap::new()),
                ops: AtomicU64::new(0),
                live: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The regions registered on this NIC, with the rkeys it advertises (a wrong one per
    /// region under the `fault_wrong_rkey` fault).
    pub fn advertised(&self) -> Vec<MemoryRegion> {
        let s = &self.s;
        s.mrs
            .lock()
            .iter()
            .map(|m| MemoryRegion {
                rkey: if s.settings.fault_wrong_rkey {
                    m.rkey ^ 0x5a5a_0000
                } else {
                    m.rkey
                },
                ..*m
            })
            .collect()
    }

    /// The regions registered on this NIC (authoritative keys).
    fn regions(&self) -> Vec<MemoryRegion> {
        self.s.mrs.lock().clone()
    }
}

impl Shared {
    /// The fabric link to the holder listening at `path` (connected on first use).
    fn remote(&self, path: &str) -> Result<Arc<RemoteMem>, VerbsError> {
        let mut remotes = self.remotes.lock();
        if let Some(r) = remotes.get(path).and_then(Weak::upgrade) {
            if r.mem.read().is_some() {
                return Ok(r);
            }
        }
        let r = Arc::new(connect_fabric(path, &self.requester_id, &self.caps.name)?);
        remotes.retain(|_, w| w.strong_count() > 0);
        remotes.insert(path.to_owned(), Arc::downgrade(&r));
        let mut live = self.live.lock();
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&r));
        // Peer death: the socket's end revokes the mapping.
        let watch = Arc::downgrade(&r);
        let sock = r._sock.try_clone().map_err(dev("fabric socket"))?;
        std::thread::Builder::new()
            .name("rdma-emu-link".into())
            .spawn(move || {
                let mut sock = sock;
                let mut b = [0u8; 64];
                while matches!(sock.read(&mut b), Ok(n) if n > 0) {}
                if let Some(r) = watch.upgrade() {
                    r.revoke();
                }
            })
            .map_err(dev("fabric watcher thread"))?;
        Ok(r)
    }

    fn lkey_covers(&self, lkey: u32, addr: u64, len: u64) -> bool {
        self.mrs
            .lock()
            .iter()
            .any(|m| m.lkey == lkey && m.contains(addr, len))
    }
}

fn dev<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> VerbsError {
    move |e| VerbsError::Device(format!("{what}: {e}"))
}

impl Nic for EmuNic {
    fn caps(&self) -> &NicCaps {
        &self.s.caps
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion, VerbsError> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(VerbsError::Device(format!(
                "register {addr:#x}+{len}: empty or overflowing"
            )));
        }
        let key = self.s.next_key.fetch_add(2, Ordering::Relaxed);
        let mr = MemoryRegion {
            addr,
            len,
            lkey: key,
            rkey: key.rotate_left(16) ^ 0x00c0_ffee,
        };
        self.s.mrs.lock().push(mr);
        Ok(mr)
    }

    fn create_qp(&self) -> Result<Box<dyn QueuePair>, VerbsError> {
        let qpn = self.s.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let inner = Arc::new(QpInner {
            qpn,
            state: Mutex::new(QpState::Reset),
            remote: Mutex::new(None),
        });
        Ok(Box::new(EmuQp {
            inner,
            sq: Mutex::new(SendQueue::Idle),
            psn: (qpn.wrapping_mul(2_654_435_761)) & 0xff_ffff,
            nic: self.s.clone(),
        }))
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize, wait: Duration) -> usize {
        let mut q = self.s.cq.q.lock();
        if q.is_empty() {
            self.s.cq.cv.wait_for(&mut q, wait);
        }
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        n
    }
}

/// Opens `names` as emulated NICs, greeting holders as `requester_id`.
///
/// # Errors
/// A bad `link` setting.
pub fn open(
    names: &[String],
    requester_id: &str,
    settings: &EmuSettings,
) -> anyhow::Result<Vec<Arc<EmuNic>>> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| Ok(Arc::new(EmuNic::new(n, i, requester_id, settings)?)))
        .collect()
}

struct QpInner {
    qpn: u32,
    state: Mutex<QpState>,
    remote: Mutex<Option<Arc<RemoteMem>>>,
}

impl QpInner {
    fn go(&self, to: QpState) -> Result<(), VerbsError> {
        let mut s = self.state.lock();
        *s = s.go(to)?;
        Ok(())
    }
}

/// An emulated reliable-connected queue pair.
/// An emulated queue pair's send queue. Its worker thread starts with the first post: a
/// holder's queue pairs only answer and never post, so they cost no thread.
enum SendQueue {
    /// Nothing posted yet.
    Idle,
    /// The worker's queue.
    Running(std::sync::mpsc::Sender<ReadWr>),
    /// Destroyed.
    Gone,
}

pub struct EmuQp {
    inner: Arc<QpInner>,
    /// The send queue to the worker.
    sq: Mutex<SendQueue>,
    psn: u32,
    nic: Arc<Shared>,
}

impl Drop for EmuQp {
    fn drop(&mut self) {
        // Destroying: whatever is still queued completes flushed, without copying.
        *self.inner.state.lock() = QpState::Error;
        *self.sq.lock() = SendQueue::Gone;
    }
}

impl QueuePair for EmuQp {
    fn qpn(&self) -> u32 {
        self.inner.qpn
    }
    fn psn(&self) -> u32 {
        self.psn
    }
    fn state(&self) -> QpState {
        *self.inner.state.lock()
    }
    fn to_init(&self) -> Result<(), VerbsError> {
        self.inner.go(QpState::Init)
    }
    fn to_rtr(&self, peer: &QpPeer) -> Result<(), VerbsError> {
        if self.state() != QpState::Init {
            return Err(crate::verbs::BadTransition {
                from: self.state(),
                to: QpState::Rtr,
            }
            .into());
        }
        if peer.link != self.nic.caps.link {
            return Err(VerbsError::Device("link layers differ".into()));
        }
        // A requester's queue pair reaches the holder's memory through the fabric; a
        // holder's (peer.fabric empty) only answers.
        if !peer.fabric.is_empty() {
            let r = self.nic.remote(&peer.fabric)?;
            *self.inner.remote.lock() = Some(r);
        }
        self.inner.go(QpState::Rtr)
    }
    fn to_rts(&self) -> Result<(), VerbsError> {
        self.inner.go(QpState::Rts)
    }
    fn to_error(&self) -> Result<(), VerbsError> {
        self.inner.go(QpState::Error)
    }
    unsafe fn post_read(&self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        let s = self.state();
        if !matches!(s, QpState::Rts | QpState::Error) {
            return Err(VerbsError::Post(format!("queue pair in {s:?}")));
        }
        let mut sq = self.sq.lock();
        if matches!(*sq, SendQueue::Idle) {
            let (tx, rx) = std::sync::mpsc::channel::<ReadWr>();
            let (nic, inner) = (self.nic.clone(), self.inner.clone());
            std::thread::Builder::new()
                .name(format!("rdma-emu-qp{}", self.inner.qpn))
                .spawn(move || worker(&nic, &inner, &rx))
                .map_err(|e| VerbsError::Post(format!("queue pair worker thread: {e}")))?;
            *sq = SendQueue::Running(tx);
        }
        let SendQueue::Running(tx) = &*sq else {
            return Err(VerbsError::Post("queue pair destroyed".into()));
        };
        for w in wrs {
            tx.send(*w)
                .map_err(|_| VerbsError::Post("queue pair worker gone".into()))?;
        }
        Ok(())
    }
}

/// The queue pair's worker: the emulated NIC's processing of one send queue, in order.
fn worker(nic: &Shared, qp: &QpInner, rx: &std::sync::mpsc::Receiver<ReadWr>) {
    let st = &nic.settings;
    while let Ok(w) = rx.recv() {
        let complete = |status: WcStatus| {
            if status != WcStatus::Success || w.signaled {
                nic.cq.push(Completion {
                    wr_id: w.wr_id,
                    qpn: qp.qpn,
                    status,
                });
            }
        };
        if w.len == 0 {
            // A drain marker (or an empty READ): completes in order, flushed in Error.
            let s = if *qp.state.lock() == QpState::Error {
                WcStatus::Flushed
            } else {
                WcStatus::Success
            };
            nic.cq.push(Completion {
                wr_id: w.wr_id,
                qpn: qp.qpn,
                status: s,
            });
            continue;
        }
        if *qp.state.lock() == QpState::Error {
            complete(WcStatus::Flushed);
            continue;
        }
        // The READ's number on this NIC decides the faults armed at the n-th operation; taken
        // in one step, so two queue pairs' workers never both (or neither) get the same n.
        let n = nic.ops.fetch_add(1, Ordering::Relaxed) + 1;
        let late = st.fault_late_after > 0 && n == st.fault_late_after;
        if late {
            // Already on the wire when the requester gave up: the bytes land late.
            std::thread::sleep(Duration::from_millis(st.fault_late_completion_ms));
        }
        if st.fault_revoke_after > 0 && n > st.fault_revoke_after {
            for r in nic.live.lock().iter().filter_map(Weak::upgrade) {
                r.revoke();
            }
        }
        let status = if st.fault_completion_error_after > 0 && n >= st.fault_completion_error_after
        {
            WcStatus::Other(INJECTED_SYNDROME)
        } else {
            read_one(nic, qp, &w)
        };
        if status != WcStatus::Success {
            *qp.state.lock() = QpState::Error;
        }
        complete(status);
    }
}

fn read_one(nic: &Shared, qp: &QpInner, w: &ReadWr) -> WcStatus {
    let Some(remote) = qp.remote.lock().clone() else {
        return WcStatus::RetryExceeded;
    };
    let len = w.len as u64;
    if !remote
        .mrs
        .iter()
        .any(|m| m.rkey == w.rkey && m.contains(w.remote_addr, len))
    {
        return WcStatus::RemoteAccess;
    }
    if !nic.lkey_covers(w.lkey, w.local_addr, len) {
        return WcStatus::LocalProtection;
    }
    let mem = remote.mem.read();
    let Some(fd) = mem.as_ref() else {
        return WcStatus::RetryExceeded;
    };
    let mut done = 0u64;
    while done < len {
        // SAFETY: the destination lies in a region registered on this NIC (checked above),
        // which the data path keeps valid until this WR's completion has been polled.
        let r = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                (w.local_addr + done) as *mut libc::c_void,
                (len - done) as usize,
                (w.remote_addr + done) as libc::off_t,
            )
        };
        if r <= 0 {
            // The holder's address space is gone (it exited) or the range is unmapped.
            return WcStatus::RetryExceeded;
        }
        done += r as u64;
    }
    WcStatus::Success
}

/// Connects to a holder's fabric socket: greeting, then the memory descriptor and the
/// holder NIC's regions.
fn connect_fabric(path: &str, requester_id: &str, nic: &str) -> Result<RemoteMem, VerbsError> {
    let unreachable = |e: std::io::Error| VerbsError::Device(format!("fabric {path}: {e}"));
    let mut s = UnixStream::connect(path).map_err(unreachable)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(unreachable)?;
    writeln!(s, "{HELLO} {requester_id} {nic}").map_err(unreachable)?;
    // The answer: one message carrying the descriptor, its text the region table.
    let mut buf = vec![0u8; 64 << 10];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let (n, fd) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let m = nix::sys::socket::recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| VerbsError::Device(format!("fabric {path}: {e}")))?;
        let mut fd = None;
        for c in m
            .cmsgs()
            .map_err(|e| VerbsError::Device(format!("fabric {path}: {e}")))?
        {
            if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                for f in fds {
                    // SAFETY: received just now over SCM_RIGHTS: ours to own.
                    let o = unsafe { OwnedFd::from_raw_fd(f) };
                    if fd.is_none() {
                        fd = Some(o);
                    }
                }
            }
        }
        (m.bytes, fd)
    };
    let text = std::str::from_utf8(&buf[..n])
        .map_err(|_| VerbsError::Device(format!("fabric {path}: answer is not text")))?;
    let mut lines = text.lines();
    match lines.next() {
        Some(l) if l == format!("{HELLO} ok") => {}
        other => {
            return Err(VerbsError::Device(format!(
                "fabric {path}: refused: {other:?}"
            )))
        }
    }
    let fd = fd.ok_or_else(|| VerbsError::Device(format!("fabric {path}: no descriptor")))?;
    let mut mrs = Vec::new();
    for l in lines {
        let p: Vec<u64> = l
            .split_whitespace()
            .filter_map(|x| u64::from_str_radix(x, 16).ok())
            .collect();
        if let [addr, len, lkey, rkey] = p[..] {
            mrs.push(MemoryRegion {
                addr,
                len,
                lkey: lkey as u32,
                rkey: rkey as u32,
            });
        }
    }
    s.set_read_timeout(None).map_err(unreachable)?;
    Ok(RemoteMem {
        mem: RwLock::new(Some(fd)),
        mrs,
        _sock: s,
    })
}

/// What the holder's fabric reports about its requesters (its lock table counts a fabric
/// connection as the requester's data connection).
pub trait FabricPeers: Send + Sync + 'static {
    /// A requester connected.
    fn connected(&self, requester: &Arc<str>);
    /// A requester's connection closed.
    fn disconnected(&self, requester: &Arc<str>);
}

/// The holder's fabric socket: hands requesters the memory descriptor and its NICs' region
/// tables (the real ones, whatever rkeys the handshake advertised).
pub struct FabricServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for FabricServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricServer")
            .field("path", &self.path)
            .finish()
    }
}

impl FabricServer {
    /// Listens in `dir` (a fresh socket name) for requesters of `nics`' memory; `peers`
    /// hears who connects and leaves. Connections beyond `max_connections` are refused.
    ///
    /// # Errors
    /// The socket cannot be bound, or `/proc/self/mem` cannot be opened.
    pub fn start(
        dir: &Path,
        nics: Vec<Arc<EmuNic>>,
        peers: Arc<dyn FabricPeers>,
        max_connections: usize,
    ) -> anyhow::Result<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        // The socket hands out a descriptor of this process's memory: it lives in a fresh
        // directory only this user can enter, is itself 0600, and every connection's peer
        // credentials must be this user's.
        let private = dir.join(format!("pf-rdma-{}", &id[..12]));
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&private)
                .map_err(|e| {
                    anyhow::anyhow!("rdma-emu: cannot create {}: {e}", private.display())
                })?;
        }
        let path = private.join("fabric.sock");
        let listener = UnixListener::bind(&path)
            .map_err(|e| {
                anyhow::anyhow!(
                    "rdma-emu: cannot listen on {} ({} bytes; a socket path has at most 107: choose a shorter emu.socket_dir): {e}",
                    path.display(),
                    path.as_os_str().len()
                )
            })?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
        let mem = std::fs::File::open("/proc/self/mem")
            .map_err(|e| anyhow::anyhow!("rdma-emu: cannot open /proc/self/mem: {e}"))?;
        let mem: OwnedFd = mem.into();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let open = Arc::new(AtomicU64::new(0));
        std::thread::Builder::new()
            .name("rdma-emu-fabric".into())
            .spawn(move || {
                for s in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(s) = s else { continue };
                    if !same_user(&s) {
                        tracing::warn!(
                            "rdma-emu: refused a fabric connection from another user (or of unknown credentials)"
                        );
                        continue;
                    }
                    if open.load(Ordering::Acquire) as usize >= max_connections {
                        continue;
                    }
                    let (nics, peers, open) = (nics.clone(), peers.clone(), open.clone());
                    let Ok(mem) = mem.try_clone() else { continue };
                    open.fetch_add(1, Ordering::AcqRel);
                    let _ = std::thread::Builder::new()
                        .name("rdma-emu-conn".into())
                        .spawn(move || {
                            if let Err(e) = serve_conn(s, &mem, &nics, &*peers) {
                                tracing::debug!(error = %e, "rdma-emu: fabric connection ended");
                            }
                            open.fetch_sub(1, Ordering::AcqRel);
                        });
                }
            })?;
        Ok(Self { path, stop })
    }

    /// The socket's path (what the handshake answer carries as the fabric address).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FabricServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = self.path.parent() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Whether the peer of `s` runs as this process's effective user (`SO_PEERCRED`).
fn same_user(s: &UnixStream) -> bool {
    nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials)
        // SAFETY: geteuid has no preconditions.
        .is_ok_and(|c| c.uid() == unsafe { libc::geteuid() })
}

fn serve_conn(
    mut s: UnixStream,
    mem: &OwnedFd,
    nics: &[Arc<EmuNic>],
    peers: &dyn FabricPeers,
) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 1024 {
        if s.read(&mut b)? == 0 {
            return Ok(());
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let mut w = line.split_whitespace();
    let (Some(HELLO), Some(requester), Some(nic)) = (w.next(), w.next(), w.next()) else {
        let _ = s.write_all(b"refused\n");
        return Ok(());
    };
    tracing::debug!(requester, nic, "rdma-emu: requester connected");
    let mut text = format!("{HELLO} ok\n");
    for n in nics {
        for m in n.regions() {
            text.push_str(&format!(
                "{:x} {:x} {:x} {:x}\n",
                m.addr, m.len, m.lkey, m.rkey
            ));
        }
    }
    // Counted before the requester can use the mapping (and lock anything through it).
    let requester: Arc<str> = requester.into();
    peers.connected(&requester);
    let fds = [mem.as_raw_fd()];
    if let Err(e) = nix::sys::socket::sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(text.as_bytes())],
        &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
        nix::sys::socket::MsgFlags::empty(),
        None,
    ) {
        peers.disconnected(&requester);
        return Err(e.into());
    }
    s.set_read_timeout(None)?;
    // The connection lives until the requester closes it (or dies).
    let mut buf = [0u8; 64];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    peers.disconnected(&requester);
    Ok(())
}
