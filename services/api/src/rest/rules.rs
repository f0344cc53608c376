//! The REST routes, read from the contracts' `google.api.http` annotations
//! (and relay's own options) once, at start-up.

use anyhow::{Context, Result, bail};
use axum::http::{Method, StatusCode};
use prost_reflect::{DescriptorPool, ExtensionDescriptor, FieldDescriptor, Kind, MessageDescriptor, MethodDescriptor};
use relay_contracts::FILE_DESCRIPTOR_SET;

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
    /// Fields bound by the path template, which nothing else may set.
    pub(crate) path_fields: Vec<String>,
    /// Input fields carrying JSON text (`relay.options.v1.raw_json`).
    pub(crate) raw_json: Vec<FieldDescriptor>,
}

struct Extensions {
    http: ExtensionDescriptor,
    success: ExtensionDescriptor,
    raw_json: ExtensionDescriptor,
}

/// The contracts' descriptors and the extensions the facade reads, decoded once.
fn pool() -> Result<&'static (DescriptorPool, Extensions)> {
    static POOL: std::sync::OnceLock<(DescriptorPool, Extensions)> = std::sync::OnceLock::new();
    if let Some(p) = POOL.get() {
        return Ok(p);
    }
    let pool = DescriptorPool::decode(FILE_DESCRIPTOR_SET).context("decoding the contracts' descriptor set")?;
    let ext = |name: &str| pool.get_extension_by_name(name).with_context(|| format!("{name} is not in the descriptor set"));
    let ext = Extensions {
        http: ext("google.api.http")?,
        success: ext("relay.options.v1.http_success_status")?,
        raw_json: ext("relay.options.v1.raw_json")?,
    };
    Ok(POOL.get_or_init(|| (pool, ext)))
}

/// Whether a field carries JSON text that REST writes as a JSON value.
pub(crate) fn is_raw_json(field: &FieldDescriptor) -> bool {
    let Ok((_, ext)) = pool() else { return false };
    field.kind() == Kind::String && field.options().get_extension(&ext.raw_json).as_bool() == Some(true)
}

fn path_params(path: &str) -> Vec<String> {
    path.split('/').filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).map(str::to_owned).collect()
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
    let path_fields = path_params(&path);
    for p in &path_fields {
        if method.input().get_field_by_name(p).is_none() {
            bail!("{}: path parameter {p:?} is not a field of {}", method.full_name(), method.input().full_name());
        }
    }
    let raw_json = method.input().fields().filter(is_raw_json).collect();
    let binding = Binding {
        method: method.clone(),
        grpc_path: format!("/{}/{}", method.parent_service().full_name(), method.name()),
        input: method.input(),
        output: method.output(),
        body_all: body == "*",
        response_field,
        success,
        path_fields,
        raw_json,
    };
    Ok(Some((verb, path, binding)))
}

pub(crate) fn rest_methods() -> Result<Vec<(Method, String, Binding)>> {
    let (pool, ext) = pool()?;
    let mut out = Vec::new();
    for service in pool.services().filter(|s| REST_PACKAGES.contains(&s.package_name())) {
        for method in service.methods() {
            if let Some(r) = rule_of(&method, ext)? {
                out.push(r);
            }
        }
    }
    Ok(out)
}
