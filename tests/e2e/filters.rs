//! Issue 27.2: payload filters. An endpoint's filter decides at expansion
//! whether an event of its types becomes a delivery for it: a non-matching
//! event leaves no delivery row behind; numbers compare exactly as
//! published; a change applies to events published after it; mistakes are
//! refused with the JSON pointer and the number that broke the rule.

use std::{collections::BTreeSet, time::Duration};

use relay_tests::{Options, Receiver, Rest, Stack};
use serde_json::{Value, json};

async fn endpoint(rest: &Rest, url: &str, filter: Option<Value>) -> anyhow::Result<String> {
    let mut body = json!({"url": url, "event_types": ["order.paid"]});
    if let Some(f) = filter {
        body["filter"] = f;
    }
    let (status, created) = rest.post("/v1/webhooks", body).await?;
    anyhow::ensure!(status == 201, "creating an endpoint answered {status}: {created}");
    Ok(created["endpoint"]["id"].as_str().unwrap_or_default().to_owned())
}

/// The `n` of every event a path received.
fn ns(receiver: &Receiver, path: &str) -> BTreeSet<u64> {
    receiver.at(path).iter().map(|r| r.json()["payload"]["n"].as_u64().expect("n")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_decides_at_expansion_which_endpoints_get_an_event() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("filters").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let example = json!({"amount": {"$gte": 100}, "currency": {"$in": ["EUR", "USD"]}, "customer.tier": {"$exists": true}});
    let a = endpoint(&rest, &receiver.url("/a"), Some(example.clone())).await?;
    // Past 2^53: a float would call 10000000000000000001 equal to the bound.
    endpoint(&rest, &receiver.url("/b"), Some(json!({"order_id": {"$gt": 10000000000000000000u64}}))).await?;
    endpoint(&rest, &receiver.url("/d"), Some(json!({"$or": [{"items.sku": "X-1"}, {"amount": {"$lt": 0}}]}))).await?;
    endpoint(&rest, &receiver.url("/e"), Some(json!({"name": {"$gt": "é"}, "$not": {"customer.tier": "gold"}}))).await?;
    // No filter: every event, and the witness that all were expanded.
    endpoint(&rest, &receiver.url("/all"), None).await?;

    let events = [
        json!({"n": 1, "amount": 100, "currency": "EUR", "customer": {"tier": "gold"}, "order_id": 10000000000000000001u64,
               "items": [{"sku": "X-1"}], "name": "Ａcme"}),
        json!({"n": 2, "amount": 99.99, "currency": "EUR", "customer": {"tier": "gold"}, "order_id": 10000000000000000000u64,
               "items": [], "name": "zeta"}),
        json!({"n": 3, "amount": 150, "currency": "GBP", "customer": {"tier": "silver"}, "order_id": 18000000000000000000u64,
               "items": [{"sku": "Y"}, {"sku": "X-1"}], "name": "Ｚ"}),
        json!({"n": 4, "amount": -5, "currency": "USD", "customer": {}, "order_id": 1, "name": "abc"}),
        json!({"n": 5, "amount": 1000, "currency": "USD", "customer": {"tier": null}, "order_id": 2, "name": "😀"}),
    ];
    let mut ids = Vec::new();
    for e in &events {
        ids.push(rest.publish("order.paid", e.clone()).await?);
    }
    let all = receiver.wait_at("/all", events.len(), Duration::from_secs(20)).await;
    assert_eq!(all.len(), events.len());
    // Expansion writes every endpoint's rows of an event at once: with the
    // witness's five sent, every row there will ever be exists; wait for
    // the rows that exist to be sent.
    let pg = stack.pg().await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    receiver.wait_for(rows as usize, Duration::from_secs(20)).await;

    let expect = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
    assert_eq!(ns(&receiver, "/a"), expect(&[1, 5]), "amount ≥ 100, EUR/USD, a tier that exists (null counts)");
    assert_eq!(ns(&receiver, "/b"), expect(&[1, 3]), "order ids compared exactly");
    assert_eq!(ns(&receiver, "/d"), expect(&[1, 3, 4]), "an item's sku, or a negative amount");
    assert_eq!(ns(&receiver, "/e"), expect(&[3, 5]), "names after é by code point, and not a gold tier");
    assert_eq!(rows, 5 + 2 + 2 + 3 + 2, "a refused pair leaves no delivery row");
    // What a filter passes is delivered as published.
    let one = receiver.at("/b").into_iter().find(|r| r.json()["payload"]["n"] == 1).expect("event 1 at /b");
    assert!(String::from_utf8_lossy(&one.body).contains("\"order_id\":10000000000000000001"), "{:?}", one.body);
    // The event's deliveries name only the endpoints that matched.
    assert_eq!(rest.deliveries(&ids[1]).await?.len(), 1, "event 2 went to the unfiltered endpoint alone");

    // Read back as a JSON object, exactly as written, and kept as text.
    let read = rest.get(&format!("/v1/webhooks/{a}")).await?;
    assert_eq!(read["filter"], example, "{read}");
    let listed = rest.get("/v1/webhooks").await?;
    let b_read = listed["endpoints"].as_array().unwrap().iter().find(|e| e["url"].as_str().unwrap().ends_with("/b")).cloned().unwrap();
    assert_eq!(b_read["filter"]["order_id"]["$gt"], json!(10000000000000000000u64), "{b_read}");
    let unfiltered = listed["endpoints"].as_array().unwrap().iter().find(|e| e["url"].as_str().unwrap().ends_with("/all")).cloned();
    assert_eq!(unfiltered.unwrap()["filter"], Value::Null);
    let stored: String = sqlx::query_scalar("SELECT filter FROM webhook_endpoints WHERE id = $1::uuid").bind(&a).fetch_one(&pg).await?;
    assert_eq!(serde_json::from_str::<Value>(&stored)?, example);
    pg.close().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_change_applies_to_events_published_after_it() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("filter-change").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let id = endpoint(&rest, &receiver.url("/f"), Some(json!({"n": {"$gte": 10}}))).await?;
    endpoint(&rest, &receiver.url("/all"), None).await?;
    let path = format!("/v1/webhooks/{id}");
    let mut published = 0;
    let mut publish = async |n: u64| -> anyhow::Result<()> {
        rest.publish("order.paid", json!({"n": n})).await?;
        published += 1;
        receiver.wait_at("/all", published, Duration::from_secs(20)).await;
        Ok(())
    };

    publish(5).await?;
    publish(11).await?;
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"filter": {"n": {"$lt": 10}}}))).await?;
    assert_eq!((status, &body["endpoint"]["filter"]), (200, &json!({"n": {"$lt": 10}})), "{body}");
    publish(6).await?;
    publish(12).await?;
    // An update that names no filter keeps it.
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"max_in_flight": 3}))).await?;
    assert_eq!((status, &body["endpoint"]["filter"]), (200, &json!({"n": {"$lt": 10}})), "{body}");
    publish(7).await?;
    // Both at once is a mistake; null removes it, as clear_filter does.
    let both = json!({"filter": {"n": 1}, "clear_filter": true});
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(both)).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_filter")), "{body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"filter": null}))).await?;
    assert_eq!((status, &body["endpoint"]["filter"]), (200, &Value::Null), "{body}");
    publish(50).await?;
    receiver.wait_at("/f", 4, Duration::from_secs(20)).await;
    let got: Vec<u64> = receiver.at("/f").iter().map(|r| r.json()["payload"]["n"].as_u64().unwrap()).collect();
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![6, 7, 11, 50], "each event judged by the filter in force when it was published");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_filters_are_refused_with_the_pointer_and_number() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("filter-bad").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let receiver = Receiver::start().await?;
    let url = receiver.url("/never");
    let deep = format!("{}{}{}", r#"{"$not":"#.repeat(999), r#"{"a":1}"#, "}".repeat(999));
    let many = (0..101).map(|i| format!(r#""f{i}": 1"#)).collect::<Vec<_>>().join(",");
    let cases: Vec<(String, Vec<&str>)> = vec![
        (deep, vec!["at most 10 deep", "1000"]),
        (format!("{{{many}}}"), vec!["/f100", "at most 100 tests"]),
        (r#"{"amount": {"$gte": [1]}}"#.into(), vec!["/amount/$gte", "numbers or strings"]),
        (r#"{"a": {"$regex": "^x"}}"#.into(), vec!["/a/$regex", "unknown operator"]),
        (r#"{"$or": [{"a": 1}, 7]}"#.into(), vec!["/$or/1", "an object"]),
        (r#"5"#.into(), vec!["expected an object"]),
        (r#""{\"a\": 1}""#.into(), vec!["expected an object", "a string"]),
        (format!(r#"{{"a": "{}"}}"#, "x".repeat(20_000)), vec!["16384"]),
        (r#"{"a\r\nX-Injected: 1": 1}"#.into(), vec![]),
    ];
    for (filter, words) in &cases {
        let body = format!(r#"{{"url": "{url}", "event_types": ["t"], "filter": {filter}}}"#);
        let (status, reply) = rest.raw(reqwest::Method::POST, "/v1/webhooks", body).await?;
        if words.is_empty() {
            // A path may hold any characters: it names a key, never a header.
            assert_eq!(status, 201, "{reply}");
            continue;
        }
        assert_eq!((status, reply["reason"].as_str()), (400, Some("invalid_filter")), "{}: {reply}", &filter[..filter.len().min(80)]);
        let message = reply["message"].as_str().unwrap_or_default();
        for w in words {
            assert!(message.contains(w), "{message:?} should say {w:?}");
        }
    }
    // Nothing refused was stored; the one accepted was.
    let listed = rest.get("/v1/webhooks").await?;
    assert_eq!(listed["endpoints"].as_array().map(Vec::len), Some(1), "{listed}");
    Ok(())
}
