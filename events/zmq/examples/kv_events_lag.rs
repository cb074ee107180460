//! Event lag from `try_publish` (the seal) to a subscriber's receipt, through a real libzmq
//! SUB socket on loopback, and the caller's cost per `try_publish`.
//!
//! ```text
//! cargo run --release -p pegaflow-events-zmq --example kv_events_lag -- [RATE] [SECONDS]
//! ```
//!
//! Publishes one `BlockStored` of 16 blocks per submission, RATE submissions per second
//! (default 2,000) for SECONDS (default 10), then as fast as it can for the same number of
//! submissions. The lag of a batch is the subscriber's clock at receipt minus the batch's
//! `ts` (the time of its first `try_publish`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pegaflow_events_zmq::{
    BlockStored, EndpointMode, EventPublisher, ExternalBlockHash, KvEvent, Medium, ZmqEventsConfig,
};

fn sealed_run(first: u64) -> Vec<KvEvent> {
    vec![KvEvent::Stored(BlockStored {
        block_hashes: (first..first + 16).map(ExternalBlockHash::Int).collect(),
        parent_block_hash: None,
        token_ids: Vec::new(),
        block_size: 16,
        lora_id: None,
        medium: Some(Medium::CPU),
        lora_name: None,
    })]
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Returns the lags (ms), the `try_publish` times (us) and the subscriber back.
fn run(
    p: &EventPublisher,
    sub: zmq::Socket,
    count: u64,
    rate: Option<u64>,
) -> (Vec<f64>, Vec<f64>, zmq::Socket) {
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            let mut lags = Vec::with_capacity(count as usize);
            let mut events = 0u64;
            while events < count {
                let Ok(f) = sub.recv_multipart(0) else { break };
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                // [ts, ...]: 0x93, then 0xcb and the float64 big-endian.
                let ts = f64::from_be_bytes(f[2][2..10].try_into().unwrap());
                lags.push((now - ts) * 1e3);
                let v = rmpv::decode::read_value(&mut &f[2][..]).unwrap();
                events += v.as_array().unwrap()[1].as_array().unwrap().len() as u64;
            }
            (lags, sub)
        });
        let mut calls = Vec::with_capacity(count as usize);
        let t0 = Instant::now();
        for i in 0..count {
            if let Some(rate) = rate {
                let due = t0 + Duration::from_nanos(i * 1_000_000_000 / rate);
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
            }
            let evs = sealed_run(i * 16);
            let t = Instant::now();
            p.try_publish(evs).unwrap();
            calls.push(t.elapsed().as_nanos() as f64 / 1e3);
        }
        let (lags, sub) = h.join().unwrap();
        (lags, calls, sub)
    })
}

fn report(name: &str, mut lags: Vec<f64>, mut calls: Vec<f64>) {
    lags.sort_by(f64::total_cmp);
    calls.sort_by(f64::total_cmp);
    println!(
        "{name}: {} batches received; lag ms p50 {:.3} p99 {:.3} max {:.3}; try_publish us p50 {:.2} p99 {:.2} max {:.1}",
        lags.len(),
        pct(&lags, 0.5),
        pct(&lags, 0.99),
        lags.last().copied().unwrap_or(f64::NAN),
        pct(&calls, 0.5),
        pct(&calls, 0.99),
        calls.last().copied().unwrap_or(f64::NAN),
    );
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rate = args.first().copied().unwrap_or(2_000);
    let secs = args.get(1).copied().unwrap_or(10);
    let p = EventPublisher::start(&ZmqEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        endpoint_mode: EndpointMode::Bind,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv-events".into(),
        hwm: 1_000_000,
        queue_capacity_events: 10_000_000,
        ..Default::default()
    })
    .expect("start");
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_rcvhwm(1_000_000).unwrap();
    sub.connect(p.pub_endpoint()).unwrap();
    sub.set_subscribe(b"kv-events").unwrap();
    sub.set_rcvtimeo(100).unwrap();
    loop {
        p.try_publish(sealed_run(0)).unwrap();
        if sub.recv_multipart(0).is_ok() {
            break;
        }
    }
    while sub.recv_multipart(0).is_ok() {}
    sub.set_rcvtimeo(5_000).unwrap();
    let count = rate * secs;
    let (lags, calls, sub) = run(&p, sub, count, Some(rate));
    report(&format!("paced {rate}/s x {secs} s"), lags, calls);
    let (lags, calls, _sub) = run(&p, sub, count, None);
    report("burst, as fast as the caller can", lags, calls);
    let s = p.stats();
    println!(
        "batches {} for {} events (merged), dropped {}, queue delay mean {} us max {} us",
        s.batches_published,
        s.events_published,
        s.events_dropped,
        s.queue_delay_us_sum / s.batches_published.max(1),
        s.queue_delay_us_max
    );
}
