//! Trust at the edges: what an outside tester broke, each made real again —
//! clients that hang up mid-request, transactions ended to break a
//! deadlock, connections left in a dropped `BEGIN`, payloads that must arrive
//! exactly as written, bodies sent before a key is checked — and the answer
//! the platform owes in each case. The delivery pipeline's edges are in
//! `pipeline_edges`.

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
    let mut refused = 0;
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
                    let (status, body) = rest.post("/v1/events", json!({"id": id.to_string(), "type": "h", "payload": {"i": i}})).await?;
                    anyhow::Ok((id, status, body))
                })
            })
            .collect();
        for p in publishes {
            // Every publish is answered: 202, or the documented overload
            // answer (503 or 429 with the JSON error), never anything else.
            let (id, status, body) = p.await??;
            match status {
                202 => {
                    accepted.insert(id);
                }
                429 | 503 => {
                    assert!(
                        ["unavailable", "overloaded", "resource_exhausted"].contains(&body["reason"].as_str().unwrap_or_default()),
                        "{body}"
                    );
                    refused += 1;
                }
                other => panic!("a publish beside reset connections answered {other}: {body}"),
            }
        }
    }
    assert_eq!(accepted.len() + refused, 180, "every publish answered");
    assert!(accepted.len() >= 100, "the api kept accepting publishes ({} accepted, {refused} refused as overloaded)", accepted.len());

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

/// A transaction Postgres ends to break a deadlock (as a manual disable and
/// an outcome batch's automatic one can make, locking an endpoint and its
/// deliveries in opposite orders) lost a conflict: it is answered "retry"
/// (503 / UNAVAILABLE) and the use-case may run it again, never a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_ended_to_break_a_deadlock_is_a_retry_not_an_internal_error() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let (pool, _) = relay_api::db::connect(&db.url, 4, Duration::from_secs(5)).await?;
    sqlx::query("CREATE TABLE locked (n int PRIMARY KEY)").execute(&pool).await?;
    sqlx::query("INSERT INTO locked VALUES (1), (2)").execute(&pool).await?;
    let (mut a, mut b) = (pool.begin().await?, pool.begin().await?);
    sqlx::query("UPDATE locked SET n = n WHERE n = 1").execute(&mut *a).await?;
    sqlx::query("UPDATE locked SET n = n WHERE n = 2").execute(&mut *b).await?;
    // Each now wants the other's row: Postgres ends one of them.
    let (ra, rb) = tokio::join!(
        sqlx::query("UPDATE locked SET n = n WHERE n = 2").execute(&mut *a),
        sqlx::query("UPDATE locked SET n = n WHERE n = 1").execute(&mut *b),
    );
    let lost = match (ra, rb) {
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => e,
        other => panic!("exactly one of two deadlocked transactions fails: {other:?}"),
    };
    let code = lost.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("40P01"), "{lost}");
    let answered = relay_api::error::AppError::from(lost);
    assert!(answered.lost_a_conflict(), "{answered:?}");
    assert_eq!(answered.code, relay_api::error::ErrorCode::Unavailable, "a lost conflict is a retry: {answered:?}");
    let status = relay_api::grpc::status(answered);
    assert_eq!((status.code(), relay_api::rest::http_status(status.code()).as_u16()), (tonic::Code::Unavailable, 503));
    drop((a, b));
    pool.close().await;
    db.cleanup().await
}

/// Issue 9.1, the pool's half: a `begin()` dropped while `BEGIN` is on the
/// wire leaves its connection inside a transaction (sqlx 0.9.0). The api's
/// pool must never hand such a connection out again, or an autocommit write
/// on it is never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_left_inside_a_dropped_begin_is_never_handed_out_again() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    // One connection, so the next statement would get the very same one.
    let (pool, _) = relay_api::db::connect(&db.url, 1, Duration::from_secs(5)).await?;
    sqlx::query("CREATE TABLE published (n int)").execute(&pool).await?;
    // A healthy connection is kept: the check must not discard it (opening
    // a backend per query would cost more than everything else).
    let mut pids = HashSet::new();
    for _ in 0..20 {
        pids.insert(sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&pool).await?);
    }
    assert_eq!(pids.len(), 1, "an idle connection was discarded and reopened");
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

/// One HTTP/1.1 exchange on a fresh connection, as raw bytes: for requests no
/// well-behaved client would send. Returns the status, the head (lowercase)
/// and the body.
pub(crate) async fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> anyhow::Result<(u16, String, String)> {
    raw_exchange_within(addr, request, Duration::from_secs(10)).await
}

pub(crate) async fn raw_exchange_within(
    addr: std::net::SocketAddr,
    request: &[u8],
    within: Duration,
) -> anyhow::Result<(u16, String, String)> {
    raw_exchange_paced(addr, vec![(Duration::ZERO, request.to_vec())], within).await
}

/// The same, the request written in parts, each after its pause, while the
/// answer is read (the server may answer, and close, before it has read
/// everything). The connection is never half-closed: a body the parts
/// leave unfinished stays unfinished.
pub(crate) async fn raw_exchange_paced(
    addr: std::net::SocketAddr,
    parts: Vec<(Duration, Vec<u8>)>,
    within: Duration,
) -> anyhow::Result<(u16, String, String)> {
    use tokio::io::AsyncReadExt;
    let (mut rd, mut wr) = tokio::net::TcpStream::connect(addr).await?.into_split();
    let writer = tokio::spawn(async move {
        for (pause, bytes) in parts {
            tokio::time::sleep(pause).await;
            if wr.write_all(&bytes).await.is_err() {
                break;
            }
        }
        // The write half lives until the answer is in (the task is then
        // aborted): dropping it would half-close the connection.
        std::future::pending::<()>().await
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut buf = [0u8; 8192];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
            // A complete answer with a declared length is enough.
            let text = String::from_utf8_lossy(&out);
            if let Some((head, body)) = text.split_once("\r\n\r\n")
                && let Some(len) =
                    head.to_ascii_lowercase().lines().find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().to_owned()))
                && body.len() >= len.parse::<usize>().unwrap_or(usize::MAX)
            {
                break;
            }
        }
    })
    .await;
    writer.abort();
    anyhow::ensure!(read.is_ok(), "no answer within {within:?}");
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((status, head.to_ascii_lowercase(), body.to_owned()))
}

/// Every error the facade answers is `{code, message, reason}` JSON whose
/// message is short, whatever the input.
pub(crate) fn assert_error_json(what: &str, status: u16, head: &str, body: &str, want: u16) {
    assert_eq!(status, want, "{what}: {head}\n{body}");
    assert!(head.contains("content-type: application/json"), "{what}: not JSON: {head}");
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: body is not JSON ({e}): {body}"));
    assert!(v["code"].is_i64() && v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{what}: {v}");
    let message = v["message"].as_str().unwrap_or_else(|| panic!("{what}: no message: {v}"));
    assert!(message.len() <= 400, "{what}: the message echoes input ({} bytes)", message.len());
}

/// The `"payload"` member of an envelope exactly as it was sent.
fn payload_text(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Envelope<'a> {
        #[serde(borrow)]
        payload: &'a serde_json::value::RawValue,
    }
    serde_json::from_slice::<Envelope>(body).expect("an envelope").payload.get().to_owned()
}

/// Issue 9.3: the payload arrives as published — numbers digit for digit,
/// keys in their order, duplicates kept — from REST and from gRPC, and any
/// nesting up to the documented 64 levels is accepted, deeper refused with 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_arrive_exactly_as_published_and_nesting_is_bounded_with_a_400() -> anyhow::Result<()> {
    use relay_contracts::relay::tenant::v1::{PublishEventRequest, event_service_client::EventServiceClient};
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("fidelity").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/f"), &["f"]).await?;

    let payloads = [
        r#"{"id": 9007199254740993, "u64": 18446744073709551615, "i64": -9223372036854775808, "big": 123456789012345678901234567890}"#,
        r#"{"z": 1, "a": 2, "m": {"y": [1.50, -0, 0.1e-7, 1E+2]}, "z": "duplicate kept"}"#,
        r#"["\u00e9\ud83d\ude00", "tab\there", null, true, {}]"#,
        "42",
        "\"just a string\"",
    ];
    let mut sent = Vec::new();
    for p in payloads {
        let body = format!(r#"{{"type": "f", "payload": {p}}}"#);
        let (status, _, answer) = raw_exchange(
            stack.addrs.rest,
            format!(
                "POST /v1/events HTTP/1.1\r\nhost: relay\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                tenant.api_key,
                body.len()
            )
            .as_bytes(),
        )
        .await?;
        assert_eq!(status, 202, "{answer}");
        let id: serde_json::Value = serde_json::from_str(&answer)?;
        sent.push((id["event_id"].as_str().unwrap().to_owned(), p.to_owned()));
    }
    // gRPC callers send the same JSON text.
    let mut grpc = EventServiceClient::connect(stack.grpc_url.clone()).await?;
    let text = r#"{"n": 100000000000000000001, "k": [3, 2, 1]}"#;
    let mut req = tonic::Request::new(PublishEventRequest { r#type: "f".into(), payload: text.into(), ..Default::default() });
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    sent.push((grpc.publish_event(req).await?.into_inner().event_id, text.to_owned()));
    // The lossy field of old clients is refused, not silently dropped.
    #[allow(deprecated)]
    let legacy = PublishEventRequest { r#type: "f".into(), legacy_payload: Some(prost_types::Value::default()), ..Default::default() };
    let mut req = tonic::Request::new(legacy);
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    let refused = grpc.publish_event(req).await.expect_err("legacy_payload is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    // Nested past the protobuf decoder's own limit: the caller's mistake, not
    // an internal error, and nothing of the decoder's words.
    let mut deep = prost_types::Value::default();
    for _ in 0..120 {
        deep = prost_types::Value { kind: Some(prost_types::value::Kind::ListValue(prost_types::ListValue { values: vec![deep] })) };
    }
    #[allow(deprecated)]
    let legacy = PublishEventRequest { r#type: "f".into(), legacy_payload: Some(deep), ..Default::default() };
    let mut req = tonic::Request::new(legacy);
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    let refused = grpc.publish_event(req).await.expect_err("an undecodable message is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(!refused.message().contains("recursion"), "{refused:?}");
    // A gRPC caller's overlong value is not echoed back either.
    let mut req = tonic::Request::new(PublishEventRequest { r#type: "t".repeat(300_000), payload: "1".into(), ..Default::default() });
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    let refused = grpc.publish_event(req).await.expect_err("an overlong type is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{}", &refused.message()[..200.min(refused.message().len())]);
    assert!(refused.message().len() < 300, "the message echoes the type ({} bytes)", refused.message().len());

    let got = receiver.wait_at("/f", sent.len(), Duration::from_secs(20)).await;
    assert_eq!(got.len(), sent.len());
    for (event_id, payload) in &sent {
        let arrived = got.iter().find(|r| r.header("relay-webhook-id") == *event_id).expect("arrived");
        assert_eq!(payload_text(&arrived.body), *payload, "the payload arrives byte for byte as published");
    }

    for depth in [34usize, 50, 64] {
        let nested = "{\"a\":".repeat(depth) + "1" + &"}".repeat(depth);
        let (status, body) = rest.raw(reqwest::Method::POST, "/v1/events", format!(r#"{{"type": "f", "payload": {nested}}}"#)).await?;
        assert_eq!(status, 202, "nesting {depth} deep is accepted: {body}");
    }
    for depth in [65usize, 200, 5000] {
        let nested = "[".repeat(depth) + &"]".repeat(depth);
        let (status, body) = rest.raw(reqwest::Method::POST, "/v1/events", format!(r#"{{"type": "f", "payload": {nested}}}"#)).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("payload_too_deep")), "nesting {depth} deep: {body}");
    }
    let (status, body) = rest.raw(reqwest::Method::POST, "/v1/events", r#"{"type": "f", "payload": {"a": 01}}"#.into()).await?;
    assert_eq!(status, 400, "not JSON: {body}");
    stack.stop().await
}

/// Issues 9.4 and 9.7: nothing is read or converted for a caller before its
/// key is checked; bodies are refused by their declared size and while they
/// stream; every refusal — 400, 401, 404, 405, 413, 414, 431, a malformed
/// chunked body, invalid UTF-8 in a path — is the JSON error with a short
/// message; and a query parameter can never override the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_json_bounded_and_early_and_the_path_cannot_be_overridden() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("edges").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (real, _) = rest.endpoint("http://127.0.0.1:9/real", &["x"]).await?;
    let addr = stack.addrs.rest;
    let key = &tenant.api_key;
    let head =
        |method: &str, path: &str, extra: &str| format!("{method} {path} HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n{extra}\r\n");

    // A query parameter naming a path-bound field is refused; the endpoint stays.
    let (status, h, body) = raw_exchange(
        addr,
        head("DELETE", &format!("/v1/webhooks/{}?id={real}", Uuid::new_v4()), &format!("authorization: Bearer {key}\r\n")).as_bytes(),
    )
    .await?;
    assert_error_json("path id overridden by the query", status, &h, &body, 400);
    assert_eq!(rest.get(&format!("/v1/webhooks/{real}")).await?["id"], real.as_str(), "the real endpoint was not touched");
    // ...and a body may not contradict the path either.
    let other = Uuid::new_v4();
    let (status, h, body) = raw_exchange(
        addr,
        (head("POST", &format!("/v1/webhooks/{real}/rotate-secret"), &format!("authorization: Bearer {key}\r\ncontent-length: 47\r\n"))
            + &format!(r#"{{"id": "{other}"}}"#))
            .as_bytes(),
    )
    .await?;
    assert_eq!(status, 200, "rotate-secret takes no body; the path decides: {body}");
    let _ = (h, other);

    let big = "x".repeat(1_900_000);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("no key", head("GET", "/v1/webhooks", "").into_bytes(), 401),
        ("unknown route", head("GET", "/v2/nothing", &format!("authorization: Bearer {key}\r\n")).into_bytes(), 404),
        ("wrong method", head("PUT", "/v1/webhooks", &format!("authorization: Bearer {key}\r\n")).into_bytes(), 405),
        ("invalid UTF-8 in the path", head("GET", "/v1/webhooks/%FF%FE", &format!("authorization: Bearer {key}\r\n")).into_bytes(), 400),
        ("declared 1.9 MB, no key", (head("POST", "/v1/events", &format!("content-length: {}\r\n", big.len())) + &big).into_bytes(), 413),
        (
            "declared 1.9 MB",
            (head("POST", "/v1/events", &format!("authorization: Bearer {key}\r\ncontent-length: {}\r\n", big.len())) + &big).into_bytes(),
            413,
        ),
        (
            "1.9 MB chunked, no key: refused before the body is read",
            (head("POST", "/v1/events", "transfer-encoding: chunked\r\n") + &format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len())).into_bytes(),
            401,
        ),
        (
            "1.9 MB chunked: refused while it streams",
            (head("POST", "/v1/events", &format!("authorization: Bearer {key}\r\ntransfer-encoding: chunked\r\n"))
                + &format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len()))
                .into_bytes(),
            413,
        ),
        (
            "malformed chunked body",
            (head("POST", "/v1/events", &format!("authorization: Bearer {key}\r\ntransfer-encoding: chunked\r\n"))
                + "zz\r\n{}\r\n0\r\n\r\n")
                .into_bytes(),
            400,
        ),
        (
            "a 1 MB event type",
            {
                let body = format!(r#"{{"type": "{}", "payload": 1}}"#, "t".repeat(200_000));
                (head("POST", "/v1/events", &format!("authorization: Bearer {key}\r\ncontent-length: {}\r\n", body.len())) + &body)
                    .into_bytes()
            },
            400,
        ),
        (
            "a 9 KB target",
            head("GET", &format!("/v1/webhooks?x={}", "a".repeat(9_000)), &format!("authorization: Bearer {key}\r\n")).into_bytes(),
            414,
        ),
        ("a 70 KB target", head("GET", &format!("/v1/webhooks?x={}", "a".repeat(70_000)), "").into_bytes(), 414),
        (
            "100 header fields",
            head("GET", "/v1/webhooks", &(0..100).map(|i| format!("x-h{i}: v\r\n")).collect::<String>()).into_bytes(),
            431,
        ),
        ("a 300 KB header", head("GET", "/v1/webhooks", &format!("x-big: {}\r\n", "b".repeat(300_000))).into_bytes(), 431),
        ("not HTTP", b"\x16\x03\x01 hello\r\n\r\n".to_vec(), 400),
    ];
    for (what, request, want) in cases {
        let (status, h, body) = raw_exchange(addr, &request).await?;
        assert_error_json(what, status, &h, &body, want);
    }
    // A query parameter the method does not have, and a value of the wrong type.
    let (status, body) = rest.call(reqwest::Method::GET, &format!("/v1/webhooks?{}=1", "q".repeat(5000)), None).await?;
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().unwrap().len() < 400, "{body}");

    let http = reqwest::Client::new();
    assert_eq!(http.get(format!("{}/readyz", stack.rest_url)).send().await?.status(), 200, "still ready after all that");
    rest.publish("x", json!({"still": "accepting"})).await?;
    stack.stop().await
}
