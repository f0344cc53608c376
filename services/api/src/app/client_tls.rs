//! TLS towards a receiver, as a tenant asks for it: a client certificate
//! the dispatcher presents (mutual TLS), and a CA bundle the endpoint pins
//! (its server certificate must chain to one of these, and to nothing else).
//!
//! Invariants:
//! - a client certificate is accepted only when it parses, its key matches
//!   it and it is valid now; the key is sealed with the key ring like a
//!   signing secret and never shown again; reads show the certificate's
//!   subject, issuer, expiry and fingerprint;
//! - a CA bundle is accepted only when every block is a certificate a TLS
//!   client can anchor trust on; it is public and shown as stored;
//! - hostile input (garbage, huge, the wrong PEM kind) is refused with the
//!   field named, never a panic.

use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use sha2::{Digest, Sha256};

use relay_domain::{Reason, models::ClientCertificateShown};

use super::Timestamp;
use crate::error::{AppError, AppResult};

/// The largest certificate chain and key accepted, in bytes of PEM.
pub const MAX_CERTIFICATE_PEM: usize = 32 * 1024;
pub const MAX_KEY_PEM: usize = 16 * 1024;
/// The most certificates in a client chain.
pub const MAX_CHAIN: usize = 8;
/// The largest CA bundle, and the most certificates in it.
pub const MAX_CA_BUNDLE_PEM: usize = 64 * 1024;
pub const MAX_CA_CERTIFICATES: usize = 16;

/// A checked client identity, ready to seal.
pub struct ClientIdentity {
    /// The chain and the key as one PEM text (what the dispatcher loads).
    pub pem: String,
    pub shown: ClientCertificateShown,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity").field("shown", &self.shown).field("pem", &"[redacted]").finish()
    }
}

fn refuse_identity(message: impl Into<String>) -> AppError {
    AppError::invalid(Reason::InvalidClientCertificate, message.into())
}

/// Checks a client certificate (PEM chain, leaf first) and its key (PEM).
pub fn check_client_identity(certificate_pem: &str, key_pem: &str, now: Timestamp) -> AppResult<ClientIdentity> {
    if certificate_pem.len() > MAX_CERTIFICATE_PEM {
        return Err(refuse_identity(format!(
            "client_certificate may be at most {MAX_CERTIFICATE_PEM} bytes of PEM; this one is {}",
            certificate_pem.len()
        )));
    }
    if key_pem.len() > MAX_KEY_PEM {
        return Err(refuse_identity(format!("client_key may be at most {MAX_KEY_PEM} bytes of PEM; this one is {}", key_pem.len())));
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(certificate_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| refuse_identity(format!("client_certificate is not PEM certificates: {e}")))?;
    if chain.is_empty() {
        return Err(refuse_identity("client_certificate holds no CERTIFICATE block"));
    }
    if chain.len() > MAX_CHAIN {
        return Err(refuse_identity(format!(
            "client_certificate may chain at most {MAX_CHAIN} certificates; this one has {}",
            chain.len()
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| refuse_identity(format!("client_key is not a PEM private key (PKCS#8, PKCS#1 or SEC1): {e}")))?;
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain.clone(), key, &provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => refuse_identity("client_key does not match client_certificate"),
        other => refuse_identity(format!("client_key cannot sign with client_certificate: {other}")),
    })?;
    let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0])
        .map_err(|e| refuse_identity(format!("client_certificate's first certificate does not parse: {e}")))?;
    let validity = leaf.validity();
    let at = |t: x509_parser::time::ASN1Time| {
        chrono::DateTime::from_timestamp(t.timestamp(), 0).map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)).unwrap_or_default()
    };
    if validity.not_after.timestamp() <= now.timestamp() {
        return Err(refuse_identity(format!("client_certificate expired at {}", at(validity.not_after))));
    }
    if validity.not_before.timestamp() > now.timestamp() {
        return Err(refuse_identity(format!("client_certificate is not valid before {}", at(validity.not_before))));
    }
    let shown = ClientCertificateShown {
        subject: leaf.subject().to_string(),
        issuer: leaf.issuer().to_string(),
        not_after: at(validity.not_after),
        fingerprint_sha256: hex::encode(Sha256::digest(chain[0].as_ref())),
        presented_until: None,
    };
    Ok(ClientIdentity { pem: format!("{}\n{}\n", certificate_pem.trim(), key_pem.trim()), shown })
}

fn refuse_bundle(message: impl Into<String>) -> AppError {
    AppError::invalid(Reason::InvalidCaBundle, message.into())
}

/// Checks a CA bundle: PEM certificates, each one a trust anchor.
pub fn check_ca_bundle(pem: &str) -> AppResult<String> {
    if pem.len() > MAX_CA_BUNDLE_PEM {
        return Err(refuse_bundle(format!("ca_bundle may be at most {MAX_CA_BUNDLE_PEM} bytes of PEM; this one is {}", pem.len())));
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| refuse_bundle(format!("ca_bundle is not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(refuse_bundle("ca_bundle holds no CERTIFICATE block"));
    }
    if certs.len() > MAX_CA_CERTIFICATES {
        return Err(refuse_bundle(format!("ca_bundle may hold at most {MAX_CA_CERTIFICATES} certificates; this one has {}", certs.len())));
    }
    let mut roots = rustls::RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|e| refuse_bundle(format!("ca_bundle's certificate {} cannot anchor trust: {e}", i + 1)))?;
    }
    Ok(pem.trim().to_owned() + "\n")
}
