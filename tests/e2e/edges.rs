//! Trust at the edges: what an outside tester broke, each made real again —
//! clients that hang up mid-request, endpoints switched off in the middle of
//! an expansion, payloads that must arrive exactly as written, bodies sent
//! before a key is checked, one tenant's large events beside another's small
//! ones — and the answer the platform owes in each case.

use std::{collections::HashSet, future::Future, time::Duration};

use relay_tests::{Options, Process, Receiver, Rest, Stack, TestDb};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

/// Sends `request` on a fresh connection and resets it (RST, not FIN) after
/// `after`: the server sees the client vanish while it works on the request.
async fn send_and_reset(addr: std::net::SocketAddr, request: String, after: Duration) {
    let Ok(mut tcp) = tokio::net::TcpStream::connect(addr).await else { return };
    #[allow(deprecated)] // blocking on drop is what makes it a reset, and it is immediate
    let _ = tcp.set_linger(Some(Duration::ZERO));
    let _ = tcp.write_all(request.as_bytes()).await;
    tokio::time::sleep(after).await;
    drop(tcp);
}

fn http_request(method: &str, path: &str, key: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: relay\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Issue 9.1: a client that disconnects while the api is inside `BEGIN` must
/// not leave a pooled connection in an open transaction, where later
/// autocommit inserts (a publish answered 202) would never commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_answered_202_is_committed_even_while_clients_hang_up_mid_request() -> anyhow::Result<()> {
    let stack = Stack::start(Options { api: false, dispatcher: false, ..Options::default() }).await?;
    // Without relays, nothing but these requests uses the pool, so a
    // connection left inside a transaction stays that way until checked.
    let mut env = stack.api_env();
    env.push(("RELAY_RUN_RELAYS", "false".into()));
    let api = Process::spawn("relay-api", &env)?;
    stack.wait_for_api().await?;
    let tenant = stack.tenant("hang-ups").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/h"), &["h"]).await?;
    let pg = stack.pg().await?;

    let mut accepted: HashSet<Uuid> = HashSet::new();
    for round in 0..3 {
        // Requests that open a transaction right after authenticating, each
        // reset 0–5 ms after it was sent.
        let storm: Vec<_> = (0..200u64)
            .map(|i| {
                let path =
                    if i % 2 == 0 { format!("/v1/webhooks/{endpoint_id}/disable") } else { format!("/v1/webhooks/{endpoint_id}/enable") };
                let request = http_request("POST", &path, &tenant.api_key, "{}");
                let after = Duration::from_micros((i * 7919 + round * 131) % 5000);
                tokio::spawn(send_and_reset(stack.addrs.rest, request, after))
            })
            .collect();
        for s in storm {
            s.await?;
        }
        // Then ordinary publishes; each one answered 202 must be committed.
        let publishes: Vec<_> = (0..60)
            .map(|i| {
                let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
                let id = Uuid::new_v4();
                tokio::spawn(async move {
                    let (status, _) =
                        rest.post("/v1/events", json!({"id": id.to_string(), "type": "h", "payload": {"i": i}})).await.ok()?;
                    (status == 202).then_some(id)
                })
            })
            .collect();
        for p in publishes {
            accepted.extend(p.await?);
        }
    }
    assert!(accepted.len() >= 100, "the api kept accepting publishes ({} accepted)", accepted.len());

    let visible = |pg: sqlx::PgPool, ids: Vec<Uuid>| async move {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE id = ANY ($1)").bind(&ids).fetch_one(&pg).await?;
        anyhow::Ok(n as usize)
    };
    let ids: Vec<Uuid> = accepted.iter().copied().collect();
    assert_eq!(visible(pg.clone(), ids.clone()).await?, ids.len(), "every event answered 202 is visible from another session");
    api.kill9().await?;
    assert_eq!(visible(pg.clone(), ids.clone()).await?, ids.len(), "and survives the api's kill -9");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.1, the pool's half: a `begin()` dropped while `BEGIN` is on the
/// wire leaves its connection inside a transaction (sqlx 0.9.0). The api's
/// pool must never hand such a connection out again, or an autocommit write
/// on it is never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_left_inside_a_dropped_begin_is_never_handed_out_again() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    // One connection, so the next statement would get the very same one.
    let pool = relay_api::db::connect(&db.url, 1, Duration::from_secs(5)).await?;
    sqlx::query("CREATE TABLE published (n int)").execute(&pool).await?;
    let mut dropped_mid_begin = 0;
    for n in 0..20 {
        {
            let mut conn = pool.acquire().await?;
            // Poll `begin()` once: BEGIN is written, its answer not yet read;
            // then drop it, as hyper drops a handler whose client went away.
            let mut begin = Box::pin(conn.begin());
            let waker = futures::task::noop_waker();
            if begin.as_mut().poll(&mut std::task::Context::from_waker(&waker)).is_pending() {
                dropped_mid_begin += 1;
            }
        }
        sqlx::query("INSERT INTO published VALUES ($1)").bind(n).execute(&pool).await?;
        let mut other = PgConnection::connect(&db.url).await?;
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM published").fetch_one(&mut other).await?;
        other.close().await?;
        assert_eq!(seen, i64::from(n) + 1, "insert {n} is visible from another session");
    }
    assert!(dropped_mid_begin > 0, "no begin() was dropped while BEGIN was in flight");
    pool.close().await;
    db.cleanup().await
}
