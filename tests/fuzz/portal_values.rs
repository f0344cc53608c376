//! The portal fuzz's hostile values: NUL bytes, control characters, invalid
//! percent-encoding, years Postgres cannot store, huge numbers and cursors,
//! overlong values; the sweep of every field with each, and the mutations
//! that put them in forms and queries or make bodies too large, slow or
//! unfinished.

use relay_api::portal::MAX_FORM_BYTES;

use super::{portal::*, *};

/// Values no field should take, percent-encoded as sent.
pub(crate) const HOSTILE: &[&str] = &[
    "%00",
    "a%00b",
    "%01",
    "%1B%5B31m",
    "%7F",
    "%FF%FE",
    "%C0%80",
    "%ED%A0%80",
    "%E2%80%AE",
    "a%0D%0Ab",
    "%",
    "%G0",
    "%25",
    "+",
    "%20%20",
    "",
    "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
    "%22%3E%3Cimg%20src%3Dx%3E",
    "'%20OR%20'1'%3D'1",
    "..%2F..%2Fetc%2Fpasswd",
    "-1",
    "0",
    "99999999999999999999",
    "-9223372036854775809",
    "1e400",
    "NaN",
    "00000000-0000-0000-0000-000000000000",
];
/// Times around what the portal parses and Postgres stores (4713 BC to 294276 AD).
pub(crate) const TIMES: &[&str] = &[
    "-5000-01-01T00:00",
    "-4713-11-23T23:59",
    "-4713-11-24T00:00",
    "%2B262142-12-31T23:59",
    "%2B262143-01-01T00:00",
    "99999-01-01T00:00",
    "0000-01-01T00:00",
    "-0001-12-31T23:59:59",
    "2026-02-30T00:00",
    "2026-01-01T24:00",
    "2026-01-01T00:00%2B99:00",
    "1970-01-01T00:00:00-23:59",
    "2026-01-01T00:00%00",
    "2026-01-01%2000:00",
];
/// Page cursors (`<seq>~<created_at>`) the portal never wrote.
pub(crate) const CURSORS: &[&str] = &[
    "1~",
    "~",
    "~~",
    "99999999999999999999~2026-01-01T00:00:00Z",
    "-9223372036854775808~0001-01-01T00:00:00Z",
    "9223372036854775807~9999-12-31T23:59:59.999999Z",
    "1~-5000-01-01T00:00:00Z",
    "1~2026-01-01T00:00:00%2B25:00",
    "1%00~2026-01-01T00:00:00Z",
];
pub(crate) const URLS: &[&str] = &[
    "http%3A%2F%2F127.0.0.1%3A1%2F%00",
    "http%3A%2F%2F%00%2F",
    "javascript%3Aalert(1)",
    "ftp%3A%2F%2Fx",
    "http%3A%2F%2F169.254.169.254%2F",
    "http%3A%2F%2F%5B%3A%3A1%5D%3A1%2F",
    "%0D%0Ahttp%3A%2F%2Fx",
    "http%3A%2F%2Fuser%3Apass%40127.0.0.1%3A1%2F",
];
pub(crate) const TYPES: &[&str] = &["a%00b", "a%0Ab%0Ac", "%2C%2C%2C", "a%20b", "%0A", "*", "%E2%80%AE"];
/// Custom header lines: injected lines, refused names, no colon, NUL.
pub(crate) const HEADER_LINES: &[&str] =
    &["X-A%3A%20a%0D%0AX-B%3A%201", "Host%3A%20evil", "no%20colon", "X-A%3A%20%00", "%3A%20v", "X-A%3A", "relay-webhook-id%3A%20x"];
/// Payload filters as typed into the form: not JSON, not the language,
/// nested past the limit, a NUL (all URL-encoded).
pub(crate) const FILTER_TEXTS: &[&str] = &[
    "%7B",
    "%7B%22a%22%3A%7B%22%24regex%22%3A1%7D%7D",
    "%5B%5B%5B%5B%5B%5B%5B%5B%5B%5B%5B%5B%5D%5D%5D%5D%5D%5D%5D%5D%5D%5D%5D%5D",
    "%7B%22a%00%22%3A1%7D",
    "%7B%7D",
    "null",
];
/// PEM as pasted wrong: not base64, a key where a certificate goes, a
/// header only, a NUL, CR/LF injection (all URL-encoded).
pub(crate) const PEM_TEXTS: &[&str] = &[
    "-----BEGIN%20CERTIFICATE-----%0Anot%20base64!%0A-----END%20CERTIFICATE-----",
    "-----BEGIN%20PRIVATE%20KEY-----%0AMC4CAQAwBQYDK2VwBCIEIA%3D%3D%0A-----END%20PRIVATE%20KEY-----",
    "-----BEGIN%20CERTIFICATE-----",
    "%00",
    "a%0D%0AX-Injected%3A%201",
];
/// OAuth2 fields as typed wrong: an address Relay never calls, not a URL,
/// control characters.
pub(crate) const OAUTH2_TEXTS: &[&str] =
    &["http%3A%2F%2F10.0.0.1%2Ftoken", "not%20a%20url", "%00", "a%0D%0Ab", "https%3A%2F%2F%5B%3A%3A1%5D%2F"];
/// Rates and bursts out of range or not numbers.
pub(crate) const RATES: &[&str] = &["0", "10001", "-5", "2.5", "1e4", "99999999999999999999", "%00", "five"];
/// In-flight caps out of range or not numbers.
pub(crate) const CAPS: &[&str] = &["0", "1001", "-1", "1e3", "99999999999999999999", "%00", "1.5"];
/// Field names the portal reads somewhere, for a field added where it is not read.
pub(crate) const FIELD_NAMES: &[&str] = &[
    "type",
    "since",
    "until",
    "id",
    "before",
    "done",
    "token",
    "url",
    "event_types",
    "signature_scheme",
    "event_id",
    "csrf",
    "headers",
    "max_in_flight",
    "clear_headers",
    "filter",
    "rate_per_second",
    "rate_burst",
    "ordering",
    "client_certificate",
    "client_key",
    "ca_bundle",
    "token_url",
    "client_id",
    "client_secret",
];

/// The hostile values of a field's own kind (times, cursors, URLs, types).
pub(crate) fn values_for(field: &str) -> &'static [&'static str] {
    match field {
        "since" | "until" => TIMES,
        "before" => CURSORS,
        "url" => URLS,
        "type" | "event_types" => TYPES,
        "headers" => HEADER_LINES,
        "max_in_flight" => CAPS,
        "filter" => FILTER_TEXTS,
        "rate_per_second" | "rate_burst" => RATES,
        "client_certificate" | "client_key" | "ca_bundle" => PEM_TEXTS,
        "token_url" | "client_id" | "client_secret" | "scope" | "audience" => OAUTH2_TEXTS,
        _ => &[],
    }
}

/// Every field of every route given each hostile value of its kind and
/// each of [`HOSTILE`], once, before the random requests: the inputs the
/// issue found (a NUL byte, a year Postgres cannot store) are sent on every
/// run, whatever the seed.
pub(crate) fn sweep(pw: &PortalWorld) -> Vec<Req> {
    let mut rng = rng_for_request(0, usize::MAX);
    let mut out = Vec::new();
    for route in ROUTES {
        for &field in route.fields {
            for value in values_for(field).iter().chain(HOSTILE) {
                let mut req = seed(route, &mut rng, pw);
                with_fields(&mut req, |fields| {
                    fields.retain(|(k, _)| k != field);
                    fields.push((field.to_owned(), value.to_string()));
                });
                req.applied.push("sweep");
                out.push(req);
            }
        }
    }
    out
}

pub(crate) fn hostile_values(rng: &mut Rng, req: &mut Req, _: &PortalWorld) {
    let long = |rng: &mut Rng| {
        let unit = rng.pick(&["x", "%C3%A9", "%00", "a%0A"]).to_string();
        unit.repeat(rng.choose(&[1_000usize, 9_000, 70_000]) / unit.len())
    };
    with_fields(req, |fields| {
        let i = match fields.len() {
            0 => None,
            n if rng.chance(85) => Some(rng.below(n)),
            _ => None,
        };
        let i = i.unwrap_or_else(|| {
            fields.push((rng.pick(FIELD_NAMES).to_string(), String::new()));
            fields.len() - 1
        });
        let own = values_for(&fields[i].0);
        let list = if !own.is_empty() && rng.chance(65) { own } else { HOSTILE };
        fields[i].1 = if rng.chance(10) { long(rng) } else { rng.pick(list).to_string() };
        // The same field again, with another value.
        if rng.chance(10) {
            let again = (fields[i].0.clone(), rng.pick(HOSTILE).to_string());
            fields.push(again);
        }
    });
}

pub(crate) fn reshape_fields(rng: &mut Rng, req: &mut Req, pw: &PortalWorld) {
    let csrf = pw.own.csrf.clone();
    let raw = match rng.below(8) {
        0 => String::new(),
        1 => "&&&".into(),
        2 => "=&=x&csrf".into(),
        3 => format!("csrf={csrf}&%FF%FE=1&=2"),
        4 => format!("csrf={csrf}&{}", (0..300).map(|i| format!("f{i}=1")).collect::<Vec<_>>().join("&")),
        5 => format!("csrf%3D{csrf}"),
        6 => format!("csrf={csrf};url=x"),
        _ => {
            // A JSON body under the form's content type.
            req.body = Body::Raw(format!(r#"{{"csrf": "{csrf}"}}"#).into_bytes());
            return;
        }
    };
    match &mut req.body {
        Body::Form(_) => req.body = Body::Raw(raw.into_bytes()),
        _ => req.query = (!raw.is_empty()).then_some(raw),
    }
}

pub(crate) fn oversize_form(rng: &mut Rng, req: &mut Req, _: &PortalWorld) {
    // Around the form limit, declared or (chunked) streamed.
    let n = rng.choose(&[MAX_FORM_BYTES - 100, MAX_FORM_BYTES + 1, 200_000]);
    with_fields(req, |fields| fields.push(("url".into(), "x".repeat(n))));
    if rng.chance(40) {
        req.framing = Framing::Chunked(rng.choose(&[1_000usize, 65_536]));
    }
}

pub(crate) fn slow_body(rng: &mut Rng, req: &mut Req, _: &PortalWorld) {
    // Some finish within the form time limit, some do not.
    req.trickle = Some(Duration::from_millis(rng.choose(&[20u64, 50, 200, 700])));
}

pub(crate) fn unfinished_body(rng: &mut Rng, req: &mut Req, _: &PortalWorld) {
    // Left open: the server must answer anyway (408 at its time limit, or at
    // once: without a session, or over the limit by declaration).
    let extra = rng.choose(&[1usize, 100, 5_000, MAX_FORM_BYTES + 1, 10_000_000_000]);
    req.framing = Framing::Short { extra, hang_up: false };
}

// ---------------------------------------------------------------------------
// Judging an answer.
