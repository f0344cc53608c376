//! Issue 29.1: the event catalogue. Types with schemas and examples as a
//! resource; a publish of a type with a schema is checked against it (400
//! with the JSON pointers of the first violations); an environment that
//! requires known types refuses other types at publish and in endpoint
//! subscriptions; bad input is a 400 naming the field, never a 5xx.

use std::time::Duration;

use relay_tests::{Options, Receiver, Rest, Stack};
use reqwest::Method;
use serde_json::{Value, json};

/// A schema as a tenant would write one, with a 64-bit bound that a double
/// cannot hold, sent as text so that its digits are the tenant's.
const INVOICE_SCHEMA: &str = r##"{"$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object", "required": ["id", "amount", "currency"],
  "properties": {
    "id": {"type": "string", "pattern": "^in_"},
    "amount": {"type": "integer", "minimum": 1, "maximum": 18446744073709551615},
    "currency": {"enum": ["EUR", "USD"]},
    "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}}},
  "$defs": {"line": {"type": "object", "required": ["sku"]}}}"##;

fn create_body(name: &str, schema: &str, examples: &str) -> String {
    format!(r#"{{"name": "{name}", "description": "An invoice was paid.", "schema": {schema}, "examples": {examples}}}"#)
}

async fn refused(rest: &Rest, method: Method, path: &str, body: Value) -> anyhow::Result<(u16, String, String)> {
    let (status, answer) = rest.call(method, path, Some(body).filter(|b| !b.is_null())).await?;
    Ok((status, answer["reason"].as_str().unwrap_or_default().to_owned(), answer["message"].as_str().unwrap_or_default().to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_are_checked_against_their_types_schema() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("catalogue").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/in"), &["invoice.paid", "note.added"]).await?;

    let (status, created) = rest
        .raw(
            Method::POST,
            "/v1/event-types",
            create_body("invoice.paid", INVOICE_SCHEMA, r#"[{"id": "in_1", "amount": 1200, "currency": "EUR"}]"#),
        )
        .await?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["event_type"]["revision"], "1", "{created}");
    // Read back as JSON, the bound's digits as written.
    let raw = rest.http.get(format!("{}/v1/event-types/invoice.paid", rest.base)).bearer_auth(&tenant.api_key).send().await?.text().await?;
    assert!(raw.contains("18446744073709551615"), "{raw}");
    let listed = rest.get("/v1/event-types").await?;
    assert_eq!(listed["event_types"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed["event_types"][0]["examples"][0]["amount"], 1200);

    // A payload that satisfies it goes through, and arrives as published.
    let ok = rest.publish("invoice.paid", json!({"id": "in_7", "amount": 18446744073709551615u64, "currency": "USD"})).await?;
    // One that does not: 400, naming each wrong value by its JSON pointer.
    let (status, reason, message) = refused(
        &rest,
        Method::POST,
        "/v1/events",
        json!({"type": "invoice.paid", "payload": {"id": "x_7", "currency": "GBP", "lines": [{"sku": 1}, {}]}}),
    )
    .await?;
    assert_eq!((status, reason.as_str()), (400, "payload_schema_mismatch"), "{message}");
    for named in ["at /id", "at /currency", "at /lines/1", "\"amount\""] {
        assert!(message.contains(named), "the refusal names {named}: {message}");
    }
    // A type outside the catalogue is free while known types are not required.
    let free = rest.publish("note.added", json!({"text": "hi"})).await?;
    let arrived = receiver.wait_at("/in", 2, Duration::from_secs(20)).await;
    let ids: Vec<String> = arrived.iter().map(|r| r.json()["id"].as_str().unwrap_or_default().to_owned()).collect();
    assert!(ids.contains(&ok) && ids.contains(&free), "{ids:?}");
    let sent = arrived.iter().find(|r| r.json()["id"] == ok.as_str()).expect("the valid invoice");
    assert!(String::from_utf8_lossy(&sent.body).contains("\"amount\":18446744073709551615"), "delivered as published");

    // Requiring known types: an unknown type is refused at publish and in a
    // subscription; a known one is fine.
    let (status, settings) = rest.call(Method::PUT, "/v1/event-catalogue", Some(json!({"require_known_event_types": true}))).await?;
    assert_eq!(status, 200, "{settings}");
    assert_eq!(rest.get("/v1/event-catalogue").await?["settings"]["require_known_event_types"], true);
    let (status, reason, message) = refused(&rest, Method::POST, "/v1/events", json!({"type": "note.added", "payload": {}})).await?;
    assert_eq!((status, reason.as_str()), (400, "unknown_event_type"), "{message}");
    assert!(message.contains("note.added"), "{message}");
    let (status, reason, message) =
        refused(&rest, Method::POST, "/v1/webhooks", json!({"url": receiver.url("/x"), "event_types": ["invoice.paid", "note.added"]}))
            .await?;
    assert_eq!((status, reason.as_str()), (400, "unknown_event_type"), "{message}");
    rest.endpoint(&receiver.url("/known"), &["invoice.paid"]).await?;

    // A new schema must admit the stored examples.
    let (status, reason, message) =
        refused(&rest, Method::PATCH, "/v1/event-types/invoice.paid", json!({"schema": {"required": ["refund_id"]}})).await?;
    assert_eq!((status, reason.as_str()), (400, "invalid_examples"), "{message}");
    // Without its schema, the payload refused before goes through.
    let (status, changed) =
        rest.call(Method::PATCH, "/v1/event-types/invoice.paid", Some(json!({"clear_schema": true, "deprecated": true}))).await?;
    assert_eq!(status, 200, "{changed}");
    assert_eq!((changed["event_type"]["schema"].clone(), changed["event_type"]["deprecated"].clone()), (Value::Null, json!(true)));
    assert_eq!(changed["event_type"]["revision"], "2");
    rest.publish("invoice.paid", json!({"id": "x_7", "currency": "GBP"})).await?;

    // The same name twice is a conflict; a deleted type is gone, and with
    // known types required, so are its publishes.
    let (status, reason, _) = refused(&rest, Method::POST, "/v1/event-types", json!({"name": "invoice.paid"})).await?;
    assert_eq!((status, reason.as_str()), (409, "event_type_exists"));
    let (status, _) = rest.call(Method::DELETE, "/v1/event-types/invoice.paid", None).await?;
    assert_eq!(status, 204);
    let (status, reason, _) = refused(&rest, Method::GET, "/v1/event-types/invoice.paid", Value::Null).await?;
    assert_eq!((status, reason.as_str()), (404, "not_found"));
    let (status, reason, _) = refused(&rest, Method::POST, "/v1/events", json!({"type": "invoice.paid", "payload": {}})).await?;
    assert_eq!((status, reason.as_str()), (400, "unknown_event_type"));

    // Another tenant's catalogue is its own.
    let other = stack.tenant("catalogue-other").await?;
    let other_rest = Rest::new(&stack.rest_url, Some(&other.api_key));
    let (status, _) = other_rest.post("/v1/event-types", json!({"name": "note.added"})).await?;
    assert_eq!(status, 201);
    let (status, reason, _) = refused(&rest, Method::GET, "/v1/event-types/note.added", Value::Null).await?;
    assert_eq!((status, reason.as_str()), (404, "not_found"), "another tenant's type answers 404");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_catalogue_input_is_refused_by_name() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("catalogue-bad").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let deep = (0..40).fold(json!({}), |inner, _| json!({"items": inner}));
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"name": "invoice paid"}), "invalid_event_type", "dot-separated"),
        (json!({"name": "invoice..paid"}), "invalid_event_type", "dot-separated"),
        (json!({"name": "a".repeat(129)}), "invalid_event_type", "129 characters"),
        (json!({"name": "x.y", "description": "d".repeat(2001)}), "invalid_description", "2001"),
        (json!({"name": "x.y", "schema": {"type": "strang"}}), "invalid_schema", "not a valid JSON Schema"),
        (json!({"name": "x.y", "schema": [1]}), "invalid_schema", "JSON object"),
        (json!({"name": "x.y", "schema": {"$ref": "https://example.com/s.json"}}), "invalid_schema", "cannot be used"),
        (json!({"name": "x.y", "schema": {"$schema": "http://json-schema.org/draft-07/schema#"}}), "invalid_schema", "2020-12"),
        (json!({"name": "x.y", "schema": deep}), "invalid_schema", "nests 41"),
        (json!({"name": "x.y", "schema": {"description": "s".repeat(70_000)}}), "invalid_schema", "65536 bytes"),
        (json!({"name": "x.y", "examples": {"a": 1}}), "invalid_examples", "JSON array"),
        (json!({"name": "x.y", "examples": (0..11).collect::<Vec<u32>>()}), "invalid_examples", "these list 11"),
        (json!({"name": "x.y", "schema": {"type": "object"}, "examples": [1]}), "invalid_examples", "example 1 of 1"),
    ];
    for (body, reason, named) in cases {
        let (status, got, message) = refused(&rest, Method::POST, "/v1/event-types", body.clone()).await?;
        assert_eq!((status, got.as_str()), (400, reason), "{message}");
        assert!(message.contains(named), "{reason} names {named:?}: {message}");
    }
    let (status, _) = rest.post("/v1/event-types", json!({"name": "kept.one"})).await?;
    assert_eq!(status, 201);
    let (status, got, message) =
        refused(&rest, Method::PATCH, "/v1/event-types/kept.one", json!({"schema": {"type": "object"}, "clear_schema": true})).await?;
    assert_eq!((status, got.as_str()), (400, "invalid_schema"), "{message}");
    // A name the catalogue lacks is 404 whatever the body says.
    let (status, got, _) =
        refused(&rest, Method::PATCH, "/v1/event-types/none.such", json!({"schema": {"type": "object"}, "clear_schema": true})).await?;
    assert_eq!((status, got.as_str()), (404, "not_found"));
    // A long name is echoed cut short.
    let (status, got, message) = refused(&rest, Method::DELETE, &format!("/v1/event-types/{}", "é".repeat(600)), Value::Null).await?;
    assert_eq!((status, got.as_str()), (400, "invalid_event_type"));
    assert!(message.len() < 600, "{} bytes", message.len());
    let names: Vec<Value> = rest.get("/v1/event-types").await?["event_types"].as_array().cloned().unwrap_or_default();
    assert_eq!(names.iter().map(|t| t["name"].clone()).collect::<Vec<_>>(), [json!("kept.one")], "nothing refused was stored");
    Ok(())
}
