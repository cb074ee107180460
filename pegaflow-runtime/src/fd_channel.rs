//! The fd side channel (STUB — being implemented): a Unix socket on which native clients send
//! one descriptor per registration, keyed by `instance_id \0 device_id`.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Bounds of the side channel.
#[derive(Debug, Clone)]
pub struct FdChannelLimits {
    /// Concurrent connection handlers (PegaFlow: 64).
    pub max_connections: usize,
    /// Descriptors received but not yet taken (PegaFlow: 1024).
    pub max_pending: usize,
    /// How long an untaken descriptor is kept (PegaFlow: 60 s).
    pub pending_ttl: Duration,
    /// How long a connection may stay silent before it is closed (PegaFlow: 5 s).
    pub receive_timeout: Duration,
}

impl Default for FdChannelLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_pending: 1024,
            pending_ttl: Duration::from_secs(60),
            receive_timeout: Duration::from_secs(5),
        }
    }
}

/// The side channel.
#[derive(Debug)]
pub struct FdChannel {
    path: PathBuf,
}

impl FdChannel {
    /// Binds the socket at `path` (mode 0600) and starts accepting. Must be called inside a
    /// tokio runtime.
    pub async fn bind(path: &Path, _limits: FdChannelLimits) -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
        }))
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the descriptor sent for `(instance_id, device_id)`, waiting up to `timeout`.
    pub async fn take(&self, _instance_id: &str, _device_id: i32, _timeout: Duration) -> Option<OwnedFd> {
        None
    }

    /// Descriptors received and not yet taken.
    pub fn pending(&self) -> usize {
        0
    }
}
