//! Allocation latency on the host backend: `cargo bench -p gpumem --bench alloc`.
//!
//! `same_size`: one alloc+free pair of 4 KiB. `random_256_live`: free one of 256 live blocks
//! and allocate a new one of a random size in 256 B – 64 MiB (one op = one free + one alloc).
//! Each is run for gpumem's caching allocator (host backend) and the system allocator.

use divan::{black_box, Bencher};
use gpumem::workload::RandomLive;
use gpumem::Device;
use gpumem::{CachingAllocator, Config, Stream};
use std::alloc::{alloc, dealloc, Layout};

fn main() {
    divan::main();
}

fn gpumem() -> CachingAllocator {
    // the allocator itself, as every front end reaches it (no deref through the device)
    Device::host(Config::from_env().unwrap())
        .unwrap()
        .allocator()
        .clone()
}

#[divan::bench(threads = [1, 2], sample_count = 200, sample_size = 2000)]
fn same_size_gpumem(b: Bencher) {
    let a = gpumem();
    b.bench(|| {
        let x = a.allocate(Stream::DEFAULT, black_box(4096), 256).unwrap();
        a.deallocate(x).unwrap();
    });
}

#[divan::bench(threads = [1, 2], sample_count = 200, sample_size = 2000)]
fn same_size_system(b: Bencher) {
    let l = Layout::from_size_align(4096, 256).unwrap();
    b.bench(|| {
        // SAFETY: non-zero layout; freed at once with the same layout.
        unsafe {
            let p = alloc(black_box(l));
            dealloc(black_box(p), l);
        }
    });
}

const STEPS: usize = 1 << 16;

/// One free + one alloc per call, over a live set that persists across iterations.
struct Live<T> {
    w: RandomLive,
    live: Vec<T>,
    step: usize,
}

impl<T> Live<T> {
    fn step(&mut self, mut op: impl FnMut(&mut T, usize)) {
        let i = self.step % STEPS;
        self.step += 1;
        op(&mut self.live[self.w.slots[i]], self.w.sizes[i]);
    }
}

#[divan::bench(sample_count = 200, sample_size = 2000)]
fn random_256_live_gpumem(b: Bencher) {
    let a = gpumem();
    let w = RandomLive::standard(7, STEPS);
    let live = (0..w.live)
        .map(|i| a.allocate(Stream::DEFAULT, w.sizes[i], 256).unwrap())
        .collect();
    let mut s = Live { w, live, step: 0 };
    b.bench_local(|| {
        s.step(|slot, size| {
            let new = a.allocate(Stream::DEFAULT, size, 256).unwrap();
            a.deallocate(std::mem::replace(slot, new)).unwrap();
        })
    });
    for x in s.live.drain(..) {
        a.deallocate(x).unwrap();
    }
}

#[divan::bench(sample_count = 200, sample_size = 2000)]
fn random_256_live_system(b: Bencher) {
    let w = RandomLive::standard(7, STEPS);
    let lay = |n: usize| Layout::from_size_align(n, 256).unwrap();
    // SAFETY (all blocks below): non-zero layouts; each pointer is freed once with its layout.
    let live = (0..w.live)
        .map(|i| (unsafe { alloc(lay(w.sizes[i])) }, w.sizes[i]))
        .collect();
    let mut s = Live { w, live, step: 0 };
    b.bench_local(|| {
        s.step(|slot, size| unsafe {
            let new = (alloc(lay(size)), size);
            let (p, n) = std::mem::replace(slot, new);
            dealloc(p, lay(n));
        })
    });
    for (p, n) in s.live.drain(..) {
        unsafe { dealloc(p, lay(n)) };
    }
}

/// The policy alone (no lock, no shard selection): what the pool itself costs.
#[divan::bench(sample_count = 200, sample_size = 2000)]
fn same_size_pool_only(b: Bencher) {
    use gpumem::pool::{CachingPool, SharedCounters};
    let backend = std::sync::Arc::new(gpumem::resource::host::HostResource::new());
    let mut p = CachingPool::new(backend, &Config::default(), Default::default());
    let _: Option<SharedCounters> = None;
    b.bench_local(|| {
        let x = p.allocate(Stream::DEFAULT, black_box(4096), 256).unwrap();
        p.free(x.addr).unwrap();
    });
}

/// Eight tensors of a layer (weights, biases, activations: 4 KiB to 4 MiB) allocated in one
/// call and freed, against the same sizes allocated one by one.
const LAYER: [usize; 8] = [
    4 << 20,
    4096,
    1 << 20,
    4096,
    2 << 20,
    64 << 10,
    512 << 10,
    8192,
];

#[divan::bench(sample_count = 200, sample_size = 500)]
fn batch_of_8_gpumem(b: Bencher) {
    let a = gpumem();
    b.bench(|| {
        let blocks = a
            .allocate_batch(Stream::DEFAULT, black_box(&LAYER), 256)
            .unwrap();
        for x in blocks {
            a.deallocate(x).unwrap();
        }
    });
}

#[divan::bench(sample_count = 200, sample_size = 500)]
fn one_by_one_8_gpumem(b: Bencher) {
    let a = gpumem();
    b.bench(|| {
        let blocks: Vec<_> = black_box(&LAYER)
            .iter()
            .map(|&s| a.allocate(Stream::DEFAULT, s, 256).unwrap())
            .collect();
        for x in blocks {
            a.deallocate(x).unwrap();
        }
    });
}
