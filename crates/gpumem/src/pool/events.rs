//! Event bookkeeping: blocks other streams still use (`record_stream`), checkpoints that tell
//! which freed pages are idle.

use super::*;

/// Events recorded on one stream, oldest first, each with the pool tick it covers: once one
/// has completed, the pages freed at or before its tick are idle; before that, another stream
/// that waits for it may take them in its own order (see `reclaim_pages`).
#[derive(Debug)]
pub(super) struct StreamCheckpoints {
    pub(super) stream: Stream,
    /// the highest free tick known idle
    pub(super) safe: u64,
    pub(super) outstanding: std::collections::VecDeque<(Event, u64)>,
}

/// Freed blocks waiting for the events other streams recorded for them (`record_stream`): per
/// stream, its events in the order recorded (the order they complete in), each with its block;
/// per block, how many of its events are outstanding.
#[derive(Debug, Default)]
pub(super) struct Pending {
    queues: Vec<(Stream, std::collections::VecDeque<(Event, u32)>)>,
    waiting: FxHashMap<u32, u32>,
    /// blocks with no event to wait for (recording failed, and their streams were waited for)
    ready: Vec<u32>,
}

impl Pending {
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.ready.is_empty()
    }

    /// Block `id` waits for `events`.
    pub(super) fn push(&mut self, id: u32, events: Vec<(Stream, Event)>) {
        if events.is_empty() {
            self.ready.push(id);
            return;
        }
        self.waiting.insert(id, events.len() as u32);
        for (st, ev) in events {
            match self.queues.iter_mut().find(|q| q.0 == st) {
                Some(q) => q.1.push_back((ev, id)),
                None => self.queues.push((st, [(ev, id)].into())),
            }
        }
    }

    /// One of block `id`'s events completed: whether it was its last.
    fn event_done(&mut self, id: u32) -> bool {
        match self.waiting.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.waiting.remove(&id);
                true
            }
        }
    }

    /// Every event still outstanding.
    pub(super) fn events(&self) -> impl Iterator<Item = Event> + '_ {
        self.queues
            .iter()
            .flat_map(|q| q.1.iter().map(|&(ev, _)| ev))
    }
}

impl StreamCheckpoints {
    /// Outstanding checkpoints one stream may have; past it, a new one replaces the newest
    /// (which it covers too): the latest frees are then covered by fewer, later events.
    const MAX_OUTSTANDING: usize = 128;
}

impl CachingPool {
    fn checkpoints_of(&mut self, stream: Stream) -> &mut StreamCheckpoints {
        let i = match self.checkpoints.iter().position(|c| c.stream == stream) {
            Some(i) => i,
            None => {
                self.checkpoints.push(StreamCheckpoints {
                    stream,
                    safe: 0,
                    outstanding: Default::default(),
                });
                self.checkpoints.len() - 1
            }
        };
        &mut self.checkpoints[i]
    }

    /// The highest free tick known to be idle on `stream` (after polling its checkpoints:
    /// events on one stream complete in order).
    pub(super) fn safe_tick(&mut self, stream: Stream) -> u64 {
        let Some(i) = self.checkpoints.iter().position(|c| c.stream == stream) else {
            return self.device_safe;
        };
        while let Some(&(ev, tick)) = self.checkpoints[i].outstanding.front() {
            if !self.backend.event_done(ev).unwrap_or(false) {
                break;
            }
            self.backend.destroy_event(ev);
            let c = &mut self.checkpoints[i];
            c.outstanding.pop_front();
            c.safe = c.safe.max(tick);
        }
        self.checkpoints[i].safe.max(self.device_safe)
    }

    /// The newest checkpoint on `stream` not known complete: its event and tick.
    pub(super) fn newest_checkpoint(&self, stream: Stream) -> Option<(Event, u64)> {
        self.checkpoints
            .iter()
            .find(|c| c.stream == stream)
            .and_then(|c| c.outstanding.back().copied())
    }

    /// The oldest checkpoint on `stream` not known complete that covers free tick `tick`.
    pub(super) fn covering_checkpoint(&self, stream: Stream, tick: u64) -> Option<(Event, u64)> {
        self.checkpoints
            .iter()
            .find(|c| c.stream == stream)
            .and_then(|c| c.outstanding.iter().find(|&&(_, t)| t >= tick).copied())
    }

    /// The highest free tick known idle on `stream`, without polling its events.
    pub(super) fn known_safe(&self, stream: Stream) -> u64 {
        self.checkpoints
            .iter()
            .find(|c| c.stream == stream)
            .map_or(0, |c| c.safe)
            .max(self.device_safe)
    }

    /// Whether `waiter` can be ordered after `other`'s frees up to `tick` without waiting on
    /// the host: they are idle, `waiter` waited for them already, or a checkpoint covers them
    /// (recorded now if need be: see [`CachingPool::cover`]).
    pub(super) fn can_order_after(&mut self, waiter: Stream, other: Stream, tick: u64) -> bool {
        waiter == other
            || self.safe_tick(other) >= tick
            || self.waited(waiter, other, tick)
            || self.cover(other, tick).is_some()
    }

    /// Whether `waiter` was already made to wait for `other`'s frees up to `tick`.
    pub(super) fn waited(&self, waiter: Stream, other: Stream, tick: u64) -> bool {
        self.cross_waited
            .iter()
            .any(|&(w, o, t)| w == waiter && o == other && t >= tick)
    }

    /// Order the work queued on `waiter` from now on after `other`'s work up to its free tick
    /// `tick`: nothing to do when that is idle or `waiter` waited for it already; otherwise
    /// `waiter` waits on the GPU for the oldest checkpoint covering it (recorded now if need
    /// be: see [`CachingPool::cover`]; a wait recorded while
    /// `waiter` captures a graph would be part of the graph: the host waits for that event
    /// instead), or, with no such checkpoint, the host waits for `other` (the device, if
    /// `other` is gone).
    pub(super) fn order_after(&mut self, waiter: Stream, other: Stream, tick: u64) {
        if waiter == other || self.safe_tick(other) >= tick || self.waited(waiter, other, tick) {
            return;
        }
        if let Some((ev, covers)) = self.cover(other, tick) {
            if !self.capturing(waiter) && self.backend.wait_event(waiter, ev).is_ok() {
                self.stats.num_cross_stream_moves += 1;
                match self
                    .cross_waited
                    .iter_mut()
                    .find(|(w, o, _)| *w == waiter && *o == other)
                {
                    Some(entry) => entry.2 = entry.2.max(covers),
                    None => self.cross_waited.push((waiter, other, covers)),
                }
                return;
            }
            if self.backend.sync_event(ev).is_ok() {
                self.set_safe(other, covers);
                return;
            }
        }
        self.stats.num_unmap_syncs += 1;
        if self.backend.synchronize(other).is_ok() {
            self.set_safe(other, tick);
        } else if self.backend.synchronize_device().is_ok() {
            self.device_safe = self.device_safe.max(tick);
        }
    }

    pub(super) fn set_safe(&mut self, stream: Stream, tick: u64) {
        let c = self.checkpoints_of(stream);
        c.safe = c.safe.max(tick);
    }

    /// Record a checkpoint event on `stream` unless one is outstanding (completed ones are
    /// retired first).
    pub(super) fn checkpoint(&mut self, stream: Stream) {
        self.safe_tick(stream);
        if self.checkpoints_of(stream).outstanding.is_empty() && !self.capturing(stream) {
            self.record_checkpoint(stream);
        }
    }

    /// A checkpoint on `stream` when one of its blocks is freed (`stream` is alive then:
    /// blocks must not outlive their streams; the pool records on another stream only while
    /// it has blocks handed out), so that once the event completes, the pages freed so far are
    /// known idle with no waiting. One outstanding checkpoint at a time is recorded here, with
    /// no driver call when there is one already: the frees after it are covered on demand, when
    /// another stream needs them ([`CachingPool::cover`]), while their stream is known alive.
    /// Where the pool has several streams, the free of a stream's last block handed out (after
    /// which the stream may be destroyed) gets a fresh checkpoint, so that its frees stay
    /// coverable; a stream alone that takes and gives back one block at a time records none.
    /// A free the pool makes on its own later (a block flushed from the quick cache, or whose
    /// events completed) records nothing on a stream with no block handed out: the stream may
    /// be gone by then.
    #[inline]
    pub(super) fn checkpoint_on_free(&mut self, stream: Stream) {
        // the common case at once: a stream alone, whose checkpoint is outstanding, records
        // none (see below: `gave_back_last_of` needs several streams)
        let alone = |c: &StreamCheckpoints| c.stream == stream && !c.outstanding.is_empty();
        if self.streams.len() < 2 && matches!(self.checkpoints.as_slice(), [c] if alone(c)) {
            return;
        }
        self.checkpoint_on_free_slow(stream);
    }

    fn checkpoint_on_free_slow(&mut self, stream: Stream) {
        let handed_out = self.handed_out_on(stream);
        if handed_out == 0 && self.freeing != Some(stream) {
            // a free the pool makes later (a block flushed from the quick cache, or whose
            // events completed) on a stream with nothing handed out: it may be gone
            return;
        }
        let tick = self.tick;
        let last = self.gave_back_last_of(|| handed_out);
        let fresh = match self.newest_checkpoint(stream) {
            None => true,
            Some((_, covers)) => last && covers < tick,
        };
        if fresh && !self.capturing(stream) {
            self.record_checkpoint(stream);
        }
    }

    /// Record a checkpoint on `stream` covering every free so far (the caller knows the
    /// stream is alive and not capturing).
    pub(super) fn record_checkpoint(&mut self, stream: Stream) {
        let tick = self.tick;
        if let Ok(ev) = self.backend.record_event(stream) {
            self.stats.num_checkpoints += 1;
            let c = self.checkpoints_of(stream);
            // at the cap, the new event replaces the newest (it covers all that one did)
            let replaced = (c.outstanding.len() >= StreamCheckpoints::MAX_OUTSTANDING)
                .then(|| c.outstanding.pop_back())
                .flatten();
            c.outstanding.push_back((ev, tick));
            if let Some((old, _)) = replaced {
                self.backend.destroy_event(old);
            }
        }
    }

    /// The oldest checkpoint on `other` not known complete that covers its free tick `tick`;
    /// if none does and `other` is known alive (it has blocks handed out) and not capturing, a
    /// checkpoint recorded there now, covering every free so far. Recorded on demand like this,
    /// a stream's frees cost no driver call until another stream needs their memory.
    pub(super) fn cover(&mut self, other: Stream, tick: u64) -> Option<(Event, u64)> {
        if let Some(c) = self.covering_checkpoint(other, tick) {
            return Some(c);
        }
        if !self.may_record_on(other) {
            return None;
        }
        self.record_checkpoint(other);
        self.covering_checkpoint(other, tick)
    }

    /// Whether a checkpoint may be recorded on `stream` now: it has blocks handed out (so it is
    /// alive) and does not capture a graph.
    pub(super) fn may_record_on(&self, stream: Stream) -> bool {
        self.handed_out_on(stream) > 0 && !self.capturing(stream)
    }

    /// Whether `stream` has just given back its last block handed out while the pool has
    /// several streams: it may be destroyed now, so its frees get a fresh checkpoint.
    #[inline]
    pub(super) fn gave_back_last(&self, stream: Stream) -> bool {
        self.gave_back_last_of(|| self.handed_out_on(stream))
    }

    /// [`CachingPool::gave_back_last`] for a stream with `handed_out()` blocks handed out
    /// (counted only where the pool has several streams: a pool of one stream, the common
    /// case, needs no search).
    #[inline]
    fn gave_back_last_of(&self, handed_out: impl FnOnce() -> u32) -> bool {
        self.streams.len() >= 2 && handed_out() == 0
    }

    /// Blocks handed out on `stream`.
    pub(super) fn handed_out_on(&self, stream: Stream) -> u32 {
        self.live_on
            .iter()
            .find(|&&(s, _)| s == stream)
            .map_or(0, |&(_, n)| n)
    }

    /// One more (`up`) or one fewer block handed out on `stream`. (Streams down to none keep
    /// their entry, so that a stream that takes and gives back one block at a time pays no
    /// insertion: the list is pruned of them only as it grows.)
    #[inline(always)]
    pub(super) fn count_live(&mut self, stream: Stream, up: bool) {
        match self.live_on.iter_mut().find(|e| e.0 == stream) {
            Some(e) if up => e.1 += 1,
            Some(e) => {
                debug_assert!(e.1 > 0, "a free on a stream with no block handed out");
                e.1 = e.1.saturating_sub(1);
            }
            None if up => self.add_live_stream(stream),
            None => debug_assert!(false, "a free on a stream with no block handed out"),
        }
    }

    #[cold]
    fn add_live_stream(&mut self, stream: Stream) {
        if self.live_on.len() >= 16 {
            self.live_on.retain(|e| e.1 > 0);
        }
        self.live_on.push((stream, 1));
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
        let lent_to = self.lent.get(&id).copied();
        let b = match self.blocks.get_mut(id as usize) {
            Some(b) if b.addr == addr && b.state == State::Allocated => b,
            _ => return Err(Error::UnknownPointer { ptr: addr }),
        };
        // a lent block is used by the stream it was lent to; its own stream is another user
        let user = lent_to.unwrap_or(b.stream);
        if user != stream {
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
        for (id, uses, nodes) in std::mem::take(&mut self.deferred) {
            if uses.iter().any(|&s| self.capturing(s)) {
                keep.push((id, uses, nodes)); // another capture still runs on one of them
                continue;
            }
            let events = self.record_uses(uses);
            self.pending.push(id, events);
        }
        self.deferred = keep;
    }

    /// Freed block `id`, whose `uses` list other streams that used it, waits for their events
    /// (recorded now, or once a graph capture on one of them has ended) before it is free.
    pub(super) fn wait_for_uses(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        let uses = b.uses.take().map(|u| *u).unwrap_or_default();
        b.state = State::Pending;
        // (asking whether a stream captures is a driver call while any capture runs: once each;
        // none at all, and no allocation, while none runs)
        let capturing: Vec<bool> = if self.shared.captures.load(Ordering::Relaxed) > 0 {
            uses.iter().map(|&s| self.capturing(s)).collect()
        } else {
            Vec::new()
        };
        if capturing.iter().any(|&c| c) {
            // where the block's own stream and every user capture, the nodes the users have
            // reached: once the block's stream depends on them all, the block is free again
            // (PyTorch's graph_capture_record_stream_reuse, always on)
            let own = self.blocks[id as usize].stream;
            let nodes = if capturing.iter().all(|&c| c) && self.capturing(own) {
                uses.iter()
                    .map(|&s| self.backend.capture_frontier(s))
                    .collect::<Option<Vec<Vec<u64>>>>()
                    .map(|v| v.concat())
            } else {
                None
            };
            self.deferred.push((id, uses, nodes));
        } else {
            let events = self.record_uses(uses);
            self.pending.push(id, events);
        }
    }

    /// During a capture, blocks of `stream` freed while other capturing streams used them are
    /// free again once `stream`'s work depends on what those streams had queued at the free
    /// (a reverse walk of the capture's graph, done only while such blocks wait).
    pub(super) fn reclaim_captured(&mut self, stream: Stream) {
        let mut i = 0;
        while i < self.deferred.len() {
            let (id, _, nodes) = &self.deferred[i];
            let ready = self.blocks[*id as usize].stream == stream
                && nodes
                    .as_ref()
                    .is_some_and(|n| self.backend.capture_follows(stream, n));
            if ready {
                let (id, _, _) = self.deferred.swap_remove(i);
                self.stats.num_capture_reclaims += 1;
                self.finish_pending(id);
            } else {
                i += 1;
            }
        }
    }

    /// An event on each stream of `uses` (a stream that cannot get one is waited for now).
    pub(super) fn record_uses(&mut self, uses: Vec<Stream>) -> Vec<(Stream, Event)> {
        let mut events = Vec::with_capacity(uses.len());
        for st in uses {
            match self.backend.record_event(st) {
                Ok(ev) => events.push((st, ev)),
                // without an event, wait for the stream now: correctness over speed
                Err(_) => {
                    let _ = self.backend.synchronize(st);
                }
            }
        }
        events
    }

    /// Free blocks whose recorded events have all completed. Events on one stream complete in
    /// the order they were recorded, so each stream's queue is asked from its oldest event up
    /// to the first that is not done: a call asks at most one event a busy stream (as
    /// PyTorch's allocator does), however many blocks wait.
    pub fn process_events(&mut self) {
        let mut freed = std::mem::take(&mut self.pending.ready);
        for q in 0..self.pending.queues.len() {
            while let Some(&(ev, id)) = self.pending.queues[q].1.front() {
                if !self.backend.event_done(ev).unwrap_or(false) {
                    break;
                }
                self.pending.queues[q].1.pop_front();
                self.backend.destroy_event(ev);
                if self.pending.event_done(id) {
                    freed.push(id);
                }
            }
        }
        self.pending.queues.retain(|q| !q.1.is_empty());
        for id in freed {
            self.finish_pending(id);
        }
    }

    /// Wait on the host for every pending event, then free those blocks.
    pub(super) fn sync_pending(&mut self) {
        self.stats.num_sync_all_streams += 1;
        let pending = std::mem::take(&mut self.pending);
        for (_, queue) in pending.queues {
            for (ev, _) in queue {
                let _ = self.backend.sync_event(ev);
                self.backend.destroy_event(ev);
            }
        }
        for id in pending.ready.into_iter().chain(pending.waiting.into_keys()) {
            self.finish_pending(id);
        }
    }

    pub(super) fn finish_pending(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let (kind, size) = (b.kind, b.size);
        let (addr, req, stream) = (b.addr, b.requested, b.stream);
        self.stats.on_pending_done(kind, size);
        self.record(Action::FreeCompleted, addr, req, stream);
        self.free_block(id);
    }
}
