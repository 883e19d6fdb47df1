//! The thread-safe caching allocator: shards of [`CachingPool`] over one backend.
//!
//! Each thread uses one shard (assigned round-robin on first use), so threads on different
//! shards never contend for a lock; PyTorch's allocator takes one mutex per device. A free goes
//! back to the shard that made the block, from any thread. When a shard runs out of memory it
//! first asks every other shard to release its cached segments, then retries.

use crate::adaptor::Limit;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::pool::summary::memory_summary;
use crate::pool::{CachingPool, Handout, SegmentInfo, SharedCounters, Stats, MAX_ALIGN};
use crate::resource::{Backend, DevPtr, Location, MemInfo, Resource, Stream};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

mod ipc;
mod pressure;
mod private;
pub use ipc::IpcExport;
pub use private::PoolId;

/// The shard lock: one atomic exchange to take it, a plain store to release it (parking_lot's
/// release is a second atomic, which costs ~10 ns on the Xeon hosts of our GPU machines).
/// Waiters yield the CPU. Shards are per thread, so waiting is rare.
type Mutex<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;
type MutexGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

/// A cache line of its own, so that shard locks do not share one.
#[repr(align(128))]
struct Padded<T>(T);

static NEXT_THREAD_SLOT: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    /// (shard count, shard index) last computed on this thread.
    static THREAD_SHARD: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    static THREAD_SLOT: usize = NEXT_THREAD_SLOT.fetch_add(1, Ordering::Relaxed);
}

struct Inner {
    /// the budget adaptor, when the configuration set one
    limit: Option<Arc<Limit>>,
    backend: Arc<dyn Backend>,
    /// the backend without the budget adaptor (pools over another allocator share the
    /// stream operations; their bytes are charged to the same budget)
    device: Arc<dyn Backend>,
    shards: Box<[Padded<Mutex<CachingPool>>]>,
    shared: Arc<SharedCounters>,
    config: Config,
    /// the accumulated counts at the last [`CachingAllocator::reset_accumulated`]
    accumulated_base: Mutex<Option<Stats>>,
    /// private pools (CUDA graphs, `torch.cuda.MemPool`): see [`PoolId`]
    private: Mutex<Vec<private::Private>>,
    /// how many private pools exist (read without the lock on the free path)
    private_count: AtomicUsize,
    /// the watch on the device's free memory (`pressure_release`)
    pressure: pressure::Pressure,
    /// `time_calls`: nanoseconds spent in allocations and frees
    time_calls: bool,
    alloc_ns: AtomicU64,
    free_ns: AtomicU64,
}

/// A block handed out by [`CachingAllocator::allocate`]. Give it back with
/// [`CachingAllocator::deallocate`]; typed buffers do that on drop.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an allocation that is never deallocated stays reserved"]
pub struct Allocation {
    ptr: DevPtr,
    size: usize,
    stream: Stream,
    shard: u32,
    id: u32,
}

impl Allocation {
    /// Device address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// Bytes requested.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Stream the block was allocated on.
    pub fn stream(&self) -> Stream {
        self.stream
    }
}

/// The caching device allocator. Cheap to clone (all clones share the pools).
#[derive(Clone)]
pub struct CachingAllocator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("backend", &self.inner.backend.name())
            .field("shards", &self.inner.shards.len())
            .finish()
    }
}

impl CachingAllocator {
    /// A caching allocator over `backend`. A `memory_fraction` or `memory_limit_mb` in the
    /// configuration wraps the backend in a [`Limit`] budget.
    pub fn new(backend: Arc<dyn Backend>, config: Config) -> Result<Self> {
        let device = backend.clone();
        let (backend, limit): (Arc<dyn Backend>, _) = match budget(&*backend, &config)? {
            Some(limit) => {
                let l = Arc::new(Limit::new(backend, limit));
                (l.clone(), Some(l))
            }
            None => (backend, None),
        };
        let shared = Arc::new(SharedCounters::default());
        let time_calls = config.pool.time_calls;
        let shards = (0..config.shard_count())
            .map(|_| {
                Padded(Mutex::new(CachingPool::new(
                    backend.clone(),
                    &config,
                    shared.clone(),
                )))
            })
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                device,
                shards,
                shared,
                config,
                limit,
                accumulated_base: Mutex::new(None),
                private: Mutex::new(Vec::new()),
                private_count: AtomicUsize::new(0),
                pressure: Default::default(),
                time_calls,
                alloc_ns: AtomicU64::new(0),
                free_ns: AtomicU64::new(0),
            }),
        })
    }

    #[inline]
    fn shard_index(&self) -> usize {
        let n = self.inner.shards.len();
        if n == 1 {
            return 0;
        }
        THREAD_SHARD.with(|c| {
            let (count, index) = c.get();
            if count == n {
                return index;
            }
            let index = THREAD_SLOT.with(|s| *s) % n;
            c.set((n, index));
            index
        })
    }

    #[inline]
    fn shard(&self, i: usize) -> MutexGuard<'_, CachingPool> {
        self.inner.shards[i].0.lock()
    }

    /// Allocate `bytes` bytes on `stream`, aligned to `align` (a power of two up to 512).
    #[inline]
    pub fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<Allocation> {
        let i = self.shard_index();
        self.allocate_in(i, stream, bytes, align, Handout::Id)
            .map(|a| Allocation {
                ptr: a.addr,
                size: bytes,
                stream,
                shard: i as u32,
                id: a.id,
            })
    }

    /// Allocate for the address-only API (C ABI, [`Resource`]): free it with
    /// [`CachingAllocator::deallocate_ptr`].
    pub fn allocate_ptr(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        let i = self.shard_index();
        self.allocate_in(i, stream, bytes, align, Handout::Address)
            .map(|a| a.addr)
    }

    #[inline]
    fn allocate_in(
        &self,
        i: usize,
        stream: Stream,
        bytes: usize,
        align: usize,
        handout: Handout,
    ) -> Result<crate::pool::PoolAlloc> {
        self.timed(&self.inner.alloc_ns, || {
            self.watch_pressure();
            let single = self.inner.shards.len() == 1;
            let r = self
                .shard(i)
                .allocate_inner(stream, bytes, align, single, handout);
            match r {
                Err(e) if !single && e.is_out_of_memory() => {
                    self.allocate_after_reclaim(i, stream, bytes, align, handout)
                }
                r => r,
            }
        })
    }

    /// `f()`, its time added to `counter` with the `time_calls` setting. (`f` is called in
    /// one place here, so that it inlines into the request path; called twice, it was kept
    /// out of line, and its arguments went through memory: 36 instructions of a same-size
    /// allocate + free.)
    #[inline(always)]
    fn timed<T>(&self, counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
        if self.inner.time_calls {
            return Self::timed_slow(counter, f);
        }
        f()
    }

    #[cold]
    #[inline(never)]
    fn timed_slow<T>(counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let r = f();
        counter.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Out of memory in shard `i`: release the other shards' caches and retry once.
    #[cold]
    fn allocate_after_reclaim(
        &self,
        i: usize,
        stream: Stream,
        bytes: usize,
        align: usize,
        handout: Handout,
    ) -> Result<crate::pool::PoolAlloc> {
        for j in (0..self.inner.shards.len()).filter(|&j| j != i) {
            self.shard(j).release_cached();
        }
        let r = self
            .shard(i)
            .allocate_inner(stream, bytes, align, true, handout);
        match r {
            Err(Error::OutOfMemory(mut report)) => {
                let stats = self.stats();
                report.reserved = stats.reserved_bytes.all.current;
                report.allocated = stats.allocated_bytes.all.current;
                report.largest_free_block = (0..self.inner.shards.len())
                    .map(|j| self.shard(j).largest_free_block())
                    .max()
                    .unwrap_or(0);
                Err(Error::OutOfMemory(report))
            }
            r => r,
        }
    }

    /// Allocate `sizes` (bytes each) on `stream` in one call: one lock, the blocks neighbours
    /// in one free block or one new segment (or run of pages) where they fit, so at most one
    /// driver call for the batch. Each comes back on its own. All or nothing.
    pub fn allocate_batch(
        &self,
        stream: Stream,
        sizes: &[usize],
        align: usize,
    ) -> Result<Vec<Allocation>> {
        let i = self.shard_index();
        let blocks = self.batch_in(i, stream, sizes, align, Handout::Id)?;
        Ok(blocks
            .into_iter()
            .zip(sizes)
            .map(|(a, &size)| Allocation {
                ptr: a.addr,
                size,
                stream,
                shard: i as u32,
                id: a.id,
            })
            .collect())
    }

    /// [`CachingAllocator::allocate_batch`] for the address-only API (C ABI): free each with
    /// [`CachingAllocator::deallocate_ptr`].
    pub fn allocate_batch_ptr(
        &self,
        stream: Stream,
        sizes: &[usize],
        align: usize,
    ) -> Result<Vec<DevPtr>> {
        let i = self.shard_index();
        Ok(self
            .batch_in(i, stream, sizes, align, Handout::Address)?
            .into_iter()
            .map(|a| a.addr)
            .collect())
    }

    fn batch_in(
        &self,
        i: usize,
        stream: Stream,
        sizes: &[usize],
        align: usize,
        handout: Handout,
    ) -> Result<Vec<crate::pool::PoolAlloc>> {
        let r = self.shard(i).allocate_batch(stream, sizes, align, handout);
        match r {
            Err(e) if self.inner.shards.len() > 1 && e.is_out_of_memory() => {
                for j in (0..self.inner.shards.len()).filter(|&j| j != i) {
                    self.shard(j).release_cached();
                }
                self.shard(i).allocate_batch(stream, sizes, align, handout)
            }
            r => r,
        }
    }

    /// Allocate for a caller that gives the block back by a token alone (a torch DataPtr's
    /// deleter): returns the address and the token for [`CachingAllocator::deallocate_token`].
    /// The block can also be freed by address ([`CachingAllocator::deallocate_ptr`]), more
    /// slowly. No address map is kept, which makes this the fastest way in and out. Tokens
    /// fit in 48 bits (shard, the block's hand-out count, slot).
    #[inline]
    pub fn allocate_token(
        &self,
        stream: Stream,
        bytes: usize,
        align: usize,
    ) -> Result<(DevPtr, u64)> {
        let i = self.shard_index();
        self.allocate_in(i, stream, bytes, align, Handout::Token)
            .map(|a| {
                let token = (i as u64) << 40 | u64::from(a.generation) << 32 | u64::from(a.id);
                (a.addr, token)
            })
    }

    /// Return a block from [`CachingAllocator::allocate_token`] by its token; returns its
    /// address. A token used twice is an error, never undefined behaviour.
    #[inline]
    pub fn deallocate_token(&self, token: u64) -> Result<DevPtr> {
        self.timed(&self.inner.free_ns, || {
            let (i, generation, id) = self.token_parts(token)?;
            self.shard(i).free_by_id(id, generation)
        })
    }

    /// (shard, hand-out count, slot) of a token of [`CachingAllocator::allocate_token`].
    fn token_parts(&self, token: u64) -> Result<(usize, u8, u32)> {
        let i = (token >> 40) as usize;
        if i >= self.inner.shards.len() {
            return Err(Error::InvalidArgument(format!(
                "token {token:#x}: no such shard"
            )));
        }
        Ok((i, (token >> 32) as u8, token as u32))
    }

    /// [`CachingAllocator::record_stream`] for a block of [`CachingAllocator::allocate_token`].
    pub fn record_stream_token(&self, token: u64, stream: Stream) -> Result<()> {
        let (i, generation, id) = self.token_parts(token)?;
        self.shard(i).record_stream_by_id(id, generation, stream)
    }

    /// Return an allocation; it is reused in order on its stream.
    #[inline]
    pub fn deallocate(&self, a: Allocation) -> Result<()> {
        self.timed(&self.inner.free_ns, || {
            self.shard(a.shard as usize).free_block_id(a.id, a.ptr)
        })
    }

    /// Return a block from [`CachingAllocator::allocate_ptr`] by its address alone (the C ABI
    /// path): unknown pointers and double frees are errors, never undefined behaviour.
    pub fn deallocate_ptr(&self, ptr: DevPtr) -> Result<()> {
        self.timed(&self.inner.free_ns, || self.deallocate_ptr_untimed(ptr))
    }

    fn deallocate_ptr_untimed(&self, ptr: DevPtr) -> Result<()> {
        let first = self.shard_index();
        let mut err = None;
        for j in std::iter::once(first).chain((0..self.inner.shards.len()).filter(|&j| j != first))
        {
            match self.shard(j).free(ptr) {
                Ok(()) => return Ok(()),
                Err(e @ Error::DoubleFree { .. }) => err = Some(e),
                Err(_) => {}
            }
        }
        if let Some(r) = self.free_private(ptr) {
            return r;
        }
        Err(err.unwrap_or(Error::UnknownPointer { ptr }))
    }

    /// Mark a live block as used by `stream` too (PyTorch's `record_stream`).
    pub fn record_stream(&self, a: &Allocation, stream: Stream) -> Result<()> {
        self.shard(a.shard as usize)
            .record_stream_id(a.id, a.ptr, stream)
    }

    /// [`CachingAllocator::record_stream`] by address.
    pub fn record_stream_ptr(&self, ptr: DevPtr, stream: Stream) -> Result<()> {
        for j in 0..self.inner.shards.len() {
            let mut s = self.shard(j);
            if s.owns(ptr) {
                return s.record_stream(ptr, stream);
            }
        }
        if let Some(r) = self.record_stream_private(ptr, stream) {
            return r;
        }
        Err(Error::UnknownPointer { ptr })
    }

    /// Release every unused cached segment to the device; returns the bytes released.
    pub fn empty_cache(&self) -> u64 {
        (0..self.inner.shards.len())
            .map(|j| self.shard(j).empty_cache())
            .sum::<u64>()
            + self.private_empty_cache()
    }

    /// Pre-populate the calling thread's shard with blocks of the given sizes.
    pub fn reserve(&self, stream: Stream, sizes: &[usize]) -> Result<()> {
        self.shard(self.shard_index()).reserve(stream, sizes)
    }

    /// Statistics over all shards. Currents and totals are exact; `reserved_bytes.all.peak` is
    /// exact, and so is `allocated_bytes.all.peak` with one shard, private pools or not (see
    /// `SharedCounters::tracking`); other peaks are exact with one shard and no private pool,
    /// an upper bound otherwise.
    pub fn stats(&self) -> Stats {
        let mut total = Stats::default();
        for j in 0..self.inner.shards.len() {
            total.merge(&self.shard(j).stats());
        }
        self.private_stats(&mut total);
        total.reserved_bytes.all.peak = self.inner.shared.peak_reserved.load(Ordering::Relaxed);
        if self.inner.shared.tracking.load(Ordering::Acquire) {
            // (private pools: their own peaks and the shards' came at other times)
            total.allocated_bytes.all.peak =
                self.inner.shared.peak_allocated.load(Ordering::Relaxed);
        }
        total.num_pressure_releases = self.inner.pressure.releases.load(Ordering::Relaxed);
        total.host_alloc_ns = self.inner.alloc_ns.load(Ordering::Relaxed);
        total.host_free_ns = self.inner.free_ns.load(Ordering::Relaxed);
        if let Some(v) = self.inner.backend.virtual_memory() {
            let c = v.calls();
            total.vmm_calls_foreground = c.foreground;
            total.vmm_calls_background = c.background;
            total.vmm_spare_bytes = c.spare_bytes;
            total.vmm_waits = c.waits;
            total.vmm_aliased = c.aliased;
            total.vmm_wait_ns = c.wait_ns;
            total.vmm_unmap_ns = c.unmap_ns;
            total.vmm_map_ns = c.map_ns;
            total.vmm_access_ns = c.access_ns;
            total.vmm_creates = c.creates;
            total.vmm_maps = c.maps;
            total.vmm_set_access = c.set_access;
            total.vmm_unmaps = c.unmaps;
            total.vmm_releases = c.releases;
            total.vmm_records = c.records;
        }
        if let Some(base) = self.inner.accumulated_base.lock().as_ref() {
            total.subtract_accumulated(base);
        }
        total
    }

    /// Start the accumulated counts over (`torch.cuda.reset_accumulated_memory_stats`): every
    /// `allocated` and `freed` total, and the counts of retries, out-of-memory errors, syncs
    /// and device calls, read 0 from now on; currents and peaks are kept.
    pub fn reset_accumulated(&self) {
        *self.inner.accumulated_base.lock() = None;
        let now = self.stats();
        *self.inner.accumulated_base.lock() = Some(now);
    }

    /// Set every peak to its current value.
    pub fn reset_peak(&self) {
        for j in 0..self.inner.shards.len() {
            self.shard(j).reset_peak();
        }
        self.private_reset_peak();
        let shared = &self.inner.shared;
        shared
            .peak_allocated
            .store(shared.allocated.load(Ordering::Relaxed), Ordering::Relaxed);
        let now = self.inner.shared.reserved.load(Ordering::Relaxed);
        self.inner
            .shared
            .peak_reserved
            .store(now, Ordering::Relaxed);
    }

    /// A text table like `torch.cuda.memory_summary()`.
    pub fn memory_summary(&self) -> String {
        let title = format!(
            "{} backend, {} shard(s)",
            self.inner.backend.name(),
            self.inner.shards.len()
        );
        memory_summary(&title, &self.stats())
    }

    /// Start recording allocator events (allocations, frees, segments and page maps) on every
    /// shard, in the JSON Lines trace format (the trace module writes it); an earlier recording is
    /// dropped. While off, recording costs one branch per call.
    pub fn start_recording(&self) {
        let start = std::time::Instant::now();
        for j in 0..self.inner.shards.len() {
            self.shard(j).start_recording(start);
        }
    }

    /// Stop recording and return the events of all shards in time order.
    pub fn stop_recording(&self) -> Vec<crate::pool::record::TraceEvent> {
        self.collect_recorded(true)
    }

    /// The events recorded since the last call (or the start), in time order; recording goes
    /// on (for a history kept elsewhere, as `torch.cuda.memory._snapshot` reads it).
    pub fn take_recorded(&self) -> Vec<crate::pool::record::TraceEvent> {
        self.collect_recorded(false)
    }

    /// Whether events are being recorded.
    pub fn is_recording(&self) -> bool {
        self.shard(0).is_recording()
    }

    fn collect_recorded(&self, stop: bool) -> Vec<crate::pool::record::TraceEvent> {
        let mut all: Vec<(u64, usize, crate::pool::record::TraceEvent)> = Vec::new();
        for j in 0..self.inner.shards.len() {
            let events = if stop {
                self.shard(j).stop_recording()
            } else {
                self.shard(j).take_recorded()
            };
            all.extend(
                events
                    .into_iter()
                    .enumerate()
                    .map(|(i, (ns, e))| (ns, i, e)),
            );
        }
        all.sort_by_key(|&(ns, i, _)| (ns, i));
        all.into_iter().map(|(_, _, e)| e).collect()
    }

    /// Change the budget to `fraction` of the device's memory
    /// (`torch.cuda.set_per_process_memory_fraction`). Needs an allocator built with a budget
    /// (`memory_fraction` or `memory_limit_mb`; `memory_fraction:1` for none yet).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        // 0 is allowed, as in PyTorch: nothing more may be reserved
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction}: must be in [0, 1]"
            )));
        }
        let Some(limit) = &self.inner.limit else {
            return Err(Error::Config(
                "this allocator has no budget to change: build it with memory_fraction".into(),
            ));
        };
        let total = self.inner.backend.mem_info()?.total;
        limit.set_limit((total as f64 * fraction) as u64);
        Ok(())
    }

    /// PyTorch's run-time allocator settings (`torch.cuda.memory._set_allocator_settings`,
    /// parsed with [`Config::parse`](crate::Config::parse)): `config`'s `max_split_size_mb`,
    /// `roundup_power2_divisions` and `garbage_collection_threshold` replace the pools' (each
    /// back to its default where the string named none, as PyTorch resets them). Other keys
    /// apply only when an allocator is built.
    pub fn set_runtime_settings(&self, config: &crate::Config) {
        for j in 0..self.inner.shards.len() {
            self.shard(j).set_runtime_settings(config);
        }
        self.private_set_runtime_settings(config);
    }

    /// Largest free cached block over all shards (see [`CachingPool::largest_free_block`]).
    pub fn largest_free_block(&self) -> u64 {
        (0..self.inner.shards.len())
            .map(|j| self.shard(j).largest_free_block())
            .max()
            .unwrap_or(0)
    }

    /// The free memory in mapped whole pages of the shared pools' expandable segments, by
    /// what a page move can do with it: `(movable, stranded)` bytes, those in physical
    /// handles that hold only free bytes and those in handles that blocks in use also cover
    /// (see [`crate::pool::CachingPool::free_page_kinds`]). Both 0 with classic segments.
    pub fn free_page_kinds(&self) -> (u64, u64) {
        (0..self.inner.shards.len())
            .map(|j| self.shard(j).free_page_kinds())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// The largest block one allocation could take now without anything being freed: the
    /// largest free cached block, or the device's free memory (within the memory budget)
    /// where that is more. This is what PyTorch's own allocator reports to `cacheInfo`
    /// (free memory as the first guess, then its cached blocks), and what cuDNN's
    /// convolutions size their workspace by: reporting the cache alone would hold them to
    /// slower algorithms with small workspaces whenever the cache runs tight (a planned
    /// layout, memory moved to where it is needed).
    pub fn largest_available_block(&self) -> u64 {
        let free = self.inner.backend.mem_info().map_or(0, |m| m.free);
        self.largest_free_block().max(free)
    }

    /// True when the pools use expandable (virtual-memory) segments.
    pub fn expandable(&self) -> bool {
        self.shard(0).expandable()
    }

    /// Segments of the shared pool only, every shard's (a private pool's: see
    /// [`CachingAllocator::pool_segments`]).
    pub fn shared_segments(&self) -> Vec<SegmentInfo> {
        (0..self.inner.shards.len())
            .flat_map(|j| self.shard(j).segments())
            .collect()
    }

    /// Every segment of every shard and private pool with its blocks (for inspection and
    /// drawing).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut all = self.shared_segments();
        all.extend(self.private_segments());
        all
    }

    /// Check each shard's invariants (tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        (0..self.inner.shards.len()).try_for_each(|j| self.shard(j).check_invariants())?;
        self.private_check_invariants()
    }

    /// Tell `hook` of every range of memory that comes to this allocator's pools (private
    /// pools included) or leaves them, from now on (see [`crate::pool::SegmentHook`]).
    pub fn add_segment_hook(&self, hook: crate::pool::SegmentHook) {
        self.inner.shared.add_segment_hook(hook);
    }

    /// The backend (with its budget adaptor, if any).
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.inner.shards.len()
    }
}

/// The byte budget a configuration asks for, if any.
fn budget(backend: &dyn Backend, config: &Config) -> Result<Option<u64>> {
    let from_fraction = match config.budget.memory_fraction {
        Some(f) => Some((backend.mem_info()?.total as f64 * f) as u64),
        None => None,
    };
    Ok(match (from_fraction, config.budget.memory_limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

/// The allocator is itself a resource, so adaptors compose over it (RMM style).
impl Resource for CachingAllocator {
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if align > MAX_ALIGN {
            return Err(Error::InvalidAlignment {
                align,
                max: MAX_ALIGN,
            });
        }
        self.allocate_ptr(stream, bytes, align)
    }
    fn deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: Stream) -> Result<()> {
        self.deallocate_ptr(ptr)
    }
    fn mem_info(&self) -> Result<MemInfo> {
        self.inner.backend.mem_info()
    }
    fn device_mem_info(&self) -> Result<MemInfo> {
        self.inner.backend.device_mem_info()
    }
    fn limit(&self) -> Option<u64> {
        self.inner.backend.limit()
    }
    fn name(&self) -> &str {
        "gpumem"
    }
    fn location(&self) -> Location {
        self.inner.backend.location()
    }
    fn peer_access(&self) -> Option<&dyn crate::resource::PeerAccess> {
        self.inner.backend.peer_access()
    }
}

crate::resource::forward_stream_ops!(CachingAllocator, |s| s.inner.backend);
