//! The `memory` directory: the shared conformance suite, and the factory that builds it
//! from a pipeline's `[directory]` table.

use std::sync::Arc;
use std::time::Duration;

use pegaflow_directory::memory::MemoryDirectory;
use pegaflow_plugin::{directory_factory, Directory, NodeId, RuntimeContext};
use pegaflow_tests::directory_suite::{
    fields_past_their_bounds_are_invalid, run_all, DirectoryFixture,
};

/// Fresh directories with a 1 s stale interval (the takeover case sleeps past it).
struct Memory;

impl DirectoryFixture for Memory {
    fn open(&self) -> Arc<dyn Directory> {
        Arc::new(MemoryDirectory::with_timing(
            self.stale_after(),
            Duration::from_secs(3600),
            3,
        ))
    }

    fn stale_after(&self) -> Duration {
        Duration::from_secs(1)
    }
}

#[tokio::test]
async fn conformance() {
    run_all(&Memory).await;
    fields_past_their_bounds_are_invalid(&Memory).await;
}

#[tokio::test]
async fn the_factory_builds_a_memory_directory_from_its_table() {
    let f = directory_factory("memory").expect("the memory kind is linked");
    let table: toml::Table = toml::from_str(
        "stale_after_secs = 5\nttl_minutes = 1\nmin_reclaimable_owners = 2\nsweep_interval_secs = 1",
    )
    .unwrap();
    let d = (f.build)(&table, &RuntimeContext::default()).expect("a valid table");
    assert_eq!(d.kind(), "memory");
    let a = NodeId::new_session("10.0.0.1:1");
    assert_eq!(
        d.heartbeat(&a).await.unwrap().stale_after,
        Duration::from_secs(5)
    );
    let bad: toml::Table = toml::from_str("ttl_minutes = 0").unwrap();
    assert!((f.build)(&bad, &RuntimeContext::default()).is_err());
    let unknown: toml::Table = toml::from_str("stale_secs = 3").unwrap();
    assert!((f.build)(&unknown, &RuntimeContext::default()).is_err());
}
