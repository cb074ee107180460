//! Saves answered before their copy ended (`[server] save_answer_early`: the transport fired
//! the operation's [`SourceRead`](crate::plugin::SourceRead) once it had read the device
//! memory), until their blocks are handed to the seal queue.
//!
//! Read your acknowledged writes (DESIGN.md §6.2) across that window: a query whose answer
//! would stop at a block such a Save is still copying waits for the Save's end, then for the
//! seal ([`super::sealer`]), and answers again. Only queries that would otherwise miss a
//! just-acknowledged block wait, and at most for the copy's remainder (for the `cuda`
//! transport, at most its staging memory's worth: the answer comes once the last gather
//! ran, ≤ 128 MiB before the end with the default staging, ~2.4 ms at 55 GB/s).
//!
//! A Save is entered with its namespace and hash lists (cloned once per Save, before the
//! copy: a memcpy of its hashes, no allocation per block), and only when the signal fires: a
//! Save answered at its end is never in the list. With none in flight a query pays one
//! atomic load.
//!
//! Must never: let a query answer a miss for a block whose Save was answered and has not
//! failed, or hold an entry past its Save's end.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pegaflow_proto::HashList;

/// One acknowledged Save's blocks: its namespace and, per distinct layer list, the group and
/// the hashes (a block of the Save is any hash of these lists; blocks already resident are
/// included, which only makes a query wait for nothing).
pub(super) struct AckedSave {
    ns: Arc<str>,
    lists: Vec<(u32, HashList)>,
}

impl AckedSave {
    /// The Save's namespace and its distinct (group, hash list) pairs.
    pub(super) fn new(ns: Arc<str>, lists: Vec<(u32, HashList)>) -> Self {
        Self { ns, lists }
    }

    fn holds(&self, ns: &str, group: u32, hash: &[u8]) -> bool {
        *self.ns == *ns
            && self
                .lists
                .iter()
                .any(|(g, l)| *g == group && l.iter().any(|h| h == hash))
    }
}

/// The acknowledged Saves in flight (see the module doc).
#[derive(Default)]
pub(super) struct AckedSaves {
    list: Mutex<Vec<Arc<AckedSave>>>,
    len: AtomicUsize,
    ended: tokio::sync::Notify,
}

impl AckedSaves {
    /// Notes `save` as acknowledged (called from the transport's thread, before the answer).
    pub(super) fn enter(&self, save: Arc<AckedSave>) {
        let mut l = self.list.lock();
        l.push(save);
        self.len.store(l.len(), Ordering::Release);
    }

    /// Ends `save`'s window (its seal is queued, or it failed); wakes the queries waiting.
    /// Does nothing for a Save never entered.
    pub(super) fn leave(&self, save: &Arc<AckedSave>) {
        {
            let mut l = self.list.lock();
            let before = l.len();
            l.retain(|s| !Arc::ptr_eq(s, save));
            if l.len() == before {
                return;
            }
            self.len.store(l.len(), Ordering::Release);
        }
        self.ended.notify_waiters();
    }

    /// Whether an acknowledged Save in flight holds (`ns`, `group`, `hash`): one atomic load
    /// when none is in flight.
    pub(super) fn holds(&self, ns: &str, group: u32, hash: &[u8]) -> bool {
        if self.len.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.list.lock().iter().any(|s| s.holds(ns, group, hash))
    }

    /// Waits until no acknowledged Save in flight holds (`ns`, `group`, `hash`).
    pub(super) async fn wait_for(&self, ns: &str, group: u32, hash: &[u8]) {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            // Registered before the check: a leave() in between still wakes this wait.
            ended.as_mut().enable();
            if !self.holds(ns, group, hash) {
                return;
            }
            ended.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(hs: &[&[u8]]) -> HashList {
        let mut l = HashList::new();
        for h in hs {
            l.push(h);
        }
        l
    }

    #[tokio::test]
    async fn a_query_waits_only_for_an_acknowledged_save_that_holds_its_hash() {
        let a = AckedSaves::default();
        let s = Arc::new(AckedSave::new("ns".into(), vec![(0, list(&[b"x", b"y"]))]));
        assert!(!a.holds("ns", 0, b"x"), "nothing entered yet");
        a.enter(s.clone());
        assert!(a.holds("ns", 0, b"y"));
        assert!(!a.holds("ns", 1, b"y"), "another group");
        assert!(!a.holds("other", 0, b"y"), "another namespace");
        assert!(!a.holds("ns", 0, b"z"), "another hash");
        // Not held: returns at once.
        a.wait_for("ns", 0, b"z").await;
        let a = Arc::new(a);
        let w = {
            let a = a.clone();
            tokio::spawn(async move { a.wait_for("ns", 0, b"x").await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!w.is_finished(), "waits while the Save is in flight");
        a.leave(&Arc::new(AckedSave::new("ns".into(), vec![]))); // never entered: no effect
        assert!(a.holds("ns", 0, b"x"));
        a.leave(&s);
        tokio::time::timeout(std::time::Duration::from_secs(5), w)
            .await
            .expect("woken when the Save left")
            .unwrap();
        assert!(!a.holds("ns", 0, b"x"));
    }
}
