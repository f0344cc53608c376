//! Fair turns across environments for work that queues in this process
//! (expansions): at most `cap_all` items in flight, at most `cap_each` of
//! them one environment's while others have work, and the next to start
//! taken from the environments with work waiting in turn, each
//! environment's own in the order it came.
//!
//! Why: the broker hands events over first come, and one environment's
//! burst put hundreds of its events in flight ahead of a quiet neighbour's
//! (W5 in relay-bench: the quiet one's p99 dozens of times its solo p99).
//! With a cap per environment, the api's queue holds at most `cap_each` of
//! the burst when the quiet environment's event arrives, and that event
//! starts at once: its wait is the burst's share, not the burst.
//!
//! The cap is for neighbours: an environment alone (no other offered an item
//! within `CONTENDED_FOR`, none has one waiting or in flight) may use all of
//! `cap_all`. Held to `cap_each` with nobody beside it, one environment's
//! throughput was `cap_each` over an expansion's round trip, and its
//! expansion batches half empty (relay-bench `w1`/`w6`: statements per
//! delivery ×2.2–2.6). A neighbour that has offered anything lately keeps
//! the cap in force, so a steady quiet environment never meets a burst's
//! full window; one quiet for longer waits, for its first event, behind
//! what the burst had in flight (once; from then on the cap holds).
//!
//! Invariant: an environment's items start in their arrival order (events of
//! one ordering key are expanded in publish order); `in_flight` counts what
//! was started and has not been reported `ended`.

use std::{
    collections::{HashMap, VecDeque},
    time::Duration,
};

use tokio::time::Instant;

/// How long after its last item an environment still counts as a
/// neighbour that holds others to `cap_each`: longer than the gaps between
/// the events of a steady publisher, so that its events never wait behind
/// a burst's whole window.
pub(crate) const CONTENDED_FOR: Duration = Duration::from_secs(2);

/// An environment with less than this share of `cap_each` in flight, beside
/// others', is a quiet one: its items go by the express way. A burst,
/// held to `cap_each` while it has a backlog, is never below it (its
/// count drops by one as an item ends and the next starts at once).
const EXPRESS_SHARE: usize = 4;

/// An item that starts now, of `env`.
pub(crate) struct Started<T> {
    pub(crate) env: String,
    pub(crate) item: T,
    /// `env` has less than its express share in flight (`EXPRESS_SHARE`),
    /// and another environment has some: the item goes by the
    /// express way (see `consume`), so that it does not wait for a call
    /// carrying the others' items.
    pub(crate) express: bool,
}

pub(crate) struct Turns<T> {
    cap_all: usize,
    cap_each: usize,
    total: usize,
    in_flight: HashMap<String, usize>,
    waiting: HashMap<String, VecDeque<T>>,
    /// Environments with items waiting, in the order of their next turn.
    ring: VecDeque<String>,
    /// When each environment last offered an item or had one end, for
    /// those seen within `CONTENDED_FOR` (and some seen a little longer
    /// ago: pruned at most every `CONTENDED_FOR / 8`).
    seen: HashMap<String, Instant>,
    pruned_at: Instant,
}

impl<T> Turns<T> {
    pub(crate) fn new(cap_all: usize, cap_each: usize) -> Self {
        let cap_all = cap_all.max(1);
        Self {
            cap_all,
            cap_each: cap_each.clamp(1, cap_all),
            total: 0,
            in_flight: HashMap::new(),
            waiting: HashMap::new(),
            ring: VecDeque::new(),
            seen: HashMap::new(),
            pruned_at: Instant::now(),
        }
    }

    /// Adds an item of `env`; returns the items that start now.
    pub(crate) fn offer(&mut self, env: String, item: T) -> Vec<Started<T>> {
        self.seen.insert(env.clone(), Instant::now());
        let queue = self.waiting.entry(env.clone()).or_default();
        if queue.is_empty() {
            self.ring.push_back(env);
        }
        queue.push_back(item);
        self.start()
    }

    /// An item of `env` ended; returns the items that start now.
    pub(crate) fn ended(&mut self, env: &str) -> Vec<Started<T>> {
        if let Some(seen) = self.seen.get_mut(env) {
            *seen = Instant::now();
        }
        if let Some(n) = self.in_flight.get_mut(env) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.in_flight.remove(env);
            }
        }
        self.start()
    }

    /// Items waiting to start.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    /// What one environment may have in flight now: `cap_each` while
    /// another has been seen lately, else everything.
    fn cap_now(&mut self) -> usize {
        let now = Instant::now();
        if now.duration_since(self.pruned_at) >= CONTENDED_FOR / 8 {
            self.pruned_at = now;
            let (in_flight, waiting) = (&self.in_flight, &self.waiting);
            self.seen.retain(|env, at| now.duration_since(*at) < CONTENDED_FOR || in_flight.contains_key(env) || waiting.contains_key(env));
        }
        if self.seen.len() > 1 { self.cap_each } else { self.cap_all }
    }

    fn start(&mut self) -> Vec<Started<T>> {
        let cap_each = self.cap_now();
        let express_below = (self.cap_each / EXPRESS_SHARE).max(1);
        let mut started = Vec::new();
        // Each look goes once round the ring at most: an environment at its
        // cap keeps its place and is passed over.
        let mut passed = 0;
        while self.total < self.cap_all && passed < self.ring.len() {
            let env = self.ring.pop_front().expect("ring not empty");
            let busy = self.in_flight.get(&env).copied().unwrap_or(0);
            if busy >= cap_each {
                self.ring.push_back(env);
                passed += 1;
                continue;
            }
            let queue = self.waiting.get_mut(&env).expect("a ring member has a queue");
            let item = queue.pop_front().expect("a ring member has work");
            if queue.is_empty() {
                self.waiting.remove(&env);
            } else {
                self.ring.push_back(env.clone());
            }
            let mine = self.in_flight.entry(env.clone()).or_default();
            let express = *mine < express_below && self.total > *mine;
            *mine += 1;
            self.total += 1;
            passed = 0;
            started.push(Started { env, item, express });
        }
        started
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(started: Vec<Started<u32>>) -> Vec<String> {
        started.into_iter().map(|s| format!("{}{}{}", s.env, s.item, if s.express { "!" } else { "" })).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_takes_its_share_beside_a_neighbour_and_a_quiet_environment_starts_at_once() {
        let mut t = Turns::new(4, 2);
        assert_eq!(names(t.offer("q".into(), 0)), ["q0"]);
        assert!(t.ended("q").is_empty());
        let mut started = Vec::new();
        for i in 0..10 {
            started.extend(t.offer("b".into(), i));
        }
        assert_eq!(names(started), ["b0", "b1"], "the burst is held to its cap: q offered an item lately");
        assert_eq!(t.waiting(), 8);
        assert_eq!(names(t.offer("q".into(), 1)), ["q1!"], "a quiet environment's item starts at once, by the express way");
        assert_eq!(names(t.ended("b")), ["b2"], "the burst goes on in its order");
        assert_eq!(names(t.ended("q")), Vec::<String>::new(), "nothing of q waits; b is at its cap");
    }

    /// Alone, an environment uses the whole window; a neighbour's item holds
    /// it to its share again, and once the neighbour has been quiet for
    /// `CONTENDED_FOR` the window is the burst's again. Time is paused.
    #[tokio::test(start_paused = true)]
    async fn an_environment_alone_uses_the_whole_window_until_a_neighbour_comes() {
        let mut t = Turns::new(4, 2);
        let mut started = Vec::new();
        for i in 0..10 {
            started.extend(t.offer("b".into(), i));
        }
        assert_eq!(names(started), ["b0", "b1", "b2", "b3"], "nobody else has work: the burst takes every slot");
        assert!(t.offer("q".into(), 0).is_empty(), "every slot is taken");
        assert_eq!(names(t.ended("b")), ["q0!"], "the first slot freed is the neighbour's");
        assert!(t.ended("b").is_empty(), "the burst has 2 in flight, its share beside q");
        assert!(t.ended("q").is_empty(), "q's item ended, but q was seen lately: b keeps to its share");
        assert_eq!(names(t.ended("b")), ["b4"], "below its share, the burst goes on in its order");

        tokio::time::advance(CONTENDED_FOR + Duration::from_millis(500)).await;
        assert_eq!(names(t.ended("b")), ["b5", "b6", "b7"], "q quiet for CONTENDED_FOR: the window is the burst's again");
    }

    #[test]
    fn the_overall_cap_is_shared_in_turns_and_each_environment_keeps_its_order() {
        let mut t = Turns::new(3, 3);
        let mut started = Vec::new();
        for i in 0..3 {
            started.extend(t.offer("a".into(), i));
        }
        for i in 0..3 {
            started.extend(t.offer("b".into(), i));
        }
        assert_eq!(names(started), ["a0", "a1", "a2"]);
        // Waiting: b0 b1 b2; a has nothing waiting.
        t.offer("a".into(), 3);
        assert_eq!(names(t.ended("a")), ["b0!"], "b waited longest for its turn");
        assert_eq!(names(t.ended("a")), ["a3"], "then a, then b again");
        assert_eq!(names(t.ended("a")), ["b1"]);
        assert_eq!(names(t.ended("b")), ["b2"]);
        assert_eq!(t.waiting(), 0);
        for _ in 0..3 {
            assert!(t.ended("x").is_empty(), "an environment with nothing in flight changes nothing");
        }
    }
}
