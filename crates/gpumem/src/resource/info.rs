//! Device capabilities (what `gpumem info` prints and what later layers decide on): the
//! queries behind them live with the backend (`cuda::query`).

use super::visibility::{MemoryVisibility, Platform, VisibilityCaps};
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
    /// the attributes memory visibility is decided from (managed memory, pageable access,
    /// native atomics, mapped pinned memory); flattened into the JSON
    #[serde(flatten)]
    pub caps: VisibilityCaps,
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
    /// the operating system under the driver
    pub platform: Platform,
    /// whether host and device see each other's writes (from the attributes and platform)
    pub visibility: MemoryVisibility,
}

/// The memory visibility of device `ordinal` (a few attribute queries, no context work), or
/// [`MemoryVisibility::ExplicitCopies`] where there is no such CUDA device.
pub fn visibility(ordinal: usize) -> MemoryVisibility {
    #[cfg(feature = "cuda")]
    {
        if ordinal < device_count() {
            return super::cuda::query::visibility(ordinal);
        }
    }
    let _ = ordinal;
    MemoryVisibility::ExplicitCopies
}

/// True where a CUDA driver is loadable, initialises, and sees at least one device.
pub fn cuda_available() -> bool {
    device_count() > 0
}

/// The device of the calling thread's current CUDA context (what the CUDA runtime calls the
/// current device), or `None` where the thread has none (or there is no driver).
pub fn current_device() -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        if device_count() == 0 {
            return None;
        }
        super::cuda::query::current_device()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Number of CUDA devices (0 without a driver or without the `cuda` feature).
pub fn device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *COUNT.get_or_init(super::cuda::query::count)
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
        (0..device_count()).map(super::cuda::query::info).collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(Vec::new())
    }
}
