//! Prometheus metrics, served as text on the operator's metrics port.
//! Labels carry decisions and never a secret, key, URL or payload.

use prometheus::{Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Attempts recorded, by decision (delivered, rescheduled, dead_lettered).
    pub attempts: IntCounterVec,
    /// Attempt latency as the dispatcher measured it, by decision.
    pub attempt_latency: HistogramVec,
    /// Lane followers' attempts recorded: sent on their predecessor's 2xx,
    /// before its outcome was recorded (`MaterialResponse.followers`).
    pub(crate) lane_follower_attempts: IntCounter,
    /// Lanes whose head an outcome ended, by how they were settled: marked
    /// idle at once (nothing queued behind the head) or promoted.
    pub(crate) ended_lanes: IntCounterVec,
    /// Attempts the delivery relay handed to the broker: retries fallen
    /// due, leases run out, and first attempts no refill took. The rest
    /// went to a dispatcher with an expansion's or an outcome's answer.
    pub(crate) relayed_attempts: IntCounter,
    /// Expansion asks taken, by the queue they took (`main`, `express`:
    /// see `app::expansion_queues`).
    pub(crate) expansion_asks: IntCounterVec,
    /// Events this api expanded as they were published (`app::at_publish`).
    pub(crate) expanded_at_publish: IntCounter,
    pub(crate) depths: IntGaugeVec,
    /// Attempts handed to the broker and not yet reported, per endpoint.
    pub(crate) endpoint_in_flight: IntGaugeVec,
    /// Endpoints by circuit state (open, half_open, recovering).
    pub(crate) circuits: IntGaugeVec,
    /// Age of the oldest event not yet published to the broker.
    pub(crate) oldest_unpublished: Gauge,
    /// 1 while this api reaches the dependency (postgres, nats), else 0.
    pub(crate) dependency_up: IntGaugeVec,
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
        let lane_follower_attempts = IntCounter::new(
            "relay_lane_follower_attempts_total",
            "Ordered lanes' attempts sent on their predecessor's 2xx before its outcome was recorded, and recorded",
        )
        .expect("valid metric");
        let ended_lanes = IntCounterVec::new(
            Opts::new(
                "relay_ended_lanes_total",
                "Ordered lanes whose head an outcome ended, by how they were settled (idle: nothing queued behind it; promoted)",
            ),
            &["settled"],
        )
        .expect("valid metric");
        let relayed_attempts = IntCounter::new(
            "relay_relayed_attempts_total",
            "Attempts the delivery relay handed to the broker (due retries, leases run out, first attempts no answer carried)",
        )
        .expect("valid metric");
        let expansion_asks = IntCounterVec::new(
            Opts::new(
                "relay_expansion_asks_total",
                "Expansion asks taken, by queue (express: an environment's only one beside another environment's)",
            ),
            &["queue"],
        )
        .expect("valid metric");
        let expanded_at_publish = IntCounter::new(
            "relay_expanded_at_publish_total",
            "Events the api expanded as they were published, their first attempts sent straight to a dispatcher",
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
            Box::new(lane_follower_attempts.clone()),
            Box::new(ended_lanes.clone()),
            Box::new(relayed_attempts.clone()),
            Box::new(expansion_asks.clone()),
            Box::new(expanded_at_publish.clone()),
            Box::new(depths.clone()),
            Box::new(endpoint_in_flight.clone()),
            Box::new(circuits.clone()),
            Box::new(oldest_unpublished.clone()),
            Box::new(dependency_up.clone()),
        ] {
            registry.register(m).expect("metrics register once");
        }
        Self {
            registry,
            attempts,
            attempt_latency,
            lane_follower_attempts,
            ended_lanes,
            relayed_attempts,
            expansion_asks,
            expanded_at_publish,
            depths,
            endpoint_in_flight,
            circuits,
            oldest_unpublished,
            dependency_up,
        }
    }
}

impl Metrics {
    /// The text exposition of what was set.
    pub fn text(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
