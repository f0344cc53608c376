//! Every reason a caller is told, in one catalogue: the api names each
//! refusal with one of these; REST puts it in the JSON error's `reason`,
//! gRPC in the `relay-error-reason` metadata of the status, and the
//! dispatcher decides what the broker is told from the seam's ones. A new
//! refusal is a new variant here; the strings appear nowhere else, and a
//! test holds docs/api.md to the tenant-visible ones.

macro_rules! catalogue {
    ($( $(#[$doc:meta])* $name:ident = $text:literal, )*) => {
        /// A machine-readable reason, stable on the wire (`as_str`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$doc])* $name, )*
        }

        impl Reason {
            /// Every reason, for tests that walk the catalogue.
            pub const ALL: &'static [Reason] = &[$(Reason::$name),*];

            /// The reason as the wire carries it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( Reason::$name => $text, )*
                }
            }

            /// The reason a wire string names, if it is one.
            pub fn parse(text: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|r| r.as_str() == text)
            }
        }
    };
}

catalogue! {
    // The internal seam (api ⇄ dispatcher).
    /// A batch item not served in this reply (its budget was spent on the
    /// items before it); ask for it again. Not a failure of the item.
    Deferred = "deferred",
    /// Another dispatcher holds this attempt (it fetched the material and
    /// has not yet reported): do not send, ask again later. If the holder
    /// died, its claim runs out and the attempt is handed out again.
    InHandElsewhere = "in_hand_elsewhere",
    /// A lane follower's report (sent on its predecessor's 2xx) whose
    /// predecessor's outcome is not yet recorded: report it again shortly.
    PredecessorUnrecorded = "predecessor_unrecorded",
    /// The attempt is no longer the delivery's current one (reported, the
    /// delivery finished, or a replay began a new generation): nothing to send.
    StaleAttempt = "stale_attempt",
    /// The endpoint was disabled or deleted; its pending deliveries end as
    /// dead letters: nothing to send.
    EndpointInactive = "endpoint_inactive",
    /// An event whose environment or type is not what the api stored.
    EventMismatch = "event_mismatch",
    /// A replay of a delivery that is no longer dead.
    AlreadyReplayed = "already_replayed",
    /// An outcome report's attempt number outside the schedule.
    AttemptOutOfRange = "attempt_out_of_range",
    /// An outcome report's generation below 1.
    GenerationOutOfRange = "generation_out_of_range",
    /// An outcome report's HTTP status outside 100–599.
    HttpStatusOutOfRange = "http_status_out_of_range",
    /// An outcome report's latency beyond a day.
    LatencyOutOfRange = "latency_out_of_range",
    /// An outcome report's texts beyond their bound.
    ReportTooLarge = "report_too_large",
    /// A material request's claim hold outside its bounds.
    HoldOutOfRange = "hold_out_of_range",
    /// A signature scheme this build does not know.
    UnknownSignatureScheme = "unknown_signature_scheme",

    // Any caller.
    /// No such resource (or another tenant's: the same answer).
    NotFound = "not_found",
    /// A required field left out.
    MissingField = "missing_field",
    /// An id that is not a UUID.
    InvalidId = "invalid_id",
    /// A time that is not RFC 3339, or that Postgres cannot store.
    InvalidTimestamp = "invalid_timestamp",
    /// A time range whose start is after its end.
    InvalidRange = "invalid_range",
    /// A page size outside its bounds.
    InvalidLimit = "invalid_limit",
    /// A page cursor this api did not hand out.
    InvalidCursor = "invalid_cursor",
    /// A credential of the wrong kind for the service called.
    WrongCredentialType = "wrong_credential_type",
    /// No valid credential.
    Unauthenticated = "unauthenticated",
    /// A valid credential without the right to this.
    PermissionDenied = "permission_denied",
    /// A message that does not decode as its protobuf type.
    UndecodableMessage = "undecodable_message",
    /// More work than the api takes on at once; retry after the pause asked.
    Overloaded = "overloaded",
    /// A bound on requests or resources reached.
    ResourceExhausted = "resource_exhausted",
    /// Invalid input without a more precise reason.
    InvalidArgument = "invalid_argument",
    /// The api cannot serve this now; retry.
    Unavailable = "unavailable",
    /// The api failed; the cause is in its logs, never in the answer.
    Internal = "internal",
    /// A status without a reason of its own.
    Error = "error",

    // Events.
    /// A payload that is not one JSON value.
    InvalidPayload = "invalid_payload",
    /// A payload beyond 256 KiB as delivered.
    PayloadTooLarge = "payload_too_large",
    /// A payload nested deeper than 64 arrays or objects.
    PayloadTooDeep = "payload_too_deep",
    /// The old `google.protobuf.Value` payload field, which alters numbers.
    LegacyPayloadRefused = "legacy_payload_refused",
    /// An event type outside the naming rules.
    InvalidEventType = "invalid_event_type",
    /// A payload that does not satisfy its event type's schema; the message
    /// lists the first violations with their JSON pointers.
    PayloadSchemaMismatch = "payload_schema_mismatch",
    /// An event type not in the catalogue of an environment that requires
    /// known types (publishing, or subscribing an endpoint).
    UnknownEventType = "unknown_event_type",

    // The event catalogue.
    /// A schema that is not a bounded JSON Schema (2020-12) usable on its own.
    InvalidSchema = "invalid_schema",
    /// Examples that are not a JSON array of at most 10 payloads satisfying
    /// the schema.
    InvalidExamples = "invalid_examples",
    /// A description beyond 2,000 characters or with control characters.
    InvalidDescription = "invalid_description",
    /// Creating an event type the catalogue already has.
    EventTypeExists = "event_type_exists",
    /// A catalogue at its 1,000 types.
    CatalogueFull = "catalogue_full",
    /// A publish over its environment's publish limit; retry after the
    /// pause the answer names (Retry-After).
    PublishRateLimited = "publish_rate_limited",
    /// A publish limit outside 1–10,000 a second (burst 1–10,000).
    PublishLimitOutOfRange = "publish_limit_out_of_range",
    /// A second listener (relay-dev listen) with an API key whose first is
    /// still connected.
    ListenerActive = "listener_active",
    /// A new URL for a listener's endpoint (relay-dev listen): it delivers
    /// only to its listener, for as long as the listener lives.
    ListenerUrlFixed = "listener_url_fixed",

    // Endpoints and environments.
    /// An endpoint URL refused by the address rules (https, public addresses).
    EndpointUrlRejected = "endpoint_url_rejected",
    /// An endpoint without any event type.
    MissingEventTypes = "missing_event_types",
    /// An endpoint subscribed to more event types than allowed.
    TooManyEventTypes = "too_many_event_types",
    /// The environment already has its quota of endpoints.
    EndpointQuotaExceeded = "endpoint_quota_exceeded",
    /// A signature scheme name that is not one of Relay's.
    InvalidSignatureScheme = "invalid_signature_scheme",
    /// Custom headers outside the rules (a name that is not a token or that
    /// Relay sets, a value that is not printable, too many or too large).
    InvalidHeaders = "invalid_headers",
    /// An endpoint's `max_in_flight` outside 1–1000.
    MaxInFlightOutOfRange = "max_in_flight_out_of_range",
    /// An endpoint's `rate_limit` outside its bounds (1–10,000 a second,
    /// bursts of 1–10,000).
    RateLimitOutOfRange = "rate_limit_out_of_range",
    /// A client certificate or key that does not parse, does not match, or
    /// is not valid now.
    InvalidClientCertificate = "invalid_client_certificate",
    /// A CA bundle that is not PEM certificates a TLS client can trust.
    InvalidCaBundle = "invalid_ca_bundle",
    /// OAuth2 client credentials outside the rules (a token URL Relay may
    /// not call, an empty or oversized field).
    InvalidOauthCredentials = "invalid_oauth_credentials",
    /// A payload filter that is not valid JSON, not within its bounds or
    /// not in the filter language (the message names the JSON pointer).
    InvalidFilter = "invalid_filter",
    /// An ordering key beyond 256 bytes or holding control characters.
    InvalidOrderingKey = "invalid_ordering_key",
    /// An endpoint `ordering` that is not "none" or "per_key".
    InvalidOrdering = "invalid_ordering",
    /// A secret that Standard Webhooks cannot use (its scheme needs `whsec_`).
    SecretNotStandardWebhooks = "secret_not_standard_webhooks",
    /// A destructive operation asked without `confirm`.
    NotConfirmed = "not_confirmed",
    /// A name outside the naming rules.
    InvalidName = "invalid_name",
    /// A name beyond its length.
    NameTooLong = "name_too_long",
    /// An endpoint quota outside its bounds.
    QuotaOutOfRange = "quota_out_of_range",
    /// A disable window outside its bounds.
    DisableWindowOutOfRange = "disable_window_out_of_range",
    /// A disable threshold outside its bounds.
    DisableMinFailuresOutOfRange = "disable_min_failures_out_of_range",
    /// A bound on held deliveries outside its range.
    MaxHeldOutOfRange = "max_held_out_of_range",

    // The REST facade's own.
    /// A path no route serves.
    NoRoute = "no_route",
    /// A route that does not take this method.
    MethodNotAllowed = "method_not_allowed",
    /// A path that does not decode (percent-encoding, dot segments).
    InvalidPath = "invalid_path",
    /// An API key in the URL, where logs keep it.
    CredentialInUrl = "credential_in_url",
    /// A query parameter the route does not know.
    UnknownParameter = "unknown_parameter",
    /// A query parameter's value that does not parse.
    InvalidParameter = "invalid_parameter",
    /// A body that is not JSON, or not the request's message.
    InvalidJson = "invalid_json",
    /// A JSON member given twice.
    DuplicateField = "duplicate_field",
    /// A body field that contradicts the path.
    PathFieldConflict = "path_field_conflict",
    /// A path's field given again in the query.
    PathFieldInQuery = "path_field_in_query",
    /// A `Content-Length` that is not a length.
    InvalidContentLength = "invalid_content_length",
    /// A body beyond the route's bound.
    BodyTooLarge = "body_too_large",
    /// A body not finished within its time limit.
    BodyTimeout = "body_timeout",
    /// A body that could not be read.
    UnreadableBody = "unreadable_body",
    /// A request target beyond its bound.
    UriTooLong = "uri_too_long",
    /// Header fields beyond their bound.
    HeadersTooLarge = "headers_too_large",
    /// A request that does not parse as HTTP/1.1.
    MalformedRequest = "malformed_request",
}

impl Reason {
    /// The reasons the dispatcher decides a broker verdict by, whatever
    /// status code carries them.
    pub const SEAM: &'static [Reason] = &[
        Reason::Deferred,
        Reason::InHandElsewhere,
        Reason::PredecessorUnrecorded,
        Reason::StaleAttempt,
        Reason::EndpointInactive,
        Reason::NotFound,
        Reason::EventMismatch,
        Reason::AlreadyReplayed,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_distinct_snake_case_and_parses_back() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            let s = r.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(!s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{s}");
            assert_eq!(Reason::parse(s), Some(*r));
        }
        assert_eq!(Reason::parse("no_such_reason"), None);
    }

    #[test]
    fn docs_api_md_lists_every_reason() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.md")).expect("docs/api.md");
        let missing: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).filter(|r| !doc.contains(&format!("| `{r}` |"))).collect();
        assert!(missing.is_empty(), "docs/api.md's table of reasons lacks {missing:?}");
    }
}
