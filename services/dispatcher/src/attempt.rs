//! One attempt: sign the stored body, POST it, classify what came back.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use relay_contracts::relay::dispatch::v1::{MaterialResponse, OAuth2ClientCredentials, OutcomeRequest, SignatureScheme};
use relay_signing::{Scheme, SigningSecret, signed_headers};
use url::Host;

use crate::{http_client::Sender, oauth2::Fetched};

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

/// A URL Relay may call, checked at call time: the rules may postdate it,
/// and an address literal never reaches the resolver that checks names.
async fn checked_url(sender: &Sender, raw: &str) -> Result<url::Url, String> {
    let policy = &sender.policy;
    let url = policy.check_url(raw).map_err(|e| format!("blocked: {e}"))?;
    match url.host() {
        Some(Host::Ipv4(v4)) if !policy.permits(IpAddr::V4(v4)) => return Err(format!("blocked: {v4} is not a permitted address")),
        Some(Host::Ipv6(v6)) if !policy.permits(IpAddr::V6(v6)) => return Err(format!("blocked: {v6} is not a permitted address")),
        Some(Host::Domain(name)) if sender.via_proxy => {
            let ips = sender.resolver.lookup(name).await.map_err(|e| format!("dns: {name}: {e}"))?;
            policy.check_addresses(name, &ips).map_err(|e| format!("blocked: {e}"))?;
        }
        _ => {}
    }
    Ok(url)
}

/// What the ordering-key header escapes: controls, space, `%` and every
/// byte beyond ASCII.
const ORDERING_KEY_ESCAPES: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b' ').add(b'%');

async fn post(sender: &Sender, m: MaterialResponse) -> Result<Answer, String> {
    // A listener's endpoint has no address: its attempts go over the broker.
    let listen = m.url.starts_with(crate::listen::LISTEN_SCHEME);
    let url = if listen { None } else { Some(checked_url(sender, &m.url).await?) };
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
    // The endpoint's own headers; the api refused any name Relay sets below
    // (or the connection frames), so none doubles a signature header. With
    // OAuth2 the bearer token is the Authorization header.
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in &m.headers {
        let name =
            reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("headers: {name:?} is not a header name"))?;
        let value = reqwest::header::HeaderValue::from_str(value).map_err(|_| format!("headers: the value of {name} is not sendable"))?;
        headers.append(name, value);
    }
    for (name, value) in [("content-type", "application/json".to_owned()), (id.0, id.1), (ts.0, ts.1), (signature.0, signature.1)] {
        let value = reqwest::header::HeaderValue::from_str(&value).map_err(|_| format!("signing: {name} is not sendable"))?;
        headers.insert(name, value);
    }
    if !m.ordering_key.is_empty() {
        let (key_name, sequence_name) = scheme.ordering_headers();
        // Percent-encoded beyond visible ASCII (a key may be any UTF-8, a
        // header value should not): "order-42" goes as it is.
        let encoded = percent_encoding::utf8_percent_encode(&m.ordering_key, ORDERING_KEY_ESCAPES).to_string();
        let key = reqwest::header::HeaderValue::from_str(&encoded).map_err(|_| "ordering: the key is not sendable".to_owned())?;
        headers.insert(key_name, key);
        headers.insert(sequence_name, reqwest::header::HeaderValue::from(m.ordering_position));
    }
    if m.oauth2.is_some() {
        headers.remove(reqwest::header::AUTHORIZATION);
    }
    let body = bytes::Bytes::from(m.payload);
    let Some(url) = url else {
        let route = sender.listen.as_ref().ok_or_else(|| "listener: this dispatcher has no route to listeners".to_owned())?;
        let attempt = crate::listen::Attempt {
            endpoint_id: &m.endpoint_id,
            delivery_id: &m.delivery_id,
            attempt: m.attempt,
            generation: m.generation,
            event_id: &m.event_id,
        };
        let answered = crate::listen::send(route, attempt, &headers, body).await?;
        return Ok(Answer { status: answered.status, body: answered.body, retry_after: None });
    };
    // Inside a client certificate's overlap, the certificate it replaced.
    let previous = if m.previous_client_identity_pem.is_empty() {
        None
    } else {
        Some(sender.client_for(&m.previous_client_identity_pem, &m.ca_bundle)?)
    };
    let send = async |bearer: Option<&str>| {
        let try_with = async |client: &reqwest::Client| {
            let mut request = client.post(url.clone()).headers(headers.clone()).body(body.clone());
            if let Some(token) = bearer {
                request = request.bearer_auth(token);
            }
            request.send().await
        };
        let presents = !m.client_identity_pem.is_empty();
        match try_with(&client).await {
            // Refused in the handshake, the receiver never saw the request:
            // presenting the previous certificate sends it once, not twice.
            // So is a connection the receiver closed (after its alert) before
            // the request could be written, which surfaces as canceled.
            Err(e) if previous.is_some() && (refused_client_certificate(&e) || never_written(&e)) => {
                let refused = explain(e, presents);
                let previous = previous.as_ref().expect("checked");
                try_with(previous).await.map_err(|e| {
                    format!("{refused}; the previous client certificate, still in its overlap, failed too: {}", explain(e, presents))
                })
            }
            other => other.map_err(|e| explain(e, presents)),
        }
    };
    let response = match &m.oauth2 {
        None => send(None).await?,
        Some(credentials) => {
            let token = sender.tokens.bearer(credentials, false, async || fetch_token(sender, credentials).await).await?;
            let first = send(Some(&token)).await?;
            // A refused token may have been revoked early: one fresh token,
            // one more try, before the attempt counts as failed.
            if first.status() == reqwest::StatusCode::UNAUTHORIZED {
                let token = sender.tokens.bearer(credentials, true, async || fetch_token(sender, credentials).await).await?;
                send(Some(&token)).await?
            } else {
                first
            }
        }
    };
    let status = response.status().as_u16();
    let retry_after = retry_after(status, response.headers(), std::time::SystemTime::now());
    Ok(Answer { status, body: read_prefix(response).await, retry_after })
}

/// The most of a token endpoint's answer read.
const MAX_TOKEN_ANSWER: usize = 64 * 1024;

#[derive(serde::Deserialize)]
struct TokenAnswer {
    access_token: String,
    #[serde(default)]
    token_type: Option<String>,
    #[serde(default)]
    expires_in: Option<serde_json::Number>,
}

/// `application/x-www-form-urlencoded`, as RFC 6749 §2.3.1 asks of the
/// client id and secret before they go into HTTP Basic.
fn form_encoded(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// Asks the token URL for a token (RFC 6749 §4.4). The URL is checked like
/// an endpoint's at every fetch and reached through the guarded client, so
/// a token server is never a way around the address rules; a token server
/// that is down, slow or answers anything but a bearer token fails the
/// attempt with a reason for its log.
async fn fetch_token(sender: &Sender, c: &OAuth2ClientCredentials) -> Result<Fetched, String> {
    let url = checked_url(sender, &c.token_url).await.map_err(|e| format!("oauth2: token_url {e}"))?;
    // Built before the first await: the serializer is not Send.
    let form = {
        let mut form = url::form_urlencoded::Serializer::new(String::new());
        form.append_pair("grant_type", "client_credentials");
        if !c.scope.is_empty() {
            form.append_pair("scope", &c.scope);
        }
        if !c.audience.is_empty() {
            form.append_pair("audience", &c.audience);
        }
        form.finish()
    };
    let response = sender
        .client
        .post(url)
        .basic_auth(form_encoded(&c.client_id), Some(form_encoded(&c.client_secret)))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("accept", "application/json")
        .body(form)
        .send()
        .await
        .map_err(|e| format!("oauth2: the token request failed: {}", describe(e)))?;
    let status = response.status().as_u16();
    let body = read_limited(response, MAX_TOKEN_ANSWER).await;
    if !(200..300).contains(&status) {
        let said = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        return Err(format!("oauth2: the token endpoint answered {status}: {said}"));
    }
    let answer: TokenAnswer =
        serde_json::from_slice(&body).map_err(|e| format!("oauth2: the token endpoint's answer is not a token: {e}"))?;
    if answer.access_token.is_empty() {
        return Err("oauth2: the token endpoint's answer has an empty access_token".into());
    }
    if let Some(t) = answer.token_type.as_deref().filter(|t| !t.eq_ignore_ascii_case("bearer")) {
        return Err(format!("oauth2: the token endpoint gave a {t:?} token; only bearer tokens can be sent"));
    }
    if reqwest::header::HeaderValue::from_str(&format!("Bearer {}", answer.access_token)).is_err() {
        return Err("oauth2: the token endpoint's access_token cannot be sent in a header".into());
    }
    let lifetime = match answer.expires_in.as_ref().and_then(serde_json::Number::as_f64) {
        Some(secs) if secs.is_finite() && secs > 0.0 => Some(Duration::from_secs_f64(secs.min(86_400.0 * 365.0))),
        _ => None,
    };
    Ok(Fetched { access: answer.access_token, lifetime })
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

async fn read_prefix(response: reqwest::Response) -> Vec<u8> {
    read_limited(response, KEEP_BODY).await
}

/// Up to `limit` bytes of a response body, within two seconds.
async fn read_limited(mut response: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut kept = Vec::new();
    // The status is the outcome; the body is only for the attempt log, so a
    // body that stalls is cut short rather than failing the attempt.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while kept.len() < limit {
            match response.chunk().await {
                Ok(Some(chunk)) => kept.extend_from_slice(&chunk[..chunk.len().min(limit - kept.len())]),
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

/// A transport error for the attempt log, saying so in words when the
/// receiver refused the client certificate (the TLS alert alone reads
/// `unknownca` or `certificaterequired`), or closed the connection before a
/// request presenting one could be written: under TLS 1.3 a receiver's
/// refusal comes after the client's side of the handshake, and when the
/// connection closes before its alert is read, all that surfaces is
/// hyper's "connection was not ready" (seen in CI's `receiver_tls` run).
fn explain(e: reqwest::Error, presented_certificate: bool) -> String {
    let refused = refused_client_certificate(&e);
    let unwritten = !refused && presented_certificate && never_written(&e);
    let mut message = describe(e);
    if refused {
        message.push_str(if presented_certificate {
            " (the receiver refused the client certificate in the TLS handshake)"
        } else {
            " (the receiver refused the TLS handshake: it may require a client certificate, and this endpoint has none)"
        });
    } else if unwritten {
        message
            .push_str(" (the receiver closed the connection before the request was written: it may have refused the client certificate)");
    }
    message
}

/// The request was never written to the connection: hyper canceled it
/// because the connection closed first (a receiver that refused the
/// handshake may close it before its alert is read).
fn never_written(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_canceled) {
            return true;
        }
        source = err.source();
    }
    false
}

/// Whether the receiver refused the client certificate in the handshake: a
/// TLS alert about the certificate (or, as TLS 1.2 servers often put it, a
/// handshake failure) received. Under TLS 1.3 the alert arrives after the
/// client's side of the handshake, so it surfaces on the request, not the
/// connect; either way the receiver's application saw nothing.
fn refused_client_certificate(e: &reqwest::Error) -> bool {
    use rustls::AlertDescription as A;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        // An io::Error's `source` skips the error it wraps: look inside.
        let wrapped =
            err.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).map(|inner| inner as &(dyn std::error::Error + 'static));
        for candidate in [Some(err), wrapped].into_iter().flatten() {
            if let Some(rustls::Error::AlertReceived(alert)) = candidate.downcast_ref::<rustls::Error>() {
                return matches!(
                    alert,
                    A::BadCertificate
                        | A::UnsupportedCertificate
                        | A::CertificateRevoked
                        | A::CertificateExpired
                        | A::CertificateUnknown
                        | A::UnknownCA
                        | A::AccessDenied
                        | A::CertificateRequired
                        | A::HandshakeFailure
                );
            }
        }
        source = err.source();
    }
    false
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
