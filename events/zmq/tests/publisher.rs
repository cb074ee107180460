//! The publisher over real sockets on loopback: sequence numbers, replay, bounds, errors.
//!
//! The clients are libzmq SUB and DEALER sockets (the same library pyzmq wraps;
//! tests/python/test_kv_events.py drives the publisher from Python as a router would).

use std::time::{Duration, Instant};

use pegaflow_events_zmq::{
    BlockRemoved, BlockStored, EndpointMode, EventPublisher, EventsError, ExternalBlockHash,
    KvEvent, Medium, ZmqEventsConfig, END_SEQ,
};

const WAIT_MS: i32 = 10_000;

fn config() -> ZmqEventsConfig {
    ZmqEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        endpoint_mode: EndpointMode::Bind,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv".into(),
        ..Default::default()
    }
}

/// A one-event batch whose hash is `n`, so a batch says which submission it was.
fn removed(n: u64) -> Vec<KvEvent> {
    vec![KvEvent::Removed(BlockRemoved {
        block_hashes: vec![ExternalBlockHash::Int(n)],
        medium: Some(Medium::CPU),
    })]
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

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().unwrap())
}

fn subscriber(ctx: &zmq::Context, publisher: &EventPublisher, topic: &[u8]) -> zmq::Socket {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.connect(publisher.pub_endpoint()).unwrap();
    sub.set_subscribe(topic).unwrap();
    sub.set_rcvtimeo(WAIT_MS).unwrap();
    sub
}

/// Publishes probe batches until `sub` receives one (the subscription has reached the PUB
/// socket); returns that batch's number. Every batch published after it reaches `sub` in
/// order.
fn go_live(publisher: &EventPublisher, sub: &zmq::Socket) -> u64 {
    sub.set_rcvtimeo(100).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let seq = loop {
        assert!(
            Instant::now() < deadline,
            "the subscription never went live"
        );
        publisher.try_publish(removed(u64::MAX)).unwrap();
        if let Ok(f) = sub.recv_multipart(0) {
            break seq_of(&f[1]);
        }
    };
    sub.set_rcvtimeo(WAIT_MS).unwrap();
    seq
}

fn wait_numbered(publisher: &EventPublisher, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while publisher.stats().next_seq < n {
        assert!(Instant::now() < deadline, "batches were not numbered");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn batches_arrive_in_order_with_no_gap() {
    let publisher = EventPublisher::start(&config()).unwrap();
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &publisher, b"kv");
    let live = go_live(&publisher, &sub);

    for n in 0..500 {
        publisher.try_publish(removed(n)).unwrap();
    }
    // Submissions may be merged into fewer batches; every event arrives once, in order,
    // and the numbers rise by one.
    let mut expect_seq = live + 1;
    let mut seen = Vec::new();
    while seen.len() < 500 {
        let f = sub.recv_multipart(0).expect("batch lost");
        assert_eq!(f.len(), 3, "[topic, seq, payload]");
        assert_eq!(f[0], b"kv");
        assert_eq!(seq_of(&f[1]), expect_seq, "a gap or a repeat");
        expect_seq += 1;
        for (tag, hash) in events_of(&f[2]) {
            assert_eq!(tag, "BlockRemoved");
            seen.push(hash.unwrap());
        }
    }
    assert_eq!(seen, (0..500).collect::<Vec<_>>());
    let s = publisher.stats();
    assert_eq!(s.next_seq, expect_seq);
    assert_eq!(s.batches_published, expect_seq);
    assert_eq!(s.events_dropped, 0);
    assert_eq!(s.queued_events, 0);
    assert_eq!(s.subscribers, 1);
    // A subscriber to another topic gets nothing.
    let other = subscriber(&ctx, &publisher, b"other");
    other.set_rcvtimeo(300).unwrap();
    publisher.try_publish(removed(1)).unwrap();
    assert!(sub.recv_multipart(0).is_ok());
    assert!(other.recv_multipart(0).is_err());
}

#[test]
fn large_submissions_are_split_and_small_ones_merged() {
    let publisher = EventPublisher::start(&ZmqEventsConfig {
        max_events_per_batch: 4,
        ..config()
    })
    .unwrap();
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &publisher, b"");
    let live = go_live(&publisher, &sub);
    // 10 events in one submission: batches of at most 4.
    publisher
        .try_publish((0..10).flat_map(removed).collect())
        .unwrap();
    let mut seen = Vec::new();
    let mut seq = live;
    while seen.len() < 10 {
        let f = sub.recv_multipart(0).unwrap();
        seq += 1;
        assert_eq!(seq_of(&f[1]), seq);
        let evs = events_of(&f[2]);
        assert!(evs.len() <= 4, "{} events in one batch", evs.len());
        seen.extend(evs.into_iter().map(|(_, h)| h.unwrap()));
    }
    assert_eq!(seen, (0..10).collect::<Vec<_>>());
}

/// Sends a replay request and collects the answer up to the end marker.
fn replay(dealer: &zmq::Socket, frames: &[&[u8]]) -> Vec<(u64, Vec<u8>)> {
    dealer.send_multipart(frames.iter().copied(), 0).unwrap();
    let mut out = Vec::new();
    loop {
        let m = dealer.recv_multipart(0).expect("replay answer stalled");
        assert_eq!(m.len(), 3, "[empty delimiter, seq, payload]: {m:?}");
        assert!(m[0].is_empty());
        if m[1] == END_SEQ {
            assert!(m[2].is_empty(), "the end marker's payload is empty");
            return out;
        }
        out.push((seq_of(&m[1]), m[2].clone()));
    }
}

fn dealer(ctx: &zmq::Context, publisher: &EventPublisher) -> zmq::Socket {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(WAIT_MS).unwrap();
    d.connect(publisher.replay_endpoint().unwrap()).unwrap();
    d
}

#[test]
fn replay_answers_from_the_requested_number_within_the_bound() {
    let publisher = EventPublisher::start(&ZmqEventsConfig {
        buffer_steps: 5,
        ..config()
    })
    .unwrap();
    // No subscriber needed: batches are numbered and kept whether or not anyone listens.
    for n in 0..12 {
        publisher.try_publish(removed(n)).unwrap();
        wait_numbered(&publisher, n + 1);
    }
    assert_eq!(publisher.stats().replay_buffer_batches, 5);
    let ctx = zmq::Context::new();
    let d = dealer(&ctx, &publisher);

    let got = replay(&d, &[b"", &9u64.to_be_bytes()]);
    let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![9, 10, 11]);
    for (s, p) in &got {
        assert_eq!(events_of(p), vec![("BlockRemoved".to_string(), Some(*s))]);
    }
    // Older than the oldest kept: everything kept (the first number tells what was lost).
    let seqs: Vec<u64> = replay(&d, &[b"", &0u64.to_be_bytes()])
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(seqs, vec![7, 8, 9, 10, 11]);
    // Past the newest: the end marker alone.
    assert!(replay(&d, &[b"", &12u64.to_be_bytes()]).is_empty());
    // Malformed (a 4-byte number): the end marker alone, counted.
    assert!(replay(&d, &[b"", b"\0\0\0\x01"]).is_empty());
    // A REQ requester reads the first answer message like vLLM's example subscriber.
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_rcvtimeo(WAIT_MS).unwrap();
    req.connect(publisher.replay_endpoint().unwrap()).unwrap();
    req.send(&11u64.to_be_bytes()[..], 0).unwrap();
    let first = req.recv_multipart(0).unwrap();
    assert_eq!(seq_of(&first[0]), 11);
    let s = publisher.stats();
    assert_eq!(s.replay_requests, 5);
    assert_eq!(s.replay_rejected, 1);
    assert!(s.replay_batches_sent >= 9);
}

#[test]
fn replay_fills_a_gap_with_the_bytes_the_stream_carried() {
    let publisher = EventPublisher::start(&config()).unwrap();
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &publisher, b"kv");
    let live = go_live(&publisher, &sub);
    for n in 0..20 {
        publisher.try_publish(removed(n)).unwrap();
        wait_numbered(&publisher, live + 2 + n);
    }
    let live_payloads: Vec<(u64, Vec<u8>)> = (0..20)
        .map(|_| {
            let f = sub.recv_multipart(0).unwrap();
            (seq_of(&f[1]), f[2].clone())
        })
        .collect();
    // Pretend batches from live+5 on were lost; ask for them.
    let d = dealer(&ctx, &publisher);
    let got = replay(&d, &[b"", &(live + 5).to_be_bytes()]);
    assert_eq!(got.len(), 16);
    for (s, p) in &got {
        let (_, live_p) = live_payloads.iter().find(|(ls, _)| ls == s).unwrap();
        assert_eq!(p, live_p, "replayed bytes differ from the live batch {s}");
    }
}

#[test]
fn a_stalled_subscriber_slows_neither_the_caller_nor_other_subscribers() {
    const HWM: usize = 1_000;
    let publisher = EventPublisher::start(&ZmqEventsConfig {
        topic: String::new(),
        max_events_per_batch: 1,
        hwm: HWM,
        queue_capacity_events: 1_000_000,
        ..config()
    })
    .unwrap();
    let ctx = zmq::Context::new();
    // Takes one message into its queue and a small socket buffer, then never reads.
    let stalled = ctx.socket(zmq::SUB).unwrap();
    stalled.set_rcvhwm(1).unwrap();
    stalled.set_rcvbuf(4096).unwrap();
    stalled.connect(publisher.pub_endpoint()).unwrap();
    stalled.set_subscribe(b"").unwrap();
    let healthy = subscriber(&ctx, &publisher, b"");
    let live = go_live(&publisher, &healthy);
    // `go_live` also made the stalled subscriber's subscription arrive (or it never will:
    // it was sent first). Publish far past its socket buffers and `hwm`.
    const N: u64 = 50_000;
    let healthy_ep = std::thread::spawn(move || {
        let mut last = 0;
        while let Ok(f) = healthy.recv_multipart(0) {
            last = seq_of(&f[1]);
            if last == live + N {
                break;
            }
        }
        last
    });
    let tokens: Vec<u32> = (100_000..100_128).collect(); // ~650-byte batches
    let mut slowest = Duration::ZERO;
    for n in 0..N {
        let ev = KvEvent::Stored(BlockStored {
            block_hashes: vec![ExternalBlockHash::Int(n)],
            token_ids: tokens.clone(),
            block_size: 128,
            ..Default::default()
        });
        let t = Instant::now();
        let r = publisher.try_publish(vec![ev]);
        slowest = slowest.max(t.elapsed());
        r.unwrap();
        if n % 1024 == 0 {
            // Keep the queue short: this test is about the socket, not our queue.
            wait_numbered(&publisher, live + 1 + n);
        }
    }
    let last = healthy_ep.join().unwrap();
    let s = publisher.stats();
    assert_eq!(
        s.next_seq,
        live + N + 1,
        "the publisher thread kept numbering"
    );
    assert_eq!(last, live + N, "the healthy subscriber got the last batch");
    assert_eq!(s.send_errors, 0);
    // The stalled subscriber was not waited for: what it holds once it reads again is an
    // increasing run of numbers with most batches missing (dropped by the PUB socket past
    // `hwm` for that peer).
    stalled.set_rcvtimeo(500).unwrap();
    let mut held = Vec::new();
    while let Ok(f) = stalled.recv_multipart(0) {
        held.push(seq_of(&f[1]));
    }
    eprintln!(
        "stalled-subscriber run: {N} batches of ~650 bytes, hwm {HWM}; slowest try_publish \
         {slowest:?}; queue delay max {} us; the stalled peer held {} batches",
        s.queue_delay_us_max,
        held.len()
    );
    assert!(held.windows(2).all(|w| w[0] < w[1]), "in order");
    assert!(
        (held.len() as u64) < N / 2,
        "the PUB socket dropped the stalled peer's copies past hwm, it did not queue them all"
    );
}

#[test]
fn a_taken_port_is_a_clear_error_at_start() {
    let first = EventPublisher::start(&config()).unwrap();
    let taken = first.pub_endpoint().to_string();
    let e = EventPublisher::start(&ZmqEventsConfig {
        endpoint: taken.clone(),
        ..config()
    })
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, EventsError::Bind { socket: "PUB", .. }),
        "{e:?}"
    );
    assert!(
        msg.contains(&taken) && msg.contains("in use"),
        "names the endpoint and the reason: {msg}"
    );
    let e = EventPublisher::start(&ZmqEventsConfig {
        replay_endpoint: Some(first.replay_endpoint().unwrap().to_string()),
        ..config()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            EventsError::Bind {
                socket: "replay",
                ..
            }
        ),
        "{e:?}"
    );
    // The first publisher is untouched.
    assert!(first.is_running());
    first.try_publish(removed(1)).unwrap();
}

#[test]
fn bad_endpoints_are_clear_errors_at_start() {
    let e = EventPublisher::start(&ZmqEventsConfig {
        // TEST-NET-1: an address this host does not have.
        endpoint: "tcp://192.0.2.1:5557".into(),
        ..config()
    })
    .unwrap_err();
    assert!(
        matches!(e, EventsError::Bind { socket: "PUB", .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("tcp://192.0.2.1:5557"), "{e}");
    let e = EventPublisher::start(&ZmqEventsConfig {
        endpoint: "inproc://x".into(),
        ..config()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            EventsError::Config {
                key: "endpoint",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn connect_mode_reaches_a_bound_subscriber() {
    // The subscriber binds (an XSUB proxy would); the publisher connects to it.
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.bind("tcp://127.0.0.1:*").unwrap();
    sub.set_subscribe(b"").unwrap();
    let ep = sub.get_last_endpoint().unwrap().unwrap();
    let publisher = EventPublisher::start(&ZmqEventsConfig {
        endpoint: ep.clone(),
        endpoint_mode: EndpointMode::Auto, // no `*`: vLLM's rule connects
        ..config()
    })
    .unwrap();
    assert_eq!(publisher.pub_endpoint(), ep);
    let live = go_live(&publisher, &sub);
    publisher.try_publish(removed(42)).unwrap();
    let f = sub.recv_multipart(0).unwrap();
    assert_eq!(seq_of(&f[1]), live + 1);
    assert_eq!(events_of(&f[2]), vec![("BlockRemoved".into(), Some(42))]);
    assert_eq!(publisher.stats().subscribers, 1);
}

#[test]
fn ipc_endpoints_work() {
    let dir = std::env::temp_dir().join(format!("pf-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ep = format!("ipc://{}/pub.sock", dir.display());
    let publisher = EventPublisher::start(&ZmqEventsConfig {
        endpoint: ep.clone(),
        endpoint_mode: EndpointMode::Auto, // ipc binds under vLLM's rule
        replay_endpoint: None,
        ..config()
    })
    .unwrap();
    assert_eq!(publisher.pub_endpoint(), ep);
    assert_eq!(publisher.replay_endpoint(), None);
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &publisher, b"kv");
    go_live(&publisher, &sub);
    drop(publisher);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_oversized_replay_request_is_refused_and_others_still_served() {
    let publisher = EventPublisher::start(&config()).unwrap();
    publisher.try_publish(removed(5)).unwrap();
    wait_numbered(&publisher, 1);
    let ctx = zmq::Context::new();
    let big = dealer(&ctx, &publisher);
    big.set_rcvtimeo(500).unwrap();
    big.send_multipart([&b""[..], &[0u8; 1024][..]], 0).unwrap();
    assert!(
        big.recv_multipart(0).is_err(),
        "a 1 KiB request gets no answer: libzmq drops the peer"
    );
    let d = dealer(&ctx, &publisher);
    let got = replay(&d, &[b"", &0u64.to_be_bytes()]);
    assert_eq!(got.len(), 1);
    assert_eq!(
        publisher.stats().replay_requests,
        1,
        "the oversized one never arrived"
    );
}
