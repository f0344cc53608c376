//! Workloads and the run: bring the system up as processes, publish, wait,
//! measure, tear down.

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use relay_contracts::relay::admin::v1::admin_service_client::AdminServiceClient;
use sqlx::{Connection, Executor};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub use crate::spec::Workload;
use crate::{
    procs::{PeakSampler, Target},
    receiver::Receiver,
    report::Report,
    tenants::{environment_with_key, register_endpoint},
};

pub struct Env {
    pub pg_admin_url: String,
    pub nats_url: String,
    /// `RELAY_STREAM_REPLICAS` for the apis.
    pub stream_replicas: String,
    pub bin_dir: PathBuf,
}

/// Held for its `kill_on_drop`: dropping it stops the process.
struct Child(#[allow(dead_code)] tokio::process::Child);

impl Child {
    fn spawn(bin: PathBuf, env: &[(&str, String)], log: PathBuf) -> Result<(Self, u32)> {
        let out = std::fs::File::create(&log)?;
        let child = tokio::process::Command::new(&bin)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RELAY_LOG", std::env::var("RELAY_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id().context("no pid")?;
        Ok((Self(child), pid))
    }
}

async fn free_port() -> Result<SocketAddr> {
    Ok(tokio::net::TcpListener::bind("127.0.0.1:0").await?.local_addr()?)
}

pub async fn run(w: &Workload, env: &Env) -> Result<(Report, crate::chart::Series)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tag = format!("bench_{}", uuid::Uuid::new_v4().simple().to_string().get(..10).unwrap_or("x"));
    let db_url = env.pg_admin_url.rsplit_once('/').map(|(base, _)| format!("{base}/{tag}")).context("a database URL")?;
    let mut admin_conn = sqlx::PgConnection::connect(&env.pg_admin_url).await.context("connecting to Postgres")?;
    admin_conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {tag}"))).await?;
    let work = std::env::temp_dir().join(&tag);
    relay_devkit::generate_pki()?.write(&work)?;
    let prefix = format!("{tag}_");
    let mut ports = Vec::new();
    for _ in 0..w.replicas {
        ports.push((free_port().await?, free_port().await?, free_port().await?));
    }
    let internal_url = |i: usize| format!("https://127.0.0.1:{}", ports[i].2.port());
    let http = reqwest::Client::builder().pool_max_idle_per_host(w.publishers).build()?;
    let (mut apis, mut api_pids) = (Vec::new(), Vec::new());
    for (i, (grpc, rest, internal)) in ports.iter().enumerate() {
        let api_env = vec![
            ("DATABASE_URL", db_url.clone()),
            ("RELAY_NATS_URL", env.nats_url.clone()),
            ("RELAY_STREAM_REPLICAS", env.stream_replicas.clone()),
            ("RELAY_STREAM_PREFIX", prefix.clone()),
            ("RELAY_TLS_CLIENT_CA", work.join("ca.pem").display().to_string()),
            ("RELAY_TLS_CERT", work.join("api.pem").display().to_string()),
            ("RELAY_TLS_KEY", work.join("api-key.pem").display().to_string()),
            ("RELAY_GRPC_ADDR", grpc.to_string()),
            ("RELAY_REST_ADDR", rest.to_string()),
            ("RELAY_INTERNAL_ADDR", internal.to_string()),
            ("RELAY_METRICS_ADDR", "off".into()),
            ("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", "true".into()),
            ("RELAY_DEV_ALLOWED_ENDPOINT_RANGES", "127.0.0.0/8".into()),
        ];
        let (api, pid) = Child::spawn(env.bin_dir.join("relay-api"), &api_env, work.join(format!("api{i}.log")))?;
        apis.push(api);
        api_pids.push(pid);
        // One at a time: the first runs the migrations.
        wait_healthy(&http, &format!("http://{rest}")).await?;
    }
    let rest_urls: Vec<String> = ports.iter().map(|(_, rest, _)| format!("http://{rest}")).collect();
    let rest_url = rest_urls[0].clone();
    let (mut dispatchers, mut dispatcher_pids) = (Vec::new(), Vec::new());
    for i in 0..w.replicas {
        // Its own api first, the others after a failure.
        let apis_in_turn: Vec<String> = (0..w.replicas).map(|j| internal_url((i + j) % w.replicas)).collect();
        let dispatcher_env = vec![
            ("RELAY_NATS_URL", env.nats_url.clone()),
            ("RELAY_STREAM_PREFIX", prefix.clone()),
            ("RELAY_API_INTERNAL_URL", apis_in_turn.join(",")),
            ("RELAY_TLS_CA", work.join("ca.pem").display().to_string()),
            ("RELAY_TLS_CERT", work.join("dispatcher.pem").display().to_string()),
            ("RELAY_TLS_KEY", work.join("dispatcher-key.pem").display().to_string()),
            ("RELAY_HEALTH_ADDR", "off".into()),
            ("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", "true".into()),
            ("RELAY_DEV_ALLOWED_ENDPOINT_RANGES", "127.0.0.0/8".into()),
        ];
        let (dispatcher, pid) =
            Child::spawn(env.bin_dir.join("relay-dispatcher"), &dispatcher_env, work.join(format!("dispatcher{i}.log")))?;
        dispatchers.push(dispatcher);
        dispatcher_pids.push(pid);
    }

    // The tenant, through the operator's AdminService.
    let read = |f: &str| std::fs::read(work.join(f)).with_context(|| format!("reading {f}"));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")?))
        .identity(Identity::from_pem(read("operator.pem")?, read("operator-key.pem")?))
        .domain_name(relay_devkit::API_TLS_NAME);
    let channel = Channel::from_shared(internal_url(0))?.tls_config(tls)?.connect().await?;
    let mut admin = AdminServiceClient::new(channel);
    let (environment_id, key) = environment_with_key(&mut admin, format!("bench-{}", w.name), w.endpoints() as u32).await?;

    let receiver = Receiver::start(Duration::from_millis(w.answer_delay_ms)).await?;
    let mut healthy_paths = Vec::new();
    let mut paths = Vec::new();
    for i in 0..w.healthy {
        healthy_paths.push(format!("/ok/{i}"));
        paths.push(format!("/ok/{i}"));
    }
    for i in 0..w.hanging {
        paths.push(format!("/hang/600/{i}"));
    }
    for i in 0..w.failing {
        paths.push(format!("/status/500/{i}"));
    }
    for (k, p) in paths.iter().enumerate() {
        let filter = if k < w.healthy { w.filter_for(k) } else { None };
        let ordering = (k < w.healthy && w.ordering_keys.is_some()).then_some("per_key");
        register_endpoint(&http, &rest_url, &key, receiver.url(p), filter, ordering).await?;
    }
    if w.schema == Some(true) {
        crate::catalogue::register(&http, &rest_url, &key).await?;
    }
    if w.backlog > 0 {
        crate::seed::seed_backlog(&db_url, &environment_id, w.backlog, w.backlog_endpoints).await?;
    }
    let neighbour_keys = match &w.neighbours {
        Some(n) => neighbours(&mut admin, &http, &rest_url, &receiver, n).await?,
        None => Vec::new(),
    };
    // RELAY_BENCH_FRESH=1: as a new installation starts, empty and never
    // analysed (what the api's statistics keeper is for).
    if std::env::var_os("RELAY_BENCH_FRESH").is_none_or(|v| v != "1") {
        crate::seed::seed_history(&db_url).await.context("seeding the delivered history")?;
    }

    // Measure from here. (Said on stderr, with the pids, for a profiler to
    // start on: what came before is setup.)
    eprintln!("measuring: api pids {api_pids:?}, dispatcher pids {dispatcher_pids:?}");
    crate::pgstats::prepare(&mut admin_conn).await;
    let pg_before = crate::pgstats::read(&mut admin_conn, &tag, &db_url).await;
    let targets = vec![Target::Pids(api_pids.clone()), Target::Pids(dispatcher_pids.clone()), Target::Named("postgres")];
    let cpu_before: Vec<f64> = targets.iter().map(Target::cpu).collect();
    // Reading smaps of every Postgres backend is not free: sample often
    // enough to see the peak of a run that lasts seconds, and no more.
    let sampler = PeakSampler::start(targets.clone(), Duration::from_millis(500));
    let ids: Arc<Vec<String>> = Arc::new((0..w.events).map(|_| uuid::Uuid::new_v4().to_string()).collect());
    let filler = "x".repeat(w.payload_bytes.saturating_sub(120));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    if w.idle_secs > 0 {
        tokio::time::sleep(Duration::from_secs(w.idle_secs)).await;
    }
    let mut publishers = Vec::new();
    for _ in 0..w.publishers {
        let (http, ids, next, key, urls, filler) =
            (http.clone(), ids.clone(), next.clone(), key.clone(), rest_urls.clone(), filler.clone());
        let (rate, keys, realistic) = (w.rate, w.ordering_keys, w.schema.is_some());
        publishers.push(tokio::spawn(async move {
            let mut sent: Vec<(usize, Instant)> = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ids.len() {
                    return anyhow::Ok(sent);
                }
                if let Some(rate) = rate {
                    tokio::time::sleep_until((started + Duration::from_secs_f64(i as f64 / rate)).into()).await;
                }
                let payload = if realistic { crate::catalogue::payload(i, "") } else { serde_json::json!({"n": i, "data": filler}) };
                let mut body = serde_json::json!({"id": ids[i], "type": "bench.event", "payload": payload});
                if let Some(keys) = keys {
                    body["ordering_key"] = format!("k{}", i % keys).into();
                }
                let at = Instant::now();
                // An overloaded api says when to come back; a client that
                // listens publishes the same id again then.
                loop {
                    let url = &urls[i % urls.len()];
                    let resp = http.post(format!("{url}/v1/events")).bearer_auth(&key).json(&body).send().await?;
                    match resp.status().as_u16() {
                        202 => break,
                        503 | 429 => {
                            let after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1);
                            tokio::time::sleep(Duration::from_secs(after)).await;
                        }
                        other => anyhow::bail!("publishing: {other}"),
                    }
                }
                sent.push((i, at));
            }
        }));
    }
    let hostile = w.hostile.then(|| tokio::spawn(hostile_bodies(ports[0].1, key.clone())));
    let beside = w.neighbours.clone().map(|n| tokio::spawn(publish_beside(http.clone(), rest_url.clone(), neighbour_keys, n)));
    let mut published_at: HashMap<String, Instant> = HashMap::with_capacity(w.events);
    for p in publishers {
        for (i, at) in p.await?? {
            published_at.insert(ids[i].clone(), at);
        }
    }
    let publish_done = Instant::now();
    if let Some(h) = hostile {
        let answers = h.await??;
        eprintln!("hostile bodies answered: {answers:?}");
        anyhow::ensure!(answers.keys().all(|s| *s < 500 || *s == 503), "a hostile body got a server error: {answers:?}");
    }

    // Wait for every healthy delivery, or until progress stops.
    let expected = w.expected_healthy();
    let (mut last_count, mut last_progress) = (0usize, Instant::now());
    loop {
        let count = receiver.arrivals.lock().expect("not poisoned").healthy_distinct;
        if count >= expected {
            break;
        }
        if count > last_count {
            (last_count, last_progress) = (count, Instant::now());
        } else if last_progress.elapsed() > Duration::from_secs(60) {
            eprintln!("no progress for 60 s: {count} of {expected} healthy deliveries arrived");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(b) = beside {
        // Whatever the neighbours have not published by now does not matter:
        // the measured environment is done.
        b.abort();
    }
    let cpu_after: Vec<f64> = targets.iter().map(Target::cpu).collect();
    let window = started.elapsed();
    let peaks = sampler.finish().await;
    // A backend publishes its commit count at most once a second, and one
    // that went idle sooner than that after its last report only ten seconds
    // later, or when it exits: so the services stop (their connections
    // close, their backends exit and report) before the counters are read.
    drop(dispatchers);
    drop(apis);
    crate::pgstats::await_backends_gone(&mut admin_conn, &tag).await;
    let pg = crate::pgstats::read(&mut admin_conn, &tag, &db_url).await.since(&pg_before);

    let measured = crate::report::Measured { cpu_before: &cpu_before, cpu_after: &cpu_after, peaks: &peaks, window, pg };
    let (mut report, series) = Report::build(w, &receiver, &published_at, &healthy_paths, started, publish_done, measured);
    // One key per endpoint: each endpoint's deliveries go one after another,
    // so what one round trip to the receiver allows is the bound to compare
    // with (measured after the run, on a machine as quiet as it was).
    if w.ordering_keys == Some(1) {
        let rtt = crate::receiver::round_trip(&receiver, w.payload_bytes).await?;
        report.set_round_trip(rtt, w.healthy);
    }
    // RELAY_BENCH_KEEP_DB=1 leaves the run's database behind, to EXPLAIN its
    // statements against the tables as the run left them, and the
    // services' logs (`RELAY_BENCH_LOG` is their `RELAY_LOG`; `warn` unless set).
    let keep = std::env::var_os("RELAY_BENCH_KEEP_DB").is_some_and(|v| v == "1");
    if keep {
        eprintln!("{}: kept database {tag} and the services' logs in {}", w.name, work.display());
    } else {
        let _ = admin_conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {tag} WITH (FORCE)"))).await;
        let _ = std::fs::remove_dir_all(&work);
    }
    delete_streams(&env.nats_url, &prefix).await;
    Ok((report, series))
}

/// The neighbour environments and their endpoints (paths outside `/ok/`,
/// so the measured figures never count them); returns their API keys.
async fn neighbours(
    admin: &mut AdminServiceClient<Channel>,
    http: &reqwest::Client,
    rest_url: &str,
    receiver: &Receiver,
    n: &crate::spec::Neighbours,
) -> Result<Vec<String>> {
    let mut keys = Vec::with_capacity(n.environments);
    for e in 0..n.environments {
        let quota = (n.healthy_each + n.hanging_each + n.failing_each) as u32;
        let (_, key) = environment_with_key(admin, format!("neighbour-{e}"), quota.max(1)).await?;
        let paths = (0..n.healthy_each)
            .map(|i| format!("/nb/{e}/{i}"))
            .chain((0..n.hanging_each).map(|i| format!("/hang/600/nb{e}-{i}")))
            .chain((0..n.failing_each).map(|i| format!("/status/500/nb{e}-{i}")));
        for p in paths {
            register_endpoint(http, rest_url, &key, receiver.url(&p), None, None).await?;
        }
        keys.push(key);
    }
    Ok(keys)
}

/// The neighbours' events, round robin over their environments, 16 at a
/// time, paced or as fast as they are accepted.
async fn publish_beside(http: reqwest::Client, rest_url: String, keys: Vec<String>, n: crate::spec::Neighbours) -> Result<()> {
    let (keys, next, started) = (Arc::new(keys), Arc::new(AtomicUsize::new(0)), Instant::now());
    let workers = (0..16).map(|_| {
        let (http, rest_url, keys, next) = (http.clone(), rest_url.clone(), keys.clone(), next.clone());
        async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n.events {
                    return anyhow::Ok(());
                }
                if let Some(rate) = n.rate {
                    tokio::time::sleep_until((started + Duration::from_secs_f64(i as f64 / rate)).into()).await;
                }
                let body = serde_json::json!({"type": "bench.event", "payload": {"n": i, "neighbour": true}});
                // A refusal under load is the neighbour's problem, not the
                // measurement's: it is not retried.
                let _ = http.post(format!("{rest_url}/v1/events")).bearer_auth(&keys[i % keys.len()]).json(&body).send().await;
            }
        }
    });
    futures::future::try_join_all(workers).await?;
    Ok(())
}

/// 200 each, all at once, over raw connections: 1 MiB chunked without a key
/// (refused before it is read), 1.9 MiB declared with a key (refused by its
/// declared size), 1 MiB chunked with a key (refused while it streams).
/// Returns how many of each status came back.
async fn hostile_bodies(rest: SocketAddr, key: String) -> Result<std::collections::BTreeMap<u16, usize>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mib = "x".repeat(1024 * 1024);
    let requests: Vec<Vec<u8>> = (0..600)
        .map(|i| {
            let head = |auth: &str, framing: String| {
                format!("POST /v1/events HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n{auth}{framing}\r\n")
            };
            let auth = format!("authorization: Bearer {key}\r\n");
            match i % 3 {
                0 => (head("", "transfer-encoding: chunked\r\n".into()) + &format!("{:x}\r\n{mib}\r\n0\r\n\r\n", mib.len())).into_bytes(),
                1 => (head(&auth, format!("content-length: {}\r\n", mib.len() * 19 / 10)) + &mib + &mib[..mib.len() * 9 / 10]).into_bytes(),
                _ => {
                    (head(&auth, "transfer-encoding: chunked\r\n".into()) + &format!("{:x}\r\n{mib}\r\n0\r\n\r\n", mib.len())).into_bytes()
                }
            }
        })
        .collect();
    let sends = requests.into_iter().map(|req| async move {
        let mut tcp = tokio::net::TcpStream::connect(rest).await.ok()?;
        // The api may answer, and close, before the body is all sent.
        let _ = tcp.write_all(&req).await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).split(' ').nth(1)?.parse::<u16>().ok()
    });
    let mut counts = std::collections::BTreeMap::new();
    for status in futures::future::join_all(sends).await {
        *counts.entry(status.unwrap_or(0)).or_insert(0) += 1;
    }
    Ok(counts)
}

async fn delete_streams(url: &str, prefix: &str) {
    if let Ok(client) = async_nats::connect(url).await {
        let js = async_nats::jetstream::new(client);
        for s in ["EVENTS", "DELIVERIES"] {
            let _ = js.delete_stream(format!("{prefix}{s}")).await;
        }
    }
}

async fn wait_healthy(http: &reqwest::Client, rest: &str) -> Result<()> {
    for _ in 0..300 {
        if http.get(format!("{rest}/healthz")).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the api did not come up on {rest}")
}
