//! The SSD tier's I/O engines: every read and write of segment data runs on the engine's own
//! threads, never on the async executor.
//!
//! An engine writes and reads whole aligned ranges through a staging buffer it owns: `fill`
//! writes the bytes of a write into the buffer on the I/O thread (the record encoder: copy
//! from host buffers and checksum), `consume` takes the bytes of a read there (verify and
//! copy into the destination). Staging makes every write one call whatever the number of a
//! block's pieces (no `IOV_MAX` limit: a block of 1,500 segments is one contiguous record),
//! satisfies O_DIRECT's alignment for any host buffer, and lets the uring engine use
//! buffers registered with the kernel.
//!
//! Two engines: [`uring`] (tokio-uring, one ring per thread, registered buffers where the
//! kernel allows) and [`posix`] (`pread`/`pwrite` on a thread pool), chosen by the `io`
//! setting; `auto` takes uring and falls back to posix when the kernel refuses io_uring
//! (EPERM under Docker's default seccomp, ENOSYS, ENOMEM). [`fault::FaultyIo`] wraps either
//! to inject failures.
//!
//! A short write or read is an error, never a success.

pub mod fault;
pub mod posix;
#[cfg(target_os = "linux")]
pub mod uring;

use std::fs::File;
use std::io;
use std::sync::Arc;

use async_trait::async_trait;

/// Fills the staging buffer of a write (exactly the write's length) on the I/O thread.
pub type Fill = Box<dyn FnOnce(&mut [u8]) + Send>;

/// Takes the bytes of a read (exactly the read's length) on the I/O thread; its result is
/// the read's.
pub type Consume = Box<dyn FnOnce(&[u8]) -> ConsumeResult + Send>;

/// What a [`Consume`] returns: `Ok` or the reason the bytes were refused (a record that
/// fails its checks).
pub type ConsumeResult = Result<(), crate::verify::Refused>;

/// A positioned-I/O engine over open files.
#[async_trait]
pub trait IoEngine: Send + Sync + 'static {
    /// `uring` or `posix` (and a wrapper's own name around it).
    fn name(&self) -> &'static str;
    /// Writes `len` bytes at `offset` of `file`: `fill` fills the staging buffer, then one
    /// write call moves it. `offset` and `len` are multiples of the file's alignment.
    ///
    /// # Errors
    /// The OS error; a short write is `WriteZero`.
    async fn write(&self, file: Arc<File>, offset: u64, len: usize, fill: Fill) -> io::Result<()>;
    /// Reads `len` bytes at `offset` of `file` and hands them to `consume`.
    ///
    /// # Errors
    /// The OS error (a short read is `UnexpectedEof`); `Ok(Err(why))` when `consume` refused
    /// the bytes.
    async fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
    ) -> io::Result<ConsumeResult>;
}

/// Reads `len` bytes at `offset` into a vector (recovery: headers and summaries).
///
/// # Errors
/// As [`IoEngine::read`].
pub async fn read_vec(
    engine: &dyn IoEngine,
    file: Arc<File>,
    offset: u64,
    len: usize,
) -> io::Result<Vec<u8>> {
    let out = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let o = out.clone();
    engine
        .read(
            file,
            offset,
            len,
            Box::new(move |b| {
                *o.lock() = b.to_vec();
                Ok(())
            }),
        )
        .await?
        .map_err(io::Error::other)?;
    let v = std::mem::take(&mut *out.lock());
    Ok(v)
}

/// Which engine to run (`io` in the pipeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoChoice {
    /// io_uring, falling back to posix when the kernel refuses it.
    Auto,
    /// io_uring only (start-up fails when refused).
    Uring,
    /// `pread`/`pwrite` on a thread pool.
    Posix,
}

/// Engine settings.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// I/O threads (rings for uring, workers for posix).
    pub threads: usize,
    /// Registered (uring) or reused (posix) staging buffers per thread.
    pub buffers_per_thread: usize,
    /// Bytes of one staging buffer (larger I/O uses a buffer of its own).
    pub buffer_bytes: usize,
    /// Memory alignment of staging buffers (bytes, a power of two).
    pub mem_align: usize,
}

/// Starts the engine `choice` asks for. Returns it and, for `auto` when io_uring was
/// refused, the reason (the caller logs it once, shows it on `/health` and counts it).
///
/// # Errors
/// `uring` asked for and refused.
pub fn start(
    choice: IoChoice,
    opts: EngineOptions,
) -> anyhow::Result<(Arc<dyn IoEngine>, Option<String>)> {
    match choice {
        IoChoice::Posix => Ok((Arc::new(posix::PosixIo::start(opts)), None)),
        #[cfg(target_os = "linux")]
        IoChoice::Uring => uring::UringIo::start(opts)
            .map(|e| (Arc::new(e) as Arc<dyn IoEngine>, None))
            .map_err(|e| anyhow::anyhow!("io = \"uring\" but the kernel refused io_uring: {e}")),
        #[cfg(target_os = "linux")]
        IoChoice::Auto => match uring::UringIo::start(opts) {
            Ok(e) => Ok((Arc::new(e), None)),
            Err(e) => Ok((
                Arc::new(posix::PosixIo::start(opts)),
                Some(format!(
                    "io_uring refused ({e}); using pread/pwrite threads"
                )),
            )),
        },
        #[cfg(not(target_os = "linux"))]
        IoChoice::Uring => anyhow::bail!("io = \"uring\" needs Linux"),
        #[cfg(not(target_os = "linux"))]
        IoChoice::Auto => Ok((
            Arc::new(posix::PosixIo::start(opts)),
            Some("io_uring needs Linux; using pread/pwrite threads".into()),
        )),
    }
}

/// A heap buffer aligned to `align` bytes (zeroed), for O_DIRECT.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
    init: usize,
}

// SAFETY: the buffer is uniquely owned heap memory; moving it between threads is sound.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Panics
    /// When the allocation fails or `align` is not a power of two.
    pub fn new(len: usize, align: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(1), align.max(1))
            .expect("aligned buffer layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            layout,
            init: len,
        }
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the capacity is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` bytes.
    pub fn slice(&self, n: usize) -> &[u8] {
        // SAFETY: `n <= len` is checked; the bytes are initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), n.min(self.len)) }
    }

    /// The first `n` bytes, writable.
    pub fn slice_mut(&mut self, n: usize) -> &mut [u8] {
        // SAFETY: as `slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), n.min(self.len)) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(target_os = "linux")]
// SAFETY: the pointer is stable for the buffer's life (heap memory that never moves);
// `bytes_init <= bytes_total`.
unsafe impl tokio_uring::buf::IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.init
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

#[cfg(target_os = "linux")]
// SAFETY: as above; `set_init` only records how many bytes the kernel wrote.
unsafe impl tokio_uring::buf::IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if pos > self.init {
            self.init = pos.min(self.len);
        }
    }
}

/// A short transfer as an error.
pub(crate) fn short(what: &str, done: usize, want: usize) -> io::Error {
    let kind = if what == "write" {
        io::ErrorKind::WriteZero
    } else {
        io::ErrorKind::UnexpectedEof
    };
    io::Error::new(kind, format!("short {what}: {done} of {want} bytes"))
}

/// `Ok` only when the transfer (`what`: "write" or "read") moved exactly `len` bytes.
pub(crate) fn exact(r: io::Result<usize>, what: &str, len: usize) -> io::Result<()> {
    match r {
        Ok(n) if n == len => Ok(()),
        Ok(n) => Err(short(what, n, len)),
        Err(e) => Err(e),
    }
}

/// One I/O handed to an engine's threads, with the channel its result goes back on.
pub(crate) enum Job {
    Write {
        file: Arc<File>,
        offset: u64,
        len: usize,
        fill: Fill,
        reply: tokio::sync::oneshot::Sender<io::Result<()>>,
    },
    Read {
        file: Arc<File>,
        offset: u64,
        len: usize,
        consume: Consume,
        reply: tokio::sync::oneshot::Sender<io::Result<ConsumeResult>>,
    },
}

/// [`IoEngine::write`] for an engine whose threads take [`Job`]s through `send`.
pub(crate) async fn submit_write(
    send: impl FnOnce(Job) -> io::Result<()>,
    file: Arc<File>,
    offset: u64,
    len: usize,
    fill: Fill,
) -> io::Result<()> {
    let (reply, rx) = tokio::sync::oneshot::channel();
    send(Job::Write {
        file,
        offset,
        len,
        fill,
        reply,
    })?;
    rx.await
        .map_err(|_| io::Error::other("SSD I/O thread dropped the write"))?
}

/// [`IoEngine::read`] for an engine whose threads take [`Job`]s through `send`.
pub(crate) async fn submit_read(
    send: impl FnOnce(Job) -> io::Result<()>,
    file: Arc<File>,
    offset: u64,
    len: usize,
    consume: Consume,
) -> io::Result<ConsumeResult> {
    let (reply, rx) = tokio::sync::oneshot::channel();
    send(Job::Read {
        file,
        offset,
        len,
        consume,
        reply,
    })?;
    rx.await
        .map_err(|_| io::Error::other("SSD I/O thread dropped the read"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        for align in [512usize, 4096, 65536] {
            let b = AlignedBuf::new(3 * align + 7, align);
            assert_eq!(b.slice(1).as_ptr() as usize % align, 0);
            assert!(b.slice(b.len()).iter().all(|&x| x == 0));
        }
    }
}
