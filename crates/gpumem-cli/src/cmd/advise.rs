//! `gpumem advise`: the configuration that reserves least for a trace's demand (its driver
//! time within 1% of the trace's wall time, where the trace has times), what it saves over
//! the default, and the warm-up sizes that would turn the first step's misses into hits.

use crate::output::{emit, Result};
use gpumem::trace::advise::{advise, Advice};
use gpumem::units::human;
use serde::Serialize;

#[derive(Serialize)]
struct AdviseOut {
    trace: String,
    events: usize,
    advice: Advice,
}

pub fn run(trace: &std::path::Path, extra: &[String], json: bool) -> Result<()> {
    let events = gpumem::trace::read_trace(trace)?;
    if !events
        .iter()
        .any(|e| e.action == gpumem::trace::Action::Alloc)
    {
        return Err(format!("{}: no allocations to advise on", trace.display()).into());
    }
    let name = trace.display().to_string();
    let advice = advise(&name, &events, extra).map_err(|e| format!("{name}: {e}"))?;
    let out = AdviseOut {
        trace: name,
        events: events.len(),
        advice,
    };
    emit(json, &out, print)
}

fn print(o: &AdviseOut) {
    let a = &o.advice;
    println!(
        "{} ({} events): configurations replayed on the simulator",
        o.trace, o.events
    );
    println!(
        "  {:<58} {:>12} {:>7} {:>8} {:>10}",
        "configuration", "reserved", "ratio", "calls", "driver"
    );
    for (i, c) in a.candidates.iter().enumerate() {
        let r = &c.report;
        let share = r
            .critical_path_share
            .map_or("-".to_string(), |s| format!("{:.2}%", s * 100.0));
        let mark = if i == a.best { "*" } else { " " };
        let conf = if c.conf.is_empty() {
            "(default)"
        } else {
            c.conf.as_str()
        };
        println!(
            "{mark} {:<58} {:>12} {:>7.3} {:>8} {:>10}{}",
            conf,
            human(r.peak_reserved_bytes),
            r.ratio,
            r.device_calls,
            share,
            if c.within_time_budget {
                ""
            } else {
                "  (over the 1% time budget)"
            }
        );
    }
    let name = |i: usize| {
        if a.candidates[i].conf.is_empty() {
            "the default".to_string()
        } else {
            format!("GPUMEM_CONF='{}'", a.candidates[i].conf)
        }
    };
    let d = &a.candidates[0].report;
    if a.best == 0 {
        println!("least memory (*): the default (no configuration tried reserves less)");
    } else {
        println!(
            "least memory (*): {}: saves {} of peak reserved and {:.0} µs of modelled driver \
             time against the default",
            name(a.best),
            human(a.saved_bytes.max(0) as u64),
            a.saved_us
        );
    }
    match a.best_within_budget {
        Some(w) if w != a.best => {
            let r = &a.candidates[w].report;
            println!(
                "within 1% of the trace's time: {}: peak reserved {} ({:+.1}% against the \
                 default), driver time {:.0} µs less",
                name(w),
                human(r.peak_reserved_bytes),
                (r.peak_reserved_bytes as f64 / d.peak_reserved_bytes.max(1) as f64 - 1.0) * 100.0,
                d.critical_path_us - r.critical_path_us
            );
        }
        Some(_) => println!("it is also within 1% of the trace's time"),
        None => println!("none tried stays within 1% of the trace's time"),
    }
    if a.warmup_misses > 0 {
        let list: Vec<String> = a
            .warmup
            .iter()
            .take(12)
            .map(|(b, n)| format!("{} x{n}", human(*b)))
            .collect();
        println!(
            "warm-up: {} allocations missed the cache before the reserved peak; reserving these \
             sizes first (CachingAllocator::reserve) turns them into hits: {}{}",
            a.warmup_misses,
            list.join(", "),
            if a.warmup.len() > 12 { ", ..." } else { "" }
        );
    }
}
