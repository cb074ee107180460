//! Fault-injecting wrappers (placeholder; being implemented).
