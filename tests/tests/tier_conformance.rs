//! The tier conformance suite (`pegaflow_tests::tier_suite`) instantiated for each in-tree
//! tier: the `dram` tier as the default pipeline builds it, and a sharded one (which also
//! exercises cross-shard fallback). Tiers are built through the plugin registry, as the
//! server builds them.

use std::sync::Arc;

use pegaflow_runtime::config::PipelineConfig;
use pegaflow_runtime::{tier_factory, RuntimeContext, Tier};
// Links the dram tier's `inventory` registration into this test binary.
use pegaflow_tier_dram as _;

/// Builds a tier from a `[[tier]]` TOML entry, through the registry.
fn build_tier(entry: &str) -> Arc<dyn Tier> {
    let pipeline =
        PipelineConfig::from_toml(&format!("[[tier]]\n{entry}\n")).expect("valid pipeline");
    let tier = &pipeline.tiers[0];
    let factory = tier_factory(&tier.kind).expect("tier kind is linked");
    (factory.build)(&tier.settings, &RuntimeContext::default()).expect("tier builds")
}

mod dram {
    use super::*;

    fn make(capacity_bytes: u64) -> Arc<dyn Tier> {
        build_tier(&format!("kind = \"dram\"\ncapacity = {capacity_bytes}"))
    }

    pegaflow_tests::tier_conformance_tests!(make);
}

mod dram_sharded {
    use super::*;

    fn make(capacity_bytes: u64) -> Arc<dyn Tier> {
        build_tier(&format!(
            "kind = \"dram\"\ncapacity = {capacity_bytes}\nshards = 4"
        ))
    }

    pegaflow_tests::tier_conformance_tests!(make);
}
