//! What a deployment runs besides the services (issue 14): `relay-api
//! migrate`, the Kubernetes migrations Job's command.

use relay_tests::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_api_migrate_brings_a_fresh_database_to_the_latest_migration_and_a_second_run_changes_nothing() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let migrate = || -> anyhow::Result<(bool, String)> {
        let out = std::process::Command::new(relay_tests::binary("relay-api")?)
            .arg("migrate")
            .env_clear()
            .env("DATABASE_URL", &db.url)
            .env("RELAY_LOG", "info")
            .output()?;
        Ok((out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)))
    };
    let latest = relay_api::MIGRATOR.iter().filter(|m| m.migration_type.is_up_migration()).count() as i64;
    let pg = sqlx::PgPool::connect(&db.url).await?;
    for run in 1..=2 {
        let (ok, log) = migrate()?;
        assert!(ok, "run {run} of relay-api migrate failed: {log}");
        assert!(log.contains("the database is at the latest migration"), "run {run}: {log}");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success").fetch_one(&pg).await?;
        assert_eq!(applied, latest, "run {run}: every migration applied once");
    }
    // The services' own tables are there, and nothing is running: it exited.
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename IN ('events', 'webhook_deliveries', 'delivery_attempts')")
            .fetch_one(&pg)
            .await?;
    assert_eq!(tables, 3);
    pg.close().await;
    let unknown = std::process::Command::new(relay_tests::binary("relay-api")?).arg("migrat").env_clear().output()?;
    let said = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(2), "{said}");
    assert!(said.contains("unrecognized subcommand 'migrat'") && said.contains("'migrate'"), "named, with the near miss: {said}");
    db.cleanup().await
}

/// Secrets mounted as files: any setting may be given as `<NAME>_FILE`, a
/// path whose contents are the value; both ways at once, or a file that
/// cannot be read, stops the process with a message naming the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_given_as_a_file_is_read_from_it_and_a_conflict_or_a_missing_file_is_named() -> anyhow::Result<()> {
    let db = TestDb::create().await?;
    let dir = std::env::temp_dir().join(format!("relay-test-files-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    // As Kubernetes writes a Secret's key: the value and a final newline.
    std::fs::write(dir.join("uri"), format!("{}\n", db.url))?;
    let migrate = |env: &[(&str, String)]| -> anyhow::Result<(bool, String)> {
        let out = std::process::Command::new(relay_tests::binary("relay-api")?)
            .arg("migrate")
            .env_clear()
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()?;
        Ok((out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)))
    };
    let file = dir.join("uri").display().to_string();
    let (ok, log) = migrate(&[("DATABASE_URL_FILE", file.clone())])?;
    assert!(ok && log.contains("the database is at the latest migration"), "{log}");
    let (ok, log) = migrate(&[("DATABASE_URL_FILE", file.clone()), ("DATABASE_URL", db.url.clone())])?;
    assert!(!ok && log.contains("DATABASE_URL and DATABASE_URL_FILE are both set"), "{log}");
    let missing = dir.join("absent").display().to_string();
    let (ok, log) = migrate(&[("DATABASE_URL_FILE", missing.clone())])?;
    assert!(!ok && log.contains("DATABASE_URL_FILE") && log.contains(&missing), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
    db.cleanup().await
}

/// An api told to skip the migrations (`RELAY_SKIP_MIGRATIONS`, as the
/// Kubernetes Deployment is) refuses a database behind it, naming what is
/// missing and the command that fixes it; once migrated, it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_that_skips_migrations_refuses_a_database_behind_it_and_starts_once_migrated() -> anyhow::Result<()> {
    let stack = relay_tests::Stack::start(relay_tests::Options { api: false, dispatcher: false, ..Default::default() }).await?;
    let mut env = stack.api_env();
    env.push(("RELAY_SKIP_MIGRATIONS", "true".into()));
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(relay_tests::binary("relay-api")?).envs(env.iter().map(|(k, v)| (*k, v.as_str()))).output(),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the api did not refuse an unmigrated database within 60 s"))??;
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the api started on an unmigrated database");
    assert!(log.contains("relay-api migrate"), "the refusal names the fix: {log}");

    let migrate = std::process::Command::new(relay_tests::binary("relay-api")?)
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &stack.db.url)
        .output()?;
    assert!(migrate.status.success(), "{}", String::from_utf8_lossy(&migrate.stderr));
    let api = relay_tests::Process::spawn("relay-api", &env)?;
    stack.wait_for_api().await?;
    api.kill9().await?;
    stack.stop().await
}

/// What the Kubernetes startup probe asks: gRPC health on the tenants'
/// port, with no credentials, for the server as a whole ("") and for a
/// tenant service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_answers_serving_on_the_public_port_without_credentials() -> anyhow::Result<()> {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
    let stack = relay_tests::Stack::start(relay_tests::Options { dispatcher: false, ..Default::default() }).await?;
    let mut health = HealthClient::new(tonic::transport::Channel::from_shared(stack.grpc_url.clone())?.connect().await?);
    for service in ["", "relay.tenant.v1.EventService"] {
        let status = health.check(HealthCheckRequest { service: service.into() }).await?.into_inner().status;
        assert_eq!(status, ServingStatus::Serving as i32, "health of {service:?}");
    }
    stack.stop().await
}
