//! The portal's sessions: a one-time link minted by the tenant's backend,
//! exchanged (once, within minutes) for a session of one environment.
//! Tokens are 32 random bytes; only their SHA-256 is stored.

use std::time::Duration;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use relay_domain::EnvironmentId;
use sha2::{Digest, Sha256};

use super::{App, Tenant, Timestamp};
use crate::{db, error::AppResult};

/// How long a minted link works if unused.
pub const LINK_TTL: Duration = Duration::from_secs(10 * 60);
/// How long a session lasts from the link's use; then the customer asks
/// the tenant for a new link.
pub const SESSION_TTL: Duration = Duration::from_secs(60 * 60);

/// Where the portal is reached and how its cookie is set.
#[derive(Debug, Clone)]
pub struct PortalSettings {
    /// The REST port's address as customers reach it (`RELAY_PUBLIC_URL`),
    /// which links are built on; never taken from a request's Host header.
    pub public_url: String,
    /// Mark the session cookie `Secure` (everywhere but the dev stack).
    pub secure_cookie: bool,
}

/// A minted link. Its `Debug` hides the token.
pub struct PortalLink {
    pub url: String,
    pub expires_at: Timestamp,
}

impl std::fmt::Debug for PortalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortalLink").field("url", &"[redacted]").field("expires_at", &self.expires_at).finish()
    }
}

/// A session just begun: the cookie's value and when it ends.
pub struct StartedSession {
    pub token: String,
    pub expires_at: Timestamp,
}

impl std::fmt::Debug for StartedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartedSession").field("token", &"[redacted]").field("expires_at", &self.expires_at).finish()
    }
}

/// A live session, as a request presents it.
#[derive(Clone)]
pub struct PortalSession {
    pub tenant: Tenant,
    /// What every state-changing form must carry.
    pub csrf_token: String,
}

impl std::fmt::Debug for PortalSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortalSession").field("environment_id", &self.tenant.environment_id).finish_non_exhaustive()
    }
}

fn token() -> String {
    URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>())
}

fn hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// The shape every token has; anything else is not looked up.
fn well_formed(token: &str) -> bool {
    token.len() == 43 && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl App {
    /// A one-time link into the portal for the tenant's environment.
    pub async fn create_portal_link(&self, tenant: Tenant) -> AppResult<PortalLink> {
        let token = token();
        let expires_at = db::portal::create_link(&self.db, &hash(&token), tenant.environment_id, LINK_TTL).await?;
        let base = self.portal.public_url.trim_end_matches('/');
        Ok(PortalLink { url: format!("{base}/portal/enter?token={token}"), expires_at })
    }

    /// Uses a link: a new session for its environment, or `None` when the
    /// link is unknown, already used or expired (not told apart).
    pub async fn enter_portal(&self, link_token: &str) -> AppResult<Option<StartedSession>> {
        if !well_formed(link_token) {
            return Ok(None);
        }
        let session = token();
        let started = db::portal::exchange(&self.db, &hash(link_token), &hash(&session), &token(), SESSION_TTL).await?;
        Ok(started.map(|(_, expires_at)| StartedSession { token: session, expires_at }))
    }

    /// The session a cookie names, while it lasts.
    pub async fn portal_session(&self, session_token: &str) -> AppResult<Option<PortalSession>> {
        if !well_formed(session_token) {
            return Ok(None);
        }
        Ok(db::portal::session(&self.db, &hash(session_token))
            .await?
            .map(|(environment_id, csrf_token): (EnvironmentId, String)| PortalSession { tenant: Tenant { environment_id }, csrf_token }))
    }

    pub async fn leave_portal(&self, session_token: &str) -> AppResult<()> {
        if well_formed(session_token) {
            db::portal::end_session(&self.db, &hash(session_token)).await?;
        }
        Ok(())
    }

    pub async fn prune_portal(&self) -> AppResult<u64> {
        db::portal::prune(&self.db).await
    }
}
