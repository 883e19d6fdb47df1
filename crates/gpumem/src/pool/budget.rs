//! The time budget of page work on the allocating thread (expandable segments).
//!
//! Moving a page (unmapping free memory in one place to map it where a block needs it, instead
//! of growing) keeps reserved memory down, but its driver calls run on the allocating thread
//! (about 45 µs a page on an H100 while kernels run) and a job whose layout drifts from step to
//! step pays them on every step. So moves are paid from a budget, by construction:
//!
//! - credit accrues at [`SHARE`] of the time that passes on the backend's clock (wall time on a
//!   GPU; a replay's clock is the trace's time plus its modelled calls), from nothing, up to
//!   [`CAP_NS`];
//! - moves are charged to it (in the dynamic pool and into a plan's region alike), and so are
//!   maps below the high-water mark of reserved bytes (memory a move unmapped, needed again:
//!   with the GPU behind the host, MoE's replay spent 2.9 ms on them on top of its 22.3 ms of
//!   moves, 1.13% of its time, where charging them holds it at 0.81%); growth past the mark
//!   is not: memory the job has never had is mapped whatever it costs (any allocator pays for
//!   it; PyTorch's cudaMalloc too), and a job's first steps, which map everything, would
//!   otherwise leave no credit for the moves of the step that sets its high-water mark
//!   (gptfix on an H100: step 1's growth took ~20 ms, more than the credit holds, and step
//!   2, where AdamW's state first sits beside the activations, could move nothing: 1.057 of
//!   its peak where moves paid from the credit give 1.012);
//! - a move is made while there is credit; with none, it may still be paid from growth's
//!   account, for an allocation that raises no peak of allocated bytes (a demand the job has
//!   met before), as long as moves paid that way took less time than growth past the
//!   high-water mark of reserved bytes did (a move costs about what growing by as much does:
//!   unmapping a handle costs what creating one does). Only growth that raises the mark fills
//!   the account, so it holds at most what mapping the job's peak once took: growth a move
//!   causes below the mark refills nothing;
//! - a move's measured duration is charged to the account that paid it; a credit-paid move
//!   that overdraws the credit stops credit-paid moves: from then on the pool maps and keeps
//!   (as PyTorch's expandable segments do), except while the job warms up (below), as the
//!   credit allows, until the cache is emptied. The first warm-up's overdraft does not count
//!   either way: the stop and the debt are forgiven once, when the detector of repeating steps
//!   (`repeat.rs`) first finds a period, and the credit starts full (the moves of a layout
//!   settling right after do not overdraw it at once, as they did on the H100 with the credit
//!   at zero); after that an overdraft stops credit-paid moves for good, and the pool does not
//!   swing between the two. (The detector runs where planned layouts are on, the default; with
//!   them off the first warm-up's stop stays.) A job whose layout holds with a few moves a
//!   step, cheaper than the credit earned meanwhile, goes on moving within the budget: gptfix
//!   on an H100 (fixed-shape GPT, AdamW), with the stop forgiven (the credit left as it was),
//!   held 10.12 GB for 10.01 GB allocated over 300 steps with 0.7 moves a step (0.25% of its
//!   time), where keeping the stop let it grow to 10.57 GB by step 80. A job that keeps
//!   growing (a KV cache) moves as the credit allows;
//! - the job warms up for [`WINDOW_NS`] after its peak of allocated bytes grows by
//!   [`WARM_GROWTH`] percent or more over its value the last time it did (its first steps, a
//!   longer sequence, a new phase), and after a planned layout first takes its region (the
//!   region's first period maps its pages where the dynamic layout left others: once per
//!   plan; `CachingPool::plan_installs`); after that, the page work of the last [`WINDOW_NS`]
//!   (growth, moves, giving back: as measured) is logged, and a move is made only where that
//!   window has room within [`SHARE`] for it (as long as the longest move so far) and for as
//!   much again as the window's moves took, which a refusal leaves to growth in their place
//!   (the allocation a refused move would have served maps pages all the same, at about the
//!   same cost). So no move takes a window past [`SHARE`], and growth in the place of refused
//!   moves fits beside them; growth the job needs besides is its own (memory it has not had).
//!   A refusal is no stop: the next move may find room. The credit and growth's
//!   account bound moves over long stretches; the window bounds every second of them. Real
//!   MoE on an H200 took 1.62% of a second after its warm-up without the window (steps 11-20,
//!   moves resumed as its peak grew by a few MB); its 40-step trace 2.1-2.5% of the worst
//!   second in replay, 0.65-0.74% with it, at a lower peak (1.064-1.090 against
//!   1.080-1.096: refused moves overdraw nothing, so they do not stop the rest).
//!
//! Over the first T ns, credit-paid moves and the maps below the mark take at most `SHARE *
//! T`, plus [`CAP_NS`] (the credit given at the end of the warm-up), plus two moves (the
//! overdraft that stops them, and the one forgiven then) and the maps of what moves had
//! unmapped when the credit ran out, and growth-paid moves at most what growth past the
//! high-water mark took plus one move: moves take at most `SHARE * T` plus `CAP_NS` plus that
//! growth's time plus three moves (one allocation's pages each). After the warm-up, moves and
//! giving back take no window of [`WINDOW_NS`] past [`SHARE`] (a move longer than any before
//! may pass it by its excess), and leave room in it for growth as long as themselves. Growth
//! past the mark is on top. Moves made because growing would pass the memory budget are not
//! charged: then fitting is the job (`num_pressure_moves` counts them, and their time is in
//! `page_map_ns`).

/// Share of wall time page moves on the allocating thread may take (beyond growth's account).
pub const SHARE: f64 = 0.01;
/// The most credit that can accrue: [`SHARE`] of one second.
pub const CAP_NS: f64 = SHARE * 1e9;
/// A warm-up lasts this long after the job's peak of allocated bytes last grew by
/// [`WARM_GROWTH`] percent; after it, the windows of page work are this long.
pub const WINDOW_NS: u64 = 1_000_000_000;
/// Growth of the peak of allocated bytes, percent, that starts (or prolongs) a warm-up.
pub const WARM_GROWTH: u64 = 1;

/// Whether a peak of `peak` bytes starts (or prolongs) a warm-up, the peak having been `level`
/// the last time one did: it is [`WARM_GROWTH`] percent higher (the job's first bytes too).
pub fn warms_up(peak: u64, level: u64) -> bool {
    peak > 0 && peak as u128 * 100 >= level as u128 * (100 + WARM_GROWTH) as u128
}

/// Credit for page moves, and whether they are stopped.
#[derive(Debug, Clone)]
pub(super) struct MoveBudget {
    /// ns of moves still allowed (negative: overdrawn)
    credit: f64,
    /// clock reading of the last accrual
    last: Option<u64>,
    /// a move overdrew the credit
    stopped: bool,
    /// the highest peak of allocated bytes seen
    peak: u64,
    /// ns charged so far
    pub(super) spent_ns: u64,
    /// the longest single move charged, ns
    pub(super) longest_ns: u64,
    /// ns growth past the high-water mark of reserved bytes took so far: growth's account
    pub(super) growth_ns: u64,
    /// ns of moves paid from it, and whether the move last allowed is
    growth_spent_ns: u64,
    from_growth: bool,
    /// times moves stopped
    pub(super) stops: u64,
    /// the peak of allocated bytes when it last grew by [`WARM_GROWTH`] percent or more, and
    /// the clock reading until which the job warms up since
    level: u64,
    warm_until: u64,
    /// page work after the warm-up within the last [`WINDOW_NS`]: (clock reading at its end,
    /// ns, whether it was a move or giving back), oldest first; its sum, and the moves' sum
    window: std::collections::VecDeque<(u64, u64, bool)>,
    window_ns: u64,
    window_moves_ns: u64,
}

impl Default for MoveBudget {
    fn default() -> Self {
        Self {
            credit: 0.0,
            last: None,
            stopped: false,
            peak: 0,
            spent_ns: 0,
            longest_ns: 0,
            growth_ns: 0,
            growth_spent_ns: 0,
            from_growth: false,
            stops: 0,
            level: 0,
            warm_until: 0,
            window: std::collections::VecDeque::new(),
            window_ns: 0,
            window_moves_ns: 0,
        }
    }
}

impl MoveBudget {
    /// Whether a move may be made now (`now`: the backend's clock; `peak`: the peak of
    /// allocated bytes).
    pub(super) fn may_move(&mut self, now: u64, peak: u64) -> bool {
        self.accrue(now);
        let raised = peak > self.peak;
        if raised {
            self.peak = peak;
        }
        if warms_up(peak, self.level) {
            self.level = peak;
            self.warm_until = now.saturating_add(WINDOW_NS);
        }
        // credit-paid moves, unless stopped (and not warming up)
        let credit = (!self.stopped || self.warm(now)) && self.credit > 0.0;
        // else paid from growth's account, for a demand the job has met before
        self.from_growth = !credit && !raised && self.growth_spent_ns < self.growth_ns;
        let ok = credit || self.from_growth;
        if ok && !self.warm(now) {
            // after the warm-up, within the window: room for the move, and for growth as
            // large as the window's moves (what refusing them would leave in their place)
            let room = self.window_room(now);
            if room < self.longest_ns + self.window_moves_ns {
                self.from_growth = false;
                return false;
            }
        }
        ok
    }

    /// The job warms up from `now` for [`WINDOW_NS`] (at least): a planned layout takes its
    /// region for the first time, and its first period maps the region's pages (see
    /// `CachingPool::plan_installs`).
    pub(super) fn warm_up(&mut self, now: u64) {
        self.warm_until = self.warm_until.max(now.saturating_add(WINDOW_NS));
    }

    /// Whether the job warms up at `now`: within [`WINDOW_NS`] of its peak of allocated bytes
    /// growing by [`WARM_GROWTH`] percent or more, or of a plan first taking its region.
    fn warm(&self, now: u64) -> bool {
        now < self.warm_until
    }

    /// ns of page work the window ending at `now` still has room for.
    fn window_room(&mut self, now: u64) -> u64 {
        while let Some(&(t, ns, moved)) = self.window.front() {
            if t.saturating_add(WINDOW_NS) > now {
                break;
            }
            self.window.pop_front();
            self.window_ns -= ns;
            if moved {
                self.window_moves_ns -= ns;
            }
        }
        ((SHARE * WINDOW_NS as f64) as u64).saturating_sub(self.window_ns)
    }

    /// Page work of `ns` (growth, moves: `moved`, giving back) ended at `now`: counted in the
    /// window, after the warm-up.
    pub(super) fn note_work(&mut self, now: u64, ns: u64, moved: bool) {
        if ns == 0 || self.warm(now) {
            return;
        }
        // (what is older than the window goes first: the log holds one second of work at most)
        self.window_room(now);
        self.window.push_back((now, ns, moved));
        self.window_ns += ns;
        if moved {
            self.window_moves_ns += ns;
        }
    }

    /// Charge a move that took `ns` to the account that paid it; a credit-paid move that
    /// overdraws the credit stops credit-paid moves.
    pub(super) fn charge(&mut self, ns: u64) {
        self.spent_ns += ns;
        self.longest_ns = self.longest_ns.max(ns);
        if self.from_growth {
            self.growth_spent_ns += ns;
            return;
        }
        self.credit -= ns as f64;
        if self.credit <= 0.0 && !self.stopped {
            self.stopped = true;
            self.stops += 1;
        }
    }

    /// Whether memory may be given back at `now` (a plan's unused pages,
    /// `plan/give_back.rs`): paid from growth's account, like a move for a demand met before
    /// (giving a page back costs about what mapping it did), so that it takes at most what
    /// growth past the high-water mark took, whatever the credit; after the warm-up, only
    /// where the window has room, as for a move.
    pub(super) fn may_give_back(&mut self, now: u64) -> bool {
        self.growth_spent_ns < self.growth_ns
            && (self.warm(now) || self.window_room(now) >= self.longest_ns + self.window_moves_ns)
    }

    /// Giving memory back took `ns` (see [`MoveBudget::may_give_back`]).
    pub(super) fn charge_give_back(&mut self, ns: u64) {
        self.spent_ns += ns;
        self.growth_spent_ns += ns;
    }

    /// Growth took `ns`, ending at `now` (the credit accrues from the job's first page call):
    /// growth that raised the high-water mark of reserved bytes (`new_high`) takes nothing
    /// from the credit and fills growth's account; growth below the mark (pages that moves
    /// unmapped, needed again: the mark is reset where the cache is emptied) is charged to
    /// the credit, which may go below zero and then pays no move until it has accrued again.
    pub(super) fn note_growth(&mut self, now: u64, ns: u64, new_high: bool) {
        self.accrue(now);
        if new_high {
            self.growth_ns += ns;
        } else {
            // a map below the mark: memory an earlier move unmapped, mapped again; part of
            // what moves cost, so the credit pays it (it cannot be put off: no stop)
            self.credit -= ns as f64;
            self.spent_ns += ns;
        }
    }

    /// Whether moves are stopped (beyond the job's growth).
    #[cfg(test)]
    fn stopped(&self) -> bool {
        self.stopped
    }

    /// The job repeats: its warm-up is over; an overdraft during it (the stop and the debt) is
    /// forgiven, and the credit starts full, so that the moves of the steps right after (a
    /// layout settling) do not overdraw it again (once: the caller calls this at the first
    /// period found).
    pub(super) fn warmed_up(&mut self) {
        self.stopped = false;
        self.credit = CAP_NS;
    }

    /// Moves allowed again (the cache was emptied); the credit and counts stay.
    pub(super) fn restart(&mut self) {
        self.stopped = false;
    }

    fn accrue(&mut self, now: u64) {
        if let Some(last) = self.last {
            let dt = now.saturating_sub(last) as f64;
            self.credit = (self.credit + SHARE * dt).min(CAP_NS);
        }
        self.last = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_stop_on_an_overdraft_and_go_on_only_while_the_job_warms_up() {
        let sec = 1_000_000_000u64;
        let mut b = MoveBudget::default();
        assert!(!b.may_move(0, 1000), "no credit before time passes");
        // growth takes nothing from the credit: a second later, all of it (the cap)
        b.note_growth(0, 4_000_000, true);
        assert!(b.may_move(sec, 1000) && !b.stopped());
        assert_eq!(b.credit, CAP_NS);
        let t = 2 * sec;
        assert!(b.may_move(t, 1000));
        b.charge(CAP_NS as u64 / 2);
        assert!(b.may_move(t, 1000) && !b.stopped());
        b.charge(CAP_NS as u64);
        assert!(b.stopped());
        // growth's account: moves as long as growth took (4 ms), whatever the credit
        assert!(b.may_move(t + sec / 4, 1000) && b.from_growth);
        b.charge(4_000_000);
        assert!(!b.may_move(t + sec / 2, 1000));
        // credit comes back with time, moves do not while the peak stays...
        assert!(!b.may_move(t + 10 * sec, 1000));
        // ...or grows by less than WARM_GROWTH percent (a few MB more of a 5 GB peak)
        assert!(!b.may_move(t + 20 * sec, 1009));
        // a peak 1% higher: the job warms up, moves again with the credit accrued, for
        // WINDOW_NS
        assert!(b.may_move(t + 21 * sec, 1019));
        assert!(b.may_move(t + 21 * sec + WINDOW_NS - 1, 1019));
        assert!(!b.may_move(t + 21 * sec + WINDOW_NS, 1019));
        assert_eq!(b.stops, 1);
        // and never beyond the credit
        assert!(b.may_move(t + 30 * sec, 1030));
        b.charge(2 * CAP_NS as u64);
        assert!(
            !b.may_move(t + 30 * sec, 2000),
            "warming up, the credit overdrawn"
        );
        assert!(
            b.may_move(t + 32 * sec, 2100),
            "warming up again, the credit accrued"
        );
        assert_eq!(b.stops, 1);
    }

    /// After the warm-up no move takes a window of a second past [`SHARE`] of it (plus a move
    /// longer than any before): a job that would move every millisecond, and grows now and
    /// then besides (0.3 ms every 100 ms), moves while the window has room for the move and
    /// for as much growth again as its moves, which leaves half the window's share to moves.
    #[test]
    fn after_the_warm_up_no_move_takes_a_window_of_a_second_past_the_share() {
        let ms = 1_000_000u64;
        let mut b = MoveBudget::default();
        assert!(!b.may_move(0, 1000));
        b.warmed_up();
        let (mut t, mut log) = (WINDOW_NS, Vec::new());
        let window = |log: &[(u64, u64, bool)], end: u64| {
            log.iter()
                .filter(|w| w.0 <= end && w.0 + WINDOW_NS > end)
                .fold((0, 0), |(a, m), w| (a + w.1, m + if w.2 { w.1 } else { 0 }))
        };
        let limit = (SHARE * WINDOW_NS as f64) as u64;
        for i in 0..20_000u64 {
            t += ms;
            if i % 100 == 0 {
                b.note_growth(t, 300_000, true);
                b.note_work(t, 300_000, false);
                log.push((t, 300_000, false));
            }
            let took = (200 + (i * 37) % 300) * 1_000;
            if b.may_move(t, 1000) {
                b.charge(took);
                b.note_work(t + took, took, true);
                log.push((t + took, took, true));
                let (all, _) = window(&log, t + took);
                assert!(
                    all <= limit + 100_000,
                    "{all} ns of page work in the second to {t}"
                );
            }
        }
        let moves = log.iter().filter(|w| w.2).count();
        // (each second: 3 ms of growth, and moves while 2 x moves + growth + the longest move
        // fit in 10 ms: about 3.2 ms of moves, ten of them)
        assert!((150..300).contains(&moves), "{moves} moves");
        for &(end, _, _) in &log {
            let (all, moved) = window(&log, end);
            assert!(all <= limit + 100_000 && moved <= limit / 2 + 500_000);
        }
        assert_eq!(b.stops, 0, "a refusal in the window is no stop");
    }

    /// The window's log holds one second of page work, whatever asks no move: growth below
    /// the high-water mark every 10 ms for 100 s leaves 100 entries, not 10,000.
    #[test]
    fn the_windows_log_holds_a_second_of_work() {
        let mut b = MoveBudget::default();
        assert!(!b.may_move(0, 1000));
        let mut t = 2 * WINDOW_NS;
        for _ in 0..10_000 {
            t += 10_000_000;
            b.note_work(t, 50_000, false);
        }
        assert_eq!(b.window.len(), 100);
        assert_eq!(b.window_ns, 100 * 50_000);
    }

    #[test]
    fn moves_may_take_as_long_as_growth_did_where_they_raise_no_peak() {
        let ms = 1_000_000u64;
        let mut b = MoveBudget::default();
        // a first step whose growth took 20 ms; a move overdraws what credit there is
        b.note_growth(0, 20 * ms, true);
        assert!(!b.may_move(0, 100) && b.may_move(ms, 100));
        b.charge(ms);
        assert!(b.stopped() && b.credit < 0.0);
        // an allocation that raises the peak of allocated bytes: no move without credit
        // (demand grows: credit-paid moves would go on, but there is none)
        assert!(!b.may_move(ms, 101));
        // the next step, past the growing window and below that peak: moves as long as they
        // took less than growth did, paid from growth's account (the credit left alone)
        let mut t = 2 * WINDOW_NS;
        let mut moved = 0;
        while b.may_move(t, 100) {
            assert!(b.from_growth);
            b.charge(3 * ms);
            moved += 3 * ms;
            t += ms;
        }
        assert_eq!(moved, 21 * ms, "growth's 20 ms, overshot by one move");
        assert!(b.credit > 0.0, "stopped: credit accrues but pays no move");
        // growth below the high-water mark (which a move may cause) refills nothing
        b.note_growth(t, 10 * ms, false);
        assert!(!b.may_move(t + 100_000 * ms, 100));
    }

    #[test]
    fn memory_goes_back_only_as_long_as_growth_took() {
        let ms = 1_000_000u64;
        let mut b = MoveBudget::default();
        assert!(!b.may_give_back(0), "nothing grown, nothing to pay with");
        b.note_growth(0, 5 * ms, true);
        assert!(b.may_give_back(0));
        b.charge_give_back(3 * ms);
        assert!(b.may_give_back(0));
        b.charge_give_back(3 * ms);
        assert!(!b.may_give_back(0), "growth's 5 ms spent (overshot by one)");
        // the credit is left alone, and no stop
        assert!(!b.stopped() && b.credit == 0.0);
        assert_eq!(b.spent_ns, 6 * ms);
        // growth below the mark refills nothing; past it, it does
        b.note_growth(ms, 10 * ms, false);
        assert!(!b.may_give_back(0));
        b.note_growth(2 * ms, 2 * ms, true);
        assert!(b.may_give_back(0));
    }

    #[test]
    fn maps_below_the_high_water_mark_are_paid_from_the_credit() {
        let ms = 1_000_000u64;
        let mut b = MoveBudget::default();
        b.note_growth(0, 0, true);
        // a second's credit (the cap), then a move of 4 ms
        assert!(b.may_move(1000 * ms, 100));
        b.charge(4 * ms);
        // the memory it unmapped is needed again: mapping it takes 7 ms, below the mark
        b.note_growth(1000 * ms, 7 * ms, false);
        assert_eq!(b.spent_ns, 11 * ms);
        // the credit is spent (10 - 11 ms): no move until it has accrued again, but no stop
        assert!(!b.may_move(1000 * ms, 100));
        assert!(!b.stopped());
        assert!(b.may_move(1000 * ms + 200 * ms, 100));
        // growth past the mark takes nothing from it
        b.note_growth(1200 * ms, 50 * ms, true);
        assert!(b.may_move(1200 * ms, 100));
        assert_eq!(b.spent_ns, 11 * ms);
    }

    #[test]
    fn an_overdraft_in_the_warm_up_is_forgiven_once_the_job_repeats() {
        let ms = 1_000_000u64;
        let mut b = MoveBudget::default();
        b.note_growth(0, 0, false);
        // the first step moves more than the credit earned: stopped, in debt
        assert!(b.may_move(100 * ms, 100));
        b.charge(5 * ms);
        assert!(b.stopped() && b.credit < 0.0 && !b.may_move(200 * ms, 100));
        // the job repeats: the stop and the debt are forgiven, the credit is full, and moves
        // go on as the credit allows, a few a step
        b.warmed_up();
        assert!(b.credit == CAP_NS && !b.stopped());
        let mut t = 10_000 * ms;
        for _ in 0..1000 {
            t += 50 * ms;
            assert!(b.may_move(t, 100));
            b.charge(ms / 5);
        }
        assert!(!b.stopped());
        // an overdraft after the warm-up stops them for good
        b.charge(CAP_NS as u64 * 2);
        assert!(b.stopped() && !b.may_move(t + 100_000 * ms, 100));
        assert_eq!(b.stops, 2);
    }

    #[test]
    fn over_any_interval_moves_take_at_most_the_share_plus_the_cap() {
        // a job that would move all the time: 50 µs moves, one every 100 µs
        let mut b = MoveBudget::default();
        let (mut t, mut spent, mut restarts) = (0u64, 0u64, 0);
        for _ in 0..1_000_000 {
            t += 100_000;
            if b.may_move(t, 100) {
                b.charge(50_000);
                spent += 50_000;
            }
            if b.stopped() && restarts < 3 {
                b.restart(); // an emptied cache starts moves again
                restarts += 1;
            }
        }
        assert!(spent as f64 <= SHARE * t as f64 + 4.0 * (CAP_NS + 50_000.0));
    }
}
