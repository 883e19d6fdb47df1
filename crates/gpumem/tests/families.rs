//! Workload families: every synthetic kind, 50 random parameter draws each (the seed draws the
//! model and the shapes), replayed through the default policy on a simulated device whose GPU
//! runs behind the host by a drawn number of allocator calls (none, 300, 3000).
//!
//! Every draw keeps page moves within their time budget (`pool/budget.rs`): the moves' time
//! on the replay's clock (the trace's times, 50 µs an event, plus the modelled driver calls) is
//! at most 1% of the trace's wall time plus what growth took, plus three of the longest move
//! and the credit's cap (the credit starts empty, and is full again at the end of the warm-up;
//! moves it does not pay take at most what growth did). Memory: each
//! test asserts the worst ratio measured when it was written (so a regression fails CI) and
//! prints how many draws are above 1.02.

use gpumem::trace::synthetic::Kind;
use gpumem::trace::{replay_simulated, SIM_CAPACITY};

#[path = "common/budget.rs"]
mod budget;
use budget::assert_within_budget;
use gpumem::resource::sim::SimulatedDevice;
use gpumem::workload::RandomLive;
use gpumem::{CachingAllocator, Config, Stream};
use std::sync::Arc;

const DRAWS: u64 = 50;
const TARGET: f64 = 1.02;

/// The GPU's lag for draw `seed`: none (kernels take no time), a little, a lot.
fn lag(seed: u64) -> Option<u64> {
    [None, Some(300), Some(3000)][(seed % 3) as usize]
}

/// Replay `DRAWS` draws of `kind`; every ratio must lie in `[1, bound]`.
fn family(kind: Kind, bound: f64) {
    family_at(kind, 1, bound)
}

/// [`family`] with `scale` times the kind's usual number of steps.
fn family_at(kind: Kind, scale: usize, bound: f64) {
    let mut worst = (0.0f64, 0u64);
    let mut above = Vec::new();
    for seed in 0..DRAWS {
        let events = kind.generate(seed, scale);
        let r = replay_simulated(
            kind.name(),
            &events,
            &Config::default(),
            SIM_CAPACITY,
            lag(seed),
        )
        .unwrap();
        let ratio = r.report.ratio;
        assert!(ratio >= 1.0, "{} seed {seed}: {ratio}", kind.name());
        assert_within_budget(&format!("{} seed {seed}", kind.name()), &events, &r.report);
        if ratio > worst.0 {
            worst = (ratio, seed);
        }
        if ratio > TARGET {
            above.push((seed, lag(seed), (ratio * 1000.0).round() / 1000.0));
        }
    }
    println!(
        "{:<26} {DRAWS} draws ({}x steps): worst ratio {:.4} (seed {}), {} above {TARGET}: {above:?}",
        kind.name(),
        scale,
        worst.0,
        worst.1,
        above.len()
    );
    assert!(
        worst.0 <= bound,
        "{}: worst ratio {:.4} (seed {}) above its bound {bound}",
        kind.name(),
        worst.0,
        worst.1
    );
}

#[test]
fn fixed_shape_training() {
    family(Kind::FixedShape, BOUND_FIXED_SHAPE);
}

#[test]
fn variable_sequence_length() {
    family(Kind::VariableSeqLen, BOUND_VARLEN);
}

#[test]
fn mixture_of_experts() {
    family(Kind::Moe, BOUND_MOE);
}

#[test]
fn kv_cache_decoding() {
    family(Kind::KvCacheDecode, BOUND_KV);
}

#[test]
fn serving_loop() {
    family(Kind::Serving, BOUND_SERVING);
}

#[test]
fn tiny_next_to_huge() {
    family(Kind::MixedTinyHuge, BOUND_TINY_HUGE);
}

#[test]
fn several_streams() {
    family(Kind::MultiStream, BOUND_MULTI_STREAM);
}

/// Several streams over 16 steps (as `scripts/bench_torch.py` runs them) rather than 4.
#[test]
fn several_streams_over_sixteen_steps() {
    family_at(Kind::MultiStream, 4, BOUND_MULTI_STREAM_16);
}

#[test]
fn convnet_training() {
    family(Kind::ConvTraining, BOUND_CONV);
}

#[test]
fn convnet_variable_resolution() {
    family(Kind::ConvVariableResolution, BOUND_CONV_RES);
}

/// Training in phases (issue 33's "plans for several phases"): runs of 6-8 steps at one of 2-3
/// sequence lengths (length buckets), each run followed by an evaluation pass (forward only).
/// Measured on this code: mean 1.037, worst 1.148, and the same with `planned_layout:False`:
/// the peak comes in the first run of the longest bucket, before a plan exists, so plans do
/// not change it. The 1.02 for phases is not met.
#[test]
fn training_in_phases() {
    family(Kind::Phases, BOUND_PHASES);
}

/// Training in phases over 3 times as many steps, where each length comes back: a plan taken
/// up again maps the holes its slots find in its home segment on the resource's thread from
/// its start (`plan_map_ahead`), as at its first take-up. When only the first take-up did,
/// the allocating thread mapped them one by one as the blocks came, the window of page work
/// refused the moves that would have made room, and the region grew: the draws below held
/// 1.2378 / 1.1467 (seed 21, the GPU 300 / 3000 calls behind) and 1.0348 / 1.0411 (seed 30,
/// in step / 3000 behind); seeds 0-49 at every lag, 150 runs: mean 1.0429 -> 1.0406, 7 lower,
/// 1 higher (seed 36 300 behind, 1.0225 -> 1.0263). Measured 2026-11-29.
#[test]
fn a_plan_taken_up_again_maps_its_holes_ahead() {
    for (seed, lag, bound) in [
        (21, Some(300), 1.06),
        (21, Some(3000), 1.04),
        (30, None, 1.025),
        (30, Some(3000), 1.025),
    ] {
        let events = Kind::Phases.generate(seed, 3);
        let r = replay_simulated("phases", &events, &Config::default(), SIM_CAPACITY, lag).unwrap();
        let name = format!("phases seed {seed} (3x steps) lag {lag:?}");
        println!("{name}: {:.4}", r.report.ratio);
        assert_within_budget(&name, &events, &r.report);
        assert!(r.report.ratio <= bound, "{name}: {:.4}", r.report.ratio);
    }
}

// Bounds measured on this code (worst of 50 draws, rounded up). Page moves are paid from a
// 1% time budget (`pool/budget.rs`): a job moves pages only with the credit it has, then
// maps and keeps, as PyTorch's expandable segments do: the issue 13 bound of 1.02 is given up
// for the time (issue 31: speed is the constraint, memory the objective). Growth takes
// nothing from that credit since the H100 showed a job's first step spending it all
// (gptfix: 1.057 -> 1.012 on the H100), and an overdraft in the warm-up is forgiven when the
// job first repeats: over the families the mean ratio went from 1.033 to 1.021
// (tiny-next-to-huge 1.087 -> 1.019 and several streams over 16 steps 1.075 -> 1.042 on
// average; worst 1.388 -> 1.144 and 1.189 -> 1.131), but fixed shape from 1.029 to 1.033
// and its worst from 1.119 to 1.158: these traces last ~30 ms, so the credit is a few moves,
// and 7 of 50 draws end higher for them, 8 lower. (Fixed shape 1.28 and several streams
// 1.33 / 1.46 when an earlier policy started with a second's credit.)
// Against gpumem's own classic segments (PyTorch's native policy) and map-and-keep (no
// moves: `expandable_slack:0.9`, a key since removed) on 20 draws each, the budgeted policy
// is below both on MoE, KV decoding, serving, tiny-next-to-huge and the convnets, and above
// map-and-keep on 7 fixed-shape draws (by up to 0.045) and 5 variable-length ones (up to 0.054): pages moved in
// the first steps leave a layout that keeping covers less tightly than one never moved.
const BOUND_FIXED_SHAPE: f64 = 1.16;
const BOUND_VARLEN: f64 = 1.23;
const BOUND_MOE: f64 = 1.075;
// (KV decoding was 1.04 while a job's first maps were not charged to the time budget and it
// started with a second's credit: its early moves kept 0.01 more; the real trace
// `torch_kv_decode` went 1.028 -> 1.042 with the change, native's 1.559)
const BOUND_KV: f64 = 1.055;
const BOUND_SERVING: f64 = 1.075;
const BOUND_TINY_HUGE: f64 = 1.15;
const BOUND_MULTI_STREAM: f64 = 1.13;
// (Several streams move pages between their segments, and a stream maps again below the
// high-water mark what a move took from it: since those maps are charged to the moves'
// credit, the mean over 50 draws went 1.0415 -> 1.0467 over 4 steps and 1.0422 -> 1.0492
// over 16, the worst of the 16-step draws 1.1305 -> 1.1554; the other families unchanged.)
const BOUND_MULTI_STREAM_16: f64 = 1.156;
const BOUND_CONV: f64 = 1.035;
const BOUND_CONV_RES: f64 = 1.06;
const BOUND_PHASES: f64 = 1.15;

/// Driver calls in the last step of a periodic job (the calls of `n + 1` steps minus those of
/// `n` steps, same seed), with and without GPU lag, as the page engine makes them (creates,
/// maps, set-access, unmaps, releases, event records; a page whose memory still lingers
/// where it is mapped again costs none): the target is none, and none of the 60 runs
/// makes one in step 9 now that a job that repeats gets a planned layout by default (with the
/// dynamic layout alone, `planned_layout:False`, 6 of 60 made calls in step 6, at most 119; 40
/// runs and 520 before page moves were paid from a time budget). Step 9, after the plan has
/// started: a plan starts in step 5 or 6 and maps what its region lacks then, once
/// (ConvTraining seed 0 maps one handle, 3 calls, in step 6 with the default quick cache of
/// one block; none with 16 blocks, the default before).
#[test]
fn periodic_jobs_driver_calls_per_step_in_steady_state() {
    let mut worst = 0;
    let mut nonzero = 0;
    let mut runs = 0;
    for kind in Kind::PERIODIC {
        for seed in 0..10 {
            for lag in [None, Some(300), Some(3000)] {
                let calls = |steps| {
                    let events = kind.generate_steps(seed, steps);
                    let r = replay_simulated("p", &events, &Config::default(), SIM_CAPACITY, lag)
                        .unwrap();
                    r.report.device_calls
                };
                let (a, b) = (calls(8), calls(9));
                let step = b.saturating_sub(a);
                worst = worst.max(step);
                nonzero += usize::from(step > 0);
                runs += 1;
            }
        }
    }
    println!("periodic jobs: {nonzero} of {runs} with driver calls in step 9; at most {worst}");
    assert_eq!(worst, 0, "{worst} calls in a steady step");
}

/// The periodic kinds with a planned layout (the default): every draw of 8 and 9 steps, with
/// and without GPU lag. Step 9 makes no driver call, and the peak ratio is measured beside the
/// dynamic layout's alone (`planned_layout:False`; printed; the worst asserted against what
/// was measured when it was written, so that a regression fails CI).
#[test]
fn periodic_jobs_with_a_planned_layout() {
    let plan = Config::default();
    let dynamic = Config::parse("planned_layout:False").unwrap();
    let (mut worst_calls, mut worst, mut better, mut runs) = (0, 0.0f64, 0, 0);
    for kind in Kind::PERIODIC {
        for seed in 0..10 {
            for lag in [None, Some(300), Some(3000)] {
                let run = |steps, config: &Config| {
                    let events = kind.generate_steps(seed, steps);
                    replay_simulated("p", &events, config, SIM_CAPACITY, lag)
                        .unwrap()
                        .report
                };
                let (a, b) = (run(8, &plan), run(9, &plan));
                let base = run(9, &dynamic);
                worst_calls = worst_calls.max(b.device_calls.saturating_sub(a.device_calls));
                worst = worst.max(b.ratio);
                better += usize::from(b.ratio <= base.ratio + 1e-9);
                runs += 1;
            }
        }
    }
    println!(
        "planned layout: worst ratio {worst:.4}, at or below the dynamic layout alone in {better} of {runs}, \
         at most {worst_calls} driver calls in step 9"
    );
    assert_eq!(worst_calls, 0, "a planned step makes no driver call");
    assert!(worst <= BOUND_PLANNED, "worst ratio {worst}");
}

/// Long runs of the kinds whose shape changes from step to step (hundreds of steps, where
/// the tests above run a few): a length or resolution that comes back a step or two gets a
/// plan, which takes the stream's segment while the job follows it. The plans must cost
/// neither memory nor driver calls beside the dynamic layout alone (`planned_layout:False`),
/// GPU 3000 calls behind. Before 2026-11-26 a plan unmapped every page of the segment it did
/// not use as it took it (the dynamic pool mapped them again after it: variable length seed
/// 4, 21,884 driver calls in 400 steps against 1,513, 6.8% of the trace's time), and a plan
/// in step when a newer one was made kept the segment while dormant, so that the next plan
/// mapped a region of its own (variable resolution seed 1: 1.62 at 60 steps against 1.008).
#[test]
fn long_runs_of_changing_shapes_cost_no_more_with_plans() {
    let dynamic = Config::parse("planned_layout:False").unwrap();
    for (kind, seed, steps) in [
        (Kind::VariableSeqLen, 1, 400),
        (Kind::VariableSeqLen, 3, 400),
        (Kind::VariableSeqLen, 4, 400),
        (Kind::ConvVariableResolution, 1, 60),
        (Kind::ConvVariableResolution, 3, 60),
    ] {
        let events = kind.generate_steps(seed, steps);
        let run = |config: &Config| {
            replay_simulated("p", &events, config, SIM_CAPACITY, Some(3000))
                .unwrap()
                .report
        };
        let (p, d) = (run(&Config::default()), run(&dynamic));
        println!(
            "{} seed {seed}, {steps} steps: planned {:.4} with {} calls, dynamic {:.4} with {}",
            kind.name(),
            p.ratio,
            p.device_calls,
            d.ratio,
            d.device_calls
        );
        let name = format!("{} seed {seed}", kind.name());
        assert!(
            p.ratio <= d.ratio + 0.01,
            "{name}: {} against {}",
            p.ratio,
            d.ratio
        );
        assert!(
            p.device_calls <= d.device_calls + d.device_calls / 4 + 100,
            "{name}: {} calls against {}",
            p.device_calls,
            d.device_calls
        );
    }
}

/// Fixed-shape training over 16 steps, every draw of 10 with and without GPU lag: once its
/// plan has served a cycle and given back the pages of its region that no slot uses (see
/// `plan_settled` in `pool/plan/give_back.rs`), its last three steps hold within 1.2% of what
/// is live (mean 1.0034 over the 30 runs, where it was 1.0268 and the worst 1.0503 when the
/// plan kept every page the first steps had mapped), and its last step makes no driver call.
/// The whole run's peak, which the first steps set before any plan, is unchanged.
#[test]
fn fixed_shape_jobs_hold_what_their_plans_need_once_settled() {
    let steps = 16;
    let (mut worst, mut sum, mut runs) = (0.0f64, 0.0, 0);
    for seed in 0..10 {
        for lag in [None, Some(300), Some(3000)] {
            let events = Kind::FixedShape.generate_steps(seed, steps);
            let r = replay_simulated("p", &events, &Config::default(), SIM_CAPACITY, lag).unwrap();
            let (t, n) = (&r.timeline, r.timeline.len());
            // (steps are of one length: the last three are the last 3/16 of the events)
            let late = &t[n * (steps - 3) / steps..];
            let live = late.iter().map(|x| x.1).max().unwrap();
            let reserved = late.iter().map(|x| x.2).max().unwrap();
            let settled = reserved as f64 / live as f64;
            let last_step = r.calls[n - 1] - r.calls[n * (steps - 1) / steps];
            assert_eq!(
                last_step, 0,
                "seed {seed} lag {lag:?}: calls in the last step"
            );
            worst = worst.max(settled);
            sum += settled;
            runs += 1;
        }
    }
    let mean = sum / runs as f64;
    println!("fixed shape, 16 steps: the last three steps' ratio worst {worst:.4}, mean {mean:.4}");
    assert!(
        worst <= 1.012 && mean <= 1.004,
        "worst {worst:.4}, mean {mean:.4}"
    );
}

/// Measured on this code (worst of the 60 runs above, 1.0503 on 2026-11-27, rounded up; at or
/// below the dynamic layout's ratio alone in 45 of the 60). It was 1.153 when plans were
/// opt-in; the target is 1.01, which peaks set in steps 1 and 2, before any plan, miss.
const BOUND_PLANNED: f64 = 1.051;

/// A job whose period is long but whose blocks live briefly: `gpumem bench alloc`'s
/// `random_256_live` workload (256 live blocks of 256 B – 64 MiB, one freed and one allocated
/// at a time, the same sequence every pass), 30,000 steps a pass: about 10,000 large
/// allocations a period, more than the 8,192 the planner took before its limit counted its
/// work instead, each meeting about 256 others. Its passes get a plan, and make no driver call
/// once it has started (the dynamic layout's moves went on within the time budget, and its
/// map-and-keep growth now and then: a pass without calls was no sign that none followed).
#[test]
fn a_long_period_of_short_lives_is_planned_and_makes_no_driver_call() {
    let sim = Arc::new(SimulatedDevice::new(80 << 30));
    let config = Config {
        shards: Some(1),
        ..Default::default()
    };
    let a = CachingAllocator::new(sim.clone(), config).unwrap();
    let w = RandomLive::standard(1, 30_000);
    let mut live: Vec<_> = (0..w.live)
        .map(|i| a.allocate(Stream::DEFAULT, w.sizes[i], 256).unwrap())
        .collect();
    let calls = |a: &CachingAllocator| {
        let s = a.stats();
        s.num_device_alloc + s.num_device_free
    };
    let mut per_pass = Vec::new();
    let mut us = 0;
    for _ in 0..6 {
        let before = calls(&a);
        for (&size, &slot) in w.sizes.iter().zip(&w.slots) {
            // (1 µs of the job between calls, on the clock the time budget runs on)
            us += 1;
            sim.set_time_us(us);
            let new = a.allocate(Stream::DEFAULT, size, 256).unwrap();
            a.deallocate(std::mem::replace(&mut live[slot], new))
                .unwrap();
        }
        per_pass.push(calls(&a) - before);
    }
    let s = a.stats();
    println!(
        "random_256_live, 30,000 steps a pass: driver calls a pass {per_pass:?}, plans made {}, \
         allocations from a plan {}, {} MiB reserved",
        s.num_plans,
        s.num_plan_allocs,
        s.reserved_bytes.all.current >> 20
    );
    assert_eq!(s.num_plans, 1);
    // (over the simulated device the layout is computed inline, and the plan takes its
    // region at the start of its period, within the pass: nothing is on its way after)
    assert_eq!(s.plans_pending, 0);
    assert_eq!(&per_pass[4..], &[0, 0], "{per_pass:?}");
    assert!(s.num_plan_allocs > 10_000);
    for h in live {
        a.deallocate(h).unwrap();
    }
}

/// A plan that `plan_resync` cannot find in step when its layout is taken (the window of the
/// job's last events recurs in the period: a run of frees of one size, as where a training
/// step ends) follows the job from the position its layout's own events give, where the
/// detector has confirmed no other period since. On an H200 gptfix's layout, made on a
/// thread, was taken among the frees that end its step 3: its plan served from step 5, with
/// 16 page calls in step 4; following from its layout's events, it serves from step 4 (stop
/// 81). On the simulated device the layout is made inline; fixed_shape seed 2 (four times
/// the usual steps) is a draw whose resync fails there: its driver calls ended at 0.18, 0.23
/// and 0.18 of its events with the GPU in step, 300 and 3,000 calls behind, now at 0.14,
/// 0.19 and 0.14.
#[test]
fn a_plan_not_found_in_step_follows_the_job_from_its_layouts_events() {
    let events = Kind::FixedShape.generate(2, 4);
    for (lag, most) in [(None, 16), (Some(300), 21), (Some(3000), 16)] {
        let r = replay_simulated("p", &events, &Config::default(), SIM_CAPACITY, lag).unwrap();
        let n = r.calls.len();
        let last = r.calls[n - 1];
        let quiet = r.calls.iter().position(|&c| c == last).unwrap();
        println!("lag {lag:?}: the last driver call at event {quiet} of {n}");
        assert!(
            quiet * 100 < n * most,
            "lag {lag:?}: calls until event {quiet} of {n}"
        );
    }
}
