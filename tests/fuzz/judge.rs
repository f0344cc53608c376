//! What an answer must be: below 500, the JSON error shape, no success
//! without a key or for another tenant's id; the report of what was not.

use super::*;

/// Whose key the server sees: the first `Authorization` header, read as
/// the api reads it (`Bearer <key>`, the key trimmed).
pub(crate) fn credential(req: &Req, world: &World) -> Option<Tenant> {
    let (_, value) = req.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case("authorization"))?;
    let text = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let key = text.strip_prefix("Bearer ")?.trim();
    if key == world.own_key {
        Some(Tenant::Own)
    } else if key == world.other_key {
        Some(Tenant::Other)
    } else {
        None
    }
}

pub(crate) fn percent_decoded(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 3 <= b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// An id in the path owned by a tenant other than the caller's, however spelled.
pub(crate) fn foreign_id(req: &Req, world: &World, caller: Tenant) -> Option<String> {
    let ids = world.ids();
    req.path.split('/').find_map(|seg| {
        let id = Uuid::parse_str(percent_decoded(seg)?.trim()).ok()?.to_string();
        match ids.owner.get(&id) {
            Some(Some(owner)) if *owner != caller => Some(id),
            _ => None,
        }
    })
}

pub(crate) fn error_body_problem(a: &Answer) -> Option<String> {
    if !header(&a.head, "content-type").is_some_and(|v| v.starts_with("application/json")) {
        return Some("an error without a JSON content type".into());
    }
    let v: Value = match serde_json::from_slice(&a.body) {
        Ok(v) => v,
        Err(e) => return Some(format!("an error body that is not JSON ({e})")),
    };
    if !v["code"].is_i64() {
        return Some("an error without an integer code".into());
    }
    if v["reason"].as_str().is_none_or(str::is_empty) {
        return Some("an error without a reason".into());
    }
    match v["message"].as_str() {
        None => Some("an error without a message".into()),
        Some(m) if m.len() > 400 => Some(format!("an error message of {} bytes (it echoes input)", m.len())),
        Some(_) => None,
    }
}

/// Everything wrong with one answer.
pub(crate) fn problems(req: &Req, world: &World, a: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    let head_only = req.method == "HEAD";
    let success = (200..300).contains(&a.status);
    if a.status >= 500 {
        out.push(format!("status {}", a.status));
    }
    if !success
        && !head_only
        && let Some(p) = error_body_problem(a)
    {
        out.push(p);
    }
    if success && !head_only {
        if a.status == 204 {
            if !a.body.is_empty() {
                out.push("a 204 with a body".into());
            }
        } else if !header(&a.head, "content-type").is_some_and(|v| v.starts_with("application/json")) {
            out.push("a success without a JSON content type".into());
        } else if let Err(e) = serde_json::from_slice::<Value>(&a.body) {
            out.push(format!("a success body that is not JSON ({e})"));
        }
    }
    if success {
        match credential(req, world) {
            None => out.push("a success without a valid key".into()),
            Some(caller) => {
                if let Some(id) = foreign_id(req, world, caller) {
                    out.push(format!("a success for the other tenant's id {id}"));
                }
            }
        }
    }
    out
}

/// Ids the api handed out join the pools, owned by the caller.
pub(crate) fn learn(req: &Req, world: &World, a: &Answer) {
    if !(200..300).contains(&a.status) || req.method == "HEAD" {
        return;
    }
    let (Some(who), Ok(v)) = (credential(req, world), serde_json::from_slice::<Value>(&a.body)) else { return };
    let mut ids = world.ids();
    let mut add = |kind, id: &Value| {
        if let Some(id) = id.as_str() {
            ids.add(who, kind, id);
        }
    };
    add(Kind::Endpoint, &v["endpoint"]["id"]);
    add(Kind::Event, &v["event_id"]);
    for e in v["endpoints"].as_array().into_iter().flatten() {
        add(Kind::Endpoint, &e["id"]);
    }
    for d in v["dead_letters"].as_array().into_iter().flatten() {
        add(Kind::DeadLetter, &d["id"]);
    }
}

#[derive(Default)]
pub(crate) struct Report {
    pub(crate) sent: usize,
    pub(crate) statuses: BTreeMap<u16, usize>,
    /// Refusals by their `reason`.
    pub(crate) reasons: BTreeMap<String, usize>,
    pub(crate) timeouts: usize,
    /// Timeouts of requests that gave the server everything it needed.
    pub(crate) hangs: Vec<String>,
    pub(crate) silent: usize,
    /// Answered requests whose path carried the other tenant's id.
    pub(crate) cross_tenant: usize,
    pub(crate) failed: usize,
    pub(crate) failures: Vec<String>,
    pub(crate) kinds: BTreeMap<String, usize>,
}

impl Report {
    pub(crate) fn fail(&mut self, what: &str, index: &str, req: &Req, wire: &Wire, answer: Option<&Answer>) {
        self.failed += 1;
        *self.kinds.entry(what.split(" (").next().unwrap_or(what).to_owned()).or_default() += 1;
        if self.failures.len() < MAX_REPORTED {
            let answer = answer.map_or(String::new(), |a| format!("\n    answer: {} {}", a.status, excerpt(&a.body)));
            self.failures.push(format!(
                "{index} {what} — {} [{}]\n    request: {}{answer}",
                req.route,
                req.applied.join(", "),
                excerpt(&wire.bytes)
            ));
        }
    }

    pub(crate) fn class(&self, lo: u16, hi: u16) -> usize {
        self.statuses.range(lo..hi).map(|(_, n)| n).sum()
    }
}

/// What a fuzz asks of its answers.
pub(crate) trait Judge: Sync {
    fn world(&self) -> &World;
    /// How long one exchange may take.
    fn limit(&self) -> Duration;
    /// Everything wrong with one answer.
    fn problems(&self, req: &Req, a: &Answer) -> Vec<String>;
    /// Whose credential the server reads from the request.
    fn caller(&self, req: &Req) -> Option<Tenant>;
    /// Ids an answer hands out join the pools.
    fn learn(&self, _req: &Req, _a: &Answer) {}
    /// Whether an exchange that timed out is a failure even while the api
    /// stays ready (else it is reported as a hang, unless it may hang).
    fn timeout_fails(&self) -> bool;
}

impl Judge for World {
    fn world(&self) -> &World {
        self
    }

    fn limit(&self) -> Duration {
        EXCHANGE_TIMEOUT
    }

    fn problems(&self, req: &Req, a: &Answer) -> Vec<String> {
        problems(req, self, a)
    }

    fn caller(&self, req: &Req) -> Option<Tenant> {
        credential(req, self)
    }

    fn learn(&self, req: &Req, a: &Answer) {
        learn(req, self, a);
    }

    fn timeout_fails(&self) -> bool {
        false
    }
}
