//! The operator's gauges, read from storage at each scrape: queue depths,
//! held deliveries, circuits, the oldest unpublished event, whether
//! Postgres and NATS answer.

use super::App;
use crate::db;

impl App {
    /// The metrics' text exposition, with the queue depths read now; `nats_up`: this
    /// api's broker connection is up.
    pub async fn render_metrics(&self, nats_up: bool) -> String {
        let (m, db) = (&self.metrics, &self.db);
        m.dependency_up.with_label_values(&["nats"]).set(i64::from(nats_up));
        m.dependency_up.with_label_values(&["postgres"]).set(i64::from(db::answers(db).await));
        match db::depths::operational_gauges(db).await {
            Ok(g) => {
                m.depths.with_label_values(&["deliveries_held"]).set(g.deliveries_held);
                m.oldest_unpublished.set(g.oldest_unpublished_secs);
                m.circuits.with_label_values(&["open"]).set(g.circuits_open);
                m.circuits.with_label_values(&["half_open"]).set(g.circuits_half_open);
                m.circuits.with_label_values(&["recovering"]).set(g.circuits_recovering);
            }
            Err(e) => tracing::warn!(error = ?e, "reading operational gauges for metrics"),
        }
        match db::depths::queue_depths(db).await {
            Ok(d) => {
                for (queue, n) in [
                    ("outbox_unpublished", d.outbox_unpublished),
                    ("deliveries_pending", d.deliveries_pending),
                    ("deliveries_due", d.deliveries_due),
                    ("deliveries_in_flight", d.deliveries_in_flight),
                    ("dead_letters", d.dead_letters),
                ] {
                    m.depths.with_label_values(&[queue]).set(n);
                }
            }
            Err(e) => tracing::warn!(error = ?e, "reading queue depths for metrics"),
        }
        match db::depths::in_flight_by_endpoint(db).await {
            Ok(rows) => {
                // Endpoints that drained since the last scrape disappear.
                m.endpoint_in_flight.reset();
                for (endpoint, n) in rows {
                    m.endpoint_in_flight.with_label_values(&[&endpoint.to_string()]).set(n);
                }
            }
            Err(e) => tracing::warn!(error = ?e, "reading in-flight attempts for metrics"),
        }
        m.text()
    }
}
