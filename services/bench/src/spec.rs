//! What a workload is: its name, its mix of endpoints, its load.

use anyhow::{Result, bail};

#[derive(Debug, Clone, serde::Serialize)]
pub struct Workload {
    pub name: String,
    pub events: usize,
    pub publishers: usize,
    pub healthy: usize,
    pub hanging: usize,
    pub failing: usize,
    /// Pending-but-not-due deliveries seeded before the run (W3)…
    pub backlog: u64,
    /// …spread evenly over this many other endpoints of the environment.
    pub backlog_endpoints: u64,
    pub payload_bytes: usize,
    /// Events per second across all publishers (`w1@500`); `None`: as fast
    /// as the api accepts them. Paced runs measure latency at a given load
    /// instead of behind a backlog the publishers outrun.
    pub rate: Option<f64>,
    /// Hostile requests sent beside the publishers, 200 of each kind at once
    /// (`bodies`): bodies without a key, bodies declared past the limit, and
    /// bodies that stream past it. The api's peak memory is the figure.
    pub hostile: bool,
    /// Other environments publishing beside the measured one (W4, W5); the
    /// figures are the measured environment's alone.
    pub neighbours: Option<Neighbours>,
    /// No traffic: the system sits this long with its endpoints registered
    /// and the run measures what it costs to do nothing (`idle`).
    pub idle_secs: u64,
    /// apis and dispatchers run, this many of each (`w1x2`: two and two);
    /// publishers spread over the apis, each dispatcher calls its own api
    /// first.
    pub replicas: usize,
    /// Payload filters on the healthy endpoints (issue 27): what a filter
    /// costs at expansion, per delivery it lets through.
    pub filter: Option<FilterMix>,
    /// Ordered delivery (issue 28): the healthy endpoints order per key and
    /// the events spread round robin over this many ordering keys.
    pub ordering_keys: Option<usize>,
    /// The catalogue (issue 29): realistic payloads (`crate::catalogue`),
    /// checked against their type's schema (`Some(true)`) or not.
    pub schema: Option<bool>,
    /// How long the receiver holds each healthy request (and each
    /// round-trip probe) before answering: a receiver at a realistic
    /// distance, whose round trip is not below what the machine can drive.
    pub answer_delay_ms: u64,
}

/// How the healthy endpoints filter: `Half`: each endpoint takes half the
/// events (even endpoints the lower half of `n`, odd ones the upper), so
/// each event goes to half of them; `All`: a filter every event matches
/// (the deliveries of W1, plus the cost of judging them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FilterMix {
    Half,
    All,
}

/// Environments beside the measured one, each with its own endpoints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Neighbours {
    pub environments: usize,
    pub healthy_each: usize,
    pub hanging_each: usize,
    pub failing_each: usize,
    /// Events published across them, round robin.
    pub events: usize,
    /// Events per second across them; `None`: as fast as accepted (a burst).
    pub rate: Option<f64>,
}

impl Workload {
    pub fn named(name: &str) -> Result<Self> {
        let (base, rate) = match name.split_once('@') {
            Some((base, rate)) => {
                let rate: f64 = rate.parse().map_err(|_| anyhow::anyhow!("{name}: the rate after @ must be events per second"))?;
                anyhow::ensure!(rate > 0.0, "{name}: the rate must be positive");
                (base, Some(rate))
            }
            None => (name, None),
        };
        // `<workload>x<N>`: N apis and N dispatchers.
        let (base, replicas) = match base.rsplit_once('x') {
            Some((b, n)) if !b.is_empty() && !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) => {
                let n: usize = n.parse().map_err(|_| anyhow::anyhow!("{name}: the count after x is too large"))?;
                anyhow::ensure!((1..=8).contains(&n), "{name}: from 1 to 8 apis and dispatchers, got {n}");
                (b, n)
            }
            _ => (base, 1),
        };
        let w = |events, publishers, healthy, hanging, failing, backlog| Workload {
            name: name.to_owned(),
            events,
            publishers,
            healthy,
            hanging,
            failing,
            backlog,
            backlog_endpoints: 1_000,
            payload_bytes: 1024,
            rate,
            hostile: false,
            neighbours: None,
            idle_secs: 0,
            replicas,
            filter: None,
            ordering_keys: None,
            schema: None,
            answer_delay_ms: 0,
        };
        // The measured environment of W4 and W5 publishes at a steady rate
        // unless the name says otherwise.
        let paced = |default: f64| Some(rate.unwrap_or(default));
        Ok(match base {
            "w1" => w(2_000, 32, 10, 0, 0, 0),
            "w2" => w(500, 32, 10, 10, 10, 0),
            "w2b" => w(1_500, 32, 10, 10, 10, 0),
            // W2b's healthy endpoints alone: the baseline its p99 is held to.
            "w2b-solo" => w(1_500, 32, 10, 0, 0, 0),
            // 1,000 failing or hanging endpoints over 50 environments, which
            // publish 50 events/s between them, beside one healthy
            // environment publishing at 100 events/s to 2 endpoints.
            "w4" => Workload {
                rate: paced(100.0),
                neighbours: Some(Neighbours {
                    environments: 50,
                    healthy_each: 0,
                    hanging_each: 10,
                    failing_each: 10,
                    events: 1_500,
                    rate: Some(50.0),
                }),
                ..w(3_000, 16, 2, 0, 0, 0)
            },
            "w4-solo" => Workload { rate: paced(100.0), ..w(3_000, 16, 2, 0, 0, 0) },
            // One environment bursts 20,000 events to 10 endpoints while the
            // measured one publishes 50 events/s to 2.
            "w5" => Workload {
                rate: paced(50.0),
                neighbours: Some(Neighbours {
                    environments: 1,
                    healthy_each: 10,
                    hanging_each: 0,
                    failing_each: 0,
                    events: 20_000,
                    rate: None,
                }),
                ..w(1_500, 16, 2, 0, 0, 0)
            },
            "w5-solo" => Workload { rate: paced(50.0), ..w(1_500, 16, 2, 0, 0, 0) },
            "w3" => w(2_000, 32, 10, 0, 0, 1_000_000),
            // W3 ten times over: 10,000,000 rows on 10,000 endpoints, what a
            // large installation's schedule holds (issue 30: within 10 % of W1).
            "w3-10m" => Workload { backlog_endpoints: 10_000, ..w(2_000, 32, 10, 0, 0, 10_000_000) },
            // W1 with a payload filter on every endpoint: half the events
            // match each (w1f), or all of them (w1f-all).
            "w1f" => Workload { filter: Some(FilterMix::Half), ..w(2_000, 32, 10, 0, 0, 0) },
            "w1f-all" => Workload { filter: Some(FilterMix::All), ..w(2_000, 32, 10, 0, 0, 0) },
            // w1f's deliveries without a filter: W1's events to 5 endpoints
            // (each event reaches 5, as under w1f), the baseline that tells
            // the filter's cost from the cost of events reaching fewer.
            "w1h" => w(2_000, 32, 5, 0, 0, 0),
            // W1 to endpoints that order per key: its events over 1,000 keys
            // (W6), or all of one key (w6-1: one delivery at a time per
            // endpoint, each after the one before it has ended).
            "w6" => Workload { ordering_keys: Some(1_000), ..w(2_000, 32, 10, 0, 0, 0) },
            "w6-1" => Workload { ordering_keys: Some(1), ..w(500, 32, 10, 0, 0, 0) },
            // w6-1 to a receiver 20 ms away: one key's rate against a round
            // trip that the machine can keep up with (on loopback, ten
            // lanes at 1 / round trip would need ten times W1's rate).
            "w6-1-20ms" => Workload { ordering_keys: Some(1), answer_delay_ms: 20, ..w(500, 32, 10, 0, 0, 0) },
            // W1 with realistic payloads (about 20 properties, nested) whose
            // type has a schema in the catalogue (w1s: every publish checked),
            // or the same payloads without one (w1s-none).
            "w1s" => Workload { schema: Some(true), ..w(2_000, 32, 10, 0, 0, 0) },
            "w1s-none" => Workload { schema: Some(false), ..w(2_000, 32, 10, 0, 0, 0) },
            // 200 publishes of 250 KiB at once beside 600 hostile bodies of
            // 1–1.9 MiB: what the api's memory does under that.
            "bodies" => Workload { payload_bytes: 250 * 1024, hostile: true, ..w(200, 200, 1, 0, 0, 0) },
            // Ten endpoints, no traffic, 10 s: the cost of standing by.
            "idle" => Workload { idle_secs: 10, ..w(0, 0, 10, 0, 0, 0) },
            // What CI runs so the benchmark keeps working.
            "smoke" => w(200, 8, 3, 1, 1, 0),
            other => bail!(
                "unknown workload {other:?}: w1, w1f, w1f-all, w1h, w1s, w1s-none, w6, w6-1, w6-1-20ms, w2, w2b, w2b-solo, w3, w3-10m, w4, w4-solo, w5, w5-solo, bodies, idle or smoke, optionally with N apis and dispatchers as <name>x<N> and paced as <name>@<events per second>"
            ),
        })
    }

    pub fn endpoints(&self) -> usize {
        self.healthy + self.hanging + self.failing
    }

    /// The healthy deliveries the run waits for: each event once per
    /// healthy endpoint whose filter it matches.
    pub fn expected_healthy(&self) -> usize {
        match self.filter {
            Some(FilterMix::Half) => (0..self.healthy).map(|k| self.filter_takes(k, self.events)).sum(),
            _ => self.events * self.healthy,
        }
    }

    /// How many of `events` the `k`th healthy endpoint's filter takes.
    fn filter_takes(&self, k: usize, events: usize) -> usize {
        let half = events / 2;
        if k.is_multiple_of(2) { half } else { events - half }
    }

    /// The `k`th healthy endpoint's payload filter, as REST takes it.
    pub fn filter_for(&self, k: usize) -> Option<serde_json::Value> {
        let half = self.events / 2;
        match self.filter? {
            FilterMix::All => Some(serde_json::json!({"n": {"$gte": 0}, "data": {"$exists": true}})),
            FilterMix::Half if k.is_multiple_of(2) => {
                Some(serde_json::json!({"$and": [{"n": {"$gte": 0}}, {"data": {"$exists": true}}, {"n": {"$lt": half}}]}))
            }
            FilterMix::Half => Some(serde_json::json!({"n": {"$gte": half}, "data": {"$exists": true}})),
        }
    }
}
