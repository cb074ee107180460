//! Cross-crate integration tests: the conformance suites (host pools, key-addressed tiers,
//! transports, registrars, directories) and the end-to-end harness.

pub mod directory_suite;
pub mod harness;
pub mod pool_suite;
pub mod redis;
pub mod registrar_suite;
pub mod tier_suite;
pub mod transport_suite;
