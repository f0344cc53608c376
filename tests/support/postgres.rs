//! A Postgres server of a test's own, primary or synchronous standby.

use super::*;

/// A Postgres server of the test's own (Debian's binaries, a fresh cluster
/// in a temporary directory, trust auth, loopback only), so a test can stop
/// and restart the database without disturbing anything else.
pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    /// `-c` settings given at every start.
    settings: Vec<String>,
}

impl PrivatePostgres {
    fn bin(name: &str) -> Result<PathBuf> {
        let dirs = std::fs::read_dir("/usr/lib/postgresql").context("Postgres's binaries are not installed")?;
        let mut found: Vec<PathBuf> = dirs.filter_map(|d| Some(d.ok()?.path().join("bin").join(name))).filter(|p| p.exists()).collect();
        found.sort();
        found.pop().with_context(|| format!("no {name} under /usr/lib/postgresql"))
    }

    /// As the `postgres` user when this runs as root (initdb refuses root).
    fn command(name: &str) -> Result<std::process::Command> {
        let bin = Self::bin(name)?;
        Ok(if running_as_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            std::process::Command::new(bin)
        })
    }

    fn run(mut command: std::process::Command, what: &str) -> Result<()> {
        let out = command.output().with_context(|| format!("running {what}"))?;
        anyhow::ensure!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    async fn empty_dir() -> Result<(u16, PathBuf)> {
        let port = free_addr().await?.port();
        let dir = std::env::temp_dir().join(format!("relay-test-pg-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        if running_as_root() {
            std::process::Command::new("chown").arg("postgres").arg(&dir).status()?;
        }
        Ok((port, dir))
    }

    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// A fresh server started with these `-c name=value` settings (kept for
    /// every restart).
    pub async fn start_with(settings: &[&str]) -> Result<Self> {
        let (port, dir) = Self::empty_dir().await?;
        let mut initdb = Self::command("initdb")?;
        initdb.arg("-D").arg(&dir).args(["-U", "postgres", "--auth=trust", "-N"]);
        Self::run(initdb, "initdb")?;
        let pg = Self { port, dir, settings: settings.iter().map(|s| s.to_string()).collect() };
        pg.resume()?;
        Ok(pg)
    }

    /// A primary whose commits return only once a standby has flushed them
    /// (`synchronous_standby_names = '*'`): with no standby attached, a
    /// commit waits, so start [`PrivatePostgres::standby_of`] before writing.
    pub async fn synchronous_primary() -> Result<Self> {
        Self::start_with(&["synchronous_standby_names=*", "synchronous_commit=on"]).await
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started on its
    /// own port and data. It has no synchronous standby of its own, so once
    /// promoted its commits do not wait for one.
    pub async fn standby_of(primary: &PrivatePostgres) -> Result<Self> {
        let (port, dir) = Self::empty_dir().await?;
        let mut backup = Self::command("pg_basebackup")?;
        backup.args(["-h", "127.0.0.1", "-p", &primary.port.to_string(), "-U", "postgres", "-X", "stream", "-R", "-D"]).arg(&dir);
        Self::run(backup, "pg_basebackup")?;
        // The copy holds the primary's log; the server wants its directory private.
        let _ = std::fs::remove_file(dir.join("log"));
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let pg = Self { port, dir, settings: vec!["synchronous_standby_names=".into()] };
        pg.resume()?;
        Ok(pg)
    }

    /// Waits (bounded) until a standby streams from this server as its
    /// synchronous one.
    pub async fn wait_for_synchronous_standby(&self) -> Result<()> {
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        let found = eventually(Duration::from_secs(30), || async {
            let mut conn = PgConnection::connect(&url).await.ok()?;
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").fetch_one(&mut conn).await.ok()?;
            (n > 0).then_some(())
        })
        .await;
        found.context("no synchronous standby streams from the primary within 30 s")
    }

    /// Promotes this standby to a primary (`pg_ctl promote`), and waits.
    pub fn promote(&self) -> Result<()> {
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "promote"]);
        Self::run(c, "pg_ctl promote")
    }

    /// (Re)starts the server on the same port and data, and waits for it.
    pub fn resume(&self) -> Result<()> {
        let mut options = format!("-p {} -c listen_addresses=127.0.0.1 -k {}", self.port, self.dir.display());
        for s in &self.settings {
            options.push_str(&format!(" -c {s:?}"));
        }
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "-l"]).arg(self.dir.join("log")).args(["-o", &options]).arg("start");
        Self::run(c, "pg_ctl start").with_context(|| {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            format!("the server's log ends: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
        })
    }

    /// Stops the server at once, as a crash would (`-m immediate`: no
    /// checkpoint, clients cut off), and waits.
    pub fn crash(&self) -> Result<()> {
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "-m", "immediate", "stop"]);
        Self::run(c, "pg_ctl stop")
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn running_as_root() -> bool {
    std::process::Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false)
}
