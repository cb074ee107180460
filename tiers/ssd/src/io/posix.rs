//! The `posix` engine: `pread`/`pwrite` on a pool of I/O threads, each with a reused aligned
//! staging buffer. The fallback when io_uring is refused, and the simplest engine to reason
//! about.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::Arc;

use super::{
    exact, submit_read, submit_write, AlignedBuf, Consume, ConsumeResult, EngineOptions, Fill,
    IoEngine, Job,
};
use async_trait::async_trait;
use parking_lot::Mutex;

/// `pread`/`pwrite` threads.
pub struct PosixIo {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl PosixIo {
    /// Starts `opts.threads` I/O threads.
    ///
    /// # Panics
    /// When a thread cannot be spawned.
    pub fn start(opts: EngineOptions) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..opts.threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("ssd-posix-{i}"))
                    .spawn(move || worker(&rx, opts))
                    .expect("spawn an SSD I/O thread")
            })
            .collect();
        Self {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        }
    }

    fn send(&self, job: Job) -> io::Result<()> {
        match self.tx.lock().as_ref() {
            Some(tx) => tx
                .send(job)
                .map_err(|_| io::Error::other("SSD I/O threads stopped")),
            None => Err(io::Error::other("SSD I/O threads stopped")),
        }
    }
}

impl Drop for PosixIo {
    fn drop(&mut self) {
        self.tx.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

/// The first `len` bytes of the reused staging buffer, or of one of the transfer's own (kept
/// in `own`) when it is larger.
fn buffer<'a>(
    staging: &'a mut AlignedBuf,
    own: &'a mut Option<AlignedBuf>,
    len: usize,
    align: usize,
) -> &'a mut [u8] {
    let b = if len <= staging.len() {
        staging
    } else {
        own.insert(AlignedBuf::new(len, align))
    };
    b.slice_mut(len)
}

fn worker(rx: &Mutex<mpsc::Receiver<Job>>, opts: EngineOptions) {
    let mut staging = AlignedBuf::new(opts.buffer_bytes, opts.mem_align);
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let mut own = None;
        match job {
            Job::Write {
                file,
                offset,
                len,
                fill,
                reply,
            } => {
                let b = buffer(&mut staging, &mut own, len, opts.mem_align);
                fill(b);
                let _ = reply.send(exact(file.write_at(b, offset), "write", len));
            }
            Job::Read {
                file,
                offset,
                len,
                consume,
                reply,
            } => {
                let b = buffer(&mut staging, &mut own, len, opts.mem_align);
                let r = exact(file.read_at(b, offset), "read", len).map(|()| consume(b));
                let _ = reply.send(r);
            }
        }
    }
}

#[async_trait]
impl IoEngine for PosixIo {
    fn name(&self) -> &'static str {
        "posix"
    }

    async fn write(&self, file: Arc<File>, offset: u64, len: usize, fill: Fill) -> io::Result<()> {
        submit_write(|j| self.send(j), file, offset, len, fill).await
    }

    async fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
    ) -> io::Result<ConsumeResult> {
        submit_read(|j| self.send(j), file, offset, len, consume).await
    }
}
