//! A test PKI for receivers over HTTPS: a CA the endpoints pin, a server
//! certificate for 127.0.0.1 signed by it, client certificates the
//! dispatcher presents (one the receiver trusts, one from a stranger CA, one
//! expired), and the rustls server configuration a TLS receiver runs with.

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
use rustls::{
    RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};

use super::*;

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct PemPair {
    pub cert: String,
    pub key: String,
}

pub struct TestPki {
    /// The CA that signed the server and the trusted client.
    pub ca: String,
    pub server: PemPair,
    /// Signed by `ca`: the receiver accepts it.
    pub client: PemPair,
    /// Signed by another CA: the receiver refuses it.
    pub stranger: PemPair,
    /// Signed by `ca`, expired in 2021: Relay refuses it at upload.
    pub expired: PemPair,
}

fn ca(name: &str) -> Result<(CertificateParams, KeyPair, String)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let pem = p.self_signed(&key)?.pem();
    Ok((p, key, pem))
}

fn leaf(issuer: &Issuer<'_, &KeyPair>, cn: &str, server: bool, expired: bool) -> Result<PemPair> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    if server {
        p.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse()?), SanType::DnsName("localhost".try_into()?)];
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth }];
    if expired {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let cert = p.signed_by(&key, issuer)?;
    Ok(PemPair { cert: cert.pem(), key: key.serialize_pem() })
}

impl TestPki {
    pub fn new() -> Result<Self> {
        let (ca_params, ca_key, ca_pem) = ca("Relay test receivers CA")?;
        let issuer = Issuer::new(ca_params, &ca_key);
        let (other_params, other_key, _) = ca("A stranger CA")?;
        let other = Issuer::new(other_params, &other_key);
        Ok(TestPki {
            ca: ca_pem,
            server: leaf(&issuer, "receiver.test", true, false)?,
            client: leaf(&issuer, "acme-dispatch", false, false)?,
            stranger: leaf(&other, "not-acme", false, false)?,
            expired: leaf(&issuer, "acme-old", false, true)?,
        })
    }

    /// The receiver's TLS: its server certificate, and when `require_client`
    /// a client certificate signed by the CA, without which the handshake
    /// fails.
    pub fn server_config(&self, require_client: bool) -> Result<Arc<ServerConfig>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(self.server.cert.as_bytes()).collect::<Result<_, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(self.server.key.as_bytes())?;
        let builder = ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = if require_client {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(self.ca.as_bytes()) {
                roots.add(c?)?;
            }
            builder.with_client_cert_verifier(WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// One test PKI for the whole test process: every stack's dispatchers trust
/// its CA (`RELAY_RECEIVER_CA_FILE`), so any receiver may answer over HTTPS.
pub fn shared_pki() -> &'static TestPki {
    static PKI: std::sync::LazyLock<TestPki> = std::sync::LazyLock::new(|| TestPki::new().expect("a test PKI"));
    &PKI
}

/// The shared PKI's CA, as a PEM file (written once per test process).
pub fn shared_ca_file() -> &'static PathBuf {
    static FILE: std::sync::LazyLock<PathBuf> = std::sync::LazyLock::new(|| {
        let path = std::env::temp_dir().join(format!("relay-test-receiver-ca-{}.pem", std::process::id()));
        std::fs::write(&path, &shared_pki().ca).expect("writing the test receivers' CA");
        path
    });
    &FILE
}
