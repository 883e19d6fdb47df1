//! Replay: the demand of a trace through gpumem's policies, on a simulated device or a real one,
//! and what the trace's own allocator reserved.

use super::{Action, TraceEvent};
use crate::config::Config;
use crate::error::{Error, Result};
pub use crate::resource::sim::CostModel;
use crate::resource::sim::SimulatedDevice;
use crate::resource::{Backend, Stream, VmmCalls};
use crate::{Allocation, CachingAllocator};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// What one policy did with a trace's demand.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// policy name (`recorded` for the trace's own allocator)
    pub name: String,
    /// where the replay ran: `simulated`, a CUDA resource name, or `trace` for `recorded`
    pub backend: String,
    /// highest sum of live requested bytes
    pub peak_live_bytes: u64,
    /// highest reserved bytes
    pub peak_reserved_bytes: u64,
    /// of those, the bytes in planned layouts' regions (the rest: the dynamic pool)
    pub planned_bytes_at_peak: u64,
    /// peak reserved / peak live
    pub ratio: f64,
    /// when reserved bytes first reached their peak: the share of the trace's events before
    /// it (`None`: nothing reserved). A peak early in a job that repeats came before any plan
    /// served, in its first steps
    pub peak_reserved_at: Option<f64>,
    /// segments held at the reserved peak
    pub segments_at_peak: u64,
    /// largest free block when reserved peaked (0 for `recorded`); for expandable segments the
    /// longest free range that is mapped
    pub largest_free_block_at_peak: u64,
    /// free bytes in mapped whole pages at the reserved peak whose physical handles hold only
    /// free bytes, so that a page move could take them (0 for `recorded` and classic segments)
    pub movable_at_peak: u64,
    /// free bytes in mapped whole pages at the reserved peak whose physical handles blocks in
    /// use also cover: an unmap covers whole handles, so no move can take them (0 for
    /// `recorded` and classic segments)
    pub stranded_at_peak: u64,
    /// allocator time per replayed event (0 for `recorded`)
    pub ns_per_event: f64,
    /// segment allocations and frees, or page map and unmap calls (expandable segments)
    pub device_calls: u64,
    /// host waits for a stream before unmapping pages, or before mapping over an address whose
    /// pages moved in stream order while that stream's work was still queued
    pub unmap_syncs: u64,
    /// checkpoint events recorded on the allocating thread (by which freed pages are known
    /// idle, or another stream takes them in its order)
    pub checkpoints: u64,
    /// modelled driver time on the allocating thread ([`CostModel`]; 0 for `recorded`), µs
    pub critical_path_us: f64,
    /// modelled driver time off the allocating thread (unmapping, releasing), µs
    pub background_us: f64,
    /// `critical_path_us` as a share of the trace's own wall time (its first to last
    /// `time_us`); `None` where the trace has no times
    pub critical_path_share: Option<f64>,
    /// the largest share of any [`WINDOW_US`] of the trace's time that page work on the
    /// allocating thread took (`Stats::page_map_ns`, the time budget's own measure: on the
    /// simulator, the modelled calls), over the windows after the warm-up: none within a
    /// second of the live bytes' peak growing by 1% or more (see [`warm_ups`]). `None` where
    /// the trace has no such window, and for `recorded` and classic segments (no pages)
    pub worst_window_share: Option<f64>,
    /// time charged to the time budget of page moves (`pool/budget.rs`; on the simulator,
    /// the modelled calls' time), µs: the part of `critical_path_us` the policy chose to spend
    pub move_us: f64,
    /// the longest single move of those, µs
    pub move_longest_us: f64,
    /// time the allocating thread spent growing past the high-water mark of reserved bytes;
    /// moves may take as long as that on top of 1% of wall time (`pool/budget.rs`), µs
    pub growth_us: f64,
    /// the page engine's calls by kind (expandable segments; `None` otherwise)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmm_calls: Option<VmmCalls>,
}

/// What a replay's driver work cost, from the pool's statistics and the page engine's calls.
impl CostModel {
    /// (allocating thread, background) µs of the driver work in `stats` (its checkpoint
    /// events included), with the page engine's calls `vmm` where the pool had expandable
    /// segments.
    pub fn cost(&self, stats: &crate::Stats, vmm: Option<&VmmCalls>) -> (f64, f64) {
        let stalls = stats.num_unmap_syncs as f64 * self.sync_stall_us;
        match vmm {
            Some(c) => {
                let fg = self.vmm_foreground_us(c)
                    + stats.num_checkpoints as f64 * self.record_us
                    + stalls;
                let bg = c.releases as f64 * self.release_us
                    + c.unmaps_background as f64 * self.unmap_us;
                (fg, bg)
            }
            None => {
                // classic segments: every cuMemAlloc and cuMemFree on the allocating thread
                let calls = (stats.num_device_alloc + stats.num_device_free) as f64;
                let mib = stats.reserved_bytes.all.allocated as f64 / (1 << 20) as f64
                    + stats.reserved_bytes.all.freed as f64 / (1 << 20) as f64;
                (
                    calls * self.segment_us + mib * self.segment_us_per_mib + stalls,
                    0.0,
                )
            }
        }
    }
}

/// The figures of the trace's own allocator, from its `segment_*` events.
pub fn recorded(events: &[TraceEvent]) -> PolicyReport {
    let (mut live, mut peak_live, mut reserved, mut peak_reserved) = (0u64, 0u64, 0u64, 0u64);
    let (mut segs, mut segs_at_peak, mut calls) = (0u64, 0u64, 0u64);
    let mut peak_at = None;
    for (i, e) in events.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                live += e.size;
                peak_live = peak_live.max(live);
            }
            Action::FreeCompleted => live = live.saturating_sub(e.size),
            Action::SegmentAlloc | Action::SegmentMap => {
                reserved += e.size;
                if e.action == Action::SegmentAlloc {
                    segs += 1;
                }
                calls += 1;
                if reserved > peak_reserved {
                    peak_reserved = reserved;
                    segs_at_peak = segs;
                    peak_at = Some(i);
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                reserved = reserved.saturating_sub(e.size);
                if e.action == Action::SegmentFree {
                    segs = segs.saturating_sub(1);
                }
                calls += 1;
            }
            Action::FreeRequested | Action::Snapshot | Action::Oom | Action::EmptyCache => {}
        }
    }
    PolicyReport {
        name: "recorded".into(),
        backend: "trace".into(),
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak_reserved,
        planned_bytes_at_peak: 0,
        ratio: ratio(peak_reserved, peak_live),
        peak_reserved_at: peak_at.map(|i| event_share(i, events.len())),
        segments_at_peak: segs_at_peak,
        largest_free_block_at_peak: 0,
        movable_at_peak: 0,
        stranded_at_peak: 0,
        ns_per_event: 0.0,
        critical_path_us: 0.0,
        move_us: 0.0,
        move_longest_us: 0.0,
        growth_us: 0.0,
        background_us: 0.0,
        vmm_calls: None,
        critical_path_share: None,
        worst_window_share: None,
        device_calls: calls,
        unmap_syncs: 0,
        checkpoints: 0,
    }
}

/// Length of the windows of [`PolicyReport::worst_window_share`], µs: the time budget's
/// window and warm-up (`pool/budget.rs`).
pub const WINDOW_US: u64 = crate::pool::MOVE_BUDGET_WINDOW_NS / 1_000;

/// The warm-ups of a job whose live bytes after each event (and the event's `time_us`) are
/// `timeline`: from each time the peak of live bytes grows by 1% or more over its value at
/// the last such time (the job's first bytes included; [`crate::pool::warms_up`], the time
/// budget's own rule on the peak of allocated bytes) to a second after it, merged where they
/// meet. The pool also warms up when a planned layout first takes its region; the replay's
/// windows do not leave those seconds out, so they are held to 1% as well.
pub fn warm_ups(timeline: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut level = 0u64;
    for &(t, live) in timeline {
        if crate::pool::warms_up(live, level) {
            level = live;
            match out.last_mut() {
                Some(w) if w.1 >= t => w.1 = t + WINDOW_US,
                _ => out.push((t, t + WINDOW_US)),
            }
        }
    }
    out
}

/// The largest share of a [`WINDOW_US`] window that the work counted by `work_ns` (after each
/// event of `timeline`, cumulative) took, over the windows that meet no warm-up
/// ([`warm_ups`]); `None` where there is none.
fn worst_window(timeline: &[(u64, u64)], work_ns: &[u64]) -> Option<f64> {
    let warm = warm_ups(timeline);
    let t0 = timeline.first()?.0;
    let mut worst: Option<f64> = None;
    let mut i = 0;
    for j in 0..timeline.len() {
        let t = timeline[j].0;
        if t < t0 + WINDOW_US {
            continue;
        }
        // the window (t - WINDOW_US, t]: work done by events i..=j, i the first inside it
        while timeline[i].0 + WINDOW_US <= t {
            i += 1;
        }
        let lo = t - WINDOW_US;
        if warm.iter().any(|&(a, b)| a <= t && b > lo) {
            continue;
        }
        let before = if i == 0 { 0 } else { work_ns[i - 1] };
        let share = (work_ns[j] - before) as f64 / (WINDOW_US as f64 * 1e3);
        worst = Some(worst.map_or(share, |w: f64| w.max(share)));
    }
    worst
}

/// The trace's own wall time, first to last `time_us`, where it has times.
fn wall_us(events: &[TraceEvent]) -> Option<f64> {
    let first = events.iter().map(|e| e.time_us).filter(|&t| t > 0).min()?;
    let last = events.iter().map(|e| e.time_us).max()?;
    (last > first).then(|| (last - first) as f64)
}

/// The share of a trace's `n` events before event `i`.
fn event_share(i: usize, n: usize) -> f64 {
    i as f64 / n.max(1) as f64
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A replay in detail: the report, the segments when reserved memory peaked, and the live and
/// reserved bytes after every replayed event.
#[derive(Debug, Clone, Serialize)]
pub struct Replay {
    /// the figures
    pub report: PolicyReport,
    /// every segment with its blocks at the reserved peak
    pub segments_at_peak: Vec<crate::pool::SegmentInfo>,
    /// `(time_us, live requested bytes, reserved bytes)` after every replayed event
    pub timeline: Vec<(u64, u64, u64)>,
    /// driver calls (segment allocations and frees, page maps and unmaps) made so far, after
    /// every replayed event
    pub calls: Vec<u64>,
    /// page work on the allocating thread so far (`Stats::page_map_ns`), ns, after every
    /// replayed event
    pub page_ns: Vec<u64>,
}

/// Replay the demand of `events` through gpumem's pool with `config` over a simulated device of
/// `capacity` bytes. A free of an address that is not live is an error naming the event.
pub fn replay(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    capacity: u64,
) -> Result<PolicyReport> {
    Ok(replay_simulated(name, events, config, capacity, None)?.report)
}

/// [`replay`] with every figure, on a simulated device whose clock follows the trace's
/// `time_us` (plus what the modelled driver calls cost: the time budget of page moves runs on
/// it) and whose GPU runs `lag` allocator calls behind the host
/// (see [`SimulatedDevice::set_lag`]): with `None` every event has completed
/// by the next call, as if kernels took no time; with `Some(u64::MAX)` none completes until
/// the pool synchronises. A real job lies in between: the host queues a training step's
/// kernels well before the GPU has run them, so the pages its frees leave are not known idle
/// for a while.
pub fn replay_simulated(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    capacity: u64,
    lag: Option<u64>,
) -> Result<Replay> {
    replay_simulated_at(name, events, config, capacity, lag, CostModel::default())
}

/// [`replay_simulated`] on a device whose driver calls cost `cost` (on its clock, which the
/// time budget of page moves runs on, and in the report's modelled driver time).
pub fn replay_simulated_at(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    capacity: u64,
    lag: Option<u64>,
    cost: CostModel,
) -> Result<Replay> {
    let make = || {
        let sim = Arc::new(SimulatedDevice::new(capacity).with_page(config.backend.page_bytes));
        sim.set_cost(cost);
        if let Some(n) = lag {
            sim.set_lag(n);
        }
        let s = sim.clone();
        let tick: Box<dyn Fn(u64)> = Box::new(move |us| {
            s.set_time_us(us);
            if lag.is_some() {
                s.advance();
            }
        });
        Ok((sim as Arc<dyn Backend>, tick))
    };
    replay_passes(name, events, config, &make, &Stream, &cost)
}

/// Capacity of the simulated device replays run on: 4 TiB, more than any GPU has, and small
/// enough that the simulator's page tables stay bounded whatever a trace asks for.
pub const SIM_CAPACITY: u64 = 1 << 42;

/// A simulated device of `capacity` bytes, as a backend to replay on.
pub fn simulated(capacity: u64) -> Arc<dyn Backend> {
    Arc::new(SimulatedDevice::new(capacity))
}

/// [`replay`] over backends made by `backend` (a fresh one per pass: the demand is replayed
/// three times, once timed with nothing but the allocator calls, once to find the reserved
/// peak, once to stop there and look at the segments), with the trace's stream ids turned into
/// the backend's streams by `stream` (on CUDA the recorded handles mean nothing in this
/// process: give each id a stream of its own). On a CUDA backend the allocations are real (no
/// kernels run).
pub fn replay_detailed(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    backend: &dyn Fn() -> Result<Arc<dyn Backend>>,
    stream: &dyn Fn(u64) -> Stream,
) -> Result<Replay> {
    let make = || Ok((backend()?, Box::new(|_| {}) as Box<dyn Fn(u64)>));
    replay_passes(name, events, config, &make, stream, &CostModel::default())
}

/// A backend for one replay pass and what advances its clock to an allocator call at the
/// given `time_us`.
type Pass = (Arc<dyn Backend>, Box<dyn Fn(u64)>);

fn replay_passes(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    backend: &dyn Fn() -> Result<Pass>,
    stream: &dyn Fn(u64) -> Stream,
    cost: &CostModel,
) -> Result<Replay> {
    // a request larger than the device fails at once, with its line, instead of growing the
    // simulator's page tables without bound
    let (first, _) = backend()?;
    let capacity = first
        .limit()
        .or_else(|| first.mem_info().ok().map(|m| m.total));
    if let Some(cap) = capacity {
        if let Some((i, e)) = events
            .iter()
            .enumerate()
            .find(|(_, e)| e.action == Action::Alloc && e.size > cap)
        {
            return Err(Error::Trace(format!(
                "{}: an allocation of {} bytes is larger than the {} device ({} bytes)",
                e.place(i),
                e.size,
                first.name(),
                cap
            )));
        }
    }
    let paged = first.virtual_memory().is_some() && config.pool.expandable_segments;
    drop(first);
    let start = Instant::now();
    let replayed = run(events, config, backend()?, stream, usize::MAX, |_, _| {})?.0;
    let ns_per_event = start.elapsed().as_nanos() as f64 / replayed.max(1) as f64;

    let mut peak = (0u64, 0u64, 0usize, 0u64); // reserved, segments, event index, planned
    let mut timeline = Vec::with_capacity(events.len());
    let mut calls = Vec::with_capacity(events.len());
    let mut page_ns = Vec::with_capacity(events.len());
    let mut live = 0u64;
    let (_, stats, backend_name, vmm) = run(
        events,
        config,
        backend()?,
        stream,
        usize::MAX,
        |alloc, i| {
            let s = alloc.stats();
            let e = &events[i];
            match e.action {
                Action::Alloc => live += e.size,
                _ => live = live.saturating_sub(e.size),
            }
            timeline.push((e.time_us, live, s.reserved_bytes.all.current));
            page_ns.push(s.page_map_ns);
            calls.push(if paged {
                s.vmm_calls_foreground + s.vmm_calls_background
            } else {
                s.num_device_alloc + s.num_device_free
            });
            if s.reserved_bytes.all.current > peak.0 {
                peak = (
                    s.reserved_bytes.all.current,
                    s.segment.all.current,
                    i,
                    s.plan_reserved_bytes,
                );
            }
        },
    )?;
    let mut at_peak = (0u64, Vec::new(), (0u64, 0u64));
    if peak.0 > 0 {
        run(events, config, backend()?, stream, peak.2, |alloc, i| {
            if i == peak.2 {
                at_peak = (
                    alloc.largest_free_block(),
                    alloc.segments(),
                    alloc.free_page_kinds(),
                );
            }
        })?;
    }
    let peak_live = recorded(events).peak_live_bytes;
    let vmm = vmm.filter(|_| paged);
    let (fg_us, bg_us) = cost.cost(&stats, vmm.as_ref());
    // driver calls: the page engine's where there is one (a map over pages whose handle
    // still lingers there makes none), else segment allocations and frees
    let device_calls = match &vmm {
        Some(c) => c.foreground + c.background,
        None => stats.num_device_alloc + stats.num_device_free,
    };
    Ok(Replay {
        report: PolicyReport {
            name: name.to_string(),
            backend: backend_name,
            peak_live_bytes: peak_live,
            peak_reserved_bytes: peak.0,
            planned_bytes_at_peak: peak.3,
            ratio: ratio(peak.0, peak_live),
            peak_reserved_at: (peak.0 > 0).then(|| event_share(peak.2, events.len())),
            segments_at_peak: peak.1,
            largest_free_block_at_peak: at_peak.0,
            movable_at_peak: at_peak.2 .0,
            stranded_at_peak: at_peak.2 .1,
            ns_per_event,
            device_calls,
            unmap_syncs: stats.num_unmap_syncs + stats.vmm_waits,
            checkpoints: stats.num_checkpoints,
            critical_path_us: fg_us,
            move_us: stats.page_move_ns as f64 / 1e3,
            move_longest_us: stats.page_move_longest_ns as f64 / 1e3,
            growth_us: stats.page_growth_ns as f64 / 1e3,
            background_us: bg_us,
            critical_path_share: wall_us(events).map(|w| fg_us / w),
            worst_window_share: paged
                .then(|| {
                    let lives: Vec<(u64, u64)> = timeline.iter().map(|t| (t.0, t.1)).collect();
                    worst_window(&lives, &page_ns)
                })
                .flatten(),
            vmm_calls: vmm,
        },
        segments_at_peak: at_peak.1,
        timeline,
        calls,
        page_ns,
    })
}

/// Replay the demand up to and including event `stop`; `after` runs after every replayed
/// allocation and free with the event's index. Returns the events replayed, the final
/// statistics and the backend's name. Blocks still live at the end are freed.
fn run(
    events: &[TraceEvent],
    config: &Config,
    (backend, tick): Pass,
    stream: &dyn Fn(u64) -> Stream,
    stop: usize,
    mut after: impl FnMut(&CachingAllocator, usize),
) -> Result<(u64, crate::Stats, String, Option<VmmCalls>)> {
    let mut config = config.clone();
    config.shards = Some(1);
    let backend_name = backend.name().to_string();
    let alloc = CachingAllocator::new(backend.clone(), config)?;
    let mut live: FxHashMap<u64, Allocation> = FxHashMap::default();
    let mut replayed = 0u64;
    let mut result = Ok(());
    for (i, e) in events.iter().enumerate().take(stop.saturating_add(1)) {
        if matches!(e.action, Action::Alloc | Action::FreeCompleted) {
            tick(e.time_us);
        }
        match e.action {
            Action::Alloc => {
                let a = match alloc.allocate(stream(e.stream), e.size.max(1) as usize, 512) {
                    Ok(a) => a,
                    Err(err) => {
                        result = Err(Error::Trace(format!(
                            "{}: alloc of {} bytes: {err}",
                            e.place(i),
                            e.size
                        )));
                        break;
                    }
                };
                if let Some(old) = live.insert(e.addr, a) {
                    alloc.deallocate(old)?;
                    result = Err(Error::Trace(format!(
                        "{}: alloc at {:#x}, which is already live",
                        e.place(i),
                        e.addr
                    )));
                    break;
                }
            }
            Action::FreeCompleted => {
                let Some(a) = live.remove(&e.addr) else {
                    result = Err(Error::Trace(format!(
                        "{}: free of unknown address {:#x}",
                        e.place(i),
                        e.addr
                    )));
                    break;
                };
                alloc.deallocate(a)?;
            }
            Action::EmptyCache => {
                alloc.empty_cache();
                continue;
            }
            _ => continue,
        }
        after(&alloc, i);
        replayed += 1;
    }
    let stats = alloc.stats();
    let vmm = backend.virtual_memory().map(|v| v.calls());
    for (_, a) in live {
        alloc.deallocate(a)?;
    }
    result.map(|()| (replayed, stats, backend_name, vmm))
}
