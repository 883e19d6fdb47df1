//! The caching pool policy: pure Rust, no CUDA calls.
//!
//! One [`CachingPool`] serves one shard of an allocator. It obtains *segments* from a
//! [`Backend`] and carves them into *blocks*. The files, in the order a request meets them:
//!
//! - `request.rs`: allocate and free. Sizes are rounded to 512 B (optionally to power-of-two
//!   divisions, [`size::round_size`]); blocks up to 1 MiB live in the small pool, larger ones in
//!   the large pool. A short *quick cache* keeps the last few freed blocks for exact-size reuse
//!   before they are coalesced (flushed before the pool ever grows, so it never costs memory);
//!   otherwise the best-fitting free block of the stream and pool is taken (per-stream size
//!   bins, `free_index.rs`: O(log n)), and the segment kind places the request.
//! - `arena.rs`: block and segment slots, links, free sets, split and coalesce.
//! - `classic.rs`: classic segments (PyTorch's native policy): one device allocation each, a
//!   stream that finds nothing of its own may take a wholly free segment another stream cached
//!   (after an event wait), growth with retries (release cached segments, retry, wait for
//!   pending events, release again, retry, then [`Error::OutOfMemory`]), garbage collection.
//! - `expandable.rs`: where the backend has virtual memory
//!   ([`crate::resource::Resource::virtual_memory`]) and `expandable_segments` is on (the
//!   default), each stream and pool gets one large reserved address range whose pages are
//!   backed by physical memory only where blocks need them. Before the pool maps past the
//!   high-water mark of reserved bytes (or just past the peak of allocated bytes), it moves
//!   pages that lie wholly inside free blocks, within a time budget (`budget.rs`), so the
//!   physical memory follows the live bytes.
//! - `lending.rs`: with several streams, a stream that would have to move pages takes a free,
//!   mapped block of another stream's expandable segment instead, ordered after that stream's
//!   work by an event wait on the GPU (as `cudaMallocAsync` shares one pool across streams).
//! - `repeat.rs`, `plan/` (`planned_layout`, on by default): a job whose large-block
//!   events repeat gets its step placed once by the blocks' lifetimes, in its large
//!   expandable segment around the blocks that stay, and served by position in the period.
//! - `events.rs`: blocks other streams still use ([`CachingPool::record_stream`]) wait for
//!   events before reuse; checkpoint events tell which freed pages are idle.
//! - `inspect.rs`: segment listings, the out-of-memory report, the invariant checker.
//! - `record.rs`: the events the pool emits when recording (the trace module writes them).
//! - `stats.rs`, `summary.rs`, `size.rs`: statistics with PyTorch's names, the summary table,
//!   size rounding; `pinned.rs`: the pinned host pool's policy.

mod arena;
mod batch;
mod budget;
mod checkpoint;
mod classic;
mod events;
mod expandable;
mod free_index;
mod inspect;
mod lending;
pub mod pinned;
mod plan;
pub mod record;
mod repeat;
mod request;
pub mod size;
pub mod stats;
pub mod summary;

use crate::config::Config;
use crate::error::{Error, OomReport, Result};
use crate::resource::{unsupported, Backend, DevPtr, Event, Stream, VirtualMemory};
pub use budget::{
    warms_up, CAP_NS as MOVE_BUDGET_CAP_NS, SHARE as MOVE_BUDGET_SHARE,
    WARM_GROWTH as MOVE_BUDGET_WARM_GROWTH, WINDOW_NS as MOVE_BUDGET_WINDOW_NS,
};
pub use checkpoint::{BlockLayout, Layout, Restored, SegmentLayout};
use expandable::Pages;
use free_index::FreeIndex;
use record::{Action, Recorder};
use rustc_hash::FxHashMap;
use serde::Serialize;
use size::{round_size, segment_size, LARGE_SEGMENT, MAX_REQUEST, MIN_BLOCK, SMALL_SIZE};
use stats::HotStats;
pub use stats::{PoolKind, Stat, StatArray, Stats};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Largest alignment the pool guarantees for every block.
pub const MAX_ALIGN: usize = MIN_BLOCK as usize;
const NIL: u32 = u32::MAX;
/// How many same-stream candidates a cross-stream search looks at per stream.
const STEAL_SCAN: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// in a free set, coalesced with its neighbours
    Free,
    /// in the quick cache: free but not yet coalesced
    Quick,
    /// handed out
    Allocated,
    /// freed by the caller, waiting for events on other streams
    Pending,
    /// a retired slot
    Dead,
}

#[derive(Debug)]
struct Block {
    // 64 bytes: one cache line (checked by a test)
    addr: u64,
    size: u64,
    /// bytes asked for by the current (or last) allocation
    requested: u64,
    /// rounded size of that request: the quick-cache key
    rounded: u64,
    stream: Stream,
    segment: u32,
    prev: u32,
    next: u32,
    state: State,
    kind: PoolKind,
    /// other streams recorded as users (record_stream); boxed to keep blocks to a cache line
    #[allow(clippy::box_collection)] // 8 bytes instead of 24: see `a_block_is_one_cache_line`
    uses: Option<Box<Vec<Stream>>>,
    /// how the caller will give the block back
    handout: Handout,
    /// counts the block's hand-outs (a token carries it, so a stale token is refused)
    generation: u8,
}

#[derive(Debug)]
struct Segment {
    addr: u64,
    /// bytes (address space, for an expandable segment)
    size: u64,
    stream: Stream,
    kind: PoolKind,
    head: u32,
    last_used: u64,
    /// which pages are mapped, for an expandable segment
    pages: Option<Box<Pages>>,
    /// a planned layout's region (see `plan/`): its free blocks stay out of the free sets
    planned: bool,
}

/// A lent block's use, remembered by the free block it went back to: the stream it was lent
/// to, the tick it was given back at, and its bytes `[lo, hi)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForeignUse {
    stream: Stream,
    tick: u64,
    lo: u64,
    hi: u64,
}

/// (stream, size, address, block id), for the invariant check.
type FreeKey = (u64, u64, u64, u32);

/// Counters shared by all shards of one allocator (updated only when segments come and go,
/// and, once private pools exist, at every allocation and free: see `allocated`).
#[derive(Debug, Default)]
pub struct SharedCounters {
    /// bytes reserved by all shards
    pub reserved: AtomicU64,
    /// peak of `reserved`
    pub peak_reserved: AtomicU64,
    /// whether `allocated` and `peak_allocated` are kept: from when the allocator's first
    /// private pool (a CUDA graph's, a `MemPool`) is made. Before, the one shard's own peak is
    /// the device's; after, a pool's own peak is not: the sum of each pool's peak overstated
    /// `torch.compile(mode="reduce-overhead")` training's on an H200 by 346 MiB of 2,261 (the
    /// graphs' warm-up in their pool and the optimizer's step in the shard peak apart)
    pub tracking: std::sync::atomic::AtomicBool,
    /// bytes allocated in every pool of the allocator together (while `tracking`)
    pub allocated: AtomicU64,
    /// peak of `allocated` (while `tracking`)
    pub peak_allocated: AtomicU64,
    /// CUDA-graph captures under way on the device: while any is, the pool asks the backend
    /// whether a stream is capturing before it records an event there
    pub captures: std::sync::atomic::AtomicU32,
    /// who is told of memory coming and going (see [`SegmentHook`])
    hook: SegmentHooks,
}

/// Memory that comes to a pool or leaves it, as a [`SegmentHook`] hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentChange {
    /// a classic segment was obtained (told after it exists)
    Alloc,
    /// a classic segment is about to go back (told before)
    Free,
    /// pages of an expandable segment were mapped (told after)
    Map,
    /// pages of an expandable segment are about to be unmapped (told before: a user of the
    /// range, such as NCCL's buffer registration, lets go of it first)
    Unmap,
}

/// One change a [`SegmentHook`] hears of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEvent {
    /// what happens
    pub change: SegmentChange,
    /// the range that comes or goes: its address...
    pub addr: DevPtr,
    /// ...and its bytes
    pub bytes: u64,
    /// the segment's stream
    pub stream: Stream,
    /// the private pool the segment belongs to (PyTorch's `MempoolId_t`; (0, 0): the
    /// shared pool)
    pub pool: (u64, u64),
}

/// Told of every range of memory that comes to the pools or leaves them, in order: a range is
/// told as mapped before any block in it is handed out, and as unmapped or freed before the
/// driver is asked to unmap or free it. Called on the allocating thread with the pool's lock
/// held: it must not call the allocator. (PyTorch's allocator trace trackers, through which
/// NCCL registers memory, hang here: see the adaptor layer's `registration`.)
pub type SegmentHook = Arc<dyn Fn(&SegmentEvent) + Send + Sync>;

#[derive(Default)]
struct SegmentHooks {
    any: std::sync::atomic::AtomicBool,
    hooks: std::sync::RwLock<Vec<SegmentHook>>,
}

impl std::fmt::Debug for SegmentHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SegmentHooks")
    }
}

impl SharedCounters {
    /// `n` bytes handed out by a pool: counted across pools while `tracking`.
    #[inline(always)]
    pub(crate) fn on_alloc(&self, n: u64) {
        if self.tracking.load(Ordering::Relaxed) {
            self.note_allocated(n);
        }
    }

    /// `n` bytes returned to a pool: counted across pools while `tracking`.
    #[inline(always)]
    pub(crate) fn on_free(&self, n: u64) {
        if self.tracking.load(Ordering::Relaxed) {
            self.note_freed(n);
        }
    }

    #[cold]
    fn note_allocated(&self, n: u64) {
        let now = self.allocated.fetch_add(n, Ordering::Relaxed) + n;
        if now > self.peak_allocated.load(Ordering::Relaxed) {
            self.peak_allocated.fetch_max(now, Ordering::Relaxed);
        }
    }

    #[cold]
    fn note_freed(&self, n: u64) {
        let _ = self
            .allocated
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| {
                Some(a.saturating_sub(n))
            });
    }

    /// Add `hook`: it hears of every change from now on.
    pub fn add_segment_hook(&self, hook: SegmentHook) {
        if let Ok(mut h) = self.hook.hooks.write() {
            h.push(hook);
            self.hook.any.store(true, Ordering::Release);
        }
    }

    /// Whether any hook listens (the callers compute a run only then).
    #[inline]
    pub(crate) fn heard(&self) -> bool {
        self.hook.any.load(Ordering::Acquire)
    }

    /// Tell the hooks of `event`.
    pub(crate) fn tell(&self, event: &SegmentEvent) {
        if !self.heard() {
            return;
        }
        if let Ok(h) = self.hook.hooks.read() {
            for f in h.iter() {
                f(event);
            }
        }
    }
}

/// How a caller gives a block back ([`CachingPool::allocate_inner`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handout {
    /// by id and address ([`CachingPool::free_block_id`]): typed buffers, the Rust API
    Id,
    /// by address ([`CachingPool::free`]): the block is listed in the address map
    Address,
    /// by id alone ([`CachingPool::free_by_id`]: a torch DataPtr's deleter), or by address
    /// (found by walking its segment, for the rare caller that has only the address)
    Token,
}

/// What [`CachingPool::allocate`] hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolAlloc {
    /// address of the block
    pub addr: DevPtr,
    /// rounded size of the block
    pub block_size: u64,
    /// the block's slot, for [`CachingPool::free_block_id`]
    pub id: u32,
    /// the block's hand-out count, for [`CachingPool::free_by_id`]
    pub generation: u8,
}

/// A block as reported by [`CachingPool::segments`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// address
    pub addr: u64,
    /// size in bytes
    pub size: u64,
    /// bytes requested (a free block: those last requested at its address, 0 if none, as
    /// PyTorch's snapshots report them)
    pub requested: u64,
    /// handed out or waiting on events
    pub active: bool,
    /// handed out
    pub allocated: bool,
}

/// A segment as reported by [`CachingPool::segments`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    /// base address
    pub addr: u64,
    /// size in bytes
    pub size: u64,
    /// owning stream
    pub stream: Stream,
    /// pool
    pub kind: PoolKind,
    /// an expandable (virtual-memory) segment
    pub expandable: bool,
    /// a planned layout's region (see `plan/`), not the dynamic pool's
    pub planned: bool,
    /// `(address, bytes)` ranges backed by memory: all of a classic segment, the mapped pages of
    /// an expandable one
    pub mapped: Vec<(u64, u64)>,
    /// blocks in address order
    pub blocks: Vec<BlockInfo>,
}

/// The policy settings a pool reads on its paths.
#[derive(Debug, Clone)]
struct Policy {
    max_split: u64,
    divisions: crate::config::Power2Divisions,
    gc_threshold: Option<f64>,
    quick_cap: usize,
    cross_stream: bool,
    /// page size of expandable segments; `None` = classic segments
    page: Option<u64>,
    /// page moves within the time budget (off: map and keep)
    moves: bool,
    /// blocks are never split: a request takes a whole free block or segment
    /// (`torch.cuda.MemPool(no_split=True)`)
    no_split: bool,
}

/// One shard of the caching allocator. Not thread-safe by itself: the allocator puts each
/// shard behind its own lock.
pub struct CachingPool {
    backend: Arc<dyn Backend>,
    /// the private pool's id, for the segment hooks ((0, 0): the shared pool)
    tag: (u64, u64),
    policy: Policy,
    shared: Arc<SharedCounters>,
    /// bytes the pool may hold (budget or device total), for garbage collection
    capacity: u64,
    blocks: Vec<Block>,
    spare_blocks: Vec<u32>,
    segments: Vec<Segment>,
    spare_segments: Vec<u32>,
    segment_index: BTreeMap<u64, u32>,
    /// free blocks of `streams[i]`: `free[i][0]` small pool, `free[i][1]` large pool
    free: Vec<[FreeIndex; 2]>,
    live: FxHashMap<DevPtr, u32>,
    /// `(rounded size, stream, block, tick of the user's free)`
    quick: Vec<(u64, Stream, u32, u64)>,
    /// +8 per quick-cache hit, -1 per miss, within ±64: below 0 the cache is mostly bypassed
    quick_score: i32,
    quick_probe: u32,
    /// freed blocks waiting for events other streams recorded (`record_stream`)
    pending: events::Pending,
    /// freed blocks used by a stream that was capturing a CUDA graph when they were freed:
    /// their events are recorded once the capture ends ([`CachingPool::end_capture`]), unless
    /// the block's own stream joins the work of those streams (the graph nodes they had
    /// reached at the free) before: then the block is free again within the capture
    deferred: Vec<(u32, Vec<Stream>, Option<Vec<u64>>)>,
    streams: Vec<Stream>,
    /// streams with blocks handed out, and how many: such a stream is alive (blocks must not
    /// outlive their streams), so a checkpoint may be recorded there when another stream
    /// needs one (see `events.rs`)
    live_on: Vec<(Stream, u32)>,
    /// the stream whose user is freeing a block now (so it is alive), during a free
    freeing: Option<Stream>,
    stats: HotStats,
    tick: u64,
    /// highest allocated bytes seen when mapping pages (expandable segments)
    peak_allocated: u64,
    /// per stream: which freed pages are idle, and the events that will tell
    checkpoints: Vec<events::StreamCheckpoints>,
    /// free ticks up to this one are idle on every stream (after a device synchronisation)
    device_safe: u64,
    /// the time budget of page moves
    budget: budget::MoveBudget,
    /// the job's period and its planned layouts (see `plan/`)
    plans: plan::Plans,
    /// highest reserved bytes of this pool since its cache was last released (expandable
    /// segments: below it, pages are mapped rather than moved)
    high_water: u64,
    /// the high-water mark the pool had when the job last emptied its cache
    /// (`empty_cache`; 0 after a release for memory): a plan kept through it maps its region
    /// back up to that mark without moves (`plan_mark`), and so does any plan made since,
    /// until a give-back or a release for memory lowers it
    emptied_mark: u64,
    /// the device's last look for its headroom (expandable segments): free bytes (spare
    /// handles counted), every shard's reserved bytes then, and when (the backend's clock)
    device_look: (u64, u64, u64),
    /// blocks of another stream's expandable segment handed out, with the stream using them
    lent: FxHashMap<u32, Stream>,
    /// free blocks with parts last used by other streams than their own (lent blocks given
    /// back, merged into them): whose work, up to which free tick, on which bytes
    foreign: FxHashMap<u32, Vec<ForeignUse>>,
    /// `(waiter, other, tick)`: `waiter` was ordered after `other`'s frees up to `tick`
    cross_waited: Vec<(Stream, Stream, u64)>,
    /// trace recording, when on
    recorder: Option<Box<Recorder>>,
}

impl std::fmt::Debug for CachingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingPool")
            .field("backend", &self.backend.name())
            .field("segments", &self.segment_index.len())
            .field("live", &self.live.len())
            .finish()
    }
}

impl CachingPool {
    /// The backend's virtual memory (there whenever the pool has expandable segments).
    fn vmm(&self) -> Result<&dyn VirtualMemory> {
        self.backend
            .virtual_memory()
            .ok_or_else(|| unsupported(self.backend.name(), "virtual-memory segments"))
    }

    /// A pool over `backend` with the given configuration and shared counters.
    pub fn new(backend: Arc<dyn Backend>, config: &Config, shared: Arc<SharedCounters>) -> Self {
        let capacity = backend
            .limit()
            .or_else(|| backend.mem_info().ok().map(|m| m.total))
            .unwrap_or(u64::MAX);
        // expandable segments take a page size that is a power of two (the driver's
        // granularity is), else the pool keeps classic segments
        let page = backend
            .virtual_memory()
            .map(|v| v.page_size())
            .filter(|&p| config.pool.expandable_segments && p >= MIN_BLOCK && p.is_power_of_two());
        Self {
            backend,
            tag: (0, 0),
            policy: Policy {
                max_split: config.pool.max_split_size.unwrap_or(u64::MAX),
                divisions: config.pool.roundup_power2_divisions.clone(),
                gc_threshold: config.pool.garbage_collection_threshold,
                quick_cap: config.pool.quick_cache,
                cross_stream: config.pool.cross_stream_reuse,
                page,
                moves: config.pool.page_moves,
                no_split: false,
            },
            shared,
            capacity,
            blocks: Vec::new(),
            spare_blocks: Vec::new(),
            segments: Vec::new(),
            spare_segments: Vec::new(),
            segment_index: BTreeMap::new(),
            free: Vec::new(),
            live: FxHashMap::default(),
            quick: Vec::with_capacity(config.pool.quick_cache),
            quick_score: 0,
            quick_probe: 0,
            pending: Default::default(),
            deferred: Vec::new(),
            streams: Vec::new(),
            live_on: Vec::new(),
            freeing: None,
            stats: HotStats::default(),
            tick: 0,
            peak_allocated: 0,
            checkpoints: Vec::new(),
            device_safe: 0,
            budget: Default::default(),
            plans: plan::Plans::new(page.is_some() && config.pool.planned_layout),
            high_water: 0,
            emptied_mark: 0,
            device_look: (0, 0, 0),
            lent: FxHashMap::default(),
            foreign: FxHashMap::default(),
            cross_waited: Vec::new(),
            recorder: None,
        }
    }

    /// Never split blocks from now on: a request takes a whole free block, or a segment of its
    /// own (`torch.cuda.MemPool(no_split=True)`; blocks already split stay so).
    pub fn set_no_split(&mut self) {
        self.policy.no_split = true;
    }

    /// Take the settings PyTorch changes at run time (`_set_allocator_settings`) from `config`:
    /// `max_split_size_mb`, `roundup_power2_divisions`, `garbage_collection_threshold`. Blocks
    /// already cached keep their sizes; later requests follow the new settings.
    pub fn set_runtime_settings(&mut self, config: &Config) {
        self.policy.max_split = config.pool.max_split_size.unwrap_or(u64::MAX);
        self.policy.divisions = config.pool.roundup_power2_divisions.clone();
        self.policy.gc_threshold = config.pool.garbage_collection_threshold;
    }

    /// True when this pool uses expandable (virtual-memory) segments.
    pub fn expandable(&self) -> bool {
        self.policy.page.is_some()
    }

    /// The backend segments come from.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Current statistics of this pool.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.snapshot();
        s.page_move_ns = self.budget.spent_ns;
        s.page_move_longest_ns = self.budget.longest_ns;
        s.page_growth_ns = self.budget.growth_ns;
        s.num_move_stops = self.budget.stops;
        if self.plans.busy() {
            s.plan_reserved_bytes = self.planned_bytes();
            s.plans_pending = self.plans.pending();
        }
        s
    }

    /// Set every peak statistic to its current value.
    pub fn reset_peak(&mut self) {
        self.stats.reset_peak();
    }

    /// Tell the hooks of a classic segment's `change`.
    pub(super) fn tell_classic(
        &self,
        change: SegmentChange,
        addr: DevPtr,
        size: u64,
        stream: Stream,
    ) {
        if self.shared.heard() {
            self.shared.tell(&SegmentEvent {
                change,
                addr,
                bytes: size,
                stream,
                pool: self.tag,
            });
        }
    }

    /// Tell the hooks of `change` to pages `[first, first + n)` of expandable segment `seg`
    /// (mapped: after a map, before an unmap).
    pub(super) fn tell_pages(&self, change: SegmentChange, seg: u32, first: u64, n: u64) {
        if !self.shared.heard() {
            return;
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let s = &self.segments[seg as usize];
        self.shared.tell(&SegmentEvent {
            change,
            addr: s.addr + first * page,
            bytes: n * page,
            stream: s.stream,
            pool: self.tag,
        });
    }

    /// Name the private pool this pool is (its segment events carry it).
    pub fn set_tag(&mut self, tag: (u64, u64)) {
        self.tag = tag;
    }

    /// True if `addr` is a live block of this pool.
    pub fn owns(&self, addr: DevPtr) -> bool {
        self.find_allocated(addr).is_some()
    }
}

impl Drop for CachingPool {
    fn drop(&mut self) {
        let live = self.stats.allocation_count();
        if live > 0 {
            tracing::warn!(
                "gpumem: pool dropped with {live} live allocation(s); their memory is released"
            );
        }
        for e in self.pending.events() {
            let _ = self.backend.sync_event(e);
            self.backend.destroy_event(e);
        }
        for &(ev, _) in self.checkpoints.iter().flat_map(|c| c.outstanding.iter()) {
            self.backend.destroy_event(ev);
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mut synced = false;
        for seg in self.segment_index.values() {
            let s = &self.segments[*seg as usize];
            let Some(pages) = &s.pages else {
                self.tell_classic(SegmentChange::Free, s.addr, s.size, s.stream);
                let _ = self.backend.deallocate(s.addr, s.size as usize, s.stream);
                self.shared.reserved.fetch_sub(s.size, Ordering::Relaxed);
                continue;
            };
            if pages.mapped > 0 && !synced {
                // the segments' streams may be gone by now: wait for the whole device
                let _ = self.backend.synchronize_device();
                synced = true;
            }
            for (f, n) in pages.runs(0, s.size / page, true) {
                self.tell_pages(SegmentChange::Unmap, *seg, f, n);
                if self
                    .vmm()
                    .and_then(|v| v.unmap(s.addr + f * page, n * page))
                    .is_ok()
                {
                    self.shared.reserved.fetch_sub(n * page, Ordering::Relaxed);
                }
            }
            let _ = self.vmm().and_then(|v| v.release_address(s.addr, s.size));
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
#[test]
fn a_block_is_one_cache_line() {
    assert!(std::mem::size_of::<Block>() <= 64);
}
