//! Prometheus metrics, served as text on the operator's metrics port.
//! Labels carry decisions and never a secret, key, URL or payload.

use prometheus::{Encoder, Gauge, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::db::depths;

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Attempts recorded, by decision (delivered, rescheduled, dead_lettered).
    pub attempts: IntCounterVec,
    /// Attempt latency as the dispatcher measured it, by decision.
    pub attempt_latency: HistogramVec,
    depths: IntGaugeVec,
    /// Attempts handed to the broker and not yet reported, per endpoint.
    endpoint_in_flight: IntGaugeVec,
    /// Endpoints by circuit state (open, half_open).
    circuits: IntGaugeVec,
    /// Age of the oldest event not yet published to the broker.
    oldest_unpublished: Gauge,
    /// 1 while this api reaches the dependency (postgres, nats), else 0.
    dependency_up: IntGaugeVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::new();
        let attempts = IntCounterVec::new(Opts::new("relay_attempts_total", "Delivery attempts recorded, by decision"), &["decision"])
            .expect("valid metric");
        let attempt_latency = HistogramVec::new(
            HistogramOpts::new("relay_attempt_latency_seconds", "Attempt latency (request to response or failure), by decision")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0]),
            &["decision"],
        )
        .expect("valid metric");
        let depths = IntGaugeVec::new(Opts::new("relay_queue_depth", "Work waiting, by queue"), &["queue"]).expect("valid metric");
        let endpoint_in_flight = IntGaugeVec::new(
            Opts::new(
                "relay_endpoint_in_flight",
                "Attempts handed to the broker and not yet reported, per endpoint (at most the in-flight cap)",
            ),
            &["endpoint_id"],
        )
        .expect("valid metric");
        let circuits =
            IntGaugeVec::new(Opts::new("relay_endpoint_circuits", "Endpoints whose circuit is not closed, by state"), &["state"])
                .expect("valid metric");
        let oldest_unpublished =
            Gauge::new("relay_outbox_oldest_seconds", "Age of the oldest event not yet published to NATS (0 when none waits)")
                .expect("valid metric");
        let dependency_up =
            IntGaugeVec::new(Opts::new("relay_dependency_up", "1 while this api reaches the dependency, else 0"), &["dependency"])
                .expect("valid metric");
        for m in [
            Box::new(attempts.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(attempt_latency.clone()),
            Box::new(depths.clone()),
            Box::new(endpoint_in_flight.clone()),
            Box::new(circuits.clone()),
            Box::new(oldest_unpublished.clone()),
            Box::new(dependency_up.clone()),
        ] {
            registry.register(m).expect("metrics register once");
        }
        Self { registry, attempts, attempt_latency, depths, endpoint_in_flight, circuits, oldest_unpublished, dependency_up }
    }
}

impl Metrics {
    /// The text exposition, with the queue depths read now; `nats_up`: this
    /// api's broker connection is up.
    pub async fn render(&self, db: &sqlx::PgPool, nats_up: bool) -> String {
        self.dependency_up.with_label_values(&["nats"]).set(i64::from(nats_up));
        self.dependency_up.with_label_values(&["postgres"]).set(i64::from(crate::db::answers(db).await));
        match depths::operational_gauges(db).await {
            Ok(g) => {
                self.depths.with_label_values(&["deliveries_held"]).set(g.deliveries_held);
                self.oldest_unpublished.set(g.oldest_unpublished_secs);
                self.circuits.with_label_values(&["open"]).set(g.circuits_open);
                self.circuits.with_label_values(&["half_open"]).set(g.circuits_half_open);
                self.circuits.with_label_values(&["recovering"]).set(g.circuits_recovering);
            }
            Err(e) => tracing::warn!(error = ?e, "reading operational gauges for metrics"),
        }
        match depths::queue_depths(db).await {
            Ok(d) => {
                for (queue, n) in [
                    ("outbox_unpublished", d.outbox_unpublished),
                    ("deliveries_pending", d.deliveries_pending),
                    ("deliveries_due", d.deliveries_due),
                    ("deliveries_in_flight", d.deliveries_in_flight),
                    ("dead_letters", d.dead_letters),
                ] {
                    self.depths.with_label_values(&[queue]).set(n);
                }
            }
            Err(e) => tracing::warn!(error = ?e, "reading queue depths for metrics"),
        }
        match depths::in_flight_by_endpoint(db).await {
            Ok(rows) => {
                // Endpoints that drained since the last scrape disappear.
                self.endpoint_in_flight.reset();
                for (endpoint, n) in rows {
                    self.endpoint_in_flight.with_label_values(&[&endpoint.to_string()]).set(n);
                }
            }
            Err(e) => tracing::warn!(error = ?e, "reading in-flight attempts for metrics"),
        }
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
