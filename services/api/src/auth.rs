//! Who is calling. Tenants present an API key as a bearer token; platform
//! services present a client certificate on the internal mTLS port, whose
//! URI SAN names their identity.

use relay_contracts::identity;
use tonic::{Request, Status};
use x509_parser::{extensions::GeneralName, prelude::FromDer};

use crate::{
    app::{App, Tenant},
    grpc::status,
};

const BEARER: &str = "Bearer ";

/// A tenant the caller already authenticated, carried in the request's
/// extensions: set by the REST facade (which checks the key before reading a
/// body) and by [`TenantAuthLayer`] on the gRPC port. Extensions cannot
/// arrive over the wire, so only the api itself can set one.
#[derive(Debug, Clone, Copy)]
pub struct Authenticated(pub Tenant);

/// The tenant of a call: the one verified before the call was decoded, or
/// (for a call that did not pass through such a check) from its API key.
pub async fn tenant<T>(app: &App, req: &Request<T>) -> Result<Tenant, Status> {
    if let Some(Authenticated(t)) = req.extensions().get::<Authenticated>() {
        return Ok(*t);
    }
    let value = req.metadata().get("authorization").map(|v| v.as_bytes());
    tenant_from_credential(app, value).await
}

/// Resolves the tenant from an `Authorization` header value. The messages
/// say what was expected and never quote what was presented.
pub async fn tenant_from_header(app: &App, value: Option<&http::HeaderValue>) -> Result<Tenant, Status> {
    tenant_from_credential(app, value.map(|v| v.as_bytes())).await
}

/// The API key an `Authorization` header value presents.
fn presented_key(value: Option<&[u8]>) -> Result<&str, Status> {
    let Some(value) = value else {
        return Err(Status::unauthenticated("an API key is required: send it as `Authorization: Bearer <key>`"));
    };
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.strip_prefix(BEARER))
        .map(str::trim)
        .ok_or_else(|| Status::unauthenticated("the Authorization header must be `Bearer <API key>`"))
}

/// The lookup prefix of the API key a call presents (unique per key): who
/// the caller is among its environment's keys. Call after [`tenant`].
pub fn key_prefix<T>(req: &Request<T>) -> Result<String, Status> {
    let presented = presented_key(req.metadata().get("authorization").map(|v| v.as_bytes()))?;
    crate::apikeys::lookup_prefix(presented)
        .map(str::to_owned)
        .ok_or_else(|| Status::unauthenticated("the API key presented is not valid; send a live key as `Authorization: Bearer <key>`"))
}

async fn tenant_from_credential(app: &App, value: Option<&[u8]>) -> Result<Tenant, Status> {
    let presented = presented_key(value)?;
    match app.authenticate_api_key(presented).await.map_err(status)? {
        Some(environment_id) => Ok(Tenant { environment_id }),
        None => Err(Status::unauthenticated(
            "the API key presented is not valid (unknown or revoked); send a live key as `Authorization: Bearer <key>`",
        )),
    }
}

/// Authenticates tenant calls on the gRPC port before their message is
/// decoded, and keeps the messages the api holds at once within a budget,
/// so an anonymous or oversized call costs a header check, not a buffer.
#[derive(Debug, Clone)]
pub struct TenantAuthLayer {
    pub app: App,
    /// Calls being decoded or served at once; a call that finds none free
    /// within a moment is answered UNAVAILABLE (`overloaded`).
    pub admission: std::sync::Arc<tokio::sync::Semaphore>,
}

impl<S> tower::Layer<S> for TenantAuthLayer {
    type Service = TenantAuth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TenantAuth { inner, app: self.app.clone(), admission: self.admission.clone() }
    }
}

#[derive(Debug, Clone)]
pub struct TenantAuth<S> {
    inner: S,
    app: App,
    admission: std::sync::Arc<tokio::sync::Semaphore>,
}

/// How long a call waits for admission before it is refused.
const ADMISSION_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// The prefix of every tenant method's path; health and reflection pass freely.
const TENANT_PATHS: &str = "/relay.tenant.";

impl<S, B> tower::Service<http::Request<B>> for TenantAuth<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // The clone that was made ready serves this call; a fresh clone
        // waits for the next (tower's clone-and-swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (app, admission) = (self.app.clone(), self.admission.clone());
        Box::pin(async move {
            if !req.uri().path().starts_with(TENANT_PATHS) {
                return inner.call(req).await;
            }
            let tenant = tenant_from_credential(&app, req.headers().get(http::header::AUTHORIZATION).map(|v| v.as_bytes())).await;
            let tenant = match tenant {
                Ok(t) => t,
                Err(st) => return Ok(st.into_http()),
            };
            let Ok(Ok(_permit)) = tokio::time::timeout(ADMISSION_WAIT, admission.acquire_owned()).await else {
                let mut st = Status::unavailable("the api is at capacity; retry after 1 s");
                st.metadata_mut()
                    .insert(relay_contracts::ERROR_REASON_METADATA, relay_domain::Reason::Overloaded.as_str().parse().expect("ascii"));
                st.metadata_mut().insert("retry-after", "1".parse().expect("ascii"));
                return Ok(st.into_http());
            };
            req.extensions_mut().insert(Authenticated(tenant));
            let resp = inner.call(req).await?;
            Ok(undecodable_as_invalid_argument(resp))
        })
    }
}

/// tonic answers a message it cannot decode with INTERNAL and the decoder's
/// own words; to a caller that is their mistake, so it is INVALID_ARGUMENT
/// with a message that names it and nothing of the decoder's internals.
fn undecodable_as_invalid_argument(resp: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    let Some(st) = Status::from_header_map(resp.headers()) else { return resp };
    if st.code() != tonic::Code::Internal || !st.message().starts_with("failed to decode Protobuf message") {
        return resp;
    }
    let mut st = Status::invalid_argument("the request is not a valid protobuf message of the method's request type");
    st.metadata_mut()
        .insert(relay_contracts::ERROR_REASON_METADATA, relay_domain::Reason::UndecodableMessage.as_str().parse().expect("ascii"));
    st.into_http()
}

/// The platform identities a peer certificate carries (its URI SANs).
pub fn peer_identities<T>(req: &Request<T>) -> Vec<String> {
    let Some(certs) = req.peer_certs() else { return Vec::new() };
    let Some(leaf) = certs.first() else { return Vec::new() };
    let Ok((_, cert)) = x509_parser::certificate::X509Certificate::from_der(leaf.as_ref()) else { return Vec::new() };
    let Ok(Some(san)) = cert.subject_alternative_name() else { return Vec::new() };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            _ => None,
        })
        .collect()
}

/// Tenant routes take an API key. On the internal port every caller carries
/// a platform identity, which reaches every environment and so may never act
/// as a tenant: such a call is refused with 403 `wrong_credential_type`.
pub fn refuse_platform_identity(req: Request<()>) -> Result<Request<()>, Status> {
    let ids = peer_identities(&req);
    let mut st = Status::permission_denied(format!(
        "this is a tenant route: it takes an API key (`Authorization: Bearer <key>`) on the public port, not a platform identity{}",
        if ids.is_empty() { String::new() } else { format!(" ({})", ids.join(", ")) }
    ));
    st.metadata_mut()
        .insert(relay_contracts::ERROR_REASON_METADATA, relay_domain::Reason::WrongCredentialType.as_str().parse().expect("ascii"));
    Err(st)
}

/// Which platform identity a service on the internal port accepts.
#[derive(Debug, Clone, Copy)]
pub enum Requires {
    Dispatcher,
    Operator,
}

impl Requires {
    fn accepts(self, id: &str) -> bool {
        match self {
            Self::Dispatcher => id == identity::DISPATCHER,
            Self::Operator => id.strip_prefix(identity::OPERATOR_PREFIX).is_some_and(|name| !name.is_empty()),
        }
    }

    /// A tonic interceptor that refuses any caller without this identity.
    pub fn interceptor(self) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
        move |req: Request<()>| {
            let ids = peer_identities(&req);
            if ids.iter().any(|id| self.accepts(id)) {
                return Ok(req);
            }
            let mut st = if ids.is_empty() {
                Status::unauthenticated("this service requires a platform client certificate")
            } else {
                Status::permission_denied(format!("this service requires the {self:?} platform identity"))
            };
            st.metadata_mut()
                .insert(relay_contracts::ERROR_REASON_METADATA, relay_domain::Reason::WrongCredentialType.as_str().parse().expect("ascii"));
            Err(st)
        }
    }
}
