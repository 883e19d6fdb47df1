//! The request path: allocate (quick cache, best fit, then the segment kind's own placement) and free.

use super::*;

impl CachingPool {
    /// Allocate `bytes` bytes on `stream` with `align` (a power of two ≤ [`MAX_ALIGN`]); the
    /// block can be freed by address ([`CachingPool::free`]) or id.
    pub fn allocate(&mut self, stream: Stream, bytes: usize, align: usize) -> Result<PoolAlloc> {
        self.allocate_inner(stream, bytes, align, true, Handout::Address)
    }

    /// [`CachingPool::allocate`] with options: `count_oom` false lets a caller that will retry
    /// elsewhere count the out-of-memory itself; `handout` says how the block comes back
    /// ([`Handout::Id`] and [`Handout::Token`] skip the address map, which is faster).
    ///
    /// Inlined into its callers, with `hand_out`: returned through memory,
    /// the 56-byte `Result` was copied with wide loads over narrower stores just made, which
    /// stall (store forwarding fails): a fifth of a same-size alloc + free on the dev VM
    /// (33 -> 27 ns), a third on an H200 machine's host (`gpumem bench alloc` same_size
    /// 81.5-88.3 -> 55.3-58.5 ns).
    #[inline(always)]
    pub fn allocate_inner(
        &mut self,
        stream: Stream,
        bytes: usize,
        align: usize,
        count_oom: bool,
        handout: Handout,
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
        if !self.deferred.is_empty() && self.shared.captures.load(Ordering::Relaxed) > 0 {
            self.reclaim_captured(stream);
        }
        if size > SMALL_SIZE && self.plans.busy() {
            if let Some(id) = self.plan_alloc(stream, size) {
                self.stats.cache_hits += 1;
                return Ok(self.hand_out(id, req, size, stream, handout));
            }
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
        Ok(self.hand_out(id, req, size, stream, handout))
    }

    /// Mark taken block `id` handed out for a request of `req` bytes (rounded to `rounded`).
    #[inline(always)]
    pub(super) fn hand_out(
        &mut self,
        id: u32,
        req: u64,
        rounded: u64,
        stream: Stream,
        handout: Handout,
    ) -> PoolAlloc {
        let b = &mut self.blocks[id as usize];
        b.state = State::Allocated;
        b.requested = req;
        b.rounded = rounded;
        b.handout = handout;
        b.generation = b.generation.wrapping_add(1);
        let (addr, bsize, kind, generation) = (b.addr, b.size, b.kind, b.generation);
        if handout == Handout::Address {
            self.live.insert(addr, id);
        }
        self.stats.on_alloc(kind, bsize, req);
        self.shared.on_alloc(bsize);
        debug_assert!(
            self.blocks[id as usize].stream == stream || self.lent.get(&id) == Some(&stream),
            "a block handed out to a stream neither owns nor borrows it"
        );
        self.count_live(stream, true);
        self.note_event(id, rounded, false);
        self.record(Action::Alloc, addr, req, stream);
        PoolAlloc {
            addr,
            block_size: bsize,
            id,
            generation,
        }
    }

    /// Exact-size reuse of a recently freed block of the same stream.
    #[inline]
    pub(super) fn take_quick(&mut self, stream: Stream, size: u64) -> Option<u32> {
        if self.quick.is_empty() {
            return None;
        }
        let Some(pos) = self
            .quick
            .iter()
            .rposition(|&(s, st, _, _)| s == size && st == stream)
        else {
            self.quick_score = (self.quick_score - 1).max(-64);
            if self.quick_score < 0 {
                // sizes are not repeating: coalesce the probe entries rather than scan them
                self.flush_quick();
            }
            return None;
        };
        self.quick_score = (self.quick_score + 8).min(64);
        Some(self.take_quick_at(pos))
    }

    /// Take entry `pos` out of the quick cache; returns its block.
    #[inline]
    pub(super) fn take_quick_at(&mut self, pos: usize) -> u32 {
        let (_, _, id, _) = self.quick.swap_remove(pos);
        self.unmark_inactive(id);
        id
    }

    pub(super) fn kind_of(size: u64) -> PoolKind {
        if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    pub(super) fn find_or_grow(&mut self, stream: Stream, size: u64) -> Result<u32> {
        let kind = Self::kind_of(size);
        if self.policy.page.is_some() {
            return self.find_or_grow_expandable(stream, size, kind);
        }
        let id = match self.best_fit(stream, size, kind) {
            None if !self.quick.is_empty() => {
                self.flush_quick();
                self.best_fit(stream, size, kind)
            }
            id => id,
        };
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

    /// [`CachingPool::find_or_grow`] with expandable segments. The best fit whose pages are
    /// all mapped, the common case, is taken as it is: no page work, and nothing to borrow
    /// instead (no page would move); else `place_expandable`.
    fn find_or_grow_expandable(
        &mut self,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Result<u32> {
        let mut id = self.best_fit(stream, size, kind);
        let mut mapped = id.is_some_and(|id| self.mapped_under(id, size));
        if !mapped && !self.quick.is_empty() {
            // a block that would need pages mapped (or none) while freed blocks wait in the
            // quick cache, unmerged: merge them first (left there, they fragment the segment
            // and its mapped pages)
            if let Some(id) = id {
                self.enter_free(id);
            }
            self.flush_quick();
            id = self.best_fit(stream, size, kind);
            mapped = id.is_some_and(|id| self.mapped_under(id, size));
        }
        match id {
            Some(id) if mapped => {
                self.split(id, size);
                if self.blocks[id as usize].size == size {
                    self.stats.cache_hits += 1;
                    if !self.foreign.is_empty() {
                        self.settle_taken(id, stream, None);
                    }
                    return Ok(id);
                }
                // (not split: the rest of the block may need pages)
                self.take_expandable(id, stream, None)
            }
            id => self.place_expandable(id, stream, size, kind),
        }
    }

    /// Return the block at `addr` (allocated with `track_address`) to the pool, ordered on its
    /// stream.
    pub fn free(&mut self, addr: DevPtr) -> Result<()> {
        if let Some(id) = self.live.remove(&addr) {
            return self.release(id);
        }
        match self.find_allocated(addr) {
            Some(id) if self.blocks[id as usize].handout == Handout::Token => self.release(id),
            _ => Err(self.bad_free(addr)),
        }
    }

    /// Return block `id` handed out with [`Handout::Token`] without its address (a torch
    /// DataPtr's deleter knows only its context), if it is still that hand-out
    /// ([`PoolAlloc::generation`]); returns the block's address.
    #[inline]
    pub fn free_by_id(&mut self, id: u32, generation: u8) -> Result<DevPtr> {
        match self.blocks.get(id as usize) {
            Some(b)
                if b.state == State::Allocated
                    && b.handout == Handout::Token
                    && b.generation == generation =>
            {
                let addr = b.addr;
                self.release(id).map(|()| addr)
            }
            _ => Err(Error::InvalidArgument(format!(
                "block {id} is not handed out by id: double free or a stale token"
            ))),
        }
    }

    /// The block handed out at `addr`: from the address map, else (a block handed out by id)
    /// found by walking its segment.
    pub(super) fn find_allocated(&self, addr: DevPtr) -> Option<u32> {
        if let Some(&id) = self.live.get(&addr) {
            return Some(id);
        }
        let (_, &seg) = self.segment_index.range(..=addr).next_back()?;
        let s = &self.segments[seg as usize];
        if addr >= s.addr + s.size {
            return None;
        }
        let mut id = s.head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if b.addr == addr {
                return (b.state == State::Allocated).then_some(id);
            }
            if b.addr > addr {
                return None;
            }
            id = b.next;
        }
        None
    }

    /// Return the block `id` at `addr` ([`PoolAlloc::id`]) to the pool.
    #[inline]
    pub fn free_block_id(&mut self, id: u32, addr: DevPtr) -> Result<()> {
        match self.blocks.get(id as usize) {
            Some(b) if b.addr == addr && b.state == State::Allocated => {
                if b.handout == Handout::Address {
                    self.live.remove(&addr);
                }
                self.release(id)
            }
            _ => Err(self.bad_free(addr)),
        }
    }

    /// Return handed-out block `id` to the pool (the user's free: its stream is alive now).
    #[inline]
    pub(super) fn release(&mut self, id: u32) -> Result<()> {
        let r = self.release_inner(id);
        self.freeing = None;
        r
    }

    #[inline(always)]
    fn release_inner(&mut self, id: u32) -> Result<()> {
        if self.plans.busy() {
            let b = &self.blocks[id as usize];
            let (size, stream) = (b.rounded, b.stream);
            if size > SMALL_SIZE {
                self.plan_free_event(id, size, stream);
            }
        }
        if !self.lent.is_empty() {
            if let Some(user) = self.lent.remove(&id) {
                self.count_live(user, false);
                self.freeing = Some(user);
                return self.release_lent(id, user);
            }
        }
        let stream = self.blocks[id as usize].stream;
        self.count_live(stream, false);
        self.freeing = Some(stream);
        let b = &mut self.blocks[id as usize];
        let (kind, size, req, rounded) = (b.kind, b.size, b.requested, b.rounded);
        let deferred = b.uses.is_some();
        self.stats.on_free(kind, size, req, deferred);
        self.shared.on_free(size);
        if self.recorder.is_some() {
            let (addr, stream) = (b.addr, b.stream);
            self.record(Action::FreeRequested, addr, req, stream);
            if !deferred {
                self.record(Action::FreeCompleted, addr, req, stream);
            }
        }
        self.note_event(id, rounded, true);
        if deferred {
            self.wait_for_uses(id);
            return Ok(());
        }
        if self.plans.busy() && self.in_plan(id) {
            self.plan_release(id);
            return Ok(());
        }
        if !self.use_quick() {
            self.free_block(id);
            return Ok(());
        }
        if self.quick.len() >= self.policy.quick_cap {
            let (_, _, old, freed_at) = self.quick.remove(0);
            self.unmark_inactive(old);
            self.free_block_freed_at(old, freed_at);
        }
        // (the user's free has a tick of its own: a checkpoint recorded from now on covers the
        // block's work, whenever the block leaves the cache)
        self.tick += 1;
        let b = &mut self.blocks[id as usize];
        b.state = State::Quick;
        self.quick.push((b.rounded, b.stream, id, self.tick));
        self.mark_inactive(id);
        if self.policy.page.is_some() && self.gave_back_last(stream) {
            // the stream's last block: a checkpoint now covers its frees so far (once it is
            // flushed from the cache, this block's free may find the stream gone)
            self.checkpoint_on_free(stream);
        }
        Ok(())
    }

    /// Whether a freed block goes to the quick cache. The cache pays off when sizes repeat; when
    /// recent allocations kept missing it, only one free in 32 still goes there (so that a
    /// return of repeating sizes is noticed) and the rest coalesce at once.
    #[inline]
    pub(super) fn use_quick(&mut self) -> bool {
        if self.policy.quick_cap == 0 {
            return false;
        }
        self.quick_probe = self.quick_probe.wrapping_add(1);
        self.quick_score >= 0 || self.quick_probe % 32 == 0
    }

    /// Why `addr` cannot be freed.
    pub(super) fn bad_free(&self, addr: DevPtr) -> Error {
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

    /// Return every wholly free segment to the backend; returns the bytes released.
    pub fn release_cached(&mut self) -> u64 {
        self.release_cache(false)
    }

    /// Release unused cached memory to the device (`torch.cuda.empty_cache()`). Unlike a
    /// release for memory ([`CachingPool::release_cached`]), the job's plans stay: the plan
    /// in step leaves its region (its free pages go back with the rest of the cache) and
    /// takes it up again at its next start, and the detector keeps what it has seen, so that
    /// a job that empties its cache every step or every few is still served from its plan.
    pub fn empty_cache(&mut self) -> u64 {
        self.release_cache(true)
    }

    fn release_cache(&mut self, keep_plans: bool) -> u64 {
        self.budget.restart();
        if keep_plans {
            self.plans_rest();
            self.emptied_mark = self.emptied_mark.max(self.high_water);
        } else {
            self.plans_dissolve_all();
            self.emptied_mark = 0;
        }
        self.flush_quick();
        self.process_events();
        let mut bytes = self.reclaim_pages(None, u64::MAX, true);
        if self.policy.page.is_some() {
            if let Ok(v) = self.vmm() {
                v.trim(); // handles kept for reuse go back too
            }
        }
        for seg in self.releasable() {
            let s = &self.segments[seg as usize];
            if s.pages.is_none() {
                bytes += s.size;
            }
            self.release_segment(seg);
        }
        // what was given back is not mapped again without need
        self.high_water = self.stats.reserved();
        bytes
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
}
