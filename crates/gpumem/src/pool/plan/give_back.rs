//! Giving back what a plan's region does not use, once the plan has served a whole cycle.

use super::*;

impl CachingPool {
    /// The current plan, the only one, has served a whole cycle of the job in its region:
    /// the region's pages that none of its slots uses go back. They were mapped by the
    /// dynamic layout before the plan took the segment (its fragmentation in the job's first
    /// steps), or with a slot's pages in one physical handle. Handles with no slot's page go
    /// at once, in the stream's order (`plan_trim`). A handle with some is unmapped whole
    /// and its slots' pages mapped again on their own (`plan_split`), once the GPU is known
    /// done with it: it held only free blocks when a checkpoint was recorded here, that
    /// checkpoint has completed since, and none of its slots has been taken in between (all
    /// the work on it was queued before the checkpoint). Handles whose slots are taken first
    /// wait for the next try, a cycle later (at most [`GIVE_BACK_TRIES`]). The high-water
    /// mark of reserved bytes comes down to what is left: what went back is not mapped again
    /// without need, and a job that repeats holds what its plan needs, not the peak its
    /// first steps reached. Paid from growth's account of the time budget (`budget.rs`: at
    /// most what growth past the high-water mark took); while that is spent, the try waits
    /// a cycle. A job with several plans (phases, lengths) keeps its pages: another phase
    /// maps what this one would give back.
    #[cold]
    pub(super) fn plan_settled(&mut self) {
        let Some(i) = self.plans.current else {
            return;
        };
        if !self.plans.plans[i].ahead.is_empty() {
            self.plan_ahead_ready(i, None);
        }
        let events = self.plans.repeats.events();
        let (stream, cycle) = {
            let p = &self.plans.plans[i];
            (p.layout.stream, p.pos.len() as u64)
        };
        if !self.plans.plans[i].give_back.waiting.is_empty() {
            self.plan_split_waiting(i, events);
            return;
        }
        let now = self.vmm().map_or(0, |v| v.now_ns());
        self.plans.plans[i].give_back.next_at = events + cycle;
        if !self.budget.may_give_back(now) {
            // (a try all the same: the tries stay bounded)
            self.plans.plans[i].give_back.tries -= 1;
            return;
        }
        let Ok(started) = self.vmm().map(|v| v.now_ns()) else {
            return;
        };
        let before = self.stats.reserved();
        // (a handle that holds no slot's page: none is left after the first try that had
        // budget)
        if self.plan_trim(i, u64::MAX) > 0 {
            // the move is over (as in `plan_map`): the stream's next move records an event of
            // its own rather than share this one's, recorded before the work queued since
            // (its pages would count as idle while the GPU may still use them)
            let _ = self.vmm().map(|v| v.finish_move(stream));
        }
        let units = self.plan_split_candidates(i);
        let g = &mut self.plans.plans[i].give_back;
        g.tries -= 1;
        if units.is_empty() {
            g.tries = 0;
        } else if self.may_record_on(stream) {
            // (a tick of its own: no checkpoint recorded before covers it, so the work queued
            // before now, which a planned block's free does not tick, is known done only when
            // this one has completed)
            self.tick += 1;
            self.record_checkpoint(stream);
            let tick = self.tick;
            let g = &mut self.plans.plans[i].give_back;
            (g.waiting, g.tick, g.event) = (units, tick, events);
        }
        self.gave_back(started, before);
    }

    /// Giving back pages began at `started` (the backend's clock) with `before` bytes
    /// reserved: the high-water mark comes down to what is left, and the time is paid.
    pub(super) fn gave_back(&mut self, started: u64, before: u64) {
        if self.stats.reserved() < before {
            self.high_water = self.high_water.min(self.stats.reserved());
            self.emptied_mark = self.emptied_mark.min(self.stats.reserved());
        }
        if let Ok(v) = self.vmm() {
            let took = v.now_ns().saturating_sub(started);
            self.stats.page_map_ns += took;
            self.budget.note_work(started + took, took, true);
            self.budget.charge_give_back(took);
        }
    }

    /// While plan `i` waits for its checkpoint (see `plan_settled`), at the detector's event
    /// `events`: handles one of whose slots was taken since are left for a later try; once
    /// the checkpoint is known complete (looked at every [`GIVE_BACK_POLL`] events), the rest
    /// are split.
    pub(super) fn plan_split_waiting(&mut self, i: usize, events: u64) {
        let g = &mut self.plans.plans[i].give_back;
        let since = g.event;
        if events.saturating_sub(since) % GIVE_BACK_POLL != 0 {
            return;
        }
        let p = &mut self.plans.plans[i];
        let mut waiting = std::mem::take(&mut p.give_back.waiting);
        let mut taken = Vec::new();
        waiting.retain(|(_, _, slots)| {
            let idle = slots.iter().all(|&k| p.taken[k as usize].at < since);
            if !idle {
                taken.extend_from_slice(slots);
            }
            idle
        });
        if !taken.is_empty() {
            self.plan_retry_when_idle(i, events, &taken);
        }
        let (stream, tick) = {
            let p = &self.plans.plans[i];
            (p.layout.stream, p.give_back.tick)
        };
        if waiting.is_empty() || self.safe_tick(stream) < tick {
            self.plans.plans[i].give_back.waiting = waiting;
            return;
        }
        let Ok(started) = self.vmm().map(|v| v.now_ns()) else {
            return;
        };
        let before = self.stats.reserved();
        self.plan_split(i, waiting);
        self.gave_back(started, before);
    }

    /// Handles of plan `i` whose `slots` were taken before the GPU was known done with them
    /// (at the detector's event `events`): the next try comes where those slots are free
    /// longest in the period (its first position), not a cycle after this one, at the same
    /// point, where they would be taken again as soon. With the GPU behind, a checkpoint
    /// recorded at the cycle's end completes only after the first slot of gptfix's one
    /// handle to split is taken in the next (the GPU 300 calls behind: the region's last
    /// steps held 1.0063 of live, where a try in its slots' idle stretch gives 1.001).
    pub(super) fn plan_retry_when_idle(&mut self, i: usize, events: u64, slots: &[u32]) {
        let p = &mut self.plans.plans[i];
        let Some(c) = p.cursor else {
            return;
        };
        let period = p.pos.len() as u32;
        let lives = slots.iter().map(|&k| &p.layout.lives[k as usize]);
        let busy: Vec<bool> = held_bytes(lives, period).iter().map(|&b| b > 0).collect();
        // the longest run of positions where none is held, around the period's end too
        let (mut best, mut run) = (None, 0u32);
        for x in 0..2 * period {
            if busy[(x % period) as usize] {
                run = 0;
                continue;
            }
            run += 1;
            if run <= period && best.is_none_or(|(_, n)| run > n) {
                best = Some(((x + 1 - run) % period, run));
            }
        }
        if let Some((first, _)) = best {
            // (the event after the free at `first`: a free is noted before it is made)
            p.give_back.next_at = events + u64::from((first + 2 + period - c) % period);
        }
    }

    /// The physical handles of plan `i`'s region that hold pages none of its slots uses
    /// beside pages some slot uses, with only free blocks on them now, each with the slots
    /// whose pages it holds. (A handle is unmapped whole or not at all.)
    pub(super) fn plan_split_candidates(&self, i: usize) -> Vec<(u64, u64, Vec<u32>)> {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let p = &self.plans.plans[i];
        let seg = p.seg;
        if seg == NIL || !self.lent.is_empty() || !self.foreign.is_empty() {
            return Vec::new();
        }
        let (base, n) = {
            let s = &self.segments[seg as usize];
            (s.addr, s.size / page)
        };
        let Ok(vmm) = self.vmm() else {
            return Vec::new();
        };
        let Some(pages) = self.segments[seg as usize].pages.as_deref() else {
            return Vec::new();
        };
        // the pages up to the last a slot uses (and the handle that holds it: spans are at
        // most MAX_SPAN pages): a candidate holds a page some slot uses, so none lies above
        // (the segment's address range is twice the device's memory: a list for each of its
        // pages cost the allocating thread milliseconds)
        let top = p
            .layout
            .slots
            .iter()
            .map(|&(off, size)| page_span(off, size, page).1)
            .max()
            .unwrap_or(0)
            .min(n);
        let n = (top + crate::resource::page_map::MAX_SPAN).min(n);
        // how many slots use each page (a count per page, not a list: a list for each page
        // cost a give-back try 230-320 µs of the allocating thread on gptfix, dev VM)
        let mut users = vec![0i64; n as usize + 1];
        for &(off, size) in &p.layout.slots {
            let (a, b) = page_span(off, size, page);
            let (a, b) = (a.min(n) as usize, b.min(n) as usize);
            if a < b {
                users[a] += 1;
                users[b] -= 1;
            }
        }
        let mut held = 0;
        for u in &mut users {
            held += *u;
            *u = held;
        }
        // whether pages `[a, b)` lie in free blocks only (one run of them, in address order)
        let free = self.free_parts(seg, None);
        let all_free = |a: u64, b: u64| {
            let (a, b) = (base + a * page, base + b * page);
            let k = free.partition_point(|f| f.0 + f.1 <= a);
            k < free.len() && free[k].0 <= a && free[k].0 + free[k].1 >= b
        };
        let mut units = Vec::new();
        let mut q = pages.next_with(0, top, true);
        while q < top {
            let (u0, u1) = match handle_pages(Some(vmm), base, page, q) {
                (u0, u1) if u1 <= n => (u0, u1),
                _ => (q, q + 1),
            };
            let span = u0 as usize..u1 as usize;
            if pages.next_with(u0, u1, false) >= u1
                && all_free(u0, u1)
                && users[span.clone()].iter().any(|&u| u > 0)
                && users[span].contains(&0)
            {
                let slots: Vec<u32> = (0..p.layout.slots.len() as u32)
                    .filter(|&k| {
                        let (off, size) = p.layout.slots[k as usize];
                        let (a, b) = page_span(off, size, page);
                        a < u1 && u0 < b
                    })
                    .collect();
                units.push((u0, u1, slots));
            }
            q = pages.next_with(u1.max(q + 1), top, true);
        }
        units
    }

    /// Split the handles `units` of plan `i`'s region (see `plan_split_candidates`), which the
    /// GPU is done with (see `plan_split_waiting`): each is unmapped and the pages its slots
    /// use are mapped again, in runs, so that the rest stays unmapped. The maps are made
    /// ahead, on the resource's thread (the slots wait for them: `plan_ahead_ready`), unless
    /// hooks hear of mapped pages (they may act on them at once).
    pub(super) fn plan_split(&mut self, i: usize, units: Vec<(u64, u64, Vec<u32>)>) {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let (seg, stream) = (self.plans.plans[i].seg, self.plans.plans[i].layout.stream);
        if seg == NIL {
            return;
        }
        let ahead = !self.shared.heard();
        let base = self.segments[seg as usize].addr;
        for (u0, u1, slots) in units {
            let p = &self.plans.plans[i];
            let mut used = vec![false; (u1 - u0) as usize];
            for &k in &slots {
                let (off, size) = p.layout.slots[k as usize];
                let (a, b) = page_span(off, size, page);
                used[(a.max(u0) - u0) as usize..(b.min(u1) - u0) as usize].fill(true);
            }
            if self.unmap_runs(seg, vec![(u0, u1 - u0)]) == 0 {
                continue;
            }
            let mut k = 0;
            while k < used.len() {
                if !used[k] {
                    k += 1;
                    continue;
                }
                let end = (k..used.len()).find(|&j| !used[j]).unwrap_or(used.len());
                let (first, n) = (u0 + k as u64, (end - k) as u64);
                let (a, bytes) = (base + first * page, n * page);
                let r = self.vmm().and_then(|v| {
                    if ahead {
                        v.map_ahead(a, bytes, stream)
                    } else {
                        v.map_on(a, bytes, stream)
                    }
                });
                if r.is_ok() {
                    self.note_mapped(seg, first, n, true);
                    if ahead {
                        self.plans.plans[i].ahead.push((first, n));
                    }
                }
                // (a page left unmapped is mapped when its slot is next taken: `plan_map`)
                k = end;
            }
            if ahead {
                // (taken again only through `plan_carve`, which waits for the maps)
                for &k in &slots {
                    self.plans.plans[i].taken[k as usize].block = NIL;
                }
            }
        }
    }

    /// The maps plan `i`'s region had made ahead (`plan_split`) over its pages `[lo, hi)`
    /// (`None`: all) are made: waited for where they are not yet (the resource's thread
    /// makes them within a millisecond or so of the split, and a slot there is taken a step
    /// later, mostly). One that could not be made leaves its pages unmapped, for `plan_map`
    /// to map when a slot there is taken.
    #[cold]
    #[inline(never)]
    pub(super) fn plan_ahead_ready(&mut self, i: usize, pages: Option<(u64, u64)>) {
        let (lo, hi) = pages.unwrap_or((0, u64::MAX));
        let all = std::mem::take(&mut self.plans.plans[i].ahead);
        let (runs, rest): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|&(f, n)| f < hi && lo < f + n);
        self.plans.plans[i].ahead = rest;
        let (seg, stream) = (self.plans.plans[i].seg, self.plans.plans[i].layout.stream);
        if runs.is_empty() || seg == NIL {
            return;
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let base = self.segments[seg as usize].addr;
        for (first, n) in runs {
            let r = self
                .vmm()
                .and_then(|v| v.wait_mapped(base + first * page, n * page, stream));
            if let Err(e) = r {
                tracing::warn!("gpumem: pages mapped ahead could not be mapped: {e}");
                let still = self.segments[seg as usize]
                    .pages
                    .as_deref()
                    .map(|p| p.runs(first, first + n, true))
                    .unwrap_or_default();
                for (f, m) in still {
                    self.note_mapped(seg, f, m, false);
                }
            }
        }
    }
}
