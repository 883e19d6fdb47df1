//! Recording: the pool emits its events (allocations, frees, segments and pages) into an
//! in-memory list when asked; the trace module above writes and reads them in files.

use super::*;
use serde::Deserialize;

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
    /// pages were mapped into an expandable segment (`size` bytes)
    SegmentMap,
    /// pages were unmapped from an expandable segment
    SegmentUnmap,
    /// a memory snapshot was taken (PyTorch)
    Snapshot,
    /// the allocator reported out of memory (PyTorch)
    Oom,
    /// the program asked the allocator to release its cache (`torch.cuda.empty_cache()`);
    /// a replay empties the replayed pool's cache there
    EmptyCache,
}

impl Action {
    pub(crate) fn from_name(s: &str) -> Option<Action> {
        Some(match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            "empty_cache" => Action::EmptyCache,
            _ => return None,
        })
    }
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
    /// line (JSON Lines) or entry (pickle) the event was read from; 0 if made in memory
    #[serde(skip)]
    pub line: u32,
    /// the recording thread's tag when the event was recorded ([`set_record_tag`]; 0: none);
    /// not part of trace files
    #[serde(skip)]
    pub tag: u64,
}

std::thread_local! {
    static TAG: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Tag the events this thread records from now on with `tag` (0: none); returns the previous
/// tag. A front end uses it to tie what it knows of a call (PyTorch's stack traces of an
/// allocation, a free or `empty_cache()`) to the events the call records.
pub fn set_record_tag(tag: u64) -> u64 {
    TAG.with(|t| t.replace(tag))
}

impl TraceEvent {
    /// An event made in memory.
    pub fn new(action: Action, addr: u64, size: u64, stream: u64, time_us: u64) -> Self {
        Self {
            action,
            addr,
            size,
            stream,
            time_us,
            line: 0,
            tag: 0,
        }
    }

    /// "line N" where the event was read from a file, else "event N" (1-based `index`).
    pub(crate) fn place(&self, index: usize) -> String {
        if self.line > 0 {
            format!("line {}", self.line)
        } else {
            format!("event {}", index + 1)
        }
    }
}

/// Events recorded by one pool: (nanoseconds since the recording started, event).
#[derive(Debug)]
pub(super) struct Recorder {
    pub(super) start: Instant,
    pub(super) events: Vec<(u64, TraceEvent)>,
}

impl Recorder {
    #[cold]
    pub(super) fn push(&mut self, action: Action, addr: u64, size: u64, stream: Stream) {
        let ns = self.start.elapsed().as_nanos() as u64;
        let mut e = TraceEvent::new(action, addr, size, stream.0, ns / 1000);
        e.tag = TAG.with(|t| t.get());
        self.events.push((ns, e));
    }
}

impl CachingPool {
    /// Start recording this pool's events (times relative to `start`), dropping any earlier
    /// recording.
    pub fn start_recording(&mut self, start: Instant) {
        self.recorder = Some(Box::new(Recorder {
            start,
            events: Vec::new(),
        }));
    }

    /// Stop recording; returns the events with their times in nanoseconds since the start.
    pub fn stop_recording(&mut self) -> Vec<(u64, TraceEvent)> {
        self.recorder.take().map(|r| r.events).unwrap_or_default()
    }

    /// The events recorded since the last call (or the start), recording going on.
    pub fn take_recorded(&mut self) -> Vec<(u64, TraceEvent)> {
        self.recorder
            .as_mut()
            .map(|r| std::mem::take(&mut r.events))
            .unwrap_or_default()
    }

    /// Whether this pool is recording.
    pub fn is_recording(&self) -> bool {
        self.recorder.is_some()
    }

    #[inline]
    pub(super) fn record(&mut self, action: Action, addr: u64, size: u64, stream: Stream) {
        if let Some(r) = self.recorder.as_mut() {
            r.push(action, addr, size, stream);
        }
    }
}
