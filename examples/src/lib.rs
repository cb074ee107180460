//! A third-party backend, written the way an outside crate would: it depends on
//! `pegaflow-runtime` for the traits, registers a factory with `inventory::submit!`, and is
//! linked into its own server binary (`src/bin/pegaflow-server-verify.rs`) — no edit to the
//! runtime.
//!
//! Two backends:
//! - `memcpy-verify`: a host transport that copies like `memcpy` and then reads the
//!   destination back and compares it with the source, failing the batch on any difference.
//!   An operator can run it in staging to rule out the data path when debugging corruption.
//! - `heap-store` ([`heap_store`]): a key-addressed tier below host DRAM in this process's
//!   heap, with its own config struct; `pipelines/two-tier.toml` runs it under `dram`.

pub mod heap_store;

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_plugin::{
    parse_settings, ConfigSchema, CopyBatch, Direction, HostRegion, MemorySpace, OpParts,
    RuntimeContext, Transport, TransportError, TransportFactory,
};
use serde::Deserialize;

/// The `memcpy-verify` transport's settings: none (an empty table is the only valid one).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyingMemcpyConfig {}

/// The verifying host transport.
#[derive(Debug, Default)]
pub struct VerifyingMemcpy;

#[async_trait]
impl Transport for VerifyingMemcpy {
    fn kind(&self) -> &'static str {
        "memcpy-verify"
    }

    fn can_address(&self, space: MemorySpace) -> bool {
        space.is_host()
    }

    fn install_host_memory(&self, _regions: &[HostRegion]) -> Result<(), TransportError> {
        Ok(())
    }

    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError> {
        // Addresses of any other space are not host addresses: never dereference them.
        if !self.can_address(batch.location) {
            return Err(TransportError(format!(
                "the memcpy-verify transport cannot address {} memory",
                batch.location
            )));
        }
        tokio::task::spawn_blocking(move || {
            for op in &batch.ops {
                let (src, dst) = match batch.direction {
                    Direction::ToHost => (op.device_addr as usize, op.host_addr),
                    Direction::ToDevice => (op.host_addr, op.device_addr as usize),
                };
                // SAFETY: the engine validated both ranges against live registrations and
                // host buffers, which it keeps alive until this future completes.
                let equal = unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, op.len);
                    std::slice::from_raw_parts(src as *const u8, op.len)
                        == std::slice::from_raw_parts(dst as *const u8, op.len)
                };
                if !equal {
                    return Err(TransportError(format!(
                        "verification failed: {} bytes at {dst:#x} differ from the source",
                        op.len
                    )));
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| TransportError(format!("copy thread failed: {e}")))?
    }

    /// Gathers the parts and verifies them as one batch.
    async fn copy_parts(&self, batch: CopyBatch, parts: OpParts) -> Result<(), TransportError> {
        let batch = parts.gather(batch).await?;
        self.copy(batch).await
    }
}

fn build(table: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Transport>> {
    let _: VerifyingMemcpyConfig = parse_settings("memcpy-verify transport", table)?;
    Ok(Arc::new(VerifyingMemcpy))
}

inventory::submit! {
    TransportFactory {
        kind: "memcpy-verify",
        summary: "host copies that read the destination back and compare (a third-party example)",
        config: ConfigSchema::NONE,
        flags: &[],
        build,
    }
}
