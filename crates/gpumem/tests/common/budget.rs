//! The time budget of page moves, checked on a replay. Included with `#[path]` by the tests
//! that replay traces.

use gpumem::pool::{MOVE_BUDGET_CAP_NS, MOVE_BUDGET_SHARE};
use gpumem::trace::{PolicyReport, TraceEvent};

/// The moves of a replay of `events` took at most 1% of its wall time plus what growth took,
/// plus the credit's cap and three of the longest move (the bound that holds by construction:
/// the credit starts empty and accrues 1% of the time, and is full again, its overdraft
/// forgiven, at the end of the warm-up; moves it does not pay may take as long as growth
/// did).
pub fn assert_within_budget(name: &str, events: &[TraceEvent], r: &PolicyReport) {
    // (as the replay's wall time: events with no time read 0 and do not count)
    let first = events
        .iter()
        .map(|e| e.time_us)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    let last = events.iter().map(|e| e.time_us).max().unwrap_or(0);
    // the wall time, with the modelled calls that lengthened it
    let wall_us = (last - first) as f64 + r.critical_path_us;
    let bound = MOVE_BUDGET_SHARE * wall_us
        + MOVE_BUDGET_CAP_NS / 1e3
        + r.growth_us
        + 3.0 * r.move_longest_us;
    assert!(
        r.move_us <= bound,
        "{name}: moves took {:.1} ms, above {:.1} ms (1% of {:.0} ms, the 10 ms cap, growth's \
         {:.1} ms and three of the longest move)",
        r.move_us / 1e3,
        bound / 1e3,
        wall_us / 1e3,
        r.growth_us / 1e3
    );
}
