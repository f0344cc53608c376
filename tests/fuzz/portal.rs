//! The portal's pages and forms under the same fuzz. Each route gets a
//! valid request (the fuzzed tenant's session cookie, its CSRF token, real
//! ids), and `RELAY_FUZZ_PORTAL_REQUESTS` (default 1500) mutated copies are
//! sent as raw bytes. Besides the REST fuzzer's mutations of a request's
//! parts and of its wire format, a portal request gets hostile query and
//! form values (NUL bytes, control characters, invalid percent-encoding,
//! years Postgres cannot store, huge numbers, overlong values), another
//! tenant's, a forged, a dead or no session and CSRF token, and bodies that
//! are too large, trickle or never finish.
//!
//! Every answer must come within the form time limit and a margin (no hang)
//! and be below 500; every answer under `/portal/` is the portal's own (its
//! headers; HTML for a refusal), but for hyper's answers to requests it
//! cannot parse (made before any path is read); no page or form succeeds
//! without a session, no form without that session's CSRF token, and
//! nothing succeeds for the other tenant's id.

use relay_api::portal::{CONTENT_SECURITY_POLICY, FORM_READ_TIMEOUT};
use relay_tests::PortalVisitor;

use super::{portal_values::*, *};

const DEFAULT_PORTAL_REQUESTS: usize = 1500;
/// Every portal request is answered within this: the form time limit, and
/// room for a loaded machine.
const PORTAL_EXCHANGE_TIMEOUT: Duration = Duration::from_secs(FORM_READ_TIMEOUT.as_secs() + 3);
/// How many sessions of the fuzzed tenant the sign-out form may end: it
/// never gets the one the other routes use.
const SPARE_SESSIONS: usize = 4;

/// A portal route: its method, its path (`{endpoint}`, `{event}` and
/// `{dead_letter}` take ids) and the fields of its form (POST) or query (GET).
pub(crate) struct PortalRoute {
    pub(crate) method: &'static str,
    pub(crate) template: &'static str,
    pub(crate) fields: &'static [&'static str],
}

const fn route(method: &'static str, template: &'static str, fields: &'static [&'static str]) -> PortalRoute {
    PortalRoute { method, template, fields }
}

pub(crate) const ENDPOINT_FORM: &[&str] =
    &["url", "event_types", "signature_scheme", "headers", "max_in_flight", "filter", "rate_per_second", "rate_burst", "ordering"];
/// The endpoint page's receiver-authentication form.
pub(crate) const AUTH_FORM: &[&str] = &[
    "client_certificate",
    "client_key",
    "end_overlap",
    "clear_client_certificate",
    "ca_bundle",
    "token_url",
    "client_id",
    "client_secret",
    "scope",
    "audience",
    "clear_oauth2",
];
pub(crate) const ROUTES: &[PortalRoute] = &[
    route("GET", "/portal/", &[]),
    route("GET", "/portal", &[]),
    route("GET", "/portal/enter", &["token"]),
    route("GET", "/portal/endpoints/new", &[]),
    route("GET", "/portal/endpoints/{endpoint}", &["done"]),
    route("GET", "/portal/events", &["type", "since", "until", "id", "before"]),
    route("GET", "/portal/events/{event}", &[]),
    route("GET", "/portal/dead-letters", &[]),
    route("GET", "/portal/assets/portal.css", &[]),
    route("GET", "/portal/assets/portal.js", &[]),
    route("POST", "/portal/logout", &[]),
    route("POST", "/portal/endpoints", ENDPOINT_FORM),
    route("POST", "/portal/endpoints/{endpoint}", ENDPOINT_FORM),
    route("POST", "/portal/endpoints/{endpoint}/auth", AUTH_FORM),
    route("POST", "/portal/endpoints/{endpoint}/rotate", &[]),
    route("POST", "/portal/endpoints/{endpoint}/enable", &[]),
    route("POST", "/portal/endpoints/{endpoint}/disable", &[]),
    route("POST", "/portal/endpoints/{endpoint}/delete", &[]),
    route("POST", "/portal/endpoints/{endpoint}/recover", &[]),
    route("POST", "/portal/dead-letters/{dead_letter}/replay", &["event_id"]),
];
/// Paths that answer without a session.
pub(crate) const PUBLIC: &[&str] = &["/portal", "/portal/assets/portal.css", "/portal/assets/portal.js"];

/// A session: its cookie's value and its CSRF token.
pub(crate) struct Visitor {
    pub(crate) cookie: String,
    pub(crate) csrf: String,
}

impl From<PortalVisitor> for Visitor {
    fn from(v: PortalVisitor) -> Self {
        Self { cookie: v.cookie, csrf: v.csrf }
    }
}

pub(crate) struct PortalWorld {
    pub(crate) base: World,
    pub(crate) own: Visitor,
    pub(crate) other: Visitor,
    /// The fuzzed tenant's sessions for signing out.
    pub(crate) spares: Vec<Visitor>,
}

impl PortalWorld {
    /// The session the server reads from the request (the first
    /// `relay_portal` cookie of a header it can read), whoever's it is.
    fn session_of(&self, req: &Req) -> Option<(Tenant, &Visitor)> {
        let value = req
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("cookie"))
            .filter(|(_, v)| v.iter().all(|b| (32..127).contains(b) || *b == b'\t'))
            .flat_map(|(_, v)| std::str::from_utf8(v).unwrap_or_default().split(';'))
            .find_map(|pair| pair.trim().strip_prefix("relay_portal="))?;
        std::iter::once((Tenant::Own, &self.own))
            .chain(std::iter::once((Tenant::Other, &self.other)))
            .chain(self.spares.iter().map(|s| (Tenant::Own, s)))
            .find(|(_, v)| v.cookie == value)
    }
}

/// A field's valid value, percent-encoded.
pub(crate) fn valid_value(name: &str, rng: &mut Rng, pw: &PortalWorld) -> String {
    match name {
        "token" => rng.uuid(),
        "done" => rng.pick(&["saved", "enabled", "disabled", "recovering"]).to_string(),
        "type" => "fz".into(),
        "since" => "2026-01-01T00:00".into(),
        "until" => "2036-01-01T00:00".into(),
        "id" | "event_id" => pw.base.ids().any(rng, Tenant::Own, Kind::Event).unwrap_or_default(),
        "before" => "1~2030-01-01T00:00:00.000000Z".into(),
        "url" => url_encoded(&pw.base.created_url),
        "event_types" => "fz.portal%0Afz.other".into(),
        "signature_scheme" => rng.pick(&["", "relay-v1", "standard-webhooks"]).to_string(),
        "headers" => rng.pick(&["", "X-Fz%3A%20v", "X-Fz%3A%20v%0AX-Other%3A%20w"]).to_string(),
        "max_in_flight" => rng.pick(&["", "1", "64"]).to_string(),
        "filter" => rng.pick(&["", "%7B%22n%22%3A%7B%22%24gte%22%3A0%7D%7D"]).to_string(),
        "rate_per_second" => rng.pick(&["", "5", "100"]).to_string(),
        "rate_burst" => rng.pick(&["", "1", "10"]).to_string(),
        "ordering" => rng.pick(&["", "none", "per_key"]).to_string(),
        // Empty keeps what is stored (a key or secret is never shown to copy back).
        "client_certificate" | "client_key" | "ca_bundle" | "token_url" | "client_id" | "client_secret" | "scope" | "audience" => {
            String::new()
        }
        "end_overlap" | "clear_client_certificate" | "clear_oauth2" => "on".into(),
        _ => "x".into(),
    }
}

pub(crate) fn url_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// A query's or a form's fields, as sent.
pub(crate) fn fields_of(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').map_or((p.to_owned(), String::new()), |(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

pub(crate) fn joined(fields: &[(String, String)]) -> String {
    fields.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

/// A valid request for `route`, with the fuzzed tenant's session and ids.
pub(crate) fn seed(route: &PortalRoute, rng: &mut Rng, pw: &PortalWorld) -> Req {
    let path = {
        let ids = pw.base.ids();
        route
            .template
            .split('/')
            .map(|seg| {
                let kind = match seg {
                    "{endpoint}" => Kind::Endpoint,
                    "{event}" => Kind::Event,
                    "{dead_letter}" => Kind::DeadLetter,
                    _ => return seg.to_owned(),
                };
                ids.any(rng, Tenant::Own, kind).unwrap_or_else(|| rng.uuid())
            })
            .collect::<Vec<_>>()
            .join("/")
    };
    // Signing out ends the session it is sent with: never the one every
    // other request uses.
    let session = if route.template == "/portal/logout" { rng.pick(&pw.spares) } else { &pw.own };
    let mut headers = vec![
        ("host".to_owned(), b"relay".to_vec()),
        ("connection".to_owned(), b"close".to_vec()),
        ("cookie".to_owned(), format!("relay_portal={}", session.cookie).into_bytes()),
    ];
    let (query, body) = if route.method == "POST" {
        headers.push(("content-type".to_owned(), b"application/x-www-form-urlencoded".to_vec()));
        let mut fields = vec![("csrf".to_owned(), session.csrf.clone())];
        fields.extend(route.fields.iter().map(|f| (f.to_string(), valid_value(f, rng, pw))));
        (None, Body::Form(fields))
    } else {
        let mut fields = Vec::new();
        for f in route.fields {
            if rng.chance(40) {
                fields.push((f.to_string(), valid_value(f, rng, pw)));
            }
        }
        ((!fields.is_empty()).then(|| joined(&fields)), Body::Raw(Vec::new()))
    };
    let mut req = Req::new(route.method, route.template, path, headers, body);
    req.query = query;
    req
}

// ---------------------------------------------------------------------------
// The mutations: the REST fuzzer's that apply to a page or a form, and the
// portal's own.

type PortalMutate = fn(&mut Rng, &mut Req, &PortalWorld);

enum Mutation {
    Rest(Mutate),
    Portal(PortalMutate),
}

/// (name, weight, function), in the order they are applied when stacked.
const PORTAL_MUTATIONS: &[(&str, u64, Mutation)] = &[
    ("method", 4, Mutation::Rest(swap_method)),
    ("path_id", 8, Mutation::Rest(replace_path_segment)),
    ("path_shape", 3, Mutation::Rest(reshape_path)),
    ("query", 3, Mutation::Rest(add_query)),
    ("session", 9, Mutation::Portal(change_session)),
    ("csrf", 8, Mutation::Portal(change_csrf)),
    ("content_type", 3, Mutation::Rest(change_content_type)),
    ("header_flood", 2, Mutation::Rest(flood_headers)),
    ("header_odd", 3, Mutation::Rest(odd_header)),
    ("values", 16, Mutation::Portal(hostile_values)),
    ("form_shape", 5, Mutation::Portal(reshape_fields)),
    ("body_bytes", 3, Mutation::Rest(damage_bytes)),
    ("body_oversize", 2, Mutation::Portal(oversize_form)),
    ("body_slow", 2, Mutation::Portal(slow_body)),
    ("body_unfinished", 3, Mutation::Portal(unfinished_body)),
    ("wire_method", 1, Mutation::Rest(odd_method)),
    ("wire_version", 1, Mutation::Rest(odd_version)),
    ("wire_framing", 4, Mutation::Rest(odd_framing)),
];

fn build(rng: &mut Rng, pw: &PortalWorld) -> Req {
    let route = rng.pick(ROUTES);
    let mut req = seed(route, rng, pw);
    if rng.chance(8) {
        return req;
    }
    let mut picked: Vec<usize> = (0..rng.range(1, 3)).map(|_| pick_weighted(rng, PORTAL_MUTATIONS, |m| m.1)).collect();
    picked.sort_unstable();
    for i in picked {
        let (name, _, mutate) = &PORTAL_MUTATIONS[i];
        match mutate {
            Mutation::Rest(f) => f(rng, &mut req, &pw.base),
            Mutation::Portal(f) => f(rng, &mut req, pw),
        }
        req.applied.push(name);
    }
    req
}

fn change_session(rng: &mut Rng, req: &mut Req, pw: &PortalWorld) {
    req.remove_header("cookie");
    let (own, other) = (&pw.own.cookie, &pw.other.cookie);
    let values: Vec<Vec<u8>> = match rng.below(11) {
        0 => vec![],
        1 => vec![format!("relay_portal={}", rng.uuid().replace('-', "")).into_bytes()],
        2 => vec![format!("relay_portal={other}").into_bytes()],
        3 => vec![b"relay_portal=\xff\xfe".to_vec()],
        4 => vec![format!("relay_portal={own}x").into_bytes()],
        5 => vec![format!("RELAY_PORTAL={own}").into_bytes()],
        6 => vec![format!("a=b; relay_portal={own}; c=%00").into_bytes()],
        7 => {
            let both = [format!("relay_portal={own}").into_bytes(), format!("relay_portal={other}").into_bytes()];
            if rng.chance(50) { both.to_vec() } else { both.into_iter().rev().collect() }
        }
        8 => vec![format!("relay_portal={}", "k".repeat(rng.range(1_000, 9_000))).into_bytes()],
        // A session that signing out may have ended.
        9 => vec![format!("relay_portal={}", rng.pick(&pw.spares).cookie).into_bytes()],
        _ => vec![b"relay_portal=".to_vec()],
    };
    for v in values {
        req.headers.push(("cookie".into(), v));
    }
}

/// The fields to work on: a form's, else the query's.
pub(crate) fn with_fields(req: &mut Req, change: impl FnOnce(&mut Vec<(String, String)>)) {
    match &mut req.body {
        Body::Form(fields) => change(fields),
        _ => {
            let mut fields = fields_of(req.query.as_deref().unwrap_or_default());
            change(&mut fields);
            req.query = (!fields.is_empty()).then(|| joined(&fields));
        }
    }
}

fn change_csrf(rng: &mut Rng, req: &mut Req, pw: &PortalWorld) {
    let own = pw.own.csrf.clone();
    let value = match rng.below(7) {
        0 => None,
        1 => Some("forged".to_owned()),
        2 => Some(pw.other.csrf.clone()),
        3 => Some(format!("{}A", &own[..own.len() - 1])),
        4 => Some(String::new()),
        5 => Some(format!("{own}&csrf={own}")),
        _ => {
            // In the query, where a form's token is never read.
            req.query = Some(format!("csrf={own}"));
            None
        }
    };
    with_fields(req, |fields| {
        fields.retain(|(k, _)| k != "csrf");
        if let Some(v) = value {
            fields.insert(0, ("csrf".into(), v));
        }
    });
}

/// The path as the server routes it: without the scheme and host of an
/// absolute target, the query or a fragment.
pub(crate) fn routed_path(req: &Req) -> &str {
    let path = req.path.strip_prefix("http://relay").unwrap_or(&req.path);
    path.split(['?', '#']).next().unwrap_or_default()
}

/// One of hyper's own answers to a request it could not parse (400, 414,
/// 431; made before any path is read, so never the portal's page), as the
/// REST server rewrites them: JSON, and no portal header. (A HEAD request's
/// answer has no body to read its reason from.)
fn hypers_own(a: &Answer) -> bool {
    [400, 414, 431].contains(&a.status)
        && header(&a.head, "content-security-policy").is_none()
        && header(&a.head, "content-type").is_some_and(|v| v.starts_with("application/json"))
}

impl Judge for PortalWorld {
    fn world(&self) -> &World {
        &self.base
    }

    fn limit(&self) -> Duration {
        PORTAL_EXCHANGE_TIMEOUT
    }

    fn problems(&self, req: &Req, a: &Answer) -> Vec<String> {
        let mut out = Vec::new();
        if a.status >= 500 {
            out.push(format!("status {}", a.status));
        }
        let path = routed_path(req);
        if !relay_api::portal::owns(path) {
            return out;
        }
        if !hypers_own(a) {
            if header(&a.head, "content-security-policy") != Some(CONTENT_SECURITY_POLICY.to_ascii_lowercase().as_str()) {
                out.push("an answer without the portal's CSP".into());
            }
            if a.status >= 400 && !header(&a.head, "content-type").is_some_and(|v| v.starts_with("text/html")) {
                out.push("a refusal that is not the portal's HTML page".into());
            }
        }
        if (200..400).contains(&a.status) && !PUBLIC.contains(&path) {
            match self.session_of(req) {
                None => out.push("a success without a session".into()),
                Some((_, visitor)) if req.method == "POST" => {
                    let body = String::from_utf8_lossy(&req.body.bytes()).into_owned();
                    let tokens: Vec<String> = fields_of(&body).into_iter().filter(|(k, _)| k == "csrf").map(|(_, v)| v).collect();
                    if tokens != [visitor.csrf.clone()] {
                        out.push("a form accepted without its session's CSRF token".into());
                    }
                }
                Some(_) => {}
            }
            if let Some(id) = self.caller(req).and_then(|caller| foreign_id(req, &self.base, caller)) {
                out.push(format!("a success for the other tenant's id {id}"));
            }
        }
        out
    }

    fn caller(&self, req: &Req) -> Option<Tenant> {
        self.session_of(req).map(|(t, _)| t)
    }

    fn timeout_fails(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_portal_route_and_form_survives_hostile_values_sessions_and_slow_bodies_with_its_own_pages_and_no_5xx() -> anyhow::Result<()>
{
    let Fuzz { seed, total, stack, receiver, _alone } = begin("portal fuzz", "RELAY_FUZZ_PORTAL_REQUESTS", DEFAULT_PORTAL_REQUESTS).await?;
    let base = populated(&stack, &receiver, Vec::new()).await?;
    let own = PortalVisitor::enter(&stack.rest_url, &base.own_key).await?.into();
    let other = PortalVisitor::enter(&stack.rest_url, &base.other_key).await?.into();
    let mut spares = Vec::new();
    for _ in 0..SPARE_SESSIONS {
        spares.push(PortalVisitor::enter(&stack.rest_url, &base.own_key).await?.into());
    }
    let pw = Arc::new(PortalWorld { base, own, other, spares });
    let report = Arc::new(Mutex::new(Report::default()));
    let swept = Arc::new(sweep(&pw));
    println!("portal fuzz: {} requests sweep every field with its hostile values first", swept.len());

    let elapsed = fan_out(swept.len() + total, {
        let (pw, report) = (pw.clone(), report.clone());
        move |i| {
            let (pw, report, swept) = (pw.clone(), report.clone(), swept.clone());
            async move {
                let (index, req) = match swept.get(i) {
                    Some(req) => (format!("sweep #{i}"), req.clone()),
                    None => {
                        let i = i - swept.len();
                        (format!("#{i}"), build(&mut rng_for_request(seed, i), &pw))
                    }
                };
                run_one(&*pw, &report, &index, &req).await;
            }
        }
    })
    .await?;

    // The portal still opens.
    let after = PortalVisitor::enter(&stack.rest_url, &pw.base.own_key).await.map(drop);
    finish("portal fuzz", &report, seed, elapsed, stack, after).await
}
