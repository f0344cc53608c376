//! The mutations of values and bytes: sizes, nesting, numbers, duplicate
//! keys, payload shapes, invalid UTF-8, odd methods, versions and framing.

use super::*;

pub(crate) fn big_values(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) fn deep_nesting(rng: &mut Rng, req: &mut Req, _: &World) {
    // Around the payload's 64 levels and serde_json's 128.
    let depth = rng.choose(&[10usize, 64, 65, 127, 128, 129, 200, 400]);
    let ms = members(req);
    let i = some_member(rng, ms, true);
    ms[i].1 =
        if rng.chance(50) { "[".repeat(depth) + "1" + &"]".repeat(depth) } else { r#"{"a":"#.repeat(depth) + "null" + &"}".repeat(depth) };
}

pub(crate) const NUMBERS: &[&str] = &[
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

pub(crate) fn extreme_numbers(rng: &mut Rng, req: &mut Req, _: &World) {
    let ms = members(req);
    let i = some_member(rng, ms, true);
    let n = rng.pick(NUMBERS);
    ms[i].1 = match rng.below(3) {
        0 => n.to_string(),
        1 => format!("[{n}]"),
        _ => format!(r#"{{"n":{n}}}"#),
    };
}

pub(crate) fn duplicate_keys(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) fn payload_shapes(rng: &mut Rng, req: &mut Req, _: &World) {
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
pub(crate) const NOT_OBJECTS: &[&[u8]] = &[
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

pub(crate) fn not_an_object(rng: &mut Rng, req: &mut Req, _: &World) {
    let body = rng.choose(NOT_OBJECTS);
    req.body = Body::Raw(body.to_vec());
}

/// Overlong, surrogate, out-of-range, stray and cut-short sequences.
pub(crate) const INVALID_UTF8: &[&[u8]] = &[b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"];

pub(crate) fn damage_bytes(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) fn oversize_body(rng: &mut Rng, req: &mut Req, _: &World) {
    // Over 300 KB: past the facade's body limit, declared or streamed.
    let n = rng.range(300_000, 400_000);
    let ms = members(req);
    ms.retain(|(k, _)| k != "payload");
    ms.push(("payload".into(), format!(r#"{{"blob":"{}"}}"#, "x".repeat(n))));
}

pub(crate) fn odd_method(rng: &mut Rng, req: &mut Req, _: &World) {
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

pub(crate) fn odd_version(rng: &mut Rng, req: &mut Req, _: &World) {
    req.version = rng.pick(&["HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "http/1.1", "HTTP/1.1 extra", "HTTP/9.9", "HTTP/1", ""]).to_string();
}

pub(crate) const BAD_LENGTHS: &[&str] = &["-1", "0x10", "1e3", "99999999999999999999", "", "1 2", "+5", "ten"];
pub(crate) const ENCODINGS: &[&str] = &["chunked", "gzip", "chunked, gzip", "identity", "xchunked", " chunked", "chunked\t"];

pub(crate) fn odd_framing(rng: &mut Rng, req: &mut Req, _: &World) {
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
