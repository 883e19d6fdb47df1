//! Where the time of one alloc+free goes, piece by piece (diagnostics for the benchmarks):
//! `cargo run --release -p gpumem --example alloc_micro`. One loop alone, for a profiler
//! (callgrind: instructions per op as the difference of two repeat counts):
//! `-- plan N` (the planned step loop of `alloc_loop.py`), `-- same N [classic]` (4 KiB
//! same-size pairs through the pool), `-- asame N` (the same through the allocator, its lock
//! included), `-- random N [classic|noplan]` (passes of random_256_live through the pool).

use gpumem::pool::{CachingPool, Handout, SharedCounters};
use gpumem::resource::sim::SimulatedDevice;
use gpumem::workload::RandomLive;
use gpumem::{CachingAllocator, Config, Stream};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn time(name: &str, n: usize, mut f: impl FnMut()) {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        best = best.min(t.elapsed().as_nanos() as f64 / n as f64);
    }
    println!("{name:<40} {best:>8.1} ns");
}

fn main() {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find(|l| l.starts_with("model name"))
        .unwrap_or("model name: ?");
    println!("{model}");
    let n = 2_000_000;
    // `alloc_micro plan`: the planned step alone (for a profiler)
    let plan_only = std::env::args().nth(1).as_deref() == Some("plan");
    let flag = AtomicBool::new(false);
    time("atomic cas + store (spin lock pair)", n, || {
        let _ =
            black_box(&flag).compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed);
        flag.store(false, Ordering::Release);
    });
    let m = parking_lot::Mutex::new(0u64);
    time("parking_lot lock + unlock", n, || {
        *black_box(&m).lock() += 1
    });
    let sim: Arc<SimulatedDevice> = Arc::new(SimulatedDevice::new(1 << 42));
    let cfg = Config::from_env().unwrap();
    if std::env::args().nth(1).as_deref() == Some("same") {
        // `alloc_micro same REPS`: 1e6 x REPS same-size pairs of 4 KiB (the quick cache)
        let reps: usize = std::env::args()
            .nth(2)
            .and_then(|r| r.parse().ok())
            .unwrap_or(1);
        let mut cfg = cfg.clone();
        if std::env::args().nth(3).as_deref() == Some("classic") {
            cfg.pool.expandable_segments = false;
        }
        let mut pool = CachingPool::new(sim.clone(), &cfg, Arc::new(SharedCounters::default()));
        time(
            "pool same_size, token (no lock)",
            1_000_000 * reps / 5,
            || {
                let a = pool
                    .allocate_inner(Stream::DEFAULT, black_box(4096), 256, true, Handout::Token)
                    .unwrap();
                pool.free_by_id(a.id, a.generation).unwrap();
            },
        );
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("asame") {
        // `alloc_micro asame REPS`: 1e6 x REPS same-size pairs of 4 KiB through the allocator
        let reps: usize = std::env::args()
            .nth(2)
            .and_then(|r| r.parse().ok())
            .unwrap_or(1);
        let alloc = CachingAllocator::new(sim.clone(), cfg.clone()).unwrap();
        time("allocator same_size", 1_000_000 * reps / 5, || {
            let a = alloc
                .allocate(Stream::DEFAULT, black_box(4096), 256)
                .unwrap();
            alloc.deallocate(a).unwrap();
        });
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("random") {
        // `alloc_micro random PASSES [classic|noplan]`: passes of random_256_live through the
        // pool after 20 warm-up passes
        let passes: usize = std::env::args()
            .nth(2)
            .and_then(|r| r.parse().ok())
            .unwrap_or(1);
        let mut cfg = cfg.clone();
        match std::env::args().nth(3).as_deref() {
            Some("classic") => cfg.pool.expandable_segments = false,
            Some("noplan") => cfg.pool.planned_layout = false,
            _ => {}
        }
        let mut pool = CachingPool::new(sim.clone(), &cfg, Arc::new(SharedCounters::default()));
        let w = RandomLive::standard(1, 1 << 16);
        let mut live: Vec<_> = (0..w.live)
            .map(|i| {
                pool.allocate_inner(Stream::DEFAULT, w.sizes[i], 256, true, Handout::Id)
                    .unwrap()
            })
            .collect();
        let mut step = 0usize;
        let mut pass = |pool: &mut CachingPool| {
            for _ in 0..w.sizes.len() {
                let i = step % w.sizes.len();
                step += 1;
                let new = pool
                    .allocate_inner(Stream::DEFAULT, w.sizes[i], 256, true, Handout::Id)
                    .unwrap();
                let old = std::mem::replace(&mut live[w.slots[i]], new);
                pool.free_block_id(old.id, old.addr).unwrap();
            }
        };
        for _ in 0..20 {
            pass(&mut pool);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let t = Instant::now();
        for _ in 0..passes {
            pass(&mut pool);
        }
        let ops = passes * w.sizes.len();
        println!(
            "pool random_256_live, {} passes: {:.1} ns, planned {}",
            passes,
            t.elapsed().as_nanos() as f64 / ops as f64,
            pool.stats().num_plan_allocs
        );
        return;
    }
    if plan_only {
        let reps = std::env::args().nth(2).and_then(|r| r.parse().ok());
        planned_steps(&sim, &cfg, reps.unwrap_or(40));
        return;
    }
    let mut pool = CachingPool::new(sim.clone(), &cfg, Arc::new(SharedCounters::default()));
    time("pool same_size (no lock)", n, || {
        let a = pool
            .allocate_inner(Stream::DEFAULT, black_box(4096), 256, true, Handout::Id)
            .unwrap();
        pool.free_block_id(a.id, a.addr).unwrap();
    });
    let alloc = CachingAllocator::new(sim.clone(), cfg.clone()).unwrap();
    time("allocator same_size", n, || {
        let a = alloc
            .allocate(Stream::DEFAULT, black_box(4096), 256)
            .unwrap();
        alloc.deallocate(a).unwrap();
    });
    let w = RandomLive::standard(1, 1 << 16);
    let mut live: Vec<_> = (0..w.live)
        .map(|i| {
            pool.allocate_inner(Stream::DEFAULT, w.sizes[i], 256, true, Handout::Id)
                .unwrap()
        })
        .collect();
    let mut step = 0usize;
    for _ in 0..2 {
        time("pool random_256_live (no lock)", 1 << 16, || {
            let i = step % w.sizes.len();
            step += 1;
            let new = pool
                .allocate_inner(Stream::DEFAULT, w.sizes[i], 256, true, Handout::Id)
                .unwrap();
            let old = std::mem::replace(&mut live[w.slots[i]], new);
            pool.free_block_id(old.id, old.addr).unwrap();
        });
    }
    let mut live: Vec<_> = (0..w.live)
        .map(|i| alloc.allocate(Stream::DEFAULT, w.sizes[i], 256).unwrap())
        .collect();
    for _ in 0..2 {
        time("allocator random_256_live", 1 << 16, || {
            let i = step % w.sizes.len();
            step += 1;
            let new = alloc.allocate(Stream::DEFAULT, w.sizes[i], 256).unwrap();
            alloc
                .deallocate(std::mem::replace(&mut live[w.slots[i]], new))
                .unwrap();
        });
    }
    planned_steps(&sim, &cfg, 1);
}

/// A repeating step of k blocks of 2-32 MiB, allocated in order and released in reverse
/// (`alloc_loop.py`'s step loop): served from a planned layout once the job repeats.
fn planned_steps(sim: &Arc<SimulatedDevice>, cfg: &Config, reps: usize) {
    for k in [32usize, 256] {
        let mut pool = CachingPool::new(sim.clone(), cfg, Arc::new(SharedCounters::default()));
        let sizes: Vec<usize> = (0..k).map(|i| (2 + (i * 7) % 31) << 20).collect();
        let mut held = Vec::with_capacity(k);
        let mut step = |pool: &mut CachingPool| {
            for &s in &sizes {
                let a =
                    pool.allocate_inner(Stream::DEFAULT, black_box(s), 256, true, Handout::Token);
                held.push(a.unwrap());
            }
            while let Some(a) = held.pop() {
                pool.free_by_id(a.id, a.generation).unwrap();
            }
        };
        for _ in 0..50 {
            step(&mut pool);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let planned = pool.stats().num_plan_allocs;
        let steps = (200_000 / k).max(10);
        let mut best = f64::MAX;
        for _ in 0..5 * reps {
            let t = Instant::now();
            for _ in 0..steps {
                step(&mut pool);
            }
            best = best.min(t.elapsed().as_nanos() as f64 / (steps * k) as f64);
        }
        let served = pool.stats().num_plan_allocs - planned;
        let name = format!("pool planned step of {k} (no lock)");
        println!(
            "{name:<40} {best:>8.1} ns  ({served} of {} from the plan)",
            5 * reps * steps * k
        );
    }
}
