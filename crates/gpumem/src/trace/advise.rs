//! Advice from a trace (Genesis' "analyze allocation patterns" and warm-up): replay a grid of
//! configurations over the trace's demand, pick the one that reserves least, and the one that
//! reserves least among those whose modelled driver time stays within 1% of the trace's wall
//! time (where the trace has times), and name the warm-up sizes: the allocations that missed the cache before the reserved peak
//! was first reached, which [`crate::CachingAllocator::reserve`] could have served from the
//! start.

use super::replay::{replay_simulated, PolicyReport, SIM_CAPACITY};
use super::{Action, TraceEvent};
use crate::config::Config;
use crate::error::Result;
use serde::Serialize;

/// Configurations tried besides the default (and any the caller adds).
pub const GRID: &[&str] = &[
    "expandable_segments:False",
    "expandable_segments:False,roundup_power2_divisions:4",
    "expandable_segments:False,max_split_size_mb:64",
    "expandable_segments:False,garbage_collection_threshold:0.8",
    // larger pages: fewer, cheaper moves (set-access and unmap are paid per mapping) for more
    // memory in the pages free blocks share with live ones
    "expandable_page_mb:4",
    "expandable_page_mb:8",
    "expandable_page_mb:16",
    "roundup_power2_divisions:4",
    "quick_cache:0",
    // more blocks held back from coalescing: the old default, which packs some fixed-shape
    // jobs tighter once moves stop and jobs of varying sizes worse
    "quick_cache:16",
];

/// Share of the trace's wall time the chosen configuration's driver calls may take.
pub const TIME_BUDGET: f64 = 0.01;

/// One configuration's replay.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// configuration string (`""`: the default)
    pub conf: String,
    /// its replay
    pub report: PolicyReport,
    /// within [`TIME_BUDGET`] (true where the trace has no times)
    pub within_time_budget: bool,
}

/// What [`advise`] found.
#[derive(Debug, Clone, Serialize)]
pub struct Advice {
    /// every configuration tried, the default first
    pub candidates: Vec<Candidate>,
    /// index in `candidates` of the one that reserves least (modelled driver time breaks ties)
    pub best: usize,
    /// index of the one that reserves least among those within [`TIME_BUDGET`], if any
    pub best_within_budget: Option<usize>,
    /// peak reserved bytes the best saves over the default (negative: it reserves more)
    pub saved_bytes: i64,
    /// modelled driver time on the allocating thread the best saves over the default, µs
    pub saved_us: f64,
    /// warm-up sizes: `(bytes, count)` of the allocations that missed the cache (made a
    /// driver call) before the default's reserved peak was first reached, largest first
    pub warmup: Vec<(u64, u64)>,
    /// how many allocations that is
    pub warmup_misses: u64,
}

/// Replay `events` under the default configuration, [`GRID`] and `extra`, and advise.
pub fn advise(name: &str, events: &[TraceEvent], extra: &[String]) -> Result<Advice> {
    let mut confs: Vec<String> = std::iter::once(String::new())
        .chain(GRID.iter().map(|s| s.to_string()))
        .chain(extra.iter().cloned())
        .collect();
    confs.dedup();
    let mut candidates = Vec::with_capacity(confs.len());
    let mut warmup = Vec::new();
    let mut warmup_misses = 0;
    for (i, conf) in confs.iter().enumerate() {
        let config = Config::parse(conf)?;
        let r = replay_simulated(name, events, &config, SIM_CAPACITY, None)?;
        if i == 0 {
            (warmup, warmup_misses) = first_misses(events, &r.timeline, &r.calls);
        }
        let within = r
            .report
            .critical_path_share
            .is_none_or(|s| s <= TIME_BUDGET);
        candidates.push(Candidate {
            conf: conf.clone(),
            report: r.report,
            within_time_budget: within,
        });
    }
    let least = |only_within: bool| {
        (0..candidates.len())
            .filter(|&i| !only_within || candidates[i].within_time_budget)
            .min_by(|&a, &b| {
                let (x, y) = (&candidates[a].report, &candidates[b].report);
                x.peak_reserved_bytes
                    .cmp(&y.peak_reserved_bytes)
                    .then(x.critical_path_us.total_cmp(&y.critical_path_us))
                    .then(a.cmp(&b))
            })
    };
    let best = least(false).unwrap_or(0);
    let best_within_budget = least(true);
    let (d, b) = (&candidates[0].report, &candidates[best].report);
    Ok(Advice {
        saved_bytes: d.peak_reserved_bytes as i64 - b.peak_reserved_bytes as i64,
        saved_us: d.critical_path_us - b.critical_path_us,
        candidates,
        best,
        best_within_budget,
        warmup,
        warmup_misses,
    })
}

/// The allocations that made a driver call before reserved bytes first reached their peak.
fn first_misses(
    events: &[TraceEvent],
    timeline: &[(u64, u64, u64)],
    calls: &[u64],
) -> (Vec<(u64, u64)>, u64) {
    let peak = timeline.iter().map(|t| t.2).max().unwrap_or(0);
    let until = timeline
        .iter()
        .position(|t| t.2 == peak)
        .unwrap_or(timeline.len());
    let mut sizes: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut misses = 0;
    let mut before = 0;
    for (i, e) in events.iter().enumerate().take(until.saturating_add(1)) {
        let after = calls.get(i).copied().unwrap_or(before);
        if e.action == Action::Alloc && after > before {
            *sizes.entry(e.size).or_default() += 1;
            misses += 1;
        }
        before = after;
    }
    let mut v: Vec<(u64, u64)> = sizes.into_iter().collect();
    v.sort_by_key(|w| std::cmp::Reverse(w.0));
    (v, misses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::synthetic::Kind;

    #[test]
    fn advice_names_a_configuration_no_worse_than_the_default_and_the_warmup() {
        let events = Kind::VariableSeqLen.generate_steps(3, 4);
        let a = advise("varlen", &events, &["expandable_page_mb:32".into()]).unwrap();
        assert_eq!(a.candidates.len(), GRID.len() + 2);
        assert_eq!(a.candidates[0].conf, "");
        let best = &a.candidates[a.best].report;
        if let Some(w) = a.best_within_budget {
            assert!(a.candidates[w].within_time_budget);
            assert!(a.candidates[w].report.peak_reserved_bytes >= best.peak_reserved_bytes);
        }
        assert!(best.peak_reserved_bytes <= a.candidates[0].report.peak_reserved_bytes);
        assert!(a.saved_bytes >= 0);
        assert!(a.warmup_misses > 0, "a fresh pool misses in its first step");
        assert_eq!(a.warmup.iter().map(|w| w.1).sum::<u64>(), a.warmup_misses);
        assert!(
            a.warmup.windows(2).all(|w| w[0].0 > w[1].0),
            "largest first"
        );
    }

    #[test]
    fn a_bad_extra_configuration_is_an_error() {
        let events = Kind::VariableSeqLen.generate_steps(3, 1);
        assert!(advise("t", &events, &["bogus:1".into()]).is_err());
    }
}
