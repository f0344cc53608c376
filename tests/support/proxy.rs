//! A real forwarding proxy (Debian's tinyproxy) on loopback, for the egress
//! proxy's tests: plain requests and CONNECT tunnels to any port, each one
//! logged, so a test can say what the proxy was asked for.

use std::process::Stdio;

use super::*;

pub struct Tinyproxy {
    pub addr: SocketAddr,
    dir: PathBuf,
    child: tokio::process::Child,
}

impl Drop for Tinyproxy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Tinyproxy {
    /// Starts one on a free port (fails if tinyproxy is not installed:
    /// `deploy/local/test` installs it).
    pub async fn start() -> Result<Self> {
        let addr = free_addr().await?;
        let dir = std::env::temp_dir().join(format!("relay-tinyproxy-{}", addr.port()));
        std::fs::create_dir_all(&dir)?;
        let log = dir.join("tinyproxy.log");
        // No ConnectPort line: CONNECT to every port (receivers listen on port 0).
        let conf = format!(
            "Port {}\nListen 127.0.0.1\nAllow 127.0.0.1\nTimeout 30\nMaxClients 64\nLogFile \"{}\"\nLogLevel Info\nPidFile \"{}\"\n",
            addr.port(),
            log.display(),
            dir.join("tinyproxy.pid").display()
        );
        let path = dir.join("tinyproxy.conf");
        std::fs::write(&path, conf)?;
        let child = tokio::process::Command::new("tinyproxy")
            .arg("-d")
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting tinyproxy (apt-get install tinyproxy; deploy/local/test does)")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "tinyproxy did not listen on {addr} within 10 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self { addr, dir, child })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What tinyproxy logged so far (each request and tunnel it was asked for).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("tinyproxy.log")).unwrap_or_default()
    }

    pub async fn stop(mut self) -> Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}
