//! Logging for every Relay service.
//!
//! One rule lives here rather than in each binary: third-party crates that
//! write message bodies into their TRACE events (async-nats prints every
//! message it reads, payload included) are capped at DEBUG, whatever
//! `RELAY_LOG` asks for, so turning logging up never puts a customer's
//! payload into the logs.

use tracing_subscriber::{EnvFilter, fmt};

/// Targets that would log payloads at TRACE.
const PAYLOAD_LOGGERS: &[&str] = &["async_nats=debug"];

/// The filter for a `RELAY_LOG`-style spec (default `info`), with the caps.
pub fn filter(spec: &str) -> EnvFilter {
    let spec = if spec.trim().is_empty() { "info" } else { spec };
    let mut f = EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("info"));
    for cap in PAYLOAD_LOGGERS {
        f = f.add_directive(cap.parse().expect("a valid directive"));
    }
    f
}

/// Installs the process's subscriber: `RELAY_LOG` for the filter,
/// `RELAY_LOG_FORMAT=json` for structured output.
pub fn init() {
    let f = filter(&std::env::var("RELAY_LOG").unwrap_or_default());
    if std::env::var("RELAY_LOG_FORMAT").as_deref() == Ok("json") {
        fmt().json().with_env_filter(f).init();
    } else {
        fmt().with_env_filter(f).init();
    }
}
