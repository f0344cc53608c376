//! Webhook signatures — the one place a signature is made. Each endpoint
//! picks a [`Scheme`]: `relay-v1` (below) or one of the two Standard Webhooks
//! schemes ([`standard`]). Receivers (and `relay-dev receive`) verify with
//! `relay-webhook-verify`; the relay-v1 check here only serves this crate's
//! own tests.
//!
//! relay-v1's contract (`shared/contracts/README.md`, restated in `docs/webhooks.md`):
//! `relay-webhook-signature` carries one `v1=<hex>` per valid secret, joined by
//! `,`, current secret first; `<hex>` is the lowercase hex HMAC-SHA256, keyed
//! with the UTF-8 bytes of the secret as shown to the customer, over
//! `v1:<timestamp>:<raw body bytes>`. The body is signed exactly as sent.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
#[cfg(test)]
use subtle::ConstantTimeEq;

pub mod standard;

pub const SCHEME: &str = "v1";
pub const ID_HEADER: &str = "relay-webhook-id";
pub const TIMESTAMP_HEADER: &str = "relay-webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "relay-webhook-signature";
/// How far a recipient should let a timestamp stray from its clock.
#[cfg(test)]
pub const DEFAULT_TOLERANCE_SECS: i64 = 5 * 60;

/// A signing secret in clear. Its `Debug` never shows the value, so it can sit
/// in structs that are logged without leaking.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret(String);

impl SigningSecret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret as the customer was shown it. Call sites are the signer, the
    /// one response that reveals it, and the encryption at rest.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningSecret([redacted])")
    }
}

fn mac(secret: &SigningSecret, timestamp: &str, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.0.as_bytes()).expect("HMAC accepts keys of any length");
    mac.update(SCHEME.as_bytes());
    mac.update(b":");
    mac.update(timestamp.as_bytes());
    mac.update(b":");
    mac.update(body);
    mac
}

/// Lowercase hex HMAC of one secret over `v1:<timestamp>:<body>`.
pub fn sign(secret: &SigningSecret, timestamp: &str, body: &[u8]) -> String {
    hex::encode(mac(secret, timestamp, body).finalize().into_bytes())
}

/// The `relay-webhook-signature` value: one `v1=<hex>` per secret, in the order
/// given (the current secret first during a rotation window).
pub fn signature_header(secrets: &[SigningSecret], timestamp: &str, body: &[u8]) -> String {
    secrets.iter().map(|s| format!("{SCHEME}={}", sign(s, timestamp, body))).collect::<Vec<_>>().join(",")
}

/// How an endpoint's deliveries are signed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scheme {
    /// The shared contract: `relay-webhook-*` headers, `v1=<hex>` entries.
    #[default]
    RelayV1,
    /// Standard Webhooks, HMAC-SHA256 keyed with the secret's decoded bytes.
    StandardWebhooks,
    /// Standard Webhooks, ed25519: receivers hold only the public key.
    StandardWebhooksEd25519,
}

impl Scheme {
    pub const ALL: [Scheme; 3] = [Scheme::RelayV1, Scheme::StandardWebhooks, Scheme::StandardWebhooksEd25519];

    /// The name the API, the database and the docs use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RelayV1 => "relay-v1",
            Self::StandardWebhooks => "standard-webhooks",
            Self::StandardWebhooksEd25519 => "standard-webhooks-ed25519",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The names of the headers that carry a delivery's ordering key and its
    /// place in the key's sequence at an endpoint that orders per key, in
    /// this scheme's family (not signed: the signature covers the id, the
    /// timestamp and the body, as every verifier library expects).
    pub fn ordering_headers(self) -> (&'static str, &'static str) {
        match self {
            Self::RelayV1 => ("relay-webhook-ordering-key", "relay-webhook-sequence"),
            Self::StandardWebhooks | Self::StandardWebhooksEd25519 => ("webhook-ordering-key", "webhook-sequence"),
        }
    }

    /// Signed with a key pair rather than a shared secret.
    pub fn is_asymmetric(self) -> bool {
        self == Self::StandardWebhooksEd25519
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The id, timestamp and signature headers of one request, signed with each
/// of `secrets` in order (the current one first during a rotation window).
///
/// Under a Standard Webhooks scheme the current secret must key it (else the
/// error); an older one that cannot — a secret minted before Standard
/// Webhooks support, kept through a rotation window — is left out.
pub fn signed_headers(
    scheme: Scheme,
    secrets: &[SigningSecret],
    msg_id: &str,
    timestamp: &str,
    body: &[u8],
) -> Result<[(&'static str, String); 3], standard::KeyError> {
    fn entries<K>(
        secrets: &[SigningSecret],
        key: impl Fn(&SigningSecret) -> Result<K, standard::KeyError>,
        sign: impl Fn(&K) -> String,
    ) -> Result<String, standard::KeyError> {
        let mut out = Vec::with_capacity(secrets.len());
        for (i, secret) in secrets.iter().enumerate() {
            match key(secret) {
                Ok(k) => out.push(sign(&k)),
                Err(e) if i == 0 => return Err(e),
                Err(_) => {}
            }
        }
        Ok(out.join(" "))
    }
    Ok(match scheme {
        Scheme::RelayV1 => [
            (ID_HEADER, msg_id.to_owned()),
            (TIMESTAMP_HEADER, timestamp.to_owned()),
            (SIGNATURE_HEADER, signature_header(secrets, timestamp, body)),
        ],
        Scheme::StandardWebhooks => [
            (standard::ID_HEADER, msg_id.to_owned()),
            (standard::TIMESTAMP_HEADER, timestamp.to_owned()),
            (
                standard::SIGNATURE_HEADER,
                entries(secrets, standard::symmetric_key, |k| standard::sign_symmetric(k, msg_id, timestamp, body))?,
            ),
        ],
        Scheme::StandardWebhooksEd25519 => [
            (standard::ID_HEADER, msg_id.to_owned()),
            (standard::TIMESTAMP_HEADER, timestamp.to_owned()),
            (standard::SIGNATURE_HEADER, entries(secrets, standard::ed25519_key, |k| standard::sign_ed25519(k, msg_id, timestamp, body))?),
        ],
    })
}

#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub enum VerifyError {
    MalformedTimestamp,
    TimestampOutOfTolerance { skew_secs: i64 },
    NoMatchingSignature,
}

#[cfg(test)]
impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MalformedTimestamp => f.write_str("relay-webhook-timestamp is not whole Unix seconds"),
            Self::TimestampOutOfTolerance { skew_secs } => {
                write!(f, "relay-webhook-timestamp is {skew_secs} s from this clock; at most {DEFAULT_TOLERANCE_SECS} s is accepted")
            }
            Self::NoMatchingSignature => f.write_str("no v1 signature in relay-webhook-signature matches this secret"),
        }
    }
}

#[cfg(test)]
impl std::error::Error for VerifyError {}

/// Verifies a received webhook the way a recipient should: the timestamp is
/// within `tolerance_secs` of `now_unix`, and any `v1=` entry matches.
#[cfg(test)]
pub fn verify(
    secret: &SigningSecret,
    signature_header: &str,
    timestamp: &str,
    body: &[u8],
    now_unix: i64,
    tolerance_secs: i64,
) -> Result<(), VerifyError> {
    let sent: i64 = timestamp.parse().map_err(|_| VerifyError::MalformedTimestamp)?;
    // The distance can exceed i64 for extreme timestamps a sender chose;
    // measured without overflow, and saturated when reported.
    let skew = now_unix.abs_diff(sent);
    if skew > tolerance_secs.unsigned_abs() {
        return Err(VerifyError::TimestampOutOfTolerance { skew_secs: i64::try_from(skew).unwrap_or(i64::MAX) });
    }
    let expected = sign(secret, timestamp, body);
    let matched = signature_header
        .split(',')
        .filter_map(|entry| entry.trim().strip_prefix("v1="))
        .any(|candidate| candidate.as_bytes().ct_eq(expected.as_bytes()).into());
    if matched { Ok(()) } else { Err(VerifyError::NoMatchingSignature) }
}

#[cfg(test)]
mod extremes {
    use super::*;

    #[test]
    fn extreme_timestamps_are_refused_not_a_panic() {
        let s = SigningSecret::new("whsec_x");
        for (ts, now) in [("-9223372036854775808", 1_700_000_000), ("9223372036854775807", -1), ("9223372036854775807", i64::MIN)] {
            assert!(matches!(verify(&s, "v1=00", ts, b"{}", now, 300), Err(VerifyError::TimestampOutOfTolerance { .. })), "{ts} at {now}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vectors() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/contracts/signature-v1-vectors.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        serde_json::from_str(&text).expect("vectors are JSON")
    }

    #[test]
    fn reproduces_every_contract_vector_byte_for_byte() {
        let all = vectors();
        let list = all["vectors"].as_array().expect("a vectors array");
        assert!(list.len() >= 6, "expected the contract's vectors, found {}", list.len());
        for v in list {
            let secrets: Vec<SigningSecret> =
                v["secrets"].as_array().unwrap().iter().map(|s| SigningSecret::new(s.as_str().unwrap())).collect();
            let ts = v["timestamp"].as_str().unwrap();
            let body = v["raw_body"].as_str().unwrap().as_bytes();
            assert_eq!(signature_header(&secrets, ts, body), v["signature_header"].as_str().unwrap(), "vector {v}");
            let now: i64 = ts.parse().unwrap();
            for s in &secrets {
                verify(s, v["signature_header"].as_str().unwrap(), ts, body, now, DEFAULT_TOLERANCE_SECS)
                    .unwrap_or_else(|e| panic!("{e} for {v}"));
            }
        }
    }

    #[test]
    fn verify_refuses_a_changed_body_a_wrong_secret_and_a_stale_timestamp() {
        let s = SigningSecret::new("s3cr3t");
        let header = signature_header(std::slice::from_ref(&s), "1700000000", b"{}");
        assert_eq!(verify(&s, &header, "1700000000", b"{ }", 1_700_000_000, 300), Err(VerifyError::NoMatchingSignature));
        let other = SigningSecret::new("other");
        assert_eq!(verify(&other, &header, "1700000000", b"{}", 1_700_000_000, 300), Err(VerifyError::NoMatchingSignature));
        assert_eq!(
            verify(&s, &header, "1700000000", b"{}", 1_700_000_301, 300),
            Err(VerifyError::TimestampOutOfTolerance { skew_secs: 301 })
        );
        assert_eq!(verify(&s, &header, "17e8", b"{}", 1_700_000_000, 300), Err(VerifyError::MalformedTimestamp));
    }

    #[test]
    fn each_scheme_names_its_headers_and_rotation_signs_current_first() {
        use base64::Engine;
        let b64 = |b: [u8; 32]| base64::engine::general_purpose::STANDARD.encode(b);
        let current = SigningSecret::new(format!("whsec_{}", b64([1; 32])));
        let previous = SigningSecret::new(format!("whsec_{}", b64([2; 32])));
        let legacy = SigningSecret::new("whsec_Ab-cd_EfGhIjKlMnOpQrStUvWxYz0123456789abcd");

        let v1 = signed_headers(Scheme::RelayV1, &[current.clone(), legacy.clone()], "evt", "1700000000", b"{}").unwrap();
        assert_eq!(v1.clone().map(|h| h.0), [ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER]);
        assert_eq!(v1[2].1.split(',').count(), 2, "relay-v1 signs with any secret text: {}", v1[2].1);

        let sw = signed_headers(Scheme::StandardWebhooks, &[current.clone(), previous.clone()], "evt", "1700000000", b"{}").unwrap();
        assert_eq!(sw.clone().map(|h| h.0), ["webhook-id", "webhook-timestamp", "webhook-signature"]);
        let entries: Vec<&str> = sw[2].1.split(' ').collect();
        let key = |s: &SigningSecret| standard::symmetric_key(s).unwrap();
        assert_eq!(
            entries,
            [
                standard::sign_symmetric(&key(&current), "evt", "1700000000", b"{}"),
                standard::sign_symmetric(&key(&previous), "evt", "1700000000", b"{}")
            ]
        );
        // A legacy previous secret is left out; a legacy current one is an error.
        let kept = signed_headers(Scheme::StandardWebhooks, &[current.clone(), legacy.clone()], "evt", "1", b"{}").unwrap();
        assert_eq!(kept[2].1.split(' ').count(), 1);
        assert!(signed_headers(Scheme::StandardWebhooks, &[legacy, current.clone()], "evt", "1", b"{}").is_err());

        let (a, _) = standard::ed25519_key_pair([3; 32]);
        let (b, _) = standard::ed25519_key_pair([4; 32]);
        let ed = signed_headers(Scheme::StandardWebhooksEd25519, &[a, b], "evt", "1", b"{}").unwrap();
        assert!(ed[2].1.split(' ').all(|e| e.starts_with("v1a,")) && ed[2].1.split(' ').count() == 2, "{}", ed[2].1);
        assert!(signed_headers(Scheme::StandardWebhooksEd25519, &[current], "evt", "1", b"{}").is_err());

        for s in Scheme::ALL {
            assert_eq!(Scheme::parse(s.as_str()), Some(s));
        }
        assert_eq!(Scheme::parse("v1"), None);
    }

    #[test]
    fn debug_redacts_the_secret() {
        assert_eq!(format!("{:?}", SigningSecret::new("hunter2")), "SigningSecret([redacted])");
    }

    mod properties {
        use proptest::{collection::vec, prelude::*, sample::Index};

        use super::super::*;

        /// The HMAC as the contract states it, computed here without the
        /// crate's helpers: key = the secret's UTF-8 bytes, message =
        /// `v1:<timestamp>:<body>` in one piece, lowercase hex.
        fn contract_hmac(secret: &str, timestamp: &str, body: &[u8]) -> String {
            let mut message = format!("v1:{timestamp}:").into_bytes();
            message.extend_from_slice(body);
            let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
            mac.update(&message);
            hex::encode(mac.finalize().into_bytes())
        }

        /// HMAC pads a short key with zero bytes, so `k` and `k\0` are the
        /// same key: a "different" secret must differ after that padding.
        fn same_hmac_key(a: &str, b: &str) -> bool {
            a.trim_end_matches('\0') == b.trim_end_matches('\0') && a.len() <= 64 && b.len() <= 64
        }

        fn secret() -> impl Strategy<Value = String> {
            // Any non-empty text, control characters and astral planes included.
            "(?s).{1,48}"
        }

        proptest! {
            #[test]
            fn every_secret_signs_once_in_order_and_each_verifies(
                secrets in vec(secret(), 1..=3),
                ts in any::<i64>(),
                body in vec(any::<u8>(), 0..4096),
                skew in -DEFAULT_TOLERANCE_SECS..=DEFAULT_TOLERANCE_SECS,
            ) {
                let timestamp = ts.to_string();
                let keys: Vec<SigningSecret> = secrets.iter().map(SigningSecret::new).collect();
                let header = signature_header(&keys, &timestamp, &body);
                let entries: Vec<&str> = header.split(',').collect();
                prop_assert_eq!(entries.len(), secrets.len(), "one entry per secret: {}", header);
                for (entry, s) in entries.iter().zip(&keys) {
                    let hex = entry.strip_prefix("v1=");
                    prop_assert!(hex.is_some(), "entry {:?} is not v1=", entry);
                    let hex = hex.unwrap_or_default();
                    prop_assert!(hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{:?}", hex);
                    // In order: entry i is secret i's signature.
                    prop_assert_eq!(hex, sign(s, &timestamp, &body));
                    prop_assert_eq!(hex, contract_hmac(s.expose(), &timestamp, &body));
                }
                // Within tolerance of the verifier's clock, on either side
                // (saturating: the skew stays within tolerance at i64's ends).
                let now = ts.saturating_add(skew);
                for s in &keys {
                    prop_assert_eq!(verify(s, &header, &timestamp, &body, now, DEFAULT_TOLERANCE_SECS), Ok(()));
                }
            }

            #[test]
            fn a_flipped_bit_another_secret_or_a_stale_timestamp_is_refused(
                secrets in vec(secret(), 1..=3),
                other in secret(),
                ts in any::<i64>(),
                body in vec(any::<u8>(), 1..4096),
                at in any::<Index>(),
                bit in 0u8..8,
                beyond in 1i64..=1_000_000,
            ) {
                let timestamp = ts.to_string();
                let keys: Vec<SigningSecret> = secrets.iter().map(SigningSecret::new).collect();
                let header = signature_header(&keys, &timestamp, &body);

                let mut flipped = body.clone();
                let i = at.index(flipped.len());
                flipped[i] ^= 1 << bit;
                for s in &keys {
                    prop_assert_eq!(
                        verify(s, &header, &timestamp, &flipped, ts, DEFAULT_TOLERANCE_SECS),
                        Err(VerifyError::NoMatchingSignature),
                        "bit {} of byte {} flipped", bit, i
                    );
                }

                prop_assume!(!secrets.iter().any(|s| same_hmac_key(s, &other)));
                prop_assert_eq!(
                    verify(&SigningSecret::new(other), &header, &timestamp, &body, ts, DEFAULT_TOLERANCE_SECS),
                    Err(VerifyError::NoMatchingSignature)
                );

                // Just past the tolerance, ahead of or behind the verifier,
                // whichever side i64 has room for.
                let off = DEFAULT_TOLERANCE_SECS + beyond;
                let now = ts.checked_add(off).or_else(|| ts.checked_sub(off)).expect("one side has room");
                for s in &keys {
                    prop_assert_eq!(
                        verify(s, &header, &timestamp, &body, now, DEFAULT_TOLERANCE_SECS),
                        Err(VerifyError::TimestampOutOfTolerance { skew_secs: off })
                    );
                }
            }
        }

        #[test]
        fn an_empty_body_and_a_one_byte_body_sign_differently() {
            // The flip property needs a byte to flip; the empty body's own case.
            let s = SigningSecret::new("s3cr3t");
            let header = signature_header(std::slice::from_ref(&s), "1700000000", b"");
            assert_eq!(verify(&s, &header, "1700000000", b"\0", 1_700_000_000, 300), Err(VerifyError::NoMatchingSignature));
            assert_eq!(verify(&s, &header, "1700000000", b"", 1_700_000_000, 300), Ok(()));
        }
    }
}
