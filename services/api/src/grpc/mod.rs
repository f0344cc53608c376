//! Thin tonic adapters over the use-cases in `app`: decode, authorise, call,
//! encode. No business rule lives here.

pub mod admin;
pub mod catalogue;
pub mod dispatch;
pub mod listen;
pub mod tenant;

use relay_contracts::ERROR_REASON_METADATA;
use relay_domain::Reason;
use tonic::{Code, Status};
use uuid::Uuid;

use crate::{
    app::Timestamp,
    error::{AppError, ErrorCode, parse_id},
};

/// The largest tenant message the gRPC port (and the REST facade's
/// in-process call) decodes: a publish at the envelope's limit, with room.
pub const MAX_TENANT_MESSAGE_BYTES: usize = 512 * 1024;
/// Tenant gRPC calls admitted at once; with the limit above, at most 32 MiB
/// of tenant messages are buffered.
pub const TENANT_CALLS_IN_MEMORY: usize = 64;

/// The single mapping from the app's error to a gRPC status. Internal causes
/// are logged with their chain and never sent.
pub fn status(e: AppError) -> Status {
    let code = match e.code {
        ErrorCode::InvalidArgument => Code::InvalidArgument,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::AlreadyExists => Code::AlreadyExists,
        ErrorCode::FailedPrecondition => Code::FailedPrecondition,
        ErrorCode::ResourceExhausted { .. } => Code::ResourceExhausted,
        ErrorCode::Unavailable => Code::Unavailable,
        ErrorCode::Internal => Code::Internal,
    };
    if let Some(src) = &e.source {
        tracing::error!(reason = e.reason.as_str(), error = format!("{src:#}"), "request failed");
    }
    let mut st = Status::new(code, crate::error::bounded(&e.message));
    if let Ok(v) = e.reason.as_str().parse() {
        st.metadata_mut().insert(ERROR_REASON_METADATA, v);
    }
    if let ErrorCode::ResourceExhausted { retry_after_secs } = e.code {
        st.metadata_mut().insert(relay_contracts::RETRY_AFTER_METADATA, retry_after_secs.into());
    }
    st
}

pub fn ts(t: Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: t.timestamp(), nanos: t.timestamp_subsec_nanos() as i32 }
}

pub fn id<Id: From<Uuid>>(field: &'static str, raw: &str) -> Result<Id, Status> {
    parse_id(field, raw).map_err(status)
}

/// An id field where empty means none.
pub fn optional_id<Id: From<Uuid>>(field: &'static str, raw: &str) -> Result<Option<Id>, Status> {
    let raw = raw.trim();
    if raw.is_empty() { Ok(None) } else { id(field, raw).map(Some) }
}

/// A required timestamp field, as the use-cases take it.
pub fn time(field: &'static str, raw: Option<&prost_types::Timestamp>) -> Result<Timestamp, Status> {
    let Some(t) = raw else {
        return Err(status(crate::error::AppError::invalid(Reason::MissingField, format!("{field} is required"))));
    };
    let t = chrono::DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(u32::MAX)).ok_or_else(|| {
        status(crate::error::AppError::invalid(Reason::InvalidTimestamp, format!("{field} is out of range: {}s {}ns", t.seconds, t.nanos)))
    })?;
    crate::app::check_time(field, t).map_err(status)
}

/// A recovery request as both adapters (tenant, operator) read it, and the
/// answer: a dry run's count or the started operation's id, and whether the
/// REST facade should say 200 (a dry run) instead of 202.
pub(crate) async fn recover(
    app: &crate::app::App,
    tenant: Option<crate::app::Tenant>,
    endpoint_id: &str,
    since: Option<&prost_types::Timestamp>,
    until: Option<&prost_types::Timestamp>,
    dry_run: bool,
) -> Result<(Option<u32>, Option<String>, tonic::metadata::MetadataMap), Status> {
    use crate::app::bulk_recovery::Recovery;
    let endpoint_id = id("id", endpoint_id)?;
    let (since, until) = (time("since", since)?, time("until", until)?);
    let mut meta = tonic::metadata::MetadataMap::new();
    match app.recover_endpoint(tenant, endpoint_id, since, until, dry_run).await.map_err(status)? {
        Recovery::WouldRecover(n) => {
            meta.insert(relay_contracts::HTTP_STATUS_METADATA, tonic::metadata::MetadataValue::from_static("200"));
            Ok((Some(n), None, meta))
        }
        Recovery::Started(op) => Ok((None, Some(op.id.to_string()), meta)),
    }
}

pub(crate) fn operation(op: relay_domain::models::Operation) -> relay_contracts::relay::tenant::v1::Operation {
    relay_contracts::relay::tenant::v1::Operation {
        id: op.id.to_string(),
        state: op.state,
        total: op.total.max(0) as u32,
        completed: op.completed.max(0) as u32,
        error: op.error.unwrap_or_default(),
    }
}
