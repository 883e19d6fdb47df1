//! Whether the job repeats: the pool's sequence of allocations and frees (rounded size and
//! stream) is compared with itself, one period back.
//!
//! A training step, or a serving loop over fixed shapes, makes the same requests in the same
//! order every time. Once the last `P` events equal the `P` before them and the allocated
//! bytes are back where they were `P` events ago (a step frees what it allocated; the layers
//! inside a step repeat too, but each keeps what it allocated, so they never qualify), the job
//! repeats with period `P`. It stops repeating at the first event that differs.
//!
//! Periods are found by content: a hash of the last [`WINDOW`] events; one window in
//! [`SAMPLE`] (by its hash, so the same windows are sampled in every period) is remembered
//! with where it was seen, and seeing it again proposes the distance as a period. Each event
//! costs a hash update and one comparison per candidate (at most [`CANDIDATES`]), and nothing
//! but a count while a plan follows the job (`plan/serve.rs`: its cursor compares each event
//! with the plan, the same comparison; the history is not written then, see [`Repeats::note`]
//! and [`Repeats::skip`]); the memory is bounded ([`MAX_PERIOD`] events of history, a bounded
//! table of windows).

use rustc_hash::FxHashMap;

/// Events hashed together to propose periods.
pub(super) const WINDOW: u64 = 16;
/// One window in this many is remembered (a power of two).
const SAMPLE: u64 = 8;
/// The longest period found, in events (allocations plus frees).
pub(super) const MAX_PERIOD: u64 = 1 << 16;
/// Periods followed at once.
const CANDIDATES: usize = 4;
/// Remembered windows before the table is cleared: 16,384 sampled windows are ~131,000
/// events, two of the longest periods. (It was 65,536: the same periods found on every
/// replay and family, but the larger table's inserts missed the cache; on a 2-core host a job
/// that never repeats paid 44-62 ns more per allocate + free with the detector on than off,
/// 23-34 ns with this one.)
const MAX_SEEN: usize = 1 << 14;
/// Events [`Repeats::recent`] keeps (a power of two, at least [`WINDOW`]): 2 KiB.
pub(super) const RECENT: u64 = 64;
/// Base of the rolling hash (odd).
const BASE: u64 = 0x0000_0100_0000_01b3;
/// BASE^WINDOW (what the print leaving the window weighs in the hash).
const TOP: u64 = {
    let mut t = 1u64;
    let mut k = 0;
    while k < WINDOW {
        t = t.wrapping_mul(BASE);
        k += 1;
    }
    t
};

/// One event as the detector sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) print: u64,
    /// allocated bytes after the event
    pub(super) live: u64,
    /// rounded bytes of the block
    pub(super) size: u64,
    /// for a free, the index of the event that allocated the block (`NONE` if unknown); for
    /// an allocation, `NONE`
    pub(super) born: u64,
}

impl Entry {
    const EMPTY: Entry = Entry {
        print: 0,
        live: 0,
        size: 0,
        born: NONE,
    };
}

/// No event: an allocation's `born`, or a free of a block allocated before the detector knew.
pub(super) const NONE: u64 = u64::MAX;

/// The print of an event: what must match for two events to be the same step position.
#[inline]
pub(super) fn print(free: bool, size: u64, stream: u64) -> u64 {
    (size << 1 | u64::from(free))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
        ^ stream.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
}

/// The rolling hash of `prints` as the detector computes it over its last [`WINDOW`] events.
pub(super) fn window_hash(prints: impl Iterator<Item = u64>) -> u64 {
    prints.fold(0u64, |h, p| h.wrapping_mul(BASE).wrapping_add(p))
}

/// A proposed period and how many events in a row have matched it.
#[derive(Debug, Clone, Copy, Default)]
struct Candidate {
    period: u64,
    run: u64,
}

/// The repeat detector of one pool.
#[derive(Debug, Default)]
pub(super) struct Repeats {
    /// the last events, a ring (power-of-two length, grown up to `MAX_PERIOD + WINDOW`)
    ring: Vec<Entry>,
    /// events seen
    n: u64,
    /// the first event the history holds (see `unwritten`)
    valid_from: u64,
    /// the first event of the stretch not written to `ring` while a plan follows the job
    /// (its last [`RECENT`] events are in `recent`)
    unwritten: Option<u64>,
    /// the last [`RECENT`] events (a ring small enough to stay in the CPU's caches, written
    /// always: the rolling hash's window, and the history where `ring` was not written)
    recent: Vec<Entry>,
    /// rolling hash of the last `WINDOW` prints
    hash: u64,
    seen: FxHashMap<u64, u64>,
    cands: [Candidate; CANDIDATES],
    /// the first of the events counted by [`Repeats::skip`] since the last one noted:
    /// `recent` and the rolling hash do not hold them (until [`Repeats::refill`])
    skipped: Option<u64>,
    /// the confirmed period (0: the job does not repeat now)
    period: u64,
    /// times a period was confirmed
    pub(super) found: u64,
}

impl Repeats {
    /// Whether the job repeats now.
    #[cfg(test)]
    pub(super) fn repeating(&self) -> bool {
        self.period != 0
    }

    /// The confirmed period in events (0: none).
    pub(super) fn period(&self) -> u64 {
        self.period
    }

    /// Forget everything (the cache was emptied, the pool's layout starts over).
    pub(super) fn reset(&mut self) {
        let found = self.found;
        *self = Self {
            found,
            ..Self::default()
        };
    }

    /// An allocation (`born`: [`NONE`]) or a free (`born`: the index [`Repeats::note`]
    /// returned for the block's allocation) of a block of `size` rounded bytes on `stream`,
    /// with `live` allocated bytes after it. Returns the event's index. `idle`: a plan has
    /// followed the job for a whole period and follows it still (its cursor compares every
    /// event with the plan, which is what the detector would compare it with): the event
    /// goes to the small ring of the last [`RECENT`] events and moves the rolling hash on
    /// (finding the job in a plan again needs it), not to the history; the detector starts
    /// afresh when the plan loses the job, with those last events as its history (see
    /// `write_back`). Writing the history all along touched a new cache line every other
    /// event of a period longer than the caches, and pushed the plan's own tables out: on
    /// `random_256_live` (cachegrind, a 2 MiB last-level cache) 0.79 last-level misses per
    /// allocate + free, against 0.05 now. Once the plan has been followed so (`quiet`), the
    /// pool only counts its events ([`Repeats::skip`]).
    #[inline(always)]
    pub(super) fn note(&mut self, born: u64, size: u64, stream: u64, live: u64, idle: bool) -> u64 {
        let print = print(born != NONE, size, stream);
        let n = self.n;
        self.push(
            Entry {
                print,
                live,
                size,
                born,
            },
            idle,
        );
        n
    }

    /// Whether an event noted with `idle` now takes the short way: a plan has followed the
    /// job since before the last event, and the history is not being written (see
    /// [`Repeats::note`]).
    #[inline(always)]
    pub(super) fn quiet(&self) -> bool {
        self.unwritten.is_some()
    }

    /// An event of a quiet stretch ([`Repeats::quiet`]) counted, and nothing else: returns
    /// its index. A plan follows the job and compares every event with its own, so the
    /// detector learns nothing from it until the stretch ends; then the plan gives the
    /// stretch's last [`RECENT`] events back ([`Repeats::refill`]), as `note` would have
    /// left them (a new phase that begins as the old one's steps is found as soon). Noting
    /// them as they came cost a planned allocate + free about 100 of its 670 instructions
    /// on the simulated device. Where the plan cannot give them back, the detector starts
    /// afresh from the next event (no history, the rolling hash filled again over the next
    /// [`WINDOW`] events).
    #[inline(always)]
    pub(super) fn skip(&mut self) -> u64 {
        let n = self.n;
        self.skipped.get_or_insert(n);
        self.n = n + 1;
        n
    }

    /// The first event counted by [`Repeats::skip`] and not given back yet, if any.
    pub(super) fn skipped_from(&self) -> Option<u64> {
        self.skipped
    }

    /// The last `entries.len()` events, all counted by [`Repeats::skip`] (at most
    /// [`RECENT`], and every such event if fewer), as they were: into `recent`, and the
    /// rolling hash over the last [`WINDOW`] events computed from it.
    pub(super) fn refill(&mut self, entries: &[Entry]) {
        let (n, m) = (self.n, entries.len() as u64);
        let Some(from) = self.skipped else {
            return;
        };
        debug_assert!(
            m <= RECENT && (m == RECENT || m == n - from),
            "{m} of {}",
            n - from
        );
        if self.recent.is_empty() {
            self.recent = vec![Entry::EMPTY; RECENT as usize];
        }
        for (k, e) in (n - m..n).zip(entries) {
            self.recent[(k % RECENT) as usize] = *e;
        }
        self.hash = window_hash(
            (n.saturating_sub(WINDOW)..n).map(|k| self.recent[(k % RECENT) as usize].print),
        );
        self.skipped = None;
    }

    /// The last events and the rolling hash forgotten: where a quiet stretch is not given
    /// back, the detector starts afresh (see [`Repeats::skip`]); debug builds' shadow
    /// detector forgets with it.
    pub(super) fn forget_recent(&mut self) {
        self.recent.fill(Entry::EMPTY);
        self.hash = 0;
    }

    /// Whether the last events and the rolling hash are those of `other` (a detector that
    /// noted every event: see the pool's tests of `plan_unskip`).
    #[cfg(debug_assertions)]
    pub(super) fn same_recent(&self, other: &Repeats) -> bool {
        self.n == other.n && self.hash == other.hash && self.recent == other.recent
    }

    /// Events seen so far (the index the next one gets).
    pub(super) fn events(&self) -> u64 {
        self.n
    }

    /// The rolling hash of the last [`WINDOW`] events (see [`window_hash`]).
    #[inline]
    pub(super) fn hash(&self) -> u64 {
        self.hash
    }

    /// The last `period` events, oldest first, if the detector still holds them.
    pub(super) fn last(&self, period: u64) -> Option<Vec<Entry>> {
        (period <= self.n
            && period <= self.ring.len() as u64
            && self.unwritten.is_none()
            && self.n - period >= self.valid_from)
            .then(|| (self.n - period..self.n).map(|i| self.at(i)).collect())
    }

    fn at(&self, i: u64) -> Entry {
        self.ring[(i as usize) & (self.ring.len() - 1)]
    }

    /// The entry `back` events before event `i` (not yet stored), if the history holds it.
    #[inline]
    fn back(&self, i: u64, back: u64) -> Option<Entry> {
        (back <= i && back < self.ring.len() as u64 && i - back >= self.valid_from)
            .then(|| self.at(i - back))
    }

    #[inline(always)]
    fn push(&mut self, e: Entry, idle: bool) {
        if idle && self.unwritten.is_some() && self.skipped.is_none() {
            // (the common case while a plan follows the job: inline)
            self.roll(self.n, e);
            self.n += 1;
            return;
        }
        self.push_slow(e, idle);
    }

    fn push_slow(&mut self, e: Entry, idle: bool) {
        let n = self.n;
        if self.skipped.take().is_some() {
            // (after a quiet stretch not given back: the last events are not known, see
            // `skip`)
            self.forget_recent();
            self.unwritten = Some(n);
            self.valid_from = n;
        }
        if idle {
            // (no comparison a period back, no history written: see `note`)
            if self.unwritten.is_none() {
                self.unwritten = Some(n);
                self.period = 0;
                self.cands = Default::default();
            }
            self.roll(n, e);
            self.n += 1;
            return;
        }
        if n as usize >= self.ring.len() && self.ring.len() < (MAX_PERIOD + WINDOW) as usize {
            self.grow();
        }
        if let Some(from) = self.unwritten {
            self.write_back(from);
        }
        // events in a row that match a period back
        if self.period != 0 {
            if self.at(n - self.period).print != e.print {
                self.period = 0;
                self.cands = Default::default();
            }
        } else {
            for k in 0..CANDIDATES {
                let c = self.cands[k];
                if c.period == 0 {
                    continue;
                }
                match self.back(n, c.period) {
                    Some(b) if b.print == e.print => {
                        self.cands[k].run += 1;
                        // a whole period matched, and it left the allocated bytes as they were
                        if c.run + 1 >= c.period && b.live == e.live {
                            self.period = c.period;
                        }
                    }
                    _ => self.cands[k] = Candidate::default(),
                }
            }
            if self.period != 0 {
                self.found += 1;
                self.cands = Default::default();
            }
        }
        self.roll(n, e);
        let len = self.ring.len();
        self.ring[(n as usize) & (len - 1)] = e;
        self.n += 1;
        if self.period == 0 && self.n >= WINDOW && self.hash & (SAMPLE - 1) == 0 {
            self.propose();
        }
    }

    /// Event `n`, `e`: into `recent`, and the rolling hash of the last [`WINDOW`] prints on.
    #[inline(always)]
    fn roll(&mut self, n: u64, e: Entry) {
        if self.recent.is_empty() {
            self.recent = vec![Entry::EMPTY; RECENT as usize];
        }
        let at = |i: u64| (i % RECENT) as usize;
        self.hash = self.hash.wrapping_mul(BASE).wrapping_add(e.print);
        if n >= WINDOW {
            let old = self.recent[at(n - WINDOW)].print;
            self.hash = self.hash.wrapping_sub(old.wrapping_mul(TOP));
        }
        // (field by field: an `Entry` built in registers and stored whole went through the
        // stack, its 8-byte stores read back at once by 16-byte loads, which stall: store
        // forwarding fails; nearly half of `note_large_event`'s time on a planned step)
        let r = &mut self.recent[at(n)];
        r.print = e.print;
        r.live = e.live;
        r.size = e.size;
        r.born = e.born;
    }

    /// The first event since a plan followed the job: the history gets the last [`RECENT`]
    /// events of that stretch back from `recent` (a new phase whose steps begin as the old
    /// one's, which the plan followed into its first step, is found as soon as it would
    /// have been with the history written all along); what is older is lost.
    #[cold]
    fn write_back(&mut self, unwritten: u64) {
        let (n, len) = (self.n, self.ring.len() as u64);
        let from = unwritten.max(n.saturating_sub(RECENT.min(len)));
        for i in from..n {
            self.ring[(i & (len - 1)) as usize] = self.recent[(i % RECENT) as usize];
        }
        if from > unwritten {
            self.valid_from = from;
        }
        self.unwritten = None;
    }

    /// The window just completed was seen before: its distance is a candidate period.
    #[cold]
    fn propose(&mut self) {
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        let now = self.n;
        let Some(before) = self.seen.insert(self.hash, now) else {
            return;
        };
        let period = now - before;
        if period == 0 || period > MAX_PERIOD || self.cands.iter().any(|c| c.period == period) {
            return;
        }
        // how far back it already matches (a whole period: it repeats from the next event
        // on, if that leaves the allocated bytes as they were)
        let run = (1..=period)
            .take_while(|&k| {
                let (a, b) = (self.back(now, k), self.back(now, k + period));
                matches!((a, b), (Some(a), Some(b)) if a.print == b.print)
            })
            .count() as u64;
        // replace an empty slot, else the candidate with the shortest run
        let slot = self
            .cands
            .iter_mut()
            .min_by_key(|c| if c.period == 0 { 0 } else { c.run + 1 })
            .expect("CANDIDATES > 0");
        *slot = Candidate { period, run };
    }

    #[cold]
    fn grow(&mut self) {
        let old = std::mem::take(&mut self.ring);
        let len = (old.len() * 2).clamp(1024, (MAX_PERIOD + WINDOW).next_power_of_two() as usize);
        let mut ring = vec![Entry::EMPTY; len];
        if !old.is_empty() {
            // keep the last events at their positions modulo the new length
            let keep = (self.n as usize).min(old.len());
            for i in self.n as usize - keep..self.n as usize {
                ring[i & (len - 1)] = old[i & (old.len() - 1)];
            }
        }
        self.ring = ring;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `steps` steps of `step` (size, free) events, returning whether it repeats after
    /// each step.
    fn run(r: &mut Repeats, step: &[(u64, bool)], steps: usize) -> Vec<bool> {
        run_idle(r, step, steps, false)
    }

    /// [`run`], with a plan following the job (`idle`) or not.
    fn run_idle(r: &mut Repeats, step: &[(u64, bool)], steps: usize, idle: bool) -> Vec<bool> {
        let mut live = 0u64;
        let mut out = Vec::new();
        for _ in 0..steps {
            for &(size, free) in step {
                if free {
                    live -= size;
                } else {
                    live += size;
                }
                r.note(if free { 0 } else { NONE }, size, 0, live, idle);
            }
            out.push(r.repeating());
        }
        out
    }

    /// A training-like step: `layers` layers that each keep an activation and a temporary,
    /// then a backward pass that frees them in reverse.
    fn training_step(layers: u64) -> Vec<(u64, bool)> {
        let mut s = Vec::new();
        for l in 0..layers {
            s.push((1000, false));
            s.push((64, false));
            s.push((64, true));
            let _ = l;
        }
        for _ in 0..layers {
            s.push((512, false));
            s.push((512, true));
            s.push((1000, true));
        }
        s
    }

    #[test]
    fn a_repeating_step_is_found_in_its_second_or_third_step_and_layers_are_not_steps() {
        let mut r = Repeats::default();
        let step = training_step(12);
        let seen = run(&mut r, &step, 6);
        assert!(seen[2..].iter().all(|&x| x), "{seen:?}");
        assert_eq!(r.period(), step.len() as u64);
        // (the layers repeat within the forward pass, but each keeps its activation)
    }

    #[test]
    fn while_a_plan_follows_the_job_only_the_hash_moves_and_it_is_found_again_after() {
        let (mut a, mut b) = (Repeats::default(), Repeats::default());
        let step = training_step(6);
        run(&mut a, &step, 3);
        run(&mut b, &step, 3);
        let found = a.found;
        // a plan follows the job: no period is kept, none is found, the rolling hash (which
        // finding the job in a plan needs) is what it would be, and no history is written
        assert!(run_idle(&mut a, &step, 4, true).iter().all(|&x| !x));
        run(&mut b, &step, 4);
        assert_eq!(
            (a.found, a.hash(), a.events()),
            (found, b.hash(), b.events())
        );
        assert!(a.last(1).is_none());
        assert_eq!(b.last(step.len() as u64).map(|v| v.len()), Some(step.len()));
        // the plan loses the job: the detector finds the period again
        let seen = run(&mut a, &step, 3);
        assert!(seen[1..].iter().all(|&x| x), "{seen:?}");
        assert_eq!((a.found, a.period()), (found + 1, step.len() as u64));
    }

    #[test]
    fn after_a_plan_followed_the_job_its_last_events_come_back_to_the_history() {
        let (mut a, mut b) = (Repeats::default(), Repeats::default());
        let step = training_step(6);
        run(&mut a, &step, 3);
        run(&mut b, &step, 3);
        run_idle(&mut a, &step, 20, true);
        run(&mut b, &step, 20);
        assert!(a.last(1).is_none());
        // a different event: the plan lost the job
        a.note(NONE, 7777, 0, 1, false);
        b.note(NONE, 7777, 0, 1, false);
        let prints = |v: Vec<Entry>| v.iter().map(|e| (e.print, e.live)).collect::<Vec<_>>();
        let back = RECENT + 1;
        assert_eq!(a.last(back).map(prints), b.last(back).map(prints));
        assert!(a.last(back + 1).is_none());
        assert!(b.last(back + 1).is_some());
    }

    #[test]
    fn after_skipped_events_the_detector_starts_afresh_and_finds_the_job_again() {
        let mut r = Repeats::default();
        let step = training_step(6);
        run(&mut r, &step, 3);
        let found = r.found;
        // a plan follows the job: its first event rolls the hash, the rest are only counted
        run_idle(&mut r, &step[..1], 1, true);
        assert!(r.quiet());
        let n = r.events();
        for k in 0..20 * step.len() as u64 {
            assert_eq!(r.skip(), n + k);
        }
        // a different event: the plan lost the job; nothing before it is history
        r.note(NONE, 7777, 0, 1, false);
        assert!(!r.quiet() && !r.repeating());
        assert_eq!(r.last(1).map(|v| v[0].size), Some(7777));
        assert!(r.last(2).is_none());
        let seen = run(&mut r, &step, 4);
        assert!(seen[2..].iter().all(|&x| x), "{seen:?}");
        assert_eq!((r.found, r.period()), (found + 1, step.len() as u64));
    }

    #[test]
    fn a_different_event_ends_the_repeat_and_it_is_found_again() {
        let mut r = Repeats::default();
        let step = training_step(4);
        run(&mut r, &step, 4);
        assert!(r.repeating());
        r.note(NONE, 7777, 0, 1, false);
        assert!(!r.repeating());
        r.note(0, 7777, 0, 0, false);
        let seen = run(&mut r, &step, 4);
        assert!(seen[2..].iter().all(|&x| x), "{seen:?}");
    }

    #[test]
    fn random_sizes_never_repeat_and_memory_stays_bounded() {
        let mut r = Repeats::default();
        let mut x = 12345u64;
        let mut live = 0;
        for _ in 0..2_000_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let size = 512 * (1 + x % 1000);
            live += size;
            r.note(NONE, size, 0, live, false);
            assert!(!r.repeating());
        }
        assert!(r.seen.len() <= MAX_SEEN);
        assert!(r.ring.len() as u64 <= (MAX_PERIOD + WINDOW).next_power_of_two());
    }

    #[test]
    fn one_size_allocated_and_freed_repeats() {
        let mut r = Repeats::default();
        let seen = run(&mut r, &[(4096, false), (4096, true)], 64);
        assert!(seen[40..].iter().all(|&x| x));
    }
}
