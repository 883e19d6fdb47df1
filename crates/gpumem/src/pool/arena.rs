//! The block/segment arena: slots, links, free sets, split and coalesce.

use super::expandable::page_span;
use super::*;

impl CachingPool {
    /// Register a new segment of `size` bytes at `addr` whose single block is taken (not in
    /// any free set); counts the segment. Returns the block.
    pub(super) fn install_segment(
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
            planned: false,
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
            handout: Handout::Id,
            generation: 0,
        });
        self.segments[seg as usize].head = id;
        self.segment_index.insert(addr, seg);
        self.register_stream(stream);
        self.stats.segment.inc(kind, 1);
        id
    }

    /// Index of `stream` in `streams` / `free`.
    #[inline]
    pub(super) fn slot_of(&self, stream: Stream) -> Option<usize> {
        self.streams.iter().position(|&s| s == stream)
    }

    pub(super) fn best_fit(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        let slot = self.slot_of(stream)?;
        let (bsize, _, id) = self.free[slot][kind as usize].best_fit(size)?;
        if !self.fits(size, bsize) {
            return None;
        }
        self.leave_free(id);
        Some(id)
    }

    pub(super) fn register_stream(&mut self, stream: Stream) {
        if self.slot_of(stream).is_none() {
            self.streams.push(stream);
            self.free.push(Default::default());
        }
    }

    /// Split `id` (taken, not free) so that it is `size` bytes, if the rest is worth keeping.
    pub(super) fn split(&mut self, id: u32, size: u64) {
        let b = &self.blocks[id as usize];
        let remaining = b.size - size;
        let worth = match b.kind {
            _ if self.policy.no_split => false,
            _ if self.policy.page.is_some() => remaining >= MIN_BLOCK,
            PoolKind::Small => remaining >= MIN_BLOCK,
            PoolKind::Large => size < self.policy.max_split && remaining > SMALL_SIZE,
        };
        if !worth {
            return;
        }
        self.split_exact(id, size);
        let r = self.blocks[id as usize].next;
        self.enter_free(r);
    }

    /// Split taken block `id` at exactly `size` bytes; the rest is a new taken block after it.
    pub(super) fn split_exact(&mut self, id: u32, size: u64) {
        let b = &self.blocks[id as usize];
        debug_assert!(size < b.size);
        let rest = Block {
            addr: b.addr + size,
            size: b.size - size,
            requested: 0,
            rounded: 0,
            stream: b.stream,
            segment: b.segment,
            prev: id,
            next: b.next,
            state: State::Allocated,
            kind: b.kind,
            uses: None,
            handout: Handout::Id,
            generation: 0,
        };
        let next = b.next;
        let r = self.new_block(rest);
        if next != NIL {
            self.blocks[next as usize].prev = r;
        }
        if !self.foreign.is_empty() {
            self.split_foreign(id, r);
        }
        let b = &mut self.blocks[id as usize];
        b.next = r;
        b.size = size;
    }

    /// Put a block that is neither free nor quick into its free set, coalescing neighbours.
    pub(super) fn free_block(&mut self, id: u32) {
        self.free_block_used_by(id, None, None);
    }

    /// [`CachingPool::free_block`] for a block its user freed at tick `freed_at` (a block
    /// leaving the quick cache): its pages count as freed then.
    pub(super) fn free_block_freed_at(&mut self, id: u32, freed_at: u64) {
        self.free_block_used_by(id, None, Some(freed_at));
    }

    /// [`CachingPool::free_block`] for a block last used by `lent_to` (a stream other than its
    /// own: see `lending.rs`) or by its own stream (`None`). A lent block's pages keep their
    /// owner's free ticks; the block remembers the other stream's free instead (see
    /// `lending.rs`).
    pub(super) fn free_block_used_by(
        &mut self,
        id: u32,
        lent_to: Option<Stream>,
        freed_at: Option<u64>,
    ) {
        if self.plans.busy() && self.in_plan(id) {
            self.plan_release(id);
            return;
        }
        self.tick += 1;
        if let Some(user) = lent_to {
            let b = &self.blocks[id as usize];
            let used = ForeignUse {
                stream: user,
                tick: self.tick,
                lo: b.addr,
                hi: b.addr + b.size,
            };
            self.checkpoint_on_free(user);
            self.foreign.entry(id).or_default().push(used);
        } else if self.policy.page.is_some() {
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            let b = &self.blocks[id as usize];
            let (addr, size, tick) = (b.addr, b.size, freed_at.unwrap_or(self.tick));
            let s = &mut self.segments[b.segment as usize];
            let base = s.addr;
            if let Some(p) = s.pages.as_mut() {
                let (p0, p1) = page_span(addr - base, size, page);
                p.mark_freed(p0, p1, tick, freed_at.is_none());
            }
        }
        let mut id = id;
        let (prev, stream) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.stream)
        };
        if prev != NIL && self.is_mergeable(prev, stream) {
            self.leave_free(prev);
            self.merge_foreign(id, prev);
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks[id as usize].next;
        if next != NIL && self.is_mergeable(next, stream) {
            self.leave_free(next);
            self.merge_foreign(next, id);
            self.absorb_next(id);
        }
        let seg = self.blocks[id as usize].segment;
        self.segments[seg as usize].last_used = self.tick;
        if lent_to.is_none() && self.policy.page.is_some() {
            // a checkpoint by which the freed pages become known idle (see `events.rs`)
            self.checkpoint_on_free(stream);
        }
        self.enter_free(id);
    }

    /// Merge the block after `id` into it (that slot is retired).
    pub(super) fn absorb_next(&mut self, id: u32) {
        let next = self.blocks[id as usize].next;
        let n = self.release_block(next);
        let b = &mut self.blocks[id as usize];
        b.size += n.size;
        b.next = n.next;
        if n.next != NIL {
            self.blocks[n.next as usize].prev = id;
        }
    }

    pub(super) fn is_mergeable(&self, id: u32, stream: Stream) -> bool {
        let b = &self.blocks[id as usize];
        b.state == State::Free && b.stream == stream
    }

    /// Coalesce every quick-cached block.
    pub(super) fn flush_quick(&mut self) {
        for (_, _, id, freed_at) in std::mem::take(&mut self.quick) {
            self.unmark_inactive(id);
            self.free_block_freed_at(id, freed_at);
        }
    }

    pub(super) fn free_key(&self, id: u32) -> FreeKey {
        let b = &self.blocks[id as usize];
        (b.stream.0, b.size, b.addr, id)
    }

    pub(super) fn index_of(&mut self, id: u32) -> &mut FreeIndex {
        let b = &self.blocks[id as usize];
        let (stream, k) = (b.stream, b.kind as usize);
        let slot = self
            .slot_of(stream)
            .expect("blocks belong to registered streams");
        &mut self.free[slot][k]
    }

    /// Make `id` free: insert into its index and count it.
    pub(super) fn enter_free(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.state = State::Free;
        let (size, addr) = (b.size, b.addr);
        self.index_of(id).insert(size, addr, id);
        self.mark_inactive(id);
    }

    /// Take free block `id` out of its index (it becomes Allocated until told otherwise).
    pub(super) fn leave_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let (size, addr) = (b.size, b.addr);
        let removed = self.index_of(id).remove(size, addr, id);
        debug_assert!(removed, "free block missing from its index");
        self.unmark_inactive(id);
        self.blocks[id as usize].state = State::Allocated;
    }

    /// Count free block `id` as inactive and split (torch's `inactive_split`), if it has a
    /// neighbour. (Inlined everywhere: out of line, with `unmark_inactive`, the plan's
    /// allocate + free took 492 instructions on the simulated device, inlined 482.)
    #[inline(always)]
    pub(super) fn mark_inactive(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        if b.prev != NIL || b.next != NIL {
            self.stats.inactive_split.inc(b.kind, 1);
            self.stats.inactive_split_bytes.inc(b.kind, b.size);
        }
    }

    /// Undo [`CachingPool::mark_inactive`] for block `id`, taken.
    #[inline(always)]
    pub(super) fn unmark_inactive(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        if b.prev != NIL || b.next != NIL {
            self.stats.inactive_split.dec(b.kind, 1);
            self.stats.inactive_split_bytes.dec(b.kind, b.size);
        }
    }

    pub(super) fn new_block(&mut self, b: Block) -> u32 {
        slab_insert(&mut self.blocks, &mut self.spare_blocks, b)
    }

    /// Retire a block slot; returns its former contents.
    pub(super) fn release_block(&mut self, id: u32) -> Block {
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
                handout: Handout::Id,
                generation: 0,
            },
        )
    }

    pub(super) fn new_segment(&mut self, s: Segment) -> u32 {
        slab_insert(&mut self.segments, &mut self.spare_segments, s)
    }

    /// Segments whose only block is free (and, if expandable, with nothing mapped).
    pub(super) fn releasable(&self) -> Vec<u32> {
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

    pub(super) fn release_segment(&mut self, seg: u32) {
        let (addr, size, stream, kind, head) = {
            let s = &self.segments[seg as usize];
            (s.addr, s.size, s.stream, s.kind, s.head)
        };
        self.leave_free(head);
        self.foreign.remove(&head);
        self.release_block(head);
        self.segment_index.remove(&addr);
        self.spare_segments.push(seg);
        if self.segments[seg as usize].pages.take().is_some() {
            if let Err(e) = self.vmm().and_then(|v| v.release_address(addr, size)) {
                tracing::warn!("gpumem: releasing address range {addr:#x} failed: {e}");
            }
            self.stats.segment.dec(kind, 1);
            return;
        }
        self.tell_classic(SegmentChange::Free, addr, size, stream);
        if let Err(e) = self.backend.deallocate(addr, size as usize, stream) {
            tracing::warn!("gpumem: returning segment {addr:#x} ({size} B) failed: {e}");
        }
        self.record(Action::SegmentFree, addr, size, stream);
        self.stats.segment.dec(kind, 1);
        self.stats.reserved_bytes.dec(kind, size);
        self.stats.num_device_free += 1;
        self.shared.reserved.fetch_sub(size, Ordering::Relaxed);
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
