//! Deterministic random allocation workloads shared by the benchmarks, the CLI and the tests
//! (no imports: any layer may use them; the synthetic traces of each workload kind are in
//! the trace module's `synthetic`).

/// A small, fast, seedable generator (SplitMix64), so workloads are identical everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// `count` sizes log-uniform between `min` and `max` bytes (inclusive).
pub fn log_uniform_sizes(seed: u64, count: usize, min: u64, max: u64) -> Vec<usize> {
    let mut r = SplitMix::new(seed);
    let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
    (0..count)
        .map(|_| {
            let u = (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            ((lo + u * (hi - lo)).exp() as u64).clamp(min, max) as usize
        })
        .collect()
}

/// The `random_256_live` workload: sizes 256 B – 64 MiB, and for each step the slot (of 256
/// live blocks) to free and refill.
#[derive(Debug, Clone)]
pub struct RandomLive {
    /// sizes, one per step (cycled)
    pub sizes: Vec<usize>,
    /// slot indices, one per step (cycled)
    pub slots: Vec<usize>,
    /// live blocks kept
    pub live: usize,
}

impl RandomLive {
    /// The standard workload: 256 live blocks, 256 B – 64 MiB, `steps` precomputed steps.
    pub fn standard(seed: u64, steps: usize) -> Self {
        let live = 256;
        let mut r = SplitMix::new(seed ^ 0x5eed);
        Self {
            sizes: log_uniform_sizes(seed, steps, 256, 64 << 20),
            slots: (0..steps).map(|_| r.below(live as u64) as usize).collect(),
            live,
        }
    }
}
