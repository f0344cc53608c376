//! Receivers as they are, not as we wish: ones that fail sometimes — the
//! first request of each webhook, at random, in bursts of 429s, for a while
//! after being idle, by timing out — for the behaviours that react to
//! failures. Each is a `Reply::Flaky` for one path of a `Receiver`; its
//! answers depend on the webhook (its payload's `fate` when it has one, so
//! that two runs sending the same payloads meet the same failures; else its
//! id, `webhook-id` or `relay-webhook-id`), how many times that webhook came
//! before, and the time.

use std::{
    collections::HashMap,
    hash::{Hash, Hasher},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::http::HeaderMap;

/// How a flaky receiver behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// This status to each webhook's first request, 200 to its later ones
    /// ("not ready yet, try again").
    FailFirst(u16),
    /// 500 to this share of requests (in percent), at random but the same
    /// for the same webhook id and request number, 200 to the rest.
    FailRandomly(u32),
    /// 429 with `Retry-After: 1` to every request for the first `burst` of
    /// each `every`, 200 otherwise.
    ThrottleInBursts { every: Duration, burst: Duration },
    /// 502 for `for_` after a request that came `idle` or more after the
    /// previous one (or was the first), 200 otherwise: a cold start.
    ColdStart { idle: Duration, for_: Duration },
    /// This share of requests (in percent) held for `hold` (past the
    /// attempt timeout), the rest answered 200 at once.
    TimeOut { percent: u32, hold: Duration },
    /// This status to every request.
    AlwaysFail(u16),
    /// 200 to every request, after holding it this long (within the
    /// attempt timeout): a receiver that works, slowly.
    Slow(Duration),
    /// Every answer after holding the request for `hold`, and 500 to
    /// `percent` of them at random (as `FailRandomly` picks them).
    SlowAndFailingRandomly { percent: u32, hold: Duration },
    /// 500 to every request whose payload's `fate` is this, 200 to the rest:
    /// one webhook that never gets through among ones that do.
    FailFate(&'static str),
}

/// What a flaky receiver answers one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<&'static str>,
    /// How long it waits before answering.
    pub after: Duration,
}

impl Answer {
    fn status(status: u16) -> Self {
        Self { status, retry_after: None, after: Duration::ZERO }
    }
}

/// A behaviour with what it remembers: per webhook id, the requests seen;
/// when the receiver started; when the last request came and when the
/// current cold start began.
#[derive(Debug)]
pub struct Flaky {
    pub behaviour: Behaviour,
    started: Instant,
    state: Mutex<Memory>,
}

#[derive(Debug, Default)]
struct Memory {
    seen: HashMap<String, u32>,
    last_request: Option<Instant>,
    cold_since: Option<Instant>,
    log: Vec<Answered>,
}

/// One request as a flaky receiver answered it.
#[derive(Debug, Clone)]
pub struct Answered {
    /// The webhook's id.
    pub id: String,
    /// Which request of this id it was (1: the first).
    pub nth: u32,
    /// When it arrived.
    pub at: Instant,
    pub answer: Answer,
}

impl Flaky {
    pub fn new(behaviour: Behaviour) -> Arc<Self> {
        Arc::new(Self { behaviour, started: Instant::now(), state: Mutex::default() })
    }

    /// The answer to a request with these headers and body, at `now`.
    pub fn answer(&self, headers: &HeaderMap, body: &[u8], now: Instant) -> Answer {
        let id = ["webhook-id", "relay-webhook-id"]
            .iter()
            .find_map(|h| headers.get(*h).and_then(|v| v.to_str().ok()))
            .unwrap_or_default()
            .to_owned();
        let fate = serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|b| b["payload"].get("fate").map(|f| f.to_string()));
        let mut memory = self.state.lock().expect("not poisoned");
        let key = fate.unwrap_or_else(|| id.clone());
        let nth = {
            let n = memory.seen.entry(key.clone()).or_default();
            *n += 1;
            *n
        };
        let idle_for = memory.last_request.map(|last| now.saturating_duration_since(last));
        memory.last_request = Some(now);
        let answer = self.decide(&mut memory, &key, nth, idle_for, now);
        memory.log.push(Answered { id, nth, at: now, answer: answer.clone() });
        answer
    }

    /// Every request answered so far, in the order they came.
    pub fn log(&self) -> Vec<Answered> {
        self.state.lock().expect("not poisoned").log.clone()
    }

    fn decide(&self, memory: &mut Memory, key: &str, nth: u32, idle_for: Option<Duration>, now: Instant) -> Answer {
        match self.behaviour {
            Behaviour::FailFirst(status) => Answer::status(if nth == 1 { status } else { 200 }),
            Behaviour::FailRandomly(percent) => Answer::status(if chance(key, nth) < percent { 500 } else { 200 }),
            Behaviour::ThrottleInBursts { every, burst } => {
                let into = now.saturating_duration_since(self.started).as_millis() % every.as_millis().max(1);
                if into < burst.as_millis() {
                    Answer { status: 429, retry_after: Some("1"), after: Duration::ZERO }
                } else {
                    Answer::status(200)
                }
            }
            Behaviour::ColdStart { idle, for_ } => {
                if idle_for.is_none_or(|d| d >= idle) {
                    memory.cold_since = Some(now);
                }
                let cold = memory.cold_since.is_some_and(|since| now.saturating_duration_since(since) < for_);
                Answer::status(if cold { 502 } else { 200 })
            }
            Behaviour::TimeOut { percent, hold } => {
                if chance(key, nth) < percent {
                    Answer { status: 200, retry_after: None, after: hold }
                } else {
                    Answer::status(200)
                }
            }
            Behaviour::AlwaysFail(status) => Answer::status(status),
            Behaviour::Slow(hold) => Answer { status: 200, retry_after: None, after: hold },
            Behaviour::FailFate(fate) => Answer::status(if key == format!("{fate:?}") { 500 } else { 200 }),
            Behaviour::SlowAndFailingRandomly { percent, hold } => {
                Answer { status: if chance(key, nth) < percent { 500 } else { 200 }, retry_after: None, after: hold }
            }
        }
    }
}

/// A number in 0..100 that depends only on the webhook's key and the
/// request's number for it.
fn chance(key: &str, nth: u32) -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (key, nth).hash(&mut h);
    (h.finish() % 100) as u32
}
