//! Allocator statistics, with PyTorch's `memory_stats()` vocabulary.

use serde::{Deserialize, Serialize};

/// One counter: current value, peak since the last reset, and cumulative increments/decrements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// current value
    pub current: u64,
    /// highest `current` since creation or [`Stats::reset_peak`]
    pub peak: u64,
    /// sum of all increments
    pub allocated: u64,
    /// sum of all decrements
    pub freed: u64,
}

impl Stat {
    fn merge(&mut self, o: &Stat) {
        self.current += o.current;
        self.peak += o.peak;
        self.allocated += o.allocated;
        self.freed += o.freed;
    }
}

/// Which pool a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum PoolKind {
    /// blocks of at most 1 MiB, in 2 MiB segments
    Small = 0,
    /// everything larger
    Large = 1,
}

/// A stat for all blocks and for each pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatArray {
    /// both pools
    pub all: Stat,
    /// the small pool
    pub small_pool: Stat,
    /// the large pool
    pub large_pool: Stat,
}

impl StatArray {
    /// Add `n` to the current value of all and of `pool` (for recomputing stats in checks).
    pub(crate) fn add_current(&mut self, pool: PoolKind, n: u64) {
        self.all.current += n;
        match pool {
            PoolKind::Small => self.small_pool.current += n,
            PoolKind::Large => self.large_pool.current += n,
        }
    }

    fn merge(&mut self, o: &StatArray) {
        self.all.merge(&o.all);
        self.small_pool.merge(&o.small_pool);
        self.large_pool.merge(&o.large_pool);
    }

    fn reset_peak(&mut self) {
        for s in [&mut self.all, &mut self.small_pool, &mut self.large_pool] {
            s.peak = s.current;
        }
    }
}

/// Everything the allocator counts. Serialisable; key names follow `torch.cuda.memory_stats()`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// number of blocks handed out
    pub allocation: StatArray,
    /// number of segments obtained from the device
    pub segment: StatArray,
    /// number of blocks allocated or waiting on stream events
    pub active: StatArray,
    /// number of free blocks that are part of a split segment
    pub inactive_split: StatArray,
    /// bytes handed out (rounded block sizes)
    pub allocated_bytes: StatArray,
    /// bytes obtained from the device
    pub reserved_bytes: StatArray,
    /// bytes allocated or waiting on stream events
    pub active_bytes: StatArray,
    /// bytes in free blocks of split segments (fragmentation)
    pub inactive_split_bytes: StatArray,
    /// bytes callers asked for (before rounding)
    pub requested_bytes: StatArray,
    /// allocations that had to free cached memory and retry
    pub num_alloc_retries: u64,
    /// allocations that failed with out-of-memory
    pub num_ooms: u64,
    /// segments obtained from the device
    pub num_device_alloc: u64,
    /// segments returned to the device
    pub num_device_free: u64,
    /// times the allocator waited on the host for pending stream work
    pub num_sync_all_streams: u64,
    /// allocations served from cached memory
    pub cache_hits: u64,
    /// allocations that needed a new segment
    pub cache_misses: u64,
    /// wholly free segments moved from one stream to another (event-ordered)
    pub num_cross_stream_reuses: u64,
    /// blocks freed with other streams recorded, whose reuse waited on events
    pub num_deferred_frees: u64,
    /// of those, blocks freed during a CUDA-graph capture and reused within it once their
    /// stream's work depended on their users' (PyTorch's graph_capture_record_stream_reuse)
    pub num_capture_reclaims: u64,
    /// bytes mapped into expandable segments (cumulative)
    pub mapped_bytes: u64,
    /// bytes unmapped from expandable segments (cumulative)
    pub unmapped_bytes: u64,
    /// host waits for one stream before unmapping its free pages
    pub num_unmap_syncs: u64,
    /// runs of pages moved in stream order (their stream's work may still be running: their
    /// memory is mapped again for the same stream at once, the old addresses unmapped once that
    /// work is done; one event recorded each)
    pub num_ordered_unmaps: u64,
    /// another stream's free pages taken in the allocating stream's order, the allocating
    /// stream made to wait for an event of the other (counted once per wait)
    pub num_cross_stream_moves: u64,
    /// free blocks of another stream's expandable segment handed out (mapped memory lent
    /// instead of pages moved; the allocating stream waits for the other's event on the GPU)
    pub num_cross_stream_blocks: u64,
    /// checkpoint events recorded (cuEventRecord) so that freed pages are known idle, or so
    /// that another stream may take them in its order (recorded when another stream needs
    /// them, not at every free)
    pub num_checkpoints: u64,
    /// allocations that moved pages (mapped beyond the allowance, so free pages elsewhere were
    /// unmapped first)
    pub num_page_moves: u64,
    /// of those, moves made because growing would pass the memory budget or the device was
    /// out of memory (made whatever the time budget; their time is in `page_map_ns`)
    pub num_pressure_moves: u64,
    /// nanoseconds charged to the time budget of page moves (see `pool/budget.rs`: moves,
    /// and maps below the high-water mark of reserved bytes, of memory moves unmapped): over
    /// the first T, at most 1% of T plus `page_growth_ns`, plus 10 ms and three of the longest
    /// move; over any later interval in which the job does not grow, 1% of it and 10 ms more
    pub page_move_ns: u64,
    /// the longest single move charged, ns
    pub page_move_longest_ns: u64,
    /// nanoseconds the allocating threads spent growing past the high-water mark of reserved
    /// bytes (what moves may take on top of 1% of wall time; see `pool/budget.rs`)
    pub page_growth_ns: u64,
    /// times page moves stopped because they overdrew the time budget (the pool then maps
    /// and keeps until the job's demand changes)
    pub num_move_stops: u64,
    /// nanoseconds the allocating threads spent mapping pages (moves included): what page
    /// work costs the job where it waits
    pub page_map_ns: u64,
    /// planned layouts made (see `pool/plan/`)
    pub num_plans: u64,
    /// plans that would have taken more memory than the dynamic layout held, left unused
    pub num_plans_declined: u64,
    /// plans forgotten because they kept losing the job before one whole cycle of their events
    pub num_plans_dropped: u64,
    /// starts that placed their plan on the allocating thread, around what was in the way
    pub num_plan_placements: u64,
    /// starts that took a placement made ahead, off the allocating thread
    pub num_plan_placements_ahead: u64,
    /// of those placements (either way), the ones mended from an earlier placement: only the
    /// slots that a new block in the way, or a block live across the start somewhere new,
    /// lands on placed again, where that spans no more than the earlier one did
    pub num_plan_repairs: u64,
    /// allocations served at their planned offsets
    pub num_plan_allocs: u64,
    /// allocations in step with a plan whose bytes were not free (served by the dynamic pool)
    pub num_plan_misses: u64,
    /// bytes of the planned regions mapped now (part of the reserved bytes)
    pub plan_reserved_bytes: u64,
    /// plans on their way: layouts being computed off the allocating thread (one a pool at a
    /// time), plans made that have not yet taken their region, which they take at the
    /// start of their period, and a plan that has yet to give back the pages of its region
    /// that none of its slots uses (a cycle or a few after it took it)
    pub plans_pending: u64,
    /// virtual-memory driver calls on the allocating threads (the backend's count, filled in
    /// by the allocator)
    pub vmm_calls_foreground: u64,
    /// virtual-memory driver calls on the backend's own thread (unmapping, releasing)
    pub vmm_calls_background: u64,
    /// times the backend waited for a stream's work before mapping over an address whose
    /// pages moved in stream order (or for its own thread's unmapping)
    pub vmm_waits: u64,
    /// pages mapped with the memory of pages moved in stream order
    pub vmm_aliased: u64,
    /// nanoseconds the allocating threads spent in the backend's maps, by phase (filled in by
    /// the allocator where the backend times them; the CUDA backend does): waiting for its
    /// own thread's unmapping
    pub vmm_wait_ns: u64,
    /// ... unmapping what lingered where pages go (and waiting for its work)
    pub vmm_unmap_ns: u64,
    /// ... creating and mapping handles
    pub vmm_map_ns: u64,
    /// ... setting access
    pub vmm_access_ns: u64,
    /// the backend's page calls by kind (filled in by the allocator): handles created, pages
    /// mapped, access set (once per mapped run), pages unmapped (on either thread), handles
    /// released, events recorded for moves
    pub vmm_creates: u64,
    /// see `vmm_creates`
    pub vmm_maps: u64,
    /// see `vmm_creates`
    pub vmm_set_access: u64,
    /// see `vmm_creates`
    pub vmm_unmaps: u64,
    /// see `vmm_creates`
    pub vmm_releases: u64,
    /// see `vmm_creates`
    pub vmm_records: u64,
    /// times the cache was released because other processes left the device short of free
    /// memory (`pressure_release`), filled in by the allocator
    pub num_pressure_releases: u64,
    /// nanoseconds the calling threads spent in allocations, the lock included (filled in by
    /// the allocator; counted only with the `time_calls` setting)
    pub host_alloc_ns: u64,
    /// ... in frees (`time_calls`)
    pub host_free_ns: u64,
    /// bytes of physical pages the backend keeps unmapped for the next map (not in
    /// `reserved_bytes`)
    pub vmm_spare_bytes: u64,
}

impl Stats {
    /// Subtract the accumulated counts of `base` (an earlier snapshot of the same counters):
    /// the `allocated` / `freed` totals of every array and the retry, out-of-memory, sync and
    /// device-call counts.
    pub fn subtract_accumulated(&mut self, base: &Stats) {
        let pairs = [
            (&mut self.allocation, &base.allocation),
            (&mut self.segment, &base.segment),
            (&mut self.active, &base.active),
            (&mut self.inactive_split, &base.inactive_split),
            (&mut self.allocated_bytes, &base.allocated_bytes),
            (&mut self.reserved_bytes, &base.reserved_bytes),
            (&mut self.active_bytes, &base.active_bytes),
            (&mut self.inactive_split_bytes, &base.inactive_split_bytes),
            (&mut self.requested_bytes, &base.requested_bytes),
        ];
        for (a, b) in pairs {
            for (x, y) in [
                (&mut a.all, &b.all),
                (&mut a.small_pool, &b.small_pool),
                (&mut a.large_pool, &b.large_pool),
            ] {
                x.allocated = x.allocated.saturating_sub(y.allocated);
                x.freed = x.freed.saturating_sub(y.freed);
            }
        }
        for (x, y) in [
            (&mut self.num_alloc_retries, base.num_alloc_retries),
            (&mut self.num_ooms, base.num_ooms),
            (&mut self.num_sync_all_streams, base.num_sync_all_streams),
            (&mut self.num_device_alloc, base.num_device_alloc),
            (&mut self.num_device_free, base.num_device_free),
        ] {
            *x = x.saturating_sub(y);
        }
    }

    /// Set every peak to its current value.
    pub fn reset_peak(&mut self) {
        for a in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            a.reset_peak();
        }
    }

    /// Add another shard's stats to these. Currents and cumulative counts add exactly; peaks add
    /// to an upper bound of the combined peak (exact when one shard did all the work).
    pub fn merge(&mut self, o: &Stats) {
        self.allocation.merge(&o.allocation);
        self.segment.merge(&o.segment);
        self.active.merge(&o.active);
        self.inactive_split.merge(&o.inactive_split);
        self.allocated_bytes.merge(&o.allocated_bytes);
        self.reserved_bytes.merge(&o.reserved_bytes);
        self.active_bytes.merge(&o.active_bytes);
        self.inactive_split_bytes.merge(&o.inactive_split_bytes);
        self.requested_bytes.merge(&o.requested_bytes);
        self.num_alloc_retries += o.num_alloc_retries;
        self.num_ooms += o.num_ooms;
        self.num_device_alloc += o.num_device_alloc;
        self.num_device_free += o.num_device_free;
        self.num_sync_all_streams += o.num_sync_all_streams;
        self.cache_hits += o.cache_hits;
        self.cache_misses += o.cache_misses;
        self.num_cross_stream_reuses += o.num_cross_stream_reuses;
        self.num_deferred_frees += o.num_deferred_frees;
        self.num_capture_reclaims += o.num_capture_reclaims;
        self.mapped_bytes += o.mapped_bytes;
        self.unmapped_bytes += o.unmapped_bytes;
        self.num_unmap_syncs += o.num_unmap_syncs;
        self.num_ordered_unmaps += o.num_ordered_unmaps;
        self.num_cross_stream_moves += o.num_cross_stream_moves;
        self.num_cross_stream_blocks += o.num_cross_stream_blocks;
        self.num_checkpoints += o.num_checkpoints;
        self.num_page_moves += o.num_page_moves;
        self.num_pressure_moves += o.num_pressure_moves;
        self.page_move_ns += o.page_move_ns;
        self.page_growth_ns += o.page_growth_ns;
        self.page_move_longest_ns = self.page_move_longest_ns.max(o.page_move_longest_ns);
        self.num_move_stops += o.num_move_stops;
        self.page_map_ns += o.page_map_ns;
        self.num_plans += o.num_plans;
        self.num_plans_declined += o.num_plans_declined;
        self.num_plan_placements += o.num_plan_placements;
        self.num_plan_placements_ahead += o.num_plan_placements_ahead;
        self.num_plan_repairs += o.num_plan_repairs;
        self.num_plans_dropped += o.num_plans_dropped;
        self.num_plan_allocs += o.num_plan_allocs;
        self.num_plan_misses += o.num_plan_misses;
        self.plan_reserved_bytes += o.plan_reserved_bytes;
        self.plans_pending += o.plans_pending;
    }

    /// Flat `"allocated_bytes.all.current" → value` map, like `torch.cuda.memory_stats()`.
    pub fn to_flat_map(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        let v = serde_json::to_value(self).unwrap_or_default();
        fn walk(
            prefix: &str,
            v: &serde_json::Value,
            m: &mut std::collections::BTreeMap<String, u64>,
        ) {
            match v {
                serde_json::Value::Object(o) => {
                    for (k, v) in o {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        walk(&key, v, m);
                    }
                }
                serde_json::Value::Number(n) => {
                    m.insert(prefix.to_string(), n.as_u64().unwrap_or(0));
                }
                _ => {}
            }
        }
        walk("", &v, &mut m);
        m
    }
}

/// One pool's counter on the hot path: current, peak and cumulative increments
/// (decrements are `total - cur`).
#[derive(Debug, Clone, Copy, Default)]
struct Lane {
    cur: u64,
    peak: u64,
    total: u64,
}

/// A counter for each pool plus the all-pool peak (the all-pool current is the lanes' sum):
/// the cheap form of a [`StatArray`] that the pool updates on every operation.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tri {
    lanes: [Lane; 2],
    all_peak: u64,
}

impl Tri {
    #[inline(always)]
    pub(crate) fn inc(&mut self, k: PoolKind, n: u64) {
        let l = &mut self.lanes[k as usize];
        l.cur += n;
        l.total += n;
        // peaks are stored only when they rise: an unconditional store on every call is one
        // more the shard lock's next acquire waits to drain (~2.5 ns of a 40 ns alloc+free)
        if l.cur > l.peak {
            l.peak = l.cur;
        }
        let all = self.current();
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    #[inline(always)]
    pub(crate) fn dec(&mut self, k: PoolKind, n: u64) {
        debug_assert!(self.lanes[k as usize].cur >= n, "stat underflow");
        self.lanes[k as usize].cur -= n;
    }

    #[inline(always)]
    pub(crate) fn current(&self) -> u64 {
        self.lanes[0].cur + self.lanes[1].cur
    }

    fn lane(&self, k: PoolKind) -> u64 {
        self.lanes[k as usize].cur
    }

    fn reset_peak(&mut self) {
        for l in &mut self.lanes {
            l.peak = l.cur;
        }
        self.all_peak = self.current();
    }

    fn snapshot(&self) -> StatArray {
        let stat = |l: &Lane| Stat {
            current: l.cur,
            peak: l.peak,
            allocated: l.total,
            freed: l.total - l.cur,
        };
        let (total, cur) = (self.lanes[0].total + self.lanes[1].total, self.current());
        StatArray {
            all: Stat {
                current: cur,
                peak: self.all_peak,
                allocated: total,
                freed: total - cur,
            },
            small_pool: stat(&self.lanes[0]),
            large_pool: stat(&self.lanes[1]),
        }
    }
}

/// The pool's live statistics, kept in the cheapest form to update; [`HotStats::snapshot`]
/// gives the public [`Stats`]. "Active" is derived: allocated blocks plus blocks waiting on
/// stream events, with its peak checked whenever it can grow (at allocation).
#[derive(Debug, Clone, Default)]
pub(crate) struct HotStats {
    allocation: Tri,
    allocated_bytes: Tri,
    requested_bytes: Tri,
    pending: Tri,
    pending_bytes: Tri,
    /// peaks of active count and bytes (small, large, all), kept once blocks have waited on
    /// events; until then active equals allocated and so do the peaks
    active_peak: [u64; 3],
    active_bytes_peak: [u64; 3],
    pending_seen: bool,
    pub(crate) segment: Tri,
    pub(crate) reserved_bytes: Tri,
    pub(crate) inactive_split: Tri,
    pub(crate) inactive_split_bytes: Tri,
    pub(crate) num_alloc_retries: u64,
    pub(crate) num_ooms: u64,
    pub(crate) num_device_alloc: u64,
    pub(crate) num_device_free: u64,
    pub(crate) num_sync_all_streams: u64,
    pub(crate) cache_hits: u64,
    pub(crate) cache_misses: u64,
    pub(crate) num_cross_stream_reuses: u64,
    pub(crate) num_deferred_frees: u64,
    pub(crate) num_capture_reclaims: u64,
    pub(crate) mapped_bytes: u64,
    pub(crate) unmapped_bytes: u64,
    pub(crate) num_unmap_syncs: u64,
    pub(crate) num_ordered_unmaps: u64,
    pub(crate) num_cross_stream_moves: u64,
    pub(crate) num_cross_stream_blocks: u64,
    pub(crate) num_checkpoints: u64,
    pub(crate) num_page_moves: u64,
    pub(crate) num_pressure_moves: u64,
    pub(crate) page_map_ns: u64,
    pub(crate) num_plans: u64,
    pub(crate) num_plans_declined: u64,
    pub(crate) num_plan_placements: u64,
    pub(crate) num_plan_placements_ahead: u64,
    pub(crate) num_plan_repairs: u64,
    pub(crate) num_plans_dropped: u64,
    pub(crate) num_plan_allocs: u64,
    pub(crate) num_plan_misses: u64,
}

impl HotStats {
    /// A block of `size` bytes handed out for a request of `req` bytes.
    #[inline(always)]
    pub(crate) fn on_alloc(&mut self, k: PoolKind, size: u64, req: u64) {
        self.allocation.inc(k, 1);
        self.allocated_bytes.inc(k, size);
        self.requested_bytes.inc(k, req);
        if self.pending_seen {
            self.update_active_peaks(k);
        }
    }

    #[cold]
    fn update_active_peaks(&mut self, k: PoolKind) {
        let i = k as usize;
        let count = self.allocation.lane(k) + self.pending.lane(k);
        let bytes = self.allocated_bytes.lane(k) + self.pending_bytes.lane(k);
        self.active_peak[i] = self.active_peak[i].max(count);
        self.active_bytes_peak[i] = self.active_bytes_peak[i].max(bytes);
        let count = self.allocation.current() + self.pending.current();
        let bytes = self.allocated_bytes.current() + self.pending_bytes.current();
        self.active_peak[2] = self.active_peak[2].max(count);
        self.active_bytes_peak[2] = self.active_bytes_peak[2].max(bytes);
    }

    /// A block returned by the caller; `deferred` if it waits on stream events first.
    #[inline(always)]
    pub(crate) fn on_free(&mut self, k: PoolKind, size: u64, req: u64, deferred: bool) {
        self.allocation.dec(k, 1);
        self.allocated_bytes.dec(k, size);
        self.requested_bytes.dec(k, req);
        if deferred {
            if !self.pending_seen {
                // from now on active peaks are tracked on their own, starting from the
                // allocated peaks they equalled so far
                self.pending_seen = true;
                self.active_peak = Self::peaks(&self.allocation);
                self.active_bytes_peak = Self::peaks(&self.allocated_bytes);
            }
            self.pending.inc(k, 1);
            self.pending_bytes.inc(k, size);
            self.num_deferred_frees += 1;
        }
    }

    /// A deferred block's events completed.
    pub(crate) fn on_pending_done(&mut self, k: PoolKind, size: u64) {
        self.pending.dec(k, 1);
        self.pending_bytes.dec(k, size);
    }

    pub(crate) fn allocation_count(&self) -> u64 {
        self.allocation.current()
    }

    pub(crate) fn reserved(&self) -> u64 {
        self.reserved_bytes.current()
    }

    pub(crate) fn allocated_large(&self) -> u64 {
        self.allocated_bytes.lane(PoolKind::Large)
    }

    pub(crate) fn allocated(&self) -> u64 {
        self.allocated_bytes.current()
    }

    pub(crate) fn reset_peak(&mut self) {
        for t in [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.pending,
            &mut self.pending_bytes,
            &mut self.segment,
            &mut self.reserved_bytes,
            &mut self.inactive_split,
            &mut self.inactive_split_bytes,
        ] {
            t.reset_peak();
        }
        self.pending_seen = self.pending.current() > 0;
        let active = self.active();
        let active_bytes = self.active_bytes();
        for (i, (c, b)) in [
            (active.small_pool, active_bytes.small_pool),
            (active.large_pool, active_bytes.large_pool),
            (active.all, active_bytes.all),
        ]
        .iter()
        .enumerate()
        {
            self.active_peak[i] = c.current;
            self.active_bytes_peak[i] = b.current;
        }
    }

    fn derived(base: &Tri, pending: &Tri, peaks: &[u64; 3]) -> StatArray {
        let (a, p) = (base.snapshot(), pending.snapshot());
        let mk = |a: Stat, p: Stat, peak: u64| Stat {
            current: a.current + p.current,
            peak,
            allocated: a.allocated,
            freed: a.allocated - (a.current + p.current),
        };
        StatArray {
            all: mk(a.all, p.all, peaks[2]),
            small_pool: mk(a.small_pool, p.small_pool, peaks[0]),
            large_pool: mk(a.large_pool, p.large_pool, peaks[1]),
        }
    }

    /// Peaks of `base` by pool (small, large, all).
    fn peaks(base: &Tri) -> [u64; 3] {
        let s = base.snapshot();
        [s.small_pool.peak, s.large_pool.peak, s.all.peak]
    }

    fn active(&self) -> StatArray {
        // until a block has waited on events, active is allocated, peaks included
        let peaks = if self.pending_seen {
            self.active_peak
        } else {
            Self::peaks(&self.allocation)
        };
        Self::derived(&self.allocation, &self.pending, &peaks)
    }

    fn active_bytes(&self) -> StatArray {
        let peaks = if self.pending_seen {
            self.active_bytes_peak
        } else {
            Self::peaks(&self.allocated_bytes)
        };
        Self::derived(&self.allocated_bytes, &self.pending_bytes, &peaks)
    }

    /// The public statistics.
    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            allocation: self.allocation.snapshot(),
            segment: self.segment.snapshot(),
            active: self.active(),
            inactive_split: self.inactive_split.snapshot(),
            allocated_bytes: self.allocated_bytes.snapshot(),
            reserved_bytes: self.reserved_bytes.snapshot(),
            active_bytes: self.active_bytes(),
            inactive_split_bytes: self.inactive_split_bytes.snapshot(),
            requested_bytes: self.requested_bytes.snapshot(),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            num_sync_all_streams: self.num_sync_all_streams,
            cache_hits: self.cache_hits,
            cache_misses: self.cache_misses,
            num_cross_stream_reuses: self.num_cross_stream_reuses,
            num_deferred_frees: self.num_deferred_frees,
            num_capture_reclaims: self.num_capture_reclaims,
            mapped_bytes: self.mapped_bytes,
            unmapped_bytes: self.unmapped_bytes,
            num_unmap_syncs: self.num_unmap_syncs,
            num_ordered_unmaps: self.num_ordered_unmaps,
            num_cross_stream_moves: self.num_cross_stream_moves,
            num_cross_stream_blocks: self.num_cross_stream_blocks,
            num_checkpoints: self.num_checkpoints,
            num_page_moves: self.num_page_moves,
            num_pressure_moves: self.num_pressure_moves,
            page_map_ns: self.page_map_ns,
            num_plans: self.num_plans,
            num_plans_declined: self.num_plans_declined,
            num_plan_placements: self.num_plan_placements,
            num_plan_placements_ahead: self.num_plan_placements_ahead,
            num_plan_repairs: self.num_plan_repairs,
            num_plans_dropped: self.num_plans_dropped,
            num_plan_allocs: self.num_plan_allocs,
            num_plan_misses: self.num_plan_misses,
            ..Stats::default()
        }
    }
}
