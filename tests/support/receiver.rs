//! HTTP receivers on loopback: every request recorded (with its sender's
//! address), answered as told per path.

use super::*;

/// One request a receiver got.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
    /// The sender's address: the torture tells its dispatchers apart by it.
    pub peer: SocketAddr,
    /// Over mutual TLS: the SHA-256 (hex) of the client certificate the
    /// sender presented, as reads show `fingerprint_sha256`.
    pub client_certificate: Option<String>,
}

/// The fingerprint of the client certificate a TLS connection presented,
/// handed from the handshake to the handler.
#[derive(Clone)]
struct PresentedCertificate(String);

impl Received {
    pub fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// How a receiver answers requests to one path.
#[derive(Debug, Clone)]
pub enum Reply {
    Status(u16),
    /// A status with one header (`Retry-After`, say).
    StatusWith(u16, &'static str, String),
    /// 302 with this `Location`.
    Redirect(String),
    /// A status with this body.
    Body(u16, String),
    /// Holds the request this long before answering 200 (past any attempt timeout).
    Hang(Duration),
    /// Fails sometimes, as `flaky` describes.
    Flaky(Arc<flaky::Flaky>),
    /// 200 to `Authorization: Bearer <t>` for a `t` in the set, else 401.
    Bearer(Arc<Mutex<std::collections::HashSet<String>>>),
}

/// An HTTP server on loopback that records every request and answers as
/// told per path (200 unless set otherwise).
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    pub got: Arc<Mutex<Vec<Received>>>,
    replies: Arc<Mutex<std::collections::HashMap<String, Reply>>>,
    concurrency: Concurrency,
    /// "http", or "https" for a receiver started with TLS.
    scheme: &'static str,
}

/// Requests being answered now and the most ever at once, by path.
type Concurrency = Arc<Mutex<std::collections::HashMap<String, (usize, usize)>>>;

/// One request being answered: counted from arrival until its answer is
/// ready (or the sender went away and its future was dropped).
struct Answering {
    table: Concurrency,
    path: String,
}

impl Answering {
    fn start(table: &Concurrency, path: &str) -> Self {
        let mut t = table.lock().expect("not poisoned");
        let (now, most) = t.entry(path.to_owned()).or_default();
        *now += 1;
        *most = (*most).max(*now);
        Self { table: table.clone(), path: path.to_owned() }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        if let Some((now, _)) = self.table.lock().expect("not poisoned").get_mut(&self.path) {
            *now -= 1;
        }
    }
}

impl Receiver {
    pub async fn start() -> Result<Self> {
        Self::start_with(None).await
    }

    /// A receiver over HTTPS with a certificate of the shared test PKI,
    /// which every test dispatcher trusts: for suites that should run over
    /// TLS as production does.
    pub async fn start_https() -> Result<Self> {
        Self::start_with(Some(shared_pki().server_config(false)?)).await
    }

    /// A receiver over HTTPS with this TLS (see `TestPki::server_config`):
    /// a request whose handshake fails is never recorded.
    pub async fn start_tls(tls: Arc<rustls::ServerConfig>) -> Result<Self> {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<Arc<rustls::ServerConfig>>) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let got: Arc<Mutex<Vec<Received>>> = Default::default();
        let replies: Arc<Mutex<std::collections::HashMap<String, Reply>>> = Default::default();
        let concurrency: Concurrency = Default::default();
        let (sink, table, counting) = (got.clone(), replies.clone(), concurrency.clone());
        let app = Router::new().fallback(
            move |peer: axum::extract::ConnectInfo<SocketAddr>,
                  presented: Option<axum::Extension<PresentedCertificate>>,
                  uri: axum::http::Uri,
                  headers: HeaderMap,
                  body: Bytes| {
                let (sink, table, counting) = (sink.clone(), table.clone(), counting.clone());
                async move {
                    let path = uri.path().to_owned();
                    let _answering = Answering::start(&counting, &path);
                    let (headers_seen, body_seen) = (headers.clone(), body.clone());
                    sink.lock().expect("not poisoned").push(Received {
                        path: path.clone(),
                        headers,
                        body,
                        at: Instant::now(),
                        peer: peer.0,
                        client_certificate: presented.map(|p| p.0.0),
                    });
                    let reply = table.lock().expect("not poisoned").get(&path).cloned().unwrap_or(Reply::Status(200));
                    use axum::response::IntoResponse;
                    match reply {
                        Reply::Status(code) => (axum::http::StatusCode::from_u16(code).expect("valid status"), "answer").into_response(),
                        Reply::StatusWith(code, name, value) => {
                            (axum::http::StatusCode::from_u16(code).expect("valid status"), [(name, value)], "answer").into_response()
                        }
                        Reply::Body(code, body) => (axum::http::StatusCode::from_u16(code).expect("valid status"), body).into_response(),
                        Reply::Redirect(to) => {
                            (axum::http::StatusCode::FOUND, [(axum::http::header::LOCATION, to)], "moved").into_response()
                        }
                        Reply::Hang(d) => {
                            tokio::time::sleep(d).await;
                            (axum::http::StatusCode::OK, "late").into_response()
                        }
                        Reply::Bearer(valid) => {
                            let token = headers_seen.get("authorization").and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "));
                            let ok = token.is_some_and(|t| valid.lock().expect("not poisoned").contains(t));
                            let status = if ok { axum::http::StatusCode::OK } else { axum::http::StatusCode::UNAUTHORIZED };
                            (status, "answer").into_response()
                        }
                        Reply::Flaky(f) => {
                            let answer = f.answer(&headers_seen, &body_seen, Instant::now());
                            tokio::time::sleep(answer.after).await;
                            let status = axum::http::StatusCode::from_u16(answer.status).expect("valid status");
                            match answer.retry_after {
                                Some(after) => (status, [("retry-after", after)], "answer").into_response(),
                                None => (status, "answer").into_response(),
                            }
                        }
                    }
                }
            },
        );
        let scheme = match tls {
            None => {
                tokio::spawn(async move { axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await });
                "http"
            }
            Some(tls) => {
                tokio::spawn(serve_tls(listener, tls, app));
                "https"
            }
        };
        Ok(Self { addr, got, replies, concurrency, scheme })
    }

    /// The most requests to `path` ever being answered at once.
    pub fn most_at_once(&self, path: &str) -> usize {
        self.concurrency.lock().expect("not poisoned").get(path).map_or(0, |&(_, most)| most)
    }

    /// Sets how requests to `path` are answered from now on.
    pub fn reply(&self, path: &str, reply: Reply) {
        self.replies.lock().expect("not poisoned").insert(path.to_owned(), reply);
    }

    /// The requests that arrived at `path`.
    pub fn at(&self, path: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.path == path).collect()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.got.lock().expect("not poisoned").clone()
    }

    /// Waits (bounded) until at least `n` requests arrived; returns them all.
    pub async fn wait_for(&self, n: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && self.received().len() < n {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.received()
    }

    /// Waits (bounded) for the first request carrying webhook `event`
    /// (its `relay-webhook-id`).
    pub async fn wait_for_event(&self, event: &str, within: Duration) -> Option<Received> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(r) = self.received().into_iter().find(|r| r.header("relay-webhook-id") == event) {
                return Some(r);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits (bounded) until at least `n` requests arrived at `path`.
    pub async fn wait_at(&self, path: &str, n: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && self.at(path).len() < n {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.at(path)
    }
}

/// Serves `app` over TLS: each connection's handshake, then HTTP/1.1 with
/// the peer's address where the handler reads it.
async fn serve_tls(listener: TcpListener, tls: Arc<rustls::ServerConfig>, app: Router) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let Ok((stream, peer)) = listener.accept().await else { continue };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            // A refused handshake (no client certificate, an unknown CA) ends here.
            let Ok(stream) = acceptor.accept(stream).await else { return };
            let presented = stream.get_ref().1.peer_certificates().and_then(|chain| chain.first()).map(|leaf| {
                use sha2::Digest;
                PresentedCertificate(hex::encode(sha2::Sha256::digest(leaf.as_ref())))
            });
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let mut req = req.map(axum::body::Body::new);
                req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                if let Some(presented) = presented.clone() {
                    req.extensions_mut().insert(presented);
                }
                tower::ServiceExt::oneshot(app.clone(), req)
            });
            let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}
