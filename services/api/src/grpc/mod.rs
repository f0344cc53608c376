//! Thin tonic adapters over the use-cases in `app`: decode, authorise, call,
//! encode. No business rule lives here.

pub mod admin;
pub mod dispatch;
pub mod tenant;

use relay_contracts::ERROR_REASON_METADATA;
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
        ErrorCode::Unavailable => Code::Unavailable,
        ErrorCode::Internal => Code::Internal,
    };
    if let Some(src) = &e.source {
        tracing::error!(reason = e.reason, error = format!("{src:#}"), "request failed");
    }
    let mut st = Status::new(code, crate::error::bounded(&e.message));
    if let Ok(v) = e.reason.parse() {
        st.metadata_mut().insert(ERROR_REASON_METADATA, v);
    }
    st
}

pub fn ts(t: Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: t.timestamp(), nanos: t.timestamp_subsec_nanos() as i32 }
}

pub fn id(field: &'static str, raw: &str) -> Result<Uuid, Status> {
    parse_id(field, raw).map_err(status)
}
