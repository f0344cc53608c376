//! Prints the table of every Relay setting, or rewrites it into its page:
//! `relay-knobs` | `relay-knobs --write [docs/configuration.md]`.

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let write = |path: &str| -> Result<()> {
        let doc = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        std::fs::write(path, relay_config::with_table(&doc).with_context(|| path.to_owned())?).with_context(|| format!("writing {path}"))
    };
    match args.as_slice() {
        [] => print!("{}", relay_config::markdown_table()),
        [flag] if flag == "--write" => write(relay_config::TABLE_FILE)?,
        [flag, path] if flag == "--write" => write(path)?,
        _ => anyhow::bail!("usage: relay-knobs [--write [{}]]", relay_config::TABLE_FILE),
    }
    Ok(())
}
