//! Expandable (virtual-memory) segments: one reserved address range per stream and pool, pages
//! mapped where blocks need them and moved from free blocks when the pool would grow.

use super::*;

/// Pages a run of busy free pages needs before it moves in stream order (see
/// `reclaim_pages`); chosen on replays of the real traces and the workload families with a
/// lagging GPU (1, 2, 4, 8 and 16 compared).
const MIN_ORDERED_RUN: u64 = 4;

/// Bytes mapped beyond the peak of allocated bytes (a fraction of it) before a map moves pages
/// rather than grows, where the high-water mark allows less: a move for the last 0.2% of a
/// job's peak buys little. It was the configuration key `expandable_slack` (default 0.002);
/// the key went, the value stayed: at 0 the workload families' moves took more time (KV
/// decoding 47 -> 261 ms over 50 draws) and tiny-next-to-huge's worst draw went from 1.144
/// to 1.297 (mean over the families 1.022 -> 1.023).
const SLACK: f64 = 0.002;

/// Device memory that growth leaves free before it counts as memory pressure: the driver and
/// the libraries take memory outside any allocator (a kernel's module loaded lazily, a
/// kernel's local memory, cuDNN's and cuBLAS's own), and a pool that maps the device's last
/// pages makes those fail (H100, LoRA under a 16 GiB cap: `CUDNN_STATUS_INTERNAL_ERROR` with
/// 19-31 MB left, where native PyTorch's last batch left 118 MiB). A 64th of the device, at
/// most 256 MiB. Growth into it moves free pages first, whatever the time budget; when they
/// do not suffice the pool still grows: the headroom never fails an allocation by itself.
const HEADROOM_MAX: u64 = 256 << 20;

/// How long a look at the device's free memory for its headroom stands (the backend's clock,
/// ns) where it showed room for twice the map and the headroom past the pool's growth since:
/// a look is a driver call (cuMemGetInfo, 6.7-7.8 µs on the H100's host). Other processes'
/// growth is the pressure watch's (`pressure_interval_ms`, 100 ms by default).
const LOOK_STANDS_NS: u64 = 100_000_000;

/// `x / page` for the pool's page size, a power of two (`CachingPool::new` takes no other):
/// a shift, not a division, on the hot path.
#[inline]
pub(super) fn page_index(x: u64, page: u64) -> u64 {
    debug_assert!(page.is_power_of_two());
    x >> page.trailing_zeros()
}

/// `x.div_ceil(page)` for the pool's page size (see [`page_index`]).
#[inline]
pub(super) fn page_count(x: u64, page: u64) -> u64 {
    page_index(x + (page - 1), page)
}

/// The pages `[first, end)` that the bytes `[lo, lo + size)` of a segment touch.
#[inline]
pub(super) fn page_span(lo: u64, size: u64, page: u64) -> (u64, u64) {
    (page_index(lo, page), page_count(lo + size, page))
}

/// The pages `[u0, u1)` of the segment at `base` that the physical handle mapped at its page
/// `q` spans (an unmap covers whole handles; see [`VirtualMemory::unit_at`]); page `q` alone
/// where no handle that starts in the segment is known there.
pub(super) fn handle_pages(
    vmm: Option<&dyn VirtualMemory>,
    base: u64,
    page: u64,
    q: u64,
) -> (u64, u64) {
    match vmm.and_then(|v| v.unit_at(base + q * page)) {
        Some((a, b)) if a >= base => ((a - base) / page, (a + b - base) / page),
        _ => (q, q + 1),
    }
}

impl CachingPool {
    /// Expandable segments: carve `size` bytes from the best-fitting free block `found` (or a
    /// new segment) and map whatever pages of it are not mapped yet.
    pub(super) fn place_expandable(
        &mut self,
        found: Option<u32>,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Result<u32> {
        // a block whose pages are all mapped needs no driver call: the smallest such among the
        // few smallest that fit, before the best fit that would map pages
        let mut found = match found {
            Some(id) if !self.mapped_under(id, size) => match self.mapped_fit(stream, size, kind) {
                Some(m) => {
                    self.enter_free(id);
                    Some(m)
                }
                None => Some(id),
            },
            f => f,
        };
        // with several streams, a free mapped block of another stream's segment rather than
        // pages moved (see `lending.rs`)
        let mut borrowed = None;
        if self.streams.len() >= 2
            && self.shared.captures.load(Ordering::Relaxed) == 0
            && self.would_move(found, size)
        {
            if let Some((id, owner, tick)) = self.borrow(stream, size, kind) {
                if let Some(f) = found {
                    self.enter_free(f);
                }
                found = Some(id);
                borrowed = Some((owner, tick));
            }
        }
        // pages that moved away from the block in stream order and are not known idle yet
        // need no wait: their memory lingers there for the stream's next map (see
        // `resource::page_map`), or the map waits for the old work before unmapping
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
        self.take_expandable(id, stream, borrowed)
    }

    /// Taken block `id` (split to its size; `borrowed` from another stream's segment with
    /// that stream and its free tick) is handed out on `stream` once its pages are mapped.
    pub(super) fn take_expandable(
        &mut self,
        id: u32,
        stream: Stream,
        borrowed: Option<(Stream, u64)>,
    ) -> Result<u32> {
        match self.ensure_mapped(id, stream) {
            Ok(0) => {
                self.stats.cache_hits += 1;
                self.settle_taken(id, stream, borrowed);
                Ok(id)
            }
            Ok(_) => {
                self.stats.cache_misses += 1;
                self.settle_taken(id, stream, borrowed);
                Ok(id)
            }
            Err(e) => {
                self.stats.cache_misses += 1;
                self.free_block(id);
                Err(e)
            }
        }
    }

    /// Bytes the pool may map before it would rather move pages than grow, with `peak` as the
    /// peak of allocated bytes: its high-water mark of reserved bytes (below it, mapping
    /// costs no memory the job has not had before), and at least the peak plus [`SLACK`].
    fn allowance(&self, peak: u64) -> u64 {
        self.high_water.max((peak as f64 * (1.0 + SLACK)) as u64)
    }

    /// Whether placing `size` bytes in `found` (taken; `None`: a new segment) would move pages:
    /// it needs pages mapped beyond the allowance.
    fn would_move(&self, found: Option<u32>, size: u64) -> bool {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let need = match found {
            None => size.div_ceil(page) * page,
            Some(id) => match self.pages_under(id, size) {
                Some((pages, p0, p1)) => {
                    pages.runs(p0, p1, false).iter().map(|r| r.1).sum::<u64>() * page
                }
                None => 0,
            },
        };
        let peak = self.peak_allocated.max(self.stats.allocated() + size);
        need > 0 && self.stats.reserved() + need > self.allowance(peak)
    }

    /// The pages of block `id`'s expandable segment and the range `[p0, p1)` of them that its
    /// first `size` bytes touch (`None` for a classic segment).
    #[inline]
    pub(super) fn pages_under(&self, id: u32, size: u64) -> Option<(&Pages, u64, u64)> {
        self.pages_within(id, 0, size)
    }

    /// [`CachingPool::pages_under`] for the bytes `[from, from + size)` of block `id`.
    #[inline(always)]
    pub(super) fn pages_within(&self, id: u32, from: u64, size: u64) -> Option<(&Pages, u64, u64)> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let b = &self.blocks[id as usize];
        let s = &self.segments[b.segment as usize];
        let pages = s.pages.as_deref()?;
        let (p0, p1) = page_span(b.addr + from - s.addr, size, page);
        Some((pages, p0, p1))
    }

    /// Whether the first `size` bytes of block `id` are all mapped.
    #[inline(always)]
    pub(super) fn mapped_under(&self, id: u32, size: u64) -> bool {
        self.mapped_within(id, 0, size)
    }

    /// Whether bytes `[from, from + size)` of block `id` are all mapped.
    #[inline(always)]
    pub(super) fn mapped_within(&self, id: u32, from: u64, size: u64) -> bool {
        self.pages_within(id, from, size)
            .is_none_or(|(pages, p0, p1)| pages.all_mapped(p0, p1))
    }

    /// The smallest free block among the few smallest that fit `size` whose first `size`
    /// bytes are all mapped; taken out of the free set.
    fn mapped_fit(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        let slot = self.slot_of(stream)?;
        let (_, _, id) = self.free[slot][kind as usize]
            .at_least(size)
            .take(32)
            .find(|&(bsize, _, id)| {
                bsize >= size && self.fits(size, bsize) && self.mapped_under(id, size)
            })?;
        self.leave_free(id);
        Some(id)
    }

    /// Address space reserved for one expandable segment.
    pub(super) fn va_size(&self, size: u64) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let va = self.capacity.saturating_mul(2).min(1 << 42).max(size);
        va.div_ceil(page) * page
    }

    /// A new expandable segment for `stream` and `kind`, nothing mapped; returns its single
    /// block, not in any free set.
    pub(super) fn grow_expandable(
        &mut self,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Result<u32> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let va = self.va_size(size);
        let addr = self.vmm()?.reserve_address(va)?;
        if addr % page != 0 {
            let _ = self.vmm().and_then(|v| v.release_address(addr, va));
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

    /// Map the unmapped pages under block `id` (taken, not free); returns the bytes mapped.
    /// Beyond the allowance (the high-water mark, or the peak of allocated bytes and
    /// [`SLACK`]), free pages elsewhere are unmapped first so that the physical memory does
    /// not grow (within the time budget, or where growing would pass the memory budget).
    pub(super) fn ensure_mapped(&mut self, id: u32, stream: Stream) -> Result<u64> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let (size, seg) = {
            let b = &self.blocks[id as usize];
            (b.size, b.segment)
        };
        let base = self.segments[seg as usize].addr;
        let runs = match self.pages_under(id, size) {
            // the common case, all mapped, costs one bitmap scan and no allocation
            Some((pages, p0, p1)) if pages.all_mapped(p0, p1) => return Ok(0),
            Some((pages, p0, p1)) => pages.runs(p0, p1, false),
            None => return Ok(0),
        };
        let need = runs.iter().map(|r| r.1).sum::<u64>() * page;
        if need == 0 {
            return Ok(0);
        }
        self.peak_allocated = self.peak_allocated.max(self.stats.allocated() + size);
        let peak = self.peak_allocated;
        let reserved = self.stats.reserved();
        let over = reserved
            .saturating_add(need)
            .saturating_sub(self.allowance(peak));
        self.page_work(stream, over, need, peak, |pool, moving| {
            if moving {
                // no waiting here: pages not yet known idle stay, new ones are mapped
                pool.reclaim_pages(Some(stream), over, false);
            }
            let mut besides = false;
            let mut result = Ok(need);
            for (first, n) in runs {
                let (a, bytes) = (base + first * page, n * page);
                // memory this stream's moved pages left is taken first; where the device is
                // short, free pages move here before the cache is released (which waits for
                // the GPU)
                let (mut r, short) = pool.map_or_move(a, bytes, stream);
                besides |= short.is_some();
                if matches!(&r, Err(e) if e.is_out_of_memory()) {
                    pool.stats.num_alloc_retries += 1;
                    pool.release_cached();
                    r = pool.vmm().and_then(|v| v.map_on(a, bytes, stream));
                    if matches!(&r, Err(e) if e.is_out_of_memory()) && !pool.pending.is_empty() {
                        pool.sync_pending();
                        pool.release_cached();
                        r = pool.vmm().and_then(|v| v.map_on(a, bytes, stream));
                    }
                }
                match r {
                    Ok(()) => pool.note_mapped(seg, first, n, true),
                    Err(e) => {
                        result = Err(if e.is_out_of_memory() {
                            // the handles the failed map made go back to the device first,
                            // so that the report (and whoever allocates next) sees its memory
                            if let Ok(v) = pool.vmm() {
                                v.trim();
                            }
                            pool.oom_error(size, need)
                        } else {
                            e
                        });
                        break;
                    }
                }
            }
            (result, besides)
        })?
    }

    /// Map `[a, a + bytes)` for `stream` (`map_on`); where the device is short of memory, free
    /// pages move here first, whatever the time budget, and the map is tried again (a move
    /// counted in `num_pressure_moves`, for the dynamic pool's maps and a plan's region's
    /// alike). Returns the map's result and, where the device was short, the bytes that moved.
    pub(super) fn map_or_move(
        &mut self,
        a: DevPtr,
        bytes: u64,
        stream: Stream,
    ) -> (Result<()>, Option<u64>) {
        let r = self.vmm().and_then(|v| v.map_on(a, bytes, stream));
        if !matches!(&r, Err(e) if e.is_out_of_memory()) {
            return (r, None);
        }
        let got = self.reclaim_pages(Some(stream), bytes, false);
        if got == 0 {
            return (r, Some(0));
        }
        self.stats.num_pressure_moves += 1;
        (
            self.vmm().and_then(|v| v.map_on(a, bytes, stream)),
            Some(got),
        )
    }

    /// Whether a map of `need` bytes, `over` of them past what may be mapped without moving
    /// pages, moves free pages first: `(pressure, budgeted)`. Where growing would pass the
    /// memory budget, whatever the time costs; else within the time budget of page moves
    /// (see `budget.rs`), where moves are on; else where growing would pass the device's
    /// headroom ([`HEADROOM_MAX`]), whatever the time costs; otherwise the pool grows, as
    /// PyTorch's expandable segments do. Counts the move.
    pub(super) fn moves_now(&mut self, over: u64, need: u64, now: u64, peak: u64) -> (bool, bool) {
        let limit = over > 0 && self.over_limit(need);
        let budgeted = over > 0 && !limit && self.policy.moves && self.budget.may_move(now, peak);
        // (the device is looked at only where the pool would otherwise grow)
        let pressure = limit || (over > 0 && !budgeted && self.device_short(need, now));
        if pressure || budgeted {
            self.stats.num_page_moves += 1;
            self.stats.num_pressure_moves += u64::from(pressure);
        }
        (pressure, budgeted)
    }

    /// The frame of page work for a map of `need` bytes on `stream`, `over` of them past what
    /// may be mapped without moving pages (`peak`: the peak of allocated bytes). Whether free
    /// pages move first is [`CachingPool::moves_now`]'s call; `work` makes the move where it
    /// is told to (`true`), then the maps, and says whether it moved pages besides (a map
    /// short of memory). A move is then finished, whatever `work` returned: what it unmapped
    /// and no map took is spare, and the stream's next move records an event of its own
    /// rather than share this one's, recorded before the work queued since (the simulated
    /// device asserts it). Last, the work is accounted: moves paid from the time budget are
    /// charged to it; a map that moved nothing is growth, which fills growth's account where
    /// it raised the high-water mark; what fitting under the memory budget costs is not
    /// charged.
    pub(super) fn page_work<T>(
        &mut self,
        stream: Stream,
        over: u64,
        need: u64,
        peak: u64,
        work: impl FnOnce(&mut Self, bool) -> (T, bool),
    ) -> Result<T> {
        let started = self.vmm()?.now_ns();
        let high_water = self.high_water;
        let (pressure, budgeted) = self.moves_now(over, need, started, peak);
        let (out, besides) = work(self, pressure || budgeted);
        let moved = pressure || budgeted || besides;
        if moved {
            let _ = self.vmm().map(|v| v.finish_move(stream));
        }
        let took = self.vmm()?.now_ns().saturating_sub(started);
        self.stats.page_map_ns += took;
        self.budget.note_work(started + took, took, budgeted);
        if budgeted {
            self.budget.charge(took);
        } else if !moved {
            let new_high = self.high_water > high_water;
            self.budget.note_growth(started + took, took, new_high);
        }
        Ok(out)
    }

    /// Whether mapping `need` more bytes would pass the memory budget (`memory_fraction`,
    /// `memory_limit_mb`, `set_per_process_memory_fraction`), all shards counted.
    fn over_limit(&self, need: u64) -> bool {
        self.backend
            .limit()
            .is_some_and(|l| self.shared.reserved.load(Ordering::Relaxed) + need > l)
    }

    /// Whether mapping `need` more bytes would leave the device less free memory than its
    /// headroom ([`HEADROOM_MAX`]), the physical handles the page engine keeps spare counted as
    /// free. A look at the device's free memory (a driver call) at `now` (the backend's
    /// clock), unless the last one stands ([`LOOK_STANDS_NS`]). Device memory only (CUDA, the
    /// simulator).
    fn device_short(&mut self, need: u64, now: u64) -> bool {
        if !self.backend.location().is_device_memory() {
            return false;
        }
        // (the device's memory: the memory budget has its own check, `over_limit`)
        let reserved = self.shared.reserved.load(Ordering::Relaxed);
        let (free, then, at) = self.device_look;
        if at != 0 && now.saturating_sub(at) < LOOK_STANDS_NS {
            // room at the last look for twice this map and the headroom, past what the pool
            // has mapped since
            let left = free.saturating_sub(reserved.saturating_sub(then));
            if left / 2 >= need.saturating_add(HEADROOM_MAX) {
                return false;
            }
        }
        let Ok(info) = self.backend.device_mem_info() else {
            return false;
        };
        let spare = self
            .backend
            .virtual_memory()
            .map_or(0, |v| v.calls().spare_bytes);
        let headroom = (info.total / 64).min(HEADROOM_MAX);
        let free = info.free.saturating_add(spare);
        self.device_look = (free, reserved, now.max(1));
        free < need.saturating_add(headroom)
    }

    /// Record that pages `[first, first + n)` of `seg` were mapped (`on`) or unmapped.
    pub(super) fn note_mapped(&mut self, seg: u32, first: u64, n: u64, on: bool) {
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
            self.tell_pages(SegmentChange::Map, seg, first, n);
            self.stats.reserved_bytes.inc(kind, bytes);
            self.high_water = self.high_water.max(self.stats.reserved());
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
    /// segments, those of `current` first and the highest addresses first. Pages freed before
    /// the owner stream's last completed checkpoint event are idle and go (checkpoints are
    /// recorded when blocks are freed, so every stream has one). On the allocation path
    /// (`current` is the allocating stream, no `may_wait`) the rest of `current`'s own free
    /// pages move in stream order ([`VirtualMemory::unmap_after`]): the map that follows takes
    /// their memory at once, as reusing a freed block on its own stream would, and their old
    /// addresses are unmapped once the stream's queued work is done; so pages move while the
    /// GPU is behind the host, with no wait. Another stream's free pages, freed before its
    /// newest checkpoint, move the same way once `current` waits for that checkpoint on the GPU
    /// ([`CachingPool::move_across_streams`]). Otherwise a fresh checkpoint is recorded on
    /// `current` and, if the stream has already caught up, more pages are safe. Only with
    /// `may_wait` (emptying the cache, out of memory: never on the allocation path) does the
    /// pool then wait for the stream, or the whole device for segments of other streams
    /// (which may have been destroyed since). Returns the bytes unmapped.
    pub(super) fn reclaim_pages(
        &mut self,
        current: Option<Stream>,
        want: u64,
        may_wait: bool,
    ) -> u64 {
        if self.policy.page.is_none() || want == 0 {
            return 0;
        }
        self.flush_quick();
        if !self.foreign.is_empty() {
            // which other users of free blocks are done by now
            for i in 0..self.checkpoints.len() {
                self.safe_tick(self.checkpoints[i].stream);
            }
        }
        let mut order: Vec<u32> = self
            .segment_index
            .values()
            .copied()
            .filter(|&s| {
                // (a plan's region keeps its pages)
                let s = &self.segments[s as usize];
                s.pages.is_some() && !s.planned
            })
            .collect();
        order.sort_by_key(|&s| Some(self.segments[s as usize].stream) != current);
        let mut got = 0u64;
        for seg in order {
            if got >= want {
                break;
            }
            let owner = self.segments[seg as usize].stream;
            // 1: pages known to be idle; on the allocation path they go straight to the map
            // that follows (no handle created for it, none left over)
            let safe = self.safe_tick(owner);
            let runs = self.free_mapped_runs(seg, want - got, safe, None);
            got += match current {
                Some(s) if !may_wait => self.unmap_runs_after(seg, runs, s, false),
                _ => self.unmap_runs(seg, runs),
            };
            if got >= want {
                break;
            }
            // (with `may_wait`, free pages that a lent block's borrower may still use are
            // waited for below: the whole device, since that stream is not the owner)
            let lent_busy = may_wait && self.lent_use_pending(seg);
            if !lent_busy && !self.any_free_mapped(seg, current) {
                continue;
            }
            let own = Some(owner) == current && !lent_busy;
            if !may_wait {
                // 2: on the allocation path, busy pages move in the allocating stream's order
                match current {
                    Some(_) if own => {
                        // its own pages, in runs of a few pages at least: the old addresses
                        // stay unusable until the stream's work passes them, which for small
                        // runs scattered among live blocks costs more than it saves. Once the
                        // job has repeated (the detector found a period), and while no plan
                        // follows it, stretches shorter than that are passed over for longer
                        // ones lower in the segment. Otherwise the runs are cut to `want`
                        // first and the short ones then left out, so that a move may get
                        // nothing while longer runs lie lower down: passing over them in the
                        // warm-up too took resres 1.0106 -> 1.0082 and moe16 (GPU 3000 calls
                        // behind) 1.085 -> 1.073, but ResNet-50's driver share there 0.994%
                        // -> 1.016% (4 more moves in its warm-up, where its first step's
                        // growth takes most of the 1%); with a plan in step, 4 of 30 convnet
                        // draws recorded 4-8 move events every step (the small pool's pages
                        // going to the large pool and back). As it is: serve 1.046 / 1.068 /
                        // 1.072 -> 1.033 at every lag, the moe family's mean 1.0082 -> 1.0065,
                        // the variable-resolution convnets' 1.0101 -> 1.0071; every other
                        // real trace the same to the byte. Measured 2026-11-27.
                        self.order_for_foreign(seg, owner);
                        let runs: Vec<(u64, u64)> =
                            if self.plans.repeated() && !self.plans.in_step() {
                                self.free_mapped_runs_of(
                                    seg,
                                    want - got,
                                    u64::MAX,
                                    Some(owner),
                                    MIN_ORDERED_RUN,
                                )
                            } else {
                                self.free_mapped_runs(seg, want - got, u64::MAX, Some(owner))
                                    .into_iter()
                                    .filter(|r| r.1 >= MIN_ORDERED_RUN)
                                    .collect()
                            };
                        got += self.unmap_runs_after(seg, runs, owner, true);
                    }
                    Some(cur) => got += self.move_across_streams(seg, owner, cur, want - got),
                    None => {}
                }
                continue;
            }
            if own {
                // 2: a fresh checkpoint, complete at once if the stream is idle
                self.checkpoint(owner);
                let safe = self.safe_tick(owner);
                let runs = self.free_mapped_runs(seg, want - got, safe, None);
                got += self.unmap_runs(seg, runs);
                if got >= want {
                    break;
                }
                if self
                    .free_mapped_runs(seg, want - got, u64::MAX, None)
                    .is_empty()
                {
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
            let runs = self.free_mapped_runs(seg, want - got, u64::MAX, None);
            got += self.unmap_runs(seg, runs);
        }
        // last, the pages of the planned region that its plan does not use
        if got < want {
            got += self.plan_trim_current(want - got);
        }
        got
    }

    /// Move up to about `want` bytes of the free pages of `seg`, a segment of stream `owner`,
    /// to `current`'s next map, in `current`'s order: pages freed before a checkpoint of
    /// `owner` (its newest, or, when those pages fall short and `owner` is known alive, one
    /// recorded now: see [`CachingPool::cover`]), once `current` waits for that checkpoint's
    /// event (as `cudaMallocAsync` reuses another stream's memory through an event dependency).
    /// Work queued on `current` from now on runs after what `owner` had queued by the
    /// checkpoint; nothing waits on the host. Returns the bytes unmapped.
    fn move_across_streams(&mut self, seg: u32, owner: Stream, current: Stream, want: u64) -> u64 {
        if self.capturing(current) {
            return 0; // a wait recorded now would be part of the graph
        }
        // (no checkpoint outstanding: the owner's frees up to its last one are idle, and only
        // lent blocks given back there may still be in use)
        let mut tick = match self.newest_checkpoint(owner) {
            Some((_, tick)) => tick,
            None => self.safe_tick(owner),
        };
        self.order_for_foreign(seg, current);
        let mut runs = self.free_mapped_runs(seg, want, tick, Some(current));
        let have: u64 = runs.iter().map(|r| r.1).sum();
        if tick < self.tick && have < want && self.may_record_on(owner) {
            // the pages freed since, through a checkpoint recorded on demand
            let all = self.free_mapped_runs(seg, want, self.tick, Some(current));
            if all.iter().map(|r| r.1).sum::<u64>() > have {
                (tick, runs) = (self.tick, all);
            }
        }
        if runs.is_empty() {
            return 0;
        }
        // (one wait per other stream and checkpoint: `order_after` remembers it)
        self.order_after(current, owner, tick);
        self.unmap_runs_after(seg, runs, current, true)
    }

    /// The free bytes of `seg`, `(addr, bytes)` in address order: its free blocks, less the
    /// bytes of lent blocks given back whose stream is not done with them and `mover` is not
    /// ordered after (see `lending.rs`).
    pub(super) fn free_parts(&self, seg: u32, mover: Option<Stream>) -> Vec<(u64, u64)> {
        let s = &self.segments[seg as usize];
        let mut free = Vec::new();
        let mut id = s.head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if b.state == State::Free {
                if self.foreign.is_empty() {
                    free.push((b.addr, b.size));
                } else {
                    // (bytes another stream used last keep their pages until it is done)
                    free.extend(self.idle_parts(id, mover));
                }
            }
            id = b.next;
        }
        // (a planned region's free blocks are not coalesced: neighbours are one part)
        free.dedup_by(|b, a| {
            let joined = a.0 + a.1 == b.0;
            if joined {
                a.1 += b.1;
            }
            joined
        });
        free
    }

    /// Whether a lent block given back in `seg` may still be in use by its borrower (no
    /// checkpoint of the borrower known complete covers its free).
    fn lent_use_pending(&self, seg: u32) -> bool {
        self.foreign.iter().any(|(&id, uses)| {
            self.blocks[id as usize].segment == seg
                && uses.iter().any(|u| self.known_safe(u.stream) < u.tick)
        })
    }

    /// Whether a free part of `seg` (see [`CachingPool::free_parts`]) holds a whole mapped
    /// page, whenever it was freed: worth ordering `mover` after its users to move it.
    fn any_free_mapped(&self, seg: u32, mover: Option<Stream>) -> bool {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let s = &self.segments[seg as usize];
        let Some(pages) = &s.pages else {
            return false;
        };
        self.free_parts(seg, mover).iter().any(|&(addr, size)| {
            let (first, end) = (
                (addr - s.addr).div_ceil(page),
                (addr + size - s.addr) / page,
            );
            first < end && pages.next_with(first, end, true) < end
        })
    }

    /// Runs of mapped pages lying wholly inside free blocks of `seg` and last freed at or
    /// before `max_tick`, highest first, about `want` bytes. Bytes of a lent block given back
    /// count only once its stream is done with them, or when they move in the order of
    /// `mover`, a stream that is that stream or was made to wait for it.
    pub(super) fn free_mapped_runs(
        &self,
        seg: u32,
        want: u64,
        max_tick: u64,
        mover: Option<Stream>,
    ) -> Vec<(u64, u64)> {
        self.free_mapped_runs_of(seg, want, max_tick, mover, 1)
    }

    /// [`CachingPool::free_mapped_runs`] where the free pages of a stretch of mapped pages
    /// count only if they come to `min_run` pages at least (a shorter stretch is passed over,
    /// not taken first and then dropped).
    pub(super) fn free_mapped_runs_of(
        &self,
        seg: u32,
        want: u64,
        max_tick: u64,
        mover: Option<Stream>,
        min_run: u64,
    ) -> Vec<(u64, u64)> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let s = &self.segments[seg as usize];
        let Some(pages) = &s.pages else {
            return Vec::new();
        };
        let free = self.free_parts(seg, mover);
        // whole physical handles (`unit_at`: an unmap covers whole ones) whose pages were all
        // last freed at or before `max_tick`, from the top
        let vmm = self.vmm().ok();
        let mut units: Vec<(u64, u64)> = Vec::new();
        let mut left = want;
        'blocks: for &(addr, size) in free.iter().rev() {
            let first = (addr - s.addr).div_ceil(page);
            let end = (addr + size - s.addr) / page;
            if first >= end {
                continue;
            }
            for (f, n) in pages.runs(first, end, true).into_iter().rev() {
                if n < min_run {
                    continue;
                }
                let from = units.len();
                let mut p = f + n;
                while p > f {
                    let (u0, u1) = handle_pages(vmm, s.addr, page, p - 1);
                    let whole = u0 >= f
                        && u0 < p
                        && u1 == p
                        && (u0..u1).all(|q| pages.freed_at(q) <= max_tick);
                    if whole {
                        units.push((u0, u1 - u0));
                    }
                    p = u0.clamp(f, p - 1);
                }
                if units[from..].iter().map(|u| u.1).sum::<u64>() < min_run {
                    units.truncate(from);
                    continue;
                }
                // (the units of this stretch, highest first, until `want` is met)
                for k in from..units.len() {
                    left = left.saturating_sub(units[k].1 * page);
                    if left == 0 {
                        units.truncate(k + 1);
                        break 'blocks;
                    }
                }
            }
        }
        // adjacent units as one run (they come highest first)
        let mut runs: Vec<(u64, u64)> = Vec::with_capacity(units.len());
        for (u, n) in units {
            match runs.last_mut() {
                Some(r) if u + n == r.0 => {
                    r.0 = u;
                    r.1 += n;
                }
                _ => runs.push((u, n)),
            }
        }
        runs
    }

    /// Unmap `runs` of `seg` for `stream`'s next map, in its order where the pages are `busy`
    /// (see [`VirtualMemory::unmap_after`]); returns the bytes unmapped.
    pub(super) fn unmap_runs_after(
        &mut self,
        seg: u32,
        runs: Vec<(u64, u64)>,
        stream: Stream,
        busy: bool,
    ) -> u64 {
        let (got, done) = self.unmap_each(seg, runs, "in stream order ", |v, a, bytes| {
            v.unmap_after(a, bytes, stream, busy)
        });
        if busy {
            self.stats.num_ordered_unmaps += done;
        }
        got
    }

    /// Unmap `runs` of `seg`; returns the bytes unmapped.
    pub(super) fn unmap_runs(&mut self, seg: u32, runs: Vec<(u64, u64)>) -> u64 {
        self.unmap_each(seg, runs, "", |v, a, bytes| v.unmap(a, bytes))
            .0
    }

    /// Unmap each of `runs` of `seg` with `unmap`, the hooks told first (and told again that
    /// a run is mapped where its unmap fails); returns the bytes and the runs unmapped.
    fn unmap_each(
        &mut self,
        seg: u32,
        runs: Vec<(u64, u64)>,
        how: &str,
        unmap: impl Fn(&dyn VirtualMemory, DevPtr, u64) -> Result<()>,
    ) -> (u64, u64) {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let base = self.segments[seg as usize].addr;
        let (mut got, mut done) = (0, 0);
        for (first, n) in runs {
            let (a, bytes) = (base + first * page, n * page);
            self.tell_pages(SegmentChange::Unmap, seg, first, n);
            match self.vmm().and_then(|v| unmap(v, a, bytes)) {
                Ok(()) => {
                    self.note_mapped(seg, first, n, false);
                    got += bytes;
                    done += 1;
                }
                Err(e) => {
                    self.tell_pages(SegmentChange::Map, seg, first, n);
                    tracing::warn!("gpumem: unmapping pages {how}failed: {e}")
                }
            }
        }
        (got, done)
    }

    /// The free memory in mapped whole pages of expandable segments, by what a page move can
    /// do with it: `(movable, stranded)`. Movable: the pages of physical handles that hold
    /// only free bytes (an unmap takes them whole). Stranded: free whole pages in handles
    /// that blocks in use (or quick-cached, or waiting on events) also cover: an unmap covers
    /// whole handles, so these pages stay where they are until those blocks are freed, and
    /// the pool grows instead of moving them.
    pub fn free_page_kinds(&self) -> (u64, u64) {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        if self.vmm().is_err() {
            return (0, 0);
        }
        let (mut movable, mut stranded) = (0, 0);
        for &seg in self.segment_index.values() {
            let s = &self.segments[seg as usize];
            let Some(pages) = &s.pages else {
                continue;
            };
            // every mapped whole page of its free bytes...
            let free: u64 = self
                .free_parts(seg, None)
                .into_iter()
                .map(|(addr, size)| {
                    let first = (addr - s.addr).div_ceil(page);
                    let end = (addr + size - s.addr) / page;
                    if first >= end {
                        return 0;
                    }
                    pages
                        .runs(first, end, true)
                        .iter()
                        .map(|r| r.1)
                        .sum::<u64>()
                })
                .sum();
            // ...and those of handles that hold nothing else, which a move takes whole
            let whole: u64 = self
                .free_mapped_runs(seg, u64::MAX, u64::MAX, None)
                .iter()
                .map(|r| r.1)
                .sum();
            movable += whole * page;
            stranded += (free - whole) * page;
        }
        (movable, stranded)
    }

    pub(super) fn largest_mapped_free(&self) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mut best = self
            .quick
            .iter()
            .map(|&(_, _, id, _)| self.blocks[id as usize].size)
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
}

/// The tick of page `p` in a per-page tick list (0 past its end: never).
fn tick_at(ticks: &[u64], p: u64) -> u64 {
    ticks.get(p as usize).copied().unwrap_or(0)
}

/// Set the ticks of pages `[from, to)` (below `high`, the list growing to `high` as needed);
/// `newest`: `tick` is the pool's tick now, at or past every tick set before.
fn mark_ticks(ticks: &mut Vec<u64>, high: u64, from: u64, to: u64, tick: u64, newest: bool) {
    let to = to.min(high);
    if from >= to {
        return;
    }
    if ticks.len() < to as usize {
        ticks.resize(high as usize, 0);
    }
    let span = &mut ticks[from as usize..to as usize];
    if newest {
        span.fill(tick);
        return;
    }
    // (a block leaving the quick cache brings the older tick of its user's free: a page it
    // shares with a block freed since keeps the later one)
    for t in span {
        *t = (*t).max(tick);
    }
}

/// The mapped pages of an expandable segment: one bit per page.
#[derive(Debug)]
pub(super) struct Pages {
    pub(super) bits: Vec<u64>,
    pub(super) mapped: u64,
    /// no page at or above this one has ever been mapped (bounds the scans)
    pub(super) high: u64,
    /// pool tick at which each page (below `high`) was last part of a block being freed
    pub(super) freed: Vec<u64>,
}

impl Pages {
    pub(super) fn new(n: u64) -> Self {
        Self {
            bits: vec![0; n.div_ceil(64) as usize],
            mapped: 0,
            high: 0,
            freed: Vec::new(),
        }
    }

    pub(super) fn set(&mut self, first: u64, n: u64, on: bool) {
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

    pub(super) fn freed_at(&self, p: u64) -> u64 {
        tick_at(&self.freed, p)
    }

    /// Mark pages `[from, to)` as freed at `tick` (`newest`: the pool's tick now).
    pub(super) fn mark_freed(&mut self, from: u64, to: u64, tick: u64, newest: bool) {
        mark_ticks(&mut self.freed, self.high, from, to, tick, newest);
    }

    /// Whether the pages `[from, to)` are all mapped: at once where no page below `high` is
    /// unmapped (every mapped page lies below it), the common case.
    #[inline]
    pub(super) fn all_mapped(&self, from: u64, to: u64) -> bool {
        (to <= self.high && self.mapped == self.high) || self.next_with(from, to, false) >= to
    }

    /// Runs `(first, count)` of pages in `[from, to)` that are mapped (`want`) or not.
    pub(super) fn runs(&self, from: u64, to: u64, want: bool) -> Vec<(u64, u64)> {
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
    pub(super) fn next_with(&self, mut p: u64, to: u64, want: bool) -> u64 {
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
