//! Properties of the address rules over many addresses, checked against
//! expectations written independently of the table in `special`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;
use relay_netguard::{Policy, Rejection, blocked_reason};

/// The IPv4 refusals restated as octet conditions, so a mistyped table row
/// shows up as a disagreement.
fn refused_by_octets(ip: Ipv4Addr) -> bool {
    match ip.octets() {
        [0 | 10 | 127, ..] => true,
        [100, 64..=127, ..] => true,
        [169, 254, ..] => true,
        [172, 16..=31, ..] => true,
        [192, 0, 0, 9 | 10] => false,
        [192, 0, 0 | 2, _] => true,
        [192, 88, 99, _] => true,
        [192, 168, ..] => true,
        [198, 18 | 19, ..] => true,
        [198, 51, 100, _] | [203, 0, 113, _] => true,
        // Multicast, reserved, limited broadcast.
        [224..=255, ..] => true,
        _ => false,
    }
}

/// The /24s where blocks begin or end, or that hold /24 and /32 rows.
const EDGE_SLASH_24S: &[[u8; 3]] = &[
    [0, 0, 0],
    [10, 0, 0],
    [100, 64, 0],
    [100, 127, 255],
    [127, 0, 0],
    [169, 254, 169],
    [172, 16, 0],
    [172, 31, 255],
    [192, 0, 0],
    [192, 0, 2],
    [192, 31, 196],
    [192, 52, 193],
    [192, 88, 99],
    [192, 168, 0],
    [192, 175, 48],
    [198, 18, 0],
    [198, 19, 255],
    [198, 51, 100],
    [203, 0, 113],
    [224, 0, 0],
    [239, 255, 255],
    [255, 255, 255],
];

/// `[a, b, c]` with `c` stepped by `shift`, carrying into `b` and `a`, so a
/// step can leave the block as well as stay in it.
fn step_slash_24([a, b, c]: [u8; 3], shift: i32) -> [u8; 3] {
    let [_, a, b, c] = (u32::from_be_bytes([0, a, b, c]).wrapping_add_signed(shift) & 0xff_ffff).to_be_bytes();
    [a, b, c]
}

#[test]
fn every_address_around_the_finely_divided_blocks_follows_the_octet_rules() {
    // Exhaustive where the /32 rows are, which random draws would rarely hit.
    for &block in EDGE_SLASH_24S {
        for shift in -1..=1 {
            let [a, b, c] = step_slash_24(block, shift);
            for d in 0..=255 {
                let ip = Ipv4Addr::new(a, b, c, d);
                assert_eq!(blocked_reason(IpAddr::V4(ip)).is_some(), refused_by_octets(ip), "{ip}");
            }
        }
    }
}

/// Uniform addresses, and addresses in and next to the edge /24s.
fn ipv4_near_special_blocks() -> impl Strategy<Value = Ipv4Addr> {
    prop_oneof![
        any::<u32>().prop_map(Ipv4Addr::from),
        (prop::sample::select(EDGE_SLASH_24S), -1..=1, any::<u8>()).prop_map(|(block, shift, d)| {
            let [a, b, c] = step_slash_24(block, shift);
            Ipv4Addr::new(a, b, c, d)
        }),
    ]
}

/// Addresses from blocks allocated to ordinary networks.
fn public_ipv4() -> impl Strategy<Value = Ipv4Addr> {
    const PUBLIC_SLASH_8S: &[u8] = &[1, 8, 9, 20, 23, 34, 45, 52, 64, 77, 93, 104, 151, 185, 200, 216, 223];
    (prop::sample::select(PUBLIC_SLASH_8S), any::<[u8; 3]>()).prop_map(|(a, [b, c, d])| Ipv4Addr::new(a, b, c, d))
}

/// The IPv6 forms that carry `v4`, with `rest` filling the bits the form
/// leaves free.
fn ipv4_embeddings(v4: Ipv4Addr, rest: u128) -> Vec<(&'static str, Ipv6Addr)> {
    let v4 = u128::from(u32::from(v4));
    let [a, b, c, d] = (v4 as u32).to_be_bytes().map(u128::from);
    vec![
        ("IPv4-mapped", Ipv6Addr::from(0xffff << 32 | v4)),
        ("IPv4-compatible", Ipv6Addr::from(v4)),
        ("IPv4-translated", Ipv6Addr::from(0xffff << 48 | v4)),
        ("NAT64 well-known", Ipv6Addr::from(0x0064_ff9b << 96 | v4)),
        ("NAT64 local-use /96", Ipv6Addr::from(0x0064_ff9b_0001 << 80 | (rest & 0xffff_ffff_ffff) << 32 | v4)),
        // RFC 6052 section 2.2 layout for a /48 prefix: two octets, the
        // zero u octet, two octets, then a free suffix.
        ("NAT64 local-use /48", Ipv6Addr::from(0x0064_ff9b_0001 << 80 | a << 72 | b << 64 | c << 48 | d << 40 | (rest & 0xff_ffff_ffff))),
        ("6to4", Ipv6Addr::from(0x2002 << 112 | v4 << 80 | (rest & ((1 << 80) - 1)))),
        ("Teredo server", Ipv6Addr::from(0x2001_0000 << 96 | v4 << 64 | (rest & u128::from(u64::MAX)))),
        ("Teredo client", Ipv6Addr::from(0x2001_0000 << 96 | (rest & 0xffff_ffff_ffff_ffff_0000_0000) | (v4 ^ 0xffff_ffff))),
    ]
}

/// An address as a URL host: IPv6 in brackets.
fn url_host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

fn any_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        ipv4_near_special_blocks().prop_map(IpAddr::V4),
        any::<u128>().prop_map(|x| IpAddr::V6(x.into())),
        // Low addresses, where the IPv4-embedding forms live.
        any::<u64>().prop_map(|x| IpAddr::V6(u128::from(x).into())),
        (any::<Ipv4Addr>(), any::<u128>(), any::<prop::sample::Index>())
            .prop_map(|(v4, rest, i)| IpAddr::V6(i.get(&ipv4_embeddings(v4, rest)).1)),
    ]
}

proptest! {
    #[test]
    fn ipv4_is_refused_exactly_where_the_octet_rules_say(ip in ipv4_near_special_blocks()) {
        prop_assert_eq!(blocked_reason(IpAddr::V4(ip)).is_some(), refused_by_octets(ip), "{}", ip);
    }

    #[test]
    fn addresses_in_public_blocks_are_allowed(ip in public_ipv4()) {
        prop_assert_eq!(blocked_reason(IpAddr::V4(ip)), None);
    }

    #[test]
    fn every_ipv6_form_of_any_ipv4_address_is_refused(v4 in any::<Ipv4Addr>(), rest in any::<u128>()) {
        for (form, v6) in ipv4_embeddings(v4, rest) {
            prop_assert!(blocked_reason(IpAddr::V6(v6)).is_some(), "{} form {} of {} was allowed", form, v6, v4);
        }
    }

    #[test]
    fn ipv6_outside_global_unicast_is_refused(
        x in prop_oneof![
            any::<u128>(),
            any::<u64>().prop_map(u128::from),
            // The first byte of every top-level block outside 2000::/3, so the
            // small ones (fe00::/9, fec0::/10) are drawn as often as the big.
            (prop::sample::select(&[0x00u8, 0x01, 0x02, 0x04, 0x08, 0x10, 0x40, 0x5f, 0x60, 0x80, 0xa0, 0xc0, 0xe0, 0xf0, 0xf8, 0xfc, 0xfd, 0xfe, 0xff][..]), any::<u128>())
                .prop_map(|(top, rest)| u128::from(top) << 120 | rest >> 8),
        ]
    ) {
        // Move any draw that lands in 2000::/3 out of it by flipping its top bit.
        let x = if x >> 125 == 0b001 { x ^ 1 << 127 } else { x };
        prop_assert!(blocked_reason(IpAddr::V6(x.into())).is_some(), "{}", Ipv6Addr::from(x));
    }

    #[test]
    fn check_url_never_panics(raw in any::<String>(), tail in "[ -~]{0,40}") {
        let _ = Policy::strict().check_url(&raw);
        let _ = Policy::strict().check_url(&format!("https://{tail}"));
    }

    #[test]
    fn check_url_refuses_refused_address_literals_and_port_zero(ip in any_ip(), port in prop_oneof![Just(0u16), any::<u16>()]) {
        let url = format!("https://{}:{port}/", url_host(ip));
        let result = Policy::strict().check_url(&url);
        if blocked_reason(ip).is_some() {
            prop_assert!(matches!(result, Err(Rejection::BlockedAddress { .. })), "{} gave {:?}", url, result);
        } else if port == 0 {
            prop_assert_eq!(result, Err(Rejection::Port(0)));
        } else {
            prop_assert!(result.is_ok(), "{} gave {:?}", url, result);
        }
    }

    #[test]
    fn dev_loopback_allowance_takes_all_of_127_and_nothing_else(b in any::<u8>(), c in any::<u8>(), d in any::<u8>(), port in 1u16..) {
        let dev = Policy { allow_http: true, allowed_ranges: vec!["127.0.0.0/8".parse().unwrap()] };
        let loopback = Ipv4Addr::new(127, b, c, d);
        prop_assert!(dev.permits(IpAddr::V4(loopback)));
        let allowed = dev.check_url(&format!("http://{loopback}:{port}/"));
        prop_assert!(allowed.is_ok(), "{:?}", allowed);
        let private = Ipv4Addr::new(10, b, c, d);
        prop_assert!(!dev.permits(IpAddr::V4(private)));
        let refused = dev.check_url(&format!("http://{private}:{port}/"));
        prop_assert!(matches!(refused, Err(Rejection::BlockedAddress { .. })), "{:?}", refused);
    }
}
