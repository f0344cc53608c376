//! `relay-bench [WORKLOAD ...] [--out DIR]`: runs each workload against api
//! and dispatcher binaries found next to this one, with Postgres and NATS on
//! 127.0.0.1, and writes `<out>/<workload>.json` and `.svg` plus a markdown
//! table (`<out>/results.md`). Exits non-zero if any delivery is missing or
//! duplicated.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use relay_bench::{
    report::Report,
    workload::{self, Env, Workload},
};

/// Relay's benchmark: runs workloads against the api and dispatcher
/// binaries next to this one (Postgres and NATS on 127.0.0.1, or
/// RELAY_BENCH_PG / RELAY_BENCH_NATS) and reports rates, latencies, CPU and
/// memory. Workloads: w1, w1f, w1f-all, w1h, w1s, w1s-none, w6, w6-1, w2, w2b, w2b-solo, w3, w3-10m,
/// w4, w4-solo, w5, w5-solo, bodies, idle, smoke; `<name>x<N>` runs N apis
/// and dispatchers, `<name>@<events per second>` paces it.
#[derive(Parser)]
#[command(name = "relay-bench", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Run,
}

#[derive(Args)]
struct Run {
    /// Workloads to run, in order (default: w1 w1@150 w1@400 w2 w2b w3 idle).
    #[arg(value_parser = workload_name)]
    workloads: Vec<String>,
    /// Where the results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Print a completion script for a shell (bash, zsh, fish, …) and exit.
    Completions(relay_config::cli::Completions),
}

/// A workload name as `Workload::named` reads it, refused at parsing.
fn workload_name(s: &str) -> Result<String, String> {
    let name = s.to_ascii_lowercase();
    Workload::named(&name).map(|_| name).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Completions(c)) = cli.command {
        c.print::<Cli>("relay-bench")?;
        return Ok(());
    }
    let Run { workloads: mut names, out } = cli.run;
    if names.is_empty() {
        names = ["w1", "w1@150", "w1@400", "w2", "w2b", "w3", "idle"].map(String::from).to_vec();
    }
    let exe = std::env::current_exe()?;
    let env = Env {
        pg_admin_url: std::env::var("RELAY_BENCH_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        nats_url: std::env::var("RELAY_BENCH_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        // On a NATS cluster (deploy/local/cluster's: RELAY_BENCH_NATS=nats://127.0.0.1:4301,... and 3).
        stream_replicas: std::env::var("RELAY_BENCH_STREAM_REPLICAS").unwrap_or_else(|_| "1".into()),
        bin_dir: exe.parent().context("no binary dir")?.to_path_buf(),
    };
    std::fs::create_dir_all(&out)?;
    let mut rows = vec![Report::MARKDOWN_HEADER.to_owned()];
    let mut bad = false;
    for name in &names {
        let w = Workload::named(name)?;
        eprintln!("running {name}: {} events, {} publishers, {}/{}/{} endpoints", w.events, w.publishers, w.healthy, w.hanging, w.failing);
        let (r, series) = workload::run(&w, &env).await.with_context(|| format!("workload {name}"))?;
        std::fs::write(out.join(format!("{name}.json")), serde_json::to_string_pretty(&r)? + "\n")?;
        std::fs::write(out.join(format!("{name}.svg")), relay_bench::chart::svg(name, &series))?;
        println!("{}", serde_json::to_string(&r)?);
        rows.push(r.markdown_row());
        if let Some(breakdown) = r.statement_breakdown() {
            eprintln!("{breakdown}");
        }
        if let Some(one_key) = r.one_key_line() {
            eprintln!("{one_key}");
        }
        if let Some(stored) = r.storage_line() {
            eprintln!("{stored}");
        }
        bad |= r.missing > 0 || r.duplicates > 0 || r.unexpected > 0;
    }
    let table = format!(
        "Machine: {}; everything (Postgres, NATS, api, dispatcher, receiver, driver) on it\n\n{}\n",
        relay_bench::report::machine(),
        rows.join("\n")
    );
    std::fs::write(out.join("results.md"), &table)?;
    println!("{table}");
    if bad {
        anyhow::bail!("deliveries were missing, duplicated or let through by a filter that should have refused them");
    }
    Ok(())
}
