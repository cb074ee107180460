//! Cross-crate integration tests: shared harness.
