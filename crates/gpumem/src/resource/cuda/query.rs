//! Device queries: count and capabilities.

use super::{cuda_err, primary_context};
use crate::resource::info::DeviceInfo;
use crate::resource::visibility::{MemoryVisibility, Platform, VisibilityCaps};
use cudarc::driver::{result, sys};

pub(crate) fn count() -> usize {
    // SAFETY: only tries to load the driver library; loads nothing else.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    if result::init().is_err() {
        return 0;
    }
    result::device::get_count().map_or(0, |n| n.max(0) as usize)
}

/// The device of the calling thread's current context (the CUDA runtime's current device:
/// it binds that device's primary context), or `None` where the thread has no context yet.
/// One driver call that reads the thread's state: cheaper than the runtime's cudaGetDevice.
pub(crate) fn current_device() -> Option<usize> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one int; fails (no context) without side effects.
    let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(dev as usize)
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> i32 {
    // SAFETY: `dev` is a valid device handle; attribute queries have no side effects.
    unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
}

fn caps(dev: sys::CUdevice) -> VisibilityCaps {
    use sys::CUdevice_attribute as A;
    let on = |a| attr(dev, a) != 0;
    VisibilityCaps {
        managed_memory: on(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY),
        concurrent_managed_access: on(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS),
        pageable_memory_access: on(A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS),
        pageable_uses_host_page_tables: on(
            A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
        ),
        host_native_atomics: on(A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED),
        can_map_host_memory: on(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY),
    }
}

/// Device `ordinal`'s memory visibility on this platform (attribute queries only).
pub(crate) fn visibility(ordinal: usize) -> MemoryVisibility {
    match result::device::get(ordinal as i32) {
        Ok(dev) => MemoryVisibility::classify(caps(dev), Platform::detect()),
        Err(_) => MemoryVisibility::ExplicitCopies,
    }
}

pub(crate) fn info(ordinal: usize) -> crate::Result<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    let name = result::device::get_name(dev).map_err(|e| cuda_err("cuDeviceGetName", e))?;
    let ctx = primary_context(ordinal)?;
    ctx.bind_to_thread()
        .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
    let (free, total) = result::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))?;
    let mut peers = Vec::new();
    for other in (0..crate::resource::info::device_count()).filter(|&o| o != ordinal) {
        let mut can = 0i32;
        if let Ok(odev) = result::device::get(other as i32) {
            // SAFETY: both handles are valid; writes one int.
            let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, odev) };
            if r == sys::CUresult::CUDA_SUCCESS && can != 0 {
                peers.push(other);
            }
        }
    }
    let caps = caps(dev);
    let platform = Platform::detect();
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
        caps,
        virtual_memory_management: attr(
            dev,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        ) != 0,
        memory_pools: attr(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) != 0,
        unified_addressing: attr(dev, A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0,
        peer_access: peers,
        driver_version,
        platform,
        visibility: MemoryVisibility::classify(caps, platform),
    })
}
