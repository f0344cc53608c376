//! The mutation table and the mutations of a request's parts: method,
//! path, query, credentials, headers, body fields and their types.

use super::*;

pub(crate) type Mutate = fn(&mut Rng, &mut Req, &World);

/// (name, weight, function), in the order they are applied when stacked:
/// the request's parts, then the body's structure, then its bytes, then the
/// wire format around it all.
pub(crate) const MUTATIONS: &[(&str, u64, Mutate)] = &[
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
pub(crate) fn pick_weighted<T>(rng: &mut Rng, table: &[T], weight: impl Fn(&T) -> u64) -> usize {
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

pub(crate) fn build(rng: &mut Rng, world: &World) -> Req {
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

pub(crate) const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"];

pub(crate) fn swap_method(rng: &mut Rng, req: &mut Req, _: &World) {
    req.method = rng.pick(METHODS).to_string();
}

/// An id in another spelling the server's UUID parser also reads.
pub(crate) fn respelled(rng: &mut Rng, id: &str) -> String {
    match rng.below(7) {
        0 => id.to_uppercase(),
        1 => id.replace('-', ""),
        2 => format!("%7B{id}%7D"),
        3 => format!("urn:uuid:{id}"),
        4 => format!("%20{id}%20"),
        _ => id.to_owned(),
    }
}

pub(crate) const NOT_UUIDS: &[&str] = &[
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
pub(crate) const PERCENT_GARBAGE: &[&str] =
    &["%FF%FE", "%00", "%2F", "%2e%2e", "%", "%G0", "%C0%AF", "%E2%80%AE", "%F0%9F%98%80", "%ED%A0%80", "%25", "a%0D%0Ab"];

pub(crate) fn replace_path_segment(rng: &mut Rng, req: &mut Req, world: &World) {
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

pub(crate) fn reshape_path(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) const CREDENTIAL_NAMES: &[&str] = &["api_key", "apikey", "key", "token", "access_token", "Authorization", "BEARER", "Api_Key"];
pub(crate) const QUERY_GARBAGE: &[&str] =
    &["%FF%FE=1", "a=%ZZ", "&&&=", "a", "=", "a=1&a=2", "a b=1", "a=%00", "%E2%80%AE=x", "x=\u{e9}", "page_size=-1", "limit=99999999999"];
pub(crate) const OTHER_FIELDS: &[&str] =
    &["url", "event_types", "type", "payload", "enabled", "environment_id", "attempt", "generation", "id"];

pub(crate) fn add_query(rng: &mut Rng, req: &mut Req, world: &World) {
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

pub(crate) fn change_authorization(rng: &mut Rng, req: &mut Req, world: &World) {
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

pub(crate) const CONTENT_TYPES: &[&[u8]] = &[
    b"",
    b"text/plain",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=xyz",
    b"application/json; charset=utf-16",
    b"application/grpc",
    b"application/json, text/html",
    b"\xff\xfe",
];

pub(crate) fn change_content_type(rng: &mut Rng, req: &mut Req, _: &World) {
    let value = rng.choose(CONTENT_TYPES);
    if value.is_empty() {
        req.remove_header("content-type");
    } else {
        req.set_header("content-type", value);
    }
}

pub(crate) fn flood_headers(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) fn odd_header(rng: &mut Rng, req: &mut Req, _: &World) {
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
pub(crate) fn members(req: &mut Req) -> &mut Vec<(String, String)> {
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
pub(crate) fn some_member(rng: &mut Rng, ms: &mut Vec<(String, String)>, prefer_payload: bool) -> usize {
    if let Some(i) = ms.iter().position(|(k, _)| k == "payload").filter(|_| prefer_payload && rng.chance(60)) {
        return i;
    }
    if ms.is_empty() {
        ms.push((rng.pick(OTHER_FIELDS).to_string(), "1".into()));
    }
    rng.below(ms.len())
}

pub(crate) fn drop_or_add_fields(rng: &mut Rng, req: &mut Req, world: &World) {
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

pub(crate) const WRONG_VALUES: &[&str] = &[
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
pub(crate) const URL_VALUES: &[&str] = &[
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
pub(crate) const TYPE_VALUES: &[&str] = &[
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

/// Custom headers (issue 27): refused names, injected lines, sizes and
/// shapes; a few acceptable ones so later mutations start from them.
pub(crate) const HEADER_VALUES: &[&str] = &[
    r#"{"X-Ok":"v"}"#,
    r#"{"Host":"evil"}"#,
    r#"{"relay-webhook-signature":"v1=x"}"#,
    r#"{"X-A":"a\r\nX-B: 1"}"#,
    r#"{"X-A":"\u0000"}"#,
    r#"{"X A":"v"}"#,
    r#"{"":"v"}"#,
    r#"{"X-A":""}"#,
    r#"{"X-A":1}"#,
    r#"{"X-A":{"nested":"v"}}"#,
    r#"{"X-A":"caf\u00e9"}"#,
    r#"{"x-a":"1","X-A":"2"}"#,
    r#"["X-A","v"]"#,
];

/// Payload filters (issue 27): every shape of mistake the language can
/// refuse, nesting past any parser's limit, and numbers no float holds.
pub(crate) const FILTER_VALUES: &[&str] = &[
    r#"{"n":{"$gte":1e999999999}}"#,
    r#"{"n":{"$gt":-0.000000000000000000000000001}}"#,
    r#"{"n":{"$regex":"x"}}"#,
    r#"{"$nor":[]}"#,
    r#"{"$or":[]}"#,
    r#"{"$and":{"a":1}}"#,
    r#"{"a":{"$in":[[1]]}}"#,
    r#"{"a":{"$exists":"yes"}}"#,
    r#"{"a":{}}"#,
    r#"{}"#,
    r#"{"a..b":1}"#,
    r#"{"a":1,"a":2}"#,
    r#"{"\u0000":{"$not":{"$not":{"$eq":null}}}}"#,
    r#"{"a\r\nX-B: 1":"\ud800"}"#,
    r#""{\"a\":1}""#,
    "null",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
];

/// Rate limits (issue 27): out of range, wrong shapes, numbers past any type.
pub(crate) const RATE_VALUES: &[&str] = &[
    r#"{"per_second":0}"#,
    r#"{"per_second":10001}"#,
    r#"{"per_second":5,"burst":99999999999}"#,
    r#"{"per_second":-1}"#,
    r#"{"per_second":1.5}"#,
    r#"{"per_second":"5"}"#,
    r#"{"burst":5}"#,
    r#"{"per_second":null}"#,
    r#"[5,5]"#,
    r#"{"per_second":5,"unknown":1}"#,
];

/// PEM fields (issue 27): garbage inside armour, the wrong block kind,
/// truncation, NULs, a key where a certificate goes.
pub(crate) const PEM_VALUES: &[&str] = &[
    r#""-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n""#,
    r#""-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----""#,
    r#""-----BEGIN CERTIFICATE-----\nMIIB""#,
    r#""-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n""#,
    r#""-----BEGIN RSA PRIVATE KEY-----\n\u0000\n-----END RSA PRIVATE KEY-----""#,
    r#""-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----""#,
    r#""\r\n\r\n""#,
    r#"["-----BEGIN CERTIFICATE-----"]"#,
];

/// OAuth2 credentials (issue 27): token URLs Relay may not call, missing
/// and oversized fields, header injection, wrong shapes.
pub(crate) const OAUTH2_VALUES: &[&str] = &[
    r#"{"token_url":"http://169.254.169.254/token","client_id":"a","client_secret":"b"}"#,
    r#"{"token_url":"file:///etc/passwd","client_id":"a","client_secret":"b"}"#,
    r#"{"token_url":"http://127.0.0.1:9/t","client_id":"","client_secret":"b"}"#,
    r#"{"token_url":"http://127.0.0.1:9/t","client_id":"a\r\nX: 1","client_secret":"b"}"#,
    r#"{"token_url":"http://127.0.0.1:9/t","client_id":"a","client_secret":"b","scope":7}"#,
    r#"{"token_url":null}"#,
    r#"[]"#,
    r#""oauth""#,
];

pub(crate) fn wrong_types(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    let i = some_member(rng, ms, false);
    let list = match ms[i].0.as_str() {
        "url" if rng.chance(60) => URL_VALUES,
        "event_types" | "type" if rng.chance(60) => TYPE_VALUES,
        "headers" if rng.chance(60) => HEADER_VALUES,
        "filter" if rng.chance(60) => FILTER_VALUES,
        "rate_limit" if rng.chance(60) => RATE_VALUES,
        "client_certificate" | "client_key" | "ca_bundle" if rng.chance(60) => PEM_VALUES,
        "oauth2" if rng.chance(60) => OAUTH2_VALUES,
        _ => WRONG_VALUES,
    };
    ms[i].1 = rng.pick(list).to_string();
}
