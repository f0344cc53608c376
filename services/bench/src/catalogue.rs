//! The catalogue workloads (issue 29): W1's events with a realistic payload
//! of about 20 properties, nested, either under a schema in the catalogue
//! (`w1s`: every publish is checked) or with none (`w1s-none`: the same
//! payloads unchecked), so that the ratio of the two is the check's cost.

use anyhow::Result;
use serde_json::{Value, json};

/// The event type's schema: what an integrator's "order paid" looks like.
pub fn schema() -> Value {
    let money = json!({"type": "object", "required": ["amount", "currency"], "additionalProperties": false,
        "properties": {"amount": {"type": "integer", "minimum": 0}, "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}}});
    let address = json!({"type": "object", "required": ["line1", "city", "country"],
        "properties": {"line1": {"type": "string", "maxLength": 200}, "line2": {"type": "string"},
                       "city": {"type": "string"}, "postal_code": {"type": "string"}, "country": {"type": "string", "minLength": 2, "maxLength": 2}}});
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["n", "order_id", "status", "total", "customer", "lines", "created_at"],
        "properties": {
            "n": {"type": "integer", "minimum": 0},
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "status": {"enum": ["paid", "refunded", "partially_refunded"]},
            "total": money.clone(),
            "tax": money.clone(),
            "customer": {"type": "object", "required": ["id", "email"], "properties": {
                "id": {"type": "string"}, "email": {"type": "string", "maxLength": 254}, "name": {"type": "string"},
                "billing": address.clone(), "shipping": address}},
            "lines": {"type": "array", "minItems": 1, "maxItems": 100, "items": {"type": "object", "required": ["sku", "quantity", "price"],
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "price": money}}},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "created_at": {"type": "string"},
            "note": {"type": "string"}
        }
    })
}

/// Event `n`'s payload, about `bytes` long, satisfying [`schema`].
pub fn payload(n: usize, note: &str) -> Value {
    let address = json!({"line1": "1 Rue de la Paix", "city": "Paris", "postal_code": "75002", "country": "FR"});
    json!({
        "n": n,
        "order_id": format!("ord_{n}"),
        "status": "paid",
        "total": {"amount": 12_900, "currency": "EUR"},
        "tax": {"amount": 2_150, "currency": "EUR"},
        "customer": {"id": format!("cus_{}", n % 97), "email": "ada@example.com", "name": "Ada", "billing": address.clone(), "shipping": address},
        "lines": [{"sku": "X-1", "quantity": 2, "price": {"amount": 4_000, "currency": "EUR"}},
                  {"sku": "Y-2", "quantity": 1, "price": {"amount": 4_900, "currency": "EUR"}}],
        "metadata": {"channel": "web", "campaign": "winter"},
        "created_at": "2026-12-03T08:00:00Z",
        "note": note
    })
}

/// Puts `bench.event` in the environment's catalogue with [`schema`].
pub async fn register(http: &reqwest::Client, rest_url: &str, key: &str) -> Result<()> {
    let body = json!({"name": "bench.event", "description": "An order was paid.", "schema": schema(), "examples": [payload(0, "")]});
    let resp = http.post(format!("{rest_url}/v1/event-types")).bearer_auth(key).json(&body).send().await?;
    anyhow::ensure!(resp.status().as_u16() == 201, "adding bench.event to the catalogue: {} {}", resp.status(), resp.text().await?);
    Ok(())
}
