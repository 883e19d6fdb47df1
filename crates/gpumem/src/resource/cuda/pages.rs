//! Virtual-memory pages of one device, cheap to move (see `shared/notes/vmm-costs.md`: on the
//! H100 a map costs 1 µs, a set-access 28 µs per call whatever the range, an unmap ~20 µs per
//! mapping, a create or release 13–50 µs):
//!
//! - physical handles are kept: an unmapped page's handle goes to a spare list that the next
//!   map takes from, so moving a page creates and releases nothing (spares beyond a small cap
//!   are released, off the allocating thread);
//! - access is set once per mapped range, not per page;
//! - unmapping runs on a background thread: `unmap` queues the pages and returns. The pool
//!   only unmaps pages whose work is known complete (events), so the delay is safe; a `map`
//!   or `release_address` over pages still queued does their unmapping first;
//! - pages whose work may still be running move in stream order (`unmap_after`): their handles
//!   are mapped at once at the new address for later work on the same stream (a handle may be
//!   mapped at two addresses; the stream runs the old work first, as it does for any block a
//!   caching allocator hands out again), and the old address is unmapped by the worker once an
//!   event recorded on the stream has completed. So a training step's pages move while the GPU
//!   is still behind the host, with no wait and no new physical memory.
//!
//! Pages are created with the POSIX file-descriptor handle type where the device supports it
//! (exportable: what IPC and NCCL registration need; it costs the same as no handle type), at
//! the device's recommended granularity.

use super::*;
use crate::resource::VmmCalls;
use parking_lot::{Condvar, Mutex};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};

type Handle = sys::CUmemGenericAllocationHandle;

/// Spare handles kept for reuse: at least this many pages...
const MIN_SPARE_PAGES: usize = 8;
/// ...or this fraction of the mapped pages (1/200 = 0.5%), whichever is more.
const SPARE_DIVISOR: usize = 200;

/// Consecutive pages queued for unmapping.
#[derive(Debug)]
struct Run {
    start: DevPtr,
    handles: Vec<Handle>,
    /// for pages whose work may still run: the event (a `CUevent` as an address) after which
    /// it is complete
    event: Option<usize>,
    /// for pages moved to a stream (`unmap_after`): that stream, whose next map may already
    /// use their handles
    alias: Option<u64>,
}

impl Run {
    fn len(&self, page: u64) -> u64 {
        self.handles.len() as u64 * page
    }
}

#[derive(Debug, Default)]
struct State {
    /// the handle of every mapped page, by address
    mapped: FxHashMap<DevPtr, Handle>,
    /// runs queued for unmapping
    queued: Vec<Run>,
    /// runs the worker is unmapping now
    in_flight: Vec<(DevPtr, u64)>,
    /// unmapped handles kept for the next map
    spare: Vec<Handle>,
    /// handles whose old address waits for its stream's work (`unmap_after`), free for that
    /// stream's next map: stream → handles
    alias: FxHashMap<u64, Vec<Handle>>,
    /// per handle, how many of its addresses wait for their stream's work
    stale: FxHashMap<Handle, u32>,
    /// idle events for `unmap_after` (as addresses)
    events: Vec<usize>,
    /// the worker should stop
    stop: bool,
    /// the worker thread could not be started: unmap inline
    no_worker: bool,
}

#[derive(Debug, Default)]
struct Counters {
    creates: AtomicU64,
    maps: AtomicU64,
    set_access: AtomicU64,
    unmaps_fg: AtomicU64,
    unmaps_bg: AtomicU64,
    releases_fg: AtomicU64,
    releases_bg: AtomicU64,
    waits: AtomicU64,
    aliased: AtomicU64,
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
    /// signalled when queued runs are done
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
            state: Mutex::new(State::default()),
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
                tracing::warn!("gpumem: no page worker ({e}): pages are unmapped inline");
                pages.state.lock().no_worker = true;
            }
        }
        pages
    }

    pub(super) fn page(&self) -> u64 {
        self.page
    }

    /// The mapped pages' addresses (for granting a peer access to all of them).
    pub(super) fn mapped_pages(&self) -> Vec<DevPtr> {
        self.state.lock().mapped.keys().copied().collect()
    }

    pub(super) fn calls(&self) -> VmmCalls {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let spare = {
            let st = self.state.lock();
            (st.spare.len() + st.alias.values().map(Vec::len).sum::<usize>()) as u64
        };
        VmmCalls {
            foreground: get(&c.creates)
                + get(&c.maps)
                + get(&c.set_access)
                + get(&c.unmaps_fg)
                + get(&c.releases_fg),
            background: get(&c.unmaps_bg) + get(&c.releases_bg),
            creates: get(&c.creates),
            maps: get(&c.maps),
            set_access: get(&c.set_access),
            unmaps: get(&c.unmaps_fg) + get(&c.unmaps_bg),
            releases: get(&c.releases_fg) + get(&c.releases_bg),
            waits: get(&c.waits),
            aliased: get(&c.aliased),
            spare_bytes: spare * self.page,
        }
    }

    /// Map `[addr, addr + bytes)` (page-aligned, unmapped) for work on `stream` with handles
    /// that stream's `unmap_after` left, kept ones or new ones, then set access for the whole
    /// range once (this device and `peers`). All or nothing.
    pub(super) fn map(
        &self,
        addr: DevPtr,
        bytes: u64,
        peers: &[usize],
        stream: Option<Stream>,
    ) -> Result<()> {
        let page = self.page;
        let n = (bytes / page) as usize;
        let mut handles = {
            let mut st = self.state.lock();
            self.settle(&mut st, addr, bytes);
            if let Some(p) = (0..n as u64)
                .map(|i| addr + i * page)
                .find(|p| st.mapped.contains_key(p))
            {
                return Err(Error::InvalidState(format!(
                    "page {p:#x} is already mapped"
                )));
            }
            let mut handles = Vec::with_capacity(n);
            if let Some(list) = stream.and_then(|s| st.alias.get_mut(&s.0)) {
                let keep = list.len().saturating_sub(n);
                handles = list.split_off(keep);
                self.counters
                    .aliased
                    .fetch_add(handles.len() as u64, Ordering::Relaxed);
            }
            let keep = st.spare.len().saturating_sub(n - handles.len());
            handles.extend(st.spare.split_off(keep));
            handles
        };
        let mut mapped = 0usize;
        let mut failed = None;
        while mapped < n {
            let h = match handles.get(mapped) {
                Some(&h) => h,
                None => {
                    let mut h: Handle = 0;
                    // SAFETY: `prop` is initialised; `h` is a valid out-pointer.
                    let r = unsafe { sys::cuMemCreate(&mut h, page as usize, &self.prop.0, 0) };
                    self.counters.creates.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = r.result() {
                        failed = Some(alloc_err("cuMemCreate", page as usize, "cuMemCreate", e));
                        break;
                    }
                    handles.push(h);
                    h
                }
            };
            let p = addr + mapped as u64 * page;
            // SAFETY: `p` is an unmapped page of reserved address space (checked above and
            // settled) and `h` a handle of one page mapped at no live address (one from
            // `unmap_after` may still be mapped at its old address, which only older work of
            // the same stream uses: a handle may be mapped at several addresses).
            let r = unsafe { sys::cuMemMap(p, page as usize, 0, h, 0) };
            self.counters.maps.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = r.result() {
                failed = Some(cuda_err("cuMemMap", e));
                break;
            }
            mapped += 1;
        }
        if failed.is_none() {
            if let Err(e) = self.set_access(addr, bytes, peers) {
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            // all or nothing: unmap what this call mapped; handles go back where they came
            // from (one still mapped at an address waiting for its stream stays that stream's)
            if mapped > 0 {
                // SAFETY: the pages were mapped just now by this call and are unused.
                let _ = unsafe { sys::cuMemUnmap(addr, mapped * page as usize) };
                self.counters.unmaps_fg.fetch_add(1, Ordering::Relaxed);
            }
            let mut st = self.state.lock();
            for h in handles {
                match stream.filter(|_| st.stale.contains_key(&h)) {
                    Some(s) => st.alias.entry(s.0).or_default().push(h),
                    None => st.spare.push(h),
                }
            }
            return Err(e);
        }
        let mut st = self.state.lock();
        for (i, h) in handles.into_iter().enumerate() {
            st.mapped.insert(addr + i as u64 * page, h);
        }
        Ok(())
    }

    /// Export the pages mapped at `[addr, addr + bytes)` (page-aligned) as POSIX file
    /// descriptors, one per page, for another process to import.
    pub(super) fn export(&self, addr: DevPtr, bytes: u64) -> Result<Vec<std::os::fd::OwnedFd>> {
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
        let st = self.state.lock();
        let mut fds = Vec::with_capacity((bytes / self.page) as usize);
        for p in (addr..addr + bytes).step_by(self.page as usize) {
            let h = *st.mapped.get(&p).ok_or_else(|| {
                Error::InvalidArgument(format!("page {p:#x} is not mapped: nothing to export"))
            })?;
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
            fds.push(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
        }
        Ok(fds)
    }

    /// Read-write access to `[addr, addr + bytes)` (mapped) for this device and `peers`.
    pub(super) fn set_access(&self, addr: DevPtr, bytes: u64, peers: &[usize]) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(peers.iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: device_location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        self.counters.set_access.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the range is mapped (callers' contract); `descs` holds `len` descriptors.
        unsafe { sys::cuMemSetAccess(addr, bytes as usize, descs.as_ptr(), descs.len()) }
            .result()
            .map_err(|e| cuda_err("cuMemSetAccess", e))
    }

    /// Queue the mapped pages of `[addr, addr + bytes)` for unmapping on the worker and return.
    /// The caller has made sure no queued work still touches them.
    pub(super) fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let mut st = self.state.lock();
        let runs = self.take_runs(&mut st, addr, bytes, None, None);
        self.enqueue(st, runs);
        Ok(())
    }

    /// Hand `runs` to the worker, or unmap them here where there is none.
    fn enqueue(&self, mut st: parking_lot::MutexGuard<'_, State>, runs: Vec<Run>) {
        if st.no_worker {
            drop(st);
            for run in runs {
                self.finish(run, false);
            }
            return;
        }
        st.queued.extend(runs);
        self.wake.notify_one();
    }

    /// An event recorded now on `stream` (an idle one of ours, or a new one).
    fn record_event(&self, st: &mut State, stream: u64) -> Result<usize> {
        let ev = match st.events.pop() {
            Some(ev) => ev as sys::CUevent,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_err("cuEventCreate", e))?,
        };
        // SAFETY: `ev` is ours and idle; the stream is the caller's live stream.
        if let Err(e) = unsafe { result::event::record(ev, raw(Stream(stream))) } {
            st.events.push(ev as usize);
            return Err(cuda_err("cuEventRecord", e));
        }
        Ok(ev as usize)
    }

    /// Move the mapped pages of `[addr, addr + bytes)` to `stream`: their handles are free at
    /// once for `stream`'s next map, and the addresses are unmapped by the worker. With `busy`,
    /// only work on `stream` has used the pages and some may still be queued: the next map's
    /// work runs after it (stream order), and the addresses are unmapped once an event recorded
    /// on `stream` now has completed. Without, the pages are idle and are unmapped at once.
    pub(super) fn unmap_after(
        &self,
        addr: DevPtr,
        bytes: u64,
        stream: Stream,
        busy: bool,
    ) -> Result<()> {
        let mut st = self.state.lock();
        let ev = if busy {
            Some(self.record_event(&mut st, stream.0)?)
        } else {
            None
        };
        let runs = self.take_runs(&mut st, addr, bytes, ev, Some(stream.0));
        if runs.is_empty() {
            st.events.extend(ev);
            return Ok(());
        }
        for run in &runs {
            for &h in &run.handles {
                *st.stale.entry(h).or_default() += 1;
            }
            st.alias
                .entry(stream.0)
                .or_default()
                .extend_from_slice(&run.handles);
        }
        self.enqueue(st, runs);
        Ok(())
    }

    /// Take the mapped pages of `[addr, addr + bytes)` out of the mapped set, as runs.
    fn take_runs(
        &self,
        st: &mut State,
        addr: DevPtr,
        bytes: u64,
        event: Option<usize>,
        alias: Option<u64>,
    ) -> Vec<Run> {
        let page = self.page;
        let mut p = addr;
        let mut run: Option<Run> = None;
        let mut runs = Vec::new();
        let new = |start, h| Run {
            start,
            handles: vec![h],
            event,
            alias,
        };
        while p < addr + bytes {
            match st.mapped.remove(&p) {
                Some(h) => match run.as_mut() {
                    Some(r) if r.start + r.len(page) == p => r.handles.push(h),
                    _ => runs.extend(run.replace(new(p, h))),
                },
                None => runs.extend(run.take()),
            }
            p += page;
        }
        runs.extend(run);
        // the runs after the first wait for the same work: give each an event of its own
        // (rare: the pool unmaps one run per call); where none can be recorded, wait here for
        // the first event, after which that run is idle
        if let (Some(first), Some(stream)) = (event, alias) {
            for r in runs.iter_mut().skip(1) {
                r.event = match self.record_event(st, stream) {
                    Ok(ev) => Some(ev),
                    Err(_) => {
                        self.wait_event(first, false);
                        None
                    }
                };
            }
        }
        runs
    }

    /// Unmap a run taken off the queue (waiting for its event first, if it has one) and put
    /// its handles where they belong: a handle still mapped at another address waiting for
    /// its stream stays where it is; one that `unmap_after` left for its stream and that
    /// nobody mapped again becomes a spare once none of its addresses waits; the rest (pages
    /// that were mapped and idle) become spares.
    fn finish(&self, run: Run, background: bool) {
        if let Some(ev) = run.event {
            self.wait_event(ev, background);
        }
        self.unmap_run(run.start, &run.handles, background);
        let spare = match run.alias {
            None => run.handles,
            Some(stream) => {
                let mut st = self.state.lock();
                st.events.extend(run.event);
                let mut spare = Vec::new();
                for h in run.handles {
                    let left = match st.stale.get_mut(&h) {
                        Some(n) => {
                            *n -= 1;
                            *n
                        }
                        None => 0,
                    };
                    if left > 0 {
                        continue;
                    }
                    st.stale.remove(&h);
                    // not mapped again: it was this stream's to map; now anyone's
                    if let Some(list) = st.alias.get_mut(&stream) {
                        if let Some(i) = list.iter().position(|&x| x == h) {
                            list.swap_remove(i);
                            spare.push(h);
                        }
                    }
                }
                spare
            }
        };
        if !spare.is_empty() {
            self.keep_or_release(spare, background);
        }
    }

    /// Wait until event `ev` has completed: polled with short sleeps on the worker (no core
    /// spinning), synchronised elsewhere.
    fn wait_event(&self, ev: usize, background: bool) {
        let ev = ev as sys::CUevent;
        if background {
            loop {
                // SAFETY: `ev` was recorded by `unmap_after` and is destroyed only by us.
                match unsafe { result::event::query(ev) } {
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {
                        std::thread::sleep(std::time::Duration::from_micros(50))
                    }
                    _ => return,
                }
            }
        }
        self.counters.waits.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        if let Err(e) = unsafe { result::event::synchronize(ev) } {
            tracing::warn!("gpumem: waiting for pages' work failed: {e:?}");
        }
    }

    /// Before `[addr, addr + bytes)` is mapped or released: unmap its queued runs here (taking
    /// them from the worker) and wait for the ones the worker is unmapping now.
    fn settle(&self, st: &mut parking_lot::MutexGuard<'_, State>, addr: DevPtr, bytes: u64) {
        let overlaps = |start: DevPtr, len: u64| start < addr + bytes && addr < start + len;
        let page = self.page;
        let mine: Vec<Run> = {
            let (mine, rest) = std::mem::take(&mut st.queued)
                .into_iter()
                .partition(|r| overlaps(r.start, r.len(page)));
            st.queued = rest;
            mine
        };
        if !mine.is_empty() {
            parking_lot::MutexGuard::unlocked(st, || {
                for run in mine {
                    self.finish(run, false);
                }
            });
        }
        while st.in_flight.iter().any(|&(s, len)| overlaps(s, len)) {
            self.counters.waits.fetch_add(1, Ordering::Relaxed);
            self.done.wait(st);
        }
    }

    /// Wait until nothing overlapping `[addr, addr + bytes)` is queued or being unmapped.
    pub(super) fn flush(&self, addr: DevPtr, bytes: u64) {
        let mut st = self.state.lock();
        self.settle(&mut st, addr, bytes);
    }

    /// Wait for every queued unmap, then release every spare handle (emptying the cache).
    pub(super) fn trim(&self) {
        let spare = {
            let mut st = self.state.lock();
            self.settle(&mut st, 0, u64::MAX);
            std::mem::take(&mut st.spare)
        };
        for h in spare {
            // SAFETY: spare handles are unmapped and owned by us alone.
            let _ = unsafe { sys::cuMemRelease(h) };
            self.counters.releases_fg.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn unmap_run(&self, start: DevPtr, hs: &[Handle], background: bool) {
        // one call over the run (unmapping is paid per mapping whatever the call covers)
        // SAFETY: the run's pages were mapped by `map` with these handles and left the mapped
        // set when queued; their work is complete (the pool's contract for `unmap`).
        let r = unsafe { sys::cuMemUnmap(start, hs.len() * self.page as usize) };
        let c = if background {
            &self.counters.unmaps_bg
        } else {
            &self.counters.unmaps_fg
        };
        c.fetch_add(hs.len() as u64, Ordering::Relaxed);
        if let Err(e) = r.result() {
            tracing::warn!("gpumem: cuMemUnmap of {start:#x} failed: {e:?}");
        }
    }

    /// Keep `hs` as spares up to the cap; release the rest.
    fn keep_or_release(&self, hs: Vec<Handle>, background: bool) {
        let extra = {
            let mut st = self.state.lock();
            let cap = MIN_SPARE_PAGES.max(st.mapped.len() / SPARE_DIVISOR);
            st.spare.extend(hs);
            let keep = st.spare.len().min(cap);
            let extra = st.spare.split_off(keep);
            // a handle still mapped at an address that waits for its stream is kept until
            // that address is unmapped (released, its identity could be reused meanwhile)
            let (stale, extra): (Vec<Handle>, Vec<Handle>) =
                extra.into_iter().partition(|h| st.stale.contains_key(h));
            st.spare.extend(stale);
            extra
        };
        let c = if background {
            &self.counters.releases_bg
        } else {
            &self.counters.releases_fg
        };
        for h in extra {
            // SAFETY: the handle is unmapped and owned by us alone.
            let _ = unsafe { sys::cuMemRelease(h) };
            c.fetch_add(1, Ordering::Relaxed);
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
        let queued = std::mem::take(&mut self.state.lock().queued);
        for run in queued {
            self.finish(run, false);
        }
        let mapped = std::mem::take(&mut self.state.lock().mapped);
        for (p, h) in mapped {
            self.unmap_run(p, &[h], false);
            if !self.state.lock().stale.contains_key(&h) {
                self.keep_or_release(vec![h], false);
            }
        }
        self.trim();
        let mut st = self.state.lock();
        // every address waiting for a stream is unmapped by now: nothing is left aliased
        debug_assert!(st.stale.is_empty(), "stale mappings left at shutdown");
        let left: Vec<Handle> = st.alias.drain().flat_map(|(_, hs)| hs).collect();
        let events = std::mem::take(&mut st.events);
        drop(st);
        for h in left {
            // SAFETY: unmapped (every run was finished above) and owned by us alone.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        for ev in events {
            // SAFETY: idle events owned by the engine.
            let _ = unsafe { result::event::destroy(ev as sys::CUevent) };
        }
    }
}

/// The worker: unmaps queued runs, keeps their handles as spares (releasing beyond the cap).
/// It holds only a weak reference, so dropping the device ends it.
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
        let batch = {
            let mut st = p.state.lock();
            while st.queued.is_empty() && !st.stop {
                p.wake.wait(&mut st);
            }
            if st.stop {
                return;
            }
            // idle pages first: a run waiting for its stream must not hold them up
            let batch = std::mem::take(&mut st.queued);
            st.in_flight = batch.iter().map(|r| (r.start, r.len(p.page))).collect();
            batch
        };
        let (waiting, idle): (Vec<Run>, Vec<Run>) =
            batch.into_iter().partition(|r| r.event.is_some());
        let mut handles = Vec::new();
        for run in idle {
            if run.alias.is_some() {
                p.finish(run, true);
            } else {
                p.unmap_run(run.start, &run.handles, true);
                handles.extend(run.handles);
            }
        }
        if !handles.is_empty() {
            p.keep_or_release(handles, true);
        }
        for run in waiting {
            p.finish(run, true);
        }
        p.state.lock().in_flight.clear();
        p.done.notify_all();
    }
}
