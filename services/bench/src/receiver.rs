//! The benchmark's receiver on loopback, keep-alive: the path chooses the
//! answer — `/ok/<n>` 200, `/status/<code>/<n>` that status, `/hang/<secs>/<n>`
//! hold the request that long, then 200. A receiver started with a delay
//! holds each other request that long before its 200.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;
use axum::{Router, body::Bytes, http::HeaderMap, http::StatusCode};

/// Arrivals per (path, event id).
#[derive(Default)]
pub struct Arrivals {
    pub by_key: HashMap<(String, String), Vec<Instant>>,
    pub total: usize,
    /// Distinct (path, event) arrivals on healthy (`/ok/`) paths, kept as a
    /// counter so the driver's progress check costs nothing per poll.
    pub healthy_distinct: usize,
}

#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    pub arrivals: Arc<Mutex<Arrivals>>,
}

impl Receiver {
    pub async fn start(delay: Duration) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let arrivals: Arc<Mutex<Arrivals>> = Default::default();
        let sink = arrivals.clone();
        let app = Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap, _body: Bytes| {
            let sink = sink.clone();
            async move {
                let now = Instant::now();
                let path = uri.path().to_owned();
                let id = headers.get("relay-webhook-id").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                {
                    let mut a = sink.lock().expect("not poisoned");
                    a.total += 1;
                    let healthy = path.starts_with("/ok/");
                    let times = a.by_key.entry((path.clone(), id)).or_default();
                    times.push(now);
                    if healthy && times.len() == 1 {
                        a.healthy_distinct += 1;
                    }
                }
                let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
                match parts.as_slice() {
                    ["status", code, ..] => StatusCode::from_u16(code.parse().unwrap_or(500)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    ["hang", secs, ..] => {
                        tokio::time::sleep(Duration::from_secs(secs.parse().unwrap_or(60))).await;
                        StatusCode::OK
                    }
                    _ => {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        StatusCode::OK
                    }
                }
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(Self { addr, arrivals })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// The receiver's round trip as a sender sees it: the median of 500 POSTs of
/// `payload_bytes`, one after another on one keep-alive connection (after
/// 50 to warm it), to a path no workload counts.
pub async fn round_trip(receiver: &Receiver, payload_bytes: usize) -> Result<Duration> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(1).build()?;
    let body = vec![b'x'; payload_bytes];
    let url = receiver.url("/round-trip");
    let mut times = Vec::with_capacity(500);
    for i in 0..550 {
        let start = Instant::now();
        let status = http.post(&url).header("content-type", "application/json").body(body.clone()).send().await?.status();
        anyhow::ensure!(status.is_success(), "the receiver answered {status} to a round-trip probe");
        if i >= 50 {
            times.push(start.elapsed());
        }
    }
    times.sort();
    Ok(times[times.len() / 2])
}
