//! OAuth2 client credentials towards receivers (RFC 6749 §4.4): a token per
//! set of credentials, fetched from the endpoint's token URL and kept until
//! shortly before it expires, shared by every lane of this process.
//!
//! Invariants:
//! - one fetch at a time per set of credentials: lanes that need the same
//!   token wait for the one fetch rather than each asking;
//! - a token is never logged.
//!
//! The fetch itself is the attempt's (`attempt::fetch_token`): the token URL
//! checked like an endpoint URL and reached through the guarded client.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use relay_contracts::relay::dispatch::v1::OAuth2ClientCredentials;
use sha2::{Digest, Sha256};

/// How long before its expiry a token is fetched anew, at most (a fifth of
/// its life for short-lived ones).
const RENEW_BEFORE: Duration = Duration::from_secs(30);
/// Sets of credentials kept at once; past this the cache starts over.
const KEPT: usize = 4096;

struct Token {
    access: String,
    renew_at: Instant,
}

/// A token as its endpoint gave it: the access token and how long it lives
/// (`None`: it did not say).
pub struct Fetched {
    pub access: String,
    pub lifetime: Option<Duration>,
}

/// How long a token that says nothing of its expiry is kept.
const UNSAID_LIFETIME: Duration = Duration::from_secs(60);

type Slot = Arc<tokio::sync::Mutex<Option<Token>>>;

/// Tokens by the digest of the credentials that fetched them.
#[derive(Default)]
pub struct Tokens {
    slots: Mutex<HashMap<[u8; 32], Slot>>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").field("kept", &self.slots.lock().map(|s| s.len()).unwrap_or(0)).finish()
    }
}

fn key(c: &OAuth2ClientCredentials) -> [u8; 32] {
    let mut d = Sha256::new();
    for part in [&c.token_url, &c.client_id, &c.client_secret, &c.scope, &c.audience] {
        d.update((part.len() as u64).to_be_bytes());
        d.update(part.as_bytes());
    }
    d.finalize().into()
}

impl Tokens {
    /// A bearer token for these credentials: the kept one unless `renew`
    /// (the receiver refused it) or it is about to expire, else one `fetch`
    /// gets (only one at a time per set of credentials).
    pub async fn bearer<F>(&self, c: &OAuth2ClientCredentials, renew: bool, fetch: F) -> Result<String, String>
    where
        F: AsyncFnOnce() -> Result<Fetched, String>,
    {
        let slot = {
            let mut slots = self.slots.lock().expect("not poisoned");
            if slots.len() >= KEPT {
                slots.clear();
            }
            slots.entry(key(c)).or_default().clone()
        };
        let mut held = slot.lock().await;
        if !renew && let Some(t) = held.as_ref().filter(|t| Instant::now() < t.renew_at) {
            return Ok(t.access.clone());
        }
        let started = Instant::now();
        let Fetched { access, lifetime } = fetch().await?;
        let lifetime = lifetime.unwrap_or(UNSAID_LIFETIME);
        let renew_at = started + lifetime.saturating_sub(RENEW_BEFORE.min(lifetime / 5));
        *held = Some(Token { access: access.clone(), renew_at });
        Ok(access)
    }
}
