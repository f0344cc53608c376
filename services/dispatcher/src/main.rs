use anyhow::{Context, Result};
use relay_dispatcher::DispatcherConfig;

#[tokio::main]
async fn main() -> Result<()> {
    use tracing_subscriber::{EnvFilter, fmt};
    let filter = EnvFilter::try_from_env("RELAY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    if std::env::var("RELAY_LOG_FORMAT").as_deref() == Ok("json") {
        fmt().json().with_env_filter(filter).init();
    } else {
        fmt().with_env_filter(filter).init();
    }
    let cfg = DispatcherConfig::from_env().context("invalid configuration")?;
    tracing::info!(api = %cfg.api_url, "relay-dispatcher starting");
    let mut d = relay_dispatcher::run(cfg).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = d.wait() => r.context("a dispatcher task stopped")?,
        _ = tokio::signal::ctrl_c() => d.shutdown().await?,
        _ = term.recv() => d.shutdown().await?,
    }
    Ok(())
}
