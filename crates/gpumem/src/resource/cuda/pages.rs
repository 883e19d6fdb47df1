//! Virtual-memory pages of one device, cheap to move (see `shared/notes/vmm-costs.md`: on the
//! H100 a map costs 1 µs, a set-access ~20–60 µs and an unmap ~15–45 µs per mapping they
//! cover, whether one call covers one mapping or several (`scripts/probes/vmm_gpu_cost.cu`,
//! 2026-11-27: 10 handles of 2 MiB in one call each, 217 and 147 µs with the GPU idle, 334
//! and 358 µs busy; one handle of 20 MiB, 21 and 14 µs, 62 and 51 µs), a create or release
//! 13–50 µs).
//!
//! The bookkeeping is [`PageMap`]'s (pure, shared with the simulator): an unmapped page is
//! not unmapped at once. Its address keeps its handle mapped ("lingers") and the handle goes
//! where the next map takes it: kept for the stream that moved it (in stream order: its next
//! work runs after the old work, as for any block a caching allocator hands out again; a
//! handle may be mapped at two addresses), or spare once the old work is done. A map at an
//! address whose own handle still lingers there and is free to take costs no driver call, so
//! pages moved back and forth between the same addresses (a training step's phases) move for
//! free after the first time. Otherwise:
//!
//! - physical handles are kept: a map takes a kept or spare handle before creating one;
//!   spares beyond a small cap are released off the allocating thread (their lingering
//!   addresses unmapped first);
//! - access is set once per newly mapped run of pages, not per page;
//! - a lingering address is unmapped only when a map needs it for another handle (after the
//!   event of its old work, if that has not completed) or when its range is given back;
//! - the worker thread waits for the events of moves in stream order, after which the handles
//!   they left are spare, and releases handles beyond the cap;
//! - it also makes maps asked for ahead of need ([`Pages::map_ahead`]: a planned region's
//!   pages mapped again after a give-back's split), after the releases queued before them;
//!   their pages are planned at once, a call over them waits until they are made, and the
//!   caller hands none out before [`Pages::wait_mapped`].
//!
//! Pages are created with the POSIX file-descriptor handle type where the device supports it
//! (exportable: what IPC and NCCL registration need; it costs the same as no handle type), at
//! the device's recommended granularity.

use super::*;
use crate::resource::page_map::{runs, Evict, MapPlan, PageMap, Release};
use crate::resource::VmmCalls;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

type Handle = sys::CUmemGenericAllocationHandle;

/// Work for the page worker.
#[derive(Debug)]
enum Job {
    /// handles beyond the spare cap: unmap their lingering addresses, then release them
    Release(Vec<Release>),
    /// a move in stream order: once `event` has completed, what `stream` kept is spare
    Settle { stream: u64, event: usize },
    /// a map made ahead of need ([`Pages::map_ahead`]): `plan`'s calls for `[addr, addr +
    /// bytes)`, whose pages the state lists as `ahead` until they are made
    Ahead {
        addr: DevPtr,
        bytes: u64,
        plan: MapPlan,
        peers: Vec<usize>,
    },
}

#[derive(Debug, Default)]
struct State {
    map: PageMap,
    /// jobs for the worker
    queued: Vec<Job>,
    /// the worker is doing jobs now
    working: bool,
    /// idle events (as addresses), for moves in stream order
    events: Vec<usize>,
    /// the event of the move in progress (stream, event, the moving thread): a move's later
    /// unmaps in stream order share it (nothing is queued on the stream in between by that
    /// thread; another thread's move records its own)
    move_event: Option<(u64, usize, std::thread::ThreadId)>,
    /// the worker should stop
    stop: bool,
    /// the worker thread could not be started: jobs run inline
    no_worker: bool,
    /// pages of maps made ahead that the worker has not made yet: a call over them waits
    ahead: rustc_hash::FxHashSet<DevPtr>,
    /// maps made ahead that failed, `(first page, bytes, why)`, until `wait_mapped` asks
    ahead_failed: Vec<(DevPtr, u64, Error)>,
}

impl Job {
    /// Where a job runs in a batch: releases first (a map made ahead may go where one
    /// lingers), settles last (a settle may wait for a long kernel).
    fn order(&self) -> u8 {
        match self {
            Job::Release(_) => 0,
            Job::Ahead { .. } => 1,
            Job::Settle { .. } => 2,
        }
    }
}

impl State {
    /// Whether any page of `[addr, addr + bytes)` is being mapped ahead.
    fn ahead_in(&self, addr: DevPtr, bytes: u64) -> bool {
        !self.ahead.is_empty()
            && (0..bytes / self.map.page())
                .any(|i| self.ahead.contains(&(addr + i * self.map.page())))
    }
}

#[derive(Debug, Default)]
struct Counters {
    creates: AtomicU64,
    maps: AtomicU64,
    set_access: AtomicU64,
    /// of those three, the calls of maps made ahead (on the worker)
    creates_bg: AtomicU64,
    maps_bg: AtomicU64,
    access_bg: AtomicU64,
    unmaps_fg: AtomicU64,
    unmaps_bg: AtomicU64,
    releases_fg: AtomicU64,
    releases_bg: AtomicU64,
    waits: AtomicU64,
    aliased: AtomicU64,
    reused: AtomicU64,
    records: AtomicU64,
    wait_ns: AtomicU64,
    unmap_ns: AtomicU64,
    map_ns: AtomicU64,
    access_ns: AtomicU64,
}

/// The page engine of one device.
#[derive(Debug)]
pub(super) struct Pages {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    page: u64,
    prop: PropHolder,
    state: Mutex<State>,
    /// wakes the worker
    wake: Condvar,
    /// signalled when the worker finished a job
    done: Condvar,
    counters: Counters,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// `CUmemAllocationProp` holds no pointers we own; it is plain data.
#[derive(Debug, Clone, Copy)]
struct PropHolder(sys::CUmemAllocationProp);
// SAFETY: the struct is plain data (the one pointer field, win32 metadata, is null).
unsafe impl Send for PropHolder {}
// SAFETY: as above; it is only read.
unsafe impl Sync for PropHolder {}

fn prop(ordinal: usize, handle_type: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is the documented default; fields set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = handle_type;
    prop.location = device_location(ordinal);
    prop
}

/// The page size and handle type of device `ordinal`'s virtual memory, or `None` where it has
/// none: the recommended granularity, exportable (POSIX file descriptor) handles where
/// supported.
pub(super) fn probe(ordinal: usize) -> Option<(u64, sys::CUmemAllocationHandleType)> {
    use sys::CUdevice_attribute as A;
    // SAFETY: attribute queries on a valid ordinal (checked by `primary_context`).
    let attr = |a| unsafe {
        let dev = result::device::get(ordinal as i32).ok()?;
        result::device::get_attribute(dev, a).ok()
    };
    if attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
        return None;
    }
    let fd =
        attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).unwrap_or(0) != 0;
    let handle_type = if fd {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    let p = prop(ordinal, handle_type);
    let mut gran = 0usize;
    // SAFETY: `p` is initialised and `gran` is a valid out-pointer.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .result()
    .ok()?;
    (gran > 0 && gran.is_power_of_two()).then_some((gran as u64, handle_type))
}

impl Pages {
    pub(super) fn new(
        ctx: Arc<CudaContext>,
        ordinal: usize,
        page: u64,
        handle_type: sys::CUmemAllocationHandleType,
    ) -> Arc<Self> {
        let pages = Arc::new(Self {
            ctx,
            ordinal,
            page,
            prop: PropHolder(prop(ordinal, handle_type)),
            state: Mutex::new(State {
                map: PageMap::new(page),
                ..State::default()
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            counters: Counters::default(),
            worker: Mutex::new(None),
        });
        let weak = Arc::downgrade(&pages);
        let spawned = std::thread::Builder::new()
            .name(format!("gpumem-pages-{ordinal}"))
            .spawn(move || worker(weak));
        match spawned {
            Ok(h) => *pages.worker.lock() = Some(h),
            Err(e) => {
                tracing::warn!("gpumem: no page worker ({e}): pages are released inline");
                pages.state.lock().no_worker = true;
            }
        }
        pages
    }

    pub(super) fn page(&self) -> u64 {
        self.page
    }

    /// Where the handle mapped at live page `addr` lies (see [`PageMap::unit_at`]).
    pub(super) fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        self.state.lock().map.unit_at(addr)
    }

    /// Every address that maps a handle, in use or lingering (for granting a peer access).
    pub(super) fn mapped_pages(&self) -> Vec<DevPtr> {
        self.state.lock().map.mapped_addresses()
    }

    pub(super) fn calls(&self) -> VmmCalls {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let idle = self.state.lock().map.idle_pages();
        VmmCalls {
            foreground: get(&c.creates)
                + get(&c.maps)
                + get(&c.set_access)
                + get(&c.unmaps_fg)
                + get(&c.releases_fg)
                + get(&c.records),
            background: get(&c.unmaps_bg)
                + get(&c.releases_bg)
                + get(&c.creates_bg)
                + get(&c.maps_bg)
                + get(&c.access_bg),
            creates: get(&c.creates) + get(&c.creates_bg),
            creates_background: get(&c.creates_bg),
            maps: get(&c.maps) + get(&c.maps_bg),
            maps_background: get(&c.maps_bg),
            set_access: get(&c.set_access) + get(&c.access_bg),
            set_access_background: get(&c.access_bg),
            unmaps: get(&c.unmaps_fg) + get(&c.unmaps_bg),
            unmaps_background: get(&c.unmaps_bg),
            releases: get(&c.releases_fg) + get(&c.releases_bg),
            waits: get(&c.waits),
            aliased: get(&c.aliased),
            spare_bytes: idle * self.page,
            reused: get(&c.reused),
            records: get(&c.records),
            wait_ns: get(&c.wait_ns),
            unmap_ns: get(&c.unmap_ns),
            map_ns: get(&c.map_ns),
            access_ns: get(&c.access_ns),
        }
    }

    /// Map `[addr, addr + bytes)` (page-aligned, not in use) for work on `stream`: pages whose
    /// own handle still lingers there and may be taken are in use again with no call; the rest
    /// get a handle that stream's moves left, a spare or a new one (after unmapping whatever
    /// lingers there), and access is set once per run of them (this device and `peers`).
    /// All or nothing.
    pub(super) fn map(
        &self,
        addr: DevPtr,
        bytes: u64,
        peers: &[usize],
        stream: Option<Stream>,
    ) -> Result<()> {
        let t = Instant::now();
        let plan = {
            let mut st = self.state.lock();
            // pages the worker is unmapping now (released handles) or mapping ahead must be
            // done first
            self.wait_for_worker(&mut st, addr, bytes);
            st.map.plan_map(addr, bytes, stream.map(|s| s.0))?
        };
        self.counters
            .wait_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.make(plan, peers, false)
    }

    /// Map `[addr, addr + bytes)` (page-aligned, not in use) for work on `stream` as
    /// [`Pages::map`] does, on the worker: the pages are planned now (a later call over any of
    /// them waits until the worker has made them) and the caller counts them as mapped, but
    /// no work may touch them before [`Pages::wait_mapped`] over them has returned. Inline
    /// where there is no worker.
    pub(super) fn map_ahead(
        &self,
        addr: DevPtr,
        bytes: u64,
        peers: &[usize],
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state.lock();
        if st.no_worker {
            drop(st);
            return self.map(addr, bytes, peers, Some(stream));
        }
        // (pages being unmapped there, by a release the worker has queued or is making, are
        // gone before this job runs: the worker runs releases first, in order)
        self.wait_ahead(&mut st, addr, bytes);
        let plan = st.map.plan_map(addr, bytes, Some(stream.0))?;
        st.ahead
            .extend((0..bytes / self.page).map(|i| addr + i * self.page));
        let job = Job::Ahead {
            addr,
            bytes,
            plan,
            peers: peers.to_vec(),
        };
        self.enqueue(st, job);
        Ok(())
    }

    /// Wait until the maps made ahead over `[addr, addr + bytes)` (as [`Pages::map_ahead`]
    /// was given it) are made; where one failed, it is tried again here, and its error
    /// returned if it fails again (the range is then not mapped).
    pub(super) fn wait_mapped(
        &self,
        addr: DevPtr,
        bytes: u64,
        peers: &[usize],
        stream: Stream,
    ) -> Result<()> {
        let t = Instant::now();
        let failed = {
            let mut st = self.state.lock();
            if self.wait_ahead(&mut st, addr, bytes) {
                self.counters
                    .wait_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            let k = st
                .ahead_failed
                .iter()
                .position(|f| f.0 < addr + bytes && addr < f.0 + f.1);
            k.map(|k| st.ahead_failed.swap_remove(k))
        };
        match failed {
            None => Ok(()),
            Some((a, b, e)) => {
                tracing::warn!("gpumem: a map made ahead failed ({e}): mapping it now");
                self.map(a, b, peers, Some(stream))
            }
        }
    }

    /// Every map made ahead is made (before a peer is granted access to the pages mapped).
    pub(super) fn wait_all_ahead(&self) {
        let mut st = self.state.lock();
        while !st.ahead.is_empty() {
            self.done.wait(&mut st);
        }
    }

    /// Wait (the lock held between waits) until no page of `[addr, addr + bytes)` is being
    /// unmapped or mapped ahead by the worker.
    fn wait_for_worker(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        addr: DevPtr,
        bytes: u64,
    ) {
        self.wait_while(st, |st| {
            st.map.unmapping_in(addr, bytes) || st.ahead_in(addr, bytes)
        });
    }

    /// Wait (the lock held between waits) until no page of `[addr, addr + bytes)` is being
    /// mapped ahead by the worker; whether it waited.
    fn wait_ahead(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        addr: DevPtr,
        bytes: u64,
    ) -> bool {
        self.wait_while(st, |st| st.ahead_in(addr, bytes))
    }

    /// Wait for the worker while `busy` holds, each wait counted; whether it waited.
    fn wait_while(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        busy: impl Fn(&State) -> bool,
    ) -> bool {
        let mut waited = false;
        while busy(st) {
            self.counters.waits.fetch_add(1, Ordering::Relaxed);
            self.done.wait(st);
            waited = true;
        }
        waited
    }

    /// Make the calls of `plan` (this device and `peers` given access), on the worker
    /// (`background`) or the caller's thread, then commit it; all or nothing.
    fn make(&self, plan: MapPlan, peers: &[usize], background: bool) -> Result<()> {
        let page = self.page;
        let c = &self.counters;
        let (creates, maps) = if background {
            (&c.creates_bg, &c.maps_bg)
        } else {
            (&c.creates, &c.maps)
        };
        let mut t = Instant::now();
        // time since `t`, added to `counter` (on the caller's thread only); `t` restarts
        let mut lap = |counter: &AtomicU64| {
            let now = Instant::now();
            if !background {
                counter.fetch_add(now.duration_since(t).as_nanos() as u64, Ordering::Relaxed);
            }
            t = now;
        };
        self.counters
            .reused
            .fetch_add(plan.reused.len() as u64, Ordering::Relaxed);
        self.counters.aliased.fetch_add(
            plan.fresh.iter().filter(|f| f.2.is_some()).count() as u64,
            Ordering::Relaxed,
        );
        if !plan.evict.is_empty() {
            self.unmap_pages(&plan.evict, background);
            let mut st = self.state.lock();
            st.map.evicted(&plan);
            self.recycle_events(&mut st);
            drop(st);
            lap(&c.unmap_ns);
        }
        let mut created = Vec::new();
        let mut mapped: Vec<(DevPtr, u64)> = Vec::with_capacity(plan.fresh.len());
        let mut failed = None;
        for &(p, n, h) in &plan.fresh {
            let size = (n * page) as usize;
            let h = match h {
                Some(h) => h,
                None => {
                    let mut h: Handle = 0;
                    // SAFETY: `prop` is initialised; `h` is a valid out-pointer; `size` is a
                    // multiple of the granularity.
                    let r = unsafe { sys::cuMemCreate(&mut h, size, &self.prop.0, 0) };
                    creates.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = r.result() {
                        failed = Some(alloc_err("cuMemCreate", size, "cuMemCreate", e));
                        break;
                    }
                    created.push(h);
                    h
                }
            };
            // SAFETY: `[p, p + size)` is reserved address space with nothing mapped (the plan
            // unmapped what lingered there) and `h` a handle of exactly `size` bytes that no
            // live page uses (it may linger at other addresses: a handle may be mapped at
            // several), mapped whole, at offset 0.
            let r = unsafe { sys::cuMemMap(p, size, 0, h, 0) };
            maps.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = r.result() {
                failed = Some(cuda_err("cuMemMap", e));
                break;
            }
            mapped.push((p, n));
        }
        lap(&c.map_ns);
        if failed.is_none() {
            for (start, n) in runs(mapped.iter().copied(), page) {
                if let Err(e) = self.access(start, n * page, peers, background) {
                    failed = Some(e);
                    break;
                }
            }
            lap(&c.access_ns);
        }
        if let Some(e) = failed {
            // all or nothing: unmap what this call mapped (access may not be set there);
            // handles go back where they came from
            let unmaps = if background {
                &c.unmaps_bg
            } else {
                &c.unmaps_fg
            };
            for &(p, n) in &mapped {
                // SAFETY: mapped just now by this call and unused.
                let _ = unsafe { sys::cuMemUnmap(p, (n * page) as usize) };
                unmaps.fetch_add(1, Ordering::Relaxed);
            }
            self.state.lock().map.abandon(plan, &created);
            return Err(e);
        }
        let excess = self.state.lock().map.commit(plan, &created);
        self.release_later(excess);
        Ok(())
    }

    /// Export the physical handles mapped over `[addr, addr + bytes)` (page-aligned) as POSIX
    /// file descriptors, whole, for another process to import: the first handle's address,
    /// and per handle its descriptor and pages.
    pub(super) fn export(
        &self,
        addr: DevPtr,
        bytes: u64,
    ) -> Result<(DevPtr, Vec<(std::os::fd::OwnedFd, u64)>)> {
        use std::os::fd::FromRawFd;
        if self.prop.0.requestedHandleTypes
            != sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        {
            return Err(Error::Unsupported {
                backend: "cuMemCreate".into(),
                what: "exporting pages (the device has no POSIX file-descriptor handles)".into(),
            });
        }
        if addr % self.page != 0 || bytes % self.page != 0 || bytes == 0 {
            return Err(Error::InvalidAlignment {
                align: self.page as usize,
                max: self.page as usize,
            });
        }
        let mut st = self.state.lock();
        self.wait_ahead(&mut st, addr, bytes);
        let mut fds = Vec::new();
        let mut first = None;
        let mut p = addr;
        while p < addr + bytes {
            let (h, base, n) = st.map.mapping_at(p).ok_or_else(|| {
                Error::InvalidArgument(format!("page {p:#x} is not mapped: nothing to export"))
            })?;
            first.get_or_insert(base);
            let mut fd: i32 = -1;
            // SAFETY: `h` is a live handle of this engine (mapped under the lock); `fd` is a
            // valid out-parameter for a POSIX descriptor.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut i32).cast(),
                    h,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            }
            .result()
            .map_err(|e| cuda_err("cuMemExportToShareableHandle", e))?;
            // SAFETY: the driver just opened `fd` for us; we own it from here.
            fds.push((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, n));
            p = base + n * self.page;
        }
        Ok((first.unwrap_or(addr), fds))
    }

    /// Read-write access to `[addr, addr + bytes)` (mapped) for this device and `peers`.
    pub(super) fn set_access(&self, addr: DevPtr, bytes: u64, peers: &[usize]) -> Result<()> {
        self.access(addr, bytes, peers, false)
    }

    /// [`Pages::set_access`], counted as the worker's call where `background`.
    fn access(&self, addr: DevPtr, bytes: u64, peers: &[usize], background: bool) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(peers.iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: device_location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        let c = &self.counters;
        let counter = if background {
            &c.access_bg
        } else {
            &c.set_access
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the range is mapped (callers' contract); `descs` holds `len` descriptors.
        unsafe { sys::cuMemSetAccess(addr, bytes as usize, descs.as_ptr(), descs.len()) }
            .result()
            .map_err(|e| cuda_err("cuMemSetAccess", e))
    }

    /// Take the pages of `[addr, addr + bytes)` out of use; no queued work touches them (the
    /// caller's contract). No driver call: the addresses linger, the handles are spare.
    pub(super) fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let excess = {
            let mut st = self.state.lock();
            self.wait_ahead(&mut st, addr, bytes);
            st.map.detach(addr, bytes, None, None)?.1
        };
        self.release_later(excess);
        Ok(())
    }

    /// Move the pages of `[addr, addr + bytes)` to `stream`: their handles are free at once
    /// for `stream`'s next map, and their addresses linger. With `busy`, only work on `stream`
    /// has used the pages and some may still be queued: the handles stay `stream`'s until an
    /// event recorded on it now has completed (the worker watches it), and the addresses are
    /// unmapped (if they ever need to be) only after it. Without, the pages are idle.
    pub(super) fn unmap_after(
        &self,
        addr: DevPtr,
        bytes: u64,
        stream: Stream,
        busy: bool,
    ) -> Result<()> {
        let mut st = self.state.lock();
        self.wait_ahead(&mut st, addr, bytes);
        let me = std::thread::current().id();
        let shared = match st.move_event {
            Some((s, ev, t)) if busy && s == stream.0 && t == me && st.map.holds(ev) => Some(ev),
            _ => None,
        };
        let ev = match (busy, shared) {
            (true, None) => Some(self.record_event(&mut st, stream.0)?),
            _ => shared,
        };
        let (n, excess) = match st.map.detach(addr, bytes, Some(stream.0), ev) {
            Ok(r) => r,
            Err(e) => {
                if let (Some(ev), None) = (ev, shared) {
                    // recorded for nothing: back to the idle events
                    st.events.push(ev);
                }
                return Err(e);
            }
        };
        if let (Some(event), true) = (ev, n > 0) {
            st.move_event = Some((stream.0, event, me));
        }
        self.recycle_events(&mut st);
        // idle pages' handles are spare once the move is finished (its maps take them first);
        // the worker watches each event once
        if let (Some(event), true, None) = (ev, n > 0, shared) {
            // the job holds the event: recycled and recorded again before the worker settles
            // it, it would settle a later move's handles and pages early
            st.map.hold_event(event);
            self.enqueue(
                st,
                Job::Settle {
                    stream: stream.0,
                    event,
                },
            );
        } else {
            drop(st);
        }
        self.release_later(excess);
        Ok(())
    }

    /// A move for `stream` is done: what it unmapped and did not map again is spare.
    pub(super) fn finish_move(&self, stream: Stream) {
        let excess = {
            let mut st = self.state.lock();
            st.move_event = None;
            st.map.finish_move(stream.0)
        };
        self.release_later(excess);
    }

    /// Run `job` on the worker, or here where there is none.
    fn enqueue(&self, mut st: parking_lot::MutexGuard<'_, State>, job: Job) {
        if st.no_worker {
            drop(st);
            self.run(job, false);
            return;
        }
        st.queued.push(job);
        self.wake.notify_one();
    }

    /// Release handles beyond the cap, on the worker.
    fn release_later(&self, excess: Vec<Release>) {
        if !excess.is_empty() {
            let st = self.state.lock();
            self.enqueue(st, Job::Release(excess));
        }
    }

    fn run(&self, job: Job, background: bool) {
        match job {
            Job::Release(rs) => self.release(rs, background),
            Job::Settle { stream, event } => {
                self.wait_event(event, background);
                let mut st = self.state.lock();
                st.map.settle_kept(stream, Some(event));
                st.map.release_event(event);
                self.recycle_events(&mut st);
            }
            Job::Ahead {
                addr,
                bytes,
                plan,
                peers,
            } => {
                let r = self.make(plan, &peers, background);
                let mut st = self.state.lock();
                for i in 0..bytes / self.page {
                    st.ahead.remove(&(addr + i * self.page));
                }
                if let Err(e) = r {
                    st.ahead_failed.push((addr, bytes, e));
                }
                drop(st);
                self.done.notify_all();
            }
        }
    }

    /// Unmap the lingering addresses of `rs` (after their events), then release the handles.
    fn release(&self, rs: Vec<Release>, background: bool) {
        for r in &rs {
            self.unmap_pages(&r.unmap, background);
        }
        let c = if background {
            &self.counters.releases_bg
        } else {
            &self.counters.releases_fg
        };
        for r in &rs {
            // SAFETY: the handle is no live page's, and every address it was mapped at has
            // just been unmapped: it is owned by us alone.
            let _ = unsafe { sys::cuMemRelease(r.handle) };
            c.fetch_add(1, Ordering::Relaxed);
        }
        let mut st = self.state.lock();
        st.map.released(&rs);
        self.recycle_events(&mut st);
        drop(st);
        self.done.notify_all();
    }

    /// Events the map no longer refers to go back to the idle list.
    fn recycle_events(&self, st: &mut State) {
        let idle = st.map.take_idle_events();
        st.events.extend(idle);
    }

    /// An event recorded now on `stream` (an idle one of ours, or a new one).
    fn record_event(&self, st: &mut State, stream: u64) -> Result<usize> {
        let ev = match st.events.pop() {
            Some(ev) => ev as sys::CUevent,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_err("cuEventCreate", e))?,
        };
        self.counters.records.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ev` is ours and idle; the stream is the caller's live stream.
        if let Err(e) = unsafe { result::event::record(ev, raw(Stream(stream))) } {
            st.events.push(ev as usize);
            return Err(cuda_err("cuEventRecord", e));
        }
        Ok(ev as usize)
    }

    /// Unmap lingering pages (each after its event, if it has one).
    fn unmap_pages(&self, pages: &[Evict], background: bool) {
        for e in pages {
            if let Some(ev) = e.event {
                self.wait_event(ev, background);
            }
        }
        let c = if background {
            &self.counters.unmaps_bg
        } else {
            &self.counters.unmaps_fg
        };
        c.fetch_add(pages.len() as u64, Ordering::Relaxed);
        let mut maps: Vec<(DevPtr, u64)> = pages.iter().map(|e| (e.addr, e.pages)).collect();
        maps.sort_unstable();
        for (start, n) in runs(maps.into_iter(), self.page) {
            // one call per run of adjacent mappings (unmapping is paid per mapping anyway)
            // SAFETY: the pages lingered (mapped, in no live block) and their old work is
            // complete (waited for above, or known idle); the map took them out under its lock
            // and marked them as being unmapped, so nothing maps there meanwhile.
            let r = unsafe { sys::cuMemUnmap(start, (n * self.page) as usize) };
            if let Err(e) = r.result() {
                tracing::warn!("gpumem: cuMemUnmap of {start:#x} failed: {e:?}");
            }
        }
    }

    /// Wait until event `ev` has completed: polled with short sleeps on the worker (no core
    /// spinning), synchronised elsewhere.
    fn wait_event(&self, ev: usize, background: bool) {
        let ev = ev as sys::CUevent;
        loop {
            // SAFETY: `ev` was recorded by `unmap_after` and is destroyed only by us.
            match unsafe { result::event::query(ev) } {
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {}
                _ => return,
            }
            if !background {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        self.counters.waits.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        if let Err(e) = unsafe { result::event::synchronize(ev) } {
            tracing::warn!("gpumem: waiting for pages' work failed: {e:?}");
        }
    }

    /// Before `[addr, addr + bytes)` is given back: unmap what lingers there and wait for the
    /// worker's unmapping of pages in it.
    pub(super) fn flush(&self, addr: DevPtr, bytes: u64) {
        let evict = {
            let mut st = self.state.lock();
            self.wait_ahead(&mut st, addr, bytes);
            // (a map made ahead there that failed is nobody's to report any more)
            st.ahead_failed
                .retain(|f| f.0 + f.1 <= addr || addr + bytes <= f.0);
            st.map.take_lingering_in(addr, bytes)
        };
        if !evict.is_empty() {
            self.unmap_pages(&evict, false);
        }
        let mut st = self.state.lock();
        st.map.unmapped_evictions(&evict);
        self.recycle_events(&mut st);
        while st.map.unmapping_in(addr, bytes) {
            self.done.wait(&mut st);
        }
    }

    /// Release every spare handle (emptying the cache), their lingering addresses unmapped
    /// first, after waiting for the work of moves in stream order (whose handles are then
    /// spare too).
    pub(super) fn trim(&self) {
        // the worker's jobs first (releases it was given are memory to give back now), once
        // the batch it is on is done (a map made ahead runs after the releases before it)
        {
            let mut st = self.state.lock();
            loop {
                while st.working {
                    self.done.wait(&mut st);
                }
                let mut jobs = std::mem::take(&mut st.queued);
                if jobs.is_empty() {
                    break;
                }
                drop(st);
                jobs.sort_by_key(Job::order);
                for job in jobs {
                    self.run(job, false);
                }
                st = self.state.lock();
            }
        }
        // moves in stream order: wait for their work, then their handles are spare too
        let pending = self.state.lock().map.pending_moves();
        for (stream, ev) in pending {
            self.wait_event(ev, false);
            let mut st = self.state.lock();
            st.map.settle_kept(stream, Some(ev));
            self.recycle_events(&mut st);
        }
        let spares = self.state.lock().map.take_spares();
        if !spares.is_empty() {
            self.release(spares, false);
        }
    }

    /// Stop the worker, then unmap and release everything left (the device is going away).
    pub(super) fn shut_down(&self) {
        self.state.lock().stop = true;
        self.wake.notify_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // the work that used the pages must be done before they go
        // SAFETY: the context is current on this thread (bound above).
        let _ = unsafe { sys::cuCtxSynchronize() };
        let (queued, events, all) = {
            let mut st = self.state.lock();
            let queued = std::mem::take(&mut st.queued);
            let all = st.map.take_all();
            let mut events = std::mem::take(&mut st.events);
            events.extend(st.map.take_idle_events());
            (queued, events, all)
        };
        let mut events = events;
        let mut handles = all.handles;
        for job in queued {
            match job {
                // handles on their way out are in the map no more: unmapped and released here
                Job::Release(rs) => {
                    for r in rs {
                        for e in r.unmap {
                            self.unmap_one(e.addr, e.pages);
                        }
                        handles.push(r.handle);
                    }
                }
                Job::Settle { event, .. } => events.push(event),
                // its evictions are out of the map (unmapped here), the handles it took
                // with them (released here); what it reused is live in the map
                Job::Ahead { plan, .. } => {
                    for e in &plan.evict {
                        self.unmap_one(e.addr, e.pages);
                    }
                    handles.extend(plan.fresh.iter().filter_map(|f| f.2));
                }
            }
        }
        for (p, n) in all.mappings {
            self.unmap_one(p, n);
        }
        for h in handles {
            // SAFETY: every address of the engine is unmapped above; the handle is ours.
            let _ = unsafe { sys::cuMemRelease(h) };
            self.counters.releases_fg.fetch_add(1, Ordering::Relaxed);
        }
        events.sort_unstable();
        events.dedup();
        for ev in events {
            // SAFETY: events owned by the engine, idle after the synchronisation above.
            let _ = unsafe { result::event::destroy(ev as sys::CUevent) };
        }
    }

    fn unmap_one(&self, p: DevPtr, pages: u64) {
        // SAFETY: shutting down after a context synchronisation: nothing uses the mapping.
        let _ = unsafe { sys::cuMemUnmap(p, (pages * self.page) as usize) };
        self.counters.unmaps_fg.fetch_add(1, Ordering::Relaxed);
    }
}

/// The worker: waits for the events of moves in stream order (then their handles are spare)
/// and releases handles beyond the spare cap. It holds only a
/// weak reference, so dropping the device ends it.
fn worker(pages: std::sync::Weak<Pages>) {
    let Some(p) = pages.upgrade() else {
        return;
    };
    if p.ctx.bind_to_thread().is_err() {
        p.state.lock().no_worker = true;
        return;
    }
    drop(p);
    // CUDA-graph captures in global mode forbid other threads' unsafe calls (event waits,
    // unmaps) unless those threads are relaxed: this thread never captures, so it is
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid in/out parameter; this sets only this thread's mode.
    let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    loop {
        let Some(p) = pages.upgrade() else {
            return;
        };
        let mut batch = {
            let mut st = p.state.lock();
            while st.queued.is_empty() && !st.stop {
                p.wake.wait(&mut st);
            }
            if st.stop {
                return;
            }
            st.working = true;
            std::mem::take(&mut st.queued)
        };
        batch.sort_by_key(Job::order);
        for job in batch {
            p.run(job, true);
        }
        p.state.lock().working = false;
        p.done.notify_all();
    }
}
