//! A simulated device of fixed capacity over a synthetic address space: real policy, fake bytes.
//!
//! Used for out-of-memory tests, property tests and trace replay. Addresses are aligned to the
//! driver's 2 MiB granularity like cuMemAlloc's. Events can be left pending so that tests can
//! check that the pool never reuses memory another stream may still be using.
//!
//! It also models virtual-memory segments: address space reserved for free, physical memory
//! mapped into it in 2 MiB pages and counted against the capacity, as on a CUDA device with
//! cuMemAddressReserve / cuMemCreate / cuMemMap.

use super::page_map::{self, Evict, MapPlan, PageMap, Release};
use super::{
    next_stream_id, CopyKind, DevPtr, Event, Location, MemInfo, Resource, Stream, StreamOps,
    VirtualMemory, VmmCalls,
};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// What the driver calls an allocator makes cost, for replays, which run none of them for real.
/// The page calls' defaults were measured on the H100 with `scripts/probes/vmm_gpu_cost.cu`
/// while the GPU ran kernels (as it does when a training job allocates): setting access and
/// unmapping cost per mapping, however many one call covers (10 handles of 2 MiB: 438 µs to
/// set access, 438 µs to unmap; one handle of 20 MiB: 57 µs and 51 µs; idle, 304/193 and
/// 30/20 µs). The cuMemAlloc figures come from `vmm_micro`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CostModel {
    /// cuMemCreate of one page, µs
    pub create_us: f64,
    /// cuMemMap of one page, µs
    pub map_us: f64,
    /// cuMemSetAccess, per page it gives access to (one call per mapped run; its cost grows
    /// with the mappings it covers), µs
    pub set_access_us: f64,
    /// cuMemUnmap of one page, µs; charged to the allocating thread wherever it runs: the
    /// driver serialises page calls, so the page worker's unmapping lands on the allocating
    /// thread's calls (measured with `vmm_micro` on the H100)
    pub unmap_us: f64,
    /// cuMemRelease of one page (off the allocating thread), µs
    pub release_us: f64,
    /// recording the event a move in stream order waits for (cuEventRecord), µs
    pub record_us: f64,
    /// cuMemAlloc or cuMemFree of a classic segment: a fixed part, µs ...
    pub segment_us: f64,
    /// ... and a part per MiB
    pub segment_us_per_mib: f64,
    /// a host wait for a stream or the device (or, before unmapping an address whose pages
    /// moved in stream order, for that stream's work): the allocating thread stalls until the
    /// GPU has caught up, which a trace does not record; this many µs each
    pub sync_stall_us: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            create_us: 13.5,
            map_us: 1.6,
            set_access_us: 44.0,
            unmap_us: 44.0,
            release_us: 14.0,
            record_us: 2.0,
            segment_us: 30.0,
            segment_us_per_mib: 0.5,
            sync_stall_us: 1000.0,
        }
    }
}

impl CostModel {
    /// This model with every driver call's cost times `factor` (host waits for the GPU stay
    /// as they are): the page calls of a busy H100 host can cost more than the measured
    /// defaults (gptfix in PyTorch 2.11: its first two steps' page calls took 1.6-1.7 times
    /// what the model gives for the same calls), and a policy whose outcome turns on such a
    /// factor is not one to trust.
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            create_us: self.create_us * factor,
            map_us: self.map_us * factor,
            set_access_us: self.set_access_us * factor,
            unmap_us: self.unmap_us * factor,
            release_us: self.release_us * factor,
            record_us: self.record_us * factor,
            segment_us: self.segment_us * factor,
            segment_us_per_mib: self.segment_us_per_mib * factor,
            sync_stall_us: self.sync_stall_us,
        }
    }

    /// µs the allocating thread spends in the page calls `c` (creates, maps, access, unmaps
    /// on that thread, event records, waits for the GPU).
    pub fn vmm_foreground_us(&self, c: &VmmCalls) -> f64 {
        (c.creates - c.creates_background) as f64 * self.create_us
            + (c.maps - c.maps_background) as f64 * (self.map_us + self.set_access_us)
            + (c.unmaps - c.unmaps_background) as f64 * self.unmap_us
            + c.records as f64 * self.record_us
            + c.waits as f64 * self.sync_stall_us
    }
}

/// Address granularity of simulated segments.
pub const SIM_GRANULARITY: u64 = 2 << 20;
const SIM_BASE: u64 = 0x7f00_0000_0000;

#[derive(Debug, Default)]
struct SimState {
    next_addr: u64,
    next_va: u64,
    used: u64,
    /// memory another process holds on the device
    external: u64,
    live: FxHashMap<DevPtr, u64>,
    next_event: u64,
    /// pending events → the clock tick at which they complete (`u64::MAX`: when told)
    pending: FxHashMap<u64, u64>,
    auto_complete: bool,
    /// with `Some(n)`, an event completes `n` ticks of [`SimulatedDevice::advance`] after it
    /// was recorded, or at a host synchronisation
    lag: Option<u64>,
    clock: u64,
    allocs: u64,
    frees: u64,
    stream_waits: u64,
    event_queries: u64,
    syncs: u64,
    /// reserved address ranges: base → bytes
    ranges: FxHashMap<DevPtr, u64>,
    /// which handle backs which page (see `page_map`: unmapped pages linger)
    pages: PageMap,
    next_handle: u64,
    /// physical handles in existence (counted in `used`)
    handles: u64,
    /// map requests
    maps: u64,
    /// unmap requests
    unmaps: u64,
    /// driver calls a CUDA engine would have made
    driver: VmmCalls,
    /// events recorded for pages moved in stream order: event → (stream, tick due)
    moves: FxHashMap<usize, (u64, u64)>,
    /// the earliest tick at which one of `moves` is due
    moves_due: u64,
    next_move_event: usize,
    /// the event of the move in progress, shared by its unmaps (as the CUDA engine does), and
    /// the GPU's tick when it was recorded
    move_event: Option<(u64, usize, u64)>,
    /// the host's time outside the allocator's driver calls, ns ([`SimulatedDevice::set_time_us`])
    time_ns: u64,
    /// what its driver calls cost on the clock ([`SimulatedDevice::set_cost`])
    cost: CostModel,
    /// CUDA-graph captures: each capturing stream's frontier (the nodes its next operation
    /// depends on), and each node's dependencies (node `n` at index `n - 1`)
    capture_frontiers: FxHashMap<u64, Vec<u64>>,
    capture_nodes: Vec<Vec<u64>>,
}

/// Counters of what the simulated device was asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimCounters {
    /// bytes currently allocated
    pub used: u64,
    /// number of allocate calls that succeeded
    pub allocs: u64,
    /// number of deallocate calls that succeeded
    pub frees: u64,
    /// number of stream waits inserted
    pub stream_waits: u64,
    /// number of times an event was asked whether it has completed
    pub event_queries: u64,
    /// events recorded and not yet complete
    pub pending_events: usize,
    /// host synchronisations with a stream
    pub syncs: u64,
    /// map calls that succeeded
    pub maps: u64,
    /// unmap calls that succeeded
    pub unmaps: u64,
    /// bytes mapped into virtual-memory segments now (included in `used`)
    pub mapped_bytes: u64,
    /// maps that waited for a stream's work before unmapping an address moved in stream
    /// order (a real device would wait for that work first)
    pub settle_waits: u64,
}

/// A device with `capacity` bytes and no memory behind its addresses.
#[derive(Debug)]
pub struct SimulatedDevice {
    capacity: u64,
    vmm: bool,
    /// bytes of one page (one physical handle)
    page: u64,
    state: Mutex<SimState>,
}

/// Start of the simulated virtual-memory address space (apart from classic segments).
const SIM_VA_BASE: u64 = 0x5000_0000_0000;

impl SimulatedDevice {
    /// A device of `capacity` bytes whose events complete at once.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            vmm: true,
            page: SIM_GRANULARITY,
            state: Mutex::new(SimState {
                next_addr: SIM_BASE,
                next_va: SIM_VA_BASE,
                auto_complete: true,
                pages: PageMap::new(SIM_GRANULARITY),
                ..Default::default()
            }),
        }
    }

    /// The same device with pages (physical handles) of `page` bytes, a multiple of the
    /// granularity (see [`Config`](crate::Config)'s `expandable_page_mb`); before any use.
    pub fn with_page(mut self, page: u64) -> Self {
        let page = page.max(SIM_GRANULARITY).next_multiple_of(SIM_GRANULARITY);
        self.page = page;
        self.state.get_mut().pages = PageMap::new(page);
        self
    }

    /// The same device without virtual-memory support (as on a GPU without VMM).
    pub fn without_vmm(mut self) -> Self {
        self.vmm = false;
        self
    }

    /// When false, recorded events stay pending until [`SimulatedDevice::complete_events`]
    /// (or a host synchronisation on them), as if kernels were still running.
    pub fn set_auto_complete(&self, on: bool) {
        self.state.lock().auto_complete = on;
    }

    /// Start capturing a CUDA graph on `stream` (the graph has no node yet).
    pub fn begin_capture(&self, stream: Stream) {
        self.state
            .lock()
            .capture_frontiers
            .insert(stream.0, Vec::new());
    }

    /// A kernel queued on capturing `stream`: a node after its frontier, which becomes the
    /// frontier.
    pub fn capture_launch(&self, stream: Stream) {
        let mut s = self.state.lock();
        let deps = s
            .capture_frontiers
            .get(&stream.0)
            .cloned()
            .unwrap_or_default();
        s.capture_nodes.push(deps);
        let node = s.capture_nodes.len() as u64;
        s.capture_frontiers.insert(stream.0, vec![node]);
    }

    /// `waiter` waits for `on`'s work so far (an event recorded on `on`, waited for on
    /// `waiter`): its frontier gains `on`'s, and it joins the capture if it was not in it.
    pub fn capture_join(&self, waiter: Stream, on: Stream) {
        let mut s = self.state.lock();
        let theirs = s.capture_frontiers.get(&on.0).cloned().unwrap_or_default();
        let mine = s.capture_frontiers.entry(waiter.0).or_default();
        for n in theirs {
            if !mine.contains(&n) {
                mine.push(n);
            }
        }
    }

    /// The capture ends: no stream captures any more.
    pub fn end_capture(&self) {
        let mut s = self.state.lock();
        s.capture_frontiers.clear();
        s.capture_nodes.clear();
    }

    /// Complete every pending event: all queued work has finished.
    pub fn complete_events(&self) {
        self.state.lock().pending.clear();
    }

    /// A GPU that runs behind the host: every event recorded from now on completes `ticks`
    /// calls of [`SimulatedDevice::advance`] later (the work queued before it has run), or at a
    /// host synchronisation; `u64::MAX` means only at a synchronisation. Replays advance one
    /// tick per allocation or free, so `ticks` is how many allocator calls the host is ahead.
    pub fn set_lag(&self, ticks: u64) {
        let mut s = self.state.lock();
        s.auto_complete = false;
        s.lag = Some(ticks);
    }

    /// Advance the lagging GPU's clock by one tick (see [`SimulatedDevice::set_lag`]).
    pub fn advance(&self) {
        let mut s = self.state.lock();
        s.clock += 1;
        let now = s.clock;
        if s.lag.is_some() && !s.pending.is_empty() {
            s.pending.retain(|_, due| *due > now);
        }
        s.settle_moves(false);
    }

    /// The host's clock reads `us` microseconds, not counting the driver calls the allocator
    /// made (a replay sets it from the trace's `time_us`; it never goes back). The device's
    /// clock ([`VirtualMemory::now_ns`]) is this plus what those calls cost at
    /// [`CostModel::default`]'s figures, so a policy measures its own page work on it as it
    /// would on a GPU.
    pub fn set_time_us(&self, us: u64) {
        let mut s = self.state.lock();
        s.time_ns = s.time_ns.max(us.saturating_mul(1000));
    }

    /// What the driver calls cost on the device's clock (which the time budget of page moves
    /// runs on); the defaults until this is called.
    pub fn set_cost(&self, cost: CostModel) {
        self.state.lock().cost = cost;
    }

    /// Another process takes (or, with a smaller figure, gives back) memory on the device:
    /// `bytes` in all from now on. It shows in the free memory and limits what this process
    /// can allocate, as on a shared GPU.
    pub fn set_external_usage(&self, bytes: u64) {
        self.state.lock().external = bytes;
    }

    /// Free memory as `mem_info` reports it (other processes counted).
    pub fn mem_info_free(&self) -> u64 {
        let s = self.state.lock();
        self.capacity.saturating_sub(s.used + s.external)
    }

    /// What the device was asked to do so far.
    pub fn counters(&self) -> SimCounters {
        let s = self.state.lock();
        SimCounters {
            used: s.used,
            allocs: s.allocs,
            frees: s.frees,
            stream_waits: s.stream_waits,
            event_queries: s.event_queries,
            pending_events: s.pending.len(),
            syncs: s.syncs,
            maps: s.maps,
            unmaps: s.unmaps,
            mapped_bytes: s.pages.live_pages() as u64 * s.pages.page(),
            settle_waits: s.driver.waits,
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl Resource for SimulatedDevice {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        if !align.is_power_of_two() || align as u64 > SIM_GRANULARITY {
            return Err(Error::InvalidAlignment {
                align,
                max: SIM_GRANULARITY as usize,
            });
        }
        let bytes = bytes as u64;
        let mut s = self.state.lock();
        if (s.used + s.external)
            .checked_add(bytes)
            .is_none_or(|u| u > self.capacity)
        {
            return Err(Error::ResourceExhausted {
                resource: "simulated".into(),
                bytes,
            });
        }
        let addr = s.next_addr;
        s.next_addr += bytes.div_ceil(SIM_GRANULARITY) * SIM_GRANULARITY;
        s.used += bytes;
        s.allocs += 1;
        s.live.insert(addr, bytes);
        Ok(addr)
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, _stream: Stream) -> Result<()> {
        let mut s = self.state.lock();
        match s.live.get(&ptr).copied() {
            Some(size) if size == bytes as u64 => {
                s.live.remove(&ptr);
                s.used -= size;
                s.frees += 1;
                Ok(())
            }
            Some(size) => Err(Error::InvalidArgument(format!(
                "simulated deallocate of {ptr:#x} with {bytes} bytes, allocated with {size}"
            ))),
            None => Err(Error::UnknownPointer { ptr }),
        }
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let s = self.state.lock();
        Ok(MemInfo {
            free: self.capacity.saturating_sub(s.used + s.external),
            total: self.capacity,
        })
    }

    fn name(&self) -> &str {
        "simulated"
    }

    fn location(&self) -> Location {
        Location::Simulated
    }

    fn virtual_memory(&self) -> Option<&dyn VirtualMemory> {
        self.vmm.then_some(self as &dyn VirtualMemory)
    }
}

impl VirtualMemory for SimulatedDevice {
    fn page_size(&self) -> u64 {
        self.page
    }

    fn reserve_address(&self, bytes: u64) -> Result<DevPtr> {
        if !self.vmm {
            return Err(crate::resource::unsupported(
                self.name(),
                "virtual-memory segments",
            ));
        }
        if bytes == 0 || bytes % self.page != 0 {
            return Err(Error::InvalidArgument(format!(
                "simulated reserve_address of {bytes} bytes: not a positive multiple of the page"
            )));
        }
        let mut s = self.state.lock();
        let addr = s.next_va;
        s.next_va += bytes + self.page; // a guard page between ranges
        s.ranges.insert(addr, bytes);
        Ok(addr)
    }

    fn release_address(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let mut s = self.state.lock();
        match s.ranges.get(&addr) {
            Some(&b) if b == bytes => {}
            _ => return Err(Error::UnknownPointer { ptr: addr }),
        }
        if let Some(page) = s.pages.live_in(addr, bytes) {
            return Err(Error::InvalidArgument(format!(
                "simulated release_address of {addr:#x}: page {page:#x} still mapped"
            )));
        }
        let evict = s.pages.take_lingering_in(addr, bytes);
        s.evict(&evict, false);
        s.pages.unmapped_evictions(&evict);
        s.ranges.remove(&addr);
        Ok(())
    }

    fn map(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.map_for(addr, bytes, None)
    }

    fn map_on(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        self.map_for(addr, bytes, Some(stream.0))
    }

    /// As a CUDA engine's worker maps ahead: done at once (the simulated GPU sees nothing
    /// until the pool hands the pages out), its calls counted off the allocating thread.
    fn map_ahead(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        self.map_calls(addr, bytes, Some(stream.0), true)
    }

    fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        self.state.lock().pages.unit_at(addr)
    }

    fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let mut s = self.state.lock();
        check_pages(&s, addr, bytes, true)?;
        let (_, excess) = s.pages.detach(addr, bytes, None, None)?;
        s.release(excess);
        s.unmaps += 1;
        Ok(())
    }

    fn unmap_after(&self, addr: DevPtr, bytes: u64, stream: Stream, busy: bool) -> Result<()> {
        let mut s = self.state.lock();
        check_pages(&s, addr, bytes, true)?;
        // a move in stream order records an event; it completes when the lagging GPU passes
        let shared = match s.move_event {
            Some((st, ev, at)) if busy && st == stream.0 && s.moves.contains_key(&ev) => {
                // one move's unmaps share its event; a later move that shared it would count
                // its pages idle once the GPU passes the old event, before the work queued
                // since (the pool ends each move with `finish_move`)
                debug_assert_eq!(
                    at, s.clock,
                    "a move shared the event of an earlier one (a move not finished)"
                );
                Some(ev)
            }
            _ => None,
        };
        let event = match (s.lag, busy) {
            (Some(_), true) if shared.is_some() => shared,
            (Some(lag), true) => {
                s.next_move_event += 1;
                let ev = s.next_move_event;
                let due = s.clock.saturating_add(lag.max(1));
                s.moves.insert(ev, (stream.0, due));
                s.moves_due = if s.moves.len() == 1 {
                    due
                } else {
                    s.moves_due.min(due)
                };
                s.driver.foreground += 1;
                s.driver.records += 1;
                Some(ev)
            }
            _ => None,
        };
        let (n, excess) = s.pages.detach(addr, bytes, Some(stream.0), event)?;
        if let (Some(ev), true) = (event, n > 0) {
            s.move_event = Some((stream.0, ev, s.clock));
        }
        s.release(excess);
        s.pages.take_idle_events();
        s.unmaps += 1;
        Ok(())
    }

    fn finish_move(&self, stream: Stream) {
        let mut s = self.state.lock();
        s.move_event = None;
        let excess = s.pages.finish_move(stream.0);
        s.release(excess);
    }

    fn trim(&self) {
        let mut s = self.state.lock();
        // emptying the cache waits for the moves' work, as the CUDA engine does
        let pending = s.pages.pending_moves().len() as u64;
        s.driver.waits += pending;
        s.settle_moves(true);
        let spares = s.pages.take_spares();
        s.release(spares);
    }

    fn now_ns(&self) -> u64 {
        let s = self.state.lock();
        s.time_ns + (s.cost.vmm_foreground_us(&s.driver) * 1000.0) as u64
    }

    fn calls(&self) -> VmmCalls {
        let s = self.state.lock();
        VmmCalls {
            spare_bytes: s.pages.idle_pages() * s.pages.page(),
            ..s.driver
        }
    }
}

impl SimulatedDevice {
    fn map_for(&self, addr: DevPtr, bytes: u64, stream: Option<u64>) -> Result<()> {
        self.map_calls(addr, bytes, stream, false)
    }

    /// A map, its calls made on the allocating thread or (`ahead`) off it.
    fn map_calls(&self, addr: DevPtr, bytes: u64, stream: Option<u64>, ahead: bool) -> Result<()> {
        let mut s = self.state.lock();
        check_pages(&s, addr, bytes, false)?;
        s.settle_moves(false);
        let plan = s.pages.plan_map(addr, bytes, stream)?;
        s.evict(&plan.evict, !ahead);
        s.pages.evicted(&plan);
        let new = plan.fresh.iter().filter(|f| f.2.is_none()).count() as u64;
        let new_pages = plan.created_pages();
        let room = self.capacity.saturating_sub(s.used + s.external) / s.pages.page();
        if new_pages > room {
            // as a CUDA engine does: the handles that fit are made, in order, until one does
            // not; what was mapped is unmapped again and the handles made stay (spare)
            let (mut made, mut left) = (Vec::new(), room);
            for f in plan.fresh.iter().filter(|f| f.2.is_none()) {
                if f.1 > left {
                    break;
                }
                left -= f.1;
                s.next_handle += 1;
                made.push((s.next_handle, f.1));
            }
            let pages: u64 = made.iter().map(|m| m.1).sum();
            s.driver.creates += made.len() as u64;
            if ahead {
                s.driver.creates_background += made.len() as u64;
                s.driver.background += made.len() as u64;
            } else {
                s.driver.foreground += made.len() as u64;
            }
            s.handles += made.len() as u64;
            s.used += pages * s.pages.page();
            let ids: Vec<u64> = made.iter().map(|m| m.0).collect();
            s.pages.abandon(plan, &ids);
            return Err(Error::ResourceExhausted {
                resource: "simulated".into(),
                bytes,
            });
        }
        let created: Vec<u64> = (0..new)
            .map(|_| {
                s.next_handle += 1;
                s.next_handle
            })
            .collect();
        s.record_map(&plan, new, ahead);
        let excess = s.pages.commit(plan, &created);
        s.handles += new;
        s.used += new_pages * s.pages.page();
        s.release(excess);
        s.maps += 1;
        Ok(())
    }
}

impl SimState {
    /// Count the calls of a planned map: a create per new handle, a map per fresh mapping, a
    /// set-access per run of adjacent fresh mappings.
    fn record_map(&mut self, plan: &MapPlan, created: u64, ahead: bool) {
        let fresh = plan.fresh.len() as u64;
        let runs =
            page_map::runs(plan.fresh.iter().map(|f| (f.0, f.1)), self.pages.page()).len() as u64;
        let d = &mut self.driver;
        d.creates += created;
        d.maps += fresh;
        d.set_access += runs;
        d.reused += plan.reused.len() as u64;
        if ahead {
            d.creates_background += created;
            d.maps_background += fresh;
            d.set_access_background += runs;
            d.background += created + fresh + runs;
        } else {
            d.foreground += created + fresh + runs;
        }
    }

    /// Unmap lingering pages (on the allocating thread: `foreground`), waiting for the events
    /// of those whose old work the lagging GPU has not passed.
    fn evict(&mut self, pages: &[Evict], foreground: bool) {
        for e in pages {
            let Some(&(_, due)) = e.event.and_then(|ev| self.moves.get(&ev)) else {
                continue;
            };
            if due > self.clock {
                self.driver.waits += 1;
                // the host waited for the GPU to pass that event, and so everything before it
                for m in self.moves.values_mut() {
                    if m.1 <= due {
                        m.1 = 0;
                    }
                }
                self.moves_due = 0;
                self.pending.retain(|_, d| *d > due);
            }
        }
        let n = pages.len() as u64;
        self.driver.unmaps += n;
        if foreground {
            self.driver.foreground += n;
        } else {
            self.driver.background += n;
            self.driver.unmaps_background += n;
        }
    }

    /// Release handles beyond the spare cap (their lingering pages unmapped first), as the
    /// CUDA engine's worker does, off the allocating thread.
    fn release(&mut self, releases: Vec<Release>) {
        if releases.is_empty() {
            return;
        }
        for r in &releases {
            self.evict(&r.unmap, false);
        }
        let n = releases.len() as u64;
        let pages: u64 = releases.iter().map(|r| r.pages).sum();
        self.pages.released(&releases);
        self.pages.take_idle_events();
        self.driver.releases += n;
        self.driver.background += n;
        self.handles -= n;
        self.used -= pages * self.pages.page();
    }

    /// Handles kept for a stream whose move event the GPU has passed become spare (the CUDA
    /// engine's worker does this once the event completes); with `all`, every one (the host
    /// waited for the device).
    fn settle_moves(&mut self, all: bool) {
        let now = self.clock;
        if self.moves.is_empty() || (!all && self.moves_due > now) {
            return;
        }
        let mut done: Vec<(usize, u64)> = Vec::new();
        self.moves.retain(|&ev, &mut (stream, due)| {
            let settled = all || due <= now;
            if settled {
                done.push((ev, stream));
            }
            !settled
        });
        self.moves_due = self.moves.values().map(|m| m.1).min().unwrap_or(u64::MAX);
        done.sort_unstable();
        for (ev, stream) in done {
            self.pages.settle_kept(stream, Some(ev));
        }
        self.pages.take_idle_events();
    }
}

/// Check that `[addr, addr + bytes)` is whole pages of one reserved range, all mapped
/// (`mapped`) or all unmapped.
fn check_pages(s: &SimState, addr: DevPtr, bytes: u64, mapped: bool) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "simulated {} of {addr:#x}+{bytes}: {why}",
            if mapped { "unmap" } else { "map" }
        )))
    };
    if bytes == 0 || addr % s.pages.page() != 0 || bytes % s.pages.page() != 0 {
        return bad("not whole pages");
    }
    let inside = s
        .ranges
        .iter()
        .any(|(&base, &len)| addr >= base && addr + bytes <= base + len);
    if !inside {
        return bad("outside reserved address space");
    }
    let mut page = addr;
    while page < addr + bytes {
        if s.pages.handle_at(page).is_some() != mapped {
            return bad(if mapped {
                "a page is not mapped"
            } else {
                "a page is already mapped"
            });
        }
        page += s.pages.page();
    }
    Ok(())
}

impl StreamOps for SimulatedDevice {
    fn record_event(&self, _stream: Stream) -> Result<Event> {
        let mut s = self.state.lock();
        s.next_event += 1;
        let id = s.next_event;
        if !s.auto_complete {
            let due = match s.lag {
                Some(lag) => s.clock.saturating_add(lag.max(1)),
                None => u64::MAX,
            };
            s.pending.insert(id, due);
        }
        Ok(Event(id))
    }
    fn event_done(&self, event: Event) -> Result<bool> {
        let mut s = self.state.lock();
        s.event_queries += 1;
        Ok(!s.pending.contains_key(&event.0))
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        self.state.lock().pending.remove(&event.0);
        Ok(())
    }
    fn wait_event(&self, _stream: Stream, _event: Event) -> Result<()> {
        self.state.lock().stream_waits += 1;
        Ok(())
    }
    fn destroy_event(&self, _event: Event) {}
    fn is_capturing(&self, stream: Stream) -> bool {
        self.state.lock().capture_frontiers.contains_key(&stream.0)
    }
    fn capture_frontier(&self, stream: Stream) -> Option<Vec<u64>> {
        self.state.lock().capture_frontiers.get(&stream.0).cloned()
    }
    fn capture_follows(&self, stream: Stream, nodes: &[u64]) -> bool {
        let s = self.state.lock();
        let Some(frontier) = s.capture_frontiers.get(&stream.0) else {
            return false;
        };
        let mut want: Vec<u64> = nodes.to_vec();
        let mut seen = std::collections::HashSet::new();
        let mut stack = frontier.clone();
        while let Some(n) = stack.pop() {
            if !seen.insert(n) {
                continue;
            }
            want.retain(|&w| w != n);
            if let Some(deps) = s.capture_nodes.get(n as usize - 1) {
                stack.extend(deps);
            }
        }
        want.is_empty()
    }
    fn create_stream(&self) -> Result<Stream> {
        Ok(Stream(next_stream_id()))
    }
    fn destroy_stream(&self, _stream: Stream) {}
    fn synchronize(&self, _stream: Stream) -> Result<()> {
        self.synchronize_device()
    }
    fn synchronize_device(&self) -> Result<()> {
        let mut s = self.state.lock();
        s.syncs += 1;
        // a lagging GPU has caught up once the host waited for it
        if s.lag.is_some() {
            s.pending.clear();
            s.settle_moves(true);
        }
        Ok(())
    }
    unsafe fn copy(&self, _: DevPtr, _: DevPtr, _: usize, _: CopyKind, _: Stream) -> Result<()> {
        Err(Error::Unsupported {
            backend: "simulated".into(),
            what: "copies (a simulated device has no bytes)".into(),
        })
    }
    unsafe fn memset(&self, _: DevPtr, _: u8, _: usize, _: Stream) -> Result<()> {
        Err(Error::Unsupported {
            backend: "simulated".into(),
            what: "memset (a simulated device has no bytes)".into(),
        })
    }
}
