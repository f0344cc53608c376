//! The facade's unit tests: routes from the annotations, binding, limits.

use super::*;

fn binding(m: Method, p: &str) -> Binding {
    rest_methods()
        .unwrap()
        .into_iter()
        .find(|(verb, path, _)| *verb == m && path == p)
        .map(|(_, _, b)| b)
        .unwrap_or_else(|| panic!("{m} {p} missing"))
}

#[test]
fn routes_come_from_the_annotations() {
    let routes = rest_methods().unwrap();
    assert_eq!(binding(Method::POST, "/v1/webhooks").success, 201);
    assert_eq!(binding(Method::DELETE, "/v1/webhooks/{id}").success, 204);
    assert_eq!(binding(Method::DELETE, "/v1/webhooks/{id}").path_fields, ["id"]);
    assert_eq!(binding(Method::POST, "/v1/webhooks/{id}/rotate-secret").success, 200);
    assert_eq!(binding(Method::POST, "/v1/events").success, 202);
    assert_eq!(binding(Method::POST, "/v1/events").raw_json.iter().map(|f| f.name()).collect::<Vec<_>>(), ["payload"]);
    assert_eq!(binding(Method::GET, "/v1/events/{event_id}/deliveries").grpc_path, "/relay.tenant.v1.EventService/ListEventDeliveries");
    assert!(
        routes.iter().all(|(_, _, b)| !b.grpc_path.contains("Admin") && !b.grpc_path.contains("Dispatch")),
        "only tenant services are exposed"
    );
}

#[test]
fn a_raw_json_field_keeps_the_exact_text_and_the_rest_is_proto3_json() {
    let b = binding(Method::POST, "/v1/events");
    let body = br#"{"type": "t", "payload": {"z": 9007199254740993, "a": [1.50, -0, 1e400], "z": "dup"}}"#;
    let msg = bind_body(&b, body).unwrap_or_else(|_| panic!("bound"));
    let field = |n: &str| msg.get_field_by_name(n).unwrap().as_str().unwrap().to_owned();
    assert_eq!(field("type"), "t");
    assert_eq!(field("payload"), r#"{"z": 9007199254740993, "a": [1.50, -0, 1e400], "z": "dup"}"#);
}

#[test]
fn bodies_that_are_not_one_object_or_repeat_a_field_are_refused() {
    let b = binding(Method::POST, "/v1/events");
    for body in [&b"[1]"[..], b"{\"type\": \"t\"} x", b"{\"type\": \"a\", \"type\": \"b\"}", b"{\"payload\": 1, \"payload\": 2}", b"\xff"] {
        let r = bind_body(&b, body).err().unwrap_or_else(|| panic!("{} accepted", String::from_utf8_lossy(body)));
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}

/// Properties of binding a publish body: the payload is the exact text
/// sent, whatever the JSON and its formatting, and no input panics.
mod properties {
    use proptest::{collection::vec, prelude::*, sample::select};

    use super::*;

    /// A JSON value whose leaves are already JSON text, so that a number
    /// keeps the spelling it was generated with (`1.50`, `-0`, `1e400`)
    /// and an object may repeat a key.
    #[derive(Debug, Clone)]
    enum Json {
        Leaf(String),
        Array(Vec<Json>),
        Object(Vec<(String, Json)>),
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            // Debug prints the shortest round-trip form: `1e300`, `0.1`, `-0.0`.
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:?}")),
            select(vec![
                "1.50",
                "-0",
                "1e400",
                "-1e400",
                "0.1e-7",
                "1E+2",
                "9007199254740993",
                "18446744073709551616",
                "123456789012345678901234567890",
                "2.2250738585072011e-308",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// A JSON string literal: any characters, some of them escaped
    /// (`\uXXXX`, surrogate pairs for the astral planes, `\/`).
    fn string() -> impl Strategy<Value = String> {
        let ch = prop_oneof![any::<char>(), select(vec!['"', '\\', '/', '\n', '\t', '\0', '\u{7f}', 'é', '😀', '\u{2028}'])];
        vec((ch, any::<bool>()), 0..12).prop_map(|chars| {
            let mut out = String::from('"');
            for (c, escape) in chars {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' if escape => out.push_str("\\n"),
                    '/' if escape => out.push_str("\\/"),
                    c if (c as u32) < 0x20 || escape => {
                        let mut units = [0u16; 2];
                        for u in c.encode_utf16(&mut units) {
                            out.push_str(&format!("\\u{u:04X}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        })
    }

    fn key() -> impl Strategy<Value = String> {
        // A small pool makes duplicate keys likely; names of the
        // envelope's own fields must not matter inside the payload.
        prop_oneof![select(vec![r#""a""#, r#""z""#, r#""type""#, r#""payload""#, r#""id""#]).prop_map(str::to_owned), string()]
    }

    fn json() -> impl Strategy<Value = Json> {
        let leaf = prop_oneof![Just("null".to_owned()), Just("true".to_owned()), Just("false".to_owned()), number(), string()];
        leaf.prop_map(Json::Leaf).prop_recursive(8, 64, 5, |inner| {
            prop_oneof![vec(inner.clone(), 0..5).prop_map(Json::Array), vec((key(), inner), 0..5).prop_map(Json::Object)]
        })
    }

    /// How a value is laid out: pretty (newlines and indentation), or the
    /// whitespace between tokens taken in turn from `gaps` (all `""`
    /// is compact).
    #[derive(Debug, Clone)]
    enum Layout {
        Pretty(usize),
        Gaps(Vec<&'static str>),
    }

    fn layout() -> impl Strategy<Value = Layout> {
        prop_oneof![
            (1usize..5).prop_map(Layout::Pretty),
            vec(select(vec!["", "", " ", "  ", "\n", "\t", "\r\n", " \n\t "]), 1..6).prop_map(Layout::Gaps),
        ]
    }

    struct Printer<'a> {
        layout: &'a Layout,
        turn: usize,
        out: String,
    }

    impl Printer<'_> {
        /// Whitespace at a token boundary; `depth` is the indentation a
        /// pretty layout puts after a line break there.
        fn gap(&mut self, depth: usize, line_break: bool) {
            match self.layout {
                Layout::Pretty(indent) if line_break => {
                    self.out.push('\n');
                    self.out.push_str(&" ".repeat(indent * depth));
                }
                Layout::Pretty(_) => {}
                Layout::Gaps(gaps) => {
                    self.out.push_str(gaps[self.turn % gaps.len()]);
                    self.turn += 1;
                }
            }
        }

        fn print(&mut self, v: &Json, depth: usize) {
            match v {
                Json::Leaf(text) => self.out.push_str(text),
                Json::Array(items) => {
                    self.out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            self.gap(depth + 1, false);
                            self.out.push(',');
                        }
                        self.gap(depth + 1, true);
                        self.print(item, depth + 1);
                    }
                    self.gap(depth, !items.is_empty());
                    self.out.push(']');
                }
                Json::Object(members) => {
                    self.out.push('{');
                    for (i, (k, item)) in members.iter().enumerate() {
                        if i > 0 {
                            self.gap(depth + 1, false);
                            self.out.push(',');
                        }
                        self.gap(depth + 1, true);
                        self.out.push_str(k);
                        self.gap(depth + 1, false);
                        self.out.push(':');
                        if matches!(self.layout, Layout::Pretty(_)) {
                            self.out.push(' ');
                        }
                        self.gap(depth + 1, false);
                        self.print(item, depth + 1);
                    }
                    self.gap(depth, !members.is_empty());
                    self.out.push('}');
                }
            }
        }
    }

    fn text(v: &Json, layout: &Layout) -> String {
        let mut p = Printer { layout, turn: 0, out: String::new() };
        p.print(v, 0);
        p.out
    }

    fn payload_of(body: &str) -> String {
        let b = binding(Method::POST, "/v1/events");
        let msg = bind_body(&b, body.as_bytes()).unwrap_or_else(|r| panic!("refused with {}: {body}", r.status()));
        msg.get_field_by_name("payload").and_then(|v| v.as_str().map(str::to_owned)).expect("payload is a string field")
    }

    /// A body the facade may refuse, but only with a 400 and the JSON error.
    fn refused_properly(body: &[u8]) -> Result<(), TestCaseError> {
        let b = binding(Method::POST, "/v1/events");
        if let Err(r) = bind_body(&b, body) {
            prop_assert_eq!(r.status(), StatusCode::BAD_REQUEST);
            let bytes = futures::executor::block_on(r.into_body().collect()).expect("an in-memory body").to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| TestCaseError::fail(format!("not JSON: {e}")))?;
            prop_assert!(v["code"].is_i64() && v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{}", v);
            prop_assert!(v["message"].as_str().is_some_and(|m| m.len() <= 400), "{}", v);
        }
        Ok(())
    }

    /// A publish body with one change a careless or hostile client makes.
    fn damaged_envelope() -> impl Strategy<Value = Vec<u8>> {
        let member_value = (json(), layout()).prop_map(|(v, l)| text(&v, &l));
        let member_key = select(vec!["type", "payload", "id", "Payload", "eventType", "", "payload\\u0000"]);
        let members = vec((member_key, member_value), 0..5).prop_map(|ms| {
            let inner: Vec<String> = ms.iter().map(|(k, v)| format!(r#""{k}":{v}"#)).collect();
            format!("{{{}}}", inner.join(",")).into_bytes()
        });
        (members, any::<prop::sample::Index>(), any::<u8>(), 0u8..4).prop_map(|(mut body, at, byte, how)| {
            let i = at.index(body.len() + 1);
            match how {
                0 => body.truncate(i),
                1 => body.insert(i, byte),
                2 if i < body.len() => body[i] = byte,
                _ => {}
            }
            body
        })
    }

    proptest! {
        #[test]
        fn the_payload_is_bound_as_the_exact_text_sent(v in json(), l in layout(), before in select(vec!["", " ", "\n\t"]), after in select(vec!["", " ", "\r\n"])) {
            let payload = text(&v, &l);
            let body = format!(r#"{{"type":"t","payload":{before}{payload}{after}}}"#);
            prop_assert_eq!(payload_of(&body), payload);
        }

        #[test]
        fn member_order_and_other_fields_do_not_change_the_payload(v in json(), l in layout()) {
            let payload = text(&v, &l);
            let body = format!(r#"{{"payload":{payload},"type":"t","id":""}}"#);
            prop_assert_eq!(payload_of(&body), payload);
        }

        #[test]
        fn arbitrary_bytes_bind_or_are_a_400(body in vec(any::<u8>(), 0..2048)) {
            refused_properly(&body)?;
        }

        #[test]
        fn damaged_envelopes_bind_or_are_a_400(body in damaged_envelope()) {
            refused_properly(&body)?;
        }
    }
}
