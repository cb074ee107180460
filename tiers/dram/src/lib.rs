//! `pegaflow-tier-dram`: the host-DRAM landing tier (pipeline kind `dram`).
//!
//! Owns: one anonymous mapping of the configured capacity (`MAP_NORESERVE`, so the kernel
//! commits pages lazily and a 30 GiB pool starts on a machine with less free memory; with
//! `use_hugepages`, reserved huge pages instead, reserved in full at start-up), split
//! into `shards` independently locked sub-pools, and the allocator that hands out
//! [`HostBuffer`]s from it in 512-byte granules. Transports copy straight into these buffers
//! on Save and out of them on Load; the runtime installs its
//! [`HostPool::regions`] into every transport (a CUDA transport pins them).
//!
//! Must never: hand one byte to two live buffers, fail an allocation because of fragmentation
//! (when no single free range fits, several are gathered into one buffer), report a wrong
//! used-byte count, or give memory back to the OS (`trim`) that a live buffer uses. It does
//! not decide what to evict: the engine's block index does, and frees buffers by dropping them.
//!
//! Settings (the `[[tier]]` table, [`DramSettings`]): `capacity` (size string or bytes,
//! default `"30gb"`; `--pool-size`), `shards` (default 1; `--pool-shards`),
//! `transparent_hugepages` (default false) and `use_hugepages` (default false;
//! `--use-hugepages`): what backs the pages (see [`DramSettings`]). Eviction is the
//! tier stack's (exact LRU), not a setting here. It is the default landing tier: a pipeline
//! without `[[tier]]` entries runs it with these defaults.

mod freelist;
mod pool;

use std::sync::Arc;

use anyhow::{bail, Context};
use pegaflow_plugin::{
    defaults_of, parse_settings, BuiltTier, ConfigSchema, FactoryFlag, FlagValue, HostBuffer,
    HostPool, HostRegion, PluginOption, Preflight, PreflightReport, RuntimeContext, Section,
    TierFactory,
};
use serde::{Deserialize, Serialize};

pub use pool::{GRANULE, HUGE_PAGE, TRIM_MIN_EXTENT};

use pool::{footprint, Backing, Pool};

/// Default capacity in bytes: `"30gb"` (30 GiB), PegaFlow's `--pool-size` default.
pub const DEFAULT_CAPACITY: u64 = 30 << 30;

/// Most shards a pool may be split into.
pub const MAX_SHARDS: usize = 4096;

/// A `dram` tier's settings: what its `[[tier]]` table deserialises into (unknown keys are
/// refused; a missing key takes its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DramSettings {
    /// Pool size in bytes (a size string like `"30gb"` or a byte count in the table); rounded
    /// down to [`GRANULE`] when the pool is built.
    #[serde(with = "pegaflow_plugin::units::size")]
    pub capacity: u64,
    /// Independently locked sub-pools (≥ 1); allocations go round-robin with fallback.
    pub shards: usize,
    /// Back the pool with transparent huge pages: align the mapping to 2 MiB and advise
    /// `MADV_HUGEPAGE`, so that the kernel (THP `enabled` of `always` or `madvise`) faults
    /// 2 MiB pages in where it has them; still committed lazily. Fewer pages to pin and to
    /// translate for every copy. Ignored when `use_hugepages` is set.
    pub transparent_hugepages: bool,
    /// Back the pool with reserved huge pages (`MAP_HUGETLB`, `--use-hugepages` as
    /// PegaFlow's flag): the whole capacity, rounded up to 2 MiB, is reserved from the
    /// kernel's huge-page pool (`vm.nr_hugepages`) at start-up, which fails when it has
    /// fewer free huge pages than that.
    pub use_hugepages: bool,
}

impl Default for DramSettings {
    fn default() -> Self {
        Self {
            capacity: DEFAULT_CAPACITY,
            shards: 1,
            transparent_hugepages: false,
            use_hugepages: false,
        }
    }
}

impl DramSettings {
    /// Reads the settings from a pipeline `[[tier]]` table (a `kind` key is ignored).
    ///
    /// # Errors
    /// An unknown key (the message lists the valid keys; eviction is the tier stack's, exact
    /// LRU, not a dram setting), a malformed `capacity`, or a `shards` that is not a
    /// non-negative integer (0 and too many shards are refused by [`DramTier::new`]).
    pub fn from_table(table: &toml::Table) -> anyhow::Result<Self> {
        if table.contains_key("eviction") {
            bail!(
                "dram tier: eviction is not a dram setting: the tier stack evicts in exact LRU order \
                 (for frequency-based admission, add the \"admission\" layer to a lower tier)"
            );
        }
        parse_settings("dram tier", table)
    }

    /// What backs the pool: reserved huge pages win over transparent ones.
    fn backing(&self) -> Backing {
        match (self.use_hugepages, self.transparent_hugepages) {
            (true, _) => Backing::Reserved,
            (false, true) => Backing::Transparent,
            (false, false) => Backing::Base,
        }
    }

    /// The capacity rounded down to whole [`GRANULE`]s, once the ranges hold.
    ///
    /// # Errors
    /// A capacity below one granule (after rounding down) or beyond the address space, and
    /// `shards` of 0, above [`MAX_SHARDS`] or above the number of granules.
    pub fn checked_capacity(&self) -> anyhow::Result<usize> {
        let capacity = usize::try_from(self.capacity)
            .ok()
            .map(|c| c / GRANULE * GRANULE)
            .filter(|&c| c > 0)
            .with_context(|| {
                format!(
                    "dram tier: capacity {} must be at least {GRANULE} bytes and fit the address space",
                    describe_bytes(self.capacity)
                )
            })?;
        let granules = capacity / GRANULE;
        if self.shards == 0 || self.shards > MAX_SHARDS || self.shards > granules {
            bail!(
                "dram tier: shards = {} is out of range: it must be between 1 and {} for a capacity of {}",
                self.shards,
                MAX_SHARDS.min(granules),
                describe_bytes(capacity as u64)
            );
        }
        Ok(capacity)
    }
}

/// The `dram` factory's settings check: [`DramSettings::from_table`] and the ranges of
/// [`DramSettings::checked_capacity`], without mapping anything.
fn check(_what: &str, table: &toml::Table) -> anyhow::Result<()> {
    DramSettings::from_table(table)?
        .checked_capacity()
        .map(drop)
}

/// A number of `/sys/kernel/mm/hugepages/hugepages-2048kB/` (`free_hugepages`,
/// `nr_hugepages`, `nr_overcommit_hugepages`); `None` where it cannot be read (no 2 MiB
/// hugetlb pages in this kernel).
fn huge_pages_2m(file: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{file}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `--check-config`'s start-up check of a `dram` tier: the reserved huge pages
/// `use_hugepages` needs (start-up's `MAP_HUGETLB` fails without them), and the capacity
/// against the machine's memory (start-up's WARN).
fn preflight(what: &str, table: &toml::Table, r: &mut PreflightReport) {
    let Ok(settings) = DramSettings::from_table(table) else {
        return;
    };
    let Ok(capacity) = settings.checked_capacity() else {
        return;
    };
    if settings.use_hugepages {
        let needed = capacity.div_ceil(HUGE_PAGE) as u64;
        match (
            huge_pages_2m("free_hugepages"),
            huge_pages_2m("nr_hugepages"),
            huge_pages_2m("nr_overcommit_hugepages"),
        ) {
            (Some(free), _, _) if free >= needed => r.pass(format!(
                "{what}: use_hugepages needs {needed} free 2 MiB huge pages; the kernel has {free}"
            )),
            (Some(free), nr, Some(surplus)) if surplus > 0 => r.warn(format!(
                "{what}: use_hugepages needs {needed} free 2 MiB huge pages; the kernel has {free} reserved (vm.nr_hugepages = {}) and may hand out up to {surplus} surplus ones (vm.nr_overcommit_hugepages): start-up fails if it cannot",
                nr.unwrap_or(0)
            )),
            (Some(free), nr, _) => r.fail(format!(
                "{what}: use_hugepages needs {needed} free 2 MiB huge pages for {}; the kernel has {free} (vm.nr_hugepages = {}): raise vm.nr_hugepages, or drop use_hugepages (--use-hugepages)",
                describe_bytes(capacity as u64),
                nr.unwrap_or(0)
            )),
            (None, _, _) => r.fail(format!(
                "{what}: use_hugepages needs 2 MiB hugetlb pages, and this kernel has none (/sys/kernel/mm/hugepages/hugepages-2048kB is missing); drop use_hugepages (--use-hugepages)"
            )),
        }
    } else {
        r.pass(format!(
            "{what}: {} of address space, committed as it is used",
            describe_bytes(capacity as u64)
        ));
    }
    if let Some(total) = physical_memory() {
        if capacity as u64 > total {
            r.warn(format!(
                "{what}: capacity {} exceeds this machine's physical memory {}: start-up works (the pool is committed lazily), but filling it will swap or meet the OOM killer",
                describe_bytes(capacity as u64),
                describe_bytes(total)
            ));
        }
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes; `None` where it cannot be read.
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn describe_bytes(n: u64) -> String {
    format!("{n} bytes ({:.2} GiB)", n as f64 / (1u64 << 30) as f64)
}

/// The host-DRAM landing tier. Cheap to share behind an `Arc`; every method is thread-safe.
#[derive(Debug)]
pub struct DramTier {
    pool: Arc<Pool>,
    settings: DramSettings,
}

impl DramTier {
    /// Maps the pool described by `settings`. Nothing is committed until buffers are written.
    ///
    /// # Errors
    /// A capacity below one [`GRANULE`] (after rounding down) or beyond the address space,
    /// `shards` of 0, above [`MAX_SHARDS`] or above the number of granules, and a failed
    /// `mmap` (with the OS error).
    pub fn new(settings: DramSettings) -> anyhow::Result<Self> {
        let capacity = settings.checked_capacity()?;
        let backing = settings.backing();
        let pool = Pool::new(capacity, settings.shards, backing).with_context(|| match backing {
            Backing::Reserved => format!(
                "dram tier: cannot map {} of reserved 2 MiB huge pages (mmap with MAP_HUGETLB): \
                 ENOMEM means the kernel has fewer free ones than that \
                 (/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages; raise vm.nr_hugepages), \
                 EINVAL a kernel without 2 MiB hugetlb pages; or drop use_hugepages (--use-hugepages)",
                describe_bytes(capacity.next_multiple_of(HUGE_PAGE) as u64)
            ),
            Backing::Base | Backing::Transparent => format!(
                "dram tier: cannot reserve {} of address space (anonymous mmap with MAP_NORESERVE); \
                 check `ulimit -v` and vm.overcommit_memory, or lower the capacity",
                // Transparent huge pages map one more huge page, to align the pool.
                describe_bytes(
                    (capacity + if backing == Backing::Transparent { HUGE_PAGE } else { 0 }) as u64
                )
            ),
        })?;
        tracing::info!(
            capacity_bytes = capacity,
            shards = settings.shards,
            pages = match pool.pages() {
                Backing::Base => "base",
                Backing::Transparent => "transparent huge (MADV_HUGEPAGE)",
                Backing::Reserved => "reserved huge (MAP_HUGETLB)",
            },
            "dram tier mapped{}",
            if pool.pages() == Backing::Reserved {
                ""
            } else {
                " (committed lazily)"
            }
        );
        if let Some(total) = physical_memory() {
            if capacity as u64 > total {
                tracing::warn!(
                    capacity_bytes = capacity,
                    mem_total_bytes = total,
                    "dram tier capacity {} exceeds this machine's physical memory {}: the pool is committed lazily, so start-up works, but filling it will swap or meet the OOM killer; lower --pool-size (capacity)",
                    describe_bytes(capacity as u64),
                    describe_bytes(total)
                );
            }
        }
        Ok(Self {
            pool: Arc::new(pool),
            settings,
        })
    }

    /// A tier of `capacity` bytes with default settings otherwise.
    ///
    /// # Errors
    /// As [`DramTier::new`].
    pub fn with_capacity(capacity: u64) -> anyhow::Result<Self> {
        Self::new(DramSettings {
            capacity,
            ..DramSettings::default()
        })
    }

    /// The settings the tier was built with (`capacity` as configured, not rounded).
    pub fn settings(&self) -> DramSettings {
        self.settings
    }

    /// One buffer of `len` bytes (as [`HostPool::allocate_batch`] with one entry and no
    /// alignment constraint).
    pub fn allocate(&self, len: usize) -> Option<HostBuffer> {
        self.pool.allocate_batch(&[len])?.pop()
    }

    /// `(address, length)` of the pool's one mapping.
    pub fn backing_range(&self) -> (usize, usize) {
        self.pool.backing()
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.pool.shard_count()
    }

    /// Free bytes of each shard (a snapshot).
    pub fn free_bytes_per_shard(&self) -> Vec<usize> {
        self.pool.free_per_shard()
    }

    /// Number of free ranges of each shard (a snapshot); 1 per shard when nothing is allocated.
    pub fn free_extents_per_shard(&self) -> Vec<usize> {
        self.pool.free_extents_per_shard()
    }

    /// Length in bytes of the largest free range of any shard: the largest allocation that
    /// is served as one contiguous extent.
    pub fn largest_free_extent(&self) -> usize {
        self.pool.largest_free()
    }

    /// Returns free ranges of at least [`TRIM_MIN_EXTENT`] bytes to the OS
    /// (`MADV_DONTNEED`); they read as zeros when next used. Returns the bytes advised.
    pub fn trim_free_memory(&self) -> u64 {
        self.pool.trim()
    }
}

impl HostPool for DramTier {
    fn kind(&self) -> &'static str {
        "dram"
    }

    fn metric_label(&self) -> &'static str {
        "ram"
    }

    fn capacity_bytes(&self) -> u64 {
        self.pool.capacity() as u64
    }

    fn used_bytes(&self) -> u64 {
        self.pool.used() as u64
    }

    fn free_bytes(&self) -> u64 {
        (self.pool.capacity() as u64).saturating_sub(self.pool.used() as u64)
    }

    fn footprint_bytes(&self, len: usize) -> u64 {
        footprint(len).map_or(u64::MAX, |f| f as u64)
    }

    fn allocate_batch(&self, lens: &[usize], align: usize) -> Option<Vec<HostBuffer>> {
        if !align.is_power_of_two() {
            return None;
        }
        if align <= GRANULE {
            self.pool.allocate_batch(lens)
        } else {
            self.pool.allocate_aligned(lens, align)
        }
    }

    fn regions(&self) -> Vec<HostRegion> {
        let (addr, len) = self.pool.backing();
        vec![HostRegion {
            addr,
            len,
            owner: self.pool.clone(),
        }]
    }

    fn trim(&self) {
        let advised = self.pool.trim();
        tracing::debug!(advised_bytes = advised, "dram tier trimmed");
    }
}

/// The `dram` factory's constructor: [`DramSettings::from_table`] then [`DramTier::new`].
///
/// # Errors
/// As those two.
pub fn build(table: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<BuiltTier> {
    let settings = DramSettings::from_table(table)?;
    Ok(BuiltTier::Landing(Arc::new(DramTier::new(settings)?)))
}

inventory::submit! {
    TierFactory {
        kind: "dram",
        summary: "host-DRAM landing tier: one lazily committed anonymous mapping, 512-byte granules, sharded allocator",
        config: ConfigSchema {
            defaults: defaults_of::<DramSettings>,
            check,
            options: &[
                PluginOption {
                    name: "capacity",
                    help: "pool size: a size string (\"30gb\", \"512mib\") or bytes; rounded down to 512 bytes, committed as it is used",
                },
                PluginOption {
                    name: "shards",
                    help: "independently locked sub-pools, used round-robin with fallback",
                },
                PluginOption {
                    name: "transparent_hugepages",
                    help: "align the pool to 2 MiB and advise MADV_HUGEPAGE (transparent huge pages where the kernel has them); committed lazily",
                },
                PluginOption {
                    name: "use_hugepages",
                    help: "back the pool with reserved huge pages (MAP_HUGETLB), reserved in full at start-up from vm.nr_hugepages",
                },
            ],
        },
        flags: &[
            FactoryFlag {
                long: "pool-size",
                value_name: "SIZE",
                help: "Host-DRAM tier capacity; units kb, mb, gb, tb (binary). [default: 30gb]",
                setting: "capacity",
                value: FlagValue::Size,
                adds_entry: false,
            },
            FactoryFlag {
                long: "pool-shards",
                value_name: "N",
                help: "Sub-pools of the DRAM tier, used round-robin. [default: 1]",
                setting: "shards",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
            FactoryFlag {
                long: "use-hugepages",
                value_name: "BOOL",
                help: "Back the DRAM tier with reserved 2 MiB huge pages (MAP_HUGETLB, from vm.nr_hugepages), reserved in full at start-up. [default: false]",
                setting: "use_hugepages",
                value: FlagValue::Bool,
                adds_entry: false,
            },
        ],
        default_landing: true,
        build,
    }
}

inventory::submit! {
    Preflight {
        section: Section::Tier,
        kind: "dram",
        check: preflight,
    }
}

#[cfg(test)]
mod tests;
