use serde_json::value::RawValue;

use super::{number::Number, *};

fn matches(filter: &str, payload: &str) -> bool {
    let f = Filter::parse(filter).unwrap_or_else(|e| panic!("{filter} should parse: {e}"));
    let raw: &RawValue = serde_json::from_str(payload).expect("payload is JSON");
    f.matches(&Document::new(raw))
}

fn refused(filter: &str) -> FilterError {
    match Filter::parse(filter) {
        Ok(f) => panic!("{filter} should be refused, parsed as {f:?}"),
        Err(e) => e,
    }
}

#[test]
fn the_issue_example_matches_and_misses() {
    let f = r#"{"amount": {"$gte": 100}, "currency": {"$in": ["EUR", "USD"]}, "customer.tier": {"$exists": true}}"#;
    assert!(matches(f, r#"{"amount": 100, "currency": "EUR", "customer": {"tier": "gold"}}"#));
    assert!(!matches(f, r#"{"amount": 99.99, "currency": "EUR", "customer": {"tier": "gold"}}"#));
    assert!(!matches(f, r#"{"amount": 150, "currency": "GBP", "customer": {"tier": "gold"}}"#));
    assert!(!matches(f, r#"{"amount": 150, "currency": "USD", "customer": {}}"#));
    assert!(!matches(f, r#"{"amount": "150", "currency": "USD", "customer": {"tier": 1}}"#), "a string is not a number");
}

#[test]
fn numbers_compare_exactly_as_written() {
    let big = r#"{"id": {"$gt": 10000000000000000000}}"#;
    assert!(matches(big, r#"{"id": 10000000000000000001}"#), "f64 would call these equal");
    assert!(!matches(big, r#"{"id": 10000000000000000000}"#));
    assert!(matches(r#"{"x": 1.10}"#, r#"{"x": 1.1}"#));
    assert!(matches(r#"{"x": 100}"#, r#"{"x": 1e2}"#));
    assert!(matches(r#"{"x": 0}"#, r#"{"x": -0.0}"#));
    assert!(matches(r#"{"x": {"$lt": 0.30000000000000001}}"#, r#"{"x": 0.3}"#));
    assert!(!matches(r#"{"x": {"$lt": 0.3}}"#, r#"{"x": 0.30000000000000001}"#));
    assert!(matches(r#"{"x": {"$lt": -5}}"#, r#"{"x": -12.5}"#));
    assert!(matches(r#"{"x": {"$gt": 1e-400}}"#, r#"{"x": 1e-399}"#));
    assert!(matches(r#"{"x": {"$gt": 99999999999999999999e999999}}"#, r#"{"x": 1e9999999999999999999999}"#));
    let order = ["-1e3", "-12.5", "-1", "-0.001", "0", "1e-9", "0.1", "1", "1.5", "2", "10", "1e20", "123456789012345678901234567890"];
    for (i, a) in order.iter().enumerate() {
        for (j, b) in order.iter().enumerate() {
            let (a, b) = (Number::parse(a).unwrap(), Number::parse(b).unwrap());
            assert_eq!(a.cmp(&b), i.cmp(&j), "{a:?} vs {b:?}");
        }
    }
}

#[test]
fn strings_compare_by_code_point() {
    // U+FF21 (fullwidth A) sorts after U+00E9 by code point; a locale would
    // not say so, nor would UTF-16 for a character past the BMP.
    assert!(matches(r#"{"s": {"$gt": "é"}}"#, r#"{"s": "Ａ"}"#));
    assert!(matches(r#"{"s": {"$gt": "\uffff"}}"#, r#"{"s": "😀"}"#));
    assert!(matches(r#"{"s": {"$lt": "a"}}"#, r#"{"s": "Z"}"#));
    assert!(matches(r#"{"s": "caf\u00e9"}"#, r#"{"s": "café"}"#), "escapes decode before comparing");
}

#[test]
fn paths_reach_into_objects_and_arrays() {
    let p = r#"{"items": [{"sku": "A", "qty": 1}, {"sku": "B", "qty": 7}], "tags": ["x", "y"], "m": [[1, 2]]}"#;
    assert!(matches(r#"{"items.sku": "B"}"#, p));
    assert!(!matches(r#"{"items.sku": "C"}"#, p));
    assert!(matches(r#"{"items.1.qty": {"$gte": 7}}"#, p));
    assert!(!matches(r#"{"items.0.qty": {"$gte": 7}}"#, p));
    assert!(matches(r#"{"items.qty": {"$gt": 5}}"#, p));
    assert!(matches(r#"{"tags": "y"}"#, p), "a test on an array holds for an element");
    assert!(matches(r#"{"tags": {"$in": ["q", "x"]}}"#, p));
    assert!(matches(r#"{"tags": {"$nin": ["q"]}}"#, p));
    assert!(!matches(r#"{"m": 1}"#, p), "an array inside an array is not looked into");
    assert!(matches(r#"{"m.0": 1}"#, p));
}

#[test]
fn negations_hold_for_missing_fields() {
    let p = r#"{"a": 1, "n": null}"#;
    assert!(matches(r#"{"b": {"$neq": 1}}"#, p));
    assert!(matches(r#"{"b": {"$nin": [1]}}"#, p));
    assert!(matches(r#"{"b": {"$not": {"$gt": 0}}}"#, p));
    assert!(!matches(r#"{"a": {"$not": {"$gt": 0}}}"#, p));
    assert!(matches(r#"{"b": null}"#, p), "null matches a missing field");
    assert!(matches(r#"{"n": null}"#, p));
    assert!(matches(r#"{"n": {"$exists": true}}"#, p), "a null field exists");
    assert!(matches(r#"{"b": {"$exists": false}}"#, p));
    assert!(!matches(r#"{"a": {"$exists": false}}"#, p));
}

#[test]
fn combinators_combine() {
    let p = r#"{"a": 1, "b": "x"}"#;
    assert!(matches(r#"{"$or": [{"a": 2}, {"b": "x"}]}"#, p));
    assert!(!matches(r#"{"$and": [{"a": 1}, {"b": "y"}]}"#, p));
    assert!(matches(r#"{"$not": {"a": 2}}"#, p));
    assert!(matches(r#"{"a": {"$gte": 1, "$lt": 2}, "$not": {"b": "y"}}"#, p));
    assert!(!matches(r#"{"a": {"$gte": 1, "$lt": 1}}"#, p));
    assert!(matches(r#"{"a": 1}"#, r#"[{"a": 1}]"#), "a payload that is an array is looked into like any array");
    assert!(!matches(r#"{"a": {"$exists": true}}"#, r#""a""#), "a payload that is a scalar has no fields");
    assert!(matches(r#"{"a": 1}"#, r#"{"a": 2, "a": 1}"#), "the last of a duplicate key counts, as JSON parsers read it");
}

#[test]
fn mistakes_are_named_by_pointer() {
    let cases: &[(&str, &str, &str)] = &[
        (r#"[1]"#, "", "expected an object"),
        (r#"{}"#, "", "empty filter"),
        (r#"{"a": {"$gte": [1]}}"#, "/a/$gte", "numbers or strings"),
        (r#"{"a": {"$in": 5}}"#, "/a/$in", "array of values"),
        (r#"{"a": {"$in": [1, {}]}}"#, "/a/$in/1", "got an object"),
        (r#"{"a": {"$regex": "x"}}"#, "/a/$regex", "unknown operator"),
        (r#"{"$nor": []}"#, "/$nor", "unknown combinator"),
        (r#"{"$or": []}"#, "/$or", "at least one"),
        (r#"{"$or": [{"a": 1}, 3]}"#, "/$or/1", "expected an object"),
        (r#"{"a": {"$exists": 1}}"#, "/a/$exists", "true or false"),
        (r#"{"a": {"b": 1}}"#, "/a/b", "dotted path"),
        (r#"{"a..b": 1}"#, "/a..b", "may not be empty"),
        (r#"{"a/b~c": {"$gt": null}}"#, "/a~1b~0c/$gt", "numbers or strings"),
        (r#"{"a": 1, "a": 2}"#, "/a", "twice"),
        (r#"{"a": {}}"#, "/a", "empty object"),
        (r#"{"a": {"$not": 1}}"#, "/a/$not", "object of operators"),
        (r#"{"a": [1]}"#, "/a", "got an array"),
        (r#"{"a": 1"#, "", "not valid JSON"),
    ];
    for (filter, pointer, words) in cases {
        let e = refused(filter);
        assert_eq!(e.pointer, *pointer, "{filter}: {e}");
        assert!(e.message.contains(words), "{filter}: {e} should say {words:?}");
    }
}

#[test]
fn bounds_are_enforced_with_their_numbers() {
    let deep = format!("{}{}{}", r#"{"$not":"#.repeat(999), r#"{"a":1}"#, "}".repeat(999));
    let e = refused(&deep);
    assert!(e.message.contains("at most 10 deep") && e.message.contains("1000"), "{e}");
    let at_limit = format!("{}{}{}", r#"{"$not":"#.repeat(9), r#"{"a":1}"#, "}".repeat(9));
    Filter::parse(&at_limit).expect("ten deep is accepted");

    let many = (0..101).map(|i| format!(r#""f{i}": 1"#)).collect::<Vec<_>>().join(",");
    let e = refused(&format!("{{{many}}}"));
    assert!(e.message.contains("at most 100 tests") && e.pointer == "/f100", "{e}");
    let list = (0..101).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let e = refused(&format!(r#"{{"a": {{"$in": [{list}]}}}}"#));
    assert!(e.message.contains("at most 100 values") && e.message.contains("101"), "{e}");
    let e = refused(&format!(r#"{{"{}": 1}}"#, ["a"; 11].join(".")));
    assert!(e.message.contains("at most 10 segments") && e.message.contains("11"), "{e}");
    let e = refused(&format!(r#"{{"a": "{}"}}"#, "x".repeat(MAX_FILTER_BYTES)));
    assert!(e.message.contains("16384"), "{e}");
}

#[test]
fn a_filter_keeps_its_text() {
    let f = Filter::parse(" {\"amount\": {\"$gte\": 100.50}} ").unwrap();
    assert_eq!(f.text(), "{\"amount\": {\"$gte\": 100.50}}");
}

#[test]
fn random_payloads_never_panic_and_agree_with_a_float_model_on_small_integers() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let mut rng = StdRng::seed_from_u64(27);
    for _ in 0..2_000 {
        let (x, y): (i32, i32) = (rng.random_range(-50..50), rng.random_range(-50..50));
        let payload = format!(r#"{{"v": {x}, "w": [{y}, "s"], "o": {{"k": {y}}}}}"#);
        for (op, holds) in [("$gt", x > y), ("$gte", x >= y), ("$lt", x < y), ("$lte", x <= y), ("$eq", x == y), ("$neq", x != y)] {
            assert_eq!(matches(&format!(r#"{{"v": {{"{op}": {y}}}}}"#), &payload), holds, "{payload} {op} {y}");
            assert_eq!(matches(&format!(r#"{{"o.k": {{"{op}": {x}}}}}"#), &payload), Filter::holds_for(op, y, x), "{payload} o.k {op} {x}");
        }
    }
}

impl Filter {
    fn holds_for(op: &str, a: i32, b: i32) -> bool {
        match op {
            "$gt" => a > b,
            "$gte" => a >= b,
            "$lt" => a < b,
            "$lte" => a <= b,
            "$eq" => a == b,
            _ => a != b,
        }
    }
}
