//! Starting a plan: planning a period found, taking the region, placing around what is live.

use super::*;

impl CachingPool {
    /// The detector found a period (at an allocation, or at the free of block `freeing`):
    /// plan it (on a thread of its own, except on a simulated device, whose replays must
    /// give the same answer every time).
    #[cold]
    pub(super) fn plan_start(&mut self, freeing: Option<u32>) {
        let period = self.plans.repeats.period();
        let Some(events) = self.plans.repeats.last(period) else {
            return;
        };
        // the stream with the most bytes allocated in the period
        let mut by_stream: FxHashMap<u64, u64> = FxHashMap::default();
        for (e, st) in events.iter().zip(self.plan_streams(&events)) {
            if e.born == NONE {
                *by_stream.entry(st).or_default() += e.size;
            }
        }
        let Some((&stream, _)) = by_stream.iter().max_by_key(|(s, b)| (**b, **s)) else {
            return;
        };
        let stream = Stream(stream);
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let allocs = events.iter().filter(|e| e.born == NONE).count();
        if allocs < MIN_ALLOCS {
            return;
        }
        // two periods where the detector still has them (see `layout`)
        let events = self.plans.repeats.last(2 * period).unwrap_or(events);
        let first = self.plans.repeats.events() - events.len() as u64;
        let home = self.plan_home(stream, first, freeing);
        self.plans.planning_found = self.plans.repeats.found;
        if matches!(
            self.backend.location(),
            crate::resource::Location::Simulated
        ) {
            self.plans.planning = Some(Planning::Done(layout(
                &events, first, period, stream, page, home,
            )));
            self.plan_poll();
        } else {
            let h = std::thread::Builder::new()
                .name("gpumem-plan".into())
                .spawn(move || layout(&events, first, period, stream, page, home));
            if let Ok(h) = h {
                self.plans.planning = Some(Planning::Thread(h));
            }
        }
    }

    /// The large expandable segment of `stream` with the most pages mapped, and its blocks in
    /// use that were allocated before event `first` (they stay: the job's long-lived tensors,
    /// its weights and optimizer state), but block `freeing`, whose free found the period
    /// (still in use until the free ends, and no longer known by its allocation's event: the
    /// step's last free, of logits or a gradient buffer the step allocated first; left in,
    /// the layout was placed around it, and the plan's first start placed anew where it was
    /// gone: buckets' 500 MiB of logits took the layout from 9,133 to 9,636 MiB, past the
    /// most its region could span); `None` where its blocks were lent to other streams.
    pub(super) fn plan_home(
        &self,
        stream: Stream,
        first: u64,
        freeing: Option<u32>,
    ) -> Option<Home> {
        let seg = self
            .segment_index
            .values()
            .copied()
            .filter(|&s| {
                let s = &self.segments[s as usize];
                s.stream == stream && s.kind == PoolKind::Large && !s.planned
            })
            .max_by_key(|&s| self.segments[s as usize].pages.as_ref().map(|p| p.mapped))?;
        let s = &self.segments[seg as usize];
        s.pages.as_ref()?;
        let mut fixed = Vec::new();
        let mut id = s.head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if self.lent.contains_key(&id) || self.foreign.contains_key(&id) {
                return None;
            }
            let born = self.plans.born.get(id as usize).copied().unwrap_or(NONE);
            let stays = match b.state {
                State::Allocated if freeing == Some(id) => false,
                State::Allocated => born == NONE || born < first,
                State::Pending => true,
                _ => false,
            };
            if stays {
                fixed.push((b.addr - s.addr, b.addr - s.addr + b.size));
            }
            id = b.next;
        }
        Some(Home {
            seg,
            addr: s.addr,
            fixed,
        })
    }

    /// The streams of `events` (the prints hide them: each is tried against the streams the
    /// pool knows).
    pub(super) fn plan_streams(&self, events: &[Entry]) -> Vec<u64> {
        events
            .iter()
            .map(|e| {
                let free = e.born != NONE;
                self.streams
                    .iter()
                    .map(|s| s.0)
                    .find(|&s| repeat::print(free, e.size, s) == e.print)
                    .unwrap_or(u64::MAX)
            })
            .collect()
    }

    /// Take a finished layout: a new plan, found in step with the job at once if it is.
    pub(super) fn plan_poll(&mut self) {
        let layout = match self.plans.planning.take() {
            Some(Planning::Thread(h)) if !h.is_finished() => {
                self.plans.planning = Some(Planning::Thread(h));
                return;
            }
            Some(Planning::Thread(h)) => h.join().ok().flatten(),
            Some(Planning::Done(l)) => l,
            None => return,
        };
        let Some(layout) = layout else {
            return;
        };
        let mut before = self.plans.current;
        if self.plans.plans.len() >= MAX_PLANS {
            // the plan used longest ago makes room
            let old = (0..self.plans.plans.len())
                .min_by_key(|&i| self.plans.plans[i].used)
                .expect("MAX_PLANS > 0");
            self.plan_given_up(old);
            self.plan_dissolve(old);
            before = before
                .filter(|&b| b != old)
                .map(|b| b - usize::from(b > old));
        }
        self.stats.num_plans += 1;
        self.plans.plans.push(Plan::new(layout));
        self.plans.current = None;
        self.plan_quiet_close();
        self.plan_resync();
        if self.plans.current.is_none() {
            self.plan_follow_from_origin();
        }
        // a plan that holds its region only while it is in step with the job
        if let Some(b) = before.filter(|&b| self.plans.current != Some(b)) {
            self.plan_leave(b);
        }
    }

    /// The plan just made, which `plan_resync` did not find in step (the last events' window
    /// occurs more than once in its period: a run of frees of the same size, as where a
    /// training step ends), where the job has repeated without a break since its layout's
    /// events (the detector's period is the plan's, and confirmed no time since): it follows
    /// the job from the position its events give. gptfix on an H200 (stop 80): its layout
    /// was taken among the 149 frees before its start, and found in step only from the event
    /// after that start, a step later.
    fn plan_follow_from_origin(&mut self) {
        let Some(i) = self.plans.plans.len().checked_sub(1) else {
            return;
        };
        let n = self.plans.repeats.events();
        let p = &self.plans.plans[i];
        let len = p.pos.len() as u64;
        if self.plans.repeats.found != self.plans.planning_found
            || self.plans.repeats.period() != u64::from(p.layout.half)
            || n < p.layout.origin
            || len == 0
        {
            return;
        }
        let next = ((n - p.layout.origin) % len) as u32;
        self.plan_follow(i, next);
    }

    /// Take plan `i`'s region (at the start of its period, where it holds the fewest bytes):
    /// the stream's segment where the plan has a home, else a region of its own, whose pages
    /// are mapped as its blocks come (`plan_map`). Nothing is unmapped here:
    /// pages move only where the region's maps would pass the high-water mark.
    #[cold]
    pub(super) fn plan_activate(&mut self, i: usize) -> Result<()> {
        let first = self.plans.plans[i].since == 0;
        let (bytes, stream, home) = {
            let l = &self.plans.plans[i].layout;
            (l.region, l.stream, l.home)
        };
        if self.plans.plans[i].declines >= MAX_DECLINES {
            return Err(Error::InvalidArgument("the plan was declined".into()));
        }
        if let Some((seg, addr)) = home {
            if self.segment_index.get(&addr) == Some(&seg) {
                self.plan_place_at_start(i, seg);
                if self.plans.plans[i].layout.region > self.plan_worth_region(seg) {
                    let p = &mut self.plans.plans[i];
                    p.declines += 1;
                    if p.declines == MAX_DECLINES {
                        self.stats.num_plans_declined += 1;
                    }
                    // (a plan of two periods tries again at the next period's start)
                    p.cursor = p.cursor.map(|c| p.soonest_copy(c));
                    return Err(Error::InvalidArgument("the plan was declined".into()));
                }
            }
            if self.plan_adopt(i, seg, addr, stream) {
                // (declines count in a row: a plan taken up is declined for good only
                // where its next starts decline it again)
                self.plans.plans[i].declines = 0;
                self.plan_installs(first);
                self.plan_map_ahead(i);
                return Ok(());
            }
            // the segment is gone or changed: the plan has no home (its offsets keep their
            // gaps in a region of its own)
        }
        self.flush_quick();
        let r = self.plan_map_region(bytes, stream);
        match r {
            Ok(seg) => {
                let head = self.segments[seg as usize].head;
                self.segments[seg as usize].planned = true;
                let p = &mut self.plans.plans[i];
                p.seg = seg;
                p.cover = Cover::new(p.layout.region, self.policy.page.unwrap_or(MIN_BLOCK));
                p.cover.first[0] = head;
                self.blocks[head as usize].state = State::Free;
                self.plan_installs(first);
                Ok(())
            }
            Err(e) => {
                // no room for it: the job goes on in the dynamic pool
                self.plans.plans.remove(i);
                self.plans.current = None;
                self.plan_quiet_close();
                Err(e)
            }
        }
    }

    /// A plan has taken its region, for the `first` time: the job warms up
    /// ([`MoveBudget::warm_up`]) while the plan's first period maps the region's pages, so
    /// that they move from where the dynamic layout left them (paid from the credit) rather
    /// than grow where the window's room is taken by the moves of the seconds before. LoRA
    /// fine-tuning's trace (an H200, `bench_torch.py`'s lora, 10 steps): the window refused
    /// 454 MiB of the region's moves in its first period by 0.4 ms, and the region grew them:
    /// 1.129 / 1.094 of the live peak with the GPU in step / 300 calls behind, 1.019 / 1.019
    /// with the warm-up (the H200's real run: 1.019), its worst second after the warm-up at
    /// 0.69% / 0.59%. Once per plan: a plan taken up again (a job that comes back to a
    /// phase) finds its layout as it left it and moves within the window.
    pub(super) fn plan_installs(&mut self, first: bool) {
        if first {
            if let Ok(now) = self.vmm().map(|v| v.now_ns()) {
                self.budget.warm_up(now);
            }
        }
    }

    /// Place plan `i` again now, at its start, around what its home segment `seg` holds: its
    /// blocks that are still live from the period before (their lives wrap around the start)
    /// keep the places they have (pinned there, or held there until their free: see
    /// [`place_at_start`]), every other block in use stays in the way (`plan_around`). At
    /// every start whose blocks in the way differ from the last one's, and from those of the
    /// few before ([`PLACEMENTS_KEPT`]), whose placements are kept: a job that comes back to
    /// a plan now and then (a length that recurs) mostly finds the same ones, its weights
    /// and optimizer state, and keeps the offsets it had (86 of 102 starts on a 1,600-step
    /// variable-length replay); one that empties its cache every step finds one of a few
    /// (see [`Plan::placed_before`]). A kept placement is taken only where its region fits
    /// the most a region may span now, as is one made ahead. The placement made ahead of the
    /// start (`plan_place_ahead`) is taken where it was made around the same blocks (its
    /// thread joined if it has not finished); else one is mended from an earlier placement
    /// (at the first start, the layout) where that spans no more ([`Plan::repaired`]), or
    /// made here, on the allocating thread (the orders of [`place`], side by side).
    pub(super) fn plan_place_at_start(&mut self, i: usize, seg: u32) {
        self.flush_quick();
        let limit = self.plan_worth_region(seg);
        let around = self.plan_around(i, seg, self.plans.repeats.events(), false);
        let p = &mut self.plans.plans[i];
        let serving = p.placement_serving(&around, limit);
        if serving == Some(None) {
            // the same blocks in the way as at its last start (a job that comes back to the
            // plan: its weights and optimizer state where they were), or none new in the
            // way of its slots: the same layout
            p.placed_around = Some(around);
            self.plans.placed_again += 1;
            return;
        }
        // (a kept placement that serves leaves those kept; the last joins them, the first)
        let taken = match serving {
            Some(Some(k)) => Some(p.placed_before.remove(k)),
            _ => None,
        };
        if let Some(a) = p.placed_around.take() {
            let offsets = p.layout.slots.iter().map(|s| s.0).collect();
            p.placed_before.insert(0, (a, offsets, p.layout.region));
        }
        if let Some((_, offsets, region)) = taken {
            for (s, off) in p.layout.slots.iter_mut().zip(offsets) {
                s.0 = off;
            }
            p.layout.region = region;
            p.placed_around = Some(around);
            self.plans.placed_again += 1;
            return;
        }
        p.placed_before.truncate(PLACEMENTS_KEPT);
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let ahead = p
            .place_ahead
            .take()
            .filter(|a| a.around == around)
            .and_then(|a| match a.job {
                PlaceJob::Done(r) => Some((r, false)),
                PlaceJob::Mended(r) => Some((r, true)),
                PlaceJob::Thread(h) => h.join().ok().map(|r| (r, false)),
                PlaceJob::Serving | PlaceJob::OutOfStep => None,
            })
            .filter(|(r, _)| r.1.div_ceil(page).max(1) * page <= limit);
        let (offsets, total) = match ahead {
            Some((r, mended)) => {
                self.stats.num_plan_placements_ahead += 1;
                self.stats.num_plan_repairs += u64::from(mended);
                r
            }
            None => {
                self.stats.num_plan_placements += 1;
                match p.repaired(&around, limit, page) {
                    Some(r) => {
                        self.stats.num_plan_repairs += 1;
                        r
                    }
                    None => {
                        let period = p.pos.len() as u32;
                        place_at_start(&p.layout.lives, period, &around.0, &around.1, limit)
                    }
                }
            }
        };
        let p = &mut self.plans.plans[i];
        for (k, s) in p.layout.slots.iter_mut().enumerate() {
            s.0 = offsets[k];
        }
        p.layout.region = total.div_ceil(page).max(1) * page;
        p.placed_around = Some(around);
    }

    /// The most bytes a region taking over segment `seg` may span and be worth planning now
    /// (`worth_region`).
    pub(super) fn plan_worth_region(&self, seg: u32) -> u64 {
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mapped = self.segments[seg as usize]
            .pages
            .as_ref()
            .map_or(0, |p| p.mapped * page);
        worth_region(self.stats.reserved(), mapped, self.plan_mark(), page)
    }

    /// What plan `i` is placed around at a start when the detector has counted `n0` events,
    /// in its home segment `seg`: the ranges of the blocks in use there (or waiting on
    /// events), but those of its blocks still live from the period before (their lives wrap
    /// around the start), which keep where they lie (see [`place_at_start`]). With `ahead` (a
    /// start to come, the job in step with the plan until then), the blocks that the plan
    /// frees before the start (allocated in its last two periods) are left out.
    pub(super) fn plan_around(&self, i: usize, seg: u32, n0: u64, ahead: bool) -> Around {
        let p = &self.plans.plans[i];
        let period = p.pos.len() as u64;
        let freed_before = |b: &Block, born: u64| {
            if !ahead
                || born == NONE
                || born < p.layout.seen
                || born >= n0
                || n0 - born > 2 * period
            {
                return false;
            }
            let k = p.pos[((born + 2 * period - n0) % period) as usize].slot;
            k != NO_SLOT && {
                let l = &p.layout.lives[k as usize];
                let len = (u64::from(l.end) + period - u64::from(l.start)) % period;
                l.size == b.rounded && b.state == State::Allocated && born + len < n0
            }
        };
        let base = self.segments[seg as usize].addr;
        let mut fixed = Vec::new();
        let mut pinned: Vec<(usize, u64)> = Vec::new();
        let mut id = self.segments[seg as usize].head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if matches!(b.state, State::Allocated | State::Pending) {
                let born = self.plans.born.get(id as usize).copied().unwrap_or(NONE);
                // its slot, if the plan allocated it in the last period
                let life = p
                    .slot_born(born, n0)
                    .filter(|&k| k != NO_SLOT)
                    .map(|k| (k as usize, &p.layout.lives[k as usize]))
                    .filter(|(_, l)| l.size == b.rounded && b.state == State::Allocated);
                match life {
                    Some((k, l)) if l.end < l.start && !pinned.iter().any(|&(j, _)| j == k) => {
                        pinned.push((k, b.addr - base))
                    }
                    _ if freed_before(b, born) => {}
                    _ => fixed.push((b.addr - base, b.addr - base + b.size)),
                }
            }
            id = b.next;
        }
        (fixed, pinned)
    }

    /// Plan `i`, waiting for its start with the job in step at position `pos` (past its last
    /// allocation whose life wraps around the start): place it now around what the start
    /// will find in the way, mended from an earlier placement where that spans no more
    /// ([`Plan::repaired`]: a few searches, here), else on a thread of its own (inline on a
    /// simulated device), so that the start takes the placement without making it (one core
    /// of the dev VM, 2ee45ac: 10-12 ms for lora and traineval, 19 for unet, 27-84 for
    /// gptfix, 31-44 for gpt_train).
    /// Where the process has no core to spare (on an H200 with each process on one core) the
    /// thread's work still lands on the step it runs beside: traineval's steps after each
    /// evaluation took 6-8 ms more than native's (9c5e3e1).
    #[cold]
    #[inline(never)]
    pub(super) fn plan_place_ahead(&mut self, i: usize, pos: u32) {
        let p = &self.plans.plans[i];
        let Some((seg, addr)) = p.layout.home else {
            return;
        };
        if p.declines >= MAX_DECLINES || self.segment_index.get(&addr) != Some(&seg) {
            return;
        }
        let n0 = self.plans.repeats.events() + (p.pos.len() as u64 - u64::from(pos));
        #[cfg(test)]
        {
            self.plans.looked_ahead += 1;
        }
        if !self.plan_followed(i, seg, n0) {
            let job = PlaceJob::OutOfStep;
            self.plans.plans[i].place_ahead = Some(PlaceAhead {
                around: Around::default(),
                job,
            });
            return;
        }
        let around = self.plan_around(i, seg, n0, true);
        let limit = self.plan_worth_region(seg);
        // (none where the start will take its last placement or a kept one, as it is; that
        // is noted, so that the events up to the start do not look again: each look walks
        // the segment's blocks and the plan's slots, and traineval's replay made 8,162 of
        // them, 19 us each on the dev VM, where its plans waited for their starts)
        if p.placement_serving(&around, limit).is_some() {
            let job = PlaceJob::Serving;
            self.plans.plans[i].place_ahead = Some(PlaceAhead { around, job });
            return;
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        // (mended where that costs nothing: no thread)
        if let Some(r) = p.repaired(&around, limit, page) {
            let job = PlaceJob::Mended(r);
            self.plans.plans[i].place_ahead = Some(PlaceAhead { around, job });
            return;
        }
        let (lives, period) = (p.layout.lives.clone(), p.pos.len() as u32);
        let (fixed, pinned) = around.clone();
        #[cfg(test)]
        {
            self.plans.placed_ahead += 1;
        }
        let place = move || place_at_start(&lives, period, &fixed, &pinned, limit);
        let job = if matches!(
            self.backend.location(),
            crate::resource::Location::Simulated
        ) {
            PlaceJob::Done(place())
        } else {
            match std::thread::Builder::new()
                .name("gpumem-place".into())
                .spawn(place)
            {
                Ok(h) => PlaceJob::Thread(h),
                Err(_) => return,
            }
        };
        self.plans.plans[i].place_ahead = Some(PlaceAhead { around, job });
    }

    /// Whether the blocks in use in plan `i`'s home segment `seg` that the job allocated in
    /// the period before event `n0` (the plan's next start) lie at positions where the plan
    /// allocates blocks of their sizes: the job did this plan's period. A cursor found again
    /// from the window of the last events may have found only the end of a period that
    /// another shares: a training step of another sequence length ends with the same
    /// optimizer step. There the start comes only if the job's next step happens to be the
    /// plan's, and a placement made ahead for it is mostly made for nothing (buckets'
    /// replay, the GPU 300 calls behind: 10 ms of one dev-VM core, at a start that never
    /// came). (This walks the segment's blocks as `plan_around` does after it; once per
    /// wait for a start, as the look itself.)
    fn plan_followed(&self, i: usize, seg: u32, n0: u64) -> bool {
        let p = &self.plans.plans[i];
        let mut id = self.segments[seg as usize].head;
        while id != NIL {
            let b = &self.blocks[id as usize];
            let born = self.plans.born.get(id as usize).copied().unwrap_or(NONE);
            let not_the_plans =
                |k: u32| k == NO_SLOT || p.layout.lives[k as usize].size != b.rounded;
            if b.state == State::Allocated && p.slot_born(born, n0).is_some_and(not_the_plans) {
                return false;
            }
            id = b.next;
        }
        true
    }

    /// Take segment `seg` (at `addr`) over for plan `i`: its free blocks leave the free sets
    /// and become the plan's; the dynamic pool grows a segment of its own from now on.
    pub(super) fn plan_adopt(&mut self, i: usize, seg: u32, addr: u64, stream: Stream) -> bool {
        self.flush_quick();
        let ok = self.segment_index.get(&addr) == Some(&seg) && {
            let s = &self.segments[seg as usize];
            s.stream == stream && !s.planned && s.pages.is_some()
        };
        if !ok
            || self
                .lent
                .keys()
                .any(|&b| self.blocks[b as usize].segment == seg)
            || self
                .foreign
                .keys()
                .any(|&b| self.blocks[b as usize].segment == seg)
        {
            return false;
        }
        let page = self.policy.page.unwrap_or(MIN_BLOCK);
        let mut cover = Cover::new(self.plans.plans[i].layout.region, page);
        let mut id = self.segments[seg as usize].head;
        while id != NIL {
            let next = self.blocks[id as usize].next;
            if self.blocks[id as usize].state == State::Free {
                self.leave_free(id);
                self.plan_enter_free(id);
            }
            if let Some(k) = cover.page(self.blocks[id as usize].addr - addr) {
                if cover.first[k] == NIL {
                    cover.first[k] = id;
                }
            }
            id = next;
        }
        self.segments[seg as usize].planned = true;
        let p = &mut self.plans.plans[i];
        p.seg = seg;
        p.cover = cover;
        true
    }
}
