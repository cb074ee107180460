//! Transfer locks (source side): blocks a peer is about to read, pinned under a session id.
//!
//! A session is a lease. `QueryBlocksForTransfer` creates it with `lease` to live; every
//! read on the data port that names it, and every socket write of its bytes, renews it
//! (data flowing = the requester is alive);
//! it never lives beyond `cap` (`--transfer-lock-timeout-secs`) from its creation. It ends
//! at the first of: `ReleaseTransferLock`, the requester's last data connection closing
//! (a killed requester releases at once), its lease running out (a frozen requester), the
//! cap. A sweeper ends expired sessions every quarter lease (at most every 250 ms).
//!
//! Owns the sessions and the per-requester connection counts. Must never: free a block's
//! memory while a data-port write from it may still run (a reader takes the session's
//! [`Locked`] `Arc` for the whole write, so a session ending mid-write only drops the last
//! reference afterwards), let a range outside the locked slots be read ([`Locked::covers`]),
//! or hold more than `max_blocks` blocks locked.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pegaflow_plugin::block::SealedBlock;

use crate::metrics::PeerMetrics;
use crate::wire::Range;

/// The blocks of one session and the byte ranges of their slots, sorted by address.
#[derive(Debug)]
pub struct Locked {
    /// Keeps the blocks' memory alive while held.
    pub blocks: Vec<Arc<SealedBlock>>,
    /// `(addr, len)` of every slot piece, sorted by address.
    pieces: Vec<(u64, u64)>,
}

impl Locked {
    /// Locks `blocks`, whose slot pieces are `pieces` (any order).
    pub fn new(blocks: Vec<Arc<SealedBlock>>, mut pieces: Vec<(u64, u64)>) -> Self {
        pieces.sort_unstable();
        Self { blocks, pieces }
    }

    /// Whether `r` lies entirely inside one locked slot piece (an empty range never does).
    pub fn covers(&self, r: Range) -> bool {
        let Some(end) = r.addr.checked_add(r.len) else {
            return false;
        };
        if r.len == 0 {
            return false;
        }
        // The last piece starting at or before r.addr.
        let i = self.pieces.partition_point(|&(a, _)| a <= r.addr);
        if i == 0 {
            return false;
        }
        let (a, l) = self.pieces[i - 1];
        end <= a.saturating_add(l)
    }
}

struct Session {
    requester: Arc<str>,
    locked: Arc<Locked>,
    created: Instant,
    expires: Instant,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<String, Session>,
    /// Live (greeted) data connections per requester id.
    conns: HashMap<Arc<str>, usize>,
    /// Live sessions per requester id.
    sessions_of: HashMap<Arc<str>, usize>,
    held_blocks: usize,
}

/// Why a lock was refused.
#[derive(Debug, thiserror::Error)]
#[error("{held} blocks are locked for peers already; at most {max} may be (max_locked_blocks)")]
pub struct LockRefused {
    held: usize,
    max: usize,
}

/// The session table.
pub struct Locks {
    inner: Mutex<Inner>,
    lease: Duration,
    cap: Duration,
    max_blocks: usize,
    metrics: PeerMetrics,
}

impl std::fmt::Debug for Locks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locks")
            .field("lease", &self.lease)
            .field("cap", &self.cap)
            .finish()
    }
}

impl Locks {
    /// A table whose sessions live `lease` past their last use and at most `cap` in all.
    pub fn new(lease: Duration, cap: Duration, max_blocks: usize, metrics: PeerMetrics) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            lease: lease.min(cap),
            cap,
            max_blocks,
            metrics,
        }
    }

    /// The lease a session gets, in whole seconds (at least 1): what the
    /// QueryBlocksForTransfer answer's `lock_timeout_secs` says.
    pub fn lease_secs(&self) -> u64 {
        self.lease.as_millis().div_ceil(1000).max(1) as u64
    }

    /// How often the sweeper runs.
    pub fn sweep_every(&self) -> Duration {
        (self.lease / 4).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }

    fn gauges(&self, inner: &Inner) {
        self.metrics.locks_held.set(inner.held_blocks as i64);
        self.metrics.lock_active.set(inner.held_blocks as i64);
        self.metrics.lock_sessions.set(inner.sessions.len() as i64);
    }

    fn end(&self, inner: &mut Inner, id: &str, reason: &str) -> usize {
        let Some(s) = inner.sessions.remove(id) else {
            return 0;
        };
        let n = s.locked.blocks.len();
        inner.held_blocks -= n;
        if let Some(c) = inner.sessions_of.get_mut(&s.requester) {
            *c -= 1;
            if *c == 0 {
                inner.sessions_of.remove(&s.requester);
            }
        }
        self.metrics
            .lock_releases
            .with_label_values(&[reason])
            .inc();
        if reason == "expired" || reason == "cap" {
            self.metrics.lock_timeouts.inc();
        }
        n
    }

    /// Locks `locked` for `requester`; returns the new session id.
    ///
    /// # Errors
    /// The table holds `max_blocks` blocks already.
    pub fn lock(&self, requester: &str, locked: Locked) -> Result<String, LockRefused> {
        let id = uuid::Uuid::new_v4().to_string();
        let now = Instant::now();
        let n = locked.blocks.len();
        let mut inner = self.inner.lock();
        if inner.held_blocks + n > self.max_blocks {
            self.metrics.lock_refusals.inc();
            return Err(LockRefused {
                held: inner.held_blocks,
                max: self.max_blocks,
            });
        }
        inner.held_blocks += n;
        let requester: Arc<str> = match inner.sessions_of.get_key_value(requester) {
            Some((k, _)) => k.clone(),
            None => requester.into(),
        };
        *inner.sessions_of.entry(requester.clone()).or_insert(0) += 1;
        inner.sessions.insert(
            id.clone(),
            Session {
                requester,
                locked: Arc::new(locked),
                created: now,
                expires: now + self.lease,
            },
        );
        self.gauges(&inner);
        Ok(id)
    }

    /// Ends session `id` (ReleaseTransferLock); returns how many blocks it held (0 for an
    /// unknown or already ended session).
    pub fn release(&self, id: &str) -> usize {
        let mut inner = self.inner.lock();
        let n = self.end(&mut inner, id, "released");
        self.gauges(&inner);
        n
    }

    /// The blocks of live session `id` for a read, renewing its lease (never past the cap).
    /// The caller holds the returned `Arc` for the whole write.
    pub fn touch(&self, id: &str) -> Option<Arc<Locked>> {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let s = inner.sessions.get_mut(id)?;
        if now >= s.expires {
            return None;
        }
        s.expires = (now + self.lease).min(s.created + self.cap);
        Some(s.locked.clone())
    }

    /// Whether `requester` holds a live session (a fetch between its lock and its release:
    /// its data connections are not to be closed for idleness).
    pub fn has_sessions(&self, requester: &str) -> bool {
        self.inner.lock().sessions_of.contains_key(requester)
    }

    /// A greeted data connection of `requester` opened.
    pub fn connected(&self, requester: &Arc<str>) {
        *self
            .inner
            .lock()
            .conns
            .entry(requester.clone())
            .or_insert(0) += 1;
    }

    /// A greeted data connection of `requester` closed: its last one ends every session it
    /// holds at once. Returns how many sessions ended.
    pub fn disconnected(&self, requester: &Arc<str>) -> usize {
        let mut inner = self.inner.lock();
        let left = match inner.conns.get_mut(requester) {
            Some(c) => {
                *c -= 1;
                *c
            }
            None => return 0,
        };
        if left > 0 {
            return 0;
        }
        inner.conns.remove(requester);
        let ids: Vec<String> = inner
            .sessions
            .iter()
            .filter(|(_, s)| s.requester == *requester)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            self.end(&mut inner, id, "disconnect");
        }
        self.gauges(&inner);
        ids.len()
    }

    /// Ends every session whose lease ran out or that reached the cap.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let ids: Vec<(String, &'static str)> = inner
            .sessions
            .iter()
            .filter_map(|(id, s)| {
                if now >= s.created + self.cap {
                    Some((id.clone(), "cap"))
                } else if now >= s.expires {
                    Some((id.clone(), "expired"))
                } else {
                    None
                }
            })
            .collect();
        if ids.is_empty() {
            return;
        }
        for (id, why) in &ids {
            self.end(&mut inner, id, why);
        }
        self.gauges(&inner);
    }

    /// Blocks locked now.
    pub fn held_blocks(&self) -> usize {
        self.inner.lock().held_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(lease_ms: u64, cap_ms: u64) -> Locks {
        Locks::new(
            Duration::from_millis(lease_ms),
            Duration::from_millis(cap_ms),
            4,
            PeerMetrics::new(&prometheus::Registry::new()),
        )
    }

    fn empty() -> Locked {
        Locked::new(Vec::new(), vec![(1000, 100), (10, 10)])
    }

    #[test]
    fn ranges_must_lie_inside_one_locked_piece() {
        let l = empty();
        assert!(l.covers(Range { addr: 10, len: 10 }));
        assert!(l.covers(Range {
            addr: 1050,
            len: 50
        }));
        assert!(!l.covers(Range {
            addr: 1050,
            len: 51
        }));
        assert!(!l.covers(Range { addr: 9, len: 2 }));
        assert!(!l.covers(Range { addr: 20, len: 1 }));
        assert!(!l.covers(Range { addr: 0, len: 1 }));
        assert!(!l.covers(Range { addr: 10, len: 0 }));
        assert!(!l.covers(Range {
            addr: u64::MAX,
            len: 2
        }));
    }

    #[test]
    fn the_last_connection_closing_releases_the_requesters_sessions() {
        let t = table(60_000, 120_000);
        let r: Arc<str> = "req".into();
        t.connected(&r);
        t.connected(&r);
        let a = t.lock("req", empty()).unwrap();
        let _b = t.lock("other", empty()).unwrap();
        assert_eq!(t.disconnected(&r), 0, "one connection is left");
        assert!(t.touch(&a).is_some());
        assert!(t.has_sessions("req"));
        assert_eq!(t.disconnected(&r), 1);
        assert!(t.touch(&a).is_none());
        assert!(!t.has_sessions("req") && t.has_sessions("other"));
        assert_eq!(
            t.inner.lock().sessions.len(),
            1,
            "another requester's stays"
        );
    }

    #[test]
    fn leases_expire_unless_renewed_and_never_outlive_the_cap() {
        let t = table(40, 120);
        let a = t.lock("req", empty()).unwrap();
        let b = t.lock("req", empty()).unwrap();
        for _ in 0..6 {
            std::thread::sleep(Duration::from_millis(15));
            assert!(t.touch(&a).is_some(), "renewed while data flows");
            t.sweep();
        }
        assert!(t.touch(&b).is_none(), "b's lease ran out");
        t.sweep();
        std::thread::sleep(Duration::from_millis(40));
        t.sweep();
        assert!(t.touch(&a).is_none(), "the cap ends even a renewed session");
        assert_eq!(t.inner.lock().sessions.len(), 0);
        assert_eq!(t.metrics.lock_timeouts.get(), 2);
    }

    #[test]
    fn release_is_idempotent_and_the_table_is_bounded() {
        let t = table(60_000, 60_000);
        let blocks = |n| Locked::new(vec![], vec![]).with_fake_count(n);
        let a = t.lock("r", blocks(3)).unwrap();
        assert!(t.lock("r", blocks(2)).is_err(), "4 blocks at most");
        assert!(t.has_sessions("r"));
        assert_eq!(t.release(&a), 3);
        assert_eq!(t.release(&a), 0);
        assert!(!t.has_sessions("r"));
        assert_eq!(t.held_blocks(), 0);
        assert_eq!(t.metrics.locks_held.get(), 0);
    }

    impl Locked {
        fn with_fake_count(mut self, n: usize) -> Self {
            use pegaflow_plugin::block::BlockShape;
            use pegaflow_plugin::{Extent, HostBuffer, HostMemory};
            struct Leak;
            impl HostMemory for Leak {
                fn release(&self, _: &[Extent]) {}
            }
            for _ in 0..n {
                let buf = Arc::new(HostBuffer::new(vec![], Arc::new(Leak)));
                self.blocks.push(Arc::new(SealedBlock::from_buffer(
                    0,
                    &BlockShape::new(vec![]),
                    buf,
                    0,
                )));
            }
            self
        }
    }
}
