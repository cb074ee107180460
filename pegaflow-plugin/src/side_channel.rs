//! The fd side channel as a registrar sees it: descriptors (memfds, CUDA VMM handles) that a
//! native client sent for a registration, waiting under `(instance_id, device_id)` (and an
//! allocation index for native registration v2) until the registration takes them.
//!
//! The server's channel (the Unix socket, its message format, bounds and expiry) is the
//! `pegaflow-fd-channel` crate; a registrar depends only on this trait, and its tests may use
//! that crate or any implementation of their own.
//!
//! Must never: hand a descriptor to a registration of another key, or keep one that a
//! refused registration sent (a refusal calls [`SideChannel::discard`], so that the client
//! can resend at once).

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;

/// Where native registrations' descriptors arrive.
#[async_trait]
pub trait SideChannel: Send + Sync + 'static {
    /// The socket path clients send to (shown in the Health answer and in messages).
    fn path(&self) -> &Path;
    /// Takes the descriptor of a native registration of `(instance_id, device_id)`, waiting
    /// up to `timeout`. `None` when none arrived in time; an expired descriptor is never
    /// returned.
    async fn take(&self, instance_id: &str, device_id: i32, timeout: Duration) -> Option<OwnedFd>;
    /// Takes the descriptor of allocation `index` of a native registration v2 of
    /// `(instance_id, device_id)`, waiting until `deadline`. `None` when none arrived in time.
    async fn take_allocation(
        &self,
        instance_id: &str,
        device_id: i32,
        index: u32,
        deadline: tokio::time::Instant,
    ) -> Option<OwnedFd>;
    /// Closes every descriptor sent for `(instance_id, device_id)` up to now (any allocation
    /// index, those still on their way included), without waiting; whether one was pending.
    fn discard(&self, instance_id: &str, device_id: i32) -> bool;
}

impl std::fmt::Debug for dyn SideChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideChannel")
            .field("path", &self.path())
            .finish()
    }
}
