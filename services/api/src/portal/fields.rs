//! The endpoint form's text fields, read into what the app takes: header
//! lines, the in-flight cap, the rate limit, the event types. The rules
//! themselves are the app's; these only say which field could not be read.

/// `Name: value` lines as pairs; the rules themselves are the app's.
pub(super) fn header_lines(raw: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    for (n, line) in raw.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("custom headers: line {} has no ':' between a name and its value", n + 1));
        };
        pairs.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    Ok(pairs)
}

/// The form's in-flight cap: `None` when left empty.
pub(super) fn in_flight_field(raw: &str) -> Result<Option<u32>, String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(None);
    }
    raw.parse().map(Some).map_err(|_| format!("max requests at once must be a whole number from 1 to 1000, got {:?}", raw))
}

/// The rate limit's two fields: an empty rate is none (the burst then
/// does not matter); an empty burst is the default.
pub(super) fn rate_fields(per_second: &str, burst: &str) -> Result<Option<(u32, u32)>, String> {
    let (per_second, burst) = (per_second.trim(), burst.trim());
    if per_second.is_empty() {
        return Ok(None);
    }
    let rate = per_second
        .parse()
        .map_err(|_| format!("rate limit: requests a second must be a whole number from 1 to 10000, got {per_second:?}"))?;
    let burst = if burst.is_empty() {
        0
    } else {
        burst.parse().map_err(|_| format!("rate limit: burst must be a whole number from 1 to 10000, got {burst:?}"))?
    };
    Ok(Some((rate, burst)))
}

pub(super) fn split_types(raw: &str) -> Vec<String> {
    raw.split([',', '\n', '\r']).map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned).collect()
}
