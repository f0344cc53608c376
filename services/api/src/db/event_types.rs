//! `event_types`: each environment's event catalogue, and the environment's
//! `require_known_event_types`. Schemas and examples are stored as the text
//! sent; the use-cases check them before they get here.

use relay_domain::{EnvironmentId, catalogue::EventType};
use sqlx::PgPool;

use crate::error::AppResult;

/// A new entry, checked.
pub struct NewEventType<'a> {
    pub name: &'a str,
    pub description: &'a str,
    pub schema: Option<&'a str>,
    pub examples: &'a str,
    pub deprecated: bool,
}

/// What an insert did.
pub enum Inserted {
    Created(EventType),
    Exists,
    Full,
}

/// Adds an entry unless the catalogue has the name or is full. The count
/// and the insert are one statement; two concurrent creates may both see
/// room for the last place, which overshoots the bound by at most the
/// number of apis racing, never without limit.
pub async fn insert(db: &PgPool, env: EnvironmentId, new: &NewEventType<'_>, max: i64) -> AppResult<Inserted> {
    let row = sqlx::query_as!(
        EventType,
        r#"INSERT INTO event_types (environment_id, name, description, schema, examples, deprecated)
           SELECT $1, $2, $3, $4, $5, $6
           WHERE (SELECT count(*) FROM event_types WHERE environment_id = $1) < $7
           ON CONFLICT (environment_id, name) DO NOTHING
           RETURNING name, description, schema, examples, deprecated, revision, created_at, updated_at"#,
        env as _,
        new.name,
        new.description,
        new.schema,
        new.examples,
        new.deprecated,
        max,
    )
    .fetch_optional(db)
    .await?;
    Ok(match row {
        Some(t) => Inserted::Created(t),
        None if get(db, env, new.name).await?.is_some() => Inserted::Exists,
        None => Inserted::Full,
    })
}

pub async fn list(db: &PgPool, env: EnvironmentId) -> AppResult<Vec<EventType>> {
    Ok(sqlx::query_as!(
        EventType,
        "SELECT name, description, schema, examples, deprecated, revision, created_at, updated_at
         FROM event_types WHERE environment_id = $1 ORDER BY name",
        env as _,
    )
    .fetch_all(db)
    .await?)
}

pub async fn get(db: &PgPool, env: EnvironmentId, name: &str) -> AppResult<Option<EventType>> {
    Ok(sqlx::query_as!(
        EventType,
        "SELECT name, description, schema, examples, deprecated, revision, created_at, updated_at
         FROM event_types WHERE environment_id = $1 AND name = $2",
        env as _,
        name,
    )
    .fetch_optional(db)
    .await?)
}

/// Writes an entry's new state (the caller read it, checked the change and
/// passes the revision it read): `None` if it is gone or changed meanwhile.
pub async fn replace(db: &PgPool, env: EnvironmentId, read_revision: i64, t: &NewEventType<'_>) -> AppResult<Option<EventType>> {
    Ok(sqlx::query_as!(
        EventType,
        "UPDATE event_types SET description = $4, schema = $5, examples = $6, deprecated = $7,
                revision = revision + 1, updated_at = now()
         WHERE environment_id = $1 AND name = $2 AND revision = $3
         RETURNING name, description, schema, examples, deprecated, revision, created_at, updated_at",
        env as _,
        t.name,
        read_revision,
        t.description,
        t.schema,
        t.examples,
        t.deprecated,
    )
    .fetch_optional(db)
    .await?)
}

pub async fn delete(db: &PgPool, env: EnvironmentId, name: &str) -> AppResult<bool> {
    let done = sqlx::query!("DELETE FROM event_types WHERE environment_id = $1 AND name = $2", env as _, name).execute(db).await?;
    Ok(done.rows_affected() > 0)
}

pub async fn require_known(db: &PgPool, env: EnvironmentId) -> AppResult<bool> {
    Ok(sqlx::query_scalar!("SELECT require_known_event_types FROM environments WHERE id = $1", env as _)
        .fetch_optional(db)
        .await?
        .unwrap_or(false))
}

pub async fn set_require_known(db: &PgPool, env: EnvironmentId, require: bool) -> AppResult<()> {
    sqlx::query!("UPDATE environments SET require_known_event_types = $2 WHERE id = $1", env as _, require).execute(db).await?;
    Ok(())
}

/// What a publish needs of its environment: whether it requires known
/// types, whether it has a publish limit, and each type's revision and
/// whether it has a schema (the schemas themselves are read by
/// [`schemas`], only when their revision is new to the reader).
pub struct Snapshot {
    pub require_known: bool,
    /// Whether the environment has a publish limit (admission control).
    pub publish_limited: bool,
    pub types: Vec<(String, i64, bool)>,
}

pub async fn snapshot(db: &PgPool, env: EnvironmentId) -> AppResult<Snapshot> {
    let rows = sqlx::query!(
        r#"SELECT e.require_known_event_types AS "require_known!", e.publish_per_second IS NOT NULL AS "publish_limited!",
                  t.name AS "name?", t.revision AS "revision?", t.schema IS NOT NULL AS "has_schema?"
           FROM environments e LEFT JOIN event_types t ON t.environment_id = e.id
           WHERE e.id = $1"#,
        env as _,
    )
    .fetch_all(db)
    .await?;
    let require_known = rows.first().is_some_and(|r| r.require_known);
    let publish_limited = rows.first().is_some_and(|r| r.publish_limited);
    let types = rows.into_iter().filter_map(|r| Some((r.name?, r.revision?, r.has_schema?))).collect();
    Ok(Snapshot { require_known, publish_limited, types })
}

/// The schemas of these types, with their revisions.
pub async fn schemas(db: &PgPool, env: EnvironmentId, names: &[String]) -> AppResult<Vec<(String, i64, Option<String>)>> {
    let rows =
        sqlx::query!("SELECT name, revision, schema FROM event_types WHERE environment_id = $1 AND name = ANY ($2)", env as _, names,)
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(|r| (r.name, r.revision, r.schema)).collect())
}

/// Which of `names` the environment's catalogue lacks.
pub async fn unknown(db: &PgPool, env: EnvironmentId, names: &[String]) -> AppResult<Vec<String>> {
    Ok(sqlx::query_scalar!(
        r#"SELECT n AS "name!" FROM UNNEST($2::text[]) AS n
           WHERE NOT EXISTS (SELECT 1 FROM event_types t WHERE t.environment_id = $1 AND t.name = n)"#,
        env as _,
        names,
    )
    .fetch_all(db)
    .await?)
}
