//! Unit and property tests of the DRAM tier and its allocator.

use super::*;

use pegaflow_plugin::buffer::ReleaseBatch;
use pegaflow_plugin::Extent;
use proptest::prelude::*;

fn tier(capacity: u64, shards: usize) -> DramTier {
    DramTier::new(DramSettings {
        capacity,
        shards,
        ..DramSettings::default()
    })
    .expect("tier builds")
}

fn table(text: &str) -> toml::Table {
    text.parse::<toml::Table>().expect("valid toml")
}

/// A byte pattern that differs between buffers and between positions of one buffer.
fn pattern(id: u32, len: usize) -> Vec<u8> {
    let mut x = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn fill(buf: &HostBuffer, id: u32) {
    buf.write_at(0, &pattern(id, buf.len()));
}

fn check(buf: &HostBuffer, id: u32) -> bool {
    let mut got = vec![0u8; buf.len()];
    buf.read_at(0, &mut got);
    got == pattern(id, buf.len())
}

/// Every reserved range of every live buffer, checked pairwise disjoint and inside `backing`.
fn assert_disjoint(bufs: &[&HostBuffer], backing: (usize, usize)) {
    let mut ranges: Vec<(usize, usize)> = bufs
        .iter()
        .flat_map(|b| b.extents().iter())
        .map(|e| (e.addr, e.len.next_multiple_of(GRANULE)))
        .collect();
    ranges.sort_unstable();
    for r in &ranges {
        assert!(
            r.0 >= backing.0 && r.0 + r.1 <= backing.0 + backing.1,
            "extent outside pool"
        );
        assert_eq!((r.0 - backing.0) % GRANULE, 0, "extent not granule-aligned");
    }
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "overlapping extents {w:?}");
    }
}

#[test]
fn footprint_rounds_up_to_granule() {
    let t = tier(1 << 20, 1);
    assert_eq!(t.footprint_bytes(0), 0);
    assert_eq!(t.footprint_bytes(1), 512);
    assert_eq!(t.footprint_bytes(512), 512);
    assert_eq!(t.footprint_bytes(513), 1024);
    assert_eq!(t.footprint_bytes(usize::MAX), u64::MAX);
    assert!(t.allocate(usize::MAX).is_none());
}

#[test]
fn capacity_rounds_down_and_accounts_exactly() {
    let t = tier(10_000, 1);
    assert_eq!(t.capacity_bytes(), 9728);
    assert_eq!(t.kind(), "dram");
    assert_eq!(t.metric_label(), "ram");
    assert_eq!(t.free_bytes(), 9728);
    let a = t.allocate(700).unwrap();
    assert_eq!(a.len(), 700);
    assert_eq!(a.extents().len(), 1);
    assert_eq!(t.used_bytes(), 1024);
    let b = t.allocate(512).unwrap();
    assert_eq!(t.used_bytes(), 1536);
    drop(a);
    assert_eq!(t.used_bytes(), 512);
    drop(b);
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.free_extents_per_shard(), vec![1]);
}

#[test]
fn zero_length_buffers_take_nothing() {
    let t = tier(4096, 1);
    let z = t.allocate(0).unwrap();
    assert!(z.is_empty());
    assert!(z.extents().is_empty());
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn exhaustion_returns_none_then_succeeds_after_free() {
    let t = tier(8 * 1024, 1);
    let bufs: Vec<_> = (0..8).map(|_| t.allocate(1024).unwrap()).collect();
    assert_eq!(t.used_bytes(), 8 * 1024);
    assert!(t.allocate(1).is_none());
    drop(bufs.into_iter().next());
    let again = t.allocate(1000).unwrap();
    assert_eq!(again.len(), 1000);
    assert!(t.allocate(9 * 1024).is_none());
}

#[test]
fn best_fit_extent_is_preferred() {
    let t = tier(64 * 1024, 1);
    let bufs: Vec<_> = (0..16).map(|_| t.allocate(4096).unwrap()).collect();
    // Holes: one of 4 KiB (index 3), one of 8 KiB (indices 8, 9).
    let base = bufs[0].extents()[0].addr;
    let hole4 = bufs[3].extents()[0].addr;
    let mut bufs: Vec<Option<HostBuffer>> = bufs.into_iter().map(Some).collect();
    bufs[3] = None;
    bufs[8] = None;
    bufs[9] = None;
    let b = t.allocate(3000).unwrap();
    assert_eq!(b.extents().len(), 1);
    assert_eq!(
        b.extents()[0].addr,
        hole4,
        "the smallest hole that fits is used"
    );
    assert!(hole4 >= base);
}

#[test]
fn fragmented_free_space_is_gathered_into_one_buffer() {
    let t = tier(64 * 1024, 1);
    let mut bufs: Vec<Option<HostBuffer>> = (0..64).map(|_| t.allocate(1024)).collect();
    assert!(bufs.iter().all(Option::is_some));
    // Free every other 1 KiB block: 32 KiB free, largest hole 1 KiB.
    for b in bufs.iter_mut().step_by(2) {
        *b = None;
    }
    assert_eq!(t.largest_free_extent(), 1024);
    let big = t
        .allocate(20_000)
        .expect("fragmentation never fails an allocation");
    assert_eq!(big.len(), 20_000);
    assert_eq!(big.extents().len(), 20);
    assert_eq!(t.used_bytes(), 32 * 1024 + 20 * 1024);
    fill(&big, 7);
    for (i, b) in bufs.iter().enumerate() {
        if let Some(b) = b {
            fill(b, 1000 + i as u32);
        }
    }
    assert!(check(&big, 7));
    let live: Vec<&HostBuffer> = bufs.iter().flatten().chain([&big]).collect();
    assert_disjoint(&live, t.backing_range());
    drop(big);
    assert_eq!(t.used_bytes(), 32 * 1024);
    bufs.clear();
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.free_extents_per_shard(), vec![1]);
}

#[test]
fn gathered_buffer_trims_only_its_last_extent() {
    let t = tier(8 * 1024, 1);
    let mut bufs: Vec<Option<HostBuffer>> = (0..8).map(|_| t.allocate(1024)).collect();
    bufs[1] = None;
    bufs[4] = None;
    bufs[6] = None;
    let b = t.allocate(2600).unwrap();
    assert_eq!(b.len(), 2600);
    assert_eq!(t.used_bytes(), 5 * 1024 + 3072);
    let lens: Vec<usize> = b.extents().iter().map(|e| e.len).collect();
    assert_eq!(lens, vec![1024, 1024, 552]);
    drop(b);
    assert_eq!(t.used_bytes(), 5 * 1024);
}

#[test]
fn batch_is_carved_contiguously_and_frees_per_block() {
    let t = tier(1 << 20, 1);
    let lens = vec![4096; 8];
    let bufs = t.allocate_batch(&lens, 1).unwrap();
    assert_eq!(bufs.len(), 8);
    let base = bufs[0].extents()[0].addr;
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            b.extents(),
            &[Extent {
                addr: base + i * 4096,
                len: 4096
            }]
        );
    }
    assert_eq!(t.used_bytes(), 8 * 4096);
    let mut bufs = bufs;
    bufs.remove(3);
    assert_eq!(t.used_bytes(), 7 * 4096);
    drop(bufs);
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.free_extents_per_shard(), vec![1]);
}

#[test]
fn a_release_batch_returns_buffers_of_every_shard_when_it_closes() {
    let t = tier(16 * 4096, 4);
    let bufs: Vec<HostBuffer> = (0..16).map(|_| t.allocate(4096).unwrap()).collect();
    assert_eq!(t.used_bytes(), 16 * 4096);
    assert!(t.allocate(1).is_none());
    let mut bufs = bufs;
    let kept = bufs.split_off(12);
    {
        let _batch = ReleaseBatch::open();
        drop(bufs);
        // Counted used until the batch closes.
        assert_eq!(t.used_bytes(), 16 * 4096);
    }
    assert_eq!(t.used_bytes(), 4 * 4096);
    assert_eq!(t.free_bytes_per_shard().iter().sum::<usize>(), 12 * 4096);
    // The memory is reusable at once, and the kept buffers are untouched by it.
    for (i, b) in kept.iter().enumerate() {
        fill(b, i as u32);
    }
    let again: Vec<HostBuffer> = (0..12).map(|_| t.allocate(4096).unwrap()).collect();
    for (i, b) in again.iter().enumerate() {
        fill(b, 100 + i as u32);
    }
    for (i, b) in kept.iter().enumerate() {
        assert!(check(b, i as u32));
    }
    drop((again, kept));
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.free_extents_per_shard(), vec![1; 4]);
}

#[test]
fn batch_with_odd_lengths_reserves_each_footprint() {
    let t = tier(64 * 1024, 1);
    let lens = [100, 0, 513, 4096, 1];
    let bufs = t.allocate_batch(&lens, 1).unwrap();
    let got: Vec<usize> = bufs.iter().map(HostBuffer::len).collect();
    assert_eq!(got, lens);
    assert_eq!(t.used_bytes(), 512 + 1024 + 4096 + 512);
    for (i, b) in bufs.iter().enumerate() {
        fill(b, i as u32);
    }
    for (i, b) in bufs.iter().enumerate() {
        assert!(check(b, i as u32));
    }
    drop(bufs);
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn batch_is_all_or_nothing() {
    let t = tier(16 * 1024, 1);
    let held = t.allocate(10 * 1024).unwrap();
    assert!(t.allocate_batch(&[4096, 4096], 1).is_none());
    assert_eq!(t.used_bytes(), 10 * 1024);
    let ok = t.allocate_batch(&[4096, 2048], 1).unwrap();
    assert_eq!(t.used_bytes(), 16 * 1024);
    drop((held, ok));
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn shards_split_evenly_and_serve_round_robin() {
    let t = tier(4 * 4096 + 512, 4);
    assert_eq!(t.shard_count(), 4);
    assert_eq!(t.free_bytes_per_shard(), vec![4608, 4096, 4096, 4096]);
    let bufs: Vec<_> = (0..4).map(|_| t.allocate(4096).unwrap()).collect();
    let free = t.free_bytes_per_shard();
    assert_eq!(free, vec![512, 0, 0, 0], "one allocation per shard");
    // Fallback: the next allocations land wherever there is room.
    let small = t.allocate(512).unwrap();
    assert!(t.allocate(1).is_none());
    drop((bufs, small));
    assert_eq!(t.free_extents_per_shard(), vec![1; 4]);
}

#[test]
fn shards_fall_back_across_pools_as_last_resort() {
    let t = tier(4096, 2);
    let a = t.allocate(1536).unwrap();
    let b = t.allocate(1536).unwrap();
    assert_eq!(t.free_bytes_per_shard(), vec![512, 512]);
    let c = t.allocate(1000).expect("1 KiB free in total");
    assert_eq!(c.extents().len(), 2);
    assert_eq!(t.used_bytes(), 4096);
    fill(&a, 1);
    fill(&b, 2);
    fill(&c, 3);
    assert!(check(&a, 1) && check(&b, 2) && check(&c, 3));
    drop(c);
    assert_eq!(t.free_bytes_per_shard(), vec![512, 512]);
    drop((a, b));
    assert_eq!(t.free_extents_per_shard(), vec![1, 1]);
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn buffers_outlive_the_tier_handle() {
    let t = tier(1 << 20, 1);
    let b = t.allocate(4096).unwrap();
    drop(t);
    fill(&b, 9);
    assert!(check(&b, 9));
}

#[test]
fn backing_range_covers_every_extent() {
    let t = tier(1 << 20, 2);
    let ranges = [t.backing_range()];
    assert_eq!(t.regions().len(), 1);
    assert_eq!(t.regions()[0].addr, ranges[0].0);
    assert_eq!(ranges[0].1, 1 << 20);
    assert_eq!(ranges[0].0 % 4096, 0, "page-aligned");
    let bufs: Vec<_> = (0..10)
        .map(|i| t.allocate(1000 * (i + 1)).unwrap())
        .collect();
    let refs: Vec<&HostBuffer> = bufs.iter().collect();
    assert_disjoint(&refs, ranges[0]);
}

#[test]
fn trim_returns_free_memory_and_spares_live_buffers() {
    let t = tier(32 << 20, 1);
    let live = t.allocate(1 << 20).unwrap();
    fill(&live, 5);
    let big = t.allocate(16 << 20).unwrap();
    big.write_at(0, &vec![0xAB; big.len()]);
    drop(big);
    let advised = t.trim_free_memory();
    assert!(advised >= 16 << 20, "advised {advised}");
    assert!(check(&live, 5), "trim must not touch live buffers");
    let again = t.allocate(16 << 20).unwrap();
    let mut out = vec![1u8; 4096];
    again.read_at(0, &mut out);
    assert!(
        out.iter().all(|&b| b == 0),
        "trimmed pages read back as zeros"
    );
    t.trim();
}

#[test]
fn trim_skips_small_free_ranges() {
    let t = tier(1 << 20, 1);
    let _held = t.allocate((1 << 20) - 4096).unwrap();
    assert_eq!(t.trim_free_memory(), 0);
}

/// The `VmFlags` line of this process's mapping that holds `addr` (`/proc/self/smaps`; the
/// kernel may have merged the pool with a neighbouring mapping of the same flags).
fn vm_flags(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let holds = |l: &str| -> Option<bool> {
        let (a, b) = l.split_whitespace().next()?.split_once('-')?;
        let a = usize::from_str_radix(a, 16).ok()?;
        let b = usize::from_str_radix(b, 16).ok()?;
        Some(a <= addr && addr < b)
    };
    let mut lines = smaps.lines().skip_while(|l| holds(l) != Some(true));
    lines.next()?;
    lines
        .find(|l| l.starts_with("VmFlags:"))
        .map(|l| l.trim_start_matches("VmFlags:").trim().to_string())
}

#[test]
fn transparent_hugepages_align_the_pool_and_advise_it() {
    let capacity = (8 << 20) + 3 * GRANULE as u64;
    let t = DramTier::new(DramSettings {
        capacity,
        transparent_hugepages: true,
        ..DramSettings::default()
    })
    .expect("tier builds");
    let (addr, len) = t.backing_range();
    assert!(
        addr.is_multiple_of(HUGE_PAGE),
        "{addr:#x} on a 2 MiB boundary"
    );
    assert_eq!(len as u64, capacity);
    let flags = vm_flags(addr).expect("the pool's mapping is listed in smaps");
    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "advised MADV_HUGEPAGE: {flags}"
        );
    } else {
        pegaflow_test_skip::skip_part!(
            "the advice part: this kernel has no transparent huge pages"
        );
    }
    // It serves as any pool: whole, exact, and the last granule is writable.
    let a = t.allocate(4 << 20).unwrap();
    let b = t.allocate((capacity as usize) - (4 << 20)).unwrap();
    fill(&a, 1);
    fill(&b, 2);
    assert!(check(&a, 1) && check(&b, 2));
    assert_eq!(t.used_bytes(), capacity);
    drop(b);
    // Trim gives back whole huge pages only: of the 4 MiB + 1536 B free at the end (from a
    // 2 MiB boundary), the 4 MiB.
    assert_eq!(t.trim_free_memory(), 4 << 20);
    assert!(check(&a, 1), "trim must not touch live buffers");
}

#[test]
fn base_pages_are_not_advised() {
    let t = tier(4 << 20, 1);
    let flags = vm_flags(t.backing_range().0).expect("listed in smaps");
    assert!(!flags.split_whitespace().any(|f| f == "hg"), "{flags}");
}

/// A number from `/sys/kernel/mm/hugepages/hugepages-2048kB/` (0 when unreadable).
fn huge_pages_2m(file: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{file}"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn reserved_hugepages_map_in_full_or_fail_clearly() {
    let settings = |capacity| DramSettings {
        capacity,
        use_hugepages: true,
        // Reserved pages win over transparent ones.
        transparent_hugepages: true,
        ..DramSettings::default()
    };
    // More than the kernel's free huge pages: refused at start-up, naming the remedy (unless
    // the kernel may hand out surplus pages beyond its pool).
    if huge_pages_2m("nr_overcommit_hugepages") == 0 {
        let too_many = (huge_pages_2m("free_hugepages") + 1) * HUGE_PAGE as u64;
        let e = format!("{:#}", DramTier::new(settings(too_many)).unwrap_err());
        assert!(
            e.contains("MAP_HUGETLB") && e.contains("vm.nr_hugepages"),
            "{e}"
        );
    } else {
        pegaflow_test_skip::skip_part!(
            "the refusal part: this kernel may hand out surplus huge pages"
        );
    }
    if huge_pages_2m("free_hugepages") == 0 {
        pegaflow_test_skip::skip_part!(
            "the mapping part: this machine has no free reserved huge pages"
        );
        return;
    }
    let t = DramTier::new(settings(3 << 19)).expect("1.5 MiB on one free huge page");
    let (addr, _) = t.backing_range();
    assert!(addr.is_multiple_of(HUGE_PAGE));
    let b = t.allocate(3 << 19).unwrap();
    fill(&b, 9);
    assert!(check(&b, 9));
    drop(b);
    assert_eq!(
        t.trim_free_memory(),
        0,
        "reserved pages are never given back"
    );
}

#[test]
fn huge_capacity_maps_lazily() {
    // Far more than this machine's memory: the mapping is committed only as it is written.
    let t = tier(64 << 30, 1);
    assert_eq!(t.capacity_bytes(), 64 << 30);
    let b = t.allocate(1 << 20).unwrap();
    fill(&b, 3);
    assert!(check(&b, 3));
    let last = t.allocate((64 << 30) - (1 << 20)).unwrap();
    last.write_at(last.len() - 4, &[1, 2, 3, 4]);
    assert_eq!(t.used_bytes(), 64 << 30);
}

#[test]
fn concurrent_allocations_never_overlap() {
    let t = Arc::new(tier(8 << 20, 2));
    std::thread::scope(|s| {
        for th in 0..4u32 {
            let t = t.clone();
            s.spawn(move || {
                for i in 0..300u32 {
                    let len = 1 + ((th * 7919 + i * 104_729) as usize % 40_000);
                    let id = th * 100_000 + i;
                    let b = t.allocate(len).expect("plenty of room");
                    fill(&b, id);
                    std::thread::yield_now();
                    assert!(check(&b, id));
                }
            });
        }
    });
    assert_eq!(t.used_bytes(), 0);
    assert_eq!(t.free_extents_per_shard(), vec![1, 1]);
}

#[test]
fn default_settings_and_factory() {
    let s = DramSettings::from_table(&toml::Table::new()).unwrap();
    assert_eq!(s, DramSettings::default());
    assert_eq!(s.capacity, 30 << 30);
    let f = pegaflow_plugin::tier_factory("dram").expect("dram is registered");
    assert_eq!(f.kind, "dram");
    let names: Vec<&str> = f.config.options.iter().map(|o| o.name).collect();
    let defaults = (f.config.defaults)();
    assert_eq!(
        names,
        defaults.keys().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(defaults["capacity"], toml::Value::String("30gb".into()));
    assert_eq!(
        DramSettings::from_table(&defaults).unwrap(),
        DramSettings::default(),
        "the rendered defaults read back as the defaults"
    );
    assert!(f.default_landing);
    assert!(pegaflow_plugin::describe_plugins().contains("capacity = \"30gb\""));
    // The default 30 GiB pool starts regardless of free memory.
    let landing = |b: BuiltTier| match b {
        BuiltTier::Landing(p) => p,
        BuiltTier::Block(_) => panic!("dram builds a landing pool"),
    };
    let t = landing((f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap());
    assert_eq!(t.capacity_bytes(), 30 << 30);
    let t = landing(
        (f.build)(
            &table("kind = \"dram\"\ncapacity = \"1.5mb\"\nshards = 3"),
            &RuntimeContext::default(),
        )
        .unwrap(),
    );
    assert_eq!(t.capacity_bytes(), 3 << 19);
    assert!(pegaflow_plugin::describe_plugins().contains("dram"));
    let s = DramSettings::from_table(&table(
        "transparent_hugepages = true\nuse_hugepages = false",
    ))
    .unwrap();
    assert!(s.transparent_hugepages && !s.use_hugepages);
}

#[test]
fn aligned_allocations_start_on_the_alignment() {
    let t = tier(4 << 20, 2);
    // Misalign the free space first.
    let _a = t.allocate(700).unwrap();
    let bufs = t.allocate_batch(&[5000, 4096, 1], 4096).unwrap();
    for b in &bufs {
        assert_eq!(b.extents().len(), 1);
        assert_eq!(b.extents()[0].addr % 4096, 0, "aligned");
    }
    assert_eq!(bufs[0].len(), 5000);
    let used = t.used_bytes();
    assert_eq!(
        used,
        1024 + 5120 + 4096 + 512,
        "only the footprints are used"
    );
    drop(bufs);
    assert_eq!(t.used_bytes(), 1024);
    assert!(t.allocate_batch(&[1], 3).is_none(), "not a power of two");
    assert!(
        t.allocate_batch(&[8 << 20], 4096).is_none(),
        "larger than the pool"
    );
    assert_eq!(t.used_bytes(), 1024, "a refused batch allocates nothing");
}

#[test]
fn integer_capacity_is_bytes() {
    let s = DramSettings::from_table(&table("capacity = 1048576")).unwrap();
    assert_eq!(s.capacity, 1 << 20);
}

fn build_err(text: &str) -> String {
    match build(&table(text), &RuntimeContext::default()) {
        Ok(_) => panic!("{text:?} should be rejected"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_settings_are_rejected_clearly() {
    let e = build_err("eviction = \"lru\"");
    assert!(e.contains("eviction") && e.contains("tier stack"), "{e}");
    let e = build_err("capacty = \"1gb\"");
    assert!(
        e.starts_with("dram tier: ")
            && e.contains("capacty")
            && e.contains("`capacity`")
            && e.contains("`shards`"),
        "{e}"
    );
    let e = build_err("shards = 0");
    assert!(e.contains("shards"), "{e}");
    let e = build_err("shards = \"two\"");
    assert_eq!(
        e,
        "dram tier: invalid type: string \"two\", expected usize in `shards`"
    );
    let e = build_err("capacity = \"lots\"");
    assert!(e.contains("capacity") || e.contains("invalid size"), "{e}");
    let e = build_err("capacity = 100");
    assert!(e.contains("at least 512 bytes"), "{e}");
    let e = build_err("capacity = 1024\nshards = 3");
    assert!(e.contains("between 1 and 2"), "{e}");
    let e = build_err("capacity = -5");
    assert_eq!(e, "dram tier: invalid size -5: negative in `capacity`");
    let e = build_err("shards = 5000");
    assert!(e.contains("between 1 and 4096"), "{e}");
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Batch(Vec<usize>),
    Free(usize),
    /// Drops up to this many live buffers inside one `ReleaseBatch`.
    FreeMany(usize),
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=600, 1usize..=5000, 4096usize..=20_000]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => size().prop_map(Op::Alloc),
        1 => prop::collection::vec(size(), 1..5).prop_map(Op::Batch),
        4 => any::<prop::sample::Index>().prop_map(|i| Op::Free(i.index(usize::MAX))),
        1 => (1usize..12).prop_map(Op::FreeMany),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_alloc_free_sequences(
        granules in 64usize..=256,
        shards in 1usize..=3,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let t = tier((granules * GRANULE) as u64, shards);
        let cap = t.capacity_bytes();
        let backing = t.backing_range();
        let mut live: Vec<(HostBuffer, u32)> = Vec::new();
        let mut next_id = 0u32;
        let mut expect_used = 0u64;
        for op in ops {
            match op {
                Op::Alloc(len) => {
                    let fp = t.footprint_bytes(len);
                    let free = cap - t.used_bytes();
                    match t.allocate(len) {
                        None => prop_assert!(free < fp, "None with {free} free for {fp}"),
                        Some(b) => {
                            prop_assert_eq!(b.len(), len);
                            expect_used += fp;
                            fill(&b, next_id);
                            live.push((b, next_id));
                            next_id += 1;
                        }
                    }
                }
                Op::Batch(lens) => {
                    let fp: u64 = lens.iter().map(|&l| t.footprint_bytes(l)).sum();
                    let free = cap - t.used_bytes();
                    match t.allocate_batch(&lens, 1) {
                        None => prop_assert!(free < fp, "batch None with {free} free for {fp}"),
                        Some(bufs) => {
                            prop_assert_eq!(bufs.len(), lens.len());
                            expect_used += fp;
                            for (b, &l) in bufs.into_iter().zip(&lens) {
                                prop_assert_eq!(b.len(), l);
                                fill(&b, next_id);
                                live.push((b, next_id));
                                next_id += 1;
                            }
                        }
                    }
                }
                Op::FreeMany(n) => {
                    let batch = ReleaseBatch::open();
                    let (mut fp, mut at_once) = (0, 0);
                    for _ in 0..n.min(live.len()) {
                        let (b, _) = live.swap_remove(0);
                        fp += t.footprint_bytes(b.len());
                        if b.extents().len() > 1 {
                            at_once += t.footprint_bytes(b.len());
                        }
                    }
                    // Buffers of one extent come back when the batch closes; others at once.
                    prop_assert_eq!(t.used_bytes(), expect_used - at_once);
                    drop(batch);
                    expect_used -= fp;
                }
                Op::Free(i) => {
                    for (b, id) in &live {
                        prop_assert!(check(b, *id), "buffer {id} was overwritten");
                    }
                    if !live.is_empty() {
                        let (b, _) = live.swap_remove(i % live.len());
                        expect_used -= t.footprint_bytes(b.len());
                    }
                }
            }
            prop_assert_eq!(t.used_bytes(), expect_used);
            prop_assert!(t.used_bytes() <= cap);
            let free: usize = t.free_bytes_per_shard().iter().sum();
            prop_assert_eq!(free as u64, cap - expect_used);
            let refs: Vec<&HostBuffer> = live.iter().map(|(b, _)| b).collect();
            assert_disjoint(&refs, backing);
        }
        for (b, id) in &live {
            prop_assert!(check(b, *id), "buffer {id} was overwritten");
        }
        live.clear();
        prop_assert_eq!(t.used_bytes(), 0);
        prop_assert_eq!(t.free_extents_per_shard(), vec![1; shards]);
    }
}
