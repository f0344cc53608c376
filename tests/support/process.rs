//! The service binaries run as real processes, so a test can kill -9 them.

use super::*;

/// A service binary built next to the tests (`cargo build --bins`, which
/// `deploy/local/test` runs first).
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(|deps| deps.parent()).context("test binary has no target dir")?;
    let path = dir.join(name);
    anyhow::ensure!(path.exists(), "{} is missing: run `cargo build --bins` first (deploy/local/test does)", path.display());
    Ok(path)
}

/// A service running as a real process, so a test can kill -9 it.
pub struct Process {
    child: tokio::process::Child,
}

impl Process {
    pub fn spawn(name: &str, env: &[(&'static str, String)]) -> Result<Self> {
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.env("RELAY_LOG", std::env::var("RELAY_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            // The caller's settings win, RELAY_LOG included.
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null());
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// Like [`Process::spawn`], but with `RELAY_LOG` as given (`None`: unset,
    /// the service's own default) and the logs discarded: for checks of what
    /// the services do at a log level other than the quiet one tests use.
    pub fn spawn_logging(name: &str, env: &[(&'static str, String)], log: Option<&str>) -> Result<Self> {
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.envs(env.iter().filter(|(k, _)| *k != "RELAY_LOG").map(|(k, v)| (*k, v.as_str())))
            .env_remove("RELAY_LOG")
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(log) = log {
            cmd.env("RELAY_LOG", log);
        }
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// Like [`Process::spawn`], with the process's output appended to `log`
    /// (a file that outlives it, for a test to point at when it fails).
    pub fn spawn_logging_to(name: &str, env: &[(&'static str, String)], log: &std::path::Path) -> Result<Self> {
        let file = || std::fs::OpenOptions::new().create(true).append(true).open(log).with_context(|| format!("opening {}", log.display()));
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.env("RELAY_LOG", std::env::var("RELAY_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null())
            .stdout(file()?)
            .stderr(file()?);
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// SIGKILL: no shutdown path runs.
    pub async fn kill9(mut self) -> Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}
