//! Publishes a scripted sequence of KV events, driven line by line from stdin, so that a
//! subscriber written in another language (tests/python/test_kv_events.py) can check
//! what it decodes.
//!
//! ```text
//! kv_events_emit [--endpoint E] [--replay E] [--topic T] [--encoding array|map]
//!                [--block-hash int|bytes] [--dp-rank N] [--buffer-steps N]
//! ```
//!
//! Prints one JSON line `{"pub": ..., "replay": ...}` with the bound endpoints, then reads
//! commands, answering each with one JSON line:
//!
//! - `probe`: publishes one `AllBlocksCleared` batch (a subscriber repeats this until it
//!   receives one: its subscription is then live); `{"seq": N}`.
//! - `script`: publishes the script below, one batch per entry (each waits until the
//!   previous one is numbered, so entries are never merged); `{"first": N, "last": M}`.
//! - `stats`: the publisher's counters.
//!
//! End of input drops the publisher and exits.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use pegaflow_events_zmq::{
    BlockHashForm, BlockRemoved, BlockStored, Encoding, EndpointMode, EventPublisher,
    ExternalBlockHash, KvEvent, Medium, ZmqEventsConfig,
};

/// The digest the script's bytes-or-int hash comes from: bytes 1..=32.
fn digest() -> Vec<u8> {
    (1..=32).collect()
}

/// The script; tests/python/test_kv_events.py spells out the same entries.
fn script(p: &EventPublisher) -> Vec<Vec<KvEvent>> {
    let int = ExternalBlockHash::Int;
    let tokens = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();
    vec![
        // A prefix's first blocks in DRAM: no parent.
        vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![int(1), int(2), int(3)],
            parent_block_hash: None,
            token_ids: tokens(1, 48),
            block_size: 16,
            lora_id: None,
            medium: Some(Medium::CPU),
            lora_name: None,
        })],
        // Its continuation written to the SSD tier, with a LoRA.
        vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![int(4)],
            parent_block_hash: Some(int(3)),
            token_ids: tokens(49, 16),
            block_size: 16,
            lora_id: Some(7),
            medium: Some(Medium::DISK),
            lora_name: Some("adapter-a".into()),
        })],
        vec![KvEvent::Removed(BlockRemoved {
            block_hashes: vec![int(1), int(2)],
            medium: Some(Medium::CPU),
        })],
        // A digest in the configured form, the largest int, a named tier, no tokens.
        vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![p.block_hash(&digest()), int(u64::MAX)],
            parent_block_hash: Some(p.block_hash(&digest())),
            token_ids: vec![],
            block_size: 256,
            lora_id: None,
            medium: Some(Medium::named("cxl-pool")),
            lora_name: None,
        })],
        vec![KvEvent::Removed(BlockRemoved {
            block_hashes: vec![int(4)],
            medium: Some(Medium::DISK),
        })],
        vec![KvEvent::AllCleared],
        // Several events in one batch, one with no medium.
        vec![
            KvEvent::Stored(BlockStored {
                block_hashes: vec![int(10)],
                parent_block_hash: None,
                token_ids: tokens(70_000, 4),
                block_size: 4,
                lora_id: None,
                medium: None,
                lora_name: None,
            }),
            KvEvent::Removed(BlockRemoved {
                block_hashes: vec![int(10)],
                medium: None,
            }),
            KvEvent::Stored(BlockStored {
                block_hashes: vec![int(11), int(12)],
                parent_block_hash: Some(int(10)),
                token_ids: tokens(0, 8),
                block_size: 4,
                lora_id: None,
                medium: Some(Medium::CPU),
                lora_name: None,
            }),
        ],
    ]
}

fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn wait_numbered(p: &EventPublisher, n: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.stats().next_seq < n {
        if Instant::now() > deadline {
            return Err(format!("batch {n} was never numbered"));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = ZmqEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        endpoint_mode: EndpointMode::Bind,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv-events".into(),
        ..Default::default()
    };
    if let Some(v) = arg_value(&args, "--endpoint") {
        cfg.endpoint = v;
    }
    if let Some(v) = arg_value(&args, "--replay") {
        cfg.replay_endpoint = Some(v);
    }
    if let Some(v) = arg_value(&args, "--topic") {
        cfg.topic = v;
    }
    if let Some(v) = arg_value(&args, "--encoding") {
        cfg.encoding = match v.as_str() {
            "array" => Encoding::Array,
            "map" => Encoding::Map,
            other => return Err(format!("--encoding {other}: array or map")),
        };
    }
    if let Some(v) = arg_value(&args, "--block-hash") {
        cfg.block_hash = match v.as_str() {
            "int" => BlockHashForm::Int,
            "bytes" => BlockHashForm::Bytes,
            other => return Err(format!("--block-hash {other}: int or bytes")),
        };
    }
    if let Some(v) = arg_value(&args, "--dp-rank") {
        cfg.data_parallel_rank = Some(v.parse().map_err(|e| format!("--dp-rank: {e}"))?);
    }
    if let Some(v) = arg_value(&args, "--buffer-steps") {
        cfg.buffer_steps = v.parse().map_err(|e| format!("--buffer-steps: {e}"))?;
    }
    let p = EventPublisher::start(&cfg).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    let say = |out: &mut std::io::StdoutLock, line: String| {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    say(
        &mut out,
        serde_json::json!({"pub": p.pub_endpoint(), "replay": p.replay_endpoint()}).to_string(),
    );
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        match line.trim() {
            "probe" => {
                let seq = p.stats().next_seq;
                p.try_publish(vec![KvEvent::AllCleared])
                    .map_err(|e| e.to_string())?;
                wait_numbered(&p, seq + 1)?;
                say(&mut out, serde_json::json!({ "seq": seq }).to_string());
            }
            "script" => {
                let first = p.stats().next_seq;
                let mut next = first;
                for batch in script(&p) {
                    p.try_publish(batch).map_err(|e| e.to_string())?;
                    next += 1;
                    wait_numbered(&p, next)?;
                }
                say(
                    &mut out,
                    serde_json::json!({"first": first, "last": next - 1}).to_string(),
                );
            }
            "stats" => {
                let s = p.stats();
                say(
                    &mut out,
                    serde_json::json!({
                        "next_seq": s.next_seq,
                        "replay_requests": s.replay_requests,
                        "replay_rejected": s.replay_rejected,
                        "replay_batches_sent": s.replay_batches_sent,
                        "replay_buffer_batches": s.replay_buffer_batches,
                        "subscribers": s.subscribers,
                        "events_dropped": s.events_dropped,
                    })
                    .to_string(),
                );
            }
            "" => {}
            other => say(
                &mut out,
                serde_json::json!({ "error": format!("unknown command {other:?}") }).to_string(),
            ),
        }
    }
    Ok(())
}
