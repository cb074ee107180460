//! Wrong bytes from the SSD: records written through the tier, then bytes moved between them
//! on disk as a misdirected or lost write (or an offset bug) would — a payload and trailer
//! over another record of the same size (in the same or another segment), a whole record at
//! another offset, a stale record of an earlier generation of the same slot over a live one
//! — and the store reopened and read back. Every moved-to record is refused (counted in
//! `pegaflow_ssd_corrupt_records_total{why}` or dropped at recovery), no block is ever served
//! with another block's bytes, and untouched blocks are served exact. Also: a store of
//! on-disk format version 1 is refused with a message that says so, and left as it was.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::Tier;
use proptest::prelude::*;

fn read_at(p: &Path, off: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(p).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off).unwrap();
    b
}

fn write_at(p: &Path, off: u64, b: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(b, off).unwrap();
    f.sync_all().unwrap();
}

/// Copies `src`'s payload and trailer over `dst`'s (same payload length).
fn payload_over(dst: &OnDisk, src: &OnDisk) {
    assert_eq!(dst.payload, src.payload);
    let n = src.payload + 8;
    let b = read_at(&src.file, src.offset + src.hlen as u64, n);
    write_at(&dst.file, dst.offset + dst.hlen as u64, &b);
}

/// Copies `src`'s whole record over `dst`'s place (same record length).
fn record_over(dst: &OnDisk, src: &OnDisk) {
    assert_eq!(dst.rec_len, src.rec_len);
    let b = read_at(&src.file, src.offset, src.rec_len as usize);
    write_at(&dst.file, dst.offset, &b);
}

#[derive(Debug, Clone, Copy)]
enum Move {
    /// Payload and trailer of another live record of the same size, same segment.
    PayloadSameSegment,
    /// Payload and trailer of another live record of the same size, another segment.
    PayloadOtherSegment,
    /// A whole live record copied to another live record's offset (same size).
    WholeRecordElsewhere,
    /// Payload and trailer of a stale record (an earlier generation of a reused slot).
    StalePayload,
    /// A whole stale record over a live one of the same size.
    StaleRecord,
}

const NS: &str = "mv";
/// Two payload sizes, so that same-size pairs and other-size neighbours both exist.
const SIZES: [usize; 2] = [3000, 7000];

/// Writes `n` blocks into a 2 MiB store of 256 KiB segments (FIFO reuse leaves stale
/// records), drops the tier, applies `mv` choosing records by `pick`, reopens and reads
/// every block back. Returns `Err` (a proptest failure) on any violated property.
fn run_case(n: u64, mv: Move, pick: (usize, usize)) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ssd");
    let cfg = config(&dir, 2 << 20, 256 << 10);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t = open_with(&cfg, &prometheus::Registry::new(), &HealthBoard::default());
        t.recover().await.unwrap();
        for i in 0..n {
            put(&t, NS, i, SIZES[(i % 2) as usize]).await.unwrap();
        }
        // What is served before anything is moved (the oldest were evicted).
        let mut before = BTreeMap::new();
        for i in 0..n {
            before.insert(i, read_back(&t, NS, i).await);
        }
        drop(t);
        let recs = scan(&dir);
        let live: Vec<&OnDisk> = recs
            .iter()
            .filter(|r| r.live && before.get(&r.id) == Some(&Some(true)))
            .collect();
        let stale: Vec<&OnDisk> = recs.iter().filter(|r| !r.live).collect();
        let choose = |v: &[&OnDisk], k: usize| -> Option<OnDisk> {
            (!v.is_empty()).then(|| v[k % v.len()].clone())
        };
        let Some(dst) = choose(&live, pick.0) else {
            return Err(TestCaseError::reject("no live record"));
        };
        let same = |r: &&&OnDisk| r.payload == dst.payload && r.id != dst.id;
        let (src, moved_id) = match mv {
            Move::PayloadSameSegment | Move::PayloadOtherSegment => {
                let want_same = matches!(mv, Move::PayloadSameSegment);
                let c: Vec<&OnDisk> = live
                    .iter()
                    .filter(same)
                    .filter(|r| (r.slot == dst.slot) == want_same)
                    .copied()
                    .collect();
                let Some(src) = choose(&c, pick.1) else {
                    return Err(TestCaseError::reject("no such pair"));
                };
                payload_over(&dst, &src);
                (src, None)
            }
            Move::WholeRecordElsewhere => {
                let c: Vec<&OnDisk> = live
                    .iter()
                    .filter(|r| r.rec_len == dst.rec_len && r.id != dst.id)
                    .copied()
                    .collect();
                let Some(src) = choose(&c, pick.1) else {
                    return Err(TestCaseError::reject("no such pair"));
                };
                record_over(&dst, &src);
                let id = src.id;
                (src, Some(id))
            }
            Move::StalePayload | Move::StaleRecord => {
                let c: Vec<&OnDisk> = stale
                    .iter()
                    .filter(|r| r.payload == dst.payload && r.rec_len == dst.rec_len)
                    .copied()
                    .collect();
                let Some(src) = choose(&c, pick.1) else {
                    return Err(TestCaseError::reject("no stale record of that size"));
                };
                if matches!(mv, Move::StalePayload) {
                    payload_over(&dst, &src);
                } else {
                    record_over(&dst, &src);
                }
                (src, None)
            }
        };
        let reg = prometheus::Registry::new();
        let t = open_with(&cfg, &reg, &HealthBoard::default());
        t.recover().await.unwrap();
        // read_back panics on any wrong byte served.
        let got = read_back(&t, NS, dst.id).await;
        prop_assert!(
            got != Some(true),
            "{mv:?}: the moved-to block {} was served ({:?} from {:?})",
            dst.id,
            dst,
            src
        );
        let corrupt: f64 = ["header", "identity", "checksum", "short"]
            .iter()
            .map(|w| {
                metric(
                    &reg,
                    &format!("pegaflow_ssd_corrupt_records_total{{why=\"{w}\"}}"),
                )
            })
            .sum();
        prop_assert!(
            got.is_none() || corrupt >= 1.0,
            "{mv:?}: a refused read is counted"
        );
        // Blocks of other segments, and of dst's segment when it is sealed, are untouched:
        // served exact. In a segment recovered by a scan, a header that is not the segment's
        // ends the scan (as a torn tail does): what follows it may be missing, never wrong.
        let slot_of: BTreeMap<u64, u32> = recs
            .iter()
            .filter(|r| r.live)
            .map(|r| (r.id, r.slot))
            .collect();
        for i in 0..n {
            if i == dst.id {
                continue;
            }
            let now = read_back(&t, NS, i).await;
            if Some(i) == moved_id {
                // Its copy may shadow it after a rescan: served exact or refused, never wrong.
                continue;
            }
            let beside = slot_of.get(&i) == Some(&dst.slot) && !dst.sealed;
            if before[&i] == Some(true) && !beside {
                prop_assert_eq!(
                    now,
                    Some(true),
                    "{:?}: untouched block {} after the move",
                    mv,
                    i
                );
            }
        }
        Ok(())
    })
}

fn moves() -> impl Strategy<Value = Move> {
    prop_oneof![
        Just(Move::PayloadSameSegment),
        Just(Move::PayloadOtherSegment),
        Just(Move::WholeRecordElsewhere),
        Just(Move::StalePayload),
        Just(Move::StaleRecord),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_global_rejects: 400, ..ProptestConfig::default() })]

    /// Every move of bytes between records is refused; nothing else changes.
    #[test]
    fn bytes_moved_between_records_are_never_served(
        n in 200u64..420,
        mv in moves(),
        a in any::<usize>(),
        b in any::<usize>(),
    ) {
        run_case(n, mv, (a, b))?;
    }
}

/// Each kind of move at least once, deterministically (the property test may reject a kind
/// whose records a case does not have).
#[test]
fn every_kind_of_move_is_refused() {
    for mv in [
        Move::PayloadSameSegment,
        Move::PayloadOtherSegment,
        Move::WholeRecordElsewhere,
        Move::StalePayload,
        Move::StaleRecord,
    ] {
        let mut done = false;
        for seed in 0..20usize {
            match run_case(400, mv, (seed * 7919, seed * 104_729)) {
                Ok(()) => {
                    done = true;
                    break;
                }
                Err(TestCaseError::Reject(_)) => continue,
                Err(e) => panic!("{mv:?}: {e}"),
            }
        }
        assert!(done, "{mv:?}: no case had the records for it");
    }
}

/// A store of format version 1 (before records bound their payload to header and place):
/// refused at start with a message naming the version and what to do, and not modified.
#[test]
fn a_store_of_format_version_1_is_refused_and_left_alone() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ssd");
    let cfg = config(&dir, 2 << 20, 256 << 10);
    {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let t = open_with(&cfg, &prometheus::Registry::new(), &HealthBoard::default());
            t.recover().await.unwrap();
            put(&t, NS, 1, 3000).await.unwrap();
        });
    }
    // The same superblock as version 1 wrote it: the version field (after the 8-byte magic)
    // is 1, its CRC-32C recomputed.
    let sb_path = dir.join("superblock");
    let mut sb = std::fs::read(&sb_path).unwrap();
    sb[8..12].copy_from_slice(&1u32.to_le_bytes());
    let body = 8 + 4 + 4 + 8 + 8 + 8;
    let crc = crc32c::crc32c(&sb[..body]);
    sb[body..body + 4].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&sb_path, &sb).unwrap();
    let listing = |p: &Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(p)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name() != "owner")
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let files_before = listing(&dir);
    let e = pegaflow_tier_ssd::open(&cfg, &prometheus::Registry::new(), &HealthBoard::default())
        .map(|_| ())
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("on-disk format version 1"), "{msg}");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    assert!(msg.contains("remove"), "{msg}");
    assert!(
        listing(&dir) == files_before,
        "the refused store was modified"
    );

    // A one-file store of version 1: refused the same way, the file untouched.
    let f = d.path().join("cache.dat");
    std::fs::File::create(&f).unwrap();
    let fcfg = config(&f, 8 << 20, 1 << 20);
    drop(open_with(
        &fcfg,
        &prometheus::Registry::new(),
        &HealthBoard::default(),
    ));
    let mut head = read_at(&f, 0, 4096);
    head[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32c::crc32c(&head[..body]);
    head[body..body + 4].copy_from_slice(&crc.to_le_bytes());
    write_at(&f, 0, &head);
    let before = std::fs::read(&f).unwrap();
    let e = pegaflow_tier_ssd::open(&fcfg, &prometheus::Registry::new(), &HealthBoard::default())
        .map(|_| ())
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("on-disk format version 1"), "{msg}");
    assert!(
        std::fs::read(&f).unwrap() == before,
        "the refused file was modified"
    );
}
