//! Sharing device memory with other processes: the driver's IPC handles of cuMemAlloc
//! segments, and virtual-memory pages exported as POSIX file descriptors, which the receiving
//! process duplicates from the sender with `pidfd_open` + `pidfd_getfd` (as PyTorch does for
//! its expandable segments), imports and maps at an address range of its own.

use super::device::CudaDevice;
use super::*;
use crate::resource::Ipc;
use std::os::fd::{FromRawFd, OwnedFd};

fn ipc_err(what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    Error::InvalidArgument(format!("{what}: {e}"))
}

/// Duplicate descriptor `fd` of process `pid` into this process.
fn fd_of(pidfd: &OwnedFd, fd: i32) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain system call on a pidfd we own; the kernel checks `fd` and permissions.
    let local = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if local < 0 {
        return Err(ipc_err("pidfd_getfd"));
    }
    // SAFETY: the kernel just opened `local` for us.
    Ok(unsafe { OwnedFd::from_raw_fd(local as i32) })
}

impl Ipc for CudaDevice {
    fn segment_handle(&self, base: DevPtr) -> Result<[u8; 64]> {
        self.bind()?;
        // SAFETY: an all-zero handle is a valid out-parameter.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `h` is a valid out-parameter; the driver checks `base`.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
            .result()
            .map_err(|e| cuda_err("cuIpcGetMemHandle", e))?;
        Ok(h.reserved.map(|c| c as u8))
    }

    fn open_segment(&self, handle: &[u8; 64]) -> Result<DevPtr> {
        self.bind()?;
        // SAFETY: an all-zero handle is valid; its bytes are set below.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        let mut p: DevPtr = 0;
        // SAFETY: `p` is a valid out-parameter; the driver validates the handle.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| cuda_err("cuIpcOpenMemHandle", e))?;
        Ok(p)
    }

    fn close_segment(&self, ptr: DevPtr) -> Result<()> {
        self.bind()?;
        // SAFETY: the driver checks that `ptr` was opened by cuIpcOpenMemHandle.
        unsafe { sys::cuIpcCloseMemHandle(ptr) }
            .result()
            .map_err(|e| cuda_err("cuIpcCloseMemHandle", e))
    }

    fn page_size(&self) -> u64 {
        self.pages_engine().map_or(0, |p| p.page())
    }

    fn export_pages(&self, addr: DevPtr, bytes: u64) -> Result<(DevPtr, Vec<(OwnedFd, u64)>)> {
        self.bind()?;
        self.pages_engine()?.export(addr, bytes)
    }

    fn import_pages(&self, pid: i32, fds: &[(i32, u64)], page: u64) -> Result<DevPtr> {
        let pages = fds
            .iter()
            .try_fold(0u64, |a, f| a.checked_add(f.1).filter(|_| f.1 > 0));
        let bytes = pages.and_then(|n| n.checked_mul(page));
        let (false, true, Some(bytes)) = (fds.is_empty(), page.is_power_of_two(), bytes) else {
            return Err(Error::InvalidArgument(format!(
                "no pages to import ({} descriptors of {page} B pages)",
                fds.len()
            )));
        };
        self.bind()?;
        // SAFETY: plain system call; the kernel checks `pid`.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if pidfd < 0 {
            return Err(ipc_err("pidfd_open"));
        }
        // SAFETY: the kernel just opened `pidfd` for us.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        let mut base: DevPtr = 0;
        // SAFETY: `base` is a valid out-parameter; a fresh range of `bytes`.
        unsafe { sys::cuMemAddressReserve(&mut base, bytes as usize, page as usize, 0, 0) }
            .result()
            .map_err(|e| cuda_err("cuMemAddressReserve", e))?;
        let undo = |mapped: u64| {
            // SAFETY: `[base, base + mapped)` was mapped above and the range reserved.
            unsafe {
                if mapped > 0 {
                    let _ = sys::cuMemUnmap(base, mapped as usize);
                }
                let _ = sys::cuMemAddressFree(base, bytes as usize);
            }
        };
        let mut mapped = 0u64;
        for &(fd, n) in fds {
            let local = match fd_of(&pidfd, fd) {
                Ok(l) => l,
                Err(e) => {
                    undo(mapped);
                    return Err(e);
                }
            };
            use std::os::fd::AsRawFd;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `h` is a valid out-parameter; a POSIX descriptor is passed by value in
            // the pointer argument, as the driver documents.
            let r = unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    local.as_raw_fd() as usize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            }
            .result();
            if let Err(e) = r {
                undo(mapped);
                return Err(cuda_err("cuMemImportFromShareableHandle", e));
            }
            // SAFETY: `h` is the handle just imported, of `n` pages (the sender says so; the
            // driver refuses a size beyond the handle's); they lie in the reserved range.
            let r = unsafe { sys::cuMemMap(base + mapped, (n * page) as usize, 0, h, 0) }.result();
            // the mapping keeps the memory: the handle is not needed past it
            // SAFETY: `h` is ours and released once.
            let _ = unsafe { sys::cuMemRelease(h) };
            if let Err(e) = r {
                undo(mapped);
                return Err(cuda_err("cuMemMap", e));
            }
            mapped += n * page;
        }
        let desc = sys::CUmemAccessDesc {
            location: device_location(self.ordinal()),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped; one descriptor.
        if let Err(e) = unsafe { sys::cuMemSetAccess(base, bytes as usize, &desc, 1) }.result() {
            undo(bytes);
            return Err(cuda_err("cuMemSetAccess", e));
        }
        Ok(base)
    }

    fn close_pages(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: `[addr, addr + bytes)` is a range `import_pages` mapped (caller's contract);
        // the driver checks it.
        unsafe { sys::cuMemUnmap(addr, bytes as usize) }
            .result()
            .map_err(|e| cuda_err("cuMemUnmap", e))?;
        // SAFETY: as above: the range `import_pages` reserved.
        unsafe { sys::cuMemAddressFree(addr, bytes as usize) }
            .result()
            .map_err(|e| cuda_err("cuMemAddressFree", e))
    }
}
