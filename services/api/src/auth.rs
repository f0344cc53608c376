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

/// Resolves the tenant from `authorization: Bearer <api key>`. The messages
/// say what was expected and never quote what was presented.
pub async fn tenant<T>(app: &App, req: &Request<T>) -> Result<Tenant, Status> {
    let Some(value) = req.metadata().get("authorization") else {
        return Err(Status::unauthenticated("an API key is required: send it as `Authorization: Bearer <key>`"));
    };
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix(BEARER))
        .map(str::trim)
        .ok_or_else(|| Status::unauthenticated("the Authorization header must be `Bearer <API key>`"))?;
    match app.authenticate_api_key(presented).await.map_err(status)? {
        Some(environment_id) => Ok(Tenant { environment_id }),
        None => Err(Status::unauthenticated(
            "the API key presented is not valid (unknown or revoked); send a live key as `Authorization: Bearer <key>`",
        )),
    }
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
    st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, "wrong_credential_type".parse().expect("ascii"));
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
            st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, "wrong_credential_type".parse().expect("ascii"));
            Err(st)
        }
    }
}
