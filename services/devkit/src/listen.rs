//! `relay-dev listen`: webhooks on a laptop. Opens a listener over a call
//! to the api (tenant gRPC, the API key's environment), prints its endpoint
//! id and signing secret, and forwards each delivery to a local URL exactly
//! as a webhook (the same body and signature headers), printing a line per
//! delivery and reporting the local answer back as the attempt's outcome.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use relay_contracts::relay::tenant::v1::{
    ListenForward, ListenRequest, ListenResult, ListenStart, listen_request, listen_response, listen_service_client::ListenServiceClient,
};
use tokio::sync::mpsc;
use tonic::{metadata::MetadataValue, transport::Channel};

/// How long the local receiver has to answer.
const LOCAL_TIMEOUT: Duration = Duration::from_secs(30);
/// The most of a local answer's body reported.
const KEPT_BODY: usize = 4096;

pub struct Args {
    pub api_key: String,
    pub api: String,
    pub events: Vec<String>,
    pub forward_to: String,
}

pub async fn listen(args: Args) -> Result<()> {
    // reqwest and tonic share rustls; this build brings ring as its provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let forward_to = reqwest::Url::parse(&args.forward_to).with_context(|| format!("--forward-to {:?} is not a URL", args.forward_to))?;
    if !matches!(forward_to.scheme(), "http" | "https") {
        bail!("--forward-to must be an http:// or https:// URL, got {forward_to}");
    }
    let channel = Channel::from_shared(args.api.clone())
        .with_context(|| format!("--api {:?} is not a URL", args.api))?
        .connect()
        .await
        .with_context(|| format!("connecting to the api at {}", args.api))?;
    let bearer: MetadataValue<_> = format!("Bearer {}", args.api_key).parse().context("the API key is not sendable as a header")?;
    let mut client = ListenServiceClient::new(channel);
    let (out, outbound) = mpsc::channel::<ListenRequest>(64);
    out.send(ListenRequest { kind: Some(listen_request::Kind::Start(ListenStart { event_types: args.events.clone() })) }).await?;
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(outbound));
    request.metadata_mut().insert("authorization", bearer);
    let mut inbound = match client.listen(request).await {
        Ok(r) => r.into_inner(),
        Err(st) => bail!("the api refused the listener: {}", st.message()),
    };
    let http = reqwest::Client::builder().timeout(LOCAL_TIMEOUT).build()?;
    loop {
        let message = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => bail!("the api ended the listener"),
            Err(st) => bail!("the listener ended: {}", st.message()),
        };
        match message.kind {
            Some(listen_response::Kind::Ready(ready)) => {
                println!("endpoint_id={}", ready.endpoint_id);
                println!("signing_secret={}", ready.secret);
                println!(
                    "relay-dev listen: receiving {} as endpoint {} ({}), forwarding to {forward_to}; Ctrl-C stops",
                    args.events.join(", "),
                    ready.endpoint_id,
                    ready.signature_scheme
                );
            }
            Some(listen_response::Kind::Forward(forward)) => {
                let (http, url, out) = (http.clone(), forward_to.clone(), out.clone());
                tokio::spawn(async move {
                    let result = forward_one(&http, url, forward).await;
                    let _ = out.send(ListenRequest { kind: Some(listen_request::Kind::Result(result)) }).await;
                });
            }
            None => {}
        }
    }
}

/// Sends one delivery on to the local receiver, prints its line, and says
/// what came back.
async fn forward_one(http: &reqwest::Client, url: reqwest::Url, f: ListenForward) -> ListenResult {
    let event_type = serde_json::from_slice::<serde_json::Value>(&f.body)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_default();
    let mut request = http.post(url);
    for h in &f.headers {
        request = request.header(&h.name, &h.value);
    }
    let started = Instant::now();
    let sent = request.body(f.body).send().await;
    let ms = started.elapsed().as_millis();
    let now = chrono::Utc::now().format("%H:%M:%S");
    let mut result = ListenResult { forward_id: f.forward_id, ..Default::default() };
    match sent {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let mut body = resp.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
            body.truncate(KEPT_BODY);
            println!("{now}  {event_type:<24} {}  attempt {}  -> {status} in {ms} ms", f.event_id, f.attempt);
            result.http_status = Some(u32::from(status));
            result.response_body = body;
        }
        Err(e) => {
            let why = if e.is_timeout() {
                format!("the local receiver did not answer within {} s", LOCAL_TIMEOUT.as_secs())
            } else if e.is_connect() {
                "the local receiver refused the connection (is it running?)".to_owned()
            } else {
                format!("forwarding failed: {e}")
            };
            println!("{now}  {event_type:<24} {}  attempt {}  -> {why}", f.event_id, f.attempt);
            result.error = why;
        }
    }
    result
}
