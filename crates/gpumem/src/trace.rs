//! Allocation traces: read them (JSON Lines, gzip or plain, in the format of PyTorch's
//! `device_traces` as shared in `shared/traces`) and replay their demand through the real pool
//! policy over a simulated device, to see what a policy would reserve before touching a GPU.
//!
//! Each line: `{"action": ..., "addr": ..., "size": ..., "stream": ..., "time_us": ...}` with
//! `action` one of `alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`. The demand is `alloc` / `free_completed`; the `segment_*` events are what the
//! recording allocator reserved.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::resource::sim::SimulatedDevice;
use crate::resource::Stream;
use crate::{Allocation, CachingAllocator};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// a block handed out
    Alloc,
    /// the program freed a block (it may still be in use by a stream)
    FreeRequested,
    /// the block is free for reuse
    FreeCompleted,
    /// the allocator obtained a segment from the device
    SegmentAlloc,
    /// the allocator returned a segment
    SegmentFree,
}

/// One trace event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// what happened
    pub action: Action,
    /// device address of the block or segment
    pub addr: u64,
    /// bytes
    pub size: u64,
    /// stream handle (0 = default)
    #[serde(default)]
    pub stream: u64,
    /// microseconds, monotonic
    #[serde(default)]
    pub time_us: u64,
}

fn bad(path: &str, line: usize, what: impl std::fmt::Display) -> Error {
    Error::Trace(format!("{path}:{line}: {what}"))
}

/// Read a trace from a `.jsonl` or `.jsonl.gz` file (gzip is detected from its magic bytes).
pub fn read_trace(path: &Path) -> Result<Vec<TraceEvent>> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| bad(&name, 0, e))?;
    let mut reader = BufReader::new(file);
    let gz = reader
        .fill_buf()
        .map(|b| b.starts_with(&[0x1f, 0x8b]))
        .unwrap_or(false);
    let reader: Box<dyn Read> = if gz {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    parse_trace(&name, BufReader::new(reader))
}

/// Parse JSON Lines from `reader`; `name` labels errors (with line numbers).
pub fn parse_trace(name: &str, reader: impl BufRead) -> Result<Vec<TraceEvent>> {
    let mut events = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| bad(name, n, format!("cannot read: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let ev: TraceEvent = serde_json::from_str(&line).map_err(|e| bad(name, n, e))?;
        events.push(ev);
    }
    Ok(events)
}

/// What one policy did with a trace's demand.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// policy name (`recorded` for the trace's own allocator)
    pub name: String,
    /// highest sum of live requested bytes
    pub peak_live_bytes: u64,
    /// highest reserved bytes
    pub peak_reserved_bytes: u64,
    /// peak reserved / peak live
    pub ratio: f64,
    /// segments held at the reserved peak
    pub segments_at_peak: u64,
    /// largest free block when reserved peaked (0 for `recorded`)
    pub largest_free_block_at_peak: u64,
    /// allocator time per replayed event (0 for `recorded`)
    pub ns_per_event: f64,
}

/// The figures of the trace's own allocator, from its `segment_*` events.
pub fn recorded(events: &[TraceEvent]) -> PolicyReport {
    let (mut live, mut peak_live, mut reserved, mut peak_reserved) = (0u64, 0u64, 0u64, 0u64);
    let (mut segs, mut segs_at_peak) = (0u64, 0u64);
    for e in events {
        match e.action {
            Action::Alloc => {
                live += e.size;
                peak_live = peak_live.max(live);
            }
            Action::FreeCompleted => live = live.saturating_sub(e.size),
            Action::SegmentAlloc => {
                reserved += e.size;
                segs += 1;
                if reserved > peak_reserved {
                    peak_reserved = reserved;
                    segs_at_peak = segs;
                }
            }
            Action::SegmentFree => {
                reserved = reserved.saturating_sub(e.size);
                segs = segs.saturating_sub(1);
            }
            Action::FreeRequested => {}
        }
    }
    PolicyReport {
        name: "recorded".into(),
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak_reserved,
        ratio: ratio(peak_reserved, peak_live),
        segments_at_peak: segs_at_peak,
        largest_free_block_at_peak: 0,
        ns_per_event: 0.0,
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Replay the demand of `events` through gpumem's pool with `config` over a simulated device of
/// `capacity` bytes. A free of an address that is not live is an error naming the event.
/// The demand is replayed twice: once timed with nothing but the allocator calls, once to
/// record the figures.
pub fn replay(
    name: &str,
    events: &[TraceEvent],
    config: &Config,
    capacity: u64,
) -> Result<PolicyReport> {
    let start = Instant::now();
    let replayed = run(events, config, capacity, |_| {})?;
    let ns_per_event = start.elapsed().as_nanos() as f64 / replayed.max(1) as f64;
    let mut peak = (0u64, 0u64, 0u64); // reserved, segments, largest free block
    run(events, config, capacity, |alloc| {
        let s = alloc.stats();
        if s.reserved_bytes.all.current > peak.0 {
            let largest = alloc
                .segments()
                .iter()
                .flat_map(|s| s.blocks.iter())
                .filter(|b| !b.active)
                .map(|b| b.size)
                .max()
                .unwrap_or(0);
            peak = (s.reserved_bytes.all.current, s.segment.all.current, largest);
        }
    })?;
    let peak_live = recorded(events).peak_live_bytes;
    Ok(PolicyReport {
        name: name.to_string(),
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak.0,
        ratio: ratio(peak.0, peak_live),
        segments_at_peak: peak.1,
        largest_free_block_at_peak: peak.2,
        ns_per_event,
    })
}

/// Replay the demand; `after_alloc` runs after every allocation. Returns the events replayed.
fn run(
    events: &[TraceEvent],
    config: &Config,
    capacity: u64,
    mut after_alloc: impl FnMut(&CachingAllocator),
) -> Result<u64> {
    let mut config = config.clone();
    config.shards = Some(1);
    let alloc = CachingAllocator::new(Arc::new(SimulatedDevice::new(capacity)), config)?;
    let mut live: FxHashMap<u64, Allocation> = FxHashMap::default();
    let mut replayed = 0u64;
    for (i, e) in events.iter().enumerate() {
        let n = i + 1;
        match e.action {
            Action::Alloc => {
                let a = alloc
                    .allocate(Stream(e.stream), e.size.max(1) as usize, 512)
                    .map_err(|err| {
                        Error::Trace(format!("event {n}: alloc of {} bytes: {err}", e.size))
                    })?;
                after_alloc(&alloc);
                if let Some(old) = live.insert(e.addr, a) {
                    alloc.deallocate(old)?;
                    return Err(Error::Trace(format!(
                        "event {n}: alloc at {:#x}, which is already live",
                        e.addr
                    )));
                }
            }
            Action::FreeCompleted => {
                let a = live.remove(&e.addr).ok_or_else(|| {
                    Error::Trace(format!("event {n}: free of unknown address {:#x}", e.addr))
                })?;
                alloc.deallocate(a)?;
            }
            _ => continue,
        }
        replayed += 1;
    }
    Ok(replayed)
}
