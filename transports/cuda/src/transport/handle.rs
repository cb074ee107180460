//! The `cuda` transport's handle ([`CudaTransport`]): what the runtime holds and calls. It
//! checks a batch (domain, served device), hands it to the copy worker of its device and
//! direction (started on first use, or at `install_host_memory`), and waits for the answer on
//! the caller's task; it also starts the landing tier's background pinning and registers the
//! `cuda` factory.
//!
//! Owns: the per-(device, direction) worker queues, the pinned set and the NUMA plan. Must
//! never: run a CUDA call or block on the async executor (a batch goes to its worker's thread
//! over a bounded queue, `queue_depth`), or answer a batch before its worker did.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{
    defaults_of, ConfigSchema, CopyBatch, Direction, HostRegion, MemorySpace, OpParts,
    RuntimeContext, Transport, TransportError, TransportFactory,
};
use tokio::sync::{mpsc, oneshot};

use super::config::{CudaTransportConfig, Wait, OPTIONS, POLL_LIMIT};
use super::numa::{run_on_node, Numa};
use super::progress::{signal_near_end, ReadListener};
use super::report::{CopyPath, CopyReport};
use super::worker::{worker_main, Job};
use crate::driver::{driver, CudaError, Driver};
use crate::pin::PinSet;
use crate::CUDA_DOMAIN;

struct Shared {
    driver: &'static Driver,
    cfg: CudaTransportConfig,
    /// The installed host memory's pinned set (set once, by `install_host_memory`).
    pins: OnceLock<Arc<PinSet>>,
    allowed: Option<Vec<i32>>,
    workers: Mutex<HashMap<(i32, bool), mpsc::Sender<Job>>>,
    /// NUMA placement for the served devices (decided once, at build).
    numa: Numa,
}

/// The `cuda` transport. Cheap to share; dropping it stops its workers (after the batches they
/// hold) and unpins the landing tier.
pub struct CudaTransport {
    shared: Result<Arc<Shared>, CudaError>,
}

impl std::fmt::Debug for CudaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.shared {
            Ok(s) => f
                .debug_struct("CudaTransport")
                .field("cfg", &s.cfg)
                .field("pins", &s.pins)
                .finish(),
            Err(e) => f.debug_tuple("CudaTransport").field(&e.0).finish(),
        }
    }
}

impl CudaTransport {
    /// Builds the transport. Without a driver it still builds (and logs a warning): every copy
    /// then fails with "CUDA driver not available: ...". Host memory arrives later, through
    /// [`Transport::install_host_memory`], which starts pinning it in the background (when
    /// `cfg.pin`) and the copy workers of every served device.
    pub fn new(cfg: CudaTransportConfig, ctx: &RuntimeContext) -> Self {
        let shared = driver().map(|drv| {
            let served: Vec<i32> = match &ctx.devices {
                Some(v) => v.clone(),
                None => drv.devices().iter().map(|d| d.ordinal).collect(),
            };
            Arc::new(Shared {
                driver: drv,
                cfg,
                pins: OnceLock::new(),
                allowed: ctx.devices.clone(),
                workers: Mutex::new(HashMap::new()),
                numa: Numa::plan(drv, &served, ctx.numa_affinity),
            })
        });
        if let Err(e) = &shared {
            crate::driver::note_unavailable("cuda transport copies", e);
        }
        Self { shared }
    }

    /// Starts pinning `regions` on the first served device (in the background, when
    /// `cfg.pin`), then the copy workers. A second call pins nothing more.
    fn install(&self, regions: &[HostRegion]) {
        let Ok(s) = &self.shared else { return };
        let pin_dev = match &s.allowed {
            Some(v) => v.first().copied(),
            None => s.driver.devices().first().map(|d| d.ordinal),
        };
        s.numa.place(regions);
        if let (Some(dev), true, false) = (pin_dev, s.cfg.pin, regions.is_empty()) {
            let ranges: Vec<(usize, usize)> = regions.iter().map(|r| r.range()).collect();
            let owners: Vec<_> = regions.iter().map(|r| r.owner.clone()).collect();
            let set = PinSet::start(
                s.driver,
                dev,
                &ranges,
                s.cfg.pin_chunk,
                s.cfg.pin_threads,
                Some(Arc::new(owners)),
                s.numa.all_cpus(),
            );
            if s.pins.set(set.clone()).is_err() {
                set.cancel();
                tracing::warn!(
                    "cuda transport: host memory was already installed; ignoring a second set"
                );
            }
        }
        self.warm_up();
    }

    /// Starts both copy workers of every served device now, in their own threads, so that the
    /// first Save or Load does not pay for the context, the streams, the copy kernel's PTX JIT
    /// and the staging buffers. Never blocks the caller; failures surface on the first copy.
    fn warm_up(&self) {
        let Ok(s) = &self.shared else { return };
        let devices: Vec<i32> = match &s.allowed {
            Some(v) => v.clone(),
            None => s.driver.devices().iter().map(|d| d.ordinal).collect(),
        };
        for ordinal in devices {
            for dir in [Direction::ToHost, Direction::ToDevice] {
                if let Err(e) = self.worker(ordinal, dir) {
                    tracing::warn!(ordinal, "cuda copy worker not started: {}", e.0);
                }
            }
        }
    }

    fn build(table: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Transport>> {
        let cfg = CudaTransportConfig::from_table(table)?;
        Ok(Arc::new(Self::new(cfg, ctx)))
    }

    /// The pinned set of the installed host memory, if pinning started.
    pub fn pins(&self) -> Option<&Arc<PinSet>> {
        self.shared.as_ref().ok().and_then(|s| s.pins.get())
    }

    /// Waits (blocking) until the landing tier's pinning finished, at most `timeout`; true when
    /// it did (or there is nothing to pin). For tests, benches and start-up probes.
    pub fn wait_pinned(&self, timeout: Duration) -> bool {
        self.pins().is_none_or(|p| p.wait(timeout))
    }

    fn worker(&self, ordinal: i32, dir: Direction) -> Result<mpsc::Sender<Job>, TransportError> {
        let s = self
            .shared
            .as_ref()
            .map_err(|e| TransportError(e.to_string()))?;
        if let Some(allowed) = &s.allowed {
            if !allowed.contains(&ordinal) {
                return Err(TransportError(format!(
                    "GPU {ordinal} is not one of the devices this server serves ({allowed:?})"
                )));
            }
        }
        if s.driver.device(ordinal).is_none() {
            return Err(TransportError(format!(
                "no CUDA device with ordinal {ordinal}"
            )));
        }
        let to_host = dir == Direction::ToHost;
        let mut workers = s.workers.lock();
        if let Some(tx) = workers.get(&(ordinal, to_host)) {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel(s.cfg.queue_depth);
        let cfg = s.cfg.clone();
        let pins = s.pins.get().cloned();
        let drv = s.driver;
        let cpus = s.numa.cpus.get(&ordinal).cloned().unwrap_or_default();
        std::thread::Builder::new()
            .name(format!(
                "cuda-copy-{ordinal}-{}",
                if to_host { "d2h" } else { "h2d" }
            ))
            .spawn(move || {
                run_on_node("cuda copy worker", &cpus);
                worker_main(drv, ordinal, dir, cfg, pins, rx)
            })
            .map_err(|e| TransportError(format!("cannot spawn a cuda copy worker: {e}")))?;
        workers.insert((ordinal, to_host), tx.clone());
        Ok(tx)
    }

    /// Runs `batch` and reports which path moved it. Completes only after the batch's streams
    /// synchronised.
    ///
    /// Errors: [`TransportError`] when the driver is missing, the device is not served, or any
    /// CUDA call fails (the batch then counts as failed as a whole).
    pub async fn copy_with_report(&self, batch: CopyBatch) -> Result<CopyReport, TransportError> {
        self.submit(batch, None).await
    }

    /// [`CudaTransport::copy_with_report`] for a batch whose ops come in parts
    /// ([`Transport::copy_parts`]): the worker plans and submits each part as it arrives, so
    /// the first bytes move while the engine still builds the rest, and synchronises once,
    /// after the last.
    ///
    /// Errors: as [`CudaTransport::copy_with_report`], and the parts' sender dropped before
    /// it finished (after waiting for what was submitted).
    pub async fn copy_parts_with_report(
        &self,
        batch: CopyBatch,
        parts: OpParts,
    ) -> Result<CopyReport, TransportError> {
        self.submit(batch, Some(parts)).await
    }

    async fn submit(
        &self,
        batch: CopyBatch,
        parts: Option<OpParts>,
    ) -> Result<CopyReport, TransportError> {
        if batch.location.domain != CUDA_DOMAIN {
            return Err(TransportError(format!(
                "the cuda transport cannot address {} memory",
                batch.location
            )));
        }
        let ordinal = batch.location.ordinal;
        if parts.is_none() && batch.ops.iter().all(|o| o.len == 0) {
            return Ok(CopyReport {
                path: CopyPath::Empty,
                bytes: 0,
                submissions: 0,
                overlapped: false,
            });
        }
        let tx = self.worker(ordinal, batch.direction)?;
        let (reply, mut rx) = oneshot::channel();
        let (near_end, near_rx) = oneshot::channel();
        let wait = self.shared.as_ref().map_or(Wait::Sleep, |s| s.cfg.wait);
        let caller_polls = wait != Wait::Sleep;
        let source_read = ReadListener::of_caller(batch.direction);
        let job = Job {
            batch,
            parts,
            reply,
            near_end,
            source_read,
            sent: std::time::Instant::now(),
        };
        tx.send(job).await.map_err(|_| {
            TransportError(format!("the cuda copy worker of GPU {ordinal} is gone"))
        })?;
        let stopped = || {
            TransportError(format!(
                "the cuda copy worker of GPU {ordinal} stopped mid-batch"
            ))
        };
        if caller_polls && near_rx.await.is_ok() {
            // The batch is in its tail (under Spin: all of it is enqueued). Under Tail, tell
            // whoever listens for the near end (the RPC layer sends a Save's response
            // headers; under Spin the end may still be a whole copy away). Then poll for the
            // answer on this task, yielding between polls, for at most POLL_LIMIT (the
            // worker's limit under Tail), then sleep on it.
            if wait == Wait::Tail {
                signal_near_end();
            }
            let until = std::time::Instant::now() + POLL_LIMIT;
            loop {
                match rx.try_recv() {
                    Ok(r) => return r,
                    Err(oneshot::error::TryRecvError::Closed) => return Err(stopped()),
                    Err(oneshot::error::TryRecvError::Empty)
                        if std::time::Instant::now() < until =>
                    {
                        tokio::task::yield_now().await;
                    }
                    Err(oneshot::error::TryRecvError::Empty) => break,
                }
            }
        }
        rx.await.map_err(|_| stopped())?
    }
}

#[async_trait]
impl Transport for CudaTransport {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn can_address(&self, space: MemorySpace) -> bool {
        space.domain == CUDA_DOMAIN
    }

    fn install_host_memory(&self, regions: &[HostRegion]) -> Result<(), TransportError> {
        self.install(regions);
        Ok(())
    }

    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        self.copy_with_report(batch).await.map(|_| ())
    }

    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        self.copy_parts_with_report(batch, parts).await.map(|_| ())
    }
}

impl Drop for CudaTransport {
    fn drop(&mut self) {
        if let Ok(s) = &self.shared {
            if let Some(p) = s.pins.get() {
                p.cancel();
            }
        }
    }
}

inventory::submit! {
    TransportFactory {
        kind: "cuda",
        summary: "GPU <-> host copies (CUDA driver loaded at run time): batched gather/scatter kernel or direct copies",
        config: ConfigSchema {
            defaults: defaults_of::<CudaTransportConfig>,
            check: |_, t| CudaTransportConfig::from_table(t).map(drop),
            options: OPTIONS,
        },
        flags: &[],
        build: CudaTransport::build,
    }
}

#[cfg(test)]
mod tests {
    use pegaflow_api::TransferMode;
    use pegaflow_plugin::CopyOp;

    use super::*;
    use crate::cuda_space;

    #[test]
    fn factory_and_missing_driver() {
        let f = pegaflow_plugin::transport_factory("cuda").unwrap();
        let t = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(t.kind(), "cuda");
        assert!(t.can_address(cuda_space(0)));
        assert!(!t.can_address(MemorySpace::HOST));
        if driver().is_ok() {
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut buf = vec![0u8; 16];
        let batch = CopyBatch {
            location: cuda_space(0),
            direction: Direction::ToHost,
            mode: TransferMode::Kernel,
            ops: vec![CopyOp {
                device_addr: 0x1000,
                host_addr: buf.as_mut_ptr() as usize,
                len: 16,
            }],
        };
        let e = rt.block_on(t.copy(batch)).unwrap_err();
        assert!(e.0.starts_with("CUDA driver not available:"), "{e}");
    }
}
