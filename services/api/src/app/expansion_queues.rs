//! The api's two expansion queues, each on a connection of its own: a
//! quiet environment's event does not wait for a burst's batch.
//!
//! Why: one queue on one connection took everything waiting, in arrival
//! order, up to a batch's bound. Beside a burst (relay-bench `w5`) the
//! batch in progress was the burst's — up to the dispatcher's share of
//! it, 16 events to 10 endpoints each, material and all — and a quiet
//! environment's event waited for that batch to end before its own began
//! (the hop log: 9.1 / 42.0 ms p50 / p99 there, 0.2 / 0.4 alone).
//!
//! Which queue: the dispatcher's fair turns know which environments are
//! quiet (little in flight beside others' work) and send their items in
//! calls of their own, marked `express`; those go to the express queue,
//! everything else to the main one, as before. The api does not count
//! asks itself for this: a burst's asks reach it in waves (a batch's
//! answers, then the next calls), so between two waves it has none here
//! and would look quiet, where the dispatcher's count of it never drops.
//! So an environment alone keeps the one queue and its batches as large as
//! ever, and a quiet environment's event waits for at most the express
//! batch in progress — other quiet environments' — and, inside it, for the
//! lease holder in progress (the two queues' writes take turns under the
//! lease guard like any expansion and relay pass, the express queue's
//! ahead of the line: `app::lease_guard`).
//!
//! Bound: an environment has at most `EXPRESS_EACH` asks in the express
//! queue at once, whatever its callers say; the rest go to the main queue.
//!
//! Order: two asks of one environment can run at once, one in each queue.
//! Events of one ordering key are still written in their order — the
//! expansion statement defers an event whose key's earlier event is not
//! written yet, and the dispatcher asks again — as with two apis.
//!
//! Invariant: `express_of` counts each express ask from the moment it is
//! queued until its caller has its answer or stops waiting (dropped).

use std::{collections::HashMap, sync::Mutex};

use relay_domain::EnvironmentId;

use super::{deliveries::Expanded, expansion::ExpandAsk};
use crate::{db::batcher::Batcher, error::AppResult};

/// Asks of one environment in the express queue at once, at most.
const EXPRESS_EACH: usize = 4;

#[derive(Debug)]
pub struct ExpansionQueues {
    main: Batcher<ExpandAsk, Expanded>,
    express: Batcher<ExpandAsk, Expanded>,
    express_of: Mutex<HashMap<EnvironmentId, usize>>,
    /// Asks taken, by queue: main, express.
    counted: [prometheus::IntCounter; 2],
}

/// Counts a call's express asks out again however the call ends.
struct Counted<'a> {
    express_of: &'a Mutex<HashMap<EnvironmentId, usize>>,
    envs: Vec<EnvironmentId>,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let mut express_of = self.express_of.lock().unwrap_or_else(|p| p.into_inner());
        leave(&mut express_of, &self.envs);
    }
}

/// Which of these asks (by environment) the express queue takes, counted in.
fn enter(express_of: &mut HashMap<EnvironmentId, usize>, envs: &[EnvironmentId]) -> Vec<bool> {
    envs.iter()
        .map(|env| {
            let n = express_of.entry(*env).or_default();
            let express = *n < EXPRESS_EACH;
            *n += usize::from(express);
            express
        })
        .collect()
}

fn leave(express_of: &mut HashMap<EnvironmentId, usize>, envs: &[EnvironmentId]) {
    for env in envs {
        if let Some(n) = express_of.get_mut(env) {
            *n -= 1;
            if *n == 0 {
                express_of.remove(env);
            }
        }
    }
}

impl ExpansionQueues {
    pub fn new(main: Batcher<ExpandAsk, Expanded>, express: Batcher<ExpandAsk, Expanded>, asks: &prometheus::IntCounterVec) -> Self {
        let counted = ["main", "express"].map(|queue| asks.with_label_values(&[queue]));
        Self { main, express, express_of: Mutex::default(), counted }
    }

    /// Each ask's answer, in order; asks of one call share batches where
    /// they share a queue. `express`: the caller's asks are of quiet
    /// environments (see the module's doc).
    pub async fn call_all(&self, asks: Vec<ExpandAsk>, express: bool) -> Vec<AppResult<Expanded>> {
        if !express {
            self.counted[0].inc_by(asks.len() as u64);
            return self.main.call_all(asks).await;
        }
        let envs: Vec<EnvironmentId> = asks.iter().map(|a| a.item.environment_id).collect();
        let taken = enter(&mut self.express_of.lock().unwrap_or_else(|p| p.into_inner()), &envs);
        let (mut to_express, mut to_main) = (Vec::new(), Vec::new());
        let mut counted = Counted { express_of: &self.express_of, envs: Vec::new() };
        for (ask, express) in asks.into_iter().zip(&taken) {
            if *express {
                counted.envs.push(ask.item.environment_id);
                to_express.push(ask);
            } else {
                to_main.push(ask);
            }
        }
        self.counted[1].inc_by(to_express.len() as u64);
        self.counted[0].inc_by(to_main.len() as u64);
        let (expressed, mained) = if to_main.is_empty() {
            (self.express.call_all(to_express).await, Vec::new())
        } else {
            tokio::join!(self.express.call_all(to_express), self.main.call_all(to_main))
        };
        let (mut expressed, mut mained) = (expressed.into_iter(), mained.into_iter());
        taken.into_iter().map(|e| if e { expressed.next() } else { mained.next() }.expect("one answer per ask")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_environment_has_at_most_its_express_share_in_the_express_queue_and_each_ask_is_counted_out() {
        let (quiet, other) = (EnvironmentId::mint(), EnvironmentId::mint());
        let mut of = HashMap::new();
        let first = enter(&mut of, &[quiet; 6]);
        assert_eq!(first, [true, true, true, true, false, false], "four express, the rest main");
        assert_eq!(enter(&mut of, &[other, quiet]), [true, false], "another environment has its own share");
        leave(&mut of, &[quiet]);
        assert_eq!(enter(&mut of, &[quiet]), [true], "one of its own ended: room for one");
        leave(&mut of, &[quiet; 4]);
        leave(&mut of, &[other]);
        assert!(of.is_empty(), "everything counted out: {of:?}");
    }
}
