//! One cache directory (or one cache file): its owner lock, superblock, geometry, segment
//! slots and free-space accounting. Blocking: opened at start, slot files opened and
//! preallocated from blocking threads.
//!
//! Owns: the owner lock — an exclusive `flock` on the store itself (the directory, or the
//! one data file), so that no file inside the store can be unlinked to defeat it — and the
//! check that the path still names the locked store ([`Dir::check_owner`]); the capacity at
//! start (`min(capacity, free + held − reserve)`, with a WARN naming both figures when that
//! cuts it) and at run time (a new segment file is created only while `statvfs` shows free
//! space above the reserve, so that stores sharing a filesystem share its free space).
//!
//! Must never: overwrite a file that is not a pegaflow store, open a store of another format
//! version, or create a segment file that would eat into the reserve.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use parking_lot::Mutex;

use crate::device;
use crate::format::{align_up, FormatError, Superblock, FORMAT_VERSION};

/// Where a store's segments live.
#[derive(Debug)]
pub enum Layout {
    /// A directory: `superblock`, `lock`, `segment-NNNNNN.dat`.
    Directory,
    /// One file: the superblock in its first MiB, segment `i` at `base + i * segment_size`.
    File {
        /// The data file.
        file: Arc<File>,
        /// Offset of segment 0.
        base: u64,
    },
}

/// Bytes before segment 0 in a one-file store.
pub const FILE_BASE: u64 = 1 << 20;

/// One directory (or file) of the SSD tier.
#[derive(Debug)]
pub struct Dir {
    /// The configured path.
    pub path: PathBuf,
    /// How segments are laid out.
    pub layout: Layout,
    /// Offset and length alignment, bytes.
    pub align: u64,
    /// Memory alignment of I/O buffers, bytes.
    pub mem_align: u64,
    /// Bytes per segment.
    pub segment_size: u64,
    /// Segment slots.
    pub slots: u32,
    /// The store's identity (from the superblock).
    pub store_id: u64,
    /// Whether data files are open with O_DIRECT.
    pub direct: bool,
    /// Where the alignment came from (`statx`, `sysfs`, ...).
    pub align_source: &'static str,
    files: Mutex<Vec<Option<Arc<File>>>>,
    /// The locked store (the directory, or the data file), and its `(dev, ino)`.
    lock: File,
    lock_id: (u64, u64),
    /// Bytes left free on the filesystem (the configured reserve, at most 5 % of it).
    pub reserve: u64,
    /// Bytes this path was configured to hold (`capacity / paths`).
    pub configured_bytes: u64,
    /// Why the capacity at start is below `configured_bytes` (free space), when it is.
    pub start_cut: Option<String>,
    /// I/O errors in a row (reads and writes; ENOSPC excluded): `max_errors` of them take the
    /// path out of service.
    pub errors: AtomicU32,
    /// Failed writes in a row (ENOSPC included); reset by a completed write.
    pub write_fails: AtomicU32,
    /// The last segment creation found no room (free space − reserve below one segment):
    /// the path holds only the segment files it has.
    pub no_room: AtomicBool,
    /// Out of service.
    pub degraded: AtomicBool,
}

/// What opening a directory needs.
#[derive(Debug, Clone, Copy)]
pub struct DirOptions {
    /// Bytes this directory may hold (before the free-space check).
    pub capacity: u64,
    /// Bytes per segment for a new store.
    pub segment_size: u64,
    /// Bytes to leave free on the filesystem (at most 5 % of it).
    pub reserve: u64,
    /// Open data files with O_DIRECT.
    pub direct: bool,
}

/// What the filesystem under a path offers (read once in [`Dir::open`]).
#[derive(Debug, Clone, Copy)]
struct Probe {
    align: u64,
    mem_align: u64,
    free: u64,
    reserve: u64,
}

/// What opening a store found or made, before it becomes a [`Dir`].
struct Opened {
    layout: Layout,
    sb: Superblock,
    slots: u32,
    direct: bool,
    files: Vec<Option<Arc<File>>>,
    start_cut: Option<String>,
}

/// The file that names the owner's pid (information for the refusal message only: the lock
/// is on the store itself, and removing this file changes nothing).
fn owner_path(path: &Path, is_file: bool) -> PathBuf {
    if is_file {
        let mut p = path.as_os_str().to_owned();
        p.push(".owner");
        PathBuf::from(p)
    } else {
        path.join("owner")
    }
}

/// How long a lock held under this process's own pid is waited for: a child this process
/// forks (a test's helper, a hook) keeps a copy of every open file description, and so the
/// flock of a directory just closed here, until it execs.
const OWN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `(dev, ino)` of an open file.
fn file_id(f: &File) -> io::Result<(u64, u64)> {
    let st = rustix::fs::fstat(f)?;
    Ok((st.st_dev, st.st_ino))
}

/// The pid holding an exclusive `flock` on the inode `id`, from `/proc/locks`.
fn flock_holder(id: (u64, u64)) -> Option<u32> {
    let want = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(id.0),
        rustix::fs::minor(id.0),
        id.1
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        // `N: FLOCK ADVISORY WRITE pid maj:min:ino start end` (waiters have `->` after N:).
        (w.len() >= 6 && w[1] == "FLOCK" && w[3] == "WRITE" && w[5] == want)
            .then(|| w[4].parse().ok())
            .flatten()
    })
}

/// The pid an owner file names (`pid N`), when it names one.
fn owner_file_pid(p: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(p).ok()?;
    s.split_whitespace()
        .skip_while(|w| *w != "pid")
        .nth(1)
        .and_then(|p| p.parse().ok())
}

/// Takes the owner lock: an exclusive `flock` on the store itself (the directory, or the
/// data file of a one-file store), so that unlinking any file inside it cannot hand the
/// store to a second server. A second server on the same path fails here, naming the
/// holder's pid (from `/proc/locks`, else the owner file). A lock that names this very
/// process is retried for up to [`OWN_LOCK_WAIT`] first: it is either a store of this
/// process still closing or a forked child's inherited copy, both brief. Then writes this
/// process's pid into the owner file.
fn take_lock(path: &Path, is_file: bool) -> anyhow::Result<(File, (u64, u64))> {
    let f =
        File::open(path).with_context(|| format!("cannot open {} to lock it", path.display()))?;
    let id = file_id(&f)?;
    let op = owner_path(path, is_file);
    let me = std::process::id();
    let deadline = std::time::Instant::now() + OWN_LOCK_WAIT;
    loop {
        match device::lock_exclusive(&f) {
            Ok(()) => break,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let holder = flock_holder(id).or_else(|| owner_file_pid(&op));
                if holder == Some(me) && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
                if holder == Some(me) {
                    bail!(
                        "SSD cache path {} is already open in this process (pid {me}): one store per directory; give each tier its own path",
                        path.display()
                    );
                }
                let holder = holder.map(|p| format!(" (pid {p})")).unwrap_or_default();
                bail!(
                    "SSD cache path {} is in use by another process{holder}: two servers cannot share one SSD directory; give each its own --ssd-cache-path",
                    path.display()
                );
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
    }
    let tmp = {
        let mut p = op.as_os_str().to_owned();
        p.push(".tmp");
        PathBuf::from(p)
    };
    std::fs::write(&tmp, format!("pid {me}\n"))
        .and_then(|()| std::fs::rename(&tmp, &op))
        .with_context(|| format!("cannot write the SSD owner file {}", op.display()))?;
    Ok((f, id))
}

impl Dir {
    /// Opens (creating when absent) the store at `path`: a directory, or an existing regular
    /// file. Checks capacity against free space: the directory gets
    /// `min(capacity, free + bytes it already holds − reserve)`, in whole segments.
    ///
    /// # Errors
    /// The path is neither a directory nor a file, the lock is held, the superblock is not
    /// ours, or no segment fits.
    pub fn open(path: &Path, opts: DirOptions) -> anyhow::Result<Self> {
        let is_file = match std::fs::metadata(path) {
            Ok(m) if m.is_file() => true,
            Ok(m) if m.is_dir() => false,
            Ok(_) => bail!(
                "SSD cache path {} is neither a directory nor a regular file",
                path.display()
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::create_dir_all(path).with_context(|| {
                    format!("cannot create the SSD cache directory {}", path.display())
                })?;
                tracing::info!(path = %path.display(), "created the SSD cache directory (and its missing parents)");
                false
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot stat {}", path.display()));
            }
        };
        let (lock, lock_id) = take_lock(path, is_file)?;
        let fs_dir = if is_file {
            match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            }
        } else {
            path.to_path_buf()
        };
        let (align, mem_align, align_source) = device::dio_alignment(&fs_dir);
        let (free, fs_size) = device::space(&fs_dir)
            .with_context(|| format!("cannot read free space of {}", fs_dir.display()))?;
        let reserve = opts.reserve.min(fs_size / 20);
        let probe = Probe {
            align,
            mem_align,
            free,
            reserve,
        };
        let o = if is_file {
            Self::open_file(path, opts, &probe)?
        } else {
            Self::open_dir(path, opts, &probe)?
        };
        let align = u64::from(o.sb.align);
        if let Some(cut) = &o.start_cut {
            tracing::warn!(
                path = %path.display(),
                configured = %bytesize::ByteSize::b(opts.capacity),
                effective = %bytesize::ByteSize::b(u64::from(o.slots) * o.sb.segment_size),
                "SSD capacity cut below the configured figure: {cut}"
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            layout: o.layout,
            align,
            mem_align: mem_align.max(align),
            segment_size: o.sb.segment_size,
            slots: o.slots,
            store_id: o.sb.store_id,
            direct: o.direct,
            align_source,
            files: Mutex::new(o.files),
            lock,
            lock_id,
            reserve,
            configured_bytes: opts.capacity,
            start_cut: o.start_cut,
            errors: AtomicU32::new(0),
            write_fails: AtomicU32::new(0),
            no_room: AtomicBool::new(false),
            degraded: AtomicBool::new(false),
        })
    }

    fn open_dir(path: &Path, opts: DirOptions, probe: &Probe) -> anyhow::Result<Opened> {
        let Probe {
            align,
            free,
            reserve,
            ..
        } = *probe;
        // Space already ours: the segment files present.
        let mut held = 0u64;
        for e in std::fs::read_dir(path)?.flatten() {
            if e.file_name().to_string_lossy().starts_with("segment-") {
                held += e.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        let room = (free + held).saturating_sub(reserve);
        let cap = opts.capacity.min(room);
        let sb_path = path.join("superblock");
        let sb = match std::fs::read(&sb_path) {
            Ok(b) => Superblock::decode(&b).map_err(|e| match e {
                FormatError::Version(v) => version_refusal(path, v, "the directory's contents"),
                e => anyhow::anyhow!(e).context(format!(
                    "{} is not a pegaflow SSD superblock (remove the directory's contents to start afresh)",
                    sb_path.display()
                )),
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Sized for what fits (free space), not only what was asked.
                let seg = segment_size_for(opts.segment_size, cap, align);
                let sb = Superblock {
                    align: align as u32,
                    segment_size: seg,
                    created_unix: now_unix(),
                    store_id: rand::random(),
                };
                let mut bytes = sb.encode();
                bytes.resize(align as usize, 0);
                let tmp = path.join("superblock.tmp");
                std::fs::write(&tmp, &bytes)?;
                File::open(&tmp)?.sync_all()?;
                std::fs::rename(&tmp, &sb_path)?;
                File::open(path)?.sync_all()?;
                sb
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", sb_path.display())),
        };
        if u64::from(sb.align) < align || u64::from(sb.align) % align != 0 {
            bail!(
                "{}: the store was formatted with {}-byte alignment but the device needs {align}: remove the directory's contents to reformat",
                path.display(),
                sb.align
            );
        }
        let slots = (cap / sb.segment_size) as u32;
        if slots == 0 {
            bail!(
                "SSD cache path {}: no room for one {}-byte segment (capacity {}, {} free + {} held, {} reserved)",
                path.display(),
                sb.segment_size,
                opts.capacity,
                free,
                held,
                reserve
            );
        }
        let start_cut = (room < opts.capacity)
            .then(|| cut_reason(free, held, reserve, u64::from(slots) * sb.segment_size));
        // Segment files past the slot count (a smaller capacity than last time) are removed.
        for e in std::fs::read_dir(path)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(n) = parse_segment_name(&name) {
                if n >= slots {
                    tracing::info!(file = %e.path().display(), "removing a segment beyond the configured capacity");
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let probe = path.join(".direct-probe");
        let (pf, direct) = device::open_data(&probe, true, opts.direct)?;
        drop(pf);
        let _ = std::fs::remove_file(&probe);
        if opts.direct && !direct {
            tracing::warn!(path = %path.display(), "the filesystem refuses O_DIRECT; the SSD tier uses the page cache");
        }
        Ok(Opened {
            layout: Layout::Directory,
            sb,
            slots,
            direct,
            files: vec![None; slots as usize],
            start_cut,
        })
    }

    fn open_file(path: &Path, opts: DirOptions, probe: &Probe) -> anyhow::Result<Opened> {
        let Probe {
            align,
            mem_align,
            free,
            reserve,
        } = *probe;
        let (file, direct) = device::open_data(path, false, opts.direct)
            .with_context(|| format!("cannot open the SSD cache file {}", path.display()))?;
        let len = file.metadata()?.len();
        let mut head = crate::io::AlignedBuf::new(4096.max(align as usize), mem_align as usize);
        let n = head.len();
        let got = file.read_at(head.slice_mut(n), 0).unwrap_or(0);
        let ours = got >= 8 && head.slice(8) == crate::format::SUPERBLOCK_MAGIC;
        let existing = if ours {
            // Our magic: it must parse (a damaged or newer-format store is refused, never
            // reformatted).
            Some(Superblock::decode(head.slice(got)).map_err(|e| match e {
                FormatError::Version(v) => version_refusal(path, v, "the file"),
                e => anyhow::anyhow!(e).context(format!(
                    "{} holds a pegaflow SSD store this build cannot open (remove the file to start afresh)",
                    path.display()
                )),
            })?)
        } else {
            None
        };
        let mut start_cut = None;
        let sb = match existing {
            Some(sb) => sb,
            None => {
                if len > 0 && got >= 8 && head.slice(8) != crate::format::SUPERBLOCK_MAGIC {
                    // An existing file that is not ours: refuse rather than overwrite it.
                    let looks_empty = head.slice(got).iter().all(|&b| b == 0);
                    if !looks_empty {
                        bail!(
                            "SSD cache file {} exists and is not a pegaflow SSD store: refusing to overwrite it (remove it, or name a directory)",
                            path.display()
                        );
                    }
                }
                let room = (free + len).saturating_sub(reserve);
                let cap = opts.capacity.min(room.saturating_sub(FILE_BASE));
                let seg = segment_size_for(opts.segment_size, cap, align);
                let sb = Superblock {
                    align: align as u32,
                    segment_size: seg,
                    created_unix: now_unix(),
                    store_id: rand::random(),
                };
                let slots = cap / seg;
                if slots == 0 {
                    bail!(
                        "SSD cache file {}: no room for one {seg}-byte segment ({free} bytes free, {reserve} reserved)",
                        path.display()
                    );
                }
                if room.saturating_sub(FILE_BASE) < opts.capacity {
                    start_cut = Some(cut_reason(free, len, reserve, slots * seg));
                }
                device::preallocate(&file, 0, FILE_BASE + slots * seg).with_context(|| {
                    format!("cannot preallocate the SSD cache file {}", path.display())
                })?;
                let mut b = crate::io::AlignedBuf::new(align as usize, mem_align as usize);
                let e = sb.encode();
                b.slice_mut(e.len()).copy_from_slice(&e);
                file.write_at(b.slice(align as usize), 0)?;
                file.sync_all()?;
                sb
            }
        };
        let len = file.metadata()?.len();
        let slots = (len.saturating_sub(FILE_BASE) / sb.segment_size)
            .min(opts.capacity / sb.segment_size) as u32;
        if slots == 0 {
            bail!(
                "SSD cache file {}: smaller than one segment",
                path.display()
            );
        }
        let file = Arc::new(file);
        Ok(Opened {
            layout: Layout::File {
                file: file.clone(),
                base: FILE_BASE,
            },
            sb,
            slots,
            direct,
            files: vec![Some(file); slots as usize],
            start_cut,
        })
    }

    /// Bytes of segments this directory may hold: every slot, or (while the filesystem has
    /// no room for another segment file, [`Dir::no_room`]) the segment files it has.
    pub fn capacity(&self) -> u64 {
        let n = if self.no_room.load(Ordering::Relaxed) {
            self.files_held()
        } else {
            self.slots
        };
        u64::from(n) * self.segment_size
    }

    /// Slots whose segment file is open (created and preallocated).
    pub fn files_held(&self) -> u32 {
        self.files.lock().iter().filter(|f| f.is_some()).count() as u32
    }

    /// Whether a new segment file fits: `statvfs`'s free bytes (now, so that several stores
    /// on one filesystem share what is left) minus the reserve cover one segment.
    ///
    /// # Errors
    /// `StorageFull` (counted and shown as no space) when it does not; the `statvfs` error.
    pub fn room_for_segment(&self) -> io::Result<()> {
        let (free, _) = device::space(&self.path)?;
        if free < self.reserve.saturating_add(self.segment_size) {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "no room for another {} segment: {} free on the filesystem, {} reserved",
                    bytesize::ByteSize::b(self.segment_size),
                    bytesize::ByteSize::b(free),
                    bytesize::ByteSize::b(self.reserve)
                ),
            ));
        }
        Ok(())
    }

    /// Lets go of slot `slot`'s open segment file (a directory store): the next use opens it
    /// again and preallocates what is missing (after a read error showed it damaged).
    pub fn forget_file(&self, slot: u32) {
        if matches!(self.layout, Layout::Directory) {
            self.files.lock()[slot as usize] = None;
        }
    }

    /// Checks that the path still names the store this process locked (a directory renamed
    /// away or removed while in use is another process's to take: a new server would lock
    /// the new one).
    ///
    /// # Errors
    /// What the path names now, in words.
    pub fn check_owner(&self) -> Result<(), String> {
        let locked =
            file_id(&self.lock).map_err(|e| format!("cannot stat the locked store: {e}"))?;
        match rustix::fs::stat(&self.path) {
            Ok(st) if (st.st_dev, st.st_ino) == locked && locked == self.lock_id => Ok(()),
            Ok(_) => Err(format!(
                "{} no longer names the store this server locked at start (it was replaced while in use)",
                self.path.display()
            )),
            Err(e) => Err(format!(
                "{} no longer names the store this server locked at start ({e})",
                self.path.display()
            )),
        }
    }

    /// The file of slot `slot` and the offset of its segment in it. With `create`, a missing
    /// segment file is created and preallocated (blocking).
    ///
    /// # Errors
    /// `NotFound` without `create`; ENOSPC/EDQUOT from preallocation; other OS errors.
    pub fn slot_file(&self, slot: u32, create: bool) -> io::Result<(Arc<File>, u64)> {
        match &self.layout {
            Layout::File { file, base } => {
                Ok((file.clone(), base + u64::from(slot) * self.segment_size))
            }
            Layout::Directory => {
                if let Some(f) = self.files.lock()[slot as usize].clone() {
                    return Ok((f, 0));
                }
                let p = self.path.join(segment_name(slot));
                let exists = p.exists();
                if !exists && !create {
                    return Err(io::Error::from(io::ErrorKind::NotFound));
                }
                if create {
                    let short = std::fs::metadata(&p).map_or(true, |m| m.len() < self.segment_size);
                    if short {
                        self.room_for_segment()?;
                    }
                }
                let (f, _) = device::open_data(&p, create, self.direct)?;
                if f.metadata()?.len() < self.segment_size {
                    if !create {
                        return Err(io::Error::from(io::ErrorKind::NotFound));
                    }
                    if let Err(e) = device::preallocate(&f, 0, self.segment_size) {
                        drop(f);
                        if !exists {
                            let _ = std::fs::remove_file(&p);
                        }
                        return Err(e);
                    }
                }
                let f = Arc::new(f);
                self.files.lock()[slot as usize] = Some(f.clone());
                Ok((f, 0))
            }
        }
    }

    /// Whether slot `slot`'s segment file is open (created and preallocated).
    pub fn has_file(&self, slot: u32) -> bool {
        self.files.lock()[slot as usize].is_some()
    }

    /// Every open data file (for `fdatasync`).
    pub fn open_files(&self) -> Vec<Arc<File>> {
        let mut v: Vec<Arc<File>> = self.files.lock().iter().flatten().cloned().collect();
        v.dedup_by(|a, b| Arc::ptr_eq(a, b));
        v
    }
}

/// A segment size for a store of `capacity` bytes: the configured one, smaller for small
/// stores (at least 8 segments, at least 1 MiB), aligned.
fn segment_size_for(configured: u64, capacity: u64, align: u64) -> u64 {
    let small = (capacity / 8).max(1 << 20);
    align_up(configured.min(small).max(16 * align), align)
}

/// Why the capacity at start is below the configured figure, in words.
fn cut_reason(free: u64, held: u64, reserve: u64, effective: u64) -> String {
    let b = bytesize::ByteSize::b;
    format!(
        "free space {} + {} of segments already held − reserve {} leaves {} (whole segments)",
        b(free),
        b(held),
        b(reserve),
        b(effective)
    )
}

/// The refusal of a store of another on-disk format version.
fn version_refusal(path: &Path, v: u32, what: &str) -> anyhow::Error {
    let why = if v < FORMAT_VERSION {
        "an earlier pegaflow-rs wrote it; its records' checksums do not bind a payload to the block \
         and place it was written for, so this build does not read them"
    } else {
        "a newer build wrote it"
    };
    anyhow::anyhow!(
        "SSD cache path {} holds a store of on-disk format version {v}, and this build reads and \
         writes version {FORMAT_VERSION} only ({why}): remove {what} (a cache: the blocks are \
         saved again) or point --ssd-cache-path elsewhere",
        path.display()
    )
}

fn segment_name(slot: u32) -> String {
    format!("segment-{slot:06}.dat")
}

fn parse_segment_name(name: &str) -> Option<u32> {
    name.strip_prefix("segment-")?
        .strip_suffix(".dat")?
        .parse()
        .ok()
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64 MiB store of 8 MiB segments.
    fn small() -> DirOptions {
        DirOptions {
            capacity: 64 << 20,
            segment_size: 8 << 20,
            reserve: 0,
            direct: true,
        }
    }

    #[test]
    fn segment_names_round_trip_and_small_stores_get_small_segments() {
        assert_eq!(parse_segment_name(&segment_name(42)), Some(42));
        assert_eq!(parse_segment_name("segment-x.dat"), None);
        assert_eq!(segment_size_for(256 << 20, 1 << 40, 4096), 256 << 20);
        assert_eq!(segment_size_for(256 << 20, 64 << 20, 4096), 8 << 20);
        assert_eq!(segment_size_for(256 << 20, 1 << 20, 4096), 1 << 20);
    }

    #[test]
    fn a_lock_this_process_lets_go_of_soon_is_waited_for() {
        // What a forked child's inherited copy of the lock looks like from here: held under
        // this pid, released a moment later.
        let d = tempfile::tempdir().unwrap();
        let o = small();
        let a = Dir::open(d.path(), o).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(a);
        });
        Dir::open(d.path(), o).expect("the second open waits for the first to close");
        release.join().unwrap();
    }

    #[test]
    fn a_second_open_of_one_directory_names_the_holder() {
        let d = tempfile::tempdir().unwrap();
        let o = small();
        let a = Dir::open(d.path(), o).unwrap();
        assert!(a.slots >= 1);
        // Held by this process: waited for, then refused as a second store in-process.
        let e = Dir::open(d.path(), o).unwrap_err().to_string();
        assert!(e.contains("already open in this process"), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(a);
        Dir::open(d.path(), o).unwrap();
        // Held by another process (flock(1) on the directory): refused at once, naming it.
        let mut other = match std::process::Command::new("flock")
            .arg("--nonblock")
            .arg(d.path())
            .args(["sleep", "30"])
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                pegaflow_tests::skip_part!("the other-process half needs flock(1): {e}");
                return;
            }
        };
        let id = file_id(&File::open(d.path()).unwrap()).unwrap();
        let t0 = std::time::Instant::now();
        while flock_holder(id).is_none() && t0.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let t0 = std::time::Instant::now();
        let e = Dir::open(d.path(), o).unwrap_err().to_string();
        assert!(
            e.contains(&format!("in use by another process (pid {})", other.id())),
            "{e}"
        );
        assert!(
            t0.elapsed() < OWN_LOCK_WAIT,
            "another holder is not waited for"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    /// The lock is on the store itself: removing the owner file (or any file in the store)
    /// does not let a second opener in.
    #[test]
    fn removing_the_owner_file_does_not_unlock_the_store() {
        let d = tempfile::tempdir().unwrap();
        let o = small();
        let a = Dir::open(d.path(), o).unwrap();
        for name in ["owner", "lock"] {
            let _ = std::fs::remove_file(d.path().join(name));
        }
        let e = Dir::open(d.path(), o)
            .map(|_| ())
            .expect_err("a second open after the owner file was unlinked");
        assert!(
            e.to_string().contains("already open in this process"),
            "{e}"
        );
        a.check_owner().unwrap();
        drop(a);
        Dir::open(d.path(), o).unwrap();
    }

    /// A store directory replaced while in use (renamed away, a new one made at its path):
    /// the check says so.
    #[test]
    fn a_replaced_store_directory_is_noticed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ssd");
        let a = Dir::open(&p, small()).unwrap();
        a.check_owner().unwrap();
        std::fs::rename(&p, d.path().join("away")).unwrap();
        let e = a.check_owner().unwrap_err();
        assert!(e.contains("no longer names the store"), "{e}");
        std::fs::create_dir(&p).unwrap();
        let e = a.check_owner().unwrap_err();
        assert!(e.contains("replaced while in use"), "{e}");
    }
}
