//! The cross-node directory conformance suite: written once against the runtime's
//! [`Directory`] contract, run for every backend (in-memory, Redis, the MetaServer client over
//! our `pegaflow-metaserver` and over PegaFlow's).
//!
//! Owns: generic checks of what the contract promises — session ownership of an address,
//! takeover only after the holder went stale, owner-checked removal, the greedy cover plan of
//! a prefix query, unregister and resync forgetting a session's entries, namespaces kept apart, large
//! batches.
//!
//! Must never: depend on a backend's kind or on counts a backend may not know (the
//! `unregister`/`resync` return values are only checked to be answered), or share state
//! between cases (every case asks the fixture for a fresh directory and uses its own
//! namespaces and node addresses).

use std::sync::Arc;
use std::time::Duration;

use pegaflow_plugin::{Directory, DirectoryError, NodeId, NodePrefix};

/// What the suite needs from a backend's test.
pub trait DirectoryFixture: Sync {
    /// A directory over a fresh, empty key space (backends may share one server process).
    fn open(&self) -> Arc<dyn Directory>;
    /// The stale interval the fixture's directories were built with (keep it short, 1–3 s:
    /// the takeover case sleeps past it).
    fn stale_after(&self) -> Duration;
}

fn h(i: u32) -> Vec<u8> {
    let mut v = b"conformance-hash-".to_vec();
    v.extend_from_slice(&i.to_be_bytes());
    v
}

fn hashes(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    r.map(h).collect()
}

fn node(port: u16) -> NodeId {
    NodeId::new_session(format!("10.9.8.7:{port}"))
}

/// The expected cover plan: segments in order.
fn prefixes(v: &[(&NodeId, u32)]) -> Vec<NodePrefix> {
    v.iter()
        .map(|(n, l)| NodePrefix {
            node: n.addr.clone(),
            prefix_len: *l,
        })
        .collect()
}

/// Runs every case, each on a fresh directory, panicking with the case's name on the first
/// failure.
pub async fn run_all(f: &dyn DirectoryFixture) {
    first_heartbeat_reports_lost_state(f).await;
    insert_then_query_reports_the_contiguous_prefix(f).await;
    prefix_stops_at_the_first_hash_nobody_holds(f).await;
    the_plan_takes_the_longest_run_at_each_position(f).await;
    namespaces_are_separate(f).await;
    insert_and_remove_need_the_session(f).await;
    removal_is_owner_checked(f).await;
    unregister_forgets_the_session(f).await;
    resync_forgets_entries_but_keeps_the_node(f).await;
    an_excluded_node_holds_nothing(f).await;
    empty_query_is_invalid(f).await;
    large_batches_are_accepted(f).await;
    reclaimable_needs_enough_live_owners(f).await;
    takeover_only_after_the_holder_is_stale(f).await;
}

/// The storage server's field bounds (not part of PegaFlow's contract: its MetaServer
/// stores whatever it gets, so [`run_all`] leaves this out; backends of this repository run
/// it): an oversized or empty field is `Invalid`, and nothing is stored.
pub async fn fields_past_their_bounds_are_invalid(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1020);
    d.heartbeat(&a).await.expect("heartbeat");
    let invalid = |r: Result<(), DirectoryError>, what: &str| match r {
        Err(DirectoryError::Invalid(m)) => assert!(m.contains(what), "{what}: {m}"),
        other => panic!("{what}: {other:?}"),
    };
    invalid(
        d.heartbeat(&NodeId::new_session("n".repeat(257)))
            .await
            .map(drop),
        "node",
    );
    invalid(
        d.insert(&a, &"n".repeat(1025), &hashes(0..1))
            .await
            .map(drop),
        "namespace",
    );
    invalid(
        d.insert(&a, "ns-bounds", &[h(0), vec![]]).await.map(drop),
        "block_hashes",
    );
    invalid(
        d.insert(&a, "ns-bounds", &[vec![1; 1025]]).await.map(drop),
        "block_hashes",
    );
    invalid(
        d.remove(&a, "ns-bounds", &[vec![]]).await.map(drop),
        "block_hashes",
    );
    invalid(
        d.query_prefix("ns-bounds", &hashes(0..1), Some(&"x".repeat(257)))
            .await
            .map(drop),
        "exclude_node",
    );
    assert!(
        d.query_prefix("ns-bounds", &[h(0)], None)
            .await
            .expect("query")
            .is_empty(),
        "nothing of a refused insert is stored"
    );
    // The bounds themselves are accepted.
    d.insert(&a, "ns-bounds", &[vec![1; 1024], vec![2]])
        .await
        .expect("a 1 KiB hash");
    d.heartbeat(&NodeId::new_session("n".repeat(256)))
        .await
        .expect("a 256-byte address");
}

/// The first heartbeat of a session says the directory had nothing of it; the next does not.
pub async fn first_heartbeat_reports_lost_state(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1001);
    let first = d.heartbeat(&a).await.expect("first heartbeat");
    assert!(
        first.state_lost,
        "a new session has no state in the directory"
    );
    assert!(
        first.stale_after > Duration::ZERO,
        "stale_after must be positive"
    );
    let second = d.heartbeat(&a).await.expect("second heartbeat");
    assert!(!second.state_lost, "a refresh keeps the session's state");
}

/// One node, one batch: the query reports how many leading hashes it holds.
pub async fn insert_then_query_reports_the_contiguous_prefix(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1002);
    d.heartbeat(&a).await.unwrap();
    let got = d.insert(&a, "ns-prefix", &hashes(0..8)).await.unwrap();
    assert_eq!(got.inserted, 8, "every hash of the batch is owned");
    assert_eq!(
        d.query_prefix("ns-prefix", &hashes(0..8), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 8)])
    );
    // A longer request: the prefix is what is held.
    assert_eq!(
        d.query_prefix("ns-prefix", &hashes(0..20), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 8)])
    );
    // Re-inserting is idempotent.
    d.insert(&a, "ns-prefix", &hashes(0..4)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-prefix", &hashes(0..8), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 8)])
    );
    // A request starting with an unknown hash finds nothing.
    assert!(d
        .query_prefix("ns-prefix", &hashes(100..104), None)
        .await
        .unwrap()
        .is_empty());
}

/// A gap ends the prefix even when later hashes are held.
pub async fn prefix_stops_at_the_first_hash_nobody_holds(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1003);
    d.heartbeat(&a).await.unwrap();
    let mut held = hashes(0..3);
    held.extend(hashes(4..10));
    d.insert(&a, "ns-gap", &held).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-gap", &hashes(0..10), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 3)])
    );
}

/// The plan is greedy: at each position the node with the longest run there takes it (ties
/// go to the smallest address), then the walk continues where that run ends; a node may
/// serve several segments.
pub async fn the_plan_takes_the_longest_run_at_each_position(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b, c) = (node(1004), node(1005), node(1006));
    for n in [&a, &b, &c] {
        d.heartbeat(n).await.unwrap();
    }
    // One node covers all: the shorter runs of the others do not show.
    d.insert(&a, "ns-multi", &hashes(0..10)).await.unwrap();
    d.insert(&b, "ns-multi", &hashes(0..4)).await.unwrap();
    d.insert(&c, "ns-multi", &hashes(5..10)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-multi", &hashes(0..10), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 10)])
    );
    // Overlapping runs: a takes 0..5, b continues from 5 to the end of its run (9).
    d.insert(&a, "ns-overlap", &hashes(0..5)).await.unwrap();
    d.insert(&b, "ns-overlap", &hashes(2..9)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-overlap", &hashes(0..10), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 5), (&b, 4)])
    );
    // Alternating holders: a, b, a again.
    d.insert(&a, "ns-alt", &hashes(0..3)).await.unwrap();
    d.insert(&a, "ns-alt", &hashes(5..8)).await.unwrap();
    d.insert(&b, "ns-alt", &hashes(3..5)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-alt", &hashes(0..10), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 3), (&b, 2), (&a, 3)])
    );
    // A tie goes to the smallest address, whatever the insertion order.
    d.insert(&c, "ns-tie", &hashes(0..4)).await.unwrap();
    d.insert(&b, "ns-tie", &hashes(0..4)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-tie", &hashes(0..4), None).await.unwrap(),
        prefixes(&[(&b, 4)])
    );
}

/// A hash inserted in one namespace is not found in another.
pub async fn namespaces_are_separate(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1007);
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns-one", &hashes(0..4)).await.unwrap();
    assert!(d
        .query_prefix("ns-two", &hashes(0..4), None)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        d.query_prefix("ns-one", &hashes(0..4), None).await.unwrap(),
        prefixes(&[(&a, 4)])
    );
}

/// Without a heartbeat (or with a session that does not hold the address), inserts and
/// removals are refused and change nothing.
pub async fn insert_and_remove_need_the_session(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1008);
    match d.insert(&a, "ns-session", &hashes(0..2)).await {
        Err(DirectoryError::UnknownNode(_)) => {}
        other => panic!("insert before any heartbeat: want UnknownNode, got {other:?}"),
    }
    assert!(d
        .query_prefix("ns-session", &hashes(0..2), None)
        .await
        .unwrap()
        .is_empty());
    d.heartbeat(&a).await.unwrap();
    d.insert(&a, "ns-session", &hashes(0..2)).await.unwrap();
    // Another session for the same address, while a is live.
    let impostor = NodeId::new_session(a.addr.clone());
    assert!(
        matches!(
            d.insert(&impostor, "ns-session", &hashes(2..4)).await,
            Err(DirectoryError::UnknownNode(_) | DirectoryError::SessionConflict(_))
        ),
        "an insert under a session that does not hold the address is refused"
    );
    assert!(
        matches!(
            d.remove(&impostor, "ns-session", &hashes(0..2)).await,
            Err(DirectoryError::UnknownNode(_) | DirectoryError::SessionConflict(_))
        ),
        "a removal under a session that does not hold the address is refused"
    );
    assert_eq!(
        d.query_prefix("ns-session", &hashes(0..4), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 2)])
    );
}

/// A node removes only its own ownership; the other owners stay visible.
pub async fn removal_is_owner_checked(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b) = (node(1009), node(1010));
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&b).await.unwrap();
    d.insert(&a, "ns-remove", &hashes(0..6)).await.unwrap();
    d.insert(&b, "ns-remove", &hashes(0..3)).await.unwrap();
    // b removes hashes it holds and some it never held.
    let removed = d.remove(&b, "ns-remove", &hashes(0..6)).await.unwrap();
    assert_eq!(removed, 3, "only b's own entries count as removed");
    assert_eq!(
        d.query_prefix("ns-remove", &hashes(0..6), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 6)])
    );
    // a removes the middle: its prefix ends there.
    assert_eq!(d.remove(&a, "ns-remove", &[h(2)]).await.unwrap(), 1);
    assert_eq!(
        d.query_prefix("ns-remove", &hashes(0..6), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 2)])
    );
    // Removing again removes nothing.
    assert_eq!(d.remove(&a, "ns-remove", &[h(2)]).await.unwrap(), 0);
}

/// Unregister forgets the node and its entries; the session must heartbeat again to insert.
pub async fn unregister_forgets_the_session(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b) = (node(1011), node(1012));
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&b).await.unwrap();
    d.insert(&a, "ns-unreg", &hashes(0..4)).await.unwrap();
    d.insert(&b, "ns-unreg", &hashes(0..2)).await.unwrap();
    d.unregister(&a).await.expect("unregister a live session");
    assert_eq!(
        d.query_prefix("ns-unreg", &hashes(0..4), None)
            .await
            .unwrap(),
        prefixes(&[(&b, 2)])
    );
    assert!(
        matches!(
            d.insert(&a, "ns-unreg", &hashes(0..1)).await,
            Err(DirectoryError::UnknownNode(_))
        ),
        "an unregistered session cannot insert"
    );
    assert!(
        matches!(d.unregister(&a).await, Err(DirectoryError::UnknownNode(_))),
        "unregistering twice names the session unknown"
    );
    // The same process registers again: a fresh start, nothing of its old entries.
    let again = d.heartbeat(&a).await.unwrap();
    assert!(again.state_lost);
    assert_eq!(
        d.query_prefix("ns-unreg", &hashes(0..4), None)
            .await
            .unwrap(),
        prefixes(&[(&b, 2)])
    );
}

/// Resync hides every entry of the session at once; the node stays registered and inserts
/// again without a new heartbeat.
pub async fn resync_forgets_entries_but_keeps_the_node(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b) = (node(1013), node(1014));
    d.heartbeat(&a).await.unwrap();
    d.heartbeat(&b).await.unwrap();
    d.insert(&a, "ns-resync", &hashes(0..5)).await.unwrap();
    d.insert(&a, "ns-resync-2", &hashes(0..5)).await.unwrap();
    d.insert(&b, "ns-resync", &hashes(0..1)).await.unwrap();
    d.resync(&a).await.expect("resync a live session");
    assert_eq!(
        d.query_prefix("ns-resync", &hashes(0..5), None)
            .await
            .unwrap(),
        prefixes(&[(&b, 1)])
    );
    assert!(d
        .query_prefix("ns-resync-2", &hashes(0..5), None)
        .await
        .unwrap()
        .is_empty());
    d.insert(&a, "ns-resync", &hashes(0..2)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-resync", &hashes(0..5), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 2)])
    );
    // Removing one of the forgotten entries removes nothing.
    assert_eq!(d.remove(&a, "ns-resync-2", &hashes(0..5)).await.unwrap(), 0);
}

/// With `exclude`, that address counts as holding nothing: the plan goes to the others and
/// stops where they stop; excluding an unknown address changes nothing.
pub async fn an_excluded_node_holds_nothing(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b, c) = (node(1020), node(1021), node(1022));
    for n in [&a, &b, &c] {
        d.heartbeat(n).await.unwrap();
    }
    d.insert(&a, "ns-exclude", &hashes(0..6)).await.unwrap();
    d.insert(&b, "ns-exclude", &hashes(0..2)).await.unwrap();
    d.insert(&c, "ns-exclude", &hashes(2..4)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-exclude", &hashes(0..6), None)
            .await
            .unwrap(),
        prefixes(&[(&a, 6)])
    );
    assert_eq!(
        d.query_prefix("ns-exclude", &hashes(0..6), Some(&a.addr))
            .await
            .unwrap(),
        prefixes(&[(&b, 2), (&c, 2)])
    );
    assert_eq!(
        d.query_prefix("ns-exclude", &hashes(0..6), Some("10.255.255.1:9"))
            .await
            .unwrap(),
        prefixes(&[(&a, 6)])
    );
    assert!(d
        .query_prefix("ns-exclude", &hashes(2..6), Some(&c.addr))
        .await
        .unwrap()
        .iter()
        .all(|p| p.node == a.addr));
}

/// A query without hashes is a malformed request.
pub async fn empty_query_is_invalid(f: &dyn DirectoryFixture) {
    let d = f.open();
    assert!(matches!(
        d.query_prefix("ns-empty", &[], None).await,
        Err(DirectoryError::Invalid(_))
    ));
}

/// 40,000 hashes in one call (more than any backend's per-RPC or per-script limit): all
/// stored, a query over the whole run counts them all.
pub async fn large_batches_are_accepted(f: &dyn DirectoryFixture) {
    let d = f.open();
    let a = node(1015);
    d.heartbeat(&a).await.unwrap();
    let all = hashes(0..40_000);
    let got = d.insert(&a, "ns-large", &all).await.unwrap();
    assert_eq!(got.inserted, 40_000);
    assert_eq!(
        d.query_prefix("ns-large", &all, None).await.unwrap(),
        prefixes(&[(&a, 40_000)])
    );
    assert_eq!(
        d.remove(&a, "ns-large", &all[20_000..]).await.unwrap(),
        20_000
    );
    assert_eq!(
        d.query_prefix("ns-large", &all, None).await.unwrap(),
        prefixes(&[(&a, 20_000)])
    );
}

/// A hash becomes reclaimable for the owner that brings its live owners to 3 (the default
/// threshold, PegaFlow's `--min-reclaimable-owner-count`), not before.
pub async fn reclaimable_needs_enough_live_owners(f: &dyn DirectoryFixture) {
    let d = f.open();
    let (a, b, c) = (node(1016), node(1017), node(1018));
    for n in [&a, &b, &c] {
        d.heartbeat(n).await.unwrap();
    }
    assert!(d
        .insert(&a, "ns-reclaim", &hashes(0..2))
        .await
        .unwrap()
        .reclaimable
        .is_empty());
    assert!(d
        .insert(&b, "ns-reclaim", &hashes(0..2))
        .await
        .unwrap()
        .reclaimable
        .is_empty());
    let mut third = d
        .insert(&c, "ns-reclaim", &hashes(0..3))
        .await
        .unwrap()
        .reclaimable;
    third.sort();
    assert_eq!(third, hashes(0..2), "the two hashes with three owners");
}

/// Another session takes an address over only once the holder has been silent for the
/// stale interval; the holder's entries are then invisible.
pub async fn takeover_only_after_the_holder_is_stale(f: &dyn DirectoryFixture) {
    let d = f.open();
    let old = node(1019);
    let new = NodeId::new_session(old.addr.clone());
    let answer = d.heartbeat(&old).await.unwrap();
    assert_eq!(answer.stale_after, f.stale_after());
    d.insert(&old, "ns-takeover", &hashes(0..3)).await.unwrap();
    match d.heartbeat(&new).await {
        Err(DirectoryError::SessionConflict(_)) => {}
        other => panic!("takeover of a live session: want SessionConflict, got {other:?}"),
    }
    // The live holder is untouched by the refused takeover.
    assert_eq!(
        d.query_prefix("ns-takeover", &hashes(0..3), None)
            .await
            .unwrap(),
        prefixes(&[(&old, 3)])
    );
    tokio::time::sleep(f.stale_after() + Duration::from_millis(600)).await;
    assert!(
        d.query_prefix("ns-takeover", &hashes(0..3), None)
            .await
            .unwrap()
            .is_empty(),
        "a stale node is hidden from queries"
    );
    let took = d.heartbeat(&new).await.expect("takeover after stale");
    assert!(took.state_lost);
    assert!(
        d.query_prefix("ns-takeover", &hashes(0..3), None)
            .await
            .unwrap()
            .is_empty(),
        "the old session's entries do not come back with the new session"
    );
    assert!(
        matches!(
            d.insert(&old, "ns-takeover", &hashes(0..1)).await,
            Err(DirectoryError::UnknownNode(_) | DirectoryError::SessionConflict(_))
        ),
        "the old session lost the address"
    );
    d.insert(&new, "ns-takeover", &hashes(0..1)).await.unwrap();
    assert_eq!(
        d.query_prefix("ns-takeover", &hashes(0..3), None)
            .await
            .unwrap(),
        prefixes(&[(&new, 1)])
    );
}
