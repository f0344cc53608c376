//! The routes under fuzz (from docs/openapi.json) and the world they run
//! in: two tenants' real ids, pooled as the api hands them out.

use super::*;

#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) method: String,
    pub(crate) template: String,
    /// The JSON body's fields (name, JSON Schema type, "" when any value),
    /// for routes that take a body.
    pub(crate) body: Option<Vec<(String, String)>>,
}

impl Route {
    pub(crate) fn params(&self) -> Vec<&str> {
        self.template.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).collect()
    }
}

pub(crate) fn routes() -> Vec<Route> {
    let spec: Value = serde_json::from_str(include_str!("../../docs/openapi.json")).expect("docs/openapi.json is JSON");
    let paths = spec["paths"].as_object().expect("the spec has paths");
    let mut out = Vec::new();
    for (template, item) in paths {
        for (method, op) in item.as_object().expect("a path item is an object") {
            if !["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                continue;
            }
            let body = op.get("requestBody").map(|rb| {
                rb["content"]["application/json"]["schema"]["properties"]
                    .as_object()
                    .map(|props| props.iter().map(|(k, v)| (k.clone(), v["type"].as_str().unwrap_or_default().to_owned())).collect())
                    .unwrap_or_default()
            });
            out.push(Route { method: method.to_uppercase(), template: template.clone(), body });
        }
    }
    out
}

// ---------------------------------------------------------------------------
// What the fuzzer knows: keys, ids and who owns them.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Tenant {
    Own,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Endpoint,
    Event,
    DeadLetter,
}

/// Which kind of id a path parameter takes (`None`: unknown, a random UUID).
pub(crate) fn param_kind(template: &str, param: &str) -> Option<Kind> {
    if param.contains("event") {
        Some(Kind::Event)
    } else if template.contains("dead-letter") {
        Some(Kind::DeadLetter)
    } else if template.contains("webhook") || param.contains("endpoint") {
        Some(Kind::Endpoint)
    } else {
        None
    }
}

#[derive(Default)]
pub(crate) struct Ids {
    pub(crate) pools: HashMap<(Tenant, Kind), Vec<String>>,
    /// Who owns each id: `None` when both tenants have one by that id (event
    /// ids are unique per environment, not across them).
    pub(crate) owner: HashMap<String, Option<Tenant>>,
}

impl Ids {
    pub(crate) fn add(&mut self, who: Tenant, kind: Kind, id: &str) {
        let Ok(id) = Uuid::parse_str(id).map(|u| u.to_string()) else { return };
        match self.owner.get(&id) {
            None => {
                self.owner.insert(id.clone(), Some(who));
            }
            Some(Some(w)) if *w != who => {
                self.owner.insert(id.clone(), None);
            }
            _ => {}
        }
        let pool = self.pools.entry((who, kind)).or_default();
        if pool.len() < POOL_CAP && !pool.contains(&id) {
            pool.push(id);
        }
    }

    pub(crate) fn any(&self, rng: &mut Rng, who: Tenant, kind: Kind) -> Option<String> {
        let pool = self.pools.get(&(who, kind)).filter(|p| !p.is_empty())?;
        Some(rng.pick(pool).clone())
    }

    pub(crate) fn any_kind(&self, rng: &mut Rng, who: Tenant) -> Option<String> {
        let kind = rng.choose(&[Kind::Endpoint, Kind::Event, Kind::DeadLetter]);
        self.any(rng, who, kind).or_else(|| self.any(rng, who, Kind::Endpoint))
    }
}

pub(crate) struct World {
    pub(crate) addr: SocketAddr,
    pub(crate) own_key: String,
    pub(crate) other_key: String,
    /// Where endpoints made by the fuzzer point (a loopback receiver).
    pub(crate) created_url: String,
    /// An event id either tenant may publish: repeated publishes are duplicates.
    pub(crate) shared_event_id: String,
    pub(crate) routes: Vec<Route>,
    pub(crate) ids: Mutex<Ids>,
}

impl World {
    pub(crate) fn ids(&self) -> std::sync::MutexGuard<'_, Ids> {
        self.ids.lock().expect("the id pools are never poisoned")
    }
}

// ---------------------------------------------------------------------------
// A request, kept in parts so that mutations can reach each of them.
