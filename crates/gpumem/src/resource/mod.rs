//! Raw resources: where bytes come from.
//!
//! One slim, stream-first trait ([`Resource`]: allocate, deallocate, memory info) like RMM's
//! `device_memory_resource`, capability traits a resource offers where it has them
//! ([`VirtualMemory`], [`PeerAccess`], [`HostRegistration`], [`ManagedMemory`]; asked for
//! through `Resource::virtual_memory()` and its siblings, so no method answers `Unsupported`
//! by default), and the stream/event/copy operations ([`StreamOps`]) that the pool policy and
//! typed buffers need. A [`Backend`] is a resource with stream operations.
//!
//! Implementations: [`host::HostResource`] (plain host memory, the CI backend),
//! [`external::External`] (another allocator's memory, for pools built over it),
//! [`sim::SimulatedDevice`] (fixed capacity, synthetic addresses, controllable events, virtual
//! memory), and with the `cuda` feature everything under [`cuda`], where all CUDA FFI lives.

pub mod external;
mod forward;
pub mod host;
pub mod info;
pub mod page_map;
mod registry;
pub mod sim;
pub mod visibility;

pub(crate) use forward::{forward_resource_passthrough, forward_stream_ops};

#[cfg(feature = "cuda")]
pub mod cuda;

use crate::error::Result;
use serde::Serialize;

/// A device (or host) address. Host addresses are stored the same way.
pub type DevPtr = u64;

/// A stream handle: a `CUstream` on CUDA, any distinct number elsewhere. 0 is the default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
pub struct Stream(pub u64);

impl Stream {
    /// The default (legacy) stream.
    pub const DEFAULT: Stream = Stream(0);

    /// The raw handle.
    pub fn raw(self) -> u64 {
        self.0
    }
}

#[cfg(feature = "cuda")]
impl From<&cudarc::driver::CudaStream> for Stream {
    fn from(s: &cudarc::driver::CudaStream) -> Self {
        Stream(s.cu_stream() as u64)
    }
}

/// A fresh stream number for backends without real streams (distinct from every other
/// number handed out, and far from small ids a caller might use on its own).
pub(crate) fn next_stream_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1 << 40);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An event handle owned by a [`StreamOps`] implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// Free and total bytes as the device (or host) reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    /// bytes free
    pub free: u64,
    /// bytes in total
    pub total: u64,
}

/// Where a resource's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Location {
    /// Host memory (no GPU).
    Host,
    /// A simulated device: addresses are synthetic, there are no bytes behind them.
    Simulated,
    /// CUDA device memory of the given ordinal.
    Cuda(usize),
    /// Page-locked (pinned) host memory, usable by every device's copies.
    PinnedHost,
    /// Managed (unified) memory, created on the given device.
    Managed(usize),
}

impl Location {
    /// A device's own memory (CUDA, or the simulated device): shared with other processes
    /// and with what the driver and libraries take, where the pool watches the free memory.
    /// Plain host memory is the operating system's to share; managed memory oversubscribes.
    pub fn is_device_memory(self) -> bool {
        matches!(self, Location::Cuda(_) | Location::Simulated)
    }
}

/// Where managed memory can live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MemPlace {
    /// host memory
    Host,
    /// a device's memory
    Device(usize),
}

/// Advice for unified (managed) memory, as cuMemAdvise takes it: each can be set and unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Advice {
    /// read-mostly: reads make read-only copies where they happen (writes collapse them)
    ReadMostly(bool),
    /// where the pages prefer to live (`None` unsets)
    PreferredLocation(Option<MemPlace>),
    /// device `n` maps the pages so that its accesses do not fault (true sets, false unsets)
    AccessedBy(usize, bool),
}

/// The raw-resource trait: stream-first allocate and deallocate, and what the resource can
/// do beyond that, as capabilities ([`VirtualMemory`], [`PeerAccess`], [`HostRegistration`])
/// that a caller asks for and gets only where the resource has them.
///
/// Implementations are thread-safe and cheap to call concurrently; they do no caching
/// (that is the pool's job).
pub trait Resource: Send + Sync + std::fmt::Debug {
    /// Allocate `bytes` bytes aligned to `align` (a power of two), ordered on `stream`.
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr>;
    /// Return memory obtained from [`Resource::allocate`] with the same `bytes`.
    /// An address this resource did not hand out is an error, never undefined behaviour.
    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: Stream) -> Result<()>;
    /// Free and total memory where this resource allocates.
    fn mem_info(&self) -> Result<MemInfo>;
    /// The device's own free and total memory (every process counted), where a budget
    /// adaptor's [`Resource::mem_info`] gives the budget's view.
    fn device_mem_info(&self) -> Result<MemInfo> {
        self.mem_info()
    }
    /// A byte budget enforced by this resource (a budget adaptor wraps a resource with one),
    /// if any.
    fn limit(&self) -> Option<u64> {
        None
    }
    /// Short name for reports ("host", "simulated", "cuMemAlloc", ...).
    fn name(&self) -> &str;
    /// Where the bytes live.
    fn location(&self) -> Location;

    /// Virtual-memory segments, where this resource has them (the pool falls back to classic
    /// segments elsewhere).
    fn virtual_memory(&self) -> Option<&dyn VirtualMemory> {
        None
    }
    /// Direct access between devices, where this resource's memory needs the resource to
    /// grant it (virtual-memory pages do; memory peers reach through the contexts' peer
    /// access needs nothing).
    fn peer_access(&self) -> Option<&dyn PeerAccess> {
        None
    }
    /// Page-locking existing host memory, where this resource can.
    fn host_registration(&self) -> Option<&dyn HostRegistration> {
        None
    }
    /// Sharing memory with other processes, where this resource can.
    fn ipc(&self) -> Option<&dyn Ipc> {
        None
    }
}

/// Memory shared with other processes (what `torch.multiprocessing` needs): the driver's IPC
/// handles of whole device allocations, and virtual-memory pages exported as POSIX file
/// descriptors (the receiving process duplicates them with `pidfd_getfd`).
pub trait Ipc: Send + Sync {
    /// The driver's IPC handle of the device allocation that starts at `base`.
    fn segment_handle(&self, base: DevPtr) -> Result<[u8; 64]>;
    /// Open a segment handle of another process: its address in this process.
    fn open_segment(&self, handle: &[u8; 64]) -> Result<DevPtr>;
    /// Close a segment opened with [`Ipc::open_segment`].
    fn close_segment(&self, ptr: DevPtr) -> Result<()>;
    /// Page size of exported pages.
    fn page_size(&self) -> u64;
    /// Export the physical handles mapped over `[addr, addr + bytes)` (page-aligned): the
    /// first one's address, and per handle in address order a file descriptor (which must
    /// stay open until the receiver has imported it) and its pages. A handle may reach
    /// beyond the range: handles are exported whole.
    fn export_pages(
        &self,
        addr: DevPtr,
        bytes: u64,
    ) -> Result<(DevPtr, Vec<(std::os::fd::OwnedFd, u64)>)>;
    /// Map the handles process `pid` exported (per handle its descriptor and pages, pages of
    /// `page` bytes) side by side at a new address of this process; returns it.
    fn import_pages(&self, pid: i32, handles: &[(i32, u64)], page: u64) -> Result<DevPtr>;
    /// Unmap pages imported with [`Ipc::import_pages`] and free their address range.
    fn close_pages(&self, addr: DevPtr, bytes: u64) -> Result<()>;
}

/// Virtual-memory segments: address space reserved without memory, and physical pages mapped
/// into it and out again.
pub trait VirtualMemory: Send + Sync {
    /// Page size (the allocation granularity); ranges are multiples of it.
    fn page_size(&self) -> u64;
    /// Reserve `bytes` (a multiple of the page size) of address space with no memory behind it.
    fn reserve_address(&self, bytes: u64) -> Result<DevPtr>;
    /// Give back address space from [`VirtualMemory::reserve_address`]; nothing may be mapped
    /// in it.
    fn release_address(&self, addr: DevPtr, bytes: u64) -> Result<()>;
    /// Back the unmapped, page-aligned range `[addr, addr + bytes)` of reserved address space
    /// with physical memory, readable and writable by this device: one handle for a run of
    /// pages, or several ([`VirtualMemory::unit_at`] says where each lies). All of the range
    /// is mapped, or none of it.
    fn map(&self, addr: DevPtr, bytes: u64) -> Result<()>;
    /// Where the physical handle mapped at `addr` lies, `(first page, bytes)`: unmaps cover
    /// whole handles. By default the page of `addr`.
    fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        let page = self.page_size().max(1);
        Some((addr / page * page, page))
    }
    /// Unmap the mapped, page-aligned range `[addr, addr + bytes)` (whole handles: one
    /// reaching outside the range is an error) and give its physical memory back (a resource
    /// may keep a few handles for the next map, and may do the unmapping on a thread of its
    /// own). The caller has made sure no queued work still touches it.
    fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()>;
    /// Unmap `[addr, addr + bytes)` for `stream`'s next [`VirtualMemory::map_on`], which may
    /// take its physical memory at once. With `busy`, only work on `stream` has used the range
    /// and some of it may still be queued (the next map's work runs after it, in stream
    /// order): the range itself is unmapped once the work queued on `stream` so far has
    /// completed. Without, no queued work touches the range. By default (a resource without
    /// kernels) the same as `unmap`.
    fn unmap_after(&self, addr: DevPtr, bytes: u64, stream: Stream, busy: bool) -> Result<()> {
        let _ = (stream, busy);
        self.unmap(addr, bytes)
    }
    /// [`VirtualMemory::map`] for work on `stream`: it may take the physical memory that
    /// `unmap_after` left for `stream`. By default the same as `map`.
    fn map_on(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let _ = stream;
        self.map(addr, bytes)
    }
    /// [`VirtualMemory::map_on`] made off the caller's thread, where the resource has a
    /// thread of its own: the range is the caller's as mapped from now on (other calls over
    /// it wait until it is made), but no work may touch it before
    /// [`VirtualMemory::wait_mapped`] over the same range has returned. For memory the caller
    /// will need again soon but not at once (a planned region's pages mapped again after a
    /// split). By default `map_on`, done when it returns.
    fn map_ahead(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        self.map_on(addr, bytes, stream)
    }
    /// Wait until the map made ahead over `[addr, addr + bytes)` (as it was given to
    /// [`VirtualMemory::map_ahead`]) is made. Where it failed, it is made now; an error says
    /// that failed too, and the range is not mapped. By default nothing to wait for.
    fn wait_mapped(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let _ = (addr, bytes, stream);
        Ok(())
    }
    /// A move of pages for `stream` ([`VirtualMemory::unmap_after`] then one or more
    /// [`VirtualMemory::map_on`]) is complete: memory it unmapped that no map took is free for
    /// anyone (beyond a small cap, given back). By default nothing to do.
    fn finish_move(&self, stream: Stream) {
        let _ = stream;
    }
    /// Give back whatever physical memory the resource keeps beyond the mapped pages, once
    /// pending unmaps are done (emptying the cache).
    fn trim(&self) {}
    /// Driver calls made for pages so far.
    fn calls(&self) -> VmmCalls {
        VmmCalls::default()
    }
    /// Nanoseconds on the clock that page work is measured and budgeted against: by default
    /// monotonic wall time, so a call's duration is its own, measured; a simulated device
    /// keeps a clock of its own (the trace's time plus what its calls would have cost).
    fn now_ns(&self) -> u64 {
        monotonic_ns()
    }
}

/// Nanoseconds of monotonic wall time since the first call in this process.
pub fn monotonic_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

/// Driver calls a [`VirtualMemory`] resource made, by where they ran and by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct VmmCalls {
    /// calls on the caller's (allocating) thread
    pub foreground: u64,
    /// calls on the resource's own thread
    pub background: u64,
    /// physical handles created (cuMemCreate)
    pub creates: u64,
    /// of those, created on the resource's own thread (maps made ahead)
    pub creates_background: u64,
    /// mappings made (cuMemMap; a handle spans one page or a run of them)
    pub maps: u64,
    /// of those, made on the resource's own thread (maps made ahead)
    pub maps_background: u64,
    /// access set (cuMemSetAccess, one per mapped range)
    pub set_access: u64,
    /// of those, set on the resource's own thread (maps made ahead)
    pub set_access_background: u64,
    /// mappings unmapped (cuMemUnmap)
    pub unmaps: u64,
    /// of those, mappings unmapped on the resource's own thread
    pub unmaps_background: u64,
    /// handles released (cuMemRelease)
    pub releases: u64,
    /// times a map waited for the background thread to finish unmapping its pages, or for a
    /// stream's work before unmapping pages moved in stream order
    pub waits: u64,
    /// pages mapped with the memory of pages moved in stream order (`unmap_after`) whose old
    /// address was still waiting for its stream
    pub aliased: u64,
    /// bytes of physical handles kept unmapped for the next map (not in any pool's reserved
    /// bytes)
    pub spare_bytes: u64,
    /// pages mapped again where their own handle had stayed mapped since they were unmapped:
    /// no driver call (see `page_map`)
    pub reused: u64,
    /// events recorded for moves in stream order (cuEventRecord, on the caller's thread)
    pub records: u64,
    /// nanoseconds the caller's thread spent in maps, by phase: waiting for the resource's
    /// thread, unmapping what lingered where the pages go (their work waited for), creating
    /// and mapping handles, setting access (0 where the resource does not time them)
    pub wait_ns: u64,
    /// see `wait_ns`
    pub unmap_ns: u64,
    /// see `wait_ns`
    pub map_ns: u64,
    /// see `wait_ns`
    pub access_ns: u64,
}

/// Direct access between devices.
pub trait PeerAccess: Send + Sync {
    /// Let device `peer` access this resource's memory, present and future (virtual-memory
    /// pages get a cuMemSetAccess descriptor for it).
    fn grant_peer_access(&self, peer: usize) -> Result<()>;
    /// Whether this resource's device may access `ptr` (another device's memory): `None` where
    /// it cannot tell.
    fn can_access(&self, ptr: DevPtr) -> Option<bool>;
}

/// Page-locking existing host memory, so that copies from and to it run at pinned speed.
pub trait HostRegistration: Send + Sync {
    /// Page-lock `bytes` bytes of existing host memory at `ptr` (cuMemHostRegister; plain host
    /// memory needs nothing).
    fn register_host(&self, ptr: DevPtr, bytes: usize) -> Result<()>;
    /// Undo [`HostRegistration::register_host`] for the range starting at `ptr`.
    fn unregister_host(&self, ptr: DevPtr) -> Result<()>;
}

/// Managed (unified) memory: moving pages ahead of use and advice about where they live.
pub trait ManagedMemory: Send + Sync + std::fmt::Debug {
    /// Move the pages of `[ptr, ptr + bytes)` to `to`, ordered on `stream`.
    ///
    /// # Safety
    /// The range must lie in managed memory of this resource.
    unsafe fn prefetch(
        &self,
        ptr: DevPtr,
        bytes: usize,
        to: MemPlace,
        stream: Stream,
    ) -> Result<()>;
    /// Give advice about `[ptr, ptr + bytes)`.
    ///
    /// # Safety
    /// The range must lie in managed memory of this resource.
    unsafe fn advise(&self, ptr: DevPtr, bytes: usize, advice: Advice) -> Result<()>;
    /// The device the memory was created on.
    fn ordinal(&self) -> usize;
}

/// The error a capability's absence gives: what is missing, and on which resource.
pub fn unsupported(resource: &str, what: &str) -> crate::error::Error {
    crate::error::Error::Unsupported {
        backend: resource.to_string(),
        what: what.into(),
    }
}

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// host → device
    HostToDevice,
    /// device → host
    DeviceToHost,
    /// device → device
    DeviceToDevice,
    /// either way, the direction found from the addresses (unified addressing: managed,
    /// registered, pinned or device memory, and pageable host memory)
    Unified,
}

/// Streams, events and copies: what the pool needs for cross-stream safety and what typed
/// buffers need to move data.
pub trait StreamOps: Send + Sync {
    /// Record an event capturing all work queued on `stream` so far.
    fn record_event(&self, stream: Stream) -> Result<Event>;
    /// True once the work the event captured has completed.
    fn event_done(&self, event: Event) -> Result<bool>;
    /// Block the host until the event completes.
    fn sync_event(&self, event: Event) -> Result<()>;
    /// Make future work on `stream` wait for `event` (no host blocking).
    fn wait_event(&self, stream: Stream, event: Event) -> Result<()>;
    /// Release an event.
    fn destroy_event(&self, event: Event);
    /// A new stream that does not synchronise with the default stream (for the transfer
    /// engine's copy lanes). Release it with [`StreamOps::destroy_stream`].
    fn create_stream(&self) -> Result<Stream>;
    /// Release a stream from [`StreamOps::create_stream`] (queued work still completes).
    fn destroy_stream(&self, stream: Stream);
    /// Block the host until all work on `stream` has completed.
    fn synchronize(&self, stream: Stream) -> Result<()>;
    /// True while `stream` is being captured into a CUDA graph: an event recorded on it then
    /// is part of the graph and cannot be queried, so the pool records none there.
    fn is_capturing(&self, _stream: Stream) -> bool {
        false
    }
    /// While `stream` captures a CUDA graph: the graph nodes its next operation will depend on
    /// (its capture frontier), as opaque numbers; `None` where it does not capture or the
    /// backend cannot say.
    fn capture_frontier(&self, _stream: Stream) -> Option<Vec<u64>> {
        None
    }
    /// While `stream` captures: whether its capture frontier depends on every one of `nodes`
    /// (a [`StreamOps::capture_frontier`] of a stream in the same capture), so that work
    /// queued on `stream` from now on runs after them. False where the backend cannot say.
    fn capture_follows(&self, _stream: Stream, _nodes: &[u64]) -> bool {
        false
    }
    /// Block the host until all work on the device has completed (needs no stream, so it is
    /// safe where a stream may have been destroyed since).
    fn synchronize_device(&self) -> Result<()>;
    /// Copy `bytes` bytes on `stream`. Host pointers are passed as addresses.
    ///
    /// # Safety
    /// `dst` and `src` must be valid for `bytes` bytes of the kind `kind` names until the copy
    /// completes on `stream`, and must not overlap.
    unsafe fn copy(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        kind: CopyKind,
        stream: Stream,
    ) -> Result<()>;
    /// Set `bytes` bytes at `dst` to `value` on `stream`.
    ///
    /// # Safety
    /// `dst` must be device memory valid for `bytes` bytes.
    unsafe fn memset(&self, dst: DevPtr, value: u8, bytes: usize, stream: Stream) -> Result<()>;
}

/// Make the work queued on `waiter` from now on wait for the work queued on `before` so far
/// (no host blocking): an event recorded on `before` through `rec`, waited for through `wait`.
/// `rec` and `wait` are the same backend for two streams of one device, and each stream's own
/// backend for streams of two devices.
pub fn stream_after<A, B>(rec: &A, before: Stream, wait: &B, waiter: Stream) -> Result<()>
where
    A: StreamOps + ?Sized,
    B: StreamOps + ?Sized,
{
    let ev = rec.record_event(before)?;
    let r = wait.wait_event(waiter, ev);
    rec.destroy_event(ev);
    r
}

/// A complete backend: a resource with stream operations.
pub trait Backend: Resource + StreamOps {}
impl<T: Resource + StreamOps> Backend for T {}
