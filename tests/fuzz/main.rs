//! A bounded mutational fuzzer over every REST route.
//!
//! The routes come from `docs/openapi.json`, read when the test runs, so a
//! new route is fuzzed without touching this file. Against a real stack with
//! real ids (two tenants, their endpoints, events and a dead letter), each
//! route gets a valid request, and `RELAY_FUZZ_REQUESTS` (default 3000)
//! mutated copies of such requests are sent as raw HTTP/1.1 bytes, each on a
//! fresh connection, by eight workers, so that no client library tidies
//! anything up. Every answer must be below 500; every refusal the JSON error
//! `{code, reason, message}` with a short message; every success JSON; and
//! no success may come without a valid key or for the other tenant's id.
//! Afterwards the api must still be ready and accept a publish, and the
//! database invariants must hold.
//!
//! The mutations of request `i` depend only on the seed (`RELAY_FUZZ_SEED`,
//! printed at the start) and `i`. The ids they start from may differ between
//! runs — ids the api hands out join the pools as they arrive — so every
//! failure is reported with the exact bytes that caused it.
//!
//! The portal's pages and forms, which share the REST port, are fuzzed the
//! same way by [`portal`], with mutations of their own (sessions, CSRF
//! tokens, hostile form and query values, slow and unfinished bodies).

mod portal;

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use relay_tests::{Options, Receiver, Reply, Rest, Rng, Stack};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use uuid::Uuid;

const DEFAULT_SEED: u64 = 0x5eed_f022_2026;
const DEFAULT_REQUESTS: usize = 3000;
/// Enough to keep the api busy on two cores without queueing behind ourselves.
const WORKERS: usize = 8;
/// How long one exchange may take. Only a few mutations are meant to make the
/// server wait (a declared length the body never reaches, on a connection
/// left open); anything else that takes this long is reported as a hang.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(3);
const MAX_REPORTED: usize = 20;
const EXCERPT_BYTES: usize = 300;
/// Ids kept per tenant and kind for filling paths.
const POOL_CAP: usize = 64;

/// Each fuzz starts a stack of its own and keeps the api busy from eight
/// workers: two at once on two cores would time each other out.
static ONE_FUZZ_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------
// The deterministic generator (`relay_tests::Rng`), with what this file adds.

/// The stream of request `index`, whichever worker sends it.
fn rng_for_request(seed: u64, index: usize) -> Rng {
    let mut r = Rng(seed ^ (index as u64).wrapping_mul(0xd1b5_4a32_d192_ed03));
    r.next_u64();
    r
}

trait RandomIds {
    fn uuid(&mut self) -> String;
}

impl RandomIds for Rng {
    fn uuid(&mut self) -> String {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()
    }
}

fn seed_from_env() -> u64 {
    let Ok(text) = std::env::var("RELAY_FUZZ_SEED") else { return DEFAULT_SEED };
    let text = text.trim();
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    };
    parsed.unwrap_or_else(|| panic!("RELAY_FUZZ_SEED={text:?} is not a number (decimal or 0x hex)"))
}

// ---------------------------------------------------------------------------
// The routes, as the published spec lists them.

#[derive(Debug, Clone)]
struct Route {
    method: String,
    template: String,
    /// The JSON body's fields (name, JSON Schema type, "" when any value),
    /// for routes that take a body.
    body: Option<Vec<(String, String)>>,
}

impl Route {
    fn params(&self) -> Vec<&str> {
        self.template.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).collect()
    }
}

fn routes() -> Vec<Route> {
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
enum Tenant {
    Own,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Endpoint,
    Event,
    DeadLetter,
}

/// Which kind of id a path parameter takes (`None`: unknown, a random UUID).
fn param_kind(template: &str, param: &str) -> Option<Kind> {
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
struct Ids {
    pools: HashMap<(Tenant, Kind), Vec<String>>,
    /// Who owns each id: `None` when both tenants have one by that id (event
    /// ids are unique per environment, not across them).
    owner: HashMap<String, Option<Tenant>>,
}

impl Ids {
    fn add(&mut self, who: Tenant, kind: Kind, id: &str) {
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

    fn any(&self, rng: &mut Rng, who: Tenant, kind: Kind) -> Option<String> {
        let pool = self.pools.get(&(who, kind)).filter(|p| !p.is_empty())?;
        Some(rng.pick(pool).clone())
    }

    fn any_kind(&self, rng: &mut Rng, who: Tenant) -> Option<String> {
        let kind = rng.choose(&[Kind::Endpoint, Kind::Event, Kind::DeadLetter]);
        self.any(rng, who, kind).or_else(|| self.any(rng, who, Kind::Endpoint))
    }
}

struct World {
    addr: SocketAddr,
    own_key: String,
    other_key: String,
    /// Where endpoints made by the fuzzer point (a loopback receiver).
    created_url: String,
    /// An event id either tenant may publish: repeated publishes are duplicates.
    shared_event_id: String,
    routes: Vec<Route>,
    ids: Mutex<Ids>,
}

impl World {
    fn ids(&self) -> std::sync::MutexGuard<'_, Ids> {
        self.ids.lock().expect("the id pools are never poisoned")
    }
}

// ---------------------------------------------------------------------------
// A request, kept in parts so that mutations can reach each of them.

#[derive(Debug, Clone)]
enum Body {
    /// An object's members, each value as JSON text, so that duplicate keys,
    /// `1e400` and bad escapes survive until they are sent.
    Members(Vec<(String, String)>),
    /// Bytes exactly as sent.
    Raw(Vec<u8>),
    /// A form's fields, each name and value as sent (already percent-encoded,
    /// so that invalid encodings survive).
    Form(Vec<(String, String)>),
}

impl Body {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Body::Raw(b) => b.clone(),
            Body::Form(fields) => fields.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&").into_bytes(),
            Body::Members(ms) => {
                let inner: Vec<String> = ms.iter().map(|(k, v)| format!("{}:{v}", Value::String(k.clone()))).collect();
                format!("{{{}}}", inner.join(",")).into_bytes()
            }
        }
    }

    /// The members to change; an empty body counts as `{}`, other bytes
    /// are no object any more and stay as they are.
    fn members(&mut self) -> Option<&mut Vec<(String, String)>> {
        if matches!(self, Body::Raw(b) if b.is_empty()) {
            *self = Body::Members(Vec::new());
        }
        match self {
            Body::Members(m) => Some(m),
            Body::Raw(_) | Body::Form(_) => None,
        }
    }
}

/// How the body is delimited on the wire.
#[derive(Debug, Clone)]
enum Framing {
    /// `content-length` matching the body.
    Exact,
    /// No length and no encoding: the body's bytes read as a next request.
    Unframed,
    /// The right length, then a second `content-length` header.
    TwoLengths(String),
    /// A `content-length` that is no number of bytes.
    BadLength(&'static str),
    /// A declared length the body falls short of; `hang_up` half-closes the
    /// connection after sending, otherwise the server waits (and we time out).
    Short {
        extra: usize,
        hang_up: bool,
    },
    /// Valid chunked encoding in chunks of this size.
    Chunked(usize),
    BadChunked(BadChunk),
    /// A `transfer-encoding` value beside the right `content-length`.
    Encoding(&'static str),
}

#[derive(Debug, Clone, Copy)]
enum BadChunk {
    NotHex,
    /// A size larger than the data (the server waits for the rest; we hang up).
    Overlong,
    /// No last chunk (we hang up).
    NoTerminator,
    BadExtension,
    MissingCrlf,
    Negative,
    HugeSize,
}

#[derive(Debug, Clone)]
struct Req {
    method: String,
    /// The request target without the query: usually a path.
    path: String,
    query: Option<String>,
    version: String,
    headers: Vec<(String, Vec<u8>)>,
    /// Lines sent as they are after the headers (no colon, folded lines...).
    raw_lines: Vec<Vec<u8>>,
    body: Body,
    framing: Framing,
    /// Send the body a byte at a time, each after this pause.
    trickle: Option<Duration>,
    /// The route it was made from and the mutations applied, for the report.
    route: String,
    params: Vec<String>,
    applied: Vec<&'static str>,
}

/// The bytes to send and how to send them.
struct Wire {
    bytes: Vec<u8>,
    /// Half-close the connection once everything is written.
    hang_up: bool,
    /// The server is expected to wait for bytes that never come.
    may_hang: bool,
    /// How many bytes go at once, and the pause before each later byte.
    trickle: Option<(usize, Duration)>,
}

fn json_string(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

impl Req {
    /// A valid request for `route`, with the fuzzed tenant's key and ids.
    fn seed(route: &Route, rng: &mut Rng, world: &World) -> Self {
        let path = {
            let ids = world.ids();
            route
                .template
                .split('/')
                .map(|seg| match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    Some(param) => {
                        param_kind(&route.template, param).and_then(|k| ids.any(rng, Tenant::Own, k)).unwrap_or_else(|| rng.uuid())
                    }
                    None => seg.to_owned(),
                })
                .collect::<Vec<_>>()
                .join("/")
        };
        let mut headers = vec![
            ("host".to_owned(), b"relay".to_vec()),
            ("connection".to_owned(), b"close".to_vec()),
            ("authorization".to_owned(), format!("Bearer {}", world.own_key).into_bytes()),
        ];
        let body = match &route.body {
            None => Body::Raw(Vec::new()),
            Some(fields) => {
                headers.push(("content-type".to_owned(), b"application/json".to_vec()));
                Body::Members(fields.iter().filter_map(|(name, ty)| Some((name.clone(), seed_value(name, ty, rng, world)?))).collect())
            }
        };
        let mut req = Self::new(&route.method, &route.template, path, headers, body);
        req.params = route.params().into_iter().map(str::to_owned).collect();
        req
    }

    /// A well-formed HTTP/1.1 request for the route `method template`, as yet unmutated.
    fn new(method: &str, template: &str, path: String, headers: Vec<(String, Vec<u8>)>, body: Body) -> Self {
        Self {
            method: method.to_owned(),
            path,
            query: None,
            version: "HTTP/1.1".into(),
            headers,
            raw_lines: Vec::new(),
            body,
            framing: Framing::Exact,
            trickle: None,
            route: format!("{method} {template}"),
            params: Vec::new(),
            applied: Vec::new(),
        }
    }

    fn remove_header(&mut self, name: &str) {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    }

    fn set_header(&mut self, name: &str, value: impl Into<Vec<u8>>) {
        self.remove_header(name);
        self.headers.push((name.to_owned(), value.into()));
    }

    fn target(&self) -> String {
        match &self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone(),
        }
    }

    fn wire(&self) -> Wire {
        let mut out = format!("{} {} {}\r\n", self.method, self.target(), self.version).into_bytes();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        for line in &self.raw_lines {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
        let body = self.body.bytes();
        let length = |n: usize| format!("content-length: {n}\r\n").into_bytes();
        let (mut hang_up, mut may_hang) = (false, false);
        let (framing, payload): (Vec<u8>, Vec<u8>) = match &self.framing {
            Framing::Exact if body.is_empty() && !matches!(self.method.as_str(), "POST" | "PUT" | "PATCH") => (Vec::new(), body),
            Framing::Exact => (length(body.len()), body),
            Framing::Unframed => (Vec::new(), body),
            Framing::TwoLengths(second) => ([length(body.len()), format!("content-length: {second}\r\n").into_bytes()].concat(), body),
            Framing::BadLength(v) => (format!("content-length: {v}\r\n").into_bytes(), body),
            Framing::Short { extra, hang_up: h } => {
                (hang_up, may_hang) = (*h, !*h);
                (length(body.len() + extra), body)
            }
            Framing::Chunked(size) => {
                let mut encoded = Vec::new();
                for c in body.chunks((*size).max(1)) {
                    encoded.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                    encoded.extend_from_slice(c);
                    encoded.extend_from_slice(b"\r\n");
                }
                encoded.extend_from_slice(b"0\r\n\r\n");
                (b"transfer-encoding: chunked\r\n".to_vec(), encoded)
            }
            Framing::BadChunked(kind) => {
                // At least one byte of data: with none, "no last chunk" would
                // be `0\r\n\r\n`, a complete body.
                let body = if body.is_empty() { b" ".to_vec() } else { body };
                let n = body.len();
                let (size_line, after, last): (Vec<u8>, &[u8], &[u8]) = match kind {
                    BadChunk::NotHex => (b"zz".to_vec(), b"\r\n", b"0\r\n\r\n"),
                    BadChunk::Overlong => (format!("{:x}", n + 10).into_bytes(), b"\r\n", b"0\r\n\r\n"),
                    BadChunk::NoTerminator => (format!("{n:x}").into_bytes(), b"\r\n", b""),
                    BadChunk::BadExtension => ([format!("{n:x};").as_bytes(), b"\xff=\x01"].concat(), b"\r\n", b"0\r\n\r\n"),
                    BadChunk::MissingCrlf => (format!("{n:x}").into_bytes(), b"", b"0\r\n\r\n"),
                    BadChunk::Negative => (b"-1".to_vec(), b"\r\n", b"0\r\n\r\n"),
                    BadChunk::HugeSize => (b"fffffffffffffffffffff".to_vec(), b"\r\n", b"0\r\n\r\n"),
                };
                // Where the server would wait for more, hang up instead: it
                // then sees the body end early. (Only ever mid-body: after a
                // complete request a half-close gets no answer at all, a known
                // limitation reported on its own, not fuzzed here.)
                hang_up = matches!(kind, BadChunk::Overlong | BadChunk::NoTerminator);
                (b"transfer-encoding: chunked\r\n".to_vec(), [size_line.as_slice(), b"\r\n", body.as_slice(), after, last].concat())
            }
            Framing::Encoding(te) => {
                // A (trimmed) `chunked` wins over the length, as RFC 9112
                // allows: the body, never chunk-encoded, is refused or (when
                // empty) still to come. Hang up so that it ends.
                hang_up = te.trim() == "chunked";
                ([format!("transfer-encoding: {te}\r\n").into_bytes(), length(body.len())].concat(), body)
            }
        };
        out.extend_from_slice(&framing);
        out.extend_from_slice(b"\r\n");
        let trickle = self.trickle.map(|pause| (out.len(), pause));
        out.extend_from_slice(&payload);
        Wire { bytes: out, hang_up, may_hang, trickle }
    }
}

/// A valid value for a body field, by name, else by type; `None` leaves an
/// optional field out.
fn seed_value(name: &str, ty: &str, rng: &mut Rng, world: &World) -> Option<String> {
    Some(match name {
        "url" => json_string(&world.created_url),
        // Endpoints the fuzzer makes subscribe to a type nobody publishes,
        // so that its publishes fan out to the setup's endpoints only.
        "event_types" => r#"["fz.created"]"#.into(),
        "type" => r#""fz""#.into(),
        "payload" => format!(r#"{{"n": {}, "s": "fuzz"}}"#, rng.below(1000)),
        // A recovery's range: timestamps, and since before until.
        "since" => r#""2026-01-01T00:00:00Z""#.into(),
        "until" => r#""2036-01-01T00:00:00Z""#.into(),
        "id" => match rng.below(3) {
            0 => return None,
            1 => json_string(&rng.uuid()),
            _ => json_string(&world.shared_event_id),
        },
        _ => match ty {
            "string" => r#""x""#,
            "array" => "[]",
            "integer" | "number" => "1",
            "boolean" => "true",
            _ => "{}",
        }
        .into(),
    })
}

// ---------------------------------------------------------------------------
// The mutations: one function per family, each a handful of variants.

type Mutate = fn(&mut Rng, &mut Req, &World);

/// (name, weight, function), in the order they are applied when stacked:
/// the request's parts, then the body's structure, then its bytes, then the
/// wire format around it all.
const MUTATIONS: &[(&str, u64, Mutate)] = &[
    ("method", 6, swap_method),
    ("path_id", 10, replace_path_segment),
    ("path_shape", 4, reshape_path),
    ("query", 8, add_query),
    ("authorization", 9, change_authorization),
    ("content_type", 4, change_content_type),
    ("header_flood", 3, flood_headers),
    ("header_odd", 5, odd_header),
    ("body_fields", 6, drop_or_add_fields),
    ("body_types", 9, wrong_types),
    ("body_big", 4, big_values),
    ("body_deep", 3, deep_nesting),
    ("body_numbers", 4, extreme_numbers),
    ("body_duplicates", 3, duplicate_keys),
    ("body_payload", 5, payload_shapes),
    ("body_not_object", 4, not_an_object),
    ("body_bytes", 6, damage_bytes),
    ("body_oversize", 1, oversize_body),
    ("wire_method", 2, odd_method),
    ("wire_version", 2, odd_version),
    ("wire_framing", 7, odd_framing),
];

/// The index of an entry of `table`, drawn by the weights `weight` gives.
fn pick_weighted<T>(rng: &mut Rng, table: &[T], weight: impl Fn(&T) -> u64) -> usize {
    let total: u64 = table.iter().map(&weight).sum();
    let mut at = rng.next_u64() % total;
    for (i, m) in table.iter().enumerate() {
        if at < weight(m) {
            return i;
        }
        at -= weight(m);
    }
    table.len() - 1
}

fn build(rng: &mut Rng, world: &World) -> Req {
    let route = rng.pick(&world.routes).clone();
    let mut req = Req::seed(&route, rng, world);
    // Some requests go out valid: the success paths are fuzzed state too.
    if rng.chance(8) {
        return req;
    }
    let mut picked: Vec<usize> = (0..rng.range(1, 3)).map(|_| pick_weighted(rng, MUTATIONS, |m| m.1)).collect();
    picked.sort_unstable();
    for i in picked {
        let (name, _, mutate) = MUTATIONS[i];
        mutate(rng, &mut req, world);
        req.applied.push(name);
    }
    req
}

const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"];

fn swap_method(rng: &mut Rng, req: &mut Req, _: &World) {
    req.method = rng.pick(METHODS).to_string();
}

/// An id in another spelling the server's UUID parser also reads.
fn respelled(rng: &mut Rng, id: &str) -> String {
    match rng.below(7) {
        0 => id.to_uppercase(),
        1 => id.replace('-', ""),
        2 => format!("%7B{id}%7D"),
        3 => format!("urn:uuid:{id}"),
        4 => format!("%20{id}%20"),
        _ => id.to_owned(),
    }
}

const NOT_UUIDS: &[&str] = &[
    "abc",
    "0",
    "-1",
    "null",
    "undefined",
    "true",
    "00000000-0000-0000-0000-000000000000",
    "ffffffff-ffff-ffff-ffff-ffffffffffff",
    "0123456789abcdef0123456789abcdef0",
    "g0000000-0000-0000-0000-000000000000",
    "1;DROP TABLE events",
    "'%20OR%20'1'='1",
    "$(id)",
    "%7B%7D",
    "9223372036854775808",
];
const PERCENT_GARBAGE: &[&str] =
    &["%FF%FE", "%00", "%2F", "%2e%2e", "%", "%G0", "%C0%AF", "%E2%80%AE", "%F0%9F%98%80", "%ED%A0%80", "%25", "a%0D%0Ab"];

fn replace_path_segment(rng: &mut Rng, req: &mut Req, world: &World) {
    let mut segments: Vec<String> = req.path.split('/').map(str::to_owned).collect();
    if segments.len() < 2 {
        return;
    }
    // Mostly the segments that carry ids: that is where lookups happen.
    let ids: Vec<usize> = (1..segments.len()).filter(|&i| Uuid::parse_str(&segments[i]).is_ok()).collect();
    let i = if !ids.is_empty() && rng.chance(80) { rng.choose(&ids) } else { rng.range(1, segments.len() - 1) };
    segments[i] = match rng.below(9) {
        0 => rng.uuid(),
        1 | 2 => {
            let theirs = world.ids().any_kind(rng, Tenant::Other).unwrap_or_else(|| rng.uuid());
            respelled(rng, &theirs)
        }
        3 => world.ids().any_kind(rng, Tenant::Own).unwrap_or_else(|| rng.uuid()),
        4 => rng.pick(NOT_UUIDS).to_string(),
        5 => rng.pick(PERCENT_GARBAGE).to_string(),
        6 => rng.pick(&["..", ".", "%2e%2e%2f%2e%2e", "..%2F..%2Fetc%2Fpasswd"]).to_string(),
        7 => {
            let unit = rng.pick(&["a", "%FF", "é"]).to_string();
            unit.repeat(rng.range(1_000, 10_000) / unit.len())
        }
        _ => String::new(),
    };
    req.path = segments.join("/");
}

fn reshape_path(rng: &mut Rng, req: &mut Req, _: &World) {
    let path = req.path.clone();
    req.path = match rng.below(10) {
        0 => format!("{path}/"),
        1 => path.replacen('/', "//", 2),
        2 => path.rsplit_once('/').map_or(path.clone(), |(head, _)| head.to_owned()),
        3 => format!("{path}/extra"),
        4 => path.to_uppercase(),
        5 => format!("http://relay{path}"),
        6 => "*".into(),
        7 => path.trim_start_matches('/').to_owned(),
        8 => format!("{path}#fragment"),
        _ => format!("/v2{}", path.strip_prefix("/v1").unwrap_or(&path)),
    };
}

const CREDENTIAL_NAMES: &[&str] = &["api_key", "apikey", "key", "token", "access_token", "Authorization", "BEARER", "Api_Key"];
const QUERY_GARBAGE: &[&str] =
    &["%FF%FE=1", "a=%ZZ", "&&&=", "a", "=", "a=1&a=2", "a b=1", "a=%00", "%E2%80%AE=x", "x=\u{e9}", "page_size=-1", "limit=99999999999"];
const OTHER_FIELDS: &[&str] = &["url", "event_types", "type", "payload", "enabled", "environment_id", "attempt", "generation", "id"];

fn add_query(rng: &mut Rng, req: &mut Req, world: &World) {
    let extra = match rng.below(6) {
        0 => format!("{}={}", rng.pick(OTHER_FIELDS), rng.pick(&["x", "1", "true", "-1", "1e400", ""])),
        // A field the path binds, given again with someone else's id.
        1 => {
            let name = req.params.first().cloned().unwrap_or_else(|| "id".into());
            let id = world.ids().any_kind(rng, Tenant::Other).unwrap_or_else(|| rng.uuid());
            format!("{name}={id}")
        }
        2 => format!("x={}", "q".repeat(rng.range(1_000, 9_000))),
        3 => format!("{}={}", rng.pick(CREDENTIAL_NAMES), world.own_key),
        4 => rng.pick(QUERY_GARBAGE).to_string(),
        _ => {
            let name = rng.pick(OTHER_FIELDS);
            format!("{name}=1&{name}=2")
        }
    };
    req.query = Some(match req.query.take() {
        Some(q) => format!("{q}&{extra}"),
        None => extra,
    });
}

fn change_authorization(rng: &mut Rng, req: &mut Req, world: &World) {
    req.remove_header("authorization");
    let own = &world.own_key;
    let other = &world.other_key;
    let values: Vec<Vec<u8>> = match rng.below(10) {
        0 => vec![],
        1 => vec![format!("Bearer rk_{}", rng.uuid().replace('-', "")).into_bytes()],
        2 => vec![format!("Bearer {other}").into_bytes()],
        3 => vec![b"Bearer \xff\xfe\x80".to_vec()],
        4 => vec![b"Basic dXNlcjpwYXNzd29yZA==".to_vec()],
        5 => vec![format!("bearer {own}").into_bytes()],
        6 => vec![format!("Bearer    {own}   ").into_bytes()],
        7 => vec![b"Bearer ".to_vec()],
        8 => {
            let both = [format!("Bearer {own}").into_bytes(), format!("Bearer {other}").into_bytes()];
            if rng.chance(50) { both.to_vec() } else { both.into_iter().rev().collect() }
        }
        _ => vec![format!("Bearer {}", "k".repeat(rng.range(1_000, 10_000))).into_bytes()],
    };
    for v in values {
        req.headers.push(("authorization".into(), v));
    }
}

const CONTENT_TYPES: &[&[u8]] = &[
    b"",
    b"text/plain",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=xyz",
    b"application/json; charset=utf-16",
    b"application/grpc",
    b"application/json, text/html",
    b"\xff\xfe",
];

fn change_content_type(rng: &mut Rng, req: &mut Req, _: &World) {
    let value = rng.choose(CONTENT_TYPES);
    if value.is_empty() {
        req.remove_header("content-type");
    } else {
        req.set_header("content-type", value);
    }
}

fn flood_headers(rng: &mut Rng, req: &mut Req, _: &World) {
    if rng.chance(50) {
        // Around the facade's limit of 64 fields and hyper's parser's 256.
        let n = rng.choose(&[10usize, 60, 61, 62, 70, 100, 255, 300]);
        for i in 0..n {
            req.headers.push((format!("x-fuzz-{i}"), i.to_string().into_bytes()));
        }
    } else {
        // Around the facade's 16 KiB of headers and hyper's 256 KiB buffer.
        let n = rng.choose(&[8_000usize, 16_000, 17_000, 100_000, 300_000]);
        req.headers.push(("x-big".into(), vec![b'b'; n]));
    }
}

fn odd_header(rng: &mut Rng, req: &mut Req, _: &World) {
    match rng.below(12) {
        0 => req.raw_lines.push(b"x-no-colon".to_vec()),
        1 => req.raw_lines.push(b"x bad name: 1".to_vec()),
        2 => req.raw_lines.push(b"x-folded: a\r\n continued".to_vec()),
        3 => req.headers.push(("host".into(), b"other.example".to_vec())),
        4 => req.remove_header("host"),
        5 => req.headers.push(("expect".into(), b"100-continue".to_vec())),
        6 => req.headers.push((
            "traceparent".into(),
            rng.pick(&[&b"garbage"[..], b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b"ff-zz"]).to_vec(),
        )),
        7 => req.headers.push(("tracestate".into(), vec![b'x'; 5_000])),
        8 => req.headers.push(("x-bytes".into(), b"\xff\xfe\x00".to_vec())),
        9 => req.headers.push(("content-encoding".into(), b"gzip".to_vec())),
        10 => req.headers.push(("upgrade".into(), b"websocket".to_vec())),
        _ => req.headers.push(("x-forwarded-for".into(), b"10.0.0.1, 127.0.0.1".to_vec())),
    }
}

/// Members to work on: the body's, or a fresh object for a body that is not one.
fn members(req: &mut Req) -> &mut Vec<(String, String)> {
    if req.body.members().is_none() {
        req.body = Body::Members(Vec::new());
    }
    match &mut req.body {
        Body::Members(m) => m,
        Body::Raw(_) | Body::Form(_) => unreachable!("just made an object"),
    }
}

/// The index of a member to change, preferring `payload` when asked; adds
/// a field when there is none.
fn some_member(rng: &mut Rng, ms: &mut Vec<(String, String)>, prefer_payload: bool) -> usize {
    if let Some(i) = ms.iter().position(|(k, _)| k == "payload").filter(|_| prefer_payload && rng.chance(60)) {
        return i;
    }
    if ms.is_empty() {
        ms.push((rng.pick(OTHER_FIELDS).to_string(), "1".into()));
    }
    rng.below(ms.len())
}

fn drop_or_add_fields(rng: &mut Rng, req: &mut Req, world: &World) {
    let id = world.ids().any_kind(rng, Tenant::Own).unwrap_or_default();
    let ms = members(req);
    match rng.below(4) {
        0 if !ms.is_empty() => {
            let i = rng.below(ms.len());
            ms.remove(i);
        }
        1 => ms.clear(),
        // Fields the method does not have, or may not take from a body.
        2 => ms.push((rng.pick(&["environment_id", "secret", "tenant", "zzz", "enabled", "created_at", ""]).to_string(), r#""x""#.into())),
        // A path field in the body, disagreeing with the path.
        _ => ms.push((rng.pick(&["id", "event_id"]).to_string(), json_string(&id))),
    }
}

const WRONG_VALUES: &[&str] = &[
    "0",
    "-1",
    "1.5",
    "true",
    "false",
    "null",
    r#""""#,
    r#"" ""#,
    r#""x""#,
    "[]",
    "{}",
    r#"["a",1]"#,
    r#"{"a":1}"#,
    r#""a\u0000b""#,
    r#""\ud800""#,
    r#""\udc00\ud800""#,
    r#""é😀\u202e""#,
    r#""   padded   ""#,
    r#""not-a-uuid""#,
    r#""00000000-0000-0000-0000-000000000000""#,
    r#""line\nbreak""#,
    r#""tab\there""#,
    r#""\u0085\u2028""#,
    r#""\x""#,
];
const URL_VALUES: &[&str] = &[
    r#""ftp://127.0.0.1/""#,
    r#""http://169.254.169.254/latest/meta-data""#,
    r#""http://[::1]:1/""#,
    r#""http://10.0.0.1/""#,
    r#""http://0/""#,
    r#""http://user:pass@127.0.0.1:1/""#,
    r#""http://127.0.0.1:99999/""#,
    r#""http://localhost:1/x""#,
    r#""https://127.0.0.1/""#,
    r#""//127.0.0.1/""#,
    r#""http://127.0.0.1:1/%FF%00""#,
    r#""http://127.1/""#,
    r#""http://0x7f000001/""#,
    r#""javascript:alert(1)""#,
];
const TYPE_VALUES: &[&str] = &[
    r#"[]"#,
    r#"[""]"#,
    r#"["a","a"]"#,
    r#"[1]"#,
    r#"[null]"#,
    r#"["*"]"#,
    r#"["a b"]"#,
    r#"["a\u0000"]"#,
    r#"" fz ""#,
    r#""fz\n""#,
    r#""FZ""#,
    r#""..""#,
];

fn wrong_types(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    let i = some_member(rng, ms, false);
    let list = match ms[i].0.as_str() {
        "url" if rng.chance(60) => URL_VALUES,
        "event_types" | "type" if rng.chance(60) => TYPE_VALUES,
        _ => WRONG_VALUES,
    };
    ms[i].1 = rng.pick(list).to_string();
}

fn big_values(rng: &mut Rng, req: &mut Req, _: &World) {
    // Around the 256 KiB payload limit, and far past any field's own limit.
    let n = rng.choose(&[1_000usize, 9_000, 70_000, 250_000, 262_000]);
    let ms = members(req);
    let i = some_member(rng, ms, true);
    ms[i].1 = match rng.below(3) {
        0 => format!(r#""{}""#, "x".repeat(n)),
        1 => format!("[{}]", vec!["1"; n / 2].join(",")),
        _ => format!(r#"{{"blob":"{}"}}"#, "é".repeat(n / 2)),
    };
}

fn deep_nesting(rng: &mut Rng, req: &mut Req, _: &World) {
    // Around the payload's 64 levels and serde_json's 128.
    let depth = rng.choose(&[10usize, 64, 65, 127, 128, 129, 200, 400]);
    let ms = members(req);
    let i = some_member(rng, ms, true);
    ms[i].1 =
        if rng.chance(50) { "[".repeat(depth) + "1" + &"]".repeat(depth) } else { r#"{"a":"#.repeat(depth) + "null" + &"}".repeat(depth) };
}

const NUMBERS: &[&str] = &[
    "1e400",
    "-1e400",
    "9007199254740993",
    "18446744073709551616",
    "-9223372036854775809",
    "1.0e-400",
    "123456789012345678901234567890.123456789",
    "-0",
    "0.1e-7",
    "1E+2",
    "01",
    "+1",
    ".5",
    "NaN",
    "Infinity",
];

fn extreme_numbers(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    let i = some_member(rng, ms, true);
    let n = rng.pick(NUMBERS);
    ms[i].1 = match rng.below(3) {
        0 => n.to_string(),
        1 => format!("[{n}]"),
        _ => format!(r#"{{"n":{n}}}"#),
    };
}

fn duplicate_keys(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    let i = some_member(rng, ms, false);
    let (key, value) = ms[i].clone();
    // The same key again, or its proto3 JSON name (`eventTypes`), which is the same field.
    let camel = key
        .split('_')
        .enumerate()
        .map(|(j, w)| if j == 0 { w.to_owned() } else { w[..1.min(w.len())].to_uppercase() + &w[1.min(w.len())..] })
        .collect::<String>();
    let again = if rng.chance(50) || camel == key { key } else { camel };
    let value = if rng.chance(50) { value } else { rng.pick(WRONG_VALUES).to_string() };
    ms.insert(rng.below(ms.len() + 1), (again, value));
}

fn payload_shapes(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    ms.retain(|(k, _)| k != "payload");
    if rng.chance(15) {
        return; // no payload at all
    }
    let value = rng.pick(&[
        r#""a string""#,
        r#""""#,
        "[1,2,3]",
        "null",
        "42",
        "-0.0",
        "{}",
        "true",
        r#"  {"a" : 1 }  "#,
        r#""{\"a\":1}""#,
        r#"{"z":1,"a":2,"z":3}"#,
        r#"["\u00e9\ud83d\ude00"]"#,
    ]);
    ms.insert(rng.below(ms.len() + 1), ("payload".into(), value.to_string()));
}

/// Bodies that are not one JSON object (or not JSON at all).
const NOT_OBJECTS: &[&[u8]] = &[
    b"",
    b"[]",
    b"null",
    b"1",
    b"\"s\"",
    b"true",
    b"[{\"type\":\"fz\",\"payload\":1}]",
    b"{",
    b"}",
    b"{}{}",
    b"{\"type\":\"fz\",\"payload\":1} trailing",
    b" \n\t ",
    b"\xef\xbb\xbf{\"type\":\"fz\",\"payload\":1}",
    b"type=fz&payload=1",
    b"\x00",
];

fn not_an_object(rng: &mut Rng, req: &mut Req, _: &World) {
    let body = rng.choose(NOT_OBJECTS);
    req.body = Body::Raw(body.to_vec());
}

/// Overlong, surrogate, out-of-range, stray and cut-short sequences.
const INVALID_UTF8: &[&[u8]] = &[b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"];

fn damage_bytes(rng: &mut Rng, req: &mut Req, _: &World) {
    let mut bytes = req.body.bytes();
    let at = rng.below(bytes.len() + 1);
    let invalid_utf8 = rng.choose(INVALID_UTF8);
    match rng.below(5) {
        0 => bytes.truncate(at),
        1 => {
            bytes.splice(at..at, invalid_utf8.iter().copied());
        }
        // Inside a string, where a parser must check the bytes it copies.
        2 => {
            let quote = bytes.iter().enumerate().filter(|(_, b)| **b == b'"').map(|(i, _)| i).nth(rng.below(4)).map_or(at, |q| q + 1);
            bytes.splice(quote..quote, invalid_utf8.iter().copied());
        }
        3 if at < bytes.len() => bytes[at] = rng.next_u64() as u8,
        _ => bytes.insert(at, rng.choose(&[0u8, 0x1b, b'\r', 0x7f])),
    }
    req.body = Body::Raw(bytes);
}

fn oversize_body(rng: &mut Rng, req: &mut Req, _: &World) {
    // Over 300 KB: past the facade's body limit, declared or streamed.
    let n = rng.range(300_000, 400_000);
    let ms = members(req);
    ms.retain(|(k, _)| k != "payload");
    ms.push(("payload".into(), format!(r#"{{"blob":"{}"}}"#, "x".repeat(n))));
}

fn odd_method(rng: &mut Rng, req: &mut Req, _: &World) {
    req.method = match rng.below(8) {
        0 => req.method.to_lowercase(),
        1 => {
            let m = req.method.to_lowercase();
            m[..1].to_uppercase() + &m[1..]
        }
        2 => "TRACE".into(),
        3 => "CONNECT".into(),
        4 => "G@T".into(),
        5 => "A".repeat(200),
        6 => "PRI".into(),
        _ => "PROPFIND".into(),
    };
}

fn odd_version(rng: &mut Rng, req: &mut Req, _: &World) {
    req.version = rng.pick(&["HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "http/1.1", "HTTP/1.1 extra", "HTTP/9.9", "HTTP/1", ""]).to_string();
}

const BAD_LENGTHS: &[&str] = &["-1", "0x10", "1e3", "99999999999999999999", "", "1 2", "+5", "ten"];
const ENCODINGS: &[&str] = &["chunked", "gzip", "chunked, gzip", "identity", "xchunked", " chunked", "chunked\t"];

fn odd_framing(rng: &mut Rng, req: &mut Req, _: &World) {
    req.framing = match rng.below(10) {
        0 => Framing::Unframed,
        1 => Framing::TwoLengths(rng.pick(&["0", "1", "5", "100000"]).to_string()),
        2 => Framing::BadLength(rng.choose(BAD_LENGTHS)),
        // Mostly hung up on; sometimes left open, which costs a timeout.
        3 => Framing::Short { extra: rng.choose(&[1usize, 1000, 200_000]), hang_up: rng.chance(80) },
        4 | 5 => Framing::Chunked(rng.choose(&[1usize, 7, 100, 65_536])),
        6 | 7 => Framing::BadChunked(rng.choose(&[
            BadChunk::NotHex,
            BadChunk::Overlong,
            BadChunk::NoTerminator,
            BadChunk::BadExtension,
            BadChunk::MissingCrlf,
            BadChunk::Negative,
            BadChunk::HugeSize,
        ])),
        _ => Framing::Encoding(rng.choose(ENCODINGS)),
    };
}

// ---------------------------------------------------------------------------
// One exchange over a fresh connection, and reading the answer.

#[derive(Debug)]
struct Answer {
    status: u16,
    /// The head, lowercase.
    head: String,
    body: Vec<u8>,
}

enum Outcome {
    Answered(Answer),
    /// The connection ended without a readable answer.
    Silent(String),
    TimedOut,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        (n.trim() == name).then(|| v.trim())
    })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let end = find(b, b"\r\n").ok_or("a chunk size line is incomplete")?;
        let size_text = String::from_utf8_lossy(&b[..end]).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or_default().trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        b = &b[end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("a chunk is incomplete".into());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The final answer in `buf` (interim 1xx answers skipped), and whether it
/// is complete by its own framing (else only the end of the connection ends it).
fn parse_answer(buf: &[u8], head_only: bool) -> Result<(Answer, bool), String> {
    let mut rest = buf;
    loop {
        let end = find(rest, b"\r\n\r\n").ok_or_else(|| format!("no complete head in {:?}", excerpt(rest)))?;
        let head = String::from_utf8_lossy(&rest[..end]).to_ascii_lowercase();
        let status = head
            .strip_prefix("http/1.1 ")
            .or_else(|| head.strip_prefix("http/1.0 "))
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("no status line in {head:?}"))?;
        let body = &rest[end + 4..];
        if (100..200).contains(&status) && status != 101 {
            rest = body;
            continue;
        }
        if head_only || status == 204 || status == 304 {
            return Ok((Answer { status, head, body: Vec::new() }, true));
        }
        if header(&head, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            return match dechunk(body) {
                Ok(b) => Ok((Answer { status, head, body: b }, true)),
                Err(_) => Ok((Answer { status, head, body: body.to_vec() }, false)),
            };
        }
        if let Some(n) = header(&head, "content-length") {
            let n: usize = n.parse().map_err(|_| format!("content-length {n:?} in the answer"))?;
            let complete = body.len() >= n;
            return Ok((Answer { status, head, body: body[..n.min(body.len())].to_vec() }, complete));
        }
        return Ok((Answer { status, head, body: body.to_vec() }, false));
    }
}

async fn exchange(addr: SocketAddr, wire: &Wire, head_only: bool, limit: Duration) -> Outcome {
    let Ok(Ok(mut tcp)) = tokio::time::timeout(limit, TcpStream::connect(addr)).await else {
        return Outcome::Silent("could not connect".into());
    };
    let (mut rd, mut wr) = tcp.split();
    // Written while the answer is read: the server may answer (and close)
    // before it has read everything, as it should for a body too large.
    let write = async {
        let (now, later) = wire.bytes.split_at(wire.trickle.map_or(wire.bytes.len(), |(at_once, _)| at_once.min(wire.bytes.len())));
        let mut written = wr.write_all(now).await.is_ok();
        if let Some((_, pause)) = wire.trickle {
            for byte in later {
                if !written {
                    break;
                }
                tokio::time::sleep(pause).await;
                written = wr.write_all(std::slice::from_ref(byte)).await.is_ok();
            }
        }
        if written && wire.hang_up {
            let _ = wr.shutdown().await;
        }
        // Not dropped until the answer is in: a dropped write half would
        // half-close the connection, and change what the server sees.
        std::future::pending::<()>().await
    };
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match rd.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if matches!(parse_answer(&buf, head_only), Ok((_, true))) {
                        break;
                    }
                }
                Err(e) if buf.is_empty() => return Err(format!("the connection failed before any answer: {e}")),
                Err(_) => break,
            }
        }
        if buf.is_empty() {
            return Err("the connection closed without an answer".to_owned());
        }
        parse_answer(&buf, head_only).map(|(a, _)| a)
    };
    let run = async {
        tokio::select! {
            answer = read => answer,
            () = write => unreachable!("the writer never finishes"),
        }
    };
    match tokio::time::timeout(limit, run).await {
        Ok(Ok(a)) => Outcome::Answered(a),
        Ok(Err(why)) => Outcome::Silent(why),
        Err(_) => Outcome::TimedOut,
    }
}

async fn ready(addr: SocketAddr) -> bool {
    let wire = Wire {
        bytes: b"GET /readyz HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n".to_vec(),
        hang_up: false,
        may_hang: false,
        trickle: None,
    };
    matches!(exchange(addr, &wire, false, Duration::from_secs(5)).await, Outcome::Answered(a) if a.status == 200)
}

// ---------------------------------------------------------------------------
// Judging an answer.

fn excerpt(bytes: &[u8]) -> String {
    let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(EXCERPT_BYTES)]).escape_debug().to_string();
    if bytes.len() > EXCERPT_BYTES { format!("{shown}… ({} bytes)", bytes.len()) } else { shown }
}

/// Whose key the server sees: the first `Authorization` header, read as
/// the api reads it (`Bearer <key>`, the key trimmed).
fn credential(req: &Req, world: &World) -> Option<Tenant> {
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

fn percent_decoded(s: &str) -> Option<String> {
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
fn foreign_id(req: &Req, world: &World, caller: Tenant) -> Option<String> {
    let ids = world.ids();
    req.path.split('/').find_map(|seg| {
        let id = Uuid::parse_str(percent_decoded(seg)?.trim()).ok()?.to_string();
        match ids.owner.get(&id) {
            Some(Some(owner)) if *owner != caller => Some(id),
            _ => None,
        }
    })
}

fn error_body_problem(a: &Answer) -> Option<String> {
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
fn problems(req: &Req, world: &World, a: &Answer) -> Vec<String> {
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
fn learn(req: &Req, world: &World, a: &Answer) {
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
struct Report {
    sent: usize,
    statuses: BTreeMap<u16, usize>,
    /// Refusals by their `reason`.
    reasons: BTreeMap<String, usize>,
    timeouts: usize,
    /// Timeouts of requests that gave the server everything it needed.
    hangs: Vec<String>,
    silent: usize,
    /// Answered requests whose path carried the other tenant's id.
    cross_tenant: usize,
    failed: usize,
    failures: Vec<String>,
    kinds: BTreeMap<String, usize>,
}

impl Report {
    fn fail(&mut self, what: &str, index: &str, req: &Req, wire: &Wire, answer: Option<&Answer>) {
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

    fn class(&self, lo: u16, hi: u16) -> usize {
        self.statuses.range(lo..hi).map(|(_, n)| n).sum()
    }
}

/// What a fuzz asks of its answers.
trait Judge: Sync {
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

/// Sends one request and records what came of it.
async fn run_one(judge: &impl Judge, report: &Mutex<Report>, index: &str, req: &Req) {
    let world = judge.world();
    let wire = req.wire();
    let outcome = exchange(world.addr, &wire, req.method == "HEAD", judge.limit()).await;
    // Checked before the report is locked: a timeout asks the api if it lives.
    let alive_after_timeout = match outcome {
        Outcome::TimedOut => Some(ready(world.addr).await),
        _ => None,
    };
    let lock = || report.lock().expect("the report is never poisoned");
    match outcome {
        Outcome::Answered(a) => {
            let found = judge.problems(req, &a);
            let cross = judge.caller(req).and_then(|caller| foreign_id(req, world, caller)).is_some();
            judge.learn(req, &a);
            let mut r = lock();
            r.sent += 1;
            r.cross_tenant += usize::from(cross);
            if let Some(reason) = serde_json::from_slice::<Value>(&a.body).ok().and_then(|v| v["reason"].as_str().map(str::to_owned)) {
                *r.reasons.entry(reason).or_default() += 1;
            }
            *r.statuses.entry(a.status).or_default() += 1;
            for p in found {
                r.fail(&p, index, req, &wire, Some(&a));
            }
        }
        Outcome::Silent(why) => {
            let mut r = lock();
            r.sent += 1;
            r.silent += 1;
            r.fail(&format!("no answer ({why})"), index, req, &wire, None);
        }
        Outcome::TimedOut => {
            let mut r = lock();
            r.sent += 1;
            r.timeouts += 1;
            if alive_after_timeout == Some(false) {
                r.fail("no answer, and /readyz no longer answers 200", index, req, &wire, None);
            } else if judge.timeout_fails() {
                r.fail(&format!("no answer within {:?}", judge.limit()), index, req, &wire, None);
            } else if !wire.may_hang && r.hangs.len() < MAX_REPORTED {
                r.hangs.push(format!("{index} {} [{}]: {}", req.route, req.applied.join(", "), excerpt(&wire.bytes)));
            }
        }
    }
}

// ---------------------------------------------------------------------------

/// How many mutated requests to send: `var` when set, else `default`.
fn requests_from_env(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{var}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// A real stack's ids for a fuzz to start from: the fuzzed tenant's
/// endpoints, an event with deliveries, a dead letter; and a second tenant
/// ("bystander") with its own.
async fn populated(stack: &Stack, receiver: &Receiver, routes: Vec<Route>) -> anyhow::Result<World> {
    let own = stack.tenant("fuzzed").await?;
    let other = stack.tenant("bystander").await?;
    receiver.reply("/dead", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&own.api_key));
    let (a, _) = rest.endpoint(&receiver.url("/a"), &["fz"]).await?;
    let (b, _) = rest.endpoint(&receiver.url("/b"), &["fz"]).await?;
    let (dead_end, _) = rest.endpoint(&receiver.url("/dead"), &["fz.dead"]).await?;
    let event = rest.publish("fz", json!({"seed": true})).await?;
    let doomed = rest.publish("fz.dead", json!({"bound": "for the dead letters"})).await?;
    let theirs = Rest::new(&stack.rest_url, Some(&other.api_key));
    let (their_endpoint, _) = theirs.endpoint(&receiver.url("/other"), &["fz"]).await?;
    let their_event = theirs.publish("fz", json!({"theirs": true})).await?;
    // Seven attempts at the failing endpoint, 50 ms apart, make a dead letter.
    let dead_letter = relay_tests::eventually(Duration::from_secs(20), || async {
        rest.get("/v1/dead-letters").await.ok()?["dead_letters"][0]["id"].as_str().map(str::to_owned)
    })
    .await;
    if dead_letter.is_none() {
        println!("fuzz: no dead letter appeared within 20 s; replays are fuzzed with random ids");
    }

    let mut ids = Ids::default();
    for id in [&a, &b, &dead_end] {
        ids.add(Tenant::Own, Kind::Endpoint, id);
    }
    ids.add(Tenant::Own, Kind::Event, &event);
    ids.add(Tenant::Own, Kind::Event, &doomed);
    if let Some(d) = &dead_letter {
        ids.add(Tenant::Own, Kind::DeadLetter, d);
    }
    ids.add(Tenant::Other, Kind::Endpoint, &their_endpoint);
    ids.add(Tenant::Other, Kind::Event, &their_event);
    let shared_event_id = Uuid::new_v4().to_string();
    ids.owner.insert(shared_event_id.clone(), None);
    Ok(World {
        addr: stack.addrs.rest,
        own_key: own.api_key.clone(),
        other_key: other.api_key.clone(),
        created_url: receiver.url("/created"),
        shared_event_id,
        routes,
        ids: Mutex::new(ids),
    })
}

/// Runs `one(i)` for every request index below `total`, from eight workers;
/// how long they all took.
async fn fan_out<F, Fut>(total: usize, one: F) -> anyhow::Result<Duration>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (one, next) = (one.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    one(i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await?;
    }
    Ok(started.elapsed())
}

/// Prints what a fuzz saw, and fails with its first failures, if any.
fn summarise(name: &str, r: &Report, seed: u64, elapsed: Duration) {
    let statuses: Vec<String> = r.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
    println!(
        "{name} summary: {} requests sent, 2xx {} 3xx {} 4xx {} 5xx {} other {}, {} timed out, {} unanswered, {} cross-tenant; seed {seed:#x}; {:.1} s",
        r.sent,
        r.class(200, 300),
        r.class(300, 400),
        r.class(400, 500),
        r.class(500, 600),
        r.class(0, 200) + r.class(600, u16::MAX),
        r.timeouts,
        r.silent,
        r.cross_tenant,
        elapsed.as_secs_f64()
    );
    println!("{name} statuses: {}", statuses.join(" "));
    println!("{name} refusals: {}", r.reasons.iter().map(|(k, n)| format!("{k}×{n}")).collect::<Vec<_>>().join(" "));
    if !r.hangs.is_empty() {
        println!("{name}: {} timeouts of requests that were complete (the api stayed ready):\n  {}", r.hangs.len(), r.hangs.join("\n  "));
    }
}

/// Ends a fuzz: what it saw printed, the stack stopped, and its verdict:
/// no failure, the api still ready, and `after` (a normal request sent
/// after the fuzz) done.
async fn finish(
    name: &str,
    report: &Mutex<Report>,
    seed: u64,
    elapsed: Duration,
    stack: Stack,
    after: anyhow::Result<()>,
) -> anyhow::Result<()> {
    let alive = ready(stack.addrs.rest).await;
    let r = std::mem::take(&mut *report.lock().expect("not poisoned"));
    summarise(name, &r, seed, elapsed);
    let stopped = stack.stop().await;
    assert_no_failures(&r, seed);
    assert!(alive, "/readyz answers 200 after the {name}");
    after.map_err(|e| anyhow::anyhow!("a normal request after the {name}: {e:#}"))?;
    stopped
}

fn assert_no_failures(r: &Report, seed: u64) {
    assert!(
        r.failures.is_empty(),
        "{} failures ({}) with seed {seed:#x}; the first {}:\n{}\nstatuses: {}",
        r.failed,
        r.kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join("; "),
        r.failures.len(),
        r.failures.join("\n"),
        r.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect::<Vec<_>>().join(" ")
    );
}

/// A fuzz about to run: alone, its seed and size read, its stack started.
struct Fuzz {
    _alone: tokio::sync::MutexGuard<'static, ()>,
    seed: u64,
    total: usize,
    stack: Stack,
    receiver: Receiver,
}

/// Starts the fuzz `name`, of `var` (else `default`) mutated requests.
async fn begin(name: &str, var: &str, default: usize) -> anyhow::Result<Fuzz> {
    let alone = ONE_FUZZ_AT_A_TIME.lock().await;
    let seed = seed_from_env();
    let total = requests_from_env(var, default);
    println!("{name}: seed {seed:#x} (RELAY_FUZZ_SEED to replay), {total} requests ({var}), {WORKERS} workers");
    Ok(Fuzz { _alone: alone, seed, total, stack: Stack::start(Options::default()).await?, receiver: Receiver::start().await? })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rest_route_survives_mutated_requests_with_json_errors_and_no_5xx() -> anyhow::Result<()> {
    let Fuzz { seed, total, stack, receiver, _alone } = begin("fuzz", "RELAY_FUZZ_REQUESTS", DEFAULT_REQUESTS).await?;
    let world = Arc::new(populated(&stack, &receiver, routes()).await?);
    let rest = Rest::new(&stack.rest_url, Some(&world.own_key));
    assert!(!world.routes.is_empty(), "docs/openapi.json lists no routes");
    let report = Arc::new(Mutex::new(Report::default()));

    // Directed first: each route with a path id, given the other tenant's id
    // (and the other tenant given ours), is exactly a 404.
    let mut probe_rng = rng_for_request(seed, usize::MAX);
    let mut probes = 0;
    for route in world.routes.iter().filter(|r| !r.params().is_empty()) {
        for (caller, owner) in [(Tenant::Own, Tenant::Other), (Tenant::Other, Tenant::Own)] {
            let mut req = Req::seed(route, &mut probe_rng, &world);
            let path: Vec<String> = route
                .template
                .split('/')
                .map(|seg| match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    Some(param) => {
                        let kind = param_kind(&route.template, param).unwrap_or(Kind::Endpoint);
                        let ids = world.ids();
                        ids.any(&mut probe_rng, owner, kind).or_else(|| ids.any(&mut probe_rng, owner, Kind::Endpoint)).unwrap_or_default()
                    }
                    None => seg.to_owned(),
                })
                .collect();
            req.path = path.join("/");
            let key = if caller == Tenant::Own { &world.own_key } else { &world.other_key };
            req.set_header("authorization", format!("Bearer {key}"));
            req.applied.push("cross_tenant_probe");
            let wire = req.wire();
            let index = format!("probe {caller:?}→{owner:?}");
            probes += 1;
            match exchange(world.addr, &wire, false, EXCHANGE_TIMEOUT).await {
                Outcome::Answered(answer) if answer.status == 404 && error_body_problem(&answer).is_none() => {}
                Outcome::Answered(answer) => {
                    report.lock().expect("not poisoned").fail("a cross-tenant id not answered 404", &index, &req, &wire, Some(&answer))
                }
                _ => report.lock().expect("not poisoned").fail("a cross-tenant id not answered", &index, &req, &wire, None),
            }
        }
    }

    println!("fuzz: {probes} cross-tenant probes sent ({} routes)", world.routes.len());

    // Then the mutated requests, from eight workers.
    let elapsed = fan_out(total, {
        let (world, report) = (world.clone(), report.clone());
        move |i| {
            let (world, report) = (world.clone(), report.clone());
            async move {
                let mut rng = rng_for_request(seed, i);
                let req = build(&mut rng, &world);
                run_one(&*world, &report, &format!("#{i}"), &req).await;
            }
        }
    })
    .await?;

    // Still accepting work.
    let after = rest.publish("fz", json!({"after": "the fuzz"})).await.map(drop);
    finish("fuzz", &report, seed, elapsed, stack, after).await
}
