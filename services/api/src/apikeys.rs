//! Tenant API keys: `rk_<lookup prefix>_<secret>`. The key is shown once; the
//! database keeps the clear prefix (to find the row) and a salted SHA-256 of
//! the whole key. The secret part carries 256 bits, so a fast hash is enough:
//! there is nothing to brute-force.

use std::fmt;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use relay_domain::EnvironmentId;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

const PREFIX_LEN: usize = 12;

/// A full API key in clear, as shown once to the operator who issued it.
#[derive(Clone)]
pub struct ApiKeySecret(String);

impl fmt::Debug for ApiKeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKeySecret([redacted])")
    }
}

impl ApiKeySecret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

pub struct MintedKey {
    pub secret: ApiKeySecret,
    pub lookup_prefix: String,
    pub salt: Vec<u8>,
    pub hash: Vec<u8>,
}

pub fn mint() -> MintedKey {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let prefix: String = (0..PREFIX_LEN).map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char).collect();
    let secret = ApiKeySecret(format!("rk_{prefix}_{}", URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>())));
    let salt = rand::random::<[u8; 16]>().to_vec();
    let hash = digest(&salt, secret.expose());
    MintedKey { secret, lookup_prefix: prefix, salt, hash }
}

fn digest(salt: &[u8], key: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(key.as_bytes());
    h.finalize().to_vec()
}

/// The lookup prefix of something shaped like a key, or `None`.
pub fn lookup_prefix(presented: &str) -> Option<&str> {
    let rest = presented.strip_prefix("rk_")?;
    let (prefix, secret) = rest.split_once('_')?;
    (prefix.len() == PREFIX_LEN && !secret.is_empty()).then_some(prefix)
}

pub fn matches(presented: &str, salt: &[u8], stored_hash: &[u8]) -> bool {
    digest(salt, presented).ct_eq(stored_hash).into()
}

/// A live key as stored: what a presented key is checked against.
#[derive(Clone)]
pub struct LiveKey {
    pub environment_id: EnvironmentId,
    pub salt: Vec<u8>,
    pub key_hash: Vec<u8>,
}

impl fmt::Debug for LiveKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveKey").field("environment_id", &self.environment_id).finish_non_exhaustive()
    }
}

/// How long a key read from the database is taken as live without reading
/// it again: a client that publishes many events costs one lookup in this
/// long, not one per request. A revocation reaches other apis sooner when
/// they hear its notification; this bounds it when they do not.
pub const VERIFIED_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Keys read recently, by lookup prefix. Only live keys are kept, and
/// each request is still checked against the key's salted hash.
#[derive(Debug, Clone, Default)]
pub struct VerifiedKeys(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, (LiveKey, std::time::Instant)>>>);

/// Keys held at most; past that the oldest go first.
const MAX_VERIFIED: usize = 10_000;

impl VerifiedKeys {
    pub fn get(&self, prefix: &str) -> Option<LiveKey> {
        let map = self.0.lock().expect("unpoisoned");
        map.get(prefix).filter(|(_, at)| at.elapsed() < VERIFIED_FOR).map(|(k, _)| k.clone())
    }

    pub fn put(&self, prefix: &str, key: LiveKey) {
        let mut map = self.0.lock().expect("unpoisoned");
        if map.len() >= MAX_VERIFIED {
            map.retain(|_, (_, at)| at.elapsed() < VERIFIED_FOR);
        }
        if map.len() < MAX_VERIFIED {
            map.insert(prefix.to_owned(), (key, std::time::Instant::now()));
        }
    }

    /// Revoked: never taken from here again.
    pub fn forget(&self, prefix: &str) {
        self.0.lock().expect("unpoisoned").remove(prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_keys_verify_and_others_do_not() {
        let k = mint();
        assert_eq!(lookup_prefix(k.secret.expose()), Some(k.lookup_prefix.as_str()));
        assert!(matches(k.secret.expose(), &k.salt, &k.hash));
        let mut other = k.secret.expose().to_owned();
        other.push('x');
        assert!(!matches(&other, &k.salt, &k.hash));
        assert!(!format!("{:?}", k.secret).contains(k.secret.expose()));
        assert_eq!(lookup_prefix("Bearer nonsense"), None);
    }
}
