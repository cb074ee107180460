//! NUMA placement for the `cuda` transport: which nodes the landing tier's pages go to before
//! they are pinned, and which CPUs each device's copy threads run on (decided once, at build,
//! from the runtime's topology; `--disable-numa-affinity` turns it off).
//!
//! Owns: the plan and applying it (`mbind` of the host regions, CPU affinity of a thread).
//! Must never: fail the transport: a placement that cannot be applied is logged and the
//! kernel's default placement stays.

use std::collections::HashMap;

use pegaflow_plugin::HostRegion;

use crate::driver::Driver;

/// What the transport does about NUMA: the pool's pages go to `placement`'s nodes (before
/// they are pinned), and each device's copy threads run on its node's CPUs.
#[derive(Debug, Default)]
pub(super) struct Numa {
    /// The node set the pool's pages are steered to; empty: placement is off.
    pub(super) nodes: Vec<usize>,
    /// CPUs per served device ordinal (absent: no affinity).
    pub(super) cpus: HashMap<i32, Vec<usize>>,
}

impl Numa {
    /// Decides placement for the served devices and logs what it decided.
    pub(super) fn plan(driver: &Driver, served: &[i32], enabled: bool) -> Self {
        let topo = crate::host_numa::Topology::system();
        let devices: Vec<_> = served.iter().filter_map(|&o| driver.device(o)).collect();
        let ids: Vec<String> = devices.iter().map(|d| d.pci_bus_id.clone()).collect();
        match crate::host_numa::NumaPlacement::plan(&topo, &ids, enabled) {
            crate::host_numa::NumaPlacement::Off(why) => {
                tracing::info!("cuda transport: no NUMA placement: {why}");
                Self::default()
            }
            crate::host_numa::NumaPlacement::On {
                nodes,
                device_nodes,
            } => {
                let cpus: HashMap<i32, Vec<usize>> = devices
                    .iter()
                    .zip(&device_nodes)
                    .map(|(d, &n)| (d.ordinal, topo.node_cpus(n)))
                    .collect();
                tracing::info!(
                    pool_nodes = ?nodes,
                    devices = ?devices
                        .iter()
                        .zip(&device_nodes)
                        .map(|(d, n)| format!("GPU {} ({}) on node {n}", d.ordinal, d.pci_bus_id))
                        .collect::<Vec<_>>(),
                    "cuda transport: pinned pool {} and each GPU's copy threads on its node's CPUs (--disable-numa-affinity turns this off)",
                    if nodes.len() == 1 { "preferred on that node" } else { "interleaved over the GPUs' nodes" }
                );
                Self { nodes, cpus }
            }
        }
    }

    /// Steers `regions`' pages to the planned nodes (before they are pinned: pinning faults
    /// them in). A failure is logged and leaves the kernel's default placement.
    pub(super) fn place(&self, regions: &[HostRegion]) {
        if self.nodes.is_empty() {
            return;
        }
        for r in regions {
            let (addr, len) = r.range();
            if let Err(e) = crate::host_numa::prefer_nodes(addr, len, &self.nodes) {
                tracing::warn!(
                    addr,
                    len,
                    "cuda transport: cannot steer host memory to NUMA nodes {:?} (mbind: {e}); the kernel's default placement stays",
                    self.nodes
                );
            }
        }
    }

    /// The CPUs of all planned nodes (for the pin threads, which serve every device).
    pub(super) fn all_cpus(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.cpus.values().flatten().copied().collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Runs the calling thread on `cpus` (a device's NUMA node), logging a failure.
pub(super) fn run_on_node(what: &str, cpus: &[usize]) {
    if let Err(e) = crate::host_numa::run_on_cpus(cpus) {
        tracing::warn!("{what}: cannot run on the GPU's NUMA node CPUs: {e}");
    }
}
