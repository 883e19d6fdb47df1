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

/// One alloc + free of 4 KiB through `pool` (the quick cache), the block handed out by id or
/// by token.
#[inline(always)]
fn same_size(pool: &mut CachingPool, handout: Handout) {
    let a = pool
        .allocate_inner(Stream::DEFAULT, black_box(4096), 256, true, handout)
        .unwrap();
    match handout {
        Handout::Token => pool.free_by_id(a.id, a.generation).map(|_| ()),
        _ => pool.free_block_id(a.id, a.addr),
    }
    .unwrap();
}

/// `random_256_live` through a pool: 256 live blocks, each op frees one and allocates another.
struct RandomLoop {
    w: RandomLive,
    live: Vec<gpumem::pool::PoolAlloc>,
    step: usize,
}

impl RandomLoop {
    fn new(pool: &mut CachingPool) -> Self {
        let w = RandomLive::standard(1, 1 << 16);
        let live = (0..w.live)
            .map(|i| {
                pool.allocate_inner(Stream::DEFAULT, w.sizes[i], 256, true, Handout::Id)
                    .unwrap()
            })
            .collect();
        Self { w, live, step: 0 }
    }

    #[inline(always)]
    fn op(&mut self, pool: &mut CachingPool) {
        let i = self.step % self.w.sizes.len();
        self.step += 1;
        let new = pool
            .allocate_inner(Stream::DEFAULT, self.w.sizes[i], 256, true, Handout::Id)
            .unwrap();
        let old = std::mem::replace(&mut self.live[self.w.slots[i]], new);
        pool.free_block_id(old.id, old.addr).unwrap();
    }
}

/// `alloc_micro MODE N [VARIANT]`, one loop alone for a profiler (see the header); false
/// where no mode is given.
fn profile(sim: &Arc<SimulatedDevice>, cfg: &Config) -> bool {
    let mut args = std::env::args().skip(1);
    let Some(mode) = args.next() else {
        return false;
    };
    let reps: Option<usize> = args.next().and_then(|r| r.parse().ok());
    let mut cfg = cfg.clone();
    match args.next().as_deref() {
        Some("classic") => cfg.pool.expandable_segments = false,
        Some("noplan") => cfg.pool.planned_layout = false,
        _ => {}
    }
    let new_pool = || CachingPool::new(sim.clone(), &cfg, Arc::new(SharedCounters::default()));
    match mode.as_str() {
        "plan" => planned_steps(sim, &cfg, reps.unwrap_or(40)),
        "same" => {
            let mut pool = new_pool();
            let n = 1_000_000 * reps.unwrap_or(1) / 5;
            time("pool same_size, token (no lock)", n, || {
                same_size(&mut pool, Handout::Token)
            });
        }
        "asame" => {
            let alloc = CachingAllocator::new(sim.clone(), cfg.clone()).unwrap();
            time(
                "allocator same_size",
                1_000_000 * reps.unwrap_or(1) / 5,
                || {
                    let a = alloc
                        .allocate(Stream::DEFAULT, black_box(4096), 256)
                        .unwrap();
                    alloc.deallocate(a).unwrap();
                },
            );
        }
        "random" => {
            // passes of the workload after 20 warm-up passes (plans are made off the thread)
            let mut pool = new_pool();
            let mut r = RandomLoop::new(&mut pool);
            let pass_ops = r.w.sizes.len();
            for _ in 0..20 {
                (0..pass_ops).for_each(|_| r.op(&mut pool));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let passes = reps.unwrap_or(1);
            let before = sim.counters();
            let t = Instant::now();
            (0..passes * pass_ops).for_each(|_| r.op(&mut pool));
            let after = sim.counters();
            println!(
                "pool random_256_live, {passes} passes: {:.1} ns, planned {}, maps {} and unmaps {} while timed",
                t.elapsed().as_nanos() as f64 / (passes * pass_ops) as f64,
                pool.stats().num_plan_allocs,
                after.maps - before.maps,
                after.unmaps - before.unmaps
            );
        }
        other => {
            eprintln!("alloc_micro: unknown mode {other:?} (plan, same, asame, random)");
            std::process::exit(2);
        }
    }
    true
}

fn main() {
    let sim: Arc<SimulatedDevice> = Arc::new(SimulatedDevice::new(1 << 42));
    let cfg = Config::from_env().unwrap();
    if profile(&sim, &cfg) {
        return;
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find(|l| l.starts_with("model name"))
        .unwrap_or("model name: ?");
    println!("{model}");
    let n = 2_000_000;
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
    let mut pool = CachingPool::new(sim.clone(), &cfg, Arc::new(SharedCounters::default()));
    time("pool same_size (no lock)", n, || {
        same_size(&mut pool, Handout::Id)
    });
    let alloc = CachingAllocator::new(sim.clone(), cfg.clone()).unwrap();
    time("allocator same_size", n, || {
        let a = alloc
            .allocate(Stream::DEFAULT, black_box(4096), 256)
            .unwrap();
        alloc.deallocate(a).unwrap();
    });
    let mut r = RandomLoop::new(&mut pool);
    for _ in 0..2 {
        time("pool random_256_live (no lock)", 1 << 16, || {
            r.op(&mut pool)
        });
    }
    let (w, mut step) = (&r.w, r.step);
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
