//! The `uring` engine: tokio-uring, one ring per I/O thread, jobs spread round-robin. Each
//! thread registers its staging buffers with its ring (`IORING_REGISTER_BUFFERS`, so the
//! kernel maps them once rather than per I/O) and uses `write_fixed`/`read_fixed`; where the
//! kernel refuses the registration (memlock limits) the thread logs it once and uses plain
//! buffers. I/O larger than a staging buffer uses a buffer of its own.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_uring::buf::fixed::FixedBufPool;
use tokio_uring::buf::{BoundedBuf, IoBufMut};

use super::{
    exact, submit_read, submit_write, AlignedBuf, Consume, ConsumeResult, EngineOptions, Fill,
    IoEngine, Job,
};

/// io_uring threads.
pub struct UringIo {
    senders: Vec<mpsc::UnboundedSender<Job>>,
    next: AtomicUsize,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    registered: bool,
}

impl UringIo {
    /// Starts `opts.threads` ring threads.
    ///
    /// # Errors
    /// The kernel refused io_uring (`io_uring_setup` failed: EPERM, ENOSYS, ENOMEM).
    pub fn start(opts: EngineOptions) -> io::Result<Self> {
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        let mut registered = true;
        for i in 0..opts.threads.max(1) {
            let (tx, rx) = mpsc::unbounded_channel::<Job>();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<bool>>();
            let t = std::thread::Builder::new()
                .name(format!("ssd-uring-{i}"))
                .spawn(move || ring_thread(rx, opts, ready_tx))?;
            match ready_rx.recv() {
                Ok(Ok(reg)) => registered &= reg,
                Ok(Err(e)) => {
                    drop(senders);
                    let _ = t.join();
                    return Err(e);
                }
                Err(_) => return Err(io::Error::other("io_uring thread exited at start")),
            }
            senders.push(tx);
            threads.push(t);
        }
        Ok(Self {
            senders,
            next: AtomicUsize::new(0),
            threads: Mutex::new(threads),
            registered,
        })
    }

    /// Whether every ring registered its staging buffers with the kernel.
    pub fn buffers_registered(&self) -> bool {
        self.registered
    }

    fn send(&self, job: Job) -> io::Result<()> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        self.senders[i]
            .send(job)
            .map_err(|_| io::Error::other("SSD io_uring thread stopped"))
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        self.senders.clear();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

fn ring_thread(
    mut rx: mpsc::UnboundedReceiver<Job>,
    opts: EngineOptions,
    ready: std::sync::mpsc::Sender<io::Result<bool>>,
) {
    let rt = match tokio_uring::Runtime::new(tokio_uring::builder().entries(256)) {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    rt.block_on(async move {
        let pool = FixedBufPool::new(
            (0..opts.buffers_per_thread.max(1))
                .map(|_| AlignedBuf::new(opts.buffer_bytes, opts.mem_align)),
        );
        let pool = match pool.register() {
            Ok(()) => Some(std::rc::Rc::new(pool)),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring refused to register the SSD staging buffers; using unregistered buffers");
                None
            }
        };
        let _ = ready.send(Ok(pool.is_some()));
        while let Some(job) = rx.recv().await {
            let pool = pool.clone();
            tokio_uring::spawn(run(job, pool, opts));
        }
    });
}

async fn run(job: Job, pool: Option<std::rc::Rc<FixedBufPool<AlignedBuf>>>, opts: EngineOptions) {
    match job {
        Job::Write {
            file,
            offset,
            len,
            fill,
            reply,
        } => {
            let _ = reply.send(write(&file, offset, len, fill, pool, opts).await);
        }
        Job::Read {
            file,
            offset,
            len,
            consume,
            reply,
        } => {
            let _ = reply.send(read(&file, offset, len, consume, pool, opts).await);
        }
    }
}

async fn write(
    file: &File,
    offset: u64,
    len: usize,
    fill: Fill,
    pool: Option<std::rc::Rc<FixedBufPool<AlignedBuf>>>,
    opts: EngineOptions,
) -> io::Result<()> {
    let f = tokio_uring::fs::File::from_std(file.try_clone()?);
    let n = match pool.filter(|_| len <= opts.buffer_bytes) {
        Some(pool) => {
            // The pool hands out buffers by exact capacity: ask for a whole staging buffer.
            let mut fb = pool.next(opts.buffer_bytes).await;
            // SAFETY: the buffer holds `buffer_bytes >= len` bytes, initialised
            // (zeroed at allocation), and this task owns it until the write returns it.
            let s = unsafe { std::slice::from_raw_parts_mut(fb.stable_mut_ptr(), len) };
            fill(s);
            // SAFETY: the first `len` bytes were just written by `fill`.
            unsafe { fb.set_init(len) };
            let (r, _) = f.write_fixed_at(fb.slice(0..len), offset).await;
            r
        }
        None => {
            let mut b = AlignedBuf::new(len, opts.mem_align);
            fill(b.slice_mut(len));
            let (r, _) = f.write_at(b.slice(0..len), offset).submit().await;
            r
        }
    };
    let _ = f.close().await;
    exact(n, "write", len)
}

async fn read(
    file: &File,
    offset: u64,
    len: usize,
    consume: Consume,
    pool: Option<std::rc::Rc<FixedBufPool<AlignedBuf>>>,
    opts: EngineOptions,
) -> io::Result<ConsumeResult> {
    let f = tokio_uring::fs::File::from_std(file.try_clone()?);
    let r = match pool.filter(|_| len <= opts.buffer_bytes) {
        Some(pool) => {
            let fb = pool.next(opts.buffer_bytes).await;
            let (r, s) = f.read_fixed_at(fb.slice(0..len), offset).await;
            exact(r, "read", len).map(|()| consume(&s[..len]))
        }
        None => {
            let b = AlignedBuf::new(len, opts.mem_align);
            let (r, s) = f.read_at(b.slice(0..len), offset).await;
            exact(r, "read", len).map(|()| consume(&s[..len]))
        }
    };
    let _ = f.close().await;
    r
}

#[async_trait]
impl IoEngine for UringIo {
    fn name(&self) -> &'static str {
        "uring"
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
