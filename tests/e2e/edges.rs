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
fn assert_error_json(what: &str, status: u16, head: &str, body: &str, want: u16) {
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

/// Issue 9.4: overload is a 503 with `Retry-After` and the JSON error, never
/// a pool timeout surfacing as a generic failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_out_of_database_connections_answers_503_with_retry_after() -> anyhow::Result<()> {
    let stack =
        Stack::start(Options { dispatcher: false, db_pool_size: 2, db_acquire_timeout: Duration::from_secs(1), ..Options::default() })
            .await?;
    let tenant = stack.tenant("overload").await?;
    let pg = stack.pg().await?;
    // Every insert into events now waits, holding its connection.
    let mut lock = pg.begin().await?;
    sqlx::query("LOCK TABLE events IN EXCLUSIVE MODE").execute(&mut *lock).await?;
    let calls: Vec<_> = (0..12)
        .map(|i| {
            let (url, key) = (stack.rest_url.clone(), tenant.api_key.clone());
            tokio::spawn(async move {
                let resp = reqwest::Client::new()
                    .post(format!("{url}/v1/events"))
                    .bearer_auth(key)
                    .json(&json!({"type": "o", "payload": {"i": i}}))
                    .send()
                    .await?;
                let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap_or_default().to_owned());
                anyhow::Ok((resp.status().as_u16(), retry_after, resp.text().await?))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    lock.rollback().await?;
    let mut refused = 0;
    for c in calls {
        let (status, retry_after, body) = c.await??;
        match status {
            202 => {}
            503 => {
                refused += 1;
                assert_eq!(retry_after.as_deref(), Some("1"), "{body}");
                let v: serde_json::Value = serde_json::from_str(&body)?;
                assert_eq!(v["reason"], "unavailable", "{v}");
            }
            other => panic!("overload answered {other}: {body}"),
        }
    }
    assert!(refused > 0, "with both connections held, some calls must have been refused");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.2: an endpoint disabled or deleted 0–30 ms after an event it
/// subscribes to was published — on either side of the expansion — leaves no
/// delivery pending: each one is delivered, or a dead letter with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delivery_strands_when_its_endpoint_is_switched_off_during_expansion() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant_with_quota("switch-off", 1000).await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let mut events = Vec::new();
    for round in 0..40u64 {
        let (endpoint, _) = rest.endpoint(&receiver.url(&format!("/s{round}")), &["s"]).await?;
        for i in 0..3 {
            events.push(rest.publish("s", json!({"round": round, "i": i})).await?);
        }
        tokio::time::sleep(Duration::from_millis((round * 7) % 31)).await;
        let (method, path) = if round % 2 == 0 {
            (reqwest::Method::POST, format!("/v1/webhooks/{endpoint}/disable"))
        } else {
            (reqwest::Method::DELETE, format!("/v1/webhooks/{endpoint}"))
        };
        let (status, body) = rest.call(method, &path, None).await?;
        assert!(status == 200 || status == 204, "{body}");
    }
    // Every delivery reaches a final state, well inside one lease.
    let pg = stack.pg().await?;
    let pending = relay_tests::eventually(Duration::from_secs(30), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'").fetch_one(&pg).await.ok()?;
        (n == 0).then_some(())
    })
    .await;
    let stuck: Vec<(Uuid, i32, bool)> =
        sqlx::query_as("SELECT d.id, d.attempt, d.dispatched_at IS NOT NULL FROM webhook_deliveries d WHERE d.state = 'pending' LIMIT 5")
            .fetch_all(&pg)
            .await?;
    assert!(pending.is_some(), "deliveries stranded pending (id, attempt, leased): {stuck:?}");
    let unexplained: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d WHERE d.state = 'dead' AND NOT EXISTS (
           SELECT 1 FROM webhook_dead_letters l WHERE l.delivery_id = d.id AND l.reason IN ('endpoint_disabled', 'endpoint_deleted'))",
    )
    .fetch_one(&pg)
    .await?;
    assert_eq!(unexplained, 0, "every dead delivery has a dead letter saying why");
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    assert!(deliveries > 0, "some events reached their endpoint before it was switched off");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.2: an attempt on the wire when its endpoint is disabled completes,
/// and a 2xx is recorded as delivered — not as a dead letter that a replay
/// would send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_answered_2xx_counts_as_delivered_even_if_the_endpoint_was_disabled_meanwhile() -> anyhow::Result<()> {
    let stack = Stack::start(Options { attempt_timeout: Duration::from_secs(5), ..Options::default() }).await?;
    let tenant = stack.tenant("in-flight").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/slow", relay_tests::Reply::Hang(Duration::from_millis(1500)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/slow"), &["i"]).await?;
    let event_id = rest.publish("i", json!({"on": "the wire"})).await?;
    assert_eq!(receiver.wait_at("/slow", 1, Duration::from_secs(20)).await.len(), 1, "the attempt is in the receiver's hands");
    let (status, body) = rest.post(&format!("/v1/webhooks/{endpoint}/disable"), json!({})).await?;
    assert_eq!(status, 200, "{body}");
    let done = relay_tests::eventually(Duration::from_secs(10), || async {
        let d = rest.deliveries(&event_id).await.ok()?.into_iter().next()?;
        (d["attempts"].as_array().is_some_and(|a| !a.is_empty())).then_some(d)
    })
    .await
    .expect("the attempt's result is recorded");
    assert_eq!(done["state"], "DELIVERY_STATE_DELIVERED", "{done}");
    assert_eq!(done["attempts"][0]["http_status"], 200, "{done}");
    let letters = rest.get("/v1/dead-letters").await?;
    assert_eq!(letters["dead_letters"].as_array().map(Vec::len), Some(0), "no dead letter to replay: {letters}");
    stack.stop().await
}

/// Issue 9.5: one tenant's burst of large events (200 × 250 KiB, more than a
/// seam message could carry at once) neither fails nor stalls, and another
/// tenant's small events keep their latency beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_large_events_do_not_stall_anothers_small_ones() -> anyhow::Result<()> {
    // The production in-flight cap: a lane then asks for 32 large payloads at once.
    let mut stack = Stack::start(Options { endpoint_cap: 64, ..Options::default() }).await?;
    let (big, small) = (stack.tenant("big").await?, stack.tenant("small").await?);
    let receiver = Receiver::start().await?;
    let big_rest = Rest::new(&stack.rest_url, Some(&big.api_key));
    let small_rest = Rest::new(&stack.rest_url, Some(&small.api_key));
    big_rest.endpoint(&receiver.url("/big"), &["b"]).await?;
    small_rest.endpoint(&receiver.url("/small"), &["s"]).await?;

    // Publish→arrival latency of small events, one every 100 ms.
    async fn small_latencies(rest: &Rest, receiver: &Receiver, n: usize) -> anyhow::Result<Vec<Duration>> {
        let mut sent = Vec::new();
        for i in 0..n {
            let at = std::time::Instant::now();
            sent.push((rest.publish("s", json!({"i": i})).await?, at));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut out = Vec::new();
        for (id, at) in sent {
            let arrived = relay_tests::eventually(Duration::from_secs(30), || async {
                receiver.at("/small").into_iter().find(|r| r.header("relay-webhook-id") == id).map(|r| r.at)
            })
            .await
            .unwrap_or_else(|| panic!("small event {id} never arrived"));
            out.push(arrived.saturating_duration_since(at));
        }
        out.sort();
        Ok(out)
    }
    let solo = small_latencies(&small_rest, &receiver, 10).await?;

    // The large events arrive together: published while no dispatcher runs,
    // they reach the next one as one backlog.
    stack.stop_dispatchers().await?;
    let payload = format!(r#"{{"blob": "{}"}}"#, "x".repeat(250 * 1024));
    let publishers: Vec<_> = (0..8)
        .map(|_| {
            let (url, key, payload) = (stack.rest_url.clone(), big.api_key.clone(), payload.clone());
            tokio::spawn(async move {
                let rest = Rest::new(&url, Some(&key));
                for _ in 0..25 {
                    let (status, body) =
                        rest.raw(reqwest::Method::POST, "/v1/events", format!(r#"{{"type": "b", "payload": {payload}}}"#)).await?;
                    anyhow::ensure!(status == 202, "a large publish answered {status}: {body}");
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for p in publishers {
        p.await??;
    }
    stack.start_dispatcher().await?;
    let beside = small_latencies(&small_rest, &receiver, 30).await?;
    let big_arrived = receiver.wait_at("/big", 200, Duration::from_secs(120)).await;
    assert_eq!(big_arrived.len(), 200, "every large event arrives");
    assert!(big_arrived.iter().all(|r| r.body.len() > 250 * 1024), "whole bodies");
    let p = |v: &[Duration], q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    println!(
        "small events: solo p50 {:?} max {:?}; beside 200 × 250 KiB: p50 {:?} p99 {:?}",
        p(&solo, 0.5),
        p(&solo, 1.0),
        p(&beside, 0.5),
        p(&beside, 0.99)
    );
    assert!(
        p(&beside, 0.99) <= Duration::from_secs(1).max(p(&solo, 1.0) * 5),
        "the small tenant's p99 {:?} beside the burst (solo max {:?})",
        p(&beside, 0.99),
        p(&solo, 1.0)
    );
    stack.stop().await
}

/// Issue 9.8: seam and admin fields out of range are INVALID_ARGUMENT naming
/// the field — item by item inside a batch — never a panic, a wrapped value
/// or an internal error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_inputs_out_of_range_are_invalid_argument_never_a_panic() -> anyhow::Result<()> {
    use relay_contracts::relay::{
        admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest},
        dispatch::v1::{
            ExpandBatchRequest, ExpandRequest, MaterialRequest, OutcomeBatchRequest, OutcomeRequest, expand_result, outcome_result,
        },
    };
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("inputs").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint("http://127.0.0.1:9/x", &["x"]).await?;
    let event_id = rest.publish("x", json!({})).await?;
    let mut seam = stack.seam().await?;
    let pg = stack.pg().await?;
    let delivery_id = relay_tests::eventually(Duration::from_secs(10), || async {
        // No dispatcher runs: expand it here.
        let _ = stack
            .seam()
            .await
            .ok()?
            .expand(ExpandRequest {
                event_id: event_id.clone(),
                environment_id: tenant.environment_id.clone(),
                r#type: "x".into(),
                ..Default::default()
            })
            .await;
        sqlx::query_scalar::<_, Uuid>("SELECT id FROM webhook_deliveries LIMIT 1").fetch_optional(&pg).await.ok()?
    })
    .await
    .expect("expanded")
    .to_string();

    fn invalid<T>(r: Result<tonic::Response<T>, tonic::Status>, what: &str) {
        match r {
            Err(st) if st.code() == tonic::Code::InvalidArgument => assert!(st.message().len() < 300, "{what}: {}", st.message()),
            Err(st) => panic!("{what}: {st:?}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }
    let outcome = |attempt: u32, generation: u32, status: Option<u32>| OutcomeRequest {
        delivery_id: delivery_id.clone(),
        attempt,
        generation,
        http_status: status,
        latency_ms: 1,
        ..Default::default()
    };
    invalid(seam.outcome(outcome(u32::MAX, 0, Some(500))).await, "attempt 4294967295");
    invalid(seam.outcome(outcome(0, 0, Some(500))).await, "attempt 0");
    invalid(seam.outcome(outcome(1, u32::MAX, Some(500))).await, "generation 4294967295");
    invalid(seam.outcome(outcome(1, 0, Some(99_999))).await, "http_status 99999");
    invalid(
        seam.material(MaterialRequest { delivery_id: delivery_id.clone(), attempt: u32::MAX, generation: 0, ..Default::default() }).await,
        "material attempt",
    );
    invalid(
        seam.material(MaterialRequest { delivery_id: "not-a-uuid".into(), attempt: 1, generation: 0, ..Default::default() }).await,
        "material id",
    );

    // In a batch, the bad item fails alone and the good one is recorded.
    let items = seam
        .outcome_batch(OutcomeBatchRequest { items: vec![outcome(u32::MAX, 0, Some(500)), outcome(1, 0, Some(200))], ..Default::default() })
        .await?
        .into_inner()
        .items;
    assert!(
        matches!(&items[0].result, Some(outcome_result::Result::Error(e)) if e.code == tonic::Code::InvalidArgument as i32 && e.reason == "attempt_out_of_range"),
        "{items:?}"
    );
    assert!(matches!(&items[1].result, Some(outcome_result::Result::Outcome(_))), "{items:?}");
    let items = seam
        .expand_batch(ExpandBatchRequest {
            items: vec![
                ExpandRequest {
                    event_id: "nope".into(),
                    environment_id: tenant.environment_id.clone(),
                    r#type: "x".into(),
                    ..Default::default()
                },
                ExpandRequest {
                    event_id: event_id.clone(),
                    environment_id: tenant.environment_id.clone(),
                    r#type: "x".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await?
        .into_inner()
        .items;
    assert!(
        matches!(&items[0].result, Some(expand_result::Result::Error(e)) if e.code == tonic::Code::InvalidArgument as i32),
        "{items:?}"
    );
    assert!(matches!(&items[1].result, Some(expand_result::Result::Expanded(x)) if x.duplicate), "{items:?}");

    let mut admin = stack.admin().await?;
    invalid(admin.create_environment(CreateEnvironmentRequest { name: "nul\0name".into(), endpoint_quota: 0 }).await, "a NUL in a name");
    invalid(
        admin.create_environment(CreateEnvironmentRequest { name: "n".repeat(1_000_000), endpoint_quota: 0 }).await,
        "a million characters",
    );
    invalid(
        admin.create_environment(CreateEnvironmentRequest { name: "ok".into(), endpoint_quota: u32::MAX }).await,
        "a quota of 4294967295",
    );
    invalid(
        admin.create_api_key(CreateApiKeyRequest { environment_id: tenant.environment_id.clone(), name: "line\nbreak".into() }).await,
        "a newline in a key name",
    );
    // Still serving.
    rest.publish("x", json!({"after": "all that"})).await?;
    pg.close().await;
    stack.stop().await
}

/// Issue 9.9: an attempt is sent only by the dispatcher holding its claim.
/// A second copy of the job (a broker redelivery racing the original) is
/// refused its material while the first holds the attempt, and finds the
/// attempt finished once the first reports; a holder that died loses its
/// claim when the claim runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_claimant_of_an_attempt_gets_its_material() -> anyhow::Result<()> {
    use relay_contracts::relay::dispatch::v1::{ExpandRequest, MaterialRequest, OutcomeRequest};
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("claims").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint("http://127.0.0.1:9/c", &["c"]).await?;
    let mut seam = stack.seam().await?;
    let pg = stack.pg().await?;
    let mut deliveries = Vec::new();
    for _ in 0..2 {
        let event_id = rest.publish("c", json!({})).await?;
        let expand = ExpandRequest {
            event_id: event_id.clone(),
            environment_id: tenant.environment_id.clone(),
            r#type: "c".into(),
            ..Default::default()
        };
        relay_tests::eventually(Duration::from_secs(10), || {
            let (mut seam, expand) = (seam.clone(), expand.clone());
            async move { seam.expand(expand).await.ok() }
        })
        .await
        .expect("expanded");
        let id: Uuid =
            sqlx::query_scalar("SELECT id FROM webhook_deliveries WHERE event_id = $1::uuid").bind(&event_id).fetch_one(&pg).await?;
        deliveries.push(id.to_string());
    }
    let (a, b) = (Uuid::new_v4().to_string(), Uuid::new_v4().to_string());
    let ask = |delivery: &str, claimant: &str, hold_ms: u32| MaterialRequest {
        delivery_id: delivery.to_owned(),
        attempt: 1,
        generation: 0,
        claimant: claimant.to_owned(),
        hold_ms,
    };
    let reason = |st: &tonic::Status| st.metadata().get("relay-error-reason").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();

    let d = &deliveries[0];
    seam.material(ask(d, &a, 30_000)).await?;
    let refused = seam.material(ask(d, &b, 30_000)).await.expect_err("a second claimant is refused");
    assert_eq!((refused.code(), reason(&refused).as_str()), (tonic::Code::Unavailable, "in_hand_elsewhere"), "{refused:?}");
    seam.material(ask(d, &a, 30_000)).await.expect("the holder may ask again (a fresh fetch renews its claim)");
    seam.outcome(OutcomeRequest {
        delivery_id: d.clone(),
        attempt: 1,
        generation: 0,
        http_status: Some(200),
        latency_ms: 3,
        ..Default::default()
    })
    .await?;
    let done = seam.material(ask(d, &b, 30_000)).await.expect_err("a finished attempt has no material");
    assert_eq!(done.code(), tonic::Code::FailedPrecondition, "{done:?}");

    // A claimant that died: its short claim runs out, and the attempt is
    // handed to the next (the one duplicate a crash can cause).
    let d = &deliveries[1];
    seam.material(ask(d, &a, 200)).await?;
    assert!(seam.material(ask(d, &b, 30_000)).await.is_err(), "held");
    tokio::time::sleep(Duration::from_millis(400)).await;
    seam.material(ask(d, &b, 30_000)).await.expect("the claim of a dead holder runs out");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.9: second copies of jobs reaching another dispatcher while the
/// first is still sending (as after a broker restart) send nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_redelivered_to_another_dispatcher_mid_attempt_is_not_sent_twice() -> anyhow::Result<()> {
    use prost::Message as _;
    use relay_contracts::{StreamNames, relay::queue::v1::DeliveryJob};
    let mut stack = Stack::start(Options { attempt_timeout: Duration::from_secs(5), ..Options::default() }).await?;
    stack.start_dispatcher().await?;
    let tenant = stack.tenant("copies").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/slow", relay_tests::Reply::Hang(Duration::from_millis(800)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/slow"), &["d"]).await?;
    let names = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.opts.nats_url).await?);
    let pg = stack.pg().await?;
    let mut published = HashSet::new();
    for i in 0..6 {
        let event_id = rest.publish("d", json!({"i": i})).await?;
        published.insert(event_id.clone());
        // Once the attempt is in the receiver's hands, put copies of its job
        // in the stream, as a broker that lost track of its acks would.
        let seen: Vec<String> =
            receiver.wait_at("/slow", i + 1, Duration::from_secs(20)).await.iter().map(|r| r.header("relay-webhook-id")).collect();
        assert_eq!(seen.len(), i + 1);
        assert_eq!(seen.iter().collect::<HashSet<_>>().len(), seen.len(), "an event was sent twice: {seen:?}");
        let id: Uuid =
            sqlx::query_scalar("SELECT id FROM webhook_deliveries WHERE event_id = $1::uuid").bind(&event_id).fetch_one(&pg).await?;
        let job = DeliveryJob {
            delivery_id: id.to_string(),
            endpoint_id: endpoint_id.clone(),
            environment_id: tenant.environment_id.clone(),
            attempt: 1,
            generation: 0,
        };
        for copy in 0..3 {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("copy-{id}-{copy}").as_str());
            js.publish_with_headers(names.deliveries_subject(&tenant.environment_id), headers, job.encode_to_vec().into()).await?.await?;
        }
        relay_tests::eventually(Duration::from_secs(10), || async {
            let d = rest.deliveries(&event_id).await.ok()?.into_iter().next()?;
            (d["state"] == "DELIVERY_STATE_DELIVERED").then_some(())
        })
        .await
        .expect("delivered");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let all: Vec<String> = receiver.at("/slow").iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(all.iter().cloned().collect::<HashSet<_>>(), published);
    assert_eq!(all.len(), published.len(), "no event was sent twice: {all:?}");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.9: the relays hold no Postgres transaction open while the broker
/// is away (they used to sit idle in transaction, row locks held, for the
/// length of a publish timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_transaction_stays_open_while_the_broker_is_away() -> anyhow::Result<()> {
    let mut nats = relay_tests::PrivateNats::start().await?;
    let stack = Stack::start(Options { nats_url: nats.url(), ..Options::default() }).await?;
    let tenant = stack.tenant("outage").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/o"), &["o"]).await?;
    rest.publish("o", json!({"before": true})).await?;
    assert_eq!(receiver.wait_at("/o", 1, Duration::from_secs(20)).await.len(), 1);
    nats.stop().await?;
    let pg = stack.pg().await?;
    let mut longest = 0.0f64;
    for i in 0..30 {
        if i % 3 == 0 {
            rest.publish("o", json!({"during": i})).await?;
        }
        let open: Option<f64> = sqlx::query_scalar(
            "SELECT max(extract(epoch FROM now() - state_change))::float8 FROM pg_stat_activity
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(&pg)
        .await?;
        longest = longest.max(open.unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(longest < 0.5, "a session sat idle in a transaction for {longest:.1} s while the broker was away");
    nats.resume().await?;
    assert_eq!(receiver.wait_at("/o", 11, Duration::from_secs(60)).await.len(), 11, "everything arrives once the broker is back");
    pg.close().await;
    stack.stop().await?;
    nats.stop().await
}

/// Issue 9.4: a tenant that opens many calls and trickles (or never sends)
/// their bodies holds at most its share of the body budget, and only for the
/// body deadline: another tenant's publishes go on, and the trickler gets 408.
/// A client that half-closes after a complete request still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holding_bodies_open_cannot_starve_another_and_is_timed_out() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (slow, other) = (stack.tenant("slow").await?, stack.tenant("other").await?);
    let addr = stack.addrs.rest;
    // Calls that declare bodies and send none: large ones, then small ones
    // to take whatever room is left — more than the whole body budget, let
    // alone the slow tenant's share of it.
    let held: Vec<_> = (0..300)
        .map(|i| {
            let key = slow.api_key.clone();
            let declared = if i < 100 { 200_000 } else { 200 };
            tokio::spawn(async move {
                let head = format!(
                    "POST /v1/events HTTP/1.1\r\nhost: relay\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n{{"
                );
                raw_exchange_within(addr, head.as_bytes(), Duration::from_secs(20)).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rest = Rest::new(&stack.rest_url, Some(&other.api_key));
    let started = std::time::Instant::now();
    for i in 0..5 {
        rest.publish("x", json!({"i": i})).await?;
    }
    assert!(started.elapsed() < Duration::from_secs(2), "the other tenant waited {:?}", started.elapsed());
    let mut statuses = std::collections::BTreeMap::new();
    for h in held {
        let (status, head, body) = h.await??;
        assert!(status == 408 || status == 503, "a held body answered {status}: {body}");
        assert_error_json("a held body", status, &head, &body, status);
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(statuses.contains_key(&408), "some held calls got room, then a deadline: {statuses:?}");

    // Half-close after a complete request: the answer still comes.
    use tokio::io::AsyncReadExt;
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(
        format!("GET /v1/webhooks HTTP/1.1\r\nhost: relay\r\nconnection: close\r\nauthorization: Bearer {}\r\n\r\n", other.api_key)
            .as_bytes(),
    )
    .await?;
    tcp.shutdown().await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await??;
    assert!(out.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&out));
    stack.stop().await
}

/// Published events are marked in batches (`relay::outbox::MARK_DELAY`), and
/// a quiet relay writes the last batch within that delay, not at its next
/// look at the outbox: with the look 30 s away, the marks still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_events_are_marked_soon_after_the_last_one_without_waiting_for_a_look() -> anyhow::Result<()> {
    let stack = Stack::start(Options { relay_idle: Duration::from_secs(30), ..Options::default() }).await?;
    let tenant = stack.tenant("marks").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/m"), &["m"]).await?;
    for i in 0..5 {
        rest.publish("m", json!({ "i": i })).await?;
    }
    receiver.wait_at("/m", 5, Duration::from_secs(20)).await;
    let pg = stack.pg().await?;
    let unmarked = relay_tests::eventually(Duration::from_secs(3), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL").fetch_one(&pg).await.ok()?;
        (n == 0).then_some(n)
    })
    .await;
    assert_eq!(unmarked, Some(0), "every delivered event is marked published within seconds, long before the next look");
    stack.stop().await
}
