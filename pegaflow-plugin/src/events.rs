//! Index events: what happened to a key in the tier stack (sealed into host DRAM, evicted,
//! written to a lower tier, promoted back), broadcast to whoever subscribes (a directory
//! client, an event publisher, tests).
//!
//! Must never: block or slow the publisher (a subscriber that falls behind loses the oldest
//! events and counts them), or announce an event before it happened.

use tokio::sync::broadcast;

use crate::block::BlockKey;

/// What happened to a key, for subscribers such as a directory client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexEventKind {
    /// Sealed by a Save: now in host DRAM.
    Sealed,
    /// Removed from host DRAM (pressure or cleanup); it may live on in a lower tier.
    Evicted,
    /// Written to the lower tier of this index (in the stack's tier order, 0 = first).
    Demoted(usize),
    /// Read back into host DRAM from a lower tier.
    Promoted,
}

/// One index event.
#[derive(Debug, Clone)]
pub struct IndexEvent {
    /// What happened.
    pub kind: IndexEventKind,
    /// To which key.
    pub key: BlockKey,
}

/// Index events are broadcast with this much backlog; a subscriber further behind loses the
/// oldest (counted in `pegaflow_index_events_lagged_total` by the subscriber).
pub const INDEX_EVENT_BACKLOG: usize = 16_384;

/// The bus index events travel on: the tier stack publishes, subscribers (a directory
/// client, tests) receive every event from the moment they subscribe. Cloning shares the bus.
/// A backend receives it in [`crate::RuntimeContext::index_events`] when it is built.
#[derive(Clone)]
pub struct IndexEvents {
    tx: broadcast::Sender<IndexEvent>,
}

impl std::fmt::Debug for IndexEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexEvents")
            .field("subscribers", &self.tx.receiver_count())
            .finish()
    }
}

impl Default for IndexEvents {
    fn default() -> Self {
        let (tx, _) = broadcast::channel(INDEX_EVENT_BACKLOG);
        Self { tx }
    }
}

impl IndexEvents {
    /// Receives every event published from now on. A receiver more than
    /// [`INDEX_EVENT_BACKLOG`] events behind loses the oldest (`RecvError::Lagged(n)`; count
    /// them in `pegaflow_index_events_lagged_total`).
    pub fn subscribe(&self) -> broadcast::Receiver<IndexEvent> {
        self.tx.subscribe()
    }

    /// Whether anyone listens (a publisher skips building events nobody receives).
    pub fn has_subscribers(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// Sends one event to every subscriber (nothing when there is none). Only the tier stack
    /// publishes.
    pub fn publish(&self, kind: IndexEventKind, key: &BlockKey) {
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(IndexEvent {
                kind,
                key: key.clone(),
            });
        }
    }
}
