//! The data port's connection table (source side): which requester holds which connection,
//! the caps per requester address, per requester id and in all, and which connection makes
//! room when a new requester finds the port full.
//!
//! A connection is admitted on arrival against the caps of its address and of the port;
//! once it greets, against the cap of its requester id. It is *busy* while a read request
//! is in flight on it, *idle* otherwise. When the port is full, a connection from an
//! address that holds fewer connections than the busiest address evicts the connection of
//! the busiest addresses that has been idle longest; a connection that carries a live
//! fetch (busy, or of a requester that holds a transfer lock) is never chosen. A new
//! requester therefore always gets a slot while any connection is idle in a larger group.
//!
//! Must never: count a connection twice or forget one (every admitted id is removed once,
//! by eviction or by [`ConnTable::close`]), evict a connection carrying a live fetch, or
//! let the table hold more than `max` connections.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::locks::Locks;
use crate::metrics::PeerMetrics;

/// The caps.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections at once, in all.
    pub max: usize,
    /// Connections at once from one IP address.
    pub per_address: usize,
    /// Greeted connections at once of one requester id.
    pub per_requester: usize,
}

/// Why a connection was refused (the metric's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The port holds `max` connections and none could be evicted.
    Full,
    /// Its address holds `per_address` connections.
    PerAddress,
    /// Its requester id holds `per_requester` greeted connections.
    PerRequester,
}

impl Refusal {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Full => "full",
            Refusal::PerAddress => "per_address",
            Refusal::PerRequester => "per_requester",
        }
    }

    /// What the requester is told, and the setting that sets the cap.
    pub fn message(self, limits: &ConnLimits) -> String {
        match self {
            Refusal::Full => format!(
                "the data port holds {} connections and none is idle in a larger group (max_data_connections)",
                limits.max
            ),
            Refusal::PerAddress => format!(
                "this address holds {} data connections already (max_data_connections_per_address)",
                limits.per_address
            ),
            Refusal::PerRequester => format!(
                "this requester holds {} data connections already (max_data_connections_per_requester)",
                limits.per_requester
            ),
        }
    }
}

/// An admitted connection's handle in the table.
#[derive(Debug)]
pub struct Admitted {
    /// Its id in the table.
    pub id: u64,
    /// Notified when it is evicted: its task closes it.
    pub evicted: Arc<Notify>,
    /// Whether admitting it evicted another connection.
    pub made_room: bool,
}

struct Entry {
    ip: IpAddr,
    /// Its requester, once greeted.
    requester: Option<Arc<str>>,
    /// A read request is in flight.
    busy: bool,
    /// When it arrived, or when its last request ended.
    idle_since: Instant,
    evicted: Arc<Notify>,
}

#[derive(Default)]
struct Inner {
    conns: HashMap<u64, Entry>,
    by_ip: HashMap<IpAddr, usize>,
    by_requester: HashMap<Arc<str>, usize>,
    /// Greeted connections with no request in flight.
    idle: usize,
    next_id: u64,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.conns.remove(&id)?;
        dec(&mut self.by_ip, &e.ip);
        if let Some(r) = &e.requester {
            dec(&mut self.by_requester, r);
            if !e.busy {
                self.idle -= 1;
            }
        }
        Some(e)
    }
}

fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: &K) {
    if let Some(n) = m.get_mut(k) {
        *n -= 1;
        if *n == 0 {
            m.remove(k);
        }
    }
}

/// The table.
pub struct ConnTable {
    limits: ConnLimits,
    locks: Arc<Locks>,
    inner: Mutex<Inner>,
    metrics: PeerMetrics,
}

impl std::fmt::Debug for ConnTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnTable")
            .field("limits", &self.limits)
            .field("open", &self.open())
            .finish()
    }
}

impl ConnTable {
    /// A table with `limits`; `locks` says which requesters hold transfer locks (their
    /// connections are never evicted).
    pub fn new(limits: ConnLimits, locks: Arc<Locks>, metrics: PeerMetrics) -> Self {
        Self {
            limits,
            locks,
            inner: Mutex::new(Inner::default()),
            metrics,
        }
    }

    /// The caps.
    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    /// Connections in the table now.
    pub fn open(&self) -> usize {
        self.inner.lock().conns.len()
    }

    fn gauges(&self, inner: &Inner) {
        self.metrics.data_connections.set(inner.conns.len() as i64);
        self.metrics.data_connections_idle.set(inner.idle as i64);
    }

    /// A connection from `ip` arrived: admits it, evicting another when the port is full
    /// (see the module's policy), or says why not.
    ///
    /// # Errors
    /// [`Refusal::PerAddress`] or [`Refusal::Full`].
    pub fn admit(&self, ip: IpAddr, now: Instant) -> Result<Admitted, Refusal> {
        let mut inner = self.inner.lock();
        let mine = inner.by_ip.get(&ip).copied().unwrap_or(0);
        if mine >= self.limits.per_address {
            return Err(Refusal::PerAddress);
        }
        let mut made_room = false;
        if inner.conns.len() >= self.limits.max {
            let victim = self.victim(&inner, mine).ok_or(Refusal::Full)?;
            if let Some(e) = inner.remove(victim) {
                e.evicted.notify_one();
            }
            made_room = true;
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let evicted = Arc::new(Notify::new());
        inner.conns.insert(
            id,
            Entry {
                ip,
                requester: None,
                busy: false,
                idle_since: now,
                evicted: evicted.clone(),
            },
        );
        *inner.by_ip.entry(ip).or_insert(0) += 1;
        self.gauges(&inner);
        Ok(Admitted {
            id,
            evicted,
            made_room,
        })
    }

    /// The connection to evict for a newcomer from an address holding `mine`: of the
    /// addresses holding more than `mine`, the busiest first, its connection idle longest
    /// (not yet greeted counts as idle since its arrival); never one that is busy or whose
    /// requester holds a transfer lock.
    fn victim(&self, inner: &Inner, mine: usize) -> Option<u64> {
        let busiest = inner.by_ip.values().copied().max().unwrap_or(0);
        if busiest <= mine {
            return None;
        }
        let mut candidates: Vec<(std::cmp::Reverse<usize>, Instant, u64)> = inner
            .conns
            .iter()
            .filter(|(_, e)| !e.busy)
            .filter_map(|(&id, e)| {
                let n = inner.by_ip.get(&e.ip).copied().unwrap_or(0);
                (n > mine).then_some((std::cmp::Reverse(n), e.idle_since, id))
            })
            .collect();
        candidates.sort_unstable();
        candidates.into_iter().map(|(_, _, id)| id).find(|id| {
            inner.conns[id]
                .requester
                .as_ref()
                .is_none_or(|r| !self.locks.has_sessions(r))
        })
    }

    /// Connection `id` greeted as `requester`: counts it for the requester (`Ok(true)`), or
    /// refuses it at the requester's cap (the caller closes it). `Ok(false)`: `id` was
    /// evicted meanwhile (the caller closes it).
    ///
    /// # Errors
    /// [`Refusal::PerRequester`].
    pub fn greet(&self, id: u64, requester: &Arc<str>) -> Result<bool, Refusal> {
        let mut inner = self.inner.lock();
        if !inner.conns.contains_key(&id) {
            return Ok(false);
        }
        let held = inner.by_requester.get(requester).copied().unwrap_or(0);
        if held >= self.limits.per_requester {
            return Err(Refusal::PerRequester);
        }
        if let Some(e) = inner.conns.get_mut(&id) {
            e.requester = Some(requester.clone());
        }
        *inner.by_requester.entry(requester.clone()).or_insert(0) += 1;
        inner.idle += 1;
        self.gauges(&inner);
        Ok(true)
    }

    /// A request began on connection `id`; `false` when it was evicted meanwhile (the
    /// caller closes it without answering).
    pub fn begin(&self, id: u64) -> bool {
        let mut inner = self.inner.lock();
        let Some(e) = inner.conns.get_mut(&id) else {
            return false;
        };
        if !e.busy && e.requester.is_some() {
            e.busy = true;
            inner.idle -= 1;
            self.gauges(&inner);
        }
        true
    }

    /// The request on connection `id` ended; `served`: when, if it was served (a refused
    /// read leaves the connection idle since its last served one).
    pub fn end(&self, id: u64, served: Option<Instant>) {
        let mut inner = self.inner.lock();
        let Some(e) = inner.conns.get_mut(&id) else {
            return;
        };
        if let Some(t) = served {
            e.idle_since = t;
        }
        if e.busy {
            e.busy = false;
            inner.idle += 1;
            self.gauges(&inner);
        }
    }

    /// Connection `id` closed (a no-op when it was evicted).
    pub fn close(&self, id: u64) {
        let mut inner = self.inner.lock();
        if inner.remove(id).is_some() {
            self.gauges(&inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::locks::Locked;

    fn table(max: usize, per_address: usize, per_requester: usize) -> (ConnTable, Arc<Locks>) {
        let metrics = PeerMetrics::new(&prometheus::Registry::new());
        let locks = Arc::new(Locks::new(
            Duration::from_secs(60),
            Duration::from_secs(60),
            100,
            metrics.clone(),
        ));
        let t = ConnTable::new(
            ConnLimits {
                max,
                per_address,
                per_requester,
            },
            locks.clone(),
            metrics,
        );
        (t, locks)
    }

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn caps_per_address_and_per_requester_refuse() {
        let (t, _) = table(100, 2, 3);
        let now = Instant::now();
        let r: Arc<str> = "r".into();
        let a = t.admit(ip(1), now).unwrap();
        let _b = t.admit(ip(1), now).unwrap();
        assert_eq!(t.admit(ip(1), now).unwrap_err(), Refusal::PerAddress);
        assert!(t.greet(a.id, &r).unwrap());
        for n in 2..4 {
            let c = t.admit(ip(n), now).unwrap();
            assert!(t.greet(c.id, &r).unwrap());
        }
        let d = t.admit(ip(9), now).unwrap();
        assert_eq!(t.greet(d.id, &r).unwrap_err(), Refusal::PerRequester);
        t.close(d.id);
        t.close(a.id);
        let e = t.admit(ip(9), now).unwrap();
        assert!(t
            .greet(e.id, &r)
            .expect("a slot of the requester was freed"));
        assert_eq!(t.open(), 4);
    }

    #[test]
    fn a_full_port_evicts_the_longest_idle_connection_of_the_busiest_address() {
        let (t, locks) = table(4, 10, 10);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // ip1 holds 3: the first carries a lock, the second a request in flight, the third
        // is idle. ip2 holds 1.
        let (r1, r2, r3): (Arc<str>, Arc<str>, Arc<str>) = ("r1".into(), "r2".into(), "r3".into());
        let locked = t.admit(ip(1), at(0)).unwrap();
        assert!(t.greet(locked.id, &r1).unwrap());
        locks.lock("r1", Locked::new(vec![], vec![])).unwrap();
        let busy = t.admit(ip(1), at(1)).unwrap();
        assert!(t.greet(busy.id, &r2).unwrap());
        assert!(t.begin(busy.id));
        let idle = t.admit(ip(1), at(2)).unwrap();
        assert!(t.greet(idle.id, &r3).unwrap());
        let other = t.admit(ip(2), at(3)).unwrap();
        assert!(!other.made_room);
        // The port is full. ip1 holds 3, more than a newcomer's 0: its idle one goes.
        let new = t.admit(ip(3), at(4)).unwrap();
        assert!(new.made_room);
        assert!(!t.inner.lock().conns.contains_key(&idle.id));
        assert!(
            !t.begin(idle.id),
            "an evicted connection's next request is refused"
        );
        assert!(!t.greet(idle.id, &r3).unwrap(), "nor is it greeted");
        // Now ip1 holds 2 (both live), ip2 and ip3 1 each: a second connection from ip2
        // or ip3 could only evict ip1's, which carry live fetches: refused.
        assert_eq!(t.admit(ip(2), at(5)).unwrap_err(), Refusal::Full);
        assert_eq!(t.admit(ip(3), at(6)).unwrap_err(), Refusal::Full);
        // The request ends: ip1's busy connection becomes idle, hence evictable.
        t.end(busy.id, Some(at(7)));
        assert!(t.admit(ip(2), at(8)).unwrap().made_room);
        assert!(!t.inner.lock().conns.contains_key(&busy.id));
        assert!(
            t.inner.lock().conns.contains_key(&locked.id),
            "never the locked"
        );
        assert_eq!(t.open(), 4);
        assert_eq!(t.metrics.data_connections.get(), 4);
    }

    #[test]
    fn every_admitted_connection_is_counted_once() {
        let (t, _) = table(3, 3, 3);
        let now = Instant::now();
        let r: Arc<str> = "r".into();
        let ids: Vec<u64> = (0..3)
            .map(|_| {
                let a = t.admit(ip(1), now).unwrap();
                assert!(t.greet(a.id, &r).unwrap());
                a.id
            })
            .collect();
        assert_eq!(t.metrics.data_connections_idle.get(), 3);
        assert!(t.begin(ids[0]));
        assert_eq!(t.metrics.data_connections_idle.get(), 2);
        for id in &ids {
            t.close(*id);
            t.close(*id);
        }
        let inner = t.inner.lock();
        assert!(inner.conns.is_empty() && inner.by_ip.is_empty() && inner.by_requester.is_empty());
        assert_eq!(inner.idle, 0);
        assert_eq!(t.metrics.data_connections.get(), 0);
        assert_eq!(t.metrics.data_connections_idle.get(), 0);
    }
}
