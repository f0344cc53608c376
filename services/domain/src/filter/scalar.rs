//! The values filters compare: what a filter writes on the right of an
//! operator, and what a payload's leaf is read as.

use std::cmp::Ordering;

use super::number::Number;

/// A value a test compares with: what a filter may write on the right of
/// an operator, and what a payload's leaf is read as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scalar {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
}

impl Scalar {
    /// Equality as the filter means it: exact numbers, same types only.
    pub(super) fn same(&self, other: &Scalar) -> bool {
        self == other
    }

    /// Order between two numbers or two strings; `None` across types.
    pub(super) fn order(&self, other: &Scalar) -> Option<Ordering> {
        match (self, other) {
            (Scalar::Number(a), Scalar::Number(b)) => Some(a.cmp(b)),
            (Scalar::String(a), Scalar::String(b)) => Some(a.as_str().cmp(b.as_str())),
            _ => None,
        }
    }
}
