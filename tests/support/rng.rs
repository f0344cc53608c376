//! The tests' random choices: seeded, so a printed seed replays a run (with
//! the same `Cargo.lock`; `rand` does not promise its generators' streams
//! across versions).

use rand::{Rng as _, RngCore, SeedableRng, rngs::StdRng};

/// A seeded generator for tests that choose at random.
#[derive(Debug, Clone)]
pub struct Rng(StdRng);

impl Rng {
    pub fn seeded(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// From 0 to `n` - 1 (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { self.0.random_range(0..n) }
    }

    /// From `lo` to `hi`, both included.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        self.0.random_range(lo..=hi)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.0.random_range(0..100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    pub fn choose<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}
