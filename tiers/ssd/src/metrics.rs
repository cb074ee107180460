//! The SSD tier's metric families (`pegaflow_ssd_*`), registered in the server's registry.

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// 1 GB/s to 40 GB/s (PegaFlow's throughput buckets).
fn throughput_buckets() -> Vec<f64> {
    vec![1e9, 2e9, 4e9, 6e9, 8e9, 10e9, 15e9, 20e9, 30e9, 40e9]
}

/// Every family of one SSD tier. The `pegaflow_ssd_write_*` and `pegaflow_ssd_prefetch_*`
/// families carry PegaFlow 0.25.1's names (a dashboard built for it keeps working); the rest
/// are this tier's own.
#[derive(Clone)]
pub struct SsdMetrics {
    /// Record bytes written (PegaFlow's `pegaflow_ssd_write_bytes`).
    pub write_bytes: IntCounter,
    /// Blocks whose write failed (PegaFlow's `pegaflow_ssd_write_failures`).
    pub write_failures: IntCounter,
    /// Bytes per second of each write (PegaFlow's `pegaflow_ssd_write_throughput`).
    pub write_throughput: Histogram,
    /// Put batches in the tier (PegaFlow's `pegaflow_ssd_write_queue_pending`).
    pub write_queue_pending: IntGauge,
    /// Put batches refused, queue full (PegaFlow's `pegaflow_ssd_write_queue_full`).
    pub write_queue_full: IntCounter,
    /// Writes in flight (PegaFlow's `pegaflow_ssd_write_inflight`).
    pub write_inflight: IntGauge,
    /// Record bytes read (PegaFlow's `pegaflow_ssd_prefetch_bytes`).
    pub prefetch_bytes: IntCounter,
    /// Blocks read and verified (PegaFlow's `pegaflow_ssd_prefetch_success`).
    pub prefetch_success: IntCounter,
    /// Blocks whose read failed (PegaFlow's `pegaflow_ssd_prefetch_failures`).
    pub prefetch_failures: IntCounter,
    /// Bytes per second of each read (PegaFlow's `pegaflow_ssd_prefetch_throughput`).
    pub prefetch_throughput: Histogram,
    /// Reads in flight (PegaFlow's `pegaflow_ssd_prefetch_inflight`).
    pub prefetch_inflight: IntGauge,
    /// Get batches refused, queue full (PegaFlow's `pegaflow_ssd_prefetch_queue_full`).
    pub prefetch_queue_full: IntCounter,
    /// Blocks written / read, by op.
    pub blocks: IntCounterVec,
    /// I/O errors by op (`write`, `read`, `preallocate`, `summary`, `sync`, `recover`) and
    /// kind (`eio`, `enospc`, `short`, `other`).
    pub errors: IntCounterVec,
    /// Records that failed their checks when read (dropped from the index, never served), by
    /// why: `header` (no record header where the index has one), `identity` (another block,
    /// generation or slot layout), `checksum` (the record checksum over place, header and
    /// payload fails: a misdirected, lost or torn write, rotten bytes), `short`.
    pub corrupt_records: IntCounterVec,
    /// Segments evicted, by reason (`capacity`, `enospc`, `degraded`, `read_error`).
    pub segment_evictions: IntCounterVec,
    /// Seconds the last recovery took.
    pub recovery_seconds: prometheus::Gauge,
    /// Blocks the last recovery indexed.
    pub recovered_blocks: IntGauge,
    /// Records the last recovery dropped (torn, failed checksums).
    pub recovery_dropped: IntGauge,
    /// Bytes held / capacity.
    pub used_bytes: IntGauge,
    /// Capacity in bytes (directories in service).
    pub capacity_bytes: IntGauge,
    /// Directories out of service after repeated errors.
    pub degraded_dirs: IntGauge,
    /// 1 for the I/O engine in use, by engine (`uring`, `posix`).
    pub io_engine: IntGaugeVec,
    /// Times `io = "auto"` fell back to posix because io_uring was refused.
    pub io_fallbacks: IntCounter,
    /// Latency of one block read (promotion), seconds.
    pub read_seconds: Histogram,
}

impl SsdMetrics {
    /// Creates the families and registers them in `registry` (a second SSD tier in one
    /// server counts into unregistered families: its figures are not exported).
    pub fn new(registry: &Registry) -> Self {
        let m = Self {
            write_bytes: IntCounter::new(
                "pegaflow_ssd_write_bytes_total",
                "Record bytes written to the SSD tier",
            )
            .unwrap(),
            write_failures: IntCounter::new(
                "pegaflow_ssd_write_failures_total",
                "Blocks whose SSD write failed",
            )
            .unwrap(),
            write_throughput: Histogram::with_opts(
                HistogramOpts::new(
                    "pegaflow_ssd_write_throughput",
                    "Bytes per second of each SSD write",
                )
                .buckets(throughput_buckets()),
            )
            .unwrap(),
            write_queue_pending: IntGauge::new(
                "pegaflow_ssd_write_queue_pending",
                "Put batches in the SSD tier",
            )
            .unwrap(),
            write_queue_full: IntCounter::new(
                "pegaflow_ssd_write_queue_full_total",
                "Put batches the SSD tier refused because its write queue was full",
            )
            .unwrap(),
            write_inflight: IntGauge::new("pegaflow_ssd_write_inflight", "SSD writes in flight")
                .unwrap(),
            prefetch_bytes: IntCounter::new(
                "pegaflow_ssd_prefetch_bytes_total",
                "Record bytes read from the SSD tier",
            )
            .unwrap(),
            prefetch_success: IntCounter::new(
                "pegaflow_ssd_prefetch_success_total",
                "Blocks read from the SSD tier and verified",
            )
            .unwrap(),
            prefetch_failures: IntCounter::new(
                "pegaflow_ssd_prefetch_failures_total",
                "Blocks whose SSD read failed (I/O error or failed checks)",
            )
            .unwrap(),
            prefetch_throughput: Histogram::with_opts(
                HistogramOpts::new(
                    "pegaflow_ssd_prefetch_throughput",
                    "Bytes per second of each SSD read",
                )
                .buckets(throughput_buckets()),
            )
            .unwrap(),
            prefetch_inflight: IntGauge::new(
                "pegaflow_ssd_prefetch_inflight",
                "SSD reads in flight",
            )
            .unwrap(),
            prefetch_queue_full: IntCounter::new(
                "pegaflow_ssd_prefetch_queue_full_total",
                "Get batches the SSD tier refused because its prefetch queue was full",
            )
            .unwrap(),
            blocks: IntCounterVec::new(
                Opts::new(
                    "pegaflow_ssd_blocks_total",
                    "Blocks written to or read from the SSD tier, by op",
                ),
                &["op"],
            )
            .unwrap(),
            errors: IntCounterVec::new(
                Opts::new(
                    "pegaflow_ssd_io_errors_total",
                    "SSD I/O errors, by op and kind",
                ),
                &["op", "kind"],
            )
            .unwrap(),
            corrupt_records: IntCounterVec::new(
                Opts::new(
                    "pegaflow_ssd_corrupt_records_total",
                    "SSD records that failed their checks when read (dropped, never served), by why: header, identity, checksum, short",
                ),
                &["why"],
            )
            .unwrap(),
            segment_evictions: IntCounterVec::new(
                Opts::new(
                    "pegaflow_ssd_segment_evictions_total",
                    "SSD segments evicted, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
            recovery_seconds: prometheus::Gauge::new(
                "pegaflow_ssd_recovery_seconds",
                "Seconds the SSD tier's index rebuild took at start",
            )
            .unwrap(),
            recovered_blocks: IntGauge::new(
                "pegaflow_ssd_recovered_blocks",
                "Blocks the SSD tier found intact at start",
            )
            .unwrap(),
            recovery_dropped: IntGauge::new(
                "pegaflow_ssd_recovery_dropped_records",
                "Records the SSD tier dropped at start (torn or failing checksums)",
            )
            .unwrap(),
            used_bytes: IntGauge::new(
                "pegaflow_ssd_used_bytes",
                "Bytes of records the SSD tier holds",
            )
            .unwrap(),
            capacity_bytes: IntGauge::new(
                "pegaflow_ssd_capacity_bytes",
                "Capacity of the SSD tier's directories in service, bytes",
            )
            .unwrap(),
            degraded_dirs: IntGauge::new(
                "pegaflow_ssd_degraded_dirs",
                "SSD directories taken out of service after repeated I/O errors",
            )
            .unwrap(),
            io_engine: IntGaugeVec::new(
                Opts::new("pegaflow_ssd_io_engine", "1 for the SSD I/O engine in use"),
                &["engine"],
            )
            .unwrap(),
            io_fallbacks: IntCounter::new(
                "pegaflow_ssd_io_fallbacks_total",
                "Times io = auto fell back to pread/pwrite because io_uring was refused",
            )
            .unwrap(),
            read_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "pegaflow_ssd_block_read_seconds",
                    "Latency of one SSD block read, seconds",
                )
                .buckets(prometheus::exponential_buckets(0.000_05, 2.0, 16).unwrap()),
            )
            .unwrap(),
        };
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.write_bytes.clone()),
            Box::new(m.write_failures.clone()),
            Box::new(m.write_throughput.clone()),
            Box::new(m.write_queue_pending.clone()),
            Box::new(m.write_queue_full.clone()),
            Box::new(m.write_inflight.clone()),
            Box::new(m.prefetch_bytes.clone()),
            Box::new(m.prefetch_success.clone()),
            Box::new(m.prefetch_failures.clone()),
            Box::new(m.prefetch_throughput.clone()),
            Box::new(m.prefetch_inflight.clone()),
            Box::new(m.prefetch_queue_full.clone()),
            Box::new(m.blocks.clone()),
            Box::new(m.errors.clone()),
            Box::new(m.corrupt_records.clone()),
            Box::new(m.segment_evictions.clone()),
            Box::new(m.recovery_seconds.clone()),
            Box::new(m.recovered_blocks.clone()),
            Box::new(m.recovery_dropped.clone()),
            Box::new(m.used_bytes.clone()),
            Box::new(m.capacity_bytes.clone()),
            Box::new(m.degraded_dirs.clone()),
            Box::new(m.io_engine.clone()),
            Box::new(m.io_fallbacks.clone()),
            Box::new(m.read_seconds.clone()),
        ];
        for c in all {
            if registry.register(c).is_err() {
                tracing::warn!(
                    "a second SSD tier's metrics are not exported (the names are taken)"
                );
                break;
            }
        }
        m
    }

    /// Counts an I/O error of `op`.
    pub fn error(&self, op: &str, e: &std::io::Error) {
        let kind = match e.raw_os_error() {
            Some(libc::EIO) => "eio",
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => "enospc",
            None if e.kind() == std::io::ErrorKind::StorageFull => "enospc",
            _ if matches!(
                e.kind(),
                std::io::ErrorKind::WriteZero | std::io::ErrorKind::UnexpectedEof
            ) =>
            {
                "short"
            }
            _ => "other",
        };
        self.errors.with_label_values(&[op, kind]).inc();
    }
}
