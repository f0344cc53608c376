//! Telling a dispatcher that attempts it holds were switched off (their
//! endpoint disabled or deleted by its tenant), as the use-cases see it: a
//! trait, so they hold no broker connection of their own. Why and for how
//! long a switch-off waits for the answer: `app::endpoints`.

use std::{fmt, future::Future, pin::Pin, time::Duration};

use prost::Message;
use relay_contracts::{StreamNames, relay::queue::v1::SwitchedOff};
use relay_domain::DispatcherId;

/// Why a dispatcher did not answer a switch-off notice.
#[derive(Debug, thiserror::Error)]
pub enum Unanswered {
    /// Nobody listens on its subject: it is gone, cut off from the broker,
    /// or older than the notices.
    #[error("no dispatcher listens for its notices")]
    NoListener,
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
    #[error("the notice could not be sent: {0}")]
    Broker(String),
}

/// Sends one dispatcher a switch-off notice and waits, at most `within`,
/// for its answer: that none of the attempts will start and none is on the
/// wire.
pub trait SwitchOffs: Send + Sync + fmt::Debug {
    fn tell<'a>(
        &'a self,
        claimant: DispatcherId,
        notice: &'a SwitchedOff,
        within: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), Unanswered>> + Send + 'a>>;
}

/// Core NATS (not a stream: a notice matters only to a dispatcher listening
/// now), on the claimant's own subject.
#[derive(Debug)]
pub struct NatsSwitchOffs {
    pub client: async_nats::Client,
    pub names: StreamNames,
}

impl SwitchOffs for NatsSwitchOffs {
    fn tell<'a>(
        &'a self,
        claimant: DispatcherId,
        notice: &'a SwitchedOff,
        within: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), Unanswered>> + Send + 'a>> {
        Box::pin(async move {
            let request = async_nats::Request::new().payload(notice.encode_to_vec().into()).timeout(Some(within));
            match self.client.send_request(self.names.switched_off_subject(&claimant.to_string()), request).await {
                Ok(_) => Ok(()),
                Err(e) => Err(match e.kind() {
                    async_nats::RequestErrorKind::NoResponders => Unanswered::NoListener,
                    async_nats::RequestErrorKind::TimedOut => Unanswered::TimedOut(within),
                    _ => Unanswered::Broker(e.to_string()),
                }),
            }
        })
    }
}
