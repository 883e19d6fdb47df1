//! Planned layouts: a job that repeats gets its step's blocks placed once, by their lifetimes.
//!
//! The repeat detector (`repeat.rs`) finds the period of the pool's events. Its last period
//! gives every block of one step: rounded size, stream, the position of its allocation and of
//! its free (a block freed in the next step wraps around). The planner places those blocks at
//! offsets in one region so that blocks whose lifetimes meet never share bytes ("greedy by
//! size", Pisarchyk & Lee 2020: the largest first, each at the lowest offset free of the
//! blocks placed before it that live at the same time; and other orders beside it, the
//! smallest layout kept: by breadth, by life, and by size with the largest blocks
//! shuffled; around blocks that stay, also one that fills the gaps between them first, in
//! the order the job allocates). The region's pages are mapped once;
//! later steps take their planned offsets without a search and without a driver call.
//!
//! Serving follows the job with a cursor over the period's events: an event that matches the
//! plan's next one moves it on, and an allocation there takes its block's offset, if the bytes
//! are free (they are, unless the job did something else in between: then the request goes to
//! the dynamic pool, which is also where everything the plan does not know goes). An event
//! that differs loses the cursor; it is found again from the detector's rolling hash of the
//! last events, which the plan indexes for each of its positions. So an evaluation step in the
//! middle of training falls back to the dynamic pool and the plan resumes after it; a lasting
//! change (new shapes) gets a plan of its own, and a few plans (phases) coexist.
//!
//! The region is a segment like any other (statistics count it as reserved, snapshots list it
//! with its blocks); its free blocks stay out of the free sets, so the dynamic pool never
//! places anything there. A plan that no longer matches is dissolved: its segment becomes an
//! ordinary expandable segment whose free pages the dynamic pool reclaims as it needs.
//!
//! The files: `layout.rs` places a period's blocks by their lives (no pool state: the placers,
//! run on a thread of their own); this file holds a plan's state (`Plan`, `Plans`); the pool's
//! side is in `start.rs` (a period found: planning it, taking a region, placing around what is
//! live at a start), `serve.rs` (the cursor that follows the job and the planned allocation,
//! the hot path, and the detector's events while a plan follows the job), `give_back.rs`
//! (what the region does not use, given back once a cycle is served) and `region.rs` (the
//! region's pages and blocks, and leaving it).

use super::expandable::{handle_pages, page_span};
use super::repeat::{self, Entry, NONE, WINDOW};
use super::*;

mod give_back;
mod layout;
mod region;
mod serve;
mod start;

use layout::Layout;
use layout::*;

/// Fewest allocations in a period worth a plan (below it, the quick cache serves the job
/// as well: the same blocks back and forth).
pub(super) const MIN_ALLOCS: usize = 8;
/// What a pair of blocks whose lives meet costs the placer, in pairs whose lives do not
/// (those it tells apart by a mask, before the exact test): on the dev VM, 8,000 blocks
/// that all meet took 1.96 s to place, and 21,681 of `random_256_live`'s period, each meeting
/// about 256 others, 0.92 s. That was before the placer's time index ([`TIME_BUCKETS`]), with
/// which most pairs of short lives that do not meet cost nothing: the model is now an upper
/// bound for them (`random_256_live`'s plan and its first placement at its start, on the dev
/// VM: 1.7 s before the index, 0.75 s with it).
const MEETING_COST: u64 = 46;
/// The most work the planner does ([`place_work`]): what 8,192 blocks whose lives all meet
/// make (about 2 s on the dev VM; it was the limit when the planner took at most 8,192
/// allocations a period, whatever their lives). A longer period of short lives is planned
/// too: a job's sequence of random sizes over 256 live blocks, 21,681 allocations a period.
const MAX_WORK: u64 = 8_192 * 8_192 + MEETING_COST * (8_192 * 8_193 / 2);
/// Plans kept at once (phases of a job); beyond, the one used longest ago is dissolved.
pub(super) const MAX_PLANS: usize = 4;
/// Times in a row a plan may take its region and lose the job before one whole cycle of its
/// events; then it is dissolved (a plan whose first events match another phase's would
/// otherwise take its region at every step of that phase and leave it a few events later).
const MAX_SHORT_STAYS: u32 = 3;
/// Plans given up before they served a whole cycle in their region (dropped after short
/// stays, or made room for before they ever did) past which, while they outnumber the plans
/// that did, the job gets no new plan: its repetition does not last long enough for one to
/// pay (an inference loop whose two residual blocks of one width in a row repeat, a period
/// of 20 events, inside a denoising step of 208: 47 plans made in 30 requests on an H200,
/// each given up within a step or two, up to 136 driver calls a step; with this bound 14-15
/// plans, and no call over the last 10 steps). The plans it has stay.
pub(super) const MAX_WASTED: u32 = 2 * MAX_PLANS as u32;
/// Tries a plan makes at giving back the pages of its region that none of its slots uses, a
/// cycle of its events apart (see `plan_settled`).
const GIVE_BACK_TRIES: u32 = 3;
/// Large events between looks at whether the checkpoint a plan giving back pages waits for
/// has completed.
const GIVE_BACK_POLL: u64 = 16;
/// Starts at which a plan placed around the blocks in its way would take more than 1% past
/// the high-water mark (`worth_planning`) before it is declined for good: the start right
/// after a plan is made finds the job's layout as its first steps left it, the next one (a
/// period later) as it settled (gptfix's trace with the GPU 3000 calls behind: declined at
/// the first, taken up at the second).
const MAX_DECLINES: u32 = 2;
/// The greedy orders [`place`] tries (see [`order`]).
const ORDERS: usize = 4;
/// Orders [`place`] also tries with the largest blocks shuffled (see [`order`]).
const SHUFFLES: usize = 4;
/// Blocks from which [`place`] tries its orders on threads of their own.
const PARALLEL_LIVES: usize = 256;
/// [`place_pinned`] stops after its first wave of tries where one spans at most the bound
/// plus this fraction of it (1/400: 0.25%; see [`near_bound`]).
const NEAR_BOUND: u64 = 400;
/// Placements a plan keeps besides its last (see [`Plan::placed_before`]).
const PLACEMENTS_KEPT: usize = 3;
/// No slot at this position of the period.
const NO_SLOT: u32 = u32::MAX;

/// The stream's large expandable segment a plan takes over, with the ranges of the blocks that
/// stay in it (offsets from its start): the plan's blocks go around them, into the free
/// space the job's first steps left between them, which would otherwise stay mapped for
/// nothing.
#[derive(Debug, Clone)]
pub(super) struct Home {
    seg: u32,
    addr: u64,
    fixed: Vec<(u64, u64)>,
}

/// Whether a plan whose region spans `region` bytes, taking over a segment with `mapped`
/// bytes mapped while the pool reserves `reserved`, is worth having: reserved memory with it
/// stays within 1% of the high-water mark `high_water` the dynamic layout reached. Otherwise
/// the dynamic layout goes on, for good. The rule as stated; the pool applies it as
/// [`worth_region`], its bound on a region of whole pages (the tests hold the two equal).
#[cfg(test)]
fn worth_planning(reserved: u64, mapped: u64, region: u64, high_water: u64) -> bool {
    let with_plan = reserved.saturating_sub(mapped) + region;
    with_plan as u128 * 100 <= high_water as u128 * 101
}

/// The most bytes a region may span and be worth planning (`worth_planning`), in whole pages
/// of `page` bytes: a plan whose region (whole pages) spans more is declined.
fn worth_region(reserved: u64, mapped: u64, high_water: u64, page: u64) -> u64 {
    let most = (high_water as u128 * 101 / 100).min(u64::MAX as u128) as u64;
    most.saturating_sub(reserved.saturating_sub(mapped)) / page * page
}

/// What a plan is placed around at its start: the ranges `[lo, hi)` of the blocks in the
/// way, and the blocks pinned where they are (index, offset).
type Around = (Vec<(u64, u64)>, Vec<(usize, u64)>);

/// Whether a placement made around `old`, its slots at `slots` (offset, bytes), serves a
/// start around `new` as it is: the same blocks pinned, and each block in the way now that
/// was not then clear of every slot (a block gone leaves room unused, no conflict). A job
/// that leaves a small block of another phase in its segment, here one time and there the
/// next, keeps its placements: traineval's train plan finds a 4 MiB block of its evaluation
/// at 1,624 MiB or at 2,878 by turns (its replay, the GPU 300 calls behind: 6 placements
/// made ahead, was 8; phases' 6 on the allocating thread, was 8; the same layouts).
fn serves_around(mut slots: impl Iterator<Item = (u64, u64)>, old: &Around, new: &Around) -> bool {
    if old.1 != new.1 {
        return false;
    }
    let added: Vec<(u64, u64)> = new
        .0
        .iter()
        .copied()
        .filter(|r| old.0.binary_search(r).is_err())
        .collect();
    // (each slot against the new blocks, sorted: those that end past its start, the first)
    added.is_empty()
        || slots.all(|(at, n)| {
            let k = added.partition_point(|r| r.1 <= at);
            added.get(k).is_none_or(|r| at + n <= r.0)
        })
}

/// Where a planned region's blocks start, by page of its layout: each page's first block
/// (the lowest that starts in it), or `NIL`. A split or a join in the region changes one
/// entry; finding the block that holds an address walks back over the pages of one block at
/// most, then forward over the blocks of one page.
#[derive(Debug, Default)]
struct Cover {
    first: Vec<u32>,
    /// log2 of the page size
    shift: u32,
}

impl Cover {
    /// The pages of `bytes` of pages of `page` bytes (a power of two), no block yet.
    fn new(bytes: u64, page: u64) -> Self {
        Self {
            first: vec![NIL; bytes.div_ceil(page).max(1) as usize],
            shift: page.trailing_zeros(),
        }
    }

    /// The page of offset `off`, if the layout spans it.
    #[inline]
    fn page(&self, off: u64) -> Option<usize> {
        let k = (off >> self.shift) as usize;
        (k < self.first.len()).then_some(k)
    }
}

/// One position of a plan, as its cursor reads it: the low half of the event's print (on one
/// stream, every multiple of 512 bytes up to 2 GB has a low half of its own; a match is
/// checked against the slot's size where it counts, at an allocation) and the slot
/// its allocation takes ([`NO_SLOT`] for a free). Eight bytes a position in one array, where
/// the print and the slot were twelve in two: on `random_256_live`'s plan of 43,362 large
/// events a pass, that is 173 KB less read per pass.
#[derive(Debug, Clone, Copy)]
struct Pos {
    print: u32,
    slot: u32,
}

/// A plan in use: its layout, its region and where the job stands in it.
#[derive(Debug)]
pub(super) struct Plan {
    layout: Layout,
    /// per position of the layout, what the cursor compares and takes
    pos: Vec<Pos>,
    /// per position, for a free: how many events before it the plan allocated the block
    /// (the life that ends there; 0 for an allocation), so that the free of another block is
    /// told to the detector (`plan_free_event`)
    held: Vec<u32>,
    /// rolling hash of the [`WINDOW`] prints ending at each position → the position after it
    /// (windows seen at several positions are left out)
    windows: FxHashMap<u64, u32>,
    /// the next position expected, while in step with the job
    cursor: Option<u32>,
    /// the region's segment, once mapped
    seg: u32,
    /// per page of the region's layout, the first of its blocks (free or not) that starts
    /// in it, or `NIL`: where a slot's bytes begin is found without a search ([`Cover`])
    cover: Cover,
    /// pool tick when the plan was last in step
    used: u64,
    /// starts at which the plan would have taken more memory than the dynamic layout holds;
    /// at [`MAX_DECLINES`] it is declined: kept (so that the job is not planned again), it
    /// never serves
    declines: u32,
    /// the detector's event count when the plan last took its region
    since: u64,
    /// times in a row it left its region before a whole cycle (see [`MAX_SHORT_STAYS`])
    short_stays: u32,
    /// it has served a whole cycle in its region (see [`MAX_WASTED`])
    stayed: bool,
    /// giving back the pages of its region that none of its slots uses (`plan_settled`)
    give_back: GiveBack,
    /// per slot, the detector's event count when it was last taken, and the block it was
    /// carved as then (`NIL` before; see `plan_take_again`)
    taken: Vec<Taken>,
    /// what its offsets were last placed around at its start (`plan_place_at_start`): the
    /// ranges of the blocks in the way and the blocks pinned where they are
    placed_around: Option<Around>,
    /// the placements before that one, the latest first (at most [`PLACEMENTS_KEPT`]): what
    /// each was placed around, its slots' offsets and its region's bytes. A job that empties
    /// its cache every step restarts its plan of two periods in the same copy each time, so
    /// the block it keeps into the next step is pinned where the last placement put it, and
    /// the placements go round a cycle of a few: each is made once, then taken from here.
    placed_before: Vec<(Around, Vec<u64>, u64)>,
    /// positions after which what is in the way at the plan's next start is known (the last
    /// allocation of a block that lives into the next period: its life wraps around), so
    /// that it can be placed then, before the start (`plan_place_ahead`)
    last_wrap: u32,
    /// that placement, made ahead of the start
    place_ahead: Option<PlaceAhead>,
    /// runs of its region's pages (first, pages) mapped ahead by the resource's thread
    /// (`plan_split`) and not yet known made: counted as mapped, but no block there is
    /// handed out before `plan_ahead_ready` (their slots' `taken` blocks are `NIL`, so that
    /// only `plan_carve` takes them, and it asks first)
    ahead: Vec<(u64, u64)>,
}

/// A slot's last taking (see [`Plan::taken`]): when, and the block and its address (while
/// the plan holds its region; `block` is `NIL` before and after).
#[derive(Debug, Clone, Copy)]
struct Taken {
    at: u64,
    block: u32,
    addr: u64,
}

/// Where a plan stands in giving back the pages of its region that none of its slots uses.
#[derive(Debug, Default)]
struct GiveBack {
    /// tries left
    tries: u32,
    /// the detector's event count from which the next try may come
    next_at: u64,
    /// physical handles (first page, end) of the region that held only free blocks when the
    /// checkpoint `tick` was recorded, at event `event`, with the slots whose pages they hold
    waiting: Vec<(u64, u64, Vec<u32>)>,
    tick: u64,
    event: u64,
}

impl Plan {
    /// The placement a start around `around` takes as it is, within `limit` bytes: its last
    /// (`Some(None)`) or the kept one at `k` of [`Plan::placed_before`] (`Some(Some(k))`),
    /// made around the same blocks or around blocks that serve it ([`serves_around`]). (A
    /// placement is taken only where it still fits the limit: one made upside down spans up
    /// to the limit it was made with, and the limit moves with the pool's other bytes.)
    fn placement_serving(&self, around: &Around, limit: u64) -> Option<Option<usize>> {
        if let Some(a) = &self.placed_around {
            let slots = self.layout.slots.iter().map(|s| (s.0, s.1));
            if self.layout.region <= limit && (a == around || serves_around(slots, a, around)) {
                return Some(None);
            }
        }
        self.placed_before
            .iter()
            .position(|b| {
                let slots = b.1.iter().zip(&self.layout.slots).map(|(&at, s)| (at, s.1));
                b.2 <= limit && (b.0 == *around || serves_around(slots, &b.0, around))
            })
            .map(Some)
    }

    /// A placement for a start around `around`, mended from one this plan has made (its
    /// last, then the kept ones: [`repair`]; at its first start, its layout's, made around
    /// the blocks that stayed when it was planned, which mostly stay until the start) where
    /// that spans no more than the one it was mended from, in whole pages of `page`, and
    /// fits `limit`; `None` where none does (the start is then placed anew). A mended
    /// placement costs no memory by construction, and one search per slot moved where a
    /// placement makes one per slot for each of its tries.
    /// (Accepting one that spans a little more, within [`NEAR_BOUND`] of the bound, cost
    /// memory: traineval's replays went from 1.012 to 1.015 of their peak.)
    fn repaired(&self, around: &Around, limit: u64, page: u64) -> Option<(Vec<u64>, u64)> {
        let period = self.pos.len() as u32;
        let last: Vec<u64> = self.layout.slots.iter().map(|s| s.0).collect();
        let kept = self.placed_before.iter().map(|b| (b.1.as_slice(), b.2));
        let mut bases = std::iter::once((last.as_slice(), self.layout.region)).chain(kept);
        bases.find_map(|(base, region)| {
            let (offsets, total, _) =
                repair(&self.layout.lives, period, base, &around.0, &around.1);
            let spans = total.div_ceil(page).max(1) * page;
            (spans <= region && spans <= limit).then_some((offsets, total))
        })
    }

    pub(super) fn new(mut layout: Layout) -> Self {
        let p = layout.prints.len();
        let slots = layout.slots.len();
        let mut windows: FxHashMap<u64, u32> = FxHashMap::default();
        let mut twice = Vec::new();
        // (a plan of two periods: the first's positions stand for both)
        for k in 0..layout.half as usize {
            let h =
                repeat::window_hash((0..WINDOW as usize).map(|i| {
                    layout.prints[(k + p * WINDOW as usize + 1 + i - WINDOW as usize) % p]
                }));
            if windows.insert(h, ((k + 1) % p) as u32).is_some() {
                twice.push(h);
            }
        }
        for h in twice {
            windows.remove(&h);
        }
        let last_wrap = layout
            .lives
            .iter()
            .filter(|l| l.end < l.start)
            .map(|l| l.start)
            .max()
            .unwrap_or(0);
        let mut held = vec![0u32; p];
        for l in &layout.lives {
            held[l.end as usize] = ((l.end as usize + p - l.start as usize) % p) as u32;
        }
        // (the layout's prints and slots per position end here: the cursor reads `pos`)
        let pos = std::mem::take(&mut layout.prints)
            .into_iter()
            .zip(std::mem::take(&mut layout.slot_at))
            .map(|(print, slot)| Pos {
                print: print as u32,
                slot,
            })
            .collect();
        Self {
            layout,
            pos,
            held,
            windows,
            cursor: None,
            seg: NIL,
            cover: Cover::default(),
            used: 0,
            declines: 0,
            since: 0,
            short_stays: 0,
            stayed: false,
            give_back: GiveBack {
                tries: GIVE_BACK_TRIES,
                ..GiveBack::default()
            },
            taken: vec![
                Taken {
                    at: 0,
                    block: NIL,
                    addr: 0
                };
                slots
            ],
            placed_around: None,
            placed_before: Vec::new(),
            last_wrap,
            place_ahead: None,
            ahead: Vec::new(),
        }
    }

    /// The slot the plan allocates at the position of event `born` (`NONE`: none), where the
    /// job made that event in the period before event `n0` (the plan's next start: `born`
    /// in `[n0 - period, n0)`, the period's first position included); `Some(NO_SLOT)` where
    /// the plan allocates nothing there (a free), `None` where `born` lies outside.
    pub(super) fn slot_born(&self, born: u64, n0: u64) -> Option<u32> {
        let period = self.pos.len() as u64;
        (born != NONE && born < n0 && n0 - born <= period)
            .then(|| self.pos[(born + period - n0) as usize].slot)
    }

    /// The position equivalent to `c` from which the plan's start, the only place it is
    /// taken up, comes soonest. A plan of two periods indexes the first one's positions, and
    /// its second period repeats them: the job is followed in the second period's copy (or
    /// at the start, which the end of the first equals), so that the start comes at the end
    /// of the current period, not a period later.
    fn soonest_copy(&self, c: u32) -> u32 {
        let half = self.layout.half;
        if self.pos.len() as u32 != 2 * half {
            return c;
        }
        match c % half {
            0 => 0,
            r => r + half,
        }
    }

    /// Move the cursor over an event with print `print`; returns the position it matched.
    #[inline]
    fn step(&mut self, print: u64) -> Option<u32> {
        let c = self.cursor?;
        if self.pos[c as usize].print != print as u32 {
            self.cursor = None;
            return None;
        }
        self.advance(c);
        Some(c)
    }

    /// The cursor on past position `c`, matched.
    #[inline(always)]
    fn advance(&mut self, c: u32) {
        let next = c + 1;
        self.cursor = Some(if next as usize == self.pos.len() {
            0
        } else {
            next
        });
    }

    /// Whether the plan, in its region since the detector's event `since`, has served a
    /// whole cycle of its events by event `events` (it is idle: see `Repeats::note`), and
    /// whether a try at giving back its region's unused pages is due then
    /// (`plan_settled`).
    #[inline(always)]
    fn idle_and_due(&self, events: u64) -> (bool, bool) {
        let idle = self.seg != NIL && events >= self.since + self.pos.len() as u64;
        let g = &self.give_back;
        let due = (g.tries > 0 && events >= g.next_at) || !g.waiting.is_empty();
        (idle, due)
    }
}

/// A placement of a plan's slots (offsets, and the bytes they span) around what is in the
/// way at a start, made ahead of that start: `around` is what it was placed around (the
/// start takes it where it finds the same in the way; placing is a function of that and the
/// plan's lives alone).
#[derive(Debug)]
struct PlaceAhead {
    around: Around,
    job: PlaceJob,
}

#[derive(Debug)]
enum PlaceJob {
    Thread(std::thread::JoinHandle<(Vec<u64>, u64)>),
    Done((Vec<u64>, u64)),
    /// mended from an earlier placement ([`Plan::repaired`]), here
    Mended((Vec<u64>, u64)),
    /// none made: the start will take its last or a kept placement as it is
    /// ([`Plan::placement_serving`]), which it checks again then
    Serving,
    /// none made: the job's last period was not the plan's (`plan_followed`); a start, if
    /// one comes, places it
    OutOfStep,
}

/// A layout being computed off the allocating thread.
pub(super) enum Planning {
    Thread(std::thread::JoinHandle<Option<Layout>>),
    Done(Option<Layout>),
}

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Planning")
    }
}

/// What the detector is told of a free whose allocation it noted as event `born` (`NONE`:
/// it never saw the allocation, and the free still counts as a free).
#[inline(always)]
fn freed_born(born: u64) -> u64 {
    if born == NONE {
        NONE - 1
    } else {
        born
    }
}

/// The plans of one pool.
#[derive(Debug, Default)]
pub(super) struct Plans {
    pub(super) on: bool,
    pub(super) repeats: repeat::Repeats,
    /// per block slot: the event index of its allocation
    born: Vec<u64>,
    plans: Vec<Plan>,
    /// the plan in step with the job
    current: Option<usize>,
    planning: Option<Planning>,
    /// the detector's confirmations when that layout was asked for
    planning_found: u64,
    /// detector confirmations already acted on
    seen: u64,
    /// plans given up before they served a whole cycle in their region, and plans that
    /// served one (see [`MAX_WASTED`])
    pub(super) wasted: u32,
    pub(super) useful: u32,
    /// events before which `note_quiet` needs to look no further than the block: the current
    /// plan is idle, no give-back is due and the detector is quiet from the event after the
    /// last `note_large_event` until then (0: look; see [`CachingPool::plan_quiet_window`])
    quiet_until: u64,
    /// that plan's `since`, for the frees of a quiet stretch
    quiet_since: u64,
    /// starts that kept their plan's last placement (for tests; those that placed it are
    /// `num_plan_placements` and `num_plan_placements_ahead`)
    pub(super) placed_again: u64,
    /// (tests) looks at the blocks a start will find in the way, made ahead of it
    /// (`plan_place_ahead`)
    #[cfg(test)]
    pub(super) looked_ahead: u64,
    /// (tests) placements made ahead of a start, in full (on a thread, or inline on a
    /// simulated device), taken or not
    #[cfg(test)]
    pub(super) placed_ahead: u64,
    /// (debug builds) a detector that notes every event as `note_large_event` does, with no
    /// quiet stretch: `plan_unskip` must give the detector back its last events as this one
    /// has them (in the unit tests, the replays of the real traces, the workload families
    /// and the property tests: 2,921 stretches given back, every one so, none not)
    #[cfg(debug_assertions)]
    pub(super) shadow: repeat::Repeats,
    /// (debug builds) quiet stretches given back to the detector, and not
    #[cfg(debug_assertions)]
    pub(super) unskipped: (u64, u64),
}

impl Plans {
    /// Plans on or off (`planned_layout`).
    pub(super) fn new(on: bool) -> Self {
        Self {
            on,
            ..Self::default()
        }
    }

    /// Whether any plan work is under way (the allocation path looks no further otherwise).
    #[inline]
    pub(super) fn busy(&self) -> bool {
        !self.plans.is_empty() || self.planning.is_some()
    }

    /// Whether a new plan may be made: plans given up before they served do not outnumber
    /// those that served, or are fewer than [`MAX_WASTED`].
    pub(super) fn may_plan(&self) -> bool {
        self.wasted < MAX_WASTED || self.wasted <= self.useful
    }

    /// Whether the job has repeated: the detector has found a period (its warm-up is over).
    #[inline]
    pub(super) fn repeated(&self) -> bool {
        self.seen > 0
    }

    /// Whether a plan follows the job now.
    #[inline]
    pub(super) fn in_step(&self) -> bool {
        self.current.is_some()
    }

    /// Plans on their way: a layout being computed (or computed and not yet taken), and plans
    /// made that have not yet taken their region (at the start of their period), unless
    /// declined.
    pub(super) fn pending(&self) -> u64 {
        // (a plan holding its region, the only one, that has pages to give back still)
        let giving_back = self.current.is_some_and(|i| {
            let (p, g) = (&self.plans[i], &self.plans[i].give_back);
            self.plans.len() == 1 && p.seg != NIL && (g.tries > 0 || !g.waiting.is_empty())
        });
        u64::from(self.planning.is_some())
            + u64::from(giving_back)
            + self
                .plans
                .iter()
                .filter(|p| p.since == 0 && p.declines < MAX_DECLINES)
                .count() as u64
    }
}

#[cfg(test)]
mod tests;
