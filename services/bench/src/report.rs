//! What a run measured, as JSON and as a markdown table row.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{chart::Series, pgstats::PgCounters, receiver::Receiver, spec::Workload};

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub workload: Workload,
    pub machine: String,
    pub events_accepted_per_sec: f64,
    pub deliveries_per_sec: f64,
    pub healthy_deliveries: usize,
    pub expected_healthy_deliveries: usize,
    pub missing: usize,
    /// Healthy deliveries beyond those expected (a payload filter that let
    /// through an event it should have refused).
    pub unexpected: usize,
    pub duplicates: usize,
    pub latency_ms: Latency,
    pub cpu_seconds: Resources<f64>,
    pub peak_rss_mib: Resources<f64>,
    /// From the first publish (or the start of an idle wait) to the last
    /// healthy arrival: the window the CPU seconds were taken over.
    pub window_secs: f64,
    /// api + dispatcher + Postgres CPU over the window, in percent of one core.
    pub cpu_percent_of_a_core: f64,
    /// Postgres's counters over the run (statements need pg_stat_statements).
    pub postgres: PgCounters,
    /// CPU, statements, WAL and commits divided by the healthy deliveries
    /// made (`None` for a run that made none).
    pub per_delivery: Option<PerDelivery>,
    /// One key per endpoint: how one endpoint's deliveries compare with one
    /// round trip to the receiver (`None` for other workloads).
    pub one_key: Option<OneKey>,
}

/// A one-key run beside the receiver's round trip: each endpoint is one lane,
/// so `1 / round trip` a second per endpoint is the most order allows.
#[derive(Debug, Clone, Serialize)]
pub struct OneKey {
    pub receiver_round_trip_ms: f64,
    pub per_endpoint_per_sec: f64,
    /// `1 / round trip`, a second.
    pub round_trip_bound_per_sec: f64,
    /// What the run reached of that bound.
    pub of_bound: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PerDelivery {
    pub cpu_ms: f64,
    pub statements: Option<f64>,
    pub wal_bytes: Option<f64>,
    pub commits: Option<f64>,
    /// Growth of the traffic tables (bytes on disk, rows) per delivery.
    pub stored_bytes: Option<f64>,
    pub stored_rows: Option<f64>,
}

/// What the run read off the processes and Postgres.
pub struct Measured<'a> {
    pub cpu_before: &'a [f64],
    pub cpu_after: &'a [f64],
    pub peaks: &'a [u64],
    pub window: Duration,
    pub pg: PgCounters,
}

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Resources<T> {
    pub api: T,
    pub dispatcher: T,
    pub postgres: T,
}

/// `x` rounded to `places` decimals, as the report prints its figures.
fn round(x: f64, places: i32) -> f64 {
    (x * 10f64.powi(places)).round() / 10f64.powi(places)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0 * 10.0).round() / 10.0
}

/// The machine a run measured: cores, CPU model, memory.
pub fn machine() -> String {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_owned()))
        .unwrap_or_else(|| "unknown CPU".into());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok()))
        .map(|kb| kb / 1024 / 1024)
        .unwrap_or(0);
    format!("{cpus} cores ({model}), {mem} GiB")
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        w: &Workload,
        receiver: &Receiver,
        published_at: &HashMap<String, Instant>,
        healthy_paths: &[String],
        started: Instant,
        publish_done: Instant,
        m: Measured<'_>,
    ) -> (Self, Series) {
        let Measured { cpu_before, cpu_after, peaks, window, pg } = m;
        let arrivals = receiver.arrivals.lock().expect("not poisoned");
        let mut latencies = Vec::new();
        let mut arrived = Vec::new();
        let (mut distinct, mut duplicates, mut last) = (0usize, 0usize, started);
        for path in healthy_paths {
            for (id, at) in published_at {
                if let Some(times) = arrivals.by_key.get(&(path.clone(), id.clone())) {
                    distinct += 1;
                    duplicates += times.len() - 1;
                    latencies.push(times[0] - *at);
                    arrived.push(times[0].saturating_duration_since(started));
                    last = last.max(times[0]);
                }
            }
        }
        latencies.sort();
        let pct =
            |p: f64| latencies.get(((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().map(ms).unwrap_or(f64::NAN);
        let expected = w.expected_healthy();
        let cpu = |i: usize| ((cpu_after.get(i).unwrap_or(&0.0) - cpu_before.get(i).unwrap_or(&0.0)) * 100.0).round() / 100.0;
        let mib = |i: usize| ((*peaks.get(i).unwrap_or(&0) as f64 / 1_048_576.0) * 10.0).round() / 10.0;
        let cpu_total = cpu(0) + cpu(1) + cpu(2);
        let per = |total: Option<i64>| total.map(|t| round(t as f64 / distinct as f64, 2));
        let per_delivery = (distinct > 0).then(|| PerDelivery {
            cpu_ms: round(cpu_total * 1000.0 / distinct as f64, 3),
            statements: per(pg.statements),
            wal_bytes: per(pg.wal_bytes).map(f64::round),
            commits: per(pg.commits),
            stored_bytes: per(pg.stored_bytes).map(f64::round),
            stored_rows: per(pg.stored_rows),
        });
        let report = Self {
            workload: w.clone(),
            machine: machine(),
            events_accepted_per_sec: (w.events as f64 / (publish_done - started).as_secs_f64()).round(),
            deliveries_per_sec: (distinct as f64 / (last - started).as_secs_f64().max(1e-9)).round(),
            healthy_deliveries: distinct,
            expected_healthy_deliveries: expected,
            missing: expected.saturating_sub(distinct),
            // More than expected can only be a filter letting through what
            // it should not: counted, so the run says so.
            unexpected: distinct.saturating_sub(expected),
            duplicates,
            latency_ms: Latency { p50: pct(0.50), p95: pct(0.95), p99: pct(0.99), max: pct(1.0) },
            cpu_seconds: Resources { api: cpu(0), dispatcher: cpu(1), postgres: cpu(2) },
            peak_rss_mib: Resources { api: mib(0), dispatcher: mib(1), postgres: mib(2) },
            window_secs: round(window.as_secs_f64(), 2),
            cpu_percent_of_a_core: round(cpu_total * 100.0 / window.as_secs_f64().max(1e-9), 1),
            postgres: pg,
            per_delivery,
            one_key: None,
        };
        (report, Series { latencies, arrivals: arrived })
    }

    /// Sets the one-key comparison from the receiver's measured round trip,
    /// over `endpoints` lanes.
    pub fn set_round_trip(&mut self, rtt: Duration, endpoints: usize) {
        let bound = 1.0 / rtt.as_secs_f64().max(1e-9);
        let per_endpoint = self.deliveries_per_sec / endpoints.max(1) as f64;
        self.one_key = Some(OneKey {
            receiver_round_trip_ms: round(rtt.as_secs_f64() * 1000.0, 3),
            per_endpoint_per_sec: round(per_endpoint, 1),
            round_trip_bound_per_sec: bound.round(),
            of_bound: round(per_endpoint / bound, 3),
        });
    }

    /// The one-key comparison, for the log.
    pub fn one_key_line(&self) -> Option<String> {
        let k = self.one_key.as_ref()?;
        Some(format!(
            "{}: {} deliveries/s per endpoint (one lane each) against 1 / round trip = {} (receiver round trip {} ms): {}x of the bound",
            self.workload.name, k.per_endpoint_per_sec, k.round_trip_bound_per_sec, k.receiver_round_trip_ms, k.of_bound
        ))
    }

    fn per_delivery_cell(&self) -> String {
        let Some(p) = &self.per_delivery else { return "–".into() };
        let or_dash = |v: Option<f64>| v.map_or("–".to_owned(), |v| v.to_string());
        format!("{} / {} / {} / {}", p.cpu_ms, or_dash(p.statements), or_dash(p.wal_bytes), or_dash(p.commits))
    }

    /// What the run left on disk per healthy delivery, for the retention
    /// window's sizing.
    pub fn storage_line(&self) -> Option<String> {
        let (bytes, rows) = (self.postgres.stored_bytes?, self.postgres.stored_rows?);
        (self.healthy_deliveries > 0).then(|| {
            let n = self.healthy_deliveries as f64;
            format!(
                "{}: stored {:.0} bytes and {:.2} rows per delivery (events, deliveries, attempt log, expansion ledger, dead letters; heap, indexes and TOAST)",
                self.workload.name,
                bytes as f64 / n,
                rows as f64 / n
            )
        })
    }

    /// The run's statements, most called first, per healthy delivery: where
    /// the database budget goes.
    pub fn statement_breakdown(&self) -> Option<String> {
        if self.postgres.by_statement.is_empty() || self.healthy_deliveries == 0 {
            return None;
        }
        let n = self.healthy_deliveries as f64;
        let mut out = format!("{}: statements per delivery (calls, exec+plan µs per call, buffers per call)\n", self.workload.name);
        if let Some(rows) = self.postgres.rows_seq_scanned {
            out += &format!("  rows read by sequential scans: {:.1} per delivery\n", rows as f64 / n);
        }

        for s in &self.postgres.by_statement {
            let per_call = (s.exec_ms + s.plan_ms) * 1000.0 / s.calls as f64;
            let blocks = s.blocks as f64 / s.calls as f64;
            out += &format!(
                "  {:>6.3}  {:>7.0} µs  {:>6.1}  {}\n",
                s.calls as f64 / n,
                per_call,
                blocks,
                s.query.chars().take(100).collect::<String>()
            );
        }
        Some(out)
    }

    pub const MARKDOWN_HEADER: &str = "| workload | events | endpoints (ok/hang/500) | events/s accepted | deliveries/s | p50 ms | p95 ms | p99 ms | max ms | missing | duplicates | CPU s api/disp/pg | CPU % of a core | per delivery: CPU ms / statements / WAL bytes / commits | peak memory (PSS) MiB api/disp/pg |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

    pub fn markdown_row(&self) -> String {
        let w = &self.workload;
        format!(
            "| {} | {} | {}/{}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{}/{} | {} | {} | {}/{}/{} |",
            w.name,
            w.events,
            w.healthy,
            w.hanging,
            w.failing,
            self.events_accepted_per_sec,
            self.deliveries_per_sec,
            self.latency_ms.p50,
            self.latency_ms.p95,
            self.latency_ms.p99,
            self.latency_ms.max,
            self.missing,
            self.duplicates,
            self.cpu_seconds.api,
            self.cpu_seconds.dispatcher,
            self.cpu_seconds.postgres,
            self.cpu_percent_of_a_core,
            self.per_delivery_cell(),
            self.peak_rss_mib.api,
            self.peak_rss_mib.dispatcher,
            self.peak_rss_mib.postgres,
        )
    }
}
