//! `gpumem viz`: one self-contained HTML file (inline SVG, no scripts, no network) with
//!
//! - a memory timeline: the biggest allocations stacked as bands in the order they were made
//!   (as in PyTorch's memory_viz), the rest of the live bytes above them, gpumem's reserved bytes
//!   and the recording allocator's reserved bytes as lines;
//! - a segment map at gpumem's reserved peak: every segment (for expandable segments, the
//!   mapped pages) with its blocks, coloured by use: requested bytes, rounding, free (cached or
//!   fragmented).

use crate::output::Result;
use gpumem::pool::SegmentInfo;
use gpumem::trace::{Action, Replay, TraceEvent};
use gpumem::units::human;
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
    let make = || Ok(gpumem::trace::simulated(gpumem::trace::SIM_CAPACITY));
    let replay = gpumem::trace::replay_detailed(name, &events, &config, &make, &gpumem::Stream)
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
            Action::FreeRequested | Action::Snapshot | Action::Oom => {}
        }
    }
    let n = replay.timeline.len().max(1);
    let report = &replay.report;
    let ymax = replay
        .timeline
        .iter()
        .map(|t| t.2.max(t.1))
        .chain(recorded.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.05;
    let x = |i: usize| 60.0 + (i as f64 / n as f64) * (W - 80.0);
    let y = |b: u64| 20.0 + (H - 60.0) * (1.0 - b as f64 / ymax);

    // bands: the biggest allocations live when live bytes peaked (what the peak is made of),
    // then the biggest others
    let peak_at = replay
        .timeline
        .iter()
        .enumerate()
        .max_by_key(|(_, t)| t.1)
        .map_or(0, |(i, _)| i);
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
    // at each column: the banded allocations live, stacked in allocation order
    let cols: Vec<usize> = (0..=COLUMNS).map(|c| c * (n - 1) / COLUMNS).collect();
    let mut edges: Vec<Vec<(usize, u64, u64)>> = vec![Vec::new(); lives.len()];
    let mut other_top = Vec::with_capacity(cols.len());
    for (c, &t) in cols.iter().enumerate() {
        let mut base = 0u64;
        for (i, l) in lives.iter().enumerate() {
            if l.start > t {
                break;
            }
            if banded[i] && l.end > t {
                edges[i].push((c, base, base + l.size));
                base += l.size;
            }
        }
        // the highest live bytes since the previous column, so that no peak is lost
        let from = if c == 0 { 0 } else { cols[c - 1] + 1 };
        let live = replay.timeline[from.min(t)..=t]
            .iter()
            .map(|p| p.1)
            .max()
            .unwrap_or(0);
        other_top.push((base, live.max(base)));
    }
    let cx = |c: usize| x(cols[c]);

    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"##
    );
    // axes and grid
    for k in 0..=5 {
        let b = (ymax / 1.05 * k as f64 / 5.0) as u64;
        let yy = y(b);
        let _ = write!(
            svg,
            r##"<line x1="60" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="55" y="{:.1}" text-anchor="end">{}</text>"##,
            W - 20.0,
            yy + 4.0,
            human(b)
        );
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
    // reserved lines
    let step = (n / (COLUMNS * 2)).max(1);
    let line = |vals: &mut dyn Iterator<Item = (usize, u64)>| {
        let mut d = String::new();
        for (i, v) in vals {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if d.is_empty() { "M" } else { " L" },
                x(i),
                y(v)
            );
        }
        d
    };
    let rec = line(&mut recorded.iter().copied().enumerate().step_by(step));
    let ours = line(
        &mut replay
            .timeline
            .iter()
            .map(|t| t.2)
            .enumerate()
            .step_by(step),
    );
    let _ = write!(
        svg,
        r##"<path d="{rec}" fill="none" stroke="#d62728" stroke-width="1.6" stroke-dasharray="5,3"><title>recorded allocator: reserved</title></path><path d="{ours}" fill="none" stroke="#1f3fbf" stroke-width="1.8"><title>{}: reserved</title></path>"##,
        esc(&report.name)
    );
    let _ = write!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="middle">allocator events (allocations and frees) →</text></svg>"##,
        W / 2.0,
        H - 12.0
    );

    let recorded_report = gpumem::trace::recorded(events);
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
<tr><td>recorded</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>–</td></tr>
<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td></tr></table>
<h2>Timeline</h2>
<div class="legend"><span><i class="sw" style="background:hsl(47,60%,62%)"></i>the {BANDS} biggest allocations (those live at the peak first), stacked in the order they were made</span><span><i class="sw" style="background:#c8c8c8"></i>all other live bytes</span><span><i class="sw" style="background:#1f3fbf"></i>{} reserved</span><span><i class="sw" style="background:#d62728"></i>recorded allocator reserved</span></div>
{svg}
"##,
        human(recorded_report.peak_live_bytes),
        human(recorded_report.peak_reserved_bytes),
        recorded_report.ratio,
        recorded_report.segments_at_peak,
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

/// The segment map: one row per segment (per mapped range of an expandable segment), scaled
/// to the largest row.
fn segment_map(policy: &str, segments: &[SegmentInfo]) -> String {
    // rows: (label, start address, bytes, blocks clipped to the row)
    let mut rows: Vec<(String, u64, u64)> = Vec::new();
    for s in segments {
        for &(a, len) in &s.mapped {
            let label = if s.expandable {
                format!(
                    "{:?} pool, expandable, pages {:#x}+{}",
                    s.kind,
                    a,
                    human(len)
                )
            } else {
                format!("{:?} pool segment {:#x}", s.kind, a)
            };
            rows.push((label, a, len));
        }
    }
    let (mut used, mut rounding, mut free) = (0u64, 0u64, 0u64);
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
        r##"<h2>Segment map at the reserved peak ({})</h2>
<div class="legend"><span><i class="sw" style="background:#2b6cb0"></i>requested bytes: {}</span><span><i class="sw" style="background:#90cdf4"></i>rounding inside blocks: {}</span><span><i class="sw" style="background:#f6ad55"></i>free but reserved (cached or fragmented): {}</span></div>
"##,
        esc(policy),
        human(used),
        human(rounding),
        human(free)
    );
    if rows.is_empty() {
        out.push_str("<p>nothing reserved</p>");
        return out;
    }
    let max = rows.iter().map(|r| r.2).max().unwrap_or(1).max(1) as f64;
    let shown = rows.len().min(400);
    let row_h = 16.0;
    let height = shown as f64 * (row_h + 4.0) + 10.0;
    let _ = write!(
        out,
        r##"<svg width="{W}" height="{height}" font-family="sans-serif" font-size="10">"##
    );
    let width = W - 20.0;
    for (r, (label, start, len)) in rows.iter().take(shown).enumerate() {
        let y0 = 5.0 + r as f64 * (row_h + 4.0);
        let scale = width / max;
        let _ = write!(
            out,
            r##"<rect x="10" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#f6ad55"><title>{}</title></rect>"##,
            *len as f64 * scale,
            esc(label)
        );
        let seg = segments
            .iter()
            .find(|s| s.mapped.iter().any(|&(a, _)| a == *start))
            .expect("row comes from a segment");
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
                r##"<rect x="{xa:.2}" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#90cdf4"/><rect x="{xa:.2}" y="{y0:.1}" width="{:.2}" height="{row_h}" fill="#2b6cb0"><title>{} requested in a block of {}</title></rect>"##,
                ((hi - lo) as f64 * scale).max(0.3),
                ((req_hi - lo) as f64 * scale).max(0.0),
                human(b.requested),
                human(b.size)
            );
        }
    }
    out.push_str("</svg>");
    if rows.len() > shown {
        let _ = write!(out, "<p>… and {} more rows</p>", rows.len() - shown);
    }
    out
}

fn overlap(a: u64, n: u64, b: u64, m: u64) -> u64 {
    (a + n).min(b + m).saturating_sub(a.max(b))
}
