//! Device memory: cuMemAlloc segments and virtual-memory pages.

use super::pages::{self, Pages};
use super::*;
use crate::resource::registry::check_request;
use crate::resource::{unsupported, HostRegistration, PeerAccess, VirtualMemory, VmmCalls};

/// Device memory from cuMemAlloc / cuMemFree (synchronous, the driver's own allocator), and
/// virtual-memory pages (one handle per page of the allocation granularity, so that pages
/// unmap one by one; kept for reuse and unmapped off the caller's thread: see `pages.rs`).
#[derive(Debug)]
pub struct CudaDevice {
    ops: CudaOps,
    ordinal: usize,
    /// the page engine, where the device has virtual-memory management
    pages: Option<Arc<Pages>>,
    /// other devices that get access to every mapped page
    peers: parking_lot::RwLock<Vec<usize>>,
}

impl CudaDevice {
    /// Device `ordinal`'s memory, on its primary context.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_page_bytes(ordinal, 0)
    }

    /// [`CudaDevice::new`] with pages (physical handles) of `page` bytes, rounded up to a power
    /// of two at least the device's granularity (0: the granularity): address ranges are
    /// reserved aligned to a page, and `cuMemAddressReserve` refuses other alignments (20 MiB
    /// failed with `CUDA_ERROR_INVALID_VALUE` on the H100).
    pub fn with_page_bytes(ordinal: usize, page: u64) -> Result<Self> {
        let ops = CudaOps::new(primary_context(ordinal)?);
        ops.bind()?;
        let pages = pages::probe(ordinal).map(|(gran, handle_type)| {
            let page = page.max(gran).next_power_of_two();
            Pages::new(ops.ctx.clone(), ordinal, page, handle_type)
        });
        Ok(Self {
            ops,
            ordinal,
            pages,
            peers: Default::default(),
        })
    }

    /// The same device with virtual-memory segments turned off (classic segments only).
    pub fn without_vmm(mut self) -> Self {
        if let Some(p) = self.pages.take() {
            p.shut_down();
        }
        self
    }

    fn map_for(&self, addr: DevPtr, bytes: u64, stream: Option<Stream>) -> Result<()> {
        let (pages, peers) = self.for_pages(addr, bytes)?;
        pages.map(addr, bytes, &peers, stream)
    }

    /// The page engine for a call over `[addr, addr + bytes)` (whole pages, checked), with the
    /// context bound and the peers that get access to what it maps.
    fn for_pages(&self, addr: DevPtr, bytes: u64) -> Result<(&Pages, Vec<usize>)> {
        let pages = self.pages()?;
        let page = pages.page();
        if addr % page != 0 || bytes % page != 0 || bytes == 0 {
            return Err(Error::InvalidAlignment {
                align: page as usize,
                max: page as usize,
            });
        }
        self.ops.bind()?;
        Ok((pages, self.peers.read().clone()))
    }

    pub(super) fn bind(&self) -> Result<()> {
        self.ops.bind()
    }

    pub(super) fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(super) fn pages_engine(&self) -> Result<&Pages> {
        self.pages()
    }

    fn pages(&self) -> Result<&Pages> {
        self.pages
            .as_deref()
            .ok_or_else(|| unsupported(self.name(), "virtual-memory segments"))
    }

    /// The cudarc context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ops.ctx
    }
}

impl Resource for CudaDevice {
    fn allocate(&self, _stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        // the driver aligns to 256 B at least (large blocks far more): checked after the call
        check_request(bytes, align, 1 << 30)?;
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

    fn virtual_memory(&self) -> Option<&dyn VirtualMemory> {
        self.pages.is_some().then_some(self as &dyn VirtualMemory)
    }

    fn peer_access(&self) -> Option<&dyn PeerAccess> {
        Some(self)
    }

    fn host_registration(&self) -> Option<&dyn HostRegistration> {
        Some(self)
    }

    fn ipc(&self) -> Option<&dyn crate::resource::Ipc> {
        Some(self)
    }
}

impl VirtualMemory for CudaDevice {
    fn page_size(&self) -> u64 {
        self.pages.as_deref().map_or(0, Pages::page)
    }

    fn reserve_address(&self, bytes: u64) -> Result<DevPtr> {
        let page = self.pages()?.page();
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
        if let Some(p) = &self.pages {
            p.flush(addr, bytes); // unmaps still queued for this range happen first
        }
        // SAFETY: the range came from `reserve_address` and nothing is mapped in it (contract,
        // and the flush above).
        unsafe { sys::cuMemAddressFree(addr, bytes as usize) }
            .result()
            .map_err(|e| cuda_err("cuMemAddressFree", e))
    }

    fn map(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.map_for(addr, bytes, None)
    }

    fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        self.pages.as_deref()?.unit_at(addr)
    }

    fn map_on(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        self.map_for(addr, bytes, Some(stream))
    }

    fn map_ahead(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let (pages, peers) = self.for_pages(addr, bytes)?;
        pages.map_ahead(addr, bytes, &peers, stream)
    }

    fn wait_mapped(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let (pages, peers) = self.for_pages(addr, bytes)?;
        pages.wait_mapped(addr, bytes, &peers, stream)
    }

    fn unmap_after(&self, addr: DevPtr, bytes: u64, stream: Stream, busy: bool) -> Result<()> {
        self.ops.bind()?;
        self.pages()?.unmap_after(addr, bytes, stream, busy)
    }

    fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.pages()?.unmap(addr, bytes)
    }

    fn finish_move(&self, stream: Stream) {
        if let Some(p) = &self.pages {
            p.finish_move(stream);
        }
    }

    fn trim(&self) {
        if let (Some(p), Ok(())) = (&self.pages, self.ops.bind()) {
            p.trim();
        }
    }

    fn calls(&self) -> VmmCalls {
        self.pages.as_deref().map(Pages::calls).unwrap_or_default()
    }
}

impl HostRegistration for CudaDevice {
    fn register_host(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.ops.register_host(ptr, bytes)
    }

    fn unregister_host(&self, ptr: DevPtr) -> Result<()> {
        self.ops.unregister_host(ptr)
    }
}

impl PeerAccess for CudaDevice {
    fn can_access(&self, ptr: DevPtr) -> Option<bool> {
        self.access_flags(ptr)
    }

    fn grant_peer_access(&self, peer: usize) -> Result<()> {
        let count = crate::resource::info::device_count();
        if peer >= count {
            return Err(Error::InvalidDevice {
                ordinal: peer,
                count,
            });
        }
        let Some(engine) = self.pages.as_deref() else {
            return Ok(());
        };
        if peer == self.ordinal || self.peers.read().contains(&peer) {
            return Ok(());
        }
        self.peers.write().push(peer);
        // pages mapped so far (maps made ahead for the peers before finished first), in runs
        // of adjacent pages
        engine.wait_all_ahead();
        let page = engine.page();
        let mut pages = engine.mapped_pages();
        pages.sort_unstable();
        self.ops.bind()?;
        let peers = self.peers.read().clone();
        let mut i = 0;
        while i < pages.len() {
            let start = pages[i];
            let mut end = start + page;
            while i + 1 < pages.len() && pages[i + 1] == end {
                i += 1;
                end += page;
            }
            engine.set_access(start, end - start, &peers)?;
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

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // pages a pool left mapped (it unmaps its own on drop; this is the safety net), the
        // queued ones and the spares
        if let Some(p) = self.pages.take() {
            p.shut_down();
        }
    }
}
