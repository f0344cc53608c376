//! Prints the table of every Relay setting, or rewrites it into a README:
//! `relay-knobs` | `relay-knobs --write README.md`.

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => print!("{}", relay_config::markdown_table()),
        [flag, path] if flag == "--write" => {
            let readme = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            std::fs::write(path, relay_config::with_table(&readme)?).with_context(|| format!("writing {path}"))?;
        }
        _ => anyhow::bail!("usage: relay-knobs [--write README.md]"),
    }
    Ok(())
}
