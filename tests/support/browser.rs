//! Headless Chromium over WebDriver for the portal, and a portal session
//! over plain HTTP.

use super::*;

/// Headless Chromium (Debian's `chromium`) driven over WebDriver by its
/// `chromedriver`, started on a free loopback port for one test.
pub struct Browser {
    pub client: fantoccini::Client,
    driver: tokio::process::Child,
    shots: PathBuf,
}

impl Browser {
    pub async fn start() -> Result<Self> {
        let driver_bin = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .context("chromedriver is not installed: deploy/local/test installs Debian's chromium and chromium-driver")?;
        let port = free_addr().await?.port();
        let driver = tokio::process::Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting chromedriver")?;
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                         "--window-size=1280,1000", "--no-first-run", "--disable-extensions"],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match fantoccini::ClientBuilder::new(connector).capabilities(caps.clone()).connect(&url).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "chromedriver not ready yet");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(anyhow::anyhow!("starting a Chromium session through chromedriver: {e}")),
            }
        };
        let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/portal-screenshots");
        std::fs::create_dir_all(&shots)?;
        Ok(Self { client, driver, shots })
    }

    /// Saves the page as `target/portal-screenshots/<name>.png` (a test
    /// artifact), and as `docs/portal/<name>.png` too when
    /// `RELAY_PORTAL_SCREENSHOTS=docs` (refreshing the pictures docs/portal.md shows).
    pub async fn screenshot(&self, name: &str) -> Result<()> {
        let png = self.client.screenshot().await.map_err(|e| anyhow::anyhow!("screenshot {name}: {e}"))?;
        std::fs::write(self.shots.join(format!("{name}.png")), &png)?;
        if std::env::var("RELAY_PORTAL_SCREENSHOTS").as_deref() == Ok("docs") {
            let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/portal");
            std::fs::create_dir_all(&docs)?;
            std::fs::write(docs.join(format!("{name}.png")), &png)?;
        }
        Ok(())
    }

    pub async fn close(mut self) -> Result<()> {
        let closed = self.client.close().await.map_err(|e| anyhow::anyhow!("closing the browser: {e}"));
        let _ = self.driver.kill().await;
        closed
    }
}

/// A portal session over plain HTTP: a link minted with the tenant's key,
/// opened, its cookie and CSRF token kept and sent by hand.
pub struct PortalVisitor {
    pub base: String,
    pub http: reqwest::Client,
    pub cookie: String,
    pub csrf: String,
}

impl PortalVisitor {
    pub async fn enter(base: &str, api_key: &str) -> Result<Self> {
        let (status, body) = Rest::new(base, Some(api_key)).post("/v1/portal-sessions", serde_json::json!({})).await?;
        anyhow::ensure!(status == 201, "minting a portal link answered {status}: {body}");
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
        let resp = http.get(body["url"].as_str().context("a url")?).send().await?;
        anyhow::ensure!(resp.status() == 200, "opening the link answered {}", resp.status());
        let set = resp.headers().get(reqwest::header::SET_COOKIE).and_then(|v| v.to_str().ok()).unwrap_or_default();
        let cookie = set.split(';').next().and_then(|kv| kv.strip_prefix("relay_portal=")).context("a session cookie")?.to_owned();
        let mut me = Self { base: base.to_owned(), http, cookie, csrf: String::new() };
        let (status, page) = me.get("/portal/").await?;
        anyhow::ensure!(status == 200, "the portal answered {status}");
        me.csrf = page.split("name=\"csrf\" value=\"").nth(1).and_then(|r| r.split('"').next()).context("a CSRF field")?.to_owned();
        Ok(me)
    }

    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        let (status, _, body) = self.open(path).await?;
        Ok((status, body))
    }

    /// A GET without following a redirect: the status, its target and the body.
    pub async fn open(&self, path: &str) -> Result<(u16, Option<String>, String)> {
        self.send(self.http.get(format!("{}{path}", self.base))).await
    }

    /// Posts a form as given (add `("csrf", &visitor.csrf)` for a real one);
    /// the status, the redirect's target and the body.
    pub async fn post(&self, path: &str, form: &[(&str, &str)]) -> Result<(u16, Option<String>, String)> {
        self.send(self.http.post(format!("{}{path}", self.base)).form(form)).await
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(u16, Option<String>, String)> {
        let resp = req.header(reqwest::header::COOKIE, format!("relay_portal={}", self.cookie)).send().await?;
        let location = resp.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Ok((resp.status().as_u16(), location, resp.text().await?))
    }
}
