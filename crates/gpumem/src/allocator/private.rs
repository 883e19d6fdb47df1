//! Private pools: PyTorch's CUDA-graph pools and `torch.cuda.MemPool`.
//!
//! A private pool is a [`CachingPool`] of its own beside the shards, named by PyTorch's
//! `MempoolId_t` ([`PoolId`]). What is allocated into it comes back to it when freed and is
//! reused only by later allocations into the same pool: memory freed during a graph capture is
//! never handed to anyone else while the graph lives (its replays still use it). A pool lives
//! while its use count (graphs and `MemPool` objects that hold it) is above zero; at zero, and
//! once nothing allocated from it is alive, its segments go back to the device.
//!
//! A `MemPool` built over another allocator (`torch.cuda.MemPool(allocator)`: a pluggable
//! allocator, NCCL's) takes its segments from that allocator through an
//! [`External`] resource and gives them back to it; its bytes count against the budget as the
//! device's do.
//!
//! Private pools use classic segments: a graph replays at fixed addresses, so the pages under a
//! graph's blocks could never move anyway, and classic segments need no events or page calls
//! while a capture runs.

use super::{CachingAllocator, Inner};
use crate::error::{Error, Result};
use crate::pool::{CachingPool, Handout, Layout, Restored, SegmentInfo, Stats};
use crate::resource::external::{External, ExternalSource};
use crate::resource::{Backend, DevPtr, Stream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A private pool's id: PyTorch's `MempoolId_t` (two numbers; `(0, 0)` is no pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u64, pub u64);

pub(super) struct Private {
    id: PoolId,
    pool: CachingPool,
    /// graphs and pool objects holding the pool
    uses: u32,
    /// captures recording into it now
    capturing: u32,
}

impl Private {
    fn idle(&self) -> bool {
        self.uses == 0 && self.capturing == 0
    }
}

fn unknown(id: PoolId) -> Error {
    Error::InvalidArgument(format!("no private pool ({}, {})", id.0, id.1))
}

impl Inner {
    /// A new private pool over the device, or over `source` (another allocator's memory,
    /// charged to the same budget).
    fn new_private(&self, id: PoolId, source: Option<Box<dyn ExternalSource>>) -> Private {
        let mut config = self.config.clone();
        config.pool.expandable_segments = false;
        config.pool.cross_stream_reuse = false;
        config.pool.garbage_collection_threshold = None;
        // best fit for every allocation, as PyTorch's pools: a graph's few allocations gain
        // nothing from the quick cache, and its last-freed-first order would put a capture's
        // tensors in other blocks than PyTorch does
        config.pool.quick_cache = 0;
        let backend: Arc<dyn Backend> = match source {
            None => self.backend.clone(),
            Some(source) => {
                let external = Arc::new(External::new(self.device.clone(), source));
                match &self.limit {
                    Some(limit) => Arc::new(limit.sharing(external)),
                    None => external,
                }
            }
        };
        let mut pool = CachingPool::new(backend, &config, self.shared.clone());
        pool.set_tag((id.0, id.1));
        Private {
            id,
            pool,
            uses: 0,
            capturing: 0,
        }
    }
}

impl CachingAllocator {
    fn with_private<T>(&self, id: PoolId, f: impl FnOnce(&mut Private) -> T) -> Result<T> {
        let mut pools = self.inner.private.lock();
        let p = pools.iter_mut().find(|p| p.id == id).ok_or(unknown(id))?;
        Ok(f(p))
    }

    /// Private pool `id` never splits its blocks from now on (`torch.cuda.MemPool(no_split=True)`):
    /// each allocation takes a whole free block or a segment of its own.
    pub fn set_pool_no_split(&self, id: PoolId) -> Result<()> {
        self.with_private(id, |p| p.pool.set_no_split())
    }

    /// Make private pool `id` if there is none, and count one more user of it
    /// (`createOrIncrefPool`: a `torch.cuda.MemPool`, or a graph that shares another's pool).
    pub fn create_or_incref_pool(&self, id: PoolId) -> Result<()> {
        self.create_or_incref_pool_over(id, None)
    }

    /// [`CachingAllocator::create_or_incref_pool`] for a pool whose segments, if it is new,
    /// come from `source` (`torch.cuda.MemPool(allocator)`: a pluggable allocator, NCCL's) and
    /// go back to it when the pool releases them. Its bytes count against the budget as the
    /// device's do. An existing pool keeps the memory it was made with.
    pub fn create_or_incref_pool_over(
        &self,
        id: PoolId,
        source: Option<Box<dyn ExternalSource>>,
    ) -> Result<()> {
        if id == PoolId(0, 0) {
            return Err(Error::InvalidArgument(
                "pool id (0, 0) names no pool".into(),
            ));
        }
        self.track_allocated();
        let mut pools = self.inner.private.lock();
        match pools.iter_mut().find(|p| p.id == id) {
            Some(p) => p.uses += 1,
            None => {
                let mut p = self.inner.new_private(id, source);
                p.uses = 1;
                pools.push(p);
                self.inner
                    .private_count
                    .store(pools.len(), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// A capture starts recording into pool `id` (made and counted as by
    /// [`CachingAllocator::create_or_incref_pool`]). Until [`CachingAllocator::end_capture`],
    /// the pools record no events on streams that are capturing.
    pub fn begin_capture(&self, id: PoolId) -> Result<()> {
        self.create_or_incref_pool(id)?;
        self.with_private(id, |p| p.capturing += 1)?;
        self.inner.shared.captures.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The capture into pool `id` has ended: blocks freed during it by streams that were
    /// capturing get their events now.
    pub fn end_capture(&self, id: PoolId) -> Result<()> {
        let was = self.with_private(id, |p| {
            let was = p.capturing;
            p.capturing = p.capturing.saturating_sub(1);
            was
        })?;
        if was == 0 {
            return Err(Error::InvalidArgument(format!(
                "no capture is recording into pool ({}, {})",
                id.0, id.1
            )));
        }
        let _ =
            self.inner
                .shared
                .captures
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1));
        for j in 0..self.inner.shards.len() {
            self.shard(j).end_capture();
        }
        for p in self.inner.private.lock().iter_mut() {
            p.pool.end_capture();
        }
        Ok(())
    }

    /// One user of pool `id` is gone (a graph reset, a `MemPool` deleted). At zero users the
    /// pool's memory goes back to the device once nothing allocated from it is alive.
    pub fn release_pool(&self, id: PoolId) -> Result<()> {
        self.with_private(id, |p| {
            if p.uses == 0 {
                return Err(Error::InvalidArgument(format!(
                    "pool ({}, {}) has no users left to release",
                    id.0, id.1
                )));
            }
            p.uses -= 1;
            Ok(())
        })??;
        self.drop_idle_pools();
        Ok(())
    }

    /// Users of pool `id` (`None` if there is no such pool).
    pub fn pool_use_count(&self, id: PoolId) -> Option<u32> {
        self.with_private(id, |p| p.uses).ok()
    }

    /// Allocate `bytes` on `stream` from private pool `id` (free it with
    /// [`CachingAllocator::deallocate_ptr`]). Out of memory, the shards' caches and idle pools
    /// are released and the allocation retried once.
    pub fn allocate_in_pool(
        &self,
        id: PoolId,
        stream: Stream,
        bytes: usize,
        align: usize,
    ) -> Result<DevPtr> {
        let r = self.with_private(id, |p| {
            p.pool
                .allocate_inner(stream, bytes, align, false, Handout::Address)
        })?;
        match r {
            Err(e) if e.is_out_of_memory() => {}
            r => return r.map(|a| a.addr),
        }
        for j in 0..self.inner.shards.len() {
            self.shard(j).release_cached();
        }
        self.drop_idle_pools();
        let r = self.with_private(id, |p| {
            p.pool
                .allocate_inner(stream, bytes, align, true, Handout::Address)
        })?;
        match r {
            Err(Error::OutOfMemory(mut report)) => {
                let stats = self.stats();
                report.reserved = stats.reserved_bytes.all.current;
                report.allocated = stats.allocated_bytes.all.current;
                Err(Error::OutOfMemory(report))
            }
            r => r.map(|a| a.addr),
        }
    }

    /// Free `ptr` if a private pool holds it: `None` if none does.
    pub(super) fn free_private(&self, ptr: DevPtr) -> Option<Result<()>> {
        if self.inner.private_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut pools = self.inner.private.lock();
        let p = pools.iter_mut().find(|p| p.pool.owns(ptr))?;
        let r = p.pool.free(ptr);
        let drop_now = p.idle() && p.pool.live_count() == 0;
        drop(pools);
        if drop_now {
            self.drop_idle_pools();
        }
        Some(r)
    }

    /// Record `stream` on `ptr` if a private pool holds it.
    pub(super) fn record_stream_private(&self, ptr: DevPtr, stream: Stream) -> Option<Result<()>> {
        if self.inner.private_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut pools = self.inner.private.lock();
        let p = pools.iter_mut().find(|p| p.pool.owns(ptr))?;
        Some(p.pool.record_stream(ptr, stream))
    }

    /// The pool `ptr` was allocated from: `None` for the shared pool (or an unknown address).
    pub fn pool_of(&self, ptr: DevPtr) -> Option<PoolId> {
        if self.inner.private_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let pools = self.inner.private.lock();
        pools.iter().find(|p| p.pool.owns(ptr)).map(|p| p.id)
    }

    /// Where a live block of a private pool lies (see [`CachingPool::extent_of`]).
    pub(super) fn private_extent_of(&self, ptr: DevPtr) -> Option<(u64, u64, u64, u64, bool)> {
        if self.inner.private_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.inner
            .private
            .lock()
            .iter()
            .find_map(|p| p.pool.extent_of(ptr))
    }

    /// Addresses allocated from pool `id` and not freed yet (PyTorch's
    /// `checkPoolLiveAllocations`).
    pub fn pool_live_allocations(&self, id: PoolId) -> Result<Vec<DevPtr>> {
        self.with_private(id, |p| p.pool.live_addrs())
    }

    /// Release the cached segments of pool `id` if it has no users left; returns the bytes
    /// released. A pool in use keeps its memory: a graph replays at its addresses.
    pub fn empty_pool_cache(&self, id: PoolId) -> Result<u64> {
        let r = self.with_private(id, |p| if p.idle() { p.pool.empty_cache() } else { 0 })?;
        self.drop_idle_pools();
        Ok(r)
    }

    /// The layout of pool `id`: which blocks of its segments are handed out
    /// (`getCheckpointState`).
    pub fn pool_layout(&self, id: PoolId) -> Result<Layout> {
        self.with_private(id, |p| p.pool.layout())
    }

    /// Put pool `id` back to `layout` (`setCheckpointPoolState`): see [`CachingPool::restore`].
    pub fn restore_pool(&self, id: PoolId, layout: &Layout) -> Result<Restored> {
        self.with_private(id, |p| p.pool.restore(layout))?
    }

    /// Segments of pool `id` (blocks whose events have completed count as free, as they are).
    pub fn pool_segments(&self, id: PoolId) -> Result<Vec<SegmentInfo>> {
        self.with_private(id, |p| {
            p.pool.process_events();
            p.pool.segments()
        })
    }

    /// Ids of the private pools that exist now.
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.inner.private.lock().iter().map(|p| p.id).collect()
    }

    /// Drop every pool with no users, no capture and nothing alive (its segments go back to
    /// the device), unless a capture is under way on the device (freeing memory then would
    /// break it).
    pub(super) fn drop_idle_pools(&self) {
        if self.inner.shared.captures.load(Ordering::Relaxed) > 0 {
            return;
        }
        let gone: Vec<Private> = {
            let mut pools = self.inner.private.lock();
            let mut gone = Vec::new();
            let mut i = 0;
            while i < pools.len() {
                if pools[i].idle() && pools[i].pool.live_count() == 0 {
                    gone.push(pools.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            self.inner
                .private_count
                .store(pools.len(), Ordering::Relaxed);
            gone
        };
        drop(gone); // outside the lock: dropping frees the segments
    }

    /// From now on, the bytes allocated in all the pools together and their peak are kept
    /// (`SharedCounters::tracking`): the first private pool is about to be made. Every shard
    /// is held while the count starts (from the bytes allocated now and the shards' peaks, a
    /// bound of the peak so far, exact with one shard), so that no allocation or free is
    /// missed or counted twice.
    fn track_allocated(&self) {
        let shared = &self.inner.shared;
        if shared.tracking.load(Ordering::Acquire) {
            return;
        }
        let shards: Vec<_> = (0..self.inner.shards.len())
            .map(|j| self.shard(j))
            .collect();
        let pools = self.inner.private.lock();
        if shared.tracking.load(Ordering::Acquire) {
            return;
        }
        let (mut now, mut peak) = (0, 0);
        for s in &shards {
            let st = s.stats();
            now += st.allocated_bytes.all.current;
            peak += st.allocated_bytes.all.peak;
        }
        for p in pools.iter() {
            let st = p.pool.stats();
            now += st.allocated_bytes.all.current;
            peak += st.allocated_bytes.all.peak;
        }
        shared.allocated.store(now, Ordering::Relaxed);
        shared
            .peak_allocated
            .store(peak.max(now), Ordering::Relaxed);
        shared.tracking.store(true, Ordering::Release);
    }

    /// Merge the private pools' statistics into `total`.
    pub(super) fn private_stats(&self, total: &mut Stats) {
        for p in self.inner.private.lock().iter() {
            total.merge(&p.pool.stats());
        }
    }

    pub(super) fn private_segments(&self) -> Vec<SegmentInfo> {
        self.inner
            .private
            .lock()
            .iter()
            .flat_map(|p| p.pool.segments())
            .collect()
    }

    pub(super) fn private_check_invariants(&self) -> std::result::Result<(), String> {
        self.inner
            .private
            .lock()
            .iter()
            .try_for_each(|p| p.pool.check_invariants())
    }

    pub(super) fn private_reset_peak(&self) {
        for p in self.inner.private.lock().iter_mut() {
            p.pool.reset_peak();
        }
    }

    pub(super) fn private_set_runtime_settings(&self, config: &crate::Config) {
        for p in self.inner.private.lock().iter_mut() {
            p.pool.set_runtime_settings(config);
        }
    }

    pub(super) fn private_empty_cache(&self) -> u64 {
        let mut n = 0;
        for p in self.inner.private.lock().iter_mut() {
            if p.idle() {
                n += p.pool.empty_cache();
            }
        }
        self.drop_idle_pools();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::resource::host::HostResource;
    use std::sync::Arc;

    const MIB: usize = 1 << 20;

    fn alloc() -> CachingAllocator {
        CachingAllocator::new(Arc::new(HostResource::new()), Config::default()).unwrap()
    }

    #[test]
    fn memory_freed_in_a_private_pool_is_reused_only_by_that_pool() {
        let a = alloc();
        let id = PoolId(1, 0);
        a.begin_capture(id).unwrap();
        let s = Stream(7);
        let p = a.allocate_in_pool(id, s, 3 * MIB, 256).unwrap();
        a.deallocate_ptr(p).unwrap(); // freed during the capture
        let q = a.allocate_in_pool(id, s, 3 * MIB, 256).unwrap();
        assert_eq!(p, q, "the pool reuses its own memory");
        a.end_capture(id).unwrap();
        a.deallocate_ptr(q).unwrap();
        // the shared pool never gets it while the graph holds the pool
        for _ in 0..4 {
            let g = a.allocate_ptr(s, 3 * MIB, 256).unwrap();
            assert_ne!(g, p);
        }
        assert_eq!(a.pool_use_count(id), Some(1));
        let reserved = a.stats().reserved_bytes.all.current;
        a.release_pool(id).unwrap(); // graph gone: the pool's memory goes back
        assert_eq!(a.pool_use_count(id), None);
        assert!(a.stats().reserved_bytes.all.current < reserved);
        a.check_invariants().unwrap();
    }

    /// The device's allocated peak where private pools exist is the peak of all pools' bytes
    /// together, not the sum of each pool's own peak: PyTorch's `max_memory_allocated()`
    /// under CUDA graphs, whose warm-up fills the graphs' pool while the shared pool peaks
    /// at another time (an H200, `torch.compile(mode="reduce-overhead")` training: 2,607 MiB
    /// reported after step 1 where native reported 1,756, and 2,261 at its peak).
    #[test]
    fn the_allocated_peak_with_private_pools_is_the_peak_of_all_pools_together() {
        let config = Config {
            shards: Some(1),
            ..Config::default()
        };
        let a = CachingAllocator::new(Arc::new(HostResource::new()), config).unwrap();
        let (s, mib) = (Stream(1), MIB as u64);
        let x = a.allocate_ptr(s, 8 * MIB, 256).unwrap();
        a.deallocate_ptr(x).unwrap();
        let id = PoolId(2, 0);
        a.create_or_incref_pool(id).unwrap();
        assert_eq!(a.stats().allocated_bytes.all.peak, 8 * mib);
        let p = a.allocate_in_pool(id, s, 6 * MIB, 256).unwrap();
        a.deallocate_ptr(p).unwrap();
        // each pool's own peak is 8 and 6 MiB; together they never held more than 8
        assert_eq!(a.stats().allocated_bytes.all.peak, 8 * mib);
        let p = a.allocate_in_pool(id, s, 6 * MIB, 256).unwrap();
        let y = a.allocate_ptr(s, 4 * MIB, 256).unwrap();
        let st = a.stats();
        assert_eq!(st.allocated_bytes.all.current, 10 * mib);
        assert_eq!(st.allocated_bytes.all.peak, 10 * mib);
        a.deallocate_ptr(y).unwrap();
        a.deallocate_ptr(p).unwrap();
        assert_eq!(a.stats().allocated_bytes.all.current, 0);
        a.reset_peak();
        assert_eq!(a.stats().allocated_bytes.all.peak, 0);
        let z = a.allocate_ptr(s, 2 * MIB, 256).unwrap();
        assert_eq!(a.stats().allocated_bytes.all.peak, 2 * mib);
        a.deallocate_ptr(z).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_released_pool_lives_until_its_last_block_is_freed() {
        let a = alloc();
        let id = PoolId(0, 5);
        a.create_or_incref_pool(id).unwrap();
        a.create_or_incref_pool(id).unwrap();
        assert_eq!(a.pool_use_count(id), Some(2));
        let p = a.allocate_in_pool(id, Stream(1), MIB, 512).unwrap();
        assert_eq!(a.pool_of(p), Some(id));
        assert_eq!(a.stats().allocated_bytes.all.current, MIB as u64);
        a.release_pool(id).unwrap();
        a.release_pool(id).unwrap();
        assert!(a.release_pool(id).is_err(), "no users left");
        assert_eq!(a.pool_use_count(id), Some(0), "a block is still alive");
        assert_eq!(a.pool_live_allocations(id).unwrap(), vec![p]);
        a.deallocate_ptr(p).unwrap();
        assert_eq!(a.pool_use_count(id), None);
        assert!(a.deallocate_ptr(p).is_err(), "double free is an error");
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
    }

    #[test]
    fn bad_pool_calls_are_errors_and_leave_the_allocator_usable() {
        let a = alloc();
        let id = PoolId(3, 0);
        assert!(a.create_or_incref_pool(PoolId(0, 0)).is_err());
        assert!(a.allocate_in_pool(id, Stream(1), 64, 8).is_err());
        assert!(a.release_pool(id).is_err());
        assert!(a.end_capture(id).is_err());
        a.create_or_incref_pool(id).unwrap();
        assert!(a.end_capture(id).is_err(), "no capture into it");
        assert!(a.allocate_in_pool(id, Stream(1), 0, 8).is_err());
        let p = a.allocate_ptr(Stream(1), 64, 8).unwrap();
        a.deallocate_ptr(p).unwrap();
    }

    #[test]
    fn a_checkpoint_puts_the_pool_back_as_it_was() {
        let a = alloc();
        let id = PoolId(9, 0);
        a.create_or_incref_pool(id).unwrap();
        let s = Stream(2);
        let x = a.allocate_in_pool(id, s, MIB, 512).unwrap();
        let y = a.allocate_in_pool(id, s, 2 * MIB, 512).unwrap();
        let z = a.allocate_in_pool(id, s, 300 << 10, 512).unwrap();
        a.deallocate_ptr(y).unwrap();
        let saved = a.pool_layout(id).unwrap();
        let before = a.stats();
        // another graph's recording changes the pool
        a.deallocate_ptr(x).unwrap();
        let w = a.allocate_in_pool(id, s, 5 * MIB, 512).unwrap();
        let v = a.allocate_in_pool(id, s, 100 << 10, 512).unwrap();
        let r = a.restore_pool(id, &saved).unwrap();
        let mut freed = r.freed.clone();
        freed.sort_unstable();
        let mut want = vec![z, w, v];
        want.sort_unstable();
        assert_eq!(freed, want);
        let mut back: Vec<DevPtr> = r.allocated.iter().map(|&(p, _)| p).collect();
        back.sort_unstable();
        let mut want = vec![x, z];
        want.sort_unstable();
        assert_eq!(back, want);
        assert_eq!(a.pool_layout(id).unwrap(), saved);
        let after = a.stats();
        assert_eq!(
            after.allocated_bytes.all.current,
            before.allocated_bytes.all.current
        );
        a.check_invariants().unwrap();
        for p in [x, z] {
            a.deallocate_ptr(p).unwrap();
        }
        a.release_pool(id).unwrap();
        assert_eq!(a.stats().allocated_bytes.all.current, 0);
    }

    #[test]
    fn a_block_freed_but_waiting_on_events_is_free_in_a_checkpoint() {
        // as PyTorch's checkpoints (graph trees) see it: a free whose events are outstanding
        // (a block freed during a capture, or used by another stream) is requested, so the
        // block is free in the saved layout, merged with its free neighbours
        let dev = Arc::new(crate::resource::sim::SimulatedDevice::new(1 << 30));
        let a = CachingAllocator::new(
            dev.clone(),
            Config::parse("expandable_segments:false").unwrap(),
        )
        .unwrap();
        dev.set_auto_complete(false);
        let id = PoolId(7, 0);
        a.create_or_incref_pool(id).unwrap();
        let s = Stream(1);
        let blocks: Vec<DevPtr> = (0..11)
            .map(|_| a.allocate_in_pool(id, s, 512, 512).unwrap())
            .collect();
        for (i, &p) in blocks.iter().enumerate() {
            if i != 5 {
                a.record_stream_ptr(p, Stream(2)).unwrap();
                a.deallocate_ptr(p).unwrap();
            }
        }
        let saved = a.pool_layout(id).unwrap();
        let held: Vec<u64> = saved.segments[0]
            .blocks
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.addr)
            .collect();
        assert_eq!(held, vec![blocks[5]]);
        assert_eq!(
            saved.segments[0].blocks.len(),
            3,
            "free, the kept block, free"
        );
        dev.complete_events();
        // the snapshot (PyTorch's graph trees compare it before and after) shows the same
        // three blocks: completed frees are free, free neighbours one block
        let shown = |a: &CachingAllocator| -> Vec<(u64, bool)> {
            a.pool_segments(id).unwrap()[0]
                .blocks
                .iter()
                .map(|b| (b.size, b.allocated))
                .collect()
        };
        let before = shown(&a);
        assert_eq!(before.len(), 3, "{before:?}");
        let r = a.restore_pool(id, &saved).unwrap();
        assert_eq!(r.allocated.len(), 1);
        assert_eq!(a.pool_layout(id).unwrap(), saved);
        assert_eq!(shown(&a), before);
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_checkpoint_of_another_pool_is_refused_unchanged() {
        let a = alloc();
        let (p1, p2) = (PoolId(1, 0), PoolId(2, 0));
        a.create_or_incref_pool(p1).unwrap();
        a.create_or_incref_pool(p2).unwrap();
        let x = a.allocate_in_pool(p1, Stream(1), MIB, 512).unwrap();
        let saved = a.pool_layout(p1).unwrap();
        let y = a.allocate_in_pool(p2, Stream(1), MIB, 512).unwrap();
        assert!(a.restore_pool(p2, &saved).is_err());
        assert_eq!(a.pool_live_allocations(p2).unwrap(), vec![y]);
        a.deallocate_ptr(x).unwrap();
        a.deallocate_ptr(y).unwrap();
    }

    #[test]
    fn a_private_pool_takes_the_best_fit_not_the_block_freed_last() {
        let a = alloc();
        let id = PoolId(9, 0);
        a.create_or_incref_pool(id).unwrap();
        // two blocks of 10 MiB less 512 B fill a 20 MiB segment; the second keeps the last
        // 1,024 B (too few to split off), so it is the larger
        let n = 10 * MIB - 512;
        let x = a.allocate_in_pool(id, Stream(1), n, 512).unwrap();
        let y = a.allocate_in_pool(id, Stream(1), n, 512).unwrap();
        assert_eq!(a.pool_segments(id).unwrap().len(), 1);
        a.deallocate_ptr(x).unwrap();
        a.deallocate_ptr(y).unwrap();
        // as in PyTorch, the exact block, although the larger was freed last
        let z = a.allocate_in_pool(id, Stream(1), n, 512).unwrap();
        assert_eq!(z, x);
        a.deallocate_ptr(z).unwrap();
        a.release_pool(id).unwrap();
    }

    /// Another allocator: real host memory, with a record of what is out.
    #[derive(Default)]
    struct Other {
        out: std::sync::Mutex<Vec<(DevPtr, usize)>>,
        allocs: std::sync::atomic::AtomicUsize,
    }

    impl ExternalSource for Arc<Other> {
        fn alloc(&self, bytes: usize, _: Stream) -> Option<DevPtr> {
            let layout = std::alloc::Layout::from_size_align(bytes, 4096).ok()?;
            // SAFETY: bytes > 0 (the resource refuses 0); freed in `free` with this layout.
            let p = unsafe { std::alloc::alloc(layout) } as DevPtr;
            if p == 0 {
                return None;
            }
            self.out.lock().unwrap().push((p, bytes));
            self.allocs.fetch_add(1, Ordering::Relaxed);
            Some(p)
        }
        fn free(&self, ptr: DevPtr, bytes: usize, _: Stream) {
            let mut out = self.out.lock().unwrap();
            let i = out.iter().position(|&o| o == (ptr, bytes)).unwrap();
            out.swap_remove(i);
            let layout = std::alloc::Layout::from_size_align(bytes, 4096).unwrap();
            // SAFETY: allocated in `alloc` with this layout, freed once (removed from `out`).
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
        }
        fn name(&self) -> &str {
            "other"
        }
    }

    #[test]
    fn a_pool_over_another_allocator_caches_its_memory_and_gives_it_back() {
        let a = alloc();
        let other = Arc::new(Other::default());
        let id = PoolId(7, 0);
        a.create_or_incref_pool_over(id, Some(Box::new(other.clone())))
            .unwrap();
        let x = a.allocate_in_pool(id, Stream(1), MIB, 512).unwrap();
        assert_eq!(other.out.lock().unwrap().len(), 1);
        let seg = other.out.lock().unwrap()[0];
        assert!(x >= seg.0 && x < seg.0 + seg.1 as u64);
        // the shared pool does not take from it
        let y = a.allocate_ptr(Stream(1), MIB, 512).unwrap();
        assert_eq!(other.allocs.load(Ordering::Relaxed), 1);
        // freed blocks stay in the pool and serve it again
        a.deallocate_ptr(x).unwrap();
        let x2 = a.allocate_in_pool(id, Stream(1), MIB, 512).unwrap();
        assert_eq!(x2, x);
        assert_eq!(other.allocs.load(Ordering::Relaxed), 1);
        assert!(a.stats().reserved_bytes.all.current >= 2 * seg.1 as u64);
        // the pool's last user goes, then its last block: the memory goes back
        a.release_pool(id).unwrap();
        assert_eq!(other.out.lock().unwrap().len(), 1);
        a.deallocate_ptr(x2).unwrap();
        assert!(other.out.lock().unwrap().is_empty());
        assert!(a.pool_ids().is_empty());
        a.deallocate_ptr(y).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn another_allocators_memory_counts_against_the_budget() {
        let config = Config::parse("memory_limit_mb:64").unwrap();
        let a = CachingAllocator::new(Arc::new(HostResource::new()), config).unwrap();
        let other = Arc::new(Other::default());
        let id = PoolId(8, 0);
        a.create_or_incref_pool_over(id, Some(Box::new(other.clone())))
            .unwrap();
        let x = a.allocate_in_pool(id, Stream(1), 50 * MIB, 512).unwrap();
        // 50 MiB of the 64 are the other allocator's: the shared pool cannot take 20 more
        let e = a.allocate_ptr(Stream(1), 20 * MIB, 512).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        // nor can the pool itself grow past the budget
        let e = a
            .allocate_in_pool(id, Stream(1), 20 * MIB, 512)
            .unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(other.out.lock().unwrap().len(), 1);
        let small = a.allocate_ptr(Stream(1), MIB, 512).unwrap();
        a.deallocate_ptr(small).unwrap();
        a.deallocate_ptr(x).unwrap();
        a.release_pool(id).unwrap();
        assert!(other.out.lock().unwrap().is_empty());
        // its bytes are back in the budget
        let y = a.allocate_ptr(Stream(1), 20 * MIB, 512).unwrap();
        a.deallocate_ptr(y).unwrap();
    }
}
