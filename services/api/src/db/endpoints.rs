//! `webhook_endpoints`. Reads never select a ciphertext; only material and
//! the rewrap read secrets.

use relay_domain::{EndpointId, EnvironmentId, models::ClientCertificatesShown, ordering::Ordering, rate::RateLimit};
use sqlx::{PgConnection, PgPool};

use relay_signing::Scheme;

pub use super::endpoint_secrets::Sealed;
use super::models::{Circuit, DisabledReason, Endpoint, EndpointHealth, FailureWindow, Timestamp};
use crate::error::AppResult;

/// The environment's endpoint quota, its row locked: concurrent creates
/// serialise on it, so two racing requests cannot both take the last slot.
pub async fn lock_quota(tx: &mut PgConnection, environment_id: EnvironmentId) -> AppResult<Option<i32>> {
    Ok(sqlx::query_scalar!("SELECT endpoint_quota FROM environments WHERE id = $1 FOR UPDATE", environment_id as _)
        .fetch_optional(&mut *tx)
        .await?)
}

pub async fn count_live(tx: &mut PgConnection, environment_id: EnvironmentId) -> AppResult<i64> {
    Ok(sqlx::query_scalar!(
        // A listener's endpoint (relay-dev listen) counts against no quota.
        r#"SELECT count(*) AS "n!" FROM webhook_endpoints e WHERE e.environment_id = $1 AND e.deleted_at IS NULL
             AND NOT EXISTS (SELECT 1 FROM listeners l WHERE l.endpoint_id = e.id)"#,
        environment_id as _
    )
    .fetch_one(&mut *tx)
    .await?)
}

/// An endpoint as every read selects it: the row, its health, and how many
/// deliveries it holds (counted on the held index).
struct EndpointRow {
    id: EndpointId,
    url: String,
    event_types: Vec<String>,
    enabled: bool,
    disabled_reason: Option<DisabledReason>,
    created_at: Timestamp,
    secret_rotated_at: Option<Timestamp>,
    signature_scheme: String,
    public_key: Option<String>,
    previous_public_key: Option<String>,
    signature_scheme_changed_at: Option<Timestamp>,
    circuit: Circuit,
    consecutive_failures: i32,
    failing_since: Option<Timestamp>,
    last_success_at: Option<Timestamp>,
    last_failure_at: Option<Timestamp>,
    next_probe_at: Option<Timestamp>,
    probe_interval_ms: i64,
    window_ms: i64,
    window_bucket: i64,
    window_attempts: i32,
    window_failures: i32,
    previous_attempts: i32,
    previous_failures: i32,
    failed_retries: i32,
    one_at_a_time: bool,
    held: i64,
    headers_shown: serde_json::Value,
    max_in_flight: Option<i32>,
    filter: Option<String>,
    rate_per_second: Option<i32>,
    rate_burst: Option<i32>,
    client_certificate_shown: Option<serde_json::Value>,
    ca_bundle: Option<String>,
    oauth2_shown: Option<serde_json::Value>,
    ordering: Ordering,
}

impl EndpointRow {
    /// The endpoint as read at `now`: its previous public key is shown while
    /// it still signs, its previous client certificate while its overlap lasts.
    fn read_at(self, now: Timestamp) -> anyhow::Result<Endpoint> {
        let r = self;
        let signature_scheme = super::models::stored_scheme(r.id, &r.signature_scheme)?;
        let headers: Vec<(String, String)> = serde_json::from_value(r.headers_shown)
            .map_err(|e| anyhow::anyhow!("endpoint {} has shown headers this api cannot read: {e}", r.id))?;
        let previous_public_key = r.previous_public_key.filter(|_| relay_domain::signing::previous_still_signs(r.secret_rotated_at, now));
        let certificates: Option<ClientCertificatesShown> = r
            .client_certificate_shown
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| anyhow::anyhow!("endpoint {} has a shown client certificate this api cannot read: {e}", r.id))?;
        let window = FailureWindow {
            length_ms: r.window_ms,
            bucket: r.window_bucket,
            attempts: r.window_attempts,
            failures: r.window_failures,
            previous_attempts: r.previous_attempts,
            previous_failures: r.previous_failures,
        };
        Ok(Endpoint {
            id: r.id,
            url: r.url,
            event_types: r.event_types,
            enabled: r.enabled,
            disabled_reason: r.disabled_reason,
            created_at: r.created_at,
            secret_rotated_at: r.secret_rotated_at,
            signature_scheme,
            public_key: r.public_key,
            previous_public_key,
            signature_scheme_changed_at: r.signature_scheme_changed_at,
            health: EndpointHealth {
                circuit: r.circuit,
                consecutive_failures: r.consecutive_failures,
                failing_since: r.failing_since,
                last_success_at: r.last_success_at,
                last_failure_at: r.last_failure_at,
                next_probe_at: r.next_probe_at,
                probe_interval_ms: r.probe_interval_ms,
                window,
                failed_retries: r.failed_retries,
                one_at_a_time: r.one_at_a_time,
            },
            recent: window.recent(now),
            held: r.held,
            headers,
            max_in_flight: r.max_in_flight.and_then(|n| u32::try_from(n).ok()),
            filter: r.filter,
            rate_limit: stored_rate(r.id, r.rate_per_second, r.rate_burst)?,
            previous_client_certificate: certificates.as_ref().and_then(|c| c.previous_at(now)).cloned(),
            client_certificate: certificates.map(|c| c.current),
            ca_bundle: r.ca_bundle,
            ordering: r.ordering,
            oauth2: r
                .oauth2_shown
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| anyhow::anyhow!("endpoint {} has shown OAuth2 credentials this api cannot read: {e}", r.id))?,
        })
    }
}

/// A rate limit as stored (both columns or neither, by a CHECK).
fn stored_rate(id: EndpointId, per_second: Option<i32>, burst: Option<i32>) -> anyhow::Result<Option<RateLimit>> {
    match (per_second, burst) {
        (Some(r), Some(b)) => RateLimit::new(u32::try_from(r).unwrap_or(0), u32::try_from(b).unwrap_or(0))
            .map(Some)
            .map_err(|e| anyhow::anyhow!("endpoint {id} has a stored rate limit this api cannot read: {e}")),
        _ => Ok(None),
    }
}

/// Signing material as stored: a secret (or private key) encrypted under a
/// key id, and under the asymmetric scheme its public half.
pub struct NewSigningMaterial<'a> {
    pub key_id: &'a str,
    pub ciphertext: &'a [u8],
    pub public_key: Option<&'a str>,
}

/// A new endpoint's row, checked and sealed.
pub struct NewEndpointRow<'a> {
    pub environment_id: EnvironmentId,
    pub url: &'a str,
    pub event_types: &'a [String],
    pub scheme: Scheme,
    pub material: NewSigningMaterial<'a>,
    pub headers: Option<&'a Sealed>,
    pub max_in_flight: Option<i32>,
    /// The payload filter's text, checked.
    pub filter: Option<&'a str>,
    pub rate_limit: Option<RateLimit>,
    pub client_tls: Option<&'a Sealed>,
    pub ca_bundle: Option<&'a str>,
    pub oauth2: Option<&'a Sealed>,
    pub ordering: Ordering,
}

/// The new endpoint's id.
pub async fn insert(tx: &mut PgConnection, row: NewEndpointRow<'_>) -> AppResult<EndpointId> {
    let NewEndpointRow {
        environment_id,
        url,
        event_types,
        scheme,
        material,
        headers,
        max_in_flight,
        filter,
        rate_limit,
        client_tls,
        ca_bundle,
        oauth2,
        ordering,
    } = row;
    Ok(sqlx::query_scalar!(
        r#"INSERT INTO webhook_endpoints (id, environment_id, url, event_types, signature_scheme, secret_key_id, secret_ciphertext, public_key,
                                        headers_key_id, headers_ciphertext, headers_shown, max_in_flight, filter,
                                        rate_per_second, rate_burst, client_tls_key_id, client_tls_ciphertext, client_certificate_shown,
                                        ca_bundle, oauth2_key_id, oauth2_ciphertext, oauth2_shown, ordering)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, COALESCE($11, '[]'::jsonb), $12, $13, $14, $15, $16, $17, $18, $19,
                 $20, $21, $22, $23) RETURNING id AS "id: EndpointId""#,
        EndpointId::mint() as _,
        environment_id as _,
        url,
        event_types,
        scheme.as_str(),
        material.key_id,
        material.ciphertext,
        material.public_key,
        headers.map(|h| h.key_id.as_str()),
        headers.map(|h| h.ciphertext.as_slice()),
        headers.map(|h| &h.shown),
        max_in_flight,
        filter,
        rate_limit.map(|r| r.per_second() as i32),
        rate_limit.map(|r| r.burst() as i32),
        client_tls.map(|t| t.key_id.as_str()),
        client_tls.map(|t| t.ciphertext.as_slice()),
        client_tls.map(|t| &t.shown),
        ca_bundle,
        oauth2.map(|o| o.key_id.as_str()),
        oauth2.map(|o| o.ciphertext.as_slice()),
        oauth2.map(|o| &o.shown),
        ordering as _,
    )
    .fetch_one(&mut *tx)
    .await?)
}

/// The live endpoints of an environment (`id` = `None`), or one of them, as
/// read at `now`.
async fn select(
    conn: &mut PgConnection,
    environment_id: EnvironmentId,
    id: Option<EndpointId>,
    now: Timestamp,
) -> AppResult<Vec<Endpoint>> {
    sqlx::query_as!(
        EndpointRow,
        r#"SELECT e.id, e.url, e.event_types, e.enabled, e.disabled_reason AS "disabled_reason?: DisabledReason", e.created_at,
                  e.secret_rotated_at, e.signature_scheme, e.public_key, e.previous_public_key, e.signature_scheme_changed_at,
                  h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, h.window_ms, h.window_bucket, h.window_attempts,
                  h.window_failures, h.previous_attempts, h.previous_failures, h.failed_retries, h.one_at_a_time,
                  (SELECT count(*) FROM webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'held') AS "held!",
                  e.headers_shown, e.max_in_flight, e.filter, e.rate_per_second, e.rate_burst,
                  e.client_certificate_shown, e.ca_bundle, e.oauth2_shown, e.ordering AS "ordering: Ordering"
           FROM webhook_endpoints e JOIN endpoint_health h ON h.endpoint_id = e.id
           WHERE e.environment_id = $1 AND e.deleted_at IS NULL AND ($2::uuid IS NULL OR e.id = $2)
           ORDER BY e.created_at, e.id"#,
        environment_id as _,
        id as _,
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| r.read_at(now).map_err(Into::into))
    .collect()
}

pub async fn list(db: &PgPool, environment_id: EnvironmentId, now: Timestamp) -> AppResult<Vec<Endpoint>> {
    select(&mut *db.acquire().await?, environment_id, None, now).await
}

pub async fn get(conn: &mut PgConnection, environment_id: EnvironmentId, id: EndpointId, now: Timestamp) -> AppResult<Option<Endpoint>> {
    Ok(select(conn, environment_id, Some(id), now).await?.pop())
}

/// A live endpoint's scheme, current secret and sealed client identity, its
/// row locked for a change of any; `None` when there is no such endpoint.
pub struct LockedSigning {
    pub signature_scheme: String,
    pub secret_key_id: String,
    pub secret_ciphertext: Vec<u8>,
    pub client_tls_key_id: Option<String>,
    pub client_tls_ciphertext: Option<Vec<u8>>,
    pub client_certificate_shown: Option<serde_json::Value>,
}

pub async fn lock_signing(tx: &mut PgConnection, environment_id: EnvironmentId, id: EndpointId) -> AppResult<Option<LockedSigning>> {
    Ok(sqlx::query_as!(
        LockedSigning,
        "SELECT signature_scheme, secret_key_id, secret_ciphertext, client_tls_key_id, client_tls_ciphertext, client_certificate_shown
         FROM webhook_endpoints WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL FOR UPDATE",
        id as _,
        environment_id as _,
    )
    .fetch_optional(&mut *tx)
    .await?)
}

/// The new material becomes current; the current one becomes the previous
/// one (public key too), signing beside it for the rotation window.
pub async fn rotate_secret(tx: &mut PgConnection, id: EndpointId, material: NewSigningMaterial<'_>) -> AppResult<()> {
    sqlx::query!(
        "UPDATE webhook_endpoints SET
           previous_secret_key_id = secret_key_id,
           previous_secret_ciphertext = secret_ciphertext,
           previous_public_key = public_key,
           secret_key_id = $2, secret_ciphertext = $3, public_key = $4, secret_rotated_at = now()
         WHERE id = $1",
        id as _,
        material.key_id,
        material.ciphertext,
        material.public_key,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What an update changes; `None` leaves a column as it is.
pub struct EndpointUpdate<'a> {
    pub url: Option<&'a str>,
    pub event_types: Option<&'a [String]>,
    pub scheme: Option<Scheme>,
    /// Material of another kind for a new scheme: it replaces the current
    /// material outright (no rotation window: the old material cannot sign
    /// under the new scheme).
    pub material: Option<NewSigningMaterial<'a>>,
    /// New custom headers: `Some(None)` removes them all.
    pub headers: Option<Option<&'a Sealed>>,
    /// A new in-flight cap: `Some(None)` returns to the platform's.
    pub max_in_flight: Option<Option<i32>>,
    /// A new payload filter (checked): `Some(None)` removes it.
    pub filter: Option<Option<&'a str>>,
    /// A new rate limit: `Some(None)` removes it.
    pub rate_limit: Option<Option<RateLimit>>,
    /// A new client certificate: `Some(None)` removes it.
    pub client_tls: Option<Option<&'a Sealed>>,
    /// A new CA bundle: `Some(None)` removes it.
    pub ca_bundle: Option<Option<&'a str>>,
    /// New OAuth2 client credentials: `Some(None)` removes them.
    pub oauth2: Option<Option<&'a Sealed>>,
    /// A new ordering, for deliveries created from now on.
    pub ordering: Option<Ordering>,
}

/// Applies an update to an endpoint locked by `lock_signing`.
pub async fn update(tx: &mut PgConnection, id: EndpointId, change: EndpointUpdate<'_>) -> AppResult<()> {
    let material = change.material.as_ref();
    let (headers, client_tls, oauth2) = (change.headers.flatten(), change.client_tls.flatten(), change.oauth2.flatten());
    sqlx::query!(
        "UPDATE webhook_endpoints SET
           url = COALESCE($2, url),
           event_types = COALESCE($3, event_types),
           signature_scheme_changed_at = CASE WHEN $4::text <> signature_scheme THEN now() ELSE signature_scheme_changed_at END,
           signature_scheme = COALESCE($4, signature_scheme),
           secret_key_id = COALESCE($5, secret_key_id),
           secret_ciphertext = COALESCE($6, secret_ciphertext),
           public_key = CASE WHEN $5::text IS NULL THEN public_key ELSE $7 END,
           previous_secret_key_id = CASE WHEN $5::text IS NULL THEN previous_secret_key_id END,
           previous_secret_ciphertext = CASE WHEN $5::text IS NULL THEN previous_secret_ciphertext END,
           previous_public_key = CASE WHEN $5::text IS NULL THEN previous_public_key END,
           secret_rotated_at = CASE WHEN $5::text IS NULL THEN secret_rotated_at END,
           headers_key_id = CASE WHEN $8 THEN $9 ELSE headers_key_id END,
           headers_ciphertext = CASE WHEN $8 THEN $10 ELSE headers_ciphertext END,
           headers_shown = CASE WHEN $8 THEN COALESCE($11, '[]'::jsonb) ELSE headers_shown END,
           max_in_flight = CASE WHEN $12 THEN $13 ELSE max_in_flight END,
           filter = CASE WHEN $14 THEN $15 ELSE filter END,
           rate_per_second = CASE WHEN $16 THEN $17 ELSE rate_per_second END,
           rate_burst = CASE WHEN $16 THEN $18 ELSE rate_burst END,
           client_tls_key_id = CASE WHEN $19 THEN $20 ELSE client_tls_key_id END,
           client_tls_ciphertext = CASE WHEN $19 THEN $21 ELSE client_tls_ciphertext END,
           client_certificate_shown = CASE WHEN $19 THEN $22 ELSE client_certificate_shown END,
           ca_bundle = CASE WHEN $23 THEN $24 ELSE ca_bundle END,
           oauth2_key_id = CASE WHEN $25 THEN $26 ELSE oauth2_key_id END,
           oauth2_ciphertext = CASE WHEN $25 THEN $27 ELSE oauth2_ciphertext END,
           oauth2_shown = CASE WHEN $25 THEN $28 ELSE oauth2_shown END,
           ordering = COALESCE($29, ordering)
         WHERE id = $1",
        id as _,
        change.url,
        change.event_types,
        change.scheme.map(Scheme::as_str),
        material.map(|m| m.key_id),
        material.map(|m| m.ciphertext),
        material.and_then(|m| m.public_key),
        change.headers.is_some(),
        headers.map(|h| h.key_id.as_str()),
        headers.map(|h| h.ciphertext.as_slice()),
        headers.map(|h| &h.shown),
        change.max_in_flight.is_some(),
        change.max_in_flight.flatten(),
        change.filter.is_some(),
        change.filter.flatten(),
        change.rate_limit.is_some(),
        change.rate_limit.flatten().map(|r| r.per_second() as i32),
        change.rate_limit.flatten().map(|r| r.burst() as i32),
        change.client_tls.is_some(),
        client_tls.map(|t| t.key_id.as_str()),
        client_tls.map(|t| t.ciphertext.as_slice()),
        client_tls.map(|t| &t.shown),
        change.ca_bundle.is_some(),
        change.ca_bundle.flatten(),
        change.oauth2.is_some(),
        oauth2.map(|o| o.key_id.as_str()),
        oauth2.map(|o| o.ciphertext.as_slice()),
        oauth2.map(|o| &o.shown),
        change.ordering as _,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Enables (`reason` = `None`) or disables a live endpoint; returns why it
/// was disabled before, or `None` when there is no such endpoint.
pub async fn set_disabled(
    tx: &mut PgConnection,
    environment_id: EnvironmentId,
    id: EndpointId,
    reason: Option<DisabledReason>,
) -> AppResult<Option<Option<DisabledReason>>> {
    Ok(sqlx::query_scalar!(
        r#"UPDATE webhook_endpoints e SET enabled = $3::text IS NULL, disabled_reason = $3
           FROM (SELECT id, disabled_reason FROM webhook_endpoints WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL FOR UPDATE) old
           WHERE e.id = old.id
           RETURNING old.disabled_reason AS "before?: DisabledReason""#,
        id as _,
        environment_id as _,
        reason.map(|r| r.as_str()),
    )
    .fetch_optional(&mut *tx)
    .await?)
}

/// Relay's own disable or re-enable of endpoints (health rules), whatever
/// their environment.
pub async fn set_disabled_by_health(tx: &mut PgConnection, ids: &[EndpointId], reason: Option<DisabledReason>) -> AppResult<()> {
    sqlx::query!(
        "UPDATE webhook_endpoints SET enabled = $2::text IS NULL, disabled_reason = $2 WHERE id = ANY ($1) AND deleted_at IS NULL",
        ids as _,
        reason.map(|r| r.as_str()),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Soft: the row stays so its dead letters can. False when there was no
/// such live endpoint.
pub async fn soft_delete(tx: &mut PgConnection, environment_id: EnvironmentId, id: EndpointId) -> AppResult<bool> {
    Ok(sqlx::query!(
        "UPDATE webhook_endpoints SET deleted_at = now() WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL",
        id as _,
        environment_id as _
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1)
}

/// The environment a live endpoint belongs to (an operator's call names
/// only the endpoint).
pub async fn environment_of(db: &PgPool, id: EndpointId) -> AppResult<Option<EnvironmentId>> {
    Ok(sqlx::query_scalar!("SELECT environment_id FROM webhook_endpoints WHERE id = $1 AND deleted_at IS NULL", id as _)
        .fetch_optional(db)
        .await?
        .map(EnvironmentId::from))
}
