//! Payload filters: an endpoint's condition on an event's payload, beyond
//! its event types, evaluated when the event is expanded (a payload that
//! does not match creates no delivery for that endpoint).
//!
//! The language is a small JSON document in the style of MongoDB's query
//! operators: `{"amount": {"$gte": 100}, "currency": {"$in": ["EUR"]}}`.
//! Keys are dotted paths into the payload (`customer.tier`, `items.0.sku`);
//! a path through an array looks into each of its elements, and a value
//! test on an array holds when it holds for the array or any element. Tests
//! are `$eq` (also a bare scalar), `$neq`, `$gt`, `$gte`, `$lt`, `$lte`,
//! `$in`, `$nin`, `$exists` and a field-level `$not`; `$and`, `$or` and
//! `$not` combine whole filters. Several keys in one object must all hold.
//!
//! Invariants:
//! - numbers compare exactly as written (`10000000000000000001` is more
//!   than `10000000000000000000`, `1.10` equals `1.1`); nothing goes through
//!   a float ([`number`]);
//! - strings compare by Unicode code point;
//! - a comparison across types (a string against a number) is false, never
//!   an error; `$neq`, `$nin` and `$not` hold where their test does not,
//!   a missing field included;
//! - a filter is bounded when it is accepted (its text, depth, clauses and
//!   lists), and evaluation reads each path of the payload once per event
//!   ([`Document`]), so it costs at most the clauses times the payload;
//! - every refusal names the JSON pointer of the mistake.

mod json;
pub mod number;
mod scalar;

use std::{cell::RefCell, cmp::Ordering, collections::HashMap, fmt};

use serde_json::value::RawValue;

pub use self::json::json_depth;
use self::json::{Kind, entries, kind, scalar_of};
pub use self::scalar::Scalar;

/// The longest filter accepted, in bytes of JSON.
pub const MAX_FILTER_BYTES: usize = 16 * 1024;
/// The deepest a filter may nest objects and arrays.
pub const MAX_FILTER_DEPTH: usize = 10;
/// The most tests and combinators one filter may hold.
pub const MAX_FILTER_CLAUSES: usize = 100;
/// The most values one `$in` or `$nin` may list.
pub const MAX_IN_VALUES: usize = 100;
/// The most segments one path may have, and its longest length in bytes.
pub const MAX_PATH_SEGMENTS: usize = 10;
pub const MAX_PATH_BYTES: usize = 256;

/// A filter that was refused, and where: `pointer` is the JSON pointer of
/// the mistake within the filter (empty for the whole).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("filter{}: {message}", if pointer.is_empty() { String::new() } else { format!(" at {pointer}") })]
pub struct FilterError {
    pub pointer: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    Gt,
    Gte,
    Lt,
    Lte,
}

/// A test on the values a path reaches.
#[derive(Debug, Clone)]
enum Test {
    Eq(Scalar),
    Neq(Scalar),
    Compare(Bound, Scalar),
    In(Vec<Scalar>),
    Nin(Vec<Scalar>),
    Exists(bool),
    Not(Box<Test>),
    All(Vec<Test>),
}

#[derive(Debug, Clone)]
enum Node {
    All(Vec<Node>),
    Any(Vec<Node>),
    Not(Box<Node>),
    Field { path: String, test: Test },
}

/// An accepted filter, ready to evaluate; `text()` is the filter as it was
/// given (numbers and key order kept), which is what is stored and shown.
#[derive(Clone)]
pub struct Filter {
    root: Node,
    text: String,
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filter").field("text", &self.text).finish()
    }
}

impl PartialEq for Filter {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Filter {
    /// Parses and checks a filter: JSON, an object at the top, within the
    /// bounds above, every operator known and every operand of its type.
    pub fn parse(text: &str) -> Result<Filter, FilterError> {
        let whole = |message: String| FilterError { pointer: String::new(), message };
        let text = text.trim();
        if text.len() > MAX_FILTER_BYTES {
            return Err(whole(format!("a filter may be at most {MAX_FILTER_BYTES} bytes; this one is {}", text.len())));
        }
        let depth = json_depth(text.as_bytes());
        if depth > MAX_FILTER_DEPTH {
            return Err(whole(format!("a filter may nest objects and arrays at most {MAX_FILTER_DEPTH} deep; this one nests {depth}")));
        }
        let raw: &RawValue = serde_json::from_str(text).map_err(|e| whole(format!("not valid JSON: {e}")))?;
        let mut parser = Parser { clauses: 0 };
        let root = parser.filter(raw, "")?;
        Ok(Filter { root, text: text.to_owned() })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether a payload (the event's JSON as published) matches.
    pub fn matches(&self, payload: &Document<'_>) -> bool {
        payload.eval(&self.root)
    }
}

/// An event's payload as filters read it: each path is looked up once,
/// whichever filters ask for it.
pub struct Document<'a> {
    root: &'a RawValue,
    reached: RefCell<HashMap<String, std::rc::Rc<Vec<&'a RawValue>>>>,
}

impl<'a> Document<'a> {
    pub fn new(payload: &'a RawValue) -> Self {
        Document { root: payload, reached: RefCell::new(HashMap::new()) }
    }

    /// The values a dotted path reaches: through an object by key, through
    /// an array by index (a numeric segment) and into each element.
    fn reach(&self, path: &str) -> std::rc::Rc<Vec<&'a RawValue>> {
        if let Some(found) = self.reached.borrow().get(path) {
            return found.clone();
        }
        let mut at: Vec<&'a RawValue> = vec![self.root];
        for segment in path.split('.') {
            let mut next = Vec::new();
            for value in at {
                step(value, segment, &mut next, true);
            }
            at = next;
            if at.is_empty() {
                break;
            }
        }
        let found = std::rc::Rc::new(at);
        self.reached.borrow_mut().insert(path.to_owned(), found.clone());
        found
    }

    fn eval(&self, node: &Node) -> bool {
        match node {
            Node::All(nodes) => nodes.iter().all(|n| self.eval(n)),
            Node::Any(nodes) => nodes.iter().any(|n| self.eval(n)),
            Node::Not(node) => !self.eval(node),
            Node::Field { path, test } => test.holds(&self.reach(path)),
        }
    }
}

/// One path segment from one value. Arrays are looked into once (an
/// element that is itself an array is not), as a document store does.
fn step<'a>(value: &'a RawValue, segment: &str, out: &mut Vec<&'a RawValue>, into_arrays: bool) {
    match kind(value) {
        Kind::Object => {
            if let Some(v) = entries(value).into_iter().rev().find(|(k, _)| k == segment).map(|(_, v)| v) {
                out.push(v);
            }
        }
        Kind::Array => {
            let elements = json::elements(value);
            if let Ok(i) = segment.parse::<usize>()
                && let Some(v) = elements.get(i)
            {
                out.push(v);
            }
            if into_arrays {
                for element in elements {
                    if kind(element) == Kind::Object {
                        step(element, segment, out, false);
                    }
                }
            }
        }
        _ => {}
    }
}

impl Test {
    fn holds(&self, reached: &[&RawValue]) -> bool {
        // A value test looks at each value reached and, for an array, at
        // each of its elements.
        let any = |f: &dyn Fn(&Scalar) -> bool| {
            reached.iter().any(|v| match kind(v) {
                Kind::Array => json::elements(v).iter().any(|e| scalar_of(e).is_some_and(|s| f(&s))),
                _ => scalar_of(v).is_some_and(|s| f(&s)),
            })
        };
        match self {
            // `null` also matches a field that is not there.
            Test::Eq(Scalar::Null) => reached.is_empty() || any(&|s| *s == Scalar::Null),
            Test::Eq(want) => any(&|s| s.same(want)),
            Test::Neq(want) => !Test::Eq(want.clone()).holds(reached),
            Test::Compare(bound, want) => any(&|s| {
                s.order(want).is_some_and(|o| match bound {
                    Bound::Gt => o == Ordering::Greater,
                    Bound::Gte => o != Ordering::Less,
                    Bound::Lt => o == Ordering::Less,
                    Bound::Lte => o != Ordering::Greater,
                })
            }),
            Test::In(list) => list.iter().any(|want| Test::Eq(want.clone()).holds(reached)),
            Test::Nin(list) => !Test::In(list.clone()).holds(reached),
            Test::Exists(want) => reached.is_empty() != *want,
            Test::Not(test) => !test.holds(reached),
            Test::All(tests) => tests.iter().all(|t| t.holds(reached)),
        }
    }
}

struct Parser {
    clauses: usize,
}

fn pointer_of(base: &str, key: &str) -> String {
    format!("{base}/{}", key.replace('~', "~0").replace('/', "~1"))
}

fn refuse<T>(pointer: &str, message: impl Into<String>) -> Result<T, FilterError> {
    Err(FilterError { pointer: pointer.to_owned(), message: message.into() })
}

impl Parser {
    fn count(&mut self, pointer: &str) -> Result<(), FilterError> {
        self.clauses += 1;
        if self.clauses > MAX_FILTER_CLAUSES {
            return refuse(pointer, format!("a filter may hold at most {MAX_FILTER_CLAUSES} tests and combinators"));
        }
        Ok(())
    }

    /// A filter object: its keys must all hold.
    fn filter(&mut self, raw: &RawValue, at: &str) -> Result<Node, FilterError> {
        if kind(raw) != Kind::Object {
            return refuse(at, format!("expected an object of conditions, got {}", kind(raw).name()));
        }
        let members = json::unique_entries(raw)
            .map_err(|key: String| FilterError { pointer: pointer_of(at, &key), message: "appears twice".into() })?;
        if members.is_empty() && at.is_empty() {
            return refuse(at, "an empty filter matches everything; leave the filter out instead");
        }
        let mut nodes = Vec::with_capacity(members.len());
        for (key, value) in members {
            let key: std::borrow::Cow<'_, str> = key;
            let here = pointer_of(at, &key);
            nodes.push(match key.as_ref() {
                "$and" | "$or" => {
                    self.count(&here)?;
                    if kind(value) != Kind::Array {
                        return refuse(&here, format!("{key} takes an array of filters, got {}", kind(value).name()));
                    }
                    let parts = json::elements(value);
                    if parts.is_empty() {
                        return refuse(&here, format!("{key} needs at least one filter"));
                    }
                    let mut inner = Vec::with_capacity(parts.len());
                    for (i, part) in parts.into_iter().enumerate() {
                        inner.push(self.filter(part, &format!("{here}/{i}"))?);
                    }
                    if key == "$and" { Node::All(inner) } else { Node::Any(inner) }
                }
                "$not" => {
                    self.count(&here)?;
                    Node::Not(Box::new(self.filter(value, &here)?))
                }
                k if k.starts_with('$') => return refuse(&here, format!("unknown combinator {k}: $and, $or or $not")),
                path => {
                    check_path(path, &here)?;
                    Node::Field { path: path.to_owned(), test: self.test(value, &here)? }
                }
            });
        }
        Ok(if nodes.len() == 1 { nodes.pop().expect("one node") } else { Node::All(nodes) })
    }

    /// What a path's value must satisfy: a scalar (equality) or an object
    /// of operators, all of which must hold.
    fn test(&mut self, raw: &RawValue, at: &str) -> Result<Test, FilterError> {
        if kind(raw) != Kind::Object {
            self.count(at)?;
            return Ok(Test::Eq(operand(raw, at)?));
        }
        let members = json::unique_entries(raw)
            .map_err(|key: String| FilterError { pointer: pointer_of(at, &key), message: "appears twice".into() })?;
        if members.is_empty() {
            return refuse(at, "expected a value or an object of operators ($eq, $gt, $in, …), got an empty object");
        }
        let mut tests = Vec::with_capacity(members.len());
        for (op, value) in members {
            let here = pointer_of(at, &op);
            self.count(&here)?;
            let bound = |b| -> Result<Test, FilterError> {
                match scalar_of(value) {
                    Some(v @ (Scalar::Number(_) | Scalar::String(_))) => Ok(Test::Compare(b, v)),
                    _ => refuse(&here, format!("{op} compares numbers or strings, got {}", kind(value).name())),
                }
            };
            tests.push(match op.as_ref() {
                "$eq" => Test::Eq(operand(value, &here)?),
                "$neq" => Test::Neq(operand(value, &here)?),
                "$gt" => bound(Bound::Gt)?,
                "$gte" => bound(Bound::Gte)?,
                "$lt" => bound(Bound::Lt)?,
                "$lte" => bound(Bound::Lte)?,
                "$in" | "$nin" => {
                    if kind(value) != Kind::Array {
                        return refuse(&here, format!("{op} takes an array of values, got {}", kind(value).name()));
                    }
                    let items = json::elements(value);
                    if items.len() > MAX_IN_VALUES {
                        return refuse(&here, format!("{op} may list at most {MAX_IN_VALUES} values; this one lists {}", items.len()));
                    }
                    let list = items.iter().enumerate().map(|(i, v)| operand(v, &format!("{here}/{i}"))).collect::<Result<Vec<_>, _>>()?;
                    if op == "$in" { Test::In(list) } else { Test::Nin(list) }
                }
                "$exists" => match scalar_of(value) {
                    Some(Scalar::Bool(b)) => Test::Exists(b),
                    _ => return refuse(&here, format!("$exists takes true or false, got {}", kind(value).name())),
                },
                "$not" => {
                    if kind(value) != Kind::Object {
                        return refuse(&here, format!("$not on a field takes an object of operators, got {}", kind(value).name()));
                    }
                    Test::Not(Box::new(self.test(value, &here)?))
                }
                other if other.starts_with('$') => {
                    return refuse(&here, format!("unknown operator {other}: $eq, $neq, $gt, $gte, $lt, $lte, $in, $nin, $exists or $not"));
                }
                other => {
                    return refuse(
                        &here,
                        format!("{other:?} is not an operator; to match an object's field write the dotted path as the key"),
                    );
                }
            });
        }
        Ok(if tests.len() == 1 { tests.pop().expect("one test") } else { Test::All(tests) })
    }
}

/// A value on the right of an operator: null, true/false, a number or a
/// string (objects and arrays are not compared).
fn operand(raw: &RawValue, at: &str) -> Result<Scalar, FilterError> {
    match scalar_of(raw) {
        Some(s) => Ok(s),
        None => refuse(at, format!("expected null, a boolean, a number or a string, got {}", kind(raw).name())),
    }
}

fn check_path(path: &str, at: &str) -> Result<(), FilterError> {
    if path.len() > MAX_PATH_BYTES {
        return refuse(at, format!("a path may be at most {MAX_PATH_BYTES} bytes; this one is {}", path.len()));
    }
    let segments = path.split('.').count();
    if segments > MAX_PATH_SEGMENTS {
        return refuse(at, format!("a path may have at most {MAX_PATH_SEGMENTS} segments; this one has {segments}"));
    }
    if path.split('.').any(str::is_empty) {
        return refuse(at, "a path's segments are separated by single dots and may not be empty");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
