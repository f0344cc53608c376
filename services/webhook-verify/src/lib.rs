//! Verifies a Relay webhook on the receiving side, whichever scheme its
//! endpoint signs with (docs/webhooks.md):
//!
//! - `relay-v1`: `relay-webhook-*` headers, `v1=<hex HMAC-SHA256>` over
//!   `v1:<timestamp>:<body>`, keyed with the secret's text;
//! - `standard-webhooks`: `webhook-*` headers, `v1,<base64 HMAC-SHA256>`
//!   over `<id>.<timestamp>.<body>`, keyed with the secret's decoded bytes;
//! - `standard-webhooks-ed25519`: the same headers, `v1a,<base64 ed25519>`
//!   entries, checked with the endpoint's `whpk_` public key.
//!
//! Signatures are compared in constant time, the timestamp must be within
//! the tolerance (5 minutes unless set), and any entry may match (two are
//! sent during a rotation). It depends on nothing of Relay's: this is the
//! code a customer would vendor or publish. With the `axum` feature,
//! [`VerifiedWebhook`] is an extractor that answers 400/401 itself.
//!
//! ```ignore
//! let verifier = Verifier::standard("whsec_…")?;
//! let verified = verifier.verify(&headers, &body)?; // verified.id: deduplicate on it
//! ```

use std::{
    fmt,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::{
    Engine,
    alphabet::STANDARD as STANDARD_ALPHABET,
    engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig},
};
use ed25519_dalek::{Signature, Verifier as _, VerifyingKey};
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

#[cfg(feature = "axum")]
mod extract;
#[cfg(feature = "axum")]
pub use extract::VerifiedWebhook;

/// The specification's (and Relay's) default: 5 minutes either way.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

const BASE64: GeneralPurpose =
    GeneralPurpose::new(&STANDARD_ALPHABET, GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent));

/// A key to verify with, as the Relay API shows it.
#[derive(Clone)]
enum Key {
    /// relay-v1: the secret's text is the HMAC key.
    RelayV1(Vec<u8>),
    /// standard-webhooks: the secret's decoded bytes are the HMAC key.
    Standard(Vec<u8>),
    Ed25519(VerifyingKey),
}

/// Verifies requests against one or more keys (several while you move
/// between schemes or keys yourself). Its `Debug` shows no key.
#[derive(Clone)]
pub struct Verifier {
    keys: Vec<Key>,
    tolerance: Duration,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kinds: Vec<&str> = self
            .keys
            .iter()
            .map(|k| match k {
                Key::RelayV1(_) => "relay-v1",
                Key::Standard(_) => "standard-webhooks",
                Key::Ed25519(_) => "standard-webhooks-ed25519",
            })
            .collect();
        f.debug_struct("Verifier").field("schemes", &kinds).field("tolerance", &self.tolerance).finish()
    }
}

/// A key the verifier was given that it cannot use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError(String);

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KeyError {}

/// Why a request was refused. The `Display` is safe to answer with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// None of the headers of a scheme this verifier holds a key for.
    MissingHeaders,
    /// The timestamp header is not whole Unix seconds.
    MalformedTimestamp,
    /// Sent longer ago (or further ahead) than the tolerance.
    OutsideTolerance { skew_secs: u64 },
    /// No entry matched any key.
    NoMatchingSignature,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingHeaders => f.write_str("the webhook's id, timestamp or signature header is missing"),
            Self::MalformedTimestamp => f.write_str("the webhook timestamp is not whole Unix seconds"),
            Self::OutsideTolerance { skew_secs } => write!(f, "the webhook timestamp is {skew_secs} s from this clock"),
            Self::NoMatchingSignature => f.write_str("no signature matches"),
        }
    }
}

impl std::error::Error for Error {}

/// A verified request's id (the event id: deduplicate on it) and timestamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub id: String,
    pub timestamp: i64,
}

impl Verifier {
    /// For a `relay-v1` endpoint: its secret, exactly as shown.
    pub fn relay_v1(secret: &str) -> Self {
        Self::with_key(Key::RelayV1(secret.as_bytes().to_vec()))
    }

    /// For a `standard-webhooks` endpoint: its `whsec_` secret.
    pub fn standard(secret: &str) -> Result<Self, KeyError> {
        let encoded = secret.strip_prefix("whsec_").ok_or_else(|| KeyError("a Standard Webhooks secret starts with whsec_".into()))?;
        let key = BASE64.decode(encoded).map_err(|_| KeyError("the secret after whsec_ is not standard base64".into()))?;
        if key.is_empty() {
            return Err(KeyError("the secret is empty".into()));
        }
        Ok(Self::with_key(Key::Standard(key)))
    }

    /// For a `standard-webhooks-ed25519` endpoint: its `whpk_` public key.
    pub fn ed25519(public_key: &str) -> Result<Self, KeyError> {
        let encoded = public_key.strip_prefix("whpk_").ok_or_else(|| KeyError("an ed25519 public key starts with whpk_".into()))?;
        let raw = BASE64.decode(encoded).map_err(|_| KeyError("the key after whpk_ is not standard base64".into()))?;
        let raw: [u8; 32] =
            raw.as_slice().try_into().map_err(|_| KeyError(format!("an ed25519 public key is 32 bytes, not {}", raw.len())))?;
        let key = VerifyingKey::from_bytes(&raw).map_err(|_| KeyError("not an ed25519 public key".into()))?;
        Ok(Self::with_key(Key::Ed25519(key)))
    }

    fn with_key(key: Key) -> Self {
        Self { keys: vec![key], tolerance: DEFAULT_TOLERANCE }
    }

    /// Also accepts what `other` accepts (its tolerance is not taken).
    pub fn or(mut self, other: Verifier) -> Self {
        self.keys.extend(other.keys);
        self
    }

    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies against this machine's clock.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<Verified, Error> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        self.verify_at(headers, body, now)
    }

    /// Verifies as if the clock read `now_unix`.
    pub fn verify_at(&self, headers: &HeaderMap, body: &[u8], now_unix: i64) -> Result<Verified, Error> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let mut missing = true;
        for (prefix, keys) in [("relay-webhook-", true), ("webhook-", false)] {
            let (Some(id), Some(timestamp), Some(signature)) =
                (header(&format!("{prefix}id")), header(&format!("{prefix}timestamp")), header(&format!("{prefix}signature")))
            else {
                continue;
            };
            let relevant: Vec<&Key> = self.keys.iter().filter(|k| matches!(k, Key::RelayV1(_)) == keys).collect();
            if relevant.is_empty() {
                continue;
            }
            missing = false;
            let sent: i64 = timestamp.parse().map_err(|_| Error::MalformedTimestamp)?;
            let skew = now_unix.abs_diff(sent);
            if skew > self.tolerance.as_secs() {
                return Err(Error::OutsideTolerance { skew_secs: skew });
            }
            if relevant.iter().any(|k| matches(k, id, timestamp, signature, body)) {
                return Ok(Verified { id: id.to_owned(), timestamp: sent });
            }
        }
        Err(if missing { Error::MissingHeaders } else { Error::NoMatchingSignature })
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().to_vec()
}

/// Whether any entry of the signature header matches this key.
fn matches(key: &Key, id: &str, timestamp: &str, signature: &str, body: &[u8]) -> bool {
    match key {
        Key::RelayV1(secret) => {
            let expected = hex::encode(hmac(secret, &[b"v1:", timestamp.as_bytes(), b":", body]));
            signature.split(',').filter_map(|e| e.trim().strip_prefix("v1=")).any(|c| bool::from(c.as_bytes().ct_eq(expected.as_bytes())))
        }
        Key::Standard(secret) => {
            let expected = hmac(secret, &[id.as_bytes(), b".", timestamp.as_bytes(), b".", body]);
            entries(signature, "v1").any(|raw| bool::from(raw.ct_eq(&expected)))
        }
        Key::Ed25519(public) => {
            let mut content = Vec::with_capacity(id.len() + timestamp.len() + 2 + body.len());
            for p in [id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
                content.extend_from_slice(p);
            }
            entries(signature, "v1a").filter_map(|raw| Signature::from_slice(&raw).ok()).any(|sig| public.verify(&content, &sig).is_ok())
        }
    }
}

/// The decoded signatures of one version in a Standard Webhooks header.
fn entries<'a>(header: &'a str, version: &'a str) -> impl Iterator<Item = Vec<u8>> + 'a {
    header.split(' ').filter_map(move |e| e.split_once(',').filter(|(v, _)| *v == version)).filter_map(|(_, sig)| BASE64.decode(sig).ok())
}

#[cfg(test)]
mod tests;
