//! The transport conformance suite (`pegaflow_tests::transport_suite`) instantiated for the
//! in-tree host transport `memcpy` (built through the plugin registry, as the server builds
//! it) and for `memcpy` under the runtime's `fault` and `metrics` layers (wrapped through
//! `wrap_transport`, as a pipeline's `layers = [...]` does). The examples' `memcpy-verify`
//! is instantiated in `examples/tests/`, the `cuda` transport in `transports/cuda/tests/`.

use std::sync::Arc;

use pegaflow_plugin::wrap_transport;
use pegaflow_plugin::{transport_factory, RuntimeContext, Transport};
use pegaflow_tests::transport_suite::TransportMaker;
// Links the shm backend's `inventory` registrations into this test binary.
use pegaflow_transport_shm as _;

/// Builds a transport from its `[[transport]]` settings, through the registry.
fn build(kind: &str, settings: &str) -> Arc<dyn Transport> {
    let table: toml::Table = toml::from_str(settings).expect("valid settings");
    let factory = transport_factory(kind).expect("transport kind is linked");
    (factory.build)(&table, &RuntimeContext::default()).expect("transport builds")
}

/// `memcpy` wrapped in `layers` (a TOML array, innermost first).
fn layered(layers: &str) -> Arc<dyn Transport> {
    let list: toml::Table = toml::from_str(&format!("layers = {layers}")).expect("valid layers");
    let list = list["layers"].as_array().expect("an array").clone();
    let t = wrap_transport(
        build("memcpy", ""),
        &list,
        &pegaflow_plugin::MetricsRegistry::new(),
    )
    .expect("layers wrap memcpy");
    assert_eq!(t.kind(), "memcpy", "layers keep the wrapped kind");
    t
}

mod memcpy {
    use super::*;

    fn make() -> Arc<dyn Transport> {
        build("memcpy", "")
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}

mod memcpy_threaded {
    use super::*;

    /// Every batch of 1 MiB or more goes through the multi-threaded split.
    fn make() -> Arc<dyn Transport> {
        build("memcpy", "threads = 4\nparallel_threshold = \"1mb\"")
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}

mod memcpy_fault_layer {
    use super::*;

    /// The `fault` layer with nothing armed: a pass-through (the suite arms its own
    /// `FaultyTransport` for the failure cases).
    fn make() -> Arc<dyn Transport> {
        layered(r#"["fault"]"#)
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}

mod memcpy_metrics_layer {
    use super::*;

    fn make() -> Arc<dyn Transport> {
        layered(r#"["metrics"]"#)
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}

mod memcpy_fault_and_metrics_layers {
    use super::*;

    fn make() -> Arc<dyn Transport> {
        layered(r#"[{ kind = "fault", fail_every = 0 }, "metrics"]"#)
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}
