//! Signing secrets at rest: AES-256-GCM, a fresh 96-bit nonce per encryption,
//! and the id of the key stored beside each ciphertext so keys can rotate.
//!
//! A signing secret is *used* (every delivery computes an HMAC with it), so it
//! cannot be hashed like an API key. The key lives in configuration, never in
//! the database beside what it protects.

use std::{collections::HashMap, fmt};

use aes_gcm::{
    Aes256Gcm, KeyInit, Nonce,
    aead::{Aead, AeadCore, OsRng},
};
use anyhow::{Context, Result, bail};
use base64::{Engine, engine::general_purpose::STANDARD};
use relay_signing::SigningSecret;

const NONCE_LEN: usize = 12;
const DEV_KEY_ID: &str = "dev";

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("stored secret names key {0:?}, which is not configured")]
    UnknownKey(String),
    #[error("stored secret failed authentication: tampered, truncated or under another key")]
    Tampered,
}

/// The configured keys. Encrypts with the active (first) key, decrypts with
/// whichever key a ciphertext names.
#[derive(Clone)]
pub struct Keyring {
    active: String,
    keys: HashMap<String, Aes256Gcm>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<_> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("Keyring").field("active", &self.active).field("key_ids", &ids).finish()
    }
}

impl Keyring {
    /// `id:base64key[,id:base64key...]`; the first is the active key.
    pub fn parse(spec: &str) -> Result<Self> {
        let mut keys = HashMap::new();
        let mut active = None;
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (id, b64) = entry.split_once(':').context("each key must be written id:base64")?;
            let raw = STANDARD.decode(b64.trim()).with_context(|| format!("key {id:?} is not base64"))?;
            if raw.len() != 32 {
                bail!("key {id:?} must decode to 32 bytes, got {}", raw.len());
            }
            keys.insert(id.to_owned(), Aes256Gcm::new_from_slice(&raw).expect("32-byte key"));
            active.get_or_insert_with(|| id.to_owned());
        }
        let active = active.context("no key given")?;
        Ok(Self { active, keys })
    }

    /// A fixed, public key for development only; production refuses it.
    pub fn development() -> Self {
        let key = [0x52u8; 32];
        Self {
            active: DEV_KEY_ID.into(),
            keys: HashMap::from([(DEV_KEY_ID.to_owned(), Aes256Gcm::new_from_slice(&key).expect("32-byte key"))]),
        }
    }

    pub fn active_key_id(&self) -> &str {
        &self.active
    }

    pub fn is_development(&self) -> bool {
        self.active == DEV_KEY_ID
    }

    /// Returns (key id, nonce || ciphertext || tag).
    pub fn encrypt(&self, secret: &SigningSecret) -> (String, Vec<u8>) {
        self.seal(secret.expose().as_bytes())
    }

    pub fn decrypt(&self, key_id: &str, stored: &[u8]) -> Result<SigningSecret, SecretError> {
        String::from_utf8(self.open(key_id, stored)?).map(SigningSecret::new).map_err(|_| SecretError::Tampered)
    }

    /// Any bytes kept as secretly as a signing secret (custom headers):
    /// (key id, nonce || ciphertext || tag) under the active key.
    pub fn seal(&self, plain: &[u8]) -> (String, Vec<u8>) {
        let cipher = &self.keys[&self.active];
        // A fresh nonce each time: equal secrets never give equal ciphertexts.
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let sealed = cipher.encrypt(&nonce, plain).expect("AES-GCM encryption does not fail on a short input");
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        (self.active.clone(), out)
    }

    pub fn open(&self, key_id: &str, stored: &[u8]) -> Result<Vec<u8>, SecretError> {
        let cipher = self.keys.get(key_id).ok_or_else(|| SecretError::UnknownKey(key_id.to_owned()))?;
        if stored.len() <= NONCE_LEN {
            return Err(SecretError::Tampered);
        }
        let (nonce, sealed) = stored.split_at(NONCE_LEN);
        cipher.decrypt(Nonce::from_slice(nonce), sealed).map_err(|_| SecretError::Tampered)
    }
}

/// A new signing secret as Standard Webhooks writes one: `whsec_` + the
/// standard base64 of 32 random bytes. relay-v1 keys its HMAC with the whole
/// text, the Standard Webhooks scheme with the decoded bytes, so one secret
/// serves both. (Until issue 13 secrets were URL-safe base64, which the
/// Standard Webhooks libraries misread; those still sign relay-v1.)
pub fn mint_signing_secret() -> SigningSecret {
    let bytes: [u8; 32] = rand::random();
    SigningSecret::new(format!("{}{}", relay_signing::standard::SECRET_PREFIX, STANDARD.encode(bytes)))
}

/// A new ed25519 key pair: the private key (`whsk_…`, to be encrypted like a
/// secret) and the public key receivers verify with (`whpk_…`).
pub fn mint_ed25519_key_pair() -> (SigningSecret, String) {
    relay_signing::standard::ed25519_key_pair(rand::random())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_fresh_nonces_and_refuses_tampering() {
        let ring = Keyring::parse(&format!("k1:{}", STANDARD.encode([7u8; 32]))).unwrap();
        let secret = mint_signing_secret();
        let (id, a) = ring.encrypt(&secret);
        let (_, b) = ring.encrypt(&secret);
        assert_ne!(a, b, "two encryptions of one secret must differ");
        assert_eq!(ring.decrypt(&id, &a).unwrap(), secret);
        let mut bad = a.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(matches!(ring.decrypt(&id, &bad), Err(SecretError::Tampered)));
        assert!(matches!(ring.decrypt("nope", &a), Err(SecretError::UnknownKey(_))));
    }

    #[test]
    fn decrypts_under_an_older_key_and_encrypts_under_the_active_one() {
        let old = Keyring::parse(&format!("old:{}", STANDARD.encode([1u8; 32]))).unwrap();
        let (old_id, stored) = old.encrypt(&SigningSecret::new("s"));
        let both = Keyring::parse(&format!("new:{},old:{}", STANDARD.encode([2u8; 32]), STANDARD.encode([1u8; 32]))).unwrap();
        assert_eq!(both.decrypt(&old_id, &stored).unwrap().expose(), "s");
        assert_eq!(both.encrypt(&SigningSecret::new("s")).0, "new");
    }

    #[test]
    fn minted_secrets_key_both_symmetric_schemes_and_key_pairs_sign() {
        let secret = mint_signing_secret();
        assert_eq!(relay_signing::standard::symmetric_key(&secret).unwrap().len(), 32);
        assert_ne!(mint_signing_secret(), secret);
        let (private, public) = mint_ed25519_key_pair();
        let key = relay_signing::standard::ed25519_key(&private).unwrap();
        assert_eq!(relay_signing::standard::public_key(&key), public);
    }

    #[test]
    fn wrong_sized_keys_are_refused_with_the_size() {
        let err = Keyring::parse(&format!("k:{}", STANDARD.encode([1u8; 16]))).unwrap_err();
        assert!(err.to_string().contains("32 bytes, got 16"), "{err}");
    }
}
