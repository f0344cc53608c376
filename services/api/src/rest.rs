//! The tenant REST/JSON facade, grpc-gateway style, derived at start-up from
//! the `google.api.http` annotations in the contracts' descriptor set: there
//! is no second, hand-kept route table.
//!
//! Each REST call is bound into the method's request message (body, then path,
//! then query), encoded, and sent in-process to the same tonic services the
//! gRPC port serves; the reply is decoded and printed as proto3 JSON with the
//! proto field names. Errors keep the gRPC status, mapped to HTTP as
//! grpc-gateway maps it, with a JSON body `{code, message, reason}`.

// Handlers here fail with a ready-made HTTP response; boxing it buys nothing.
#![allow(clippy::result_large_err)]

use std::{collections::BTreeMap, sync::Arc};

use anyhow::{Context, Result, bail};
use axum::{
    Router,
    body::Body,
    extract::{RawPathParams, RawQuery},
    http::{HeaderMap, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{MethodFilter, MethodRouter},
};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use prost::Message;
use prost_reflect::{
    DescriptorPool, DynamicMessage, ExtensionDescriptor, FieldDescriptor, Kind, MessageDescriptor, MethodDescriptor, ReflectMessage,
    SerializeOptions, Value,
};
use relay_contracts::{ERROR_REASON_METADATA, FILE_DESCRIPTOR_SET};
use tonic::{Code, Status, service::Routes};
use tower::ServiceExt;

/// Query parameters that would carry a credential in the URL.
const CREDENTIAL_PARAMS: &[&str] = &["api_key", "apikey", "key", "token", "access_token", "authorization", "bearer"];

/// Packages whose annotated methods become REST routes.
const REST_PACKAGES: &[&str] = &["relay.tenant.v1"];

#[derive(Debug)]
pub(crate) struct Binding {
    pub(crate) method: MethodDescriptor,
    pub(crate) grpc_path: String,
    pub(crate) input: MessageDescriptor,
    pub(crate) output: MessageDescriptor,
    /// `*`, or empty for no body.
    pub(crate) body_all: bool,
    pub(crate) response_field: Option<FieldDescriptor>,
    pub(crate) success: StatusCode,
}

struct Extensions {
    http: ExtensionDescriptor,
    success: ExtensionDescriptor,
}

fn pool() -> Result<(DescriptorPool, Extensions)> {
    let pool = DescriptorPool::decode(FILE_DESCRIPTOR_SET).context("decoding the contracts' descriptor set")?;
    let http = pool.get_extension_by_name("google.api.http").context("google.api.http is not in the descriptor set")?;
    let success = pool
        .get_extension_by_name("relay.options.v1.http_success_status")
        .context("relay.options.v1.http_success_status is not in the descriptor set")?;
    Ok((pool.clone(), Extensions { http, success }))
}

fn rule_of(method: &MethodDescriptor, ext: &Extensions) -> Result<Option<(Method, String, Binding)>> {
    let options = method.options();
    if !options.has_extension(&ext.http) {
        return Ok(None);
    }
    let rule = options.get_extension(&ext.http);
    let Some(rule) = rule.as_message() else { bail!("{}: google.api.http is not a message", method.full_name()) };
    let text = |name: &str| rule.get_field_by_name(name).and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let (verb, path) =
        [("get", Method::GET), ("post", Method::POST), ("put", Method::PUT), ("delete", Method::DELETE), ("patch", Method::PATCH)]
            .into_iter()
            .find_map(|(f, m)| {
                let p = text(f);
                (!p.is_empty()).then_some((m, p))
            })
            .with_context(|| format!("{}: google.api.http has no supported verb", method.full_name()))?;
    if path.contains('=') || path.contains('*') || path.contains(':') {
        bail!("{}: path template {path:?} uses a form this facade does not bind", method.full_name());
    }
    let body = text("body");
    if !(body.is_empty() || body == "*") {
        bail!("{}: body {body:?} is not supported (only \"*\" or none)", method.full_name());
    }
    let response_body = text("response_body");
    let response_field = if response_body.is_empty() {
        None
    } else {
        Some(
            method
                .output()
                .get_field_by_name(&response_body)
                .with_context(|| format!("{}: response_body {response_body:?} is not a field", method.full_name()))?,
        )
    };
    let code = options.get_extension(&ext.success).as_u32().unwrap_or(0);
    let success = if code == 0 { StatusCode::OK } else { StatusCode::from_u16(code as u16)? };
    let binding = Binding {
        method: method.clone(),
        grpc_path: format!("/{}/{}", method.parent_service().full_name(), method.name()),
        input: method.input(),
        output: method.output(),
        body_all: body == "*",
        response_field,
        success,
    };
    Ok(Some((verb, path, binding)))
}

pub(crate) fn rest_methods() -> Result<Vec<(Method, String, Binding)>> {
    let (pool, ext) = pool()?;
    let mut out = Vec::new();
    for service in pool.services().filter(|s| REST_PACKAGES.contains(&s.package_name())) {
        for method in service.methods() {
            if let Some(r) = rule_of(&method, &ext)? {
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// The axum router for every annotated tenant method, calling `grpc` in-process.
pub fn router(grpc: Routes) -> Result<Router> {
    let mut by_path: BTreeMap<String, MethodRouter> = BTreeMap::new();
    for (verb, path, binding) in rest_methods()? {
        let binding = Arc::new(binding);
        let grpc = grpc.clone();
        let handler = move |params: RawPathParams, RawQuery(query): RawQuery, headers: HeaderMap, body: Bytes| {
            let binding = binding.clone();
            let grpc = grpc.clone();
            async move {
                let params: Vec<(String, String)> = params.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
                // Detached from the client: a caller that hangs up does not
                // cancel work that has begun (see `crate::detach`).
                let work = tokio::spawn(async move { transcode(&binding, grpc, params, query, headers, body).await.unwrap_or_else(|e| e) });
                work.await.unwrap_or_else(|e| internal(anyhow::anyhow!("a REST handler failed: {e}")))
            }
        };
        let filter = MethodFilter::try_from(verb.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let entry = by_path.remove(&path).unwrap_or_default();
        by_path.insert(path, entry.on(filter, handler));
    }
    let mut router = Router::new();
    for (path, mr) in by_path {
        router = router.route(
            &path,
            mr.fallback(|| async {
                error_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    Code::Unimplemented,
                    "method_not_allowed",
                    "this route does not accept that method",
                )
            }),
        );
    }
    Ok(router.fallback(|| async { error_response(StatusCode::NOT_FOUND, Code::NotFound, "no_route", "no such route") }))
}

/// grpc-gateway's mapping from gRPC codes to HTTP statuses.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).expect("valid"),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn error_response(http: StatusCode, code: Code, reason: &str, message: &str) -> Response {
    let body = serde_json::json!({ "code": code as i32, "message": message, "reason": reason });
    (http, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn invalid(reason: &str, message: String) -> Response {
    error_response(StatusCode::BAD_REQUEST, Code::InvalidArgument, reason, &message)
}

fn status_response(st: &Status) -> Response {
    let reason = st.metadata().get(ERROR_REASON_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("");
    let reason = if reason.is_empty() { default_reason(st.code()) } else { reason };
    error_response(http_status(st.code()), st.code(), reason, st.message())
}

fn default_reason(code: Code) -> &'static str {
    match code {
        Code::Unauthenticated => "unauthenticated",
        Code::NotFound => "not_found",
        Code::InvalidArgument => "invalid_argument",
        Code::PermissionDenied => "permission_denied",
        _ => "error",
    }
}

/// A path or query value, parsed as the field's scalar type.
fn scalar(field: &FieldDescriptor, raw: &str) -> Result<Value, String> {
    let bad = || format!("{} must be a {:?}, got {raw:?}", field.name(), field.kind());
    Ok(match field.kind() {
        Kind::String => Value::String(raw.to_owned()),
        Kind::Bool => Value::Bool(raw.parse().map_err(|_| bad())?),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(raw.parse().map_err(|_| bad())?),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(raw.parse().map_err(|_| bad())?),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(raw.parse().map_err(|_| bad())?),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(raw.parse().map_err(|_| bad())?),
        _ => return Err(format!("{} cannot be set from a path or query parameter", field.name())),
    })
}

fn set_scalar(msg: &mut DynamicMessage, name: &str, raw: &str) -> Result<(), Response> {
    let field =
        msg.descriptor().get_field_by_name(name).ok_or_else(|| invalid("unknown_parameter", format!("unknown parameter {name:?}")))?;
    let value = scalar(&field, raw).map_err(|m| invalid("invalid_parameter", m))?;
    if field.is_list() {
        if let Value::List(list) = msg.get_field_mut(&field) {
            list.push(value);
        }
    } else {
        msg.set_field(&field, value);
    }
    Ok(())
}

async fn transcode(
    b: &Binding,
    grpc: Routes,
    params: Vec<(String, String)>,
    query: Option<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Response> {
    // A credential in the URL ends up in logs and referrers: refuse it
    // outright, whatever the route, rather than ignoring or binding it.
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(query.as_deref().unwrap_or_default().as_bytes()).into_owned().collect();
    if pairs.iter().any(|(k, _)| CREDENTIAL_PARAMS.contains(&k.to_ascii_lowercase().as_str())) {
        return Err(error_response(
            StatusCode::UNAUTHORIZED,
            Code::Unauthenticated,
            "credential_in_url",
            "API keys are accepted only in the Authorization header (`Authorization: Bearer <key>`), never in the URL",
        ));
    }
    // Bind: body (when the rule takes one), then path, then query.
    let mut msg = if b.body_all && !body.iter().all(u8::is_ascii_whitespace) {
        let mut de = serde_json::Deserializer::from_slice(&body);
        DynamicMessage::deserialize(b.input.clone(), &mut de)
            .and_then(|m| de.end().map(|()| m))
            .map_err(|e| invalid("invalid_json", format!("the request body is not a valid {}: {e}", b.input.name())))?
    } else {
        DynamicMessage::new(b.input.clone())
    };
    for (name, value) in &params {
        set_scalar(&mut msg, name, value)?;
    }
    if !b.body_all {
        for (name, value) in &pairs {
            set_scalar(&mut msg, name, value)?;
        }
    }

    // Frame it as a unary gRPC call and send it to the in-process server.
    let encoded = msg.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + encoded.len());
    frame.put_u8(0);
    frame.put_u32(encoded.len() as u32);
    frame.put_slice(&encoded);
    let mut req = http::Request::builder()
        .method(Method::POST)
        .uri(&b.grpc_path)
        .header(header::CONTENT_TYPE, "application/grpc")
        .header(header::TE, "trailers");
    if let Some(auth) = headers.get(header::AUTHORIZATION) {
        req = req.header(header::AUTHORIZATION, auth);
    }
    // A caller's trace context continues into the call (W3C names only).
    for name in ["traceparent", "tracestate"] {
        if let Some(v) = headers.get(name) {
            req = req.header(name, v);
        }
    }
    let req = req.body(Full::new(frame.freeze())).map_err(|e| internal(anyhow::Error::new(e)))?;
    let resp = grpc.oneshot(req).await.map_err(|e: std::convert::Infallible| match e {})?;
    let head_status = Status::from_header_map(resp.headers());
    let collected = resp.into_body().collect().await.map_err(|e| internal(anyhow::anyhow!("{e}")))?;
    let status = head_status.or_else(|| collected.trailers().and_then(Status::from_header_map));
    match status {
        Some(st) if st.code() != Code::Ok => return Err(status_response(&st)),
        None => return Err(internal(anyhow::anyhow!("in-process gRPC call ended without a status"))),
        _ => {}
    }
    let mut data = collected.to_bytes();
    if data.len() < 5 {
        return Err(internal(anyhow::anyhow!("in-process gRPC reply has no message")));
    }
    data.advance(1);
    let len = data.get_u32() as usize;
    let reply = DynamicMessage::decode(b.output.clone(), data.slice(..len.min(data.len())))
        .map_err(|e| internal(anyhow::Error::new(e).context("decoding an in-process reply")))?;

    if b.success == StatusCode::NO_CONTENT {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let options = SerializeOptions::new().use_proto_field_name(true).skip_default_fields(false);
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::new(&mut out);
    let written = match &b.response_field {
        Some(field) => match reply.get_field(field).as_message() {
            Some(inner) => inner.serialize_with_options(&mut ser, &options),
            None => reply.serialize_with_options(&mut ser, &options),
        },
        None => reply.serialize_with_options(&mut ser, &options),
    };
    written.map_err(|e| internal(anyhow::Error::new(e).context("printing a reply as JSON")))?;
    Ok((b.success, [(header::CONTENT_TYPE, "application/json")], Body::from(out)).into_response())
}

fn internal(e: anyhow::Error) -> Response {
    tracing::error!(error = format!("{e:#}"), "REST facade failure");
    error_response(StatusCode::INTERNAL_SERVER_ERROR, Code::Internal, "internal", "internal error")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_come_from_the_annotations() {
        let routes = rest_methods().unwrap();
        let find = |m: Method, p: &str| {
            routes.iter().find(|(verb, path, _)| *verb == m && path == p).map(|(_, _, b)| b).unwrap_or_else(|| panic!("{m} {p} missing"))
        };
        assert_eq!(find(Method::POST, "/v1/webhooks").success, 201);
        assert_eq!(find(Method::DELETE, "/v1/webhooks/{id}").success, 204);
        assert_eq!(find(Method::POST, "/v1/webhooks/{id}/rotate-secret").success, 200);
        assert_eq!(find(Method::POST, "/v1/events").success, 202);
        assert_eq!(find(Method::GET, "/v1/events/{event_id}/deliveries").grpc_path, "/relay.tenant.v1.EventService/ListEventDeliveries");
        assert!(
            routes.iter().all(|(_, _, b)| !b.grpc_path.contains("Admin") && !b.grpc_path.contains("Dispatch")),
            "only tenant services are exposed"
        );
    }

    #[test]
    fn grpc_codes_map_as_grpc_gateway_maps_them() {
        assert_eq!(http_status(Code::NotFound), StatusCode::NOT_FOUND);
        assert_eq!(http_status(Code::FailedPrecondition), StatusCode::BAD_REQUEST);
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(http_status(Code::PermissionDenied), StatusCode::FORBIDDEN);
        assert_eq!(http_status(Code::AlreadyExists), StatusCode::CONFLICT);
        assert_eq!(http_status(Code::Unavailable), StatusCode::SERVICE_UNAVAILABLE);
    }
}
