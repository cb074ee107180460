//! The host-pool conformance suite (`pegaflow_tests::pool_suite`) instantiated for each
//! in-tree landing pool: the `dram` tier as the default pipeline builds it, and a sharded one (which also
//! exercises cross-shard fallback). Tiers are built through the plugin registry, as the
//! server builds them.

use std::sync::Arc;

use pegaflow_plugin::{tier_factory, BuiltTier, HostPool, RuntimeContext};
use pegaflow_runtime::config::PipelineConfig;
// Links the dram tier's `inventory` registration into this test binary.
use pegaflow_tier_dram as _;

/// Builds a tier from a `[[tier]]` TOML entry, through the registry.
fn build_tier(entry: &str) -> Arc<dyn HostPool> {
    let pipeline =
        PipelineConfig::from_toml(&format!("[[tier]]\n{entry}\n")).expect("valid pipeline");
    let tier = &pipeline.tiers[0];
    let factory = tier_factory(&tier.kind).expect("tier kind is linked");
    match (factory.build)(&tier.settings, &RuntimeContext::default()).expect("tier builds") {
        BuiltTier::Landing(p) => p,
        BuiltTier::Block(_) => panic!("{} is not a landing pool", tier.kind),
    }
}

mod dram {
    use super::*;

    fn make(capacity_bytes: u64) -> Arc<dyn HostPool> {
        build_tier(&format!("kind = \"dram\"\ncapacity = {capacity_bytes}"))
    }

    pegaflow_tests::pool_conformance_tests!(make);
}

mod dram_sharded {
    use super::*;

    fn make(capacity_bytes: u64) -> Arc<dyn HostPool> {
        build_tier(&format!(
            "kind = \"dram\"\ncapacity = {capacity_bytes}\nshards = 4"
        ))
    }

    pegaflow_tests::pool_conformance_tests!(make);
}
