//! Helpers shared by the SSD tier's hardening tests (`misplaced.rs`, `failures.rs`).

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use pegaflow_plugin::block::{BlockKey, SealedBlock, Slot};
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::{Tier, TierError, TierGet, TierPut};
use pegaflow_tests::pool_suite::pattern;
use pegaflow_tests::tier_suite::heap_buffer;
use pegaflow_tier_ssd::format::{Footer, RecordHeader, SegmentHeader, Superblock};
use pegaflow_tier_ssd::{IoChoice, SsdConfig, SsdTier};

pub fn key(ns: &str, i: u64) -> BlockKey {
    BlockKey {
        namespace: ns.into(),
        group: 0,
        hash: i.to_le_bytes().to_vec().into(),
    }
}

/// A block of one slot holding `pattern(id, len)`.
pub fn block(id: u64, len: usize) -> Arc<SealedBlock> {
    let b = heap_buffer(len, 1);
    b.write_at(0, &pattern(id, len));
    Arc::new(SealedBlock {
        group: 0,
        slots: [Slot {
            buf: Arc::new(b),
            offset: 0,
            len,
        }]
        .into_iter()
        .collect(),
        footprint: len as u64,
        sealed_at: std::time::Instant::now(),
    })
}

/// A small store: posix I/O, no reserve, 64 KiB writes.
pub fn config(path: &Path, capacity: u64, segment_size: u64) -> SsdConfig {
    SsdConfig {
        paths: vec![path.to_path_buf()],
        capacity,
        segment_size,
        reserve: 0,
        io: IoChoice::Posix,
        write_chunk: 64 << 10,
        io_threads: 2,
        admission: Some(pegaflow_tier_ssd::Admission::Always),
        ..SsdConfig::default()
    }
}

pub fn open_with(cfg: &SsdConfig, reg: &prometheus::Registry, health: &HealthBoard) -> SsdTier {
    pegaflow_tier_ssd::open(cfg, reg, health).expect("open the SSD tier")
}

pub async fn put(t: &SsdTier, ns: &str, id: u64, len: usize) -> Result<(), TierError> {
    t.put(vec![TierPut {
        key: key(ns, id),
        block: block(id, len),
    }])
    .await
    .pop()
    .unwrap()
}

/// Reads `(ns, id)` back: `Some(true)` exact, `Some(false)` refused, `None` not held.
/// Panics on wrong bytes reported as success: no test may ever see one.
pub async fn read_back(t: &SsdTier, ns: &str, id: u64) -> Option<bool> {
    let k = key(ns, id);
    let shape = t.lookup(std::slice::from_ref(&k)).await.unwrap().pop()?;
    let len = shape.len_bytes() as usize;
    let dest = Arc::new(heap_buffer(len, 1));
    let r = t
        .get(vec![TierGet {
            key: k,
            shape,
            dest: dest.clone(),
        }])
        .await;
    match &r[0] {
        Ok(()) => {
            let mut got = vec![0u8; len];
            dest.read_at(0, &mut got);
            assert!(
                got == pattern(id, len),
                "block {ns}/{id}: WRONG BYTES SERVED"
            );
            Some(true)
        }
        Err(TierError::NotFound) => None,
        Err(_) => Some(false),
    }
}

pub fn metrics_text(reg: &prometheus::Registry) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&reg.gather())
        .unwrap()
}

/// The value of the sample whose line starts with `series` (`name{labels}`), 0 when absent.
pub fn metric(reg: &prometheus::Registry, series: &str) -> f64 {
    metrics_text(reg)
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures every log line of this test binary at INFO and above (once; later calls share
/// the buffer).
pub fn capture_logs() -> Arc<Mutex<Vec<u8>>> {
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let b = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || Capture(b.clone()))
            .finish();
        tracing::subscriber::set_global_default(sub).expect("one subscriber per test binary");
        buf
    })
    .clone()
}

/// The captured lines that mention `needle`.
pub fn log_lines(needle: &str) -> Vec<String> {
    let buf = capture_logs();
    let text = String::from_utf8_lossy(&buf.lock()).into_owned();
    text.lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// A tmpfs of `size` mounted inside a temporary directory, unmounted on drop.
pub struct Tmpfs {
    _dir: tempfile::TempDir,
    pub mnt: PathBuf,
}

impl Tmpfs {
    /// Mounts one, or says why it cannot (not root, no mount).
    pub fn mount(size: &str) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mnt = dir.path().join("fs");
        std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&mnt)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).trim().to_string());
        }
        Ok(Self { _dir: dir, mnt })
    }

    /// Bytes free on it now.
    pub fn free(&self) -> u64 {
        let s = rustix::fs::statvfs(&self.mnt).unwrap();
        s.f_bavail * s.f_frsize
    }

    /// Bytes in all.
    pub fn size(&self) -> u64 {
        let s = rustix::fs::statvfs(&self.mnt).unwrap();
        s.f_blocks * s.f_frsize
    }

    /// Fills it with a file `name`, leaving about `leave` bytes free.
    pub fn hog(&self, name: &str, leave: u64) -> PathBuf {
        let p = self.mnt.join(name);
        let f = std::fs::File::create(&p).unwrap();
        let n = self.free().saturating_sub(leave);
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, n).unwrap();
        p
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let o = Command::new("umount").arg(&self.mnt).output();
        if !o.is_ok_and(|o| o.status.success()) {
            eprintln!("cannot unmount {}", self.mnt.display());
        }
    }
}

/// Bytes of the segment files under `dir`.
pub fn segment_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("segment-"))
                .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// One record found on disk.
#[derive(Debug, Clone)]
pub struct OnDisk {
    pub file: PathBuf,
    pub slot: u32,
    pub offset: u64,
    pub id: u64,
    pub hlen: usize,
    pub payload: usize,
    pub rec_len: u64,
    /// Its generation is its segment's (else a stale record behind the append point).
    pub live: bool,
    /// Its segment is sealed (a summary and footer: recovery reads the summary; else it
    /// scans the segment, and a header that is not the segment's ends the scan there).
    pub sealed: bool,
}

/// Every record header that parses at an aligned offset of every segment file under `dir`.
pub fn scan(dir: &Path) -> Vec<OnDisk> {
    let sb = Superblock::decode(&std::fs::read(dir.join("superblock")).unwrap()).unwrap();
    let align = u64::from(sb.align);
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("segment-")
        })
        .collect();
    files.sort();
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let slot: u32 = name["segment-".len()..name.len() - 4].parse().unwrap();
        let bytes = std::fs::read(&file).unwrap();
        let Ok(sh) = SegmentHeader::decode(&bytes) else {
            continue;
        };
        let sealed = Footer::decode(&bytes[bytes.len() - align as usize..])
            .is_ok_and(|f| f.generation == sh.generation);
        let mut off = align;
        while off + align <= bytes.len() as u64 {
            if let Ok(h) = RecordHeader::decode(&bytes[off as usize..]) {
                let rec_len = h.record_len(align);
                out.push(OnDisk {
                    file: file.clone(),
                    slot,
                    offset: off,
                    id: u64::from_le_bytes(h.key.hash[..8].try_into().unwrap()),
                    hlen: h.encoded_len(),
                    payload: h.payload_len() as usize,
                    rec_len,
                    live: h.generation == sh.generation,
                    sealed,
                });
                if h.generation == sh.generation {
                    off += rec_len;
                    continue;
                }
            }
            off += align;
        }
    }
    out
}
