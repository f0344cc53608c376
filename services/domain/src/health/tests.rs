//! The health rules over sequences of outcomes: receivers that fail
//! sometimes (the first attempt only, at random, in bursts, slowly, with
//! 429s) never open the circuit; a receiver that is down does, and a probe
//! that can succeed brings it back.

use std::collections::BinaryHeap;

use chrono::{TimeZone, Utc};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::*;

fn at(secs: i64) -> Timestamp {
    Utc.timestamp_opt(1_800_000_000 + secs, 0).unwrap()
}

fn at_ms(ms: i64) -> Timestamp {
    at(0) + chrono::Duration::milliseconds(ms)
}

/// Production's rule: 2 min window, 20 attempts, 90 %, 30 s quiet, 5 failed
/// retries; probes from 10 s to 10 min.
const POLICY: CircuitPolicy = CircuitPolicy::production(Duration::from_secs(60));

const NEVER_DISABLE: DisablePolicy = DisablePolicy { after: Duration::MAX, min_failures: u32::MAX };

fn healthy() -> EndpointStanding {
    EndpointStanding { health: EndpointHealth::new(), disabled: None }
}

/// Production's tiers, in ms: the delay before attempt n at index n - 1.
const TIERS_MS: [i64; 7] = [0, 1_000, 5_000, 30_000, 300_000, 1_800_000, 7_200_000];

/// What a receiver answers: given the event, the attempt (1-based) and when
/// it is sent (ms), the result and how long the request takes (ms).
type Receiver<'a> = dyn FnMut(usize, u32, i64) -> (Seen, i64) + 'a;

/// The results one endpoint's lane produces under the plain retry schedule
/// (no circuit): `events` published at the given ms, attempts sent one at a
/// time in due order, a failure rescheduled by its tier, the seventh
/// failure the end. Returns each result with when it was seen, in order,
/// and each event's delivery time (ms after publishing), if delivered.
fn plain_schedule(published: &[i64], receiver: &mut Receiver) -> (Vec<(Seen, Timestamp)>, Vec<Option<i64>>) {
    // Min-heap by (due, event): what the relay hands out first.
    let mut due: BinaryHeap<std::cmp::Reverse<(i64, usize, u32)>> =
        published.iter().enumerate().map(|(e, &t)| std::cmp::Reverse((t, e, 1))).collect();
    let (mut free_at, mut results, mut delivered) = (0i64, Vec::new(), vec![None; published.len()]);
    while let Some(std::cmp::Reverse((when, event, attempt))) = due.pop() {
        let sent = when.max(free_at);
        let (seen, took) = receiver(event, attempt, sent);
        free_at = sent + took;
        results.push((seen, at_ms(free_at)));
        if seen.is_success() {
            delivered[event] = Some(free_at - published[event]);
        } else if let Some(&tier) = TIERS_MS.get(attempt as usize) {
            due.push(std::cmp::Reverse((free_at + tier, event, attempt + 1)));
        }
    }
    (results, delivered)
}

fn retry_of(attempt: u32) -> bool {
    attempt > 1
}

/// Feeds results one at a time, as outcome batches of one would; returns
/// where the circuit ended and whether it ever opened.
fn run(results: &[(Seen, Timestamp)]) -> (EndpointStanding, bool) {
    let mut s = healthy();
    let mut opened = false;
    for &r in results {
        let (after, effects) = s.observe(&[r], &POLICY, &NEVER_DISABLE);
        opened |= effects.opened || after.health.circuit.holds();
        s = after;
    }
    (s, opened)
}

fn burst(n: usize) -> Vec<i64> {
    vec![0; n]
}

fn paced(n: usize, per_second: i64) -> Vec<i64> {
    (0..n as i64).map(|i| i * 1000 / per_second).collect()
}

/// A fast receiver's round trip, in ms.
const RTT: i64 = 2;

#[test]
fn a_receiver_that_refuses_each_first_request_never_opens_the_circuit_however_large_the_burst() {
    for published in [burst(60), burst(2_000), burst(50_000), paced(2_000, 200)] {
        let mut receiver = |_, attempt, _| if attempt == 1 { (Seen::Failure { retry: false }, RTT) } else { (Seen::Success, RTT) };
        let (results, delivered) = plain_schedule(&published, &mut receiver);
        assert!(delivered.iter().all(Option::is_some));
        let (s, opened) = run(&results);
        assert!(!opened, "{} events: opened ({:?})", published.len(), s.health);
    }
}

#[test]
fn receivers_that_fail_at_random_never_open_the_circuit() {
    for (fail_percent, seed) in [(50, 1), (80, 2), (80, 3)] {
        for published in [burst(2_000), paced(2_000, 100), paced(300, 2)] {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut receiver = |_, attempt, _| {
                if rng.random_range(0..100) < fail_percent {
                    (Seen::Failure { retry: retry_of(attempt) }, RTT)
                } else {
                    (Seen::Success, RTT)
                }
            };
            let (results, _) = plain_schedule(&published, &mut receiver);
            let (s, opened) = run(&results);
            assert!(!opened, "{fail_percent}% failing, {} events: opened ({:?})", published.len(), s.health);
        }
    }
}

#[test]
fn a_receiver_that_times_out_a_fifth_of_its_requests_never_opens_the_circuit() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut receiver = |_, attempt, _| {
        if rng.random_range(0..5) == 0 { (Seen::Unanswered { retry: retry_of(attempt) }, 15_000) } else { (Seen::Success, 40) }
    };
    let (results, _) = plain_schedule(&paced(2_000, 50), &mut receiver);
    assert!(!run(&results).1);
}

#[test]
fn bursts_of_429_are_back_pressure_and_never_open_the_circuit() {
    // One second in five, every request is refused with 429.
    let mut receiver = |_, _, sent: i64| if sent % 5_000 < 1_000 { (Seen::Throttled, RTT) } else { (Seen::Success, RTT) };
    let (results, delivered) = plain_schedule(&paced(2_000, 100), &mut receiver);
    assert!(delivered.iter().all(Option::is_some));
    let (s, opened) = run(&results);
    assert!(!opened);
    assert_eq!(s.health.consecutive_failures, 0, "a 429 is not a failure");
    // And a receiver that answers nothing but 429 is slowed, not cut off.
    let results: Vec<(Seen, Timestamp)> = (0..10_000).map(|i| (Seen::Throttled, at_ms(i * 10))).collect();
    let (s, opened) = run(&results);
    assert!(!opened && s.health.window.is_clean(at_ms(100_000)));
}

#[test]
fn a_receiver_that_answers_502_for_ten_seconds_after_being_idle_never_opens_the_circuit() {
    let mut receiver = |_, attempt, sent: i64| {
        if sent < 10_000 { (Seen::Failure { retry: retry_of(attempt) }, RTT) } else { (Seen::Success, RTT) }
    };
    for published in [burst(2_000), paced(2_000, 200)] {
        let (results, delivered) = plain_schedule(&published, &mut receiver);
        assert!(delivered.iter().all(Option::is_some));
        assert!(!run(&results).1, "{} events", published.len());
    }
}

#[test]
fn a_receiver_that_is_down_opens_the_circuit_once_the_evidence_is_in() {
    let mut receiver = |_, attempt, _| (Seen::Failure { retry: retry_of(attempt) }, RTT);
    // Published for a minute: attempts go on past the quiet period.
    let (results, _) = plain_schedule(&paced(6_000, 100), &mut receiver);
    let mut s = healthy();
    let mut opened_at = None;
    for &r in &results {
        let (after, effects) = s.observe(&[r], &POLICY, &NEVER_DISABLE);
        if effects.opened {
            opened_at = Some(r.1);
            assert!(effects.hold, "opening holds what is pending");
            break;
        }
        s = after;
    }
    let opened_at = opened_at.expect("a dead receiver opens the circuit");
    let after = (opened_at - at(0)).num_milliseconds();
    assert!((30_000..31_000).contains(&after), "opened {after} ms after the first failure: the quiet period, and no later");
}

#[test]
fn a_healthy_endpoint_that_dies_opens_once_failures_outweigh_its_recent_successes() {
    // 10 a second succeed for two minutes, then all fail.
    let mut seen: Vec<(Seen, Timestamp)> = (0..1_200).map(|i| (Seen::Success, at_ms(i * 100))).collect();
    seen.extend((1_200..4_000).map(|i| (Seen::Failure { retry: i % 2 == 0 }, at_ms(i * 100))));
    let mut s = healthy();
    // Successes of a healthy endpoint are not written (the outcome path
    // skips them); only from the first failure on does the window count.
    let mut opened_at = None;
    for &(r, t) in &seen {
        if r.is_success() && s.health.is_plainly_healthy(t, &POLICY) {
            continue;
        }
        let (after, effects) = s.observe(&[(r, t)], &POLICY, &NEVER_DISABLE);
        if effects.opened {
            opened_at = Some(t);
            break;
        }
        s = after;
    }
    let after = (opened_at.expect("it opens") - at(120)).num_milliseconds();
    assert!((30_000..31_000).contains(&after), "opened {after} ms after the first failure");
}

#[test]
fn a_short_outage_with_successes_around_it_does_not_open_the_circuit_before_the_quiet_period() {
    let mut seen: Vec<(Seen, Timestamp)> = (0..200).map(|i| (Seen::Failure { retry: true }, at_ms(i * 100))).collect();
    seen.push((Seen::Success, at_ms(20_000)));
    seen.extend((201..400).map(|i| (Seen::Failure { retry: true }, at_ms(i * 100))));
    let (s, opened) = run(&seen);
    assert!(!opened, "no 30 s without a success: {:?}", s.health);
    assert_eq!(s.health.failing_since, Some(at_ms(20_100)));
}

#[test]
fn a_failure_rate_under_the_threshold_does_not_open_the_circuit_even_without_a_recent_success_counted() {
    // Within the window: 30 successes then 60 failures over 40 s: 67 % < 90 %.
    let mut seen: Vec<(Seen, Timestamp)> = vec![(Seen::Failure { retry: false }, at(0))];
    seen.extend((0..30).map(|i| (Seen::Success, at_ms(500 + i * 10))));
    seen.extend((0..60).map(|i| (Seen::Failure { retry: true }, at_ms(1_000 + i * 666))));
    let (s, opened) = run(&seen);
    assert!(!opened, "{:?}", s.health);
    assert!(s.health.failing_since.is_some_and(|since| at_ms(40_000) - since >= chrono::Duration::seconds(30)));
}

#[test]
fn the_window_forgets_what_is_older_than_itself() {
    let mut w = FailureWindow::default();
    let window = Duration::from_secs(120);
    // Aligned buckets: at(0) is 1_800_000_000 s, a multiple of 120 s.
    for i in 0..100 {
        w.count(at_ms(i * 100), window, true);
    }
    assert_eq!(w.estimate(at(10)), (100.0, 100.0));
    assert_eq!(w.recent(at(10)), (100, 100));
    // Half way into the next bucket: half the previous one still counts.
    let (attempts, failures) = w.estimate(at(180));
    assert!((attempts - 50.0).abs() < 1e-9 && (failures - 50.0).abs() < 1e-9, "{attempts} {failures}");
    assert!(!w.is_clean(at(180)));
    assert!(w.is_clean(at(240)), "two buckets on, nothing is left");
    assert_eq!(w.estimate(at(240)), (0.0, 0.0));
    // Counting under another length starts again.
    w.count(at(240), Duration::from_secs(60), true);
    assert_eq!((w.length_ms, w.estimate(at(240))), (60_000, (1.0, 1.0)));
}

fn opened_by_failures() -> EndpointStanding {
    let seen: Vec<(Seen, Timestamp)> = (0..40).map(|i| (Seen::Failure { retry: i > 0 }, at(i))).collect();
    let (s, opened) = run(&seen);
    assert!(opened && s.health.circuit == Circuit::Open);
    s
}

#[test]
fn a_probe_that_succeeds_starts_the_recovery_and_successes_release_the_rest_two_at_a_time() {
    let s = opened_by_failures();
    let first_probe = s.health.next_probe_at.unwrap();
    assert_eq!(first_probe, at(30 + 10), "the first probe waits `first_probe` after opening");
    assert!(s.probe_due(first_probe) && !s.probe_due(first_probe - chrono::Duration::seconds(1)));
    let (s, step) = s.probe(first_probe, Some(at(5)), &POLICY);
    assert_eq!((step, s.health.circuit), (ProbeStep::Probe, Circuit::HalfOpen));
    let (s, e) = s.observe(&[(Seen::Success, at(41))], &POLICY, &NEVER_DISABLE);
    assert_eq!(s.health.circuit, Circuit::Recovering);
    assert!(e.recover && !e.hold && !e.opened);
    assert_eq!(e.release, RELEASED_PER_SUCCESS);
    // Each later success releases two more; a failure none.
    let (s, e) =
        s.observe(&[(Seen::Success, at(42)), (Seen::Success, at(42)), (Seen::Failure { retry: true }, at(42))], &POLICY, &NEVER_DISABLE);
    assert_eq!((e.release, e.recover, e.hold, s.health.circuit), (4, false, false, Circuit::Recovering));
    // The prober's tick releases a few whatever the answers, then closes
    // the circuit once nothing is held.
    let tick = s.health.next_probe_at.unwrap();
    let (s, step) = s.probe(tick, Some(at(0)), &POLICY);
    assert_eq!((step, s.health.circuit), (ProbeStep::Release(RELEASED_PER_TICK), Circuit::Recovering));
    let (s, step) = s.probe(s.health.next_probe_at.unwrap(), None, &POLICY);
    assert_eq!((step, s.health.circuit, s.health.next_probe_at), (ProbeStep::Closed, Circuit::Closed, None));
}

#[test]
fn failed_probes_back_off_but_a_held_retry_falling_due_brings_the_next_one_forward() {
    let mut s = opened_by_failures();
    let mut waits = Vec::new();
    for _ in 0..8 {
        let next = s.health.next_probe_at.unwrap();
        let (probing, step) = s.probe(next, Some(next), &POLICY);
        assert_eq!(step, ProbeStep::Probe);
        let (after, e) = probing.observe(&[(Seen::Failure { retry: true }, next)], &POLICY, &NEVER_DISABLE);
        assert!(e.hold && !e.opened, "a failed probe holds its delivery again; the circuit was open already");
        waits.push((after.health.next_probe_at.unwrap() - next).num_seconds());
        s = after;
    }
    assert_eq!(waits, [20, 40, 80, 160, 320, 600, 600, 600]);
    // A held retry due in 30 s: the next probe then, not in 600 s…
    let now = s.health.next_probe_at.unwrap();
    let (probing, _) = s.probe(now, Some(now), &POLICY);
    let (failed, _) = probing.observe(&[(Seen::Failure { retry: true }, now)], &POLICY, &NEVER_DISABLE);
    let sooner = failed.probe_by_held_retry(now, Some(now + chrono::Duration::seconds(30)), &POLICY);
    assert_eq!(sooner.health.next_probe_at, Some(now + chrono::Duration::seconds(30)));
    // …but never sooner than the first probe's wait.
    let soonest = failed.probe_by_held_retry(now, Some(now + chrono::Duration::seconds(1)), &POLICY);
    assert_eq!(soonest.health.next_probe_at, Some(now + chrono::Duration::seconds(10)));
    assert_eq!(failed.probe_by_held_retry(now, None, &POLICY), failed);
}

#[test]
fn a_probe_waits_for_its_delivery_to_fall_due() {
    let s = opened_by_failures();
    let next = s.health.next_probe_at.unwrap();
    let (s, step) = s.probe(next, Some(at(1800)), &POLICY);
    assert_eq!((step, s.health.circuit, s.health.next_probe_at), (ProbeStep::Wait, Circuit::Open, Some(at(1800))));
    let (s, step) = s.probe(at(1800), Some(at(1800)), &POLICY);
    assert_eq!((step, s.health.circuit), (ProbeStep::Probe, Circuit::HalfOpen));
    assert_eq!(s.health.next_probe_at, Some(at(1800 + 60)), "the guard, longer than the interval, bounds the wait for the result");
}

#[test]
fn a_due_probe_with_nothing_held_closes_an_enabled_circuit() {
    let s = opened_by_failures();
    let (s, step) = s.probe(at(40), None, &POLICY);
    assert_eq!((step, s.health.circuit), (ProbeStep::Closed, Circuit::Closed));
    // The run of failures is kept: the next failure re-opens at once.
    let (s, e) = s.observe(&[(Seen::Failure { retry: true }, at(41))], &POLICY, &NEVER_DISABLE);
    assert!(e.opened && e.hold && s.health.circuit == Circuit::Open);
}

#[test]
fn a_recovering_endpoint_that_goes_down_again_opens_again_on_the_same_evidence() {
    let s = opened_by_failures();
    let (s, _) = s.probe(at(40), Some(at(0)), &POLICY);
    let (mut s, _) = s.observe(&[(Seen::Success, at(41))], &POLICY, &NEVER_DISABLE);
    let mut opened_at = None;
    for i in 0..100 {
        let (after, e) = s.observe(&[(Seen::Failure { retry: true }, at(42 + i))], &POLICY, &NEVER_DISABLE);
        s = after;
        if e.opened {
            opened_at = Some(42 + i);
            assert!(e.hold && e.release == 0 && !e.recover);
            break;
        }
    }
    assert_eq!(opened_at, Some(72), "30 s after the last success");
}

#[test]
fn the_switch_off_keeps_the_circuit_closed() {
    let off = CircuitPolicy { enabled: false, ..POLICY };
    let seen: Vec<(Seen, Timestamp)> = (0..1000).map(|i| (Seen::Failure { retry: true }, at(i))).collect();
    let (s, e) = healthy().observe(&seen, &off, &NEVER_DISABLE);
    assert_eq!(s.health.circuit, Circuit::Closed);
    assert!(!e.opened && !e.hold);
}

#[test]
fn failing_for_the_window_and_the_count_disables_and_a_success_re_enables() {
    let rule = DisablePolicy { after: Duration::from_secs(100), min_failures: 10 };
    let never = CircuitPolicy { enabled: false, ..POLICY };
    // Long enough but too few.
    let (s, e) = healthy().observe(&[(Seen::Failure { retry: false }, at(0)), (Seen::Failure { retry: true }, at(200))], &never, &rule);
    assert_eq!((s.disabled, e.disable), (None, None));
    // Enough failures, window reached.
    let more: Vec<(Seen, Timestamp)> = (201..209).map(|i| (Seen::Failure { retry: true }, at(i))).collect();
    let (s, e) = s.observe(&more, &never, &rule);
    assert_eq!((s.disabled, e.disable, s.health.circuit), (Some(DisabledReason::Failing), Some(DisabledReason::Failing), Circuit::Open));
    assert!(e.hold && !e.opened, "announced as disabled, not as opened");
    assert!(s.probe_due(s.health.next_probe_at.unwrap()), "a failing endpoint is probed");
    // A probe that succeeds re-enables it, and the recovery starts.
    let (s, _) = s.probe(s.health.next_probe_at.unwrap(), Some(at(0)), &POLICY);
    let (s, e) = s.observe(&[(Seen::Success, at(1000))], &POLICY, &rule);
    assert_eq!((s.disabled, s.health.circuit), (None, Circuit::Recovering));
    assert!(e.enable && e.recover);
}

#[test]
fn a_410_disables_at_once_and_is_never_probed() {
    let (s, e) = healthy().observe(&[(Seen::Gone, at(0))], &POLICY, &DisablePolicy::default());
    assert_eq!((s.disabled, e.disable), (Some(DisabledReason::Gone), Some(DisabledReason::Gone)));
    assert!(e.hold && !e.opened);
    assert_eq!(s.health.next_probe_at, None);
    assert!(!s.probe_due(at(1_000_000)));
    // A late 2xx from an attempt sent before does not undo the receiver's word.
    let (s, e) = s.observe(&[(Seen::Success, at(1))], &POLICY, &DisablePolicy::default());
    assert_eq!(s.disabled, Some(DisabledReason::Gone));
    assert!(e.release == 0 && !e.enable && !e.recover);
}

#[test]
fn a_tenants_disable_is_not_overridden() {
    let manual = EndpointStanding { health: EndpointHealth::new(), disabled: Some(DisabledReason::Manual) };
    let (s, e) = manual.observe(&[(Seen::Gone, at(0)), (Seen::Success, at(1))], &POLICY, &DisablePolicy::default());
    assert_eq!(s.disabled, Some(DisabledReason::Manual));
    assert!(!e.enable && e.release == 0 && e.disable.is_none());
    let seen: Vec<(Seen, Timestamp)> = (0..100).map(|i| (Seen::Failure { retry: true }, at(i))).collect();
    let (s, _) = manual.observe(&seen, &POLICY, &DisablePolicy::default());
    assert!(!s.probe_due(at(1_000_000)), "a manually disabled endpoint is never probed");
}

#[test]
fn statuses_map_to_what_they_say_about_the_endpoint() {
    let secs = Some(Duration::from_secs(1));
    assert_eq!(Seen::of(Some(204), None, 1), Seen::Success);
    assert_eq!(Seen::of(Some(410), None, 1), Seen::Gone);
    assert_eq!(Seen::of(Some(429), None, 1), Seen::Throttled);
    assert_eq!(Seen::of(Some(429), secs, 3), Seen::Throttled);
    assert_eq!(Seen::of(Some(503), secs, 1), Seen::Throttled);
    assert_eq!(Seen::of(Some(503), None, 1), Seen::Failure { retry: false });
    for s in [Some(301), Some(404), Some(500), Some(502)] {
        assert_eq!(Seen::of(s, None, 2), Seen::Failure { retry: true }, "{s:?}");
    }
    assert_eq!(Seen::of(None, None, 1), Seen::Unanswered { retry: false }, "a timeout or a refused connection");
}

#[test]
fn an_endpoint_is_handed_one_attempt_at_a_time_only_while_failing_costs_its_lane() {
    let step = |s: EndpointStanding, seen: Seen| s.observe(&[(seen, at(0))], &POLICY, &NEVER_DISABLE).0;
    // Fast 5xx to first attempts (a receiver that accepts retries): its cap stays.
    let mut s = healthy();
    for _ in 0..100 {
        s = step(s, Seen::Failure { retry: false });
    }
    assert!(!s.health.one_at_a_time);
    // A timeout held the lane: one at a time, until a success.
    let s = step(s, Seen::Unanswered { retry: false });
    assert!(s.health.one_at_a_time);
    let s = step(s, Seen::Success);
    assert!(!s.health.one_at_a_time);
    // Retries failing too: one at a time once the evidence is in.
    let mut s = s;
    for i in 1..=5 {
        s = step(s, Seen::Failure { retry: true });
        assert_eq!(s.health.one_at_a_time, i >= 5, "after {i} failed retries");
    }
}
