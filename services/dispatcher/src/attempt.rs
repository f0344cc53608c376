//! One attempt: sign the stored body, POST it, classify what came back.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use relay_contracts::relay::dispatch::v1::{MaterialResponse, OutcomeRequest, SignatureScheme};
use relay_signing::{Scheme, SigningSecret, signed_headers};
use url::Host;

use crate::http_client::Sender;

/// How much of a response body the attempt log keeps.
const KEEP_BODY: usize = relay_contracts::RESPONSE_BODY_KEPT_BYTES;

/// Sends one attempt and returns the outcome to report. Never fails: every
/// way a customer's side can go wrong is an outcome, not an error.
pub async fn send(sender: &Sender, material: MaterialResponse) -> OutcomeRequest {
    let started = Instant::now();
    let mut outcome = OutcomeRequest {
        delivery_id: material.delivery_id.clone(),
        attempt: material.attempt,
        generation: material.generation,
        signature_scheme: material.signature_scheme,
        ..Default::default()
    };
    match post(sender, material).await {
        Ok(Answer { status, body, retry_after }) => {
            outcome.http_status = Some(u32::from(status));
            outcome.response_body = body;
            outcome.retry_after_ms = retry_after.map(|d| d.as_millis().min(u128::from(u64::MAX)) as u64);
        }
        Err(error) => outcome.error = error,
    }
    outcome.latency_ms = started.elapsed().as_millis() as u64;
    outcome
}

/// What the receiver answered.
struct Answer {
    status: u16,
    body: Vec<u8>,
    /// Its `Retry-After`, on the statuses that ask the sender to wait.
    retry_after: Option<Duration>,
}

/// The longest a lane waits on a receiver's word before its next request:
/// the delivery itself waits as long as asked (up to an hour, the api's
/// rule), but a lane holding other deliveries' claims tries again sooner.
pub const MAX_BACK_PRESSURE: Duration = Duration::from_secs(60);
/// The wait after a 429 that does not say how long.
const DEFAULT_BACK_PRESSURE: Duration = Duration::from_secs(1);

/// How long the endpoint's lane waits before its next request after this
/// outcome: a 429 (as long as `Retry-After` asks, else a second), or a 503
/// with `Retry-After`, is the receiver asking to be sent less. `None`: go on.
pub fn back_pressure(outcome: &OutcomeRequest) -> Option<Duration> {
    let asked = outcome.retry_after_ms.map(Duration::from_millis);
    match outcome.http_status {
        Some(429) => Some(asked.unwrap_or(DEFAULT_BACK_PRESSURE).min(MAX_BACK_PRESSURE)),
        Some(503) => asked.map(|d| d.min(MAX_BACK_PRESSURE)),
        _ => None,
    }
}

/// `Retry-After` on a 429 or 503: seconds, or an HTTP date (a date already
/// past is no wait at all). Anything unreadable is ignored, as if absent.
pub fn retry_after(status: u16, headers: &reqwest::header::HeaderMap, now: std::time::SystemTime) -> Option<Duration> {
    if status != 429 && status != 503 {
        return None;
    }
    let value = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

async fn post(sender: &Sender, m: MaterialResponse) -> Result<Answer, String> {
    let policy = &sender.policy;
    // The rules again, at send time: the URL may predate a rule, and an address
    // literal never reaches the resolver that checks names.
    let url = policy.check_url(&m.url).map_err(|e| format!("blocked: {e}"))?;
    match url.host() {
        Some(Host::Ipv4(v4)) if !policy.permits(IpAddr::V4(v4)) => return Err(format!("blocked: {v4} is not a permitted address")),
        Some(Host::Ipv6(v6)) if !policy.permits(IpAddr::V6(v6)) => return Err(format!("blocked: {v6} is not a permitted address")),
        Some(Host::Domain(name)) if sender.via_proxy => {
            let ips = sender.resolver.lookup(name).await.map_err(|e| format!("dns: {name}: {e}"))?;
            policy.check_addresses(name, &ips).map_err(|e| format!("blocked: {e}"))?;
        }
        _ => {}
    }
    let scheme = scheme_of(m.signature_scheme)
        .ok_or_else(|| format!("signing: signature scheme {} is newer than this dispatcher", m.signature_scheme))?;
    let secrets: Vec<SigningSecret> = m.secrets.into_iter().map(SigningSecret::new).collect();
    let timestamp = chrono_free_unix_now().to_string();
    // The event id is the message id under every scheme: stable across
    // attempts and replays, so a receiver deduplicates on it.
    let [id, ts, signature] = signed_headers(scheme, &secrets, &m.event_id, &timestamp, &m.payload)
        .map_err(|e| format!("signing: the endpoint's {scheme} key cannot sign: {e}"))?;
    drop(secrets);
    let client = sender.client_for(&m.client_identity_pem, &m.ca_bundle)?;
    let mut request = client.post(url);
    // The endpoint's own headers; the api refused any name Relay sets below
    // (or the connection frames), so none doubles a signature header.
    for (name, value) in &m.headers {
        let name =
            reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("headers: {name:?} is not a header name"))?;
        let value = reqwest::header::HeaderValue::from_str(value).map_err(|_| format!("headers: the value of {name} is not sendable"))?;
        request = request.header(name, value);
    }
    let response = request
        .header("content-type", "application/json")
        .header(id.0, id.1)
        .header(ts.0, ts.1)
        .header(signature.0, signature.1)
        .body(m.payload)
        .send()
        .await
        .map_err(describe)?;
    let status = response.status().as_u16();
    let retry_after = retry_after(status, response.headers(), std::time::SystemTime::now());
    Ok(Answer { status, body: read_prefix(response).await, retry_after })
}

/// The material's scheme; an api that predates the field sends none, which
/// meant relay-v1. A value this build does not know is not guessed at.
fn scheme_of(wire: i32) -> Option<Scheme> {
    Some(match SignatureScheme::try_from(wire).ok()? {
        SignatureScheme::Unspecified | SignatureScheme::RelayV1 => Scheme::RelayV1,
        SignatureScheme::StandardWebhooks => Scheme::StandardWebhooks,
        SignatureScheme::StandardWebhooksEd25519 => Scheme::StandardWebhooksEd25519,
    })
}

async fn read_prefix(mut response: reqwest::Response) -> Vec<u8> {
    let mut kept = Vec::new();
    // The status is the outcome; the body is only for the attempt log, so a
    // body that stalls is cut short rather than failing the attempt.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while kept.len() < KEEP_BODY {
            match response.chunk().await {
                Ok(Some(chunk)) => kept.extend_from_slice(&chunk[..chunk.len().min(KEEP_BODY - kept.len())]),
                _ => break,
            }
        }
    })
    .await;
    kept
}

/// A short, stable description of a transport failure for the attempt log.
fn describe(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else if e.is_redirect() {
        "redirect"
    } else {
        "request"
    };
    let mut msg = format!("{kind}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

fn chrono_free_unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

    use relay_contracts::relay::dispatch::v1::OutcomeRequest;

    use super::{back_pressure, retry_after};

    #[test]
    fn a_429_or_a_503_that_asks_slows_the_lane_within_a_minute() {
        let outcome = |status, retry_after_ms| OutcomeRequest { http_status: Some(status), retry_after_ms, ..Default::default() };
        assert_eq!(back_pressure(&outcome(429, Some(2_000))), Some(Duration::from_secs(2)));
        assert_eq!(back_pressure(&outcome(429, None)), Some(Duration::from_secs(1)), "a 429 without a wait: a second");
        assert_eq!(back_pressure(&outcome(429, Some(3_600_000))), Some(Duration::from_secs(60)));
        assert_eq!(back_pressure(&outcome(503, Some(5_000))), Some(Duration::from_secs(5)));
        assert_eq!(back_pressure(&outcome(503, None)), None, "a 503 that does not ask is a failure");
        assert_eq!(back_pressure(&outcome(500, Some(5_000))), None);
        assert_eq!(back_pressure(&OutcomeRequest::default()), None, "no answer at all");
    }

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn retry_after_reads_seconds_and_dates_on_429_and_503_only() {
        let now = UNIX_EPOCH + Duration::from_secs(1_784_000_000);
        assert_eq!(retry_after(429, &with("120"), now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(503, &with(" 7 "), now), Some(Duration::from_secs(7)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(retry_after(503, &with(&later), now), Some(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(retry_after(429, &with(&past), now), Some(Duration::ZERO));
        assert_eq!(retry_after(500, &with("120"), now), None, "only 429 and 503 ask the sender to wait");
        assert_eq!(retry_after(429, &with("soon"), now), None);
        assert_eq!(retry_after(429, &HeaderMap::new(), SystemTime::now()), None);
    }
}
