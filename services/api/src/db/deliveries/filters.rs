//! What payload filters need at expansion: the filters of the environments
//! being expanded for, and the bodies of the events they must read.

use relay_domain::{EndpointId, EnvironmentId, EventId};
use sqlx::PgConnection;

use crate::error::AppResult;

/// A live endpoint with a payload filter.
pub struct FilteredEndpoint {
    pub id: EndpointId,
    pub environment_id: EnvironmentId,
    pub event_types: Vec<String>,
    pub filter: String,
}

/// The live endpoints with a filter in these environments, from the partial
/// index (an environment without filters costs an empty probe).
pub async fn filtered_endpoints(conn: &mut PgConnection, environments: &[EnvironmentId]) -> AppResult<Vec<FilteredEndpoint>> {
    Ok(sqlx::query_as!(
        FilteredEndpoint,
        r#"SELECT id AS "id: EndpointId", environment_id AS "environment_id: EnvironmentId", event_types, filter AS "filter!"
           FROM webhook_endpoints WHERE environment_id = ANY ($1) AND filter IS NOT NULL AND deleted_at IS NULL"#,
        environments as _,
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// An event's body as every attempt sends it.
pub struct EventBody {
    pub environment_id: EnvironmentId,
    pub id: EventId,
    pub envelope: Vec<u8>,
}

/// The bodies of these events (pairs by position).
pub async fn event_bodies(conn: &mut PgConnection, environments: &[EnvironmentId], ids: &[EventId]) -> AppResult<Vec<EventBody>> {
    Ok(sqlx::query_as!(
        EventBody,
        r#"SELECT v.environment_id AS "environment_id: EnvironmentId", v.id AS "id: EventId", v.envelope
           FROM UNNEST($1::uuid[], $2::uuid[]) AS k(environment_id, id)
           JOIN events v ON v.environment_id = k.environment_id AND v.id = k.id
           -- The keys as an index condition too (INDEXED_LOOKUPS).
           WHERE v.environment_id = ANY ($1::uuid[]) AND v.id = ANY ($2::uuid[])"#,
        environments as _,
        ids as _,
    )
    .fetch_all(&mut *conn)
    .await?)
}
