//! Event bookkeeping: blocks other streams still use (`record_stream`), checkpoints that tell
//! which freed pages are idle.

use super::*;

impl CachingPool {
    /// The highest free tick known to be idle on `stream` (after polling its checkpoint).
    pub(super) fn safe_tick(&mut self, stream: Stream) -> u64 {
        let Some(i) = self.checkpoints.iter().position(|c| c.0 == stream) else {
            return self.device_safe;
        };
        if let (Some(ev), tick) = (self.checkpoints[i].2, self.checkpoints[i].3) {
            if self.backend.event_done(ev).unwrap_or(false) {
                self.backend.destroy_event(ev);
                let c = &mut self.checkpoints[i];
                c.2 = None;
                c.1 = c.1.max(tick);
            }
        }
        self.checkpoints[i].1.max(self.device_safe)
    }

    pub(super) fn set_safe(&mut self, stream: Stream, tick: u64) {
        match self.checkpoints.iter_mut().find(|c| c.0 == stream) {
            Some(c) => c.1 = c.1.max(tick),
            None => self.checkpoints.push((stream, tick, None, 0)),
        }
    }

    /// Record a checkpoint event on `stream` unless one is outstanding (a completed one is
    /// retired first).
    pub(super) fn checkpoint(&mut self, stream: Stream) {
        self.safe_tick(stream);
        self.checkpoint_on_free(stream);
    }

    /// A checkpoint on `stream` unless an incomplete one is outstanding: recorded when a block
    /// of the stream is freed (the stream is alive then: blocks must not outlive their
    /// streams), so that once the event completes, the pages freed so far are known idle with
    /// no waiting.
    pub(super) fn checkpoint_on_free(&mut self, stream: Stream) {
        if self.capturing(stream) {
            return; // an event recorded now would be part of the graph
        }
        let i = match self.checkpoints.iter().position(|c| c.0 == stream) {
            Some(i) => i,
            None => {
                self.checkpoints.push((stream, 0, None, 0));
                self.checkpoints.len() - 1
            }
        };
        if self.checkpoints[i].2.is_some() {
            // with several streams, a completed checkpoint is retired and a fresh one
            // recorded, so that the stream's checkpoint covers its recent frees too (another
            // stream's allocation can move those pages only through it): one event query per
            // free while one is outstanding. With one stream, reclaiming refreshes its own.
            if self.streams.len() < 2 {
                return;
            }
            self.safe_tick(stream);
            if self.checkpoints[i].2.is_some() {
                return;
            }
        }
        if let Ok(ev) = self.backend.record_event(stream) {
            self.checkpoints[i].2 = Some(ev);
            self.checkpoints[i].3 = self.tick;
        }
    }

    /// Record that `stream` uses the live block at `addr` (PyTorch's `record_stream`): when it
    /// is freed, it is reused only after the work queued on `stream` by then has completed.
    pub fn record_stream(&mut self, addr: DevPtr, stream: Stream) -> Result<()> {
        let id = self
            .find_allocated(addr)
            .ok_or(Error::UnknownPointer { ptr: addr })?;
        self.record_stream_id(id, addr, stream)
    }

    /// [`CachingPool::record_stream`] for a block handed out with a token
    /// ([`CachingPool::free_by_id`]'s `id` and `generation`).
    pub fn record_stream_by_id(&mut self, id: u32, generation: u8, stream: Stream) -> Result<()> {
        match self.blocks.get(id as usize) {
            Some(b) if b.generation == generation && b.handout == Handout::Token => {
                let addr = b.addr;
                self.record_stream_id(id, addr, stream)
            }
            _ => Err(Error::InvalidArgument(format!(
                "block {id} is not handed out by token: a stale token"
            ))),
        }
    }

    /// [`CachingPool::record_stream`] for block `id` at `addr`.
    pub fn record_stream_id(&mut self, id: u32, addr: DevPtr, stream: Stream) -> Result<()> {
        let b = match self.blocks.get_mut(id as usize) {
            Some(b) if b.addr == addr && b.state == State::Allocated => b,
            _ => return Err(Error::UnknownPointer { ptr: addr }),
        };
        if b.stream != stream {
            let uses = b.uses.get_or_insert_with(Default::default);
            if !uses.contains(&stream) {
                uses.push(stream);
            }
        }
        Ok(())
    }

    /// True if `stream` is capturing a CUDA graph (asked of the backend only while a capture
    /// is under way on the device).
    #[inline]
    pub(super) fn capturing(&self, stream: Stream) -> bool {
        self.shared.captures.load(Ordering::Relaxed) > 0 && self.backend.is_capturing(stream)
    }

    /// A capture has ended: blocks freed during it while a capturing stream used them get their
    /// events now (recorded on streams that no longer capture, they complete with the work
    /// queued there) and wait for them as any other.
    pub fn end_capture(&mut self) {
        let mut keep = Vec::new();
        for (id, uses) in std::mem::take(&mut self.deferred) {
            if uses.iter().any(|&s| self.capturing(s)) {
                keep.push((id, uses)); // another capture still runs on one of them
                continue;
            }
            let events = self.record_uses(uses);
            self.pending.push((id, events));
        }
        self.deferred = keep;
    }

    /// An event on each stream of `uses` (a stream that cannot get one is waited for now).
    pub(super) fn record_uses(&mut self, uses: Vec<Stream>) -> Vec<Event> {
        let mut events = Vec::with_capacity(uses.len());
        for st in uses {
            match self.backend.record_event(st) {
                Ok(ev) => events.push(ev),
                // without an event, wait for the stream now: correctness over speed
                Err(_) => {
                    let _ = self.backend.synchronize(st);
                }
            }
        }
        events
    }

    /// Free blocks whose recorded events have all completed.
    pub fn process_events(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = self.pending[i]
                .1
                .iter()
                .all(|&e| self.backend.event_done(e).unwrap_or(false));
            if done {
                let (id, events) = self.pending.swap_remove(i);
                self.finish_pending(id, events);
            } else {
                i += 1;
            }
        }
    }

    /// Wait on the host for every pending event, then free those blocks.
    pub(super) fn sync_pending(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for (id, events) in std::mem::take(&mut self.pending) {
            for &e in &events {
                let _ = self.backend.sync_event(e);
            }
            self.finish_pending(id, events);
        }
    }

    pub(super) fn finish_pending(&mut self, id: u32, events: Vec<Event>) {
        for e in events {
            self.backend.destroy_event(e);
        }
        let b = &self.blocks[id as usize];
        let (kind, size) = (b.kind, b.size);
        let (addr, req, stream) = (b.addr, b.requested, b.stream);
        self.stats.on_pending_done(kind, size);
        self.record(Action::FreeCompleted, addr, req, stream);
        self.free_block(id);
    }
}
