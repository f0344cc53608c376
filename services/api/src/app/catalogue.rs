//! The event catalogue (`relay_domain::catalogue`): its entries kept, and
//! every publish checked against it (and admitted, if its environment has a
//! publish limit). Each api keeps, per environment, what a
//! publish needs (whether known types are required; each type's compiled
//! schema) for at most [`FRESH`]; a change made through this api applies to
//! its next publish at once, through another api within [`FRESH`]. A schema
//! is compiled once per revision, not per publish.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use relay_domain::{
    EnvironmentId, Reason,
    catalogue::{self, EventSchema, EventType, MAX_TYPES_PER_ENVIRONMENT},
};

use super::{App, Tenant};
use crate::{
    db::{self, event_types::NewEventType},
    error::{AppError, AppResult, ErrorCode, quoted},
};

/// How long an api trusts what it read of a catalogue.
pub const FRESH: Duration = Duration::from_secs(1);
/// Environments whose catalogue one api keeps at once; past it, it starts over.
const KEPT_ENVIRONMENTS: usize = 10_000;

/// One environment's catalogue as a publish needs it.
pub(crate) struct Known {
    read_at: Instant,
    require_known: bool,
    /// An operator limits how fast it publishes (see `App::admit_publish`).
    publish_limited: bool,
    /// Each type's revision and compiled schema (`None`: not checked).
    types: HashMap<String, (i64, Option<Arc<EventSchema>>)>,
}

/// What this api read of each environment's catalogue.
#[derive(Default)]
pub struct Catalogues {
    known: Mutex<HashMap<EnvironmentId, Arc<Known>>>,
}

impl std::fmt::Debug for Catalogues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Catalogues({} environments)", self.known.lock().map_or(0, |m| m.len()))
    }
}

impl Catalogues {
    fn forget(&self, env: EnvironmentId) {
        self.known.lock().expect("unpoisoned").remove(&env);
    }
}

/// A catalogue entry's fields as a create or update gives them.
pub struct EventTypeFields<'a> {
    pub description: &'a str,
    /// JSON text; empty: none.
    pub schema: &'a str,
    /// A JSON array as text; empty: none.
    pub examples: &'a str,
    pub deprecated: bool,
}

/// An update: what is given changes.
pub struct EventTypeChange<'a> {
    pub description: Option<&'a str>,
    /// JSON text; empty: unchanged.
    pub schema: &'a str,
    pub clear_schema: bool,
    /// A JSON array as text; empty: unchanged.
    pub examples: &'a str,
    pub deprecated: Option<bool>,
}

fn checked_name(name: &str) -> AppResult<&str> {
    let name = name.trim();
    catalogue::check_name(name).map_err(|r| AppError::invalid(Reason::InvalidEventType, r.0))?;
    Ok(name)
}

/// Checks an entry's fields; the schema compiled, if any.
fn checked(f: &EventTypeFields<'_>) -> AppResult<Option<EventSchema>> {
    catalogue::check_description(f.description).map_err(|r| AppError::invalid(Reason::InvalidDescription, r.0))?;
    let schema = if f.schema.trim().is_empty() {
        None
    } else {
        Some(EventSchema::compile(f.schema).map_err(|r| AppError::invalid(Reason::InvalidSchema, r.0))?)
    };
    if !f.examples.trim().is_empty() {
        catalogue::check_examples(schema.as_ref(), f.examples).map_err(|r| AppError::invalid(Reason::InvalidExamples, r.0))?;
    }
    Ok(schema)
}

fn stored<'a>(name: &'a str, f: &EventTypeFields<'a>) -> NewEventType<'a> {
    NewEventType {
        name,
        description: f.description,
        schema: Some(f.schema).filter(|s| !s.trim().is_empty()),
        examples: if f.examples.trim().is_empty() { "[]" } else { f.examples },
        deprecated: f.deprecated,
    }
}

impl App {
    pub async fn create_event_type(&self, tenant: Tenant, name: &str, fields: EventTypeFields<'_>) -> AppResult<EventType> {
        let name = checked_name(name)?;
        checked(&fields)?;
        let env = tenant.environment_id;
        let out = match db::event_types::insert(&self.db, env, &stored(name, &fields), MAX_TYPES_PER_ENVIRONMENT).await? {
            db::event_types::Inserted::Created(t) => t,
            db::event_types::Inserted::Exists => {
                return Err(AppError::new(
                    ErrorCode::AlreadyExists,
                    Reason::EventTypeExists,
                    format!("the catalogue already has {}; change it with an update", quoted(name)),
                ));
            }
            db::event_types::Inserted::Full => {
                return Err(AppError::precondition(
                    Reason::CatalogueFull,
                    format!("the catalogue holds at most {MAX_TYPES_PER_ENVIRONMENT} event types and is full"),
                ));
            }
        };
        self.catalogues.forget(env);
        Ok(out)
    }

    pub async fn list_event_types(&self, tenant: Tenant) -> AppResult<Vec<EventType>> {
        db::event_types::list(&self.db, tenant.environment_id).await
    }

    pub async fn get_event_type(&self, tenant: Tenant, name: &str) -> AppResult<EventType> {
        let name = checked_name(name)?;
        db::event_types::get(&self.db, tenant.environment_id, name).await?.ok_or_else(|| AppError::not_found("event type"))
    }

    /// Applies `change` to the entry as read; an entry changed meanwhile by
    /// someone else is read again and the change checked against it.
    pub async fn update_event_type(&self, tenant: Tenant, name: &str, change: EventTypeChange<'_>) -> AppResult<EventType> {
        let name = checked_name(name)?;
        let env = tenant.environment_id;
        for _ in 0..3 {
            // Whether it exists first: a name that is not this tenant's
            // answers 404 whatever the body says.
            let now = db::event_types::get(&self.db, env, name).await?.ok_or_else(|| AppError::not_found("event type"))?;
            if change.clear_schema && !change.schema.trim().is_empty() {
                return Err(AppError::invalid(Reason::InvalidSchema, "schema and clear_schema cannot both be given"));
            }
            let schema = match (change.clear_schema, change.schema.trim().is_empty()) {
                (true, _) => "",
                (false, true) => now.schema.as_deref().unwrap_or(""),
                (false, false) => change.schema,
            };
            let fields = EventTypeFields {
                description: change.description.unwrap_or(&now.description),
                schema,
                examples: if change.examples.trim().is_empty() { &now.examples } else { change.examples },
                deprecated: change.deprecated.unwrap_or(now.deprecated),
            };
            checked(&fields)?;
            if let Some(t) = db::event_types::replace(&self.db, env, now.revision, &stored(name, &fields)).await? {
                self.catalogues.forget(env);
                return Ok(t);
            }
        }
        Err(AppError::precondition(Reason::Error, format!("{} kept changing while this update was checked; try again", quoted(name))))
    }

    pub async fn delete_event_type(&self, tenant: Tenant, name: &str) -> AppResult<()> {
        let name = checked_name(name)?;
        if !db::event_types::delete(&self.db, tenant.environment_id, name).await? {
            return Err(AppError::not_found("event type"));
        }
        self.catalogues.forget(tenant.environment_id);
        Ok(())
    }

    pub async fn require_known_event_types(&self, tenant: Tenant) -> AppResult<bool> {
        db::event_types::require_known(&self.db, tenant.environment_id).await
    }

    pub async fn set_require_known_event_types(&self, tenant: Tenant, require: bool) -> AppResult<bool> {
        db::event_types::set_require_known(&self.db, tenant.environment_id, require).await?;
        self.catalogues.forget(tenant.environment_id);
        Ok(require)
    }

    /// Refuses a publish of `event_type` the catalogue does not allow: an
    /// unknown type where known ones are required, or a payload that fails
    /// the type's schema (the first violations, with their JSON pointers).
    pub(crate) fn check_against_catalogue(&self, known: &Known, event_type: &str, payload: &str) -> AppResult<()> {
        let Some((_, schema)) = known.types.get(event_type) else {
            if known.require_known {
                return Err(AppError::invalid(
                    Reason::UnknownEventType,
                    format!("type {} is not in this environment's event catalogue, which requires known types", quoted(event_type)),
                ));
            }
            return Ok(());
        };
        let Some(schema) = schema else { return Ok(()) };
        // Checked as serde_json reads it; what is stored is the text.
        let value: serde_json::Value = serde_json::from_str(if payload.trim().is_empty() { "null" } else { payload })
            .map_err(|e| AppError::invalid(Reason::InvalidPayload, format!("payload is not JSON: {e}")))?;
        let violations = schema.violations(&value);
        if violations.is_empty() {
            return Ok(());
        }
        let listed: Vec<String> = violations.iter().map(ToString::to_string).collect();
        Err(AppError::invalid(
            Reason::PayloadSchemaMismatch,
            format!(
                "payload does not satisfy the schema of {} ({} violation{}{}): {}",
                quoted(event_type),
                violations.len(),
                if violations.len() == 1 { "" } else { "s" },
                if violations.len() == catalogue::MAX_VIOLATIONS { " shown, there may be more" } else { "" },
                listed.join("; ")
            ),
        ))
    }

    /// Admission control: a publish to an environment with a publish limit
    /// takes one from its gate, shared by every api, or is refused with
    /// when to retry. An environment without one (the default) costs no
    /// statement: whether it has one is read with its catalogue.
    pub(crate) async fn admit_publish(&self, env: EnvironmentId, known: &Known) -> AppResult<()> {
        if !known.publish_limited {
            return Ok(());
        }
        match db::environments::take_publish(&self.db, env).await? {
            Ok(()) => Ok(()),
            Err(wait) => Err(AppError::exhausted(
                Reason::PublishRateLimited,
                format!("this environment's publish limit is reached; nothing was written; retry in {} ms", wait.as_millis().max(1)),
                wait,
            )),
        }
    }

    /// Forgets what this api read of an environment (its limit changed).
    pub(crate) fn forget_environment(&self, env: EnvironmentId) {
        self.catalogues.forget(env);
    }

    /// Whether subscribing to `types` is allowed: in an environment that
    /// requires known types, each must be in the catalogue.
    pub(crate) async fn check_subscriptions(&self, env: EnvironmentId, types: &[String]) -> AppResult<()> {
        if !self.known_catalogue(env).await?.require_known {
            return Ok(());
        }
        let unknown = db::event_types::unknown(&self.db, env, types).await?;
        if let Some(first) = unknown.first() {
            return Err(AppError::invalid(
                Reason::UnknownEventType,
                format!(
                    "event_types lists {} type{} not in this environment's event catalogue, which requires known types: {}{}",
                    unknown.len(),
                    if unknown.len() == 1 { "" } else { "s" },
                    quoted(first),
                    if unknown.len() > 1 { " and others" } else { "" }
                ),
            ));
        }
        Ok(())
    }

    /// The environment's catalogue as read within [`FRESH`]; read again
    /// (compiling only schemas whose revision changed) when older.
    pub(crate) async fn known_catalogue(&self, env: EnvironmentId) -> AppResult<Arc<Known>> {
        let before = self.catalogues.known.lock().expect("unpoisoned").get(&env).cloned();
        if let Some(k) = before.as_ref().filter(|k| k.read_at.elapsed() < FRESH) {
            return Ok(k.clone());
        }
        let read_at = Instant::now();
        let snapshot = db::event_types::snapshot(&self.db, env).await?;
        let mut types = HashMap::with_capacity(snapshot.types.len());
        let mut unread = Vec::new();
        for (name, revision, has_schema) in snapshot.types {
            match before.as_ref().and_then(|k| k.types.get(&name)).filter(|(r, _)| *r == revision) {
                Some((_, same)) => {
                    types.insert(name, (revision, same.clone()));
                }
                None if !has_schema => {
                    types.insert(name, (revision, None));
                }
                None => unread.push(name),
            }
        }
        // Only schemas whose revision is new to this api are read and compiled.
        if !unread.is_empty() {
            for (name, revision, schema) in db::event_types::schemas(&self.db, env, &unread).await? {
                let compiled = match schema.as_deref().map(EventSchema::compile).transpose() {
                    Ok(s) => s.map(Arc::new),
                    // Stored schemas compiled when stored; one that no longer
                    // does (a newer crate's stricter rules) checks nothing
                    // rather than refusing every publish of its type.
                    Err(e) => {
                        tracing::warn!(environment_id = %env, event_type = %name, error = %e, "a stored schema no longer compiles; its type's publishes go unchecked");
                        None
                    }
                };
                types.insert(name, (revision, compiled));
            }
        }
        let known = Arc::new(Known { read_at, require_known: snapshot.require_known, publish_limited: snapshot.publish_limited, types });
        let mut map = self.catalogues.known.lock().expect("unpoisoned");
        if map.len() >= KEPT_ENVIRONMENTS {
            map.clear();
        }
        map.insert(env, known.clone());
        Ok(known)
    }
}
