//! `gpumem viz`: one self-contained HTML file (inline SVG, no scripts, no network) with
//!
//! - a memory timeline: the biggest allocations stacked as bands in the order they were made
//!   (as in PyTorch's memory_viz), the rest of the live bytes above them, gpumem's reserved bytes
//!   and the recording allocator's reserved bytes as lines. Each column draws the envelope of
//!   the events it covers (the highest live bytes, with the bands as they were at that moment,
//!   and the highest reserved bytes of each line), so the drawn maxima are the figures in the
//!   table; the peaks are marked, and the trace's time runs under the event axis;
//! - a segment map at gpumem's reserved peak: every segment (for expandable segments, the
//!   mapped pages) with its blocks, coloured by use: requested bytes, rounding, free (cached or
//!   fragmented).

use crate::output::Result;
use gpumem::pool::SegmentInfo;
use gpumem::trace::{Action, Replay, TraceEvent};
use gpumem::units::{human, size_label};
use std::fmt::Write as _;
use std::path::Path;

/// Columns of the timeline.
const COLUMNS: usize = 480;
/// Allocations drawn as their own band.
const BANDS: usize = 160;
const W: f64 = 1200.0;
const H: f64 = 420.0;

pub fn write(trace: &Path, output: &Path, conf: Option<&str>) -> Result<()> {
    let events = gpumem::trace::read_trace(trace)?;
    if !events.iter().any(|e| e.action == Action::Alloc) {
        return Err(format!(
            "{}: the trace has no allocations ({} events): nothing to draw",
            trace.display(),
            events.len()
        )
        .into());
    }
    if conf.is_some_and(|c| c.trim().is_empty()) {
        return Err("--conf \"\": an empty configuration string names no policy".into());
    }
    // --conf, else GPUMEM_CONF, else the default policy
    let config = crate::output::config_from(conf)?;
    let name = conf.unwrap_or("gpumem");
    // (on the simulator with the trace's clock, as `gpumem replay` does)
    let replay =
        gpumem::trace::replay_simulated(name, &events, &config, gpumem::trace::SIM_CAPACITY, None)
            .map_err(|e| format!("{}: {e}", trace.display()))?;
    let html = render(&trace.display().to_string(), &events, &replay);
    std::fs::write(output, html).map_err(|e| format!("{}: {e}", output.display()))?;
    eprintln!(
        "wrote {} ({} events, peak reserved {} for {} live, ratio {:.3})",
        output.display(),
        events.len(),
        human(replay.report.peak_reserved_bytes),
        human(replay.report.peak_live_bytes),
        replay.report.ratio
    );
    Ok(())
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// One allocation of the trace: replayed-event indices of its alloc and free.
struct Life {
    size: u64,
    start: usize,
    end: usize,
}

pub fn render(title: &str, events: &[TraceEvent], replay: &Replay) -> String {
    // lifetimes in replayed-event indices, and the recorder's reserved bytes at each index
    let mut lives: Vec<Life> = Vec::new();
    let mut open: std::collections::HashMap<u64, usize> = Default::default();
    let mut recorded = Vec::with_capacity(replay.timeline.len());
    let (mut rec_reserved, mut idx) = (0u64, 0usize);
    for e in events {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => rec_reserved += e.size,
            Action::SegmentFree | Action::SegmentUnmap => {
                rec_reserved = rec_reserved.saturating_sub(e.size)
            }
            Action::Alloc => {
                open.insert(e.addr, lives.len());
                lives.push(Life {
                    size: e.size,
                    start: idx,
                    end: usize::MAX,
                });
                recorded.push(rec_reserved);
                idx += 1;
            }
            Action::FreeCompleted => {
                if let Some(l) = open.remove(&e.addr) {
                    lives[l].end = idx;
                }
                recorded.push(rec_reserved);
                idx += 1;
            }
            Action::FreeRequested | Action::Snapshot | Action::Oom | Action::EmptyCache => {}
        }
    }
    let n = replay.timeline.len().max(1);
    let report = &replay.report;
    let scale = Scale::new(&replay.timeline, &recorded);
    let (x, y) = (|i: usize| scale.x(i), |b: u64| scale.y(b));

    // bands: the biggest allocations live when live bytes peaked (what the peak is made of),
    // then the biggest others
    let peak_at = first_max(0..=n - 1, |i| replay.timeline.get(i).map_or(0, |t| t.1));
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_by_key(|&i| {
        let l = &lives[i];
        (
            l.start > peak_at || l.end <= peak_at,
            std::cmp::Reverse(l.size),
        )
    });
    let mut banded = vec![false; lives.len()];
    for &i in order.iter().take(BANDS) {
        banded[i] = true;
    }
    // each column covers the events since the previous one and draws their envelope: the
    // highest live bytes (the bands as they were at that event) and each line's highest
    // reserved bytes
    let cols: Vec<usize> = (0..=COLUMNS).map(|c| c * (n - 1) / COLUMNS).collect();
    let mut edges: Vec<Vec<(usize, u64, u64)>> = vec![Vec::new(); lives.len()];
    let mut other_top = Vec::with_capacity(cols.len());
    let (mut ours_top, mut rec_top) = (Vec::with_capacity(cols.len()), Vec::new());
    for (c, &end) in cols.iter().enumerate() {
        let r = (if c == 0 { 0 } else { cols[c - 1] + 1 }).min(end)..=end;
        let at = first_max(r.clone(), |i| replay.timeline[i].1);
        let mut base = 0u64;
        for (i, l) in lives.iter().enumerate() {
            if l.start > at {
                break;
            }
            if banded[i] && l.end > at {
                edges[i].push((c, base, base + l.size));
                base += l.size;
            }
        }
        other_top.push((base, replay.timeline[at].1.max(base)));
        ours_top.push(r.clone().map(|i| replay.timeline[i].2).max().unwrap_or(0));
        rec_top.push(
            r.map(|i| recorded.get(i).copied().unwrap_or(0))
                .max()
                .unwrap_or(0),
        );
    }
    let cx = |c: usize| x(cols[c]);

    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"##
    );
    // axes and grid: round byte ticks, and round event ticks along the bottom
    let ystep = nice_step(scale.ymax as u64, 6, &BYTE_UNITS);
    let mut b = 0u64;
    while (b as f64) <= scale.ymax {
        let yy = y(b);
        let _ = write!(
            svg,
            r##"<line x1="60" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="55" y="{:.1}" text-anchor="end">{}</text>"##,
            W - 20.0,
            yy + 4.0,
            if b == 0 {
                "0".to_string()
            } else {
                size_label(b)
            }
        );
        b += ystep;
    }
    let xstep = nice_step(n as u64, 10, &COUNT_UNITS);
    // (events with no time read 0)
    let t0 = replay
        .timeline
        .iter()
        .map(|t| t.0)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    let timed = replay.timeline.last().is_some_and(|t| t.0 > t0);
    let mut i = 0u64;
    while i <= n as u64 {
        let xx = x(i as usize);
        let _ = write!(
            svg,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{:.1}" y2="{:.1}" stroke="#999"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            H - 40.0,
            H - 36.0,
            H - 26.0,
            count_label(i)
        );
        // the trace's own time at that event, where it has times
        if let Some(t) = replay
            .timeline
            .get(i as usize)
            .map(|t| t.0)
            .filter(|&t| timed && t > 0)
        {
            let _ = write!(
                svg,
                r##"<text x="{xx:.1}" y="{:.1}" text-anchor="middle" fill="#666">{}</text>"##,
                H - 15.0,
                time_label(t.saturating_sub(t0))
            );
        }
        i += xstep;
    }
    // "other" live bytes above the bands
    let mut pts = String::new();
    for (c, &(_, top)) in other_top.iter().enumerate() {
        let _ = write!(pts, "{:.1},{:.1} ", cx(c), y(top));
    }
    for (c, &(base, _)) in other_top.iter().enumerate().rev() {
        let _ = write!(pts, "{:.1},{:.1} ", cx(c), y(base));
    }
    let _ = write!(
        svg,
        r##"<polygon points="{pts}" fill="#c8c8c8"><title>smaller allocations</title></polygon>"##
    );
    // bands
    for (i, e) in edges.iter().enumerate() {
        if e.is_empty() {
            continue;
        }
        let mut pts = String::new();
        for &(c, _, top) in e {
            let _ = write!(pts, "{:.1},{:.1} ", cx(c), y(top));
        }
        for &(c, lo, _) in e.iter().rev() {
            let _ = write!(pts, "{:.1},{:.1} ", cx(c), y(lo));
        }
        let hue = (i * 47) % 360;
        let _ = write!(
            svg,
            r##"<polygon points="{pts}" fill="hsl({hue},60%,62%)" stroke="hsl({hue},60%,42%)" stroke-width="0.3"><title>{} allocated at event {}</title></polygon>"##,
            human(lives[i].size),
            lives[i].start
        );
    }
    // reserved lines: each column's highest reserved bytes
    let line = |tops: &[u64]| {
        let mut d = String::new();
        for (c, &v) in tops.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if d.is_empty() { "M" } else { " L" },
                cx(c),
                y(v)
            );
        }
        d
    };
    let rec = if recorded.iter().any(|&r| r > 0) {
        line(&rec_top)
    } else {
        String::new() // no recording allocator in the trace: no line
    };
    let ours = line(&ours_top);
    let _ = write!(
        svg,
        r##"<path d="{ours}" fill="none" stroke="#1f3fbf" stroke-width="3.5"><title>{}: reserved</title></path><path d="{rec}" fill="none" stroke="#d62728" stroke-width="1.6" stroke-dasharray="6,4"><title>recorded allocator: reserved</title></path>"##,
        esc(&report.name)
    );
    // the peaks: live bytes, and gpumem's reserved bytes
    let reserved_at = first_max(0..=n - 1, |i| replay.timeline.get(i).map_or(0, |t| t.2));
    for (at, bytes, what, colour, dy) in [
        (
            peak_at,
            replay.timeline.get(peak_at).map_or(0, |t| t.1),
            "peak live",
            "#333",
            0.0,
        ),
        (
            reserved_at,
            report.peak_reserved_bytes,
            "peak reserved",
            "#1f3fbf",
            12.0,
        ),
    ] {
        let c = cols.partition_point(|&e| e < at).min(cols.len() - 1);
        let (xx, yy) = (cx(c), y(bytes));
        let when = replay
            .timeline
            .get(at)
            .filter(|_| timed)
            .map_or(String::new(), |t| {
                format!(", {}", time_label(t.0.saturating_sub(t0)))
            });
        let _ = write!(
            svg,
            r##"<line class="peak" x1="{xx:.1}" x2="{xx:.1}" y1="{yy:.1}" y2="{:.1}" stroke="{colour}" stroke-dasharray="2,2"/><circle cx="{xx:.1}" cy="{yy:.1}" r="3" fill="{colour}"/><text x="{:.1}" y="{:.1}" fill="{colour}" text-anchor="{}">{what} {} at event {at}{when}</text>"##,
            H - 40.0,
            if xx > W / 2.0 { xx - 6.0 } else { xx + 6.0 },
            yy - 6.0 - dy,
            if xx > W / 2.0 { "end" } else { "start" },
            human(bytes)
        );
    }
    let _ = write!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="middle">allocator events: allocations and frees, in trace order (the trace's time below) →</text></svg>"##,
        W / 2.0,
        H - 2.0
    );

    let recorded_report = gpumem::trace::recorded(events);
    // a trace with no segment events (a synthetic one) says nothing of an allocator
    let has_recorder = recorded_report.device_calls > 0;
    let recorded_row = if has_recorder {
        format!(
            "<tr><td>recorded</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>–</td></tr>",
            human(recorded_report.peak_live_bytes),
            human(recorded_report.peak_reserved_bytes),
            recorded_report.ratio,
            recorded_report.segments_at_peak
        )
    } else {
        format!(
            "<tr><td>recorded</td><td>{}</td><td colspan=\"4\">n/a: the trace records no segments</td></tr>",
            human(recorded_report.peak_live_bytes)
        )
    };
    let recorded_legend = if has_recorder {
        r##"<span><i class="sw" style="height:2px;background:repeating-linear-gradient(90deg,#d62728 0 6px,transparent 6px 10px)"></i>recorded allocator reserved (dashed, drawn on top)</span>"##
    } else {
        ""
    };
    let mut html = String::new();
    let _ = write!(
        html,
        r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gpumem: {t}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
.legend span {{ display: inline-block; margin-right: 16px; font-size: 13px; }}
.sw {{ display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px; }}
</style></head><body>
<h1>Memory of {t}</h1>
<table><tr><th>allocator</th><th>peak live</th><th>peak reserved</th><th>reserved / live</th><th>segments at peak</th><th>largest free at peak</th></tr>
{recorded_row}
<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td></tr></table>
<h2>Timeline</h2>
<div class="legend"><span><i class="sw" style="width:36px;background:linear-gradient(90deg,hsl(0,60%,62%),hsl(94,60%,62%),hsl(188,60%,62%),hsl(282,60%,62%))"></i>the {BANDS} biggest allocations, one colour each (those live at the peak first), stacked in the order they were made</span><span><i class="sw" style="background:#c8c8c8"></i>all other live bytes</span><span><i class="sw" style="height:4px;background:#1f3fbf"></i>{} reserved (thick)</span>{recorded_legend}</div>
{svg}
"##,
        esc(&report.name),
        human(report.peak_live_bytes),
        human(report.peak_reserved_bytes),
        report.ratio,
        report.segments_at_peak,
        human(report.largest_free_block_at_peak),
        esc(&report.name),
        t = esc(title),
    );
    html.push_str(&segment_map(&report.name, &replay.segments_at_peak));
    html.push_str("</body></html>\n");
    html
}

/// The segment map: one row per segment, labelled (pool, stream, address, size), on one scale
/// (the widest row fills the width); an expandable segment's row spans its mapped pages, with
/// the unmapped gaps between them left blank.
fn segment_map(policy: &str, segments: &[SegmentInfo]) -> String {
    // rows: (label, start, span, the segment)
    let mut rows: Vec<(String, u64, u64, &SegmentInfo)> = Vec::new();
    for s in segments {
        let (Some(lo), Some(hi)) = (
            s.mapped.iter().map(|m| m.0).min(),
            s.mapped.iter().map(|m| m.0 + m.1).max(),
        ) else {
            continue;
        };
        let mapped: u64 = s.mapped.iter().map(|m| m.1).sum();
        let label = if s.expandable {
            format!(
                "{:?} pool, stream {}, {}: {} mapped in {} piece{} over {} at {lo:#x}",
                s.kind,
                s.stream.0,
                if s.planned {
                    "planned layout"
                } else {
                    "expandable"
                },
                human(mapped),
                s.mapped.len(),
                if s.mapped.len() == 1 { "" } else { "s" },
                human(hi - lo)
            )
        } else {
            format!(
                "{:?} pool, stream {}, segment of {} at {lo:#x}",
                s.kind,
                s.stream.0,
                human(s.size)
            )
        };
        rows.push((label, lo, hi - lo, s));
    }
    let (mut used, mut rounding, mut free) = (0u64, 0u64, 0u64);
    let (planned, dynamic): (u64, u64) = segments.iter().fold((0, 0), |(p, d), s| {
        let m: u64 = s.mapped.iter().map(|m| m.1).sum();
        if s.planned {
            (p + m, d)
        } else {
            (p, d + m)
        }
    });
    for s in segments {
        for b in &s.blocks {
            let mapped: u64 = s
                .mapped
                .iter()
                .map(|&(a, l)| overlap(b.addr, b.size, a, l))
                .sum();
            if b.allocated {
                used += b.requested;
                rounding += mapped.saturating_sub(b.requested);
            } else {
                free += mapped;
            }
        }
    }
    let mut out = String::new();
    let _ = write!(
        out,
        r##"<h2>Segment map at the reserved peak ({}, {} segments)</h2>
<div class="legend"><span><i class="sw" style="background:#2b6cb0"></i>requested bytes: {}</span><span><i class="sw" style="background:#90cdf4"></i>rounding inside blocks: {}</span><span><i class="sw" style="background:#f6ad55"></i>free but reserved (cached or fragmented): {}</span><span><i class="sw" style="background:#fff;border:1px solid #bbb"></i>not mapped (expandable segments)</span></div>
<p>Reserved at the peak: {} in planned layouts' regions, {} in the dynamic pool.</p>
"##,
        esc(policy),
        rows.len(),
        human(used),
        human(rounding),
        human(free),
        human(planned),
        human(dynamic)
    );
    if rows.is_empty() {
        out.push_str("<p>nothing reserved</p>");
        return out;
    }
    let max = rows.iter().map(|r| r.2).max().unwrap_or(1).max(1);
    let shown = rows.len().min(200);
    let (row_h, label_h) = (14.0, 13.0);
    let pitch = row_h + label_h + 6.0;
    let top = 28.0;
    let height = top + shown as f64 * pitch + 6.0;
    let width = W - 20.0;
    let scale = width / max as f64;
    let _ = write!(
        out,
        r##"<svg width="100%" viewBox="0 0 {W} {height}" style="max-width:{W}px" font-family="sans-serif" font-size="10">"##
    );
    // the scale: round ticks over the widest row
    let step = nice_step(max, 8, &BYTE_UNITS);
    let mut t = 0u64;
    while t <= max {
        let xx = 10.0 + t as f64 * scale;
        let _ = write!(
            out,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="16" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="12" text-anchor="middle">{}</text>"##,
            height - 4.0,
            if t == 0 {
                "0".to_string()
            } else {
                size_label(t)
            }
        );
        t += step;
    }
    for (r, (label, start, len, seg)) in rows.iter().take(shown).enumerate() {
        let y_label = top + r as f64 * pitch + 10.0;
        let y0 = y_label + 3.0;
        let _ = write!(
            out,
            r##"<text x="10" y="{y_label:.1}" fill="#333">{}</text><rect x="10" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#fff" stroke="#bbb" stroke-width="0.5"/>"##,
            esc(label),
            *len as f64 * scale
        );
        for &(a, l) in &seg.mapped {
            let _ = write!(
                out,
                r##"<rect x="{:.2}" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#f6ad55"><title>{} mapped at {a:#x}</title></rect>"##,
                10.0 + (a - start) as f64 * scale,
                (l as f64 * scale).max(0.3),
                human(l)
            );
        }
        for b in &seg.blocks {
            if !b.allocated || overlap(b.addr, b.size, *start, *len) == 0 {
                continue;
            }
            let lo = b.addr.max(*start);
            let hi = (b.addr + b.size).min(start + len);
            let req_hi = (b.addr + b.requested).clamp(lo, hi);
            let xa = 10.0 + (lo - start) as f64 * scale;
            let _ = write!(
                out,
                r##"<rect x="{xa:.2}" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#90cdf4"/><rect x="{xa:.2}" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#2b6cb0"><title>{} requested in a block of {} at {:#x}</title></rect>"##,
                ((hi - lo) as f64 * scale).max(0.3),
                ((req_hi - lo) as f64 * scale).max(0.0),
                human(b.requested),
                human(b.size),
                b.addr
            );
        }
    }
    out.push_str("</svg>");
    if rows.len() > shown {
        let _ = write!(out, "<p>… and {} more segments</p>", rows.len() - shown);
    }
    out
}

/// The timeline's coordinates: event `i` of `n` across, bytes up to `ymax` (5% above the
/// highest live or reserved bytes) up.
struct Scale {
    n: usize,
    ymax: f64,
}

impl Scale {
    fn new(timeline: &[(u64, u64, u64)], recorded: &[u64]) -> Self {
        let ymax = timeline
            .iter()
            .map(|t| t.2.max(t.1))
            .chain(recorded.iter().copied())
            .max()
            .unwrap_or(1)
            .max(1) as f64
            * 1.05;
        Scale {
            n: timeline.len().max(1),
            ymax,
        }
    }

    fn x(&self, i: usize) -> f64 {
        60.0 + (i as f64 / self.n as f64) * (W - 80.0)
    }

    fn y(&self, b: u64) -> f64 {
        20.0 + (H - 60.0) * (1.0 - b as f64 / self.ymax)
    }
}

/// The first index of `range` where `value` is highest (the range's start if it is empty).
fn first_max(range: std::ops::RangeInclusive<usize>, value: impl Fn(usize) -> u64) -> usize {
    let start = *range.start();
    range
        .max_by_key(|&i| (value(i), std::cmp::Reverse(i)))
        .unwrap_or(start)
}

/// Microseconds as a time label: 850 µs, 12.5 ms, 3.2 s, 41 s.
fn time_label(us: u64) -> String {
    match us {
        0..1_000 => format!("{us} µs"),
        1_000..1_000_000 => format!("{:.1} ms", us as f64 / 1e3),
        1_000_000..100_000_000 => format!("{:.1} s", us as f64 / 1e6),
        _ => format!("{:.0} s", us as f64 / 1e6),
    }
}

/// Byte units for axis steps.
const BYTE_UNITS: [u64; 5] = [1, 1 << 10, 1 << 20, 1 << 30, 1 << 40];
/// Count units for axis steps.
const COUNT_UNITS: [u64; 5] = [1, 1_000, 1_000_000, 1_000_000_000, 1_000_000_000_000];

/// The smallest round step (1, 2 or 5 × 10^k of a unit) that cuts `max` into at most `ticks`.
fn nice_step(max: u64, ticks: u64, units: &[u64]) -> u64 {
    for &u in units {
        for m in [1u64, 2, 5, 10, 20, 50, 100, 200, 500] {
            let step = m.saturating_mul(u);
            if max / step < ticks {
                return step.max(1);
            }
        }
    }
    max.max(1)
}

/// An event count as an axis label: 0, 500, 20k, 1.5M.
fn count_label(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 if n % 1_000 == 0 => format!("{}k", n / 1_000),
        1_000..1_000_000 => format!("{:.1}k", n as f64 / 1e3),
        _ if n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

fn overlap(a: u64, n: u64, b: u64, m: u64) -> u64 {
    (a + n).min(b + m).saturating_sub(a.max(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem::trace::TraceEvent;

    /// The y coordinates of an SVG element's points (`points="x,y ..."` or `d="Mx,y Lx,y"`)
    /// that follows `marker` in `svg`.
    fn ys_after(svg: &str, marker: &str, attr: &str) -> Vec<f64> {
        let at = svg.find(marker).expect(marker);
        // the element holding the marker (its title): back to the shape's opening tag
        let start = ["<path", "<polygon"]
            .iter()
            .filter_map(|t| svg[..at].rfind(t))
            .max()
            .unwrap();
        let el = &svg[start..];
        let a = el.find(&format!("{attr}=\"")).unwrap() + attr.len() + 2;
        let b = a + el[a..].find('"').unwrap();
        el[a..b]
            .split([' ', 'M', 'L'])
            .filter_map(|p| p.split_once(','))
            .map(|(_, y)| y.trim().parse().unwrap())
            .collect()
    }

    /// A trace of 20,000 events whose live and reserved peaks (a 5 GiB spike, allocated and
    /// freed with its segment at once) fall between two of the 480 columns' sampled events:
    /// the drawn maxima of live bytes, gpumem's reserved bytes and the recording allocator's
    /// reserved bytes match the reported peaks within one pixel, and the peak is marked.
    #[test]
    fn the_drawn_maxima_are_the_reported_peaks() {
        const MIB: u64 = 1 << 20;
        let mut ev = Vec::new();
        let mut t = 0;
        let mut push = |ev: &mut Vec<TraceEvent>, a, addr, size| {
            t += 10;
            ev.push(TraceEvent::new(a, addr, size, 0, t));
        };
        push(&mut ev, Action::SegmentAlloc, 1 << 40, 64 * MIB);
        for i in 0..10_000u64 {
            let addr = (1 << 40) + (i % 8) * 4 * MIB;
            push(&mut ev, Action::Alloc, addr, 4 * MIB);
            push(&mut ev, Action::FreeCompleted, addr, 4 * MIB);
            if i == 5_003 {
                // (event 10,007: not one of the columns' events, 41.67 apart)
                let big = 1 << 42;
                push(&mut ev, Action::SegmentAlloc, big, 5 << 30);
                push(&mut ev, Action::Alloc, big, 5 << 30);
                push(&mut ev, Action::FreeCompleted, big, 5 << 30);
                push(&mut ev, Action::SegmentFree, big, 5 << 30);
            }
        }
        let cfg =
            gpumem::Config::parse("expandable_segments:False,garbage_collection_threshold:0.5")
                .unwrap();
        let replay = gpumem::trace::replay_simulated("gpumem", &ev, &cfg, 1 << 40, None).unwrap();
        let html = render("spike", &ev, &replay);
        let rec = gpumem::trace::recorded(&ev);
        let (live, reserved) = (rec.peak_live_bytes, replay.report.peak_reserved_bytes);
        assert!(live >= 5 << 30 && rec.peak_reserved_bytes > 5 << 30);
        let mut recorded = Vec::new();
        let mut r = 0u64;
        for e in &ev {
            match e.action {
                Action::SegmentAlloc => r += e.size,
                Action::SegmentFree => r -= e.size,
                Action::Alloc | Action::FreeCompleted => recorded.push(r),
                _ => {}
            }
        }
        let scale = Scale::new(&replay.timeline, &recorded);
        let top = |ys: Vec<f64>| ys.into_iter().fold(f64::INFINITY, f64::min);
        let drawn_live = top(ys_after(&html, "<title>smaller allocations", "points"));
        let drawn_ours = top(ys_after(&html, ": reserved</title>", "d"));
        let drawn_rec = top(ys_after(&html, "recorded allocator: reserved</title>", "d"));
        assert!(
            (drawn_live - scale.y(live)).abs() <= 1.0,
            "{drawn_live} {}",
            scale.y(live)
        );
        assert!((drawn_ours - scale.y(reserved)).abs() <= 1.0);
        assert!((drawn_rec - scale.y(rec.peak_reserved_bytes)).abs() <= 1.0);
        assert!(html.contains("peak live 5.00 GiB at event"), "peak marked");
        // the trace's time runs under the events
        assert!(html.contains(" ms</text>"));
    }
}
