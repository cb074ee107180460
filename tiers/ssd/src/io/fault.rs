//! A fault-injecting engine around a real one: write number k (counted from 0 over the
//! engine's life) fails with EIO or ENOSPC, comes back short, or is torn — only its first
//! half reaches the file while the engine reports success (a device that lies; the records'
//! checksums must catch it). Reads can fail with EIO. Tests drive the SSD tier's recovery
//! and degraded paths with it (`pegaflow_tier_ssd::open_with_engine`).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::{Consume, ConsumeResult, Fill, IoEngine};

/// What an armed write (or read) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// Fails with EIO; nothing written.
    Eio,
    /// Fails with ENOSPC; nothing written.
    Enospc,
    /// Writes the first half, reports a short write (an error).
    Short,
    /// Writes the first half, reports success.
    Torn,
}

/// The fault-injecting engine.
pub struct FaultyIo {
    inner: Arc<dyn IoEngine>,
    writes: AtomicU64,
    reads: AtomicU64,
    at_write: Mutex<HashMap<u64, Fault>>,
    every_write: Mutex<Option<Fault>>,
    fail_reads: Mutex<bool>,
}

impl FaultyIo {
    /// Wraps `inner`, nothing armed.
    pub fn new(inner: Arc<dyn IoEngine>) -> Self {
        Self {
            inner,
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            at_write: Mutex::new(HashMap::new()),
            every_write: Mutex::new(None),
            fail_reads: Mutex::new(false),
        }
    }

    /// Arms write number `k` (0-based, over the engine's life) with `fault`.
    pub fn arm_write(&self, k: u64, fault: Fault) {
        self.at_write.lock().insert(k, fault);
    }

    /// Every write from now on fails with `fault` (`None` disarms).
    pub fn fail_every_write(&self, fault: Option<Fault>) {
        *self.every_write.lock() = fault;
    }

    /// Every read from now on fails with EIO (or not).
    pub fn fail_reads(&self, on: bool) {
        *self.fail_reads.lock() = on;
    }

    /// Writes attempted so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Reads attempted so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

fn os(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

#[async_trait]
impl IoEngine for FaultyIo {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn write(&self, file: Arc<File>, offset: u64, len: usize, fill: Fill) -> io::Result<()> {
        let k = self.writes.fetch_add(1, Ordering::Relaxed);
        let fault = self.at_write.lock().remove(&k).or(*self.every_write.lock());
        match fault {
            None => self.inner.write(file, offset, len, fill).await,
            Some(Fault::Eio) => Err(os(libc::EIO)),
            Some(Fault::Enospc) => Err(os(libc::ENOSPC)),
            Some(f @ (Fault::Short | Fault::Torn)) => {
                // Fill the whole record, write its first half (rounded down to 512 bytes, a
                // multiple of any alignment the half of an aligned length allows).
                let mut full = vec![0u8; len];
                fill(&mut full);
                let half = (len / 2) & !511;
                if half > 0 {
                    let head = full[..half].to_vec();
                    // The half is itself aligned only when the alignment divides it; a
                    // refused partial write still leaves nothing, which is a torn write too.
                    let _ = self
                        .inner
                        .write(
                            file,
                            offset,
                            half,
                            Box::new(move |b| b.copy_from_slice(&head)),
                        )
                        .await;
                }
                if f == Fault::Short {
                    Err(super::short("write", half, len))
                } else {
                    Ok(())
                }
            }
        }
    }

    async fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
    ) -> io::Result<ConsumeResult> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        if *self.fail_reads.lock() {
            return Err(os(libc::EIO));
        }
        self.inner.read(file, offset, len, consume).await
    }
}
