//! What a KV event costs the caller: encoding a batch, and `try_publish` on a running
//! publisher (the publisher thread encodes and sends concurrently).
//!
//! `cargo bench -p pegaflow-events-zmq --bench publish`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use pegaflow_events_zmq::{
    encode_batch, BlockStored, Encoding, EndpointMode, EventPublisher, ExternalBlockHash, KvEvent,
    Medium, ZmqEventsConfig,
};

/// One sealed run of 16 blocks in DRAM, as the server would report it (no token ids).
fn sealed_run(first: u64) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: (first..first + 16)
            .map(|n| ExternalBlockHash::Int(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect(),
        parent_block_hash: Some(ExternalBlockHash::Int(first)),
        token_ids: Vec::new(),
        block_size: 16,
        lora_id: None,
        medium: Some(Medium::CPU),
        lora_name: None,
    })
}

fn bench(c: &mut Criterion) {
    let ev = [sealed_run(1)];
    c.bench_function("encode_batch/array/1x16_blocks", |b| {
        b.iter(|| encode_batch(1.0, std::hint::black_box(&ev), None, Encoding::Array))
    });
    c.bench_function("encode_batch/map/1x16_blocks", |b| {
        b.iter(|| encode_batch(1.0, std::hint::black_box(&ev), None, Encoding::Map))
    });

    let p = EventPublisher::start(&ZmqEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        endpoint_mode: EndpointMode::Bind,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        queue_capacity_events: 10_000_000,
        ..Default::default()
    })
    .unwrap();
    let mut n = 0u64;
    c.bench_function("try_publish/1x16_blocks", |b| {
        b.iter_batched(
            || {
                n += 16;
                vec![sealed_run(n)]
            },
            |evs| p.try_publish(evs).unwrap(),
            BatchSize::SmallInput,
        )
    });
    let s = p.stats();
    eprintln!(
        "published {} batches, dropped {} events, mean queue delay {} us",
        s.batches_published,
        s.events_dropped,
        s.queue_delay_us_sum / s.batches_published.max(1)
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
