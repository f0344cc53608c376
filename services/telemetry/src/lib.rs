//! Logging for every Relay service.
//!
//! One rule lives here rather than in each binary: third-party crates that
//! write message bodies into their TRACE events (async-nats prints every
//! message it reads, payload included) are capped at DEBUG, whatever
//! `RELAY_LOG` asks for, so turning logging up never puts a customer's
//! payload into the logs.

use tracing_subscriber::{EnvFilter, fmt};

/// Targets that would log payloads at TRACE.
const PAYLOAD_LOGGERS: &[&str] = &["async_nats"];

/// The filter for a `RELAY_LOG`-style spec (default `info`), with the caps:
/// where the spec would let a payload logger reach TRACE (a global `trace`,
/// or that target at `trace`), it is held at DEBUG instead. A spec that does
/// not reach TRACE is left exactly as written.
pub fn filter(spec: &str) -> EnvFilter {
    let spec = if spec.trim().is_empty() { "info" } else { spec };
    let mut f = EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("info"));
    let directives: Vec<&str> = spec.split(',').map(str::trim).collect();
    let global_trace = directives.iter().any(|d| d.eq_ignore_ascii_case("trace"));
    for target in PAYLOAD_LOGGERS {
        let target_trace = directives.iter().any(|d| d.starts_with(target) && d.to_ascii_lowercase().ends_with("=trace"));
        if global_trace || target_trace {
            f = f.add_directive(format!("{target}=debug").parse().expect("a valid directive"));
        }
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

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn payload_loggers_are_capped_only_where_trace_would_reach_them() {
        assert!(filter("trace").to_string().contains("async_nats=debug"));
        assert!(filter("info,async_nats=trace").to_string().contains("async_nats=debug"));
        assert!(!filter("warn").to_string().contains("async_nats"), "a quiet spec stays quiet");
        assert!(!filter("relay_api=trace").to_string().contains("async_nats"));
    }
}
