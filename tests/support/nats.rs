//! NATS servers of a test's own: one, or three routed as a JetStream cluster.

use super::*;

/// A NATS server of the test's own, on its own port and store, so a test
/// can stop the broker without disturbing anything else on the machine.
pub struct PrivateNats {
    pub port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
    /// As a node of a cluster: its name, its route port and its peers' routes.
    cluster: Option<(String, u16, Vec<String>)>,
}

impl PrivateNats {
    pub async fn start() -> Result<Self> {
        let port = free_addr().await?.port();
        let dir = std::env::temp_dir().join(format!("relay-test-nats-{}", Uuid::new_v4().simple()));
        let mut n = Self { port, dir, child: None, cluster: None };
        n.resume().await?;
        Ok(n)
    }

    /// The node's server name in its cluster (what stream info calls the leader).
    pub fn server_name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|c| c.0.as_str())
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store.
    pub async fn resume(&mut self) -> Result<()> {
        let bin = ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .context("nats-server is not installed")?;
        let mut command = tokio::process::Command::new(bin);
        command.args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"]).arg(&self.dir);
        if let Some((name, route_port, routes)) = &self.cluster {
            command.args(["--server_name", name, "--cluster_name", "relay-test"]).args([
                "--cluster",
                &format!("nats://127.0.0.1:{route_port}"),
                "--routes",
                &routes.join(","),
            ]);
        }
        let child = command.kill_on_drop(true).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn()?;
        self.child = Some(child);
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("the private NATS did not start on port {}", self.port)
    }

    /// Kills the server with SIGKILL (no shutdown path runs), and waits.
    pub async fn kill9(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.start_kill()?;
            c.wait().await?;
        }
        Ok(())
    }

    /// Deletes the server's store (while it is down): it comes back
    /// without streams or consumers, as a broker that lost its disk.
    pub fn wipe_store(&self) -> Result<()> {
        anyhow::ensure!(self.child.is_none(), "the server is running");
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir)?;
        }
        Ok(())
    }

    /// Stops the server the way an operator would (SIGTERM), and waits.
    pub async fn stop(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
            }
            c.wait().await?;
        }
        Ok(())
    }
}

/// Three NATS servers of the test's own, routed to each other as one
/// JetStream cluster (streams replicated ×3 survive the loss of any one).
pub struct NatsCluster {
    pub nodes: Vec<PrivateNats>,
}

impl NatsCluster {
    pub async fn start() -> Result<Self> {
        let mut ports = Vec::new();
        for _ in 0..3 {
            ports.push((free_addr().await?.port(), free_addr().await?.port()));
        }
        let mut nodes = Vec::new();
        for (i, &(port, route_port)) in ports.iter().enumerate() {
            let routes = ports.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, (_, r))| format!("nats://127.0.0.1:{r}")).collect();
            let dir = std::env::temp_dir().join(format!("relay-test-nats-{}", Uuid::new_v4().simple()));
            nodes.push(PrivateNats { port, dir, child: None, cluster: Some((format!("n{}", i + 1), route_port, routes)) });
        }
        for n in &mut nodes {
            n.resume().await?;
        }
        let cluster = Self { nodes };
        // JetStream answers once the cluster has elected its meta leader.
        let js = async_nats::jetstream::new(async_nats::connect(cluster.nodes[0].url()).await?);
        // Ready when it can place a stream on all three nodes.
        let probe = format!("probe_{}", Uuid::new_v4().simple());
        let mut last = None;
        for _ in 0..200 {
            let config = async_nats::jetstream::stream::Config {
                name: probe.clone(),
                subjects: vec![format!("{probe}.>")],
                num_replicas: 3,
                ..Default::default()
            };
            match js.create_stream(config).await {
                Ok(_) => {
                    js.delete_stream(&probe).await?;
                    return Ok(cluster);
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("the NATS cluster elected no JetStream leader within 20 s: {last:?}")
    }

    /// Every node, comma-separated, as `RELAY_NATS_URL` takes them.
    pub fn url(&self) -> String {
        self.nodes.iter().map(PrivateNats::url).collect::<Vec<_>>().join(",")
    }

    /// The node that leads a stream now, by index.
    pub async fn leader_of(&self, stream: &str) -> Result<usize> {
        for n in &self.nodes {
            let Ok(client) = async_nats::connect(n.url()).await else { continue };
            let js = async_nats::jetstream::new(client);
            let Ok(mut s) = js.get_stream(stream).await else { continue };
            let info = s.info().await?;
            let leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).context("a clustered stream names its leader")?;
            return self.nodes.iter().position(|n| n.server_name() == Some(leader.as_str())).context("the leader is one of the nodes");
        }
        anyhow::bail!("no node answered for stream {stream}")
    }
}

impl NatsCluster {
    /// For each node (by index), which of these streams and consumers it
    /// leads now: `(stream, None)` names a stream, `(stream, Some(durable))`
    /// a consumer. Asked of the first node that answers.
    pub async fn leadership(&self, assets: &[(String, Option<String>)]) -> Result<Vec<Vec<String>>> {
        let mut led = vec![Vec::new(); self.nodes.len()];
        for n in &self.nodes {
            let Ok(client) = async_nats::connect(n.url()).await else { continue };
            let js = async_nats::jetstream::new(client);
            for (stream, durable) in assets {
                let Ok(mut s) = js.get_stream(stream).await else { continue };
                let leader = match durable {
                    None => s.info().await?.cluster.as_ref().and_then(|c| c.leader.clone()),
                    Some(d) => {
                        let mut c: async_nats::jetstream::consumer::PullConsumer =
                            s.get_consumer(d).await.map_err(|e| anyhow::anyhow!("{e}"))?;
                        c.info().await?.cluster.as_ref().and_then(|c| c.leader.clone())
                    }
                };
                if let Some(i) = leader.and_then(|l| self.nodes.iter().position(|n| n.server_name() == Some(l.as_str()))) {
                    led[i].push(durable.clone().unwrap_or_else(|| stream.clone()));
                }
            }
            return Ok(led);
        }
        anyhow::bail!("no node of the cluster answered")
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
