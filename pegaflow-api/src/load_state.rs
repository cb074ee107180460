//! The load-completion word in POSIX shared memory, laid out exactly as the published client's
//! `PyLoadState` (`engine-wire.md` §7): a 32-byte object `/dev/shm/pega_load_<32 hex>` holding
//! `u64 offset` at byte 0, then at `offset`: `u32 magic 0x50464C44`, `u32 version 1`,
//! `i64 state` (0 pending, 1 success, < 0 failure), written with release ordering.
//!
//! Two handles, one per side:
//! - [`LoadState`], the creator's (a CPU client, a test, the bench): creates the object, maps
//!   it and polls the word, as `PyLoadState` does.
//! - [`LoadStateWriter`], the server's: attaches a client's object and stores the final state.
//!   It must never map the object. The client owns it and may truncate it at any moment; a
//!   load or store through a mapping of a file that shrank under it is a SIGBUS, and a SIGBUS
//!   kills the whole server (issue 14: `ftruncate` to 0 right after the Load RPC returned did,
//!   3 of 3 tries). Through the descriptor nothing can fault: `pread` past the end returns
//!   short, `pwrite` past the end extends the file, and both copy with the kernel's
//!   fault-handled user copies.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{fence, AtomicI64, Ordering};

use crate::ApiError;

/// Magic of the load-state struct ("DLFP" as little-endian bytes).
pub const LOAD_STATE_MAGIC: u32 = 0x5046_4C44;
/// Version of the load-state struct.
pub const LOAD_STATE_VERSION: u32 = 1;
/// Size of the shared-memory object in bytes.
pub const LOAD_STATE_BYTES: usize = 32;
/// State value: the load is still running.
pub const LOAD_PENDING: i64 = 0;
/// State value: every byte landed.
pub const LOAD_SUCCESS: i64 = 1;
/// State value the server writes when a load fails.
pub const LOAD_FAILED: i64 = -1;

/// A load-state object its creator made and mapped. Dropping it unmaps and unlinks the name.
///
/// The mapping faults if someone else truncates the object: only its creator, who owns the
/// object, may hold one. The server attaches with [`LoadStateWriter`].
pub struct LoadState {
    ptr: *mut u8,
    len: usize,
    offset: usize,
    name: String,
}

// SAFETY: the mapping is shared memory accessed only through atomics and plain reads of
// immutable header fields; the pointer stays valid until drop.
unsafe impl Send for LoadState {}
// SAFETY: see above; `set`/`get` use atomic operations.
unsafe impl Sync for LoadState {}

impl std::fmt::Debug for LoadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadState")
            .field("name", &self.name)
            .finish()
    }
}

fn shm_open(name: &str, flags: libc::c_int) -> Result<OwnedFd, ApiError> {
    let c = CString::new(format!("/{name}"))
        .map_err(|_| ApiError::InvalidArgument(format!("shm name {name:?} contains NUL")))?;
    // SAFETY: `c` is a valid NUL-terminated string; the returned fd is checked.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(ApiError::io(
            format!("shm_open {name}"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is a fresh, owned descriptor.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

fn map(fd: &OwnedFd, len: usize, what: &str) -> Result<*mut u8, ApiError> {
    // SAFETY: mapping a shared object of at least `len` bytes (checked by callers).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(ApiError::io(
            what.to_string(),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(p.cast())
}

impl LoadState {
    /// Creates a fresh object named `pega_load_<uuid>` in the pending state, as `PyLoadState()`.
    pub fn create() -> Result<Self, ApiError> {
        let name = format!("pega_load_{}", uuid::Uuid::new_v4().simple());
        let fd = shm_open(&name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR)?;
        // SAFETY: fd is a valid shm descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), LOAD_STATE_BYTES as libc::off_t) } != 0 {
            return Err(ApiError::io(
                "ftruncate load state",
                std::io::Error::last_os_error(),
            ));
        }
        let ptr = map(&fd, LOAD_STATE_BYTES, "mmap load state")?;
        let offset = 8usize;
        // SAFETY: ptr maps LOAD_STATE_BYTES writable bytes; the offsets are in bounds.
        unsafe {
            std::ptr::write_unaligned(ptr.cast::<u64>(), offset as u64);
            std::ptr::write_unaligned(ptr.add(offset).cast::<u32>(), LOAD_STATE_MAGIC);
            std::ptr::write_unaligned(ptr.add(offset + 4).cast::<u32>(), LOAD_STATE_VERSION);
        }
        let s = Self {
            ptr,
            len: LOAD_STATE_BYTES,
            offset,
            name,
        };
        s.atomic().store(LOAD_PENDING, Ordering::Release);
        Ok(s)
    }

    fn atomic(&self) -> &AtomicI64 {
        // SAFETY: create() maps len = 32 bytes with offset = 8, so the i64 at offset + 8 is
        // aligned (mmap is page-aligned) and inside the mapping for the lifetime of self.
        unsafe { &*self.ptr.add(self.offset + 8).cast::<AtomicI64>() }
    }

    /// The object's name (no leading `/`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stores `state` with release ordering.
    pub fn set(&self, state: i64) {
        self.atomic().store(state, Ordering::Release);
    }

    /// Reads the state with acquire ordering.
    pub fn get(&self) -> i64 {
        self.atomic().load(Ordering::Acquire)
    }

    /// Waits until the state is non-zero or `timeout` passes; returns the last state read.
    pub fn wait(&self, timeout: std::time::Duration) -> i64 {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let s = self.get();
            if s != LOAD_PENDING || std::time::Instant::now() >= deadline {
                return s;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

impl Drop for LoadState {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        if let Ok(c) = CString::new(format!("/{}", self.name)) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

/// The server's handle on a client's load-state object: its descriptor and where the word is,
/// never a mapping (see the module doc).
///
/// A client can truncate, regrow, resize or unlink the object at any time. None of it can
/// fault the server: [`attach`](Self::attach) reads the header with `pread` and refuses a
/// short read; [`complete`](Self::complete) checks the size and writes with `pwrite`. What
/// reaches the client is then its own business: a client that shrank the object below the
/// word is not told (its own mapping of the word would fault for it).
#[derive(Debug)]
pub struct LoadStateWriter {
    file: File,
    /// Byte offset of the i64 state word in the object: the struct's offset + 8.
    word_offset: u64,
    name: String,
}

impl LoadStateWriter {
    /// Attaches an object a client created, checking its size, offset, alignment, magic and
    /// version (the checks of PegaFlow's attach). The name has no leading `/`.
    ///
    /// # Errors
    /// [`ApiError::InvalidArgument`] for a bad name or an object that is not a load state
    /// (including one that shrinks while it is read); [`ApiError::Io`] when it cannot be
    /// opened or read.
    pub fn attach(name: &str) -> Result<Self, ApiError> {
        if name.is_empty() || name.contains('/') || name.len() > 200 {
            return Err(ApiError::InvalidArgument(format!(
                "load_state_shm {name:?} is not a shared-memory object name"
            )));
        }
        let file = File::from(shm_open(name, libc::O_RDWR)?);
        let meta = file
            .metadata()
            .map_err(|e| ApiError::io(format!("fstat {name}"), e))?;
        if !meta.file_type().is_file() {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} is not a regular file"
            )));
        }
        let len = meta.len();
        if len < LOAD_STATE_BYTES as u64 {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} is {len} bytes, expected at least {LOAD_STATE_BYTES}"
            )));
        }
        // A file that shrinks between the fstat and a read makes the read short, never fault.
        let read = |buf: &mut [u8; 8], at: u64| {
            file.read_exact_at(buf, at).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    ApiError::InvalidArgument(format!(
                        "load state {name} shrank while the server attached it"
                    ))
                } else {
                    ApiError::io(format!("read load state {name}"), e)
                }
            })
        };
        let mut word = [0u8; 8];
        read(&mut word, 0)?;
        let offset = u64::from_le_bytes(word);
        if offset < 8 || offset.checked_add(16).is_none_or(|e| e > len) || !offset.is_multiple_of(8)
        {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} has an invalid offset {offset}"
            )));
        }
        read(&mut word, offset)?;
        let magic = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        let version = u32::from_le_bytes([word[4], word[5], word[6], word[7]]);
        if magic != LOAD_STATE_MAGIC || version != LOAD_STATE_VERSION {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} has magic {magic:#x} version {version}, expected {LOAD_STATE_MAGIC:#x} version {LOAD_STATE_VERSION}"
            )));
        }
        Ok(Self {
            file,
            word_offset: offset + 8,
            name: name.to_string(),
        })
    }

    /// The object's name (no leading `/`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stores the final `state` (non-zero: [`LOAD_SUCCESS`] or a negative failure) into the
    /// pending word, with release ordering: everything this thread observed before (the
    /// copy's completion) is visible to a client that reads the new state with acquire.
    ///
    /// Cannot fault: the size is checked first, and the write is a `pwrite`. When the client
    /// shrank the object below the word, nothing is written (writing would regrow the file
    /// and the client could not read it anyway). A truncation racing between the check and the
    /// write makes the `pwrite` extend the file with zeros up to the word: still no fault.
    ///
    /// Cannot tear into a wrong outcome. The kernel copies a `pwrite`'s bytes with its user-copy
    /// routine (`rep movsb` on x86-64 CPUs with fast short strings), which promises no
    /// single-copy atomicity beyond one byte, so the store is arranged so that no mix of old
    /// and new bytes reads as the wrong outcome, starting from the pending 0 the client
    /// created:
    /// - `state > 0` is written in one `pwrite`: bytes 1..8 are written with the zeros they
    ///   already hold, and the top byte stays below 0x80, so a reader sees 0 or a positive
    ///   value; for [`LOAD_SUCCESS`] only byte 0 changes, so a reader sees exactly 0 or 1.
    /// - `state < 0` is written in two: first the sign byte alone (a one-byte store cannot
    ///   tear), then the other seven. From the first write on, the word is negative whatever
    ///   mix a reader catches, so it reads as failed; between the two writes (two syscalls)
    ///   a reader can catch a negative value other than the final one (for [`LOAD_FAILED`],
    ///   e.g. `0xFF00_0000_0000_0000`). The published client only tests `state < 0`.
    ///
    /// # Errors
    /// [`ApiError::InvalidArgument`] when the object shrank below the word (nothing written);
    /// [`ApiError::Io`] when `fstat` or `pwrite` fails (e.g. `/dev/shm` is full).
    pub fn complete(&self, state: i64) -> Result<(), ApiError> {
        let len = self
            .file
            .metadata()
            .map_err(|e| ApiError::io(format!("fstat load state {}", self.name), e))?
            .len();
        if len < self.word_offset + 8 {
            return Err(ApiError::InvalidArgument(format!(
                "load state {} shrank to {len} bytes under the server (its state word is at \
                 bytes {}..{}): not written",
                self.name,
                self.word_offset,
                self.word_offset + 8
            )));
        }
        // Orders this thread's earlier accesses before the stores the kernel makes for us
        // (the `pwrite` is a syscall, not an atomic of ours; the fence is what makes it a
        // release store: `dmb ish` on arm64, a compiler barrier on x86-64's TSO).
        fence(Ordering::Release);
        let bytes = state.to_le_bytes();
        let write = |buf: &[u8], at: u64| {
            self.file
                .write_all_at(buf, at)
                .map_err(|e| ApiError::io(format!("write load state {}", self.name), e))
        };
        if state < 0 {
            write(&bytes[7..], self.word_offset + 7)?;
            write(&bytes[..7], self.word_offset)
        } else {
            write(&bytes, self.word_offset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &LoadState) -> String {
        format!("/dev/shm/{}", s.name())
    }

    fn set_len(s: &LoadState, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path(s))
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    #[test]
    fn create_attach_roundtrip() {
        let a = LoadState::create().unwrap();
        assert!(a.name().starts_with("pega_load_"));
        assert_eq!(a.name().len(), "pega_load_".len() + 32);
        let b = LoadStateWriter::attach(a.name()).unwrap();
        assert_eq!(b.name(), a.name());
        assert_eq!(a.get(), LOAD_PENDING);
        b.complete(LOAD_FAILED).unwrap();
        assert_eq!(a.get(), LOAD_FAILED);
        let bytes = std::fs::read(path(&a)).unwrap();
        assert_eq!(
            &bytes[..16],
            &[8, 0, 0, 0, 0, 0, 0, 0, 0x44, 0x4c, 0x46, 0x50, 1, 0, 0, 0]
        );
        for state in [LOAD_SUCCESS, -42, i64::MIN, 1 << 40] {
            a.set(LOAD_PENDING);
            b.complete(state).unwrap();
            assert_eq!(a.get(), state);
        }
        // The unlinked object stays writable through the descriptor.
        std::fs::remove_file(path(&a)).unwrap();
        a.set(LOAD_PENDING);
        b.complete(LOAD_SUCCESS).unwrap();
        assert_eq!(a.get(), LOAD_SUCCESS);
    }

    #[test]
    fn a_non_default_offset_is_honoured() {
        let a = LoadState::create().unwrap();
        set_len(&a, 64);
        let mut raw = [0u8; 64];
        raw[..8].copy_from_slice(&16u64.to_le_bytes());
        raw[16..20].copy_from_slice(&LOAD_STATE_MAGIC.to_le_bytes());
        raw[20..24].copy_from_slice(&LOAD_STATE_VERSION.to_le_bytes());
        std::fs::write(path(&a), raw).unwrap();
        LoadStateWriter::attach(a.name())
            .unwrap()
            .complete(LOAD_SUCCESS)
            .unwrap();
        let bytes = std::fs::read(path(&a)).unwrap();
        assert_eq!(i64::from_le_bytes(bytes[24..32].try_into().unwrap()), 1);
        assert_eq!(&bytes[8..16], &[0; 8], "the default word is untouched");
    }

    #[test]
    fn a_shrunk_object_is_not_written_and_does_not_fault() {
        let a = LoadState::create().unwrap();
        let b = LoadStateWriter::attach(a.name()).unwrap();
        for len in [0, 8, 23] {
            set_len(&a, len);
            let e = b.complete(LOAD_SUCCESS).unwrap_err();
            assert!(e.to_string().contains("shrank"), "{e}");
            assert_eq!(std::fs::metadata(path(&a)).unwrap().len(), len);
        }
        // Regrown (zeroed): the word lands again, and `a`'s mapping sees it.
        set_len(&a, 24);
        b.complete(LOAD_SUCCESS).unwrap();
        assert_eq!(a.get(), LOAD_SUCCESS);
        // Resized huge: still one word at the same place.
        set_len(&a, 1 << 40);
        b.complete(LOAD_FAILED).unwrap();
        assert_eq!(a.get(), LOAD_FAILED);
    }

    #[test]
    fn attach_rejects_bad_objects() {
        assert!(LoadStateWriter::attach("pega_load_does_not_exist").is_err());
        assert!(LoadStateWriter::attach("../etc/passwd").is_err());
        assert!(LoadStateWriter::attach("").is_err());
        let name = format!("pega_bad_{}", uuid::Uuid::new_v4().simple());
        let file = format!("/dev/shm/{name}");
        let header = |offset: u64, magic: u32| {
            let mut raw = [0u8; 32];
            raw[..8].copy_from_slice(&offset.to_le_bytes());
            raw[8..12].copy_from_slice(&magic.to_le_bytes());
            raw[12..16].copy_from_slice(&LOAD_STATE_VERSION.to_le_bytes());
            raw
        };
        let cases: [(&[u8], &str); 5] = [
            (&[0u8; 32], "offset 0"),
            (&header(8, LOAD_STATE_MAGIC)[..31], "31 bytes"),
            (&header(12, LOAD_STATE_MAGIC), "offset 12"),
            (&header(24, LOAD_STATE_MAGIC), "offset 24"),
            (&header(8, 0xdead), "magic 0xdead"),
        ];
        for (content, needle) in cases {
            std::fs::write(&file, content).unwrap();
            let e = LoadStateWriter::attach(&name).unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
        std::fs::remove_file(&file).unwrap();
    }
}
