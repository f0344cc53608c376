//! Which of several Postgres servers is the primary, followed as it moves.
//!
//! sqlx takes one host per URL (transact-rs/sqlx#3333); a replicated
//! Postgres has several, and after a failover the primary is another one.
//! `DATABASE_URL` may therefore list them the way libpq does
//! (`postgres://user@pg1:5432,pg2:5432/relay`, `target_session_attrs`
//! `read-write` or `primary` if given at all): the api connects to the first
//! that accepts writes, and a [`Follower`] asks it once a second whether it
//! still does. When it stops answering or has become a standby, the follower
//! tries the list again in order and points the pool at the primary it finds;
//! connections already open are checked before each use (see the pool's
//! `before_acquire`), so none is handed out that reaches a standby or a dead
//! server. With one host nothing here runs: the pool reconnects to the same
//! address by itself.

use std::{str::FromStr, time::Duration};

use anyhow::{Context, Result, bail};
use sqlx::{Connection, PgConnection, PgPool, postgres::PgConnectOptions};
use tokio::sync::watch;

/// How long one server may take to accept a connection or answer the probe
/// before the next in the list is tried.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the primary is asked whether it still is one.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);
/// How long to wait between rounds over the list while no server is primary
/// (the old one gone, the standby not yet promoted).
const SEARCH_EVERY: Duration = Duration::from_millis(250);

/// The servers `DATABASE_URL` names, in its order, each with the URL's
/// user, database and parameters.
#[derive(Clone)]
pub struct Servers {
    candidates: Vec<PgConnectOptions>,
}

impl std::fmt::Debug for Servers {
    /// Hosts and ports only: the options carry the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.candidates.iter().map(address)).finish()
    }
}

/// `host:port`, for logs (never the password).
pub fn address(o: &PgConnectOptions) -> String {
    format!("{}:{}", o.get_host(), o.get_port())
}

impl Servers {
    /// Parses a libpq-style URL whose host part may list several
    /// `host[:port]` entries separated by commas (a missing port is 5432).
    pub fn parse(url: &str) -> Result<Self> {
        let scheme_end = url.find("://").map(|i| i + 3).context("DATABASE_URL must start with postgres:// or postgresql://")?;
        let after_scheme = &url[scheme_end..];
        let authority_len = after_scheme.find(['/', '?']).unwrap_or(after_scheme.len());
        let authority = &after_scheme[..authority_len];
        let (userinfo, hosts) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        if !hosts.contains(',') {
            // One server (or a socket given as a parameter): exactly as sqlx reads it.
            let options = PgConnectOptions::from_str(url).context("DATABASE_URL is not a Postgres URL")?;
            return Ok(Self { candidates: vec![options] });
        }
        let rest = after_scheme[authority_len..].to_string();
        let (rest, session_attrs) = take_query_param(&rest, "target_session_attrs");
        if let Some(v) = session_attrs.as_deref()
            && !matches!(v, "read-write" | "primary")
        {
            bail!("DATABASE_URL: target_session_attrs={v} is not supported; the api writes, so it is always read-write (or primary)");
        }
        let entries: Vec<&str> = hosts.split(',').collect();
        let mut candidates = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            if entry.is_empty() {
                bail!("DATABASE_URL: host {} of {} is empty", i + 1, entries.len());
            }
            let (host, port) =
                split_host_port(entry).with_context(|| format!("DATABASE_URL: host {} of {} ({entry})", i + 1, entries.len()))?;
            let one = format!("{}{userinfo}{host}{}{rest}", &url[..scheme_end], port.map(|p| format!(":{p}")).unwrap_or_default());
            candidates
                .push(PgConnectOptions::from_str(&one).with_context(|| format!("DATABASE_URL: host {} of {}", i + 1, entries.len()))?);
        }
        Ok(Self { candidates })
    }

    /// More than one server: the primary must be found and followed.
    pub fn is_replicated(&self) -> bool {
        self.candidates.len() > 1
    }

    pub fn first(&self) -> &PgConnectOptions {
        &self.candidates[0]
    }

    /// The first server, in the URL's order, that accepts writes; waits
    /// and asks again until `within` has passed.
    pub async fn find_primary(&self, within: Duration) -> Result<PgConnectOptions> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut seen = Vec::with_capacity(self.candidates.len());
            for c in &self.candidates {
                match role(c).await {
                    Ok(Role::Primary) => return Ok(c.clone()),
                    Ok(Role::Standby) => seen.push(format!("{}: a standby", address(c))),
                    Err(e) => seen.push(format!("{}: {e:#}", address(c))),
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("no Postgres server in DATABASE_URL accepts writes ({})", seen.join("; "));
            }
            tokio::time::sleep(SEARCH_EVERY).await;
        }
    }
}

/// Removes `key=value` from a URL's query (the part from `?` on, possibly
/// preceded by `/db`), returning what remains and the value.
fn take_query_param(rest: &str, key: &str) -> (String, Option<String>) {
    let Some(q) = rest.find('?') else { return (rest.to_string(), None) };
    let (path, query) = (&rest[..q], &rest[q + 1..]);
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.split_once('=') {
            Some((k, v)) if k == key => {
                value = Some(v.to_string());
                false
            }
            _ => !pair.is_empty(),
        })
        .collect();
    if kept.is_empty() { (path.to_string(), value) } else { (format!("{path}?{}", kept.join("&")), value) }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host_port(entry: &str) -> Result<(&str, Option<u16>)> {
    let (host, port) = if let Some(close) = entry.strip_prefix('[').and_then(|_| entry.find(']')) {
        let (host, after) = entry.split_at(close + 1);
        match after.strip_prefix(':') {
            Some(p) => (host, Some(p)),
            None if after.is_empty() => (host, None),
            None => bail!("unexpected {after:?} after the address"),
        }
    } else {
        match entry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (entry, None),
        }
    };
    let port = port.map(|p| p.parse::<u16>().with_context(|| format!("port {p:?} is not a number from 1 to 65535"))).transpose()?;
    if port == Some(0) {
        bail!("port 0 is not a port");
    }
    Ok((host, port))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Primary,
    Standby,
}

async fn ask_role(conn: &mut PgConnection) -> Result<Role> {
    let in_recovery: bool = tokio::time::timeout(PROBE_TIMEOUT, sqlx::query_scalar("SELECT pg_is_in_recovery()").fetch_one(&mut *conn))
        .await
        .context("no answer in time")??;
    Ok(if in_recovery { Role::Standby } else { Role::Primary })
}

async fn role(options: &PgConnectOptions) -> Result<Role> {
    let mut conn = tokio::time::timeout(PROBE_TIMEOUT, PgConnection::connect_with(options)).await.context("no connection in time")??;
    let role = ask_role(&mut conn).await;
    let _ = tokio::time::timeout(PROBE_TIMEOUT, conn.close()).await;
    role
}

/// Keeps a pool pointed at whichever listed server is the primary.
pub struct Follower {
    pub servers: Servers,
    pub pool: PgPool,
}

impl Follower {
    /// Until `stop`: holds one connection to the pool's server and asks it
    /// each second whether it is still the primary; when it is not (or does
    /// not answer), searches the list and moves the pool to the one that is.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let mut probe: Option<PgConnection> = None;
        let mut tick = tokio::time::interval(FOLLOW_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => return Ok(()),
            }
            let current = self.pool.connect_options();
            let still_primary = async {
                if probe.is_none() {
                    let conn = tokio::time::timeout(PROBE_TIMEOUT, PgConnection::connect_with(&current))
                        .await
                        .context("no connection in time")??;
                    probe = Some(conn);
                }
                ask_role(probe.as_mut().expect("just opened")).await
            }
            .await;
            match still_primary {
                Ok(Role::Primary) => continue,
                Ok(Role::Standby) => {
                    tracing::warn!(server = %address(&current), "the Postgres server the api writes to is a standby now; looking for the primary")
                }
                Err(e) => {
                    tracing::warn!(server = %address(&current), error = %format!("{e:#}"), "the Postgres primary does not answer; looking for a primary among DATABASE_URL's servers")
                }
            }
            probe = None;
            let found = tokio::select! {
                found = self.servers.find_primary(Duration::MAX / 4) => found,
                _ = stop.wait_for(|s| *s) => return Ok(()),
            }?;
            if address(&found) != address(&current) {
                tracing::warn!(from = %address(&current), to = %address(&found), "the Postgres primary moved; new connections go to the new one");
                self.pool.set_connect_options(found);
            } else {
                tracing::info!(server = %address(&found), "the Postgres primary answers again");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(url: &str) -> Vec<String> {
        Servers::parse(url).expect("valid").candidates.iter().map(address).collect()
    }

    #[test]
    fn one_host_stays_as_sqlx_reads_it() {
        assert_eq!(hosts("postgres://postgres@127.0.0.1:5433/relay"), ["127.0.0.1:5433"]);
        assert_eq!(hosts("postgres://postgres@db/relay"), ["db:5432"]);
        assert!(!Servers::parse("postgres://postgres@db/relay").expect("valid").is_replicated());
    }

    #[test]
    fn a_host_list_keeps_user_database_and_parameters_for_each() {
        let s = Servers::parse("postgresql://relay:pw@pg1:5432,pg2,[::1]:6000/relaydb?target_session_attrs=read-write&application_name=x")
            .expect("valid");
        assert!(s.is_replicated());
        assert_eq!(s.candidates.iter().map(address).collect::<Vec<_>>(), ["pg1:5432", "pg2:5432", "[::1]:6000"]);
        for c in &s.candidates {
            assert_eq!(c.get_database(), Some("relaydb"));
            assert_eq!(c.get_username(), "relay");
            assert_eq!(c.get_application_name(), Some("x"));
        }
        assert!(!format!("{s:?}").contains("pw"), "Debug shows no password: {s:?}");
    }

    #[test]
    fn mistakes_are_named_with_their_position() {
        let err = |url: &str| format!("{:#}", Servers::parse(url).expect_err("refused"));
        assert!(err("postgres://u@pg1:5432,,pg3/db").contains("host 2 of 3 is empty"));
        assert!(err("postgres://u@pg1:5432,pg2:99999/db").contains("host 2 of 2"));
        assert!(err("postgres://u@pg1,pg2/db?target_session_attrs=any").contains("target_session_attrs=any"));
        assert!(err("pg1,pg2").contains("postgres://"));
        // One host is sqlx's own reading, socket parameters and all.
        assert_eq!(hosts("postgres:///relay?host=/var/run/postgresql"), ["/var/run/postgresql:5432"]);
    }
}
