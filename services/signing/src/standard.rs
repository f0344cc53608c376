//! Standard Webhooks (standardwebhooks.com, v1.0.0): the symmetric scheme
//! (`v1,<base64 HMAC-SHA256>`) and the asymmetric one (`v1a,<base64
//! ed25519>`), both over `<webhook-id>.<webhook-timestamp>.<raw body>`.
//!
//! Keys as the specification writes them: a symmetric secret is `whsec_`
//! followed by the base64 of its random bytes (24 to 64 of them), and the HMAC
//! is keyed with those decoded bytes, not with the text; an ed25519 public
//! key is `whpk_` + the base64 of its 32 bytes. The private key never leaves
//! the platform; Relay writes it `whsk_` + the base64 of its 32-byte seed.

use std::fmt;

use base64::{
    Engine,
    alphabet::STANDARD as STANDARD_ALPHABET,
    engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig, general_purpose::STANDARD},
};
use ed25519_dalek::{Signer, SigningKey};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::SigningSecret;

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";

pub const SECRET_PREFIX: &str = "whsec_";
pub const PRIVATE_KEY_PREFIX: &str = "whsk_";
pub const PUBLIC_KEY_PREFIX: &str = "whpk_";

/// The specification's bounds on a symmetric secret's decoded length.
pub const MIN_SECRET_BYTES: usize = 24;
pub const MAX_SECRET_BYTES: usize = 64;

/// Standard base64, padded or not: the specification's own libraries pad
/// before decoding, so both spellings name the same key.
const LENIENT: GeneralPurpose =
    GeneralPurpose::new(&STANDARD_ALPHABET, GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent));

/// Why a stored secret cannot key a Standard Webhooks signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// The secret does not start with the prefix its scheme needs.
    WrongPrefix { expected: &'static str },
    /// What follows the prefix is not standard base64 (secrets minted before
    /// Standard Webhooks support were URL-safe base64: they sign `relay-v1`
    /// only).
    NotBase64,
    /// Decoded, it has a length the scheme does not accept.
    WrongLength { bytes: usize, expected: &'static str },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WrongPrefix { expected } => write!(f, "the key does not start with {expected}"),
            Self::NotBase64 => f.write_str("the key after its prefix is not standard base64"),
            Self::WrongLength { bytes, expected } => write!(f, "the key decodes to {bytes} bytes; {expected}"),
        }
    }
}

impl std::error::Error for KeyError {}

/// The HMAC key a `whsec_` secret names: its decoded bytes.
pub fn symmetric_key(secret: &SigningSecret) -> Result<Vec<u8>, KeyError> {
    let encoded = secret.expose().strip_prefix(SECRET_PREFIX).ok_or(KeyError::WrongPrefix { expected: SECRET_PREFIX })?;
    let key = LENIENT.decode(encoded).map_err(|_| KeyError::NotBase64)?;
    if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&key.len()) {
        return Err(KeyError::WrongLength { bytes: key.len(), expected: "Standard Webhooks secrets are 24 to 64 bytes" });
    }
    Ok(key)
}

/// The ed25519 key a `whsk_` private key names.
pub fn ed25519_key(secret: &SigningSecret) -> Result<SigningKey, KeyError> {
    let encoded = secret.expose().strip_prefix(PRIVATE_KEY_PREFIX).ok_or(KeyError::WrongPrefix { expected: PRIVATE_KEY_PREFIX })?;
    let seed = LENIENT.decode(encoded).map_err(|_| KeyError::NotBase64)?;
    let seed: [u8; 32] = seed
        .as_slice()
        .try_into()
        .map_err(|_| KeyError::WrongLength { bytes: seed.len(), expected: "an ed25519 private key is a 32-byte seed" })?;
    Ok(SigningKey::from_bytes(&seed))
}

/// A new ed25519 key pair from a 32-byte random seed: the private key as
/// Relay stores it (`whsk_…`, encrypted at rest) and the public key as
/// receivers configure it (`whpk_…`).
pub fn ed25519_key_pair(seed: [u8; 32]) -> (SigningSecret, String) {
    let key = SigningKey::from_bytes(&seed);
    (SigningSecret::new(format!("{PRIVATE_KEY_PREFIX}{}", STANDARD.encode(seed))), public_key(&key))
}

/// The `whpk_` spelling of a key's public half.
pub fn public_key(key: &SigningKey) -> String {
    format!("{PUBLIC_KEY_PREFIX}{}", STANDARD.encode(key.verifying_key().as_bytes()))
}

/// The bytes both schemes sign: `<id>.<timestamp>.<body>`.
fn signed_content(msg_id: &str, timestamp: &str, body: &[u8]) -> Vec<u8> {
    let mut content = Vec::with_capacity(msg_id.len() + timestamp.len() + 2 + body.len());
    content.extend_from_slice(msg_id.as_bytes());
    content.push(b'.');
    content.extend_from_slice(timestamp.as_bytes());
    content.push(b'.');
    content.extend_from_slice(body);
    content
}

/// One `v1,<base64>` entry.
pub fn sign_symmetric(key: &[u8], msg_id: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts keys of any length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// One `v1a,<base64>` entry.
pub fn sign_ed25519(key: &SigningKey, msg_id: &str, timestamp: &str, body: &[u8]) -> String {
    format!("v1a,{}", STANDARD.encode(key.sign(&signed_content(msg_id, timestamp, body)).to_bytes()))
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::{Signature, Verifier, VerifyingKey};

    use super::*;

    /// The example in the specification and its libraries' test suites.
    #[test]
    fn reproduces_the_specifications_example() {
        let secret = SigningSecret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        let key = symmetric_key(&secret).unwrap();
        assert_eq!(
            sign_symmetric(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", br#"{"test": 2432232314}"#),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn keys_are_read_as_the_specification_writes_them() {
        let padded = SigningSecret::new(format!("whsec_{}", STANDARD.encode([7u8; 32])));
        assert_eq!(symmetric_key(&padded).unwrap(), vec![7u8; 32]);
        let unpadded = SigningSecret::new(format!("whsec_{}", STANDARD.encode([7u8; 32]).trim_end_matches('=')));
        assert_eq!(symmetric_key(&unpadded).unwrap(), vec![7u8; 32]);
        // What Relay minted before: URL-safe base64 with '-' or '_'.
        let legacy = SigningSecret::new("whsec_Ab-cd_EfGhIjKlMnOpQrStUvWxYz0123456789abcd");
        assert_eq!(symmetric_key(&legacy), Err(KeyError::NotBase64));
        assert_eq!(symmetric_key(&SigningSecret::new("s3cr3t")), Err(KeyError::WrongPrefix { expected: "whsec_" }));
        let short = SigningSecret::new(format!("whsec_{}", STANDARD.encode([1u8; 16])));
        assert!(matches!(symmetric_key(&short), Err(KeyError::WrongLength { bytes: 16, .. })));
    }

    #[test]
    fn an_ed25519_signature_verifies_with_the_published_public_key_only() {
        let (private, public) = ed25519_key_pair([9u8; 32]);
        let key = ed25519_key(&private).unwrap();
        let entry = sign_ed25519(&key, "evt_1", "1700000000", b"{}");
        let raw = STANDARD.decode(entry.strip_prefix("v1a,").unwrap()).unwrap();
        let signature = Signature::from_slice(&raw).unwrap();
        let published: [u8; 32] = STANDARD.decode(public.strip_prefix("whpk_").unwrap()).unwrap().try_into().unwrap();
        let verifying = VerifyingKey::from_bytes(&published).unwrap();
        assert!(verifying.verify(b"evt_1.1700000000.{}", &signature).is_ok());
        assert!(verifying.verify(b"evt_1.1700000000.{ }", &signature).is_err());
        assert!(matches!(ed25519_key(&SigningSecret::new("whsk_AAAA")), Err(KeyError::WrongLength { bytes: 3, .. })));
    }
}
