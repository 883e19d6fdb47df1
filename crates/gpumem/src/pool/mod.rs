//! The caching pool policy: pure Rust, no CUDA calls.
//!
//! One [`CachingPool`] serves one shard of an allocator. It obtains *segments* from a
//! [`Backend`] and carves them into *blocks*:
//!
//! - sizes are rounded to 512 B (optionally to power-of-two divisions, [`size::round_size`]);
//!   blocks up to 1 MiB live in the small pool (2 MiB segments), larger ones in the large pool;
//! - a request takes the best-fitting free block of its stream and pool (`BTreeSet` ordered by
//!   stream, size, address: O(log n)), splitting off the rest; freed blocks coalesce with free
//!   neighbours;
//! - a short *quick cache* keeps the last few freed blocks for exact-size reuse before they are
//!   coalesced; it is flushed before the pool ever grows, so it never costs memory;
//! - a block freed while other streams may still use it ([`CachingPool::record_stream`]) waits
//!   for events recorded on those streams before it can be reused;
//! - a stream that finds nothing of its own may take a wholly free segment cached by another
//!   stream, after an event wait that orders it behind that stream's work;
//! - when the device refuses a segment: release cached segments, retry, wait for pending
//!   events, release again, retry, then report [`Error::OutOfMemory`].
//!
//! Where the backend has virtual memory ([`crate::resource::Resource::vmm_page_size`]) and
//! `expandable_segments` is on (the default), each stream and pool gets one *expandable*
//! segment instead: a large reserved address range whose pages are backed by physical memory
//! only where blocks need them. Blocks are placed in it by the same best fit; a block that
//! lands on unmapped pages gets them mapped. Before the pool maps more than the peak of
//! allocated bytes (plus `expandable_slack`), it first unmaps pages that lie wholly inside free
//! blocks (after waiting for their stream), so the physical memory follows the live bytes and
//! fragmentation costs at most the partly used pages at block edges.

mod free_index;
pub mod pinned;
pub mod size;
pub mod stats;
pub mod summary;

use crate::config::Config;
use crate::error::{Error, OomReport, Result};
use crate::resource::{Backend, DevPtr, Event, Stream};
use crate::trace::{Action, TraceEvent};
use free_index::FreeIndex;
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
    /// listed in the address map (allocated through the address-only API)
    tracked: bool,
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
}

/// The mapped pages of an expandable segment: one bit per page.
#[derive(Debug)]
struct Pages {
    bits: Vec<u64>,
    mapped: u64,
    /// no page at or above this one has ever been mapped (bounds the scans)
    high: u64,
    /// pool tick at which each page (below `high`) was last part of a block being freed
    freed: Vec<u64>,
}

impl Pages {
    fn new(n: u64) -> Self {
        Self {
            bits: vec![0; n.div_ceil(64) as usize],
            mapped: 0,
            high: 0,
            freed: Vec::new(),
        }
    }

    fn set(&mut self, first: u64, n: u64, on: bool) {
        for p in first..first + n {
            let (w, bit) = ((p / 64) as usize, 1u64 << (p % 64));
            debug_assert_eq!(
                self.bits[w] & bit != 0,
                !on,
                "page mapped twice or unmapped twice"
            );
            if on {
                self.bits[w] |= bit;
            } else {
                self.bits[w] &= !bit;
            }
        }
        if on {
            self.mapped += n;
            self.high = self.high.max(first + n);
        } else {
            self.mapped -= n;
        }
    }

    fn freed_at(&self, p: u64) -> u64 {
        self.freed.get(p as usize).copied().unwrap_or(0)
    }

    /// Mark pages `[from, to)` as freed at `tick`.
    fn mark_freed(&mut self, from: u64, to: u64, tick: u64) {
        let to = to.min(self.high);
        if from >= to {
            return;
        }
        if self.freed.len() < to as usize {
            self.freed.resize(self.high as usize, 0);
        }
        self.freed[from as usize..to as usize].fill(tick);
    }

    /// Runs `(first, count)` of pages in `[from, to)` that are mapped (`want`) or not.
    fn runs(&self, from: u64, to: u64, want: bool) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut p = from;
        while p < to {
            let start = self.next_with(p, to, want);
            if start >= to {
                break;
            }
            let end = self.next_with(start, to, !want);
            out.push((start, end - start));
            p = end;
        }
        out
    }

    /// The first page at or after `p` (below `to`, else `to`) whose bit is `want`.
    fn next_with(&self, mut p: u64, to: u64, want: bool) -> u64 {
        if p >= self.high {
            return if want { to } else { p.min(to) };
        }
        // nothing is mapped at or above `high`
        let end = if want { to.min(self.high) } else { to };
        while p < end {
            let w = (p / 64) as usize;
            let word = if want { self.bits[w] } else { !self.bits[w] };
            let word = word & (u64::MAX << (p % 64));
            if word != 0 {
                return (w as u64 * 64 + word.trailing_zeros() as u64).min(to);
            }
            p = (w as u64 + 1) * 64;
        }
        to
    }
}

/// (stream, size, address, block id), for the invariant check.
type FreeKey = (u64, u64, u64, u32);

/// Counters shared by all shards of one allocator (updated only when segments come and go).
#[derive(Debug, Default)]
pub struct SharedCounters {
    /// bytes reserved by all shards
    pub reserved: AtomicU64,
    /// peak of `reserved`
    pub peak_reserved: AtomicU64,
    /// highest page-churn level of any shard (see `Churn`): shards share what one learnt
    pub churn_level: std::sync::atomic::AtomicU32,
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
}

/// A block as reported by [`CachingPool::segments`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// address
    pub addr: u64,
    /// size in bytes
    pub size: u64,
    /// bytes requested (0 when free)
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
    slack: f64,
    move_budget: f64,
}

/// One shard of the caching allocator. Not thread-safe by itself: the allocator puts each
/// shard behind its own lock.
pub struct CachingPool {
    backend: Arc<dyn Backend>,
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
    quick: Vec<(u64, Stream, u32)>,
    /// +8 per quick-cache hit, -1 per miss, within ±64: below 0 the cache is mostly bypassed
    quick_score: i32,
    quick_probe: u32,
    pending: Vec<(u32, Vec<Event>)>,
    streams: Vec<Stream>,
    stats: HotStats,
    tick: u64,
    /// highest allocated bytes seen when mapping pages (expandable segments)
    peak_allocated: u64,
    /// per stream: (stream, highest free tick known idle, outstanding checkpoint event, its tick)
    checkpoints: Vec<(Stream, u64, Option<Event>, u64)>,
    /// free ticks up to this one are idle on every stream (after a device synchronisation)
    device_safe: u64,
    /// how often pages are being moved, which scales the slack
    churn: Churn,
    /// trace recording, when on
    recorder: Option<Box<Recorder>>,
}

/// Page moves per window of allocations. Moving pages costs driver calls (about 40 µs per
/// page and call on an H100) and sometimes a wait for a stream; a workload whose sizes never
/// settle (random sizes, say) would move pages on a good share of its allocations. Each window
/// of [`Churn::WINDOW`] allocations in which more than [`Churn::HIGH`] moved pages (and the
/// peak of allocated bytes did not grow by more than 1%), or in which moving pages took more
/// than `expandable_move_budget` of the wall time, doubles the
/// slack, up to 2^[`Churn::MAX_LEVEL`] times the configured one (where the pool is practically
/// PyTorch's expandable segments: pages are mapped as it grows and kept); `empty_cache` starts
/// over. Workloads that repeat (training steps) or grow slowly (decoding) stay at the
/// configured slack.
#[derive(Debug, Default)]
struct Churn {
    allocs: u32,
    moves: u32,
    level: u32,
    /// peak allocated bytes when the window started
    peak: u64,
    /// when the window started
    start: Option<Instant>,
    /// time spent moving pages in this window
    move_ns: u64,
}

impl Churn {
    const WINDOW: u32 = 1024;
    const HIGH: u32 = 16;
    const MAX_LEVEL: u32 = 8;

    /// Count one allocation; true when the level went up. `budget`: the share of wall time
    /// moves may take (0 = no limit).
    #[inline]
    fn tick(&mut self, peak_allocated: u64, budget: f64) -> bool {
        self.allocs += 1;
        let before = self.level;
        if self.allocs >= Self::WINDOW {
            // moves while the peak grows are the pool filling up (a first training step), not
            // churn
            let grew = peak_allocated > self.peak + self.peak / 100;
            let now = Instant::now();
            let wall = self
                .start
                .map_or(0, |s| now.duration_since(s).as_nanos() as u64);
            let costly = budget > 0.0 && self.move_ns as f64 > budget * wall as f64;
            if (self.moves > Self::HIGH && !grew) || costly {
                self.level = (self.level + 1).min(Self::MAX_LEVEL);
            }
            self.allocs = 0;
            self.moves = 0;
            self.move_ns = 0;
            self.start = Some(now);
            self.peak = peak_allocated;
        }
        self.level > before
    }
}

/// Events recorded by one pool: (nanoseconds since the recording started, event).
#[derive(Debug)]
struct Recorder {
    start: Instant,
    events: Vec<(u64, TraceEvent)>,
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
    /// A pool over `backend` with the given configuration and shared counters.
    pub fn new(backend: Arc<dyn Backend>, config: &Config, shared: Arc<SharedCounters>) -> Self {
        let capacity = backend
            .limit()
            .or_else(|| backend.mem_info().ok().map(|m| m.total))
            .unwrap_or(u64::MAX);
        let page = backend
            .vmm_page_size()
            .filter(|&p| config.expandable_segments && p % MIN_BLOCK == 0);
        Self {
            backend,
            policy: Policy {
                max_split: config.max_split_size.unwrap_or(u64::MAX),
                divisions: config.roundup_power2_divisions.clone(),
                gc_threshold: config.garbage_collection_threshold,
                quick_cap: config.quick_cache,
                cross_stream: config.cross_stream_reuse,
                page,
                slack: config.expandable_slack,
                move_budget: config.expandable_move_budget,
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
            quick: Vec::with_capacity(config.quick_cache),
            quick_score: 0,
            quick_probe: 0,
            pending: Vec::new(),
            streams: Vec::new(),
            stats: HotStats::default(),
            tick: 0,
            peak_allocated: 0,
            checkpoints: Vec::new(),
            device_safe: 0,
            churn: Churn::default(),
            recorder: None,
        }
    }

    /// Start recording this pool's events (times relative to `start`), dropping any earlier
    /// recording.
    pub fn start_recording(&mut self, start: Instant) {
        self.recorder = Some(Box::new(Recorder {
            start,
            events: Vec::new(),
        }));
    }

    /// Stop recording; returns the events with their times in nanoseconds since the start.
    pub fn stop_recording(&mut self) -> Vec<(u64, TraceEvent)> {
        self.recorder.take().map(|r| r.events).unwrap_or_default()
    }

    #[inline]
    fn record(&mut self, action: Action, addr: u64, size: u64, stream: Stream) {
        if let Some(r) = self.recorder.as_mut() {
            r.push(action, addr, size, stream);
        }
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
        self.stats.snapshot()
    }

    /// Set every peak statistic to its current value.
    pub fn reset_peak(&mut self) {
        self.stats.reset_peak();
    }

    /// True if `addr` is a live block of this pool allocated with `track_address`.
    pub fn owns(&self, addr: DevPtr) -> bool {
        self.live.contains_key(&addr)
    }

    // ----------------------------------------------------------------------------- allocate

    /// Allocate `bytes` bytes on `stream` with `align` (a power of two ≤ [`MAX_ALIGN`]); the
    /// block can be freed by address ([`CachingPool::free`]) or id.
    pub fn allocate(&mut self, stream: Stream, bytes: usize, align: usize) -> Result<PoolAlloc> {
        self.allocate_inner(stream, bytes, align, true, true)
    }

    /// [`CachingPool::allocate`] with options: `count_oom` false lets a caller that will retry
    /// elsewhere count the out-of-memory itself; `track_address` false skips the address map,
    /// so the block can only be freed by id ([`CachingPool::free_block_id`]), which is faster.
    pub fn allocate_inner(
        &mut self,
        stream: Stream,
        bytes: usize,
        align: usize,
        count_oom: bool,
        track_address: bool,
    ) -> Result<PoolAlloc> {
        let req = bytes as u64;
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        if req > MAX_REQUEST {
            return Err(Error::SizeTooLarge {
                requested: req,
                max: MAX_REQUEST,
            });
        }
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(Error::InvalidAlignment {
                align,
                max: MAX_ALIGN,
            });
        }
        let size = round_size(req, &self.policy.divisions);
        if !self.pending.is_empty() {
            self.process_events();
        }
        let id = match self.take_quick(stream, size) {
            Some(id) => {
                self.stats.cache_hits += 1;
                id
            }
            None => match self.find_or_grow(stream, size) {
                Ok(id) => id,
                Err(e) => {
                    if count_oom && e.is_out_of_memory() {
                        self.stats.num_ooms += 1;
                        self.record(Action::Oom, 0, req, stream);
                    }
                    return Err(e);
                }
            },
        };
        let b = &mut self.blocks[id as usize];
        b.state = State::Allocated;
        b.requested = req;
        b.rounded = size;
        b.tracked = track_address;
        let (addr, bsize, kind) = (b.addr, b.size, b.kind);
        if track_address {
            self.live.insert(addr, id);
        }
        self.stats.on_alloc(kind, bsize, req);
        self.record(Action::Alloc, addr, req, stream);
        Ok(PoolAlloc {
            addr,
            block_size: bsize,
            id,
        })
    }

    /// Exact-size reuse of a recently freed block of the same stream.
    #[inline]
    fn take_quick(&mut self, stream: Stream, size: u64) -> Option<u32> {
        if self.quick.is_empty() {
            return None;
        }
        let Some(pos) = self
            .quick
            .iter()
            .rposition(|&(s, st, _)| s == size && st == stream)
        else {
            self.quick_score = (self.quick_score - 1).max(-64);
            if self.quick_score < 0 {
                // sizes are not repeating: coalesce the probe entries rather than scan them
                self.flush_quick();
            }
            return None;
        };
        self.quick_score = (self.quick_score + 8).min(64);
        let (_, _, id) = self.quick.swap_remove(pos);
        self.unmark_inactive(id);
        Some(id)
    }

    fn kind_of(size: u64) -> PoolKind {
        if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    fn find_or_grow(&mut self, stream: Stream, size: u64) -> Result<u32> {
        let kind = Self::kind_of(size);
        let id = match self.best_fit(stream, size, kind) {
            Some(id) => Some(id),
            None if !self.quick.is_empty() => {
                self.flush_quick();
                self.best_fit(stream, size, kind)
            }
            None => None,
        };
        if self.policy.page.is_some() {
            return self.place_expandable(id, stream, size, kind);
        }
        let id = match id.or_else(|| self.steal(stream, size, kind)) {
            Some(id) => {
                self.stats.cache_hits += 1;
                id
            }
            None => {
                self.stats.cache_misses += 1;
                self.grow_with_retries(stream, size, kind)?
            }
        };
        self.split(id, size);
        Ok(id)
    }

    /// Expandable segments: carve `size` bytes from the best-fitting free block `found` (or a
    /// new segment) and map whatever pages of it are not mapped yet.
    fn place_expandable(
        &mut self,
        found: Option<u32>,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Result<u32> {
        let id = match found {
            Some(id) => id,
            None => match self.grow_expandable(stream, size, kind) {
                Ok(id) => id,
                Err(e) => {
                    self.stats.cache_misses += 1;
                    return Err(e);
                }
            },
        };
        self.split(id, size);
        if self
            .churn
            .tick(self.peak_allocated, self.policy.move_budget)
        {
            self.shared
                .churn_level
                .fetch_max(self.churn.level, Ordering::Relaxed);
        }
        match self.ensure_mapped(id, stream) {
            Ok(0) => {
                self.stats.cache_hits += 1;
                Ok(id)
            }
            Ok(_) => {
                self.stats.cache_misses += 1;
                Ok(id)
            }
            Err(e) => {
                self.stats.cache_misses += 1;
                self.free_block(id);
                Err(e)
            }
        }
    }

    /// Address space reserved for one expandable segment.
    fn va_size(&self, size: u64) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let va = self.capacity.saturating_mul(2).min(1 << 42).max(size);
        va.div_ceil(page) * page
    }

    /// A new expandable segment for `stream` and `kind`, nothing mapped; returns its single
    /// block, not in any free set.
    fn grow_expandable(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Result<u32> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let va = self.va_size(size);
        let addr = self.backend.reserve_address(va)?;
        if addr % page != 0 {
            let _ = self.backend.release_address(addr, va);
            return Err(Error::Unsupported {
                backend: self.backend.name().to_string(),
                what: format!("reserved address {addr:#x} is not page-aligned"),
            });
        }
        let id = self.install_segment(
            addr,
            va,
            stream,
            kind,
            Some(Box::new(Pages::new(va / page))),
        );
        Ok(id)
    }

    /// Register a new segment of `size` bytes at `addr` whose single block is taken (not in
    /// any free set); counts the segment. Returns the block.
    fn install_segment(
        &mut self,
        addr: u64,
        size: u64,
        stream: Stream,
        kind: PoolKind,
        pages: Option<Box<Pages>>,
    ) -> u32 {
        let seg = self.new_segment(Segment {
            addr,
            size,
            stream,
            kind,
            head: NIL,
            last_used: self.tick,
            pages,
        });
        let id = self.new_block(Block {
            addr,
            size,
            requested: 0,
            rounded: 0,
            stream,
            segment: seg,
            prev: NIL,
            next: NIL,
            state: State::Allocated,
            kind,
            uses: None,
            tracked: false,
        });
        self.segments[seg as usize].head = id;
        self.segment_index.insert(addr, seg);
        self.register_stream(stream);
        self.stats.segment.inc(kind, 1);
        id
    }

    /// Map the unmapped pages under block `id` (taken, not free); returns the bytes mapped.
    /// Beyond the allowance (peak allocated bytes plus the slack), free pages elsewhere are
    /// unmapped first so that the physical memory does not grow.
    fn ensure_mapped(&mut self, id: u32, stream: Stream) -> Result<u64> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let (addr, size, seg) = {
            let b = &self.blocks[id as usize];
            (b.addr, b.size, b.segment)
        };
        let base = self.segments[seg as usize].addr;
        let (p0, p1) = ((addr - base) / page, (addr + size - base).div_ceil(page));
        let runs = match &self.segments[seg as usize].pages {
            // the common case, all mapped, costs one bitmap scan and no allocation
            Some(pages) if pages.next_with(p0, p1, false) >= p1 => return Ok(0),
            Some(pages) => pages.runs(p0, p1, false),
            None => return Ok(0),
        };
        let need = runs.iter().map(|r| r.1).sum::<u64>() * page;
        if need == 0 {
            return Ok(0);
        }
        self.peak_allocated = self.peak_allocated.max(self.stats.allocated() + size);
        let level = self
            .churn
            .level
            .max(self.shared.churn_level.load(Ordering::Relaxed));
        let slack = self.policy.slack * f64::from(1u32 << level);
        let allowance = (self.peak_allocated as f64 * (1.0 + slack)) as u64;
        let reserved = self.stats.reserved();
        let moving = reserved + need > allowance;
        let started = moving.then(Instant::now);
        if moving {
            self.churn.moves += 1;
            self.reclaim_pages(Some(stream), reserved + need - allowance);
        }
        for (first, n) in runs {
            let (a, bytes) = (base + first * page, n * page);
            let mut r = self.backend.map(a, bytes);
            if matches!(&r, Err(e) if e.is_out_of_memory()) {
                self.stats.num_alloc_retries += 1;
                self.release_cached();
                r = self.backend.map(a, bytes);
                if matches!(&r, Err(e) if e.is_out_of_memory()) && !self.pending.is_empty() {
                    self.sync_pending();
                    self.release_cached();
                    r = self.backend.map(a, bytes);
                }
            }
            match r {
                Ok(()) => self.note_mapped(seg, first, n, true),
                Err(e) if e.is_out_of_memory() => return Err(self.oom_error(size, need)),
                Err(e) => return Err(e),
            }
        }
        if let Some(t) = started {
            self.churn.move_ns += t.elapsed().as_nanos() as u64;
        }
        Ok(need)
    }

    /// Record that pages `[first, first + n)` of `seg` were mapped (`on`) or unmapped.
    fn note_mapped(&mut self, seg: u32, first: u64, n: u64, on: bool) {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let s = &mut self.segments[seg as usize];
        let kind = s.kind;
        if let Some(p) = s.pages.as_mut() {
            p.set(first, n, on);
        }
        let bytes = n * page;
        let (addr, stream) = (s.addr + first * page, s.stream);
        self.record(
            if on {
                Action::SegmentMap
            } else {
                Action::SegmentUnmap
            },
            addr,
            bytes,
            stream,
        );
        if on {
            self.stats.reserved_bytes.inc(kind, bytes);
            self.stats.num_device_alloc += 1;
            self.stats.mapped_bytes += bytes;
            let now = self.shared.reserved.fetch_add(bytes, Ordering::Relaxed) + bytes;
            self.shared.peak_reserved.fetch_max(now, Ordering::Relaxed);
        } else {
            self.stats.reserved_bytes.dec(kind, bytes);
            self.stats.num_device_free += 1;
            self.stats.unmapped_bytes += bytes;
            self.shared.reserved.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Unmap up to about `want` bytes of pages lying wholly inside free blocks of expandable
    /// segments, those of `stream` first and the highest addresses first. Unmapping is
    /// immediate, so no queued work may still touch a page: pages freed before the owner
    /// stream's last completed checkpoint event go first (no waiting); then a fresh checkpoint
    /// is recorded and, if the stream has already caught up, more pages are safe; only then
    /// does the pool wait for the stream. Only `current` (the stream of the allocation being
    /// served, alive by contract) gets events recorded on it or is waited for; segments of
    /// other streams, which may have been destroyed since, are made safe by a device-wide
    /// synchronisation. Returns the bytes unmapped.
    fn reclaim_pages(&mut self, current: Option<Stream>, want: u64) -> u64 {
        if self.policy.page.is_none() || want == 0 {
            return 0;
        }
        self.flush_quick();
        let mut order: Vec<u32> = self
            .segment_index
            .values()
            .copied()
            .filter(|&s| self.segments[s as usize].pages.is_some())
            .collect();
        order.sort_by_key(|&s| Some(self.segments[s as usize].stream) != current);
        let mut got = 0u64;
        for seg in order {
            if got >= want {
                break;
            }
            let owner = self.segments[seg as usize].stream;
            // 1: pages known to be idle
            let safe = self.safe_tick(owner);
            let runs = self.free_mapped_runs(seg, want - got, safe);
            got += self.unmap_runs(seg, runs);
            if got >= want {
                break;
            }
            if self.free_mapped_runs(seg, want - got, u64::MAX).is_empty() {
                continue;
            }
            let own = Some(owner) == current;
            if own {
                // 2: a fresh checkpoint, complete at once if the stream is idle
                self.checkpoint(owner);
                let safe = self.safe_tick(owner);
                let runs = self.free_mapped_runs(seg, want - got, safe);
                got += self.unmap_runs(seg, runs);
                if got >= want {
                    break;
                }
                if self.free_mapped_runs(seg, want - got, u64::MAX).is_empty() {
                    continue;
                }
            }
            // 3: wait for the stream (or the device), then the rest is idle
            let waited = if own {
                self.backend.synchronize(owner)
            } else {
                self.backend.synchronize_device()
            };
            if let Err(e) = waited {
                tracing::warn!("gpumem: cannot synchronize before unmapping: {e}");
                continue;
            }
            self.stats.num_unmap_syncs += 1;
            if own {
                self.set_safe(owner, self.tick);
            } else {
                self.device_safe = self.tick;
            }
            let runs = self.free_mapped_runs(seg, want - got, u64::MAX);
            got += self.unmap_runs(seg, runs);
        }
        got
    }

    /// The highest free tick known to be idle on `stream` (after polling its checkpoint).
    fn safe_tick(&mut self, stream: Stream) -> u64 {
        let Some(i) = self.checkpoints.iter().position(|c| c.0 == stream) else {
            return self.device_safe;
        };
        if let (Some(ev), tick) = (self.checkpoints[i].2, self.checkpoints[i].3) {
            if self.backend.event_done(ev).unwrap_or(false) {
                self.backend.destroy_event(ev);
                let c = &mut self.checkpoints[i];
                c.2 = None;
                c.1 = c.1.max(tick);
            }
        }
        self.checkpoints[i].1.max(self.device_safe)
    }

    fn set_safe(&mut self, stream: Stream, tick: u64) {
        match self.checkpoints.iter_mut().find(|c| c.0 == stream) {
            Some(c) => c.1 = c.1.max(tick),
            None => self.checkpoints.push((stream, tick, None, 0)),
        }
    }

    /// Record a checkpoint event on `stream` unless one is outstanding.
    fn checkpoint(&mut self, stream: Stream) {
        self.safe_tick(stream); // retire a completed one first
        let tick = self.tick;
        let i = match self.checkpoints.iter().position(|c| c.0 == stream) {
            Some(i) => i,
            None => {
                self.checkpoints.push((stream, 0, None, 0));
                self.checkpoints.len() - 1
            }
        };
        if self.checkpoints[i].2.is_none() {
            if let Ok(ev) = self.backend.record_event(stream) {
                self.checkpoints[i].2 = Some(ev);
                self.checkpoints[i].3 = tick;
            }
        }
    }

    /// Runs of mapped pages lying wholly inside free blocks of `seg` and last freed at or
    /// before `max_tick`, highest first, about `want` bytes.
    fn free_mapped_runs(&self, seg: u32, want: u64, max_tick: u64) -> Vec<(u64, u64)> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let s = &self.segments[seg as usize];
        let Some(pages) = &s.pages else {
            return Vec::new();
        };
        let mut free = Vec::new();
        let mut id = s.head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if b.state == State::Free {
                free.push((b.addr, b.size));
            }
            id = b.next;
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut take = want;
        'blocks: for &(addr, size) in free.iter().rev() {
            let first = (addr - s.addr).div_ceil(page);
            let end = (addr + size - s.addr) / page;
            if first >= end {
                continue;
            }
            for (f, n) in pages.runs(first, end, true).into_iter().rev() {
                // the run minus pages freed after `max_tick`, from the top
                let mut p = f + n;
                while p > f && take > 0 {
                    while p > f && pages.freed_at(p - 1) > max_tick {
                        p -= 1;
                    }
                    let hi = p;
                    while p > f && take > 0 && pages.freed_at(p - 1) <= max_tick {
                        p -= 1;
                        take = take.saturating_sub(page);
                    }
                    if p < hi {
                        runs.push((p, hi - p));
                    }
                }
                if take == 0 {
                    break 'blocks;
                }
            }
        }
        runs
    }

    /// Unmap `runs` of `seg`; returns the bytes unmapped.
    fn unmap_runs(&mut self, seg: u32, runs: Vec<(u64, u64)>) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let base = self.segments[seg as usize].addr;
        let mut got = 0;
        for (first, n) in runs {
            match self.backend.unmap(base + first * page, n * page) {
                Ok(()) => {
                    self.note_mapped(seg, first, n, false);
                    got += n * page;
                }
                Err(e) => tracing::warn!("gpumem: unmapping pages failed: {e}"),
            }
        }
        got
    }

    /// PyTorch's rules for using a block of `bsize` for a request of `size`.
    fn fits(&self, size: u64, bsize: u64) -> bool {
        if self.policy.page.is_some() {
            return true; // expandable segments: any free block will do, it costs only pages
        }
        let max = self.policy.max_split;
        if size < max && bsize >= max {
            return false; // never hand an unsplittable block to a small request
        }
        if size >= max && bsize >= size + LARGE_SEGMENT {
            return false; // nor a much larger one to a large request
        }
        true
    }

    /// Index of `stream` in `streams` / `free`.
    #[inline]
    fn slot_of(&self, stream: Stream) -> Option<usize> {
        self.streams.iter().position(|&s| s == stream)
    }

    fn best_fit(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        let slot = self.slot_of(stream)?;
        let (bsize, _, id) = self.free[slot][kind as usize].best_fit(size)?;
        if !self.fits(size, bsize) {
            return None;
        }
        self.leave_free(id);
        Some(id)
    }

    /// Take a wholly free segment another stream cached, ordered behind that stream's work.
    fn steal(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        if !self.policy.cross_stream || self.policy.page.is_some() {
            return None;
        }
        let k = kind as usize;
        let mut best: Option<(u64, Stream, u32)> = None;
        for (slot, &other) in self.streams.iter().enumerate() {
            if other == stream {
                continue;
            }
            let found =
                self.free[slot][k]
                    .at_least(size)
                    .take(STEAL_SCAN)
                    .find(|&(bsize, _, id)| {
                        let b = &self.blocks[id as usize];
                        b.prev == NIL && b.next == NIL && self.fits(size, bsize)
                    });
            if let Some((bsize, _, id)) = found {
                if best.is_none_or(|b| bsize < b.0) {
                    best = Some((bsize, other, id));
                }
            }
        }
        let (_, owner, id) = best?;
        crate::resource::stream_after(&*self.backend, owner, &*self.backend, stream).ok()?;
        self.leave_free(id);
        self.register_stream(stream);
        let b = &mut self.blocks[id as usize];
        b.stream = stream;
        let seg = b.segment as usize;
        self.segments[seg].stream = stream;
        self.stats.num_cross_stream_reuses += 1;
        Some(id)
    }

    fn register_stream(&mut self, stream: Stream) {
        if self.slot_of(stream).is_none() {
            self.streams.push(stream);
            self.free.push(Default::default());
        }
    }

    fn grow_with_retries(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Result<u32> {
        let seg = segment_size(size);
        self.collect_garbage(seg);
        match self.grow(stream, seg, kind) {
            Err(e) if e.is_out_of_memory() => {}
            other => return other,
        }
        self.stats.num_alloc_retries += 1;
        self.release_cached();
        match self.grow(stream, seg, kind) {
            Err(e) if e.is_out_of_memory() => {}
            other => return other,
        }
        if !self.pending.is_empty() {
            self.sync_pending();
            self.release_cached();
            if let Some(id) = self.best_fit(stream, size, kind) {
                return Ok(id);
            }
            match self.grow(stream, seg, kind) {
                Err(e) if e.is_out_of_memory() => {}
                other => return other,
            }
        }
        Err(self.oom_error(size, seg))
    }

    /// Build the out-of-memory report from this pool's view.
    pub fn oom_error(&self, requested: u64, segment_request: u64) -> Error {
        let info = self.backend.mem_info().ok();
        Error::OutOfMemory(Box::new(OomReport {
            requested,
            segment_request,
            device_free: info.map_or(0, |m| m.free),
            device_total: info.map_or(0, |m| m.total),
            reserved: self.stats.reserved(),
            allocated: self.stats.allocated(),
            largest_free_block: self.largest_free_block(),
            limit: self.backend.limit(),
        }))
    }

    /// Obtain a new segment; returns its single block, not in any free set.
    fn grow(&mut self, stream: Stream, seg_size: u64, kind: PoolKind) -> Result<u32> {
        let addr = self
            .backend
            .allocate(stream, seg_size as usize, MAX_ALIGN)?;
        if addr % MAX_ALIGN as u64 != 0 {
            let _ = self.backend.deallocate(addr, seg_size as usize, stream);
            return Err(Error::Unsupported {
                backend: self.backend.name().to_string(),
                what: format!("segment at {addr:#x} is not {MAX_ALIGN}-byte aligned"),
            });
        }
        let id = self.install_segment(addr, seg_size, stream, kind, None);
        self.stats.reserved_bytes.inc(kind, seg_size);
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentAlloc, addr, seg_size, stream);
        let now = self.shared.reserved.fetch_add(seg_size, Ordering::Relaxed) + seg_size;
        self.shared.peak_reserved.fetch_max(now, Ordering::Relaxed);
        Ok(id)
    }

    /// Split `id` (taken, not free) so that it is `size` bytes, if the rest is worth keeping.
    fn split(&mut self, id: u32, size: u64) {
        let b = &self.blocks[id as usize];
        let remaining = b.size - size;
        let worth = match b.kind {
            _ if self.policy.page.is_some() => remaining >= MIN_BLOCK,
            PoolKind::Small => remaining >= MIN_BLOCK,
            PoolKind::Large => size < self.policy.max_split && remaining > SMALL_SIZE,
        };
        if !worth {
            return;
        }
        let rest = Block {
            addr: b.addr + size,
            size: remaining,
            requested: 0,
            rounded: 0,
            stream: b.stream,
            segment: b.segment,
            prev: id,
            next: b.next,
            state: State::Allocated,
            kind: b.kind,
            uses: None,
            tracked: false,
        };
        let next = b.next;
        let r = self.new_block(rest);
        if next != NIL {
            self.blocks[next as usize].prev = r;
        }
        let b = &mut self.blocks[id as usize];
        b.next = r;
        b.size = size;
        self.enter_free(r);
    }

    // --------------------------------------------------------------------------------- free

    /// Return the block at `addr` (allocated with `track_address`) to the pool, ordered on its
    /// stream.
    pub fn free(&mut self, addr: DevPtr) -> Result<()> {
        let Some(id) = self.live.remove(&addr) else {
            return Err(self.bad_free(addr));
        };
        self.release(id)
    }

    /// Return the block `id` at `addr` ([`PoolAlloc::id`]) to the pool.
    #[inline]
    pub fn free_block_id(&mut self, id: u32, addr: DevPtr) -> Result<()> {
        match self.blocks.get(id as usize) {
            Some(b) if b.addr == addr && b.state == State::Allocated => {
                if b.tracked {
                    self.live.remove(&addr);
                }
                self.release(id)
            }
            _ => Err(self.bad_free(addr)),
        }
    }

    fn release(&mut self, id: u32) -> Result<()> {
        let b = &mut self.blocks[id as usize];
        let (kind, size, req) = (b.kind, b.size, b.requested);
        let deferred = b.uses.is_some();
        self.stats.on_free(kind, size, req, deferred);
        if self.recorder.is_some() {
            let (addr, stream) = (b.addr, b.stream);
            self.record(Action::FreeRequested, addr, req, stream);
            if !deferred {
                self.record(Action::FreeCompleted, addr, req, stream);
            }
        }
        let b = &mut self.blocks[id as usize];
        if deferred {
            let uses = b.uses.take().map(|u| *u).unwrap_or_default();
            b.state = State::Pending;
            let mut events = Vec::with_capacity(uses.len());
            for st in uses {
                match self.backend.record_event(st) {
                    Ok(ev) => events.push(ev),
                    // without an event, wait for the stream now: correctness over speed
                    Err(_) => {
                        let _ = self.backend.synchronize(st);
                    }
                }
            }
            self.pending.push((id, events));
            return Ok(());
        }
        if !self.use_quick() {
            self.free_block(id);
            return Ok(());
        }
        if self.quick.len() >= self.policy.quick_cap {
            let (_, _, old) = self.quick.remove(0);
            self.unmark_inactive(old);
            self.free_block(old);
        }
        let b = &mut self.blocks[id as usize];
        b.state = State::Quick;
        self.quick.push((b.rounded, b.stream, id));
        self.mark_inactive(id);
        Ok(())
    }

    /// Whether a freed block goes to the quick cache. The cache pays off when sizes repeat; when
    /// recent allocations kept missing it, only one free in 32 still goes there (so that a
    /// return of repeating sizes is noticed) and the rest coalesce at once.
    #[inline]
    fn use_quick(&mut self) -> bool {
        if self.policy.quick_cap == 0 {
            return false;
        }
        self.quick_probe = self.quick_probe.wrapping_add(1);
        self.quick_score >= 0 || self.quick_probe % 32 == 0
    }

    /// Why `addr` cannot be freed.
    fn bad_free(&self, addr: DevPtr) -> Error {
        if let Some((_, &seg)) = self.segment_index.range(..=addr).next_back() {
            let s = &self.segments[seg as usize];
            let mut id = if addr < s.addr + s.size { s.head } else { NIL };
            while id != NIL {
                let b = &self.blocks[id as usize];
                if (b.addr..b.addr + b.size).contains(&addr) {
                    // a free block starting here, or one that absorbed it since, was freed;
                    // an allocated block was handed out by id, not by address
                    return match b.state {
                        State::Free | State::Quick | State::Pending => {
                            Error::DoubleFree { ptr: addr }
                        }
                        _ => Error::UnknownPointer { ptr: addr },
                    };
                }
                id = b.next;
            }
        }
        Error::UnknownPointer { ptr: addr }
    }

    /// Record that `stream` uses the live block at `addr` (PyTorch's `record_stream`): when it
    /// is freed, it is reused only after the work queued on `stream` by then has completed.
    pub fn record_stream(&mut self, addr: DevPtr, stream: Stream) -> Result<()> {
        let id = *self
            .live
            .get(&addr)
            .ok_or(Error::UnknownPointer { ptr: addr })?;
        self.record_stream_id(id, addr, stream)
    }

    /// [`CachingPool::record_stream`] for block `id` at `addr`.
    pub fn record_stream_id(&mut self, id: u32, addr: DevPtr, stream: Stream) -> Result<()> {
        let b = match self.blocks.get_mut(id as usize) {
            Some(b) if b.addr == addr && b.state == State::Allocated => b,
            _ => return Err(Error::UnknownPointer { ptr: addr }),
        };
        if b.stream != stream {
            let uses = b.uses.get_or_insert_with(Default::default);
            if !uses.contains(&stream) {
                uses.push(stream);
            }
        }
        Ok(())
    }

    /// Put a block that is neither free nor quick into its free set, coalescing neighbours.
    fn free_block(&mut self, id: u32) {
        self.tick += 1;
        if self.policy.page.is_some() {
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            let b = &self.blocks[id as usize];
            let (addr, size, tick) = (b.addr, b.size, self.tick);
            let s = &mut self.segments[b.segment as usize];
            let base = s.addr;
            if let Some(p) = s.pages.as_mut() {
                p.mark_freed(
                    (addr - base) / page,
                    (addr + size - base).div_ceil(page),
                    tick,
                );
            }
        }
        let mut id = id;
        let (prev, stream) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.stream)
        };
        if prev != NIL && self.is_mergeable(prev, stream) {
            self.leave_free(prev);
            let b = self.release_block(id);
            let p = &mut self.blocks[prev as usize];
            p.size += b.size;
            p.next = b.next;
            if b.next != NIL {
                self.blocks[b.next as usize].prev = prev;
            }
            id = prev;
        }
        let next = self.blocks[id as usize].next;
        if next != NIL && self.is_mergeable(next, stream) {
            self.leave_free(next);
            let n = self.release_block(next);
            let b = &mut self.blocks[id as usize];
            b.size += n.size;
            b.next = n.next;
            if n.next != NIL {
                self.blocks[n.next as usize].prev = id;
            }
        }
        let seg = self.blocks[id as usize].segment;
        self.segments[seg as usize].last_used = self.tick;
        self.enter_free(id);
    }

    fn is_mergeable(&self, id: u32, stream: Stream) -> bool {
        let b = &self.blocks[id as usize];
        b.state == State::Free && b.stream == stream
    }

    /// Coalesce every quick-cached block.
    fn flush_quick(&mut self) {
        for (_, _, id) in std::mem::take(&mut self.quick) {
            self.unmark_inactive(id);
            self.free_block(id);
        }
    }

    /// Free blocks whose recorded events have all completed.
    pub fn process_events(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = self.pending[i]
                .1
                .iter()
                .all(|&e| self.backend.event_done(e).unwrap_or(false));
            if done {
                let (id, events) = self.pending.swap_remove(i);
                self.finish_pending(id, events);
            } else {
                i += 1;
            }
        }
    }

    /// Wait on the host for every pending event, then free those blocks.
    fn sync_pending(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for (id, events) in std::mem::take(&mut self.pending) {
            for &e in &events {
                let _ = self.backend.sync_event(e);
            }
            self.finish_pending(id, events);
        }
    }

    fn finish_pending(&mut self, id: u32, events: Vec<Event>) {
        for e in events {
            self.backend.destroy_event(e);
        }
        let b = &self.blocks[id as usize];
        let (kind, size) = (b.kind, b.size);
        let (addr, req, stream) = (b.addr, b.requested, b.stream);
        self.stats.on_pending_done(kind, size);
        self.record(Action::FreeCompleted, addr, req, stream);
        self.free_block(id);
    }

    // ------------------------------------------------------------------- free sets and stats

    fn free_key(&self, id: u32) -> FreeKey {
        let b = &self.blocks[id as usize];
        (b.stream.0, b.size, b.addr, id)
    }

    fn index_of(&mut self, id: u32) -> &mut FreeIndex {
        let b = &self.blocks[id as usize];
        let (stream, k) = (b.stream, b.kind as usize);
        let slot = self
            .slot_of(stream)
            .expect("blocks belong to registered streams");
        &mut self.free[slot][k]
    }

    /// Make `id` free: insert into its index and count it.
    fn enter_free(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.state = State::Free;
        let (size, addr) = (b.size, b.addr);
        self.index_of(id).insert(size, addr, id);
        self.mark_inactive(id);
    }

    /// Take free block `id` out of its index (it becomes Allocated until told otherwise).
    fn leave_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let (size, addr) = (b.size, b.addr);
        let removed = self.index_of(id).remove(size, addr, id);
        debug_assert!(removed, "free block missing from its index");
        self.unmark_inactive(id);
        self.blocks[id as usize].state = State::Allocated;
    }

    fn mark_inactive(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        if b.prev != NIL || b.next != NIL {
            self.stats.inactive_split.inc(b.kind, 1);
            self.stats.inactive_split_bytes.inc(b.kind, b.size);
        }
    }

    fn unmark_inactive(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        if b.prev != NIL || b.next != NIL {
            self.stats.inactive_split.dec(b.kind, 1);
            self.stats.inactive_split_bytes.dec(b.kind, b.size);
        }
    }

    fn new_block(&mut self, b: Block) -> u32 {
        slab_insert(&mut self.blocks, &mut self.spare_blocks, b)
    }

    /// Retire a block slot; returns its former contents.
    fn release_block(&mut self, id: u32) -> Block {
        self.spare_blocks.push(id);
        std::mem::replace(
            &mut self.blocks[id as usize],
            Block {
                addr: 0,
                size: 0,
                requested: 0,
                rounded: 0,
                stream: Stream::DEFAULT,
                segment: NIL,
                prev: NIL,
                next: NIL,
                state: State::Dead,
                kind: PoolKind::Small,
                uses: None,
                tracked: false,
            },
        )
    }

    fn new_segment(&mut self, s: Segment) -> u32 {
        slab_insert(&mut self.segments, &mut self.spare_segments, s)
    }

    // ------------------------------------------------------------------ releasing segments

    /// Segments whose only block is free (and, if expandable, with nothing mapped).
    fn releasable(&self) -> Vec<u32> {
        self.segment_index
            .values()
            .copied()
            .filter(|&s| {
                let seg = &self.segments[s as usize];
                let b = &self.blocks[seg.head as usize];
                b.state == State::Free
                    && b.next == NIL
                    && seg.pages.as_ref().is_none_or(|p| p.mapped == 0)
            })
            .collect()
    }

    fn release_segment(&mut self, seg: u32) {
        let (addr, size, stream, kind, head) = {
            let s = &self.segments[seg as usize];
            (s.addr, s.size, s.stream, s.kind, s.head)
        };
        self.leave_free(head);
        self.release_block(head);
        self.segment_index.remove(&addr);
        self.spare_segments.push(seg);
        if self.segments[seg as usize].pages.take().is_some() {
            if let Err(e) = self.backend.release_address(addr, size) {
                tracing::warn!("gpumem: releasing address range {addr:#x} failed: {e}");
            }
            self.stats.segment.dec(kind, 1);
            return;
        }
        if let Err(e) = self.backend.deallocate(addr, size as usize, stream) {
            tracing::warn!("gpumem: returning segment {addr:#x} ({size} B) failed: {e}");
        }
        self.record(Action::SegmentFree, addr, size, stream);
        self.stats.segment.dec(kind, 1);
        self.stats.reserved_bytes.dec(kind, size);
        self.stats.num_device_free += 1;
        self.shared.reserved.fetch_sub(size, Ordering::Relaxed);
    }

    /// Return every wholly free segment to the backend; returns the bytes released.
    pub fn release_cached(&mut self) -> u64 {
        self.churn = Churn::default();
        self.shared.churn_level.store(0, Ordering::Relaxed);
        self.flush_quick();
        self.process_events();
        let mut bytes = self.reclaim_pages(None, u64::MAX);
        for seg in self.releasable() {
            let s = &self.segments[seg as usize];
            if s.pages.is_none() {
                bytes += s.size;
            }
            self.release_segment(seg);
        }
        bytes
    }

    /// Release unused cached memory to the device (`torch.cuda.empty_cache()`).
    pub fn empty_cache(&mut self) -> u64 {
        self.release_cached()
    }

    /// If growing by `incoming` bytes would pass the garbage-collection threshold, release the
    /// least recently used free segments until it would not (or none is left).
    fn collect_garbage(&mut self, incoming: u64) {
        let Some(t) = self.policy.gc_threshold else {
            return;
        };
        if self.policy.page.is_some() {
            return; // expandable segments never hold more than the allowance anyway
        }
        let target = ((self.capacity as f64 * t) as u64).saturating_sub(incoming);
        if self.shared.reserved.load(Ordering::Relaxed) <= target {
            return;
        }
        self.flush_quick();
        let mut segs = self.releasable();
        segs.sort_by_key(|&s| self.segments[s as usize].last_used);
        for seg in segs {
            if self.shared.reserved.load(Ordering::Relaxed) <= target {
                break;
            }
            self.release_segment(seg);
        }
    }

    /// Warm-up: allocate blocks of the given sizes and free them again, so that later requests
    /// of those sizes are served from the cache.
    pub fn reserve(&mut self, stream: Stream, sizes: &[usize]) -> Result<()> {
        let mut got = Vec::with_capacity(sizes.len());
        let mut result = Ok(());
        for &s in sizes {
            match self.allocate(stream, s, MAX_ALIGN) {
                Ok(a) => got.push(a.addr),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        for a in got {
            self.free(a)?;
        }
        self.flush_quick();
        result
    }

    // ------------------------------------------------------------------------- inspection

    /// Largest free (cached) block; in expandable segments, the longest free range that is
    /// mapped (so it is served with no driver call).
    pub fn largest_free_block(&self) -> u64 {
        if self.policy.page.is_some() {
            return self.largest_mapped_free();
        }
        let free = self.free.iter().flatten().filter_map(|f| f.largest());
        let quick = self
            .quick
            .iter()
            .map(|&(_, _, id)| self.blocks[id as usize].size);
        free.chain(quick).max().unwrap_or(0)
    }

    fn largest_mapped_free(&self) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mut best = self
            .quick
            .iter()
            .map(|&(_, _, id)| self.blocks[id as usize].size)
            .max()
            .unwrap_or(0);
        for &seg in self.segment_index.values() {
            let s = &self.segments[seg as usize];
            let Some(pages) = &s.pages else {
                continue;
            };
            let mut id = s.head;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.state == State::Free {
                    let (lo, hi) = (b.addr - s.addr, b.addr + b.size - s.addr);
                    for (f, n) in pages.runs(lo / page, hi.div_ceil(page), true) {
                        let run = (hi.min((f + n) * page)) - lo.max(f * page);
                        best = best.max(run);
                    }
                }
                id = b.next;
            }
        }
        best
    }

    /// Every segment with its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.segment_index
            .values()
            .map(|&seg| {
                let s = &self.segments[seg as usize];
                let mut blocks = Vec::new();
                let mut id = s.head;
                while id != NIL {
                    let b = &self.blocks[id as usize];
                    let allocated = b.state == State::Allocated;
                    blocks.push(BlockInfo {
                        addr: b.addr,
                        size: b.size,
                        requested: if allocated { b.requested } else { 0 },
                        active: allocated || b.state == State::Pending,
                        allocated,
                    });
                    id = b.next;
                }
                let page = self.policy.page.unwrap_or(MIN_BLOCK);
                let mapped = match &s.pages {
                    None => vec![(s.addr, s.size)],
                    Some(p) => p
                        .runs(0, s.size / page, true)
                        .into_iter()
                        .map(|(f, n)| (s.addr + f * page, n * page))
                        .collect(),
                };
                SegmentInfo {
                    addr: s.addr,
                    size: s.size,
                    stream: s.stream,
                    kind: s.kind,
                    expandable: s.pages.is_some(),
                    mapped,
                    blocks,
                }
            })
            .collect()
    }

    /// Check every structural invariant; returns a description of the first violation.
    /// Used by the property tests after every step.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut want = Stats::default();
        let mut free_keys = BTreeSet::new();
        let mut live = 0usize;
        for &seg in self.segment_index.values() {
            let s = &self.segments[seg as usize];
            want.segment.add_current(s.kind, 1);
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            match &s.pages {
                None => want.reserved_bytes.add_current(s.kind, s.size),
                Some(p) => {
                    let count: u64 = p.bits.iter().map(|w| w.count_ones() as u64).sum();
                    if count != p.mapped {
                        return Err(format!("segment {:#x}: mapped page count is off", s.addr));
                    }
                    want.reserved_bytes.add_current(s.kind, p.mapped * page);
                }
            }
            let (mut id, mut cursor, mut prev) = (s.head, s.addr, NIL);
            let mut prev_free = false;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.addr != cursor {
                    return Err(format!(
                        "gap or overlap at {:#x} in segment {:#x}",
                        b.addr, s.addr
                    ));
                }
                if b.prev != prev || b.segment != seg || b.stream != s.stream {
                    return Err(format!("bad links of block {:#x}", b.addr));
                }
                if b.addr % MAX_ALIGN as u64 != 0 || b.size % MIN_BLOCK != 0 {
                    return Err(format!("misaligned block {:#x}+{}", b.addr, b.size));
                }
                let split = b.prev != NIL || b.next != NIL;
                if let (Some(p), false) = (&s.pages, b.state == State::Free) {
                    let (lo, hi) = (b.addr - s.addr, b.addr + b.size - s.addr);
                    if !p.runs(lo / page, hi.div_ceil(page), false).is_empty() {
                        return Err(format!("block {:#x} in use on unmapped pages", b.addr));
                    }
                }
                match b.state {
                    State::Free => {
                        if prev_free {
                            return Err(format!("uncoalesced free neighbours at {:#x}", b.addr));
                        }
                        free_keys.insert(self.free_key(id));
                    }
                    State::Allocated => {
                        live += 1;
                        if b.tracked && self.live.get(&b.addr) != Some(&id) {
                            return Err(format!("allocated block {:#x} not in live map", b.addr));
                        }
                        want.allocation.add_current(b.kind, 1);
                        want.allocated_bytes.add_current(b.kind, b.size);
                        want.requested_bytes.add_current(b.kind, b.requested);
                        want.active.add_current(b.kind, 1);
                        want.active_bytes.add_current(b.kind, b.size);
                    }
                    State::Pending => {
                        want.active.add_current(b.kind, 1);
                        want.active_bytes.add_current(b.kind, b.size);
                    }
                    State::Quick => {}
                    State::Dead => return Err(format!("retired block {:#x} linked in", b.addr)),
                }
                if matches!(b.state, State::Free | State::Quick) && split {
                    want.inactive_split.add_current(b.kind, 1);
                    want.inactive_split_bytes.add_current(b.kind, b.size);
                }
                prev_free = b.state == State::Free;
                cursor += b.size;
                prev = id;
                id = b.next;
            }
            if cursor != s.addr + s.size {
                return Err(format!("blocks do not cover segment {:#x}", s.addr));
            }
        }
        let mut have = BTreeSet::new();
        for (slot, pair) in self.free.iter().enumerate() {
            for (k, index) in pair.iter().enumerate() {
                for (size, addr, id) in index.iter() {
                    let b = &self.blocks[id as usize];
                    if b.kind as usize != k {
                        return Err(format!("block {addr:#x} indexed in the wrong pool"));
                    }
                    have.insert((self.streams[slot].0, size, addr, id));
                }
            }
        }
        if have != free_keys {
            return Err("free sets disagree with free blocks".into());
        }
        let counted = self.stats.allocation_count();
        if live as u64 != counted || self.live.len() > live {
            return Err(format!(
                "{live} blocks allocated, counted {counted}, {} in the address map",
                self.live.len()
            ));
        }
        let have = self.stats.snapshot();
        let pairs = [
            ("allocation", &want.allocation, &have.allocation),
            ("segment", &want.segment, &have.segment),
            ("active", &want.active, &have.active),
            ("inactive_split", &want.inactive_split, &have.inactive_split),
            (
                "allocated_bytes",
                &want.allocated_bytes,
                &have.allocated_bytes,
            ),
            ("reserved_bytes", &want.reserved_bytes, &have.reserved_bytes),
            ("active_bytes", &want.active_bytes, &have.active_bytes),
            (
                "inactive_split_bytes",
                &want.inactive_split_bytes,
                &have.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &want.requested_bytes,
                &have.requested_bytes,
            ),
        ];
        for (name, w, h) in pairs {
            for (pool, a, b) in [
                ("all", w.all, h.all),
                ("small", w.small_pool, h.small_pool),
                ("large", w.large_pool, h.large_pool),
            ] {
                if a.current != b.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but the blocks sum to {}",
                        b.current, a.current
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Recorder {
    #[cold]
    fn push(&mut self, action: Action, addr: u64, size: u64, stream: Stream) {
        let ns = self.start.elapsed().as_nanos() as u64;
        self.events
            .push((ns, TraceEvent::new(action, addr, size, stream.0, ns / 1000)));
    }
}

/// Put `item` in a free slot of `slab` (listed in `spare`) or at its end; returns the slot.
fn slab_insert<T>(slab: &mut Vec<T>, spare: &mut Vec<u32>, item: T) -> u32 {
    match spare.pop() {
        Some(id) => {
            slab[id as usize] = item;
            id
        }
        None => {
            slab.push(item);
            (slab.len() - 1) as u32
        }
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
        for e in self.pending.iter().flat_map(|(_, evs)| evs.iter()) {
            let _ = self.backend.sync_event(*e);
            self.backend.destroy_event(*e);
        }
        for ev in self.checkpoints.iter().filter_map(|c| c.2) {
            self.backend.destroy_event(ev);
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mut synced = false;
        for seg in self.segment_index.values() {
            let s = &self.segments[*seg as usize];
            let Some(pages) = &s.pages else {
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
                if self.backend.unmap(s.addr + f * page, n * page).is_ok() {
                    self.shared.reserved.fetch_sub(n * page, Ordering::Relaxed);
                }
            }
            let _ = self.backend.release_address(s.addr, s.size);
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
