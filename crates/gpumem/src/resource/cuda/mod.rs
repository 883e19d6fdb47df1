//! CUDA resources: device memory (cuMemAlloc, and virtual-memory segments through
//! cuMemAddressReserve / cuMemCreate / cuMemMap where the device supports them) and a
//! stream-ordered pool (cuMemAllocFromPoolAsync). Both use the device's primary context, shared
//! with PyTorch, CuPy and cudarc in the same process. This is the FFI edge: every `unsafe` block is a
//! driver call on handles this module owns.

use super::{Advice, CopyKind, DevPtr, Event, Location, MemInfo, MemPlace, Resource, Stream};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, DriverError};
use std::sync::Arc;

mod async_pool;
pub mod cupti;
mod device;
mod ipc;
mod managed;
mod pages;
mod pinned;
pub(crate) mod query;

pub use async_pool::CudaAsyncPool;
pub use device::CudaDevice;
pub use managed::CudaManaged;
pub use pinned::CudaPinnedHost;

/// The error of driver call `call` that returned `e`: the call, the code and its name.
pub fn cuda_err(call: &'static str, e: DriverError) -> Error {
    Error::Cuda {
        call,
        code: e.0 as i32,
        name: format!("{:?}", e.0),
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
    let count = crate::resource::info::device_count();
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

    fn is_capturing(&self, stream: Stream) -> bool {
        if self.bind().is_err() {
            return false;
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's live stream; `status` is a valid out-parameter.
        let r = unsafe { sys::cuStreamIsCapturing(raw(stream), &mut status) };
        r == sys::CUresult::CUDA_SUCCESS
            && status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    fn capture_frontier(&self, stream: Stream) -> Option<Vec<u64>> {
        self.bind().ok()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph) = (0u64, std::ptr::null_mut());
        let (mut deps, mut edges, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: the caller's live stream; every out-parameter is valid; the driver's
        // dependency array stays valid until the next operation on the stream, and is copied
        // out at once.
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                raw(stream),
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        {
            return None;
        }
        if n == 0 || deps.is_null() {
            return Some(Vec::new());
        }
        // SAFETY: the driver returned `n` nodes at `deps`.
        let nodes = unsafe { std::slice::from_raw_parts(deps, n) };
        Some(nodes.iter().map(|&d| d as u64).collect())
    }

    fn capture_follows(&self, stream: Stream, nodes: &[u64]) -> bool {
        let Some(frontier) = self.capture_frontier(stream) else {
            return false;
        };
        let mut want: std::collections::HashSet<u64> = nodes.iter().copied().collect();
        let mut seen = std::collections::HashSet::new();
        let mut queue: std::collections::VecDeque<u64> = frontier.into();
        // walk the graph back from the frontier, nearest nodes first, until every wanted node
        // is found (a walk longer than MAX_CAPTURE_WALK says no: the block then waits for the
        // capture's end)
        while let Some(node) = queue.pop_front() {
            if want.is_empty() {
                break;
            }
            if !seen.insert(node) {
                continue;
            }
            if seen.len() > MAX_CAPTURE_WALK {
                return false;
            }
            want.remove(&node);
            let h = node as sys::CUgraphNode;
            let mut count = 0usize;
            // SAFETY: `h` is a node of the capture's graph (from the driver); a null array
            // asks for the count only.
            let r = unsafe {
                sys::cuGraphNodeGetDependencies_v2(
                    h,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut count,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return false;
            }
            if count == 0 {
                continue;
            }
            let mut deps: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
            // SAFETY: `deps` holds `count` nodes; edge data is not asked for.
            let r = unsafe {
                sys::cuGraphNodeGetDependencies_v2(
                    h,
                    deps.as_mut_ptr(),
                    std::ptr::null_mut(),
                    &mut count,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return false;
            }
            queue.extend(deps.iter().take(count).map(|&d| d as u64));
        }
        want.is_empty()
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

/// Graph nodes a capture walk visits at most ([`CudaOps::capture_follows`]): it runs on the
/// allocating thread while a capture holds blocks freed with other streams' uses, with two
/// driver calls a node.
const MAX_CAPTURE_WALK: usize = 4096;

macro_rules! cuda_stream_ops {
    ($ty:ty) => {
        crate::resource::forward_stream_ops!($ty, |s| s.ops);
    };
}
use cuda_stream_ops;
/// Let device `from` access device `to`'s memory directly (cuCtxEnablePeerAccess on the
/// primary contexts; enabling twice is fine). Virtual-memory pages also need
/// [`crate::resource::PeerAccess::grant_peer_access`] on `to`'s resource.
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
