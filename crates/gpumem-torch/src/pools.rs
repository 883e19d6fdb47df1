//! The C ABI of private pools (CUDA-graph pools and `torch.cuda.MemPool`) for the native torch
//! allocator: a pool is named by PyTorch's `MempoolId_t`, two numbers `(a, b)`. Which
//! allocations go to which pool is decided in C++ (torch hands the allocator a filter of
//! streams per capture); the pools themselves are gpumem's ([`gpumem::PoolId`]).
//!
//! Calls on a pool that does not exist or a device that cannot be used answer -1 (or null);
//! nothing here panics across the ABI.

use super::{
    allocator, checked_result, copy_out, guard, made_allocator, segments_flat, sized_allocator,
    state,
};
use gpumem::pool::Layout;
use gpumem::{PoolId, Stream};
use std::ffi::{c_char, c_int, c_void};

fn status(r: gpumem::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(_) => -1,
    }
}

/// A capture on `device` starts recording into pool `(a, b)` (made if new, its use count
/// raised): `beginAllocateToPool`. 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_pool_begin(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        allocator(device).map_or(-1, |al| status(al.begin_capture(PoolId(a, b))))
    })
}

/// The capture into pool `(a, b)` ended (`endAllocateToPool`). 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_pool_end(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        allocator(device).map_or(-1, |al| status(al.end_capture(PoolId(a, b))))
    })
}

/// Make pool `(a, b)` or count one more user (`createOrIncrefPool`). 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_pool_incref(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        allocator(device).map_or(-1, |al| status(al.create_or_incref_pool(PoolId(a, b))))
    })
}

/// Another allocator's calls, as C++ hands them over: `alloc(ctx, bytes, stream)` returns an
/// address or null, `free(ctx, ptr, bytes, stream)` gives one back, `drop(ctx)` lets go of
/// `ctx` once the pool is gone.
pub type ExternalAlloc = unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void;
/// See [`ExternalAlloc`].
pub type ExternalFree = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut c_void);
/// See [`ExternalAlloc`].
pub type ExternalDrop = unsafe extern "C" fn(*mut c_void);

/// A `torch.cuda.MemPool`'s own allocator (`CUDAPluggableAllocator`, NCCL's), reached through
/// the C++ side's three calls.
struct CSource {
    ctx: *mut c_void,
    alloc: ExternalAlloc,
    free: ExternalFree,
    drop: ExternalDrop,
    name: String,
}

// SAFETY: `ctx` is the C++ side's handle on a thread-safe allocator (its calls may come from
// any thread, as PyTorch's own pools make them), released once in `Drop`.
unsafe impl Send for CSource {}
// SAFETY: as for Send: the C++ calls are thread-safe.
unsafe impl Sync for CSource {}

impl gpumem::resource::external::ExternalSource for CSource {
    fn alloc(&self, bytes: usize, stream: Stream) -> Option<gpumem::DevPtr> {
        // SAFETY: the C++ side's contract (gpumem_pool_incref_external): `alloc` takes `ctx`
        // and a size and stream, returns null on failure and never throws.
        let p = unsafe { (self.alloc)(self.ctx, bytes, stream.raw() as *mut c_void) };
        (!p.is_null()).then_some(p as gpumem::DevPtr)
    }
    fn free(&self, ptr: gpumem::DevPtr, bytes: usize, stream: Stream) {
        // SAFETY: as for alloc; `ptr` came from `alloc` with `bytes`.
        unsafe {
            (self.free)(
                self.ctx,
                ptr as *mut c_void,
                bytes,
                stream.raw() as *mut c_void,
            )
        }
    }
    fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for CSource {
    fn drop(&mut self) {
        // SAFETY: `ctx` is released once, here, after its last use.
        unsafe { (self.drop)(self.ctx) }
    }
}

/// [`gpumem_pool_incref`] for a `MemPool` over another allocator: a new pool's segments come
/// from `alloc` and go back through `free` (their bytes count against the memory fraction as
/// the device's do); `drop(ctx)` is called once when the pool no longer needs `ctx` (at once,
/// if the pool existed already). `name` (null or a NUL-terminated string) names the allocator
/// in messages. 0 on success.
///
/// # Safety
/// `alloc`, `free` and `drop` must be callable from any thread with `ctx`, never unwind, and
/// `alloc` must return null when it has no memory; `name` must be null or NUL-terminated.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpumem_pool_incref_external(
    device: c_int,
    a: u64,
    b: u64,
    ctx: *mut c_void,
    alloc: ExternalAlloc,
    free: ExternalFree,
    drop: ExternalDrop,
    name: *const c_char,
) -> c_int {
    let name = if name.is_null() {
        "another allocator".to_string()
    } else {
        // SAFETY: the caller's contract: a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    let source = CSource {
        ctx,
        alloc,
        free,
        drop,
        name,
    };
    guard(-1, || {
        allocator(device).map_or(-1, |al| {
            status(al.create_or_incref_pool_over(PoolId(a, b), Some(Box::new(source))))
        })
    })
}

/// Pool `(a, b)` never splits its blocks from now on (`setNoSplit`:
/// `torch.cuda.MemPool(no_split=True)`). 0 on success, -1 if there is no such pool.
#[no_mangle]
pub extern "C" fn gpumem_pool_set_no_split(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        made_allocator(device).map_or(-1, |al| status(al.set_pool_no_split(PoolId(a, b))))
    })
}

/// One user of pool `(a, b)` is gone (`releasePool`). 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_pool_release(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        made_allocator(device).map_or(-1, |al| status(al.release_pool(PoolId(a, b))))
    })
}

/// Users of pool `(a, b)`; -1 if there is no such pool.
#[no_mangle]
pub extern "C" fn gpumem_pool_use_count(device: c_int, a: u64, b: u64) -> c_int {
    guard(-1, || {
        made_allocator(device)
            .and_then(|al| al.pool_use_count(PoolId(a, b)))
            .map_or(-1, |n| c_int::try_from(n).unwrap_or(c_int::MAX))
    })
}

/// [`super::gpumem_alloc_checked`] from pool `(a, b)`.
///
/// # Safety
/// As [`super::gpumem_alloc_checked`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpumem_pool_alloc_checked(
    device: c_int,
    a: u64,
    b: u64,
    size: isize,
    stream: *mut c_void,
    err: *mut c_char,
    errlen: usize,
    oom: *mut c_int,
) -> *mut c_void {
    let result = guard(Err((false, String::new())), || {
        let al = sized_allocator(size, device)?;
        al.allocate_in_pool(PoolId(a, b), Stream(stream as u64), size as usize, 512)
            .map_err(|e| (e.is_out_of_memory(), e.to_string()))
    });
    // SAFETY: the caller's contract.
    unsafe { checked_result(result, err, errlen, oom) }
}

/// The live allocations of pool `(a, b)` (`checkPoolLiveAllocations`): writes at most `cap`
/// addresses to `out` and returns how many there are; -1 if there is no such pool.
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_pool_live(
    device: c_int,
    a: u64,
    b: u64,
    out: *mut u64,
    cap: usize,
) -> isize {
    let live = guard(None, || {
        made_allocator(device).and_then(|al| al.pool_live_allocations(PoolId(a, b)).ok())
    });
    match live {
        // SAFETY: the caller's contract.
        Some(v) => unsafe { copy_out(&v, out, cap) as isize },
        None => -1,
    }
}

/// Release the cached memory of pool `(a, b)` on every device where it has no users left
/// (`emptyCache(mempool_id)`); returns the bytes released.
#[no_mangle]
pub extern "C" fn gpumem_pool_empty_cache(a: u64, b: u64) -> u64 {
    guard(0, || {
        let Some(set) = state().devices.as_ref() else {
            return 0;
        };
        set.made()
            .filter_map(|d| d.empty_pool_cache(PoolId(a, b)).ok())
            .sum()
    })
}

/// The segments of pool `(a, b)`, flat as [`super::gpumem_segments_flat`]; 0 if none.
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_pool_segments_flat(
    device: c_int,
    a: u64,
    b: u64,
    out: *mut u64,
    cap: usize,
) -> usize {
    let flat = guard(Vec::new(), || {
        made_allocator(device)
            .and_then(|al| al.pool_segments(PoolId(a, b)).ok())
            .map_or_else(Vec::new, |s| segments_flat(&s))
    });
    // SAFETY: the caller's contract.
    unsafe { copy_out(&flat, out, cap) }
}

/// The private pools of `device` that exist now, as pairs `(a, b)` flat in `out` (at most
/// `cap` values); returns the number of values (twice the pools).
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_pool_ids(device: c_int, out: *mut u64, cap: usize) -> usize {
    let flat = guard(Vec::new(), || {
        made_allocator(device).map_or_else(Vec::new, |al| {
            al.pool_ids().into_iter().flat_map(|p| [p.0, p.1]).collect()
        })
    });
    // SAFETY: the caller's contract.
    unsafe { copy_out(&flat, out, cap) }
}

/// A checkpoint of pool `(a, b)` (`getCheckpointState`), freed with
/// [`gpumem_checkpoint_free`]; null if there is no such pool.
#[no_mangle]
pub extern "C" fn gpumem_pool_checkpoint(device: c_int, a: u64, b: u64) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        match made_allocator(device).map(|al| al.pool_layout(PoolId(a, b))) {
            Some(Ok(layout)) => Box::into_raw(Box::new(layout)) as *mut c_void,
            _ => std::ptr::null_mut(),
        }
    })
}

/// How many blocks a checkpoint holds allocated.
///
/// # Safety
/// `ckpt` must come from [`gpumem_pool_checkpoint`] and not be freed yet.
#[no_mangle]
pub unsafe extern "C" fn gpumem_checkpoint_allocated(ckpt: *const c_void) -> usize {
    if ckpt.is_null() {
        return 0;
    }
    // SAFETY: the caller's contract: a live `Box<Layout>`.
    let layout = unsafe { &*(ckpt as *const Layout) };
    layout
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.allocated)
        .count()
}

/// Free a checkpoint.
///
/// # Safety
/// `ckpt` must come from [`gpumem_pool_checkpoint`] and be freed once.
#[no_mangle]
pub unsafe extern "C" fn gpumem_checkpoint_free(ckpt: *mut c_void) {
    if !ckpt.is_null() {
        // SAFETY: the caller's contract: a `Box<Layout>` freed once.
        drop(unsafe { Box::from_raw(ckpt as *mut Layout) });
    }
}

/// Put pool `(a, b)` back to checkpoint `ckpt` (`setCheckpointPoolState`): the addresses freed
/// go to `freed` (room for `freed_cap`: the pool's live count), those handed out again to
/// `allocd` (room for `allocd_cap`: [`gpumem_checkpoint_allocated`]); `counts[0]` and
/// `counts[1]` say how many. 0 on success, -1 (nothing changed) otherwise.
///
/// # Safety
/// `ckpt` as in [`gpumem_checkpoint_allocated`]; `freed`, `allocd` hold their caps; `counts`
/// holds two values.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpumem_pool_restore(
    device: c_int,
    a: u64,
    b: u64,
    ckpt: *const c_void,
    freed: *mut u64,
    freed_cap: usize,
    allocd: *mut u64,
    allocd_cap: usize,
    counts: *mut usize,
) -> c_int {
    if ckpt.is_null() || counts.is_null() {
        return -1;
    }
    // SAFETY: the caller's contract: a live `Box<Layout>`.
    let layout = unsafe { &*(ckpt as *const Layout) };
    let r = guard(None, || {
        made_allocator(device).and_then(|al| al.restore_pool(PoolId(a, b), layout).ok())
    });
    let Some(r) = r else {
        return -1;
    };
    let back: Vec<u64> = r.allocated.iter().map(|&(p, _)| p).collect();
    // SAFETY: the caller's contract.
    unsafe {
        *counts = copy_out(&r.freed, freed, freed_cap);
        *counts.add(1) = copy_out(&back, allocd, allocd_cap);
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_through_the_c_abi() {
        let _turn = super::super::TEST_LOCK.lock();
        let (a, b) = (77, 0);
        assert_eq!(gpumem_pool_use_count(0, a, b), -1);
        assert_eq!(gpumem_pool_begin(0, a, b), 0);
        let mut err = [0 as c_char; 256];
        let mut oom = 0;
        // SAFETY: err and oom are ours, sized as passed.
        let p = unsafe {
            gpumem_pool_alloc_checked(
                0,
                a,
                b,
                4096,
                std::ptr::null_mut(),
                err.as_mut_ptr(),
                256,
                &mut oom,
            )
        };
        assert!(!p.is_null());
        // SAFETY: as above.
        let bad = unsafe {
            gpumem_pool_alloc_checked(
                0,
                5,
                5,
                4096,
                std::ptr::null_mut(),
                err.as_mut_ptr(),
                256,
                &mut oom,
            )
        };
        assert!(bad.is_null());
        assert_eq!(oom, 0);
        assert_eq!(gpumem_pool_end(0, a, b), 0);
        assert_eq!(gpumem_pool_end(0, a, b), -1, "no capture left");
        let mut live = [0u64; 4];
        // SAFETY: `live` holds 4 values.
        assert_eq!(
            unsafe { gpumem_pool_live(0, a, b, live.as_mut_ptr(), 4) },
            1
        );
        assert_eq!(live[0], p as u64);
        let ck = gpumem_pool_checkpoint(0, a, b);
        assert!(!ck.is_null());
        // SAFETY: a live checkpoint.
        assert_eq!(unsafe { gpumem_checkpoint_allocated(ck) }, 1);
        assert_eq!(super::super::gpumem_free_ptr(p), 0);
        let (mut freed, mut allocd, mut counts) = ([0u64; 1], [0u64; 1], [0usize; 2]);
        // SAFETY: arrays sized as passed; `ck` live.
        let r = unsafe {
            gpumem_pool_restore(
                0,
                a,
                b,
                ck,
                freed.as_mut_ptr(),
                1,
                allocd.as_mut_ptr(),
                1,
                counts.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0);
        assert_eq!(counts, [0, 1]);
        assert_eq!(allocd[0], p as u64);
        // SAFETY: freed once.
        unsafe { gpumem_checkpoint_free(ck) };
        assert_eq!(gpumem_pool_use_count(0, a, b), 1);
        assert_eq!(gpumem_pool_release(0, a, b), 0);
        assert_eq!(gpumem_pool_use_count(0, a, b), 0, "a block is alive");
        assert_eq!(super::super::gpumem_free_ptr(p), 0);
        assert_eq!(
            gpumem_pool_use_count(0, a, b),
            -1,
            "gone with its last block"
        );
        assert_eq!(gpumem_pool_release(0, a, b), -1);
    }
}
