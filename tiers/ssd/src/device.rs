//! What the device and the filesystem under a path allow: direct-I/O alignment (from
//! `statx`, never a constant), free space, and the calls that open, preallocate and lock
//! files. All blocking: called at start-up and from I/O or blocking threads only.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rustix::fs::{AtFlags, FallocateFlags, FlockOperation, StatxFlags, CWD};

/// Direct-I/O alignment of files under `dir`, in bytes: `statx`'s `dio_offset_align` (Linux
/// 6.1+, filesystems that report it), else the logical block size of the block device
/// holding the filesystem (sysfs), else the filesystem's preferred I/O size. Also returns
/// the memory alignment for buffers (`dio_mem_align`, at least the page size) and where the
/// offset alignment came from.
pub fn dio_alignment(dir: &Path) -> (u64, u64, &'static str) {
    let page = rustix::param::page_size() as u64;
    if let Ok(st) = rustix::fs::statx(
        CWD,
        dir,
        AtFlags::empty(),
        StatxFlags::DIOALIGN | StatxFlags::BASIC_STATS,
    ) {
        let off = u64::from(st.stx_dio_offset_align);
        let mem = u64::from(st.stx_dio_mem_align);
        if off.is_power_of_two() && off >= 512 {
            return (off, mem.max(page), "statx");
        }
        if let Some(l) = logical_block_size(st.stx_dev_major, st.stx_dev_minor) {
            return (l, l.max(page), "sysfs");
        }
        let blk = u64::from(st.stx_blksize);
        if blk.is_power_of_two() && blk >= 512 {
            return (blk, blk.max(page), "st_blksize");
        }
    }
    (page, page, "page size")
}

fn logical_block_size(major: u32, minor: u32) -> Option<u64> {
    let base = format!("/sys/dev/block/{major}:{minor}");
    // A partition's directory has no queue/: its parent (the disk) has.
    for p in [
        format!("{base}/queue/logical_block_size"),
        format!("{base}/../queue/logical_block_size"),
    ] {
        if let Ok(s) = std::fs::read_to_string(&p) {
            if let Ok(v) = s.trim().parse::<u64>() {
                if v.is_power_of_two() && v >= 512 {
                    return Some(v);
                }
            }
        }
    }
    None
}

/// Free bytes for an unprivileged writer (`statvfs` `f_bavail`) and the filesystem's size.
///
/// # Errors
/// `statvfs` failed.
pub fn space(dir: &Path) -> io::Result<(u64, u64)> {
    let st = rustix::fs::statvfs(dir)?;
    Ok((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// Opens (creating when `create`) a data file for direct I/O. When the filesystem refuses
/// O_DIRECT (EINVAL), opens it buffered; the bool says whether direct I/O is on.
///
/// # Errors
/// The open failed.
pub fn open_data(path: &Path, create: bool, direct: bool) -> io::Result<(File, bool)> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(create);
    if direct {
        let mut od = o.clone();
        od.custom_flags(libc::O_DIRECT);
        match od.open(path) {
            Ok(f) => return Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((o.open(path)?, false))
}

/// Preallocates `[offset, offset + len)` of `file` (`fallocate`, mode 0: blocks reserved,
/// the size extended), so that ENOSPC shows now rather than mid-record.
///
/// # Errors
/// ENOSPC, EDQUOT, or a filesystem without `fallocate` (EOPNOTSUPP).
pub fn preallocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    rustix::fs::fallocate(file, FallocateFlags::empty(), offset, len).map_err(io::Error::from)
}

/// Takes an exclusive `flock` on `file` without waiting.
///
/// # Errors
/// `WouldBlock` when another process holds it.
pub fn lock_exclusive(file: &File) -> io::Result<()> {
    rustix::fs::flock(file, FlockOperation::NonBlockingLockExclusive).map_err(io::Error::from)
}

/// `fdatasync`.
///
/// # Errors
/// The OS error.
pub fn sync_data(file: &File) -> io::Result<()> {
    rustix::fs::fdatasync(file).map_err(io::Error::from)
}

/// Whether an I/O error means "no space": ENOSPC, EDQUOT, or the tier's own free-space
/// accounting (`StorageFull` without an OS error: free space minus reserve below a segment).
pub fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || (e.raw_os_error().is_none() && e.kind() == io::ErrorKind::StorageFull)
}
