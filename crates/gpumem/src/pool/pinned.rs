//! The pinned (page-locked) host pool.
//!
//! Page-locked memory is slow to get (cuMemHostAlloc took 1.1 ms for 1 MiB and 31.7 ms for
//! 64 MiB on the H100 machine) and fast to use, so blocks are cached by size class and handed
//! out again with no driver call. Unlike device memory, host memory is not stream-ordered: the
//! CPU writes a reused block at once, while a copy queued earlier may still be reading it. So
//! a block comes back with the events of the copies that used it, and it is handed out again
//! only once every one of them has completed, whatever stream asks (PyTorch's
//! `CachingHostAllocator` keeps the same rule).
//!
//! Policy only: the pool calls its backend through [`Backend`] (cuMemHostAlloc on a GPU, plain
//! host memory in CI, a simulated device with controllable events in tests).

use crate::error::{Error, Result};
use crate::resource::{Backend, DevPtr, Event, Stream};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::Arc;

/// Smallest size class: one host page.
pub const PINNED_MIN_BLOCK: usize = 4096;
/// Alignment of every pinned block (a host page).
pub const PINNED_ALIGN: usize = 4096;
/// Largest single request (1 TiB): anything larger is a caller bug, not a size to try.
pub const PINNED_MAX_REQUEST: usize = 1 << 40;

/// The size class of a request: one page at least, then four classes per power of two (so a
/// block wastes at most a quarter of its size).
pub fn size_class(bytes: usize) -> usize {
    if bytes <= PINNED_MIN_BLOCK {
        return PINNED_MIN_BLOCK;
    }
    let floor = 1usize << (usize::BITS - 1 - bytes.leading_zeros());
    let step = (floor / 4).max(PINNED_MIN_BLOCK);
    bytes.next_multiple_of(step)
}

/// Pinned-pool counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PinnedStats {
    /// bytes of blocks handed out now (size classes)
    pub allocated_bytes: u64,
    /// most `allocated_bytes` seen
    pub peak_allocated_bytes: u64,
    /// bytes held from the backend (handed out, cached and waiting)
    pub reserved_bytes: u64,
    /// most `reserved_bytes` seen
    pub peak_reserved_bytes: u64,
    /// bytes of blocks that are free but still wait for copies to complete
    pub pending_bytes: u64,
    /// blocks handed out
    pub num_allocs: u64,
    /// of which served from the cache (no driver call)
    pub num_cache_hits: u64,
    /// backend allocations (cuMemHostAlloc)
    pub num_host_alloc: u64,
    /// backend frees (cuMemFreeHost)
    pub num_host_free: u64,
    /// frees that had to wait for copies before the block could be reused
    pub num_deferred_frees: u64,
}

/// A pinned block handed out by [`PinnedPool::allocate`]. Give it back with
/// [`PinnedPool::free`]; [`crate::PinnedBuffer`] does that on drop.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pinned block that is never freed stays reserved"]
pub struct PinnedBlock {
    ptr: DevPtr,
    size: usize,
    class: usize,
}

impl PinnedBlock {
    /// Host address (page-aligned).
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// Bytes requested.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Bytes usable (the size class).
    pub fn capacity(&self) -> usize {
        self.class
    }
}

/// A freed block waiting for the copies that used it.
#[derive(Debug)]
struct Waiting {
    ptr: DevPtr,
    class: usize,
    events: Vec<Event>,
}

#[derive(Debug, Default)]
struct State {
    /// idle blocks by size class
    free: FxHashMap<usize, Vec<DevPtr>>,
    /// blocks handed out: address → size class
    live: FxHashMap<DevPtr, usize>,
    /// freed blocks whose copies may still run
    waiting: Vec<Waiting>,
    stats: PinnedStats,
}

struct Inner {
    backend: Arc<dyn Backend>,
    state: Mutex<State>,
}

/// The caching pool of pinned host memory. Cheap to clone (clones share the cache).
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("backend", &self.inner.backend.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl PinnedPool {
    /// A pool over `backend` (cuMemHostAlloc on a GPU; any backend in tests).
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The backend (for copies and events on the pool's memory).
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// A block of at least `bytes` bytes, page-aligned. A cached block whose copies have all
    /// completed is reused with no driver call; otherwise the backend is asked, and when it
    /// has no memory left the idle cache is released and the request tried once more.
    pub fn allocate(&self, bytes: usize) -> Result<PinnedBlock> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        if bytes > PINNED_MAX_REQUEST {
            return Err(Error::SizeTooLarge {
                requested: bytes as u64,
                max: PINNED_MAX_REQUEST as u64,
            });
        }
        let class = size_class(bytes);
        let mut st = self.inner.state.lock();
        if let Some(ptr) = self.take_free(&mut st, class) {
            st.stats.num_cache_hits += 1;
            return Ok(self.hand_out(&mut st, ptr, bytes, class));
        }
        if !st.waiting.is_empty() {
            self.collect(&mut st);
            if let Some(ptr) = self.take_free(&mut st, class) {
                st.stats.num_cache_hits += 1;
                return Ok(self.hand_out(&mut st, ptr, bytes, class));
            }
        }
        let ptr = match self
            .inner
            .backend
            .allocate(Stream::DEFAULT, class, PINNED_ALIGN)
        {
            Ok(p) => p,
            Err(Error::ResourceExhausted { .. }) => {
                self.release_idle(&mut st);
                self.inner
                    .backend
                    .allocate(Stream::DEFAULT, class, PINNED_ALIGN)?
            }
            Err(e) => return Err(e),
        };
        st.stats.num_host_alloc += 1;
        st.stats.reserved_bytes += class as u64;
        st.stats.peak_reserved_bytes = st.stats.peak_reserved_bytes.max(st.stats.reserved_bytes);
        Ok(self.hand_out(&mut st, ptr, bytes, class))
    }

    fn take_free(&self, st: &mut State, class: usize) -> Option<DevPtr> {
        st.free.get_mut(&class).and_then(Vec::pop)
    }

    fn hand_out(&self, st: &mut State, ptr: DevPtr, bytes: usize, class: usize) -> PinnedBlock {
        st.live.insert(ptr, class);
        st.stats.num_allocs += 1;
        st.stats.allocated_bytes += class as u64;
        st.stats.peak_allocated_bytes = st.stats.peak_allocated_bytes.max(st.stats.allocated_bytes);
        PinnedBlock {
            ptr,
            size: bytes,
            class,
        }
    }

    /// Give a block back. `events` capture the copies that used it (recorded after each was
    /// queued); the pool owns them from here and hands the block out again only once all have
    /// completed.
    pub fn free(&self, block: PinnedBlock, events: Vec<Event>) -> Result<()> {
        let mut st = self.inner.state.lock();
        match st.live.get(&block.ptr) {
            Some(&class) if class == block.class => {}
            _ => {
                drop(st);
                self.destroy_events(events);
                return Err(Error::UnknownPointer { ptr: block.ptr });
            }
        }
        st.live.remove(&block.ptr);
        st.stats.allocated_bytes -= block.class as u64;
        let mut pending = Vec::new();
        for ev in events {
            match self.inner.backend.event_done(ev) {
                Ok(true) => self.inner.backend.destroy_event(ev),
                // an event that cannot be queried is waited for later (sync_event)
                Ok(false) | Err(_) => pending.push(ev),
            }
        }
        if pending.is_empty() {
            st.free.entry(block.class).or_default().push(block.ptr);
        } else {
            st.stats.num_deferred_frees += 1;
            st.stats.pending_bytes += block.class as u64;
            st.waiting.push(Waiting {
                ptr: block.ptr,
                class: block.class,
                events: pending,
            });
        }
        Ok(())
    }

    /// Move waiting blocks whose copies have all completed to the cache.
    fn collect(&self, st: &mut State) {
        let backend = &self.inner.backend;
        let mut i = 0;
        while i < st.waiting.len() {
            let w = &mut st.waiting[i];
            w.events.retain(|&ev| match backend.event_done(ev) {
                Ok(true) => {
                    backend.destroy_event(ev);
                    false
                }
                _ => true,
            });
            if w.events.is_empty() {
                let w = st.waiting.swap_remove(i);
                st.stats.pending_bytes -= w.class as u64;
                st.free.entry(w.class).or_default().push(w.ptr);
            } else {
                i += 1;
            }
        }
    }

    fn release_idle(&self, st: &mut State) -> u64 {
        self.collect(st);
        let mut released = 0;
        for (class, ptrs) in st.free.drain() {
            for p in ptrs {
                match self.inner.backend.deallocate(p, class, Stream::DEFAULT) {
                    Ok(()) => {
                        released += class as u64;
                        st.stats.num_host_free += 1;
                    }
                    Err(e) => tracing::error!("gpumem: pinned free of {p:#x} failed: {e}"),
                }
            }
        }
        st.stats.reserved_bytes -= released;
        released
    }

    /// Return every idle cached block to the backend (blocks whose copies still run stay);
    /// returns the bytes released.
    pub fn empty_cache(&self) -> u64 {
        let mut st = self.inner.state.lock();
        self.release_idle(&mut st)
    }

    /// Wait for the copies of every freed block, making all cached blocks idle.
    pub fn synchronize(&self) -> Result<()> {
        let mut st = self.inner.state.lock();
        let mut first_err = None;
        for w in &st.waiting {
            for &ev in &w.events {
                if let Err(e) = self.inner.backend.sync_event(ev) {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.collect(&mut st);
        first_err.map_or(Ok(()), Err)
    }

    /// Counters.
    pub fn stats(&self) -> PinnedStats {
        self.inner.state.lock().stats
    }

    /// Zero the peaks (they restart from the current values).
    pub fn reset_peak(&self) {
        let mut st = self.inner.state.lock();
        st.stats.peak_allocated_bytes = st.stats.allocated_bytes;
        st.stats.peak_reserved_bytes = st.stats.reserved_bytes;
    }

    /// True if `ptr` is a block this pool handed out and has not had back.
    pub fn owns(&self, ptr: DevPtr) -> bool {
        self.inner.state.lock().live.contains_key(&ptr)
    }

    /// Check the bookkeeping: every reserved byte is handed out, cached or waiting, and no
    /// block is in two places.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = self.inner.state.lock();
        let live: u64 = st.live.values().map(|&c| c as u64).sum();
        let cached: u64 = st
            .free
            .iter()
            .map(|(&c, v)| c as u64 * v.len() as u64)
            .sum();
        let waiting: u64 = st.waiting.iter().map(|w| w.class as u64).sum();
        if live != st.stats.allocated_bytes {
            return Err(format!(
                "live blocks hold {live} bytes, stats say {}",
                st.stats.allocated_bytes
            ));
        }
        if waiting != st.stats.pending_bytes {
            return Err(format!(
                "waiting blocks hold {waiting} bytes, stats say {}",
                st.stats.pending_bytes
            ));
        }
        if live + cached + waiting != st.stats.reserved_bytes {
            return Err(format!(
                "live {live} + cached {cached} + waiting {waiting} != reserved {}",
                st.stats.reserved_bytes
            ));
        }
        let mut seen = rustc_hash::FxHashSet::default();
        let all = st
            .live
            .keys()
            .chain(st.free.values().flatten())
            .chain(st.waiting.iter().map(|w| &w.ptr));
        for p in all {
            if !seen.insert(*p) {
                return Err(format!("block {p:#x} is in two places"));
            }
        }
        Ok(())
    }

    fn destroy_events(&self, events: Vec<Event>) {
        for ev in events {
            self.inner.backend.destroy_event(ev);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Last handle gone: no buffer holds a block (buffers hold the pool), so wait for the
        // copies of waiting blocks and give everything back.
        let st = self.state.get_mut();
        for w in st.waiting.drain(..) {
            for ev in w.events {
                let _ = self.backend.sync_event(ev);
                self.backend.destroy_event(ev);
            }
            let _ = self.backend.deallocate(w.ptr, w.class, Stream::DEFAULT);
        }
        for (class, ptrs) in st.free.drain() {
            for p in ptrs {
                let _ = self.backend.deallocate(p, class, Stream::DEFAULT);
            }
        }
        if !st.live.is_empty() {
            // raw blocks still out (their holders use the addresses): leaked, not freed
            tracing::warn!(
                "gpumem: pinned pool dropped with {} block(s) still handed out",
                st.live.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::sim::SimulatedDevice;
    use crate::resource::StreamOps;

    #[test]
    fn size_classes_waste_at_most_a_quarter() {
        assert_eq!(size_class(1), 4096);
        assert_eq!(size_class(4096), 4096);
        assert_eq!(size_class(4097), 8192);
        assert_eq!(size_class(5 << 20), 5 << 20);
        assert_eq!(size_class((5 << 20) + 1), 6 << 20);
        for b in [4097usize, 10_000, 123_457, 1 << 20, 3 << 30, 999_999_999] {
            let c = size_class(b);
            assert!(
                c >= b && (c - b) as f64 <= b as f64 * 0.25 + 4096.0,
                "{b} -> {c}"
            );
            assert_eq!(c % PINNED_ALIGN, 0);
        }
    }

    #[test]
    fn cache_hit_needs_no_backend_call() {
        let pool = PinnedPool::new(Arc::new(crate::resource::host::HostResource::new()));
        let a = pool.allocate(100_000).unwrap();
        let p = a.ptr();
        pool.free(a, vec![]).unwrap();
        let b = pool.allocate(100_000).unwrap();
        assert_eq!(b.ptr(), p);
        let s = pool.stats();
        assert_eq!(
            (s.num_host_alloc, s.num_cache_hits, s.num_allocs),
            (1, 1, 2)
        );
        pool.free(b, vec![]).unwrap();
        pool.check_invariants().unwrap();
        assert_eq!(pool.empty_cache(), size_class(100_000) as u64);
        assert_eq!(pool.stats().reserved_bytes, 0);
    }

    #[test]
    fn block_in_flight_is_not_reused_until_its_copy_completes() {
        let dev = Arc::new(SimulatedDevice::new(1 << 30));
        dev.set_auto_complete(false);
        let pool = PinnedPool::new(dev.clone());
        let a = pool.allocate(1 << 20).unwrap();
        let p = a.ptr();
        let ev = dev.record_event(Stream(7)).unwrap(); // a copy reading the block
        pool.free(a, vec![ev]).unwrap();
        assert_eq!(pool.stats().pending_bytes, 1 << 20);
        let b = pool.allocate(1 << 20).unwrap();
        assert_ne!(b.ptr(), p, "handed out while its copy may still read it");
        pool.check_invariants().unwrap();
        dev.complete_events();
        let c = pool.allocate(1 << 20).unwrap();
        assert_eq!(c.ptr(), p, "reused once the copy completed");
        assert_eq!(pool.stats().pending_bytes, 0);
        pool.free(b, vec![]).unwrap();
        pool.free(c, vec![]).unwrap();
        pool.check_invariants().unwrap();
        assert_eq!(pool.stats().num_deferred_frees, 1);
    }

    #[test]
    fn bad_requests_are_errors_and_leave_the_pool_usable() {
        let pool = PinnedPool::new(Arc::new(crate::resource::host::HostResource::new()));
        assert!(matches!(pool.allocate(0), Err(Error::ZeroSize)));
        assert!(matches!(
            pool.allocate(usize::MAX),
            Err(Error::SizeTooLarge { .. })
        ));
        let a = pool.allocate(10).unwrap();
        let fake = PinnedBlock {
            ptr: a.ptr() + 4096,
            size: 10,
            class: 4096,
        };
        assert!(matches!(
            pool.free(fake, vec![]),
            Err(Error::UnknownPointer { .. })
        ));
        let again = PinnedBlock {
            ptr: a.ptr(),
            size: 10,
            class: 4096,
        };
        pool.free(a, vec![]).unwrap();
        // a second free of the same block (forged, since blocks are not Clone)
        assert!(matches!(
            pool.free(again, vec![]),
            Err(Error::UnknownPointer { .. })
        ));
        pool.check_invariants().unwrap();
        let b = pool.allocate(10).unwrap();
        pool.free(b, vec![]).unwrap();
    }

    #[test]
    fn exhausted_backend_releases_the_idle_cache_and_retries() {
        let dev = Arc::new(SimulatedDevice::new(3 << 20));
        let pool = PinnedPool::new(dev.clone());
        let a = pool.allocate(1 << 20).unwrap();
        let b = pool.allocate(1 << 20).unwrap();
        pool.free(a, vec![]).unwrap();
        pool.free(b, vec![]).unwrap();
        // 2 MiB cached of 3 MiB; a 2 MiB class needs the cache released
        let c = pool.allocate(2 << 20).unwrap();
        assert_eq!(pool.stats().num_host_free, 2);
        pool.free(c, vec![]).unwrap();
        pool.check_invariants().unwrap();
    }
}
