//! Tenant API keys: `rk_<lookup prefix>_<secret>`. The key is shown once; the
//! database keeps the clear prefix (to find the row) and a salted SHA-256 of
//! the whole key. The secret part carries 256 bits, so a fast hash is enough:
//! there is nothing to brute-force.

use std::fmt;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
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
