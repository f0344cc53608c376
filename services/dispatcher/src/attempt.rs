//! One attempt: sign the stored body, POST it, classify what came back.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use relay_contracts::relay::dispatch::v1::{MaterialResponse, OutcomeRequest};
use relay_signing::{ID_HEADER, SIGNATURE_HEADER, SigningSecret, TIMESTAMP_HEADER, signature_header};
use url::Host;

use crate::http_client::Sender;

/// How much of a response body the attempt log keeps.
const KEEP_BODY: usize = 4096;

/// Sends one attempt and returns the outcome to report. Never fails: every
/// way a customer's side can go wrong is an outcome, not an error.
pub async fn send(sender: &Sender, material: MaterialResponse) -> OutcomeRequest {
    let started = Instant::now();
    let mut outcome = OutcomeRequest {
        delivery_id: material.delivery_id.clone(),
        attempt: material.attempt,
        generation: material.generation,
        ..Default::default()
    };
    match post(sender, material).await {
        Ok((status, body)) => {
            outcome.http_status = Some(u32::from(status));
            outcome.response_body = body;
        }
        Err(error) => outcome.error = error,
    }
    outcome.latency_ms = started.elapsed().as_millis() as u64;
    outcome
}

async fn post(sender: &Sender, m: MaterialResponse) -> Result<(u16, Vec<u8>), String> {
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
    let secrets: Vec<SigningSecret> = m.secrets.into_iter().map(SigningSecret::new).collect();
    let timestamp = chrono_free_unix_now().to_string();
    let signature = signature_header(&secrets, &timestamp, &m.payload);
    drop(secrets);
    let response = sender
        .client
        .post(url)
        .header("content-type", "application/json")
        .header(ID_HEADER, &m.event_id)
        .header(TIMESTAMP_HEADER, &timestamp)
        .header(SIGNATURE_HEADER, signature)
        .body(m.payload)
        .send()
        .await
        .map_err(describe)?;
    let status = response.status().as_u16();
    Ok((status, read_prefix(response).await))
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
