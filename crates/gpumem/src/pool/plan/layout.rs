//! Placing a period's blocks by their lives: the offline planner (no pool state).

use super::*;

/// One block of a period: its rounded size and the positions of its allocation and free
/// (`end < start`: freed in the next period).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Life {
    pub size: u64,
    pub start: u32,
    pub end: u32,
}

impl Life {
    /// The positions `[a, b)` the block is held, as one or two intervals.
    pub(super) fn spans(&self, period: u32) -> [(u32, u32); 2] {
        if self.start < self.end {
            [(self.start, self.end), (0, 0)]
        } else {
            [(self.start, period), (0, self.end)]
        }
    }

    pub(super) fn meets(&self, other: &Life, period: u32) -> bool {
        self.spans(period).iter().any(|&(a0, a1)| {
            a0 < a1
                && other
                    .spans(period)
                    .iter()
                    .any(|&(b0, b1)| b0 < b1 && a0 < b1 && b0 < a1)
        })
    }
}

/// Offsets for `lives` (multiples of [`MIN_BLOCK`]) such that blocks whose lives meet never
/// overlap, nor any of the `fixed` ranges `[lo, hi)` (blocks that stay where they are), and
/// the bytes the layout spans: the best of a few greedy orders.
pub(super) fn place(lives: &[Life], period: u32, fixed: &[(u64, u64)]) -> (Vec<u64>, u64) {
    place_pinned(lives, period, fixed, &[], true, u64::MAX)
}

/// A plan's offsets at a start, around the `fixed` ranges of the blocks in its way and the
/// blocks `live` from the period before (slot index, offset: their lives wrap around the
/// start), and the bytes the layout spans. Each live block is pinned where it lies, its slot
/// there for good; where that spans more than `limit` bytes (the most a region may span and
/// still be worth planning: `worth_region`), a second placement is made, with each live
/// block held where it lies only until its free in the first period (a life of its own from
/// the start to its free) and its slot placed as any other for the periods after, and the
/// smaller kept (the first on a tie). The second is the looser: where the dynamic layout left
/// a block live across the start at an awkward place, pinning its slot there bends every
/// later period around it (LoRA's trace with the GPU 3,000 calls behind: 6,174 and 5,634 MiB
/// at the two starts its plan could take, both declined against a high-water mark of 5,558,
/// and the dynamic layout then grew to 1.158 of live; held, the plan is taken, 1.0186). Made
/// at every start, it lost elsewhere (gpt_train 1.0223 -> 1.0312, gptfix 1.0115 -> 1.0122:
/// its slots' first period moved more) and doubled the placement's work, so it is made only
/// for a plan that would otherwise be declined, and after a third, upside down
/// ([`place_reflected`]: a block live across the start high in the segment bends a placement
/// from the bottom up; gptfix's step-4 start 10,034 MiB, upside down 9,536), made at the limit
/// and then as tight as that layout allows: where that fits the limit it is kept without the
/// held one (gptfix's and emptycache's starts: their held placement, 10,145 MiB, took 15 tries
/// of work for nothing); else the smallest of all is kept. The pinned placement's second
/// wave of tries ([`place_pinned`]) waits where its first passes the limit, until upside down
/// has not fitted: emptycache's start that pinned a block of logits high took 137 ms of one
/// dev-VM core (a pinned placement of both waves at 10,035 MiB, then upside down at the
/// limit), 50 without that second wave (stop 88; every replay the same).
pub(super) fn place_at_start(
    lives: &[Life],
    period: u32,
    fixed: &[(u64, u64)],
    live: &[(usize, u64)],
    limit: u64,
) -> (Vec<u64>, u64) {
    let defer = if live.is_empty() { u64::MAX } else { limit };
    let pinned = place_pinned(lives, period, fixed, live, true, defer);
    if live.is_empty() || pinned.1 <= limit {
        return pinned;
    }
    // upside down: the first at the limit, the second as tight as the first allows
    let mut best = pinned;
    let mut top = limit;
    for _ in 0..2 {
        match place_reflected(lives, period, fixed, live, top) {
            Some(r) if r.1 < best.1 => {
                top = r.2;
                best = (r.0, r.1);
            }
            _ => break,
        }
    }
    if best.1 <= limit {
        return best;
    }
    // (the pinned placement's second wave, deferred until upside down did not fit)
    let pinned = place_pinned(lives, period, fixed, live, true, u64::MAX);
    if pinned.1 <= limit {
        return pinned;
    }
    if pinned.1 < best.1 {
        best = pinned;
    }
    let mut all = lives.to_vec();
    let mut held = Vec::with_capacity(live.len());
    for &(k, off) in live {
        // (a block freed at the period's first event holds nothing past the start)
        let end = lives[k].end;
        if end > 0 {
            held.push((all.len(), off));
            all.push(Life {
                size: lives[k].size,
                start: 0,
                end,
            });
        }
    }
    let (mut offsets, total) = place_pinned(&all, period, fixed, &held, true, u64::MAX);
    offsets.truncate(lives.len());
    if total < best.1 {
        return (offsets, total);
    }
    best
}

/// A placement `base` (offsets of `lives`) made around other blocks, mended for a start
/// around the `fixed` ranges and the `pinned` blocks (index, offset): each pinned block goes
/// where it lies, and only the blocks that now overlap a fixed range, or a pinned block that
/// moved while their lives meet, are placed again (the largest first, each in the smallest
/// gap it fits beside all the others, else on top); the rest keep their offsets. The offsets,
/// the bytes spanned, and how many blocks moved. One search per moved block, where a
/// placement makes one per block for each of its 3 to 15 tries: a job that leaves a block of
/// another phase in the plan's way now and then (an evaluation's), or keeps a block across
/// the start somewhere else, moves a few slots instead of placing them all again.
pub(super) fn repair(
    lives: &[Life],
    period: u32,
    base: &[u64],
    fixed: &[(u64, u64)],
    pinned: &[(usize, u64)],
) -> (Vec<u64>, u64, usize) {
    let mut at = base.to_vec();
    let mut stays = vec![true; lives.len()];
    let mut is_pinned = vec![false; lives.len()];
    let mut sorted = fixed.to_vec();
    sorted.sort_unstable();
    for &(k, off) in pinned {
        at[k] = off;
        is_pinned[k] = true;
    }
    let overlaps = |lo: u64, hi: u64| {
        let f = sorted.partition_point(|r| r.1 <= lo);
        sorted.get(f).is_some_and(|r| r.0 < hi)
    };
    for (i, l) in lives.iter().enumerate() {
        if is_pinned[i] {
            continue;
        }
        let (lo, hi) = (at[i], at[i] + l.size);
        stays[i] = !overlaps(lo, hi)
            && !pinned.iter().any(|&(k, off)| {
                off != base[k] && off < hi && lo < off + lives[k].size && l.meets(&lives[k], period)
            });
    }
    let kept: Vec<(usize, u64)> = (0..lives.len())
        .filter(|&i| stays[i])
        .map(|i| (i, at[i]))
        .collect();
    let mut moved: Vec<usize> = (0..lives.len()).filter(|&i| !stays[i]).collect();
    moved.sort_by_key(|&i| (u64::MAX - lives[i].size, lives[i].start));
    let mut p = Placer::new(lives, period, &sorted, &kept);
    for &i in &moved {
        let off = p.lowest_fit(i, true);
        p.put(i, off);
    }
    (p.offset, p.total, moved.len())
}

/// [`place_pinned`] upside down above the `fixed` ranges: each `live` block pinned at its
/// reflection in `[base, top)` (`base` the top of the fixed ranges), the layout made, and
/// every block placed at or above `base` reflected back, so that the live blocks lie where
/// they are. The dynamic layout leaves a block live across a start where it found room, often
/// high in the segment; pinned there, a placement from the bottom up bends around it (gptfix at
/// step 4's start, 500 MiB of logits at 8,524 MiB: 10,034 MiB, where pinned at 4,616-7,000 it
/// packs into the fixed blocks plus the step's peak, 9,534). `None` where a live block lies
/// below `base` or above `top`, or the layout passes `top` or has a block across `base`; else
/// the offsets, the bytes spanned (`top`) and the least `top` that the same layout would take.
pub(super) fn place_reflected(
    lives: &[Life],
    period: u32,
    fixed: &[(u64, u64)],
    live: &[(usize, u64)],
    top: u64,
) -> Option<(Vec<u64>, u64, u64)> {
    let base = fixed.iter().map(|f| f.1).max().unwrap_or(0);
    let mut pins = Vec::with_capacity(live.len());
    for &(k, off) in live {
        let end = off + lives[k].size;
        if off < base || end > top {
            return None;
        }
        pins.push((k, base + top - end));
    }
    let (offsets, total) = place_pinned(lives, period, fixed, &pins, true, u64::MAX);
    let across = lives
        .iter()
        .zip(&offsets)
        .any(|(l, &o)| o < base && o + l.size > base);
    if total > top || across {
        return None;
    }
    let reflected = lives
        .iter()
        .zip(&offsets)
        .map(|(l, &o)| {
            if o >= base {
                base + top - o - l.size
            } else {
                o
            }
        })
        .collect();
    // the same layout reflected within [base, least) puts the live blocks `top - least` lower
    let least = live
        .iter()
        .map(|&(k, off)| off + lives[k].size)
        .max()
        .unwrap_or(0)
        .max(total);
    Some((reflected, top, least))
}

/// The (order, best gap) pairs [`place`] tries, in the order it keeps the first smallest:
/// every greedy order with first and best gap, then the shuffled ones with first gap.
pub(super) fn tries() -> impl Iterator<Item = (usize, bool)> {
    (0..ORDERS)
        .flat_map(|k| [(k, false), (k, true)])
        .chain((ORDERS..ORDERS + SHUFFLES).map(|k| (k, false)))
}

/// [`place`] with `pinned` blocks (index, offset) where they are; `gaps`: all of [`tries`]
/// and the layout that fills the gaps between `fixed` ranges first ([`fill_gaps_first`]),
/// else (the blocks left above those gaps) greedy by size and by breadth only.
///
/// With `gaps`, the tries come in two waves: first those that most often place best (by
/// breadth, with first and best gap, and the gaps first), then the others only where none of
/// the first came within [`NEAR_BOUND`] of the bound no layout passes below (the step's peak
/// of held bytes beside the fixed ranges' bytes). Each try is quadratic in the blocks and a
/// start's placement may run on the allocating thread; over every real trace's placements
/// (dev VM, stop 87) the first wave's best was within 0.25% of the bound in most of them
/// (unet, lora, vit, resnet, buckets, traineval, gptfix's later starts), which then cost
/// 5 tries' work instead of 15: unet's first start (2,810 blocks) 216-236 ms of one dev-VM
/// core before, 61 after. On an H200 with every process on one core, traineval's steps after
/// each evaluation, where the placement made ahead shared the core, took 20-25 ms more than
/// native's before, 6-8 after. Where the first wave's best spans more than `defer_above`, the
/// second is left to the caller (`place_at_start` tries upside down first).
pub(super) fn place_pinned(
    lives: &[Life],
    period: u32,
    fixed: &[(u64, u64)],
    pinned: &[(usize, u64)],
    gaps: bool,
    defer_above: u64,
) -> (Vec<u64>, u64) {
    // `None`: the gaps first
    let attempt = |t: Option<(usize, bool)>| {
        #[cfg(test)]
        ATTEMPTS.with(|n| n.set(n.get() + 1));
        match t {
            Some((k, fit)) => {
                place_around(lives, period, &order(lives, period, k), fit, fixed, pinned)
            }
            None => fill_gaps_first(lives, period, fixed, pinned),
        }
    };
    // each attempt is quadratic in the blocks: a step of a few thousand blocks tries them
    // side by side (on threads of their own; one by one where threads cannot be had), so
    // that the plan serves a step sooner
    // (each result beside its try; a try whose thread panicked is left out, as one that
    // could not be made)
    type Try = Option<(usize, bool)>;
    let run = |tries: &[Try]| -> Vec<(Try, (Vec<u64>, u64))> {
        if lives.len() < PARALLEL_LIVES || tries.len() < 2 {
            return tries.iter().map(|&t| (t, attempt(t))).collect();
        }
        std::thread::scope(|s| {
            let handles: Vec<_> = tries
                .iter()
                .map(|&t| {
                    std::thread::Builder::new()
                        .name("gpumem-place".into())
                        .spawn_scoped(s, move || attempt(t))
                        .ok()
                })
                .collect();
            handles
                .into_iter()
                .zip(tries)
                .filter_map(|(h, &t)| match h {
                    Some(h) => h.join().ok().map(|r| (t, r)),
                    None => Some((t, attempt(t))),
                })
                .collect()
        })
    };
    if !gaps {
        return first_smallest(run(&[Some((0, false)), Some((3, false))]));
    }
    let all: Vec<Try> = tries()
        .map(Some)
        .chain((!fixed.is_empty()).then_some(None))
        .collect();
    let (one, two): (Vec<Try>, Vec<Try>) =
        all.iter().partition(|t| matches!(t, None | Some((3, _))));
    let mut results = run(&one);
    let near = near_bound(lives, period, fixed);
    let least = results.iter().map(|r| r.1 .1).min().unwrap_or(0);
    if least > near && least <= defer_above {
        results.extend(run(&two));
        // (in the order of `all`, so that the first of the smallest is as one by one)
        results.sort_by_key(|(t, _)| all.iter().position(|a| a == t));
    }
    first_smallest(results)
}

#[cfg(test)]
thread_local! {
    /// Attempts [`place_pinned`] made on this thread (those of fewer than
    /// [`PARALLEL_LIVES`] blocks run where it is called), for the tests.
    pub(super) static ATTEMPTS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The first of the smallest of `results` (offsets, bytes spanned).
fn first_smallest<T>(results: Vec<(T, (Vec<u64>, u64))>) -> (Vec<u64>, u64) {
    let mut best: Option<(Vec<u64>, u64)> = None;
    for (_, r) in results {
        if best.as_ref().is_none_or(|b| r.1 < b.1) {
            best = Some(r);
        }
    }
    best.unwrap_or_default()
}

/// What a placement of `lives` beside `fixed` may span and end [`place_pinned`]'s search:
/// within [`NEAR_BOUND`] of the least any layout spans where the fixed ranges lie below it
/// (the step's peak of held bytes and the fixed bytes together).
pub(super) fn near_bound(lives: &[Life], period: u32, fixed: &[(u64, u64)]) -> u64 {
    let held = held_bytes(lives, period).into_iter().max().unwrap_or(0);
    let bound = held + fixed.iter().map(|f| f.1 - f.0).sum::<u64>();
    bound + bound / NEAR_BOUND
}

/// The bytes `lives` hold at each position of a period of `period` events.
pub(super) fn held_bytes<'a>(lives: impl IntoIterator<Item = &'a Life>, period: u32) -> Vec<u64> {
    let mut delta = vec![0i128; period as usize + 1];
    for l in lives {
        for (a, b) in l.spans(period) {
            if a < b {
                delta[a as usize] += l.size as i128;
                delta[b as usize] -= l.size as i128;
            }
        }
    }
    let mut acc = 0i128;
    delta[..period as usize]
        .iter()
        .map(|d| {
            acc += d;
            acc.max(0) as u64
        })
        .collect()
}

/// The blocks of `lives` in the `k`-th of [`place`]'s orders: by size (0), by size times
/// length of life (1), by length of life (2), by breadth (3), larger first; from
/// [`ORDERS`] on, by size with the largest blocks shuffled.
pub(super) fn order(lives: &[Life], period: u32, k: usize) -> Vec<usize> {
    let len = |l: &Life| u64::from((l.end + period - l.start) % period);
    let base = if k >= ORDERS { 0 } else { k };
    // bytes held at each position, and the most held during each block's life ("breadth")
    let breadth: Vec<u64> = if base == 3 {
        let held = held_bytes(lives, period);
        lives
            .iter()
            .map(|l| {
                l.spans(period)
                    .iter()
                    .filter(|s| s.0 < s.1)
                    .flat_map(|&(a, b)| held[a as usize..b as usize].iter().copied())
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    } else {
        Vec::new()
    };
    let key = |i: usize| {
        let l = &lives[i];
        match base {
            0 => (u64::MAX - l.size, u64::MAX - len(l), l.start),
            1 => (u64::MAX - l.size.saturating_mul(len(l)), 0, l.start),
            2 => (u64::MAX - len(l), u64::MAX - l.size, l.start),
            // greedy by breadth (Pisarchyk & Lee): the blocks of the fullest moments first
            _ => (u64::MAX - breadth[i], u64::MAX - l.size, l.start),
        }
    };
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_by_key(|&i| key(i));
    if k >= ORDERS {
        // by size, with the blocks of at least half the largest one's size in an order drawn
        // from `k`: every by-size order stacks blocks of one size from the bottom, and puts
        // the next size above them all, where two blocks that take turns (the two copies of
        // an output a loop keeps into its next step) are best at either end of the stack of
        // the ones they meet in turn (gpt_train's plan: 500 MiB over its bound by size, at
        // it in two of four shuffles)
        let largest = lives.iter().map(|l| l.size).max().unwrap_or(0);
        let big = order
            .iter()
            .take_while(|&&i| lives[i].size.saturating_mul(2) >= largest)
            .count();
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (k as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        for i in (1..big).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    order
}

/// Blocks that stay (`fixed`) lie scattered where a job's first steps put them (an
/// optimizer's state, created in the first step, fills the holes its activations left).
/// Placed around them in [`place_pinned`]'s orders, the step's blocks leave much of the gaps
/// between them unused (gptfix: 10.52 GB around 2.29 GB of fixed blocks, where the step alone
/// packs into its 7.71 GB peak). So fill the gaps first, in the order the job allocates: each
/// block goes into the gaps below the highest fixed block at the lowest offset where it fits
/// for its whole life (a step's blocks die mostly in the reverse order of their allocation, so
/// the gaps fill like stacks and stay full at the step's fullest moment); then every other
/// block is placed above them, greedy by size and by breadth, where alone they pack as well
/// as the whole step does (gptfix: 9.997 GB, the fixed blocks plus the step's peak; all of
/// [`tries`] give the same there, and took the placement at the plan's start, on the
/// allocating thread, from 45 to 69 ms on a 2-core host).
pub(super) fn fill_gaps_first(
    lives: &[Life],
    period: u32,
    fixed: &[(u64, u64)],
    pinned: &[(usize, u64)],
) -> (Vec<u64>, u64) {
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_by_key(|&i| lives[i].start);
    let ceiling = fixed.iter().map(|f| f.1).max().unwrap_or(0);
    let mut p = Placer::new(lives, period, fixed, pinned);
    for i in order {
        if p.is_placed(i) {
            continue;
        }
        let at = p.lowest_fit(i, false);
        if at + lives[i].size <= ceiling {
            p.put(i, at);
        }
    }
    // the others above the gaps
    let mut above = fixed.to_vec();
    above.push((0, ceiling));
    let placed = p.placed();
    place_pinned(lives, period, &above, &placed, false, u64::MAX)
}

/// Place `lives` in `order`, each at the lowest offset where it fits (`best_gap`: in the
/// smallest gap it fits, else on top), `pinned` blocks (index, offset) first where they are.
pub(super) fn place_around(
    lives: &[Life],
    period: u32,
    order: &[usize],
    best_gap: bool,
    fixed: &[(u64, u64)],
    pinned: &[(usize, u64)],
) -> (Vec<u64>, u64) {
    let mut p = Placer::new(lives, period, fixed, pinned);
    for &i in order {
        if !p.is_placed(i) {
            let at = p.lowest_fit(i, best_gap);
            p.put(i, at);
        }
    }
    (p.offset, p.total)
}

/// Time buckets of a [`Placer`]'s index: placed blocks are listed by the buckets of the
/// period their lives hold, so that a block's search meets only the blocks held near its
/// own life, not every block placed.
pub(super) const TIME_BUCKETS: u32 = 512;
/// A block whose life holds more buckets than this is listed once, by offset, with the other
/// long ones, not in each of its buckets.
pub(super) const LONG_BUCKETS: u32 = 32;

/// A layout being built: the blocks placed so far beside the `fixed` ranges, indexed by time.
pub(super) struct Placer<'a> {
    pub(super) lives: &'a [Life],
    /// each life's held positions as two intervals (see [`Life::spans`])
    pub(super) spans: Vec<[u32; 4]>,
    /// each life's held positions in 64 buckets of the period, a bit each: lives whose masks
    /// share no bit never meet, and skip the exact test
    pub(super) masks: Vec<u64>,
    /// each life's [`TIME_BUCKETS`] buckets, as two ranges `[lo, hi)` (empty where unused)
    pub(super) buckets: Vec<[u32; 4]>,
    /// the fixed ranges, sorted
    pub(super) fixed: Vec<(u64, u64)>,
    /// the placed blocks of long lives (more than [`LONG_BUCKETS`] buckets) `(lo, hi, index,
    /// mask)`, sorted by `(lo, hi)`
    pub(super) long: Vec<(u64, u64, usize, u64)>,
    /// the placed blocks of short lives, by bucket
    pub(super) short: Vec<Vec<u32>>,
    /// the placed blocks of short lives, all of them (what a long life's search scans)
    pub(super) short_all: Vec<u32>,
    pub(super) offset: Vec<u64>,
    pub(super) is_placed: Vec<bool>,
    /// the top of the highest placed block
    pub(super) total: u64,
    /// scratch of [`Placer::lowest_fit`]: the short blocks in the way, the search that last
    /// saw each block, and the search's number
    pub(super) busy: Vec<(u64, u64)>,
    pub(super) seen: Vec<u32>,
    pub(super) search: u32,
}

impl<'a> Placer<'a> {
    pub(super) fn new(
        lives: &'a [Life],
        period: u32,
        fixed: &[(u64, u64)],
        pinned: &[(usize, u64)],
    ) -> Self {
        let period = period.max(1);
        let spans: Vec<[u32; 4]> = lives
            .iter()
            .map(|l| {
                let [(a0, a1), (b0, b1)] = l.spans(period);
                [a0, a1, b0, b1]
            })
            .collect();
        let mut fixed = fixed.to_vec();
        fixed.sort_unstable();
        // the buckets `[lo, hi)` of `n` over the period that positions `[a, b)` fall in
        let range = |a: u32, b: u32, n: u32| {
            let bucket = |x: u32| (u64::from(x) * u64::from(n) / u64::from(period)) as u32;
            if a < b {
                (bucket(a), bucket(b - 1) + 1)
            } else {
                (0, 0)
            }
        };
        let masks = spans
            .iter()
            .map(|s| {
                [(s[0], s[1]), (s[2], s[3])]
                    .iter()
                    .map(|&(a, b)| range(a, b, 64))
                    .filter(|&(lo, hi)| lo < hi)
                    .fold(0u64, |m, (lo, hi)| {
                        m | ((u64::MAX >> (64 - hi)) & (u64::MAX << lo))
                    })
            })
            .collect();
        let nb = TIME_BUCKETS.min(period);
        let buckets = spans
            .iter()
            .map(|s| {
                let (x, y) = (range(s[0], s[1], nb), range(s[2], s[3], nb));
                [x.0, x.1, y.0, y.1]
            })
            .collect();
        let mut p = Self {
            lives,
            spans,
            masks,
            buckets,
            fixed,
            long: Vec::new(),
            short: vec![Vec::new(); nb as usize],
            short_all: Vec::new(),
            offset: vec![0; lives.len()],
            is_placed: vec![false; lives.len()],
            total: 0,
            busy: Vec::new(),
            seen: vec![0; lives.len()],
            search: 0,
        };
        for &(i, off) in pinned {
            p.put(i, off);
        }
        p
    }

    pub(super) fn is_placed(&self, i: usize) -> bool {
        self.is_placed[i]
    }

    /// How many time buckets block `i`'s life holds.
    pub(super) fn width(&self, i: usize) -> u32 {
        let b = &self.buckets[i];
        (b[1] - b[0]) + (b[3] - b[2])
    }

    /// Block `i` at `at`.
    pub(super) fn put(&mut self, i: usize, at: u64) {
        let hi = at + self.lives[i].size;
        if self.width(i) > LONG_BUCKETS {
            let k = self
                .long
                .partition_point(|&(l, h, _, _)| (l, h) <= (at, hi));
            self.long.insert(k, (at, hi, i, self.masks[i]));
        } else {
            let b = self.buckets[i];
            for k in (b[0]..b[1]).chain(b[2]..b[3]) {
                self.short[k as usize].push(i as u32);
            }
            self.short_all.push(i as u32);
        }
        self.offset[i] = at;
        self.is_placed[i] = true;
        self.total = self.total.max(hi);
    }

    /// The placed blocks and their offsets, by offset.
    pub(super) fn placed(&self) -> Vec<(usize, u64)> {
        let mut v: Vec<(u64, u64, usize)> = self
            .is_placed
            .iter()
            .enumerate()
            .filter(|(_, &p)| p)
            .map(|(i, _)| (self.offset[i], self.offset[i] + self.lives[i].size, i))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(lo, _, i)| (i, lo)).collect()
    }

    /// Whether the lives of blocks `i` and `j` meet ([`Life::meets`]).
    #[inline]
    pub(super) fn meet(&self, i: usize, j: usize) -> bool {
        let (a, b) = (&self.spans[i], &self.spans[j]);
        let ov = |a0: u32, a1: u32, b0: u32, b1: u32| (a0 < a1) & (b0 < b1) & (a0 < b1) & (b0 < a1);
        ov(a[0], a[1], b[0], b[1])
            | ov(a[0], a[1], b[2], b[3])
            | ov(a[2], a[3], b[0], b[1])
            | ov(a[2], a[3], b[2], b[3])
    }

    /// Where block `i` goes beside the fixed ranges and the placed blocks whose lives meet
    /// its own: the lowest offset where it fits (`best_gap`: the smallest gap it fits, else on
    /// top of them all). The long blocks in the way come by offset from their list; the short
    /// ones are gathered from the buckets of `i`'s life (or, for a long `i`, from all of them)
    /// and sorted.
    pub(super) fn lowest_fit(&mut self, i: usize, best_gap: bool) -> u64 {
        let size = self.lives[i].size;
        let mask = self.masks[i];
        let mut short = std::mem::take(&mut self.busy);
        let mut seen = std::mem::take(&mut self.seen);
        short.clear();
        self.search = self.search.wrapping_add(1);
        if self.search == 0 {
            seen.fill(0);
            self.search = 1;
        }
        let search = self.search;
        let mut consider = |j: u32| {
            let j = j as usize;
            if seen[j] != search {
                seen[j] = search;
                if self.masks[j] & mask != 0 && self.meet(i, j) {
                    let lo = self.offset[j];
                    short.push((lo, lo + self.lives[j].size));
                }
            }
        };
        if self.width(i) > LONG_BUCKETS {
            self.short_all.iter().for_each(|&j| consider(j));
        } else {
            let b = self.buckets[i];
            for k in (b[0]..b[1]).chain(b[2]..b[3]) {
                self.short[k as usize].iter().for_each(|&j| consider(j));
            }
        }
        short.sort_unstable_by_key(|r| r.0);
        // the ranges in the way, lowest first, from the three lists: the long blocks that
        // meet `i` (tested as they come, so that a fit found low ends the search early), the
        // short ones, the fixed ranges
        let (long, fixed) = (&self.long, &self.fixed);
        let (mut l, mut s, mut f) = (0, 0, 0);
        let mut at = 0u64;
        let mut gap: Option<(u64, u64)> = None;
        loop {
            while l < long.len() {
                let (_, _, j, m) = long[l];
                if m & mask != 0 && self.meet(i, j) {
                    break;
                }
                l += 1;
            }
            let mut next = None;
            let mut from = 0;
            if l < long.len() {
                next = Some((long[l].0, long[l].1));
            }
            if s < short.len() && next.is_none_or(|n| short[s] < n) {
                next = Some(short[s]);
                from = 1;
            }
            if f < fixed.len() && next.is_none_or(|n| fixed[f] < n) {
                next = Some(fixed[f]);
                from = 2;
            }
            let Some((lo, hi)) = next else {
                break;
            };
            match from {
                0 => l += 1,
                1 => s += 1,
                _ => f += 1,
            }
            if lo >= at + size {
                if !best_gap {
                    break;
                }
                if gap.is_none_or(|g| lo - at < g.1) {
                    gap = Some((at, lo - at));
                }
            }
            at = at.max(hi);
        }
        self.busy = short;
        self.seen = seen;
        gap.map_or(at, |(g, _)| g)
    }
}

/// The lives of the blocks of `events` (oldest first; the first one's index is `first`),
/// which hold one period of `period` events or two, by allocation position; and, over one
/// period, how many were held longer than it (those are left out).
///
/// Over one period, a free of a block allocated in the period before (which the detector
/// found equal to this one) wraps around: that block, allocated at the same position here,
/// is freed at this position in the next period. Over two periods, only blocks allocated and
/// freed within them are paired directly; one allocated in the second period and freed after
/// it lives as its twin of the first period did, one period later.
pub(super) fn lives(events: &[Entry], first: u64, period: usize) -> (Vec<(u32, Life)>, usize) {
    let n = events.len();
    let one = n == period;
    let mut long = 0;
    let mut end = vec![NONE; n];
    for (j, e) in events.iter().enumerate() {
        if e.born == NONE {
            continue;
        }
        let a = if e.born >= first {
            e.born - first
        } else if one && e.born + n as u64 >= first && e.born + n as u64 - first > j as u64 {
            e.born + n as u64 - first
        } else {
            // held longer than a period (two of it live at once), or born before the job
            // repeated
            long += usize::from(one);
            continue;
        };
        let Some(alloc) = events.get(a as usize) else {
            continue;
        };
        if alloc.born != NONE || alloc.size != e.size || end[a as usize] != NONE {
            continue;
        }
        end[a as usize] = j as u64;
    }
    if !one {
        for a in period..n {
            let t = a - period;
            if events[a].born != NONE || end[a] != NONE || end[t] == NONE || end[t] < t as u64 {
                continue;
            }
            let free = end[t] + period as u64;
            if free >= n as u64 && free - (n as u64) < a as u64 {
                end[a] = free - n as u64;
            }
        }
    }
    let lives = end
        .iter()
        .enumerate()
        .filter(|&(_, &e)| e != NONE)
        .map(|(a, &e)| {
            (
                a as u32,
                Life {
                    size: events[a].size,
                    start: a as u32,
                    end: e as u32,
                },
            )
        })
        .collect();
    (lives, long)
}

/// A plan computed from one period, before its region exists.
#[derive(Debug)]
pub(in crate::pool) struct Layout {
    /// the print of each position, rotated so that position 0 is where the fewest planned
    /// bytes are held (the plan starts there); with `slot_at`, taken by [`Plan::new`] into
    /// the plan's positions (empty after)
    pub(super) prints: Vec<u64>,
    /// per position, the slot its allocation takes
    pub(super) slot_at: Vec<u32>,
    /// per slot, its offset and bytes
    pub(super) slots: Vec<(u64, u64)>,
    /// per slot, its life (positions from the plan's start)
    pub(super) lives: Vec<Life>,
    /// bytes the layout spans from its region's start (whole pages)
    pub(super) region: u64,
    /// the job's period (`prints` holds it twice where blocks live longer than it)
    pub(super) half: u32,
    /// the detector's event from which the job's events were the layout's: where the events
    /// it was made from begin (see `plan_around`)
    pub(super) seen: u64,
    /// the detector's event at the plan's position 0 among those (the job's event `e` is at
    /// position `(e - origin) % prints.len()` while it repeats)
    pub(super) origin: u64,
    /// the segment the plan takes over (index and address), if any
    pub(super) home: Option<(u32, u64)>,
    pub(super) stream: Stream,
}

/// Build a layout from the last periods of events on `stream` (others stay dynamic):
/// `events` holds one period of `period` events or two, the first one's index `first`. Blocks
/// held longer than a period (an output a training loop keeps until the next step replaces
/// it) are planned over two periods, where each of their two copies has a place of its own;
/// `None` when there is nothing worth planning.
pub(super) fn layout(
    events: &[Entry],
    first: u64,
    period: u64,
    stream: Stream,
    page: u64,
    home: Option<Home>,
) -> Option<Layout> {
    let skip = events.len() - period as usize;
    let (mut all, long) = lives(&events[skip..], first + skip as u64, period as usize);
    let half = period as u32;
    let (events, seen) = if long > 0 && skip >= period as usize {
        let skip = skip - period as usize;
        all = lives(&events[skip..], first + skip as u64, period as usize).0;
        (&events[skip..], first + skip as u64)
    } else {
        (&events[skip..], first + skip as u64)
    };
    let period = events.len() as u32;
    // only blocks of `stream`: the print mixes the stream in, so compare with its own
    let mine: Vec<(u32, Life)> = all
        .into_iter()
        .filter(|(a, l)| events[*a as usize].print == repeat::print(false, l.size, stream.0))
        .collect();
    if mine.len() < MIN_ALLOCS
        || place_work(mine.iter().map(|(_, l)| l), mine.len(), period) > MAX_WORK
    {
        return None;
    }
    // where the fewest planned bytes are held: the plan starts at that allocation
    let held = held_bytes(mine.iter().map(|(_, l)| l), period);
    let start = mine
        .iter()
        .map(|(a, _)| *a)
        .min_by_key(|&a| {
            // bytes held just before the allocation at `a`
            held[((a + period - 1) % period) as usize]
        })
        .expect("MIN_ALLOCS > 0");
    let rot = |x: u32| (x + period - start) % period;
    let lives: Vec<Life> = mine
        .iter()
        .map(|(_, l)| Life {
            size: l.size,
            start: rot(l.start),
            end: rot(l.end),
        })
        .collect();
    // a plan with a home is placed at its first start around what is in the way then
    // (`plan_place_at_start`), mended from these offsets where the blocks that stay are
    // still the ones in the way (`Plan::repaired`): so they are placed as a start places
    // (the first wave of `place_pinned`'s tries; the second waits for a start that needs
    // it). Two quick tries placed them looser: ViT's replay, mended from those at its first
    // start, held 1.0106 of live over its last steps where a start's placement holds 1.0029.
    // (The full search, tried in the pages mapped first and then around the fixed blocks
    // alone, 26 tries, took 28 ms of gptfix's layout on the dev VM.)
    let (offsets, total) = match &home {
        Some(h) => place_pinned(&lives, period, &h.fixed, &[], true, 0),
        None => place(&lives, period, &[]),
    };
    let mut slot_at = vec![NO_SLOT; period as usize];
    let mut slots = Vec::with_capacity(lives.len());
    for (i, l) in lives.iter().enumerate() {
        slot_at[l.start as usize] = i as u32;
        slots.push((offsets[i], l.size));
    }
    let prints = (0..period)
        .map(|k| events[((k + start) % period) as usize].print)
        .collect();
    Some(Layout {
        prints,
        slot_at,
        slots,
        lives,
        region: total.div_ceil(page).max(1) * page,
        home: home.map(|h| (h.seg, h.addr)),
        half,
        seen,
        origin: seen + u64::from(start),
        stream,
    })
}

/// The placer's work for `n` blocks with lives `lives` over `period` positions: every pair
/// of blocks is told apart by a mask, and a pair whose lives meet costs [`MEETING_COST`]
/// such pairs more. A pair meets where one's life begins while the other is held, so each
/// block counts the blocks held where its own life begins (itself too: the count is about).
pub(super) fn place_work<'a>(
    lives: impl Iterator<Item = &'a Life> + Clone,
    n: usize,
    period: u32,
) -> u64 {
    let mut diff = vec![0i64; period as usize + 1];
    for l in lives.clone() {
        for (a, b) in l.spans(period) {
            if a < b {
                diff[a as usize] += 1;
                diff[b as usize] -= 1;
            }
        }
    }
    let mut held = Vec::with_capacity(period as usize);
    let mut now = 0i64;
    for d in &diff[..period as usize] {
        now += d;
        held.push(now.max(0) as u64);
    }
    let meeting: u64 = lives
        .map(|l| held[l.start as usize % held.len().max(1)])
        .sum();
    (n as u64).pow(2) + MEETING_COST * meeting
}
