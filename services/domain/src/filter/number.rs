//! JSON numbers compared exactly, as decimal text: no float, no limit on
//! digits, so a 20-digit id or an amount like `0.1` compares as written.

use std::cmp::Ordering;

/// A JSON number as sign, significant digits and the position of the
/// decimal point: the value is `0.d₁d₂… × 10^point`. Zero has no digits
/// (and no sign: `-0` equals `0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Number {
    negative: bool,
    digits: Vec<u8>,
    point: i64,
}

impl Number {
    /// Reads JSON number text (`-12.50e3`); `None` if it is not one.
    pub fn parse(text: &str) -> Option<Number> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let (int, frac) = match mantissa.split_once('.') {
            Some((i, f)) => (i, f),
            None => (mantissa, ""),
        };
        let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !all_digits(int) || (mantissa.contains('.') && !all_digits(frac)) {
            return None;
        }
        // An exponent too large for any payload to mean is held at a bound
        // far past every digit count a bounded text can have.
        let exponent: i64 = match exponent {
            None => 0,
            Some(e) => {
                let (neg, digits) = match e.as_bytes().first() {
                    Some(b'-') => (true, &e[1..]),
                    Some(b'+') => (false, &e[1..]),
                    _ => (false, e),
                };
                if !all_digits(digits) {
                    return None;
                }
                let magnitude = digits.parse::<i64>().unwrap_or(i64::MAX / 4).min(i64::MAX / 4);
                if neg { -magnitude } else { magnitude }
            }
        };
        let mut digits: Vec<u8> = int.bytes().chain(frac.bytes()).map(|b| b - b'0').collect();
        let mut point = int.len() as i64 + exponent;
        let leading = digits.iter().take_while(|&&d| d == 0).count();
        digits.drain(..leading);
        point -= leading as i64;
        while digits.last() == Some(&0) {
            digits.pop();
        }
        if digits.is_empty() {
            return Some(Number { negative: false, digits, point: 0 });
        }
        Some(Number { negative, digits, point })
    }

    fn magnitude_cmp(&self, other: &Number) -> Ordering {
        self.point.cmp(&other.point).then_with(|| self.digits.cmp(&other.digits))
    }
}

impl Ord for Number {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self.digits.is_empty(), other.digits.is_empty()) {
            (true, true) => return Ordering::Equal,
            (true, false) => return if other.negative { Ordering::Greater } else { Ordering::Less },
            (false, true) => return if self.negative { Ordering::Less } else { Ordering::Greater },
            _ => {}
        }
        match (self.negative, other.negative) {
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
            (false, false) => self.magnitude_cmp(other),
            (true, true) => other.magnitude_cmp(self),
        }
    }
}

impl PartialOrd for Number {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
