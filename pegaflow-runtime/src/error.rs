//! The engine's error type and its one mapping to gRPC status codes.
//!
//! Codes are chosen with the published Python client in mind (`engine-wire.md` §5):
//! INVALID_ARGUMENT becomes `ValueError`, INTERNAL `PegaflowInternal`, everything else
//! `PegaFlowError`.
//!
//! Also owns how client-supplied strings appear in messages ([`echo`]: a short prefix and the
//! length) and the cap on any status message ([`MAX_STATUS_MESSAGE_BYTES`]): a status travels
//! in an HTTP/2 header block, and one past the peer's header limit resets the stream or, from
//! about 256 KB, closes the client's whole connection (and with it its Session).

/// Longest status message the server sends, in bytes; a longer one is cut, marked with
/// `…(cut, N bytes)`. Far below h2's default 16 KiB header-list limit.
pub const MAX_STATUS_MESSAGE_BYTES: usize = 1024;

pub use pegaflow_api::echo::{echo, Echo, ECHO_PREFIX_CHARS};

/// `m` cut to at most [`MAX_STATUS_MESSAGE_BYTES`] (at a character boundary), the cut marked.
pub fn cap_message(m: &str) -> std::borrow::Cow<'_, str> {
    if m.len() <= MAX_STATUS_MESSAGE_BYTES {
        return m.into();
    }
    let mark = format!("…(cut, {} bytes)", m.len());
    let mut end = MAX_STATUS_MESSAGE_BYTES - mark.len();
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{mark}", &m[..end]).into()
}

/// `s` with its message capped ([`cap_message`]); code and details kept.
pub fn capped_status(s: tonic::Status) -> tonic::Status {
    if s.message().len() <= MAX_STATUS_MESSAGE_BYTES {
        return s;
    }
    let m = cap_message(s.message()).into_owned();
    tonic::Status::with_details_and_metadata(
        s.code(),
        m,
        s.details().to_vec().into(),
        s.metadata().clone(),
    )
}

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
    /// The gRPC status for this error, its message capped at [`MAX_STATUS_MESSAGE_BYTES`].
    pub fn to_status(&self) -> tonic::Status {
        let (code, m) = match self {
            EngineError::InvalidArgument(m) => (tonic::Code::InvalidArgument, m),
            EngineError::FailedPrecondition(m) => (tonic::Code::FailedPrecondition, m),
            EngineError::ResourceExhausted(m) => (tonic::Code::ResourceExhausted, m),
            EngineError::Internal(m) => (tonic::Code::Internal, m),
        };
        tonic::Status::new(code, cap_message(m).into_owned())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_shows_short_values_whole_and_long_ones_as_a_prefix() {
        assert_eq!(echo("inst-1").to_string(), "inst-1");
        assert_eq!(format!("{:?}", echo("a b")), "\"a b\"");
        let long = "é".repeat(100);
        let shown = echo(&long).to_string();
        assert_eq!(
            shown,
            format!("{}…(200 bytes)", "é".repeat(ECHO_PREFIX_CHARS))
        );
        assert_eq!(
            echo(&"x".repeat(ECHO_PREFIX_CHARS)).to_string().len(),
            ECHO_PREFIX_CHARS
        );
        assert!(format!("{:?}", echo(&long)).ends_with("\"…(200 bytes)"));
    }

    #[test]
    fn status_messages_are_capped() {
        let m = "ü".repeat(5000);
        let s = EngineError::invalid(m).to_status();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(
            s.message().len() <= MAX_STATUS_MESSAGE_BYTES,
            "{}",
            s.message().len()
        );
        assert!(s.message().ends_with("…(cut, 10000 bytes)"));
        let s = capped_status(tonic::Status::not_found("n".repeat(1 << 20)));
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert!(s.message().len() <= MAX_STATUS_MESSAGE_BYTES);
        let short = tonic::Status::internal("short");
        assert_eq!(capped_status(short).message(), "short");
    }
}
