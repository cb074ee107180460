//! The key-addressed tier conformance suite (`pegaflow_tests::tier_suite`) for the SSD tier,
//! once per I/O engine, on real files, with recovery after a reopen (persistent).

use std::path::Path;
use std::sync::Arc;

use pegaflow_plugin::health::HealthBoard;
use pegaflow_plugin::Tier;
use pegaflow_tier_ssd::{IoChoice, SsdConfig};

fn make(capacity: u64, dir: &Path, io: IoChoice) -> Arc<dyn Tier> {
    let cfg = SsdConfig {
        paths: vec![dir.join("ssd")],
        capacity,
        reserve: 0,
        io,
        write_chunk: 1 << 20,
        io_threads: 2,
        ..SsdConfig::default()
    };
    let t = pegaflow_tier_ssd::open(&cfg, &prometheus::Registry::new(), &HealthBoard::default())
        .expect("open the SSD tier");
    Arc::new(t)
}

mod posix {
    use super::*;
    fn make_posix(c: u64, d: &Path) -> Arc<dyn Tier> {
        make(c, d, IoChoice::Posix)
    }
    pegaflow_tests::block_tier_conformance_tests!(
        pegaflow_tests::tier_suite::TierMaker { make: make_posix },
        persistent
    );
}

mod uring {
    use super::*;
    fn make_uring(c: u64, d: &Path) -> Arc<dyn Tier> {
        // `auto`: io_uring, or posix where the kernel refuses it (the suite then runs twice
        // on posix; the engine in use is checked in tests/ssd.rs).
        make(c, d, IoChoice::Auto)
    }
    pegaflow_tests::block_tier_conformance_tests!(
        pegaflow_tests::tier_suite::TierMaker { make: make_uring },
        persistent
    );
}
