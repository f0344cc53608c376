//! A tenant's REST client, and a reflection client as grpcurl uses it.

use super::*;

/// A REST client for one tenant.
pub struct Rest {
    pub base: String,
    pub key: Option<String>,
    pub http: reqwest::Client,
}

impl Rest {
    pub async fn get(&self, path: &str) -> Result<serde_json::Value> {
        let (status, body) = self.call(reqwest::Method::GET, path, None).await?;
        anyhow::ensure!(status == 200, "GET {path} answered {status}: {body}");
        Ok(body)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> Result<(u16, serde_json::Value)> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// Registers an endpoint; returns (id, secret).
    pub async fn endpoint(&self, url: &str, types: &[&str]) -> Result<(String, String)> {
        let (status, body) = self.post("/v1/webhooks", serde_json::json!({"url": url, "event_types": types})).await?;
        anyhow::ensure!(status == 201, "creating an endpoint answered {status}: {body}");
        Ok((body["endpoint"]["id"].as_str().context("id")?.to_owned(), body["secret"].as_str().context("secret")?.to_owned()))
    }

    /// Publishes an event; returns its id.
    pub async fn publish(&self, event_type: &str, payload: serde_json::Value) -> Result<String> {
        let (status, body) = self.post("/v1/events", serde_json::json!({"type": event_type, "payload": payload})).await?;
        anyhow::ensure!(status == 202, "publishing answered {status}: {body}");
        Ok(body["event_id"].as_str().context("event_id")?.to_owned())
    }

    /// The deliveries of one event.
    pub async fn deliveries(&self, event_id: &str) -> Result<Vec<serde_json::Value>> {
        Ok(self.get(&format!("/v1/events/{event_id}/deliveries")).await?["deliveries"].as_array().cloned().unwrap_or_default())
    }

    pub fn new(base: &str, key: Option<&str>) -> Self {
        Self { base: base.to_owned(), key: key.map(str::to_owned), http: reqwest::Client::new() }
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<serde_json::Value>) -> Result<(u16, serde_json::Value)> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        self.send(req).await
    }

    /// A call with a body sent exactly as given (serde_json would re-print
    /// numbers and keys).
    pub async fn raw(&self, method: reqwest::Method, path: &str, body: String) -> Result<(u16, serde_json::Value)> {
        let req = self.http.request(method, format!("{}{path}", self.base)).header("content-type", "application/json").body(body);
        self.send(req).await
    }

    async fn send(&self, mut req: reqwest::RequestBuilder) -> Result<(u16, serde_json::Value)> {
        if let Some(k) = &self.key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let json = if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?
        };
        Ok((status, json))
    }
}

/// A reflection client, as grpcurl uses it.
pub mod reflection {
    use anyhow::{Context, Result, bail};
    use tonic::transport::Channel;

    /// Lists services through server reflection (v1, or v1alpha as grpcurl 1.8 speaks).
    pub async fn list_services(channel: Channel, v1alpha: bool) -> Result<Vec<String>> {
        if v1alpha {
            use tonic_reflection::pb::v1alpha::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
                server_reflection_response::MessageResponse,
            };
            let mut c = ServerReflectionClient::new(channel);
            let req = ServerReflectionRequest { host: String::new(), message_request: Some(MessageRequest::ListServices(String::new())) };
            let mut stream = c.server_reflection_info(tokio_stream::iter([req])).await?.into_inner();
            let resp = stream.message().await?.context("no reflection response")?;
            match resp.message_response {
                Some(MessageResponse::ListServicesResponse(l)) => Ok(l.service.into_iter().map(|s| s.name).collect()),
                other => bail!("unexpected reflection response {other:?}"),
            }
        } else {
            use tonic_reflection::pb::v1::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
                server_reflection_response::MessageResponse,
            };
            let mut c = ServerReflectionClient::new(channel);
            let req = ServerReflectionRequest { host: String::new(), message_request: Some(MessageRequest::ListServices(String::new())) };
            let mut stream = c.server_reflection_info(tokio_stream::iter([req])).await?.into_inner();
            let resp = stream.message().await?.context("no reflection response")?;
            match resp.message_response {
                Some(MessageResponse::ListServicesResponse(l)) => Ok(l.service.into_iter().map(|s| s.name).collect()),
                other => bail!("unexpected reflection response {other:?}"),
            }
        }
    }
}
