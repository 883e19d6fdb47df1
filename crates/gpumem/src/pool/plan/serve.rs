//! Serving from a plan: the cursor that follows the job, the planned allocation, and the
//! detector's events while a plan follows the job.

use super::*;

impl CachingPool {
    /// A request of `size` rounded bytes on `stream`: the planned block, if the job is in step
    /// with a plan and its bytes are free. The common case first, inlined: the job's next
    /// event is the plan's, whose slot's block is free as it was left
    /// ([`CachingPool::plan_take_again`]); nothing changes unless it is taken. Else
    /// `plan_alloc_slow`, which looks at the same from the start.
    #[inline(always)]
    pub(in crate::pool) fn plan_alloc(&mut self, stream: Stream, size: u64) -> Option<u32> {
        if self.plans.planning.is_none() {
            if let Some(i) = self.plans.current {
                let p = &self.plans.plans[i];
                if let Some(c) = p.cursor {
                    let at = p.pos[c as usize];
                    if at.print == repeat::print(false, size, stream.0) as u32
                        && at.slot != NO_SLOT
                        && p.seg != NIL
                    {
                        let tick = self.tick;
                        let p = &mut self.plans.plans[i];
                        p.advance(c);
                        p.used = tick;
                        if let Some(id) = self.plan_take_again(i, at.slot, size) {
                            let events = self.plans.repeats.events();
                            self.plans.plans[i].taken[at.slot as usize].at = events;
                            self.stats.num_plan_allocs += 1;
                            return Some(id);
                        }
                        return self.plan_alloc_carved(i, at.slot, size);
                    }
                }
            }
        }
        self.plan_alloc_slow(stream, size)
    }

    /// [`CachingPool::plan_alloc`] where the job's event is the plan's next (its print
    /// matched, the cursor moved past it, its slot `slot` is in the region) but the slot's
    /// block is not free as it was left (slots whose lives never meet share bytes): carved from the
    /// region without looking at the position again (`plan_alloc_slow`, which did, cost
    /// `random_256_live` 14 of its 1,294 instructions an operation on the simulated device).
    #[inline(never)]
    pub(super) fn plan_alloc_carved(&mut self, i: usize, slot: u32, size: u64) -> Option<u32> {
        let p = &mut self.plans.plans[i];
        let (off, bytes) = p.layout.slots[slot as usize];
        if bytes != size {
            // the low half of another event's print: not the plan's event after all (as in
            // `Plan::step`, the cursor is lost)
            p.cursor = None;
            self.plan_out_of_step(i);
            return None;
        }
        let r = self.plan_carve(i, off, size);
        self.plan_taken(i, slot, r)
    }

    /// Plan `i`'s slot `slot` taken as block `r` (a miss where `None`), counted.
    #[inline]
    pub(super) fn plan_taken(&mut self, i: usize, slot: u32, r: Option<u32>) -> Option<u32> {
        match r {
            Some(id) => {
                let events = self.plans.repeats.events();
                let addr = self.blocks[id as usize].addr;
                self.plans.plans[i].taken[slot as usize] = Taken {
                    at: events,
                    block: id,
                    addr,
                };
                self.stats.num_plan_allocs += 1;
            }
            None => self.stats.num_plan_misses += 1,
        }
        r
    }

    #[inline(never)]
    pub(super) fn plan_alloc_slow(&mut self, stream: Stream, size: u64) -> Option<u32> {
        if self.plans.planning.is_some() {
            self.plan_poll();
        }
        let i = self.plans.current?;
        let print = repeat::print(false, size, stream.0);
        let pos = match self.plans.plans[i].step(print) {
            Some(p) => p,
            None => {
                self.plan_out_of_step(i);
                return None;
            }
        };
        self.plans.plans[i].used = self.tick;
        if self.plans.plans[i].seg == NIL {
            if pos != 0 {
                self.plan_before_start(i, pos);
                return None;
            }
            if self.plan_activate(i).is_err() {
                return None;
            }
            self.plans.plans[i].since = self.plans.repeats.events();
            self.plan_quiet_close();
        }
        let p = &self.plans.plans[i];
        let slot = p.pos[pos as usize].slot;
        if slot == NO_SLOT {
            return None;
        }
        let (off, bytes) = p.layout.slots[slot as usize];
        if bytes != size {
            // the low half of another event's print: not the plan's event after all (as in
            // `Plan::step`, the cursor is lost)
            self.plans.plans[i].cursor = None;
            self.plan_out_of_step(i);
            return None;
        }
        let r = match self.plan_take_again(i, slot, size) {
            Some(id) => Some(id),
            None => self.plan_carve(i, off, size),
        };
        self.plan_taken(i, slot, r)
    }

    /// Slot `slot` of plan `i` (of `size` bytes) as it was last taken in the plan's region,
    /// if that block is free and still exactly the slot's bytes (a slot whose bytes no other
    /// slot shares, the common case in a job's steady state: a planned block's free leaves it
    /// as it is): taken back without looking for it (`plan_carve`), its pages mapped still.
    #[inline(always)]
    pub(super) fn plan_take_again(&mut self, i: usize, slot: u32, size: u64) -> Option<u32> {
        let p = &self.plans.plans[i];
        let t = p.taken[slot as usize];
        let b = self.blocks.get(t.block as usize)?;
        if b.state != State::Free || b.segment != p.seg || b.addr != t.addr || b.size != size {
            return None;
        }
        let id = t.block;
        // (a slot's pages stay mapped while its plan holds the region: the give-back's split
        // forgets the slots whose pages it maps again, `plan_split`, and leaving the region
        // forgets them all, `plan_leave`)
        debug_assert!({
            let s = &self.segments[p.seg as usize];
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            let (lo, hi) = page_span(b.addr - s.addr, size, page);
            s.pages
                .as_deref()
                .is_some_and(|pages| pages.all_mapped(lo, hi))
        });
        self.unmark_inactive(id);
        self.blocks[id as usize].state = State::Allocated;
        Some(id)
    }

    /// A free of block `id`, of `size` rounded bytes on `stream`: the cursor moves on. Where
    /// the block is not the one the plan allocated for this free (a job may free blocks of
    /// one size in another order than the plan saw: the prints match, the lives do not), the
    /// free is told to the detector rather than only counted (`note_quiet`'s window closes),
    /// so that the plan's events, given back to it (`plan_events`), are the ones it would
    /// have noted. (`bench_torch.py`'s phases job, recorded on an H200, did that at its event
    /// 8,318; debug builds check what is given back.)
    #[inline]
    pub(in crate::pool) fn plan_free_event(&mut self, id: u32, size: u64, stream: Stream) {
        if let Some(i) = self.plans.current {
            match self.plans.plans[i].step(repeat::print(true, size, stream.0)) {
                None => self.plan_out_of_step(i),
                Some(pos) if self.plans.plans[i].seg == NIL => self.plan_before_start(i, pos),
                Some(pos) => {
                    let born = self.plans.born.get(id as usize).copied().unwrap_or(NONE);
                    let held = self.plans.plans[i].held[pos as usize];
                    if born.wrapping_add(u64::from(held)) != self.plans.repeats.events() {
                        self.plan_quiet_close();
                    }
                }
            }
        }
    }

    /// An event at position `pos` (not the start) of plan `i`, which follows the job and waits
    /// for its start: past the period's last block that lives into the next one, the
    /// placement for the start is made ahead, once. From frees as well as allocations: a
    /// training step's start comes after the frees that end the step before, and a plan that
    /// begins to follow the job among them (its layout taken at a free, `note_large_event`)
    /// sees no allocation before its start.
    #[cold]
    #[inline(never)]
    fn plan_before_start(&mut self, i: usize, pos: u32) {
        let p = &self.plans.plans[i];
        if pos != 0 && pos > p.last_wrap && p.place_ahead.is_none() {
            self.plan_place_ahead(i, pos);
        }
    }

    /// Tell the detector of an allocation of block `id` of `rounded` bytes (`free`: false) or
    /// its free.
    #[inline(always)]
    pub(in crate::pool) fn note_event(&mut self, id: u32, rounded: u64, free: bool) {
        // plans place large blocks only; small ones fill the small pool's pages (this much
        // is inlined: most events are small ones)
        if rounded > SMALL_SIZE && self.plans.on && !self.note_quiet(id, rounded, free) {
            self.note_large_event(id, free);
        }
    }

    /// [`CachingPool::note_large_event`] where it has nothing to do but count the event, the
    /// common case once a plan follows the job: the plan has served a whole cycle in its
    /// region (the detector only counts events then, see `Repeats::skip`) and no try at
    /// giving back pages is due (the event lies in the window `plan_quiet_window` computed),
    /// and the block's slot in `born` exists; and the plan can give the
    /// event back as it was (`plan_unskip`): the block is of its rounded size (the pool's
    /// count of allocated bytes moves by the plan's size), and a freed block was allocated
    /// since the plan took its region (its allocation is where the plan says). Returns false,
    /// having done nothing, otherwise. (Inlined: the whole of `note_large_event`, out of
    /// line, cost about twice as many instructions an event, a third of them saving and
    /// restoring registers.)
    #[inline(always)]
    pub(super) fn note_quiet(&mut self, id: u32, rounded: u64, free: bool) -> bool {
        if self.plans.repeats.events() >= self.plans.quiet_until {
            return false;
        }
        #[cfg(debug_assertions)]
        self.check_quiet_window();
        let idx = id as usize;
        let Some(&born) = self.plans.born.get(idx) else {
            return false;
        };
        let since = self.plans.quiet_since;
        if self.blocks[idx].size != rounded || (free && (born == NONE || born < since)) {
            return false;
        }
        // (as in `note_large_event`, whose other steps have nothing to do here: the detector
        // confirms no period while the plan follows the job)
        #[cfg(debug_assertions)]
        self.shadow_note(id, free, true);
        let n = self.plans.repeats.skip();
        self.plans.born[idx] = if free { NONE } else { n };
        true
    }

    #[inline(never)]
    pub(super) fn note_large_event(&mut self, id: u32, free: bool) {
        if let (Some(i), Some(_)) = (self.plans.current, self.plans.repeats.skipped_from()) {
            // (a quiet stretch ends: see `plan_unskip`; the pool's count has this event
            // already)
            let (now, bytes) = (self.stats.allocated_large(), self.blocks[id as usize].size);
            let before = if free {
                now + bytes
            } else {
                now.saturating_sub(bytes)
            };
            self.plan_unskip(i, before);
        }
        let b = &self.blocks[id as usize];
        let (size, stream) = (b.rounded, b.stream.0);
        let idx = id as usize;
        if self.plans.born.len() <= idx {
            self.plans.born.resize(idx + 1, NONE);
        }
        let live = self.stats.allocated_large();
        let (idle, settled) = self.plans.current.map_or((false, false), |i| {
            let (idle, due) = self.plans.plans[i].idle_and_due(self.plans.repeats.events());
            (idle, idle && due)
        });
        if let Some(i) = self.plans.current.filter(|_| idle) {
            self.plan_stayed(i);
        }
        if settled && self.plans.plans.len() == 1 {
            self.plan_settled();
        }
        #[cfg(debug_assertions)]
        self.shadow_note(id, free, idle);
        if free {
            let born = freed_born(std::mem::replace(&mut self.plans.born[idx], NONE));
            self.plans.repeats.note(born, size, stream, live, idle);
        } else {
            let n = self.plans.repeats.note(NONE, size, stream, live, idle);
            self.plans.born[idx] = n;
        }
        if free && self.plans.planning.is_some() {
            // (a layout is also taken at a free: a job's frees that end a step come just
            // before the plan's start, where an allocation that looked would be too late:
            // the plan finds the job in step only from the event after it, a step later)
            self.plan_poll();
        }
        if self.plans.current.is_none() && !self.plans.plans.is_empty() {
            self.plan_resync();
        }
        if self.plans.repeats.found != self.plans.seen {
            if self.plans.seen == 0 {
                // the job repeats: its warm-up is over (see `budget.rs`)
                self.budget.warmed_up();
            }
            self.plans.seen = self.plans.repeats.found;
            // a period no plan in step follows (a plan in step may follow only the first
            // events of a new phase's steps)
            let period = self.plans.repeats.period();
            let followed = self
                .plans
                .current
                .is_some_and(|i| u64::from(self.plans.plans[i].layout.half) == period);
            if !followed && self.plans.planning.is_none() && self.plans.may_plan() {
                self.plan_start(free.then_some(id));
            }
        }
        self.plan_quiet_window();
    }

    /// From the next event on, until which one the current plan is idle (it has served a
    /// whole cycle in its region), no give-back is due and the detector only counts events
    /// ([`repeat::Repeats::quiet`]): `note_quiet`'s window, so that a quiet event asks one
    /// question instead of five (the plan's step loop on the simulated device: 535 -> 492
    /// instructions an allocate + free). Computed where those change in the common case (the
    /// end of `note_large_event`, which every event outside the window passes through); every
    /// other place that changes them (a plan taken up, left or dropped, a quiet stretch given
    /// back) closes the window (`plan_quiet_close`), and debug builds check the window
    /// against the five questions at every quiet event.
    pub(super) fn plan_quiet_window(&mut self) {
        (self.plans.quiet_until, self.plans.quiet_since) =
            self.quiet_window_now().unwrap_or((0, 0));
    }

    /// The five questions of [`CachingPool::plan_quiet_window`] asked now: where all answer
    /// quiet, the event at which one stops doing so, and the current plan's `since`.
    pub(super) fn quiet_window_now(&self) -> Option<(u64, u64)> {
        let p = &self.plans.plans[self.plans.current?];
        let (idle, due) = p.idle_and_due(self.plans.repeats.events());
        if !idle || due || !self.plans.repeats.quiet() {
            return None;
        }
        // (idle stays so while the plan holds its region; a try at giving back comes due at
        // `next_at`, while tries are left)
        let g = &p.give_back;
        Some((if g.tries > 0 { g.next_at } else { u64::MAX }, p.since))
    }

    /// Close `note_quiet`'s window (see [`CachingPool::plan_quiet_window`]).
    #[inline]
    pub(super) fn plan_quiet_close(&mut self) {
        self.plans.quiet_until = 0;
    }

    /// (debug builds) An event inside `note_quiet`'s window: the five questions it stands
    /// for give what the window says.
    #[cfg(debug_assertions)]
    pub(super) fn check_quiet_window(&self) {
        let now = self.quiet_window_now();
        assert!(
            now.is_some_and(|(_, since)| since == self.plans.quiet_since),
            "a quiet window left open: now {now:?}, since {}",
            self.plans.quiet_since
        );
    }

    /// Plan `i` has served a whole cycle in its region: counted once (see [`MAX_WASTED`]).
    #[inline]
    pub(super) fn plan_stayed(&mut self, i: usize) {
        let p = &mut self.plans.plans[i];
        if !p.stayed {
            p.stayed = true;
            self.plans.useful += 1;
        }
    }

    /// Plan `i` is about to be given up (dropped, or made room for): counted as wasted if it
    /// never served a whole cycle in its region (see [`MAX_WASTED`]).
    pub(super) fn plan_given_up(&mut self, i: usize) {
        let (idle, _) = self.plans.plans[i].idle_and_due(self.plans.repeats.events());
        if idle {
            self.plan_stayed(i);
        } else if !self.plans.plans[i].stayed {
            self.plans.wasted += 1;
        }
    }

    /// The job left plan `i`'s steps (an evaluation step, a new shape): the plan leaves its
    /// region at once, so that the dynamic pool has its memory, and waits dormant for the
    /// job to come back to it; unless it has lost the job before one whole cycle of its events
    /// [`MAX_SHORT_STAYS`] times in a row, then it is dissolved (the detector plans the job
    /// anew if it comes back).
    pub(super) fn plan_out_of_step(&mut self, i: usize) {
        // (the event that lost the job is not counted yet)
        self.plan_unskip(i, self.stats.allocated_large());
        let now = self.plans.repeats.events();
        let p = &mut self.plans.plans[i];
        // (a look that found the job in another period is forgotten with it: a later one
        // may find it in this plan's)
        if matches!(&p.place_ahead, Some(a) if matches!(a.job, PlaceJob::OutOfStep)) {
            p.place_ahead = None;
        }
        if p.seg != NIL {
            let short = now < p.since + p.pos.len() as u64;
            p.short_stays = if short { p.short_stays + 1 } else { 0 };
            if p.short_stays >= MAX_SHORT_STAYS {
                self.stats.num_plans_dropped += 1;
                self.plan_given_up(i);
                self.plan_dissolve(i);
                return;
            }
        }
        self.plan_leave(i);
    }

    /// (debug builds) Block `id`'s allocation or free to the shadow detector, as
    /// `note_large_event` tells the detector (called before `born` changes).
    #[cfg(debug_assertions)]
    pub(super) fn shadow_note(&mut self, id: u32, free: bool, idle: bool) {
        let b = &self.blocks[id as usize];
        let (size, stream) = (b.rounded, b.stream.0);
        let live = self.stats.allocated_large();
        let born = match free {
            true => freed_born(self.plans.born.get(id as usize).copied().unwrap_or(NONE)),
            false => NONE,
        };
        self.plans.shadow.note(born, size, stream, live, idle);
    }

    /// The detector's last events where it only counted them while plan `i` followed the
    /// job (`Repeats::skip`), as the plan had them: the events since the plan took its
    /// region (at its position 0) are its positions in turn, so each one's print, size and,
    /// for a free, its allocation's event come from the plan; the allocated bytes after each
    /// from `live` (after the last of them), back over their sizes (`note_quiet` counts only
    /// events whose block has its rounded size). Given back to the detector as `note` would
    /// have left them (`Repeats::refill`); where a position does not say (an allocation the
    /// plan does not place, a free of a block it did not) or does not match its print,
    /// nothing is, and the detector starts afresh. Debug builds check what is given back
    /// against a detector that noted every event.
    #[cold]
    pub(super) fn plan_unskip(&mut self, i: usize, live: u64) {
        self.plan_quiet_close();
        let Some(from) = self.plans.repeats.skipped_from() else {
            return;
        };
        let Some(back) = self.plan_events(i, from, live) else {
            #[cfg(debug_assertions)]
            {
                // (the detector starts afresh at its next event, and so does the shadow:
                // a later give-back is checked against what the detector can know)
                self.plans.shadow.forget_recent();
                self.plans.unskipped.1 += 1;
            }
            return;
        };
        self.plans.repeats.refill(&back);
        #[cfg(debug_assertions)]
        {
            assert!(
                self.plans.repeats.same_recent(&self.plans.shadow),
                "the plan gave the detector back other events than it saw"
            );
            self.plans.unskipped.0 += 1;
        }
    }

    /// The detector's events from `from` on (its last [`repeat::RECENT`] at most) as plan `i`
    /// has them, with `live` bytes allocated after the last (see `plan_unskip`).
    pub(super) fn plan_events(&self, i: usize, from: u64, live: u64) -> Option<Vec<Entry>> {
        let n = self.plans.repeats.events();
        let p = &self.plans.plans[i];
        let len = p.pos.len() as u64;
        if len == 0 || from < p.since || p.seg == NIL {
            return None;
        }
        let stream = p.layout.stream.0;
        let m = (n - from).min(repeat::RECENT);
        let mut live = live;
        let mut back = Vec::with_capacity(m as usize);
        for k in (n - m..n).rev() {
            let q = ((k - p.since) % len) as u32;
            let at = p.pos[q as usize];
            let (free, size, born) = if at.slot != NO_SLOT {
                (false, p.layout.slots[at.slot as usize].1, NONE)
            } else {
                // the life that ends here began `held` positions before (`Plan::held`), where
                // its allocation takes its slot (none: a free the plan does not place)
                let held = u64::from(p.held[q as usize]);
                let slot = p.pos[((u64::from(q) + len - held) % len) as usize].slot;
                if slot == NO_SLOT {
                    return None;
                }
                (true, p.layout.slots[slot as usize].1, k.checked_sub(held)?)
            };
            let print = repeat::print(free, size, stream);
            if print as u32 != at.print {
                return None;
            }
            back.push(Entry {
                print,
                live,
                size,
                born,
            });
            live = if free {
                live + size
            } else {
                live.checked_sub(size)?
            };
        }
        back.reverse();
        Some(back)
    }

    /// Find where the job stands in one of the plans from the last events.
    #[cold]
    pub(super) fn plan_resync(&mut self) {
        if self.plans.repeats.events() < WINDOW {
            return;
        }
        let h = self.plans.repeats.hash();
        let found = self
            .plans
            .plans
            .iter()
            .enumerate()
            .find_map(|(i, p)| Some((i, *p.windows.get(&h)?)));
        if let Some((i, next)) = found {
            self.plan_follow(i, next);
        }
    }

    /// Plan `i` follows the job, whose next event is at position `next` of its period (the
    /// soonest copy of it in a plan of two periods).
    pub(super) fn plan_follow(&mut self, i: usize, next: u32) {
        let p = &mut self.plans.plans[i];
        p.cursor = Some(p.soonest_copy(next));
        self.plans.current = Some(i);
        self.plan_quiet_close();
    }
}
