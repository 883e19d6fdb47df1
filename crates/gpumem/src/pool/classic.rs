//! Classic segments: whole device allocations (PyTorch's native policy), stolen across streams
//! when wholly free, grown with retries, garbage-collected.

use super::*;

impl CachingPool {
    /// PyTorch's rules for using a block of `bsize` for a request of `size`.
    pub(super) fn fits(&self, size: u64, bsize: u64) -> bool {
        if self.policy.page.is_some() {
            return true; // expandable segments: any free block will do, it costs only pages
        }
        let max = self.policy.max_split;
        if size < max && bsize >= max {
            return false; // never hand an unsplittable block to a small request
        }
        if size >= max && bsize >= size + LARGE_SEGMENT {
            return false; // nor a much larger one to a large request
        }
        true
    }

    /// Take a wholly free segment another stream cached, ordered behind that stream's work.
    pub(super) fn steal(&mut self, stream: Stream, size: u64, kind: PoolKind) -> Option<u32> {
        if !self.policy.cross_stream || self.policy.page.is_some() {
            return None;
        }
        let k = kind as usize;
        let mut best: Option<(u64, Stream, u32)> = None;
        for (slot, &other) in self.streams.iter().enumerate() {
            if other == stream {
                continue;
            }
            let found =
                self.free[slot][k]
                    .at_least(size)
                    .take(STEAL_SCAN)
                    .find(|&(bsize, _, id)| {
                        let b = &self.blocks[id as usize];
                        b.prev == NIL && b.next == NIL && self.fits(size, bsize)
                    });
            if let Some((bsize, _, id)) = found {
                if best.is_none_or(|b| bsize < b.0) {
                    best = Some((bsize, other, id));
                }
            }
        }
        let (_, owner, id) = best?;
        crate::resource::stream_after(&*self.backend, owner, &*self.backend, stream).ok()?;
        self.leave_free(id);
        self.register_stream(stream);
        let b = &mut self.blocks[id as usize];
        b.stream = stream;
        let seg = b.segment as usize;
        self.segments[seg].stream = stream;
        self.stats.num_cross_stream_reuses += 1;
        Some(id)
    }

    pub(super) fn grow_with_retries(
        &mut self,
        stream: Stream,
        size: u64,
        kind: PoolKind,
    ) -> Result<u32> {
        let seg = segment_size(size);
        self.collect_garbage(seg);
        match self.grow(stream, seg, kind) {
            Err(e) if e.is_out_of_memory() => {}
            other => return other,
        }
        self.stats.num_alloc_retries += 1;
        self.release_cached();
        match self.grow(stream, seg, kind) {
            Err(e) if e.is_out_of_memory() => {}
            other => return other,
        }
        if !self.pending.is_empty() {
            self.sync_pending();
            self.release_cached();
            if let Some(id) = self.best_fit(stream, size, kind) {
                return Ok(id);
            }
            match self.grow(stream, seg, kind) {
                Err(e) if e.is_out_of_memory() => {}
                other => return other,
            }
        }
        Err(self.oom_error(size, seg))
    }

    /// Obtain a new segment; returns its single block, not in any free set.
    pub(super) fn grow(&mut self, stream: Stream, seg_size: u64, kind: PoolKind) -> Result<u32> {
        let addr = self
            .backend
            .allocate(stream, seg_size as usize, MAX_ALIGN)?;
        if addr % MAX_ALIGN as u64 != 0 {
            let _ = self.backend.deallocate(addr, seg_size as usize, stream);
            return Err(Error::Unsupported {
                backend: self.backend.name().to_string(),
                what: format!("segment at {addr:#x} is not {MAX_ALIGN}-byte aligned"),
            });
        }
        let id = self.install_segment(addr, seg_size, stream, kind, None);
        self.stats.reserved_bytes.inc(kind, seg_size);
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentAlloc, addr, seg_size, stream);
        self.tell_classic(SegmentChange::Alloc, addr, seg_size, stream);
        let now = self.shared.reserved.fetch_add(seg_size, Ordering::Relaxed) + seg_size;
        self.shared.peak_reserved.fetch_max(now, Ordering::Relaxed);
        Ok(id)
    }

    /// If growing by `incoming` bytes would pass the garbage-collection threshold, release the
    /// least recently used free segments until it would not (or none is left).
    pub(super) fn collect_garbage(&mut self, incoming: u64) {
        let Some(t) = self.policy.gc_threshold else {
            return;
        };
        if self.policy.page.is_some() {
            return; // expandable segments never hold more than the allowance anyway
        }
        let target = ((self.capacity as f64 * t) as u64).saturating_sub(incoming);
        if self.shared.reserved.load(Ordering::Relaxed) <= target {
            return;
        }
        self.flush_quick();
        let mut segs = self.releasable();
        segs.sort_by_key(|&s| self.segments[s as usize].last_used);
        for seg in segs {
            if self.shared.reserved.load(Ordering::Relaxed) <= target {
                break;
            }
            self.release_segment(seg);
        }
    }
}
