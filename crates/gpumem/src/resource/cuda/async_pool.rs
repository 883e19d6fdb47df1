//! A stream-ordered pool (cuMemAllocFromPoolAsync).

use super::*;
use crate::resource::registry::check_request;

/// A private stream-ordered pool (cuMemPoolCreate + cuMemAllocFromPoolAsync) with a release
/// threshold: what `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` uses.
#[derive(Debug)]
pub struct CudaAsyncPool {
    ops: CudaOps,
    ordinal: usize,
    pool: usize,
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
        // the driver aligns to 256 B at least (large blocks far more): checked after the call
        check_request(bytes, align, 1 << 30)?;
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
