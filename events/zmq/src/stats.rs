//! The publisher's counters and gauges, plain atomics read into a [`StatsSnapshot`].
//!
//! Owns the numbers only; it never decides anything from them. The runtime maps them to its
//! `pegaflow_events_*` Prometheus families.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The live counters (shared by the caller's threads and the publisher thread).
#[derive(Debug, Default)]
pub(crate) struct EventStats {
    pub(crate) batches_published: AtomicU64,
    pub(crate) events_published: AtomicU64,
    pub(crate) payload_bytes_published: AtomicU64,
    pub(crate) submissions_dropped: AtomicU64,
    pub(crate) events_dropped: AtomicU64,
    pub(crate) clears_after_drop: AtomicU64,
    pub(crate) queued_events: AtomicU64,
    pub(crate) send_errors: AtomicU64,
    pub(crate) next_seq: AtomicU64,
    pub(crate) queue_delay_us_sum: AtomicU64,
    pub(crate) queue_delay_us_max: AtomicU64,
    pub(crate) subscribers: AtomicU64,
    pub(crate) replay_requests: AtomicU64,
    pub(crate) replay_batches_sent: AtomicU64,
    pub(crate) replay_rejected: AtomicU64,
    pub(crate) replay_timeouts: AtomicU64,
    pub(crate) replay_buffer_batches: AtomicU64,
    pub(crate) replay_buffer_bytes: AtomicU64,
}

impl EventStats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        StatsSnapshot {
            batches_published: g(&self.batches_published),
            events_published: g(&self.events_published),
            payload_bytes_published: g(&self.payload_bytes_published),
            submissions_dropped: g(&self.submissions_dropped),
            events_dropped: g(&self.events_dropped),
            clears_after_drop: g(&self.clears_after_drop),
            queued_events: g(&self.queued_events),
            send_errors: g(&self.send_errors),
            next_seq: g(&self.next_seq),
            queue_delay_us_sum: g(&self.queue_delay_us_sum),
            queue_delay_us_max: g(&self.queue_delay_us_max),
            subscribers: g(&self.subscribers),
            replay_requests: g(&self.replay_requests),
            replay_batches_sent: g(&self.replay_batches_sent),
            replay_rejected: g(&self.replay_rejected),
            replay_timeouts: g(&self.replay_timeouts),
            replay_buffer_batches: g(&self.replay_buffer_batches),
            replay_buffer_bytes: g(&self.replay_buffer_bytes),
        }
    }
}

/// The publisher's figures at one moment. Counters (`_total`-like) only grow; gauges are
/// marked. `events_published + events_dropped` is every event handed to
/// [`crate::EventPublisher::try_publish`] once the queue is empty (`queued_events` = 0),
/// not counting the `AllBlocksCleared` events the publisher adds after drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    /// PUB messages (batches) sent, each with its own sequence number.
    pub batches_published: u64,
    /// Events in them, the publisher's own `AllBlocksCleared` included.
    pub events_published: u64,
    /// MessagePack payload bytes in them.
    pub payload_bytes_published: u64,
    /// Submissions refused because the queue was full (or the publisher had stopped).
    pub submissions_dropped: u64,
    /// Events in those submissions.
    pub events_dropped: u64,
    /// `AllBlocksCleared` events the publisher queued after a drop.
    pub clears_after_drop: u64,
    /// Gauge: events waiting for the publisher thread.
    pub queued_events: u64,
    /// PUB sends that failed (the batch still gets its number and is kept for replay).
    pub send_errors: u64,
    /// Gauge: the sequence number the next batch gets (= batches numbered so far).
    pub next_seq: u64,
    /// Sum over batches of the time from the oldest submission in the batch to its send,
    /// in microseconds (mean = this / `batches_published`).
    pub queue_delay_us_sum: u64,
    /// The longest such time seen, in microseconds.
    pub queue_delay_us_max: u64,
    /// Gauge: peers connected to the PUB socket (from the socket's connect and disconnect
    /// notices; a subscriber that vanished without a TCP close counts until detected).
    pub subscribers: u64,
    /// Replay requests received.
    pub replay_requests: u64,
    /// Batches sent in replay answers.
    pub replay_batches_sent: u64,
    /// Replay requests that were not `[empty frame,] 8-byte sequence number` (answered with
    /// the end marker alone when the requester could be told apart).
    pub replay_rejected: u64,
    /// Replay answers abandoned after `replay_timeout_ms` (the requester stopped reading).
    pub replay_timeouts: u64,
    /// Gauge: batches held for replay.
    pub replay_buffer_batches: u64,
    /// Gauge: their payload bytes.
    pub replay_buffer_bytes: u64,
}
