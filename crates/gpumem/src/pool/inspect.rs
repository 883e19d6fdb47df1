//! Inspection: segment and block listings, the largest free block, the out-of-memory report and
//! the invariant checker the property tests use.

use super::*;

impl CachingPool {
    /// Build the out-of-memory report from this pool's view.
    pub fn oom_error(&self, requested: u64, segment_request: u64) -> Error {
        let info = self.backend.mem_info().ok();
        Error::OutOfMemory(Box::new(OomReport {
            requested,
            segment_request,
            device_free: info.map_or(0, |m| m.free),
            device_total: info.map_or(0, |m| m.total),
            reserved: self.stats.reserved(),
            allocated: self.stats.allocated(),
            largest_free_block: self.largest_free_block(),
            limit: self.backend.limit(),
        }))
    }

    /// Where the live block at `addr` lies:
    /// `(block address, block size, segment address, segment size, expandable)`.
    pub fn extent_of(&self, addr: DevPtr) -> Option<(u64, u64, u64, u64, bool)> {
        let id = self.find_allocated(addr)?;
        let b = &self.blocks[id as usize];
        let s = &self.segments[b.segment as usize];
        Some((b.addr, b.size, s.addr, s.size, s.pages.is_some()))
    }

    /// Largest free (cached) block; in expandable segments, the longest free range that is
    /// mapped (so it is served with no driver call).
    pub fn largest_free_block(&self) -> u64 {
        if self.policy.page.is_some() {
            return self.largest_mapped_free();
        }
        let free = self.free.iter().flatten().filter_map(|f| f.largest());
        let quick = self
            .quick
            .iter()
            .map(|&(_, _, id, _)| self.blocks[id as usize].size);
        free.chain(quick).max().unwrap_or(0)
    }

    /// Every segment with its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.segment_index
            .values()
            .map(|&seg| {
                let s = &self.segments[seg as usize];
                let mut blocks: Vec<BlockInfo> = Vec::new();
                let mut id = s.head;
                while id != NIL {
                    let b = &self.blocks[id as usize];
                    let allocated = b.state == State::Allocated;
                    let free = matches!(b.state, State::Free | State::Quick);
                    // free neighbours (a quick-cached block is free, only not merged yet) are
                    // one free block, as a program sees the pool
                    if let Some(last) = blocks.last_mut().filter(|l| free && !l.active) {
                        last.size += b.size;
                        id = b.next;
                        continue;
                    }
                    blocks.push(BlockInfo {
                        addr: b.addr,
                        size: b.size,
                        // a free block keeps the size last requested at its address (as
                        // PyTorch's snapshots report it)
                        requested: b.requested.min(b.size),
                        active: allocated || b.state == State::Pending,
                        allocated,
                    });
                    id = b.next;
                }
                let page = self.policy.page.unwrap_or(MIN_BLOCK);
                let mapped = match &s.pages {
                    None => vec![(s.addr, s.size)],
                    Some(p) => p
                        .runs(0, s.size / page, true)
                        .into_iter()
                        .map(|(f, n)| (s.addr + f * page, n * page))
                        .collect(),
                };
                SegmentInfo {
                    addr: s.addr,
                    size: s.size,
                    stream: s.stream,
                    kind: s.kind,
                    expandable: s.pages.is_some(),
                    planned: s.planned,
                    mapped,
                    blocks,
                }
            })
            .collect()
    }

    /// Check every structural invariant; returns a description of the first violation.
    /// Used by the property tests after every step.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut want = Stats::default();
        let mut free_keys = BTreeSet::new();
        let mut live = 0usize;
        for &seg in self.segment_index.values() {
            let s = &self.segments[seg as usize];
            want.segment.add_current(s.kind, 1);
            let page = self.policy.page.unwrap_or(MIN_BLOCK);
            match &s.pages {
                None => want.reserved_bytes.add_current(s.kind, s.size),
                Some(p) => {
                    let count: u64 = p.bits.iter().map(|w| w.count_ones() as u64).sum();
                    if count != p.mapped {
                        return Err(format!("segment {:#x}: mapped page count is off", s.addr));
                    }
                    want.reserved_bytes.add_current(s.kind, p.mapped * page);
                }
            }
            let (mut id, mut cursor, mut prev) = (s.head, s.addr, NIL);
            let mut prev_free = false;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.addr != cursor {
                    return Err(format!(
                        "gap or overlap at {:#x} in segment {:#x}",
                        b.addr, s.addr
                    ));
                }
                if b.prev != prev || b.segment != seg || b.stream != s.stream {
                    return Err(format!("bad links of block {:#x}", b.addr));
                }
                if b.addr % MAX_ALIGN as u64 != 0 || b.size % MIN_BLOCK != 0 {
                    return Err(format!("misaligned block {:#x}+{}", b.addr, b.size));
                }
                let split = b.prev != NIL || b.next != NIL;
                if let (Some(p), false) = (&s.pages, b.state == State::Free) {
                    let (lo, hi) = (b.addr - s.addr, b.addr + b.size - s.addr);
                    if !p.runs(lo / page, hi.div_ceil(page), false).is_empty() {
                        return Err(format!("block {:#x} in use on unmapped pages", b.addr));
                    }
                }
                match b.state {
                    State::Free => {
                        // (a planned region's free blocks join only when a request
                        // needs their bytes together)
                        if prev_free && !s.planned {
                            return Err(format!("uncoalesced free neighbours at {:#x}", b.addr));
                        }
                        // (a planned region's free blocks are its plan's, not the free sets':
                        // `plan_check` below asserts that its plan's page index matches the
                        // region's blocks)
                        if !s.planned {
                            free_keys.insert(self.free_key(id));
                        }
                    }
                    State::Allocated => {
                        live += 1;
                        if b.handout == Handout::Address && self.live.get(&b.addr) != Some(&id) {
                            return Err(format!("allocated block {:#x} not in live map", b.addr));
                        }
                        want.allocation.add_current(b.kind, 1);
                        want.allocated_bytes.add_current(b.kind, b.size);
                        want.requested_bytes.add_current(b.kind, b.requested);
                        want.active.add_current(b.kind, 1);
                        want.active_bytes.add_current(b.kind, b.size);
                    }
                    State::Pending => {
                        want.active.add_current(b.kind, 1);
                        want.active_bytes.add_current(b.kind, b.size);
                    }
                    State::Quick => {}
                    State::Dead => return Err(format!("retired block {:#x} linked in", b.addr)),
                }
                if matches!(b.state, State::Free | State::Quick) && split {
                    want.inactive_split.add_current(b.kind, 1);
                    want.inactive_split_bytes.add_current(b.kind, b.size);
                }
                prev_free = b.state == State::Free;
                cursor += b.size;
                prev = id;
                id = b.next;
            }
            if cursor != s.addr + s.size {
                return Err(format!("blocks do not cover segment {:#x}", s.addr));
            }
        }
        let mut have = BTreeSet::new();
        for (slot, pair) in self.free.iter().enumerate() {
            for (k, index) in pair.iter().enumerate() {
                for (size, addr, id) in index.iter() {
                    let b = &self.blocks[id as usize];
                    if b.kind as usize != k {
                        return Err(format!("block {addr:#x} indexed in the wrong pool"));
                    }
                    have.insert((self.streams[slot].0, size, addr, id));
                }
            }
        }
        if have != free_keys {
            return Err("free sets disagree with free blocks".into());
        }
        for (&id, &user) in &self.lent {
            let b = &self.blocks[id as usize];
            if b.state != State::Allocated || b.stream == user {
                return Err(format!("block {:#x} listed as lent to {user:?}", b.addr));
            }
        }
        for (&id, uses) in &self.foreign {
            let b = &self.blocks[id as usize];
            if b.state != State::Free
                || uses.is_empty()
                || uses
                    .iter()
                    .any(|u| u.hi <= b.addr || u.lo >= b.addr + b.size)
            {
                return Err(format!("block {:#x}: stale uses by other streams", b.addr));
            }
        }
        let counted = self.stats.allocation_count();
        if live as u64 != counted || self.live.len() > live {
            return Err(format!(
                "{live} blocks allocated, counted {counted}, {} in the address map",
                self.live.len()
            ));
        }
        let have = self.stats.snapshot();
        let pairs = [
            ("allocation", &want.allocation, &have.allocation),
            ("segment", &want.segment, &have.segment),
            ("active", &want.active, &have.active),
            ("inactive_split", &want.inactive_split, &have.inactive_split),
            (
                "allocated_bytes",
                &want.allocated_bytes,
                &have.allocated_bytes,
            ),
            ("reserved_bytes", &want.reserved_bytes, &have.reserved_bytes),
            ("active_bytes", &want.active_bytes, &have.active_bytes),
            (
                "inactive_split_bytes",
                &want.inactive_split_bytes,
                &have.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &want.requested_bytes,
                &have.requested_bytes,
            ),
        ];
        for (name, w, h) in pairs {
            for (pool, a, b) in [
                ("all", w.all, h.all),
                ("small", w.small_pool, h.small_pool),
                ("large", w.large_pool, h.large_pool),
            ] {
                if a.current != b.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but the blocks sum to {}",
                        b.current, a.current
                    ));
                }
            }
        }
        self.plan_check()
    }
}
