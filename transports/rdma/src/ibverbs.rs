//! The libibverbs backend (`[peer] kind = "rdma"`, cargo feature `ibverbs`): real NICs.
//!
//! The library is opened at run time (`libibverbs.so.1`, with `dlopen` through
//! `libloading`), never linked: a binary with this backend starts on a machine without
//! the library or without devices, and [`open`] answers [`VerbsError::Unavailable`] with
//! the reason. The `ibverbs` crate was the design card's choice; it is not used because
//! its safe API registers only memory it allocates itself (`ProtectionDomain::allocate`),
//! not an existing pool, and posts only two-sided SEND/RECV (no RDMA READ), while its raw
//! bindings (`ibverbs-sys`) build rdma-core with cmake and bindgen and link libibverbs at
//! build time, so the binary would not start where the library is missing.
//!
//! Layouts: the few structs passed by pointer are declared here `#[repr(C)]` (`ibv_sge`,
//! `ibv_send_wr`, `ibv_wc`, `ibv_qp_init_attr`) or filled by byte offset (`ibv_qp_attr`,
//! `ibv_port_attr`, `ibv_device_attr`), with the sizes and offsets of rdma-core's
//! `verbs.h` (stable ABI, checked against v44 headers; the size assertions below fail the
//! build if a declaration drifts). `ibv_post_send` and `ibv_poll_cq` are inline functions
//! in the header that call through the context's ops table; this module does the same, at
//! the table's ABI offsets.
//!
//! Per NIC: one device context, one protection domain, one completion queue (polled by the
//! data path's poller thread for that NIC); the pool is registered once per NIC with local
//! write and remote read access. Queue pairs are RC; RoCEv2 ports are addressed by GID
//! (`gid_index`), InfiniBand ports by LID (a LID of 0 on an InfiniBand port is refused:
//! every WR would fail).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::verbs::{
    BadTransition, Completion, LinkLayer, MemoryRegion, Nic, NicCaps, QpPeer, QpState, QueuePair,
    ReadWr, VerbsError, WcStatus,
};

#[repr(C)]
struct Sge {
    addr: u64,
    length: u32,
    lkey: u32,
}

#[repr(C)]
struct SendWr {
    wr_id: u64,
    next: *mut SendWr,
    sg_list: *mut Sge,
    num_sge: c_int,
    opcode: u32,
    send_flags: u32,
    imm_data: u32,
    remote_addr: u64,
    rkey: u32,
    _rest: [u8; 76],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm_data: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: u32,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
    _pad: [u8; 2],
}

#[repr(C)]
struct QpInitAttr {
    qp_context: *mut c_void,
    send_cq: *mut c_void,
    recv_cq: *mut c_void,
    srq: *mut c_void,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
    qp_type: u32,
    sq_sig_all: c_int,
    _pad: u32,
}

const _: () = assert!(std::mem::size_of::<Sge>() == 16);
const _: () = assert!(std::mem::size_of::<SendWr>() == 128);
const _: () = assert!(std::mem::size_of::<Wc>() == 48);
const _: () = assert!(std::mem::size_of::<QpInitAttr>() == 64);

// verbs.h constants.
const QPT_RC: u32 = 2;
const WR_RDMA_READ: u32 = 4;
const SEND_SIGNALED: u32 = 2;
const ACCESS_LOCAL_WRITE: c_int = 1;
const ACCESS_REMOTE_READ: c_int = 4;
const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;
const QPS_ERR: u32 = 6;
const QP_STATE: c_int = 1;
const QP_ACCESS_FLAGS: c_int = 8;
const QP_PKEY_INDEX: c_int = 16;
const QP_PORT: c_int = 32;
const QP_AV: c_int = 128;
const QP_PATH_MTU: c_int = 256;
const QP_TIMEOUT: c_int = 512;
const QP_RETRY_CNT: c_int = 1024;
const QP_RNR_RETRY: c_int = 2048;
const QP_RQ_PSN: c_int = 4096;
const QP_MAX_QP_RD_ATOMIC: c_int = 8192;
const QP_MIN_RNR_TIMER: c_int = 32768;
const QP_SQ_PSN: c_int = 65536;
const QP_MAX_DEST_RD_ATOMIC: c_int = 131072;
const QP_DEST_QPN: c_int = 1048576;
const LINK_LAYER_ETHERNET: u8 = 2;

// Byte offsets in `struct ibv_qp_attr` (144 bytes).
const QA_SIZE: usize = 144;
const QA_STATE: usize = 0;
const QA_PATH_MTU: usize = 8;
const QA_RQ_PSN: usize = 20;
const QA_SQ_PSN: usize = 24;
const QA_DEST_QPN: usize = 28;
const QA_ACCESS: usize = 32;
const QA_AH: usize = 56;
const AH_DGID: usize = 0;
const AH_SGID_INDEX: usize = 20;
const AH_HOP_LIMIT: usize = 21;
const AH_DLID: usize = 24;
const AH_IS_GLOBAL: usize = 29;
const AH_PORT: usize = 30;
const QA_PKEY_INDEX: usize = 120;
const QA_MAX_RD_ATOMIC: usize = 126;
const QA_MAX_DEST_RD_ATOMIC: usize = 127;
const QA_MIN_RNR_TIMER: usize = 128;
const QA_PORT: usize = 129;
const QA_TIMEOUT: usize = 130;
const QA_RETRY_CNT: usize = 131;
const QA_RNR_RETRY: usize = 132;
// `struct ibv_port_attr` (52 bytes; the exported query fills its compat prefix).
const PA_STATE: usize = 0;
const PA_ACTIVE_MTU: usize = 8;
const PA_LID: usize = 34;
const PA_LINK_LAYER: usize = 46;
// `struct ibv_device_attr` (232 bytes).
const DA_SIZE: usize = 232;
const DA_MAX_QP_WR: usize = 112;
const DA_MAX_CQE: usize = 132;
const DA_MAX_MR_SIZE: usize = 80;
const DA_MAX_QP_RD_ATOM: usize = 144;
const DA_MAX_QP_INIT_RD_ATOM: usize = 156;
// `struct ibv_context`: the ops table's poll_cq and post_send.
const CTX_POLL_CQ: usize = 96;
const CTX_POST_SEND: usize = 208;
// `struct ibv_qp`: qp_num; `struct ibv_mr`: lkey, rkey.
const QP_NUM: usize = 52;
const MR_LKEY: usize = 36;
const MR_RKEY: usize = 40;

type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut Wc) -> c_int;
type PostSend = unsafe extern "C" fn(*mut c_void, *mut SendWr, *mut *mut SendWr) -> c_int;

struct Lib {
    _lib: libloading::Library,
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    query_device: unsafe extern "C" fn(*mut c_void, *mut u8) -> c_int,
    query_port: unsafe extern "C" fn(*mut c_void, u8, *mut u8) -> c_int,
    query_gid: unsafe extern "C" fn(*mut c_void, u8, c_int, *mut u8) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut c_void,
    create_cq:
        unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void,
    create_qp: unsafe extern "C" fn(*mut c_void, *mut QpInitAttr) -> *mut c_void,
    modify_qp: unsafe extern "C" fn(*mut c_void, *mut u8, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut c_void) -> c_int,
}

fn lib() -> Result<&'static Lib, VerbsError> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: loading libibverbs runs its initialisers, which only read the system's
        // provider configuration.
        let l = unsafe { libloading::Library::new("libibverbs.so.1") }
            .map_err(|e| format!("libibverbs.so.1 cannot be loaded ({e}); install rdma-core"))?;
        macro_rules! sym {
            ($n:literal) => {
                // SAFETY: the symbol's C signature is the one declared in `Lib` (verbs.h).
                *unsafe { l.get($n) }.map_err(|e| {
                    format!(
                        "libibverbs lacks {}: {e}",
                        String::from_utf8_lossy(&$n[..$n.len() - 1])
                    )
                })?
            };
        }
        Ok(Lib {
            get_device_list: sym!(b"ibv_get_device_list\0"),
            get_device_name: sym!(b"ibv_get_device_name\0"),
            open_device: sym!(b"ibv_open_device\0"),
            query_device: sym!(b"ibv_query_device\0"),
            query_port: sym!(b"ibv_query_port\0"),
            query_gid: sym!(b"ibv_query_gid\0"),
            alloc_pd: sym!(b"ibv_alloc_pd\0"),
            reg_mr: sym!(b"ibv_reg_mr\0"),
            create_cq: sym!(b"ibv_create_cq\0"),
            create_qp: sym!(b"ibv_create_qp\0"),
            modify_qp: sym!(b"ibv_modify_qp\0"),
            destroy_qp: sym!(b"ibv_destroy_qp\0"),
            _lib: l,
        })
    })
    .as_ref()
    .map_err(|e| VerbsError::Unavailable(e.clone()))
}

fn errno(what: &str) -> VerbsError {
    VerbsError::Device(format!("{what}: {}", std::io::Error::last_os_error()))
}

fn rd<T: Copy>(b: &[u8], at: usize) -> T {
    assert!(at + std::mem::size_of::<T>() <= b.len());
    // SAFETY: in bounds (asserted); an unaligned read of a plain integer.
    unsafe { std::ptr::read_unaligned(b.as_ptr().add(at).cast()) }
}

fn wr<T: Copy>(b: &mut [u8], at: usize, v: T) {
    assert!(at + std::mem::size_of::<T>() <= b.len());
    // SAFETY: in bounds (asserted); an unaligned write of a plain integer.
    unsafe { std::ptr::write_unaligned(b.as_mut_ptr().add(at).cast(), v) }
}

/// One opened device.
pub struct IbvNic {
    lib: &'static Lib,
    ctx: *mut c_void,
    pd: *mut c_void,
    cq: *mut c_void,
    caps: NicCaps,
    active_mtu: u32,
    max_rd_atomic: u8,
    max_init_rd_atomic: u8,
    /// Registered regions (never deregistered: the pool lives as long as the process).
    mrs: Mutex<Vec<MemoryRegion>>,
    /// This NIC's own `Arc` (set by [`open`]): each queue pair holds the NIC it was made on.
    me: std::sync::Weak<IbvNic>,
    /// The poller's sleep between empty polls, in µs: 50 while completions come, doubling
    /// up to [`IDLE_POLL_MAX_US`] while none do (an idle NIC wakes ~1,000 times a second,
    /// not 20,000).
    idle_us: std::sync::atomic::AtomicU32,
}

/// The longest sleep between two empty polls of an idle completion queue, in µs.
const IDLE_POLL_MAX_US: u32 = 1000;
/// The sleep between empty polls while completions are arriving, in µs.
const BUSY_POLL_US: u32 = 50;

// SAFETY: verbs objects are thread-safe per rdma-core's documentation (every call takes
// the provider's own locks); the raw pointers are only handed to libibverbs.
unsafe impl Send for IbvNic {}
// SAFETY: as above.
unsafe impl Sync for IbvNic {}

impl std::fmt::Debug for IbvNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvNic").field("caps", &self.caps).finish()
    }
}

fn numa_of(name: &str) -> i32 {
    std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(-1)
}

/// Opens `names` (empty: every device), port 1 of each, using GID `gid_index` on RoCE ports.
///
/// # Errors
/// [`VerbsError::Unavailable`] without the library, without devices, for a named device
/// that is absent, or a port that is down; [`VerbsError::Device`] when a device call fails.
pub fn open(names: &[String], gid_index: u8) -> Result<Vec<Arc<IbvNic>>, VerbsError> {
    let l = lib()?;
    let mut n: c_int = 0;
    // SAFETY: a plain library call; the list is freed by the process's end (it is small
    // and read once).
    let list = unsafe { (l.get_device_list)(&mut n) };
    if list.is_null() || n <= 0 {
        return Err(VerbsError::Unavailable(
            "no RDMA devices on this machine".into(),
        ));
    }
    let mut found = Vec::new();
    for i in 0..n as usize {
        // SAFETY: `list` holds `n` device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
        let name = unsafe { CStr::from_ptr((l.get_device_name)(dev)) }
            .to_string_lossy()
            .into_owned();
        found.push((name, dev));
    }
    let wanted: Vec<(String, *mut c_void)> = if names.is_empty() {
        found.clone()
    } else {
        names
            .iter()
            .map(|w| {
                found.iter().find(|(n, _)| n == w).cloned().ok_or_else(|| {
                    VerbsError::Unavailable(format!(
                        "no RDMA device {w:?}; this machine has {:?}",
                        found.iter().map(|(n, _)| n).collect::<Vec<_>>()
                    ))
                })
            })
            .collect::<Result<_, _>>()?
    };
    wanted
        .into_iter()
        .map(|(name, dev)| {
            open_one(l, &name, dev, gid_index).map(|n| {
                Arc::new_cyclic(|me| IbvNic {
                    me: me.clone(),
                    ..n
                })
            })
        })
        .collect()
}

fn open_one(
    l: &'static Lib,
    name: &str,
    dev: *mut c_void,
    gid_index: u8,
) -> Result<IbvNic, VerbsError> {
    // SAFETY: each call gets the objects it documents; failures return NULL / non-zero.
    unsafe {
        let ctx = (l.open_device)(dev);
        if ctx.is_null() {
            return Err(errno(&format!("ibv_open_device {name}")));
        }
        let mut da = [0u8; DA_SIZE + 64];
        if (l.query_device)(ctx, da.as_mut_ptr()) != 0 {
            return Err(errno(&format!("ibv_query_device {name}")));
        }
        let mut pa = [0u8; 128];
        if (l.query_port)(ctx, 1, pa.as_mut_ptr()) != 0 {
            return Err(errno(&format!("ibv_query_port {name} 1")));
        }
        if rd::<u32>(&pa, PA_STATE) != 4 {
            return Err(VerbsError::Unavailable(format!(
                "{name} port 1 is not active"
            )));
        }
        let link = if rd::<u8>(&pa, PA_LINK_LAYER) == LINK_LAYER_ETHERNET {
            LinkLayer::Ethernet
        } else {
            LinkLayer::Infiniband
        };
        let lid: u16 = rd(&pa, PA_LID);
        if link == LinkLayer::Infiniband && lid == 0 {
            return Err(VerbsError::Unavailable(format!(
                "{name}: InfiniBand port with LID 0 (no subnet manager?)"
            )));
        }
        let mut gid = [0u8; 16];
        if link == LinkLayer::Ethernet
            && (l.query_gid)(ctx, 1, gid_index as c_int, gid.as_mut_ptr()) != 0
        {
            return Err(errno(&format!("ibv_query_gid {name} index {gid_index}")));
        }
        if link == LinkLayer::Ethernet && gid == [0; 16] {
            return Err(VerbsError::Unavailable(format!(
                "{name}: GID index {gid_index} is empty (set gid_index)"
            )));
        }
        let pd = (l.alloc_pd)(ctx);
        if pd.is_null() {
            return Err(errno(&format!("ibv_alloc_pd {name}")));
        }
        // A send queue of at most 4096 WRs per queue pair (what one pull may post on it),
        // and a completion queue of at most 64 Ki entries, within what the device allows.
        let max_qp_wr = rd::<i32>(&da, DA_MAX_QP_WR).clamp(16, 4096) as u32;
        let cqe = rd::<i32>(&da, DA_MAX_CQE).clamp(256, 65_536);
        let cq = (l.create_cq)(ctx, cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0);
        if cq.is_null() {
            return Err(errno(&format!("ibv_create_cq {name}")));
        }
        Ok(IbvNic {
            me: std::sync::Weak::new(),
            idle_us: std::sync::atomic::AtomicU32::new(BUSY_POLL_US),
            lib: l,
            ctx,
            pd,
            cq,
            caps: NicCaps {
                name: name.to_owned(),
                port: 1,
                link,
                lid,
                gid,
                gid_index,
                numa_node: numa_of(name),
                mtu: rd::<u32>(&pa, PA_ACTIVE_MTU).clamp(1, 5) as u8,
                max_qp_wr,
                max_msg_bytes: rd::<u64>(&da, DA_MAX_MR_SIZE).min(1 << 31),
            },
            active_mtu: rd::<u32>(&pa, PA_ACTIVE_MTU),
            max_rd_atomic: rd::<i32>(&da, DA_MAX_QP_RD_ATOM).clamp(1, 16) as u8,
            max_init_rd_atomic: rd::<i32>(&da, DA_MAX_QP_INIT_RD_ATOM).clamp(1, 16) as u8,
            mrs: Mutex::new(Vec::new()),
        })
    }
}

impl Nic for IbvNic {
    fn caps(&self) -> &NicCaps {
        &self.caps
    }

    unsafe fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion, VerbsError> {
        // SAFETY: the caller keeps the range mapped for the NIC's life.
        let mr = unsafe {
            (self.lib.reg_mr)(
                self.pd,
                addr as *mut c_void,
                len as usize,
                ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
            )
        };
        if mr.is_null() {
            return Err(errno(&format!(
                "ibv_reg_mr {} ({len} bytes)",
                self.caps.name
            )));
        }
        // SAFETY: a live `struct ibv_mr` (48 bytes).
        let b = unsafe { std::slice::from_raw_parts(mr as *const u8, 48) };
        let m = MemoryRegion {
            addr,
            len,
            lkey: rd(b, MR_LKEY),
            rkey: rd(b, MR_RKEY),
        };
        self.mrs.lock().push(m);
        Ok(m)
    }

    fn create_qp(&self) -> Result<Box<dyn QueuePair>, VerbsError> {
        let mut init = QpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: std::ptr::null_mut(),
            max_send_wr: self.caps.max_qp_wr,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            qp_type: QPT_RC,
            sq_sig_all: 0,
            _pad: 0,
        };
        // SAFETY: the PD and CQ are live; `init` is a valid init attr.
        let qp = unsafe { (self.lib.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(errno(&format!("ibv_create_qp {}", self.caps.name)));
        }
        // SAFETY: a live `struct ibv_qp` (160 bytes).
        let qpn: u32 = rd(
            unsafe { std::slice::from_raw_parts(qp as *const u8, 160) },
            QP_NUM,
        );
        let psn = (uuid::Uuid::new_v4().as_u128() as u32) & 0xff_ffff;
        let nic = self
            .me
            .upgrade()
            .ok_or_else(|| VerbsError::Device(format!("{} is closing", self.caps.name)))?;
        Ok(Box::new(IbvQp {
            nic,
            qp,
            qpn,
            psn,
            state: Mutex::new(QpState::Reset),
        }))
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize, wait: Duration) -> usize {
        let mut wc = vec![
            Wc {
                wr_id: 0,
                status: 0,
                opcode: 0,
                vendor_err: 0,
                byte_len: 0,
                imm_data: 0,
                qp_num: 0,
                src_qp: 0,
                wc_flags: 0,
                pkey_index: 0,
                slid: 0,
                sl: 0,
                dlid_path_bits: 0,
                _pad: [0; 2],
            };
            max.clamp(1, 256)
        ];
        // SAFETY: the context's ops table holds poll_cq at its ABI offset.
        let poll: PollCq = unsafe { *(self.ctx.cast::<u8>().add(CTX_POLL_CQ) as *const PollCq) };
        let end = Instant::now() + wait;
        loop {
            // SAFETY: a live CQ and a buffer of `wc.len()` entries.
            let n = unsafe { poll(self.cq, wc.len() as c_int, wc.as_mut_ptr()) };
            if n > 0 {
                for w in &wc[..n as usize] {
                    out.push(Completion {
                        wr_id: w.wr_id,
                        qpn: w.qp_num,
                        status: match w.status {
                            0 => WcStatus::Success,
                            4 => WcStatus::LocalProtection,
                            5 => WcStatus::Flushed,
                            10 => WcStatus::RemoteAccess,
                            12 => WcStatus::RetryExceeded,
                            s => WcStatus::Other(s << 16 | (w.vendor_err & 0xffff)),
                        },
                    });
                }
                self.idle_us
                    .store(BUSY_POLL_US, std::sync::atomic::Ordering::Relaxed);
                return n as usize;
            }
            if n < 0 || Instant::now() >= end {
                return 0;
            }
            let us = self.idle_us.load(std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(Duration::from_micros(u64::from(us)));
            self.idle_us.store(
                (us * 2).min(IDLE_POLL_MAX_US),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }
}

/// A queue pair of an [`IbvNic`].
pub struct IbvQp {
    /// The NIC it was made on, kept alive while the queue pair lives.
    nic: Arc<IbvNic>,
    qp: *mut c_void,
    qpn: u32,
    psn: u32,
    state: Mutex<QpState>,
}

// SAFETY: see IbvNic; each queue pair holds its NIC (`nic`), which therefore outlives it.
unsafe impl Send for IbvQp {}
// SAFETY: as above.
unsafe impl Sync for IbvQp {}

/// The path MTU of a connection (verbs numbering, 1 = 256 … 5 = 4096 bytes): the smaller of
/// this port's active MTU and the peer's (`0`: unknown, ours then).
fn path_mtu(mine: u32, theirs: u8) -> u32 {
    let mine = mine.clamp(1, 5);
    match u32::from(theirs) {
        0 => mine,
        t => mine.min(t.clamp(1, 5)),
    }
}

impl Drop for IbvQp {
    fn drop(&mut self) {
        // SAFETY: a live QP, destroyed once.
        unsafe { (self.nic().lib.destroy_qp)(self.qp) };
    }
}

impl IbvQp {
    fn nic(&self) -> &IbvNic {
        &self.nic
    }

    fn modify(&self, to: QpState, attr: &mut [u8; QA_SIZE], mask: c_int) -> Result<(), VerbsError> {
        let mut s = self.state.lock();
        let next = s.go(to)?;
        // SAFETY: a live QP and a full `struct ibv_qp_attr`.
        if unsafe { (self.nic().lib.modify_qp)(self.qp, attr.as_mut_ptr(), mask) } != 0 {
            return Err(errno(&format!("ibv_modify_qp {} -> {to:?}", self.qpn)));
        }
        *s = next;
        Ok(())
    }
}

impl QueuePair for IbvQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }
    fn psn(&self) -> u32 {
        self.psn
    }
    fn state(&self) -> QpState {
        *self.state.lock()
    }
    fn to_init(&self) -> Result<(), VerbsError> {
        let mut a = [0u8; QA_SIZE];
        wr(&mut a, QA_STATE, QPS_INIT);
        wr(&mut a, QA_PKEY_INDEX, 0u16);
        wr(&mut a, QA_PORT, self.nic().caps.port);
        wr(
            &mut a,
            QA_ACCESS,
            (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ) as u32,
        );
        self.modify(
            QpState::Init,
            &mut a,
            QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS,
        )
    }
    fn to_rtr(&self, peer: &QpPeer) -> Result<(), VerbsError> {
        let nic = self.nic();
        if peer.link != nic.caps.link {
            return Err(BadTransition {
                from: self.state(),
                to: QpState::Rtr,
            }
            .into());
        }
        let mut a = [0u8; QA_SIZE];
        wr(&mut a, QA_STATE, QPS_RTR);
        wr(&mut a, QA_PATH_MTU, path_mtu(nic.active_mtu, peer.mtu));
        wr(&mut a, QA_DEST_QPN, peer.qpn);
        wr(&mut a, QA_RQ_PSN, peer.psn);
        wr(&mut a, QA_MAX_DEST_RD_ATOMIC, nic.max_rd_atomic);
        wr(&mut a, QA_MIN_RNR_TIMER, 12u8);
        wr(&mut a, QA_AH + AH_PORT, nic.caps.port);
        match peer.link {
            LinkLayer::Infiniband => {
                if peer.lid == 0 {
                    return Err(VerbsError::Device("peer InfiniBand LID 0".into()));
                }
                wr(&mut a, QA_AH + AH_DLID, peer.lid);
            }
            LinkLayer::Ethernet => {
                wr(&mut a, QA_AH + AH_IS_GLOBAL, 1u8);
                a[QA_AH + AH_DGID..QA_AH + AH_DGID + 16].copy_from_slice(&peer.gid);
                wr(&mut a, QA_AH + AH_SGID_INDEX, nic.caps.gid_index);
                wr(&mut a, QA_AH + AH_HOP_LIMIT, 64u8);
            }
        }
        self.modify(
            QpState::Rtr,
            &mut a,
            QP_STATE
                | QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER,
        )
    }
    fn to_rts(&self) -> Result<(), VerbsError> {
        let mut a = [0u8; QA_SIZE];
        wr(&mut a, QA_STATE, QPS_RTS);
        // 4.096 µs × 2^14 ≈ 67 ms per try, 7 retries: a dead peer fails in about 0.5 s.
        wr(&mut a, QA_TIMEOUT, 14u8);
        wr(&mut a, QA_RETRY_CNT, 7u8);
        wr(&mut a, QA_RNR_RETRY, 7u8);
        wr(&mut a, QA_SQ_PSN, self.psn);
        wr(&mut a, QA_MAX_RD_ATOMIC, self.nic().max_init_rd_atomic);
        self.modify(
            QpState::Rts,
            &mut a,
            QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC,
        )
    }
    fn to_error(&self) -> Result<(), VerbsError> {
        if self.state() == QpState::Error {
            return Ok(());
        }
        let mut a = [0u8; QA_SIZE];
        wr(&mut a, QA_STATE, QPS_ERR);
        self.modify(QpState::Error, &mut a, QP_STATE)
    }
    unsafe fn post_read(&self, wrs: &[ReadWr]) -> Result<(), VerbsError> {
        let s = self.state();
        if !matches!(s, QpState::Rts | QpState::Error) {
            return Err(VerbsError::Post(format!("queue pair in {s:?}")));
        }
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Sge> = wrs
            .iter()
            .map(|w| Sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut list: Vec<SendWr> = wrs
            .iter()
            .enumerate()
            .map(|(i, w)| SendWr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: &mut sges[i],
                num_sge: (w.len > 0) as c_int,
                opcode: WR_RDMA_READ,
                send_flags: if w.signaled { SEND_SIGNALED } else { 0 },
                imm_data: 0,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                _rest: [0; 76],
            })
            .collect();
        for i in 1..list.len() {
            let next: *mut SendWr = &mut list[i];
            list[i - 1].next = next;
        }
        let nic = self.nic();
        // SAFETY: the context's ops table holds post_send at its ABI offset.
        let post: PostSend =
            unsafe { *(nic.ctx.cast::<u8>().add(CTX_POST_SEND) as *const PostSend) };
        let mut bad: *mut SendWr = std::ptr::null_mut();
        // SAFETY: a live QP; the list and its SGEs live across the call (the provider
        // copies them into the send queue); the caller keeps the local buffers valid.
        let rc = unsafe { post(self.qp, list.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(VerbsError::Post(format!(
                "ibv_post_send on QPN {}: {}",
                self.qpn,
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_path_mtu_is_the_smaller_ports() {
        assert_eq!(super::path_mtu(5, 3), 3, "4096 here, 1024 there: 1024");
        assert_eq!(super::path_mtu(3, 5), 3);
        assert_eq!(super::path_mtu(4, 0), 4, "an unknown peer MTU: ours");
        assert_eq!(super::path_mtu(0, 0), 1, "never below 256 bytes");
        assert_eq!(super::path_mtu(9, 9), 5, "never above 4096 bytes");
    }

    use super::*;

    /// On a machine without the library or without devices, opening reports RDMA
    /// unavailable (never a panic); with devices, each opened NIC declares sane caps.
    #[test]
    fn opening_without_hardware_reports_unavailable() {
        match open(&[], 3) {
            Err(VerbsError::Unavailable(why)) => {
                pegaflow_test_skip::skip_part!(
                    "the hardware part: RDMA unavailable here, as expected: {why}"
                )
            }
            Err(e) => panic!("expected Unavailable, got {e}"),
            Ok(nics) => {
                for n in &nics {
                    assert!(n.caps().max_qp_wr >= 16, "{:?}", n.caps());
                }
            }
        }
        match open(&["no-such-nic".into()], 3) {
            Err(VerbsError::Unavailable(_)) => {}
            other => panic!("a missing device is unavailable: {other:?}"),
        }
    }
}
