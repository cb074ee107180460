//! The node table of the in-memory directory: which session holds each address, when it was
//! last heard from, and how many entries it owns.
//!
//! Every address a node registers gets a *slot* (its id in owner records, 4 bytes) for as long
//! as a registration holds it; an unregistered or expired address gives its slot back, and a
//! later address may reuse it. Each registration of a slot (a first heartbeat, a takeover, a
//! resync) draws the slot's next *generation*, and owner records carry the generation they
//! were inserted under, so:
//! - an owner is visible only while its generation is the slot's live registration's;
//! - records of an earlier registration (a replaced session, an unregistered node, a
//!   previous address of a reused slot) are invisible at once and dropped by the sweep,
//!   whatever they were left behind by (an insert that raced an unregister included).
//!
//! Generations wrap at 2^32 and are compared with wrapping arithmetic ([`newer`]): sound as
//! long as a slot sees fewer than 2^31 registrations between two sweeps.
//!
//! Must never: count a registration twice against `max_nodes`, hand out a generation equal to
//! [`NONE`], or keep a slot for an address no registration holds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use pegaflow_plugin::{DirectoryError, NodeId};

/// "No live registration" in a snapshot of generations; never a generation.
pub(super) const NONE: u32 = u32::MAX;

/// Whether generation `a` was drawn after `b` on the same slot.
pub(super) fn newer(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// A session holding an address.
pub(super) struct Registration {
    pub session: Box<str>,
    pub gen: u32,
    /// The directory's clock (ms) at the last heartbeat, insert or removal.
    pub last_seen_ms: AtomicU64,
    /// Owner records of this generation (what `max_blocks_per_node` bounds).
    pub owned: AtomicU64,
}

impl Registration {
    fn new(session: &str, gen: u32, now_ms: u64) -> Arc<Self> {
        Arc::new(Self {
            session: session.into(),
            gen,
            last_seen_ms: AtomicU64::new(now_ms),
            owned: AtomicU64::new(0),
        })
    }

    /// Whether it was heard from within `stale_ms` of `now_ms`.
    pub fn live(&self, now_ms: u64, stale_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_seen_ms.load(Ordering::Relaxed)) <= stale_ms
    }
}

/// An address's place in the table.
pub(super) struct Slot {
    /// The address; empty while the slot is free.
    pub addr: Arc<str>,
    /// The last generation drawn on this slot.
    pub issued: u32,
    pub reg: Option<Arc<Registration>>,
}

/// Addresses, their slots and registrations.
#[derive(Default)]
pub(super) struct NodeTable {
    by_addr: HashMap<Arc<str>, u32>,
    pub slots: Vec<Slot>,
    free: Vec<u32>,
    registered: u64,
}

fn next_gen(g: u32) -> u32 {
    match g.wrapping_add(1) {
        NONE => 0,
        n => n,
    }
}

impl NodeTable {
    /// The slot and registration of `addr`, if registered.
    pub fn registration(&self, addr: &str) -> Option<(u32, &Arc<Registration>)> {
        let slot = *self.by_addr.get(addr)?;
        self.slots[slot as usize].reg.as_ref().map(|r| (slot, r))
    }

    /// The slot and registration of `node` when its session holds the address.
    ///
    /// # Errors
    /// `UnknownNode` when the address is not registered, `SessionConflict` when another
    /// session holds it.
    pub fn current(&self, node: &NodeId) -> Result<(u32, &Arc<Registration>), DirectoryError> {
        match self.registration(&node.addr) {
            None => Err(DirectoryError::UnknownNode(node.addr.clone())),
            Some((slot, r)) if *r.session == *node.session => Ok((slot, r)),
            Some(_) => Err(DirectoryError::SessionConflict(node.addr.clone())),
        }
    }

    /// Registers `node`'s session under a fresh generation: a new address (refused past
    /// `max_nodes` registered), or one whose registration it replaces (a takeover; the
    /// caller checked that the holder went stale). Returns the new registration.
    ///
    /// # Errors
    /// `LimitReached` (`max_nodes`) for a new address when `max_nodes` are registered.
    pub fn register(
        &mut self,
        node: &NodeId,
        now_ms: u64,
        max_nodes: u64,
    ) -> Result<Arc<Registration>, DirectoryError> {
        let slot = match self.by_addr.get(node.addr.as_str()) {
            Some(&s) => s,
            None => {
                if self.registered >= max_nodes {
                    return Err(DirectoryError::LimitReached {
                        limit: "max_nodes",
                        message: format!(
                            "the directory has {} registered nodes; the limit is {max_nodes} \
                             (max_nodes): a node leaves when it unregisters or stays silent \
                             for the TTL",
                            self.registered
                        ),
                    });
                }
                let addr: Arc<str> = node.addr.as_str().into();
                let slot = match self.free.pop() {
                    Some(s) => {
                        self.slots[s as usize].addr = addr.clone();
                        s
                    }
                    None => {
                        self.slots.push(Slot {
                            addr: addr.clone(),
                            issued: NONE,
                            reg: None,
                        });
                        (self.slots.len() - 1) as u32
                    }
                };
                self.by_addr.insert(addr, slot);
                slot
            }
        };
        let s = &mut self.slots[slot as usize];
        s.issued = next_gen(s.issued);
        let reg = Registration::new(&node.session, s.issued, now_ms);
        if s.reg.replace(reg.clone()).is_none() {
            self.registered += 1;
        }
        Ok(reg)
    }

    /// Gives `slot`'s registration a fresh generation (same session, no entries): a resync.
    /// Returns the generation it replaces.
    pub fn renew(&mut self, slot: u32, now_ms: u64) -> u32 {
        let s = &mut self.slots[slot as usize];
        let old = s.reg.as_ref().map_or(s.issued, |r| r.gen);
        let session = s
            .reg
            .as_ref()
            .map(|r| r.session.clone())
            .unwrap_or_default();
        s.issued = next_gen(s.issued);
        s.reg = Some(Registration::new(&session, s.issued, now_ms));
        old
    }

    /// Ends `slot`'s registration and frees the slot. Returns the generation it had.
    pub fn release(&mut self, slot: u32) -> u32 {
        let s = &mut self.slots[slot as usize];
        let gen = match s.reg.take() {
            Some(r) => {
                self.registered -= 1;
                r.gen
            }
            None => s.issued,
        };
        self.by_addr.remove(&s.addr);
        s.addr = Arc::from("");
        self.free.push(slot);
        gen
    }

    /// The live generation of every slot (`NONE` where there is none, or it is stale).
    pub fn live_gens(&self, now_ms: u64, stale_ms: u64) -> Vec<u32> {
        self.slots
            .iter()
            .map(|s| match &s.reg {
                Some(r) if r.live(now_ms, stale_ms) => r.gen,
                _ => NONE,
            })
            .collect()
    }
}
