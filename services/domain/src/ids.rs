//! Typed ids: an endpoint's id cannot be passed where an environment's is
//! meant. Each wraps a UUID (time-ordered, v7, when Relay mints it), prints
//! and parses as one, and is stored as Postgres `uuid` (feature `sqlx`).

use std::{fmt, str::FromStr};

use uuid::Uuid;

/// A string that is not the id it was meant to be.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{what} must be a UUID, got {got:?}")]
pub struct NotAnId {
    pub what: &'static str,
    pub got: String,
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(transparent))]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(transparent))]
        #[repr(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// What the id names, as messages say it.
            pub const WHAT: &'static str = $what;

            /// A new, time-ordered id.
            pub fn mint() -> Self {
                Self(Uuid::now_v7())
            }

            pub const fn from_uuid(id: Uuid) -> Self {
                Self(id)
            }

            pub const fn uuid(self) -> Uuid {
                self.0
            }

            /// Parses `s`, naming what it was meant to be if it is not one.
            pub fn parse(s: &str) -> Result<Self, NotAnId> {
                s.parse()
            }
        }

        impl From<Uuid> for $name {
            fn from(id: Uuid) -> Self {
                Self(id)
            }
        }

        impl From<$name> for Uuid {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }

        impl FromStr for $name {
            type Err = NotAnId;

            fn from_str(s: &str) -> Result<Self, NotAnId> {
                Uuid::parse_str(s).map(Self).map_err(|_| NotAnId { what: $what, got: s.chars().take(64).collect() })
            }
        }
    };
}

typed_id!(
    /// A tenant: one environment of a customer's.
    EnvironmentId,
    "environment id"
);
typed_id!(
    /// A registered webhook endpoint.
    EndpointId,
    "endpoint id"
);
typed_id!(
    /// A published event (the tenant may choose it, to publish idempotently).
    EventId,
    "event id"
);
typed_id!(
    /// One event's delivery to one endpoint.
    DeliveryId,
    "delivery id"
);
typed_id!(
    /// A dead letter: the record of a delivery that ended without a 2xx.
    DeadLetterId,
    "dead letter id"
);
typed_id!(
    /// An API key (its id, never its secret).
    ApiKeyId,
    "api key id"
);
typed_id!(
    /// A long-running operation (a bulk recovery).
    OperationId,
    "operation id"
);
typed_id!(
    /// A dispatcher process, as it claims attempts: each run picks a new one,
    /// so a restarted dispatcher never inherits its predecessor's claims.
    DispatcherId,
    "dispatcher id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_prints_and_parses_as_its_uuid_and_a_wrong_one_is_named() {
        let id = EndpointId::mint();
        assert_eq!(id.to_string().parse::<EndpointId>(), Ok(id));
        assert_eq!(Uuid::from(id), id.uuid());
        let err = EventId::parse("nope").unwrap_err();
        assert_eq!(err.to_string(), "event id must be a UUID, got \"nope\"");
        assert_eq!(format!("{:?}", DeliveryId::from_uuid(Uuid::nil())), "DeliveryId(00000000-0000-0000-0000-000000000000)");
    }
}
