//! Placeholder: replaced by the fuzzer.
