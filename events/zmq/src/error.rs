//! The crate's errors: what the lead's plugin factory turns into a start-up failure.
//!
//! Owns the error type only; it never logs (the caller says what happened, once).

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// A setting is out of range or unparsable; `key` is its name in `[events]`.
    #[error("[events] {key}: {reason}")]
    Config {
        /// The setting.
        key: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A socket could not bind (port in use, address not on this host, no permission) or
    /// its name could not be resolved.
    #[error("[events] cannot bind the {socket} socket to {endpoint}: {reason}")]
    Bind {
        /// `PUB` or `replay`.
        socket: &'static str,
        /// The endpoint as configured.
        endpoint: String,
        /// The operating system's or the ZMQ layer's reason.
        reason: String,
    },
    /// The publisher thread or its runtime could not be created.
    #[error("[events] cannot start the publisher thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Why one submission was not queued ([`crate::EventPublisher::try_publish`]). Either way
/// it is counted in the publisher's stats and nothing else happens to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The queue holds `queue_capacity_events` already; the events were dropped and an
    /// `AllBlocksCleared` follows them in the stream.
    #[error("the events queue is full; {events} events dropped")]
    QueueFull {
        /// Events in the dropped submission.
        events: usize,
    },
    /// The publisher thread has stopped (shut down, or it failed); nothing more is sent.
    #[error("the events publisher has stopped")]
    Stopped,
}
