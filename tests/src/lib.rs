//! Cross-crate integration tests: shared harness.

pub mod tier_suite;
