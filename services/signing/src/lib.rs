//! Webhook signatures, scheme v1 — the one place a signature is made or checked.
//!
//! The contract (`shared/contracts/README.md`, restated in `docs/webhooks.md`):
//! `relay-webhook-signature` carries one `v1=<hex>` per valid secret, joined by
//! `,`, current secret first; `<hex>` is the lowercase hex HMAC-SHA256, keyed
//! with the UTF-8 bytes of the secret as shown to the customer, over
//! `v1:<timestamp>:<raw body bytes>`. The body is signed exactly as sent.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

pub const SCHEME: &str = "v1";
pub const ID_HEADER: &str = "relay-webhook-id";
pub const TIMESTAMP_HEADER: &str = "relay-webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "relay-webhook-signature";
/// How far a recipient should let a timestamp stray from its clock.
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

#[derive(Debug, PartialEq, Eq)]
pub enum VerifyError {
    MalformedTimestamp,
    TimestampOutOfTolerance { skew_secs: i64 },
    NoMatchingSignature,
}

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

impl std::error::Error for VerifyError {}

/// Verifies a received webhook the way a recipient should: the timestamp is
/// within `tolerance_secs` of `now_unix`, and any `v1=` entry matches.
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
