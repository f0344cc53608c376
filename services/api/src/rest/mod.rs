//! The tenant REST/JSON facade, grpc-gateway style, derived at start-up from
//! the `google.api.http` annotations in the contracts' descriptor set: there
//! is no second, hand-kept route table.
//!
//! A REST call is taken in this order, so that no work is done for a caller
//! who could never succeed: the head's limits ([`server`]), the route, a
//! credential in the URL (refused), the declared body size (413), the API key
//! (401), room in the api's budget for request bodies (503 when full), then
//! the body, read with its limit enforced while it streams (413) and within
//! a time limit (408), by the rule the portal's forms share ([`crate::body`]).
//! Only then is it bound into the method's request message (body, path,
//! query; a path binding is never overridden), encoded, and sent in-process
//! to the same tonic services the gRPC port serves, carrying the verified
//! tenant. The reply is printed as proto3 JSON with the proto field names.
//! Errors keep the gRPC status, mapped to HTTP as grpc-gateway maps it, with
//! a JSON body `{code, message, reason}` ([`errors`]).

// Handlers here fail with a ready-made HTTP response; boxing it buys nothing.
#![allow(clippy::result_large_err)]

pub mod errors;
mod raw_json;
mod rules;
pub mod server;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::Result;
use axum::{
    Router,
    body::Body,
    extract::{RawPathParams, RawQuery, rejection::RawPathParamsRejection},
    http::{HeaderMap, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{MethodFilter, MethodRouter},
};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use prost::Message;
use prost_reflect::{DynamicMessage, FieldDescriptor, Kind, ReflectMessage, SerializeOptions, Value};
use relay_domain::{EnvironmentId, Reason};
use serde_json::value::RawValue;
use tokio::sync::Semaphore;
use tonic::{Code, Status, service::Routes};
use tower::ServiceExt;

pub use self::errors::http_status;
use self::errors::{error_response, internal, invalid, overloaded, status_response};
pub(crate) use self::rules::{Binding, is_raw_json, rest_methods};
use crate::{
    app::{App, events::MAX_ENVELOPE_BYTES},
    auth,
    body::{BodyError, declared_length, read_bounded},
};

/// The largest request body the facade reads. The largest request that can
/// succeed is a publish of a payload at the envelope's limit; the rest of an
/// event's fields need far less than the slack.
pub const MAX_BODY_BYTES: usize = MAX_ENVELOPE_BYTES + 8 * 1024;
/// Request bodies held in memory at once, across all REST calls, counting
/// the copies a body goes through on its way in (the bytes read, the bound
/// message, its encoding, the service's decoding, the stored envelope). Each
/// call reserves that much for its declared size (for the limit when
/// undeclared) before reading a byte, and holds it until it is answered.
pub const BODY_BUDGET_BYTES: usize = 64 * 1024 * 1024;
/// How many times its own size a body occupies while it is converted.
const BODY_COPIES: usize = 5;
/// How long a call waits for room in that budget before answering 503.
const BODY_BUDGET_WAIT: Duration = Duration::from_secs(2);
/// The share of the body budget one tenant may hold at once, so that one
/// tenant's calls (slow or many) cannot fill it for every other.
const TENANT_BUDGET_SHARE: usize = 4;
/// How long a body may take to arrive once its head is in (at the limit,
/// about 27 KiB/s): a caller that trickles cannot hold its reservation long.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Query parameters that would carry a credential in the URL.
const CREDENTIAL_PARAMS: &[&str] = &["api_key", "apikey", "key", "token", "access_token", "authorization", "bearer"];

/// What every REST call shares.
struct Facade {
    app: App,
    grpc: Routes,
    /// How long a call may take before it is answered 503 (the work goes on).
    deadline: Duration,
    /// Room for request bodies, in KiB.
    body_budget: Arc<Semaphore>,
    /// Each tenant's share of that room, in KiB, by environment.
    tenant_budgets: std::sync::Mutex<std::collections::HashMap<EnvironmentId, Arc<Semaphore>>>,
}

impl Facade {
    fn tenant_budget(&self, tenant: crate::app::Tenant) -> Arc<Semaphore> {
        let mut budgets = self.tenant_budgets.lock().expect("unpoisoned");
        budgets
            .entry(tenant.environment_id)
            .or_insert_with(|| Arc::new(Semaphore::new(BODY_BUDGET_BYTES / TENANT_BUDGET_SHARE / 1024)))
            .clone()
    }
}

/// The axum router for every annotated tenant method, calling `grpc` in-process.
pub fn router(app: App, grpc: Routes, deadline: Duration) -> Result<Router> {
    let facade = Arc::new(Facade {
        app,
        grpc,
        deadline,
        body_budget: Arc::new(Semaphore::new(BODY_BUDGET_BYTES / 1024)),
        tenant_budgets: Default::default(),
    });
    let mut by_path: BTreeMap<String, MethodRouter> = BTreeMap::new();
    for (verb, path, binding) in rest_methods()? {
        let binding = Arc::new(binding);
        let facade = facade.clone();
        let handler =
            move |params: Result<RawPathParams, RawPathParamsRejection>, RawQuery(query): RawQuery, headers: HeaderMap, body: Body| {
                let (binding, facade) = (binding.clone(), facade.clone());
                async move { handle(&facade, binding, params, query, headers, body).await.unwrap_or_else(|e| e) }
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
                    Reason::MethodNotAllowed,
                    "this route does not accept that method",
                )
            }),
        );
    }
    Ok(router.fallback(|| async { error_response(StatusCode::NOT_FOUND, Code::NotFound, Reason::NoRoute, "no such route") }))
}

async fn handle(
    facade: &Facade,
    binding: Arc<Binding>,
    params: Result<RawPathParams, RawPathParamsRejection>,
    query: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Response> {
    let params: Vec<(String, String)> = match params {
        Ok(p) => p.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
        Err(_) => return Err(invalid(Reason::InvalidPath, "a path segment is not valid UTF-8 once percent-decoded")),
    };
    // A credential in the URL ends up in logs and referrers: refuse it
    // outright, whatever the route, rather than ignoring or binding it.
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(query.as_deref().unwrap_or_default().as_bytes()).into_owned().collect();
    if pairs.iter().any(|(k, _)| CREDENTIAL_PARAMS.contains(&k.to_ascii_lowercase().as_str())) {
        return Err(error_response(
            StatusCode::UNAUTHORIZED,
            Code::Unauthenticated,
            Reason::CredentialInUrl,
            "API keys are accepted only in the Authorization header (`Authorization: Bearer <key>`), never in the URL",
        ));
    }
    let declared = declared_length(&headers, MAX_BODY_BYTES).map_err(|e| body_refused(&e))?;
    let tenant = auth::tenant_from_header(&facade.app, headers.get(header::AUTHORIZATION)).await.map_err(|st| status_response(&st))?;

    let body = if binding.body_all {
        let reserve = (declared.map_or(MAX_BODY_BYTES, |n| n as usize) * BODY_COPIES).div_ceil(1024).max(1) as u32;
        // The tenant's share first, then the api's: waiting for the shared
        // room never holds any of it.
        let tenant_budget = facade.tenant_budget(tenant);
        let permits = tokio::time::timeout(BODY_BUDGET_WAIT, async {
            let own = tenant_budget.acquire_many_owned(reserve).await.ok()?;
            let shared = facade.body_budget.clone().acquire_many_owned(reserve).await.ok()?;
            Some((own, shared))
        })
        .await
        .ok()
        .flatten()
        .ok_or_else(overloaded)?;
        let bytes = read_bounded(body, MAX_BODY_BYTES, BODY_READ_TIMEOUT).await.map_err(|e| body_refused(&e))?;
        Some((bytes, permits))
    } else {
        None
    };
    // Detached from the client: a caller that hangs up does not cancel work
    // that has begun (see `crate::detach`).
    let grpc = facade.grpc.clone();
    let work = tokio::spawn(async move {
        let (bytes, _permit) = body.unzip();
        transcode(&binding, grpc, tenant, params, pairs, headers, bytes.unwrap_or_default()).await
    });
    match tokio::time::timeout(facade.deadline, work).await {
        Ok(done) => done.unwrap_or_else(|e| Err(internal(anyhow::anyhow!("a REST handler failed: {e}")))),
        // The work goes on in its task; the caller learns only that nothing can be assumed.
        Err(_) => Err(status_response(&crate::grpc::status(crate::detach::past_deadline(facade.deadline)))),
    }
}

/// A body not read, as a REST error: a slow one is a deadline, the rest the caller's mistake.
fn body_refused(e: &BodyError) -> Response {
    let code = if matches!(e, BodyError::TooSlow(_)) { Code::DeadlineExceeded } else { Code::InvalidArgument };
    error_response(e.status(), code, e.reason(), &e.to_string())
}

/// A path or query value, parsed as the field's scalar type.
fn scalar(field: &FieldDescriptor, raw: &str) -> Result<Value, String> {
    let bad = || format!("{} must be a {:?}, got {}", field.name(), field.kind(), crate::error::quoted(raw));
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
    let field = msg
        .descriptor()
        .get_field_by_name(name)
        .ok_or_else(|| invalid(Reason::UnknownParameter, format!("unknown parameter {}", crate::error::quoted(name))))?;
    let value = scalar(&field, raw).map_err(|m| invalid(Reason::InvalidParameter, m))?;
    if field.is_list() {
        if let Value::List(list) = msg.get_field_mut(&field) {
            list.push(value);
        }
    } else {
        msg.set_field(&field, value);
    }
    Ok(())
}

/// The members of a JSON object body in the order written, each value as
/// its exact text.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// The body bound into the input message. Fields marked `raw_json` take the
/// exact text of their value; everything else goes through proto3 JSON.
fn bind_body(b: &Binding, body: &[u8]) -> Result<DynamicMessage, Response> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(DynamicMessage::new(b.input.clone()));
    }
    let not_valid =
        |e: &dyn std::fmt::Display| invalid(Reason::InvalidJson, format!("the request body is not a valid {}: {e}", b.input.name()));
    let Members(members) = serde_json::from_slice(body).map_err(|e| not_valid(&e))?;
    let mut seen: Vec<String> = Vec::with_capacity(members.len());
    let mut rest = String::with_capacity(body.len());
    let mut raw: Vec<(&FieldDescriptor, &str)> = Vec::new();
    for (key, value) in &members {
        let field = b.input.get_field_by_name(key).or_else(|| b.input.get_field_by_json_name(key));
        let name = field.as_ref().map_or(key.as_str(), |f| f.name());
        if seen.iter().any(|s| s == name) {
            return Err(invalid(Reason::DuplicateField, format!("the request body sets {} more than once", crate::error::quoted(name))));
        }
        seen.push(name.to_owned());
        match b.raw_json.iter().find(|f| Some(f.name()) == field.as_ref().map(|f| f.name())) {
            Some(f) => raw.push((f, value.get())),
            None => {
                rest.push(if rest.is_empty() { '{' } else { ',' });
                rest.push_str(&serde_json::to_string(key).expect("a string serialises"));
                rest.push(':');
                rest.push_str(value.get());
            }
        }
    }
    if rest.is_empty() {
        rest.push('{');
    }
    rest.push('}');
    let mut de = serde_json::Deserializer::from_str(&rest);
    let mut msg = DynamicMessage::deserialize(b.input.clone(), &mut de).and_then(|m| de.end().map(|()| m)).map_err(|e| {
        // Name the member that does not fit its field: on this error path
        // only, each member is read on its own until one fails.
        let misfit = members.iter().filter(|(key, _)| !raw.iter().any(|(f, _)| f.name() == key.as_str())).find(|(key, value)| {
            let one = format!("{{{}:{}}}", serde_json::to_string(key).expect("a string serialises"), value.get());
            DynamicMessage::deserialize(b.input.clone(), &mut serde_json::Deserializer::from_str(&one)).is_err()
        });
        match misfit {
            Some((key, _)) => not_valid(&format!("field {}: {e}", crate::error::quoted(key))),
            None => not_valid(&e),
        }
    })?;
    for (field, text) in raw {
        msg.set_field(field, Value::String(text.to_owned()));
    }
    Ok(msg)
}

/// A message as one uncompressed gRPC frame: flag, length, bytes.
fn grpc_frame(msg: &DynamicMessage) -> anyhow::Result<BytesMut> {
    let len = msg.encoded_len();
    let mut frame = BytesMut::with_capacity(5 + len);
    frame.put_u8(0);
    frame.put_u32(u32::try_from(len).map_err(|_| anyhow::anyhow!("a message of {len} bytes does not fit a gRPC frame"))?);
    msg.encode(&mut frame).map_err(|e| anyhow::Error::new(e).context("encoding an in-process call"))?;
    Ok(frame)
}

/// The request side of one REST rule on its own (a JSON body bound to the
/// method's input and framed as the in-process call), so the micro
/// benchmarks can time the transcoder without a server.
pub struct BodyTranscoder(Binding);

impl BodyTranscoder {
    /// The rule for `method path` as the contracts declare it (`POST`, `/v1/events`).
    pub fn for_rule(method: &str, path: &str) -> anyhow::Result<Self> {
        rest_methods()?
            .into_iter()
            .find(|(m, p, _)| m.as_str() == method && p == path)
            .map(|(_, _, b)| Self(b))
            .ok_or_else(|| anyhow::anyhow!("no REST rule {method} {path}"))
    }

    /// The framed call a body becomes; an error names the refusal's status.
    pub fn frame(&self, body: &[u8]) -> anyhow::Result<BytesMut> {
        let msg = bind_body(&self.0, body).map_err(|r| anyhow::anyhow!("the body was refused: {}", r.status()))?;
        grpc_frame(&msg)
    }
}

async fn transcode(
    b: &Binding,
    grpc: Routes,
    tenant: crate::app::Tenant,
    params: Vec<(String, String)>,
    pairs: Vec<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Response> {
    // Bind: body (when the rule takes one), then path, then query. A field
    // the path binds is the path's: the body may only repeat it, and the
    // query may not name it at all.
    let mut msg = if b.body_all { bind_body(b, &body)? } else { DynamicMessage::new(b.input.clone()) };
    for (name, value) in &params {
        if let Some(field) = b.input.get_field_by_name(name)
            && msg.has_field(&field)
            && msg.get_field(&field).as_str() != Some(value.as_str())
        {
            return Err(invalid(Reason::PathFieldConflict, format!("{name} is bound by the path; the body may not give it another value")));
        }
        set_scalar(&mut msg, name, value)?;
    }
    if !b.body_all {
        for (name, value) in &pairs {
            if b.path_fields.iter().any(|p| p == name) {
                return Err(invalid(
                    Reason::PathFieldInQuery,
                    format!("{name} is bound by the path; it cannot be given as a query parameter"),
                ));
            }
            set_scalar(&mut msg, name, value)?;
        }
    }

    // Frame it as a unary gRPC call and send it to the in-process server,
    // with the tenant this facade already verified.
    let frame = grpc_frame(&msg).map_err(internal)?;
    drop(msg);
    let mut req = http::Request::builder()
        .method(Method::POST)
        .uri(&b.grpc_path)
        .header(header::CONTENT_TYPE, "application/grpc")
        .header(header::TE, "trailers")
        .extension(auth::Authenticated(tenant));
    // A caller's trace context continues into the call (W3C names only).
    for name in ["traceparent", "tracestate"] {
        if let Some(v) = headers.get(name) {
            req = req.header(name, v);
        }
    }
    let req = req.body(Full::new(frame.freeze())).map_err(|e| internal(anyhow::Error::new(e)))?;
    let resp = grpc.oneshot(req).await.map_err(|e: std::convert::Infallible| match e {})?;
    let head_status = Status::from_header_map(resp.headers());
    // A method whose success status depends on the request (a dry run is
    // 200 where the real thing is 202) says so in its response metadata.
    let success = resp
        .headers()
        .get(relay_contracts::HTTP_STATUS_METADATA)
        .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
        .filter(StatusCode::is_success)
        .unwrap_or(b.success);
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

    if success == StatusCode::NO_CONTENT {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let options = SerializeOptions::new().use_proto_field_name(true).skip_default_fields(false);
    let printed = match &b.response_field {
        Some(field) => match reply.get_field(field).as_message() {
            Some(inner) => raw_json::print(inner, &options),
            None => raw_json::print(&reply, &options),
        },
        None => raw_json::print(&reply, &options),
    };
    let out = printed.map_err(|e| internal(e.context("printing a reply as JSON")))?;
    Ok((success, [(header::CONTENT_TYPE, "application/json")], Body::from(out)).into_response())
}

#[cfg(test)]
mod tests;
