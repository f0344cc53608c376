//! Placeholder: replaced by the torture test.
