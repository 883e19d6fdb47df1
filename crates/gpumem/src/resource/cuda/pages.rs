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
//!   or `release_address` over pages still queued does their unmapping first.
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

#[derive(Debug, Default)]
struct State {
    /// the handle of every mapped page, by address
    mapped: FxHashMap<DevPtr, Handle>,
    /// runs queued for unmapping: first address and the handles of its consecutive pages
    queued: Vec<(DevPtr, Vec<Handle>)>,
    /// runs the worker is unmapping now
    in_flight: Vec<(DevPtr, u64)>,
    /// unmapped handles kept for the next map
    spare: Vec<Handle>,
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
        let spare = self.state.lock().spare.len() as u64;
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
            spare_bytes: spare * self.page,
        }
    }

    /// Map `[addr, addr + bytes)` (page-aligned, unmapped) with kept or new handles, then set
    /// access for the whole range once (this device and `peers`). All or nothing.
    pub(super) fn map(&self, addr: DevPtr, bytes: u64, peers: &[usize]) -> Result<()> {
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
            let keep = st.spare.len().saturating_sub(n);
            st.spare.split_off(keep)
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
            // settled) and `h` an unmapped handle of one page.
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
            // all or nothing: unmap what this call mapped, keep every handle as a spare
            if mapped > 0 {
                // SAFETY: the pages were mapped just now by this call and are unused.
                let _ = unsafe { sys::cuMemUnmap(addr, mapped * page as usize) };
                self.counters.unmaps_fg.fetch_add(1, Ordering::Relaxed);
            }
            let mut st = self.state.lock();
            st.spare.extend(handles);
            return Err(e);
        }
        let mut st = self.state.lock();
        for (i, h) in handles.into_iter().enumerate() {
            st.mapped.insert(addr + i as u64 * page, h);
        }
        Ok(())
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
        let page = self.page;
        let mut st = self.state.lock();
        let mut p = addr;
        let mut run: Option<(DevPtr, Vec<Handle>)> = None;
        let mut runs = Vec::new();
        while p < addr + bytes {
            match st.mapped.remove(&p) {
                Some(h) => match run.as_mut() {
                    Some((start, hs)) if *start + hs.len() as u64 * page == p => hs.push(h),
                    _ => runs.extend(run.replace((p, vec![h]))),
                },
                None => runs.extend(run.take()),
            }
            p += page;
        }
        runs.extend(run);
        if st.no_worker {
            drop(st);
            for (start, hs) in runs {
                self.unmap_run(start, &hs, false);
                self.keep_or_release(hs, false);
            }
            return Ok(());
        }
        st.queued.extend(runs);
        self.wake.notify_one();
        Ok(())
    }

    /// Before `[addr, addr + bytes)` is mapped or released: unmap its queued runs here (taking
    /// them from the worker) and wait for the ones the worker is unmapping now.
    fn settle(&self, st: &mut parking_lot::MutexGuard<'_, State>, addr: DevPtr, bytes: u64) {
        let overlaps = |start: DevPtr, len: u64| start < addr + bytes && addr < start + len;
        let page = self.page;
        let mine: Vec<(DevPtr, Vec<Handle>)> = {
            let (mine, rest) = std::mem::take(&mut st.queued)
                .into_iter()
                .partition(|(s, hs)| overlaps(*s, hs.len() as u64 * page));
            st.queued = rest;
            mine
        };
        for (start, hs) in mine {
            self.unmap_run(start, &hs, false);
            st.spare.extend(hs);
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
            st.spare.split_off(keep)
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
        let (queued, mapped) = {
            let mut st = self.state.lock();
            (
                std::mem::take(&mut st.queued),
                std::mem::take(&mut st.mapped),
            )
        };
        for (start, hs) in queued {
            self.unmap_run(start, &hs, false);
            self.keep_or_release(hs, false);
        }
        for (p, h) in mapped {
            self.unmap_run(p, &[h], false);
            self.keep_or_release(vec![h], false);
        }
        self.trim();
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
            let batch = std::mem::take(&mut st.queued);
            st.in_flight = batch
                .iter()
                .map(|(s, hs)| (*s, hs.len() as u64 * p.page))
                .collect();
            batch
        };
        let mut handles = Vec::new();
        for (start, hs) in batch {
            p.unmap_run(start, &hs, true);
            handles.extend(hs);
        }
        p.state.lock().in_flight.clear();
        p.done.notify_all();
        p.keep_or_release(handles, true);
    }
}
