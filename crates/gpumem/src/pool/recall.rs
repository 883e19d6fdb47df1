//! Layout recall (expandable segments): in a job whose allocations repeat (training steps),
//! an allocation gets the address the same allocation got last time, if that memory is free,
//! so that the layout, and with it the pages each step maps, repeats instead of drifting
//! (best fit alone does not repeat: the blocks alive across a step boundary differ from one
//! step to the next). "The same allocation" is the same size, on the same stream, with the
//! same bytes allocated at that moment and the same sizes just before it: in a periodic job
//! that names each allocation of a step; in a job whose sizes vary it rarely matches, and
//! placement is best fit as before. A recalled placement that needs pages moves home first
//! the free pages whose memory lingers where it maps (`move_homes` in `expandable.rs`), so
//! that a step's page moves come to cost no driver call. Recall is on while pages may move
//! (see `budget.rs`), and with several streams only where no page has to move.

use super::*;
use std::hash::{Hash, Hasher};

/// How many earlier allocation sizes are part of an allocation's context.
const DEPTH: usize = 8;
/// Contexts remembered at most (a job whose sizes never repeat starts over past this).
const MAX_HINTS: usize = 1 << 16;

#[derive(Debug, Default)]
pub(super) struct Recall {
    recent: [u64; DEPTH],
    pos: usize,
    /// context → where the allocation was placed
    hints: FxHashMap<u64, DevPtr>,
    /// allocations in this window, and those whose context was seen before
    asked: u32,
    seen: u32,
    /// at least half the contexts of the last window had been seen before: the job repeats
    repeats: bool,
}

/// Allocations per window of the repeat measure.
const WINDOW: u32 = 256;

impl Recall {
    /// The context of an allocation of `size` bytes on `stream` with `live` bytes allocated;
    /// counts it in as the newest size.
    #[inline]
    pub(super) fn context(&mut self, stream: Stream, size: u64, live: u64) -> u64 {
        let mut h = rustc_hash::FxHasher::default();
        (stream.0, size, live).hash(&mut h);
        for i in 0..DEPTH {
            self.recent[(self.pos + i) % DEPTH].hash(&mut h);
        }
        self.recent[self.pos] = size;
        self.pos = (self.pos + 1) % DEPTH;
        h.finish()
    }

    /// Where the allocation of context `ctx` went last time, if the job repeats (half
    /// contexts of the last window of allocations had been seen before; where few repeat, a
    /// remembered address is mostly a stale one that would cut free blocks apart).
    #[inline]
    pub(super) fn hint(&mut self, ctx: u64) -> Option<DevPtr> {
        let hint = self.hints.get(&ctx).copied();
        self.asked += 1;
        self.seen += u32::from(hint.is_some());
        if self.asked >= WINDOW {
            self.repeats = self.seen * 2 >= self.asked;
            self.asked = 0;
            self.seen = 0;
        }
        hint.filter(|_| self.repeats)
    }

    #[inline]
    pub(super) fn remember(&mut self, ctx: u64, addr: DevPtr) {
        if self.hints.len() >= MAX_HINTS {
            self.hints.clear();
        }
        self.hints.insert(ctx, addr);
    }

    pub(super) fn clear(&mut self) {
        *self = Self::default();
    }
}

impl CachingPool {
    /// Whether placements are recalled: while pages may move (see `budget.rs`). Once moves
    /// have stopped, a recalled placement that needs pages mapped would only grow the pool
    /// where best fit finds mapped memory.
    #[inline]
    pub(super) fn settled(&self) -> bool {
        !self.budget.stopped()
    }

    /// The hinted block, if it waits in the quick cache with this size and stream; taken out.
    pub(super) fn take_recalled(&mut self, stream: Stream, size: u64) -> Option<u32> {
        let addr = self.hint?;
        let pos = self.quick.iter().position(|&(s, st, id)| {
            s == size && st == stream && self.blocks[id as usize].addr == addr
        })?;
        self.hint = None;
        self.stats.num_recalled += 1;
        Some(self.take_quick_at(pos))
    }

    /// The hinted address, if a free block holds `[addr, addr + size)`: placed there (pages
    /// mapped as needed); `None` if it is not free.
    pub(super) fn take_hinted(&mut self, stream: Stream, size: u64) -> Result<Option<u32>> {
        let kind = Self::kind_of(size);
        match self.cut_at_hint(stream, size, kind) {
            Some(id) => self
                .place_expandable(Some(id), stream, size, kind, true)
                .map(Some),
            None => Ok(None),
        }
    }

    /// The hinted address as part of a free block of `stream` and `kind` that holds
    /// `[addr, addr + size)`: taken out of its free set and cut to start at the address (the
    /// bytes before it stay free).
    fn cut_at_hint(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        let addr = self.hint.take()?;
        let (_, &id) = self.starts.range(..=addr).next_back()?;
        let b = &self.blocks[id as usize];
        let front = addr.checked_sub(b.addr)?;
        if b.state != State::Free
            || self.segments[b.segment as usize].pages.is_none()
            || b.stream != stream
            || b.kind != kind
            || front + size > b.size
            || (front > 0 && front < MIN_BLOCK)
            || !self.fits(size, b.size - front)
        {
            return None;
        }
        // with several streams, only where no page has to move (else another stream's free
        // mapped block may serve: see `lending.rs`)
        if self.streams.len() >= 2 && !self.mapped_within(id, front, size) {
            return None;
        }
        self.leave_free(id);
        self.stats.num_recalled += 1;
        if front == 0 {
            return Some(id);
        }
        self.split_exact(id, front);
        let r = self.blocks[id as usize].next;
        self.enter_free(id);
        Some(r)
    }
}
