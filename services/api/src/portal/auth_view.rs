//! What the endpoint page shows of how Relay authenticates to the receiver:
//! the client certificate's subject and expiry and, during an overlap, the
//! previous one; the pinned CA; OAuth2 without its secret.

use relay_domain::models::OAuth2Shown;

use super::when;
use crate::app::endpoints::Endpoint;

/// The endpoint's receiver authentication as the page shows it.
#[derive(Default)]
pub struct ReceiverAuthView {
    /// The client certificate's subject and expiry, and the previous one
    /// while its overlap lasts; empty: none.
    pub client_certificate: String,
    pub previous_certificate: String,
    /// The pinned CA bundle (public PEM); empty: the platform's roots.
    pub ca_bundle: String,
    /// OAuth2 without its secret; `None`: none.
    pub oauth2: Option<OAuth2Shown>,
}

impl ReceiverAuthView {
    pub fn of(e: &Endpoint) -> Self {
        Self {
            client_certificate: e
                .client_certificate
                .as_ref()
                .map(|c| format!("{} (expires {})", c.subject, c.not_after))
                .unwrap_or_default(),
            previous_certificate: e
                .previous_client_certificate
                .as_ref()
                .and_then(|p| {
                    p.presented_until.map(|until| format!("{}, presented when the new one is refused until {}", p.subject, when(until)))
                })
                .unwrap_or_default(),
            ca_bundle: e.ca_bundle.clone().unwrap_or_default(),
            oauth2: e.oauth2.clone(),
        }
    }

    /// The one-line summary beside "Authentication".
    pub fn summary(&self) -> String {
        let mut parts = vec!["signature".to_owned()];
        if !self.client_certificate.is_empty() {
            parts.push(format!("client certificate {}", self.client_certificate));
        }
        if !self.ca_bundle.is_empty() {
            parts.push("pinned CA".into());
        }
        if let Some(o) = &self.oauth2 {
            parts.push(format!("OAuth2 client {} at {}", o.client_id, o.token_url));
        }
        parts.join(" · ")
    }
}
