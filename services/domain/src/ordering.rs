//! Ordering keys: an event may name one, and the events of one key in one
//! environment have a publish order — the order in which the api accepted
//! them, numbered from 1 without gaps (the event's `ordering_sequence`). A
//! publish takes its keys' locks before writing its events and holds them
//! until it commits, so a key's numbers are also its commit order and its
//! outbox order, and an event's predecessors are committed before it.

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
