//! The benchmark's tenants, made as an operator and a tenant make them: an
//! environment and its API key through the AdminService, endpoints through
//! the REST facade.

use anyhow::{Context, Result};
use relay_contracts::relay::admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest, admin_service_client::AdminServiceClient};
use tonic::transport::Channel;

/// A new environment and an API key for it: (environment id, key).
pub(crate) async fn environment_with_key(
    admin: &mut AdminServiceClient<Channel>,
    name: String,
    endpoint_quota: u32,
) -> Result<(String, String)> {
    let environment = admin
        .create_environment(CreateEnvironmentRequest { name, endpoint_quota })
        .await?
        .into_inner()
        .environment
        .context("no environment")?;
    let key =
        admin.create_api_key(CreateApiKeyRequest { environment_id: environment.id.clone(), name: "bench".into() }).await?.into_inner().key;
    Ok((environment.id, key))
}

/// Registers an endpoint at `url` for the bench's event type, through the REST facade.
pub(crate) async fn register_endpoint(
    http: &reqwest::Client,
    rest_url: &str,
    key: &str,
    url: String,
    filter: Option<serde_json::Value>,
    ordering: Option<&str>,
) -> Result<()> {
    let mut body = serde_json::json!({"url": url, "event_types": ["bench.event"], "ordering": ordering.unwrap_or("none")});
    if let Some(f) = filter {
        body["filter"] = f;
    }
    let resp = http.post(format!("{rest_url}/v1/webhooks")).bearer_auth(key).json(&body).send().await?;
    anyhow::ensure!(resp.status().as_u16() == 201, "creating an endpoint at {url}: {} {}", resp.status(), resp.text().await?);
    Ok(())
}
