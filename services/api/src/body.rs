//! Reading a request body within bounds: the one rule the REST facade and
//! the portal's forms share. The declared length is judged before a byte is
//! read (a caller who declares too much is answered at once, from the
//! header), the body is read with its limit enforced while it streams, and
//! a body that does not arrive in time is given up on, so that a caller who
//! trickles or never finishes cannot hold a connection and its memory.
//! Each surface answers the [`BodyError`] in its own format.

use std::time::Duration;

use axum::{
    body::Body,
    http::{HeaderMap, StatusCode, header},
};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};

/// Why a request body was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("Content-Length must be a whole number of bytes")]
    InvalidLength,
    #[error("a request body may be at most {limit} bytes; this one declares {declared}")]
    DeclaredTooLarge { limit: usize, declared: u64 },
    #[error("a request body may be at most {limit} bytes; this one is longer")]
    TooLarge { limit: usize },
    #[error("the request body could not be read (malformed chunked encoding, or cut short)")]
    Unreadable,
    #[error("the request body did not arrive within {} s of its head", .0.as_secs())]
    TooSlow(Duration),
}

impl BodyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidLength | Self::Unreadable => StatusCode::BAD_REQUEST,
            Self::DeclaredTooLarge { .. } | Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TooSlow(_) => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// The machine-readable reason, as the REST facade's error bodies name it.
    pub fn reason(&self) -> relay_domain::Reason {
        use relay_domain::Reason;
        match self {
            Self::InvalidLength => Reason::InvalidContentLength,
            Self::DeclaredTooLarge { .. } | Self::TooLarge { .. } => Reason::BodyTooLarge,
            Self::Unreadable => Reason::UnreadableBody,
            Self::TooSlow(_) => Reason::BodyTimeout,
        }
    }
}

/// The length a request declares, refused when it is no number of bytes or
/// more than `limit`: checked before anything else is done for the request.
pub fn declared_length(headers: &HeaderMap, limit: usize) -> Result<Option<u64>, BodyError> {
    let Some(v) = headers.get(header::CONTENT_LENGTH) else { return Ok(None) };
    let n = v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).ok_or(BodyError::InvalidLength)?;
    if n > limit as u64 {
        return Err(BodyError::DeclaredTooLarge { limit, declared: n });
    }
    Ok(Some(n))
}

/// The whole body, when it is at most `limit` bytes and all of it arrives
/// within `within`.
pub async fn read_bounded(body: Body, limit: usize, within: Duration) -> Result<Bytes, BodyError> {
    match tokio::time::timeout(within, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(BodyError::TooLarge { limit }),
        Ok(Err(_)) => Err(BodyError::Unreadable),
        Err(_) => Err(BodyError::TooSlow(within)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_length(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, v.parse().unwrap());
        h
    }

    #[test]
    fn a_declared_length_is_judged_from_the_header_alone() {
        assert_eq!(declared_length(&HeaderMap::new(), 10), Ok(None));
        assert_eq!(declared_length(&with_length("10"), 10), Ok(Some(10)));
        assert_eq!(
            declared_length(&with_length("10000000000"), 10),
            Err(BodyError::DeclaredTooLarge { limit: 10, declared: 10_000_000_000 })
        );
        for bad in ["-1", "1e3", "ten", "99999999999999999999999"] {
            assert_eq!(declared_length(&with_length(bad), 10), Err(BodyError::InvalidLength), "{bad}");
        }
        assert_eq!(BodyError::DeclaredTooLarge { limit: 1, declared: 2 }.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(BodyError::TooSlow(Duration::from_secs(1)).status(), StatusCode::REQUEST_TIMEOUT);
    }

    #[tokio::test]
    async fn a_body_is_read_within_its_limit_and_its_time() {
        assert_eq!(read_bounded(Body::from("abc"), 3, Duration::from_secs(1)).await, Ok(Bytes::from_static(b"abc")));
        assert_eq!(read_bounded(Body::from("abcd"), 3, Duration::from_secs(1)).await, Err(BodyError::TooLarge { limit: 3 }));
        // A body that never ends.
        let endless = Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>());
        let within = Duration::from_millis(50);
        assert_eq!(read_bounded(endless, 3, within).await, Err(BodyError::TooSlow(within)));
    }
}
