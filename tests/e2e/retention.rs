//! Retention (issue 14): events past `RELAY_RETENTION_DAYS` go with their
//! deliveries, attempt log and expansion claim once every delivery has
//! ended; an event stays while a delivery is open or its dead letter can
//! still be replayed, and young events stay.

use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack, eventually};
use serde_json::json;
use uuid::Uuid;

/// Rows each table still holds for an event: (events, deliveries, attempts, claims).
async fn rows(pg: &sqlx::PgPool, event: Uuid) -> anyhow::Result<(i64, i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM events WHERE id = $1),
                (SELECT count(*) FROM webhook_deliveries WHERE event_id = $1),
                (SELECT count(*) FROM delivery_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id WHERE d.event_id = $1),
                (SELECT count(*) FROM consumed_events WHERE event_id = $1)",
    )
    .bind(event)
    .fetch_one(pg)
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_past_retention_go_with_their_rows_unless_a_delivery_is_open_or_a_dead_letter_is_kept() -> anyhow::Result<()> {
    // No circuit in the way: the failing endpoint's delivery runs its seven
    // attempts and is dead-lettered.
    let stack = Stack::start(Options::default().circuit_off()).await?;
    let tenant = stack.tenant("retention").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/bad", Reply::Status(500));
    receiver.reply("/hang", Reply::Hang(Duration::from_secs(30)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/ok"), &["done", "young"]).await?;
    rest.endpoint(&receiver.url("/bad"), &["dead"]).await?;
    rest.endpoint(&receiver.url("/hang"), &["open"]).await?;
    let id = |s: String| Uuid::parse_str(&s);
    let done = id(rest.publish("done", json!({"n": 1})).await?)?;
    let dead = id(rest.publish("dead", json!({"n": 2})).await?)?;
    let young = id(rest.publish("young", json!({"n": 3})).await?)?;
    let pg = stack.pg().await?;
    let state_of = async |event: Uuid| -> Option<String> {
        sqlx::query_scalar("SELECT state FROM webhook_deliveries WHERE event_id = $1").bind(event).fetch_optional(&pg).await.ok().flatten()
    };
    // Ended: delivered, and dead-lettered after the schedule's seven attempts.
    for (event, want) in [(done, "delivered"), (young, "delivered"), (dead, "dead")] {
        let ended = eventually(Duration::from_secs(30), || async { (state_of(event).await.as_deref() == Some(want)).then_some(()) }).await;
        assert!(ended.is_some(), "{event} never became {want}");
    }
    let open = id(rest.publish("open", json!({"n": 4})).await?)?;
    assert!(
        eventually(Duration::from_secs(10), || async { (!receiver.at("/hang").is_empty()).then_some(()) }).await.is_some(),
        "the open event's first attempt never started"
    );
    assert_eq!(state_of(open).await.as_deref(), Some("pending"), "its attempt is in flight");
    for event in [done, dead, young, open] {
        assert!(rows(&pg, event).await?.0 == 1 && rows(&pg, event).await?.1 == 1, "{event} has its rows before anything is old");
    }

    // Thirty-one days pass for all but the young one.
    sqlx::query("UPDATE events SET created_at = now() - interval '31 days' WHERE id = ANY ($1)")
        .bind(vec![done, dead, open])
        .execute(&pg)
        .await?;
    let gone = eventually(Duration::from_secs(10), || async { (rows(&pg, done).await.ok()? == (0, 0, 0, 0)).then_some(()) }).await;
    assert!(gone.is_some(), "an old event whose deliveries ended kept rows: {:?}", rows(&pg, done).await?);
    // Several more passes (every 200 ms here) keep the rest.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (events, deliveries, attempts, _) = rows(&pg, dead).await?;
    assert_eq!((events, deliveries), (1, 1), "the dead-lettered event went while its dead letter is kept");
    assert_eq!(attempts, 7, "with its whole attempt log");
    assert_eq!(rows(&pg, open).await?.0, 1, "an old event with a delivery not ended went");
    assert!(matches!(state_of(open).await.as_deref(), Some("pending" | "held")), "{:?}", state_of(open).await);
    assert_eq!(rows(&pg, young).await?.0, 1, "a young event went");

    // The dead letter's own retention (7 days) runs out: then the event goes.
    sqlx::query("UPDATE webhook_dead_letters SET dead_lettered_at = now() - interval '8 days' WHERE event_id = $1")
        .bind(dead)
        .execute(&pg)
        .await?;
    let gone = eventually(Duration::from_secs(10), || async { (rows(&pg, dead).await.ok()? == (0, 0, 0, 0)).then_some(()) }).await;
    assert!(gone.is_some(), "the dead-lettered event stayed after its dead letter expired: {:?}", rows(&pg, dead).await?);
    // What a tenant sees of a pruned event: nothing, as for an unknown one.
    let (status, body) = rest.call(reqwest::Method::GET, &format!("/v1/events/{done}/deliveries"), None).await?;
    let unknown = rest.call(reqwest::Method::GET, &format!("/v1/events/{}/deliveries", Uuid::new_v4()), None).await?;
    assert_eq!((status, &body), (unknown.0, &unknown.1), "a pruned event answers as an unknown one");
    // The open delivery ends (delivered once its endpoint answers), and then
    // its old event goes too.
    receiver.reply("/hang", Reply::Status(200));
    let gone = eventually(Duration::from_secs(30), || async { (rows(&pg, open).await.ok()? == (0, 0, 0, 0)).then_some(()) }).await;
    assert!(gone.is_some(), "the open event stayed after its delivery ended: {:?} {:?}", rows(&pg, open).await?, state_of(open).await);
    pg.close().await;
    stack.stop().await
}
