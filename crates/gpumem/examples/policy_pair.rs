//! Two configurations of the pool side by side on the simulated device, batch by batch, as
//! `gpumem bench alloc` pairs its two policies on a GPU (on the host backend, which has no
//! virtual-memory pages, gpumem's expandable policy cannot be measured; here it can):
//!
//! `cargo run --release -p gpumem --example policy_pair -- [CONF] [AGAINST]`
//!
//! CONF defaults to the default configuration, AGAINST to `expandable_segments:False`
//! (classic segments). Both run random_256_live (256 live blocks of 256 B – 64 MiB, free one
//! and allocate another), each warmed up for 10 passes, then 1,000 batches of 1,000 ops in
//! turn (the same ops for both, the order reversed every other batch). Prints the median of
//! the ratios of CONF's batch to AGAINST's with a 95% interval, each one's median ns per op,
//! and CONF's plans.

use gpumem::resource::sim::SimulatedDevice;
use gpumem::workload::RandomLive;
use gpumem::{Allocation, CachingAllocator, Config, Stream};
use std::sync::Arc;
use std::time::Instant;

const PASS: usize = 1 << 16;
const WARM_PASSES: usize = 10;
const BATCHES: usize = 1000;
const BATCH: usize = 1000;

/// `n` ops of `w` from op `start` on: free one block, allocate another.
fn ops(
    a: &CachingAllocator,
    w: &RandomLive,
    live: &mut [Allocation],
    start: usize,
    n: usize,
) -> gpumem::Result<()> {
    for s in start..start + n {
        let i = s % w.sizes.len();
        let new = a.allocate(Stream::DEFAULT, w.sizes[i], 256)?;
        let old = std::mem::replace(&mut live[w.slots[i]], new);
        a.deallocate(old)?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(conf: &str, against: &str) -> gpumem::Result<()> {
    let open = |c: &str| -> gpumem::Result<CachingAllocator> {
        let sim = Arc::new(SimulatedDevice::new(80 << 30));
        sim.set_auto_complete(true);
        CachingAllocator::new(sim, Config::parse(c)?)
    };
    let pools = [open(conf)?, open(against)?];
    let w = RandomLive::standard(1, PASS);
    let mut lives = Vec::new();
    for a in &pools {
        let mut live = (0..w.live)
            .map(|i| a.allocate(Stream::DEFAULT, w.sizes[i], 256))
            .collect::<gpumem::Result<Vec<_>>>()?;
        for _ in 0..WARM_PASSES {
            ops(a, &w, &mut live, 0, PASS)?;
        }
        lives.push(live);
    }
    let (mut ratios, mut times) = (Vec::new(), [Vec::new(), Vec::new()]);
    for k in 0..BATCHES {
        let mut t = [0.0; 2];
        for j in if k % 2 == 0 { [0, 1] } else { [1, 0] } {
            let started = Instant::now();
            ops(&pools[j], &w, &mut lives[j], k * BATCH, BATCH)?;
            t[j] = started.elapsed().as_nanos() as f64 / BATCH as f64;
        }
        ratios.push(t[0] / t[1]);
        times[0].push(t[0]);
        times[1].push(t[1]);
    }
    ratios.sort_by(f64::total_cmp);
    // ranks of a 95% interval of the median: n/2 -/+ 1.96 sqrt(n) / 2
    let half = (1.96 * (BATCHES as f64).sqrt() / 2.0) as usize;
    let s = pools[0].stats();
    println!(
        "{conf:?} / {against:?}, random_256_live, {BATCHES} batches of {BATCH} in turn: \
         median {:.4} (95% {:.4}-{:.4}); {:.1} / {:.1} ns per op; {} plans, {} allocations \
         served from them",
        ratios[BATCHES / 2],
        ratios[BATCHES / 2 - half - 1],
        ratios[BATCHES / 2 + half + 1],
        median(times[0].clone()),
        median(times[1].clone()),
        s.num_plans,
        s.num_plan_allocs,
    );
    for (a, live) in pools.iter().zip(lives) {
        for b in live {
            a.deallocate(b)?;
        }
    }
    Ok(())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let conf = args.next().unwrap_or_default();
    let against = args
        .next()
        .unwrap_or_else(|| "expandable_segments:False".into());
    if let Err(e) = run(&conf, &against) {
        eprintln!("policy_pair: {e}");
        std::process::exit(1);
    }
}
