//! The SSD tier's failures are visible and cost no more than they must: a full filesystem
//! (ENOSPC) is logged, rate-limited, and shown on `/health` as a path that cannot write,
//! until space comes back; a capacity cut below the configured figure is logged with both
//! figures; two stores on one filesystem share its free space; one truncated segment loses
//! its own blocks, not the whole path; a store directory replaced while in use leaves
//! service. Tests that need root (tmpfs mounts) report themselves skipped (`pegaflow_tests::skip!`) with the reason where they
//! cannot run.

mod common;

use std::sync::Arc;

use common::*;
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::{Tier, TierError};
use pegaflow_tier_ssd::io::fault::{Fault, FaultyIo};
use pegaflow_tier_ssd::io::{EngineOptions, IoEngine};

/// The `/health` line of `path`.
fn health_line(h: &HealthBoard, path: &std::path::Path) -> String {
    h.render()
        .lines()
        .find(|l| l.starts_with(&format!("ssd {}:", path.display())))
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_filesystem_is_logged_and_shown_until_space_returns() {
    let fs = match Tmpfs::mount("16m") {
        Ok(m) => m,
        Err(why) => {
            pegaflow_tests::skip!("needs root to mount a tmpfs: {why}");
            return;
        }
    };
    capture_logs();
    let dir = fs.mnt.join("ssd");
    // 2 GiB asked of a 16 MiB filesystem: cut at start, with a WARN naming both figures.
    let cfg = pegaflow_tier_ssd::SsdConfig {
        max_errors: 3,
        ..config(&dir, 2 << 30, 1 << 20)
    };
    let reg = prometheus::Registry::new();
    let health = HealthBoard::default();
    let t = open_with(&cfg, &reg, &health);
    t.recover().await.unwrap();
    let cut = log_lines("SSD capacity cut below the configured figure");
    let cut: Vec<&String> = cut
        .iter()
        .filter(|l| l.contains(&dir.display().to_string()))
        .collect();
    assert_eq!(cut.len(), 1, "{cut:?}");
    assert!(cut[0].contains("configured=2.0 GiB"), "{}", cut[0]);
    assert!(cut[0].contains("effective="), "{}", cut[0]);
    assert!(cut[0].contains("reserve"), "{}", cut[0]);
    assert!(
        health_line(&health, &dir).contains("capacity cut to"),
        "{}",
        health.render()
    );
    assert!(!health.degraded());

    // Someone fills the filesystem before the tier wrote anything: no segment fits, none
    // can be reused, every write fails.
    let hog = fs.hog("hog", 256 << 10);
    let mut failed = 0;
    for i in 0..50u64 {
        match put(&t, "ns", i, 20_000).await {
            Err(TierError::Full(_)) => failed += 1,
            other => panic!("put {i} on a full filesystem: {other:?}"),
        }
    }
    assert_eq!(failed, 50);
    assert!(health.degraded(), "{}", health.render());
    let line = health_line(&health, &dir);
    assert!(line.contains(": degraded; cannot write:"), "{line}");
    assert!(
        line.contains("no room") || line.contains("No space"),
        "{line}"
    );
    assert!(
        metric(
            &reg,
            "pegaflow_ssd_io_errors_total{kind=\"enospc\",op=\"preallocate\"}"
        ) >= 50.0,
        "{}",
        metrics_text(&reg)
    );
    let path = dir.display().to_string();
    let warns: Vec<String> = log_lines("SSD I/O error")
        .into_iter()
        .filter(|l| l.contains(&path))
        .collect();
    assert!(!warns.is_empty(), "the failed writes are logged");
    assert!(
        warns.len() <= 2,
        "50 failures within seconds log at most one line per 10 s: {warns:?}"
    );
    assert_eq!(
        log_lines("SSD path cannot write")
            .iter()
            .filter(|l| l.contains(&path))
            .count(),
        1
    );

    // Space comes back: the next write succeeds and /health says ok again.
    std::fs::remove_file(hog).unwrap();
    put(&t, "ns", 100, 20_000).await.unwrap();
    assert_eq!(read_back(&t, "ns", 100).await, Some(true));
    assert!(!health.degraded(), "{}", health.render());
    assert!(!log_lines("SSD path writes again").is_empty());
}

/// ENOSPC from the write itself (a device or filesystem that reports it mid-segment, through
/// the fault-injecting engine): logged, and `/health` degraded once every write fails; the
/// path stays in service (a full filesystem forgets nothing) and says ok after a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_writes_are_logged_and_make_the_path_degraded() {
    capture_logs();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("enospc");
    let posix: Arc<dyn IoEngine> = Arc::new(pegaflow_tier_ssd::io::posix::PosixIo::start(
        EngineOptions {
            threads: 1,
            buffers_per_thread: 1,
            buffer_bytes: 64 << 10,
            mem_align: 4096,
        },
    ));
    let faulty = Arc::new(FaultyIo::new(posix));
    let health = HealthBoard::default();
    let reg = prometheus::Registry::new();
    let cfg = pegaflow_tier_ssd::SsdConfig {
        max_errors: 4,
        ..config(&dir, 8 << 20, 1 << 20)
    };
    let t = pegaflow_tier_ssd::open_with_engine(&cfg, faulty.clone(), &reg, &health).unwrap();
    t.recover().await.unwrap();
    put(&t, "ns", 0, 4096).await.unwrap();
    faulty.fail_every_write(Some(Fault::Enospc));
    for i in 1..30u64 {
        assert!(put(&t, "ns", i, 4096).await.is_err());
    }
    assert!(health.degraded(), "{}", health.render());
    let line = health_line(&health, &dir);
    assert!(line.contains("cannot write:"), "{line}");
    assert!(line.contains("No space left on device"), "{line}");
    assert!(!line.contains("out of service"), "{line}");
    assert_eq!(
        read_back(&t, "ns", 0).await,
        Some(true),
        "nothing forgotten"
    );
    let path = dir.display().to_string();
    let warns = log_lines("SSD I/O error");
    let warns: Vec<&String> = warns.iter().filter(|l| l.contains(&path)).collect();
    assert!(!warns.is_empty() && warns.len() <= 2, "{warns:?}");
    faulty.fail_every_write(None);
    put(&t, "ns", 99, 4096).await.unwrap();
    assert!(!health.degraded(), "{}", health.render());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_segment_loses_only_its_own_blocks() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ssd");
    let reg = prometheus::Registry::new();
    let health = HealthBoard::default();
    // 8 segments of 1 MiB; ~45 blocks of 20 KB a segment; max_errors 8 (the default).
    let t = open_with(&config(&dir, 8 << 20, 1 << 20), &reg, &health);
    t.recover().await.unwrap();
    for i in 0..200u64 {
        put(&t, "ns", i, 20_000).await.unwrap();
    }
    let recs = scan(&dir);
    let in_slot = |s: u32| -> Vec<u64> {
        recs.iter()
            .filter(|r| r.live && r.slot == s)
            .map(|r| r.id)
            .collect()
    };
    let victims = in_slot(0);
    assert!(victims.len() >= 10, "{victims:?}");
    assert!(recs.iter().any(|r| r.live && r.slot != 0));
    // Someone truncates segment 0 to its header while the server runs.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("segment-000000.dat"))
        .unwrap()
        .set_len(4096)
        .unwrap();
    // Its blocks are asked for first, one after the other (each a short read on the old
    // code: eight in a row took the whole path out of service).
    for &i in &victims {
        assert_ne!(read_back(&t, "ns", i).await, Some(true), "block {i}");
    }
    assert!(!health.degraded(), "{}", health.render());
    assert_eq!(metric(&reg, "pegaflow_ssd_degraded_dirs"), 0.0);
    assert_eq!(
        metric(
            &reg,
            "pegaflow_ssd_segment_evictions_total{reason=\"read_error\"}"
        ),
        1.0,
        "{}",
        metrics_text(&reg)
    );
    // Every other block is still served, and the path keeps writing.
    for i in 0..200u64 {
        if !victims.contains(&i) {
            assert_eq!(read_back(&t, "ns", i).await, Some(true), "block {i}");
        }
    }
    for i in 200..260u64 {
        put(&t, "ns", i, 20_000).await.unwrap();
        assert_eq!(read_back(&t, "ns", i).await, Some(true));
    }
}

/// Two stores on one filesystem, each configured for more than all of it: together they
/// never hold more than the filesystem, their capacities add up to at most its size, and
/// both keep writing (each reuses its own oldest segments once no file fits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_filesystem_share_its_free_space() {
    let fs = match Tmpfs::mount("24m") {
        Ok(m) => m,
        Err(why) => {
            pegaflow_tests::skip!("needs root to mount a tmpfs: {why}");
            return;
        }
    };
    let size = fs.size();
    let (ha, hb) = (HealthBoard::default(), HealthBoard::default());
    let a = open_with(
        &config(&fs.mnt.join("a"), 64 << 20, 1 << 20),
        &prometheus::Registry::new(),
        &ha,
    );
    let b = open_with(
        &config(&fs.mnt.join("b"), 64 << 20, 1 << 20),
        &prometheus::Registry::new(),
        &hb,
    );
    a.recover().await.unwrap();
    b.recover().await.unwrap();
    // 96 MiB of blocks, alternately: four times the filesystem.
    let mut ok = [0u32; 2];
    for i in 0..2400u64 {
        let (t, k) = if i % 2 == 0 { (&a, 0) } else { (&b, 1) };
        if put(t, "ns", i, 40_000).await.is_ok() {
            ok[k] += 1;
        }
        let held = segment_bytes(&fs.mnt.join("a")) + segment_bytes(&fs.mnt.join("b"));
        assert!(held <= size, "segment files {held} > filesystem {size}");
    }
    assert!(ok[0] >= 1150 && ok[1] >= 1150, "both keep writing: {ok:?}");
    let caps = a.capacity_bytes() + b.capacity_bytes();
    assert!(
        caps <= size,
        "capacities {} + {} claim more than the {size}-byte filesystem",
        a.capacity_bytes(),
        b.capacity_bytes()
    );
    for (t, last) in [(&a, 2398u64), (&b, 2399u64)] {
        assert_eq!(read_back(t, "ns", last).await, Some(true));
    }
    assert!(
        health_line(&ha, &fs.mnt.join("a")).contains("no room on the filesystem")
            || health_line(&hb, &fs.mnt.join("b")).contains("no room on the filesystem"),
        "{}\n{}",
        ha.render(),
        hb.render()
    );
    assert!(!ha.degraded() && !hb.degraded());
}

/// The store directory renamed away and a new one made at its path while the server runs:
/// the next check takes the path out of service (nothing more is written under a path that
/// another server may now own), and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_directory_replaced_while_in_use_leaves_service() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ssd");
    let health = HealthBoard::default();
    let t = open_with(
        &config(&dir, 8 << 20, 1 << 20),
        &prometheus::Registry::new(),
        &health,
    );
    t.recover().await.unwrap();
    put(&t, "ns", 1, 4096).await.unwrap();
    std::fs::rename(&dir, d.path().join("moved")).unwrap();
    std::fs::create_dir(&dir).unwrap();
    let tt = t.clone();
    tokio::task::spawn_blocking(move || tt.check_paths())
        .await
        .unwrap();
    assert!(health.degraded(), "{}", health.render());
    let line = health_line(&health, &dir);
    assert!(line.contains("out of service"), "{line}");
    assert!(line.contains("no longer names the store"), "{line}");
    assert_eq!(read_back(&t, "ns", 1).await, None);
    assert!(put(&t, "ns", 2, 4096).await.is_err());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing written into the new directory"
    );
}
