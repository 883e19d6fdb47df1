//! Per-call cost of the pool on a real job's repeating step, over the simulated device (the
//! host side of `python/gpumem_torch/tests/trace_loop.py`, without PyTorch or a GPU):
//!
//! `cargo run --release -p gpumem --example step_loop -- TRACE [CONFIG]`
//!
//! The step (the shortest period that the middle of the trace repeats, by action and size)
//! is replayed through a [`CachingAllocator`] `STEPS` times (default 40), each call timed
//! alone; with `POLLUTE=n` (default 0,2000) the loop touches n random cache lines of a 64 MiB
//! buffer between calls, outside the timing, as a real step's kernel launches and autograd
//! evict the allocator's data from the CPU caches. Prints ns per call, the median over the
//! second half of the steps (a plan is made and taken up in the first ones).

use gpumem::resource::sim::SimulatedDevice;
use gpumem::trace::{read_trace, Action};
use gpumem::{Allocation, CachingAllocator, Config, Stream};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// One call of the step: allocate `size` bytes into slot `slot`, or release it.
#[derive(Clone, Copy)]
enum Op {
    Alloc { size: usize, slot: usize },
    Free { slot: usize },
}

/// The repeating step of `path` as calls over slots (a block held over from the step before
/// keeps a slot of its own; its free in this step is paired with such a slot by size).
fn step_ops(path: &str) -> Result<(Vec<Op>, usize), String> {
    let events: Vec<_> = read_trace(std::path::Path::new(path))
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|e| matches!(e.action, Action::Alloc | Action::FreeCompleted))
        .collect();
    let key = |i: usize| (events[i].action == Action::Alloc, events[i].size);
    let (n, mid) = (events.len(), events.len() / 2);
    let period = (50..n / 3)
        .find(|&p| (0..p).all(|k| key(mid + k) == key(mid + k + p)))
        .ok_or_else(|| format!("{path}: no repeating step found"))?;
    let step = &events[mid..mid + period];
    let mut seen = HashSet::new();
    let mut freed_in_step = HashSet::new();
    for e in step {
        if e.action == Action::Alloc {
            seen.insert(e.addr);
        } else if seen.contains(&e.addr) {
            freed_in_step.insert(e.addr);
        }
    }
    let mut held_over: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut slots = 0;
    for e in step {
        if e.action == Action::Alloc && !freed_in_step.contains(&e.addr) {
            held_over.entry(e.size).or_default().push(slots);
            slots += 1;
        }
    }
    let mut give = held_over.clone();
    let (mut slot_of, mut free_slots, mut ops) = (HashMap::new(), Vec::new(), Vec::new());
    for e in step {
        if e.action == Action::Alloc {
            let slot = if freed_in_step.contains(&e.addr) {
                let s = free_slots.pop().unwrap_or_else(|| {
                    slots += 1;
                    slots - 1
                });
                slot_of.insert(e.addr, s);
                s
            } else {
                held_over.get_mut(&e.size).expect("counted above").remove(0)
            };
            ops.push(Op::Alloc {
                size: e.size as usize,
                slot,
            });
        } else if let Some(s) = slot_of.remove(&e.addr) {
            free_slots.push(s);
            ops.push(Op::Free { slot: s });
        } else if let Some(s) = give.get_mut(&e.size).filter(|v| !v.is_empty()) {
            ops.push(Op::Free { slot: s.remove(0) });
        }
    }
    Ok((ops, slots))
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: step_loop TRACE [CONFIG]")?;
    let conf = args.get(2).cloned().unwrap_or_default();
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let steps: usize = env("STEPS", "40").parse().map_err(|_| "STEPS: a number")?;
    let (ops, slots) = step_ops(path)?;
    for pollute in env("POLLUTE", "0,2000").split(',') {
        let pollute: usize = pollute.parse().map_err(|_| "POLLUTE: numbers")?;
        let sim = Arc::new(SimulatedDevice::new(80 << 30));
        let mut config = Config::parse(&conf).map_err(|e| e.to_string())?;
        config.shards = Some(1);
        let a = CachingAllocator::new(sim.clone(), config).map_err(|e| e.to_string())?;
        // a block whose next copy is allocated before it is freed waits in `early` until then
        let mut held: Vec<Option<Allocation>> = (0..slots).map(|_| None).collect();
        let mut early: Vec<Option<Allocation>> = (0..slots).map(|_| None).collect();
        let lines = 8usize << 20;
        let mut junk = vec![1u64; lines];
        let mut x: u64 = 88172645463325252;
        let mut per_step = Vec::new();
        let mut clock_us = 0;
        for _ in 0..steps {
            let mut ns = 0.0;
            for &op in &ops {
                for _ in 0..pollute {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    junk[(x as usize) & (lines - 1)] += 1;
                }
                // 20 µs of the job between calls, on the clock the time budget runs on
                clock_us += 20;
                sim.set_time_us(clock_us);
                let t = Instant::now();
                match op {
                    Op::Alloc { size, slot } => {
                        if held[slot].is_some() {
                            early[slot] = held[slot].take();
                        }
                        let b = a.allocate(Stream::DEFAULT, size, 512);
                        held[slot] = Some(b.map_err(|e| e.to_string())?);
                    }
                    Op::Free { slot } => {
                        if let Some(b) = early[slot].take().or_else(|| held[slot].take()) {
                            a.deallocate(b).map_err(|e| e.to_string())?;
                        }
                    }
                }
                ns += t.elapsed().as_nanos() as f64;
            }
            per_step.push(ns / ops.len() as f64);
        }
        let mut tail = per_step[steps / 2..].to_vec();
        tail.sort_by(f64::total_cmp);
        let s = a.stats();
        println!(
            "{path} [{conf}]: a step of {} calls, {pollute} cache lines touched between calls: \
             {:.0} ns/call median (min {:.0}); {} of its allocations from a plan (check {})",
            ops.len(),
            tail[tail.len() / 2],
            tail[0],
            s.num_plan_allocs,
            junk[(x as usize) & (lines - 1)] % 10,
        );
    }
    Ok(())
}
