//! Issue 28, its first part: ordering keys on publish. The events of one key
//! in one environment are numbered 1, 2, 3… without gaps or repeats in the
//! order the api accepted them, also when many callers publish the key at
//! once through two apis; a caller's own successive publishes of a key get
//! increasing numbers; a repeat publish takes no number; the outbox holds
//! each key's events in their numbers' order; bad keys are refused by name.

use std::collections::BTreeMap;

use relay_tests::{Options, Rest, Stack};
use serde_json::{Value, json};

/// Publishes with a key; (event id, its number; 0 for none, as proto3 JSON
/// prints a uint64: a string).
async fn publish_keyed(rest: &Rest, body: Value) -> anyhow::Result<(String, u64)> {
    let (status, reply) = rest.post("/v1/events", body).await?;
    anyhow::ensure!(status == 202, "publishing answered {status}: {reply}");
    let number = reply["ordering_sequence"].as_str().unwrap_or("0").parse()?;
    Ok((reply["event_id"].as_str().unwrap_or_default().to_owned(), number))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_events_are_numbered_in_publish_order_without_gaps_across_concurrent_callers_and_two_apis() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (second, _) = stack.start_api_replica().await?;
    let tenant = stack.tenant("ordering-keys").await?;
    const CALLERS: usize = 8;
    const EACH: usize = 25;
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        // Half the callers through each api: the numbers are the key's, not a process's.
        let rest = Rest::new(if caller % 2 == 0 { &stack.rest_url } else { &second }, Some(&tenant.api_key));
        tasks.push(tokio::spawn(async move {
            let mut mine: Vec<(String, u64)> = Vec::new();
            for n in 0..EACH {
                // Two shared keys, and one event in five without a key.
                let key = if n % 5 == 4 {
                    ""
                } else if n % 2 == 0 {
                    "order-1"
                } else {
                    "order-ü-2"
                };
                let (_, number) =
                    publish_keyed(&rest, json!({"type": "o", "payload": {"caller": caller, "n": n}, "ordering_key": key})).await?;
                mine.push((key.to_owned(), number));
            }
            anyhow::Ok(mine)
        }));
    }
    let mut numbers: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for task in tasks {
        let mine = task.await??;
        // One caller's successive publishes of a key: increasing numbers.
        for key in ["order-1", "order-ü-2"] {
            let seen: Vec<u64> = mine.iter().filter(|(k, _)| k == key).map(|(_, n)| *n).collect();
            assert!(seen.windows(2).all(|w| w[0] < w[1]), "{key}: a caller's numbers go up in its order: {seen:?}");
        }
        for (key, number) in mine {
            numbers.entry(key).or_default().push(number);
        }
    }
    assert!(numbers[""].iter().all(|&n| n == 0), "no key, no number");
    for key in ["order-1", "order-ü-2"] {
        let mut got = numbers[key].clone();
        got.sort_unstable();
        let want: Vec<u64> = (1..=got.len() as u64).collect();
        assert_eq!(got, want, "{key}: 1..n, each once");
    }

    // A repeat publish takes no number; the next event continues the count.
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let id = "0196b1a4-0000-7000-8000-00000000a001";
    let (_, first) = publish_keyed(&rest, json!({"id": id, "type": "o", "payload": 1, "ordering_key": "order-1"})).await?;
    let (status, again) = rest.post("/v1/events", json!({"id": id, "type": "o", "payload": 1, "ordering_key": "order-1"})).await?;
    assert_eq!((status, &again["duplicate"], &again["ordering_sequence"]), (202, &json!(true), &json!("0")), "{again}");
    let (_, next) = publish_keyed(&rest, json!({"type": "o", "payload": 2, "ordering_key": "order-1"})).await?;
    assert_eq!(next, first + 1, "no gap after a repeat publish");

    // The outbox holds each key's events in their numbers' order, and the
    // rows say what the replies said.
    let pg = stack.pg().await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT ordering_key, ordering_sequence FROM events WHERE environment_id = $1::uuid AND ordering_key IS NOT NULL ORDER BY seq",
    )
    .bind(&tenant.environment_id)
    .fetch_all(&pg)
    .await?;
    pg.close().await;
    for key in ["order-1", "order-ü-2"] {
        let in_outbox: Vec<i64> = rows.iter().filter(|(k, _)| k == key).map(|(_, n)| *n).collect();
        let want: Vec<i64> = (1..=in_outbox.len() as i64).collect();
        assert_eq!(in_outbox, want, "{key}: outbox order is number order");
    }
    assert_eq!(rows.iter().filter(|(k, _)| k == "order-1").count() as u64, next, "every number has its event");

    // The portal's event page shows the key and the number.
    let http = crate::portal::browser();
    let session = crate::portal::enter(&http, &crate::portal::mint(&rest).await?).await?;
    let (status, _, html) = crate::portal::page(&http, format!("{}/portal/events/{id}", stack.rest_url), Some(&session)).await?;
    assert_eq!(status, 200, "{html}");
    assert!(html.contains(&format!("order-1 · number {first}")), "the event page shows its key and number");
    stack.stop().await
}

/// A keyed publish tells new events from repeats before it writes them and
/// numbers them as it writes. A repeat of its id under no key (or another
/// key) holds none of its locks, so it can commit in between: here it is
/// held open in a transaction of the test's own until the publish waits for
/// it. The publish must then answer a duplicate and its key must not have
/// lost a number: the next event of the key is 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_committed_under_another_key_while_a_keyed_publish_writes_leaves_no_gap() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("ordering-race").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let pg = stack.pg().await?;
    let id = "0196b1a4-0000-7000-8000-00000000b001";
    let mut other = pg.begin().await?;
    sqlx::query("INSERT INTO events (environment_id, id, event_type, envelope) VALUES ($1::uuid, $2::uuid, 'o', '\\x7b7d'::bytea)")
        .bind(&tenant.environment_id)
        .bind(id)
        .execute(&mut *other)
        .await?;
    let publishing = {
        let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
        tokio::spawn(async move { rest.post("/v1/events", json!({"id": id, "type": "o", "payload": 1, "ordering_key": "race"})).await })
    };
    // The publish has read its snapshot (no such event) and waits on the
    // other transaction's row.
    let mut waited = false;
    for _ in 0..200 {
        let waiting: i64 = sqlx::query_scalar(
            // (Waiting on a transaction: the only one here is the test's own.
            // The statement's text is cut at 1 KiB in this view.)
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'transactionid'",
        )
        .fetch_one(&pg)
        .await?;
        if waiting > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    if !waited {
        let seen: Vec<(Option<String>, Option<String>, Option<String>)> =
            sqlx::query_as("SELECT wait_event_type, wait_event, left(query, 80) FROM pg_stat_activity WHERE datname = current_database()")
                .fetch_all(&pg)
                .await?;
        let answer = if publishing.is_finished() { format!("{:?}", publishing.await?) } else { "still waiting".into() };
        panic!("the keyed publish never waited for the other insert of its id: {seen:?}; publish: {answer}");
    }
    other.commit().await?;
    let (status, reply) = publishing.await??;
    assert_eq!((status, &reply["duplicate"], &reply["ordering_sequence"]), (202, &json!(true), &json!("0")), "{reply}");
    let (_, next) = publish_keyed(&rest, json!({"type": "o", "payload": 2, "ordering_key": "race"})).await?;
    assert_eq!(next, 1, "the repeat took no number of its key");
    let numbers: Vec<i64> =
        sqlx::query_scalar("SELECT ordering_sequence FROM events WHERE environment_id = $1::uuid AND ordering_key = 'race' ORDER BY seq")
            .bind(&tenant.environment_id)
            .fetch_all(&pg)
            .await?;
    assert_eq!(numbers, vec![1], "one event of the key, numbered 1");
    pg.close().await;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ordering_keys_are_refused_by_name_and_nothing_is_written() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("ordering-bad").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let cases = [
        (json!("k".repeat(257)), "at most 256 bytes of UTF-8; this one is 257"),
        (json!("ü".repeat(129)), "this one is 258"),
        (json!("order\n42"), "byte 5 is U+000A"),
        (json!("\u{0}"), "byte 0 is U+0000"),
    ];
    for (key, words) in &cases {
        let (status, body) = rest.post("/v1/events", json!({"type": "o", "payload": 1, "ordering_key": key})).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_ordering_key")), "{body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains("ordering_key") && message.contains(words), "{message:?} should say {words:?}");
    }
    // Not a string: refused by the JSON reading, field named.
    for wrong in [json!(42), json!({"k": 1}), json!(["a"])] {
        let (status, body) = rest.post("/v1/events", json!({"type": "o", "payload": 1, "ordering_key": wrong})).await?;
        assert_eq!(status, 400, "{body}");
        assert!(body.to_string().contains("ordering_key"), "the field is named: {body}");
    }
    let (_, number) = publish_keyed(&rest, json!({"type": "o", "payload": 1, "ordering_key": "k".repeat(256)})).await?;
    assert_eq!(number, 1, "256 bytes is a key, and the refused ones took no number");
    let pg = stack.pg().await?;
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE environment_id = $1::uuid")
        .bind(&tenant.environment_id)
        .fetch_one(&pg)
        .await?;
    pg.close().await;
    assert_eq!(written, 1, "no refused publish wrote an event");
    stack.stop().await
}
