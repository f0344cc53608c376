//! Custom headers a tenant asks Relay to send with every delivery to one
//! endpoint (a partner id, a static credential the receiver's gateway
//! checks). The rules for what may be asked for, and how a stored value is
//! shown again.
//!
//! Invariants: at most [`MAX_HEADERS`] pairs of at most [`MAX_HEADERS_BYTES`]
//! in all; each name an RFC 9110 token, unique regardless of case, and none
//! that frames the request or that Relay signs or sets itself; each value
//! printable ASCII without leading or trailing blanks, so no value can end a
//! header line (CR/LF) or smuggle another. A value is often a credential:
//! `Debug` shows names only, and reads show it masked ([`mask`]).

use std::fmt;

/// Pairs an endpoint may carry, at most.
pub const MAX_HEADERS: usize = 20;
/// Names and values together, in bytes, at most.
pub const MAX_HEADERS_BYTES: usize = 4096;
/// How many leading characters of a value a read shows.
pub const SHOWN_PREFIX: usize = 4;

/// Names that frame or route the request, or that the HTTP client and
/// Relay set themselves: a copy from the tenant would change what the
/// receiver parses, or what it verifies.
const REFUSED: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "user-agent",
];
/// Prefixes of names that are Relay's signature headers (under every
/// scheme) or speak to a proxy.
const REFUSED_PREFIXES: &[&str] = &["relay-webhook-", "webhook-", "proxy-"];

/// Why a set of headers was refused, naming the header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HeaderRefusal(pub String);

/// An endpoint's custom headers, valid by construction, in the order given.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct CustomHeaders(Vec<(String, String)>);

impl fmt::Debug for CustomHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CustomHeaders").field(&self.0.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()).finish()
    }
}

fn is_tchar(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// A shown prefix of `s`, bounded, for messages (the value itself may be a
/// credential: messages quote names, never values).
fn shown_name(s: &str) -> String {
    let head: String = s.chars().take(40).flat_map(char::escape_default).collect();
    if s.chars().count() > 40 { format!("\"{head}…\"") } else { format!("\"{head}\"") }
}

impl CustomHeaders {
    /// Checks every pair; the first mistake is named.
    pub fn parse(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, HeaderRefusal> {
        let pairs: Vec<(String, String)> = pairs.into_iter().collect();
        if pairs.len() > MAX_HEADERS {
            return Err(HeaderRefusal(format!("headers may hold at most {MAX_HEADERS} pairs; got {}", pairs.len())));
        }
        let total: usize = pairs.iter().map(|(n, v)| n.len() + v.len()).sum();
        if total > MAX_HEADERS_BYTES {
            return Err(HeaderRefusal(format!("headers may hold at most {MAX_HEADERS_BYTES} bytes of names and values; got {total}")));
        }
        let mut seen: Vec<String> = Vec::with_capacity(pairs.len());
        for (name, value) in &pairs {
            if name.is_empty() || !name.chars().all(is_tchar) {
                return Err(HeaderRefusal(format!(
                    "header name {} is not a token: letters, digits and !#$%&'*+-.^_`|~ only",
                    shown_name(name)
                )));
            }
            let lower = name.to_ascii_lowercase();
            if REFUSED.contains(&lower.as_str()) || REFUSED_PREFIXES.iter().any(|p| lower.starts_with(p)) {
                return Err(HeaderRefusal(format!(
                    "header {name} is set by Relay or the HTTP connection and cannot be sent as a custom header"
                )));
            }
            if seen.contains(&lower) {
                return Err(HeaderRefusal(format!("header {name} is given twice (names are case-insensitive)")));
            }
            if let Some(at) = value.chars().position(|c| !(c == ' ' || c == '\t' || c.is_ascii_graphic())) {
                return Err(HeaderRefusal(format!(
                    "the value of header {name} holds a character that is not printable ASCII at position {at} (control characters such as CR and LF are refused)"
                )));
            }
            if value.is_empty() || value.trim() != value {
                return Err(HeaderRefusal(format!("the value of header {name} is empty or begins or ends with a blank")));
            }
            seen.push(lower);
        }
        Ok(Self(pairs))
    }

    pub fn pairs(&self) -> &[(String, String)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs with their values masked, as reads show them.
    pub fn masked(&self) -> Vec<(String, String)> {
        self.0.iter().map(|(n, v)| (n.clone(), mask(v))).collect()
    }
}

/// A value as reads show it: its first [`SHOWN_PREFIX`] characters, and
/// never more than half of it, then `…`.
pub fn mask(value: &str) -> String {
    let shown = SHOWN_PREFIX.min(value.chars().count() / 2);
    let head: String = value.chars().take(shown).collect();
    format!("{head}…")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str, value: &str) -> Result<CustomHeaders, HeaderRefusal> {
        CustomHeaders::parse([(name.to_owned(), value.to_owned())])
    }

    #[test]
    fn acceptable_headers_keep_their_order_and_debug_shows_names_only() {
        let h =
            CustomHeaders::parse([("X-Partner-Id".into(), "acme".into()), ("Authorization".into(), "Bearer s3cr3t-token".into())]).unwrap();
        assert_eq!(h.pairs()[0].0, "X-Partner-Id");
        assert_eq!(format!("{h:?}"), r#"CustomHeaders(["X-Partner-Id", "Authorization"])"#);
        assert_eq!(h.masked(), vec![("X-Partner-Id".into(), "ac…".into()), ("Authorization".into(), "Bear…".into())]);
    }

    #[test]
    fn framing_signing_and_injected_headers_are_refused_by_name() {
        for name in [
            "Host",
            "content-length",
            "Transfer-Encoding",
            "Connection",
            "relay-webhook-signature",
            "Webhook-Id",
            "Proxy-Authorization",
            "User-Agent",
            "Content-Type",
        ] {
            let e = one(name, "x").unwrap_err();
            assert!(e.0.contains(name), "{e}");
        }
        assert!(one("X-A", "ok\r\nX-Injected: 1").unwrap_err().0.contains("position 2"));
        assert!(one("X-A", "caf\u{e9}").is_err());
        assert!(one("X A", "v").unwrap_err().0.contains("not a token"));
        assert!(one("X-A:", "v").is_err());
        assert!(one("X-A", "").is_err());
        assert!(one("X-A", " padded").is_err());
        let twice = CustomHeaders::parse([("X-A".into(), "1".into()), ("x-a".into(), "2".into())]).unwrap_err();
        assert!(twice.0.contains("twice"), "{twice}");
    }

    #[test]
    fn counts_and_sizes_are_bounded() {
        let many = (0..=MAX_HEADERS).map(|i| (format!("X-{i}"), "v".to_owned()));
        assert!(CustomHeaders::parse(many).unwrap_err().0.contains("at most 20 pairs; got 21"));
        let big = one("X-Big", &"v".repeat(MAX_HEADERS_BYTES)).unwrap_err();
        assert!(big.0.contains("4096 bytes"), "{big}");
    }

    #[test]
    fn masks_never_show_more_than_half_or_four_characters() {
        assert_eq!(mask("abc"), "a…");
        assert_eq!(mask("ab"), "a…");
        assert_eq!(mask("a"), "…");
        assert_eq!(mask("longer-secret"), "long…");
    }
}
