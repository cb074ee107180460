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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pegaflow_proto::HashList;

/// How long a query waits for one acknowledged Save before it answers with what is indexed:
/// 10 s, far beyond a copy's remainder (a wedged copy otherwise holds the query too).
pub(super) const ACKED_WAIT_LIMIT: Duration = Duration::from_secs(10);

/// One acknowledged Save's blocks: its namespace and, per distinct layer list, the group and
/// the hashes (a block of the Save is any hash of these lists; blocks already resident are
/// included, which only makes a query wait for nothing).
pub(super) struct AckedSave {
    ns: Arc<str>,
    lists: Vec<(u32, HashList)>,
    /// Set by [`AckedSaves::leave`]: the Save queued its seal or failed. An entry that ended
    /// is never entered again (a signal fired late).
    ended: AtomicBool,
}

impl AckedSave {
    /// The Save's namespace and its distinct (group, hash list) pairs.
    pub(super) fn new(ns: Arc<str>, lists: Vec<(u32, HashList)>) -> Self {
        Self {
            ns,
            lists,
            ended: AtomicBool::new(false),
        }
    }

    /// Whether the Save holds (`ns`, `group`, `hash`) and has not ended.
    pub(super) fn pending(&self, ns: &str, group: u32, hash: &[u8]) -> bool {
        !self.ended.load(Ordering::Acquire)
            && *self.ns == *ns
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
    /// Notes `save` as acknowledged (called from the transport's thread, before the answer);
    /// nothing once it has ended.
    pub(super) fn enter(&self, save: Arc<AckedSave>) {
        let mut l = self.list.lock();
        if save.ended.load(Ordering::Acquire) {
            return;
        }
        l.push(save);
        self.len.store(l.len(), Ordering::Release);
    }

    /// Ends `save`'s window (its seal is queued, or it failed); wakes the queries waiting.
    pub(super) fn leave(&self, save: &Arc<AckedSave>) {
        {
            let mut l = self.list.lock();
            save.ended.store(true, Ordering::Release);
            l.retain(|s| !Arc::ptr_eq(s, save));
            self.len.store(l.len(), Ordering::Release);
        }
        self.ended.notify_waiters();
    }

    /// The Saves acknowledged so far and not ended: one atomic load when there are none. A
    /// query takes it before its seal barrier: every Save answered before the query arrived is
    /// in it, or has queued its seal already (which the barrier then waits for).
    pub(super) fn snapshot(&self) -> Vec<Arc<AckedSave>> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.list.lock().clone()
    }

    /// Waits until `save` has ended, at most [`ACKED_WAIT_LIMIT`]; false when the limit
    /// passed first.
    pub(super) async fn wait_ended(&self, save: &AckedSave) -> bool {
        let wait = async {
            loop {
                let ended = self.ended.notified();
                tokio::pin!(ended);
                // Registered before the check: a leave() in between still wakes this wait.
                ended.as_mut().enable();
                if save.ended.load(Ordering::Acquire) {
                    return;
                }
                ended.await;
            }
        };
        tokio::time::timeout(ACKED_WAIT_LIMIT, wait).await.is_ok()
    }
}

/// The first Save of `snapshot` still in flight that holds (`ns`, `group`, `hash`).
pub(super) fn pending_in<'a>(
    snapshot: &'a [Arc<AckedSave>],
    ns: &str,
    group: u32,
    hash: &[u8],
) -> Option<&'a Arc<AckedSave>> {
    snapshot.iter().find(|s| s.pending(ns, group, hash))
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
        let a = Arc::new(AckedSaves::default());
        let s = Arc::new(AckedSave::new("ns".into(), vec![(0, list(&[b"x", b"y"]))]));
        assert!(a.snapshot().is_empty(), "nothing entered yet");
        a.enter(s.clone());
        let snap = a.snapshot();
        assert!(pending_in(&snap, "ns", 0, b"y").is_some());
        assert!(pending_in(&snap, "ns", 1, b"y").is_none(), "another group");
        assert!(
            pending_in(&snap, "other", 0, b"y").is_none(),
            "another namespace"
        );
        assert!(pending_in(&snap, "ns", 0, b"z").is_none(), "another hash");
        let w = {
            let (a, s) = (a.clone(), s.clone());
            tokio::spawn(async move { a.wait_ended(&s).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!w.is_finished(), "waits while the Save is in flight");
        a.leave(&s);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), w)
            .await
            .expect("woken when the Save left")
            .unwrap();
        assert!(ended);
        assert!(pending_in(&snap, "ns", 0, b"x").is_none(), "ended");
        assert!(a.snapshot().is_empty());
        // A signal that fires after the Save ended enters nothing.
        a.enter(s.clone());
        assert!(a.snapshot().is_empty());
    }
}
