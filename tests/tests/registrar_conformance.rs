//! The registrar conformance suite (`pegaflow_tests::registrar_suite`) instantiated for the
//! in-tree `host-memfd` registrar, built through the plugin registry as the server builds it,
//! over a real fd side channel. The CUDA registrars are instantiated in
//! `transports/cuda/tests/`.

use std::sync::Arc;
use std::time::Duration;

use pegaflow_fd_channel::FdChannel;
use pegaflow_plugin::{registrar_factory, Registrar, RuntimeContext};
use pegaflow_tests::registrar_suite::{
    memfd_mappings, no_extra_malformed, read_host, ClientMemory, MemfdClient, RegistrarMaker,
};
// Links the shm backend's `inventory` registrations into this test binary.
use pegaflow_transport_shm as _;

mod host_memfd {
    use super::*;

    fn make(channel: Option<Arc<FdChannel>>, fd_timeout: Duration) -> Arc<dyn Registrar> {
        let mut t = toml::Table::new();
        t.insert(
            "fd_timeout_secs".into(),
            toml::Value::Float(fd_timeout.as_secs_f64()),
        );
        let ctx = RuntimeContext {
            fd_channel: channel.map(|c| c as Arc<dyn pegaflow_plugin::SideChannel>),
            ..RuntimeContext::default()
        };
        let f = registrar_factory("host-memfd").expect("host-memfd is linked");
        (f.build)(&t, &ctx).expect("host-memfd builds")
    }

    fn client(name: &str, _device_id: i32, len: u64) -> Result<Box<dyn ClientMemory>, String> {
        Ok(Box::new(MemfdClient::new(name, len)))
    }

    const MAKER: RegistrarMaker = RegistrarMaker {
        make,
        client,
        read: read_host,
        live_mappings: memfd_mappings,
        device_ids: &[0, 1, 2],
        malformed: no_extra_malformed,
    };

    pegaflow_tests::registrar_conformance_tests!(MAKER);
}
