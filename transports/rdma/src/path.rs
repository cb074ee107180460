//! The RDMA data path over any [`Nic`] backend: both roles of one server.
//!
//! - **Registration**: the landing pool's regions are registered once per NIC, on first
//!   use (the holder's first handshake, the requester's first fetch); the engine keeps the
//!   regions mapped for as long as it lives.
//! - **Requester** ([`Engine`] as [`PeerDataPath`] and [`Handshake`]): the handshake creates
//!   `qps_per_peer` queue pairs per local NIC, offers them, and connects those the holder
//!   linked (Init → RTR → RTS); a pull splits every range into READs of at most
//!   `max_wr_bytes` over the connection's queue pairs, signals every `signal_every`-th WR
//!   and the last of each queue pair (RC completes in order: the last signalled
//!   completion of a queue pair means all its READs landed), and waits for those
//!   completions, which a **poller thread per NIC** routes to the pull by `wr_id`.
//! - **Holder** ([`Engine::answer`]): pairs the offer's NICs with its own
//!   ([`crate::codec::pair`]), creates and connects one queue pair per linked requester
//!   queue pair, keyed by the requester's id and the connection id it chose (never by queue
//!   pair numbers: a simultaneous mutual handshake is two independent connections), keeps
//!   each requester's newest [`CONNS_PER_PEER`], and answers its NICs with the pool's
//!   regions and rkeys.
//!
//! Must never: let a destination be freed while a READ may still write into it. On any
//! error completion, timeout or cancellation (the pull future dropped), every queue pair
//! the pull used goes to Error, a signalled marker WR is posted behind its READs, and the
//! destinations stay held (counted in `pegaflow_rdma_draining_bytes`) until every marker
//! has completed: then no READ of the pull is still running, and the buffers go back to
//! the pool. A connection that failed is never used again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{HostBuffer, HostPool, HostRegion, PeerDataError, PeerDataPath, PeerRead};
use pegaflow_transport_tcp::fetch::{Exchange, Handshake, HandshakeError};
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::codec::{self, Kind, LinkInfo, Meta, MrInfo, NicInfo, QpInfo};
use crate::verbs::{
    Completion, MemoryRegion, Nic, QpPeer, QpState, QueuePair, ReadWr, VerbsError, WcStatus,
};

/// The low `wr_id` bits number a WR within its pull; the high bits are the pull's id.
const WR_INDEX_BITS: u32 = 24;
/// The index of a pull's drain markers.
const MARKER: u64 = (1 << WR_INDEX_BITS) - 1;
/// Queue pairs one offer may ask the holder to create, at most (16 NICs × 64).
pub const MAX_OFFERED_QPS: usize = 1024;
/// Connections kept per peer (requester side) and per requester (holder side): a new
/// handshake keeps the newest few, so concurrent fetches that handshake at the same moment
/// do not cut each other's connection.
pub const CONNS_PER_PEER: usize = 4;

/// Holder-side queue pairs kept over all requesters at most: beyond it the oldest
/// connections go (each answer makes up to [`MAX_OFFERED_QPS`], and requester ids cost a
/// caller nothing, so the connection caps alone would not bound them).
pub const MAX_HOLDER_QPS: usize = 4096;

/// Settings of the data path.
#[derive(Debug, Clone, Copy)]
pub struct PathLimits {
    /// Queue pairs per local NIC per peer.
    pub qps_per_peer: usize,
    /// Bytes one READ moves at most.
    pub max_wr_bytes: u64,
    /// Every how many READs of a queue pair one is signalled (the last always is).
    pub signal_every: usize,
    /// Holder connections kept at once (one per requester), at most.
    pub max_holder_connections: usize,
}

/// The data path's metric families (invariant: `pegaflow_rdma_draining_bytes` is 0 when
/// no failed pull is waiting for its queue pairs to drain).
#[derive(Clone)]
pub struct RdmaMetrics {
    /// Bytes of destination buffers held until their queue pairs drain.
    pub draining_bytes: IntGauge,
    /// Pulls that ended in a drain, by how the drain ended: `drained` (every marker
    /// completed), `stuck` (a marker could not be posted: the buffers stay held).
    pub drains: IntCounterVec,
    /// Completions polled, by status: `success`, `remote_access`, `local_protection`,
    /// `retry_exceeded`, `flushed`, `other`.
    pub completions: IntCounterVec,
    /// Completions for a pull that no longer waits for them (counted, ignored).
    pub stray_completions: IntCounter,
    /// READ work requests posted.
    pub wrs_posted: IntCounter,
    /// Live queue pairs (both roles).
    pub queue_pairs: IntGauge,
}

impl RdmaMetrics {
    /// Registers the families in `registry` (an already registered family is reused
    /// unregistered, as the tcp crate's are).
    pub fn new(registry: &Registry) -> Self {
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            let _ = r.register(Box::new(c.clone()));
            c
        }
        Self {
            draining_bytes: reg(
                registry,
                IntGauge::new(
                    "pegaflow_rdma_draining_bytes",
                    "Bytes of fetch buffers held until the queue pairs that read into them have drained",
                )
                .expect("metric"),
            ),
            drains: reg(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_rdma_drains_total",
                        "Failed or cancelled RDMA pulls drained before their buffers were freed, by outcome",
                    ),
                    &["outcome"],
                )
                .expect("metric"),
            ),
            completions: reg(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "pegaflow_rdma_completions_total",
                        "RDMA work completions polled, by status",
                    ),
                    &["status"],
                )
                .expect("metric"),
            ),
            stray_completions: reg(
                registry,
                IntCounter::new(
                    "pegaflow_rdma_stray_completions_total",
                    "RDMA completions of pulls that no longer wait for them",
                )
                .expect("metric"),
            ),
            wrs_posted: reg(
                registry,
                IntCounter::new(
                    "pegaflow_rdma_wrs_posted_total",
                    "RDMA READ work requests posted",
                )
                .expect("metric"),
            ),
            queue_pairs: reg(
                registry,
                IntGauge::new("pegaflow_rdma_queue_pairs", "Live RDMA queue pairs")
                    .expect("metric"),
            ),
        }
    }
}

fn status_label(s: WcStatus) -> &'static str {
    match s {
        WcStatus::Success => "success",
        WcStatus::RemoteAccess => "remote_access",
        WcStatus::LocalProtection => "local_protection",
        WcStatus::RetryExceeded => "retry_exceeded",
        WcStatus::Flushed => "flushed",
        WcStatus::Other(_) => "other",
    }
}

/// What a failed pull keeps alive until its queue pairs have drained.
struct Hold {
    _dests: Vec<Arc<HostBuffer>>,
    _conn: Arc<Conn>,
    bytes: u64,
}

enum Entry {
    /// A pull waiting for its completions.
    Live(tokio::sync::mpsc::UnboundedSender<Completion>),
    /// A failed pull whose queue pairs drain: `markers` still to complete.
    Draining { markers: usize, hold: Hold },
}

/// A queue pair counted in the `queue_pairs` gauge while it lives.
struct Qp {
    qp: Box<dyn QueuePair>,
    gauge: IntGauge,
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// One requester-side connection to a holder.
struct Conn {
    /// `(local NIC, holder NIC, queue pair)`.
    qps: Vec<(usize, usize, Qp)>,
    /// The holder's regions per holder NIC, as its answer advertised them.
    holder_mrs: Vec<Vec<MrInfo>>,
    broken: AtomicBool,
    /// Creation order (the oldest of a peer's go first).
    seq: u64,
}

/// One holder-side connection (its queue pairs).
struct HolderConn {
    _qps: Vec<Qp>,
    seq: u64,
}

/// The data path over a set of NICs.
pub struct Engine {
    kind: &'static str,
    nics: Vec<Arc<dyn Nic>>,
    limits: PathLimits,
    /// The pool's regions registered per NIC (`local[nic]`), once.
    local: Mutex<Option<Vec<Vec<MemoryRegion>>>>,
    /// Why the pool's registration failed, once it did: not retried (regions already
    /// registered on the NICs before the failing one stay registered, and a retry would add
    /// more of them each time).
    register_failed: Mutex<Option<VerbsError>>,
    /// Keeps the registered regions mapped.
    regions: Mutex<Vec<HostRegion>>,
    pending: Arc<Mutex<HashMap<u64, Entry>>>,
    next_pull: AtomicU64,
    conns: Mutex<HashMap<String, Arc<Conn>>>,
    /// By `(requester id, connection id)`.
    holder_conns: Mutex<HashMap<(String, u64), HolderConn>>,
    /// Creation order of connections, both roles.
    holder_seq: AtomicU64,
    /// The holder's fabric address (the emulator's socket), sent in answers.
    fabric: String,
    /// Fault: advertise rkeys that do not match (the emulator's key-mismatch fault).
    wrong_rkey: bool,
    stop: Arc<AtomicBool>,
    metrics: RdmaMetrics,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("kind", &self.kind)
            .field("nics", &self.nics.len())
            .finish()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Engine {
    /// An engine named `kind` (metric label) over `nics`, with one poller thread per NIC.
    ///
    /// # Errors
    /// No NIC, or a poller thread cannot be started.
    pub fn new(
        kind: &'static str,
        nics: Vec<Arc<dyn Nic>>,
        limits: PathLimits,
        fabric: String,
        wrong_rkey: bool,
        metrics: RdmaMetrics,
    ) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(!nics.is_empty(), "{kind}: no NIC");
        let e = Arc::new(Self {
            kind,
            nics,
            limits,
            local: Mutex::new(None),
            register_failed: Mutex::new(None),
            regions: Mutex::new(Vec::new()),
            pending: Arc::new(Mutex::new(HashMap::new())),
            next_pull: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            holder_conns: Mutex::new(HashMap::new()),
            holder_seq: AtomicU64::new(0),
            fabric,
            wrong_rkey,
            stop: Arc::new(AtomicBool::new(false)),
            metrics,
        });
        for (i, nic) in e.nics.iter().enumerate() {
            let (nic, pending, stop, m) = (
                nic.clone(),
                e.pending.clone(),
                e.stop.clone(),
                e.metrics.clone(),
            );
            std::thread::Builder::new()
                .name(format!("rdma-poll-{i}"))
                .spawn(move || poller(&*nic, &pending, &stop, &m))?;
        }
        Ok(e)
    }

    /// The metric families.
    pub fn metrics(&self) -> &RdmaMetrics {
        &self.metrics
    }

    /// The NICs.
    pub fn nics(&self) -> &[Arc<dyn Nic>] {
        &self.nics
    }

    /// Registers `pool`'s regions on every NIC, once (later calls return at once).
    ///
    /// # Errors
    /// A registration failed (the device's message).
    pub fn register_pool(&self, pool: &Arc<dyn HostPool>) -> Result<(), VerbsError> {
        if self.local.lock().is_some() {
            return Ok(());
        }
        self.register_regions(pool.regions())
    }

    /// [`Engine::register_pool`] from async code: the first registration (which pins the
    /// whole pool on every NIC and can take seconds) runs on a blocking thread, not on the
    /// caller's async worker; later calls return at once.
    ///
    /// # Errors
    /// As [`Engine::register_pool`]; a failure is remembered and returned again.
    pub async fn register_pool_async(
        self: &Arc<Self>,
        pool: &Arc<dyn HostPool>,
    ) -> Result<(), VerbsError> {
        if self.local.lock().is_some() {
            return Ok(());
        }
        let (me, pool) = (self.clone(), pool.clone());
        tokio::task::spawn_blocking(move || me.register_pool(&pool))
            .await
            .map_err(|e| VerbsError::Device(format!("pool registration task: {e}")))?
    }

    /// Registers `regions` on every NIC, unless a registration happened already; the
    /// engine holds the regions (their owners keep them mapped) for as long as it lives.
    ///
    /// # Errors
    /// A registration failed (the device's message).
    pub fn register_regions(&self, regions: Vec<HostRegion>) -> Result<(), VerbsError> {
        let mut local = self.local.lock();
        if local.is_some() {
            return Ok(());
        }
        if let Some(e) = self.register_failed.lock().clone() {
            return Err(e);
        }
        let mut per_nic = Vec::with_capacity(self.nics.len());
        for nic in &self.nics {
            let mut mrs = Vec::with_capacity(regions.len());
            for r in &regions {
                // SAFETY: the regions are kept mapped for as long as the engine lives: by
                // `self.regions` on success, and on failure by leaking them below (the
                // registrations made before the failure stay with the NIC).
                match unsafe { nic.register(r.addr as u64, r.len as u64) } {
                    Ok(m) => mrs.push(m),
                    Err(e) => {
                        *self.register_failed.lock() = Some(e.clone());
                        std::mem::forget(regions);
                        return Err(e);
                    }
                }
            }
            per_nic.push(mrs);
        }
        *self.regions.lock() = regions;
        *local = Some(per_nic);
        Ok(())
    }

    fn nic_info(&self, i: usize, mrs: Vec<MrInfo>, qps: Vec<QpInfo>) -> NicInfo {
        let c = self.nics[i].caps();
        NicInfo {
            link: c.link,
            port: c.port,
            lid: c.lid,
            gid: c.gid,
            gid_index: c.gid_index,
            numa_node: c.numa_node,
            mtu: c.mtu,
            mrs,
            qps,
        }
    }

    fn new_qp(&self, nic: usize) -> Result<Qp, VerbsError> {
        let qp = self.nics[nic].create_qp()?;
        self.metrics.queue_pairs.inc();
        let qp = Qp {
            qp,
            gauge: self.metrics.queue_pairs.clone(),
        };
        qp.qp.to_init()?;
        Ok(qp)
    }

    /// The holder's answer to `offer` from `requester` (its pool registered already):
    /// pairs NICs, connects one queue pair per linked requester queue pair, replaces the
    /// requester's previous connection.
    ///
    /// # Errors
    /// The offer is not an offer, the pool is not registered, or a verbs call failed.
    pub fn answer(&self, requester: &str, offer: &Meta) -> Result<Meta, VerbsError> {
        if offer.kind != Kind::Offer {
            return Err(VerbsError::Device("expected an offer".into()));
        }
        let offered: usize = offer.nics.iter().map(|n| n.qps.len()).sum();
        if offered > MAX_OFFERED_QPS {
            return Err(VerbsError::Device(format!(
                "an offer of {offered} queue pairs (at most {MAX_OFFERED_QPS})"
            )));
        }
        let local = self
            .local
            .lock()
            .clone()
            .ok_or_else(|| VerbsError::Device("the pool is not registered".into()))?;
        let mine: Vec<NicInfo> = (0..self.nics.len())
            .map(|i| self.nic_info(i, Vec::new(), Vec::new()))
            .collect();
        let pairs = codec::pair(&offer.nics, &mine);
        let mut qps = Vec::new();
        let mut per_nic: Vec<Vec<QpInfo>> = vec![Vec::new(); self.nics.len()];
        let mut links = Vec::new();
        for (ri, r) in offer.nics.iter().enumerate() {
            for (qi, q) in r.qps.iter().enumerate() {
                let Some(h) = pairs[ri][qi] else { continue };
                let qp = self.new_qp(h)?;
                qp.qp.to_rtr(&QpPeer {
                    qpn: q.qpn,
                    psn: q.psn,
                    lid: r.lid,
                    gid: r.gid,
                    link: r.link,
                    mtu: r.mtu,
                    fabric: String::new(),
                })?;
                qp.qp.to_rts()?;
                per_nic[h].push(QpInfo {
                    qpn: qp.qp.qpn(),
                    psn: qp.qp.psn(),
                });
                links.push(LinkInfo {
                    requester_qpn: q.qpn,
                    holder_nic: h as u8,
                    holder_qpn: qp.qp.qpn(),
                });
                qps.push(qp);
            }
        }
        let nics = per_nic
            .into_iter()
            .enumerate()
            .map(|(i, q)| {
                let mrs = local[i]
                    .iter()
                    .map(|m| MrInfo {
                        addr: m.addr,
                        len: m.len,
                        rkey: if self.wrong_rkey {
                            m.rkey ^ 0x5a5a_0000
                        } else {
                            m.rkey
                        },
                    })
                    .collect();
                self.nic_info(i, mrs, q)
            })
            .collect();
        let seq = self.holder_seq.fetch_add(1, Ordering::Relaxed);
        let mut hc = self.holder_conns.lock();
        hc.insert(
            (requester.to_owned(), offer.conn_id),
            HolderConn { _qps: qps, seq },
        );
        // The requester's oldest beyond CONNS_PER_PEER, then the oldest of all beyond
        // max_connections.
        loop {
            let mine = hc.keys().filter(|(r, _)| r == requester).count();
            let total_qps: usize = hc.values().map(|c| c._qps.len()).sum();
            let victim = if mine > CONNS_PER_PEER {
                hc.iter()
                    .filter(|((r, _), _)| r == requester)
                    .min_by_key(|(_, c)| c.seq)
                    .map(|(k, _)| k.clone())
            } else if hc.len() > self.limits.max_holder_connections
                || (total_qps > MAX_HOLDER_QPS && hc.len() > 1)
            {
                hc.iter().min_by_key(|(_, c)| c.seq).map(|(k, _)| k.clone())
            } else {
                None
            };
            match victim {
                Some(k) => {
                    hc.remove(&k);
                }
                None => break,
            }
        }
        Ok(Meta {
            kind: Kind::Answer,
            conn_id: offer.conn_id,
            fabric: self.fabric.clone(),
            nics,
            links,
        })
    }

    /// Drops `requester`'s holder-side connections (their queue pairs): the requester is
    /// gone. Returns how many there were.
    pub fn forget_requester(&self, requester: &str) -> usize {
        let mut hc = self.holder_conns.lock();
        let before = hc.len();
        hc.retain(|(r, _), _| r != requester);
        before - hc.len()
    }

    fn conn(&self, endpoint: &str) -> Option<Arc<Conn>> {
        self.conns
            .lock()
            .get(endpoint)
            .filter(|c| !c.broken.load(Ordering::Acquire))
            .cloned()
    }

    fn lkey(&self, nic: usize, addr: u64, len: u64) -> Option<u32> {
        self.local
            .lock()
            .as_ref()?
            .get(nic)?
            .iter()
            .find(|m| m.contains(addr, len))
            .map(|m| m.lkey)
    }

    /// The READs of `reads` per queue pair of `conn`, `wr_id`s under pull `pull`. Ranges
    /// contiguous on both sides (a block's K and V slots, consecutive slots of one holder
    /// buffer landing in one local buffer) are coalesced into one READ of up to
    /// `max_wr_bytes` while they stay inside one registered region on each side, so a block
    /// of many layers costs about `block bytes / max_wr_bytes` READs, not one per range.
    fn plan(
        &self,
        conn: &Conn,
        pull: u64,
        reads: &[PeerRead],
    ) -> Result<(Vec<Vec<ReadWr>>, usize), PeerDataError> {
        let n = conn.qps.len();
        let max = self.limits.max_wr_bytes;
        // Every NIC registers the same regions (the pool), so one NIC's tables decide
        // whether a coalesced range stays inside one region.
        let (lnic0, hnic0, _) = conn.qps[0];
        let local_region = |addr: u64, len: u64| self.lkey(lnic0, addr, len).is_some();
        let holder_region = |addr: u64, len: u64| {
            conn.holder_mrs[hnic0].iter().any(|m| {
                addr >= m.addr
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= m.addr.saturating_add(m.len))
            })
        };
        // (local addr, remote addr, len), in pull order.
        let mut segs: Vec<(u64, u64, u64)> = Vec::new();
        for r in reads {
            let mut off = r.dest_offset;
            for rr in &r.ranges {
                let mut raddr = rr.addr;
                for piece in r.dest.pieces(off, rr.len as usize) {
                    let mut laddr = piece.addr as u64;
                    let mut left = piece.len as u64;
                    while left > 0 {
                        if let Some(last) = segs.last_mut() {
                            let (l0, r0, n0) = *last;
                            if l0 + n0 == laddr && r0 + n0 == raddr && n0 < max {
                                let add = left.min(max - n0);
                                if local_region(l0, n0 + add) && holder_region(r0, n0 + add) {
                                    last.2 += add;
                                    laddr += add;
                                    raddr += add;
                                    left -= add;
                                    continue;
                                }
                            }
                        }
                        let len = left.min(max);
                        segs.push((laddr, raddr, len));
                        laddr += len;
                        raddr += len;
                        left -= len;
                    }
                }
                off += rr.len as usize;
            }
        }
        if segs.len() as u64 >= MARKER {
            return Err(PeerDataError::Refused("too many READs in one pull".into()));
        }
        let mut per_qp: Vec<Vec<ReadWr>> = vec![Vec::with_capacity(segs.len() / n + 1); n];
        for (k, &(laddr, raddr, len)) in segs.iter().enumerate() {
            let q = k % n;
            let (lnic, hnic, _) = &conn.qps[q];
            let lkey = self.lkey(*lnic, laddr, len).ok_or_else(|| {
                PeerDataError::Refused("a destination outside this node's registered pool".into())
            })?;
            let rkey = conn.holder_mrs[*hnic]
                .iter()
                .find(|m| {
                    raddr >= m.addr
                        && raddr
                            .checked_add(len)
                            .is_some_and(|e| e <= m.addr.saturating_add(m.len))
                })
                .map(|m| m.rkey)
                .ok_or_else(|| {
                    PeerDataError::Refused(format!(
                        "range {raddr:#x}+{len} outside the holder's registered regions"
                    ))
                })?;
            per_qp[q].push(ReadWr {
                wr_id: pull << WR_INDEX_BITS | (k as u64 + 1),
                local_addr: laddr,
                lkey,
                remote_addr: raddr,
                rkey,
                len: len as u32,
                signaled: false,
            });
        }
        let mut signalled = 0;
        for (q, wrs) in per_qp.iter_mut().enumerate() {
            let depth = self.nics[conn.qps[q].0].caps().max_qp_wr as usize;
            if wrs.len() + 1 > depth {
                return Err(PeerDataError::Refused(format!(
                    "{} READs on one queue pair exceed its depth {depth} (lower max_fetch_bytes or raise max_wr_bytes)",
                    wrs.len()
                )));
            }
            let last = wrs.len();
            for (i, w) in wrs.iter_mut().enumerate() {
                w.signaled = (i + 1) % self.limits.signal_every == 0 || i + 1 == last;
                signalled += w.signaled as usize;
            }
        }
        Ok((per_qp, signalled))
    }
}

/// Routes one NIC's completions to the pulls waiting for them, and ends drains.
fn poller(nic: &dyn Nic, pending: &Mutex<HashMap<u64, Entry>>, stop: &AtomicBool, m: &RdmaMetrics) {
    let mut buf = Vec::with_capacity(64);
    while !stop.load(Ordering::Acquire) {
        buf.clear();
        if nic.poll(&mut buf, 64, Duration::from_millis(20)) == 0 {
            continue;
        }
        for c in &buf {
            m.completions
                .with_label_values(&[status_label(c.status)])
                .inc();
            let pull = c.wr_id >> WR_INDEX_BITS;
            let mut done = None;
            {
                let mut p = pending.lock();
                match p.get_mut(&pull) {
                    Some(Entry::Live(tx)) => {
                        let _ = tx.send(*c);
                    }
                    Some(Entry::Draining { markers, .. }) => {
                        if c.wr_id & MARKER == MARKER {
                            *markers -= 1;
                            if *markers == 0 {
                                done = p.remove(&pull);
                            }
                        }
                    }
                    None => m.stray_completions.inc(),
                }
            }
            if let Some(Entry::Draining { hold, .. }) = done {
                m.draining_bytes.sub(hold.bytes as i64);
                m.drains.with_label_values(&["drained"]).inc();
                // The buffers go back to the pool here, after every READ into them ended.
                drop(hold);
            }
        }
    }
}

/// A pull in flight: unless [`InFlight::done`], dropping it (an error, a timeout, the
/// future cancelled) fences its queue pairs and hands its buffers to the drain.
struct InFlight<'a> {
    engine: &'a Engine,
    pull: u64,
    conn: Arc<Conn>,
    used: Vec<usize>,
    dests: Vec<Arc<HostBuffer>>,
    bytes: u64,
    armed: bool,
}

impl InFlight<'_> {
    fn done(mut self) {
        self.armed = false;
        self.engine.pending.lock().remove(&self.pull);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let e = self.engine;
        self.conn.broken.store(true, Ordering::Release);
        e.conns.lock().retain(|_, c| !Arc::ptr_eq(c, &self.conn));
        let hold = Hold {
            _dests: std::mem::take(&mut self.dests),
            _conn: self.conn.clone(),
            bytes: self.bytes,
        };
        e.metrics.draining_bytes.add(self.bytes as i64);
        // Draining first, so that the poller finds the entry when a marker completes.
        e.pending.lock().insert(
            self.pull,
            Entry::Draining {
                markers: self.used.len(),
                hold,
            },
        );
        let mut stuck = false;
        for &q in &self.used {
            let qp = &self.conn.qps[q].2.qp;
            let _ = qp.to_error();
            let marker = ReadWr {
                wr_id: self.pull << WR_INDEX_BITS | MARKER,
                local_addr: 0,
                lkey: 0,
                remote_addr: 0,
                rkey: 0,
                len: 0,
                signaled: true,
            };
            // SAFETY: a zero-length READ touches no memory.
            if unsafe { qp.post_read(&[marker]) }.is_err() {
                stuck = true;
            }
        }
        if stuck {
            // Without its marker a queue pair's end cannot be observed: the buffers stay
            // held (never freed under a possible DMA).
            e.metrics.drains.with_label_values(&["stuck"]).inc();
            tracing::error!(
                pull = self.pull,
                bytes = self.bytes,
                "rdma: a drain marker could not be posted; the pull's buffers stay held"
            );
        }
    }
}

fn wc_error(s: WcStatus) -> PeerDataError {
    match s {
        WcStatus::RemoteAccess => PeerDataError::Refused(
            "the holder refused the READ (remote access error: rkey or bounds)".into(),
        ),
        WcStatus::RetryExceeded | WcStatus::Flushed => {
            PeerDataError::Unreachable(format!("RDMA completion: {}", status_label(s)))
        }
        WcStatus::LocalProtection => PeerDataError::Refused("local protection error".into()),
        WcStatus::Other(v) => PeerDataError::Unreachable(format!("RDMA completion error {v:#x}")),
        WcStatus::Success => PeerDataError::Unreachable("unexpected success".into()),
    }
}

fn verbs_unreachable(e: VerbsError) -> PeerDataError {
    PeerDataError::Unreachable(e.to_string())
}

#[async_trait]
impl PeerDataPath for Engine {
    fn kind(&self) -> &'static str {
        self.kind
    }

    async fn connect(&self, endpoint: &str, _deadline: Instant) -> Result<(), PeerDataError> {
        match self.conn(endpoint) {
            Some(_) => Ok(()),
            None => Err(PeerDataError::Unreachable(format!(
                "no live RDMA connection {endpoint}"
            ))),
        }
    }

    async fn pull(
        &self,
        endpoint: &str,
        _session: &str,
        reads: Vec<PeerRead>,
        deadline: Instant,
    ) -> Result<(), PeerDataError> {
        let conn = self.conn(endpoint).ok_or_else(|| {
            PeerDataError::Unreachable(format!("no live RDMA connection {endpoint}"))
        })?;
        let pull = self.next_pull.fetch_add(1, Ordering::Relaxed);
        let (plan, mut left) = self.plan(&conn, pull, &reads)?;
        if left == 0 {
            return Ok(());
        }
        let bytes = reads.iter().map(|r| r.dest.len() as u64).sum();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.pending.lock().insert(pull, Entry::Live(tx));
        let used: Vec<usize> = (0..plan.len()).filter(|&q| !plan[q].is_empty()).collect();
        let flight = InFlight {
            engine: self,
            pull,
            conn: conn.clone(),
            used,
            dests: reads.iter().map(|r| r.dest.clone()).collect(),
            bytes,
            armed: true,
        };
        drop(reads);
        for (q, wrs) in plan.iter().enumerate() {
            if wrs.is_empty() {
                continue;
            }
            // SAFETY: every destination is held by `flight` until the queue pair's last
            // signalled completion (success) or its drain marker (failure) has been polled.
            unsafe { conn.qps[q].2.qp.post_read(wrs) }.map_err(verbs_unreachable)?;
            self.metrics.wrs_posted.inc_by(wrs.len() as u64);
        }
        loop {
            match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
                Err(_) => return Err(PeerDataError::Timeout),
                Ok(None) => return Err(PeerDataError::Unreachable("completion queue gone".into())),
                Ok(Some(c)) if c.status == WcStatus::Success => {
                    left -= 1;
                    if left == 0 {
                        flight.done();
                        return Ok(());
                    }
                }
                Ok(Some(c)) => return Err(wc_error(c.status)),
            }
        }
    }
}

#[async_trait]
impl Handshake for Engine {
    async fn handshake(
        &self,
        node: &str,
        rpc: &mut dyn Exchange,
        _deadline: Instant,
    ) -> Result<String, HandshakeError> {
        let data = |e: VerbsError| HandshakeError::Data(verbs_unreachable(e));
        let mut mine: Vec<(usize, Qp)> = Vec::new();
        let mut nics = Vec::with_capacity(self.nics.len());
        for i in 0..self.nics.len() {
            let mut qps = Vec::new();
            for _ in 0..self.limits.qps_per_peer {
                let qp = self.new_qp(i).map_err(data)?;
                qps.push(QpInfo {
                    qpn: qp.qp.qpn(),
                    psn: qp.qp.psn(),
                });
                mine.push((i, qp));
            }
            nics.push(self.nic_info(i, Vec::new(), qps));
        }
        let conn_id = uuid::Uuid::new_v4().as_u128() as u64;
        let offer = Meta {
            kind: Kind::Offer,
            conn_id,
            fabric: String::new(),
            nics,
            links: Vec::new(),
        };
        let answer = rpc
            .exchange(offer.encode())
            .await
            .map_err(HandshakeError::Rpc)?;
        let a = Meta::decode(&answer).map_err(|e| HandshakeError::Refused(e.to_string()))?;
        if a.kind != Kind::Answer || a.conn_id != conn_id {
            return Err(HandshakeError::Refused(
                "the answer is not for this offer (kind or connection id)".into(),
            ));
        }
        if a.links.is_empty() {
            return Err(HandshakeError::Refused(
                "the holder paired none of this node's NICs (no common link layer)".into(),
            ));
        }
        // Connect the linked queue pairs (the emulator's RTR opens its fabric link, a
        // blocking local connect: off the async workers).
        let fabric = a.fabric.clone();
        let linked = tokio::task::spawn_blocking(move || {
            let mut linked = Vec::new();
            for l in &a.links {
                let Some(pos) = mine.iter().position(|(_, q)| q.qp.qpn() == l.requester_qpn) else {
                    return Err(VerbsError::Device(format!(
                        "the answer links QPN {} this node did not offer",
                        l.requester_qpn
                    )));
                };
                let (lnic, qp) = mine.swap_remove(pos);
                let h = &a.nics[l.holder_nic as usize];
                let psn = h
                    .qps
                    .iter()
                    .find(|q| q.qpn == l.holder_qpn)
                    .map_or(0, |q| q.psn);
                qp.qp.to_rtr(&QpPeer {
                    qpn: l.holder_qpn,
                    psn,
                    lid: h.lid,
                    gid: h.gid,
                    link: h.link,
                    mtu: h.mtu,
                    fabric: fabric.clone(),
                })?;
                qp.qp.to_rts()?;
                debug_assert_eq!(qp.qp.state(), QpState::Rts);
                linked.push((lnic, l.holder_nic as usize, qp));
            }
            Ok((linked, a.nics.iter().map(|n| n.mrs.clone()).collect()))
        })
        .await
        .map_err(|e| HandshakeError::Refused(format!("handshake task: {e}")))?;
        let (qps, holder_mrs) = linked.map_err(data)?;
        let conn = Arc::new(Conn {
            qps,
            holder_mrs,
            broken: AtomicBool::new(false),
            seq: self.holder_seq.fetch_add(1, Ordering::Relaxed),
        });
        let endpoint = format!("{node}#{conn_id:016x}");
        let mut conns = self.conns.lock();
        conns.insert(endpoint.clone(), conn);
        // Keep this peer's newest few (a concurrent fetch may be about to use another).
        let mut mine: Vec<(String, u64)> = conns
            .iter()
            .filter(|(k, _)| k.rsplit_once('#').map(|(n, _)| n) == Some(node))
            .map(|(k, c)| (k.clone(), c.seq))
            .collect();
        if mine.len() > CONNS_PER_PEER {
            mine.sort_by_key(|(_, seq)| *seq);
            for (k, _) in &mine[..mine.len() - CONNS_PER_PEER] {
                conns.remove(k);
            }
        }
        Ok(endpoint)
    }

    fn one_sided(&self) -> bool {
        true
    }
}
