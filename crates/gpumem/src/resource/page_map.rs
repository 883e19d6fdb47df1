//! Which physical handle backs which pages of reserved address space, and which driver calls a
//! map or an unmap needs: the bookkeeping of a page engine, without the calls (the CUDA engine
//! makes them; the simulator counts them).
//!
//! On an H100 the driver's page calls cost per mapping, not per byte: setting access and
//! unmapping cost ~20–45 µs per mapping they cover, creating a handle ~13 µs, whatever its
//! size (`shared/notes/vmm-costs.md`). So a handle spans a run of pages: a map creates one
//! handle per run of pages it needs (at most [`MAX_SPAN`] pages, cut from the run's start), and
//! the pool unmaps only whole handles ([`PageMap::unit_at`] says where one lies). A handle can
//! be mapped only whole, at offset 0: a later map uses a free handle only where it fits.
//!
//! A page that is already mapped costs nothing. So an unmapped handle is not unmapped at
//! once: its address keeps it mapped ("lingers"), and the handle goes where the next map can
//! take it (kept for the stream that moved it, or spare). A later map over that address finds
//! its own handle still mapped there and reuses it with no call at all. A job that moves the
//! same memory back and forth between the same addresses each step (a training step's phases)
//! thus moves it for free after the first step. A lingering mapping is unmapped only when
//! another handle must go where it lies, or when its handle is released (beyond the spare
//! cap, or when the cache is emptied), or when its address range is given back.
//!
//! Lingering pays where memory comes back to its address; where it does not (sizes that vary
//! from step to step), a map over a lingering mapping unmaps it first on the allocating
//! thread. That is rare: moves are paid from a time budget and a job that repeats gets a
//! planned layout. (Until 2026-11-26 an address whose maps found another handle there twice
//! in a row had its lingering mapping unmapped in the background once the handle went live
//! elsewhere; with or without it, every replay of the real traces and the workload families
//! kept the same ratio, and its driver calls and modelled time on the allocating thread
//! were the same within 1%, so it went.)
//!
//! A handle may be mapped at several addresses at once (the driver allows it); only one of
//! them is live (pages of the pool), the others linger and nothing touches them.
//!
//! Safety of reuse: a handle is available to a map only when all work through its earlier
//! addresses has completed (spare) or runs on the mapping stream before the new work (kept for
//! that stream after a move in stream order). A lingering mapping remembers the event after
//! which its own old work is done; unmapping it waits for that event first.

use super::DevPtr;
use crate::error::{Error, Result};
use rustc_hash::{FxHashMap, FxHashSet};

/// Keep the entries of `list` that `valid` accepts, each once, where it was last (the lists
/// are read newest first).
fn prune(list: &mut Vec<Hid>, valid: impl Fn(&Hid) -> bool) {
    let mut seen = FxHashSet::default();
    let mut kept: Vec<Hid> = list
        .iter()
        .rev()
        .filter(|h| valid(h) && seen.insert(**h))
        .copied()
        .collect();
    kept.reverse();
    *list = kept;
}

/// A physical handle (a `CUmemGenericAllocationHandle`, or a number in the simulator).
pub type Hid = u64;
/// An event (a `CUevent` as a number, or a number in the simulator).
pub type Ev = usize;

/// Spare pages kept for reuse: at least this many...
pub const MIN_SPARE_PAGES: usize = 8;
/// ...or this fraction of the live pages (1/200 = 0.5%), whichever is more.
pub const SPARE_DIVISOR: usize = 200;

/// Pages a created handle spans at most (a longer run is cut into handles this long from its
/// first page, not on a fixed grid: a run crossing a grid line would cost a second handle,
/// and its calls, for nothing): 32 pages of 2 MiB are 64 MiB (PyTorch's expandable segments
/// use 20 MiB handles for large blocks). Chosen on the replays of the real traces and the
/// workload families (8, 16, 32, 64 compared, when runs were still cut on a grid: 32 gave the
/// lowest ratios with the fewest calls but for 64's).
pub const MAX_SPAN: u64 = 32;

/// Where a handle that is not live is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Avail {
    /// anyone may map it: no work through it is queued
    Spare,
    /// moved away by this stream: only its next maps may take it until `event` (recorded on
    /// the stream at the move; `None`: the pages were idle) has completed
    Kept { stream: u64, event: Option<Ev> },
}

/// A lingering mapping: its handle is still mapped there.
#[derive(Debug, Clone, Copy)]
struct Linger {
    handle: Hid,
    /// after this event the address's old work is done (`None`: it is)
    event: Option<Ev>,
}

/// A mapping to unmap: a handle lingering at `addr` (its first page) over `pages` pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evict {
    /// the mapping's first page
    pub addr: DevPtr,
    /// its pages
    pub pages: u64,
    /// the event to wait for before unmapping (`None`: none)
    pub event: Option<Ev>,
}

/// The driver work of one map.
#[derive(Debug, Default)]
pub struct MapPlan {
    /// mappings in use again with the handle still mapped there: no call (first page, pages)
    pub reused: Vec<(DevPtr, u64)>,
    /// lingering mappings to unmap before mapping there
    pub evict: Vec<Evict>,
    /// mappings to make, in address order: (first page, pages, a free handle of that many
    /// pages or `None`: create one)
    pub fresh: Vec<(DevPtr, u64, Option<Hid>)>,
    /// the stream the plan is for, and the handles taken from its kept ones
    stream: Option<u64>,
    from_kept: Vec<(Hid, Option<Ev>)>,
}

impl MapPlan {
    /// Pages of handles the plan creates.
    pub fn created_pages(&self) -> u64 {
        self.fresh
            .iter()
            .filter(|f| f.2.is_none())
            .map(|f| f.1)
            .sum()
    }
}

/// A handle to release, once its lingering mappings are unmapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// the handle
    pub handle: Hid,
    /// its pages
    pub pages: u64,
    /// mappings still made of it, each with the event to wait for before unmapping
    pub unmap: Vec<Evict>,
}

/// What [`PageMap::take_all`] hands over at shutdown: mappings (first page, pages) live or
/// lingering, and every handle.
#[derive(Debug, Default)]
pub struct Everything {
    /// mappings to unmap
    pub mappings: Vec<(DevPtr, u64)>,
    /// handles to release
    pub handles: Vec<Hid>,
}

/// The page bookkeeping of one device (see the module docs).
#[derive(Debug)]
pub struct PageMap {
    page: u64,
    /// pages of each handle the map knows (live, lingering or available)
    span: FxHashMap<Hid, u64>,
    /// pages in use: address → handle (every page of a live mapping)
    live: FxHashMap<DevPtr, Hid>,
    /// the same, handle → its first page
    live_at: FxHashMap<Hid, DevPtr>,
    /// lingering mappings, by first page
    linger: FxHashMap<DevPtr, Linger>,
    /// every page of a lingering mapping → that mapping's first page
    cover: FxHashMap<DevPtr, DevPtr>,
    /// handle → the first pages of its lingering mappings
    at: FxHashMap<Hid, Vec<DevPtr>>,
    /// handles that are not live → where they are
    avail: FxHashMap<Hid, Avail>,
    /// spare handles in the order they came (entries whose `avail` no longer says spare are
    /// stale and skipped)
    spare: std::collections::VecDeque<Hid>,
    /// pages of the spare handles
    spare_pages: u64,
    /// per stream, handles kept for it (stale entries skipped, as above)
    kept: FxHashMap<u64, Vec<Hid>>,
    /// per stream and move event, the handles kept until it (stale entries skipped)
    kept_by: FxHashMap<(u64, Option<Ev>), Vec<Hid>>,
    /// events still referenced (by kept handles or lingering mappings) → references
    events: FxHashMap<Ev, u32>,
    /// event → mappings (first pages) that lingered with it (entries that no longer do are
    /// skipped)
    by_event: FxHashMap<Ev, Vec<DevPtr>>,
    /// events no longer referenced, for the engine to recycle
    idle_events: Vec<Ev>,
    /// pages being unmapped outside the lock (a map there must wait)
    unmapping: FxHashSet<DevPtr>,
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
            span: FxHashMap::default(),
            live: FxHashMap::default(),
            live_at: FxHashMap::default(),
            linger: FxHashMap::default(),
            cover: FxHashMap::default(),
            at: FxHashMap::default(),
            avail: FxHashMap::default(),
            spare: std::collections::VecDeque::new(),
            spare_pages: 0,
            kept: FxHashMap::default(),
            kept_by: FxHashMap::default(),
            events: FxHashMap::default(),
            by_event: FxHashMap::default(),
            idle_events: Vec::new(),
            unmapping: FxHashSet::default(),
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
        self.cover.len()
    }

    /// Handles not in use (spare or kept for a stream).
    pub fn idle_handles(&self) -> usize {
        self.avail.len()
    }

    /// Pages of the handles not in use: physical memory beyond the live pages.
    pub fn idle_pages(&self) -> u64 {
        self.avail.keys().map(|&h| self.span_of(h)).sum()
    }

    /// Pages of handle `h`.
    pub fn span_of(&self, h: Hid) -> u64 {
        self.span.get(&h).copied().unwrap_or(1)
    }

    /// The handle of live page `addr`.
    pub fn handle_at(&self, addr: DevPtr) -> Option<Hid> {
        self.live.get(&addr).copied()
    }

    /// The live mapping that page `addr` belongs to: (handle, first page, pages).
    pub fn mapping_at(&self, addr: DevPtr) -> Option<(Hid, DevPtr, u64)> {
        let h = *self.live.get(&addr)?;
        Some((h, *self.live_at.get(&h)?, self.span_of(h)))
    }

    /// Where the handle mapped at live page `addr` lies, `(first page, bytes)`: the smallest
    /// range an unmap around `addr` may cover.
    pub fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        let page = addr / self.page * self.page;
        self.mapping_at(page).map(|(_, a, n)| (a, n * self.page))
    }

    /// A live page in `[addr, addr + bytes)`, if any.
    pub fn live_in(&self, addr: DevPtr, bytes: u64) -> Option<DevPtr> {
        self.live
            .keys()
            .copied()
            .filter(|&p| p >= addr && p < addr + bytes)
            .min()
    }

    /// Every page that maps a handle (live or lingering): what a new peer needs access to.
    pub fn mapped_addresses(&self) -> Vec<DevPtr> {
        self.live.keys().chain(self.cover.keys()).copied().collect()
    }

    /// Whether any page of `[addr, addr + bytes)` is being unmapped outside the lock.
    pub fn unmapping_in(&self, addr: DevPtr, bytes: u64) -> bool {
        !self.unmapping.is_empty() && self.pages(addr, bytes).any(|p| self.unmapping.contains(&p))
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

    /// Whether mappings or handles still refer to `ev` (an event no longer referred to may
    /// have been recycled).
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

    /// Make handle `h` linger at `base` (its pages covered).
    fn add_linger(&mut self, base: DevPtr, h: Hid, event: Option<Ev>) {
        let n = self.span_of(h);
        self.linger.insert(base, Linger { handle: h, event });
        for i in 0..n {
            self.cover.insert(base + i * self.page, base);
        }
        self.at.entry(h).or_default().push(base);
    }

    /// Take the lingering mapping at `base` out of the map (its pages uncovered); with
    /// `unmapping`, its pages are marked as being unmapped. Returns it as an eviction.
    fn remove_linger(&mut self, base: DevPtr, unmapping: bool) -> Option<Evict> {
        let l = self.linger.remove(&base)?;
        let n = self.span_of(l.handle);
        for i in 0..n {
            let p = base + i * self.page;
            self.cover.remove(&p);
            if unmapping {
                self.unmapping.insert(p);
            }
        }
        if let Some(list) = self.at.get_mut(&l.handle) {
            if let Some(i) = list.iter().position(|&a| a == base) {
                list.swap_remove(i);
            }
            if list.is_empty() {
                self.at.remove(&l.handle);
            }
        }
        Some(Evict {
            addr: base,
            pages: n,
            event: l.event,
        })
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
            self.spare_pages -= self.span_of(h);
        }
        Some(a)
    }

    fn keep(&mut self, h: Hid, stream: u64, event: Option<Ev>) {
        self.avail.insert(h, Avail::Kept { stream, event });
        // stale entries (handles taken since) are skipped where the lists are read and dropped
        // when their event settles; a stream whose kept handles are taken again before that
        // (moved back and forth with no event between) drops them here, or its lists would
        // grow with every move
        self.kept.entry(stream).or_default().push(h);
        self.trim_kept(stream);
        let bound = self.list_bound();
        let avail = &self.avail;
        let list = self.kept_by.entry((stream, event)).or_default();
        list.push(h);
        if list.len() > bound {
            prune(list, |h| {
                avail.get(h) == Some(&Avail::Kept { stream, event })
            });
        }
        self.hold(event, 1);
    }

    /// How long a list of kept handles may grow before its stale entries are dropped.
    fn list_bound(&self) -> usize {
        2 * self.avail.len() + 64
    }

    /// Drop the stale entries of `stream`'s list of kept handles once it is past
    /// [`PageMap::list_bound`]; an emptied list goes.
    fn trim_kept(&mut self, stream: u64) {
        let bound = self.list_bound();
        let avail = &self.avail;
        if let Some(list) = self.kept.get_mut(&stream) {
            if list.len() > bound {
                prune(
                    list,
                    |h| matches!(avail.get(h), Some(Avail::Kept { stream: s, .. }) if *s == stream),
                );
            }
            if list.is_empty() {
                self.kept.remove(&stream);
            }
        }
    }

    fn put_spare(&mut self, h: Hid) {
        self.avail.insert(h, Avail::Spare);
        self.spare.push_back(h);
        self.spare_pages += self.span_of(h);
        let spares = self.avail.len();
        if self.spare.len() > 2 * spares + 64 {
            let avail = &self.avail;
            self.spare.retain(|h| avail.get(h) == Some(&Avail::Spare));
            // a handle pushed twice while spare is in the list twice: keep one
            let mut seen = FxHashSet::default();
            self.spare.retain(|&h| seen.insert(h));
        }
    }

    /// The oldest spare handle, taken (the one to release first).
    fn pop_oldest_spare(&mut self) -> Option<Hid> {
        while let Some(h) = self.spare.pop_front() {
            if self.avail.get(&h) == Some(&Avail::Spare) {
                self.avail.remove(&h);
                self.spare_pages -= self.span_of(h);
                return Some(h);
            }
        }
        None
    }

    /// Handles `stream` may map now, largest first: those kept for it before spares, the
    /// newest first among equals (not taken).
    fn usable(&self, stream: Option<u64>) -> Vec<(u64, Hid)> {
        let mut seen = FxHashSet::default();
        let mut out = Vec::new();
        if let Some(s) = stream {
            for &h in self.kept.get(&s).into_iter().flatten().rev() {
                if matches!(self.avail.get(&h), Some(Avail::Kept { stream, .. }) if *stream == s)
                    && seen.insert(h)
                {
                    out.push((self.span_of(h), h));
                }
            }
        }
        for &h in self.spare.iter().rev() {
            if self.avail.get(&h) == Some(&Avail::Spare) && seen.insert(h) {
                out.push((self.span_of(h), h));
            }
        }
        out.sort_by_key(|u| std::cmp::Reverse(u.0));
        out
    }

    fn set_live(&mut self, base: DevPtr, h: Hid) {
        for i in 0..self.span_of(h) {
            self.live.insert(base + i * self.page, h);
        }
        self.live_at.insert(h, base);
    }

    fn unset_live(&mut self, base: DevPtr, h: Hid) {
        for i in 0..self.span_of(h) {
            self.live.remove(&(base + i * self.page));
        }
        self.live_at.remove(&h);
    }

    /// Plan mapping `[addr, addr + bytes)` (whole pages, none live) for work on `stream`:
    /// mappings lingering wholly inside it whose handle this stream may take are live again at
    /// once; the rest get handles kept for the stream or spares where they fit, or new ones,
    /// one per run (cut every [`MAX_SPAN`] pages from its start), after unmapping whatever
    /// lingers there. The caller makes the calls, then [`PageMap::commit`]s (or
    /// [`PageMap::abandon`]s) the plan.
    pub fn plan_map(&mut self, addr: DevPtr, bytes: u64, stream: Option<u64>) -> Result<MapPlan> {
        if let Some(p) = self.pages(addr, bytes).find(|p| self.live.contains_key(p)) {
            return Err(Error::InvalidState(format!(
                "page {p:#x} is already mapped"
            )));
        }
        let page = self.page;
        let end = addr + bytes;
        let n = (bytes / page) as usize;
        let idx = |p: DevPtr| ((p - addr) / page) as usize;
        let mut done = vec![false; n];
        let mut plan = MapPlan {
            stream,
            ..MapPlan::default()
        };
        // 1: mappings lingering wholly inside whose own handle may be taken: no call
        let mut p = addr;
        while p < end {
            let Some(&base) = self.cover.get(&p) else {
                p += page;
                continue;
            };
            let Some(l) = self.linger.get(&base).copied() else {
                p += page;
                continue;
            };
            let span = self.span_of(l.handle);
            let top = base + span * page;
            if base >= addr && top <= end {
                if let Some(a) = self.take_if_usable(l.handle, stream) {
                    self.remove_linger(base, false);
                    self.drop_ref(l.event);
                    if let Avail::Kept { event, .. } = a {
                        plan.from_kept.push((l.handle, event));
                    }
                    self.set_live(base, l.handle);
                    plan.reused.push((base, span));
                    done[idx(base)..idx(top)].fill(true);
                }
            }
            p = top.max(p + page);
        }
        // 2: whatever lingers over the rest is unmapped first
        for (i, _) in done.iter().enumerate().filter(|d| !*d.1) {
            if let Some(&base) = self.cover.get(&(addr + i as u64 * page)) {
                if let Some(e) = self.remove_linger(base, true) {
                    plan.evict.push(e);
                }
            }
        }
        // 3: the rest, run by run, left to right: the largest free handle that fits, else new
        // handles
        let mut free = self.usable(stream);
        let mut i = 0;
        while i < n {
            if done[i] {
                i += 1;
                continue;
            }
            let j = (i..n).find(|&k| done[k]).unwrap_or(n);
            let (mut q, stop) = (i as u64, j as u64);
            while q < stop {
                let p = addr + q * page;
                let left = stop - q;
                let found = loop {
                    let Some(k) = free.iter().position(|&(s, _)| s <= left) else {
                        break None;
                    };
                    let (_, h) = free.remove(k);
                    if let Some(a) = self.take_if_usable(h, stream) {
                        break Some((h, a));
                    }
                };
                match found {
                    Some((h, a)) => {
                        if let Avail::Kept { event, .. } = a {
                            plan.from_kept.push((h, event));
                        }
                        let s = self.span_of(h);
                        plan.fresh.push((p, s, Some(h)));
                        q += s;
                    }
                    None => {
                        // nothing free fits the rest of the run: new handles of up to
                        // MAX_SPAN pages
                        while q < stop {
                            let s = MAX_SPAN.min(stop - q);
                            plan.fresh.push((addr + q * page, s, None));
                            q += s;
                        }
                    }
                }
            }
            i = j;
        }
        Ok(plan)
    }

    /// The evictions of `plan` are done (the engine unmapped them): drop their event
    /// references.
    pub fn evicted(&mut self, plan: &MapPlan) {
        self.unmapped_evictions(&plan.evict);
    }

    /// The fresh mappings of `plan` are made, `created` holding the handles made for those
    /// that had none (in order): they are live. Returns the spares beyond the cap, to release.
    pub fn commit(&mut self, plan: MapPlan, created: &[Hid]) -> Vec<Release> {
        let mut created = created.iter();
        for (p, n, h) in plan.fresh {
            let h = match h {
                Some(h) => h,
                None => match created.next() {
                    Some(&h) => {
                        self.span.insert(h, n);
                        h
                    }
                    None => continue,
                },
            };
            self.set_live(p, h);
        }
        for (_, ev) in plan.from_kept {
            self.drop_ref(ev);
        }
        self.excess()
    }

    /// Undo `plan` after a failed call (the caller unmapped whatever it mapped): every handle
    /// the plan took or `created` goes back (to the stream where it was kept for it, else
    /// spare), reused mappings linger again.
    pub fn abandon(&mut self, plan: MapPlan, created: &[Hid]) {
        let kept: FxHashMap<Hid, Option<Ev>> = plan.from_kept.iter().copied().collect();
        let give_back = |m: &mut Self, h: Hid| match (kept.get(&h), plan.stream) {
            (Some(&ev), Some(s)) => {
                m.keep(h, s, ev);
                // the plan held the handle's reference: it went back with it
                m.drop_ref(ev);
            }
            _ => m.put_spare(h),
        };
        for &(p, _) in &plan.reused {
            if let Some(h) = self.live.get(&p).copied() {
                self.unset_live(p, h);
                self.add_linger(p, h, None);
                give_back(self, h);
            }
        }
        let mut made = created.iter();
        let mut handles = Vec::new();
        for &(_, n, h) in &plan.fresh {
            match h {
                Some(h) => handles.push(h),
                None => {
                    if let Some(&c) = made.next() {
                        self.span.insert(c, n);
                        handles.push(c);
                    }
                }
            }
        }
        for h in handles {
            give_back(self, h);
        }
        // the kept handles' event references went back with them
        self.evicted(&plan);
    }

    /// Take the live mappings of `[addr, addr + bytes)` out of use (whole handles only: a
    /// handle reaching outside the range is an error, and nothing changes); their addresses
    /// linger. With `stream`, their handles are kept for that stream's next maps until `event`
    /// (recorded on it now; `None` if the pages are idle: then until
    /// [`PageMap::finish_move`]) has completed; without, they are spare (idle). Returns the
    /// pages taken and the spares beyond the cap, to release.
    pub fn detach(
        &mut self,
        addr: DevPtr,
        bytes: u64,
        stream: Option<u64>,
        event: Option<Ev>,
    ) -> Result<(u64, Vec<Release>)> {
        let (page, end) = (self.page, addr + bytes);
        let mut found = Vec::new();
        let mut p = addr;
        while p < end {
            let Some((h, base, n)) = self.mapping_at(p) else {
                p += page;
                continue;
            };
            let top = base + n * page;
            if base < addr || top > end {
                return Err(Error::InvalidArgument(format!(
                    "unmapping {addr:#x}+{bytes} would split the physical handle mapped at \
                     {base:#x}+{} (only whole handles unmap)",
                    n * page
                )));
            }
            found.push((base, h));
            p = top;
        }
        let mut n = 0u64;
        for (base, h) in found {
            n += self.span_of(h);
            self.unset_live(base, h);
            self.add_linger(base, h, event);
            if let Some(ev) = event {
                self.by_event.entry(ev).or_default().push(base);
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
        Ok((n, excess))
    }

    /// A move for `stream` (its unmapping, then the maps of one or more runs) is done: what
    /// its unmapping of idle pages left and no map took is spare. Returns the spares beyond the
    /// cap, to release.
    pub fn finish_move(&mut self, stream: u64) -> Vec<Release> {
        self.settle_kept(stream, None);
        self.excess()
    }

    /// Event `event` has completed (`None`: for kept handles of idle pages): the handles kept
    /// for `stream` until then that no map took are spare, and the mappings that lingered with
    /// it are idle. Returns nothing to release (the next map or unmap trims the spares).
    pub fn settle_kept(&mut self, stream: u64, event: Option<Ev>) {
        let want = Avail::Kept { stream, event };
        for h in self.kept_by.remove(&(stream, event)).unwrap_or_default() {
            if self.avail.get(&h) == Some(&want) {
                self.avail.remove(&h);
                self.put_spare(h);
                self.drop_ref(event);
            }
        }
        self.trim_kept(stream);
        if let Some(ev) = event {
            // its lingering mappings are idle now
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

    /// Spare handles beyond the cap, out of the map, each with its lingering mappings (whose
    /// pages are marked as being unmapped: call [`PageMap::released`] when done).
    fn excess(&mut self) -> Vec<Release> {
        let cap = MIN_SPARE_PAGES.max(self.live.len() / SPARE_DIVISOR) as u64;
        let mut out = Vec::new();
        while self.spare_pages > cap {
            let Some(h) = self.pop_oldest_spare() else {
                break;
            };
            out.push(self.release_handle(h));
        }
        out
    }

    fn release_handle(&mut self, h: Hid) -> Release {
        let bases = self.at.get(&h).cloned().unwrap_or_default();
        let unmap = bases
            .into_iter()
            .filter_map(|b| self.remove_linger(b, true))
            .collect();
        self.at.remove(&h);
        let pages = self.span.remove(&h).unwrap_or(1);
        Release {
            handle: h,
            pages,
            unmap,
        }
    }

    /// The event references of released handles' mappings are no longer needed once the
    /// engine has unmapped them.
    pub fn released(&mut self, releases: &[Release]) {
        for r in releases {
            self.unmapped_evictions(&r.unmap);
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
        while let Some(h) = self.pop_oldest_spare() {
            out.push(self.release_handle(h));
        }
        out
    }

    /// Lingering mappings of `[addr, addr + bytes)`, out of the map (marked as being
    /// unmapped), before the range is given back. Their handles stay where they are.
    pub fn take_lingering_in(&mut self, addr: DevPtr, bytes: u64) -> Vec<Evict> {
        let mut found: Vec<DevPtr> = self
            .linger
            .keys()
            .copied()
            .filter(|&p| p >= addr && p < addr + bytes)
            .collect();
        found.sort_unstable();
        found
            .into_iter()
            .filter_map(|b| self.remove_linger(b, true))
            .collect()
    }

    /// Mappings taken out of the map to unmap (evictions from [`PageMap::take_lingering_in`],
    /// a plan's or a release's) are unmapped: their pages are no longer being
    /// unmapped, and their event references go.
    pub fn unmapped_evictions(&mut self, done: &[Evict]) {
        for e in done {
            for i in 0..e.pages {
                self.unmapping.remove(&(e.addr + i * self.page));
            }
            self.drop_ref(e.event);
        }
    }

    /// Everything, for shutting down: every mapping (live, lingering) and every handle.
    pub fn take_all(&mut self) -> Everything {
        let mut mappings: Vec<(DevPtr, u64)> = self
            .live_at
            .iter()
            .map(|(&h, &b)| (b, self.span_of(h)))
            .collect();
        mappings.extend(
            self.linger
                .iter()
                .map(|(&b, l)| (b, self.span_of(l.handle))),
        );
        let mut handles: Vec<Hid> = self.live_at.keys().copied().collect();
        handles.extend(self.avail.keys().copied());
        handles.sort_unstable();
        handles.dedup();
        self.live.clear();
        self.live_at.clear();
        self.linger.clear();
        self.cover.clear();
        self.avail.clear();
        self.at.clear();
        self.span.clear();
        self.spare.clear();
        self.spare_pages = 0;
        self.kept.clear();
        self.kept_by.clear();
        self.idle_events.extend(self.events.drain().map(|(e, _)| e));
        self.by_event.clear();
        Everything { mappings, handles }
    }
}

/// Runs `(first page, pages)` of adjacent mappings among `maps` (`(first page, pages)`, in
/// address order): one set-access call (or unmap call) each.
pub fn runs(maps: impl Iterator<Item = (DevPtr, u64)>, page: u64) -> Vec<(DevPtr, u64)> {
    let mut out: Vec<(DevPtr, u64)> = Vec::new();
    for (a, n) in maps {
        match out.last_mut() {
            Some((s, m)) if *s + *m * page == a => *m += n,
            _ => out.push((a, n)),
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
    /// plan's mappings (reused, evicted, fresh) and handles created.
    fn map(m: &mut PageMap, at: DevPtr, n: u64, stream: u64, next: &mut u64) -> [usize; 4] {
        let plan = m.plan_map(at, n * P, Some(stream)).unwrap();
        let created: Vec<Hid> = plan
            .fresh
            .iter()
            .filter(|f| f.2.is_none())
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
    fn a_run_of_pages_is_one_handle_and_only_whole_handles_unmap() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        // 36 pages from a multiple of MAX_SPAN: a handle of 32 pages and one of 4
        assert_eq!(MAX_SPAN, 32);
        assert_eq!(map(&mut m, A, 36, 1, &mut next), [0, 0, 2, 2]);
        assert_eq!(m.unit_at(A + 3 * P + 5), Some((A, 32 * P)));
        assert_eq!(m.unit_at(A + 33 * P), Some((A + 32 * P, 4 * P)));
        assert!(
            m.detach(A, 4 * P, Some(1), None).is_err(),
            "splits a handle"
        );
        assert_eq!(m.live_pages(), 36, "a refused unmap changes nothing");
        assert_eq!(m.detach(A + 32 * P, 4 * P, Some(1), None).unwrap().0, 4);
        // a run is cut from its own start, wherever that lies
        let c = A + 64 * P + 29 * P;
        assert_eq!(map(&mut m, c, 6, 2, &mut next), [0, 0, 1, 1]);
        assert_eq!(m.unit_at(c + 5 * P), Some((c, 6 * P)));
        let d = c + 6 * P;
        assert_eq!(map(&mut m, d, 40, 2, &mut next), [0, 0, 2, 2]);
        assert_eq!(m.unit_at(d + 31 * P), Some((d, 32 * P)));
        assert_eq!(m.unit_at(d + 32 * P), Some((d + 32 * P, 8 * P)));
    }

    /// Memory moved away and back with no event between (a handle kept for its stream, taken
    /// again by the next map there): the lists of kept handles stay as long as what is kept.
    #[test]
    fn handles_kept_and_taken_again_leave_no_trail() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 4, 1, &mut next);
        for _ in 0..10_000 {
            m.detach(A, 4 * P, Some(1), None).unwrap();
            assert_eq!(
                map(&mut m, A, 4, 1, &mut next),
                [1, 0, 0, 0],
                "its own mapping, back"
            );
        }
        let kept: usize = m.kept.values().map(Vec::len).sum();
        let kept_by: usize = m.kept_by.values().map(Vec::len).sum();
        assert!(kept <= 2 * m.avail.len() + 65, "{kept} entries");
        assert!(kept_by <= 2 * m.avail.len() + 65, "{kept_by} entries");
        assert_eq!(next, 1, "one handle all along");
    }

    #[test]
    fn a_free_handle_is_used_where_it_fits_and_new_ones_fill_the_rest() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 4, 1, &mut next);
        m.detach(A, 4 * P, Some(1), None).unwrap();
        // 2 pages: the kept handle of 4 does not fit
        assert_eq!(map(&mut m, B, 2, 1, &mut next), [0, 0, 1, 1]);
        // 6 pages: the 4 kept, and one new handle of 2
        let c = B + 32 * P;
        assert_eq!(map(&mut m, c, 6, 1, &mut next), [0, 0, 2, 1]);
        assert_eq!(m.unit_at(c), Some((c, 4 * P)));
        assert_eq!(m.unit_at(c + 4 * P), Some((c + 4 * P, 2 * P)));
        assert_eq!(m.idle_pages(), 0);
    }

    #[test]
    fn an_event_held_for_a_settle_is_not_recycled_before_it_is_let_go() {
        // a move in stream order with event 9: the engine's settle job holds it
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 7, &mut next);
        m.detach(A, 2 * P, Some(7), Some(9)).unwrap();
        m.hold_event(9);
        // every mapping and handle lets go of it: the next map takes the kept handle, a map
        // at A evicts the lingering mapping
        map(&mut m, B, 2, 7, &mut next);
        m.finish_move(7);
        assert_eq!(map(&mut m, A, 2, 7, &mut next), [0, 1, 1, 1]);
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
        assert_eq!(map(&mut m, A, 4, 7, &mut next), [0, 0, 1, 1]);
        // A's pages move to B (idle): B takes A's handle, A keeps it mapped
        m.detach(A, 4 * P, Some(7), None).unwrap();
        assert_eq!(map(&mut m, B, 4, 7, &mut next), [0, 0, 1, 0]);
        assert!(m.finish_move(7).is_empty());
        assert_eq!(
            (m.live_pages(), m.lingering_pages(), m.idle_handles()),
            (4, 4, 0)
        );
        // and back, then again: no call at all
        for _ in 0..3 {
            m.detach(B, 4 * P, Some(7), None).unwrap();
            assert_eq!(map(&mut m, A, 4, 7, &mut next), [1, 0, 0, 0]);
            m.finish_move(7);
            m.detach(A, 4 * P, Some(7), None).unwrap();
            assert_eq!(map(&mut m, B, 4, 7, &mut next), [1, 0, 0, 0]);
            m.finish_move(7);
        }
        assert_eq!(next, 1, "no handle created after the first map");
    }

    #[test]
    fn another_streams_busy_memory_is_not_taken_and_its_address_waits_for_its_event() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 1, &mut next);
        // stream 1 moves its busy pages away (event 9): kept for stream 1 only
        m.detach(A, 2 * P, Some(1), Some(9)).unwrap();
        assert_eq!(m.idle_pages(), 2);
        // stream 2 maps elsewhere: a new handle
        assert_eq!(map(&mut m, B, 2, 2, &mut next), [0, 0, 1, 1]);
        // stream 2 maps at A: A's handle is stream 1's: unmap A after event 9, a new handle
        let plan = m.plan_map(A, 2 * P, Some(2)).unwrap();
        assert_eq!(
            plan.evict,
            vec![Evict {
                addr: A,
                pages: 2,
                event: Some(9)
            }]
        );
        assert!(m.unmapping_in(A + P, P));
        m.evicted(&plan);
        m.commit(plan, &[100]);
        // once event 9 completes, stream 1's handle is spare and the event is free again
        m.settle_kept(1, Some(9));
        assert_eq!(m.take_idle_events(), vec![9]);
        assert_eq!(m.idle_pages(), 2);
    }

    #[test]
    fn spares_beyond_the_cap_are_released_with_their_lingering_addresses() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        for i in 0..20 {
            map(&mut m, A + 2 * i * P, 1, 1, &mut next);
        }
        let mut excess = Vec::new();
        for i in 0..20 {
            let (n, e) = m.detach(A + 2 * i * P, P, None, None).unwrap();
            assert_eq!(n, 1);
            excess.extend(e);
        }
        // the cap is 8 pages here: the 12 oldest spares go, each unmapped where it lingers
        assert_eq!(excess.len(), 12);
        assert!(excess.iter().all(|r| r.unmap.len() == 1 && r.pages == 1));
        m.released(&excess);
        assert_eq!((m.idle_handles(), m.lingering_pages()), (8, 8));
        // emptying the cache: the rest
        let rest = m.take_spares();
        assert_eq!(rest.len(), 8);
        m.released(&rest);
        assert_eq!((m.idle_handles(), m.lingering_pages()), (0, 0));
        // a handle larger than the cap goes whole
        map(&mut m, B, 12, 1, &mut next);
        let (_, e) = m.detach(B, 12 * P, None, None).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!((e[0].pages, e[0].unmap[0].pages), (12, 12));
    }

    #[test]
    fn a_failed_map_gives_everything_back() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 2, 1, &mut next);
        m.detach(A, 2 * P, Some(1), None).unwrap();
        let plan = m.plan_map(B, 4 * P, Some(1)).unwrap();
        assert_eq!(
            plan.fresh,
            vec![(B, 2, Some(1)), (B + 2 * P, 2, None)],
            "the kept handle where it fits, a new one for the rest"
        );
        m.abandon(plan, &[50]);
        assert_eq!((m.live_pages(), m.idle_pages()), (0, 4));
        // the stream still gets its own handle back first, and A reuses it in place
        assert_eq!(map(&mut m, A, 2, 1, &mut next), [1, 0, 0, 0]);
        assert!(
            m.plan_map(A, P, Some(1)).is_err(),
            "mapping a live page is an error"
        );
    }

    #[test]
    fn shutting_down_lists_every_mapping_and_handle_once() {
        let mut m = PageMap::new(P);
        let mut next = 0;
        map(&mut m, A, 3, 1, &mut next);
        m.detach(A, 3 * P, Some(1), Some(5)).unwrap();
        map(&mut m, B, 3, 1, &mut next);
        let all = m.take_all();
        assert_eq!(all.mappings.len(), 2);
        assert_eq!(all.handles, vec![1]);
        assert!(m.take_idle_events().contains(&5));
    }
}
