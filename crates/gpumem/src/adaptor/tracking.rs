//! Leak tracking: remembers every live allocation made through it.

use crate::error::{Error, Result};
use crate::resource::forward_stream_ops;
use crate::resource::{Backend, DevPtr, Location, MemInfo, Resource, Stream, VirtualMemory};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::Arc;

/// A live allocation, as reported by [`Tracking::leaks`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leak {
    /// address
    pub ptr: DevPtr,
    /// bytes
    pub bytes: usize,
    /// stream it was allocated on
    pub stream: Stream,
    /// sequence number of the allocation (0 = first)
    pub seq: u64,
    /// where it was allocated, when captured
    pub backtrace: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    live: FxHashMap<DevPtr, Leak>,
    seq: u64,
}

/// Wraps a resource and records what is live. With `capture_backtraces`, each allocation
/// records where it came from (slow; for debugging).
#[derive(Debug)]
pub struct Tracking {
    inner: Arc<dyn Backend>,
    capture_backtraces: bool,
    state: Mutex<State>,
}

impl Tracking {
    /// Track allocations made through `inner`.
    pub fn new(inner: Arc<dyn Backend>, capture_backtraces: bool) -> Self {
        Self {
            inner,
            capture_backtraces,
            state: Mutex::new(State::default()),
        }
    }

    /// Allocations not yet returned, oldest first.
    pub fn leaks(&self) -> Vec<Leak> {
        let mut v: Vec<Leak> = self.state.lock().live.values().cloned().collect();
        v.sort_by_key(|l| l.seq);
        v
    }

    /// Bytes not yet returned.
    pub fn outstanding_bytes(&self) -> usize {
        self.state.lock().live.values().map(|l| l.bytes).sum()
    }
}

impl Resource for Tracking {
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        let ptr = self.inner.allocate(stream, bytes, align)?;
        let backtrace = self
            .capture_backtraces
            .then(|| std::backtrace::Backtrace::force_capture().to_string());
        let mut s = self.state.lock();
        let seq = s.seq;
        s.seq += 1;
        s.live.insert(
            ptr,
            Leak {
                ptr,
                bytes,
                stream,
                seq,
                backtrace,
            },
        );
        Ok(ptr)
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: Stream) -> Result<()> {
        let known = self.state.lock().live.remove(&ptr);
        match known {
            Some(leak) => self.inner.deallocate(ptr, bytes, stream).inspect_err(|_| {
                self.state.lock().live.insert(ptr, leak);
            }),
            None => Err(Error::UnknownPointer { ptr }),
        }
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.inner.mem_info()
    }

    fn device_mem_info(&self) -> Result<MemInfo> {
        self.inner.device_mem_info()
    }

    fn limit(&self) -> Option<u64> {
        self.inner.limit()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn location(&self) -> Location {
        self.inner.location()
    }

    crate::resource::forward_resource_passthrough!(inner);

    /// Virtual-memory pages are not allocations: they pass through untracked.
    fn virtual_memory(&self) -> Option<&dyn VirtualMemory> {
        self.inner.virtual_memory()
    }
}

forward_stream_ops!(Tracking, |s| s.inner);
