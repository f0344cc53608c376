//! The event catalogue's page: each type with its description, its schema
//! (printed readably: indented, keys in the order written) and its examples.
//! Read-only: the catalogue is kept through the API.

use askama::Template;
use axum::{extract::State, http::HeaderMap, http::StatusCode, response::Response};
use serde_json::value::RawValue;

use super::{Frame, Section, failed, html, session, when};
use crate::app::App;

struct TypeView {
    name: String,
    description: String,
    deprecated: bool,
    /// Indented JSON; empty: no schema.
    schema: String,
    examples: Vec<String>,
    updated_at: String,
    revision: i64,
}

#[derive(Template)]
#[template(path = "portal/event_types.html")]
struct List {
    frame: Frame,
    types: Vec<TypeView>,
    require_known: bool,
}

/// JSON text indented for reading, every token as written (numbers keep
/// their digits, keys their order): re-parsing into values would round
/// numbers and sort keys.
fn indented(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                // An empty object or array stays on its line.
                while chars.peek().is_some_and(|n| n.is_whitespace()) {
                    chars.next();
                }
                if chars.peek().is_some_and(|&n| n == '}' || n == ']') {
                    out.push(chars.next().expect("peeked"));
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// Each example of a stored JSON array, indented.
fn examples(text: &str) -> Vec<String> {
    serde_json::from_str::<Vec<&RawValue>>(text).map(|v| v.into_iter().map(|e| indented(e.get())).collect()).unwrap_or_default()
}

pub async fn list(State(app): State<App>, headers: HeaderMap) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let (types, require_known) = match tokio::try_join!(app.list_event_types(s.tenant), app.require_known_event_types(s.tenant)) {
        Ok(both) => both,
        Err(e) => return failed(e),
    };
    let types = types
        .into_iter()
        .map(|t| TypeView {
            schema: t.schema.as_deref().map(indented).unwrap_or_default(),
            examples: examples(&t.examples),
            updated_at: when(t.updated_at),
            name: t.name,
            description: t.description,
            deprecated: t.deprecated,
            revision: t.revision,
        })
        .collect();
    html(StatusCode::OK, List { frame: Frame::new(&s, Section::Catalogue), types, require_known })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indenting_keeps_every_token_as_written() {
        let text = r#"{"b":18446744073709551615,"a":[1.50,{}, []],"s":"x, {y}: \"z\""}"#;
        let out = indented(text);
        assert_eq!(
            out,
            "{\n  \"b\": 18446744073709551615,\n  \"a\": [\n    1.50,\n    {},\n    []\n  ],\n  \"s\": \"x, {y}: \\\"z\\\"\"\n}"
        );
        let squeezed: String = out.chars().filter(|c| !c.is_whitespace()).collect();
        let original: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        assert_eq!(squeezed.replace("x,{y}:", "x, {y}: "), original.replace("x,{y}:", "x, {y}: "));
    }
}
