//! An endpoint's sealed values (signing secrets, custom headers, a client
//! key, OAuth2 credentials): how they are stored, and moving them all to the
//! key ring's active key. Reads never return a ciphertext.

use relay_domain::EndpointId;
use sqlx::PgConnection;

use crate::error::AppResult;

/// A value sealed under a key id (custom headers as JSON pairs, a client
/// certificate and key as one PEM text, OAuth2 credentials as JSON), and
/// what reads show of it (masked values, a certificate's subject, OAuth2
/// without its secret).
pub struct Sealed {
    pub key_id: String,
    pub ciphertext: Vec<u8>,
    pub shown: serde_json::Value,
}

/// An endpoint's stored secrets, for re-encryption under another key.
pub struct StoredSecrets {
    pub id: EndpointId,
    pub secret_key_id: String,
    pub secret_ciphertext: Vec<u8>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub headers_key_id: Option<String>,
    pub headers_ciphertext: Option<Vec<u8>>,
    pub client_tls_key_id: Option<String>,
    pub client_tls_ciphertext: Option<Vec<u8>>,
    pub oauth2_key_id: Option<String>,
    pub oauth2_ciphertext: Option<Vec<u8>>,
}

/// Up to 100 endpoints with a secret, custom headers, a client key or OAuth2 credentials not under
/// `active_key_id`, locked.
pub async fn lock_not_under_key(tx: &mut PgConnection, active_key_id: &str) -> AppResult<Vec<StoredSecrets>> {
    Ok(sqlx::query_as!(
        StoredSecrets,
        "SELECT id, secret_key_id, secret_ciphertext, previous_secret_key_id, previous_secret_ciphertext, headers_key_id, headers_ciphertext,
                client_tls_key_id, client_tls_ciphertext, oauth2_key_id, oauth2_ciphertext
         FROM webhook_endpoints
         WHERE secret_key_id <> $1 OR (previous_secret_key_id IS NOT NULL AND previous_secret_key_id <> $1)
            OR (headers_key_id IS NOT NULL AND headers_key_id <> $1)
            OR (client_tls_key_id IS NOT NULL AND client_tls_key_id <> $1)
            OR (oauth2_key_id IS NOT NULL AND oauth2_key_id <> $1)
         ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
        active_key_id,
    )
    .fetch_all(&mut *tx)
    .await?)
}

pub async fn store_secrets(
    tx: &mut PgConnection,
    id: EndpointId,
    current: (&str, &[u8]),
    previous: Option<(&str, &[u8])>,
    headers: Option<(&str, &[u8])>,
    client_tls: Option<(&str, &[u8])>,
    oauth2: Option<(&str, &[u8])>,
) -> AppResult<()> {
    sqlx::query!(
        "UPDATE webhook_endpoints SET secret_key_id = $2, secret_ciphertext = $3,
           previous_secret_key_id = $4, previous_secret_ciphertext = $5, headers_key_id = $6, headers_ciphertext = $7,
           client_tls_key_id = $8, client_tls_ciphertext = $9, oauth2_key_id = $10, oauth2_ciphertext = $11 WHERE id = $1",
        id as _,
        current.0,
        current.1,
        previous.map(|p| p.0),
        previous.map(|p| p.1),
        headers.map(|h| h.0),
        headers.map(|h| h.1),
        client_tls.map(|t| t.0),
        client_tls.map(|t| t.1),
        oauth2.map(|o| o.0),
        oauth2.map(|o| o.1),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}
