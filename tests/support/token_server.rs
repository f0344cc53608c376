//! An OAuth2 token server on loopback (RFC 6749 §4.4, client credentials):
//! checks HTTP Basic and the form, issues `tok-1`, `tok-2`… with the
//! lifetime it is told, records every request, and can be told to answer
//! garbage or an error. The tokens it issues go into `valid`, which a
//! receiver answering `Reply::Bearer(valid)` accepts.

use std::collections::HashSet;

use axum::{Router, http::HeaderMap, routing::post};

use super::*;

/// How the token endpoint answers.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenMode {
    /// A token living this many seconds.
    Issue(u64),
    /// 200 with a body that is not JSON.
    Garbage,
    /// This status, no token.
    Status(u16),
}

/// One token request as it arrived.
#[derive(Debug, Clone)]
pub struct TokenRequest {
    /// HTTP Basic, decoded: `client_id:client_secret` (still form-encoded).
    pub basic: String,
    pub form: Vec<(String, String)>,
}

#[derive(Clone)]
pub struct TokenServer {
    pub addr: SocketAddr,
    pub valid: Arc<Mutex<HashSet<String>>>,
    pub requests: Arc<Mutex<Vec<TokenRequest>>>,
    pub mode: Arc<Mutex<TokenMode>>,
}

impl TokenServer {
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = TokenServer {
            addr,
            valid: Default::default(),
            requests: Default::default(),
            mode: Arc::new(Mutex::new(TokenMode::Issue(3600))),
        };
        let s = server.clone();
        let app = Router::new().route(
            "/token",
            post(move |headers: HeaderMap, body: String| {
                let s = s.clone();
                async move {
                    use axum::response::IntoResponse;
                    use base64::Engine;
                    let basic = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok()?.strip_prefix("Basic "))
                        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default();
                    let form: Vec<(String, String)> = url::form_urlencoded::parse(body.as_bytes()).into_owned().collect();
                    let n = {
                        let mut r = s.requests.lock().expect("not poisoned");
                        r.push(TokenRequest { basic, form });
                        r.len()
                    };
                    let mode = s.mode.lock().expect("not poisoned").clone();
                    match mode {
                        TokenMode::Issue(secs) => {
                            let token = format!("tok-{n}");
                            s.valid.lock().expect("not poisoned").insert(token.clone());
                            axum::Json(serde_json::json!({"access_token": token, "token_type": "Bearer", "expires_in": secs}))
                                .into_response()
                        }
                        TokenMode::Garbage => (axum::http::StatusCode::OK, "<html>not a token</html>").into_response(),
                        TokenMode::Status(code) => {
                            (axum::http::StatusCode::from_u16(code).expect("valid status"), "token endpoint down").into_response()
                        }
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    pub fn requests(&self) -> Vec<TokenRequest> {
        self.requests.lock().expect("not poisoned").clone()
    }

    pub fn set_mode(&self, mode: TokenMode) {
        *self.mode.lock().expect("not poisoned") = mode;
    }

    /// The receiver stops accepting this token (revoked before its expiry).
    pub fn revoke(&self, token: &str) {
        self.valid.lock().expect("not poisoned").remove(token);
    }
}
