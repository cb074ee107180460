//! The transport conformance suite (`pegaflow_tests::transport_suite`) instantiated for the
//! third-party `memcpy-verify` transport, built through the plugin registry as its server
//! builds it.

use std::sync::Arc;

use pegaflow_plugin::{transport_factory, RuntimeContext, Transport};
use pegaflow_tests::transport_suite::TransportMaker;
// Links the examples' `inventory` registrations into this test binary.
use pegaflow_examples as _;

mod memcpy_verify {
    use super::*;

    fn make() -> Arc<dyn Transport> {
        let f = transport_factory("memcpy-verify").expect("memcpy-verify is linked");
        (f.build)(&toml::Table::new(), &RuntimeContext::default()).expect("memcpy-verify builds")
    }

    pegaflow_tests::transport_conformance_tests!(TransportMaker::host(make));
}
