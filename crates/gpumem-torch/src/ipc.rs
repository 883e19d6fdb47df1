//! The C ABI for sharing CUDA tensors between processes (`torch.multiprocessing`): the native
//! torch allocator's `shareIpcHandle` and `getIpcDevPtr`.
//!
//! The handle is a byte string in PyTorch's layout: a version byte (2), a kind byte, then:
//! - `'c'` (a classic segment): the driver's 64-byte IPC handle, exactly as PyTorch's own
//!   allocator writes it, so a receiver that runs PyTorch's allocator opens it too;
//! - `'g'` (gpumem's virtual-memory pages): the sender's process id (i32), the page size
//!   (u64), the number of physical handles (u64) and, per handle in address order, its file
//!   descriptor (i32) and its pages (u32), all little-endian; the receiver (gpumem)
//!   duplicates the descriptors with `pidfd_getfd` and maps the handles side by side.
//!
//! The sender keeps a page export's descriptors open until the block is freed (PyTorch keeps
//! the block allocated until every receiver has let it go). The receiver opens each handle
//! once and counts its users.

use super::{allocator, guard, state};
use gpumem::allocator::IpcExport;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

const VERSION: u8 = 2;
const SEGMENT: u8 = b'c';
const PAGES: u8 = b'g';

/// An export: its handle, the block's offset in it, the page descriptors kept open.
type Export = (Vec<u8>, i64, Vec<(OwnedFd, u64)>);
/// Exports by block address.
static EXPORTED: Mutex<Option<HashMap<u64, Export>>> = Mutex::new(None);
static ANY_EXPORTED: AtomicBool = AtomicBool::new(false);

/// Opened handles: handle bytes → (device, address, users, bytes mapped for pages or 0).
type Opened = HashMap<Vec<u8>, (c_int, u64, u32, u64)>;
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn fail(msg: String) -> isize {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
    -1
}

/// The message of this thread's last failed IPC call, NUL-terminated into `buf` (at most
/// `cap` bytes); returns its length.
///
/// # Safety
/// `buf` must be null or hold `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpumem_ipc_last_error(buf: *mut c_char, cap: usize) -> usize {
    LAST_ERROR.with(|e| {
        let e = e.borrow();
        if !buf.is_null() && cap > 0 {
            let n = e.len().min(cap - 1);
            // SAFETY: `buf` holds `cap` bytes (the caller's contract); n + 1 <= cap.
            unsafe {
                std::ptr::copy_nonoverlapping(e.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        e.len()
    })
}

/// The handle of a new export.
fn encode(e: &IpcExport) -> (Vec<u8>, i64) {
    match e {
        IpcExport::Segment { handle, offset } => {
            let mut v = vec![VERSION, SEGMENT];
            v.extend_from_slice(handle);
            (v, *offset as i64)
        }
        IpcExport::Pages { fds, page, offset } => {
            let mut v = vec![VERSION, PAGES];
            v.extend_from_slice(&(std::process::id() as i32).to_le_bytes());
            v.extend_from_slice(&page.to_le_bytes());
            v.extend_from_slice(&(fds.len() as u64).to_le_bytes());
            for (fd, pages) in fds {
                v.extend_from_slice(&fd.as_raw_fd().to_le_bytes());
                v.extend_from_slice(&(*pages as u32).to_le_bytes());
            }
            (v, *offset as i64)
        }
    }
}

/// Share the live block at `ptr` (any device): writes its handle into `out` (at most `cap`
/// bytes) and the block's offset in what the handle maps into `*offset`; returns the handle's
/// length (call with `cap` 0 first to learn it: the export is made once and kept), or -1 (see
/// [`gpumem_ipc_last_error`]).
///
/// # Safety
/// `out` must be null or hold `cap` writable bytes; `offset` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn gpumem_ipc_share(
    ptr: u64,
    out: *mut u8,
    cap: usize,
    offset: *mut i64,
) -> isize {
    let r = guard(Err("gpumem panicked".to_string()), || {
        let mut map = EXPORTED.lock().map_err(|_| "poisoned".to_string())?;
        let map = map.get_or_insert_with(HashMap::new);
        if let Some((h, off, _)) = map.get(&ptr) {
            return Ok((h.clone(), *off));
        }
        let set = state()
            .devices
            .as_ref()
            .ok_or("gpumem has no devices (bad configuration)")?;
        let mut last = format!("{ptr:#x} is not a live gpumem allocation");
        for d in set.made() {
            match d.ipc_export(ptr) {
                Ok(e) => {
                    let (h, off) = encode(&e);
                    let fds = match e {
                        IpcExport::Pages { fds, .. } => fds,
                        IpcExport::Segment { .. } => Vec::new(),
                    };
                    map.insert(ptr, (h.clone(), off, fds));
                    ANY_EXPORTED.store(true, Ordering::Relaxed);
                    return Ok((h, off));
                }
                Err(gpumem::Error::UnknownPointer { .. }) => {}
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    });
    match r {
        Ok((h, off)) => {
            if !offset.is_null() {
                // SAFETY: the caller's contract.
                unsafe { *offset = off };
            }
            if !out.is_null() {
                let n = h.len().min(cap);
                // SAFETY: `out` holds `cap` bytes (the caller's contract) and n <= cap.
                unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), out, n) };
            }
            h.len() as isize
        }
        Err(e) => fail(format!("cannot share {ptr:#x}: {e}")),
    }
}

/// The device allocation that holds the live block at `ptr` (torch's `getBaseAllocation`):
/// its base, and its size in `*size`; 0 (see [`gpumem_ipc_last_error`]) if `ptr` is not a live
/// block or lies in virtual-memory pages, which belong to no one allocation.
///
/// # Safety
/// `size` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn gpumem_base_allocation(ptr: u64, size: *mut u64) -> u64 {
    let r = guard(None, || {
        let set = state().devices.as_ref()?;
        set.made().find_map(|d| d.block_extent(ptr))
    });
    match r {
        Some((_, _, seg, seg_size, false)) => {
            if !size.is_null() {
                // SAFETY: the caller's contract.
                unsafe { *size = seg_size };
            }
            seg
        }
        Some(_) => {
            fail(format!(
                "{ptr:#x} lies in virtual-memory pages (expandable segments), which are no one \
                 device allocation: share it with shareIpcHandle, or use \
                 GPUMEM_CONF=expandable_segments:False"
            ));
            0
        }
        None => {
            fail(format!("{ptr:#x} is not a live gpumem allocation"));
            0
        }
    }
}

/// A block was freed: close the descriptors of its export, if any.
pub(crate) fn forget_export(ptr: u64) {
    if !ANY_EXPORTED.load(Ordering::Relaxed) {
        return;
    }
    if let Ok(mut m) = EXPORTED.lock() {
        if let Some(m) = m.as_mut() {
            m.remove(&ptr);
        }
    }
}

/// Open a handle another process shared (`len` bytes at `handle`) on `device`: writes the
/// address it maps at into `*out` (add the sender's offset for the tensor); 0 on success, -1
/// otherwise (see [`gpumem_ipc_last_error`]). Close it with [`gpumem_ipc_close`] once per open.
///
/// # Safety
/// `handle` must hold `len` bytes; `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn gpumem_ipc_open(
    device: c_int,
    handle: *const u8,
    len: usize,
    out: *mut u64,
) -> c_int {
    if handle.is_null() || out.is_null() {
        return fail("null handle or output".into()) as c_int;
    }
    // SAFETY: `handle` holds `len` bytes (the caller's contract).
    let h = unsafe { std::slice::from_raw_parts(handle, len) }.to_vec();
    let r = guard(Err("gpumem panicked".to_string()), || open(device, &h));
    match r {
        Ok(p) => {
            // SAFETY: the caller's contract.
            unsafe { *out = p };
            0
        }
        Err(e) => fail(format!("cannot open a shared CUDA handle: {e}")) as c_int,
    }
}

fn open(device: c_int, h: &[u8]) -> Result<u64, String> {
    let mut opened = OPENED.lock().map_err(|_| "poisoned".to_string())?;
    let opened = opened.get_or_insert_with(HashMap::new);
    if let Some(e) = opened.get_mut(h) {
        e.2 += 1;
        return Ok(e.1);
    }
    let a = allocator(device).ok_or(format!("device {device} cannot be used"))?;
    let ipc = a
        .backend()
        .ipc()
        .ok_or("this device cannot share memory between processes")?;
    let (ptr, bytes) = match h {
        [VERSION, SEGMENT, rest @ ..] if rest.len() == 64 => {
            let mut b = [0u8; 64];
            b.copy_from_slice(rest);
            (ipc.open_segment(&b).map_err(|e| e.to_string())?, 0)
        }
        [VERSION, PAGES, rest @ ..] if rest.len() >= 20 => {
            let pid = i32::from_le_bytes(rest[0..4].try_into().unwrap_or_default());
            let page = u64::from_le_bytes(rest[4..12].try_into().unwrap_or_default());
            let n = u64::from_le_bytes(rest[12..20].try_into().unwrap_or_default());
            let fds = &rest[20..];
            if n == 0 || n > 1 << 24 || fds.len() as u64 != n * 8 {
                return Err(format!(
                    "malformed page handle ({n} handles, {} bytes)",
                    fds.len()
                ));
            }
            let fds: Vec<(i32, u64)> = fds
                .chunks_exact(8)
                .map(|c| {
                    (
                        i32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                        u64::from(u32::from_le_bytes([c[4], c[5], c[6], c[7]])),
                    )
                })
                .collect();
            let pages: u64 = fds.iter().map(|f| f.1).sum();
            let p = ipc
                .import_pages(pid, &fds, page)
                .map_err(|e| e.to_string())?;
            (p, pages * page)
        }
        [v, k, ..] => {
            return Err(format!(
                "unknown handle (version {v}, kind {:?}): not made by gpumem or PyTorch's \
                 allocator with classic segments",
                *k as char
            ))
        }
        _ => return Err("handle too short".into()),
    };
    opened.insert(h.to_vec(), (device, ptr, 1, bytes));
    Ok(ptr)
}

/// One user of the handle opened at `ptr` is done; the last one unmaps it. 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_ipc_close(ptr: u64) -> c_int {
    guard(-1, || {
        let Ok(mut opened) = OPENED.lock() else {
            return -1;
        };
        let Some(opened) = opened.as_mut() else {
            return -1;
        };
        let Some(key) = opened
            .iter()
            .find(|(_, v)| v.1 == ptr)
            .map(|(k, _)| k.clone())
        else {
            return -1;
        };
        let e = opened.get_mut(&key).expect("found above");
        e.2 -= 1;
        if e.2 > 0 {
            return 0;
        }
        let (device, ptr, _, bytes) = opened.remove(&key).expect("found above");
        let Some(ipc) = allocator(device).and_then(|a| a.backend().ipc()) else {
            return -1;
        };
        let r = if bytes > 0 {
            ipc.close_pages(ptr, bytes)
        } else {
            ipc.close_segment(ptr)
        };
        if r.is_ok() {
            0
        } else {
            -1
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharing_on_the_host_backend_says_why_it_cannot() {
        let _turn = super::super::TEST_LOCK.lock();
        let p = super::super::gpumem_alloc(4096, 0, std::ptr::null_mut());
        let mut off = 0;
        // SAFETY: null output with cap 0; `off` is ours.
        let n = unsafe { gpumem_ipc_share(p as u64, std::ptr::null_mut(), 0, &mut off) };
        assert_eq!(n, -1);
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` holds 256 bytes.
        let len = unsafe { gpumem_ipc_last_error(buf.as_mut_ptr(), 256) };
        // SAFETY: NUL-terminated above.
        let msg = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        assert!(
            len > 0 && msg.contains("sharing memory between processes"),
            "{msg}"
        );
        // SAFETY: as above.
        let n = unsafe { gpumem_ipc_share(0xdead, std::ptr::null_mut(), 0, &mut off) };
        assert_eq!(n, -1);
        let mut out = 0u64;
        let junk = [2u8, b'x', 1, 2, 3];
        // SAFETY: `junk` holds 5 bytes; `out` is ours.
        assert_eq!(
            unsafe { gpumem_ipc_open(0, junk.as_ptr(), 5, &mut out) },
            -1
        );
        let short = [2u8, b'g', 1];
        // SAFETY: as above.
        assert_eq!(
            unsafe { gpumem_ipc_open(0, short.as_ptr(), 3, &mut out) },
            -1
        );
        assert_eq!(gpumem_ipc_close(0x1234), -1);
        let mut size = 0;
        // SAFETY: `size` is ours.
        let base = unsafe { gpumem_base_allocation(p as u64, &mut size) };
        assert!(base != 0 && base <= p as u64 && (p as u64) < base + size);
        // SAFETY: as above.
        assert_eq!(unsafe { gpumem_base_allocation(0xdead, &mut size) }, 0);
        assert_eq!(super::super::gpumem_free_ptr(p), 0);
    }
}
