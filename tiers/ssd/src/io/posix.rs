//! The `posix` engine: `pread`/`pwrite` on a pool of I/O threads, each with a reused aligned
//! staging buffer. The fallback when io_uring is refused, and the simplest engine to reason
//! about.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::{short, AlignedBuf, Consume, ConsumeResult, EngineOptions, Fill, IoEngine};

enum Job {
    Write {
        file: Arc<File>,
        offset: u64,
        len: usize,
        fill: Fill,
        reply: oneshot::Sender<io::Result<()>>,
    },
    Read {
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
        reply: oneshot::Sender<io::Result<ConsumeResult>>,
    },
}

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

fn worker(rx: &Mutex<mpsc::Receiver<Job>>, opts: EngineOptions) {
    let mut staging = AlignedBuf::new(opts.buffer_bytes, opts.mem_align);
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        match job {
            Job::Write {
                file,
                offset,
                len,
                fill,
                reply,
            } => {
                let mut own;
                let buf = if len <= staging.len() {
                    &mut staging
                } else {
                    own = AlignedBuf::new(len, opts.mem_align);
                    &mut own
                };
                let b = buf.slice_mut(len);
                fill(b);
                let r = match file.write_at(b, offset) {
                    Ok(n) if n == len => Ok(()),
                    Ok(n) => Err(short("write", n, len)),
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Job::Read {
                file,
                offset,
                len,
                consume,
                reply,
            } => {
                let mut own;
                let buf = if len <= staging.len() {
                    &mut staging
                } else {
                    own = AlignedBuf::new(len, opts.mem_align);
                    &mut own
                };
                let b = buf.slice_mut(len);
                let r = match file.read_at(b, offset) {
                    Ok(n) if n == len => Ok(consume(b)),
                    Ok(n) => Err(short("read", n, len)),
                    Err(e) => Err(e),
                };
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
        let (reply, rx) = oneshot::channel();
        self.send(Job::Write {
            file,
            offset,
            len,
            fill,
            reply,
        })?;
        rx.await
            .map_err(|_| io::Error::other("SSD I/O thread dropped the write"))?
    }

    async fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
    ) -> io::Result<ConsumeResult> {
        let (reply, rx) = oneshot::channel();
        self.send(Job::Read {
            file,
            offset,
            len,
            consume,
            reply,
        })?;
        rx.await
            .map_err(|_| io::Error::other("SSD I/O thread dropped the read"))?
    }
}
