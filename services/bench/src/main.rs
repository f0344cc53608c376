//! `relay-bench [w1|w1@150|w2|w2b|w3|idle|smoke ...] [--out DIR]`: runs each workload
//! against api and dispatcher binaries found next to this one, with Postgres
//! and NATS on 127.0.0.1, and writes `<out>/<workload>.json` and `.svg` plus a markdown
//! table (`<out>/results.md`). Exits non-zero if any delivery is missing or
//! duplicated.

use std::path::PathBuf;

use anyhow::{Context, Result};
use relay_bench::{
    report::Report,
    workload::{self, Env, Workload},
};

#[tokio::main]
async fn main() -> Result<()> {
    let mut names = Vec::new();
    let mut out = PathBuf::from("bench-results");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(args.next().context("--out needs a directory")?),
            other => names.push(other.to_ascii_lowercase()),
        }
    }
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
