//! The REST port's HTTP server: hyper with its limits set deliberately, the
//! request head checked before anything is routed, and hyper's own answers
//! to unparseable requests given the same JSON error body as every other.
//! (The portal shares the port: a head refused on one of its paths is its
//! page; hyper's own answers, made before any path is read, stay JSON.)

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use anyhow::Result;
use axum::{Router, extract::Request, http::StatusCode, response::Response};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use relay_domain::Reason;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};
use tonic::Code;
use tower::ServiceExt;

use super::errors::{error_json, error_response};

/// The longest request target answered by the facade; longer ones get 414.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// The most header fields, and their total size, a request may carry; 431 beyond.
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// hyper's own parser limits, set well above ours so that almost every
/// oversized head reaches the checks above and gets a JSON answer. Beyond
/// these (a head over 256 KiB, a target over 64 KiB) hyper answers itself,
/// and [`JsonErrors`] rewrites that answer.
const PARSER_BUF_BYTES: usize = 256 * 1024;
const PARSER_MAX_HEADERS: usize = 256;
/// A client has this long to send a request head (slow-loris protection).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for requests in progress.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` completes.
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) -> Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // A client may close its side once its request is sent and still
        // wait for the answer; without this hyper would drop the request.
        .half_close(true)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(PARSER_BUF_BYTES)
        .max_headers(PARSER_MAX_HEADERS);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, say: pause rather than spin.
                    tracing::warn!(error = %e, "accepting a REST connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let router = router.clone();
        let service = TowerToHyperService::new(tower::service_fn(move |req: Request<hyper::body::Incoming>| {
            let router = router.clone();
            async move { Ok::<_, std::convert::Infallible>(checked_head(router, req.map(axum::body::Body::new)).await) }
        }));
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(JsonErrors::new(tcp)), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    Ok(())
}

/// The request head's limits, answered before routing: in JSON, or as the
/// portal's page for a path of the portal's.
async fn checked_head(router: Router, req: Request) -> Response {
    let refuse = |status: StatusCode, reason: Reason, message: &str| {
        if crate::portal::owns(req.uri().path()) {
            crate::portal::refusal(status, message)
        } else {
            error_response(status, Code::InvalidArgument, reason, message)
        }
    };
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target > MAX_URI_BYTES {
        return refuse(
            StatusCode::URI_TOO_LONG,
            Reason::UriTooLong,
            &format!("the request target may be at most {MAX_URI_BYTES} bytes; this one is {target}"),
        );
    }
    let count = req.headers().len();
    let bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    if count > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return refuse(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Reason::HeadersTooLarge,
            &format!(
                "a request may carry at most {MAX_HEADERS} header fields and {MAX_HEADER_BYTES} bytes of them; this one has {count} fields, {bytes} bytes"
            ),
        );
    }
    router.oneshot(req).await.unwrap_or_else(|never| match never {})
}

/// The status line, reason and message for one of hyper's automatic
/// answers, by its status code.
fn automatic_answer(status: &[u8]) -> Option<(&'static str, Reason, String)> {
    Some(match status {
        b"400" => ("400 Bad Request", Reason::MalformedRequest, "the request could not be parsed as HTTP/1.1".to_owned()),
        b"414" => (
            "414 URI Too Long",
            Reason::UriTooLong,
            format!("the request target is longer than the server parses (at most {MAX_URI_BYTES} bytes are accepted)"),
        ),
        b"431" => (
            "431 Request Header Fields Too Large",
            Reason::HeadersTooLarge,
            format!(
                "the request head is larger than the server parses (at most {MAX_HEADERS} header fields and {MAX_HEADER_BYTES} bytes of them are accepted)"
            ),
        ),
        _ => return None,
    })
}

/// If `buf` is the head of one of hyper's automatic error answers (a parse
/// error status, no content type: every answer of ours has one), the JSON
/// answer to send instead.
fn rewrite(buf: &[u8]) -> Option<Vec<u8>> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ").or_else(|| buf.strip_prefix(b"HTTP/1.0 "))?;
    let (line, reason, message) = automatic_answer(rest.get(..3)?)?;
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head_text = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    if head_text.contains("\r\ncontent-type:") {
        return None;
    }
    let body = error_json(Code::InvalidArgument, reason, &message);
    Some(
        format!("HTTP/1.1 {line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
            .into_bytes(),
    )
}

/// A connection whose outgoing bytes are watched for hyper's automatic
/// answers to requests it could not parse (which carry no body and cannot be
/// configured), so that those too are JSON errors. hyper closes the
/// connection after such an answer, so nothing follows the replacement.
struct JsonErrors {
    tcp: TcpStream,
    /// A replacement being written, and how much of it is out; reported to
    /// hyper as its own bytes written once all of it is.
    replacing: Option<(Vec<u8>, usize)>,
}

impl JsonErrors {
    fn new(tcp: TcpStream) -> Self {
        Self { tcp, replacing: None }
    }
}

impl AsyncRead for JsonErrors {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for JsonErrors {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.replacing.is_none()
            && let Some(replacement) = rewrite(buf)
        {
            self.replacing = Some((replacement, 0));
        }
        let this = &mut *self;
        match &mut this.replacing {
            None => Pin::new(&mut this.tcp).poll_write(cx, buf),
            Some((replacement, written)) => {
                while *written < replacement.len() {
                    let n = ready!(Pin::new(&mut this.tcp).poll_write(cx, &replacement[*written..]))?;
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                    }
                    *written += n;
                }
                Poll::Ready(Ok(buf.len()))
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    // Not vectored: hyper then hands over each answer's head in one
    // contiguous buffer, where it can be recognised.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_automatic_answers_are_rewritten_and_ours_are_not() {
        let auto = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 30 Nov 2026 17:00:00 GMT\r\n\r\n";
        let out = String::from_utf8(rewrite(auto).expect("rewritten")).unwrap();
        assert!(out.starts_with("HTTP/1.1 431 "), "{out}");
        let body: serde_json::Value = serde_json::from_str(out.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["reason"], "headers_too_large");
        assert_eq!(body["code"], 3);
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert!(rewrite(ours).is_none());
        assert!(rewrite(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(rewrite(b"{\"code\": 3}").is_none());
    }
}
