//! Replies whose fields carry JSON text (`raw_json`, e.g. an endpoint's
//! payload filter) print that text as a JSON value, exactly as stored:
//! numbers keep their digits, keys their order. proto3 JSON would print a
//! string; re-parsing into a `serde_json::Value` would round numbers.
//!
//! How: each such field's text is swapped for a token no reply can contain
//! otherwise (a control character and a fresh random nonce), the message is
//! printed as proto3 JSON, and each token's printed string is replaced by
//! the text (an empty field prints `null`).

use prost_reflect::{DynamicMessage, Kind, ReflectMessage, SerializeOptions, Value};

use super::is_raw_json;

/// Prints `msg` as proto3 JSON with its `raw_json` fields as JSON values.
pub(super) fn print(msg: &DynamicMessage, options: &SerializeOptions) -> anyhow::Result<Vec<u8>> {
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut texts: Vec<String> = Vec::new();
    let mut msg = msg.clone();
    swap(&mut msg, &nonce, &mut texts);
    let mut out = Vec::new();
    msg.serialize_with_options(&mut serde_json::Serializer::new(&mut out), options)?;
    if texts.is_empty() {
        return Ok(out);
    }
    let mut printed = String::from_utf8(out)?;
    for (i, text) in texts.iter().enumerate() {
        let token = serde_json::to_string(&token(&nonce, i))?;
        let value = if text.is_empty() { "null" } else { text.as_str() };
        printed = printed.replacen(&token, value, 1);
    }
    Ok(printed.into_bytes())
}

fn token(nonce: &str, i: usize) -> String {
    format!("\u{1}raw-json-{nonce}-{i}")
}

fn swap(msg: &mut DynamicMessage, nonce: &str, texts: &mut Vec<String>) {
    for field in msg.descriptor().fields() {
        if is_raw_json(&field) {
            let text = msg.get_field(&field).as_str().unwrap_or_default().to_owned();
            msg.set_field(&field, Value::String(token(nonce, texts.len())));
            texts.push(text);
            continue;
        }
        if !matches!(field.kind(), Kind::Message(_)) || field.is_map() || !msg.has_field(&field) {
            continue;
        }
        match msg.get_field_mut(&field) {
            Value::Message(inner) => swap(inner, nonce, texts),
            Value::List(items) => {
                for item in items.iter_mut() {
                    if let Value::Message(inner) = item {
                        swap(inner, nonce, texts);
                    }
                }
            }
            _ => {}
        }
    }
}
