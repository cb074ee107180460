//! Cross-crate integration tests: the conformance suites (host pools, key-addressed tiers,
//! transports, registrars, directories) and the end-to-end harness.

pub mod directory_suite;
pub mod harness;
pub mod pool_suite;
pub mod redis;
pub mod registrar_suite;
pub mod tier_suite;
pub mod transport_suite;

/// How a test that cannot run here says so (counted as skipped by `scripts/test.sh`, not as
/// passed): re-exported for the crates that already take this one as a dev-dependency.
pub use pegaflow_test_skip::{skip, skip_part};

/// The path of example `name` of the crate whose test is running (cargo puts test binaries in
/// `target/<profile>/deps/` and examples in `target/<profile>/examples/`).
///
/// # Panics
/// When the example is not built (`cargo test` of the crate, or `cargo build --all-targets`,
/// builds it).
pub fn example_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let p = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("target/<profile>/deps/<test>")
        .join("examples")
        .join(name);
    assert!(
        p.exists(),
        "{} missing: `cargo test` builds the crate's examples",
        p.display()
    );
    p
}
