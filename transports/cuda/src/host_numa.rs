//! NUMA placement: which node a PCI device (a GPU, a NIC) sits on, which CPUs a node has,
//! and the two actions a transport takes with them — steering a host range's pages to a node
//! (`mbind`) and running a thread on a node's CPUs (`sched_setaffinity`).
//!
//! A pinned copy between a GPU and host memory on the other socket crosses the inter-socket
//! link and loses bandwidth; PegaFlow places its pinned pools and copy threads on the GPU's
//! node for that reason, and `--disable-numa-affinity` (its flag) turns the placement off.
//! Here the placement is the transport's: it knows its devices' PCI addresses and the pool's
//! regions, and calls [`NumaPlacement::plan`] before it pins them.
//!
//! Everything is read from sysfs under a root (`/sys` in production, a fake tree in tests):
//! `devices/system/node/online`, `devices/system/node/nodeN/cpulist`,
//! `bus/pci/devices/<bus id>/numa_node`. A machine with one node, a device whose node the
//! kernel does not know (`-1`), or no sysfs leaves placement off, and says why.

use std::io;
use std::path::{Path, PathBuf};

/// Parses a kernel CPU or node list (`"0-3,8,10-11"`) into its members, ascending.
///
/// # Errors
/// A member that is not a number, or a range whose end is below its start.
pub fn parse_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: usize = a
            .parse()
            .map_err(|_| format!("{part:?} is not a list member"))?;
        let b: usize = b
            .parse()
            .map_err(|_| format!("{part:?} is not a list member"))?;
        if b < a {
            return Err(format!("{part:?}: range ends before it starts"));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The machine's NUMA nodes and CPUs, as sysfs describes them.
#[derive(Debug, Clone)]
pub struct Topology {
    root: PathBuf,
    /// Online node ids, ascending (`[0]` where sysfs has no node directory).
    pub nodes: Vec<usize>,
}

impl Topology {
    /// Reads the topology under `root` (`/sys`). A missing node list reads as one node 0.
    pub fn read(root: &Path) -> Self {
        let nodes = std::fs::read_to_string(root.join("devices/system/node/online"))
            .ok()
            .and_then(|s| parse_list(&s).ok())
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| vec![0]);
        Self {
            root: root.to_path_buf(),
            nodes,
        }
    }

    /// The running machine's topology (`/sys`).
    pub fn system() -> Self {
        Self::read(Path::new("/sys"))
    }

    /// The node of the PCI device at `bus_id` (`"0000:3b:00.0"`; CUDA's upper-case form and
    /// NVML's 8-digit domain are accepted). `None`: the kernel does not know (`-1`), the
    /// device is absent, or the id is malformed.
    pub fn pci_node(&self, bus_id: &str) -> Option<usize> {
        let id = normalize_bus_id(bus_id)?;
        let s =
            std::fs::read_to_string(self.root.join("bus/pci/devices").join(id).join("numa_node"))
                .ok()?;
        let n: i64 = s.trim().parse().ok()?;
        usize::try_from(n).ok().filter(|n| self.nodes.contains(n))
    }

    /// The CPUs of `node`, ascending; empty when sysfs does not say.
    pub fn node_cpus(&self, node: usize) -> Vec<usize> {
        std::fs::read_to_string(
            self.root
                .join(format!("devices/system/node/node{node}/cpulist")),
        )
        .ok()
        .and_then(|s| parse_list(&s).ok())
        .unwrap_or_default()
    }
}

/// `"0000:3B:00.0"` or `"00000000:3b:00.0"` → `"0000:3b:00.0"` (sysfs's form).
fn normalize_bus_id(id: &str) -> Option<String> {
    let mut parts = id.trim().splitn(2, ':');
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    let rest = parts.next()?.to_ascii_lowercase();
    let (bus, devfn) = rest.split_once(':')?;
    let (dev, func) = devfn.split_once('.')?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func}"))
}

/// What a transport does about NUMA for the devices it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NumaPlacement {
    /// Nothing, and why (one node, placement disabled, a device of unknown node).
    Off(String),
    /// Host pages preferred on `nodes` (one node: preferred there; several: interleaved
    /// over them), and each device's threads on its own node's CPUs.
    On {
        /// The nodes the pool's pages go to, ascending.
        nodes: Vec<usize>,
        /// Per device (in the order given to [`NumaPlacement::plan`]): its node.
        device_nodes: Vec<usize>,
    },
}

impl NumaPlacement {
    /// Decides placement for devices at `bus_ids` on `topo`. `enabled` false
    /// (`--disable-numa-affinity`), a single-node machine or a device whose node is unknown
    /// turn it off.
    pub fn plan(topo: &Topology, bus_ids: &[String], enabled: bool) -> Self {
        if !enabled {
            return Self::Off("--disable-numa-affinity".into());
        }
        if topo.nodes.len() < 2 {
            return Self::Off("this machine has one NUMA node".into());
        }
        if bus_ids.is_empty() {
            return Self::Off("no device to place for".into());
        }
        let mut device_nodes = Vec::with_capacity(bus_ids.len());
        for id in bus_ids {
            match topo.pci_node(id) {
                Some(n) => device_nodes.push(n),
                None => {
                    return Self::Off(format!(
                        "the kernel reports no NUMA node for device {id} (numa_node -1 or absent)"
                    ))
                }
            }
        }
        let mut nodes = device_nodes.clone();
        nodes.sort_unstable();
        nodes.dedup();
        Self::On {
            nodes,
            device_nodes,
        }
    }
}

const MPOL_PREFERRED: i32 = 1;
const MPOL_INTERLEAVE: i32 = 3;
const MPOL_MF_MOVE: u32 = 1 << 1;

/// Steers the pages of `[addr, addr + len)` to `nodes`: preferred on a single node (the
/// kernel falls back to others when it is full, so a full node never fails an allocation),
/// interleaved over several. Pages already faulted in are moved where the kernel can
/// (`MPOL_MF_MOVE`, best effort). `addr` must be page-aligned.
///
/// # Errors
/// The OS error of `mbind` (EINVAL for an unaligned range or an offline node, EPERM, ENOSYS
/// where the kernel lacks NUMA support).
pub fn prefer_nodes(addr: usize, len: usize, nodes: &[usize]) -> io::Result<()> {
    let Some(&max) = nodes.iter().max() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no node given"));
    };
    const BITS: usize = u64::BITS as usize;
    let mut mask = vec![0u64; max / BITS + 1];
    for &n in nodes {
        mask[n / BITS] |= 1 << (n % BITS);
    }
    let mode = if nodes.len() == 1 {
        MPOL_PREFERRED
    } else {
        MPOL_INTERLEAVE
    };
    // maxnode counts bits, and the kernel reads one less than given.
    let maxnode = (mask.len() * BITS + 1) as libc::c_ulong;
    // SAFETY: mbind only changes the policy of the caller's own range; `mask` outlives the
    // call and holds `maxnode - 1` bits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as libc::c_ulong,
            len as libc::c_ulong,
            mode as libc::c_ulong,
            mask.as_ptr(),
            maxnode,
            MPOL_MF_MOVE as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The memory policy of the page at `addr` and its node mask (nodes 0–63), as
/// `get_mempolicy(MPOL_F_ADDR)` reports it: `(mode, nodes)`; mode 0 is the default policy.
///
/// # Errors
/// The OS error.
pub fn policy_at(addr: usize) -> io::Result<(i32, Vec<usize>)> {
    const MPOL_F_ADDR: libc::c_ulong = 1 << 1;
    let mut mode: libc::c_int = 0;
    let mut mask: u64 = 0;
    // SAFETY: both out-pointers are valid for the call; maxnode 65 covers `mask`'s 64 bits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            &mut mask as *mut u64,
            65 as libc::c_ulong,
            addr as libc::c_ulong,
            MPOL_F_ADDR,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let nodes = (0..64).filter(|n| mask & (1 << n) != 0).collect();
    Ok((mode, nodes))
}

/// Restricts the calling thread to `cpus` (a node's CPUs). An empty list changes nothing.
///
/// # Errors
/// The OS error of `sched_setaffinity` (EINVAL when none of the CPUs is usable, e.g. outside
/// the process's cgroup).
pub fn run_on_cpus(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let cap = std::mem::size_of::<libc::cpu_set_t>() * 8;
    for &c in cpus.iter().filter(|&&c| c < cap) {
        // SAFETY: c is below the set's capacity.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is valid for its size.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sysfs(
        online: &str,
        nodes: &[(usize, &str)],
        devices: &[(&str, &str)],
    ) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let n = d.path().join("devices/system/node");
        std::fs::create_dir_all(&n).unwrap();
        std::fs::write(n.join("online"), online).unwrap();
        for (id, cpus) in nodes {
            let p = n.join(format!("node{id}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("cpulist"), cpus).unwrap();
        }
        for (bus, node) in devices {
            let p = d.path().join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("numa_node"), node).unwrap();
        }
        d
    }

    #[test]
    fn lists_parse_as_the_kernel_writes_them() {
        assert_eq!(
            parse_list("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_list("0").unwrap(), vec![0]);
        assert_eq!(parse_list("").unwrap(), Vec::<usize>::new());
        assert!(parse_list("3-1").is_err());
        assert!(parse_list("a-b").is_err());
    }

    #[test]
    fn bus_ids_in_cuda_and_nvml_form_find_the_sysfs_device() {
        assert_eq!(
            normalize_bus_id("0000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_bus_id("00000000:3b:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(normalize_bus_id("0000:3b:00"), None);
        assert_eq!(
            normalize_bus_id("0000:3b:20.0"),
            None,
            "device numbers stop at 0x1f"
        );
        assert_eq!(normalize_bus_id("../../etc:00:00.0"), None);
    }

    #[test]
    fn two_gpus_on_two_nodes_interleave_and_keep_their_own_node() {
        let d = fake_sysfs(
            "0-1",
            &[(0, "0-7"), (1, "8-15")],
            &[("0000:19:00.0", "0\n"), ("0000:9b:00.0", "1\n")],
        );
        let t = Topology::read(d.path());
        assert_eq!(t.nodes, vec![0, 1]);
        assert_eq!(t.node_cpus(1), (8..16).collect::<Vec<_>>());
        let p = NumaPlacement::plan(
            &t,
            &["0000:9B:00.0".to_string(), "0000:19:00.0".to_string()],
            true,
        );
        assert_eq!(
            p,
            NumaPlacement::On {
                nodes: vec![0, 1],
                device_nodes: vec![1, 0]
            }
        );
        let one = NumaPlacement::plan(&t, &["0000:9b:00.0".to_string()], true);
        assert_eq!(
            one,
            NumaPlacement::On {
                nodes: vec![1],
                device_nodes: vec![1]
            }
        );
    }

    #[test]
    fn placement_is_off_when_disabled_single_node_or_unknown() {
        let d = fake_sysfs(
            "0-1",
            &[(0, "0-7"), (1, "8-15")],
            &[("0000:19:00.0", "-1\n")],
        );
        let t = Topology::read(d.path());
        let gpu = ["0000:19:00.0".to_string()];
        assert!(
            matches!(NumaPlacement::plan(&t, &gpu, false), NumaPlacement::Off(w) if w.contains("disable"))
        );
        assert!(
            matches!(NumaPlacement::plan(&t, &gpu, true), NumaPlacement::Off(w) if w.contains("no NUMA node"))
        );
        let absent = ["0000:20:00.0".to_string()];
        assert!(matches!(
            NumaPlacement::plan(&t, &absent, true),
            NumaPlacement::Off(_)
        ));
        let single = fake_sysfs("0", &[(0, "0-1")], &[("0000:19:00.0", "0\n")]);
        let t = Topology::read(single.path());
        assert!(
            matches!(NumaPlacement::plan(&t, &gpu, true), NumaPlacement::Off(w) if w.contains("one NUMA node"))
        );
        let none = tempfile::tempdir().unwrap();
        assert_eq!(Topology::read(none.path()).nodes, vec![0]);
    }

    #[test]
    fn a_range_preferred_on_node_0_reports_that_policy() {
        // Every Linux machine has node 0; the kernel must record the policy on the range.
        let len = 4 << 20;
        // SAFETY: a fresh anonymous mapping, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let addr = p as usize;
        match prefer_nodes(addr, len, &[0]) {
            Ok(()) => {
                let (mode, nodes) = policy_at(addr + (1 << 20)).unwrap();
                assert_eq!(mode, MPOL_PREFERRED);
                assert_eq!(nodes, vec![0]);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                pegaflow_test_skip::skip_part!("this kernel has no NUMA support (mbind: {e})");
            }
            Err(e) => panic!("mbind on node 0: {e}"),
        }
        assert!(
            prefer_nodes(addr + 1, len - 4096, &[0]).is_err(),
            "unaligned start"
        );
        assert!(prefer_nodes(addr, len, &[]).is_err());
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
    }

    #[test]
    fn a_thread_runs_on_the_cpus_it_was_given() {
        std::thread::spawn(|| {
            // The last CPU this process may use (a cgroup may exclude CPU 0).
            // SAFETY: cpu_set_t is plain data; the call fills it.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            let size = std::mem::size_of::<libc::cpu_set_t>();
            // SAFETY: pid 0 is this thread; `set` is valid for `size`.
            assert_eq!(unsafe { libc::sched_getaffinity(0, size, &mut set) }, 0);
            // SAFETY: reads a bit of the set.
            let cpu = (0..size * 8)
                .rev()
                .find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
                .unwrap();
            run_on_cpus(&[cpu]).unwrap();
            // SAFETY: plain call.
            assert_eq!(unsafe { libc::sched_getcpu() }, cpu as i32);
            assert!(run_on_cpus(&[]).is_ok());
        })
        .join()
        .unwrap();
    }
}
