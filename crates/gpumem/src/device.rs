//! Device capabilities: what `gpumem info` prints and what later layers decide on.

use serde::Serialize;

/// One CUDA device and the attributes gpumem's features depend on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// ordinal
    pub ordinal: usize,
    /// marketing name
    pub name: String,
    /// (major, minor)
    pub compute_capability: (i32, i32),
    /// bytes of device memory
    pub total_memory: u64,
    /// bytes free now
    pub free_memory: u64,
    /// streaming multiprocessors
    pub multiprocessors: i32,
    /// cuMemAllocManaged works
    pub managed_memory: bool,
    /// CPU and GPU may touch managed memory concurrently
    pub concurrent_managed_access: bool,
    /// the GPU can access pageable host memory
    pub pageable_memory_access: bool,
    /// cuMemCreate/cuMemMap (virtual-memory segments)
    pub virtual_memory_management: bool,
    /// cuMemPool* / cuMemAllocAsync
    pub memory_pools: bool,
    /// unified virtual addressing
    pub unified_addressing: bool,
    /// ordinals of the other devices this one can access directly
    pub peer_access: Vec<usize>,
    /// CUDA driver version, e.g. 13000
    pub driver_version: i32,
}

/// True where a CUDA driver is loadable, initialises, and sees at least one device.
pub fn cuda_available() -> bool {
    device_count() > 0
}

/// Number of CUDA devices (0 without a driver or without the `cuda` feature).
pub fn device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *COUNT.get_or_init(cuda_impl::count)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Every CUDA device's capabilities (empty without a GPU).
pub fn devices() -> crate::Result<Vec<DeviceInfo>> {
    #[cfg(feature = "cuda")]
    {
        (0..device_count()).map(cuda_impl::info).collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(Vec::new())
    }
}

#[cfg(feature = "cuda")]
mod cuda_impl {
    use super::DeviceInfo;
    use crate::resource::cuda::{cuda_err, primary_context};
    use cudarc::driver::{result, sys};

    pub(super) fn count() -> usize {
        // SAFETY: only tries to load the driver library; loads nothing else.
        if !unsafe { sys::is_culib_present() } {
            return 0;
        }
        if result::init().is_err() {
            return 0;
        }
        result::device::get_count().map_or(0, |n| n.max(0) as usize)
    }

    fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> i32 {
        // SAFETY: `dev` is a valid device handle; attribute queries have no side effects.
        unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
    }

    pub(super) fn info(ordinal: usize) -> crate::Result<DeviceInfo> {
        use sys::CUdevice_attribute as A;
        let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        let name = result::device::get_name(dev).map_err(|e| cuda_err("cuDeviceGetName", e))?;
        let ctx = primary_context(ordinal)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        let (free, total) = result::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))?;
        let mut peers = Vec::new();
        for other in (0..super::device_count()).filter(|&o| o != ordinal) {
            let mut can = 0i32;
            if let Ok(odev) = result::device::get(other as i32) {
                // SAFETY: both handles are valid; writes one int.
                let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, odev) };
                if r == sys::CUresult::CUDA_SUCCESS && can != 0 {
                    peers.push(other);
                }
            }
        }
        let mut driver_version = 0i32;
        // SAFETY: writes one int.
        let _ = unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        Ok(DeviceInfo {
            ordinal,
            name,
            compute_capability: (
                attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            total_memory: total as u64,
            free_memory: free as u64,
            multiprocessors: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            managed_memory: attr(dev, A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY) != 0,
            concurrent_managed_access: attr(dev, A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)
                != 0,
            pageable_memory_access: attr(dev, A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS) != 0,
            virtual_memory_management: attr(
                dev,
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            ) != 0,
            memory_pools: attr(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) != 0,
            unified_addressing: attr(dev, A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0,
            peer_access: peers,
            driver_version,
        })
    }
}
