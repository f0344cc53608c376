//! The OpenAPI 3 document of the tenant REST facade, generated from the same
//! descriptors and annotations the facade routes by. Served at
//! `GET /openapi.json` and checked in as `docs/openapi.json` (a test fails
//! when the two differ).

use std::collections::BTreeMap;

use anyhow::Result;
use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{Map, Value, json};

use crate::rest::{self, Binding};

/// Leading comments of a descriptor element, from the source info protoc kept.
fn comment(file: &prost_reflect::FileDescriptor, path: &[i32]) -> Option<String> {
    let info = file.file_descriptor_proto().source_code_info.as_ref()?;
    let loc = info.location.iter().find(|l| l.path == path)?;
    let text = loc.leading_comments.as_deref()?.trim();
    (!text.is_empty()).then(|| text.lines().map(str::trim).collect::<Vec<_>>().join(" "))
}

fn schema_name(m: &MessageDescriptor) -> String {
    m.full_name().to_owned()
}

fn field_schema(f: &FieldDescriptor, refs: &mut Vec<MessageDescriptor>) -> Value {
    let single = match f.kind() {
        // JSON text on the wire of gRPC, the JSON value itself in REST.
        Kind::String if rest::is_raw_json(f) => json!({}),
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => json!({"type": "string", "format": "date-time"}),
            "google.protobuf.Value" => json!({"description": "any JSON value"}),
            "google.protobuf.Struct" => json!({"type": "object"}),
            _ => {
                refs.push(m.clone());
                json!({"$ref": format!("#/components/schemas/{}", schema_name(&m))})
            }
        },
        Kind::Enum(e) => json!({"type": "string", "enum": e.values().map(|v| v.name().to_owned()).collect::<Vec<_>>()}),
        Kind::String => json!({"type": "string"}),
        Kind::Bool => json!({"type": "boolean"}),
        Kind::Bytes => json!({"type": "string", "format": "byte"}),
        Kind::Double | Kind::Float => json!({"type": "number"}),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => json!({"type": "integer", "format": "int32"}),
        Kind::Uint32 | Kind::Fixed32 => json!({"type": "integer", "format": "int64", "minimum": 0}),
        // proto3 JSON writes 64-bit integers as strings.
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 | Kind::Uint64 | Kind::Fixed64 => json!({"type": "string", "format": "int64"}),
    };
    let mut s = if f.is_list() { json!({"type": "array", "items": single}) } else { single };
    if let Some(text) = comment(&f.parent_file(), f.path()) {
        s.as_object_mut().expect("an object").insert("description".into(), text.into());
    }
    s
}

fn message_schema(m: &MessageDescriptor, skip: &[String], refs: &mut Vec<MessageDescriptor>) -> Value {
    let mut props = Map::new();
    // Deprecated fields are refused when set; the document does not offer them.
    let deprecated = |f: &FieldDescriptor| f.field_descriptor_proto().options.as_ref().is_some_and(|o| o.deprecated());
    for f in m.fields().filter(|f| !skip.iter().any(|s| s == f.name()) && !deprecated(f)) {
        props.insert(f.name().to_owned(), field_schema(&f, refs));
    }
    let mut s = json!({"type": "object", "properties": props});
    if let Some(text) = comment(&m.parent_file(), m.path()) {
        s["description"] = text.into();
    }
    s
}

fn path_params(path: &str) -> Vec<String> {
    path.split('/').filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).map(str::to_owned).collect()
}

/// The whole document, deterministic (sorted maps), for `docs/openapi.json`.
pub fn document() -> Result<Value> {
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    let mut refs: Vec<MessageDescriptor> = Vec::new();
    for (verb, path, b) in rest::rest_methods()? {
        let Binding { input, output, body_all, response_field, success, method, .. } = &b;
        let in_path = path_params(&path);
        let mut parameters: Vec<Value> =
            in_path.iter().map(|p| json!({"name": p, "in": "path", "required": true, "schema": {"type": "string"}})).collect();
        if !body_all {
            for f in input.fields().filter(|f| !in_path.iter().any(|p| p == f.name())) {
                parameters.push(json!({"name": f.name(), "in": "query", "required": false, "schema": field_schema(&f, &mut refs)}));
            }
        }
        let mut op = Map::new();
        op.insert("operationId".into(), method.name().into());
        op.insert("tags".into(), json!([method.parent_service().name()]));
        if let Some(text) = comment(&method.parent_file(), method.path()) {
            op.insert("summary".into(), text.into());
        }
        if !parameters.is_empty() {
            op.insert("parameters".into(), parameters.into());
        }
        if *body_all {
            let schema = message_schema(input, &in_path, &mut refs);
            op.insert("requestBody".into(), json!({"required": true, "content": {"application/json": {"schema": schema}}}));
        }
        let ok = if success.as_u16() == 204 {
            json!({"description": "done; no body"})
        } else {
            let shown = match response_field.as_ref().map(|f| f.kind()) {
                Some(Kind::Message(m)) => m,
                _ => output.clone(),
            };
            refs.push(shown.clone());
            json!({"description": "success", "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{}", schema_name(&shown))}}}})
        };
        op.insert(
            "responses".into(),
            json!({
                success.as_u16().to_string(): ok,
                "default": {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            }),
        );
        paths.entry(path).or_default().insert(verb.as_str().to_ascii_lowercase(), op.into());
    }

    let mut schemas: BTreeMap<String, Value> = BTreeMap::new();
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "properties": {
                "code": {"type": "integer", "description": "the gRPC status code"},
                "message": {"type": "string", "description": "what went wrong, for a human"},
                "reason": {"type": "string", "description": "what went wrong, for a program (e.g. endpoint_quota_exceeded)"},
            },
        }),
    );
    while let Some(m) = refs.pop() {
        let name = schema_name(&m);
        if schemas.contains_key(&name) {
            continue;
        }
        let s = message_schema(&m, &[], &mut refs);
        schemas.insert(name, s);
    }
    Ok(json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Relay Webhooks tenant API",
            "version": "v1",
            "description": "Generated from the protos' google.api.http annotations; the same routes the REST facade serves.",
        },
        "security": [{"apiKey": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "an API key: Authorization: Bearer rk_…"}},
            "schemas": schemas,
        },
    }))
}

/// The document as checked in: pretty JSON with a trailing newline.
pub fn rendered() -> Result<String> {
    Ok(serde_json::to_string_pretty(&document()?)? + "\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_in_document_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        let checked_in = std::fs::read_to_string(path).unwrap_or_default();
        let generated = super::rendered().unwrap();
        assert!(
            checked_in == generated,
            "docs/openapi.json is stale: regenerate it with `cargo run -q -p relay-api -- openapi > docs/openapi.json`"
        );
    }

    #[test]
    fn every_route_is_documented_with_its_status() {
        let doc = super::document().unwrap();
        assert!(doc["paths"]["/v1/webhooks"]["post"]["responses"]["201"].is_object());
        assert!(doc["paths"]["/v1/webhooks/{id}"]["delete"]["responses"]["204"].is_object());
        assert!(doc["paths"]["/v1/events"]["post"]["responses"]["202"].is_object());
        assert_eq!(doc["paths"]["/v1/webhooks/{id}"]["get"]["parameters"][0]["name"], "id");
        let create = &doc["components"]["schemas"]["relay.tenant.v1.CreateWebhookEndpointResponse"];
        assert!(create["properties"]["secret"].is_object(), "{create}");
    }
}
