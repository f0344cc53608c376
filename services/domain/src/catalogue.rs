//! The event catalogue: an environment's event types, each with a
//! description, an optional JSON Schema (draft 2020-12) that a publish of
//! the type must satisfy, examples that satisfy it, and a deprecation mark.
//!
//! Invariants: a stored schema compiled (so a publish never meets a schema
//! it cannot use), within its bounds, and refers to nothing outside itself
//! (no remote or file `$ref` is ever fetched: the crate is built without
//! those resolvers); every stored example satisfies the schema stored with
//! it. A payload's check reports at most [`MAX_VIOLATIONS`] violations, each
//! with the JSON pointer of the offending value.
//!
//! Numbers: payloads are checked as serde_json reads them: integers within
//! 64 bits exactly, others as doubles. What is stored and delivered is the
//! text as published, never a re-serialisation.

use std::fmt;

use serde_json::Value;

/// A type name: dotted segments of letters, digits, `_` and `-`
/// (`invoice.paid`, `order.line_item.added`), at most this long.
pub const MAX_NAME_LEN: usize = 128;
pub const MAX_DESCRIPTION_CHARS: usize = 2_000;
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Arrays and objects nested in a schema, at most.
pub const MAX_SCHEMA_DEPTH: usize = 32;
pub const MAX_EXAMPLES: usize = 10;
/// The examples of one type together, as JSON text.
pub const MAX_EXAMPLES_BYTES: usize = 64 * 1024;
pub const MAX_VIOLATIONS: usize = 10;
/// Event types one environment's catalogue holds, at most.
pub const MAX_TYPES_PER_ENVIRONMENT: i64 = 1_000;

/// A catalogue entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventType {
    pub name: String,
    pub description: String,
    /// The schema's text as sent; `None`: payloads are not checked.
    pub schema: Option<String>,
    /// A JSON array of example payloads, as sent.
    pub examples: String,
    pub deprecated: bool,
    pub revision: i64,
    pub created_at: crate::Timestamp,
    pub updated_at: crate::Timestamp,
}

/// Why a name, schema or example was refused: the message names the field
/// and, for a schema or example, where in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub fn check_name(name: &str) -> Result<(), Refusal> {
    let segment_ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if name.is_empty() || name.len() > MAX_NAME_LEN || !name.split('.').all(segment_ok) {
        return Err(Refusal(format!(
            "name {} must be 1 to {MAX_NAME_LEN} characters of dot-separated segments, each of letters, digits, '_' or '-' (e.g. invoice.paid); this one is {} characters",
            shown(name),
            name.chars().count()
        )));
    }
    Ok(())
}

pub fn check_description(description: &str) -> Result<(), Refusal> {
    let n = description.chars().count();
    if n > MAX_DESCRIPTION_CHARS || description.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(Refusal(format!(
            "description must be at most {MAX_DESCRIPTION_CHARS} characters without control characters other than newline and tab; this one is {n}"
        )));
    }
    Ok(())
}

/// One way a payload fails its type's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The JSON pointer of the offending value ("" for the payload itself).
    pub pointer: String,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = if self.pointer.is_empty() { "/" } else { self.pointer.as_str() };
        write!(f, "at {at}: {}", self.message)
    }
}

/// A compiled schema.
pub struct EventSchema {
    validator: jsonschema::Validator,
}

impl fmt::Debug for EventSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EventSchema")
    }
}

impl EventSchema {
    /// Compiles a schema as stored: bounded, a JSON object (or boolean),
    /// valid against the 2020-12 meta-schema, every `$ref` inside it.
    pub fn compile(text: &str) -> Result<Self, Refusal> {
        if text.len() > MAX_SCHEMA_BYTES {
            return Err(Refusal(format!("schema may be at most {MAX_SCHEMA_BYTES} bytes; this one is {}", text.len())));
        }
        let schema: Value = serde_json::from_str(text).map_err(|e| Refusal(format!("schema is not JSON: {e}")))?;
        if !schema.is_object() && !schema.is_boolean() {
            return Err(Refusal("schema must be a JSON object (or true / false)".into()));
        }
        let depth = depth(&schema);
        if depth > MAX_SCHEMA_DEPTH {
            return Err(Refusal(format!("schema may nest at most {MAX_SCHEMA_DEPTH} arrays or objects; this one nests {depth}")));
        }
        if let Some(d) = schema.get("$schema").and_then(Value::as_str)
            && d.trim_end_matches('#') != "https://json-schema.org/draft/2020-12/schema"
        {
            return Err(Refusal(format!(
                "schema's $schema is {d:?}: the catalogue takes draft 2020-12 (https://json-schema.org/draft/2020-12/schema) or no $schema"
            )));
        }
        if let Err(e) = jsonschema::draft202012::meta::validate(&schema) {
            return Err(Refusal(format!("schema is not a valid JSON Schema (2020-12) at {}: {e}", pointer_of(e.instance_path().as_str()))));
        }
        let validator = jsonschema::draft202012::new(&schema).map_err(|e| Refusal(format!("schema cannot be used: {e}")))?;
        Ok(Self { validator })
    }

    /// The first violations (at most [`MAX_VIOLATIONS`]) of `payload`.
    pub fn violations(&self, payload: &Value) -> Vec<Violation> {
        self.validator
            .iter_errors(payload)
            .take(MAX_VIOLATIONS)
            .map(|e| Violation { pointer: e.instance_path().as_str().to_owned(), message: e.to_string() })
            .collect()
    }
}

/// `examples`: a JSON array of at most [`MAX_EXAMPLES`] payloads, each
/// satisfying `schema` if there is one.
pub fn check_examples(schema: Option<&EventSchema>, text: &str) -> Result<(), Refusal> {
    if text.len() > MAX_EXAMPLES_BYTES {
        return Err(Refusal(format!("examples may be at most {MAX_EXAMPLES_BYTES} bytes together; these are {}", text.len())));
    }
    let examples: Value = serde_json::from_str(text).map_err(|e| Refusal(format!("examples are not JSON: {e}")))?;
    let Value::Array(items) = examples else {
        return Err(Refusal("examples must be a JSON array of example payloads".into()));
    };
    if items.len() > MAX_EXAMPLES {
        return Err(Refusal(format!("examples may list at most {MAX_EXAMPLES} payloads; these list {}", items.len())));
    }
    if let Some(schema) = schema {
        for (i, example) in items.iter().enumerate() {
            if let Some(v) = schema.violations(example).first() {
                return Err(Refusal(format!("example {} of {} does not satisfy the schema {v}", i + 1, items.len())));
            }
        }
    }
    Ok(())
}

/// A name as a refusal echoes it: quoted, and cut after 64 characters.
fn shown(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
        None => format!("{s:?}"),
    }
}

/// "" stays "" (the root), shown as "/".
fn pointer_of(p: &str) -> &str {
    if p.is_empty() { "/" } else { p }
}

/// Arrays and objects nested, counting the outermost; iterative so that no
/// input can exhaust the stack.
fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        deepest = deepest.max(d);
        stack.extend(children.map(|c| (c, d + 1)));
    }
    deepest
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn invoice_schema() -> EventSchema {
        EventSchema::compile(
            r##"{"type": "object", "required": ["id", "amount"], "properties": {
                 "id": {"type": "string", "pattern": "^in_"},
                 "amount": {"type": "integer", "minimum": 1, "maximum": 18446744073709551615},
                 "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}}},
               "$defs": {"line": {"type": "object", "required": ["sku"]}}}"##,
        )
        .unwrap()
    }

    #[test]
    fn names_are_dotted_segments() {
        for ok in ["invoice.paid", "order.line_item.added", "a", "v2-beta.x_y"] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        for bad in ["", ".paid", "invoice.", "invoice..paid", "invoice paid", "invoice.*", "é.x", &"a".repeat(129)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_payload_is_checked_with_pointers_to_what_is_wrong() {
        let schema = invoice_schema();
        assert_eq!(schema.violations(&json!({"id": "in_1", "amount": 5, "lines": [{"sku": "a"}]})), vec![]);
        let v = schema.violations(&json!({"id": "x", "amount": 0, "lines": [{"sku": "a"}, {}]}));
        let pointers: Vec<&str> = v.iter().map(|v| v.pointer.as_str()).collect();
        assert!(pointers.contains(&"/id") && pointers.contains(&"/amount") && pointers.contains(&"/lines/1"), "{v:?}");
        let missing = schema.violations(&json!({}));
        assert!(missing.iter().all(|v| v.pointer.is_empty()) && missing.len() == 2, "{missing:?}");
    }

    #[test]
    fn a_64_bit_integer_is_compared_exactly() {
        let schema = invoice_schema();
        let max: Value = serde_json::from_str(r#"{"id": "in_1", "amount": 18446744073709551615}"#).unwrap();
        assert!(schema.violations(&max).is_empty());
        let schema = EventSchema::compile(r#"{"properties": {"n": {"maximum": 9007199254740993}}}"#).unwrap();
        // 2^53 + 1 and 2^53 + 2 are the same double; as integers they differ.
        let over: Value = serde_json::from_str(r#"{"n": 9007199254740994}"#).unwrap();
        assert_eq!(schema.violations(&over).len(), 1, "a double would have let 2^53+2 pass a maximum of 2^53+1");
    }

    #[test]
    fn at_most_ten_violations_are_reported() {
        let schema = EventSchema::compile(r#"{"additionalProperties": false}"#).unwrap();
        let wide: serde_json::Map<String, Value> = (0..30).map(|i| (format!("k{i}"), json!(i))).collect();
        assert!(schema.violations(&Value::Object(wide)).len() <= MAX_VIOLATIONS);
    }

    #[test]
    fn bad_schemas_are_refused_by_what_is_wrong() {
        let refused = |s: &str| EventSchema::compile(s).unwrap_err().0;
        assert!(refused("{").contains("not JSON"));
        assert!(refused("[1]").contains("JSON object"));
        assert!(refused(r#"{"type": "strang"}"#).contains("not a valid JSON Schema"), "{}", refused(r#"{"type": "strang"}"#));
        assert!(refused(r#"{"minimum": "one"}"#).contains("not a valid JSON Schema"));
        assert!(refused(r#"{"$schema": "http://json-schema.org/draft-07/schema#"}"#).contains("2020-12"));
        assert!(refused(r#"{"$ref": "https://example.com/other.json"}"#).contains("cannot be used"));
        assert!(refused(r##"{"$ref": "#/$defs/missing"}"##).contains("cannot be used"));
        let deep = format!("{}{}", r#"{"items":"#.repeat(40), "{}".to_owned() + &"}".repeat(40));
        assert!(refused(&deep).contains("nest at most 32"), "{}", refused(&deep));
        let big = format!(r#"{{"description": "{}"}}"#, "x".repeat(MAX_SCHEMA_BYTES));
        assert!(refused(&big).contains("at most 65536 bytes"));
    }

    #[test]
    fn examples_must_satisfy_the_schema() {
        let schema = invoice_schema();
        assert_eq!(check_examples(Some(&schema), r#"[{"id": "in_1", "amount": 3}]"#), Ok(()));
        let e = check_examples(Some(&schema), r#"[{"id": "in_1", "amount": 3}, {"id": "in_2"}]"#).unwrap_err().0;
        assert!(e.contains("example 2 of 2") && e.contains("amount"), "{e}");
        assert!(check_examples(None, r#"{"id": 1}"#).unwrap_err().0.contains("JSON array"));
        assert!(check_examples(None, &format!("[{}]", ["1"; 11].join(","))).unwrap_err().0.contains("at most 10"));
        assert_eq!(check_examples(None, r#"[1, "two", {"three": 3}]"#), Ok(()));
    }
}
