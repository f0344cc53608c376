//! The one error type every use-case returns. It carries a transport-neutral
//! code, a machine-readable reason and a message for a human; the gRPC layer
//! maps the code to a status and the REST facade maps that status to HTTP.

use std::fmt;

pub use relay_domain::Reason;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    /// Over a limit: retry after this many seconds (at least 1).
    ResourceExhausted {
        retry_after_secs: u64,
    },
    Unavailable,
    Internal,
}

#[derive(thiserror::Error)]
#[error("{message}")]
pub struct AppError {
    pub code: ErrorCode,
    pub reason: Reason,
    pub message: String,
    /// The cause, kept for the logs; never shown to a caller.
    #[source]
    pub source: Option<anyhow::Error>,
}

impl fmt::Debug for AppError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}/{}: {}", self.code, self.reason.as_str(), self.message)?;
        if let Some(src) = &self.source {
            write!(f, ": {src:#}")?;
        }
        Ok(())
    }
}

pub type AppResult<T> = Result<T, AppError>;

impl AppError {
    pub fn new(code: ErrorCode, reason: Reason, message: impl Into<String>) -> Self {
        Self { code, reason, message: message.into(), source: None }
    }

    pub fn invalid(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, reason, message)
    }

    /// The same answer for "never existed" and "belongs to another tenant".
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorCode::NotFound, Reason::NotFound, format!("no such {what}"))
    }

    pub fn precondition(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, reason, message)
    }

    /// Over a limit; `retry_after` is when the same request would pass.
    pub fn exhausted(reason: Reason, message: impl Into<String>, retry_after: std::time::Duration) -> Self {
        let retry_after_secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        Self::new(ErrorCode::ResourceExhausted { retry_after_secs: retry_after_secs.max(1) }, reason, message)
    }

    pub fn internal(source: anyhow::Error) -> Self {
        Self { code: ErrorCode::Internal, reason: Reason::Internal, message: "internal error".into(), source: Some(source) }
    }

    pub fn unavailable(source: anyhow::Error) -> Self {
        Self {
            code: ErrorCode::Unavailable,
            reason: Reason::Unavailable,
            message: "temporarily unavailable; retry".into(),
            source: Some(source),
        }
    }
}

/// Postgres ended the transaction so that a concurrent one could finish
/// (`deadlock_detected`, `serialization_failure`): nothing was written, and
/// the same request run again succeeds.
fn lost_a_conflict(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).is_some_and(|c| c == "40P01" || c == "40001")
}

/// Database errors are internal unless a caller mapped them first; a lost
/// conflict is a retry, not a fault.
impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) => Self::unavailable(anyhow::Error::new(e).context("database")),
            e2 if lost_a_conflict(e2) => Self::unavailable(anyhow::Error::new(e).context("a concurrent change won")),
            _ => Self::internal(anyhow::Error::new(e).context("database")),
        }
    }
}

impl AppError {
    /// The same answer again, for each item of a batch that failed as a
    /// whole (the cause kept as text).
    pub fn for_each(&self) -> Self {
        Self {
            code: self.code,
            reason: self.reason,
            message: self.message.clone(),
            source: self.source.as_ref().map(|s| anyhow::anyhow!("{s:#}")),
        }
    }

    /// Whether the transaction that failed lost a conflict with a concurrent
    /// one and may simply run again.
    pub fn lost_a_conflict(&self) -> bool {
        self.source.as_ref().is_some_and(|s| s.downcast_ref::<sqlx::Error>().is_some_and(lost_a_conflict))
    }
}

impl From<anyhow::Error> for AppError {
    fn from(e: anyhow::Error) -> Self {
        Self::internal(e)
    }
}

/// The longest message an error carries, over gRPC or REST. Messages name
/// the mistake and the number; anything longer is input being echoed, which
/// is cut.
pub const MAX_MESSAGE_CHARS: usize = 300;

/// `message`, cut to [`MAX_MESSAGE_CHARS`] on a character boundary.
pub fn bounded(message: &str) -> String {
    match message.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_owned(),
    }
}

/// How much of a caller's value an error message quotes back.
const QUOTED_CHARS: usize = 64;

/// A caller's value quoted for an error message: Rust-escaped, and cut
/// after [`QUOTED_CHARS`] characters with the full length said, so a
/// message never echoes unbounded input.
pub fn quoted(raw: &str) -> String {
    match raw.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{:?}… ({} bytes)", &raw[..cut], raw.len()),
        None => format!("{raw:?}"),
    }
}

/// Parses an id a caller supplied, with an error naming the field.
pub fn parse_id<Id: From<uuid::Uuid>>(field: &'static str, raw: &str) -> AppResult<Id> {
    uuid::Uuid::parse_str(raw.trim())
        .map(Id::from)
        .map_err(|_| AppError::invalid(Reason::InvalidId, format!("{field} must be a UUID, got {}", quoted(raw))))
}

#[cfg(test)]
mod tests {
    #[test]
    fn quoted_values_are_bounded() {
        assert_eq!(super::quoted("abc"), "\"abc\"");
        let long = "x".repeat(1_000_000);
        let q = super::quoted(&long);
        assert!(q.len() < 100 && q.ends_with("(1000000 bytes)"), "{q}");
    }
}
