//! Use-cases, free of any transport: the gRPC adapters and the relays call
//! these. They read and write through `crate::db`, ask `state` what a result
//! means, hand first attempts to a `queue::JobQueue` and take the time from
//! a `Clock`. Each takes the tenant's environment as an argument resolved
//! from a verified credential, never from the request body.

pub mod admin;
pub mod at_publish;
pub mod attempt_stats;
pub mod bulk_recovery;
pub mod catalogue;
mod circuit;
pub mod client_tls;
pub mod deliveries;
mod endpoint_requests;
pub mod endpoints;
pub mod events;
pub mod expansion;
mod expansion_queues;
mod filtering;
mod gauges;
mod lanes;
pub(crate) mod lease_guard;
pub mod listen;
pub(crate) mod material;
pub mod operational;
mod outbox_offers;
mod outcomes;
pub mod portal;
mod refill;
mod runs;
mod statistics;

use std::sync::Arc;

use relay_domain::{EnvironmentId, Reason, health, schedule::RetrySchedule};
use relay_netguard::Policy;
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::{
    db::{
        self,
        batcher::{Batcher, Shape},
    },
    error::{AppError, AppResult},
    secrets::Keyring,
};

/// Wakes a relay that is asleep waiting for work.
#[derive(Debug, Clone, Default)]
pub struct Wake(Arc<Notify>);

impl Wake {
    pub fn wake(&self) {
        self.0.notify_one();
    }

    pub async fn wait(&self) {
        self.0.notified().await
    }
}

#[derive(Debug, Clone)]
pub struct App {
    db: PgPool,
    keyring: Keyring,
    url_policy: Policy,
    resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
    schedule: RetrySchedule,
    outbox_wake: Wake,
    deliveries_wake: Wake,
    /// Events this process just wrote, for its outbox relay.
    outbox_offers: events::OutboxOffers,
    /// API keys read in the last moment (see `apikeys::VERIFIED_FOR`).
    verified_keys: crate::apikeys::VerifiedKeys,
    /// The delivery relay's last look found rows due that it could not take
    /// (their endpoints at their in-flight cap, or another relay holding
    /// them): only then does an outcome, which frees a slot, wake it.
    slots_awaited: Arc<std::sync::atomic::AtomicBool>,
    /// Wakes the prober when a circuit opens (its next probe may be sooner
    /// than the prober's current sleep).
    probes_wake: Wake,
    /// Wakes the recovery pass when a recovery starts.
    recover_wake: Wake,
    /// When this process last counted a dead letter for its endpoint's
    /// operations endpoint; the announcer asks the database only while one
    /// may still be waiting.
    dead_letters_counted: operational::DeadLetterHint,
    metrics: crate::metrics::Metrics,
    /// Set when this api runs the relays: first attempts created by an
    /// expansion are handed to the broker right after it commits, instead of
    /// waiting for a relay pass to find them.
    direct: Option<DirectDispatch>,
    /// Held by whatever hands out leases in this process (see `lease_guard`).
    lease_guard: Arc<lease_guard::LeaseGuard>,
    clock: Arc<dyn Clock>,
    health: HealthSettings,
    /// The hot paths' own connections (see `db::batcher`); started by
    /// [`App::start_batchers`] before the api serves.
    batchers: Arc<std::sync::OnceLock<Batchers>>,
    portal: portal::PortalSettings,
    /// Attempts recorded by this process, added up for the portal's charts.
    attempt_stats: Arc<attempt_stats::AttemptStats>,
    /// Tells dispatchers which attempts in their hands a disable or delete
    /// ended (see `endpoints`).
    switch_offs: Arc<dyn crate::switch_offs::SwitchOffs>,
    /// What this api read of each environment's event catalogue.
    catalogues: Arc<catalogue::Catalogues>,
    /// Dispatchers taking first attempts of events expanded at publish.
    at_publish: Arc<at_publish::AtPublish>,
}

/// What an [`App`] is built from; the rest of its state starts empty.
pub struct AppParts {
    pub db: PgPool,
    pub keyring: Keyring,
    pub url_policy: Policy,
    pub resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
    pub schedule: RetrySchedule,
    pub health: HealthSettings,
    pub portal: portal::PortalSettings,
    pub direct: Option<DirectDispatch>,
    pub switch_offs: Arc<dyn crate::switch_offs::SwitchOffs>,
    pub clock: Arc<dyn Clock>,
}

impl App {
    pub fn new(parts: AppParts) -> Self {
        let AppParts { db, keyring, url_policy, resolver, schedule, health, portal, direct, switch_offs, clock } = parts;
        // Only an api that runs the relays hands attempts out itself.
        let at_publish = at_publish::AtPublish::new(direct.as_ref().map_or(0, |d| d.expand_at_publish));
        Self {
            at_publish,
            db,
            keyring,
            url_policy,
            resolver,
            schedule,
            outbox_wake: Default::default(),
            deliveries_wake: Default::default(),
            outbox_offers: Default::default(),
            catalogues: Default::default(),
            verified_keys: Default::default(),
            slots_awaited: Default::default(),
            probes_wake: Default::default(),
            recover_wake: Default::default(),
            dead_letters_counted: Default::default(),
            metrics: Default::default(),
            direct,
            lease_guard: Default::default(),
            clock,
            health,
            batchers: Default::default(),
            portal,
            attempt_stats: Default::default(),
            switch_offs,
        }
    }

    /// The pool, for the relays' kept connections and readiness.
    pub fn db(&self) -> &PgPool {
        &self.db
    }

    /// The time, as every rule reads it.
    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    pub fn health_settings(&self) -> &HealthSettings {
        &self.health
    }

    pub fn portal_settings(&self) -> &portal::PortalSettings {
        &self.portal
    }

    pub fn outbox_wake(&self) -> &Wake {
        &self.outbox_wake
    }

    pub fn deliveries_wake(&self) -> &Wake {
        &self.deliveries_wake
    }

    pub fn probes_wake(&self) -> &Wake {
        &self.probes_wake
    }

    pub fn recover_wake(&self) -> &Wake {
        &self.recover_wake
    }

    pub fn outbox_offers(&self) -> &events::OutboxOffers {
        &self.outbox_offers
    }

    pub fn verified_keys(&self) -> &crate::apikeys::VerifiedKeys {
        &self.verified_keys
    }

    /// Whether the delivery relay's last look found due rows it could not take.
    pub fn slots_awaited(&self) -> &std::sync::atomic::AtomicBool {
        &self.slots_awaited
    }

    /// Attempts a relay pass handed to the broker (`relay_relayed_attempts_total`).
    pub fn count_relayed(&self, attempts: usize) {
        self.metrics.relayed_attempts.inc_by(attempts as u64);
    }

    pub(crate) fn lease_guard(&self) -> &lease_guard::LeaseGuard {
        &self.lease_guard
    }

    pub fn dead_letters_counted(&self) -> &operational::DeadLetterHint {
        &self.dead_letters_counted
    }
}

/// The use-cases that run on connections of their own, in batches.
#[derive(Debug)]
pub struct Batchers {
    pub outcomes: Batcher<deliveries::OutcomeAsk, deliveries::Recorded>,
    pub expansions: expansion_queues::ExpansionQueues,
    pub publishes: Batcher<events::NewEvent, Option<events::Written>>,
}

/// The outcome batcher: two connections, one commits while the other gathers.
const OUTCOMES: Shape = Shape { connections: 2, max_batch: 512, plan_once: true };
/// Each of the two expansion queues (`expansion_queues`): one connection
/// (expansions take turns with the relay's leasing anyway, `lease_guard`,
/// and a batch gathers what waits meanwhile), at most 32 events a batch: an expansion holds its
/// subscribers' health rows share-locked until it commits, so a batch of
/// hundreds (a burst) made every outcome that changes a circuit wait for it,
/// and handed out no first attempt before the last event was written.
const EXPANSIONS: Shape = Shape { connections: 1, max_batch: 32, plan_once: true };
/// The publish batcher: two connections, so one gathers the next batch while
/// the other waits for its commit.
const PUBLISHES: Shape = Shape { connections: 2, max_batch: 256, plan_once: false };

impl App {
    /// Starts the batchers; each stops, between batches, once `stop` turns true.
    pub fn start_batchers(&self, queue_timeout: std::time::Duration, stop: tokio::sync::watch::Receiver<bool>) {
        let outcomes = self
            .batcher(OUTCOMES, queue_timeout, &stop, |app, conn, asks| Box::pin(async move { app.record_outcome_batch(conn, asks).await }));
        let expansion_queue = |express: bool| {
            self.batcher(EXPANSIONS, queue_timeout, &stop, move |app, conn, asks| {
                Box::pin(async move { app.expand_on(conn, asks, express).await })
            })
        };
        let expansions =
            expansion_queues::ExpansionQueues::new(expansion_queue(false), expansion_queue(true), &self.metrics.expansion_asks);
        let publishes = self.batcher(PUBLISHES, queue_timeout, &stop, |app, conn, events| {
            Box::pin(async move { app.insert_events_on(conn, events).await })
        });
        if self.batchers.set(Batchers { outcomes, expansions, publishes }).is_err() {
            tracing::warn!("the batchers were started twice; the second start is ignored");
        }
    }

    /// A batcher whose batches run `run` on this app.
    fn batcher<Req: Send + Sync + 'static, Resp: Send + 'static>(
        &self,
        shape: Shape,
        queue_timeout: std::time::Duration,
        stop: &tokio::sync::watch::Receiver<bool>,
        run: impl for<'c> Fn(App, &'c mut sqlx::PgConnection, &'c [Req]) -> crate::db::batcher::BatchFuture<'c, Resp> + Send + Sync + 'static,
    ) -> Batcher<Req, Resp> {
        let app = self.clone();
        Batcher::spawn(&self.db, shape, queue_timeout, stop.clone(), Arc::new(move |conn, items| run(app.clone(), conn, items)))
    }

    fn batchers(&self) -> &Batchers {
        self.batchers.get().expect("the batchers start before the api serves")
    }
}

/// How long a tenant's call may take before its caller is answered
/// UNAVAILABLE, while the work itself (detached, see above) goes on. What
/// this bounds is a wait nobody can shorten: a commit that waits for a
/// synchronous standby that is gone waits until one returns, and cancelling
/// it would leave the write committed locally, unreplicated, yet reported
/// as done. So the caller is told only that nothing can be assumed, and
/// retries; a publish retried with the same event id is idempotent.
pub const TENANT_WORK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The platform's endpoint-health settings.
#[derive(Debug, Clone, Copy)]
pub struct HealthSettings {
    pub circuit: health::CircuitPolicy,
    /// Deliveries a bulk recovery of an endpoint sends again per second.
    pub recover_per_second: u32,
    /// The shortest disable window an operator may set for an environment:
    /// an hour in production, a second in development (tests).
    pub shortest_disable_window: std::time::Duration,
}

/// What handing first attempts straight to the broker needs.
#[derive(Clone)]
pub struct DirectDispatch {
    pub jobs: Arc<dyn crate::queue::JobQueue>,
    /// The relay's per-endpoint cap, applied the same way.
    pub endpoint_cap: i64,
    /// Expansions at publish in flight at once, at most (0: none; see
    /// `at_publish`).
    pub expand_at_publish: usize,
}

/// Where the use-cases get the time: the schedule and the secrets' rotation
/// window are decided against it.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Timestamp;
}

/// The system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        chrono::Utc::now()
    }
}

impl std::fmt::Debug for DirectDispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectDispatch")
            .field("endpoint_cap", &self.endpoint_cap)
            .field("expand_at_publish", &self.expand_at_publish)
            .finish_non_exhaustive()
    }
}

/// An environment, resolved from a verified credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    pub environment_id: EnvironmentId,
}

pub use relay_domain::Timestamp;

/// A time a caller gave, refused with its field named when Postgres could
/// not store it (see [`db::storable`]).
pub(crate) fn check_time(field: &str, t: Timestamp) -> AppResult<Timestamp> {
    if !db::storable(t) {
        return Err(AppError::invalid(
            Reason::InvalidTimestamp,
            format!("{field} is out of range: times from 4713 BC to 294276 AD are accepted, got {}", t.format("%Y-%m-%d %H:%M:%S UTC")),
        ));
    }
    Ok(t)
}

pub(crate) fn require_nonempty(field: &'static str, value: &str) -> AppResult<()> {
    if value.trim().is_empty() {
        return Err(AppError::invalid(Reason::MissingField, format!("{field} is required")));
    }
    Ok(())
}
