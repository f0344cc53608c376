//! Ordering keys: an event may name one, and the events of one key in one
//! environment have a publish order — the order in which the api accepted
//! them, numbered from 1 without gaps (the event's `ordering_sequence`). A
//! publish takes its keys' locks before writing its events and holds them
//! until it commits, so a key's numbers are also its commit order and its
//! outbox order, and an event's predecessors are committed before it.

/// How an endpoint orders its deliveries (`webhook_endpoints.ordering`).
///
/// Under [`Ordering::PerKey`] the deliveries of one ordering key to the
/// endpoint form a lane: at most one of them (the head) is pending or held,
/// and the next is promoted only when it has ended, delivered or dead. A
/// dead head lets the key move on rather than block it for ever: a receiver
/// waiting for one event must not stop receiving every later one, and the
/// dead letter stays replayable (a replay joins the lane's tail). Events
/// without a key, and endpoints without ordering, are unordered. Decided
/// when a delivery is created, so a change applies to deliveries created
/// after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(type_name = "text", rename_all = "snake_case"))]
pub enum Ordering {
    #[default]
    None,
    PerKey,
}

impl Ordering {
    pub const ALL: [Self; 2] = [Self::None, Self::PerKey];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::PerKey => "per_key",
        }
    }

    /// The ordering a request names; the message says which ones exist.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|o| o.as_str() == name).ok_or_else(|| {
            let shown: String = name.chars().take(40).flat_map(char::escape_default).collect();
            format!("ordering must be \"none\" or \"per_key\"; got \"{shown}\"")
        })
    }
}

/// The longest ordering key, in bytes of UTF-8.
pub const MAX_ORDERING_KEY_BYTES: usize = 256;

/// Checks an ordering key as published: 1–256 bytes, no control characters
/// (a key is an id a receiver reads back, never a carrier of line breaks or
/// NULs). Empty means none, and is not checked here.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.len() > MAX_ORDERING_KEY_BYTES {
        return Err(format!("ordering_key may be at most {MAX_ORDERING_KEY_BYTES} bytes of UTF-8; this one is {}", key.len()));
    }
    if let Some((at, c)) = key.char_indices().find(|(_, c)| c.is_control()) {
        return Err(format!("ordering_key may not hold control characters; byte {at} is U+{:04X}", c as u32));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orderings_parse_by_name_only() {
        for o in Ordering::ALL {
            assert_eq!(Ordering::parse(o.as_str()), Ok(o));
        }
        let e = Ordering::parse("PER_KEY\n").unwrap_err();
        assert!(e.contains("per_key") && e.contains("PER_KEY\\n"), "{e}");
    }

    #[test]
    fn keys_are_bounded_and_hold_no_control_characters() {
        assert!(check_key("order-42").is_ok());
        assert!(check_key(&"é".repeat(128)).is_ok(), "256 bytes of UTF-8");
        let long = check_key(&"k".repeat(257)).unwrap_err();
        assert!(long.contains("256") && long.contains("257"), "{long}");
        for (bad, at) in [("a\nb", "byte 1 is U+000A"), ("\u{0}", "byte 0 is U+0000"), ("ü\u{7f}", "byte 2 is U+007F")] {
            let e = check_key(bad).unwrap_err();
            assert!(e.contains(at), "{bad:?}: {e}");
        }
    }
}
