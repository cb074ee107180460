//! Host KV memory in a memfd: what a CPU engine (or a test) registers through the `host-memfd`
//! registrar. The memfd is sent to the server on the fd side channel; both sides map it shared.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::MmapMut;

use crate::ApiError;

/// A shared, zero-filled host allocation backed by a memfd.
pub struct HostMemfd {
    fd: OwnedFd,
    map: MmapMut,
}

impl std::fmt::Debug for HostMemfd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemfd")
            .field("len", &self.map.len())
            .finish()
    }
}

impl HostMemfd {
    /// Creates a memfd of `len_bytes` (> 0) and maps it read-write, shared.
    pub fn new(name: &str, len_bytes: usize) -> Result<Self, ApiError> {
        if len_bytes == 0 {
            return Err(ApiError::InvalidArgument("memfd length must be > 0".into()));
        }
        let cname = std::ffi::CString::new(name)
            .map_err(|_| ApiError::InvalidArgument("memfd name contains NUL".into()))?;
        let fd = nix::sys::memfd::memfd_create(
            cname.as_c_str(),
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| ApiError::io("memfd_create", e.into()))?;
        nix::unistd::ftruncate(&fd, len_bytes as libc::off_t)
            .map_err(|e| ApiError::io("ftruncate memfd", e.into()))?;
        // SAFETY: the memfd is ours and sized to len_bytes; shared mappings of it are the point.
        let map = unsafe { memmap2::MmapOptions::new().len(len_bytes).map_mut(&fd) }
            .map_err(|e| ApiError::io("mmap memfd", e))?;
        Ok(Self { fd, map })
    }

    /// The allocation's length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the allocation is empty (never: construction rejects 0).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The mapped bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The memfd, to send on the side channel.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
