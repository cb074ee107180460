//! The KV-cache events and their MessagePack encoding, byte for byte as vLLM's msgspec structs
//! encode (`vllm/distributed/kv_events.py`: `KVEventBatch`, `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`).
//!
//! Owns the event types and the encoder. It never does I/O and never fails: an encoder that
//! writes into memory has no error to report.
//!
//! # The two encodings
//!
//! The batch is always a MessagePack array `[ts, events, data_parallel_rank]` (vLLM's
//! `EventBatch` is `array_like`, and msgspec writes every field of an `array_like` struct,
//! its `omit_defaults` notwithstanding, so a batch without a rank ends in `nil`). Each event
//! is tagged with its class name and comes in one of two shapes ([`Encoding`]):
//!
//! - [`Encoding::Array`]: `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
//!   `["AllBlocksCleared"]`. vLLM's events were `array_like` through its 0.23 releases. The
//!   fields are those of vLLM's struct once `lora_name` was added; every array-era decoder
//!   reads them (older structs ignore trailing elements, newer ones default the later fields
//!   `extra_keys`, `group_idx` and `kv_cache_spec_*`).
//! - [`Encoding::Map`]: `{"type": "BlockStored", "block_hashes": ..., ...}` with the same
//!   fields in the same order; fields that have a default in vLLM's struct are left out, as
//!   msgspec's `omit_defaults` does for maps. vLLM publishes this shape since its events
//!   dropped `array_like` (vLLM 0.26 does).
//!
//! Integers take the smallest MessagePack form (msgspec does the same), `ts` is always a
//! float64, hashes are `uint64` or `bin` ([`ExternalBlockHash`]), strings are `str`.

use std::borrow::Cow;

use bytes::Bytes;
use rmp::encode::{self as mp, ByteBuf, ValueWriteError};
use serde::{Deserialize, Serialize};

/// A block hash as vLLM's `ExternalBlockHash` (`bytes | int`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExternalBlockHash {
    /// vLLM's default form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default): the low 64
    /// bits of the digest read as a big-endian integer. Encoded as a MessagePack unsigned int.
    Int(u64),
    /// The digest itself. Encoded as MessagePack `bin`.
    Bytes(Bytes),
}

impl ExternalBlockHash {
    /// vLLM's int form of `digest`: `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. its
    /// last 8 bytes read big-endian (a shorter digest is read whole; an empty one is 0).
    pub fn int_from_digest(digest: &[u8]) -> Self {
        let tail = &digest[digest.len().saturating_sub(8)..];
        Self::Int(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// `digest` in the given form ([`BlockHashForm`]).
    pub fn from_digest(digest: &[u8], form: BlockHashForm) -> Self {
        match form {
            BlockHashForm::Int => Self::int_from_digest(digest),
            BlockHashForm::Bytes => Self::Bytes(Bytes::copy_from_slice(digest)),
        }
    }
}

/// How a block's digest goes on the wire (`[events] block_hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockHashForm {
    /// The low 64 bits as an unsigned int: what vLLM sends by default and what routers
    /// index on.
    #[default]
    Int,
    /// The whole digest as `bin` (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes,
}

/// Where a block lives, vLLM's `medium` string. vLLM itself says `GPU` for its device
/// cache and `CPU` for its CPU offload; this server says [`Medium::CPU`] for host DRAM,
/// [`Medium::DISK`] for the SSD tier and a tier's own name for any other tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Medium(pub Cow<'static, str>);

impl Medium {
    /// Host DRAM (the landing tier).
    pub const CPU: Medium = Medium(Cow::Borrowed("CPU"));
    /// The SSD tier.
    pub const DISK: Medium = Medium(Cow::Borrowed("DISK"));
    /// A device's memory (vLLM's own `MEDIUM_GPU`).
    pub const GPU: Medium = Medium(Cow::Borrowed("GPU"));

    /// Any other tier, by name.
    pub fn named(name: impl Into<String>) -> Self {
        Self(Cow::Owned(name.into()))
    }

    /// The string sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Blocks became available in a medium (vLLM's `BlockStored`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// The blocks, in prefix order.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// The block before the first one in the prefix, `None` for a prefix's first block.
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The tokens the blocks hold (vLLM sends `block_size` per block; empty when unknown).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter id (deprecated by vLLM in favour of `lora_name`; still sent).
    pub lora_id: Option<u64>,
    /// Where the blocks are.
    pub medium: Option<Medium>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
}

/// Blocks are no longer available in a medium (vLLM's `BlockRemoved`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// The blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// Where they were.
    pub medium: Option<Medium>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`.
    Stored(BlockStored),
    /// `BlockRemoved`.
    Removed(BlockRemoved),
    /// `AllBlocksCleared`: a subscriber forgets every block of this publisher. Also sent by
    /// the publisher itself after it dropped events (crate docs, "Drops").
    AllCleared,
}

impl KvEvent {
    /// vLLM's class name, the tag.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::Stored(_) => "BlockStored",
            KvEvent::Removed(_) => "BlockRemoved",
            KvEvent::AllCleared => "AllBlocksCleared",
        }
    }
}

/// The shape of each event inside a batch (`[events] encoding`; module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Tagged arrays (vLLM through 0.23).
    #[default]
    Array,
    /// Tagged maps with the tag under `"type"` (newer vLLM).
    Map,
}

/// A batch of events as vLLM's `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// When the batch was made, seconds since the Unix epoch.
    pub ts: f64,
    /// The events, applied in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank the batch is from; `None` sends `nil`.
    pub data_parallel_rank: Option<u32>,
}

impl EventBatch {
    /// The batch's MessagePack bytes.
    pub fn encode(&self, encoding: Encoding) -> Vec<u8> {
        encode_batch(self.ts, &self.events, self.data_parallel_rank, encoding)
    }
}

/// Encodes `[ts, events, data_parallel_rank]` (module docs).
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<u32>,
    encoding: Encoding,
) -> Vec<u8> {
    let mut w = Writer(ByteBuf::with_capacity(32 + events.len() * 48));
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for e in events {
        w.event(e, encoding);
    }
    w.opt_uint(data_parallel_rank.map(u64::from));
    w.0.into_vec()
}

/// A MessagePack writer into memory: `ByteBuf`'s error type is uninhabited, so every write
/// succeeds and the results are matched away without a panic path.
struct Writer(ByteBuf);

fn ok<T>(r: Result<T, ValueWriteError<std::convert::Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => {
            match e {}
        }
    }
}

fn len32(n: usize) -> u32 {
    // A batch is capped far below 2^32 elements (`max_events_per_batch`, the queue's
    // capacity); saturate rather than wrap if a caller ever hands more.
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Writer {
    fn array(&mut self, n: usize) {
        ok(mp::write_array_len(&mut self.0, len32(n)));
    }
    fn map(&mut self, n: usize) {
        ok(mp::write_map_len(&mut self.0, len32(n)));
    }
    fn f64(&mut self, v: f64) {
        ok(mp::write_f64(&mut self.0, v));
    }
    fn uint(&mut self, v: u64) {
        ok(mp::write_uint(&mut self.0, v));
    }
    fn nil(&mut self) {
        ok(mp::write_nil(&mut self.0).map_err(ValueWriteError::InvalidMarkerWrite));
    }
    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn str(&mut self, s: &str) {
        ok(mp::write_str(&mut self.0, s));
    }
    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }
    fn hash(&mut self, h: &ExternalBlockHash) {
        match h {
            ExternalBlockHash::Int(v) => self.uint(*v),
            ExternalBlockHash::Bytes(b) => ok(mp::write_bin(&mut self.0, b)),
        }
    }
    fn hashes(&mut self, hs: &[ExternalBlockHash]) {
        self.array(hs.len());
        for h in hs {
            self.hash(h);
        }
    }
    fn key(&mut self, encoding: Encoding, name: &str) {
        if encoding == Encoding::Map {
            self.str(name);
        }
    }

    fn event(&mut self, e: &KvEvent, encoding: Encoding) {
        // Fields after the tag; the map form writes the same values under their names.
        let fields = match e {
            KvEvent::Stored(_) => 7,
            KvEvent::Removed(_) => 2,
            KvEvent::AllCleared => 0,
        };
        match encoding {
            Encoding::Array => {
                self.array(1 + fields);
                self.str(e.tag());
            }
            Encoding::Map => {
                self.map(1 + fields);
                self.str("type");
                self.str(e.tag());
            }
        }
        match e {
            KvEvent::Stored(s) => {
                self.key(encoding, "block_hashes");
                self.hashes(&s.block_hashes);
                self.key(encoding, "parent_block_hash");
                match &s.parent_block_hash {
                    Some(h) => self.hash(h),
                    None => self.nil(),
                }
                self.key(encoding, "token_ids");
                self.array(s.token_ids.len());
                for t in &s.token_ids {
                    self.uint(u64::from(*t));
                }
                self.key(encoding, "block_size");
                self.uint(u64::from(s.block_size));
                self.key(encoding, "lora_id");
                self.opt_uint(s.lora_id);
                self.key(encoding, "medium");
                self.opt_str(s.medium.as_ref().map(Medium::as_str));
                self.key(encoding, "lora_name");
                self.opt_str(s.lora_name.as_deref());
            }
            KvEvent::Removed(r) => {
                self.key(encoding, "block_hashes");
                self.hashes(&r.block_hashes);
                self.key(encoding, "medium");
                self.opt_str(r.medium.as_ref().map(Medium::as_str));
            }
            KvEvent::AllCleared => {}
        }
    }
}
