use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use relay_dispatcher::DispatcherConfig;

/// Relay's dispatcher: consumes EVENTS and DELIVERIES, has the api expand
/// events, signs and sends each attempt, and reports its outcome. Settings
/// come from the environment (RELAY_*; see docs/configuration.md).
#[derive(Parser)]
#[command(name = "relay-dispatcher", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run (what runs without a command).
    Serve,
    /// Print a completion script for a shell (bash, zsh, fish, …) and exit.
    Completions(relay_config::cli::Completions),
}

/// mimalloc rather than glibc's malloc, as in the api: the dispatcher's CPU at
/// saturation fell a tenth with it (glibc's bins and consolidation).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    if let Some(Command::Completions(c)) = Cli::parse().command {
        c.print::<Cli>("relay-dispatcher")?;
        return Ok(());
    }
    // Read before anything starts: the runtime is built to this size.
    let threads = relay_config::Env.number::<usize>("RELAY_DISPATCHER_THREADS", 1..=256).context("invalid configuration")?;
    tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()?.block_on(serve())
}

async fn serve() -> Result<()> {
    let telemetry = relay_telemetry::init_with("relay-dispatcher").context("invalid telemetry configuration")?;
    let cfg = DispatcherConfig::from_env().context("invalid configuration")?;
    tracing::info!(api = %cfg.api_url, "relay-dispatcher starting");
    let health = relay_config::Env.addr_or_off("RELAY_HEALTH_ADDR").context("invalid configuration")?;
    let health = match health {
        Some(a) => Some(tokio::net::TcpListener::bind(a).await.with_context(|| format!("binding {a}"))?),
        None => None,
    };
    let mut d = relay_dispatcher::run(cfg).await?;
    let (health_stop, health_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(listener) = health {
        let readiness = d.readiness();
        tokio::spawn(async move {
            if let Err(e) = relay_dispatcher::serve_health(listener, readiness, async move {
                let _ = health_stopped.await;
            })
            .await
            {
                tracing::error!(error = format!("{e:#}"), "the health port stopped");
            }
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = d.wait() => r.context("a dispatcher task stopped")?,
        _ = tokio::signal::ctrl_c() => d.shutdown().await?,
        _ = term.recv() => d.shutdown().await?,
    }
    let _ = health_stop.send(());
    // Spans still queued for the collector go out before the process ends.
    telemetry.shutdown()
}
