//! Blocks lent across streams (expandable segments, several streams).
//!
//! Each stream has its own expandable segments, as in PyTorch. When two streams take turns
//! (one queues its step, then the other), each needs memory while the other's lies free, so
//! keeping the physical memory near the peak of allocated bytes moves pages between their
//! segments on every step: driver calls paid from the time budget of moves. Instead,
//! a stream that would have to move pages takes a free block of another stream's segment whose
//! pages are all mapped, after waiting on the GPU for that stream's checkpoint event that
//! covers the block's last free (as `cudaMallocAsync` reuses memory across streams through
//! event dependencies). No driver call, no host wait.
//!
//! The block stays in its owner's segment. Given back, it goes to the owner's free set at once
//! (a caching allocator's free is ordered on the freeing stream), the block remembering the
//! stream it was lent to and its free tick (`CachingPool::foreign`); whoever takes it next (the
//! owner, or a third stream) first waits for a checkpoint of that stream covering the free
//! (recorded when needed: see `CachingPool::cover`), and its pages are not unmapped before that
//! stream is known done with them. A block that merges with such a block inherits what it
//! remembers.

use super::*;

impl CachingPool {
    /// A free block of another stream's expandable segment of `kind` whose first `size` bytes
    /// are mapped and whose last users `stream` can be ordered after without a host wait: the
    /// smallest among the few smallest that fit, per stream. Returns it taken out of its free
    /// set, with its owner and the free tick to order after.
    pub(super) fn borrow(
        &mut self,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Option<(u32, Stream, u64)> {
        let mut best: Option<(u64, u32, Stream, u64)> = None;
        for slot in 0..self.streams.len() {
            let owner = self.streams[slot];
            if owner == stream {
                continue;
            }
            let candidates: Vec<(u64, u32)> = self.free[slot][kind as usize]
                .at_least(size)
                .take(STEAL_SCAN)
                .map(|(bsize, _, id)| (bsize, id))
                .collect();
            for (bsize, id) in candidates {
                if best.is_some_and(|b| b.0 <= bsize) {
                    break;
                }
                let seg = self.blocks[id as usize].segment;
                if self.segments[seg as usize].pages.is_none()
                    || !self.fits(size, bsize)
                    || !self.mapped_under(id, size)
                {
                    continue;
                }
                let tick = self.owner_tick(id, size);
                if !self.can_order_after(stream, owner, tick) {
                    continue;
                }
                let addr = self.blocks[id as usize].addr;
                let others: Vec<ForeignUse> = self
                    .foreign
                    .get(&id)
                    .map(|l| l.iter().filter(|u| u.lo < addr + size).copied().collect())
                    .unwrap_or_default();
                if others
                    .iter()
                    .all(|u| self.can_order_after(stream, u.stream, u.tick))
                {
                    best = Some((bsize, id, owner, tick));
                    break;
                }
            }
        }
        let (_, id, owner, tick) = best?;
        self.leave_free(id);
        Some((id, owner, tick))
    }

    /// The latest free tick of the owner's pages under the first `size` bytes of block `id`.
    fn owner_tick(&self, id: u32, size: u64) -> u64 {
        self.pages_under(id, size).map_or(0, |(pages, p0, p1)| {
            (p0..p1).map(|p| pages.freed_at(p)).max().unwrap_or(0)
        })
    }

    /// Block `id`, taken by `stream` (from its own free set, or `borrowed` from another
    /// stream's with the owner's free tick), is about to be handed out: order `stream` after
    /// every other stream that used it last, and note a lent block.
    #[inline]
    pub(super) fn settle_taken(
        &mut self,
        id: u32,
        stream: Stream,
        borrowed: Option<(Stream, u64)>,
    ) {
        if let Some((owner, tick)) = borrowed {
            self.order_after(stream, owner, tick);
            self.lent.insert(id, stream);
            self.stats.num_cross_stream_blocks += 1;
        }
        if self.foreign.is_empty() {
            return;
        }
        // (split already gave the uses past the block to the rest)
        if let Some(list) = self.foreign.remove(&id) {
            for u in list {
                self.order_after(stream, u.stream, u.tick);
            }
        }
    }

    /// Give back block `id`, lent to `user`.
    pub(super) fn release_lent(&mut self, id: u32, user: Stream) -> Result<()> {
        let capturing = self.capturing(user);
        let b = &self.blocks[id as usize];
        let (kind, size, req, addr) = (b.kind, b.size, b.requested, b.addr);
        if b.uses.is_some() || capturing {
            // other streams recorded as users, or a graph capture on `user` (no checkpoint
            // can be recorded there now): wait for events like any such block
            let uses = self.blocks[id as usize]
                .uses
                .get_or_insert_with(Default::default);
            if !uses.contains(&user) {
                uses.push(user);
            }
            self.stats.on_free(kind, size, req, true);
            self.shared.on_free(size);
            self.record(Action::FreeRequested, addr, req, user);
            self.wait_for_uses(id);
            return Ok(());
        }
        self.stats.on_free(kind, size, req, false);
        self.shared.on_free(size);
        if self.recorder.is_some() {
            self.record(Action::FreeRequested, addr, req, user);
            self.record(Action::FreeCompleted, addr, req, user);
        }
        self.free_block_used_by(id, Some(user), None);
        Ok(())
    }

    /// Block `from` merges into `into`: `into` remembers `from`'s other users too (those
    /// known done are dropped).
    pub(super) fn merge_foreign(&mut self, from: u32, into: u32) {
        if self.foreign.is_empty() {
            return;
        }
        let mut list = self.foreign.remove(&from).unwrap_or_default();
        if let Some(old) = self.foreign.remove(&into) {
            list.extend(old);
        }
        list.retain(|u| self.known_safe(u.stream) < u.tick);
        if !list.is_empty() {
            self.foreign.insert(into, list);
        }
    }

    /// Block `id` was split, `rest` after it: each keeps the other users of its own bytes.
    pub(super) fn split_foreign(&mut self, id: u32, rest: u32) {
        let Some(list) = self.foreign.remove(&id) else {
            return;
        };
        let cut = self.blocks[rest as usize].addr;
        let (mine, theirs): (Vec<ForeignUse>, Vec<ForeignUse>) =
            list.iter().partition(|u| u.lo < cut);
        let theirs: Vec<ForeignUse> = theirs
            .into_iter()
            .chain(mine.iter().filter(|u| u.hi > cut).copied())
            .collect();
        if !mine.is_empty() {
            self.foreign.insert(id, mine);
        }
        if !theirs.is_empty() {
            self.foreign.insert(rest, theirs);
        }
    }

    /// The parts of free block `id` (address, bytes) that no other stream may still be using
    /// (all of it, unless a lent block given back there is not known done), or that `mover`
    /// is ordered after.
    pub(super) fn idle_parts(&self, id: u32, mover: Option<Stream>) -> Vec<(u64, u64)> {
        let b = &self.blocks[id as usize];
        let (mut lo, end) = (b.addr, b.addr + b.size);
        let Some(list) = self.foreign.get(&id) else {
            return vec![(lo, b.size)];
        };
        let mut busy: Vec<(u64, u64)> = list
            .iter()
            .filter(|u| self.known_safe(u.stream) < u.tick && !self.ordered(mover, u))
            .map(|u| (u.lo, u.hi))
            .collect();
        busy.sort_unstable();
        let mut parts = Vec::new();
        for (blo, bhi) in busy {
            if blo > lo {
                parts.push((lo, blo.min(end) - lo));
            }
            lo = lo.max(bhi);
        }
        if lo < end {
            parts.push((lo, end - lo));
        }
        parts
    }

    /// Whether work queued on `mover` from now on runs after lent use `u`.
    fn ordered(&self, mover: Option<Stream>, u: &ForeignUse) -> bool {
        let Some(m) = mover else {
            return false;
        };
        m == u.stream || self.waited(m, u.stream, u.tick)
    }

    /// Before `mover` moves free pages of `seg` in its order: order it after the lent uses
    /// given back there that a checkpoint covers (recorded now if need be: see
    /// [`CachingPool::cover`]).
    pub(super) fn order_for_foreign(&mut self, seg: u32, mover: Stream) {
        if self.foreign.is_empty() || self.capturing(mover) {
            return;
        }
        let uses: Vec<ForeignUse> = self
            .foreign
            .iter()
            .filter(|(&id, _)| self.blocks[id as usize].segment == seg)
            .flat_map(|(_, l)| l.iter().copied())
            .filter(|u| u.stream != mover)
            .collect();
        for u in uses {
            if !self.ordered(Some(mover), &u)
                && self.safe_tick(u.stream) < u.tick
                && self.cover(u.stream, u.tick).is_some()
            {
                self.order_after(mover, u.stream, u.tick);
            }
        }
    }
}
