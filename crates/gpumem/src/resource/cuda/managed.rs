//! Managed (unified) memory (cuMemAllocManaged) with a VRAM guard, advice and prefetch.

use super::pinned::PINNED_ALIGN;
use super::*;
use crate::resource::registry::{check_request, Registry};
use crate::resource::ManagedMemory;

/// Managed (unified) memory (cuMemAllocManaged, attached globally) with a VRAM guard: a
/// request that would take managed memory past `guard` × the device's free memory is refused
/// (oversubscribing managed memory can stall the whole GPU).
#[derive(Debug)]
pub struct CudaManaged {
    ops: CudaOps,
    ordinal: usize,
    guard: f64,
    oversubscribe: bool,
    live: Registry<()>,
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
            live: Registry::new("managed"),
        })
    }

    /// The guard's fraction of free device memory (default 0.8), in (0, 1].
    pub fn with_guard(mut self, fraction: f64) -> Result<Self> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidArgument(format!(
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
        self.live.total_bytes()
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
        check_request(bytes, align, PINNED_ALIGN)?;
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
        self.live.insert(p, (), bytes);
        Ok(p)
    }

    fn deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: Stream) -> Result<()> {
        self.live.take(ptr, None)?;
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
        let live = self.live.drain();
        if !live.is_empty() && self.ops.bind().is_ok() {
            for (p, ()) in live {
                // SAFETY: registered blocks came from cuMemAllocManaged and were never freed.
                let _ = unsafe { result::free_sync(p) };
            }
        }
    }
}

cuda_stream_ops!(CudaManaged);

impl ManagedMemory for CudaManaged {
    unsafe fn prefetch(
        &self,
        ptr: DevPtr,
        bytes: usize,
        to: MemPlace,
        stream: Stream,
    ) -> Result<()> {
        if let MemPlace::Device(d) = to {
            let count = crate::resource::info::device_count();
            if d >= count {
                return Err(Error::InvalidDevice { ordinal: d, count });
            }
        }
        self.ops.bind()?;
        // SAFETY: the caller guarantees the range lies in managed memory from this resource;
        // the destination device exists (checked above).
        unsafe { result::mem_prefetch_async(ptr, bytes, mem_location(to), raw(stream)) }
            .map_err(|e| cuda_err("cuMemPrefetchAsync", e))
    }
    unsafe fn advise(&self, ptr: DevPtr, bytes: usize, advice: Advice) -> Result<()> {
        // SAFETY: forwarded under the caller's guarantee.
        unsafe { CudaManaged::advise(self, ptr, bytes, advice) }
    }
    fn ordinal(&self) -> usize {
        CudaManaged::ordinal(self)
    }
}
