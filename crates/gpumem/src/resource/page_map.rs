//! Which physical handle backs which page of reserved address space, and which driver calls a
//! map or an unmap needs: the bookkeeping of a page engine, without the calls (the CUDA engine
//! makes them; the simulator counts them).
//!
//! On an H100 a page move costs ~50 µs of driver time, most of it unmapping (~20 µs per
//! mapping) and setting access (~28 µs per call), while a page that is already mapped costs
//! nothing. So an unmapped page is not unmapped at once: its address keeps its handle mapped
//! ("lingers"), and the handle goes where the next map can take it (kept for the stream that
//! moved it, or spare). A later map at that address finds its own handle still mapped there
//! and reuses it with no call at all. A job that moves the same pages back and forth between
//! the same addresses each step (a training step's phases) thus moves them for free after the
//! first step. A lingering address is unmapped only when a different handle must go there,
//! or when its handle is released (beyond the spare cap, or when the cache is emptied), or when
//! its address range is given back.
//!
//! Lingering pays where memory comes back to its address; where it does not (sizes that vary
//! from step to step), each map at a lingering address unmaps it first on the allocating
//! thread (~20 µs a page). So an address whose maps found another handle there
//! [`CHURNY`] times in a row is "churny": once the handle lingering there goes live elsewhere,
//! the stale mapping is handed to the engine to unmap off the allocating thread
//! ([`PageMap::take_stale`]). The handle is remembered (a ghost): if a later map there finds
//! it free, the guess was wrong, the address takes it back and is no longer churny.
//!
//! A handle may be mapped at several addresses at once (the driver allows it); only one of
//! them is live (a page of the pool), the others linger and nothing touches them.
//!
//! Safety of reuse: a handle is available to a map only when all work through its earlier
//! addresses has completed (spare) or runs on the mapping stream before the new work (kept for
//! that stream after a move in stream order). A lingering address remembers the event after
//! which its own old work is done; unmapping it waits for that event first.

use super::DevPtr;
use crate::error::{Error, Result};
use rustc_hash::FxHashMap;

/// A physical handle (a `CUmemGenericAllocationHandle`, or a number in the simulator).
pub type Hid = u64;
/// An event (a `CUevent` as a number, or a number in the simulator).
pub type Ev = usize;

/// Spare handles kept for reuse: at least this many...
pub const MIN_SPARE_PAGES: usize = 8;
/// ...or this fraction of the live pages (1/200 = 0.5%), whichever is more.
pub const SPARE_DIVISOR: usize = 200;

/// Maps in a row that found another handle lingering at an address before its own lingering
/// mapping is unmapped in the background once its handle is live elsewhere (one such map may
/// be a job's first steps, which settle).
const CHURNY: u32 = 2;

/// Where a handle that is not live is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Avail {
    /// anyone may map it: no work through it is queued
    Spare,
    /// moved away by this stream: only its next maps may take it until `event` (recorded on
    /// the stream at the move; `None`: the pages were idle) has completed
    Kept { stream: u64, event: Option<Ev> },
}

/// A lingering address: its handle is still mapped there.
#[derive(Debug, Clone, Copy)]
struct Linger {
    handle: Hid,
    /// after this event the address's old work is done (`None`: it is)
    event: Option<Ev>,
}

/// A page a map must unmap first: it lingers with a handle this map cannot use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evict {
    /// the page's address
    pub addr: DevPtr,
    /// the event to wait for before unmapping (`None`: none)
    pub event: Option<Ev>,
}

/// The driver work of one map.
#[derive(Debug, Default)]
pub struct MapPlan {
    /// pages made live again with the handle still mapped there: no call
    pub reused: Vec<DevPtr>,
    /// lingering pages to unmap before mapping there
    pub evict: Vec<Evict>,
    /// pages to map: with a kept handle, or `None` (create one)
    pub fresh: Vec<(DevPtr, Option<Hid>)>,
    /// the stream the plan is for, and the handles taken from its kept ones
    stream: Option<u64>,
    from_kept: Vec<(Hid, Option<Ev>)>,
}

/// A handle to release, once its lingering addresses are unmapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// the handle
    pub handle: Hid,
    /// addresses still mapped to it, each with the event to wait for before unmapping
    pub unmap: Vec<Evict>,
}

/// The page bookkeeping of one device (see the module docs).
#[derive(Debug)]
pub struct PageMap {
    page: u64,
    /// pages in use: address → handle
    live: FxHashMap<DevPtr, Hid>,
    /// the same, handle → address
    live_at: FxHashMap<Hid, DevPtr>,
    /// pages not in use whose handle is still mapped there
    linger: FxHashMap<DevPtr, Linger>,
    /// handle → its lingering addresses
    at: FxHashMap<Hid, Vec<DevPtr>>,
    /// handles that are not live → where they are
    avail: FxHashMap<Hid, Avail>,
    /// spare handles in the order they came (entries whose `avail` no longer says spare are
    /// stale and skipped)
    spare: std::collections::VecDeque<Hid>,
    spare_count: usize,
    /// per stream, handles kept for it (stale entries skipped, as above)
    kept: FxHashMap<u64, Vec<Hid>>,
    /// per stream and move event, the handles kept until it (stale entries skipped)
    kept_by: FxHashMap<(u64, Option<Ev>), Vec<Hid>>,
    /// events still referenced (by kept handles or lingering pages) → references
    events: FxHashMap<Ev, u32>,
    /// event → pages that lingered with it (entries whose page no longer does are skipped)
    by_event: FxHashMap<Ev, Vec<DevPtr>>,
    /// events no longer referenced, for the engine to recycle
    idle_events: Vec<Ev>,
    /// pages being unmapped outside the lock (a map there must wait)
    unmapping: FxHashMap<DevPtr, ()>,
    /// addresses whose last map found another handle lingering there and unmapped it: their
    /// memory did not come back to them, so once it is live elsewhere its mapping there is
    /// stale and goes off the allocating thread (see [`PageMap::take_stale`])
    churny: FxHashMap<DevPtr, u32>,
    /// stale pages unmapped in the background → the handle that lingered there: if a map
    /// there finds that handle free to take, the guess was wrong (its memory would have come
    /// back) and the address is no longer churny
    ghost: FxHashMap<DevPtr, Hid>,
    /// stale lingering pages out of the map (marked as being unmapped), for the engine to
    /// unmap in the background
    stale: Vec<Evict>,
}

impl Default for PageMap {
    /// Pages of 2 MiB, the granularity of current GPUs.
    fn default() -> Self {
        Self::new(2 << 20)
    }
}

impl PageMap {
    /// An empty map of pages of `page` bytes.
    pub fn new(page: u64) -> Self {
        Self {
            page,
            live: FxHashMap::default(),
            live_at: FxHashMap::default(),
            linger: FxHashMap::default(),
            at: FxHashMap::default(),
            avail: FxHashMap::default(),
            spare: std::collections::VecDeque::new(),
            spare_count: 0,
            kept: FxHashMap::default(),
            kept_by: FxHashMap::default(),
            events: FxHashMap::default(),
            by_event: FxHashMap::default(),
            idle_events: Vec::new(),
            unmapping: FxHashMap::default(),
            churny: FxHashMap::default(),
            ghost: FxHashMap::default(),
            stale: Vec::new(),
        }
    }

    /// The page size.
    pub fn page(&self) -> u64 {
        self.page
    }

    /// Pages in use.
    pub fn live_pages(&self) -> usize {
        self.live.len()
    }

    /// Pages not in use that still map a handle.
    pub fn lingering_pages(&self) -> usize {
        self.linger.len()
    }

    /// Handles not in use (spare or kept for a stream): physical memory beyond the live pages.
    pub fn idle_handles(&self) -> usize {
        self.avail.len()
    }

    /// The handle of live page `addr`.
    pub fn handle_at(&self, addr: DevPtr) -> Option<Hid> {
        self.live.get(&addr).copied()
    }

    /// A live page in `[addr, addr + bytes)`, if any.
    pub fn live_in(&self, addr: DevPtr, bytes: u64) -> Option<DevPtr> {
        self.live
            .keys()
            .copied()
            .filter(|&p| p >= addr && p < addr + bytes)
            .min()
    }

    /// Every address that maps a handle (live or lingering): what a new peer needs access to.
    pub fn mapped_addresses(&self) -> Vec<DevPtr> {
        self.live
            .keys()
            .chain(self.linger.keys())
            .copied()
            .collect()
    }

    /// Whether any page of `[addr, addr + bytes)` is being unmapped outside the lock.
    pub fn unmapping_in(&self, addr: DevPtr, bytes: u64) -> bool {
        !self.unmapping.is_empty()
            && self
                .pages(addr, bytes)
                .any(|p| self.unmapping.contains_key(&p))
    }

    /// Events no longer referenced, for the engine to reuse or destroy.
    pub fn take_idle_events(&mut self) -> Vec<Ev> {
        std::mem::take(&mut self.idle_events)
    }

    fn pages(&self, addr: DevPtr, bytes: u64) -> impl Iterator<Item = DevPtr> {
        let page = self.page;
        (0..bytes / page).map(move |i| addr + i * page)
    }

    fn hold(&mut self, ev: Option<Ev>, n: u32) {
        if let (Some(ev), true) = (ev, n > 0) {
            *self.events.entry(ev).or_default() += n;
        }
    }

    /// Whether pages or handles still refer to `ev` (an event no longer referred to may have
    /// been recycled).
    pub fn holds(&self, ev: Ev) -> bool {
        self.events.contains_key(&ev)
    }

    /// Hold `ev` for a caller that waits on it outside the map (the engine's settle job): it
    /// is not recycled until [`PageMap::release_event`].
    pub fn hold_event(&mut self, ev: Ev) {
        self.hold(Some(ev), 1);
    }

    /// Let go of an event held with [`PageMap::hold_event`].
    pub fn release_event(&mut self, ev: Ev) {
        self.drop_ref(Some(ev));
    }

    fn drop_ref(&mut self, ev: Option<Ev>) {
        let Some(ev) = ev else { return };
        if let Some(n) = self.events.get_mut(&ev) {
            *n -= 1;
            if *n == 0 {
                self.events.remove(&ev);
                self.by_event.remove(&ev);
                self.idle_events.push(ev);
            }
        }
    }

    fn forget_linger(&mut self, addr: DevPtr, handle: Hid) {
        if let Some(list) = self.at.get_mut(&handle) {
            if let Some(i) = list.iter().position(|&a| a == addr) {
                list.swap_remove(i);
            }
            if list.is_empty() {
                self.at.remove(&handle);
            }
        }
    }

    /// Take `h` out of the available handles if `stream` may map it now; what it was.
    fn take_if_usable(&mut self, h: Hid, stream: Option<u64>) -> Option<Avail> {
        let a = *self.avail.get(&h)?;
        let usable = match a {
            Avail::Spare => true,
            Avail::Kept { stream: s, .. } => Some(s) == stream,
        };
        if !usable {
            return None;
        }
        self.avail.remove(&h);
        if a == Avail::Spare {
            self.spare_count -= 1;
        }
        Some(a)
    }

    fn keep(&mut self, h: Hid, stream: u64, event: Option<Ev>) {
        self.avail.insert(h, Avail::Kept { stream, event });
        self.kept.entry(stream).or_default().push(h);
        self.kept_by.entry((stream, event)).or_default().push(h);
        self.hold(event, 1);
    }

    fn put_spare(&mut self, h: Hid) {
        self.avail.insert(h, Avail::Spare);
        self.spare.push_back(h);
        self.spare_count += 1;
        if self.spare.len() > 2 * self.spare_count + 64 {
            let avail = &self.avail;
            self.spare.retain(|h| avail.get(h) == Some(&Avail::Spare));
            // a handle pushed twice while spare is in the list twice: keep one
            let mut seen = rustc_hash::FxHashSet::default();
            self.spare.retain(|&h| seen.insert(h));
        }
    }

    /// Some handle `stream` may map now: one kept for it, else the newest spare (or, with
    /// `oldest`, the oldest spare: the one to release first).
    fn pop_usable(&mut self, stream: Option<u64>, oldest: bool) -> Option<(Hid, Avail)> {
        if let Some(s) = stream {
            while let Some(list) = self.kept.get_mut(&s) {
                let Some(h) = list.pop() else {
                    self.kept.remove(&s);
                    break;
                };
                if let Some(a @ Avail::Kept { stream, .. }) = self.avail.get(&h).copied() {
                    if stream == s {
                        self.avail.remove(&h);
                        return Some((h, a));
                    }
                }
            }
        }
        while let Some(h) = if oldest {
            self.spare.pop_front()
        } else {
            self.spare.pop_back()
        } {
            if self.avail.get(&h) == Some(&Avail::Spare) {
                self.avail.remove(&h);
                self.spare_count -= 1;
                return Some((h, Avail::Spare));
            }
        }
        None
    }

    fn set_live(&mut self, p: DevPtr, h: Hid) {
        self.live.insert(p, h);
        self.live_at.insert(h, p);
    }

    fn unset_live(&mut self, p: DevPtr) -> Option<Hid> {
        let h = self.live.remove(&p)?;
        self.live_at.remove(&h);
        Some(h)
    }

    /// Plan mapping `[addr, addr + bytes)` (whole pages, none live) for work on `stream`:
    /// lingering pages whose handle this stream may take are live again at once; the rest get
    /// handles kept for the stream, spares, or new ones, after unmapping whatever lingers there
    /// with a handle in use elsewhere. The caller makes the calls, then [`PageMap::commit`]s
    /// (or [`PageMap::abandon`]s) the plan.
    pub fn plan_map(&mut self, addr: DevPtr, bytes: u64, stream: Option<u64>) -> Result<MapPlan> {
        if let Some(p) = self.pages(addr, bytes).find(|p| self.live.contains_key(p)) {
            return Err(Error::InvalidState(format!(
                "page {p:#x} is already mapped"
            )));
        }
        let mut plan = MapPlan {
            stream,
            ..MapPlan::default()
        };
        let pages: Vec<DevPtr> = self.pages(addr, bytes).collect();
        let mut rest = Vec::new();
        // 1: pages whose own handle is still mapped there and usable
        for &p in &pages {
            let Some(l) = self.linger.get(&p).copied() else {
                rest.push(p);
                continue;
            };
            match self.take_if_usable(l.handle, stream) {
                Some(a) => {
                    self.linger.remove(&p);
                    self.forget_linger(p, l.handle);
                    self.drop_ref(l.event);
                    if let Avail::Kept { event, .. } = a {
                        plan.from_kept.push((l.handle, event));
                    }
                    self.set_live(p, l.handle);
                    // its memory came back: a page that repeats
                    self.churny.remove(&p);
                    plan.reused.push(p);
                }
                None => rest.push(p),
            }
        }
        // 2: the rest: unmap what lingers there, then a kept, spare or new handle
        for p in rest {
            if let Some(l) = self.linger.remove(&p) {
                self.forget_linger(p, l.handle);
                self.unmapping.insert(p, ());
                plan.evict.push(Evict {
                    addr: p,
                    event: l.event,
                });
                *self.churny.entry(p).or_default() += 1;
            }
            // the memory a stale unmapping took from here is free again: it would have come
            // back, so this address repeats after all, and gets it
            let ghost = self.ghost.remove(&p).and_then(|h| {
                let a = self.take_if_usable(h, stream)?;
                self.churny.remove(&p);
                Some((h, a))
            });
            let h = ghost
                .or_else(|| self.pop_usable(stream, false))
                .map(|(h, a)| {
                    if let Avail::Kept { event, .. } = a {
                        plan.from_kept.push((h, event));
                    }
                    h
                });
            plan.fresh.push((p, h));
        }
        Ok(plan)
    }

    /// The evictions of `plan` are done (the engine unmapped them): drop their event
    /// references.
    pub fn evicted(&mut self, plan: &MapPlan) {
        for e in &plan.evict {
            self.unmapping.remove(&e.addr);
            self.drop_ref(e.event);
        }
    }

    /// The fresh pages of `plan` are mapped, `created` holding the handles made for the pages
    /// that had none (in order): they are live. Returns the spares beyond the cap, to release.
    pub fn commit(&mut self, plan: MapPlan, created: &[Hid]) -> Vec<Release> {
        let mut created = created.iter();
        for (p, h) in plan.fresh {
            let h = match h.or_else(|| created.next().copied()) {
                Some(h) => h,
                None => continue,
            };
            self.set_live(p, h);
            self.mark_stale(h);
        }
        for &p in &plan.reused {
            if let Some(h) = self.live.get(&p).copied() {
                self.mark_stale(h);
            }
        }
        for (_, ev) in plan.from_kept {
            self.drop_ref(ev);
        }
        self.excess()
    }

    /// Handle `h` is live again: where it still lingers at an address whose memory does not
    /// come back (its last map had to unmap another handle there), that mapping is stale;
    /// the next map there would unmap it on the allocating thread, so it goes now, off it.
    fn mark_stale(&mut self, h: Hid) {
        if self.churny.is_empty() {
            return;
        }
        let Some(addrs) = self.at.get(&h) else { return };
        let stale: Vec<DevPtr> = addrs
            .iter()
            .copied()
            .filter(|a| self.churny.get(a).is_some_and(|&n| n >= CHURNY))
            .collect();
        for a in stale {
            if let Some(l) = self.linger.remove(&a) {
                self.forget_linger(a, l.handle);
                self.unmapping.insert(a, ());
                self.ghost.insert(a, l.handle);
                self.stale.push(Evict {
                    addr: a,
                    event: l.event,
                });
            }
        }
    }

    /// Stale lingering pages (see [`PageMap::commit`]) to unmap off the allocating thread,
    /// each after its event; they are marked as being unmapped (a map there waits), and
    /// [`PageMap::unmapped_evictions`] ends that.
    pub fn take_stale(&mut self) -> Vec<Evict> {
        std::mem::take(&mut self.stale)
    }

    /// Undo `plan` after a failed call: pages `mapped` (fresh ones the caller did map, with
    /// their handles) linger, every handle the plan took or `created` goes back (to the
    /// stream where it was kept for it, else spare), reused pages linger again.
    pub fn abandon(&mut self, plan: MapPlan, mapped: &[(DevPtr, Hid)], created: &[Hid]) {
        let kept: FxHashMap<Hid, Option<Ev>> = plan.from_kept.iter().copied().collect();
        let give_back = |m: &mut Self, h: Hid| match (kept.get(&h), plan.stream) {
            (Some(&ev), Some(s)) => {
                m.keep(h, s, ev);
                // the plan held the handle's reference: it went back with it
                m.drop_ref(ev);
            }
            _ => m.put_spare(h),
        };
        for &p in &plan.reused {
            if let Some(h) = self.unset_live(p) {
                self.linger.insert(
                    p,
                    Linger {
                        handle: h,
                        event: None,
                    },
                );
                self.at.entry(h).or_default().push(p);
                give_back(self, h);
            }
        }
        for &(p, h) in mapped {
            self.linger.insert(
                p,
                Linger {
                    handle: h,
                    event: None,
                },
            );
            self.at.entry(h).or_default().push(p);
        }
        let mut handles: Vec<Hid> = plan.fresh.iter().filter_map(|&(_, h)| h).collect();
        handles.extend_from_slice(created);
        for h in handles {
            give_back(self, h);
        }
        // the kept handles' event references went back with them
        self.evicted(&plan);
    }

    /// Take the live pages of `[addr, addr + bytes)` out of use; their addresses linger. With
    /// `stream`, their handles are kept for that stream's next maps until `event` (recorded on
    /// it now; `None` if the pages are idle: then until [`PageMap::finish_move`]) has
    /// completed; without, they are spare (idle). Returns the pages taken and the spares beyond
    /// the cap, to release.
    pub fn detach(
        &mut self,
        addr: DevPtr,
        bytes: u64,
        stream: Option<u64>,
        event: Option<Ev>,
    ) -> (u64, Vec<Release>) {
        let mut n = 0u64;
        let pages: Vec<DevPtr> = self.pages(addr, bytes).collect();
        for p in pages {
            let Some(h) = self.unset_live(p) else {
                continue;
            };
            n += 1;
            self.linger.insert(p, Linger { handle: h, event });
            self.at.entry(h).or_default().push(p);
            if let Some(ev) = event {
                self.by_event.entry(ev).or_default().push(p);
            }
            match stream {
                Some(s) => self.keep(h, s, event),
                None => self.put_spare(h),
            }
            self.hold(event, 1);
        }
        if n == 0 {
            if let Some(ev) = event {
                if !self.events.contains_key(&ev) {
                    self.idle_events.push(ev);
                }
            }
        }
        let excess = if stream.is_none() {
            self.excess()
        } else {
            Vec::new()
        };
        (n, excess)
    }

    /// A move for `stream` (its unmapping, then the maps of one or more runs) is done: what
    /// its unmapping of idle pages left and no map took is spare. Returns the spares beyond the
    /// cap, to release.
    pub fn finish_move(&mut self, stream: u64) -> Vec<Release> {
        self.settle_kept(stream, None);
        self.excess()
    }

    /// Event `event` has completed (`None`: for kept handles of idle pages): the handles kept
    /// for `stream` until then that no map took are spare, and the pages that lingered with it
    /// are idle. Returns nothing to release (the next map or unmap trims the spares).
    pub fn settle_kept(&mut self, stream: u64, event: Option<Ev>) {
        let want = Avail::Kept { stream, event };
        for h in self.kept_by.remove(&(stream, event)).unwrap_or_default() {
            if self.avail.get(&h) == Some(&want) {
                self.avail.remove(&h);
                self.put_spare(h);
                self.drop_ref(event);
            }
        }
        if let Some(list) = self.kept.get_mut(&stream) {
            // drop stale entries now and then (taken handles stay listed until popped)
            let avail = &self.avail;
            if list.len() > 64 && list.len() > 2 * avail.len() {
                list.retain(
                    |h| matches!(avail.get(h), Some(Avail::Kept { stream: s, .. }) if *s == stream),
                );
            }
            if list.is_empty() {
                self.kept.remove(&stream);
            }
        }
        if let Some(ev) = event {
            // its lingering pages are idle now
            for p in self.by_event.remove(&ev).unwrap_or_default() {
                match self.linger.get_mut(&p) {
                    Some(l) if l.event == Some(ev) => {
                        l.event = None;
                        self.drop_ref(Some(ev));
                    }
                    _ => {}
                }
            }
        }
    }

    /// Spare handles beyond the cap, out of the map, each with its lingering addresses (which
    /// are marked as being unmapped: call [`PageMap::released`] when done).
    fn excess(&mut self) -> Vec<Release> {
        let cap = MIN_SPARE_PAGES.max(self.live.len() / SPARE_DIVISOR);
        let mut out = Vec::new();
        while self.spare_count > cap {
            let Some((h, _)) = self.pop_usable(None, true) else {
                break;
            };
            out.push(self.release_handle(h));
        }
        out
    }

    fn release_handle(&mut self, h: Hid) -> Release {
        let addrs = self.at.remove(&h).unwrap_or_default();
        let mut unmap = Vec::with_capacity(addrs.len());
        for a in addrs {
            if let Some(l) = self.linger.remove(&a) {
                self.unmapping.insert(a, ());
                unmap.push(Evict {
                    addr: a,
                    event: l.event,
                });
            }
        }
        Release { handle: h, unmap }
    }

    /// The event references of released handles' addresses are no longer needed once the
    /// engine has unmapped them.
    pub fn released(&mut self, releases: &[Release]) {
        for r in releases {
            for e in &r.unmap {
                self.unmapping.remove(&e.addr);
                self.drop_ref(e.event);
            }
        }
    }

    /// The (stream, event) of every move in stream order whose kept handles wait for it.
    pub fn pending_moves(&self) -> Vec<(u64, Ev)> {
        let mut out: Vec<(u64, Ev)> = self
            .avail
            .values()
            .filter_map(|a| match *a {
                Avail::Kept {
                    stream,
                    event: Some(ev),
                } => Some((stream, ev)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every spare handle, to release (emptying the cache); handles kept for a stream stay
    /// until their event completes (see [`PageMap::pending_moves`]).
    pub fn take_spares(&mut self) -> Vec<Release> {
        let streams: Vec<u64> = self.kept.keys().copied().collect();
        for s in streams {
            self.settle_kept(s, None);
        }
        let mut out = Vec::new();
        while let Some((h, _)) = self.pop_usable(None, true) {
            out.push(self.release_handle(h));
        }
        out
    }

    /// Lingering pages of `[addr, addr + bytes)`, out of the map (marked as being unmapped),
    /// before the range is given back. Their handles stay where they are.
    pub fn take_lingering_in(&mut self, addr: DevPtr, bytes: u64) -> Vec<Evict> {
        let mut out = Vec::new();
        let mut found: Vec<DevPtr> = self
            .linger
            .keys()
            .copied()
            .filter(|&p| p >= addr && p < addr + bytes)
            .collect();
        found.sort_unstable();
        self.churny.retain(|&p, _| p < addr || p >= addr + bytes);
        self.ghost.retain(|&p, _| p < addr || p >= addr + bytes);
        for p in found {
            if let Some(l) = self.linger.remove(&p) {
                self.forget_linger(p, l.handle);
                self.unmapping.insert(p, ());
                out.push(Evict {
                    addr: p,
                    event: l.event,
                });
            }
        }
        out
    }

    /// Event references of evictions from [`PageMap::take_lingering_in`], once unmapped.
    pub fn unmapped_evictions(&mut self, done: &[Evict]) {
        for e in done {
            self.unmapping.remove(&e.addr);
            self.drop_ref(e.event);
        }
    }

    /// Everything, for shutting down: live pages with handles, lingering pages, every handle.
    pub fn take_all(&mut self) -> (Vec<(DevPtr, Hid)>, Vec<DevPtr>, Vec<Hid>) {
        let live: Vec<(DevPtr, Hid)> = self.live.drain().collect();
        self.live_at.clear();
        let mut linger: Vec<DevPtr> = self.linger.drain().map(|(p, _)| p).collect();
        // stale pages not unmapped yet are mapped still
        linger.extend(self.stale.drain(..).map(|e| e.addr));
        let mut handles: Vec<Hid> = live.iter().map(|&(_, h)| h).collect();
        handles.extend(self.avail.drain().map(|(h, _)| h));
        handles.sort_unstable();
        handles.dedup();
        self.at.clear();
        self.spare.clear();
        self.spare_count = 0;
        self.kept.clear();
        self.kept_by.clear();
        self.idle_events.extend(self.events.drain().map(|(e, _)| e));
        self.by_event.clear();
        self.churny.clear();
        self.ghost.clear();
        (live, linger, handles)
    }
}

/// Runs `(start, pages)` of adjacent pages of `page` bytes among `addrs` (in the order given):
/// one set-access call (or unmap call) each.
pub fn runs(addrs: impl Iterator<Item = DevPtr>, page: u64) -> Vec<(DevPtr, u64)> {
    let mut out: Vec<(DevPtr, u64)> = Vec::new();
    for a in addrs {
        match out.last_mut() {
            Some((s, n)) if *s + *n * page == a => *n += 1,
            _ => out.push((a, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 2 << 20;
    const A: DevPtr = 0x1000_0000;
    const B: DevPtr = 0x2000_0000;

    /// Map `n` pages at `at` for `stream`, creating handles numbered from `next`; returns the
    /// plan's (reused, evicted, fresh, created).
    fn map(m: &mut PageMap, at: DevPtr, n: u64, stream: u64, next: &mut u64) -> [usize; 4] {
        let plan = m.plan_map(at, n * P, Some(stream)).unwrap();
        let created: Vec<Hid> = plan
            .fresh
            .iter()
            .filter(|f| f.1.is_none())
            .map(|_| {
                *next += 1;
                *next
            })
            .collect();
        let out = [
            plan.reused.len(),
            plan.evict.len(),
            plan.fresh.len(),
            created.len(),
        ];
        m.evicted(&plan);
        assert!(m.commit(plan, &created).is_empty());
        out
    }

    #[test]
    fn an_address_whose_memory_never_comes_back_is_unmapped_off_the_allocating_thread() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        let elsewhere = [0x3000_0000, 0x4000_0000, 0x5000_0000];
        map(&mut m, A, 1, 7, &mut next);
        // each step A's memory moves elsewhere, and the next map at A finds it in use there
        // and must unmap it (on the allocating thread: `evict`)
        for (i, &to) in elsewhere.iter().enumerate() {
            m.detach(A, P, Some(7), None);
            map(&mut m, to, 1, 7, &mut next);
            m.finish_move(7);
            if i < 2 {
                assert!(
                    m.take_stale().is_empty(),
                    "not churny yet after {i} evictions"
                );
                assert_eq!(map(&mut m, A, 1, 7, &mut next), [0, 1, 1, 1], "step {i}");
            }
        }
        // after CHURNY evictions in a row, A's mapping went stale when its handle went live
        // at the last address: it is handed to the background, and a map there waits for it
        let stale = m.take_stale();
        assert_eq!(stale.iter().map(|e| e.addr).collect::<Vec<_>>(), vec![A]);
        assert!(m.unmapping_in(A, P));
        m.unmapped_evictions(&stale);
        assert!(!m.unmapping_in(A, P));
        // the next map at A has nothing to unmap
        assert_eq!(map(&mut m, A, 1, 7, &mut next), [0, 0, 1, 1]);
        // a guess that was wrong: A's old memory is free when A is mapped again, so A takes it
        // and repeats from then on (its mapping lingers again)
        m.detach(A, P, Some(7), None);
        map(&mut m, B, 1, 7, &mut next);
        let stale = m.take_stale();
        assert_eq!(stale.len(), 1);
        m.unmapped_evictions(&stale);
        m.detach(B, P, Some(7), None);
        m.finish_move(7);
        assert_eq!(
            map(&mut m, A, 1, 7, &mut next),
            [0, 0, 1, 0],
            "its old handle"
        );
        m.detach(A, P, Some(7), None);
        map(&mut m, B, 1, 7, &mut next);
        assert!(m.take_stale().is_empty(), "A repeats: it lingers");
        m.detach(B, P, Some(7), None);
        assert_eq!(map(&mut m, A, 1, 7, &mut next), [1, 0, 0, 0], "no call");
    }

    #[test]
    fn an_event_held_for_a_settle_is_not_recycled_before_it_is_let_go() {
        // a move in stream order with event 9: the engine's settle job holds it
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 7, &mut next);
        m.detach(A, 2 * P, Some(7), Some(9));
        m.hold_event(9);
        // every page and handle lets go of it: the next map takes the kept handles, a map at
        // A evicts the lingering pages
        map(&mut m, B, 2, 7, &mut next);
        m.finish_move(7);
        assert_eq!(map(&mut m, A, 2, 7, &mut next), [0, 2, 2, 2]);
        assert!(
            m.take_idle_events().is_empty(),
            "recorded again now, the settle job would settle a later move's pages early"
        );
        m.settle_kept(7, Some(9));
        m.release_event(9);
        assert_eq!(m.take_idle_events(), vec![9]);
    }

    #[test]
    fn pages_moved_back_and_forth_reuse_their_memory_with_no_call() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        assert_eq!(map(&mut m, A, 4, 7, &mut next), [0, 0, 4, 4]);
        // A's pages move to B (idle): B takes A's handles, A keeps them mapped
        m.detach(A, 4 * P, Some(7), None);
        assert_eq!(map(&mut m, B, 4, 7, &mut next), [0, 0, 4, 0]);
        assert!(m.finish_move(7).is_empty());
        assert_eq!(
            (m.live_pages(), m.lingering_pages(), m.idle_handles()),
            (4, 4, 0)
        );
        // and back, then again: no call at all
        for _ in 0..3 {
            m.detach(B, 4 * P, Some(7), None);
            assert_eq!(map(&mut m, A, 4, 7, &mut next), [4, 0, 0, 0]);
            m.finish_move(7);
            m.detach(A, 4 * P, Some(7), None);
            assert_eq!(map(&mut m, B, 4, 7, &mut next), [4, 0, 0, 0]);
            m.finish_move(7);
        }
        assert_eq!(next, 4, "no handle created after the first map");
    }

    #[test]
    fn another_streams_busy_memory_is_not_taken_and_its_address_waits_for_its_event() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 1, &mut next);
        // stream 1 moves its busy pages away (event 9): kept for stream 1 only
        m.detach(A, 2 * P, Some(1), Some(9));
        assert_eq!(m.idle_handles(), 2);
        // stream 2 maps elsewhere: new handles
        assert_eq!(map(&mut m, B, 2, 2, &mut next), [0, 0, 2, 2]);
        // stream 2 maps at A: A's handles are stream 1's: unmap A after event 9, new handles
        let plan = m.plan_map(A, 2 * P, Some(2)).unwrap();
        assert_eq!(
            plan.evict,
            vec![
                Evict {
                    addr: A,
                    event: Some(9)
                },
                Evict {
                    addr: A + P,
                    event: Some(9)
                }
            ]
        );
        assert!(m.unmapping_in(A, P));
        m.evicted(&plan);
        let created = [100, 101];
        m.commit(plan, &created);
        // once event 9 completes, stream 1's handles are spare and the event is free again
        m.settle_kept(1, Some(9));
        assert_eq!(m.take_idle_events(), vec![9]);
        assert_eq!(m.idle_handles(), 2);
    }

    #[test]
    fn spares_beyond_the_cap_are_released_with_their_lingering_addresses() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 20, 1, &mut next);
        let (n, excess) = m.detach(A, 20 * P, None, None);
        assert_eq!(n, 20);
        // the cap is 8 pages here: the 12 oldest spares go, each unmapped where it lingers
        assert_eq!(excess.len(), 12);
        assert!(excess.iter().all(|r| r.unmap.len() == 1));
        m.released(&excess);
        assert_eq!((m.idle_handles(), m.lingering_pages()), (8, 8));
        // emptying the cache: the rest
        let rest = m.take_spares();
        assert_eq!(rest.len(), 8);
        m.released(&rest);
        assert_eq!((m.idle_handles(), m.lingering_pages()), (0, 0));
    }

    #[test]
    fn a_failed_map_gives_everything_back() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 1, &mut next);
        m.detach(A, 2 * P, Some(1), None);
        let plan = m.plan_map(B, 4 * P, Some(1)).unwrap();
        assert_eq!(plan.fresh.iter().filter(|f| f.1.is_some()).count(), 2);
        m.abandon(plan, &[], &[]);
        assert_eq!((m.live_pages(), m.idle_handles()), (0, 2));
        // the stream still gets its own handles back first, and A reuses them in place
        assert_eq!(map(&mut m, A, 2, 1, &mut next), [2, 0, 0, 0]);
        assert!(
            m.plan_map(A, P, Some(1)).is_err(),
            "mapping a live page is an error"
        );
    }

    #[test]
    fn shutting_down_lists_every_address_and_handle_once() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 3, 1, &mut next);
        m.detach(A, 3 * P, Some(1), Some(5));
        map(&mut m, B, 3, 1, &mut next);
        let (live, linger, handles) = m.take_all();
        assert_eq!((live.len(), linger.len(), handles.len()), (3, 3, 3));
        assert!(m.take_idle_events().contains(&5));
    }
}
