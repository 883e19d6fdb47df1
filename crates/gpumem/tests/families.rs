//! Workload families: every synthetic kind, 50 random parameter draws each (the seed draws the
//! model and the shapes), replayed through the default policy on a simulated device whose GPU
//! runs behind the host by a drawn number of allocator calls. Peak reserved must stay within
//! 2% of peak live bytes on every draw; the periodic kinds must reach a steady state with no
//! driver calls per step.

use gpumem::trace::synthetic::Kind;
use gpumem::trace::{replay_simulated, SIM_CAPACITY};
use gpumem::Config;

const DRAWS: u64 = 50;

/// The GPU's lag for draw `seed`: none (kernels take no time), a little, a lot.
fn lag(seed: u64) -> Option<u64> {
    [None, Some(300), Some(3000)][(seed % 3) as usize]
}

fn family(kind: Kind) {
    let mut worst = (0.0f64, 0u64);
    let mut failed = Vec::new();
    for seed in 0..DRAWS {
        let events = kind.generate(seed, 1);
        let r = replay_simulated(
            kind.name(),
            &events,
            &Config::default(),
            SIM_CAPACITY,
            lag(seed),
        )
        .unwrap();
        let ratio = r.report.ratio;
        if ratio > worst.0 {
            worst = (ratio, seed);
        }
        if !(1.0..=1.02).contains(&ratio) {
            failed.push((
                seed,
                lag(seed),
                (ratio * 1000.0).round() / 1000.0,
                r.report.peak_live_bytes >> 20,
                r.report.segments_at_peak,
            ));
        }
    }
    println!(
        "{:<26} {DRAWS} draws, worst ratio {:.4} (seed {})",
        kind.name(),
        worst.0,
        worst.1
    );
    assert!(failed.is_empty(), "{}: {failed:?}", kind.name());
}

#[test]
fn fixed_shape_training() {
    family(Kind::FixedShape);
}

#[test]
fn variable_sequence_length() {
    family(Kind::VariableSeqLen);
}

#[test]
fn mixture_of_experts() {
    family(Kind::Moe);
}

#[test]
fn kv_cache_decoding() {
    family(Kind::KvCacheDecode);
}

#[test]
fn serving_loop() {
    family(Kind::Serving);
}

#[test]
fn tiny_next_to_huge() {
    family(Kind::MixedTinyHuge);
}

#[test]
fn several_streams() {
    family(Kind::MultiStream);
}

#[test]
fn convnet_training() {
    family(Kind::ConvTraining);
}

#[test]
fn convnet_variable_resolution() {
    family(Kind::ConvVariableResolution);
}

/// A periodic job reaches a steady state: after warm-up, a step makes no driver calls (the
/// calls of `n + 1` steps minus those of `n` steps, same seed), with and without GPU lag.
#[test]
fn periodic_jobs_make_no_driver_calls_in_steady_state() {
    for kind in Kind::PERIODIC {
        for seed in 0..10 {
            for lag in [None, Some(300), Some(3000)] {
                let calls = |steps| {
                    let events = kind.generate_steps(seed, steps);
                    let r = replay_simulated("p", &events, &Config::default(), SIM_CAPACITY, lag)
                        .unwrap();
                    r.report.device_calls
                };
                let (a, b) = (calls(5), calls(6));
                assert_eq!(
                    b - a,
                    0,
                    "{} seed {seed} lag {lag:?}: {a} calls in 5 steps, {b} in 6",
                    kind.name()
                );
            }
        }
    }
}
