//! An endpoint's client certificates (mutual TLS towards its receiver), and
//! how a new one replaces the old: like a signing secret, with an overlap.
//!
//! A TLS handshake presents one certificate, so the overlap cannot mean
//! "both at once" as it does for signatures. It means: for
//! [`ROTATION_WINDOW`] after a change, the certificate that was replaced
//! stays sealed beside the new one, and an attempt whose receiver refuses the
//! new one in the handshake presents the previous one instead. A receiver
//! that has not yet learnt to trust the new certificate keeps receiving while
//! its operators catch up; once the window ends (or the tenant ends it), only
//! the new certificate is presented.
//!
//! What is sealed is one text: the current identity's PEM (certificate chain
//! and key) alone, as before rotation existed, or a JSON object holding both
//! identities and the end of the overlap. Rows sealed before rotation read
//! as an identity with no previous one.

use crate::{Timestamp, signing::ROTATION_WINDOW};

/// The identities sealed for one endpoint. `Debug` redacts the keys.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentities {
    /// The certificate chain and key presented first, one PEM text.
    pub current: String,
    /// The identity `current` replaced, and until when it is presented.
    pub previous: Option<(String, Timestamp)>,
}

impl std::fmt::Debug for ClientIdentities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentities")
            .field("current", &"[redacted]")
            .field("previous_until", &self.previous.as_ref().map(|(_, until)| until))
            .finish()
    }
}

/// Sealed text that is neither PEM nor the JSON form.
#[derive(Debug, thiserror::Error)]
#[error("a sealed client identity that is neither PEM nor its JSON form: {0}")]
pub struct UnreadableIdentity(String);

impl ClientIdentities {
    /// One identity, no overlap.
    pub fn single(pem: String) -> Self {
        Self { current: pem, previous: None }
    }

    /// `new` replaces the current identity; the current one is presented as
    /// the fallback until `now` + [`ROTATION_WINDOW`] (a previous one of an
    /// earlier change is dropped: one overlap at a time).
    pub fn rotated(self, new: String, now: Timestamp) -> Self {
        let until = now + chrono::Duration::from_std(ROTATION_WINDOW).expect("24 h fits");
        Self { current: new, previous: Some((self.current, until)) }
    }

    /// The overlap ended: only the current identity.
    pub fn without_previous(self) -> Self {
        Self::single(self.current)
    }

    /// The previous identity if its overlap still lasts at `now`.
    pub fn previous_at(&self, now: Timestamp) -> Option<&str> {
        self.previous.as_ref().filter(|(_, until)| now < *until).map(|(pem, _)| pem.as_str())
    }

    /// The text to seal: the PEM alone when there is no previous identity
    /// (the form rows had before rotation), otherwise JSON.
    pub fn encode(&self) -> String {
        match &self.previous {
            None => self.current.clone(),
            Some((previous, until)) => serde_json::json!({
                "current": self.current,
                "previous": previous,
                "previous_until": until.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            })
            .to_string(),
        }
    }

    /// Reads what [`encode`](Self::encode) wrote (or a row sealed before
    /// rotation existed: PEM alone).
    pub fn decode(sealed: &str) -> Result<Self, UnreadableIdentity> {
        if !sealed.trim_start().starts_with('{') {
            return Ok(Self::single(sealed.to_owned()));
        }
        let value: serde_json::Value = serde_json::from_str(sealed).map_err(|e| UnreadableIdentity(e.to_string()))?;
        let text = |field: &str| {
            value[field].as_str().map(str::to_owned).ok_or_else(|| UnreadableIdentity(format!("{field} is missing or not a string")))
        };
        let until = chrono::DateTime::parse_from_rfc3339(&text("previous_until")?)
            .map_err(|e| UnreadableIdentity(format!("previous_until: {e}")))?
            .with_timezone(&chrono::Utc);
        Ok(Self { current: text("current")?, previous: Some((text("previous")?, until)) })
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn at(secs: i64) -> Timestamp {
        chrono::Utc.timestamp_opt(1_800_000_000 + secs, 0).single().expect("valid")
    }

    #[test]
    fn a_row_sealed_before_rotation_reads_as_one_identity_and_writes_back_the_same() {
        let pem =
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nMC4\n-----END PRIVATE KEY-----\n";
        let read = ClientIdentities::decode(pem).expect("PEM reads");
        assert_eq!(read, ClientIdentities::single(pem.to_owned()));
        assert_eq!(read.encode(), pem, "no previous: the sealed text stays plain PEM");
    }

    #[test]
    fn the_previous_identity_is_presented_for_exactly_the_window_and_survives_sealing() {
        let rotated = ClientIdentities::single("old".into()).rotated("new".into(), at(0));
        let read = ClientIdentities::decode(&rotated.encode()).expect("JSON reads");
        assert_eq!(read, rotated);
        assert_eq!(read.current, "new");
        assert_eq!(read.previous_at(at(0)), Some("old"));
        assert_eq!(read.previous_at(at(24 * 3600 - 1)), Some("old"));
        assert_eq!(read.previous_at(at(24 * 3600)), None, "the window is 24 h, end excluded");
        // A second change inside the window: its fallback is the identity it
        // replaced, never the one before.
        let again = read.rotated("newer".into(), at(60));
        assert_eq!((again.current.as_str(), again.previous_at(at(60))), ("newer", Some("new")));
        assert_eq!(again.without_previous(), ClientIdentities::single("newer".into()));
    }

    #[test]
    fn sealed_text_that_is_neither_form_is_refused_not_guessed() {
        for bad in ["{", "{\"current\": \"x\"}", "{\"current\": \"x\", \"previous\": \"y\", \"previous_until\": \"soon\"}"] {
            assert!(ClientIdentities::decode(bad).is_err(), "{bad}");
        }
        let debug = format!("{:?}", ClientIdentities::single("-----BEGIN PRIVATE KEY-----".into()));
        assert!(!debug.contains("PRIVATE"), "{debug}");
    }
}
