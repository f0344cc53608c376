//! Where the platform may send a webhook.
//!
//! A tenant supplies the URL and the platform fetches it, so without these
//! rules the dispatcher is a request-forgery tool pointed at whatever it can
//! reach. The api checks them at registration; the dispatcher checks them again
//! at send time against the addresses it actually connects to.

pub mod special;

use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use url::{Host, Url};

/// What is allowed beyond the production rules. Both allowances exist for the
/// local stack and the tests, which send to receivers on loopback over plain
/// http; a production api refuses to start with either set.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Accept `http://` as well as `https://`.
    pub allow_http: bool,
    /// Address ranges accepted even though the rules block them.
    pub allowed_ranges: Vec<IpNet>,
}

/// Why a production service refuses to start with the dev allowances.
pub const DEV_ALLOWANCES_IN_PRODUCTION: &str = "RELAY_DEV_ALLOW_HTTP_ENDPOINTS / RELAY_DEV_ALLOWED_ENDPOINT_RANGES are development allowances; refusing to start with them in production";

impl Policy {
    /// The policy both services read from `RELAY_DEV_ALLOW_HTTP_ENDPOINTS`
    /// (`allow_http`) and `RELAY_DEV_ALLOWED_ENDPOINT_RANGES` (`ranges`,
    /// comma-separated CIDRs); unset means strict.
    pub fn from_dev_settings(allow_http: Option<&str>, ranges: Option<&str>) -> Result<Self, String> {
        let allow_http = match allow_http.map(str::trim) {
            None | Some("" | "0" | "false" | "off" | "no") => false,
            Some("1" | "true" | "on" | "yes") => true,
            Some(other) => return Err(format!("RELAY_DEV_ALLOW_HTTP_ENDPOINTS must be true or false, got {other:?}")),
        };
        let allowed_ranges = ranges
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|v| {
                v.split(',')
                    .map(|r| r.trim().parse().map_err(|_| format!("RELAY_DEV_ALLOWED_ENDPOINT_RANGES: {r:?} is not a CIDR range")))
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?
            .unwrap_or_default();
        Ok(Self { allow_http, allowed_ranges })
    }

    /// The production policy: https only, no blocked address.
    pub fn strict() -> Self {
        Self::default()
    }

    pub fn is_strict(&self) -> bool {
        !self.allow_http && self.allowed_ranges.is_empty()
    }

    /// Whether the platform may connect to `ip`.
    pub fn permits(&self, ip: IpAddr) -> bool {
        blocked_reason(ip).is_none() || self.allowed_ranges.iter().any(|r| r.contains(&ip))
    }

    /// Checks a URL's form and, where its host is an address literal, the
    /// address. Names are checked by [`Policy::check_addresses`] once resolved.
    pub fn check_url(&self, raw: &str) -> Result<Url, Rejection> {
        let url = Url::parse(raw.trim()).map_err(|e| Rejection::Malformed(e.to_string()))?;
        match url.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            other => return Err(Rejection::Scheme(other.to_owned())),
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Rejection::Credentials);
        }
        // The WHATWG parser has already turned integer, octal and hex IPv4
        // spellings ("2130706433", "0x7f.1", "0177.0.0.1") into an address.
        match url.host() {
            None => return Err(Rejection::Malformed("the URL has no host".into())),
            Some(Host::Ipv4(v4)) => self.check_ip(IpAddr::V4(v4))?,
            Some(Host::Ipv6(v6)) => self.check_ip(IpAddr::V6(v6))?,
            Some(Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if (name == "localhost" || name.ends_with(".localhost")) && !self.permits(IpAddr::V4(Ipv4Addr::LOCALHOST)) {
                    return Err(Rejection::BlockedName(name));
                }
            }
        }
        // No receiver listens on port 0, so say so now rather than fail at
        // every send. `port()` is None for the scheme's default, never 0.
        if let Some(0) = url.port() {
            return Err(Rejection::Port(0));
        }
        Ok(url)
    }

    fn check_ip(&self, ip: IpAddr) -> Result<(), Rejection> {
        match blocked_reason(ip) {
            Some(reason) if !self.permits(ip) => Err(Rejection::BlockedAddress { ip, reason }),
            _ => Ok(()),
        }
    }

    /// Checks every address a name resolved to: one blocked address refuses
    /// the whole name, since the caller cannot choose which one is used.
    pub fn check_addresses(&self, host: &str, addrs: &[IpAddr]) -> Result<(), Rejection> {
        if addrs.is_empty() {
            return Err(Rejection::Unresolvable(host.to_owned()));
        }
        for ip in addrs {
            if let Err(Rejection::BlockedAddress { ip, reason }) = self.check_ip(*ip) {
                return Err(Rejection::ResolvesToBlocked { host: host.to_owned(), ip, reason });
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("url is not a valid absolute URL: {0}")]
    Malformed(String),
    #[error("url must use https, not {0}: a signature protects the body, not the reader")]
    Scheme(String),
    #[error("url must not carry a user name or password")]
    Credentials,
    #[error("url port {0} is not a port a webhook can be sent to")]
    Port(u16),
    #[error("url host {0} is a loopback name")]
    BlockedName(String),
    #[error("url host {ip} is {reason}, which webhooks may not target")]
    BlockedAddress { ip: IpAddr, reason: &'static str },
    #[error("url host {host} resolves to {ip}, {reason}, which webhooks may not target")]
    ResolvesToBlocked { host: String, ip: IpAddr, reason: &'static str },
    #[error("url host {0} does not resolve to any address")]
    Unresolvable(String),
}

/// Why an address may not be a webhook target, naming the block it falls in
/// and the RFC defining it, or `None` if it may be a target. The rules are the
/// table in [`special`].
pub fn blocked_reason(ip: IpAddr) -> Option<&'static str> {
    special::refusal(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict_err(url: &str) -> Rejection {
        Policy::strict().check_url(url).expect_err(url)
    }

    #[test]
    fn refuses_plain_http_and_credentials() {
        assert_eq!(strict_err("http://example.com/hook"), Rejection::Scheme("http".into()));
        assert_eq!(strict_err("https://u:p@example.com/"), Rejection::Credentials);
        assert!(matches!(strict_err("not a url"), Rejection::Malformed(_)));
    }

    #[test]
    fn refuses_every_spelling_of_a_blocked_address() {
        for url in [
            "https://127.0.0.1/",
            "https://2130706433/",
            "https://0x7f.0.0.1/",
            "https://0177.0.0.1/",
            "https://0x7f000001/",
            "https://10.1.2.3/",
            "https://172.31.255.255/",
            "https://192.168.0.1/",
            "https://169.254.169.254/latest/meta-data",
            "https://100.64.0.1/",
            "https://0.0.0.0/",
            "https://255.255.255.255/",
            "https://224.0.0.1/",
            "https://[::1]/",
            "https://[::]/",
            "https://[::ffff:127.0.0.1]/",
            "https://[::ffff:a9fe:a9fe]/",
            "https://[::127.0.0.1]/",
            "https://[64:ff9b::a00:1]/",
            "https://[2002:c0a8:0101::]/",
            "https://[fc00::1]/",
            "https://[fd12:3456::1]/",
            "https://[fe80::1]/",
            "https://[ff02::1]/",
        ] {
            assert!(matches!(strict_err(url), Rejection::BlockedAddress { .. }), "{url} should be blocked");
        }
        for url in ["https://localhost/", "https://LOCALHOST./", "https://api.localhost/"] {
            assert!(matches!(strict_err(url), Rejection::BlockedName(_)), "{url} should be blocked");
        }
    }

    #[test]
    fn refuses_ipv4_embeddings_whatever_they_carry_and_non_global_blocks() {
        for ip in [
            "64:ff9b:1::a00:1",
            "::ffff:0:7f00:1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "2002:5db8:d70e::",
            "64:ff9b::5db8:d70e",
            "::ffff:93.184.215.14",
            "::93.184.215.14",
            "100::1",
            "100:0:0:1::1",
            "3fff::1",
            "5f00::1",
            "2001:2::1",
            "2001:10::1",
            "2001:1::4",
            "fec0::1",
            "4000::1",
            "192.88.99.1",
            "192.0.0.8",
            "192.0.0.170",
            "198.19.255.255",
            "240.0.0.1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(blocked_reason(ip).is_some(), "{ip} should be refused");
            let url = format!("https://{}/", UrlHost(ip));
            assert!(matches!(strict_err(&url), Rejection::BlockedAddress { .. }), "{url} should be refused");
        }
    }

    #[test]
    fn accepts_globally_reachable_addresses_and_exceptions() {
        for ip in [
            "192.0.0.9",
            "192.0.0.10",
            "192.31.196.1",
            "192.52.193.1",
            "192.175.48.1",
            "2001:1::1",
            "2001:3::1",
            "2001:4:112::1",
            "2001:20::1",
            "2620:4f:8000::1",
            "2606:4700::1111",
            "8.8.8.8",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(blocked_reason(ip), None, "{ip} should be allowed");
            let url = format!("https://{}/", UrlHost(ip));
            Policy::strict().check_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// An address as a URL host: IPv6 in brackets.
    struct UrlHost(IpAddr);

    impl std::fmt::Display for UrlHost {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.0 {
                IpAddr::V4(v4) => write!(f, "{v4}"),
                IpAddr::V6(v6) => write!(f, "[{v6}]"),
            }
        }
    }

    #[test]
    fn reasons_name_the_block_and_its_rfc() {
        let reason = |ip: &str| blocked_reason(ip.parse().unwrap());
        assert_eq!(reason("10.1.2.3"), Some("a private-use address (10.0.0.0/8, RFC 1918)"));
        assert_eq!(reason("192.0.0.11"), Some("an IETF protocol assignment address (192.0.0.0/24, RFC 6890)"));
        assert_eq!(reason("::ffff:8.8.8.8"), Some("an IPv4-mapped address (::ffff:0:0/96, RFC 4291)"));
        assert_eq!(reason("2002:808:808::1"), Some("a 6to4 address (2002::/16, RFC 3056)"));
        assert_eq!(
            strict_err("https://169.254.169.254/").to_string(),
            "url host 169.254.169.254 is a link-local (cloud metadata) address (169.254.0.0/16, RFC 3927), which webhooks may not target"
        );
    }

    #[test]
    fn refuses_port_zero() {
        assert_eq!(strict_err("https://example.com:0/"), Rejection::Port(0));
        assert_eq!(strict_err("https://93.184.215.14:0/hook"), Rejection::Port(0));
        assert_eq!(Rejection::Port(0).to_string(), "url port 0 is not a port a webhook can be sent to");
        let dev = Policy { allow_http: true, allowed_ranges: vec!["127.0.0.0/8".parse().unwrap()] };
        assert_eq!(dev.check_url("http://127.0.0.1:0/"), Err(Rejection::Port(0)));
        Policy::strict().check_url("https://example.com:443/").unwrap();
        Policy::strict().check_url("https://example.com:8443/").unwrap();
    }

    #[test]
    fn accepts_public_hosts() {
        for url in ["https://example.com/hook", "https://93.184.215.14/x", "https://[2606:4700::1111]/", "https://172.32.0.1/"] {
            Policy::strict().check_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    #[test]
    fn resolved_names_are_refused_if_any_address_is_blocked() {
        let p = Policy::strict();
        let public: IpAddr = "93.184.215.14".parse().unwrap();
        let meta: IpAddr = "169.254.169.254".parse().unwrap();
        p.check_addresses("ok.example", &[public]).unwrap();
        assert!(matches!(p.check_addresses("evil.example", &[public, meta]), Err(Rejection::ResolvesToBlocked { .. })));
        assert!(matches!(p.check_addresses("none.example", &[]), Err(Rejection::Unresolvable(_))));
    }

    #[test]
    fn dev_settings_parse_or_name_the_mistake() {
        assert!(Policy::from_dev_settings(None, None).unwrap().is_strict());
        let p = Policy::from_dev_settings(Some("true"), Some("127.0.0.0/8, ::1/128")).unwrap();
        assert!(p.allow_http && p.allowed_ranges.len() == 2);
        assert!(Policy::from_dev_settings(Some("maybe"), None).unwrap_err().contains("RELAY_DEV_ALLOW_HTTP_ENDPOINTS"));
        assert!(Policy::from_dev_settings(None, Some("10.0.0.0/99")).unwrap_err().contains("is not a CIDR range"));
    }

    #[test]
    fn dev_allowances_are_explicit_and_narrow() {
        let dev = Policy { allow_http: true, allowed_ranges: vec!["127.0.0.0/8".parse().unwrap()] };
        assert!(!dev.is_strict());
        dev.check_url("http://127.0.0.1:9000/hook").unwrap();
        dev.check_url("http://localhost:9000/hook").unwrap();
        assert!(matches!(dev.check_url("http://10.0.0.1/"), Err(Rejection::BlockedAddress { .. })));
        assert!(matches!(dev.check_url("http://169.254.169.254/"), Err(Rejection::BlockedAddress { .. })));
    }
}

/// Name resolution, injectable so tests can control what a name resolves to
/// (and change it between registration and send time, as a rebinding
/// attacker would).
pub trait Resolve: Send + Sync + std::fmt::Debug {
    fn lookup(&self, host: &str) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Vec<IpAddr>>> + Send + '_>>;
}

/// The system resolver.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn lookup(&self, host: &str) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Vec<IpAddr>>> + Send + '_>> {
        let host = host.to_owned();
        Box::pin(async move { Ok(tokio::net::lookup_host((host.as_str(), 0)).await?.map(|a| a.ip()).collect()) })
    }
}

/// A resolver answering from a table, counting lookups; for tests.
#[derive(Debug, Default)]
pub struct StaticResolver {
    table: std::sync::Mutex<std::collections::HashMap<String, Vec<IpAddr>>>,
    lookups: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

impl StaticResolver {
    /// Sets (or replaces) what `host` resolves to.
    pub fn set(&self, host: &str, addrs: &[IpAddr]) {
        self.table.lock().expect("not poisoned").insert(host.to_ascii_lowercase(), addrs.to_vec());
    }

    /// How many times `host` was looked up.
    pub fn lookups(&self, host: &str) -> usize {
        self.lookups.lock().expect("not poisoned").get(&host.to_ascii_lowercase()).copied().unwrap_or(0)
    }
}

impl Resolve for StaticResolver {
    fn lookup(&self, host: &str) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Vec<IpAddr>>> + Send + '_>> {
        let host = host.to_ascii_lowercase();
        *self.lookups.lock().expect("not poisoned").entry(host.clone()).or_default() += 1;
        let found = self.table.lock().expect("not poisoned").get(&host).cloned();
        Box::pin(
            async move { found.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} is not in the table"))) },
        )
    }
}
