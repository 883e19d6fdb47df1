//! Allocation traces: read them (JSON Lines, gzip or plain, in the format of PyTorch's
//! `device_traces` as shared in `shared/traces`) and replay their demand through the real pool
//! policy over a simulated device, to see what a policy would reserve before touching a GPU.
//!
//! Each line: `{"action": ..., "addr": ..., "size": ..., "stream": ..., "time_us": ...}` with
//! `action` one of `alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap` (expandable segments), `snapshot`, `oom`.
//! The demand is `alloc` / `free_completed`; the `segment_*` events are what the recording
//! allocator reserved.
//!
//! [`read_trace`] also reads PyTorch's own snapshot files
//! (`torch.cuda.memory._dump_snapshot(...)` pickles): the events of their `device_traces`.

use crate::error::{Error, Result};
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

pub use crate::pool::record::{Action, TraceEvent};

pub mod advise;
mod replay;
pub mod synthetic;

pub use replay::{
    recorded, replay, replay_detailed, replay_simulated, replay_simulated_at, simulated, warm_ups,
    CostModel, PolicyReport, Replay, SIM_CAPACITY, WINDOW_US,
};

fn bad(path: &str, line: usize, what: impl std::fmt::Display) -> Error {
    Error::Trace(format!("{path}:{line}: {what}"))
}

/// Read a trace: JSON Lines, plain or gzip-compressed, or a PyTorch snapshot pickle (the
/// format is detected from the first bytes).
pub fn read_trace(path: &Path) -> Result<Vec<TraceEvent>> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| bad(&name, 0, e))?;
    let mut reader = BufReader::new(file);
    let head = reader.fill_buf().map(|b| b.to_vec()).unwrap_or_default();
    if head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]) {
        return read_pickle(&name, reader);
    }
    let gz = head.starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn Read> = if gz {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    parse_trace(&name, BufReader::new(reader))
}

/// Write `events` as JSON Lines to `path`, gzip-compressed when the name ends in `.gz`.
pub fn write_trace(path: &Path, events: &[TraceEvent]) -> Result<()> {
    let name = path.display().to_string();
    let file = std::fs::File::create(path).map_err(|e| bad(&name, 0, e))?;
    let err = |e: std::io::Error| bad(&name, 0, e);
    if name.ends_with(".gz") {
        let mut gz =
            flate2::write::GzEncoder::new(BufWriter::new(file), flate2::Compression::default());
        write_events(&mut gz, events).map_err(err)?;
        gz.finish().map_err(err)?.flush().map_err(err)?;
    } else {
        let mut out = BufWriter::new(file);
        write_events(&mut out, events).map_err(err)?;
        out.flush().map_err(err)?;
    }
    Ok(())
}

/// Write `events` as JSON Lines.
pub fn write_events(out: &mut dyn Write, events: &[TraceEvent]) -> std::io::Result<()> {
    for e in events {
        serde_json::to_writer(&mut *out, e)?;
        out.write_all(b"\n")?;
    }
    Ok(())
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
        let mut ev: TraceEvent = serde_json::from_str(&line).map_err(|e| bad(name, n, e))?;
        ev.line = n as u32;
        events.push(ev);
    }
    Ok(events)
}

/// Read the `device_traces` of a PyTorch memory snapshot pickle (`_dump_snapshot`): the events
/// of the first device that has any.
pub fn read_pickle(name: &str, reader: impl Read) -> Result<Vec<TraceEvent>> {
    use serde_pickle::{DeOptions, HashableValue as K, Value as V};
    // (stack frames shared through the memo may refer to themselves: they become None, as
    // replay reads no frames)
    let opts = DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let root = serde_pickle::value_from_reader(reader, opts)
        .map_err(|e| Error::Trace(format!("{name}: not a readable pickle: {e}")))?;
    let key = |k: &str| K::String(k.to_string());
    let V::Dict(top) = root else {
        return Err(Error::Trace(format!(
            "{name}: a snapshot pickle holds a dict"
        )));
    };
    let Some(V::List(devices)) = top.get(&key("device_traces")) else {
        return Err(Error::Trace(format!(
            "{name}: no `device_traces` (record with torch.cuda.memory._record_memory_history)"
        )));
    };
    let Some(V::List(entries)) = devices
        .iter()
        .find(|d| matches!(d, V::List(l) if !l.is_empty()))
        .or(devices.first())
    else {
        return Ok(Vec::new());
    };
    let int = |d: &std::collections::BTreeMap<K, V>, k: &str, n: usize| -> Result<Option<u64>> {
        match d.get(&key(k)) {
            None | Some(V::None) => Ok(None),
            Some(V::I64(v)) if *v >= 0 => Ok(Some(*v as u64)),
            Some(V::Bool(b)) => Ok(Some(*b as u64)),
            Some(V::Int(big)) => big
                .to_string()
                .parse::<u64>()
                .map(Some)
                .map_err(|_| Error::Trace(format!("{name}: entry {n}: `{k}` out of range"))),
            Some(other) => Err(Error::Trace(format!(
                "{name}: entry {n}: `{k}` is {other:?}, not a non-negative integer"
            ))),
        }
    };
    let mut events = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let n = i + 1;
        let V::Dict(d) = e else {
            return Err(Error::Trace(format!("{name}: entry {n} is not a dict")));
        };
        let action = match d.get(&key("action")) {
            Some(V::String(a)) => Action::from_name(a)
                .ok_or_else(|| Error::Trace(format!("{name}: entry {n}: unknown action `{a}`")))?,
            _ => return Err(Error::Trace(format!("{name}: entry {n}: no action"))),
        };
        events.push(TraceEvent {
            action,
            addr: int(d, "addr", n)?.unwrap_or(0),
            size: int(d, "size", n)?.unwrap_or(0),
            stream: int(d, "stream", n)?.unwrap_or(0),
            time_us: int(d, "time_us", n)?.unwrap_or(0),
            line: n as u32,
            tag: 0,
        });
    }
    Ok(events)
}
