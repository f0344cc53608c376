//! A request as parts (method, path, query, headers, body, framing) and
//! its valid seed values; `Req::wire` renders it as raw HTTP/1.1 bytes.

use super::*;

#[derive(Debug, Clone)]
pub(crate) enum Body {
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
    pub(crate) fn bytes(&self) -> Vec<u8> {
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
    pub(crate) fn members(&mut self) -> Option<&mut Vec<(String, String)>> {
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
pub(crate) enum Framing {
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
pub(crate) enum BadChunk {
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
pub(crate) struct Req {
    pub(crate) method: String,
    /// The request target without the query: usually a path.
    pub(crate) path: String,
    pub(crate) query: Option<String>,
    pub(crate) version: String,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    /// Lines sent as they are after the headers (no colon, folded lines...).
    pub(crate) raw_lines: Vec<Vec<u8>>,
    pub(crate) body: Body,
    pub(crate) framing: Framing,
    /// Send the body a byte at a time, each after this pause.
    pub(crate) trickle: Option<Duration>,
    /// The route it was made from and the mutations applied, for the report.
    pub(crate) route: String,
    pub(crate) params: Vec<String>,
    pub(crate) applied: Vec<&'static str>,
}

/// The bytes to send and how to send them.
pub(crate) struct Wire {
    pub(crate) bytes: Vec<u8>,
    /// Half-close the connection once everything is written.
    pub(crate) hang_up: bool,
    /// The server is expected to wait for bytes that never come.
    pub(crate) may_hang: bool,
    /// How many bytes go at once, and the pause before each later byte.
    pub(crate) trickle: Option<(usize, Duration)>,
}

pub(crate) fn json_string(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

impl Req {
    /// A valid request for `route`, with the fuzzed tenant's key and ids.
    pub(crate) fn seed(route: &Route, rng: &mut Rng, world: &World) -> Self {
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
    pub(crate) fn new(method: &str, template: &str, path: String, headers: Vec<(String, Vec<u8>)>, body: Body) -> Self {
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

    pub(crate) fn remove_header(&mut self, name: &str) {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    }

    pub(crate) fn set_header(&mut self, name: &str, value: impl Into<Vec<u8>>) {
        self.remove_header(name);
        self.headers.push((name.to_owned(), value.into()));
    }

    pub(crate) fn target(&self) -> String {
        match &self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone(),
        }
    }

    pub(crate) fn wire(&self) -> Wire {
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
pub(crate) fn seed_value(name: &str, ty: &str, rng: &mut Rng, world: &World) -> Option<String> {
    Some(match name {
        "url" => json_string(&world.created_url),
        // Endpoints the fuzzer makes subscribe to a type nobody publishes,
        // so that its publishes fan out to the setup's endpoints only.
        "event_types" => r#"["fz.created"]"#.into(),
        "type" => r#""fz""#.into(),
        "payload" => format!(r#"{{"n": {}, "s": "fuzz"}}"#, rng.below(1000)),
        // Left out: a valid certificate would need a PKI per run; the
        // mutations give them hostile PEM instead.
        "client_certificate" | "client_key" | "ca_bundle" => return None,
        // Left out or pointed at a port nobody serves (never fetched: the
        // fuzzer's endpoints get no events).
        "oauth2" => match rng.below(2) {
            0 => return None,
            _ => r#"{"token_url": "http://127.0.0.1:9/token", "client_id": "fz", "client_secret": "fz"}"#.into(),
        },
        "ordering" => match rng.below(3) {
            0 => return None,
            1 => r#""none""#.into(),
            _ => r#""per_key""#.into(),
        },
        "ordering_key" => match rng.below(2) {
            0 => return None,
            _ => format!(r#""fz-{}""#, rng.below(4)),
        },
        "rate_limit" => match rng.below(2) {
            0 => return None,
            _ => r#"{"per_second": 50, "burst": 5}"#.into(),
        },
        "filter" => match rng.below(3) {
            0 => return None,
            1 => r#"{"n": {"$gte": 0}}"#.into(),
            _ => r#"{"$or": [{"s": "fuzz"}, {"n": {"$in": [1, 2.50, 10000000000000000001]}}]}"#.into(),
        },
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
