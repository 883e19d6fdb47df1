//! A plan's region: its pages, its blocks, and leaving it.

use super::*;

/// A planned region's pages are mapped in runs aligned to this many pages (`plan_map`,
/// `plan_map_ahead`): whole handles of the page map's grid.
const GRID: u64 = 32;

/// Pages `[lo, hi)` widened to whole runs of [`GRID`] pages.
fn on_grid(lo: u64, hi: u64) -> (u64, u64) {
    (lo / GRID * GRID, hi.div_ceil(GRID) * GRID)
}

impl CachingPool {
    /// Unmap up to `want` bytes of the pages of plan `i`'s region that are free and that none
    /// of its blocks uses (the dynamic layout left them mapped where the plan puts nothing),
    /// in its stream's order; returns the bytes unmapped. Only when memory would otherwise
    /// pass its high-water mark: the region's own maps, or the dynamic pool's, take them.
    pub(in crate::pool) fn plan_trim(&mut self, i: usize, want: u64) -> u64 {
        if !self.plans.plans[i].ahead.is_empty() {
            self.plan_ahead_ready(i, None);
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let p = &self.plans.plans[i];
        let (seg, stream) = (p.seg, p.layout.stream);
        if seg == NIL || want == 0 {
            return 0;
        }
        let mut used: Vec<(u64, u64)> = p
            .layout
            .slots
            .iter()
            .map(|&(off, size)| page_span(off, size, page))
            .collect();
        used.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(used.len());
        for (a, b) in used {
            match merged.last_mut() {
                Some(m) if a <= m.1 => m.1 = m.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let touches = |a: u64, b: u64| {
            let k = merged.partition_point(|m| m.1 <= a);
            k < merged.len() && merged[k].0 < b
        };
        let base = self.segments[seg as usize].addr;
        let Ok(vmm) = self.vmm() else {
            return 0;
        };
        let mut unused = Vec::new();
        let mut bytes = 0;
        'runs: for (f, n) in self.free_mapped_runs(seg, u64::MAX, u64::MAX, Some(stream)) {
            let mut q = f;
            while q < f + n {
                if bytes >= want {
                    break 'runs;
                }
                let (u0, u1) = handle_pages(Some(vmm), base, page, q);
                if u0 >= f && u1 <= f + n && u1 > u0 && !touches(u0, u1) {
                    unused.push((u0, u1 - u0));
                    bytes += (u1 - u0) * page;
                }
                q = u1.max(q + 1);
            }
        }
        self.unmap_runs_after(seg, unused, stream, true)
    }

    /// A new segment of `bytes` for `stream`, nothing mapped yet; returns it.
    pub(super) fn plan_map_region(&mut self, bytes: u64, stream: Stream) -> Result<u32> {
        let page = self
            .policy
            .page
            .ok_or_else(|| unsupported(self.backend.name(), "planned layouts"))?;
        let addr = self.vmm()?.reserve_address(bytes)?;
        let id = self.install_segment(
            addr,
            bytes,
            stream,
            PoolKind::Large,
            Some(Box::new(Pages::new(bytes / page))),
        );
        Ok(self.blocks[id as usize].segment)
    }

    /// Map the pages under block `id` of a planned region that are not mapped yet (the
    /// region fills during the plan's first period, from then on it is all mapped): in whole
    /// handles of the page map's grid. Where that would pass the high-water mark, free pages
    /// move there first (the region's own that the plan does not use, then the dynamic
    /// pool's), within the time budget of page moves or where growing would pass the memory
    /// budget, as in the dynamic pool (`moves_now`; none where page moves are off): a job
    /// whose shape keeps changing takes plans up again and again, so this is not once per
    /// plan.
    pub(super) fn plan_map(&mut self, i: usize, id: u32) -> Result<()> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let (seg, stream, lo, hi) = {
            let b = &self.blocks[id as usize];
            let s = &self.segments[b.segment as usize];
            let (lo, hi) = page_span(b.addr - s.addr, b.size, page);
            (b.segment, s.stream, lo, hi)
        };
        let runs = {
            let pages = self.segments[seg as usize]
                .pages
                .as_deref()
                .expect("a planned region has pages");
            if pages.all_mapped(lo, hi) {
                return Ok(());
            }
            // (within the pages the plan uses: its layout's extent)
            let extent = self.plans.plans[i].layout.region / page;
            let (glo, ghi) = on_grid(lo, hi);
            let end = (self.segments[seg as usize].size / page).min(extent.max(hi));
            pages.runs(glo, ghi.min(end), false)
        };
        let need: u64 = runs.iter().map(|r| r.1).sum::<u64>() * page;
        let over = (self.stats.reserved() + need).saturating_sub(self.plan_mark());
        // past the high-water mark, pages move here (the region's own unused ones first) as
        // in the dynamic pool; otherwise the region grows
        let peak = self.peak_allocated.max(self.stats.allocated());
        let base = self.segments[seg as usize].addr;
        self.page_work(stream, over, need, peak, |pool, moving| {
            if moving {
                let got = pool.plan_trim(i, over);
                pool.reclaim_pages(Some(stream), over.saturating_sub(got), false);
            }
            let mut besides = false;
            let mut result = Ok(());
            for (first, n) in runs {
                let (a, bytes) = (base + first * page, n * page);
                let (r, short) = pool.map_or_move(a, bytes, stream);
                besides |= short.is_some();
                match r {
                    Ok(()) => pool.note_mapped(seg, first, n, true),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            (result, besides)
        })?
    }

    /// Plan `i` has taken its home segment at a start, its first or a later one (a job back
    /// in a phase it had left: another sequence length, an evaluation pass in between): the
    /// pages its slots use there that the dynamic layout left unmapped (holes where its pages
    /// moved, or above what it mapped) are mapped now, ahead, on the resource's thread (the
    /// slots wait for them: `plan_ahead_ready`), rather than one by one on the allocating
    /// thread as the period's blocks come (`plan_map`). As `plan_map` would: where that
    /// passes the high-water mark, the region's pages that no slot uses move there (within
    /// the time budget, or where growing would pass the memory budget); what still would pass
    /// it is left to `plan_map`. Not where hooks hear of mapped pages (they may act on them
    /// at once).
    pub(super) fn plan_map_ahead(&mut self, i: usize) {
        if self.shared.heard() {
            return;
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let (seg, stream) = (self.plans.plans[i].seg, self.plans.plans[i].layout.stream);
        let Some(pages) = self.segments[seg as usize].pages.as_deref() else {
            return;
        };
        let p = &self.plans.plans[i];
        let end = (self.segments[seg as usize].size / page).min(p.layout.region.div_ceil(page));
        // the pages under the slots, in the grid `plan_map` maps in
        let mut want: Vec<(u64, u64)> = p
            .layout
            .slots
            .iter()
            .map(|&(off, size)| {
                let (lo, hi) = page_span(off, size, page);
                on_grid(lo, hi)
            })
            .collect();
        want.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut reach = 0;
        for (lo, hi) in want {
            let (lo, hi) = (lo.max(reach), hi.min(end));
            if lo < hi {
                for (f, n) in pages.runs(lo, hi, false) {
                    match runs.last_mut() {
                        Some(r) if r.0 + r.1 == f => r.1 += n,
                        _ => runs.push((f, n)),
                    }
                }
                reach = hi;
            }
        }
        if runs.is_empty() {
            return;
        }
        let need: u64 = runs.iter().map(|r| r.1).sum::<u64>() * page;
        let over = (self.stats.reserved() + need).saturating_sub(self.plan_mark());
        let peak = self.peak_allocated.max(self.stats.allocated());
        let base = self.segments[seg as usize].addr;
        let _ = self.page_work(stream, over, need, peak, |pool, moving| {
            if moving {
                pool.plan_trim(i, over);
            }
            // (what would still pass the mark is mapped as the blocks come, with moves then;
            // trimming unmaps, so the mark is as it was)
            if pool.stats.reserved() + need <= pool.plan_mark() {
                for (first, n) in runs {
                    let r = pool
                        .vmm()
                        .and_then(|v| v.map_ahead(base + first * page, n * page, stream));
                    if r.is_ok() {
                        pool.note_mapped(seg, first, n, true);
                        pool.plans.plans[i].ahead.push((first, n));
                    }
                }
            }
            ((), false)
        });
    }

    /// Take `[off, off + size)` of plan `i`'s region, if it is free: the free blocks there
    /// (freed blocks stay as they were until a request needs their bytes, so that a slot
    /// whose bytes no other slot shares takes its block back as it was) become one. (Out of
    /// line: inlined, it made `plan_alloc` save and restore every register for
    /// `plan_take_again`'s few instructions.)
    #[inline(never)]
    pub(super) fn plan_carve(&mut self, i: usize, off: u64, size: u64) -> Option<u32> {
        if !self.plans.plans[i].ahead.is_empty() {
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            self.plan_ahead_ready(i, Some(page_span(off, size, page)));
        }
        let seg = self.plans.plans[i].seg;
        let base = self.segments[seg as usize].addr;
        let addr = base + off;
        let end = addr + size;
        // the block that holds `addr`, which must be free
        let id = self.plan_block_at(i, base, off)?;
        let at = self.blocks[id as usize].addr;
        // the free blocks from `id` on must reach `end` with nothing handed out between
        let (mut last, mut reach) = {
            let b = &self.blocks[id as usize];
            (id, b.addr + b.size)
        };
        if reach <= addr || self.blocks[id as usize].state != State::Free {
            return None;
        }
        while reach < end {
            let n = self.blocks[last as usize].next;
            if n == NIL || self.blocks[n as usize].state != State::Free {
                return None;
            }
            reach += self.blocks[n as usize].size;
            last = n;
        }
        self.unmark_inactive(id);
        let mut joined = id;
        while joined != last {
            joined = self.blocks[id as usize].next;
            self.plan_cover_drop(i, base, joined);
            self.unmark_inactive(joined);
            self.absorb_next(id);
        }
        self.blocks[id as usize].state = State::Allocated;
        let mut id = id;
        if at < addr {
            self.split_exact(id, addr - at);
            let front = id;
            id = self.blocks[front as usize].next;
            self.plan_enter_free(front);
            self.plan_cover_add(i, base, id);
        }
        if self.blocks[id as usize].size > size {
            self.split_exact(id, size);
            let rest = self.blocks[id as usize].next;
            self.plan_enter_free(rest);
            self.plan_cover_add(i, base, rest);
        }
        if self.plan_map(i, id).is_err() {
            // no memory for it now: the dynamic pool serves the request
            self.plan_release(id);
            return None;
        }
        Some(id)
    }

    /// The block of plan `i`'s region (at `base`) that holds offset `off` of its layout.
    #[inline]
    pub(super) fn plan_block_at(&self, i: usize, base: u64, off: u64) -> Option<u32> {
        let cover = &self.plans.plans[i].cover;
        let addr = base + off;
        let mut k = cover.page(off)?;
        let mut id = cover.first[k];
        // (no block starts in this page at or below `addr`: the one that holds it starts in
        // an earlier page, the last one to start there)
        while id == NIL || self.blocks[id as usize].addr > addr {
            k = k.checked_sub(1)?;
            id = cover.first[k];
        }
        loop {
            let b = &self.blocks[id as usize];
            if b.addr + b.size > addr {
                return Some(id);
            }
            id = b.next;
            if id == NIL {
                return None;
            }
        }
    }

    /// Block `id` now starts where it is, in plan `i`'s region (at `base`).
    #[inline]
    pub(super) fn plan_cover_add(&mut self, i: usize, base: u64, id: u32) {
        let addr = self.blocks[id as usize].addr;
        let cover = &mut self.plans.plans[i].cover;
        if let Some(k) = cover.page(addr - base) {
            let first = cover.first[k];
            if first == NIL || self.blocks[first as usize].addr > addr {
                cover.first[k] = id;
            }
        }
    }

    /// Block `id` of plan `i`'s region (at `base`) is about to join the block before it.
    #[inline]
    pub(super) fn plan_cover_drop(&mut self, i: usize, base: u64, id: u32) {
        let b = &self.blocks[id as usize];
        let cover = &self.plans.plans[i].cover;
        let Some(k) = cover.page(b.addr - base) else {
            return;
        };
        if cover.first[k] == id {
            // the next block of the page, if one starts there
            let next = b.next;
            let same = next != NIL && cover.page(self.blocks[next as usize].addr - base) == Some(k);
            self.plans.plans[i].cover.first[k] = if same { next } else { NIL };
        }
    }

    /// Block `id` of a planned region is free: its plan's (a planned region's free blocks
    /// stay out of the free sets).
    #[inline]
    pub(super) fn plan_enter_free(&mut self, id: u32) {
        self.blocks[id as usize].state = State::Free;
        self.mark_inactive(id);
    }

    /// Whether block `id` lies in a planned region (one of the large pool's: a small block's
    /// free does not look up its segment).
    #[inline]
    pub(in crate::pool) fn in_plan(&self, id: u32) -> bool {
        let b = &self.blocks[id as usize];
        b.kind == PoolKind::Large && self.segments[b.segment as usize].planned
    }

    /// Return block `id` of a planned region to it, as it is: its free neighbours join it
    /// only when a request needs their bytes together (`plan_carve`).
    #[inline]
    pub(in crate::pool) fn plan_release(&mut self, id: u32) {
        debug_assert!(
            {
                let seg = self.blocks[id as usize].segment;
                self.plans.plans.iter().any(|p| p.seg == seg)
            },
            "a planned segment without its plan"
        );
        self.plan_enter_free(id);
    }

    /// Give plan `i` up: it leaves its region, and is forgotten. (The plan in step, if a later
    /// one, is known by its index, which moves down with it.)
    pub(in crate::pool) fn plan_dissolve(&mut self, i: usize) {
        self.plan_leave(i);
        self.plans.plans.remove(i);
        if let Some(c) = self.plans.current.filter(|&c| c > i) {
            self.plans.current = Some(c - 1);
        }
    }

    /// Plan `i` leaves its region, which becomes an ordinary expandable segment again: its
    /// free blocks join the free sets (freed now, as far as its pages know), its blocks still
    /// handed out come back there. The plan stays, dormant, until the job is in step with it
    /// again and it is taken up anew.
    pub(super) fn plan_leave(&mut self, i: usize) {
        // (the dynamic pool hands out what it finds mapped there)
        self.plan_ahead_ready(i, None);
        self.plan_quiet_close();
        if self.plans.current == Some(i) {
            self.plans.current = None;
        }
        let p = &mut self.plans.plans[i];
        let seg = std::mem::replace(&mut p.seg, NIL);
        p.cover = Cover::default();
        for t in &mut p.taken {
            t.block = NIL;
        }
        // (handles waiting to be split are the region's: it goes back to the dynamic pool)
        p.give_back.waiting.clear();
        if seg == NIL {
            return;
        }
        let mut free: Vec<u32> = Vec::new();
        let mut id = self.segments[seg as usize].head;
        while id != NIL {
            if self.blocks[id as usize].state == State::Free {
                free.push(id);
            }
            id = self.blocks[id as usize].next;
        }
        self.segments[seg as usize].planned = false;
        let stream = self.segments[seg as usize].stream;
        self.tick += 1;
        let (base, page) = (
            self.segments[seg as usize].addr,
            self.policy.page.unwrap_or(MIN_BLOCK),
        );
        // (free neighbours become one, as the free sets expect)
        let mut merged: Vec<u32> = Vec::with_capacity(free.len());
        for id in free {
            self.unmark_inactive(id);
            match merged.last() {
                Some(&m) if self.blocks[m as usize].next == id => self.absorb_next(m),
                _ => merged.push(id),
            }
        }
        for id in merged {
            let b = &self.blocks[id as usize];
            let (lo, hi) = page_span(b.addr - base, b.size, page);
            let tick = self.tick;
            if let Some(pages) = self.segments[seg as usize].pages.as_mut() {
                pages.mark_freed(lo, hi, tick, true);
            }
            self.enter_free(id);
        }
        self.checkpoint_on_free(stream);
    }

    /// The job empties its cache (`empty_cache`): the plan in step leaves its region, whose
    /// free pages go back with the rest of the cache, and stays in step with the job, its
    /// cursor at the soonest copy of its position, so that it takes its region up again at
    /// its next start (its slots' pages mapped ahead, up to the mark the pool had before:
    /// `plan_mark`). The other plans, the detector and the layout being computed stay.
    pub(in crate::pool) fn plans_rest(&mut self) {
        let Some(i) = self.plans.current else {
            return;
        };
        let cursor = self.plans.plans[i].cursor;
        self.plan_leave(i);
        if let Some(c) = cursor {
            let p = &mut self.plans.plans[i];
            p.cursor = Some(p.soonest_copy(c));
            self.plans.current = Some(i);
        }
    }

    /// The high-water mark a plan's region is judged and mapped against: the pool's, or the
    /// one it had when the job last emptied its cache, the higher (a plan kept through
    /// `empty_cache` maps its region back as it was, without moves).
    #[inline]
    pub(super) fn plan_mark(&self) -> u64 {
        self.high_water.max(self.emptied_mark)
    }

    /// Dissolve every plan (the cache is released for memory: the job starts over).
    pub(in crate::pool) fn plans_dissolve_all(&mut self) {
        while !self.plans.plans.is_empty() {
            self.plan_dissolve(0);
        }
        if let Some(Planning::Thread(h)) = self.plans.planning.take() {
            let _ = h.join();
        }
        self.plans.repeats.reset();
        self.plan_quiet_close();
        #[cfg(debug_assertions)]
        self.plans.shadow.reset();
        self.plans.seen = self.plans.repeats.found;
        self.plans.born.clear();
    }

    /// Each plan's length in events and the job's period (twice the period: a plan of two).
    #[cfg(test)]
    pub(in crate::pool) fn plan_lengths(&self) -> Vec<(u32, u32)> {
        self.plans
            .plans
            .iter()
            .map(|p| (p.pos.len() as u32, p.layout.half))
            .collect()
    }

    /// [`CachingPool::plan_trim`] for the plan in step, the only one that holds a region.
    pub(in crate::pool) fn plan_trim_current(&mut self, want: u64) -> u64 {
        self.plans.current.map_or(0, |i| self.plan_trim(i, want))
    }

    /// Only the plan in step with the job holds a region, and each planned segment is a plan's
    /// (part of [`CachingPool::check_invariants`]).
    pub(in crate::pool) fn plan_check(&self) -> std::result::Result<(), String> {
        let mut held = 0;
        for (i, p) in self.plans.plans.iter().enumerate() {
            if p.seg == NIL {
                continue;
            }
            held += 1;
            if self.plans.current != Some(i) {
                return Err(format!("plan {i} holds a region out of step with the job"));
            }
            if !self.segments[p.seg as usize].planned {
                return Err(format!("plan {i} holds a segment not marked planned"));
            }
            // its index of the region's blocks is the region's: each page's first block
            let base = self.segments[p.seg as usize].addr;
            let mut first = vec![NIL; p.cover.first.len()];
            let mut id = self.segments[p.seg as usize].head;
            while id != NIL {
                if let Some(k) = p.cover.page(self.blocks[id as usize].addr - base) {
                    if first[k] == NIL {
                        first[k] = id;
                    }
                }
                id = self.blocks[id as usize].next;
            }
            if first != p.cover.first {
                return Err(format!(
                    "plan {i}'s index of its region's blocks is out of date"
                ));
            }
            // no block is handed out on pages mapped ahead that it has not waited for
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            let mut id = self.segments[p.seg as usize].head;
            while id != NIL {
                let b = &self.blocks[id as usize];
                let (lo, hi) = page_span(b.addr - base, b.size, page);
                if b.state != State::Free && p.ahead.iter().any(|&(f, n)| f < hi && lo < f + n) {
                    return Err(format!(
                        "block {:#x} handed out on pages mapped ahead and not waited for",
                        b.addr
                    ));
                }
                id = b.next;
            }
        }
        let planned = self
            .segment_index
            .values()
            .filter(|&&s| self.segments[s as usize].planned)
            .count();
        if planned != held {
            return Err(format!("{planned} planned segments for {held} plans"));
        }
        Ok(())
    }

    /// Bytes mapped in planned regions now.
    pub(in crate::pool) fn planned_bytes(&self) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        self.plans
            .plans
            .iter()
            .filter(|p| p.seg != NIL)
            .filter_map(|p| self.segments[p.seg as usize].pages.as_ref())
            .map(|pages| pages.mapped * page)
            .sum()
    }
}
