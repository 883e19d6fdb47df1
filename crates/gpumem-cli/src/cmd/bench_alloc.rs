//! `gpumem bench alloc`: allocation latency of gpumem's cached pool against the driver's
//! allocators on a GPU, or against the system allocator on the host backend.

#[cfg(feature = "cuda")]
use crate::output::device_name;
use crate::output::{emit, mean, median, Result, Target};
use gpumem::workload::RandomLive;
use gpumem::{Allocation, CachingAllocator, Config, Device, Stream};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub allocator: String,
    pub scenario: String,
    pub threads: usize,
    /// median over batches of 1000 ops (for the multi-threaded scenario: wall time / all ops)
    pub ns_per_op: f64,
    /// total time / ops: the throughput figure the thread speedup is computed from
    pub mean_ns_per_op: f64,
    /// driver calls gpumem made during the timed part (segments, or pages mapped and
    /// unmapped); 0 for the other allocators, whose every op is a call
    pub device_calls: u64,
    /// passes over the random workload before the timed part (see [`MAX_WARM_PASSES`]); 0
    /// where there is none
    pub warm_passes: usize,
    /// gpumem's allocators: the share of the timed allocations served from a planned layout
    /// (the least of a round); 0 for the others
    pub planned_share: f64,
    /// gpumem's allocators: layouts planned by the end of the scenario, counting those of the
    /// allocator's earlier scenarios (the most of a round); 0 for the others
    pub plans: u64,
    /// gpumem's allocators: what the timed part's driver calls were (of the round with the most),
    /// to tell a settling pool from one that keeps moving pages
    pub timed_call_kinds: CallKinds,
    /// gpumem's allocators: `ns_per_op` of each round (fresh allocators each round; the
    /// configured policy's and classic segments' single-thread scenarios run batch by batch
    /// in turn, see [`Paired`]); the row's `ns_per_op` is their median, `mean_ns_per_op`
    /// their mean's mean, `device_calls` and `warm_passes` their most. One entry for the
    /// other allocators.
    pub rounds: Vec<f64>,
}

/// gpumem's driver calls (and what made them) over a stretch: segments or pages mapped and
/// unmapped, allocations that moved pages, layouts planned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CallKinds {
    pub maps: u64,
    pub unmaps: u64,
    pub page_moves: u64,
    pub plans: u64,
}

impl CallKinds {
    fn since(self, before: CallKinds) -> CallKinds {
        CallKinds {
            maps: self.maps - before.maps,
            unmaps: self.unmaps - before.unmaps,
            page_moves: self.page_moves - before.page_moves,
            plans: self.plans - before.plans,
        }
    }
}

/// One row per allocator and scenario from the rows of several rounds (see [`Row::rounds`]).
fn combine(rounds: Vec<Vec<Row>>) -> Vec<Row> {
    let mut out: Vec<Row> = Vec::new();
    let mut means: Vec<Vec<f64>> = Vec::new();
    for r in rounds.into_iter().flatten() {
        match out
            .iter()
            .position(|o| o.allocator == r.allocator && o.scenario == r.scenario)
        {
            Some(i) => {
                let o = &mut out[i];
                o.rounds.push(r.ns_per_op);
                if r.device_calls > o.device_calls {
                    o.timed_call_kinds = r.timed_call_kinds;
                }
                o.device_calls = o.device_calls.max(r.device_calls);
                o.warm_passes = o.warm_passes.max(r.warm_passes);
                o.planned_share = o.planned_share.min(r.planned_share);
                o.plans = o.plans.max(r.plans);
                means[i].push(r.mean_ns_per_op);
            }
            None => {
                means.push(vec![r.mean_ns_per_op]);
                out.push(Row {
                    rounds: vec![r.ns_per_op],
                    ..r
                });
            }
        }
    }
    for (o, m) in out.iter_mut().zip(means) {
        o.ns_per_op = median(o.rounds.clone());
        o.mean_ns_per_op = mean(&m);
    }
    out
}

/// Ops in one pass over the random workload: the whole period of its sizes.
const PASS_OPS: usize = 1 << 16;

/// Warm-up of the random scenarios: passes over the workload ([`PASS_OPS`] each) until one
/// makes no driver call and ends with no plan on its way (the pool has settled: what it maps,
/// it keeps, and no plan is about to take its region), at most this many passes that end with
/// no plan on its way. Passes that end while a plan is on its way (its layout is computed off
/// the allocating thread: on the H100, about 0.4 s for the 21,000 allocations of a pass) do
/// not count, for at most [`MAX_PLAN_WAIT`].
pub const MAX_WARM_PASSES: usize = 20;

/// How long the warm-up waits for plans on their way, at most.
pub const MAX_PLAN_WAIT: Duration = Duration::from_secs(10);

/// Where a warm-up stands (see [`MAX_WARM_PASSES`]).
struct Warmup {
    passes: usize,
    counted: usize,
    started: Instant,
}

impl Warmup {
    fn new() -> Self {
        Self {
            passes: 0,
            counted: 0,
            started: Instant::now(),
        }
    }

    /// A pass is over, in which the allocator made driver calls or not, and after which a
    /// plan is on its way or not: whether the warm-up is over.
    fn pass_done(&mut self, calls: bool, settling: bool) -> bool {
        self.passes += 1;
        if !calls && !settling {
            return true;
        }
        if !settling {
            self.counted += 1;
        }
        self.counted >= MAX_WARM_PASSES || self.started.elapsed() >= MAX_PLAN_WAIT
    }
}

/// What a benchmark needs from an allocator: one alloc and one free.
pub trait Api: Sync {
    type Handle: Send;
    fn name(&self) -> String;
    fn alloc(&self, bytes: usize) -> Self::Handle;
    fn free(&self, h: Self::Handle);
    /// How many timed operations this allocator can afford (the driver's are slow).
    fn budget(&self, wanted: usize) -> usize {
        wanted
    }
    /// Driver calls made so far (gpumem's statistics).
    fn device_calls(&self) -> u64 {
        0
    }
    /// [`Api::device_calls`] by kind, with what made them (gpumem's statistics).
    fn call_kinds(&self) -> CallKinds {
        CallKinds::default()
    }
    /// Whether the allocator is still settling on its own (gpumem: a planned layout being
    /// computed off the allocating thread, or made and not yet in its region).
    fn settling(&self) -> bool {
        false
    }
    /// Layouts planned and allocations served from them so far (gpumem's statistics).
    fn plan_counts(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// What an allocator's plans did between `before` and `after` ([`Api::plan_counts`]) for
/// `allocs` timed allocations: (share served from a plan, plans by the end).
fn plan_figures(before: (u64, u64), after: (u64, u64), allocs: usize) -> (f64, u64) {
    let served = after.1.saturating_sub(before.1) as f64;
    ((served / allocs.max(1) as f64).min(1.0), after.0)
}

/// gpumem's allocator under a name for the table.
pub struct Gpumem(pub CachingAllocator, pub &'static str);

/// The bench's allocators from gpumem: its configuration, and, where that configuration has
/// expandable segments, the same with classic segments (PyTorch's native policy: no page
/// moves, no plans), so that every run compares the two on one machine in one process.
fn gpumem_settings(config: Config) -> Vec<(Config, &'static str)> {
    let mut settings = vec![(config.clone(), "gpumem")];
    if config.pool.expandable_segments {
        let mut classic = config;
        classic.pool.expandable_segments = false;
        settings.push((classic, "gpumem (classic)"));
    }
    settings
}

/// Every scenario for gpumem's `settings`, for `plan.rounds` rounds, each on fresh devices
/// from `open`: one list of rows a setting and round, for [`combine`], and the single-thread
/// scenarios' batch-by-batch comparison of the first setting with the second ([`Paired`]).
/// Where there are two settings (the configured policy and classic segments), their
/// single-thread scenarios run side by side, batch by batch in turn ([`same_size_turns`],
/// [`random_live_turns`]); then each one's threads (its cache emptied first, and each
/// device dropped before the next round's are opened).
fn gpumem_rounds(
    settings: &[(Config, &'static str)],
    plan: &Plan,
    pb: &ProgressBar,
    open: impl Fn(Config) -> gpumem::Result<Device>,
) -> gpumem::Result<(Vec<Vec<Row>>, Vec<Paired>)> {
    let mut rounds = Vec::new();
    let (mut same, mut random): (Turns, Turns) = (Vec::new(), Vec::new());
    for _ in 0..plan.rounds {
        let gs = settings
            .iter()
            .map(|(config, name)| Ok(Gpumem(open(config.clone())?.allocator().clone(), name)))
            .collect::<gpumem::Result<Vec<_>>>()?;
        if gs.len() < 2 {
            rounds.extend(gs.iter().map(|g| run_all(g, plan, pb)));
            continue;
        }
        let apis: Vec<&Gpumem> = gs.iter().collect();
        let (same_rows, t) = same_size_turns(&apis, plan.pairs, pb);
        same.extend(t);
        let (random_rows, t) = random_live_turns(&apis, plan.ops, pb);
        random.extend(t);
        for g in &gs {
            g.0.empty_cache();
        }
        for (j, g) in gs.into_iter().enumerate() {
            pb.set_message(format!(
                "{}: random_256_live, {} threads",
                g.name(),
                plan.threads
            ));
            let threads = random_live_threads(&g, plan.threads, plan.ops, pb);
            rounds.push(vec![same_rows[j].clone(), random_rows[j].clone(), threads]);
            g.0.empty_cache();
        }
    }
    let paired = match settings {
        [(_, a), (_, b), ..] => vec![
            Paired::of("same_size", a, b, &same),
            Paired::of("random_256_live", a, b, &random),
        ],
        _ => Vec::new(),
    };
    Ok((rounds, paired))
}

/// Batch times (ns per op) of allocators taking turns: entry `k` holds each allocator's
/// batch `k`, in the allocators' order.
type Turns = Vec<Vec<f64>>;

/// The order in which the allocators run batch `k`: forwards, then backwards, in turn (so
/// that neither always runs right after the other).
fn turn_order(n: usize, k: usize) -> Vec<usize> {
    if k % 2 == 0 {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// `batches` batches of `n` allocators in turn: `batch(j, k)` runs batch `k` on allocator `j`
/// and gives its ns per op, the allocators in [`turn_order`].
fn in_turns(n: usize, batches: usize, mut batch: impl FnMut(usize, usize) -> f64) -> Turns {
    (0..batches)
        .map(|k| {
            let mut t = vec![0.0; n];
            for j in turn_order(n, k) {
                t[j] = batch(j, k);
            }
            t
        })
        .collect()
}

/// An allocator's counters before a timed part: driver calls and [`Api::plan_counts`].
#[derive(Clone, Copy)]
struct Counters {
    calls: u64,
    plans: (u64, u64),
    kinds: CallKinds,
}

impl Counters {
    fn of<A: Api>(api: &A) -> Self {
        Self {
            calls: api.device_calls(),
            plans: api.plan_counts(),
            kinds: api.call_kinds(),
        }
    }
}

/// A row of `api`'s timed part of `scenario` on `threads` threads, from its batch times `per`
/// and its counters `at` its start and end, for `allocs` timed allocations.
fn row_of<A: Api>(
    api: &A,
    (scenario, threads): (String, usize),
    per: Vec<f64>,
    at: (Counters, Counters),
    allocs: usize,
    warm_passes: usize,
) -> Row {
    let (before, after) = at;
    let (planned_share, plans) = plan_figures(before.plans, after.plans, allocs);
    Row {
        allocator: api.name(),
        scenario,
        threads,
        mean_ns_per_op: mean(&per),
        ns_per_op: median(per),
        device_calls: after.calls - before.calls,
        warm_passes,
        planned_share,
        plans,
        timed_call_kinds: after.kinds.since(before.kinds),
        rounds: Vec::new(),
    }
}

/// One row an allocator from the batch times of `turns` (see [`Turns`]), each allocator's
/// counters `before` the timed part and its warm-up passes, for `allocs` allocations each.
fn turn_rows<A: Api>(
    apis: &[&A],
    scenario: &str,
    turns: &Turns,
    before: &[Counters],
    allocs: usize,
    warm: &[usize],
) -> Vec<Row> {
    apis.iter()
        .enumerate()
        .map(|(j, api)| {
            let per = turns.iter().map(|t| t[j]).collect();
            let at = (before[j], Counters::of(*api));
            row_of(*api, (scenario.into(), 1), per, at, allocs, warm[j])
        })
        .collect()
}

/// [`same_size`] on `apis` side by side: batch `k` of each in turn (see [`turn_order`]), so
/// that the host's slow stretches fall on all of them alike.
fn same_size_turns<A: Api>(apis: &[&A], pairs: usize, pb: &ProgressBar) -> (Vec<Row>, Turns) {
    for api in apis {
        pb.set_message(format!("{}: same_size", api.name()));
        for _ in 0..BATCH {
            let h = api.alloc(4096);
            api.free(h);
        }
    }
    let pairs = pairs.max(BATCH);
    let before: Vec<Counters> = apis.iter().map(|a| Counters::of(*a)).collect();
    let turns = in_turns(apis.len(), pairs / BATCH, |j, _| {
        let api = apis[j];
        let started = Instant::now();
        for _ in 0..BATCH {
            let h = api.alloc(std::hint::black_box(4096));
            api.free(h);
        }
        pb.inc(BATCH as u64);
        started.elapsed().as_nanos() as f64 / BATCH as f64
    });
    let allocs = turns.len() * BATCH;
    let rows = turn_rows(
        apis,
        "same_size",
        &turns,
        &before,
        allocs,
        &vec![0; apis.len()],
    );
    (rows, turns)
}

/// [`random_live`] on `apis` side by side: each warmed up on its own (the same workload
/// each), then batch `k` of each in turn (see [`turn_order`]), the same steps of the workload.
fn random_live_turns<A: Api>(apis: &[&A], ops: usize, pb: &ProgressBar) -> (Vec<Row>, Turns) {
    let w = RandomLive::standard(1, PASS_OPS);
    let mut lives = Vec::new();
    let mut warm = Vec::new();
    for api in apis {
        pb.set_message(format!("{}: random_256_live", api.name()));
        let mut live = warm_set(*api, &w);
        warm.push(warm_passes(*api, &w, &mut live, pb));
        lives.push(live);
    }
    let before: Vec<Counters> = apis.iter().map(|a| Counters::of(*a)).collect();
    let turns = in_turns(apis.len(), ops.div_ceil(BATCH), |j, k| {
        let step = k * BATCH;
        let n = BATCH.min(ops - step);
        random_steps_from(apis[j], &w, &mut lives[j], step, n, pb)[0]
    });
    let rows = turn_rows(apis, "random_256_live", &turns, &before, ops, &warm);
    for (api, live) in apis.iter().zip(lives) {
        for h in live {
            api.free(h);
        }
    }
    (rows, turns)
}

/// One allocator against another, batch by batch: the ratios of the first's time of each
/// batch to the second's time of the same batch (run in turn, see [`turn_order`]).
#[derive(Debug, Clone, Serialize)]
pub struct Paired {
    pub scenario: String,
    pub allocator: String,
    pub against: String,
    pub batches: usize,
    /// median of the ratios
    pub median_ratio: f64,
    /// a 95% interval of that median (order statistics: distribution-free)
    pub low: f64,
    pub high: f64,
}

impl Paired {
    fn of(scenario: &str, allocator: &str, against: &str, turns: &Turns) -> Self {
        let mut r: Vec<f64> = turns
            .iter()
            .filter(|t| t.len() >= 2 && t[1] > 0.0)
            .map(|t| t[0] / t[1])
            .collect();
        r.sort_by(f64::total_cmp);
        let n = r.len();
        let (low, high) = median_interval(n);
        let at = |i: usize| r.get(i.min(n.saturating_sub(1))).copied().unwrap_or(0.0);
        Self {
            scenario: scenario.into(),
            allocator: allocator.into(),
            against: against.into(),
            batches: n,
            median_ratio: at(n / 2),
            low: at(low),
            high: at(high),
        }
    }
}

/// Ranks (0-based, in sorted order) of a 95% interval of the median of `n` samples: n/2 ∓
/// 1.96 √n / 2 (the binomial's normal approximation).
fn median_interval(n: usize) -> (usize, usize) {
    let half = 1.96 * (n as f64).sqrt() / 2.0;
    let mid = n as f64 / 2.0;
    let low = (mid - half).floor().max(0.0) as usize;
    let high = ((mid + half).ceil() as usize).min(n.saturating_sub(1));
    (low, high)
}

impl Api for Gpumem {
    type Handle = Allocation;
    fn name(&self) -> String {
        self.1.into()
    }
    fn alloc(&self, bytes: usize) -> Allocation {
        self.0
            .allocate(Stream::DEFAULT, bytes, 256)
            .unwrap_or_else(|e| fail(&e))
    }
    fn free(&self, h: Allocation) {
        self.0.deallocate(h).unwrap_or_else(|e| fail(&e))
    }
    fn device_calls(&self) -> u64 {
        let s = self.0.stats();
        s.num_device_alloc + s.num_device_free
    }
    fn call_kinds(&self) -> CallKinds {
        let s = self.0.stats();
        CallKinds {
            maps: s.num_device_alloc,
            unmaps: s.num_device_free,
            page_moves: s.num_page_moves,
            plans: s.num_plans,
        }
    }
    fn settling(&self) -> bool {
        self.0.stats().plans_pending > 0
    }
    fn plan_counts(&self) -> (u64, u64) {
        let s = self.0.stats();
        (s.num_plans, s.num_plan_allocs)
    }
}

/// A raw resource with no caching (cuMemAlloc, cuMemAllocAsync).
#[cfg(feature = "cuda")]
pub struct Raw {
    pub resource: std::sync::Arc<dyn gpumem::Resource>,
    pub slow: bool,
}

#[cfg(feature = "cuda")]
impl Api for Raw {
    type Handle = (u64, usize);
    fn name(&self) -> String {
        self.resource.name().to_string()
    }
    fn alloc(&self, bytes: usize) -> (u64, usize) {
        let p = self
            .resource
            .allocate(Stream::DEFAULT, bytes, 256)
            .unwrap_or_else(|e| fail(&e));
        (p, bytes)
    }
    fn free(&self, (p, n): (u64, usize)) {
        self.resource
            .deallocate(p, n, Stream::DEFAULT)
            .unwrap_or_else(|e| fail(&e))
    }
    fn budget(&self, wanted: usize) -> usize {
        if self.slow {
            wanted.min(2048)
        } else {
            wanted
        }
    }
}

/// The process's global allocator (malloc): the host baseline.
pub struct System;

pub struct SysPtr(*mut u8, usize);
// SAFETY: a heap pointer owned by exactly one handle; malloc memory may be freed on any thread.
unsafe impl Send for SysPtr {}

impl Api for System {
    type Handle = SysPtr;
    fn name(&self) -> String {
        "system".into()
    }
    fn alloc(&self, bytes: usize) -> SysPtr {
        let l = Layout::from_size_align(bytes, 256).expect("valid layout");
        // SAFETY: non-zero size; freed once in `free` with the same layout.
        SysPtr(std::hint::black_box(unsafe { std::alloc::alloc(l) }), bytes)
    }
    fn free(&self, SysPtr(p, n): SysPtr) {
        let l = Layout::from_size_align(n, 256).expect("valid layout");
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { std::alloc::dealloc(p, l) }
    }
}

fn fail(e: &gpumem::Error) -> ! {
    eprintln!("gpumem bench: allocation failed: {e}");
    std::process::exit(1)
}

/// Plan of one run, for the progress bar.
pub struct Plan {
    pub pairs: usize,
    pub ops: usize,
    pub threads: usize,
    /// rounds of gpumem's allocators (see [`Row::rounds`])
    pub rounds: usize,
}

pub fn progress(total: u64, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg:<40} [{bar:30}] {percent:>3}% {elapsed}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb
}

const BATCH: usize = 1000;

/// `same_size`: alloc+free pairs of 4 KiB on one thread; median ns per pair over batches.
pub fn same_size<A: Api>(api: &A, pairs: usize, pb: &ProgressBar) -> Row {
    let (mut rows, _) = same_size_turns(&[api], api.budget(pairs), pb);
    rows.remove(0)
}

/// Run `ops` steps of the random workload over `live`, timing batches; returns ns per op
/// (one op = one free + one alloc) for each batch.
fn random_steps<A: Api>(
    api: &A,
    w: &RandomLive,
    live: &mut [A::Handle],
    ops: usize,
    pb: &ProgressBar,
) -> Vec<f64> {
    random_steps_from(api, w, live, 0, ops, pb)
}

/// [`random_steps`] from step `start` of the workload on.
fn random_steps_from<A: Api>(
    api: &A,
    w: &RandomLive,
    live: &mut [A::Handle],
    start: usize,
    ops: usize,
    pb: &ProgressBar,
) -> Vec<f64> {
    let mut per = Vec::new();
    let mut step = start;
    let ops = start + ops;
    while step < ops {
        let n = BATCH.min(ops - step);
        let t = Instant::now();
        for _ in 0..n {
            let i = step % w.sizes.len();
            step += 1;
            let new = api.alloc(w.sizes[i]);
            let old = std::mem::replace(&mut live[w.slots[i]], new);
            api.free(old);
        }
        per.push(t.elapsed().as_nanos() as f64 / n as f64);
        pb.inc(n as u64);
    }
    per
}

fn warm_set<A: Api>(api: &A, w: &RandomLive) -> Vec<A::Handle> {
    (0..w.live).map(|i| api.alloc(w.sizes[i])).collect()
}

/// Warm-up passes over `w` until the pool has settled (see [`MAX_WARM_PASSES`]); returns how
/// many ran.
fn warm_passes<A: Api>(api: &A, w: &RandomLive, live: &mut [A::Handle], pb: &ProgressBar) -> usize {
    let n = api.budget(w.sizes.len());
    let mut warm = Warmup::new();
    loop {
        if warm.passes > 0 {
            pb.inc_length(n as u64);
        }
        let calls = api.device_calls();
        random_steps(api, w, live, n, pb);
        if warm.pass_done(api.device_calls() != calls, api.settling()) {
            return warm.passes;
        }
    }
}

/// `random_256_live`: 256 live blocks of 256 B – 64 MiB; free one, allocate another.
/// Warm-up passes first (until the pool has settled: see [`MAX_WARM_PASSES`]), then median ns
/// per op over batches.
pub fn random_live<A: Api>(api: &A, ops: usize, pb: &ProgressBar) -> Row {
    let (mut rows, _) = random_live_turns(&[api], api.budget(ops), pb);
    rows.remove(0)
}

/// `random_256_live_N_threads`: the same on N threads at once, each with its own live set;
/// ns per op = wall time / all ops of all threads (so 8 threads that never wait show 1/8 of
/// the single-thread figure). Warm-up passes run on all threads at once, until the pool has
/// settled (see [`MAX_WARM_PASSES`]).
pub fn random_live_threads<A: Api>(api: &A, threads: usize, ops: usize, pb: &ProgressBar) -> Row {
    let ops = api.budget(ops);
    let barrier = Barrier::new(threads + 1);
    let warming = AtomicBool::new(true);
    let wall = std::thread::scope(|s| {
        for t in 0..threads {
            let (barrier, warming) = (&barrier, &warming);
            s.spawn(move || {
                let w = RandomLive::standard(100 + t as u64, PASS_OPS);
                let mut live = warm_set(api, &w);
                // warm-up passes, as long as the main thread says so after each
                barrier.wait();
                while warming.load(Ordering::Acquire) {
                    random_steps(api, &w, &mut live, api.budget(w.sizes.len()), pb);
                    barrier.wait(); // the pass is done
                    barrier.wait(); // the verdict is out
                }
                barrier.wait(); // the timed part starts
                random_steps(api, &w, &mut live, ops, pb);
                barrier.wait();
                for h in live {
                    api.free(h);
                }
            });
        }
        // driver calls are read while every thread waits at a barrier
        let (mut warm, mut calls) = (Warmup::new(), api.device_calls());
        barrier.wait(); // the live sets are allocated
        loop {
            barrier.wait(); // the threads' pass is done
            let now = api.device_calls();
            let done = warm.pass_done(now != calls, api.settling());
            calls = now;
            if done {
                warming.store(false, Ordering::Release);
            } else {
                pb.inc_length((api.budget(PASS_OPS) * threads) as u64);
            }
            barrier.wait(); // the verdict is out
            if done {
                break;
            }
        }
        barrier.wait(); // the timed part starts
        let t = Instant::now();
        let before = Counters::of(api);
        barrier.wait();
        (t.elapsed(), (before, Counters::of(api)), warm.passes)
    });
    let (wall, at, warm) = wall;
    let per_op = wall.as_nanos() as f64 / (ops * threads) as f64;
    let scenario = (format!("random_256_live_{threads}_threads"), threads);
    // (one figure: wall time / all ops, as median and as mean)
    row_of(api, scenario, vec![per_op], at, ops * threads, warm)
}

/// Run every scenario for one allocator.
pub fn run_all<A: Api>(api: &A, plan: &Plan, pb: &ProgressBar) -> Vec<Row> {
    let mut rows = vec![same_size(api, plan.pairs, pb)];
    rows.push(random_live(api, plan.ops, pb));
    pb.set_message(format!(
        "{}: random_256_live, {} threads",
        api.name(),
        plan.threads
    ));
    rows.push(random_live_threads(api, plan.threads, plan.ops, pb));
    rows
}

/// Total progress units of `run_all` for an allocator.
pub fn units<A: Api>(api: &A, plan: &Plan) -> u64 {
    let warm = api.budget(PASS_OPS);
    let pairs = api.budget(plan.pairs).max(BATCH) / BATCH * BATCH;
    let ops = api.budget(plan.ops);
    (pairs + (warm + ops) * (1 + plan.threads)) as u64
}

#[derive(Serialize)]
struct BenchOut {
    pub device: String,
    rows: Vec<Row>,
    /// gpumem's policy against classic segments, batch by batch (empty where its
    /// configuration has classic segments already)
    paired: Vec<Paired>,
}

pub struct AllocArgs {
    pub json: bool,
    pub plan: Plan,
    pub target: Target,
}

pub fn run(a: AllocArgs) -> Result<()> {
    let config = a.target.config()?;
    let gpu = a.target.gpu();
    let (device, rows, paired) = if gpu {
        bench_gpu(&a, config)?
    } else {
        let settings = gpumem_settings(config);
        let total = units(&System, &a.plan) * (1 + (a.plan.rounds * settings.len()) as u64);
        let pb = progress(total, a.json);
        let (mut rounds, paired) = gpumem_rounds(&settings, &a.plan, &pb, Device::host)?;
        rounds.push(run_all(&System, &a.plan, &pb));
        let rows = combine(rounds);
        pb.finish_and_clear();
        ("host (no GPU)".to_string(), rows, paired)
    };
    emit(
        a.json,
        &BenchOut {
            device,
            rows,
            paired,
        },
        print,
    )
}

/// The table, and each allocator's thread speedup.
fn print(out: &BenchOut) {
    let (device, rows) = (&out.device, &out.rows);
    println!("allocation latency on {device} (one op = one alloc + one free)");
    println!(
        "{:<18} {:<32} {:>7} {:>14} {:>12} {:>12} {:>6} {:>8}  rounds",
        "allocator",
        "scenario",
        "threads",
        "median ns/op",
        "mean ns/op",
        "timed calls",
        "warm",
        "planned"
    );
    for r in rows {
        let rounds: Vec<String> = r.rounds.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "{:<18} {:<32} {:>7} {:>14.1} {:>12.1} {:>12} {:>6} {:>7.1}%  {}",
            r.allocator,
            r.scenario,
            r.threads,
            r.ns_per_op,
            r.mean_ns_per_op,
            r.device_calls,
            r.warm_passes,
            100.0 * r.planned_share,
            if rounds.len() > 1 {
                rounds.join(" / ")
            } else {
                String::new()
            }
        );
    }
    println!("(median ns/op: gpumem's is the median over its rounds, fresh allocators each, the two policies' single-thread scenarios batch by batch in turn; timed calls: gpumem's driver calls while timed, the most of a round; planned: gpumem's timed allocations served from a planned layout, the least of a round; warm: warm-up passes of {PASS_OPS} ops, until one made no driver call with no plan on its way; at most {MAX_WARM_PASSES}, not counting those that ended with a plan on its way, for up to {} s)", MAX_PLAN_WAIT.as_secs());
    for r in rows.iter().filter(|r| r.device_calls > 0) {
        let k = r.timed_call_kinds;
        println!(
            "{} {}: timed calls of the round with the most: {} maps, {} unmaps; {} allocations moved pages, {} layouts planned",
            r.allocator, r.scenario, k.maps, k.unmaps, k.page_moves, k.plans
        );
    }
    for p in &out.paired {
        println!(
            "{} / {}, {}, batch by batch ({} batches of {BATCH} in turn): median {:.3} (95% {:.3}-{:.3})",
            p.allocator, p.against, p.scenario, p.batches, p.median_ratio, p.low, p.high
        );
    }
    let mut names: Vec<&str> = rows.iter().map(|r| r.allocator.as_str()).collect();
    names.dedup();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for alloc in names {
        let one = rows
            .iter()
            .find(|r| r.allocator == alloc && r.scenario == "random_256_live");
        let many = rows.iter().find(|r| r.allocator == alloc && r.threads > 1);
        if let (Some(one), Some(many)) = (one, many) {
            println!(
                "{alloc}: {} threads on {cores} cores give {:.1}x the single-thread throughput ({:.1} vs {:.1} ns/op, wall time / ops)",
                many.threads,
                one.mean_ns_per_op / many.mean_ns_per_op,
                many.mean_ns_per_op,
                one.mean_ns_per_op
            );
        }
    }
}

#[cfg(feature = "cuda")]
fn bench_gpu(a: &AllocArgs, config: Config) -> Result<(String, Vec<Row>, Vec<Paired>)> {
    use gpumem::resource::cuda::{CudaAsyncPool, CudaDevice};
    use std::sync::Arc;
    let name = device_name(a.target.device)?;
    let raw = Raw {
        resource: Arc::new(CudaDevice::new(a.target.device)?),
        slow: true,
    };
    let pool = Raw {
        resource: Arc::new(CudaAsyncPool::new(a.target.device, u64::MAX)?),
        slow: false,
    };
    let settings = gpumem_settings(config);
    // gpumem's units are those of any unthrottled allocator (the async pool's)
    let total = units(&pool, &a.plan) * (1 + (a.plan.rounds * settings.len()) as u64)
        + units(&raw, &a.plan);
    let pb = progress(total, a.json);
    let (mut rounds, paired) = gpumem_rounds(&settings, &a.plan, &pb, |c| {
        gpumem::Device::cuda(a.target.device, c)
    })?;
    rounds.push(run_all(&pool, &a.plan, &pb));
    drop(pool);
    rounds.push(run_all(&raw, &a.plan, &pb));
    let rows = combine(rounds);
    pb.finish_and_clear();
    Ok((name, rows, paired))
}

#[cfg(not(feature = "cuda"))]
fn bench_gpu(a: &AllocArgs, _: Config) -> Result<(String, Vec<Row>, Vec<Paired>)> {
    Err(format!("device {}: built without the cuda feature", a.target.device).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(alloc: &str, ns: f64, mean: f64, calls: u64, warm: usize) -> Row {
        Row {
            allocator: alloc.into(),
            scenario: "random_256_live".into(),
            threads: 1,
            ns_per_op: ns,
            mean_ns_per_op: mean,
            device_calls: calls,
            warm_passes: warm,
            planned_share: 1.0,
            plans: 1,
            timed_call_kinds: CallKinds {
                maps: calls,
                ..CallKinds::default()
            },
            rounds: Vec::new(),
        }
    }

    #[test]
    fn rounds_combine_into_one_row_per_allocator_with_the_median() {
        let rows = combine(vec![
            vec![row("gpumem", 300.0, 310.0, 0, 8)],
            vec![row("classic", 220.0, 230.0, 0, 3)],
            vec![row("gpumem", 200.0, 210.0, 2, 9)],
            vec![row("classic", 340.0, 350.0, 1, 3)],
            vec![row("gpumem", 250.0, 260.0, 0, 7)],
            vec![row("classic", 230.0, 240.0, 0, 4)],
            vec![row("system", 900.0, 950.0, 0, 1)],
        ]);
        assert_eq!(rows.len(), 3);
        let g = &rows[0];
        assert_eq!((g.allocator.as_str(), g.ns_per_op), ("gpumem", 250.0));
        assert_eq!(g.rounds, vec![300.0, 200.0, 250.0]);
        assert_eq!(
            (g.mean_ns_per_op, g.device_calls, g.warm_passes),
            (260.0, 2, 9)
        );
        // the kinds of the round with the most calls
        assert_eq!(g.timed_call_kinds.maps, 2);
        let c = &rows[1];
        assert_eq!((c.ns_per_op, c.device_calls, c.warm_passes), (230.0, 1, 4));
        assert_eq!(rows[2].rounds, vec![900.0]);
        assert_eq!(rows[2].ns_per_op, 900.0);
    }

    #[test]
    fn batch_by_batch_ratios_give_their_median_within_an_interval() {
        // 100 batches: gpumem's twice classic's in the first half, the same in the second
        let turns: Turns = (0..100)
            .map(|k| vec![if k < 50 { 200.0 } else { 100.0 }, 100.0])
            .collect();
        let p = Paired::of("same_size", "gpumem", "gpumem (classic)", &turns);
        assert_eq!((p.batches, p.median_ratio), (100, 2.0));
        assert_eq!((p.low, p.high), (1.0, 2.0));
        // ranks of the interval: 50 -/+ 9.8
        assert_eq!(median_interval(100), (40, 60));
        assert_eq!(median_interval(1), (0, 0));
        assert_eq!(median_interval(0), (0, 0));
        let none = Paired::of("same_size", "a", "b", &Vec::new());
        assert_eq!((none.batches, none.median_ratio), (0, 0.0));
        // plans: the share of the timed allocations the plans served, and plans by the end
        assert_eq!(plan_figures((1, 100), (2, 600), 1000), (0.5, 2));
        assert_eq!(plan_figures((0, 0), (0, 0), 1000), (0.0, 0));
        // the order in which allocators run a batch turns around every other batch
        assert_eq!(turn_order(2, 0), vec![0, 1]);
        assert_eq!(turn_order(2, 1), vec![1, 0]);
    }

    #[test]
    fn the_warm_up_ends_at_a_quiet_pass_and_passes_with_a_plan_on_its_way_do_not_count() {
        let mut w = Warmup::new();
        // a quiet pass with a plan on its way goes on; a quiet settled one ends it
        assert!(!w.pass_done(false, true));
        assert!(w.pass_done(false, false));
        assert_eq!(w.passes, 2);
        // driver calls in every pass: 20 counted passes, however many waited for a plan
        let mut w = Warmup::new();
        for _ in 0..5 {
            assert!(!w.pass_done(true, true));
        }
        for _ in 0..MAX_WARM_PASSES - 1 {
            assert!(!w.pass_done(true, false));
        }
        assert!(w.pass_done(true, false));
        assert_eq!(w.passes, 5 + MAX_WARM_PASSES);
    }
}
