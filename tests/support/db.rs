//! A fresh database per test on the shared Postgres, dropped afterwards.

use super::*;

/// A database created for one test and dropped by `cleanup`.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub port: u16,
}

impl TestDb {
    pub async fn create() -> Result<Self> {
        Self::create_on(5432).await
    }

    /// A fresh database on the Postgres at this loopback port.
    pub async fn create_on(port: u16) -> Result<Self> {
        let name = format!("relay_test_{}", Uuid::new_v4().simple());
        let admin = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let mut conn = PgConnection::connect(&admin).await.with_context(|| format!("connecting to Postgres on 127.0.0.1:{port}"))?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).await?;
        Ok(Self { url: format!("postgres://postgres@127.0.0.1:{port}/{name}"), name, port })
    }

    /// The same database on another server (a promoted standby's port).
    pub fn moved_to(&mut self, port: u16) {
        self.url = format!("postgres://postgres@127.0.0.1:{port}/{}", self.name);
        self.port = port;
    }

    pub async fn cleanup(self) -> Result<()> {
        let admin = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        let Ok(mut conn) = PgConnection::connect(&admin).await else {
            // A private server already stopped takes its databases with it.
            return Ok(());
        };
        conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))).await?;
        Ok(())
    }
}
