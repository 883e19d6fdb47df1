//! CUDA resources: device memory (cuMemAlloc, and virtual-memory segments through
//! cuMemAddressReserve / cuMemCreate / cuMemMap where the device supports them) and a
//! stream-ordered pool (cuMemAllocFromPoolAsync). Both use the device's primary context, shared
//! with PyTorch, CuPy and cudarc in the same process. This is the FFI edge: every `unsafe` block is a
//! driver call on handles this module owns.

use super::{Advice, CopyKind, DevPtr, Event, Location, MemInfo, MemPlace, Resource, Stream};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, DriverError};
use std::sync::Arc;

pub(crate) fn cuda_err(call: &'static str, e: DriverError) -> Error {
    Error::Cuda {
        call,
        message: format!("{e:?}"),
    }
}

fn alloc_err(resource: &str, bytes: usize, call: &'static str, e: DriverError) -> Error {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Error::ResourceExhausted {
            resource: resource.to_string(),
            bytes: bytes as u64,
        }
    } else {
        cuda_err(call, e)
    }
}

fn raw(s: Stream) -> sys::CUstream {
    s.0 as sys::CUstream
}

/// The primary context of device `ordinal`, after checking that the driver and device exist.
pub fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = crate::device::device_count();
    if count == 0 {
        return Err(Error::NoGpu("no CUDA driver or device found".into()));
    }
    if ordinal >= count {
        return Err(Error::InvalidDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))
}

/// Stream, event and copy operations shared by the CUDA resources. Events are pooled:
/// creating one costs a driver round trip, and record_stream-heavy code records one per free.
#[derive(Debug)]
struct CudaOps {
    ctx: Arc<CudaContext>,
    /// idle events (as addresses), reused by `record_event`
    events: parking_lot::Mutex<Vec<usize>>,
}

impl CudaOps {
    fn new(ctx: Arc<CudaContext>) -> Self {
        Self {
            ctx,
            events: parking_lot::Mutex::new(Vec::new()),
        }
    }
}

impl Drop for CudaOps {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            for ev in self.events.get_mut().drain(..) {
                // SAFETY: idle pooled events are owned by the pool alone.
                let _ = unsafe { result::event::destroy(ev as sys::CUevent) };
            }
        }
    }
}

impl CudaOps {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn record_event(&self, stream: Stream) -> Result<Event> {
        self.bind()?;
        let pooled = self.events.lock().pop();
        let ev = match pooled {
            Some(ev) => ev as sys::CUevent,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_err("cuEventCreate", e))?,
        };
        // SAFETY: `ev` is ours and idle; the stream handle is the caller's live stream.
        if let Err(e) = unsafe { result::event::record(ev, raw(stream)) } {
            self.events.lock().push(ev as usize);
            return Err(cuda_err("cuEventRecord", e));
        }
        Ok(Event(ev as u64))
    }

    fn event_done(&self, event: Event) -> Result<bool> {
        self.bind()?;
        // SAFETY: events are created by `record_event` and destroyed only by `destroy_event`.
        match unsafe { result::event::query(event.0 as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(cuda_err("cuEventQuery", e)),
        }
    }

    fn sync_event(&self, event: Event) -> Result<()> {
        self.bind()?;
        // SAFETY: as in `event_done`.
        unsafe { result::event::synchronize(event.0 as sys::CUevent) }
            .map_err(|e| cuda_err("cuEventSynchronize", e))
    }

    fn wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.bind()?;
        // SAFETY: live event (as above) and the caller's live stream.
        unsafe {
            result::stream::wait_event(
                raw(stream),
                event.0 as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("cuStreamWaitEvent", e))
    }

    /// Return an event to the pool (it may be re-recorded at once: a later record replaces the
    /// captured work, and nobody waits on a returned event).
    fn destroy_event(&self, event: Event) {
        self.events.lock().push(event.0 as usize);
    }

    fn create_stream(&self) -> Result<Stream> {
        self.bind()?;
        let s = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Stream(s as u64))
    }

    fn destroy_stream(&self, stream: Stream) {
        if stream != Stream::DEFAULT && self.bind().is_ok() {
            // SAFETY: streams reach here only from `create_stream`; the driver lets queued
            // work finish after a destroy.
            let _ = unsafe { result::stream::destroy(raw(stream)) };
        }
    }

    /// Page-lock existing host memory (portable: every context's copies see it pinned).
    fn register_host(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        self.bind()?;
        // SAFETY: the caller (a registration guard holding a unique borrow of the range)
        // keeps the memory alive until `unregister_host`.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut std::ffi::c_void,
                bytes,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| cuda_err("cuMemHostRegister", e))
    }

    fn unregister_host(&self, ptr: DevPtr) -> Result<()> {
        self.bind()?;
        // SAFETY: the driver checks that `ptr` starts a registered range.
        unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) }
            .result()
            .map_err(|e| cuda_err("cuMemHostUnregister", e))
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's live stream.
        unsafe { result::stream::synchronize(raw(stream)) }
            .map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    fn synchronize_device(&self) -> Result<()> {
        self.bind()?;
        result::ctx::synchronize().map_err(|e| cuda_err("cuCtxSynchronize", e))
    }

    unsafe fn copy(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        kind: CopyKind,
        stream: Stream,
    ) -> Result<()> {
        self.bind()?;
        let s = raw(stream);
        // SAFETY: the caller guarantees the ranges (trait contract).
        let r = unsafe {
            match kind {
                CopyKind::HostToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, bytes, s)
                }
                CopyKind::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(dst as *mut std::ffi::c_void, src, bytes, s)
                }
                CopyKind::DeviceToDevice => sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s),
                CopyKind::Unified => sys::cuMemcpyAsync(dst, src, bytes, s),
            }
        };
        r.result().map_err(|e| cuda_err("cuMemcpyAsync", e))
    }

    unsafe fn memset(&self, dst: DevPtr, value: u8, bytes: usize, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst` (trait contract).
        unsafe { result::memset_d8_async(dst, value, bytes, raw(stream)) }
            .map_err(|e| cuda_err("cuMemsetD8Async", e))
    }
}

macro_rules! cuda_stream_ops {
    ($ty:ty) => {
        crate::adaptor::forward_stream_ops!($ty, |s| s.ops);
    };
}

/// Device memory from cuMemAlloc / cuMemFree (synchronous, the driver's own allocator), and
/// virtual-memory pages (one cuMemCreate handle per page of the allocation granularity, so
/// that pages unmap one by one).
#[derive(Debug)]
pub struct CudaDevice {
    ops: CudaOps,
    ordinal: usize,
    /// allocation granularity, where the device has virtual-memory management
    page: Option<u64>,
    /// physical handle of every mapped page, by address
    handles: parking_lot::Mutex<rustc_hash::FxHashMap<DevPtr, u64>>,
    /// other devices that get access to every mapped page
    peers: parking_lot::RwLock<Vec<usize>>,
}

fn alloc_prop(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is the documented default; fields set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location = device_location(ordinal);
    prop
}

/// The device's virtual-memory granularity, or `None` where it has no VMM.
fn vmm_granularity(ordinal: usize) -> Option<u64> {
    // SAFETY: attribute queries on a valid ordinal (checked by `primary_context`).
    let supported = unsafe {
        let dev = result::device::get(ordinal as i32).ok()?;
        result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )
        .ok()?
    };
    if supported == 0 {
        return None;
    }
    let prop = alloc_prop(ordinal);
    let mut gran = 0usize;
    // SAFETY: `prop` is initialised and `gran` is a valid out-pointer.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .ok()?;
    (gran > 0 && gran.is_power_of_two()).then_some(gran as u64)
}

impl CudaDevice {
    /// Device `ordinal`'s memory, on its primary context.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ops = CudaOps::new(primary_context(ordinal)?);
        ops.bind()?;
        Ok(Self {
            ops,
            ordinal,
            page: vmm_granularity(ordinal),
            handles: Default::default(),
            peers: Default::default(),
        })
    }

    /// The same device with virtual-memory segments turned off (classic segments only).
    pub fn without_vmm(mut self) -> Self {
        self.page = None;
        self
    }

    /// Unmap and release the pages `[addr, addr + bytes)` that are in the handle map.
    fn unmap_pages(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let page = self.page.unwrap_or(1);
        let mut handles = self.handles.lock();
        let mut first_err = None;
        let mut p = addr;
        while p < addr + bytes {
            if let Some(h) = handles.remove(&p) {
                // SAFETY: `p` was mapped with handle `h` by `map`; the pool has waited for
                // the work that used it.
                let r = unsafe { sys::cuMemUnmap(p, page as usize) }
                    .result()
                    .and_then(|()| unsafe { sys::cuMemRelease(h) }.result());
                if let Err(e) = r {
                    first_err.get_or_insert(cuda_err("cuMemUnmap", e));
                }
            }
            p += page;
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The cudarc context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ops.ctx
    }

    /// Read-write access to `[addr, addr + bytes)` (mapped) for this device and its peers.
    fn set_access(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(self.peers.read().iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: device_location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the range is mapped (callers' contract); `descs` holds `len` descriptors.
        unsafe { sys::cuMemSetAccess(addr, bytes as usize, descs.as_ptr(), descs.len()) }
            .result()
            .map_err(|e| cuda_err("cuMemSetAccess", e))
    }
}

impl Resource for CudaDevice {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        self.ops.bind()?;
        // SAFETY: plain driver allocation; the memory is only exposed as an address.
        let p = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| alloc_err("cuMemAlloc", bytes, "cuMemAlloc", e))?;
        if p % align as u64 != 0 {
            // SAFETY: `p` was just allocated and is not shared.
            let _ = unsafe { result::free_sync(p) };
            return Err(Error::InvalidAlignment { align, max: 256 });
        }
        Ok(p)
    }

    fn deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: Stream) -> Result<()> {
        self.ops.bind()?;
        // SAFETY: cuMemFree validates the address and fails on one it did not hand out.
        unsafe { result::free_sync(ptr) }.map_err(|e| cuda_err("cuMemFree", e))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.ops.mem_info()
    }

    fn name(&self) -> &str {
        "cuMemAlloc"
    }

    fn location(&self) -> Location {
        Location::Cuda(self.ordinal)
    }

    fn vmm_page_size(&self) -> Option<u64> {
        self.page
    }

    fn reserve_address(&self, bytes: u64) -> Result<DevPtr> {
        let page = self.page.ok_or_else(|| self.no_vmm())?;
        self.ops.bind()?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; reserving address space maps nothing.
        unsafe { sys::cuMemAddressReserve(&mut addr, bytes as usize, page as usize, 0, 0) }
            .result()
            .map_err(|e| {
                alloc_err(
                    "cuMemAddressReserve",
                    bytes as usize,
                    "cuMemAddressReserve",
                    e,
                )
            })?;
        Ok(addr)
    }

    fn release_address(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.ops.bind()?;
        // SAFETY: the range came from `reserve_address` and nothing is mapped in it (contract).
        unsafe { sys::cuMemAddressFree(addr, bytes as usize) }
            .result()
            .map_err(|e| cuda_err("cuMemAddressFree", e))
    }

    fn map(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let page = self.page.ok_or_else(|| self.no_vmm())?;
        if addr % page != 0 || bytes % page != 0 || bytes == 0 {
            return Err(Error::InvalidAlignment {
                align: page as usize,
                max: page as usize,
            });
        }
        self.ops.bind()?;
        let prop = alloc_prop(self.ordinal);
        let mut p = addr;
        let mut failed = None;
        while p < addr + bytes {
            if self.handles.lock().contains_key(&p) {
                failed = Some(Error::Config(format!("page {p:#x} is already mapped")));
                break;
            }
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `prop` is initialised; `h` is a valid out-pointer.
            if let Err(e) = unsafe { sys::cuMemCreate(&mut h, page as usize, &prop, 0) }.result() {
                failed = Some(alloc_err("cuMemCreate", page as usize, "cuMemCreate", e));
                break;
            }
            // SAFETY: `p` is an unmapped page of reserved address space and `h` a fresh
            // handle of one page.
            if let Err(e) = unsafe { sys::cuMemMap(p, page as usize, 0, h, 0) }.result() {
                // SAFETY: `h` is unmapped and ours.
                let _ = unsafe { sys::cuMemRelease(h) };
                failed = Some(cuda_err("cuMemMap", e));
                break;
            }
            self.handles.lock().insert(p, h);
            p += page;
        }
        if failed.is_none() {
            if let Err(e) = self.set_access(addr, bytes) {
                failed = Some(e);
            }
        }
        match failed {
            None => Ok(()),
            Some(e) => {
                // all or nothing: undo the pages mapped by this call
                let _ = self.unmap_pages(addr, p - addr);
                Err(e)
            }
        }
    }

    fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.page.ok_or_else(|| self.no_vmm())?;
        self.ops.bind()?;
        self.unmap_pages(addr, bytes)
    }

    fn register_host(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.ops.register_host(ptr, bytes)
    }

    fn unregister_host(&self, ptr: DevPtr) -> Result<()> {
        self.ops.unregister_host(ptr)
    }

    fn can_access(&self, ptr: DevPtr) -> Option<bool> {
        self.access_flags(ptr)
    }

    fn grant_peer_access(&self, peer: usize) -> Result<()> {
        let count = crate::device::device_count();
        if peer >= count {
            return Err(Error::InvalidDevice {
                ordinal: peer,
                count,
            });
        }
        if peer == self.ordinal || self.page.is_none() || self.peers.read().contains(&peer) {
            return Ok(());
        }
        self.peers.write().push(peer);
        // pages mapped so far, in runs of adjacent pages
        let page = self.page.unwrap_or(1);
        let mut pages: Vec<DevPtr> = self.handles.lock().keys().copied().collect();
        pages.sort_unstable();
        self.ops.bind()?;
        let mut i = 0;
        while i < pages.len() {
            let start = pages[i];
            let mut end = start + page;
            while i + 1 < pages.len() && pages[i + 1] == end {
                i += 1;
                end += page;
            }
            self.set_access(start, end - start)?;
            i += 1;
        }
        Ok(())
    }
}

cuda_stream_ops!(CudaDevice);

impl CudaDevice {
    /// Whether this device may access `ptr` (CU_POINTER_ATTRIBUTE_ACCESS_FLAGS from this
    /// device's context); `None` where the driver cannot say.
    fn access_flags(&self, ptr: DevPtr) -> Option<bool> {
        self.ops.bind().ok()?;
        let mut flags: u32 = 0;
        // SAFETY: the attribute is a 32-bit flag word; the driver validates the pointer.
        unsafe {
            sys::cuPointerGetAttribute(
                &mut flags as *mut u32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                ptr,
            )
        }
        .result()
        .ok()?;
        Some(flags != 0)
    }
}

/// Let device `from` access device `to`'s memory directly (cuCtxEnablePeerAccess on the
/// primary contexts; enabling twice is fine). Virtual-memory pages also need
/// [`Resource::grant_peer_access`] on `to`'s resource.
pub fn enable_peer_access(from: usize, to: usize) -> Result<()> {
    if from == to {
        return Ok(());
    }
    let (a, b) = (primary_context(from)?, primary_context(to)?);
    let dev = |o: usize| result::device::get(o as i32).map_err(|e| cuda_err("cuDeviceGet", e));
    let mut can = 0i32;
    // SAFETY: both handles are valid devices; writes one int.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev(from)?, dev(to)?) }
        .result()
        .map_err(|e| cuda_err("cuDeviceCanAccessPeer", e))?;
    if can == 0 {
        return Err(Error::Unsupported {
            backend: "cuda".into(),
            what: format!("peer access from device {from} to device {to}"),
        });
    }
    a.bind_to_thread()
        .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
    // SAFETY: `b` is a live primary context; the current context is `a`'s.
    match unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => Err(cuda_err("cuCtxEnablePeerAccess", DriverError(e))),
    }
}

/// The device a device pointer belongs to.
pub fn pointer_device(ptr: DevPtr) -> Result<usize> {
    let mut ordinal: i32 = -1;
    // SAFETY: the attribute is an int; the driver validates the pointer.
    unsafe {
        sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    }
    .result()
    .map_err(|e| cuda_err("cuPointerGetAttribute", e))?;
    Ok(ordinal.max(0) as usize)
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // pages a pool left mapped (it unmaps its own on drop; this is the safety net)
        let pages: Vec<DevPtr> = self.handles.get_mut().keys().copied().collect();
        if !pages.is_empty() && self.ops.bind().is_ok() {
            let page = self.page.unwrap_or(1);
            for p in pages {
                let _ = self.unmap_pages(p, page);
            }
        }
    }
}

/// A private stream-ordered pool (cuMemPoolCreate + cuMemAllocFromPoolAsync) with a release
/// threshold: what `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` uses.
#[derive(Debug)]
pub struct CudaAsyncPool {
    ops: CudaOps,
    ordinal: usize,
    pool: usize,
}

/// The one place `CUmemLocation` literals are built (its layout changes across CUDA
/// versions; see cudarc notes).
fn mem_location(p: MemPlace) -> sys::CUmemLocation {
    match p {
        MemPlace::Host => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
        MemPlace::Device(d) => device_location(d),
    }
}

fn device_location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

impl CudaAsyncPool {
    /// A pool on device `ordinal` keeping up to `release_threshold` bytes cached.
    pub fn new(ordinal: usize, release_threshold: u64) -> Result<Self> {
        let ops = CudaOps::new(primary_context(ordinal)?);
        ops.bind()?;
        // SAFETY: an all-zero CUmemPoolProps is the documented default; fields set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = device_location(ordinal);
        // SAFETY: `props` is a valid, initialised struct.
        let pool = unsafe { result::mem_pool::create(&props) }
            .map_err(|e| cuda_err("cuMemPoolCreate", e))?;
        let mut threshold = release_threshold;
        // SAFETY: the release threshold attribute takes a u64 (cuuint64_t).
        unsafe {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
        }
        .map_err(|e| cuda_err("cuMemPoolSetAttribute", e))?;
        Ok(Self {
            ops,
            ordinal,
            pool: pool as usize,
        })
    }

    fn handle(&self) -> sys::CUmemoryPool {
        self.pool as sys::CUmemoryPool
    }
}

impl Resource for CudaAsyncPool {
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        self.ops.bind()?;
        // SAFETY: our live pool and the caller's stream.
        let p = unsafe { result::mem_pool::alloc_async(self.handle(), bytes, raw(stream)) }
            .map_err(|e| {
                alloc_err(
                    "cuMemAllocFromPoolAsync",
                    bytes,
                    "cuMemAllocFromPoolAsync",
                    e,
                )
            })?;
        if p % align as u64 != 0 {
            // SAFETY: `p` was just allocated on `stream` and is not shared.
            let _ = unsafe { result::free_async(p, raw(stream)) };
            return Err(Error::InvalidAlignment { align, max: 256 });
        }
        Ok(p)
    }

    fn deallocate(&self, ptr: DevPtr, _bytes: usize, stream: Stream) -> Result<()> {
        self.ops.bind()?;
        // SAFETY: the driver validates the address; ordered on the caller's stream.
        unsafe { result::free_async(ptr, raw(stream)) }.map_err(|e| cuda_err("cuMemFreeAsync", e))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.ops.mem_info()
    }

    fn name(&self) -> &str {
        "cuMemAllocAsync"
    }

    fn location(&self) -> Location {
        Location::Cuda(self.ordinal)
    }
}

impl Drop for CudaAsyncPool {
    fn drop(&mut self) {
        if self.ops.bind().is_ok() {
            // SAFETY: the pool is ours; outstanding frees are ordered before the destroy by a
            // device synchronisation.
            unsafe {
                let _ = result::ctx::synchronize();
                let _ = result::mem_pool::destroy(self.handle());
            }
        }
    }
}

cuda_stream_ops!(CudaAsyncPool);

/// Page-locked host memory (cuMemHostAlloc, portable across contexts): the raw resource under
/// the pinned pool. Each call costs a driver round trip that grows with the size (on the H100
/// machine 1.1 ms for 1 MiB and 31.7 ms for 64 MiB), which is why the pool caches.
#[derive(Debug)]
pub struct CudaPinnedHost {
    ops: CudaOps,
    /// live allocations and their sizes: a free of an address we did not hand out is an
    /// error, not undefined behaviour
    live: parking_lot::Mutex<rustc_hash::FxHashMap<DevPtr, usize>>,
}

/// Alignment cuMemHostAlloc guarantees (a host page).
const PINNED_ALIGN: usize = 4096;

impl CudaPinnedHost {
    /// Pinned host memory, with copies and events on device `ordinal`'s primary context.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ops = CudaOps::new(primary_context(ordinal)?);
        ops.bind()?;
        Ok(Self {
            ops,
            live: Default::default(),
        })
    }
}

impl Resource for CudaPinnedHost {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        if !align.is_power_of_two() || align > PINNED_ALIGN {
            return Err(Error::InvalidAlignment {
                align,
                max: PINNED_ALIGN,
            });
        }
        self.ops.bind()?;
        // SAFETY: plain driver allocation, exposed only as an address.
        let p = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| alloc_err("cuMemHostAlloc", bytes, "cuMemHostAlloc", e))?;
        self.live.lock().insert(p as DevPtr, bytes);
        Ok(p as DevPtr)
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, _stream: Stream) -> Result<()> {
        match self.live.lock().remove(&ptr) {
            Some(b) if b == bytes => {}
            Some(b) => {
                self.live.lock().insert(ptr, b);
                return Err(Error::Config(format!(
                    "pinned deallocate of {ptr:#x} with a size ({bytes}) other than it was allocated with ({b})"
                )));
            }
            None => return Err(Error::UnknownPointer { ptr }),
        }
        self.ops.bind()?;
        // SAFETY: `ptr` came from cuMemHostAlloc (the registry proves it) and leaves the
        // registry here, so it is freed once; callers have waited for copies using it.
        unsafe { result::free_host(ptr as *mut std::ffi::c_void) }
            .map_err(|e| cuda_err("cuMemFreeHost", e))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        Ok(super::host::host_mem_info())
    }

    fn name(&self) -> &str {
        "cuMemHostAlloc"
    }

    fn location(&self) -> Location {
        Location::PinnedHost
    }

    fn register_host(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.ops.register_host(ptr, bytes)
    }

    fn unregister_host(&self, ptr: DevPtr) -> Result<()> {
        self.ops.unregister_host(ptr)
    }
}

impl Drop for CudaPinnedHost {
    fn drop(&mut self) {
        let live: Vec<DevPtr> = self.live.get_mut().keys().copied().collect();
        if !live.is_empty() && self.ops.bind().is_ok() {
            for p in live {
                // SAFETY: blocks still registered came from cuMemHostAlloc and were never freed.
                let _ = unsafe { result::free_host(p as *mut std::ffi::c_void) };
            }
        }
    }
}

cuda_stream_ops!(CudaPinnedHost);

/// Managed (unified) memory (cuMemAllocManaged, attached globally) with a VRAM guard: a
/// request that would take managed memory past `guard` × the device's free memory is refused
/// (oversubscribing managed memory can stall the whole GPU).
#[derive(Debug)]
pub struct CudaManaged {
    ops: CudaOps,
    ordinal: usize,
    guard: f64,
    oversubscribe: bool,
    live: parking_lot::Mutex<rustc_hash::FxHashMap<DevPtr, usize>>,
}

impl CudaManaged {
    /// Managed memory created on device `ordinal`, refusing to grow past 0.8 × free memory.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ops = CudaOps::new(primary_context(ordinal)?);
        ops.bind()?;
        Ok(Self {
            ops,
            ordinal,
            guard: 0.8,
            oversubscribe: false,
            live: Default::default(),
        })
    }

    /// The guard's fraction of free device memory (default 0.8), in (0, 1].
    pub fn with_guard(mut self, fraction: f64) -> Result<Self> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::Config(format!(
                "managed guard fraction {fraction} must be in (0, 1]"
            )));
        }
        self.guard = fraction;
        Ok(self)
    }

    /// Allow managed memory past the guard (oversubscription: pages are evicted to the host
    /// as the device fills). Explicit opt-in: it can stall the whole GPU, so never on shared
    /// machines.
    pub fn allow_oversubscription(mut self) -> Self {
        self.oversubscribe = true;
        self
    }

    /// The device this memory is created on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Apply `advice` to `[ptr, ptr + bytes)`.
    ///
    /// # Safety
    /// The range must lie in managed memory from this resource.
    pub unsafe fn advise(&self, ptr: DevPtr, bytes: usize, advice: Advice) -> Result<()> {
        use sys::CUmem_advise as A;
        let (a, loc) = match advice {
            Advice::ReadMostly(true) => (A::CU_MEM_ADVISE_SET_READ_MOSTLY, self.here()),
            Advice::ReadMostly(false) => (A::CU_MEM_ADVISE_UNSET_READ_MOSTLY, self.here()),
            Advice::PreferredLocation(Some(l)) => {
                (A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, mem_location(l))
            }
            Advice::PreferredLocation(None) => {
                (A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, self.here())
            }
            Advice::AccessedBy(d, true) => (A::CU_MEM_ADVISE_SET_ACCESSED_BY, device_location(d)),
            Advice::AccessedBy(d, false) => {
                (A::CU_MEM_ADVISE_UNSET_ACCESSED_BY, device_location(d))
            }
        };
        self.ops.bind()?;
        // SAFETY: the caller guarantees the range (contract above).
        unsafe { result::mem_advise(ptr, bytes, a, loc) }.map_err(|e| cuda_err("cuMemAdvise", e))
    }

    fn here(&self) -> sys::CUmemLocation {
        device_location(self.ordinal)
    }

    /// Bytes of managed memory this resource holds.
    pub fn outstanding_bytes(&self) -> u64 {
        self.live.lock().values().map(|&b| b as u64).sum()
    }

    /// Migrate `[ptr, ptr + bytes)` to the device, ordered on `stream`.
    ///
    /// # Safety
    /// The range must lie in managed memory from this resource.
    pub unsafe fn prefetch_to_device(
        &self,
        ptr: DevPtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.ops.bind()?;
        // SAFETY: the caller guarantees the range (contract above).
        unsafe {
            result::mem_prefetch_async(ptr, bytes, device_location(self.ordinal), raw(stream))
        }
        .map_err(|e| cuda_err("cuMemPrefetchAsync", e))
    }

    /// Migrate `[ptr, ptr + bytes)` to host memory, ordered on `stream`.
    ///
    /// # Safety
    /// The range must lie in managed memory from this resource.
    pub unsafe fn prefetch_to_host(&self, ptr: DevPtr, bytes: usize, stream: Stream) -> Result<()> {
        self.ops.bind()?;
        let host = mem_location(MemPlace::Host);
        // SAFETY: the caller guarantees the range (contract above).
        unsafe { result::mem_prefetch_async(ptr, bytes, host, raw(stream)) }
            .map_err(|e| cuda_err("cuMemPrefetchAsync", e))
    }
}

impl Resource for CudaManaged {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        if !align.is_power_of_two() || align > PINNED_ALIGN {
            return Err(Error::InvalidAlignment {
                align,
                max: PINNED_ALIGN,
            });
        }
        let free = self.ops.mem_info()?.free;
        let held = self.outstanding_bytes();
        // managed pages already on the device count against `free`: the guard compares all
        // managed memory with what the device could hold
        let allowed = ((free + held) as f64 * self.guard) as u64;
        if !self.oversubscribe && held + bytes as u64 > allowed {
            return Err(Error::ManagedGuard {
                requested: bytes as u64,
                would_hold: held + bytes as u64,
                free,
                fraction: self.guard,
            });
        }
        self.ops.bind()?;
        // SAFETY: plain driver allocation, exposed only as an address.
        let p =
            unsafe { result::malloc_managed(bytes, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                .map_err(|e| alloc_err("cuMemAllocManaged", bytes, "cuMemAllocManaged", e))?;
        self.live.lock().insert(p, bytes);
        Ok(p)
    }

    fn deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: Stream) -> Result<()> {
        if self.live.lock().remove(&ptr).is_none() {
            return Err(Error::UnknownPointer { ptr });
        }
        self.ops.bind()?;
        // SAFETY: `ptr` came from cuMemAllocManaged (the registry proves it), freed once.
        unsafe { result::free_sync(ptr) }.map_err(|e| cuda_err("cuMemFree", e))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.ops.mem_info()
    }

    fn name(&self) -> &str {
        "cuMemAllocManaged"
    }

    fn location(&self) -> Location {
        Location::Managed(self.ordinal)
    }
}

impl Drop for CudaManaged {
    fn drop(&mut self) {
        let live: Vec<DevPtr> = self.live.get_mut().keys().copied().collect();
        if !live.is_empty() && self.ops.bind().is_ok() {
            for p in live {
                // SAFETY: registered blocks came from cuMemAllocManaged and were never freed.
                let _ = unsafe { result::free_sync(p) };
            }
        }
    }
}

cuda_stream_ops!(CudaManaged);
