//! Which address blocks a webhook may be sent to, as data with their sources.
//!
//! Each row is a block from an IANA registry, with the RFC that defines it and
//! the registry's "Globally Reachable" column; a block not globally reachable
//! is refused. An address is judged by the most specific row containing it,
//! so an exception (192.0.0.9/32, reachable) can sit inside a refused block
//! (192.0.0.0/24). An address no row contains is ordinary global unicast.
//!
//! Every IPv6 form that embeds or translates an IPv4 address is refused
//! outright, whatever IPv4 address it carries, and even where the registry
//! calls the block globally reachable (64:ff9b::/96). Judging such an address
//! by the IPv4 address inside it trusts a choice the attacker made: the
//! network that receives the packet decides where it goes, and a NAT64 or
//! SIIT translator, a 6to4 or Teredo relay, or a dual-stack host reading an
//! IPv4-mapped address as IPv4 may deliver it inside that network, to a
//! host the public-looking embedded address says nothing about. A real
//! receiver is reachable at its own address, so nothing is lost.

use std::net::IpAddr;
use std::sync::OnceLock;

use Registry::{Ipv4Multicast, Ipv4SpecialPurpose, Ipv6AddressSpace, Ipv6SpecialPurpose};
use ipnet::IpNet;

/// The IANA registry a row comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registry {
    /// IANA IPv4 Special-Purpose Address Registry (RFC 6890).
    Ipv4SpecialPurpose,
    /// IANA IPv4 Multicast Address Space Registry (RFC 5771).
    Ipv4Multicast,
    /// IANA IPv6 Special-Purpose Address Registry (RFC 6890).
    Ipv6SpecialPurpose,
    /// IANA Internet Protocol Version 6 Address Space registry (RFC 4291): the
    /// top-level allocations, of which only 2000::/3 is global unicast. Also
    /// cited for the IPv4-embedding forms that its ::/8 reservation holds but
    /// the special-purpose registry has no row for.
    Ipv6AddressSpace,
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// The block, in CIDR notation.
    pub prefix: &'static str,
    /// What an address in the block is, as a refusal names it.
    pub name: &'static str,
    /// The RFCs defining the block.
    pub rfc: &'static str,
    /// Where IANA records the block.
    pub registry: Registry,
    /// The registry's "Globally Reachable" column. A block the registry marks
    /// N/A (Teredo, 6to4, 192.88.99.2) or has no such column for is recorded
    /// as false: what is not known to be reachable is refused.
    pub globally_reachable: bool,
    /// The block carries or translates an IPv4 address, which refuses it
    /// whatever the registry says (see the module documentation).
    pub embeds_ipv4: bool,
}

impl Entry {
    /// Whether a webhook may be sent to an address this row is the most
    /// specific match for.
    pub fn permits(&self) -> bool {
        self.globally_reachable && !self.embeds_ipv4
    }
}

const fn not_global(prefix: &'static str, name: &'static str, rfc: &'static str, registry: Registry) -> Entry {
    Entry { prefix, name, rfc, registry, globally_reachable: false, embeds_ipv4: false }
}

const fn global(prefix: &'static str, name: &'static str, rfc: &'static str, registry: Registry) -> Entry {
    Entry { prefix, name, rfc, registry, globally_reachable: true, embeds_ipv4: false }
}

const fn embeds_ipv4(entry: Entry) -> Entry {
    Entry { embeds_ipv4: true, ..entry }
}

/// The table. Order does not matter: the most specific row wins.
pub const ENTRIES: &[Entry] = &[
    // IANA IPv4 Special-Purpose Address Registry, every row.
    not_global("0.0.0.0/8", "an address on \"this network\"", "RFC 791", Ipv4SpecialPurpose),
    not_global("0.0.0.0/32", "the \"this host on this network\" address", "RFC 1122", Ipv4SpecialPurpose),
    not_global("10.0.0.0/8", "a private-use address", "RFC 1918", Ipv4SpecialPurpose),
    not_global("100.64.0.0/10", "a shared (carrier-grade NAT) address", "RFC 6598", Ipv4SpecialPurpose),
    not_global("127.0.0.0/8", "a loopback address", "RFC 1122", Ipv4SpecialPurpose),
    not_global("169.254.0.0/16", "a link-local (cloud metadata) address", "RFC 3927", Ipv4SpecialPurpose),
    not_global("172.16.0.0/12", "a private-use address", "RFC 1918", Ipv4SpecialPurpose),
    not_global("192.0.0.0/24", "an IETF protocol assignment address", "RFC 6890", Ipv4SpecialPurpose),
    not_global("192.0.0.0/29", "an IPv4 service continuity address", "RFC 7335", Ipv4SpecialPurpose),
    not_global("192.0.0.8/32", "the IPv4 dummy address", "RFC 7600", Ipv4SpecialPurpose),
    global("192.0.0.9/32", "the Port Control Protocol anycast address", "RFC 7723", Ipv4SpecialPurpose),
    global("192.0.0.10/32", "the TURN anycast address", "RFC 8155", Ipv4SpecialPurpose),
    not_global("192.0.0.170/32", "a NAT64/DNS64 discovery address", "RFC 8880, RFC 7050", Ipv4SpecialPurpose),
    not_global("192.0.0.171/32", "a NAT64/DNS64 discovery address", "RFC 8880, RFC 7050", Ipv4SpecialPurpose),
    not_global("192.0.2.0/24", "a documentation address", "RFC 5737", Ipv4SpecialPurpose),
    global("192.31.196.0/24", "an AS112 address", "RFC 7535", Ipv4SpecialPurpose),
    global("192.52.193.0/24", "an AMT address", "RFC 7450", Ipv4SpecialPurpose),
    not_global("192.88.99.0/24", "a deprecated 6to4 relay anycast address", "RFC 7526", Ipv4SpecialPurpose),
    not_global("192.88.99.2/32", "the 6a44 relay anycast address", "RFC 6751", Ipv4SpecialPurpose),
    not_global("192.168.0.0/16", "a private-use address", "RFC 1918", Ipv4SpecialPurpose),
    global("192.175.48.0/24", "an AS112 direct delegation address", "RFC 7534", Ipv4SpecialPurpose),
    not_global("198.18.0.0/15", "a benchmarking address", "RFC 2544", Ipv4SpecialPurpose),
    not_global("198.51.100.0/24", "a documentation address", "RFC 5737", Ipv4SpecialPurpose),
    not_global("203.0.113.0/24", "a documentation address", "RFC 5737", Ipv4SpecialPurpose),
    not_global("240.0.0.0/4", "a reserved address", "RFC 1112", Ipv4SpecialPurpose),
    not_global("255.255.255.255/32", "the limited broadcast address", "RFC 919, RFC 8190", Ipv4SpecialPurpose),
    not_global("224.0.0.0/4", "a multicast address", "RFC 5771", Ipv4Multicast),
    // IANA IPv6 Address Space: everything outside 2000::/3. fc00::/7 and
    // fe80::/10 are taken from the special-purpose registry below.
    not_global("::/8", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    embeds_ipv4(not_global("::/96", "an IPv4-compatible address", "RFC 4291", Ipv6AddressSpace)),
    embeds_ipv4(not_global("::ffff:0:0:0/96", "an IPv4-translated (SIIT) address", "RFC 2765", Ipv6AddressSpace)),
    not_global("100::/8", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("200::/7", "a reserved IPv6 address outside global unicast", "RFC 4048", Ipv6AddressSpace),
    not_global("400::/6", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("800::/5", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("1000::/4", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("4000::/3", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("6000::/3", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("8000::/3", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("a000::/3", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("c000::/3", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("e000::/4", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("f000::/5", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("f800::/6", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("fe00::/9", "a reserved IPv6 address outside global unicast", "RFC 4291", Ipv6AddressSpace),
    not_global("fec0::/10", "a site-local address", "RFC 3879", Ipv6AddressSpace),
    not_global("ff00::/8", "a multicast address", "RFC 4291", Ipv6AddressSpace),
    // IANA IPv6 Special-Purpose Address Registry, every row.
    not_global("::/128", "the unspecified address", "RFC 4291", Ipv6SpecialPurpose),
    not_global("::1/128", "the loopback address", "RFC 4291", Ipv6SpecialPurpose),
    embeds_ipv4(not_global("::ffff:0:0/96", "an IPv4-mapped address", "RFC 4291", Ipv6SpecialPurpose)),
    embeds_ipv4(global("64:ff9b::/96", "a NAT64 (well-known prefix) address", "RFC 6052", Ipv6SpecialPurpose)),
    embeds_ipv4(not_global("64:ff9b:1::/48", "a local-use NAT64 address", "RFC 8215", Ipv6SpecialPurpose)),
    not_global("100::/64", "a discard-only address", "RFC 6666", Ipv6SpecialPurpose),
    not_global("100:0:0:1::/64", "a dummy-prefix address", "RFC 9780", Ipv6SpecialPurpose),
    not_global("2001::/23", "an IETF protocol assignment address", "RFC 2928", Ipv6SpecialPurpose),
    embeds_ipv4(not_global("2001::/32", "a Teredo address", "RFC 4380, RFC 8190", Ipv6SpecialPurpose)),
    global("2001:1::1/128", "the Port Control Protocol anycast address", "RFC 7723", Ipv6SpecialPurpose),
    global("2001:1::2/128", "the TURN anycast address", "RFC 8155", Ipv6SpecialPurpose),
    global("2001:1::3/128", "the DNS-SD service registration protocol anycast address", "RFC 9665", Ipv6SpecialPurpose),
    not_global("2001:2::/48", "a benchmarking address", "RFC 5180", Ipv6SpecialPurpose),
    global("2001:3::/32", "an AMT address", "RFC 7450", Ipv6SpecialPurpose),
    global("2001:4:112::/48", "an AS112 address", "RFC 7535", Ipv6SpecialPurpose),
    not_global("2001:10::/28", "a deprecated ORCHID address", "RFC 4843", Ipv6SpecialPurpose),
    global("2001:20::/28", "an ORCHIDv2 address", "RFC 7343", Ipv6SpecialPurpose),
    global("2001:30::/28", "a drone remote ID (DET) address", "RFC 9374", Ipv6SpecialPurpose),
    not_global("2001:db8::/32", "a documentation address", "RFC 3849", Ipv6SpecialPurpose),
    embeds_ipv4(not_global("2002::/16", "a 6to4 address", "RFC 3056", Ipv6SpecialPurpose)),
    global("2620:4f:8000::/48", "an AS112 direct delegation address", "RFC 7534", Ipv6SpecialPurpose),
    not_global("3fff::/20", "a documentation address", "RFC 9637", Ipv6SpecialPurpose),
    not_global("5f00::/16", "a segment routing (SRv6) SID", "RFC 9602", Ipv6SpecialPurpose),
    not_global("fc00::/7", "a unique-local address", "RFC 4193, RFC 8190", Ipv6SpecialPurpose),
    not_global("fe80::/10", "a link-local address", "RFC 4291", Ipv6SpecialPurpose),
];

/// A row parsed, with the refusal text built once so it can be handed out as
/// `&'static str`.
struct Rule {
    net: IpNet,
    entry: &'static Entry,
    reason: String,
}

/// The rows parsed, most specific first, so the first containing rule is the
/// longest match.
fn rules() -> &'static [Rule] {
    static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
    RULES.get_or_init(|| {
        let mut rules: Vec<Rule> = ENTRIES
            .iter()
            .map(|entry| Rule {
                net: entry.prefix.parse().unwrap_or_else(|_| panic!("special-purpose table: {:?} is not a CIDR block", entry.prefix)),
                entry,
                reason: format!("{} ({}, {})", entry.name, entry.prefix, entry.rfc),
            })
            .collect();
        rules.sort_by_key(|r| std::cmp::Reverse(r.net.prefix_len()));
        rules
    })
}

/// The most specific rule containing `ip`, if any.
fn most_specific(ip: IpAddr) -> Option<&'static Rule> {
    rules().iter().find(|r| r.net.contains(&ip))
}

/// Why the table refuses `ip`, naming the block; `None` if it may be a target.
pub(crate) fn refusal(ip: IpAddr) -> Option<&'static str> {
    most_specific(ip).filter(|r| !r.entry.permits()).map(|r| r.reason.as_str())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::Ipv6Addr;

    use ipnet::Ipv6Net;

    use super::*;

    #[test]
    fn every_entry_parses_as_a_network_and_no_prefix_repeats() {
        let mut seen = HashSet::new();
        for entry in ENTRIES {
            let net: IpNet = entry.prefix.parse().unwrap_or_else(|e| panic!("{}: {e}", entry.prefix));
            assert_eq!(net, net.trunc(), "{} has host bits set", entry.prefix);
            assert!(seen.insert(net), "{} is listed twice", entry.prefix);
        }
        assert_eq!(rules().len(), ENTRIES.len());
    }

    #[test]
    fn rows_refused_outside_ipv6_global_unicast_cover_all_of_it() {
        let global_unicast: Ipv6Net = "2000::/3".parse().unwrap();
        let mut outside = Vec::new();
        for r in rules() {
            if let IpNet::V6(net) = r.net
                && !global_unicast.contains(&net)
            {
                assert!(!r.entry.permits(), "{} is outside 2000::/3 yet permitted", r.entry.prefix);
                outside.push(net);
            }
        }
        outside.push(global_unicast);
        assert_eq!(Ipv6Net::aggregate(&outside), vec![Ipv6Net::new(Ipv6Addr::UNSPECIFIED, 0).unwrap()]);
    }

    #[test]
    fn the_most_specific_row_decides() {
        let cases: [(&str, &str); 6] = [
            ("192.0.0.9", "192.0.0.9/32"),
            ("192.0.0.11", "192.0.0.0/24"),
            ("0.0.0.0", "0.0.0.0/32"),
            ("0.1.2.3", "0.0.0.0/8"),
            ("2001:1::1", "2001:1::1/128"),
            ("2001:1::4", "2001::/23"),
        ];
        for (ip, prefix) in cases {
            assert_eq!(most_specific(ip.parse().unwrap()).map(|r| r.entry.prefix), Some(prefix), "{ip}");
        }
        assert!(most_specific("8.8.8.8".parse().unwrap()).is_none());
    }
}
