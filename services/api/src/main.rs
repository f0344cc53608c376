use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use relay_api::{Listeners, config::ApiConfig};
use tokio::net::TcpListener;

/// Relay's api: the tenants' REST and gRPC facade, the portal, the
/// dispatchers' internal seam, the outbox relay and the upkeep. Settings come
/// from the environment (RELAY_*, DATABASE_URL; see docs/configuration.md).
#[derive(Parser)]
#[command(name = "relay-api", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve (what runs without a command).
    Serve,
    /// Print the REST facade's OpenAPI document and exit.
    Openapi,
    /// Run the database migrations and exit: a deployment runs this once (a
    /// Kubernetes Job) before rolling out apis that skip them.
    Migrate,
    /// Print a completion script for a shell (bash, zsh, fish, …) and exit.
    Completions(relay_config::cli::Completions),
}

/// mimalloc rather than glibc's malloc: allocation was 8% of the api's CPU
/// at moderate load, most of it in glibc's bins and consolidation.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Some(Command::Openapi) => {
            print!("{}", relay_api::openapi::rendered()?);
            return Ok(());
        }
        Some(Command::Migrate) => return migrate().await,
        Some(Command::Completions(c)) => {
            c.print::<Cli>("relay-api")?;
            return Ok(());
        }
        Some(Command::Serve) | None => {}
    }
    let telemetry = relay_telemetry::init_with("relay-api").context("invalid telemetry configuration")?;
    let cfg = ApiConfig::from_env().context("invalid configuration")?;
    let addrs = ApiConfig::listen_addrs_from_env()?;
    let bind = |a| async move { TcpListener::bind(a).await.with_context(|| format!("binding {a}")) };
    let metrics = match relay_api::config::metrics_addr_from_env()? {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let listeners =
        Listeners { grpc: bind(addrs.grpc).await?, rest: bind(addrs.rest).await?, internal: bind(addrs.internal).await?, metrics };
    tracing::info!(grpc = %addrs.grpc, rest = %addrs.rest, internal = %addrs.internal, "relay-api listening");
    let mut api = relay_api::run(cfg, listeners).await?;
    tokio::select! {
        r = api.wait() => r.context("an api task stopped")?,
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            api.shutdown().await?;
        }
    }
    // Spans still queued for the collector go out before the process ends.
    telemetry.shutdown()
}

async fn migrate() -> Result<()> {
    let telemetry = relay_telemetry::init_with("relay-api").context("invalid telemetry configuration")?;
    relay_config::Env.check_files().context("invalid configuration")?;
    let url = relay_config::Env.string_or_default("DATABASE_URL");
    let (db, _) = relay_api::db::connect(&url, 2, std::time::Duration::from_secs(30)).await?;
    relay_api::MIGRATOR.run(&db).await.context("running migrations")?;
    let applied = relay_api::MIGRATOR.iter().filter(|m| m.migration_type.is_up_migration()).count();
    tracing::info!(migrations = applied, "the database is at the latest migration");
    db.close().await;
    telemetry.shutdown()
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("installing SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
