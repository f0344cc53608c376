//! The receiver guides in docs/receiving/ run against a live stack: each
//! verifies relay-v1 and standard-webhooks deliveries of its endpoint,
//! processes each event once (a repeated id is answered but not processed
//! again), and refuses a request signed with another secret.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use relay_signing::{Scheme, SigningSecret, signed_headers};
use relay_tests::{Options, Rest, Stack, eventually};
use reqwest::Method;
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A guide's receiver as a process, its stdout collected line by line.
struct Guide {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Guide {
    fn start(name: &str, port: u16, secret: &str) -> Result<Self> {
        let guides = root().join("docs/receiving");
        let mut command = match name {
            "python" => {
                let mut c = Command::new(relay_tests::verifiers_python()?);
                c.arg(guides.join("python/receiver.py"));
                c
            }
            "node" => {
                ensure!(
                    guides.join("node/node_modules/standardwebhooks").exists(),
                    "docs/receiving/node has no node_modules: deploy/local/test installs them (ensure_verifiers)"
                );
                let mut c = Command::new("node");
                c.arg(guides.join("node/receiver.mjs"));
                c
            }
            "go" => {
                // Built first, so the receiver's start is not a compile.
                let binary = std::env::temp_dir().join(format!("relay-go-receiver-{}", std::process::id()));
                let built = Command::new("go")
                    .args(["build", "-o"])
                    .arg(&binary)
                    .arg(guides.join("go/main.go"))
                    .output()
                    .context("running go build (deploy/local/test installs Go: ensure_verifiers)")?;
                ensure!(built.status.success(), "go build failed: {}", String::from_utf8_lossy(&built.stderr));
                Command::new(binary)
            }
            "rust" => {
                // Beside this test binary's profile directory (deps/..), wherever
                // the target directory is.
                let profile = std::env::current_exe()?.parent().and_then(|deps| deps.parent()).context("the profile directory")?.to_owned();
                let binary = profile.join("examples/receiver");
                ensure!(binary.exists(), "{} is not built: deploy/local/test builds the examples", binary.display());
                Command::new(binary)
            }
            other => anyhow::bail!("no guide {other}"),
        };
        let mut child = command
            .env("RELAY_SECRET", secret)
            .env("PORT", port.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting the {name} guide"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().context("stdout")?;
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Ok(Self { child, lines })
    }

    fn count(&self, line: &str) -> usize {
        self.lines.lock().unwrap().iter().filter(|l| l.as_str() == line).count()
    }

    fn said(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    async fn wait_for(&self, line: &str) -> Result<()> {
        eventually(Duration::from_secs(20), || async { (self.count(line) > 0).then_some(()) })
            .await
            .with_context(|| format!("the guide never said {line:?}; it said:\n{}", self.said()))
    }
}

impl Drop for Guide {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Posts a request signed the relay-v1 way with `secret`, as Relay would.
async fn post_signed(port: u16, secret: &str, id: &str, body: &str) -> Result<u16> {
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs().to_string();
    let headers = signed_headers(Scheme::RelayV1, &[SigningSecret::new(secret)], id, &ts, body.as_bytes())?;
    let mut req = reqwest::Client::new().post(format!("http://127.0.0.1:{port}/")).body(body.to_owned());
    for (name, value) in headers {
        req = req.header(name, value);
    }
    Ok(req.send().await?.status().as_u16())
}

async fn run_guide(rest: &Rest, name: &str) -> Result<()> {
    let port = free_port()?;
    let (status, created) = rest.post("/v1/webhooks", json!({"url": format!("http://127.0.0.1:{port}/"), "event_types": [name]})).await?;
    ensure!(status == 201, "{created}");
    let id = created["endpoint"]["id"].as_str().unwrap().to_owned();
    let secret = created["secret"].as_str().unwrap().to_owned();
    let guide = Guide::start(name, port, &secret)?;
    guide.wait_for(&format!("listening on {port}")).await?;

    let first = rest.publish(name, json!({"scheme": "relay-v1"})).await?;
    guide.wait_for(&format!("processed {first} {name}")).await?;
    let (status, body) =
        rest.call(Method::PATCH, &format!("/v1/webhooks/{id}"), Some(json!({"signature_scheme": "standard-webhooks"}))).await?;
    ensure!(status == 200, "{body}");
    let second = rest.publish(name, json!({"scheme": "standard-webhooks"})).await?;
    guide.wait_for(&format!("processed {second} {name}")).await?;

    // The same event again (Relay sends at least once): answered, not processed.
    let envelope = json!({"id": first, "type": name}).to_string();
    assert_eq!(post_signed(port, &secret, &first, &envelope).await?, 204, "{name}");
    guide.wait_for(&format!("duplicate {first}")).await?;
    // Another secret's signature is refused.
    let status = post_signed(port, "whsec_c29tZW9uZSBlbHNlJ3Mgc2VjcmV0IGtleSBieXRlcw==", "evt_forged", &envelope).await?;
    assert_eq!(status, 401, "{name}: {}", guide.said());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(guide.count(&format!("processed {first} {name}")), 1, "{name}: {}", guide.said());
    assert!(!guide.said().contains("evt_forged"), "{name}: {}", guide.said());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_node_rust_and_go_receiver_guides_verify_deduplicate_and_refuse() -> Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("guides").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for name in ["python", "node", "rust", "go"] {
        run_guide(&rest, name).await.with_context(|| format!("the {name} guide"))?;
    }
    stack.stop().await
}
