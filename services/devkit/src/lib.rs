//! Developer tools: a throwaway certificate authority for the internal mTLS
//! port, and a receiver that verifies and prints webhooks.

use std::{fs, path::Path};

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
use relay_contracts::identity;

/// A PEM certificate and its private key.
#[derive(Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pem { key: [redacted] }")
    }
}

/// A dev CA and the certificates the local stack and the tests need.
#[derive(Debug, Clone)]
pub struct DevPki {
    pub ca: Pem,
    /// The api's internal port: DNS `relay-api` and `localhost`, IP 127.0.0.1.
    pub api: Pem,
    /// Carries the dispatcher's platform identity.
    pub dispatcher: Pem,
    /// Carries an operator identity (`…/operator/dev`).
    pub operator: Pem,
}

/// The name the dispatcher checks the api's certificate against.
pub const API_TLS_NAME: &str = "relay-api";

fn leaf(issuer: &Issuer<'_, &KeyPair>, cn: &str, sans: Vec<SanType>, server: bool) -> Result<Pem> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.subject_alt_names = sans;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth }];
    let cert = p.signed_by(&key, issuer)?;
    Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
}

pub fn generate_pki() -> Result<DevPki> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "Relay development CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let ca_pem = Pem { cert: ca_cert.pem(), key: ca_key.serialize_pem() };
    let issuer = Issuer::new(ca, &ca_key);
    let uri = |u: String| -> Result<SanType> { Ok(SanType::URI(u.try_into()?)) };
    Ok(DevPki {
        api: leaf(
            &issuer,
            "relay-api",
            vec![
                SanType::DnsName(API_TLS_NAME.try_into()?),
                SanType::DnsName("localhost".try_into()?),
                SanType::IpAddress("127.0.0.1".parse()?),
            ],
            true,
        )?,
        dispatcher: leaf(&issuer, "relay-dispatcher", vec![uri(identity::DISPATCHER.to_owned())?], false)?,
        operator: leaf(&issuer, "relay-operator", vec![uri(format!("{}dev", identity::OPERATOR_PREFIX))?], false)?,
        ca: ca_pem,
    })
}

impl DevPki {
    /// Writes `ca.pem`, and `<name>.pem` / `<name>-key.pem` for api,
    /// dispatcher and operator, into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::write(dir.join("ca.pem"), &self.ca.cert)?;
        for (name, pem) in [("api", &self.api), ("dispatcher", &self.dispatcher), ("operator", &self.operator)] {
            fs::write(dir.join(format!("{name}.pem")), &pem.cert)?;
            fs::write(dir.join(format!("{name}-key.pem")), &pem.key)?;
        }
        Ok(())
    }
}
