//! KV-cache events in vLLM's ZMQ wire format, for routers that pick an engine by what it
//! has cached (`[events] kind = "zmq"`).
//!
//! This crate is a self-contained library: it knows nothing of the server's tier stack. The
//! runtime's plugin factory builds an [`EventPublisher`] from a [`ZmqEventsConfig`] and calls
//! [`EventPublisher::try_publish`] with [`KvEvent`]s as blocks are sealed into DRAM,
//! written to a lower tier or dropped from one. It must never slow the caller (the
//! queue is bounded, a full queue drops and counts), never leave a gap in the sequence
//! numbers, and never let a subscriber trust a block after events about it were dropped.
//!
//! # What a subscriber sees
//!
//! - A PUB socket sends one message per batch: three frames `[topic, seq, payload]`. `seq`
//!   is 8 bytes, big-endian, starting at 0 and rising by one per batch; `payload` is a
//!   MessagePack `KVEventBatch` ([`event`] describes the bytes).
//! - A ROUTER socket (when `replay_endpoint` is set) answers a request carrying a starting
//!   sequence number with the batches still kept from there on and an end marker
//!   ([`replay`] describes the frames).
//! - Both follow vLLM's `ZmqEventPublisher`, so a subscriber written for vLLM reads this
//!   server unchanged.
//!
//! # Bounds
//!
//! - The queue holds at most `queue_capacity_events` events; a submission that does not fit
//!   is dropped whole.
//! - Drops: after a drop an `AllBlocksCleared` event is queued behind everything queued
//!   before it (at most one in a row), so a subscriber forgets the blocks it may have missed
//!   news about and relearns them from later `BlockStored` events.
//! - The replay buffer keeps the newest `buffer_steps` batches and at most
//!   `replay_buffer_bytes` of payload.
//! - Each subscriber connection has its own send queue of at most `hwm` batches (libzmq's
//!   send high-water mark); a subscriber that stops reading loses batches past that (PUB
//!   semantics) and sees a gap in `seq`, which replay fills.
//! - A replay answer that cannot be handed over within `replay_timeout_ms` (per 1,000
//!   batches) is abandoned.
//!
//! # Threads
//!
//! `pegaflow-events` owns the PUB socket: it waits on the queue, encodes and sends.
//! `pegaflow-events-replay` owns the ROUTER socket (only with a replay endpoint).
//! [`EventPublisher::try_publish`] only appends to the queue under a short lock and wakes
//! the first. Dropping the publisher publishes what is queued, closes the sockets and joins
//! both threads.

pub mod config;
pub mod error;
pub mod event;
mod publisher;
pub mod replay;
mod stats;

pub use config::{EndpointMode, ZmqEventsConfig};
pub use error::{EventsError, PublishError};
pub use event::{
    encode_batch, BlockHashForm, BlockRemoved, BlockStored, Encoding, EventBatch,
    ExternalBlockHash, KvEvent, Medium,
};
pub use publisher::EventPublisher;
pub use replay::END_SEQ;
pub use stats::StatsSnapshot;
