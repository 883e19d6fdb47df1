//! Device memory: cuMemAlloc segments and virtual-memory pages.

use super::*;
use crate::resource::registry::check_request;
use crate::resource::{unsupported, HostRegistration, PeerAccess, VirtualMemory};

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
        self.page.is_some().then_some(self as &dyn VirtualMemory)
    }

    fn peer_access(&self) -> Option<&dyn PeerAccess> {
        Some(self)
    }

    fn host_registration(&self) -> Option<&dyn HostRegistration> {
        Some(self)
    }
}

impl VirtualMemory for CudaDevice {
    fn page_size(&self) -> u64 {
        self.page.unwrap_or(0)
    }

    fn reserve_address(&self, bytes: u64) -> Result<DevPtr> {
        let page = self
            .page
            .ok_or_else(|| unsupported(self.name(), "virtual-memory segments"))?;
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
        let page = self
            .page
            .ok_or_else(|| unsupported(self.name(), "virtual-memory segments"))?;
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
                failed = Some(Error::InvalidState(format!(
                    "page {p:#x} is already mapped"
                )));
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
        self.page
            .ok_or_else(|| unsupported(self.name(), "virtual-memory segments"))?;
        self.ops.bind()?;
        self.unmap_pages(addr, bytes)
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
