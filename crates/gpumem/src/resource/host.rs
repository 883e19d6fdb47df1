//! Plain host memory: the backend where no GPU is present, and the one CI tests run on.

use super::registry::{check_request, Registry};
use super::HostRegistration;
use super::{
    next_stream_id, CopyKind, DevPtr, Event, Location, MemInfo, Resource, Stream, StreamOps,
};
use crate::error::{Error, Result};
use std::alloc::Layout;

/// Smallest alignment of host segments.
const HOST_MIN_ALIGN: usize = 512;

/// The allocation behind a live host segment.
#[derive(Debug, Clone, Copy)]
struct Raw {
    base: *mut u8,
    layout: Layout,
}

// SAFETY: `base` is a heap allocation owned by the registry; it is only freed under its lock.
unsafe impl Send for Raw {}

/// Host memory from the system allocator. Segments are zeroed when first obtained (through
/// calloc, so large ones cost no page touches until used), so every byte a typed buffer can
/// read is initialised. Work is synchronous: every event is complete at once.
#[derive(Debug)]
pub struct HostResource {
    live: Registry<Raw>,
}

impl Default for HostResource {
    fn default() -> Self {
        Self {
            live: Registry::new("host"),
        }
    }
}

impl HostResource {
    /// A new host resource.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently obtained from the system allocator.
    pub fn outstanding_bytes(&self) -> u64 {
        self.live.total_bytes()
    }
}

impl Resource for HostResource {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        let align = align.max(HOST_MIN_ALIGN);
        check_request(bytes, align, 1 << 30)?;
        let bad_align = || Error::InvalidAlignment {
            align,
            max: 1 << 30,
        };
        // Over-allocate with the natural alignment (which lets the system use calloc, whose
        // large blocks come zeroed from the kernel) and align inside the block.
        let total = bytes.checked_add(align).ok_or_else(bad_align)?;
        let layout = Layout::from_size_align(total, 16).map_err(|_| bad_align())?;
        // SAFETY: the layout has a non-zero size (checked above).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(Error::ResourceExhausted {
                resource: "host".into(),
                bytes: bytes as u64,
            });
        }
        let ptr = (base as usize).next_multiple_of(align) as DevPtr;
        self.live.insert(ptr, Raw { base, layout }, bytes);
        Ok(ptr)
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, _stream: Stream) -> Result<()> {
        let raw = self.live.take(ptr, Some(bytes))?;
        // SAFETY: `raw.base` came from `alloc_zeroed` with `raw.layout` (the registry proves
        // it) and has left the registry, so it is freed once.
        unsafe { std::alloc::dealloc(raw.base, raw.layout) };
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo> {
        Ok(host_mem_info())
    }

    fn name(&self) -> &str {
        "host"
    }

    fn location(&self) -> Location {
        Location::Host
    }

    fn host_registration(&self) -> Option<&dyn HostRegistration> {
        Some(self)
    }
}

/// Plain host memory is already as good as host memory gets here: nothing to do.
impl HostRegistration for HostResource {
    fn register_host(&self, _ptr: DevPtr, _bytes: usize) -> Result<()> {
        Ok(())
    }

    fn unregister_host(&self, _ptr: DevPtr) -> Result<()> {
        Ok(())
    }
}

impl Drop for HostResource {
    fn drop(&mut self) {
        for (_, raw) in self.live.drain() {
            // SAFETY: every registered block came from `alloc_zeroed` with its layout.
            unsafe { std::alloc::dealloc(raw.base, raw.layout) };
        }
    }
}

impl StreamOps for HostResource {
    fn record_event(&self, _stream: Stream) -> Result<Event> {
        Ok(Event(0))
    }
    fn event_done(&self, _event: Event) -> Result<bool> {
        Ok(true)
    }
    fn sync_event(&self, _event: Event) -> Result<()> {
        Ok(())
    }
    fn wait_event(&self, _stream: Stream, _event: Event) -> Result<()> {
        Ok(())
    }
    fn destroy_event(&self, _event: Event) {}
    fn create_stream(&self) -> Result<Stream> {
        Ok(Stream(next_stream_id()))
    }
    fn destroy_stream(&self, _stream: Stream) {}
    fn synchronize(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }
    fn synchronize_device(&self) -> Result<()> {
        Ok(())
    }
    unsafe fn copy(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        _kind: CopyKind,
        _stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are valid and disjoint (trait contract);
        // on the host backend device addresses are host addresses.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    unsafe fn memset(&self, dst: DevPtr, value: u8, bytes: usize, _stream: Stream) -> Result<()> {
        // SAFETY: the caller guarantees `dst` is valid for `bytes` bytes (trait contract).
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
        Ok(())
    }
}

/// Host memory figures from /proc/meminfo (Linux); zeros where unavailable.
pub fn host_mem_info() -> MemInfo {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    MemInfo {
        free: field("MemAvailable:"),
        total: field("MemTotal:"),
    }
}
