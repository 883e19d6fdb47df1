//! Checkpoints of a pool's layout: which blocks of which segments are handed out. PyTorch's
//! CUDA-graph trees (`torch.compile(mode="reduce-overhead")`) save one after recording each
//! graph into a private pool and, to record another graph from that point, put the pool back
//! to it: every block allocated now is freed, and the checkpoint's blocks are handed out again
//! at their addresses (the tensors of the graphs recorded so far live there).

use super::*;

/// One block of a saved segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    /// address
    pub addr: u64,
    /// bytes
    pub size: u64,
    /// bytes requested, when allocated
    pub requested: u64,
    /// handed out when the checkpoint was taken
    pub allocated: bool,
}

/// One saved segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentLayout {
    /// base address
    pub addr: u64,
    /// bytes
    pub size: u64,
    /// blocks in address order, covering the segment
    pub blocks: Vec<BlockLayout>,
}

/// A pool's layout ([`CachingPool::layout`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    /// segments in address order
    pub segments: Vec<SegmentLayout>,
}

/// What [`CachingPool::restore`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// addresses that were handed out and are free now
    pub freed: Vec<DevPtr>,
    /// `(address, requested bytes)` handed out again from the checkpoint
    pub allocated: Vec<(DevPtr, u64)>,
}

impl CachingPool {
    /// The layout of every segment: blocks handed out count as allocated; blocks freed and
    /// waiting on events (freed during a capture, say) count as free, as in PyTorch's
    /// checkpoints (restoring waits for those events first); neighbouring free blocks are one
    /// free range.
    pub fn layout(&self) -> Layout {
        let mut segments = Vec::with_capacity(self.segment_index.len());
        for &seg in self.segment_index.values() {
            let s = &self.segments[seg as usize];
            let mut blocks = Vec::new();
            let mut id = s.head;
            while id != NIL {
                let b = &self.blocks[id as usize];
                let allocated = b.state == State::Allocated;
                id = b.next;
                // free neighbours (a quick-cached block beside a free one) are one free range
                if let Some(last) = blocks
                    .last_mut()
                    .filter(|l: &&mut BlockLayout| !l.allocated)
                {
                    if !allocated {
                        last.size += b.size;
                        continue;
                    }
                }
                blocks.push(BlockLayout {
                    addr: b.addr,
                    size: b.size,
                    requested: if allocated { b.requested } else { 0 },
                    allocated,
                });
            }
            segments.push(SegmentLayout {
                addr: s.addr,
                size: s.size,
                blocks,
            });
        }
        Layout { segments }
    }

    /// Addresses handed out through the address API (for PyTorch's live-allocation check).
    pub fn live_addrs(&self) -> Vec<DevPtr> {
        self.live.keys().copied().collect()
    }

    /// Number of blocks handed out through the address API.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Put the pool back to `layout`: free every block handed out now, then hand out the
    /// checkpoint's allocated blocks at their addresses (address API). Every segment of the
    /// checkpoint must still be in the pool, whole (classic segments; segments made since stay,
    /// free). On an error nothing has changed.
    pub fn restore(&mut self, layout: &Layout) -> Result<Restored> {
        for sl in &layout.segments {
            let ok = self
                .segment_index
                .get(&sl.addr)
                .is_some_and(|&s| self.segments[s as usize].size == sl.size);
            let covered = sl.blocks.iter().map(|b| b.size).sum::<u64>() == sl.size
                && sl.blocks.first().is_none_or(|b| b.addr == sl.addr)
                && sl
                    .blocks
                    .windows(2)
                    .all(|w| w[0].addr + w[0].size == w[1].addr);
            if !ok || !covered || sl.blocks.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint segment {:#x} ({} B) is not a segment of this pool",
                    sl.addr, sl.size
                )));
            }
        }
        if !self.deferred.is_empty() {
            return Err(Error::InvalidArgument(
                "cannot restore a checkpoint while a CUDA-graph capture holds freed blocks".into(),
            ));
        }
        if self.policy.page.is_some() {
            return Err(unsupported(
                self.backend.name(),
                "checkpoints of expandable segments",
            ));
        }
        let untracked = self
            .blocks
            .iter()
            .filter(|b| {
                b.state == State::Allocated && b.handout != Handout::Address && b.segment != NIL
            })
            .count();
        if untracked > 0 {
            return Err(Error::InvalidArgument(format!(
                "{untracked} block(s) of this pool were not handed out by address"
            )));
        }
        // 1. everything handed out goes back
        self.sync_pending();
        self.flush_quick();
        let mut freed: Vec<(u64, u32)> = self.live.drain().collect();
        freed.sort_unstable();
        for &(addr, id) in &freed {
            let b = &self.blocks[id as usize];
            let (kind, size, req, stream) = (b.kind, b.size, b.requested, b.stream);
            self.stats.on_free(kind, size, req, false);
            self.shared.on_free(size);
            self.count_live(stream, false);
            self.record(Action::FreeRequested, addr, req, stream);
            self.record(Action::FreeCompleted, addr, req, stream);
            self.free_block(id);
        }
        // 2. each checkpoint segment is one free block now: carve it as saved
        let mut allocated = Vec::new();
        for sl in &layout.segments {
            let seg = self.segment_index[&sl.addr];
            let mut id = self.segments[seg as usize].head;
            debug_assert!(
                self.blocks[id as usize].next == NIL,
                "segment not coalesced"
            );
            self.leave_free(id);
            for (i, bl) in sl.blocks.iter().enumerate() {
                if i + 1 < sl.blocks.len() {
                    self.split_exact(id, bl.size);
                }
                let next = self.blocks[id as usize].next;
                if bl.allocated {
                    let b = &mut self.blocks[id as usize];
                    b.requested = bl.requested.max(1);
                    b.rounded = b.size;
                    b.handout = Handout::Address;
                    let (addr, bsize, kind, req, stream) =
                        (b.addr, b.size, b.kind, b.requested, b.stream);
                    self.live.insert(addr, id);
                    self.stats.on_alloc(kind, bsize, req);
                    self.shared.on_alloc(bsize);
                    self.count_live(stream, true);
                    self.record(Action::Alloc, addr, req, stream);
                    allocated.push((addr, req));
                } else {
                    self.enter_free(id);
                }
                id = next;
            }
        }
        Ok(Restored {
            freed: freed.into_iter().map(|(a, _)| a).collect(),
            allocated,
        })
    }
}
