//! The load-completion word in POSIX shared memory, laid out exactly as the published client's
//! `PyLoadState` (`engine-wire.md` §7): a 32-byte object `/dev/shm/pega_load_<32 hex>` holding
//! `u64 offset` at byte 0, then at `offset`: `u32 magic 0x50464C44`, `u32 version 1`,
//! `i64 state` (0 pending, 1 success, < 0 failure), written with release ordering.
//!
//! The server attaches and stores the final state; tests and CPU clients create one.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI64, Ordering};

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

/// A mapped load-state object. Dropping it unmaps; the creator also unlinks the name.
pub struct LoadState {
    ptr: *mut u8,
    len: usize,
    offset: usize,
    name: String,
    unlink_on_drop: bool,
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
            unlink_on_drop: true,
        };
        s.atomic().store(LOAD_PENDING, Ordering::Release);
        Ok(s)
    }

    /// Attaches an object a client created, checking its size, offset, alignment, magic and
    /// version (the checks of PegaFlow's attach). The name has no leading `/`.
    pub fn attach(name: &str) -> Result<Self, ApiError> {
        if name.is_empty() || name.contains('/') || name.len() > 200 {
            return Err(ApiError::InvalidArgument(format!(
                "load_state_shm {name:?} is not a shared-memory object name"
            )));
        }
        let fd = shm_open(name, libc::O_RDWR)?;
        let st = nix::sys::stat::fstat(&fd)
            .map_err(|e| ApiError::io(format!("fstat {name}"), e.into()))?;
        let len = st.st_size as usize;
        if len < LOAD_STATE_BYTES {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} is {len} bytes, expected at least {LOAD_STATE_BYTES}"
            )));
        }
        let ptr = map(&fd, len, "mmap load state")?;
        let mut s = Self {
            ptr,
            len,
            offset: 8,
            name: name.to_string(),
            unlink_on_drop: false,
        };
        // SAFETY: ptr maps `len >= 32` bytes.
        let offset = unsafe { std::ptr::read_unaligned(ptr.cast::<u64>()) } as usize;
        if offset < 8 || offset.checked_add(16).is_none_or(|e| e > len) || !offset.is_multiple_of(8)
        {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} has an invalid offset {offset}"
            )));
        }
        s.offset = offset;
        // SAFETY: offset + 8 <= len was checked.
        let (magic, version) = unsafe {
            (
                std::ptr::read_unaligned(ptr.add(offset).cast::<u32>()),
                std::ptr::read_unaligned(ptr.add(offset + 4).cast::<u32>()),
            )
        };
        if magic != LOAD_STATE_MAGIC || version != LOAD_STATE_VERSION {
            return Err(ApiError::InvalidArgument(format!(
                "load state {name} has magic {magic:#x} version {version}, expected {LOAD_STATE_MAGIC:#x} version {LOAD_STATE_VERSION}"
            )));
        }
        Ok(s)
    }

    fn atomic(&self) -> &AtomicI64 {
        // SAFETY: offset + 16 <= len and offset is 8-aligned (mmap is page-aligned), so the i64
        // at offset + 8 is aligned and inside the mapping for the lifetime of self.
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
        if self.unlink_on_drop {
            if let Ok(c) = CString::new(format!("/{}", self.name)) {
                // SAFETY: valid C string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_attach_roundtrip() {
        let a = LoadState::create().unwrap();
        assert!(a.name().starts_with("pega_load_"));
        assert_eq!(a.name().len(), "pega_load_".len() + 32);
        let b = LoadState::attach(a.name()).unwrap();
        assert_eq!(b.get(), LOAD_PENDING);
        b.set(LOAD_FAILED);
        assert_eq!(a.get(), LOAD_FAILED);
        let bytes = std::fs::read(format!("/dev/shm/{}", a.name())).unwrap();
        assert_eq!(
            &bytes[..16],
            &[8, 0, 0, 0, 0, 0, 0, 0, 0x44, 0x4c, 0x46, 0x50, 1, 0, 0, 0]
        );
    }

    #[test]
    fn attach_rejects_bad_objects() {
        assert!(LoadState::attach("pega_load_does_not_exist").is_err());
        assert!(LoadState::attach("../etc/passwd").is_err());
        assert!(LoadState::attach("").is_err());
        let name = format!("pega_bad_{}", uuid::Uuid::new_v4().simple());
        std::fs::write(format!("/dev/shm/{name}"), [0u8; 32]).unwrap();
        assert!(LoadState::attach(&name).is_err());
        std::fs::remove_file(format!("/dev/shm/{name}")).unwrap();
    }
}
