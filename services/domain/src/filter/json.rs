//! Reading JSON text a level at a time without turning numbers into floats:
//! an object's members and an array's elements come back as the raw text of
//! each value, and only leaves are read as scalars.

use std::{borrow::Cow, fmt};

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::{number::Number, scalar::Scalar};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Object => "an object",
            Kind::Array => "an array",
            Kind::String => "a string",
            Kind::Number => "a number",
            Kind::Bool => "a boolean",
            Kind::Null => "null",
        }
    }
}

/// What a value is, from its first character (the text is valid JSON).
pub(super) fn kind(raw: &RawValue) -> Kind {
    match raw.get().trim_start().as_bytes().first() {
        Some(b'{') => Kind::Object,
        Some(b'[') => Kind::Array,
        Some(b'"') => Kind::String,
        Some(b't' | b'f') => Kind::Bool,
        Some(b'n') => Kind::Null,
        _ => Kind::Number,
    }
}

/// A leaf as a scalar; `None` for objects and arrays.
pub(super) fn scalar_of(raw: &RawValue) -> Option<Scalar> {
    let text = raw.get().trim();
    match kind(raw) {
        Kind::Object | Kind::Array => None,
        Kind::Null => Some(Scalar::Null),
        Kind::Bool => Some(Scalar::Bool(text == "true")),
        // A string whose escapes do not decode (a lone surrogate) is not a
        // value any test can hold for.
        Kind::String => serde_json::from_str::<String>(text).ok().map(Scalar::String),
        Kind::Number => Number::parse(text).map(Scalar::Number),
    }
}

struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    out.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// An object's members in the order written (duplicates kept); empty for
/// anything else.
pub(super) fn entries(raw: &RawValue) -> Vec<(Cow<'_, str>, &RawValue)> {
    serde_json::from_str::<Members<'_>>(raw.get()).map(|m| m.0).unwrap_or_default()
}

/// An object's members, refusing a key written twice (`Err` names it).
pub(super) fn unique_entries(raw: &RawValue) -> Result<Vec<(Cow<'_, str>, &RawValue)>, String> {
    let members = entries(raw);
    for (i, (key, _)) in members.iter().enumerate() {
        if members[..i].iter().any(|(k, _)| k == key) {
            return Err(key.clone().into_owned());
        }
    }
    Ok(members)
}

/// An array's elements; empty for anything else.
pub(super) fn elements(raw: &RawValue) -> Vec<&RawValue> {
    serde_json::from_str::<Vec<&RawValue>>(raw.get()).unwrap_or_default()
}

/// How deep a JSON text nests objects and arrays, by a scan that knows
/// strings and never recurses: safe on any input, valid JSON or not, and
/// cheap enough to run before parsing, so that text nested past any sane
/// depth is refused with its depth rather than a parser's limit.
pub fn json_depth(text: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in text {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}
