//! `memory_summary()`: a text table in the manner of `torch.cuda.memory_summary()`.

use super::stats::{Stat, StatArray, Stats};
pub use crate::units::human;
use std::fmt::Write;

/// Render the stats as a table. `title` names the device/backend.
pub fn memory_summary(title: &str, s: &Stats) -> String {
    let mut out = String::new();
    let rule = "=".repeat(79);
    let thin = "-".repeat(79);
    let _ = writeln!(out, "{rule}");
    let _ = writeln!(out, "|{:^77}|", format!("gpumem memory summary, {title}"));
    let _ = writeln!(out, "|{:^77}|", "");
    let _ = writeln!(
        out,
        "|  retries: {:<8} OOMs: {:<8} cache hits: {:<10} misses: {:<13}|",
        s.num_alloc_retries, s.num_ooms, s.cache_hits, s.cache_misses
    );
    let _ = writeln!(out, "{rule}");
    let _ = writeln!(
        out,
        "| {:<25}| {:>11} | {:>11} | {:>11} | {:>11} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    let rows: [(&str, &StatArray, bool); 9] = [
        ("Allocated memory", &s.allocated_bytes, true),
        ("Active memory", &s.active_bytes, true),
        ("Requested memory", &s.requested_bytes, true),
        ("GPU reserved memory", &s.reserved_bytes, true),
        ("Non-releasable memory", &s.inactive_split_bytes, true),
        ("Allocations", &s.allocation, false),
        ("Active allocs", &s.active, false),
        ("GPU reserved segments", &s.segment, false),
        ("Non-releasable allocs", &s.inactive_split, false),
    ];
    for (name, arr, bytes) in rows {
        let _ = writeln!(out, "{thin}");
        let fmt = |v: u64| if bytes { human(v) } else { v.to_string() };
        let line = |out: &mut String, label: &str, st: &Stat| {
            let _ = writeln!(
                out,
                "| {:<25}| {:>11} | {:>11} | {:>11} | {:>11} |",
                label,
                fmt(st.current),
                fmt(st.peak),
                fmt(st.allocated),
                fmt(st.freed)
            );
        };
        line(&mut out, name, &arr.all);
        line(&mut out, "      from large pool", &arr.large_pool);
        line(&mut out, "      from small pool", &arr.small_pool);
    }
    let _ = writeln!(out, "{thin}");
    let _ = writeln!(
        out,
        "| device allocs: {:<8} device frees: {:<8} cross-stream reuses: {:<13}|",
        s.num_device_alloc, s.num_device_free, s.num_cross_stream_reuses
    );
    let _ = writeln!(out, "{rule}");
    out
}
