//! The engine's error type and its one mapping to gRPC status codes.
//!
//! Codes are chosen with the published Python client in mind (`engine-wire.md` §5):
//! INVALID_ARGUMENT becomes `ValueError`, INTERNAL `PegaflowInternal`, everything else
//! `PegaFlowError`.

/// Why an engine operation was refused or failed. The message goes to the client verbatim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// Malformed or out-of-range input (INVALID_ARGUMENT). Nothing changed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The server is not in the state the request needs: unknown instance, worker or lease,
    /// topology mismatch, version mismatch (FAILED_PRECONDITION). Nothing changed.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A bound was hit: host pool full of pinned blocks, too many leases or instances
    /// (RESOURCE_EXHAUSTED). Nothing changed.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The server failed: an import, a copy, a driver call (INTERNAL).
    #[error("{0}")]
    Internal(String),
}

impl EngineError {
    /// The gRPC status for this error.
    pub fn to_status(&self) -> tonic::Status {
        match self {
            EngineError::InvalidArgument(m) => tonic::Status::invalid_argument(m.clone()),
            EngineError::FailedPrecondition(m) => tonic::Status::failed_precondition(m.clone()),
            EngineError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m.clone()),
            EngineError::Internal(m) => tonic::Status::internal(m.clone()),
        }
    }

    /// Shorthand for [`EngineError::InvalidArgument`].
    pub fn invalid(m: impl Into<String>) -> Self {
        EngineError::InvalidArgument(m.into())
    }

    /// Shorthand for [`EngineError::FailedPrecondition`].
    pub fn precondition(m: impl Into<String>) -> Self {
        EngineError::FailedPrecondition(m.into())
    }

    /// Shorthand for [`EngineError::Internal`].
    pub fn internal(m: impl Into<String>) -> Self {
        EngineError::Internal(m.into())
    }
}

impl From<EngineError> for tonic::Status {
    fn from(e: EngineError) -> Self {
        e.to_status()
    }
}

/// Result alias of the engine.
pub type EngineResult<T> = Result<T, EngineError>;
