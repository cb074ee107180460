//! The key-addressed tier conformance suite (`pegaflow_tests::tier_suite`) instantiated for
//! the examples' `heap-store` tier, built through the plugin registry as the server builds
//! it, alone and under each of the runtime's layers (`metrics`, `fault` with nothing armed,
//! `admission` is not here: it refuses first sightings by design, which the suite's
//! put-then-get cases do not model).

use std::path::Path;
use std::sync::Arc;

use pegaflow_plugin::layers::AdmissionMetrics;
use pegaflow_plugin::MetricsRegistry;
use pegaflow_plugin::{tier_factory, BuiltTier, RuntimeContext, Tier};
use pegaflow_runtime::config::PipelineConfig;
use pegaflow_tests::tier_suite::TierMaker;

use pegaflow_examples as _;

/// Builds the tier of a `[[tier]]` TOML entry (with its layers) through the registry.
fn build(entry: &str) -> Arc<dyn Tier> {
    let p = PipelineConfig::from_toml(&format!("[[tier]]\n{entry}\n")).expect("pipeline");
    let t = &p.tiers[0];
    let f = tier_factory(&t.kind).expect("kind linked");
    let tier = match (f.build)(&t.settings, &RuntimeContext::default()).expect("builds") {
        BuiltTier::Block(t) => t,
        BuiltTier::Landing(_) => panic!("{} is a landing pool", t.kind),
    };
    pegaflow_plugin::wrap_tier(tier, &t.layers, &MetricsRegistry::new()).expect("layers apply")
}

mod heap_store {
    use super::*;

    fn make(capacity: u64, _dir: &Path) -> Arc<dyn Tier> {
        build(&format!("kind = \"heap-store\"\ncapacity = {capacity}"))
    }

    pegaflow_tests::block_tier_conformance_tests!(TierMaker { make });
}

mod heap_store_no_eviction {
    use super::*;

    fn make(capacity: u64, _dir: &Path) -> Arc<dyn Tier> {
        build(&format!(
            "kind = \"heap-store\"\ncapacity = {capacity}\nevict = false"
        ))
    }

    pegaflow_tests::block_tier_conformance_tests!(TierMaker { make });
}

mod heap_store_with_layers {
    use super::*;

    fn make(capacity: u64, _dir: &Path) -> Arc<dyn Tier> {
        build(&format!(
            "kind = \"heap-store\"\ncapacity = {capacity}\nlayers = [\"metrics\", {{ kind = \"fault\" }}, \"metrics\"]"
        ))
    }

    pegaflow_tests::block_tier_conformance_tests!(TierMaker { make });
}

/// The `admission` layer writes a block only on its second sighting: the first put is
/// refused as not admitted (nothing stored), a lookup that misses counts as a sighting, and
/// the next put is admitted.
#[tokio::test]
async fn admission_layer_admits_on_the_second_sighting() {
    use pegaflow_plugin::TierError;
    use pegaflow_tests::tier_suite::{block, key};
    let metrics = MetricsRegistry::new();
    let p = PipelineConfig::from_toml(
        "[[tier]]\nkind = \"heap-store\"\ncapacity = \"4mb\"\nlayers = [\"admission\"]\n",
    )
    .unwrap();
    let t = &p.tiers[0];
    let BuiltTier::Block(inner) =
        (tier_factory(&t.kind).unwrap().build)(&t.settings, &RuntimeContext::default()).unwrap()
    else {
        panic!("block tier")
    };
    let tier = pegaflow_plugin::wrap_tier(inner.clone(), &t.layers, &metrics).unwrap();
    let put = |id| pegaflow_plugin::TierPut {
        key: key("ns", id),
        block: block(id, &[1024]),
    };
    let r = tier.put(vec![put(1)]).await;
    assert!(
        matches!(&r[0], Err(TierError::Full(m)) if m.contains("not admitted")),
        "{r:?}"
    );
    assert!(inner.lookup(&[key("ns", 1)]).await.unwrap().is_empty());
    assert_eq!(AdmissionMetrics::of(&metrics).rejections.get(), 1);
    tier.put(vec![put(1)]).await[0].clone().unwrap();
    assert_eq!(tier.lookup(&[key("ns", 1)]).await.unwrap().len(), 1);
    // A missed lookup is a sighting: the first put after it is admitted.
    assert!(tier.lookup(&[key("ns", 2)]).await.unwrap().is_empty());
    tier.put(vec![put(2)]).await[0].clone().unwrap();
    assert_eq!(AdmissionMetrics::of(&metrics).rejections.get(), 1);
}
