//! Generates the Rust side of every contract in `proto/`, plus the descriptor
//! set that server reflection and the REST facade read at run time.

use std::{env, path::PathBuf};

/// Messages that carry a secret in clear: their `Debug` is written by hand in
/// `lib.rs` so that a stray `{:?}` can never print one.
const SECRET_BEARING: &[&str] = &[
    ".relay.tenant.v1.CreateWebhookEndpointRequest",
    ".relay.tenant.v1.UpdateWebhookEndpointRequest",
    ".relay.tenant.v1.CreateWebhookEndpointResponse",
    ".relay.tenant.v1.RotateWebhookEndpointSecretResponse",
    ".relay.tenant.v1.CreatePortalSessionResponse",
    ".relay.admin.v1.CreateApiKeyResponse",
    ".relay.dispatch.v1.MaterialResponse",
    ".relay.dispatch.v1.OAuth2ClientCredentials",
    ".relay.tenant.v1.OAuth2ClientCredentials",
    ".relay.tenant.v1.ListenReady",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not when it was compiled: a build script
    // compiled for one checkout may be run for another sharing the target
    // directory (a worktree), and would generate that one's contracts.
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let out = PathBuf::from(env::var("OUT_DIR")?);
    if env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded.
        unsafe { env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let wkt = protoc_bin_vendored::include_path()?;

    let files = [
        "relay/options/v1/options.proto",
        "relay/tenant/v1/webhooks.proto",
        "relay/tenant/v1/events.proto",
        "relay/tenant/v1/dead_letters.proto",
        "relay/tenant/v1/portal.proto",
        "relay/tenant/v1/event_types.proto",
        "relay/tenant/v1/listen.proto",
        "relay/admin/v1/admin.proto",
        "relay/dispatch/v1/dispatch.proto",
        "relay/queue/v1/queue.proto",
    ]
    .map(|f| root.join(f));

    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("relay_descriptor.bin"))
        .include_file("relay.rs")
        .skip_debug(SECRET_BEARING.iter().copied())
        .compile_protos(&files, &[root.clone(), wkt])?;
    println!("cargo:rerun-if-changed={}", root.display());
    Ok(())
}
