//! The publisher: a bounded queue in front of a thread that numbers, encodes and sends
//! batches on the PUB socket and keeps them for replay, and a second thread that serves
//! the replay socket.
//!
//! Owns the queue, both threads (`pegaflow-events`, `pegaflow-events-replay`), both libzmq
//! sockets and the replay buffer. It must never block or slow the caller of
//! [`EventPublisher::try_publish`]: that call takes a short lock to append to a deque and
//! never waits on the thread, a socket or a subscriber. It must never leave a gap in the
//! sequence numbers it assigns, and never let a dropped event leave a subscriber believing
//! a block is present that may have gone (an `AllBlocksCleared` follows every drop). A
//! replay requester never delays the live stream (its own thread, its own socket).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};

use crate::config::{parse_endpoint, Target, TcpHost, ZmqEventsConfig};
use crate::error::{EventsError, PublishError};
use crate::event::{encode_batch, BlockHashForm, ExternalBlockHash, KvEvent};
use crate::replay::{ReplayBuffer, Request, END_SEQ};
use crate::stats::{EventStats, StatsSnapshot};

/// How long the PUB socket may keep delivering after the publisher is dropped.
const PUB_LINGER_MS: i32 = 100;
/// How often the publisher thread wakes with nothing queued (to read the socket monitor).
const IDLE_WAKE: Duration = Duration::from_millis(100);
/// How long the replay thread waits for a request before it looks at the stop flag.
const REPLAY_POLL_MS: i32 = 100;
/// The largest message frame a peer may send: a subscription (topic prefix) to the PUB
/// socket, a replay request to the ROUTER. libzmq disconnects a peer that sends more.
const PUB_MAX_INBOUND_BYTES: i64 = 4096;
const REPLAY_MAX_INBOUND_BYTES: i64 = 64;

/// One `try_publish` call waiting for the thread.
struct Item {
    /// Wall-clock time of the call, seconds since the Unix epoch (the batch's `ts`).
    ts: f64,
    /// Monotonic time of the call (for the queue delay).
    at: Instant,
    events: Vec<KvEvent>,
    /// The publisher's own `AllBlocksCleared` after a drop.
    clear: bool,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Caller events in `items` (the publisher's clears not counted).
    events: usize,
}

/// What the caller's threads and the publisher's threads share.
struct Shared {
    queue: Mutex<Queue>,
    capacity_events: usize,
    wake: Condvar,
    /// Set (under the queue lock) by `Drop`: the threads drain and end.
    stop: AtomicBool,
    /// Set by the publisher thread when it ends: submissions are refused.
    stopped: AtomicBool,
    stats: EventStats,
    buffer: Mutex<ReplayBuffer>,
    drop_log: LogGate,
    /// Tests hold the thread back to fill the queue.
    #[cfg(test)]
    paused: AtomicBool,
}

/// The KV-event publisher (crate docs). Share it behind an `Arc`; dropping it publishes
/// what is queued, closes both sockets and joins both threads.
pub struct EventPublisher {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub_endpoint: String,
    replay_endpoint: Option<String>,
    block_hash: BlockHashForm,
    /// Dropped last: terminating a context waits for its sockets, which the threads own.
    _context: zmq::Context,
}

impl std::fmt::Debug for EventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPublisher")
            .field("pub_endpoint", &self.pub_endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

/// Tells monitor endpoints of publishers in one process apart.
static MONITOR_ID: AtomicU64 = AtomicU64::new(0);

impl EventPublisher {
    /// Checks `config`, binds (or, for the PUB socket in connect mode, starts connecting)
    /// both sockets and starts the threads. A taken port or a bad address is an error here
    /// ([`EventsError::Bind`]), never later. In connect mode libzmq connects in the
    /// background and reconnects by itself; batches published before a peer is there are
    /// numbered and kept for replay.
    pub fn start(config: &ZmqEventsConfig) -> Result<Self, EventsError> {
        config.check()?;
        let context = zmq::Context::new();
        let zerr = |socket: &'static str, endpoint: &str| {
            let endpoint = endpoint.to_string();
            move |e: zmq::Error| EventsError::Bind {
                socket,
                endpoint: endpoint.clone(),
                reason: e.to_string(),
            }
        };

        let publ = context
            .socket(zmq::PUB)
            .map_err(|e| EventsError::Thread(std::io::Error::other(e)))?;
        let pub_target = parse_endpoint("endpoint", &config.endpoint)?;
        let setup = |s: &zmq::Socket| -> Result<(), zmq::Error> {
            s.set_sndhwm(i32::try_from(config.hwm).unwrap_or(i32::MAX))?;
            s.set_maxmsgsize(PUB_MAX_INBOUND_BYTES)?;
            s.set_linger(PUB_LINGER_MS)?;
            s.set_ipv6(is_ipv6(&pub_target))
        };
        setup(&publ).map_err(zerr("PUB", &config.endpoint))?;
        let monitor_ep = format!(
            "inproc://pegaflow-events-monitor-{}",
            MONITOR_ID.fetch_add(1, Ordering::Relaxed)
        );
        publ.monitor(
            &monitor_ep,
            (zmq::SocketEvent::ACCEPTED as i32)
                | (zmq::SocketEvent::CONNECTED as i32)
                | (zmq::SocketEvent::DISCONNECTED as i32),
        )
        .map_err(zerr("PUB", &config.endpoint))?;
        let monitor = context
            .socket(zmq::PAIR)
            .and_then(|m| m.set_linger(0).map(|()| m))
            .and_then(|m| m.connect(&monitor_ep).map(|()| m))
            .map_err(zerr("PUB", &config.endpoint))?;
        let pub_endpoint = if config.binds_pub() {
            publ.bind(&libzmq_endpoint(&pub_target))
                .map_err(zerr("PUB", &config.endpoint))?;
            last_endpoint(&publ, &config.endpoint, &pub_target)
        } else {
            publ.connect(&libzmq_endpoint(&pub_target))
                .map_err(zerr("PUB", &config.endpoint))?;
            config.endpoint.clone()
        };

        let replay = match &config.replay_endpoint {
            Some(ep) => {
                let target = parse_endpoint("replay_endpoint", ep)?;
                let router = context.socket(zmq::ROUTER).map_err(zerr("replay", ep))?;
                let step_ms = config.replay_timeout_ms.min(REPLAY_POLL_MS as u64) as i32;
                router
                    .set_router_mandatory(true)
                    .and_then(|()| router.set_maxmsgsize(REPLAY_MAX_INBOUND_BYTES))
                    .and_then(|()| router.set_linger(0))
                    .and_then(|()| router.set_rcvtimeo(REPLAY_POLL_MS))
                    .and_then(|()| router.set_sndtimeo(step_ms))
                    .and_then(|()| router.set_ipv6(is_ipv6(&target)))
                    .and_then(|()| router.bind(&libzmq_endpoint(&target)))
                    .map_err(zerr("replay", ep))?;
                let bound = last_endpoint(&router, ep, &target);
                Some((router, bound))
            }
            None => None,
        };
        let replay_endpoint = replay.as_ref().map(|(_, b)| b.clone());

        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            capacity_events: config.queue_capacity_events,
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            stats: EventStats::default(),
            buffer: Mutex::new(ReplayBuffer::new(
                config.buffer_steps,
                config.replay_buffer_bytes,
            )),
            drop_log: LogGate::new(Duration::from_secs(10)),
            #[cfg(test)]
            paused: AtomicBool::new(false),
        });
        let mut threads = Vec::with_capacity(2);
        let mut sender = Sender {
            publ,
            monitor,
            topic: config.topic.clone().into_bytes(),
            cfg: config.clone(),
            shared: shared.clone(),
            next_seq: 0,
            send_log: LogGate::new(Duration::from_secs(10)),
        };
        threads.push(
            std::thread::Builder::new()
                .name("pegaflow-events".into())
                .spawn(move || {
                    // Marks the publisher stopped however the thread ends (a panic too).
                    let _stopped = StoppedOnExit(sender.shared.clone());
                    sender.run();
                })
                .map_err(EventsError::Thread)?,
        );
        if let Some((router, _)) = replay {
            let sh = shared.clone();
            let timeout = Duration::from_millis(config.replay_timeout_ms);
            let spawned = std::thread::Builder::new()
                .name("pegaflow-events-replay".into())
                .spawn(move || serve_replay(router, &sh, timeout));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    stop_and_join(&shared, &mut threads);
                    return Err(EventsError::Thread(e));
                }
            }
        }
        tracing::info!(
            pub_endpoint = %pub_endpoint,
            mode = if config.binds_pub() { "bind" } else { "connect" },
            replay_endpoint = replay_endpoint.as_deref().unwrap_or("none"),
            topic = %config.topic,
            encoding = ?config.encoding,
            "KV events: publishing in vLLM's ZMQ format"
        );
        Ok(Self {
            shared,
            threads,
            pub_endpoint,
            replay_endpoint,
            block_hash: config.block_hash,
            _context: context,
        })
    }

    /// Queues `events` as (part of) one batch, stamped with the current time. Never blocks:
    /// when the queue already holds `queue_capacity_events` events, or the publisher has
    /// stopped, the events are dropped, counted, and (queue full) an `AllBlocksCleared`
    /// is queued behind everything queued so far so subscribers forget what they can no
    /// longer trust. An empty `events` does nothing.
    pub fn try_publish(&self, events: Vec<KvEvent>) -> Result<(), PublishError> {
        let n = events.len();
        if n == 0 {
            return Ok(());
        }
        let sh = &*self.shared;
        let stats = &sh.stats;
        if sh.stopped.load(Ordering::Acquire) {
            EventStats::add(&stats.submissions_dropped, 1);
            EventStats::add(&stats.events_dropped, n as u64);
            return Err(PublishError::Stopped);
        }
        let at = Instant::now();
        let ts = unix_secs();
        let mut q = sh.queue.lock();
        if q.events + n > sh.capacity_events {
            // At most one clear in a row: a clear already last in the queue comes after
            // this drop too.
            let clear = q.items.back().is_none_or(|i| !i.clear);
            if clear {
                q.items.push_back(Item {
                    ts,
                    at,
                    events: vec![KvEvent::AllCleared],
                    clear: true,
                });
            }
            drop(q);
            if clear {
                EventStats::add(&stats.clears_after_drop, 1);
                sh.wake.notify_one();
            }
            EventStats::add(&stats.submissions_dropped, 1);
            EventStats::add(&stats.events_dropped, n as u64);
            if let Some(suppressed) = sh.drop_log.pass() {
                tracing::warn!(
                    dropped_events = n,
                    capacity_events = sh.capacity_events,
                    suppressed_warnings = suppressed,
                    "KV events: queue full, events dropped; subscribers are told to clear"
                );
            }
            return Err(PublishError::QueueFull { events: n });
        }
        q.events += n;
        stats
            .queued_events
            .store(q.events as u64, Ordering::Relaxed);
        let was_empty = q.items.is_empty();
        q.items.push_back(Item {
            ts,
            at,
            events,
            clear: false,
        });
        drop(q);
        if was_empty {
            sh.wake.notify_one();
        }
        Ok(())
    }

    /// `digest` in the configured `block_hash` form.
    pub fn block_hash(&self, digest: &[u8]) -> ExternalBlockHash {
        ExternalBlockHash::from_digest(digest, self.block_hash)
    }

    /// The PUB endpoint as bound (`tcp://ADDR:PORT` with the real port when the
    /// configuration said 0), or as configured in connect mode.
    pub fn pub_endpoint(&self) -> &str {
        &self.pub_endpoint
    }

    /// The replay endpoint as bound, when there is one.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The counters and gauges now.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Whether the publisher thread is running (false once it ended, which only a panic
    /// in it can cause before drop).
    pub fn is_running(&self) -> bool {
        !self.shared.stopped.load(Ordering::Acquire)
    }
}

struct StoppedOnExit(Arc<Shared>);

impl Drop for StoppedOnExit {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Release);
    }
}

fn stop_and_join(shared: &Shared, threads: &mut Vec<std::thread::JoinHandle<()>>) {
    {
        let _q = shared.queue.lock();
        shared.stop.store(true, Ordering::Release);
        shared.wake.notify_all();
    }
    for t in threads.drain(..) {
        if t.join().is_err() {
            tracing::error!("KV events: a publisher thread panicked");
        }
    }
}

impl Drop for EventPublisher {
    fn drop(&mut self) {
        stop_and_join(&self.shared, &mut self.threads);
    }
}

fn is_ipv6(t: &Target) -> bool {
    matches!(
        t,
        Target::Tcp {
            host: TcpHost::Ip(std::net::IpAddr::V6(_)),
            ..
        }
    )
}

/// The endpoint in libzmq's syntax (`*` kept, IPv6 in brackets, port 0 as `*`).
fn libzmq_endpoint(t: &Target) -> String {
    match t {
        Target::Tcp { host, port } => {
            let host = match host {
                TcpHost::Ip(ip) if ip.is_unspecified() && ip.is_ipv4() => "*".to_string(),
                h => h.as_string(),
            };
            let port = if *port == 0 {
                "*".to_string()
            } else {
                port.to_string()
            };
            format!("tcp://{host}:{port}")
        }
        Target::Ipc(path) => format!("ipc://{path}"),
    }
}

/// The endpoint a socket bound, with the real port; `*` stays `*` as configured.
fn last_endpoint(s: &zmq::Socket, configured: &str, target: &Target) -> String {
    let bound = match s.get_last_endpoint() {
        Ok(Ok(e)) => e,
        _ => return configured.to_string(),
    };
    match target {
        Target::Tcp {
            host: TcpHost::Ip(ip),
            ..
        } if ip.is_unspecified() && ip.is_ipv4() && configured.contains('*') => {
            match bound.rsplit_once(':') {
                Some((_, port)) => format!("tcp://*:{port}"),
                None => bound,
            }
        }
        _ => bound,
    }
}

fn unix_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// At most one log line per interval; says how many were held back.
struct LogGate {
    base: Instant,
    interval_ms: u64,
    /// Milliseconds since `base` from which the next line may pass (0: now).
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogGate {
    fn new(interval: Duration) -> Self {
        Self {
            base: Instant::now(),
            interval_ms: interval.as_millis() as u64,
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may be logged now.
    fn pass(&self) -> Option<u64> {
        let now = self.base.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.interval_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// The publisher thread.
struct Sender {
    publ: zmq::Socket,
    monitor: zmq::Socket,
    topic: Vec<u8>,
    cfg: ZmqEventsConfig,
    shared: Arc<Shared>,
    next_seq: u64,
    send_log: LogGate,
}

impl Sender {
    /// Publishes until `stop` is set and the queue is empty.
    fn run(&mut self) {
        loop {
            #[cfg(test)]
            while self.shared.paused.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (items, stop) = {
                let mut q = self.shared.queue.lock();
                if q.items.is_empty() && !self.shared.stop.load(Ordering::Acquire) {
                    self.shared.wake.wait_for(&mut q, IDLE_WAKE);
                }
                (
                    std::mem::take(&mut q.items),
                    self.shared.stop.load(Ordering::Acquire),
                )
            };
            self.watch_subscribers();
            if items.is_empty() {
                if stop {
                    break;
                }
                continue;
            }
            self.publish_items(items);
        }
        tracing::info!(
            batches = self.next_seq,
            "KV events: publisher stopped; sockets closing"
        );
    }

    /// Publishes `items` in batches of at most `max_events_per_batch` events.
    fn publish_items(&mut self, items: VecDeque<Item>) {
        let max = self.cfg.max_events_per_batch;
        let mut batch: Vec<KvEvent> = Vec::new();
        let mut head: Option<(f64, Instant)> = None;
        let mut caller_events = 0usize;
        for item in items {
            if !item.clear {
                caller_events += item.events.len();
            }
            for ev in item.events {
                let h = *head.get_or_insert((item.ts, item.at));
                batch.push(ev);
                if batch.len() == max {
                    self.publish(std::mem::take(&mut batch), h);
                    head = None;
                }
            }
        }
        if let Some(h) = head {
            self.publish(batch, h);
        }
        let mut q = self.shared.queue.lock();
        q.events -= caller_events;
        self.shared
            .stats
            .queued_events
            .store(q.events as u64, Ordering::Relaxed);
    }

    /// Numbers, encodes, sends and keeps one batch.
    fn publish(&mut self, events: Vec<KvEvent>, (ts, at): (f64, Instant)) {
        let stats = &self.shared.stats;
        let payload = Bytes::from(encode_batch(
            ts,
            &events,
            self.cfg.data_parallel_rank,
            self.cfg.encoding,
        ));
        let seq = self.next_seq;
        self.next_seq += 1;
        stats.next_seq.store(self.next_seq, Ordering::Relaxed);
        // A PUB socket never blocks: past `hwm` for a peer it drops that peer's copy.
        let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
        if let Err(e) = self.publ.send_multipart(frames, zmq::DONTWAIT) {
            EventStats::add(&stats.send_errors, 1);
            if let Some(n) = self.send_log.pass() {
                tracing::warn!(seq, error = %e, suppressed_warnings = n,
                    "KV events: PUB send failed; the batch stays available for replay");
            }
        }
        let delay_us = at.elapsed().as_micros() as u64;
        EventStats::add(&stats.queue_delay_us_sum, delay_us);
        stats
            .queue_delay_us_max
            .fetch_max(delay_us, Ordering::Relaxed);
        EventStats::add(&stats.batches_published, 1);
        EventStats::add(&stats.events_published, events.len() as u64);
        EventStats::add(&stats.payload_bytes_published, payload.len() as u64);
        let mut b = self.shared.buffer.lock();
        b.push(seq, payload);
        stats
            .replay_buffer_batches
            .store(b.len() as u64, Ordering::Relaxed);
        stats
            .replay_buffer_bytes
            .store(b.bytes(), Ordering::Relaxed);
    }

    /// Keeps the `subscribers` gauge from the PUB socket's monitor (non-blocking).
    fn watch_subscribers(&mut self) {
        let gauge = &self.shared.stats.subscribers;
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some(ev) = frames.first().filter(|f| f.len() >= 2) else {
                continue;
            };
            let ev = zmq::SocketEvent::from_raw(u16::from_le_bytes([ev[0], ev[1]]));
            match ev {
                zmq::SocketEvent::ACCEPTED | zmq::SocketEvent::CONNECTED => {
                    gauge.fetch_add(1, Ordering::Relaxed);
                }
                zmq::SocketEvent::DISCONNECTED => {
                    let _ = gauge.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                        Some(v.saturating_sub(1))
                    });
                }
                _ => {}
            }
        }
    }
}

/// The replay thread: serves requests one at a time until `stop`. An answer is abandoned
/// when the requester has not taken a message for `timeout` or the whole answer takes
/// longer than `timeout` per 1,000 batches (at least `timeout`).
fn serve_replay(router: zmq::Socket, shared: &Shared, timeout: Duration) {
    let stats = &shared.stats;
    let log = LogGate::new(Duration::from_secs(10));
    while !shared.stop.load(Ordering::Acquire) {
        let frames = match router.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                if let Some(n) = log.pass() {
                    tracing::warn!(error = %e, suppressed_warnings = n,
                        "KV events: replay socket receive failed");
                }
                std::thread::sleep(Duration::from_millis(REPLAY_POLL_MS as u64));
                continue;
            }
        };
        EventStats::add(&stats.replay_requests, 1);
        let Some(req) = Request::parse(frames.into_iter().map(Bytes::from).collect()) else {
            EventStats::add(&stats.replay_rejected, 1);
            continue;
        };
        let batches = match req.start {
            Some(start) => shared.buffer.lock().since(start),
            None => {
                EventStats::add(&stats.replay_rejected, 1);
                if let Some(n) = log.pass() {
                    tracing::warn!(
                        suppressed_warnings = n,
                        "KV events: malformed replay request (want an empty frame and an \
                         8-byte big-endian sequence number); answered with the end marker"
                    );
                }
                Vec::new()
            }
        };
        let budget = timeout * (1 + (batches.len() / 1000) as u32);
        let deadline = Instant::now() + budget;
        let mut outcome = Ok(());
        for (seq, payload) in batches {
            outcome = send_answer(
                &router,
                &req.answer(seq.to_be_bytes(), payload),
                shared,
                deadline,
            );
            if outcome.is_err() {
                break;
            }
            EventStats::add(&stats.replay_batches_sent, 1);
        }
        if outcome.is_ok() {
            outcome = send_answer(
                &router,
                &req.answer(END_SEQ, Bytes::new()),
                shared,
                deadline,
            );
        }
        match outcome {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => {
                EventStats::add(&stats.replay_timeouts, 1);
                if let Some(n) = log.pass() {
                    tracing::warn!(
                        timeout_ms = budget.as_millis() as u64,
                        suppressed_warnings = n,
                        "KV events: replay answer abandoned; the requester stopped reading"
                    );
                }
            }
            Err(e) => {
                if let Some(n) = log.pass() {
                    tracing::warn!(error = %e, suppressed_warnings = n,
                        "KV events: replay answer failed (requester gone?)");
                }
            }
        }
    }
}

/// Sends one answer message, retrying the socket's short send timeout until `deadline`
/// or `stop`; `EAGAIN` when it gave up.
fn send_answer(
    router: &zmq::Socket,
    frames: &[Bytes],
    shared: &Shared,
    deadline: Instant,
) -> Result<(), zmq::Error> {
    let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
    loop {
        match router.send_multipart(parts.iter().copied(), 0) {
            Err(zmq::Error::EAGAIN)
                if Instant::now() < deadline && !shared.stop.load(Ordering::Acquire) => {}
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockRemoved, Medium};

    fn removed(hashes: std::ops::Range<u64>) -> Vec<KvEvent> {
        hashes
            .map(|n| {
                KvEvent::Removed(BlockRemoved {
                    block_hashes: vec![ExternalBlockHash::Int(n)],
                    medium: Some(Medium::CPU),
                })
            })
            .collect()
    }

    /// (tag, first hash) of every event of a payload.
    fn events_of(payload: &[u8]) -> Vec<(String, Option<u64>)> {
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        v.as_array().unwrap()[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let e = e.as_array().unwrap();
                let hash = e.get(1).and_then(|h| h.as_array()?.first()?.as_u64());
                (e[0].as_str().unwrap().to_string(), hash)
            })
            .collect()
    }

    #[test]
    fn a_full_queue_drops_counts_and_tells_subscribers_to_clear() {
        let publisher = EventPublisher::start(&ZmqEventsConfig {
            endpoint: "tcp://127.0.0.1:0".into(),
            endpoint_mode: crate::EndpointMode::Bind,
            queue_capacity_events: 10,
            max_events_per_batch: 100,
            ..Default::default()
        })
        .unwrap();
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.connect(publisher.pub_endpoint()).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(100).unwrap();
        // Live once a probe arrives.
        loop {
            publisher.try_publish(removed(999..1000)).unwrap();
            if sub.recv_multipart(0).is_ok() {
                break;
            }
        }
        let before = publisher.stats();
        publisher.shared.paused.store(true, Ordering::Release);
        let full = |events| PublishError::QueueFull { events };
        assert_eq!(publisher.try_publish(removed(0..3)), Ok(()));
        assert_eq!(publisher.try_publish(removed(3..6)), Ok(()));
        assert_eq!(publisher.try_publish(removed(6..9)), Ok(()));
        assert_eq!(publisher.try_publish(removed(100..103)), Err(full(3)));
        assert_eq!(
            publisher.try_publish(removed(9..10)),
            Ok(()),
            "10 fit exactly"
        );
        assert_eq!(publisher.try_publish(removed(200..203)), Err(full(3)));
        assert_eq!(publisher.try_publish(removed(300..302)), Err(full(2)));
        let s = publisher.stats();
        assert_eq!(s.queued_events, 10);
        assert_eq!(s.submissions_dropped - before.submissions_dropped, 3);
        assert_eq!(s.events_dropped - before.events_dropped, 8);
        assert_eq!(s.clears_after_drop, 2, "one clear per run of drops");
        publisher.shared.paused.store(false, Ordering::Release);

        let mut seen = Vec::new();
        while seen.len() < 12 {
            sub.set_rcvtimeo(10_000).unwrap();
            let m = sub.recv_multipart(0).unwrap();
            seen.extend(events_of(&m[2]));
        }
        let removed_ = |n: u64| ("BlockRemoved".to_string(), Some(n));
        let cleared = ("AllBlocksCleared".to_string(), None);
        let mut want: Vec<_> = (0..9).map(removed_).collect();
        want.push(cleared.clone());
        want.push(removed_(9));
        want.push(cleared);
        assert_eq!(
            seen, want,
            "dropped events are gone and a clear follows each run"
        );
        let s = publisher.stats();
        assert_eq!(s.queued_events, 0);
        assert_eq!(s.events_published - before.events_published, 12);
        // The queue has room again.
        assert_eq!(publisher.try_publish(removed(0..10)), Ok(()));
    }

    #[test]
    fn the_log_gate_passes_one_line_per_interval_and_counts_the_rest() {
        let g = LogGate::new(Duration::from_secs(3600));
        assert_eq!(g.pass(), Some(0));
        assert_eq!(g.pass(), None);
        assert_eq!(g.pass(), None);
        let g = LogGate::new(Duration::ZERO);
        assert_eq!(g.pass(), Some(0));
        assert_eq!(g.pass(), Some(0));
    }
}
