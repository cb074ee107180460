//! The `cuda` transport's settings: the `[[transport]] kind = "cuda"` table
//! ([`CudaTransportConfig`]), what each setting chooses ([`Policy`], [`KernelPath`], [`Wait`]),
//! the fixed sizes and limits behind them, and the option list `--list-plugins` prints.
//!
//! Owns: parsing and range-checking the table, and the defaults. Must never: touch CUDA, or
//! accept a value outside the ranges the workers rely on (`staging_buffers` 2 to 8,
//! `staging_chunk` 1 MiB to 1 GiB, ...): a bad table is refused here, naming the key.

use std::time::Duration;

use pegaflow_plugin::{parse_settings, PluginOption};
use serde::{Deserialize, Serialize};

use crate::pin::MAX_PIN_CHUNK;

/// The first staging chunk of a batch holds at most this many bytes; each next one doubles up
/// to `staging_chunk` ([`crate::plan::StagedPlan::begin_ramped`]): the copy engine starts after a gather
/// of 2 MiB rather than of a whole chunk, and small batches still overlap gather and copy.
pub(super) const FIRST_CHUNK_BYTES: u64 = 2 << 20;

/// Which transfer mode a batch runs in, relative to the batch's [`pegaflow_api::TransferMode`] hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Per batch: the direct path for few or large ranges, the kernel path otherwise.
    Auto,
    /// The batch's mode: `Direct` → direct path, `Kernel` → kernel path.
    Hint,
    /// Always the direct path.
    Direct,
    /// Always the kernel path.
    Kernel,
}

/// How the kernel path reaches host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelPath {
    /// Through a device staging buffer and large pinned copies.
    Staged,
    /// Directly, through mapped pinned host memory (falls back to `Staged` for ranges not
    /// pinned by this transport).
    Mapped,
}

/// How a copy worker waits for the end of a batch (the last step before it answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wait {
    /// Sleep until the GPU signals each stream's end (`cuEventSynchronize` on events made
    /// with `CU_EVENT_BLOCKING_SYNC`): no CPU while the copy runs, plus the driver's wake-up
    /// latency on every batch.
    Sleep,
    /// Sleep until each stream of the batch is in its tail, on events recorded on the way (on
    /// a stream, one after each pinned or direct copy that brings [`MARK_BYTES`] more on it):
    /// per stream, the last mark with at least [`TAIL_BYTES`] after it; then poll every
    /// stream's end (`cuEventQuery` in a loop). Whatever order the copy engine runs the
    /// streams' copies in, the stream whose mark fires last still has [`TAIL_BYTES`] to copy,
    /// so the wake-up latency falls inside the copy. A mark can only follow a whole copy (up
    /// to a `staging_chunk` where host memory is contiguous, or one direct copy), so a stream
    /// holds up to [`MARK_BYTES`] and one copy more than the tail after its mark, and where
    /// the streams copy side by side the polled part is about that much per stream. Each
    /// stream's poll stops after [`POLL_LIMIT`] and sleeps for the rest, so a long or stalled
    /// copy never holds a core.
    /// From the tail on, the task that waits for the batch also polls for the worker's
    /// answer (yielding to the async runtime between polls) for up to [`POLL_LIMIT`].
    Tail,
    /// Poll every stream's end: the lowest latency, one core busy per copying worker for the
    /// whole batch; the waiting task polls for the answer as under [`Wait::Tail`].
    Spin,
}

/// The most copy streams (and staging buffers) a worker has: `staging_buffers` is clamped to
/// 2..=8.
pub(super) const MAX_STREAMS: usize = 8;

/// [`Wait::Tail`] polls for at least this many bytes of each stream's end: 16 MiB, ~0.3 ms
/// of copy at 55 GB/s, more than a sleeping thread's wake-up on the H200 machine.
pub const TAIL_BYTES: u64 = 16 << 20;
/// [`Wait::Tail`] records a mark (an event it can sleep on) on a stream each time this many
/// more bytes are enqueued on it: 8 MiB.
pub const MARK_BYTES: u64 = 8 << 20;
/// A copy worker allocates one descriptor page of this many bytes (host-mapped pinned
/// memory) ahead of its batches, once it is idle and the pool is pinned: 4 MiB, 174,762
/// descriptors of 24 bytes, more than a 4 GiB Load of 32 KiB ops needs. A batch that needs
/// more adds pages as before. Allocating pinned pages while a batch ran cost the first two
/// 512 MiB Saves after a start ~2 ms each on the H200 machine.
pub const DESC_PAGE_START: usize = 4 << 20;
/// Under [`Wait::Tail`] a copy worker creates the marks' events of a batch this large ahead of
/// its batches, with its descriptor page: 4 GiB, 512 events at [`MARK_BYTES`] (twice that for
/// a device → host worker with `overlap`: a batch started ahead uses a second set), so that
/// no batch up to that size creates events while it runs.
pub const MARKS_START_BYTES: u64 = 4 << 30;
/// [`Wait::Tail`] polls one stream's end for at most this long, then sleeps: 2 ms, more than
/// one 64 MiB staging chunk's copy (1.2 ms at 55 GB/s) plus the tail (each stream's poll
/// has its own limit). Under Tail and Spin the task waiting for a batch polls for the
/// worker's answer for at most this long too, then awaits it.
pub const POLL_LIMIT: Duration = Duration::from_millis(2);

/// Settings of a `[[transport]] kind = "cuda"` table: what it deserialises into (unknown
/// keys are refused; a missing key takes its default). Sizes are size strings or bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaTransportConfig {
    /// `policy`: `"auto"` (default), `"hint"`, `"direct"` or `"kernel"`.
    pub policy: Policy,
    /// `kernel_path`: `"staged"` (default) or `"mapped"`.
    pub kernel_path: KernelPath,
    /// `staging_chunk`: bytes per staging buffer, default 64 MiB (a batch's first chunks are
    /// smaller: they ramp from 2 MiB).
    #[serde(with = "pegaflow_plugin::units::size")]
    pub staging_chunk: u64,
    /// `staging_buffers`: staging buffers (and streams) per worker, 2 to 8, default 2. Chunk
    /// `i` of a batch runs on buffer and stream `i % staging_buffers`, so this many chunks are
    /// in flight at once.
    pub staging_buffers: usize,
    /// `direct_min_bytes`: under `auto`, batches whose merged ranges average at least this
    /// many bytes take the direct path; default 8 MiB.
    #[serde(with = "pegaflow_plugin::units::size")]
    pub direct_min_bytes: u64,
    /// `pin`: register the landing tier's memory with CUDA, default true.
    pub pin: bool,
    /// `pin_threads`: threads registering it in parallel, default min(8, CPUs).
    pub pin_threads: usize,
    /// `pin_chunk`: most bytes per registration, default and maximum 64 GiB.
    #[serde(with = "pegaflow_plugin::units::size")]
    pub pin_chunk: usize,
    /// `queue_depth`: batches waiting per worker before `copy` waits, default 64.
    pub queue_depth: usize,
    /// `blocks_per_sm`: kernel thread blocks per multiprocessor, default 8.
    pub blocks_per_sm: u32,
    /// `wait`: how a worker waits for a batch's end: `"tail"` (default), `"sleep"` or
    /// `"spin"` ([`Wait`]). On the H200 machine `tail` moved a 512 MiB Save in 9.90 ms
    /// against 10.10 ms with `sleep` (docs/benchmarks/log/cuda.md §13).
    pub wait: Wait,
    /// `idle_poll_us`: after a batch, a worker polls its queue for this many µs before it
    /// sleeps on it, so that a Save or Load that follows within that time starts without the
    /// worker's wake-up. Default 3,000 (3 ms: more than the published client's ~0.5–2 ms
    /// between Saves); 0 to 100,000. Costs one core per worker (one per device and direction)
    /// for that long after each batch, so under steady traffic a busy worker never sleeps.
    /// On the H200 machine the handover to the worker fell from ~55 to ~17 µs on a 256-block
    /// Save, and 32-block Saves went from 34.3 to 34.9 GB/s (docs/benchmarks/log/cuda.md §13).
    pub idle_poll_us: u64,
    /// `overlap`: a device → host batch that is queued when the worker starts waiting for the
    /// previous one's end, or arrives while it polls for it (under `wait = "tail"` or
    /// `"spin"`), is enqueued behind it at once, so that
    /// the copy engine goes from one batch to the next without a gap; default false. The
    /// staging buffers and the descriptor page are shared as one ring by the two batches.
    /// `false` starts every batch after the previous one ended.
    pub overlap: bool,
    /// [`Wait::Tail`]'s tail ([`TAIL_BYTES`]) and mark spacing ([`MARK_BYTES`]), in bytes. Not
    /// settings: tests shrink them so that small batches take the sleeping branch too.
    #[doc(hidden)]
    #[serde(skip, default = "default_tail_bytes")]
    pub tail_bytes: u64,
    #[doc(hidden)]
    #[serde(skip, default = "default_mark_bytes")]
    pub mark_bytes: u64,
    /// The staged path's first chunk (`FIRST_CHUNK_BYTES`, 2 MiB), in bytes. Not a setting:
    /// `cuda_bench` varies it.
    #[doc(hidden)]
    #[serde(skip, default = "default_first_chunk_bytes")]
    pub first_chunk_bytes: u64,
}

fn default_first_chunk_bytes() -> u64 {
    FIRST_CHUNK_BYTES
}

fn default_tail_bytes() -> u64 {
    TAIL_BYTES
}

fn default_mark_bytes() -> u64 {
    MARK_BYTES
}

impl Default for CudaTransportConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Auto,
            kernel_path: KernelPath::Staged,
            staging_chunk: 64 << 20,
            staging_buffers: 2,
            direct_min_bytes: 8 << 20,
            pin: true,
            pin_threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(8),
            pin_chunk: MAX_PIN_CHUNK,
            queue_depth: 64,
            blocks_per_sm: 8,
            wait: Wait::Tail,
            idle_poll_us: 3_000,
            overlap: false,
            tail_bytes: TAIL_BYTES,
            mark_bytes: MARK_BYTES,
            first_chunk_bytes: FIRST_CHUNK_BYTES,
        }
    }
}

pub(super) const OPTIONS: &[PluginOption] = &[
    PluginOption {
        name: "policy",
        help: "auto | hint (follow the instance's transfer_mode) | direct | kernel",
    },
    PluginOption {
        name: "kernel_path",
        help: "staged (device staging buffer + large pinned copies) | mapped (zero-copy)",
    },
    PluginOption {
        name: "staging_chunk",
        help: "bytes per staging buffer (1 MiB to 1 GiB); each worker (per device and direction) has staging_buffers of them",
    },
    PluginOption {
        name: "staging_buffers",
        help: "staging buffers and streams per worker, 2 to 8: chunks in flight at once",
    },
    PluginOption {
        name: "direct_min_bytes",
        help: "auto: average merged range size from which the direct path is used",
    },
    PluginOption {
        name: "pin",
        help: "pin (cuMemHostRegister) the landing tier in the background",
    },
    PluginOption {
        name: "pin_threads",
        help: "threads pinning in parallel, 1 to 256 (default: min(8, CPUs))",
    },
    PluginOption {
        name: "pin_chunk",
        help: "most bytes per cuMemHostRegister call (2 MiB to 64 GiB)",
    },
    PluginOption {
        name: "queue_depth",
        help: "batches queued per worker, 1 to 65536",
    },
    PluginOption {
        name: "blocks_per_sm",
        help: "copy kernel thread blocks per multiprocessor, 1 to 64",
    },
    PluginOption {
        name: "wait",
        help: "how a worker waits for a batch's end: tail (sleep until each stream is in its last 16 MiB, then poll; the waiting task polls for the answer too, up to 2 ms) | sleep (until the GPU's interrupt) | spin (poll: one core per copying worker)",
    },
    PluginOption {
        name: "idle_poll_us",
        help: "µs a worker polls its queue after a batch before sleeping on it (0 to 100000, default 3000): the next batch starts without a wake-up",
    },
    PluginOption {
        name: "overlap",
        help: "start a queued device to host batch behind the previous one while that one still copies (under wait = tail or spin), so the copy engine has no gap between Saves; default false",
    },
];

impl CudaTransportConfig {
    /// Reads a `cuda` transport table.
    ///
    /// # Errors
    /// Unknown keys (listing the valid ones), wrong types, out-of-range values (naming the
    /// key and its range).
    pub fn from_table(table: &toml::Table) -> anyhow::Result<Self> {
        let c: Self = parse_settings("cuda transport", table)?;
        let range = |key: &str, v: u64, lo: u64, hi: u64, unit: &str| -> anyhow::Result<()> {
            anyhow::ensure!(
                (lo..=hi).contains(&v),
                "cuda transport: {key} must be between {lo} and {hi}{unit}, got {v}"
            );
            Ok(())
        };
        range("staging_chunk", c.staging_chunk, 1 << 20, 1 << 30, " bytes")?;
        range("staging_buffers", c.staging_buffers as u64, 2, 8, "")?;
        range("pin_threads", c.pin_threads as u64, 1, 256, "")?;
        range(
            "pin_chunk",
            c.pin_chunk as u64,
            2 << 20,
            MAX_PIN_CHUNK as u64,
            " bytes",
        )?;
        range("queue_depth", c.queue_depth as u64, 1, 65536, "")?;
        range("blocks_per_sm", u64::from(c.blocks_per_sm), 1, 64, "")?;
        range("idle_poll_us", c.idle_poll_us, 0, 100_000, " µs")?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use pegaflow_plugin::defaults_of;

    use super::*;

    #[test]
    fn config_parsing() {
        let c = CudaTransportConfig::from_table(&toml::Table::new()).unwrap();
        assert_eq!(c, CudaTransportConfig::default());
        let t: toml::Table = toml::from_str(
            r#"policy = "hint"
kernel_path = "mapped"
staging_chunk = "32mb"
staging_buffers = 4
pin = false
pin_threads = 3
pin_chunk = "1gb"
queue_depth = 8
blocks_per_sm = 2
wait = "spin"
idle_poll_us = 3000
overlap = true
direct_min_bytes = "1mb""#,
        )
        .unwrap();
        let c = CudaTransportConfig::from_table(&t).unwrap();
        assert_eq!(c.policy, Policy::Hint);
        assert_eq!(c.kernel_path, KernelPath::Mapped);
        assert_eq!(c.staging_chunk, 32 << 20);
        assert_eq!(c.staging_buffers, 4);
        assert!(!c.pin);
        assert_eq!(
            (c.pin_threads, c.pin_chunk, c.queue_depth, c.blocks_per_sm),
            (3, 1 << 30, 8, 2)
        );
        assert_eq!(c.direct_min_bytes, 1 << 20);
        assert_eq!(c.wait, Wait::Spin);
        assert_eq!(c.idle_poll_us, 3000);
        assert!(c.overlap);
        assert!(!CudaTransportConfig::default().overlap);
        for bad in [
            "overlap = 1",
            "idle_poll_us = 100001",
            "idle_poll_us = -1",
            "wait = \"busy\"",
            "policy = \"fast\"",
            "bogus = 1",
            "staging_chunk = \"1kb\"",
            "staging_buffers = 1",
            "staging_buffers = 9",
            "pin_chunk = \"65gb\"",
            "pin_threads = 0",
            "pin = 1",
        ] {
            let t: toml::Table = toml::from_str(bad).unwrap();
            assert!(CudaTransportConfig::from_table(&t).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_linked_factory_documents_its_settings() {
        let problems = pegaflow_plugin::doc_problems();
        assert!(problems.is_empty(), "{problems:#?}");
        let defaults = defaults_of::<CudaTransportConfig>();
        assert_eq!(
            defaults["staging_chunk"],
            toml::Value::String("64mb".into())
        );
        assert_eq!(defaults["policy"], toml::Value::String("auto".into()));
        assert_eq!(
            CudaTransportConfig::from_table(&defaults).unwrap(),
            CudaTransportConfig::default()
        );
        let listing = pegaflow_plugin::describe_plugins();
        assert!(listing.contains("kernel_path = \"staged\""), "{listing}");
    }
}
