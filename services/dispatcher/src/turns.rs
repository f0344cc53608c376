//! Fair turns across environments for work that queues in this process
//! (expansions): at most `cap_all` items in flight, at most `cap_each` of
//! them one environment's, and the next to start taken from the
//! environments with work waiting in turn, each environment's own in the
//! order it came.
//!
//! Why: the broker hands events over first come, and one environment's
//! burst put hundreds of its events in flight ahead of a quiet neighbour's
//! (W5 in relay-bench: the quiet one's p99 dozens of times its solo p99).
//! With a cap per environment, the api's queue holds at most `cap_each` of
//! the burst when the quiet environment's event arrives, and that event
//! starts at once: its wait is the burst's share, not the burst.
//!
//! Invariant: an environment's items start in their arrival order (events of
//! one ordering key are expanded in publish order); `in_flight` counts what
//! was started and has not been reported `ended`.

use std::collections::{HashMap, VecDeque};

pub(crate) struct Turns<T> {
    cap_all: usize,
    cap_each: usize,
    total: usize,
    in_flight: HashMap<String, usize>,
    waiting: HashMap<String, VecDeque<T>>,
    /// Environments with items waiting, in the order of their next turn.
    ring: VecDeque<String>,
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
        }
    }

    /// Adds an item of `env`; returns the items that start now.
    pub(crate) fn offer(&mut self, env: String, item: T) -> Vec<(String, T)> {
        let queue = self.waiting.entry(env.clone()).or_default();
        if queue.is_empty() {
            self.ring.push_back(env);
        }
        queue.push_back(item);
        self.start()
    }

    /// An item of `env` ended; returns the items that start now.
    pub(crate) fn ended(&mut self, env: &str) -> Vec<(String, T)> {
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

    fn start(&mut self) -> Vec<(String, T)> {
        let mut started = Vec::new();
        // Each look goes once round the ring at most: an environment at its
        // cap keeps its place and is passed over.
        let mut passed = 0;
        while self.total < self.cap_all && passed < self.ring.len() {
            let env = self.ring.pop_front().expect("ring not empty");
            let busy = self.in_flight.get(&env).copied().unwrap_or(0);
            if busy >= self.cap_each {
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
            *self.in_flight.entry(env.clone()).or_default() += 1;
            self.total += 1;
            passed = 0;
            started.push((env, item));
        }
        started
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(started: Vec<(String, u32)>) -> Vec<String> {
        started.into_iter().map(|(e, i)| format!("{e}{i}")).collect()
    }

    #[test]
    fn a_burst_takes_its_share_and_a_quiet_environment_starts_at_once() {
        let mut t = Turns::new(4, 2);
        let mut started = Vec::new();
        for i in 0..10 {
            started.extend(t.offer("b".into(), i));
        }
        assert_eq!(names(started), ["b0", "b1"], "the burst is held to its cap");
        assert_eq!(t.waiting(), 8);
        assert_eq!(names(t.offer("q".into(), 0)), ["q0"], "a quiet environment's item starts at once");
        assert_eq!(names(t.ended("b")), ["b2"], "the burst goes on in its order");
        assert_eq!(names(t.ended("q")), Vec::<String>::new(), "nothing of q waits; b is at its cap");
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
        assert_eq!(names(t.ended("a")), ["b0"], "b waited longest for its turn");
        assert_eq!(names(t.ended("a")), ["a3"], "then a, then b again");
        assert_eq!(names(t.ended("a")), ["b1"]);
        assert_eq!(names(t.ended("b")), ["b2"]);
        assert_eq!(t.waiting(), 0);
        for _ in 0..3 {
            assert!(t.ended("x").is_empty(), "an environment with nothing in flight changes nothing");
        }
    }
}
