use http::{HeaderMap, HeaderValue};

use super::*;

fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.insert(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

/// The example in the Standard Webhooks specification.
#[test]
fn the_specifications_example_verifies_within_tolerance_only() {
    let v = Verifier::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let h = headers(&[
        ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek".into()),
        ("webhook-timestamp", "1614265330".into()),
        ("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=".into()),
    ]);
    let body = br#"{"test": 2432232314}"#;
    assert_eq!(v.verify_at(&h, body, 1_614_265_330), Ok(Verified { id: "msg_p5jXN8AQM9LWM0D4loKWxJek".into(), timestamp: 1_614_265_330 }));
    assert_eq!(v.verify_at(&h, body, 1_614_265_330 + 301), Err(Error::OutsideTolerance { skew_secs: 301 }));
    assert_eq!(v.verify_at(&h, br#"{"test": 2432232315}"#, 1_614_265_330), Err(Error::NoMatchingSignature));
    assert_eq!(v.verify_at(&HeaderMap::new(), body, 1_614_265_330), Err(Error::MissingHeaders));
    assert!(Verifier::standard("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
}

/// The shared contract's relay-v1 vectors.
#[test]
fn every_relay_v1_contract_vector_verifies() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/contracts/signature-v1-vectors.json");
    let text = std::fs::read_to_string(path).unwrap();
    let all = contract::vectors(&text);
    assert!(all.len() >= 6, "expected the contract's vectors, found {}", all.len());
    for v in all {
        let ts: i64 = v.timestamp.parse().unwrap();
        for secret in &v.secrets {
            let h = headers(&[
                ("relay-webhook-id", "evt".into()),
                ("relay-webhook-timestamp", v.timestamp.clone()),
                ("relay-webhook-signature", v.signature_header.clone()),
            ]);
            assert!(Verifier::relay_v1(secret).verify_at(&h, v.raw_body.as_bytes(), ts).is_ok(), "{secret} {}", v.signature_header);
        }
    }
}

/// What Relay's signer sends under each scheme, this crate accepts — with
/// the right key only.
#[test]
fn relays_own_signatures_verify_under_each_scheme() {
    use relay_signing::{Scheme, SigningSecret, signed_headers, standard};
    let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([5u8; 32]));
    let (private, public) = standard::ed25519_key_pair([6u8; 32]);
    let (_, other_public) = standard::ed25519_key_pair([7u8; 32]);
    for (scheme, signing, right, wrong) in [
        (Scheme::RelayV1, SigningSecret::new(secret.clone()), Verifier::relay_v1(&secret), Verifier::relay_v1("whsec_other")),
        (
            Scheme::StandardWebhooks,
            SigningSecret::new(secret.clone()),
            Verifier::standard(&secret).unwrap(),
            Verifier::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap(),
        ),
        (Scheme::StandardWebhooksEd25519, private, Verifier::ed25519(&public).unwrap(), Verifier::ed25519(&other_public).unwrap()),
    ] {
        let signed = signed_headers(scheme, &[signing], "evt_1", "1700000000", b"{\"a\":1}").unwrap();
        let h = headers(&signed);
        assert_eq!(right.verify_at(&h, b"{\"a\":1}", 1_700_000_000).map(|v| v.id), Ok("evt_1".to_owned()), "{scheme}");
        assert_eq!(right.verify_at(&h, b"{\"a\":2}", 1_700_000_000), Err(Error::NoMatchingSignature), "{scheme}");
        assert_eq!(wrong.verify_at(&h, b"{\"a\":1}", 1_700_000_000), Err(Error::NoMatchingSignature), "{scheme}");
        // A verifier for another scheme's headers finds none of its own.
        let other = if scheme == Scheme::RelayV1 { Verifier::standard(&secret).unwrap() } else { Verifier::relay_v1(&secret) };
        assert_eq!(other.verify_at(&h, b"{\"a\":1}", 1_700_000_000), Err(Error::MissingHeaders), "{scheme}");
        assert!(other.or(right.clone()).verify_at(&h, b"{\"a\":1}", 1_700_000_000).is_ok(), "{scheme}");
    }
    assert!(!format!("{:?}", Verifier::relay_v1("hunter2")).contains("hunter2"));
}

#[tokio::test]
async fn the_extractor_runs_the_handler_for_verified_webhooks_only() {
    use axum::{Router, body::Body, routing::post};
    use tower::ServiceExt as _;

    let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([8u8; 32]));
    let app = Router::new()
        .route("/hook", post(|w: VerifiedWebhook| async move { format!("{} {}", w.id, w.body.len()) }))
        .with_state(Verifier::standard(&secret).unwrap());
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs().to_string();
    let signed = relay_signing::signed_headers(
        relay_signing::Scheme::StandardWebhooks,
        &[relay_signing::SigningSecret::new(secret.clone())],
        "evt_9",
        &now,
        b"{}",
    )
    .unwrap();
    let request = |pairs: &[(&'static str, String)], body: &'static str| {
        let mut r = http::Request::post("/hook").body(Body::from(body)).unwrap();
        *r.headers_mut() = headers(pairs);
        r
    };
    let answer = app.clone().oneshot(request(&signed, "{}")).await.unwrap();
    assert_eq!(answer.status(), 200);
    let text = axum::body::to_bytes(answer.into_body(), 1024).await.unwrap();
    assert_eq!(&text[..], b"evt_9 2");
    assert_eq!(app.clone().oneshot(request(&signed, "{ }")).await.unwrap().status(), 401);
    assert_eq!(app.oneshot(request(&[], "{}")).await.unwrap().status(), 400);
}

/// The contract's vectors file, as the test reads it.
mod contract {
    pub struct Vector {
        pub secrets: Vec<String>,
        pub timestamp: String,
        pub raw_body: String,
        pub signature_header: String,
    }
    pub fn vectors(text: &str) -> Vec<Vector> {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        v["vectors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| Vector {
                secrets: v["secrets"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect(),
                timestamp: v["timestamp"].as_str().unwrap().to_owned(),
                raw_body: v["raw_body"].as_str().unwrap().to_owned(),
                signature_header: v["signature_header"].as_str().unwrap().to_owned(),
            })
            .collect()
    }
}
