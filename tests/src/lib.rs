//! Cross-crate integration tests: the tier conformance suite and the end-to-end harness.

pub mod harness;
pub mod tier_suite;
