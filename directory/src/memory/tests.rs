//! The in-memory directory's unit tests: PegaFlow's semantics (sessions, takeover, the cover
//! plan, owner-checked removal, reclaimable hashes, the sweep) and the bounds (field limits,
//! the caps, slots and namespaces given back, a cut plan).

use super::*;
use crate::limits::ENTRY_OVERHEAD_BYTES;

fn dir() -> MemoryDirectory {
    MemoryDirectory::new(&MemoryConfig::default())
}

fn h(i: u8) -> Vec<u8> {
    vec![i; 8]
}

fn hs(r: std::ops::Range<u8>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

fn p(node: &NodeId, n: u32) -> NodePrefix {
    NodePrefix {
        node: node.addr.clone(),
        prefix_len: n,
    }
}

#[test]
fn config_defaults_and_checks() {
    let t = defaults_of::<MemoryConfig>();
    let c: MemoryConfig = parse_settings("memory", &t).unwrap();
    assert_eq!(c, MemoryConfig::default());
    assert_eq!(c.stale_after_secs, 30);
    assert_eq!(c.ttl_minutes, 120);
    assert_eq!(c.min_reclaimable_owners, 3);
    c.check().unwrap();
    let bad = MemoryConfig {
        ttl_minutes: 1,
        stale_after_secs: 61,
        ..c.clone()
    };
    assert!(bad.check().unwrap_err().to_string().contains("ttl_minutes"));
    let bad = MemoryConfig {
        ttl_minutes: 0,
        ..c.clone()
    };
    assert!(bad.check().is_err());
    let bad = MemoryConfig {
        min_reclaimable_owners: 1,
        ..c
    };
    assert!(bad.check().is_err());
    let mut t = toml::Table::new();
    t.insert("nope".into(), toml::Value::Integer(1));
    assert!(parse_settings::<MemoryConfig>("memory", &t).is_err());
    let f = pegaflow_plugin::directory_factory("memory").unwrap();
    assert!(
        f.config.doc_problems().is_empty(),
        "{:?}",
        f.config.doc_problems()
    );
}

#[test]
fn heartbeat_registers_refreshes_and_refuses_a_live_holder() {
    let d = dir();
    let a = NodeId::new_session("10.0.0.1:1");
    assert!(d.heartbeat_sync(&a).unwrap().state_lost);
    let again = d.heartbeat_sync(&a).unwrap();
    assert!(!again.state_lost);
    assert_eq!(again.stale_after, Duration::from_secs(30));
    let b = NodeId::new_session("10.0.0.1:1");
    assert_eq!(
        d.heartbeat_sync(&b),
        Err(DirectoryError::SessionConflict(a.addr.clone()))
    );
    // Stale: the address changes hands, the new session starts empty.
    d.insert_sync(&a, "ns", &hs(0..2)).unwrap();
    d.advance(Duration::from_secs(31));
    assert!(d.query_sync("ns", &hs(0..2), None).unwrap().is_empty());
    assert!(d.heartbeat_sync(&b).unwrap().state_lost);
    assert!(d.query_sync("ns", &hs(0..2), None).unwrap().is_empty());
    assert_eq!(
        d.insert_sync(&a, "ns", &hs(0..1)),
        Err(DirectoryError::SessionConflict(a.addr.clone()))
    );
    assert!(matches!(
        d.heartbeat_sync(&NodeId::new_session("")),
        Err(DirectoryError::Invalid(_))
    ));
}

#[test]
fn writes_need_the_current_session_and_refresh_a_stale_node() {
    let d = dir();
    let a = NodeId::new_session("10.0.0.1:1");
    assert_eq!(
        d.insert_sync(&a, "ns", &hs(0..1)),
        Err(DirectoryError::UnknownNode(a.addr.clone()))
    );
    assert_eq!(
        d.remove_sync(&a, "ns", &hs(0..1)),
        Err(DirectoryError::UnknownNode(a.addr.clone()))
    );
    d.heartbeat_sync(&a).unwrap();
    d.insert_sync(&a, "ns", &hs(0..3)).unwrap();
    d.advance(Duration::from_secs(40));
    assert!(
        d.query_sync("ns", &hs(0..3), None).unwrap().is_empty(),
        "stale"
    );
    // PegaFlow accepts a stale session's insert and counts it as activity.
    d.insert_sync(&a, "ns", &hs(3..4)).unwrap();
    assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&a, 4)]);
    let b = NodeId::new_session("10.0.0.1:1");
    assert!(matches!(
        d.heartbeat_sync(&b),
        Err(DirectoryError::SessionConflict(_))
    ));
}

#[test]
fn query_answers_the_greedy_cover_plan() {
    let d = dir();
    let (a, b, c) = (
        NodeId::new_session("10.0.0.3:1"),
        NodeId::new_session("10.0.0.1:1"),
        NodeId::new_session("10.0.0.2:1"),
    );
    for n in [&a, &b, &c] {
        d.heartbeat_sync(n).unwrap();
    }
    d.insert_sync(&a, "ns", &hs(0..5)).unwrap();
    d.insert_sync(&b, "ns", &hs(0..5)).unwrap();
    d.insert_sync(&c, "ns", &[h(0), h(1), h(3)]).unwrap();
    // a and b tie for the longest run: the smaller address takes it; c's shorter run
    // does not show.
    assert_eq!(d.query_sync("ns", &hs(0..8), None).unwrap(), vec![p(&b, 5)]);
    assert_eq!(d.query_sync("ns", &hs(0..3), None).unwrap(), vec![p(&b, 3)]);
    assert_eq!(d.query_sync("other", &hs(0..8), None).unwrap(), vec![]);
    assert_eq!(d.query_sync("ns", &hs(5..8), None).unwrap(), vec![]);
    assert!(matches!(
        d.query_sync("ns", &[], None),
        Err(DirectoryError::Invalid(_))
    ));
    // a loses h0, b loses h2: b (smaller than c) takes h0..h1, then a, whose run from h2
    // is the only one, takes h2..h4.
    d.remove_sync(&a, "ns", &hs(0..1)).unwrap();
    d.remove_sync(&b, "ns", &hs(2..3)).unwrap();
    assert_eq!(
        d.query_sync("ns", &hs(0..8), None).unwrap(),
        vec![p(&b, 2), p(&a, 3)]
    );
    // One node may serve several segments: x holds 0..3 and 5..8, y holds 3..5.
    let (x, y) = (
        NodeId::new_session("10.0.0.8:1"),
        NodeId::new_session("10.0.0.9:1"),
    );
    d.heartbeat_sync(&x).unwrap();
    d.heartbeat_sync(&y).unwrap();
    let mut xs = hs(0..3);
    xs.extend(hs(5..8));
    d.insert_sync(&x, "two", &xs).unwrap();
    d.insert_sync(&y, "two", &hs(3..5)).unwrap();
    assert_eq!(
        d.query_sync("two", &hs(0..8), None).unwrap(),
        vec![p(&x, 3), p(&y, 2), p(&x, 3)]
    );
    assert_eq!(
        d.query_sync("two", &hs(0..10), None).unwrap(),
        vec![p(&x, 3), p(&y, 2), p(&x, 3)]
    );
    // A node that does not hold the segment's first hash cannot start it.
    assert_eq!(
        d.query_sync("two", &hs(3..8), None).unwrap(),
        vec![p(&y, 2), p(&x, 3)]
    );
}

#[test]
fn removal_is_owner_checked_and_drops_empty_keys() {
    let d = dir();
    let (a, b) = (
        NodeId::new_session("10.0.0.1:1"),
        NodeId::new_session("10.0.0.2:1"),
    );
    d.heartbeat_sync(&a).unwrap();
    d.heartbeat_sync(&b).unwrap();
    d.insert_sync(&a, "ns", &hs(0..4)).unwrap();
    d.insert_sync(&b, "ns", &hs(0..2)).unwrap();
    assert_eq!(d.stats().entries, 4);
    assert_eq!(d.stats().owners, 6);
    assert_eq!(d.remove_sync(&b, "ns", &hs(2..4)).unwrap(), 0);
    assert_eq!(d.remove_sync(&b, "ns", &[h(0), h(0), h(1)]).unwrap(), 2);
    assert_eq!(d.remove_sync(&a, "ns", &hs(3..4)).unwrap(), 1);
    let s = d.stats();
    assert_eq!((s.entries, s.owners), (3, 3));
    assert_eq!(s.redundancy, [3, 0, 0, 0]);
    assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&a, 3)]);
}

#[test]
fn reclaimable_counts_live_owners_and_new_ownership_only() {
    let d = dir();
    let n: Vec<NodeId> = (1..=4)
        .map(|i| NodeId::new_session(format!("10.0.0.{i}:1")))
        .collect();
    for x in &n {
        d.heartbeat_sync(x).unwrap();
    }
    assert!(d
        .insert_sync(&n[0], "ns", &hs(0..3))
        .unwrap()
        .reclaimable
        .is_empty());
    assert!(d
        .insert_sync(&n[1], "ns", &hs(0..2))
        .unwrap()
        .reclaimable
        .is_empty());
    let got = d
        .insert_sync(&n[2], "ns", &[h(0), h(0), h(1), h(2)])
        .unwrap();
    assert_eq!(got.inserted, 4);
    assert_eq!(got.reclaimable, vec![h(0), h(1)]);
    // Already an owner: nothing new.
    assert!(d
        .insert_sync(&n[2], "ns", &hs(0..2))
        .unwrap()
        .reclaimable
        .is_empty());
    // Stale owners do not count.
    d.advance(Duration::from_secs(31));
    d.heartbeat_sync(&n[3]).unwrap();
    assert!(d
        .insert_sync(&n[3], "ns", &hs(0..1))
        .unwrap()
        .reclaimable
        .is_empty());
    let s = d.stats();
    assert_eq!((s.nodes_active, s.nodes_stale), (1, 3));
    // h0: 4 owners, h1: 3, h2: 2.
    assert_eq!(s.redundancy, [0, 1, 1, 1]);
    assert!((s.redundancy_avg() - 3.0).abs() < 1e-9);
}

#[test]
fn unregister_and_resync_forget_every_owner_of_the_address() {
    let d = dir();
    let a = NodeId::new_session("10.0.0.1:1");
    let b = NodeId::new_session("10.0.0.2:1");
    d.heartbeat_sync(&a).unwrap();
    d.heartbeat_sync(&b).unwrap();
    d.insert_sync(&a, "ns", &hs(0..3)).unwrap();
    d.insert_sync(&a, "ns2", &hs(0..2)).unwrap();
    d.insert_sync(&b, "ns", &hs(0..1)).unwrap();
    let impostor = NodeId::new_session("10.0.0.1:1");
    assert!(matches!(
        d.unregister_sync(&impostor),
        Err(DirectoryError::SessionConflict(_))
    ));
    assert_eq!(d.resync_sync(&a).unwrap(), 5);
    assert_eq!(d.query_sync("ns", &hs(0..3), None).unwrap(), vec![p(&b, 1)]);
    d.insert_sync(&a, "ns", &hs(0..2)).unwrap();
    assert_eq!(d.unregister_sync(&a).unwrap(), 2);
    assert!(matches!(
        d.unregister_sync(&a),
        Err(DirectoryError::UnknownNode(_))
    ));
    assert!(matches!(
        d.insert_sync(&a, "ns", &hs(0..1)),
        Err(DirectoryError::UnknownNode(_))
    ));
    let s = d.stats();
    assert_eq!((s.entries, s.owners, s.nodes_active), (1, 1, 1));
}

#[test]
fn sweep_drops_expired_nodes_replaced_sessions_and_empty_keys() {
    let d = MemoryDirectory::with_timing(Duration::from_secs(2), Duration::from_secs(60), 3);
    let live = NodeId::new_session("10.0.0.1:1");
    let gone = NodeId::new_session("10.0.0.2:1");
    let old = NodeId::new_session("10.0.0.3:1");
    for n in [&live, &gone, &old] {
        d.heartbeat_sync(n).unwrap();
    }
    d.insert_sync(&live, "ns", &hs(0..2)).unwrap();
    d.insert_sync(&gone, "ns", &hs(0..3)).unwrap();
    d.insert_sync(&old, "ns", &hs(5..7)).unwrap();
    d.advance(Duration::from_secs(3));
    let new = NodeId::new_session("10.0.0.3:1");
    d.heartbeat_sync(&new).unwrap();
    d.heartbeat_sync(&live).unwrap();
    // The replaced session's two owners go; nothing has reached the TTL.
    assert_eq!(
        d.sweep(),
        SweepCounts {
            owners: 2,
            keys: 2,
            nodes: 0
        }
    );
    for _ in 0..7 {
        d.advance(Duration::from_secs(10));
        d.heartbeat_sync(&live).unwrap();
        d.heartbeat_sync(&new).unwrap();
    }
    // `gone` was silent for 73 s; `live`'s entries are 73 s old and stay.
    assert_eq!(
        d.sweep(),
        SweepCounts {
            owners: 3,
            keys: 1,
            nodes: 1
        }
    );
    assert_eq!(
        d.query_sync("ns", &hs(0..3), None).unwrap(),
        vec![p(&live, 2)]
    );
    assert!(matches!(
        d.insert_sync(&gone, "ns", &hs(0..1)),
        Err(DirectoryError::UnknownNode(_))
    ));
    let s = d.stats();
    assert_eq!(
        (s.entries, s.owners, s.nodes_active, s.nodes_stale),
        (2, 2, 2, 0)
    );
    assert_eq!(d.sweep(), SweepCounts::default());
}

#[test]
fn many_entries_and_concurrent_writers() {
    let d = Arc::new(dir());
    let nodes: Vec<NodeId> = (0..4)
        .map(|i| NodeId::new_session(format!("10.1.0.{i}:1")))
        .collect();
    for n in &nodes {
        d.heartbeat_sync(n).unwrap();
    }
    let key = |i: u32| -> Vec<u8> { i.to_le_bytes().repeat(8) };
    std::thread::scope(|s| {
        for (k, n) in nodes.iter().enumerate() {
            let d = &d;
            s.spawn(move || {
                let batch: Vec<Vec<u8>> = (0..50_000u32).map(key).collect();
                for c in batch.chunks(4096) {
                    d.insert_sync(n, "big", c).unwrap();
                }
                if k == 3 {
                    d.remove_sync(n, "big", &batch[25_000..]).unwrap();
                }
            });
        }
    });
    let s = d.stats();
    assert_eq!(s.entries, 50_000);
    assert_eq!(s.owners, 175_000);
    assert_eq!(s.redundancy, [0, 0, 25_000, 25_000]);
    let all: Vec<Vec<u8>> = (0..50_000u32).map(key).collect();
    // Nodes 0..2 hold everything: the smallest address covers it in one segment.
    assert_eq!(
        d.query_sync("big", &all, None).unwrap(),
        vec![p(&nodes[0], 50_000)]
    );
    assert_eq!(d.unregister_sync(&nodes[0]).unwrap(), 50_000);
    assert_eq!(d.stats().owners, 125_000);
}

/// 1M keys with 3 owners each: how long the calls take (run with `--release -- --ignored
/// --nocapture`).
#[test]
#[ignore = "prints figures"]
fn million_entries_figures() {
    use std::time::Instant;
    let d = dir();
    let nodes: Vec<NodeId> = (0..3)
        .map(|i| NodeId::new_session(format!("10.2.0.{i}:50055")))
        .collect();
    for n in &nodes {
        d.heartbeat_sync(n).unwrap();
    }
    let key = |i: u32| -> Vec<u8> {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        k[28..].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
        k.to_vec()
    };
    let rss_kib = || -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    };
    let all: Vec<Vec<u8>> = (0..1_000_000u32).map(key).collect();
    let rss_before = rss_kib();
    let t = Instant::now();
    for n in &nodes {
        for c in all.chunks(16_384) {
            d.insert_sync(n, "m", c).unwrap();
        }
    }
    let inserted = t.elapsed();
    let rss_mib = rss_kib().saturating_sub(rss_before) / 1024;
    let t = Instant::now();
    for i in 0..100 {
        let q = &all[i * 1000..i * 1000 + 1000];
        assert_eq!(d.query_sync("m", q, None).unwrap().len(), 1);
    }
    let query = t.elapsed() / 100;
    let t = Instant::now();
    let s = d.stats();
    let stats = t.elapsed();
    let t = Instant::now();
    d.sweep();
    let sweep = t.elapsed();
    let t = Instant::now();
    let removed = d.unregister_sync(&nodes[0]).unwrap();
    let unregister = t.elapsed();
    assert_eq!(
        (s.entries, s.owners, removed),
        (1_000_000, 3_000_000, 1_000_000)
    );
    println!(
        "3M inserts {inserted:?} ({:.0} ns each); 1000-hash query {query:?}; stats {stats:?}; \
         sweep {sweep:?}; unregister of 1M owners {unregister:?}; {rss_mib} MiB resident, \
         {} MiB estimated (max_store_bytes accounting)",
        inserted.as_nanos() as f64 / 3e6,
        s.bytes >> 20
    );
}

fn with_caps(max_nodes: u64, max_blocks_per_node: u64, max_store_bytes: u64) -> MemoryDirectory {
    dir().with_caps(Caps {
        max_nodes,
        max_blocks_per_node,
        max_store_bytes,
    })
}

#[test]
fn fields_past_their_bounds_are_invalid_and_change_nothing() {
    let d = dir();
    let a = NodeId::new_session("10.0.0.1:1");
    d.heartbeat_sync(&a).unwrap();
    let long_addr = NodeId::new_session("a".repeat(257));
    let invalid = |r: Result<(), DirectoryError>, what: &str| match r {
        Err(DirectoryError::Invalid(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{what}: {other:?}"),
    };
    invalid(d.heartbeat_sync(&long_addr).map(drop), "node is 257 bytes");
    invalid(
        d.heartbeat_sync(&NodeId {
            addr: "10.0.0.2:1".into(),
            session: "s".repeat(1 << 20),
        })
        .map(drop),
        "node_id is 1048576 bytes",
    );
    invalid(
        d.insert_sync(&a, &"n".repeat(1025), &hs(0..1)).map(drop),
        "namespace is 1025 bytes",
    );
    invalid(
        d.insert_sync(&a, "ns", &[h(0), vec![]]).map(drop),
        "block_hashes[1] is empty",
    );
    invalid(
        d.insert_sync(&a, "ns", &[vec![1; 1025]]).map(drop),
        "block_hashes[0] is 1025 bytes",
    );
    invalid(
        d.remove_sync(&a, "ns", &[vec![]]).map(drop),
        "block_hashes[0] is empty",
    );
    invalid(
        d.query_sync("ns", &hs(0..1), Some(&"x".repeat(300)))
            .map(drop),
        "exclude_node is 300 bytes",
    );
    let s = d.stats();
    assert_eq!((s.entries, s.nodes_active, s.bytes), (0, 1, 0));
    // The bounds themselves are accepted.
    d.insert_sync(&a, &"n".repeat(1024), &[vec![1; 1024], vec![2]])
        .unwrap();
    assert!(d
        .heartbeat_sync(&NodeId::new_session("a".repeat(256)))
        .is_ok());
}

#[test]
fn caps_refuse_nodes_and_entries_and_keep_nothing_of_a_refused_insert() {
    let d = with_caps(2, 10, 1 << 30);
    let (a, b, c) = (
        NodeId::new_session("10.0.0.1:1"),
        NodeId::new_session("10.0.0.2:1"),
        NodeId::new_session("10.0.0.3:1"),
    );
    d.heartbeat_sync(&a).unwrap();
    d.heartbeat_sync(&b).unwrap();
    match d.heartbeat_sync(&c) {
        Err(DirectoryError::LimitReached { limit, message }) => {
            assert_eq!(limit, "max_nodes");
            assert!(
                message.contains("2 registered nodes; the limit is 2"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A refresh and a takeover are no new node.
    d.heartbeat_sync(&a).unwrap();
    d.advance(Duration::from_secs(31));
    let b2 = NodeId::new_session("10.0.0.2:1");
    d.heartbeat_sync(&b2).unwrap();
    d.heartbeat_sync(&a).unwrap();

    d.insert_sync(&a, "ns", &hs(0..8)).unwrap();
    match d.insert_sync(&a, "ns", &hs(5..12)) {
        Err(DirectoryError::LimitReached { limit, message }) => {
            assert_eq!(limit, "max_blocks_per_node");
            assert!(
                message.contains("owns 10 block entries; the limit is 10"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // The two hashes that fitted were taken back.
    assert_eq!(
        d.query_sync("ns", &hs(0..12), None).unwrap(),
        vec![p(&a, 8)]
    );
    assert_eq!(d.stats().entries, 8);
    // Already-owned hashes do not count again; removals give quota back.
    d.insert_sync(&a, "ns", &hs(0..10)).unwrap();
    assert!(d.insert_sync(&a, "ns", &hs(10..11)).is_err());
    assert_eq!(d.remove_sync(&a, "ns", &hs(0..3)).unwrap(), 3);
    d.insert_sync(&a, "ns", &hs(10..13)).unwrap();
    // Each session has its own quota; a resync empties it.
    d.insert_sync(&b2, "ns", &hs(0..10)).unwrap();
    assert_eq!(d.resync_sync(&a).unwrap(), 10);
    d.insert_sync(&a, "ns", &hs(20..30)).unwrap();
    // An unregistered node frees its place.
    d.unregister_sync(&b2).unwrap();
    d.heartbeat_sync(&c).unwrap();
}

#[test]
fn the_store_budget_refuses_inserts_and_is_given_back() {
    // Room for a namespace and a few 8-byte-hash entries.
    let entry = ENTRY_OVERHEAD_BYTES + 8;
    let ns_cost = NAMESPACE_OVERHEAD_BYTES + 2;
    let d = with_caps(10, 1_000, ns_cost + 4 * entry + OWNER_BYTES);
    let (a, b) = (
        NodeId::new_session("10.0.0.1:1"),
        NodeId::new_session("10.0.0.2:1"),
    );
    d.heartbeat_sync(&a).unwrap();
    d.heartbeat_sync(&b).unwrap();
    d.insert_sync(&a, "ns", &hs(0..4)).unwrap();
    assert_eq!(d.stats().bytes, ns_cost + 4 * entry);
    // A second owner of an entry costs less than a new entry.
    d.insert_sync(&b, "ns", &hs(0..1)).unwrap();
    match d.insert_sync(&b, "ns", &hs(1..2)) {
        Err(DirectoryError::LimitReached { limit, .. }) => assert_eq!(limit, "max_store_bytes"),
        other => panic!("{other:?}"),
    }
    assert!(d.insert_sync(&a, "ns", &hs(4..5)).is_err());
    assert_eq!(d.stats().bytes, ns_cost + 4 * entry + OWNER_BYTES);
    // Removals, unregistering and the sweep give it all back.
    d.remove_sync(&a, "ns", &hs(0..2)).unwrap();
    d.insert_sync(&a, "ns", &hs(8..9)).unwrap();
    d.unregister_sync(&a).unwrap();
    d.unregister_sync(&b).unwrap();
    assert_eq!(d.stats().bytes, ns_cost);
    d.sweep();
    let s = d.stats();
    assert_eq!((s.entries, s.owners, s.bytes), (0, 0, 0));
}

#[test]
fn addresses_and_namespaces_are_given_back() {
    let d = dir();
    for i in 0..5_000u32 {
        let n = NodeId::new_session(format!("10.1.{}.{}:1", i / 256, i % 256));
        d.heartbeat_sync(&n).unwrap();
        d.insert_sync(&n, &format!("ns-{i}"), &hs(0..2)).unwrap();
        d.unregister_sync(&n).unwrap();
    }
    assert!(
        d.nodes.read().slots.len() <= 2,
        "{} slots",
        d.nodes.read().slots.len()
    );
    assert_eq!(d.namespaces.read().len(), 5_000);
    d.sweep();
    assert_eq!(d.namespaces.read().len(), 0);
    assert_eq!(d.stats().bytes, 0);
}

#[test]
fn records_left_by_an_earlier_registration_of_a_slot_stay_invisible() {
    let d = dir();
    let a = NodeId::new_session("10.0.0.1:1");
    d.heartbeat_sync(&a).unwrap();
    d.insert_sync(&a, "ns", &hs(0..4)).unwrap();
    // What an insert racing an unregister leaves: the registration ends, its records stay.
    let slot = {
        let mut t = d.nodes.write();
        let (slot, _) = t.current(&a).unwrap();
        t.release(slot);
        slot
    };
    let b = NodeId::new_session("10.0.0.2:1");
    d.heartbeat_sync(&b).unwrap();
    assert_eq!(d.nodes.read().registration(&b.addr).unwrap().0, slot);
    assert!(d.query_sync("ns", &hs(0..4), None).unwrap().is_empty());
    // b inserting one of the hashes takes the stale record over.
    d.insert_sync(&b, "ns", &hs(0..1)).unwrap();
    assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&b, 1)]);
    assert_eq!(
        d.sweep(),
        SweepCounts {
            owners: 3,
            keys: 3,
            nodes: 0
        }
    );
    assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&b, 1)]);
}

#[test]
fn a_plan_is_cut_at_its_segment_limit() {
    let d = dir();
    let (a, b) = (
        NodeId::new_session("10.0.0.1:1"),
        NodeId::new_session("10.0.0.2:1"),
    );
    d.heartbeat_sync(&a).unwrap();
    d.heartbeat_sync(&b).unwrap();
    let key = |i: u32| i.to_le_bytes().to_vec();
    let n = 2 * MAX_PLAN_SEGMENTS as u32 + 10;
    let all: Vec<Vec<u8>> = (0..n).map(key).collect();
    let even: Vec<Vec<u8>> = (0..n).step_by(2).map(key).collect();
    let odd: Vec<Vec<u8>> = (1..n).step_by(2).map(key).collect();
    d.insert_sync(&a, "alt", &even).unwrap();
    d.insert_sync(&b, "alt", &odd).unwrap();
    let plan = d.query_sync("alt", &all, None).unwrap();
    assert_eq!(plan.len(), MAX_PLAN_SEGMENTS);
    assert!(plan.iter().all(|s| s.prefix_len == 1));
    assert_eq!(plan[0], p(&a, 1));
    assert_eq!(plan[1], p(&b, 1));
    // Short of the limit, the plan is whole.
    let plan = d.query_sync("alt", &all[..100], None).unwrap();
    assert_eq!(plan.len(), 100);
}
