//! The client SDK's error type.

/// What can go wrong when a native client talks to the server.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The gRPC connection could not be made (bad endpoint, server down).
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// The endpoint the client was given.
        endpoint: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server answered with a non-OK gRPC status.
    #[error("{rpc} failed: {status}")]
    Rpc {
        /// The RPC's name, e.g. `Release`.
        rpc: &'static str,
        /// The status the server returned.
        status: tonic::Status,
    },
    /// The server answered OK but its `ResponseStatus.ok` was false, or the body was malformed.
    #[error("{rpc} rejected by the server: {message}")]
    Rejected {
        /// The RPC's name.
        rpc: &'static str,
        /// The server's message.
        message: String,
    },
    /// A local argument was invalid; nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A system call failed (memfd, mmap, Unix socket).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl ApiError {
    /// The gRPC status code, when the server returned one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ApiError::Rpc { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ApiError::Io {
            what: what.into(),
            source,
        }
    }
}
