//! PyTorch's allocator trace trackers (`attachAllocatorTraceTracker`), through which
//! ProcessGroupNCCL registers allocator memory with NCCL
//! (`TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`): the C++ shim installs one listener
//! here and hands each change to every tracker as a `SEGMENT_ALLOC` (register) or
//! `SEGMENT_FREE` (deregister) entry.
//!
//! The changes are those of [`gpumem::adaptor::registration`]: classic segments whole, and the
//! pages of expandable segments as each map makes them (never joined to registered neighbours,
//! which may be in use), each range deregistered before any of its memory is unmapped or freed
//! (what stays of it registered again). PyTorch's NCCL hooks act on `SEGMENT_ALLOC` and
//! `SEGMENT_FREE` only, so mapped pages are told with those actions too (pages told as
//! `SEGMENT_MAP` would never be registered, nor deregistered before an unmap, as with
//! PyTorch's own expandable segments).
//!
//! Every change is also checked against the ranges told so far ([`Registry`]); a change that
//! breaks the rule (memory going while registered) is counted in `gpumem.tracker_violations`,
//! logged, and fails a debug build.

use crate::{log_once, state};
use gpumem::adaptor::registration::{RangeChange, Registry};
use gpumem::CachingAllocator;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The shim's listener: `(ctx, device, register, addr, bytes, stream, pool id (2 values))`;
/// `register` is 1 to register, 0 to deregister. Called on the allocating thread with a
/// pool's lock held: it must not allocate from gpumem, and must not throw.
pub type SegmentListener = unsafe extern "C" fn(*mut c_void, c_int, c_int, u64, u64, u64, u64, u64);

struct Listener {
    f: SegmentListener,
    ctx: usize,
}

/// Whether a listener is set, on which devices (bit = ordinal) it is installed, and the
/// violations seen.
pub(crate) struct Trackers {
    on: AtomicBool,
    installed: AtomicU64,
    listener: Mutex<Option<Listener>>,
    pub(crate) violations: AtomicU64,
    /// ranges told registrable, and told to deregister
    pub(crate) registers: AtomicU64,
    pub(crate) deregisters: AtomicU64,
}

pub(crate) static TRACKERS: Trackers = Trackers {
    on: AtomicBool::new(false),
    installed: AtomicU64::new(0),
    listener: Mutex::new(None),
    violations: AtomicU64::new(0),
    registers: AtomicU64::new(0),
    deregisters: AtomicU64::new(0),
};

/// Set the listener for every device, those in use now and those used later (one listener: a
/// second call replaces the first). Returns 0, or -1 where `f` is null.
///
/// # Safety
/// `f` must stay callable with `ctx` for the rest of the process.
#[no_mangle]
pub unsafe extern "C" fn gpumem_set_segment_listener(
    f: Option<SegmentListener>,
    ctx: *mut c_void,
) -> c_int {
    crate::guard(-1, || {
        let Some(f) = f else {
            return -1;
        };
        if let Ok(mut l) = TRACKERS.listener.lock() {
            *l = Some(Listener {
                f,
                ctx: ctx as usize,
            });
        }
        TRACKERS.on.store(true, Ordering::Release);
        if let Some(set) = state().devices.as_ref() {
            for i in 0..set.count() {
                if let Some(d) = set.made_device(i) {
                    install(i, d.allocator());
                }
            }
        }
        0
    })
}

/// Install the listener on `device`'s allocator if a listener is set and it is not there yet
/// (on every allocator lookup: one load where no listener is set).
#[inline]
pub(crate) fn ensure(device: usize, a: &CachingAllocator) {
    if TRACKERS.on.load(Ordering::Acquire) {
        let bit = 1u64.checked_shl(device as u32).unwrap_or(0);
        if TRACKERS.installed.load(Ordering::Acquire) & bit == 0 {
            install(device, a);
        }
    }
}

#[cold]
fn install(device: usize, a: &CachingAllocator) {
    let bit = 1u64.checked_shl(device as u32).unwrap_or(0);
    if bit == 0 || TRACKERS.installed.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
        return; // installed already (or a device beyond 64, which is not tracked)
    }
    // what the tracker's users may hold already: what a snapshot lists now
    let seen = a.segments().into_iter().flat_map(|s| s.mapped.into_iter());
    let registry = Arc::new(Mutex::new(Registry::with(seen)));
    a.add_segment_hook(Arc::new(move |e| {
        let Ok(mut reg) = registry.lock() else {
            return;
        };
        let changes = reg.changes(e);
        if let Err(why) = reg.apply_all(e, &changes) {
            TRACKERS.violations.fetch_add(1, Ordering::Relaxed);
            log_once("tracker", || format!("gpumem: segment tracker: {why}"));
            debug_assert!(false, "segment tracker: {why}");
        }
        drop(reg);
        let Ok(l) = TRACKERS.listener.lock() else {
            return;
        };
        let Some(l) = l.as_ref() else {
            return;
        };
        for r in changes {
            let register = c_int::from(r.change == RangeChange::Register);
            if register == 1 {
                TRACKERS.registers.fetch_add(1, Ordering::Relaxed);
            } else {
                TRACKERS.deregisters.fetch_add(1, Ordering::Relaxed);
            }
            // SAFETY: the listener's contract (set by `gpumem_set_segment_listener`).
            unsafe {
                (l.f)(
                    l.ctx as *mut c_void,
                    device as c_int,
                    register,
                    r.addr,
                    r.bytes,
                    r.stream.0,
                    r.pool.0,
                    r.pool.1,
                )
            };
        }
    }));
}
