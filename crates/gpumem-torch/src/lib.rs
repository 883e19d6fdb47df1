//! gpumem as PyTorch's (and CuPy's) allocator: the C ABI that
//! `torch.cuda.memory.CUDAPluggableAllocator(path, "gpumem_alloc", "gpumem_free")` loads.
//!
//! One caching allocator per device, created on first use on the device's primary context
//! (the one PyTorch uses), configured from `GPUMEM_CONF`. Nothing here panics across the ABI:
//! bad calls (unknown or double frees, negative sizes, devices never initialised) are counted,
//! logged to stderr once per kind, and answered with a null pointer or nothing. An allocation
//! that fails after gpumem has emptied its cache and retried returns null, which PyTorch turns
//! into its usual `OutOfMemoryError`; the message gpumem logs says what was reserved, free and
//! fragmented.
//!
//! The statistics functions return JSON or text in a buffer the caller frees with
//! [`gpumem_free_string`].

use gpumem::{CachingAllocator, Config, Stream};
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

mod ipc;
mod pools;
mod trackers;
pub use ipc::*;
pub use pools::*;

/// Counters of calls gpumem refused.
#[derive(Debug, Default)]
pub struct Refused {
    /// frees of addresses gpumem did not hand out (or already freed)
    pub bad_frees: AtomicU64,
    /// requests with a negative size
    pub negative_sizes: AtomicU64,
    /// requests for a device gpumem could not initialise
    pub bad_devices: AtomicU64,
    /// allocations that failed (out of memory or a driver error)
    pub failed_allocs: AtomicU64,
    /// requests of zero bytes (answered with null, as PyTorch does)
    pub zero_sizes: AtomicU64,
}

struct State {
    /// the devices (`None` where the configuration is bad: every call is then refused)
    devices: Option<gpumem::DeviceSet>,
    refused: Refused,
    /// kinds of refusal already logged (log once each)
    logged: Mutex<Vec<&'static str>>,
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| State {
        devices: match config() {
            Ok(c) => Some(device_set(c)),
            Err(e) => {
                eprintln!("gpumem: {e}");
                None
            }
        },
        refused: Refused::default(),
        logged: Mutex::new(Vec::new()),
    })
}

fn log_once(kind: &'static str, msg: impl FnOnce() -> String) {
    let first = state()
        .logged
        .lock()
        .map(|mut l| {
            let new = !l.contains(&kind);
            if new {
                l.push(kind);
            }
            new
        })
        .unwrap_or(true);
    if first {
        eprintln!("gpumem: {} (further ones are only counted)", msg());
    }
}

/// The configuration the library uses: `GPUMEM_CONF`, with a budget of the whole device
/// unless one is set (so the memory fraction can be changed later), and one shard unless
/// `shards` is set: PyTorch frees from its autograd threads what the main thread allocated,
/// and one pool per device keeps all of it in one place (PyTorch's allocator has one lock per
/// device too).
fn config() -> gpumem::Result<Config> {
    let mut c = Config::from_env()?;
    if c.budget.memory_fraction.is_none() && c.budget.memory_limit.is_none() {
        c.budget.memory_fraction = Some(1.0);
    }
    let explicit = std::env::var(gpumem::config::ENV_VAR).is_ok_and(|s| s.contains("shards"));
    if !explicit {
        c.shards = Some(1);
    }
    Ok(c)
}

/// The allocator of `device` if it is in use already (reading figures never makes a device:
/// on a machine of several GPUs that would create a context on each).
fn made_allocator(device: c_int) -> Option<&'static CachingAllocator> {
    let set = state().devices.as_ref()?;
    let d = set.made_device(usize::try_from(device).ok()?)?;
    Some(d.allocator())
}

/// The allocator of `device`, created on first use; `None` if it cannot be (the reason is
/// logged once).
pub fn allocator(device: c_int) -> Option<&'static CachingAllocator> {
    let set = state().devices.as_ref()?;
    let ordinal = usize::try_from(device).ok()?;
    match set.device(ordinal) {
        Ok(d) => {
            let a = d.allocator();
            trackers::ensure(ordinal, a);
            // a device first used while torch records history records too (checked by a bit
            // per device, not by locking a shard on every call)
            if HISTORY.on.load(Ordering::Relaxed) {
                let bit = 1u64.checked_shl(ordinal as u32).unwrap_or(0);
                if HISTORY.started.load(Ordering::Relaxed) & bit == 0 || bit == 0 {
                    if !a.is_recording() {
                        a.start_recording();
                    }
                    HISTORY.started.fetch_or(bit, Ordering::Relaxed);
                }
            }
            Some(a)
        }
        Err(e) => {
            log_once("device", || {
                format!("cannot initialise device {device}: {e}")
            });
            None
        }
    }
}

/// The GPUs, each made on first use on its primary context (the one PyTorch uses).
#[cfg(all(feature = "cuda", not(test)))]
fn device_set(config: Config) -> gpumem::DeviceSet {
    gpumem::DeviceSet::new(config)
}

/// Without CUDA (and in this crate's unit tests, which exercise the ABI on the host backend)
/// device 0 is host memory; there is no other device.
#[cfg(any(not(feature = "cuda"), test))]
fn device_set(config: Config) -> gpumem::DeviceSet {
    gpumem::DeviceSet::host(config)
}

fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

fn to_c(s: String) -> *mut c_char {
    CString::new(s.replace('\0', " "))
        .map(CString::into_raw)
        .unwrap_or(std::ptr::null_mut())
}

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)` for PyTorch.
#[no_mangle]
pub extern "C" fn gpumem_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let r = &state().refused;
        if size < 0 {
            r.negative_sizes.fetch_add(1, Ordering::Relaxed);
            log_once("negative", || {
                format!("allocation of a negative size ({size})")
            });
            return std::ptr::null_mut();
        }
        if size == 0 {
            r.zero_sizes.fetch_add(1, Ordering::Relaxed);
            return std::ptr::null_mut();
        }
        let Some(a) = allocator(device) else {
            r.bad_devices.fetch_add(1, Ordering::Relaxed);
            log_once("device", || {
                format!("allocation on device {device}, which gpumem could not initialise")
            });
            return std::ptr::null_mut();
        };
        match a.allocate_ptr(Stream(stream as u64), size as usize, 512) {
            Ok(p) => p as *mut c_void,
            Err(e) => {
                r.failed_allocs.fetch_add(1, Ordering::Relaxed);
                eprintln!("gpumem: allocation of {size} bytes on device {device} failed: {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// [`gpumem_alloc`] for the native torch allocator (`csrc/allocator.cpp`): on failure the
/// reason (gpumem's explanation: requested, free, reserved, allocated, largest free block,
/// budget) is written NUL-terminated into `err` (at most `errlen` bytes) and `*oom` is set to
/// 1 when the device is out of memory (after gpumem emptied its cache and retried), else 0.
///
/// # Safety
/// `err` must be null or hold `errlen` writable bytes; `oom` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn gpumem_alloc_checked(
    size: isize,
    device: c_int,
    stream: *mut c_void,
    err: *mut c_char,
    errlen: usize,
    oom: *mut c_int,
) -> *mut c_void {
    let result = guard(Err((false, String::new())), || {
        let a = sized_allocator(size, device)?;
        a.allocate_ptr(Stream(stream as u64), size as usize, 512)
            .map_err(|e| (e.is_out_of_memory(), e.to_string()))
    });
    // SAFETY: the caller's contract.
    unsafe { checked_result(result, err, errlen, oom) }
}

/// [`gpumem_alloc_checked`] for a torch DataPtr: `*token` receives what
/// [`gpumem_free_token`] frees the block with (the DataPtr's context: its deleter gets
/// nothing else). The block can also be freed by address ([`gpumem_free_ptr`]).
///
/// # Safety
/// As [`gpumem_alloc_checked`]; `token` must be writable.
#[no_mangle]
pub unsafe extern "C" fn gpumem_alloc_token(
    size: isize,
    device: c_int,
    stream: *mut c_void,
    err: *mut c_char,
    errlen: usize,
    oom: *mut c_int,
    token: *mut u64,
) -> *mut c_void {
    let result = guard(Err((false, String::new())), || {
        if !(0..=0xffff).contains(&device) {
            return Err((false, format!("allocation on device {device}")));
        }
        let a = sized_allocator(size, device)?;
        a.allocate_token(Stream(stream as u64), size as usize, 512)
            .map(|(p, t)| {
                // SAFETY: the caller's contract.
                unsafe { *token = (device as u64) << 48 | t };
                p
            })
            .map_err(|e| (e.is_out_of_memory(), e.to_string()))
    });
    // SAFETY: the caller's contract.
    unsafe { checked_result(result, err, errlen, oom) }
}

/// Free the block of `token` ([`gpumem_alloc_token`]); 0 on success, -1 if the token is not
/// (or no longer) a live block.
#[no_mangle]
pub extern "C" fn gpumem_free_token(token: u64) -> c_int {
    guard(-1, || {
        let device = (token >> 48) as c_int;
        let Some(a) = made_allocator(device) else {
            return -1;
        };
        match a.deallocate_token(token & 0xffff_ffff_ffff) {
            Ok(ptr) => {
                ipc::forget_export(ptr);
                0
            }
            Err(e) => {
                state().refused.bad_frees.fetch_add(1, Ordering::Relaxed);
                log_once("free", || format!("free of token {token:#x}: {e}"));
                -1
            }
        }
    })
}

/// The device of the calling thread's current CUDA context (torch's current device), or -1
/// where the thread has no context yet (ask the CUDA runtime then). One driver call, cheaper
/// than torch's own lookup (measured on the H100 host: cudaGetDevice 40 ns, c10's 54 ns).
#[no_mangle]
pub extern "C" fn gpumem_current_device() -> c_int {
    gpumem::device::current_device().map_or(-1, |d| d as c_int)
}

/// Allocate `n` blocks of `sizes[i]` bytes each on `device` and `stream` in one call
/// (neighbouring blocks, at most one driver call: see `CachingAllocator::allocate_batch`);
/// `out[i]` receives each address. 0 on success; -1 otherwise, with nothing allocated. Free
/// each with [`gpumem_free_ptr`].
///
/// # Safety
/// `sizes` must hold `n` values and `out` `n` writable pointers.
#[no_mangle]
pub unsafe extern "C" fn gpumem_alloc_batch(
    sizes: *const usize,
    n: usize,
    device: c_int,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> c_int {
    if n == 0 {
        return 0;
    }
    if sizes.is_null() || out.is_null() {
        return -1;
    }
    // SAFETY: the caller's contract.
    let sizes = unsafe { std::slice::from_raw_parts(sizes, n) };
    let r = guard(None, || {
        let a = allocator(device)?;
        match a.allocate_batch_ptr(Stream(stream as u64), sizes, 512) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("gpumem: batch of {n} allocations on device {device} failed: {e}");
                None
            }
        }
    });
    let Some(ptrs) = r else {
        return -1;
    };
    for (i, p) in ptrs.into_iter().enumerate() {
        // SAFETY: `out` holds `n` pointers (the caller's contract) and i < n.
        unsafe { *out.add(i) = p as *mut c_void };
    }
    0
}

/// `record_stream` for the block of `token` ([`gpumem_alloc_token`]); 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_record_stream_token(token: u64, stream: *mut c_void) -> c_int {
    guard(-1, || {
        let Some(a) = made_allocator((token >> 48) as c_int) else {
            return -1;
        };
        match a.record_stream_token(token & 0xffff_ffff_ffff, Stream(stream as u64)) {
            Ok(()) => 0,
            Err(_) => -1,
        }
    })
}

/// The allocator of `device` for an allocation of `size` bytes, or why there is none (not out
/// of memory).
pub(crate) fn sized_allocator(
    size: isize,
    device: c_int,
) -> Result<&'static CachingAllocator, (bool, String)> {
    if size <= 0 {
        return Err((false, format!("allocation of {size} bytes")));
    }
    allocator(device).ok_or_else(|| {
        (
            false,
            format!("device {device} could not be initialised (see the log)"),
        )
    })
}

/// The pointer of `result`, or null with the reason written to `err` and `*oom` set.
///
/// # Safety
/// As [`gpumem_alloc_checked`]'s `err`, `errlen` and `oom`.
unsafe fn checked_result(
    result: Result<u64, (bool, String)>,
    err: *mut c_char,
    errlen: usize,
    oom: *mut c_int,
) -> *mut c_void {
    match result {
        Ok(p) => p as *mut c_void,
        Err((is_oom, msg)) => {
            // an empty message: the allocation panicked (caught by `guard`, whose fallback
            // allocates nothing on the fast path)
            let msg = if msg.is_empty() {
                "gpumem panicked".to_string()
            } else {
                msg
            };
            if !oom.is_null() {
                // SAFETY: the caller's contract.
                unsafe { *oom = c_int::from(is_oom) };
            }
            if !err.is_null() && errlen > 0 {
                let bytes = msg.as_bytes();
                let n = bytes.len().min(errlen - 1);
                // SAFETY: `err` holds `errlen` bytes (the caller's contract); n + 1 <= errlen.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), err as *mut u8, n);
                    *err.add(n) = 0;
                }
            }
            std::ptr::null_mut()
        }
    }
}

/// Free `ptr`, allocated on any device (the native torch allocator's deleter knows only the
/// pointer); 0 on success, -1 if no device knows it.
#[no_mangle]
pub extern "C" fn gpumem_free_ptr(ptr: *mut c_void) -> c_int {
    guard(-1, || {
        if ptr.is_null() {
            return 0;
        }
        let Some(set) = state().devices.as_ref() else {
            return -1;
        };
        ipc::forget_export(ptr as u64);
        for d in set.made() {
            if d.deallocate_ptr(ptr as u64).is_ok() {
                return 0;
            }
        }
        state().refused.bad_frees.fetch_add(1, Ordering::Relaxed);
        log_once("free", || format!("free of {ptr:?}: no device knows it"));
        -1
    })
}

/// Fill `out[i]` with the statistic named `keys[i]` (`torch.cuda.memory_stats()` names such as
/// `"allocated_bytes.all.current"`; 0 where gpumem has no such figure) for `device`; 0 on
/// success, -1 if the device cannot be used.
///
/// # Safety
/// `keys` must hold `n` NUL-terminated strings and `out` `n` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_stats_values(
    device: c_int,
    keys: *const *const c_char,
    out: *mut i64,
    n: usize,
) -> c_int {
    guard(-1, || {
        let Some(a) = allocator(device) else {
            return -1;
        };
        if n == 0 || keys.is_null() || out.is_null() {
            return 0;
        }
        let map = a.stats().to_flat_map();
        for i in 0..n {
            // SAFETY: the caller's contract: `keys` holds `n` C strings, `out` `n` values.
            unsafe {
                let k = std::ffi::CStr::from_ptr(*keys.add(i)).to_string_lossy();
                *out.add(i) = map.get(k.as_ref()).map_or(0, |&v| v as i64);
            }
        }
        0
    })
}

/// The largest free block of `device` (`torch.cuda` cache info), 0 if none or no device.
#[no_mangle]
pub extern "C" fn gpumem_largest_free_block(device: c_int) -> u64 {
    guard(0, || {
        allocator(device).map_or(0, |a| a.largest_free_block())
    })
}

/// The largest block one allocation on `device` could take now: its largest free block or
/// the device's free memory within the budget, whichever is more (`cacheInfo`, as PyTorch's
/// own allocator answers it: cuDNN sizes its workspaces by it); 0 if no device.
#[no_mangle]
pub extern "C" fn gpumem_largest_available_block(device: c_int) -> u64 {
    guard(0, || {
        allocator(device).map_or(0, |a| a.largest_available_block())
    })
}

/// Copy `v` into `out` (at most `cap` values); returns `v.len()`, what the whole answer needs.
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
pub(crate) unsafe fn copy_out(v: &[u64], out: *mut u64, cap: usize) -> usize {
    if !out.is_null() {
        let n = v.len().min(cap);
        // SAFETY: `out` holds `cap` values (the caller's contract) and n <= cap.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, n) };
    }
    v.len()
}

/// The segments of `device` for `torch.cuda.memory._snapshot()`, as a flat array of u64:
/// per segment `address, total_size, stream, is_large, is_expandable, block count`, then per
/// block `size, requested_size, allocated, active`. The shared pool's segments only (a private
/// pool's: `gpumem_pool_segments_flat`). An expandable segment is reported as one
/// segment per mapped run of pages (what it holds in memory), its blocks clipped to the run.
/// Writes at most `cap` values into `out` and returns how many the whole answer needs (call
/// again with that much room); 0 where the device cannot be used.
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_segments_flat(device: c_int, out: *mut u64, cap: usize) -> usize {
    let flat = guard(Vec::new(), || {
        made_allocator(device).map_or_else(Vec::new, |a| segments_flat(&a.shared_segments()))
    });
    // SAFETY: the caller's contract.
    unsafe { copy_out(&flat, out, cap) }
}

/// See [`gpumem_segments_flat`].
pub fn segments_flat(segments: &[gpumem::pool::SegmentInfo]) -> Vec<u64> {
    let mut v = Vec::new();
    for s in segments {
        let large = u64::from(s.kind == gpumem::pool::PoolKind::Large);
        let runs: Vec<(u64, u64)> = if s.expandable {
            s.mapped.clone()
        } else {
            vec![(s.addr, s.size)]
        };
        for (start, len) in runs {
            let end = start + len;
            let blocks: Vec<[u64; 4]> = s
                .blocks
                .iter()
                .filter(|b| b.addr < end && b.addr + b.size > start)
                .map(|b| {
                    let size = (b.addr + b.size).min(end) - b.addr.max(start);
                    [
                        size,
                        b.requested.min(size),
                        u64::from(b.allocated),
                        u64::from(b.active),
                    ]
                })
                .collect();
            v.extend([start, len, s.stream.0, large, u64::from(s.expandable)]);
            v.push(blocks.len() as u64);
            for b in blocks {
                v.extend(b);
            }
        }
    }
    v
}

/// `torch.cuda.memory._record_memory_history`: whether gpumem records, the most events kept per
/// device, and what each device recorded so far.
struct History {
    on: std::sync::atomic::AtomicBool,
    /// devices (bit = ordinal, below 64) recording since history was turned on
    started: AtomicU64,
    max_entries: AtomicU64,
    events: Mutex<Vec<DeviceHistory>>,
}

/// One device's recorded events.
#[derive(Default)]
struct DeviceHistory {
    /// the events kept (the last `max_entries`)
    kept: Vec<gpumem::trace::TraceEvent>,
    /// events taken from the allocator since the library was loaded (never reset: the C++
    /// side numbers events with it, see [`gpumem_history_count`])
    taken: u64,
}

static HISTORY: History = History {
    on: std::sync::atomic::AtomicBool::new(false),
    started: AtomicU64::new(0),
    max_entries: AtomicU64::new(u64::MAX),
    events: Mutex::new(Vec::new()),
};

/// Record allocator events on every device (`on` non-zero), keeping at most `max_entries` per
/// device (0: no limit), or stop and forget them. Devices first used later record too. A call
/// while recording goes on keeps what was recorded unless `clear` is non-zero
/// (`torch.cuda.memory._record_memory_history(..., clear_history=...)`).
#[no_mangle]
pub extern "C" fn gpumem_record_history(on: c_int, max_entries: usize, clear: c_int) {
    guard((), || {
        let on = on != 0;
        let was = HISTORY.on.swap(on, Ordering::Relaxed);
        let max = if max_entries == 0 {
            u64::MAX
        } else {
            max_entries as u64
        };
        HISTORY.max_entries.store(max, Ordering::Relaxed);
        if on && was && clear == 0 {
            return; // recording goes on, with the new limit
        }
        HISTORY.started.store(0, Ordering::Relaxed);
        if let Ok(mut h) = HISTORY.events.lock() {
            h.iter_mut().for_each(|d| d.kept.clear());
        }
        let Some(set) = state().devices.as_ref() else {
            return;
        };
        for d in set.made() {
            let a = d.allocator();
            if on {
                a.start_recording();
            } else {
                a.stop_recording();
            }
        }
    })
}

/// Whether history is being recorded.
#[no_mangle]
pub extern "C" fn gpumem_history_enabled() -> c_int {
    c_int::from(HISTORY.on.load(Ordering::Relaxed))
}

/// Tag the events this thread records from now on (see [`gpumem::pool::record::set_record_tag`]);
/// returns the previous tag. The C++ allocator ties PyTorch's stack traces to events with it.
#[no_mangle]
pub extern "C" fn gpumem_history_set_tag(tag: u64) -> u64 {
    gpumem::pool::record::set_record_tag(tag)
}

/// The recorded history of `device` as a flat array of u64, six per event: action (PyTorch's
/// `TraceEntry::Action` numbering: alloc 0, free_requested 1, free_completed 2, segment_alloc
/// 3, segment_free 4, segment_map 5, segment_unmap 6, snapshot 7, oom 8), address, size,
/// stream, microseconds since recording started, the tag the recording thread had set (0:
/// none; see [`gpumem_history_set_tag`]). Writes at most `cap` values into `out` and
/// returns how many the whole answer needs; recording goes on.
///
/// # Safety
/// `out` must be null or hold `cap` writable values.
#[no_mangle]
pub unsafe extern "C" fn gpumem_history_flat(device: c_int, out: *mut u64, cap: usize) -> usize {
    let flat = guard(Vec::new(), || {
        with_history(device, |d| history_flat(&d.kept)).unwrap_or_default()
    });
    // SAFETY: the caller's contract.
    unsafe { copy_out(&flat, out, cap) }
}

/// How many events `device` has recorded since the library was loaded, those not yet taken
/// from its allocator included (0 for a device not in use). The `k`-th of the `n` events
/// [`gpumem_history_flat`] returns is event number `count - n + k`: the C++ allocator ties
/// `_set_memory_metadata` to the events that follow it with these numbers.
#[no_mangle]
pub extern "C" fn gpumem_history_count(device: c_int) -> u64 {
    guard(0, || with_history(device, |d| d.taken).unwrap_or(0))
}

/// `f` over `device`'s history, after taking what its allocator recorded since (keeping the
/// last `max_entries`); `None` for a device not in use.
fn with_history<T>(device: c_int, f: impl FnOnce(&DeviceHistory) -> T) -> Option<T> {
    let (a, ordinal) = (made_allocator(device)?, usize::try_from(device).ok()?);
    let mut h = HISTORY.events.lock().ok()?;
    if h.len() <= ordinal {
        h.resize_with(ordinal + 1, DeviceHistory::default);
    }
    let d = &mut h[ordinal];
    let new = a.take_recorded();
    d.taken += new.len() as u64;
    d.kept.extend(new);
    let max = HISTORY.max_entries.load(Ordering::Relaxed) as usize;
    if d.kept.len() > max {
        d.kept.drain(..d.kept.len() - max);
    }
    Some(f(d))
}

/// See [`gpumem_history_flat`].
pub fn history_flat(events: &[gpumem::trace::TraceEvent]) -> Vec<u64> {
    use gpumem::trace::Action;
    events
        .iter()
        .flat_map(|e| {
            let action = match e.action {
                Action::Alloc => 0,
                Action::FreeRequested => 1,
                Action::FreeCompleted => 2,
                Action::SegmentAlloc => 3,
                Action::SegmentFree => 4,
                Action::SegmentMap => 5,
                Action::SegmentUnmap => 6,
                Action::Snapshot => 7,
                Action::Oom => 8,
                // (the pool records none: a trace file's own)
                Action::EmptyCache => 9,
            };
            [action, e.addr, e.size, e.stream, e.time_us, e.tag]
        })
        .collect()
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)` for PyTorch. The
/// block goes back to the pool ordered on the stream it was allocated on.
#[no_mangle]
pub extern "C" fn gpumem_free(ptr: *mut c_void, size: isize, device: c_int, _stream: *mut c_void) {
    guard((), || {
        if ptr.is_null() {
            return;
        }
        let r = &state().refused;
        let Some(a) = allocator(device) else {
            r.bad_devices.fetch_add(1, Ordering::Relaxed);
            log_once("device-free", || {
                format!("free on device {device}, which gpumem could not initialise")
            });
            return;
        };
        if let Err(e) = a.deallocate_ptr(ptr as u64) {
            r.bad_frees.fetch_add(1, Ordering::Relaxed);
            log_once("free", || format!("free of {ptr:?} ({size} bytes): {e}"));
        }
    })
}

/// `torch.cuda.empty_cache()`: release every cached block of every device; returns the bytes
/// released.
#[no_mangle]
pub extern "C" fn gpumem_empty_cache() -> u64 {
    guard(0, || {
        state()
            .devices
            .iter()
            .flat_map(|set| set.made())
            .map(|d| d.empty_cache())
            .sum()
    })
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`; 0 on success, -1 on error.
#[no_mangle]
pub extern "C" fn gpumem_set_memory_fraction(fraction: f64, device: c_int) -> c_int {
    guard(-1, || {
        match allocator(device).map(|a| a.set_memory_fraction(fraction)) {
            Some(Ok(())) => 0,
            Some(Err(e)) => {
                eprintln!("gpumem: {e}");
                -1
            }
            None => -1,
        }
    })
}

/// `torch.cuda.memory._set_allocator_settings(settings)`: the run-time settings
/// (`max_split_size_mb`, `roundup_power2_divisions`, `garbage_collection_threshold`) of every
/// device's allocator made so far (see `CachingAllocator::set_runtime_settings`); 0 on
/// success, -1 if the string does not parse (nothing changes then).
///
/// # Safety
/// `settings` is a NUL-terminated string, or null (an error).
#[no_mangle]
pub unsafe extern "C" fn gpumem_set_allocator_settings(settings: *const c_char) -> c_int {
    if settings.is_null() {
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated string, read only during this call.
    let s = unsafe { std::ffi::CStr::from_ptr(settings) }
        .to_string_lossy()
        .into_owned();
    guard(-1, || {
        // parsed once, before any device changes: a bad string changes nothing
        let config = match Config::parse(&s) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("gpumem: allocator settings {s:?}: {e}");
                return -1;
            }
        };
        for d in state().devices.iter().flat_map(|set| set.made()) {
            d.set_runtime_settings(&config);
        }
        0
    })
}

/// Record that `stream` uses the block at `ptr` (`Tensor.record_stream`); 0 on success.
#[no_mangle]
pub extern "C" fn gpumem_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    guard(-1, || match allocator(device) {
        Some(a) => match a.record_stream_ptr(ptr as u64, Stream(stream as u64)) {
            Ok(()) => 0,
            Err(e) => {
                log_once("record", || format!("record_stream of {ptr:?}: {e}"));
                -1
            }
        },
        None => -1,
    })
}

/// `torch.cuda.reset_peak_memory_stats(device)`.
#[no_mangle]
pub extern "C" fn gpumem_reset_peak(device: c_int) {
    guard((), || {
        if let Some(a) = allocator(device) {
            a.reset_peak();
        }
    })
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`.
#[no_mangle]
pub extern "C" fn gpumem_reset_accumulated(device: c_int) {
    guard((), || {
        if let Some(a) = allocator(device) {
            a.reset_accumulated();
        }
    })
}

/// The statistics of `device` as a JSON object with `torch.cuda.memory_stats()` key names
/// (`"allocated_bytes.all.current"`, ...) plus gpumem's own and the refused-call counters.
/// Free the string with [`gpumem_free_string`].
#[no_mangle]
pub extern "C" fn gpumem_stats_json(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || to_c(stats_json(device)))
}

/// The stats JSON (see [`gpumem_stats_json`]).
pub fn stats_json(device: c_int) -> String {
    let mut map: serde_json::Map<String, serde_json::Value> = serde_json::Map::new();
    if let Some(a) = allocator(device) {
        for (k, v) in a.stats().to_flat_map() {
            map.insert(k, v.into());
        }
    }
    let r = &state().refused;
    for (k, v) in [
        ("gpumem.bad_frees", &r.bad_frees),
        ("gpumem.negative_sizes", &r.negative_sizes),
        ("gpumem.bad_devices", &r.bad_devices),
        ("gpumem.failed_allocs", &r.failed_allocs),
        ("gpumem.zero_sizes", &r.zero_sizes),
        ("gpumem.tracker_violations", &trackers::TRACKERS.violations),
        ("gpumem.tracker_registers", &trackers::TRACKERS.registers),
        (
            "gpumem.tracker_deregisters",
            &trackers::TRACKERS.deregisters,
        ),
    ] {
        map.insert(k.into(), v.load(Ordering::Relaxed).into());
    }
    serde_json::Value::Object(map).to_string()
}

/// `torch.cuda.memory_summary(device)`: a text table. Free with [`gpumem_free_string`].
#[no_mangle]
pub extern "C" fn gpumem_memory_summary(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        to_c(match allocator(device) {
            Some(a) => a.memory_summary(),
            None => format!("gpumem: device {device} is not initialised\n"),
        })
    })
}

/// Live allocations of `device` as JSON: `{"count", "bytes", "largest": [{"addr", "size",
/// "requested"}, ... up to 20]}`. Free with [`gpumem_free_string`].
#[no_mangle]
pub extern "C" fn gpumem_leak_report(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || to_c(leak_report(device)))
}

/// The leak report JSON (see [`gpumem_leak_report`]).
pub fn leak_report(device: c_int) -> String {
    let mut live: Vec<(u64, u64, u64)> = allocator(device)
        .map(|a| {
            a.segments()
                .iter()
                .flat_map(|s| s.blocks.iter())
                .filter(|b| b.allocated)
                .map(|b| (b.addr, b.size, b.requested))
                .collect()
        })
        .unwrap_or_default();
    live.sort_by_key(|l| std::cmp::Reverse(l.2));
    let bytes: u64 = live.iter().map(|l| l.2).sum();
    let largest: Vec<serde_json::Value> = live
        .iter()
        .take(20)
        .map(|&(addr, size, requested)| {
            serde_json::json!({"addr": addr, "size": size, "requested": requested})
        })
        .collect();
    serde_json::json!({"count": live.len(), "bytes": bytes, "largest": largest}).to_string()
}

/// Free a string returned by this library.
///
/// # Safety
/// `s` must come from one of this library's string functions and not be freed before.
#[no_mangle]
pub unsafe extern "C" fn gpumem_free_string(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the contract above: `s` came from `CString::into_raw` here.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The C ABI's state is global: its tests take turns.
#[cfg(test)]
pub(crate) static TEST_LOCK: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(key: &str) -> u64 {
        let v: serde_json::Value = serde_json::from_str(&stats_json(0)).unwrap();
        v[key].as_u64().unwrap_or_else(|| panic!("no {key}"))
    }

    fn string(p: *mut c_char) -> String {
        assert!(!p.is_null());
        // SAFETY: a string this library returned, read then freed once.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned();
        unsafe { gpumem_free_string(p) };
        s
    }

    #[test]
    fn tokens_free_blocks_once_and_addresses_still_work() {
        let _turn = super::TEST_LOCK.lock();
        let s = std::ptr::null_mut();
        let (mut err, mut oom, mut token) = ([0 as c_char; 128], 0, 0u64);
        let base = stat("allocated_bytes.all.current");
        // SAFETY: buffers sized as passed.
        let p =
            unsafe { gpumem_alloc_token(4096, 0, s, err.as_mut_ptr(), 128, &mut oom, &mut token) };
        assert!(!p.is_null());
        assert_eq!(stat("allocated_bytes.all.current"), base + 4096);
        assert_eq!(
            gpumem_record_stream(p, 0, 7 as *mut c_void),
            0,
            "found by address"
        );
        assert_eq!(gpumem_record_stream_token(token, 8 as *mut c_void), 0);
        assert_eq!(gpumem_free_token(token), 0);
        assert_eq!(gpumem_free_token(token), -1, "a token frees once");
        assert_eq!(gpumem_free_token(u64::MAX), -1);
        assert_eq!(gpumem_record_stream_token(token, s), -1, "freed");
        assert_eq!(stat("allocated_bytes.all.current"), base);
        // a block of a token given back by address (torch's raw_delete of a storage's pointer)
        // SAFETY: as above.
        let q =
            unsafe { gpumem_alloc_token(8192, 0, s, err.as_mut_ptr(), 128, &mut oom, &mut token) };
        assert_eq!(gpumem_free_ptr(q), 0);
        assert_eq!(gpumem_free_token(token), -1, "already freed by address");
        // SAFETY: as above; a negative size and a bad device are refused.
        unsafe {
            assert!(
                gpumem_alloc_token(-1, 0, s, err.as_mut_ptr(), 128, &mut oom, &mut token).is_null()
            );
            assert!(
                gpumem_alloc_token(64, 9, s, err.as_mut_ptr(), 128, &mut oom, &mut token).is_null()
            );
        }
    }

    #[test]
    fn a_batch_through_the_c_abi() {
        let _turn = super::TEST_LOCK.lock();
        let base = stat("allocated_bytes.all.current");
        let sizes = [4096usize, 1 << 20, 100];
        let mut out = [std::ptr::null_mut(); 3];
        // SAFETY: arrays sized as passed.
        let r = unsafe {
            gpumem_alloc_batch(sizes.as_ptr(), 3, 0, std::ptr::null_mut(), out.as_mut_ptr())
        };
        assert_eq!(r, 0);
        assert!(out.iter().all(|p| !p.is_null()));
        assert!(stat("allocated_bytes.all.current") > base);
        for p in out {
            assert_eq!(gpumem_free_ptr(p), 0);
        }
        assert_eq!(stat("allocated_bytes.all.current"), base);
        let bad = [4096usize, 0];
        let mut out2 = [std::ptr::null_mut(); 2];
        // SAFETY: as above.
        let r = unsafe {
            gpumem_alloc_batch(bad.as_ptr(), 2, 0, std::ptr::null_mut(), out2.as_mut_ptr())
        };
        assert_eq!(r, -1);
        assert_eq!(
            stat("allocated_bytes.all.current"),
            base,
            "nothing stays allocated"
        );
    }

    // one test: the library's state is process-wide
    #[test]
    fn the_c_abi_allocates_frees_reports_and_never_crashes_on_bad_calls() {
        let _turn = super::TEST_LOCK.lock();
        // the refusal counters are process-wide and other tests add to them: count from here
        let counted: Vec<(&str, u64)> = [
            "gpumem.bad_frees",
            "gpumem.negative_sizes",
            "gpumem.zero_sizes",
            "gpumem.bad_devices",
            "gpumem.failed_allocs",
            "num_ooms",
        ]
        .into_iter()
        .map(|k| (k, stat(k)))
        .collect();
        let before = |k: &str| counted.iter().find(|c| c.0 == k).unwrap().1;
        let s = std::ptr::null_mut();
        let p = gpumem_alloc(1000, 0, s);
        assert!(!p.is_null());
        assert_eq!(stat("allocated_bytes.all.current"), 1024);
        assert_eq!(stat("requested_bytes.all.current"), 1000);
        let q = gpumem_alloc(3 << 20, 0, s);
        assert!(!q.is_null());
        assert!(string(gpumem_memory_summary(0)).contains("Allocated memory"));
        let leaks: serde_json::Value =
            serde_json::from_str(&string(gpumem_leak_report(0))).unwrap();
        assert_eq!(leaks["count"], 2);
        assert_eq!(leaks["bytes"], 1000 + (3 << 20));
        assert_eq!(leaks["largest"][0]["requested"], 3 << 20);
        gpumem_free(p, 1000, 0, s);
        gpumem_free(q, 3 << 20, 0, s);
        assert_eq!(stat("allocated_bytes.all.current"), 0);
        // bad calls: counted, never a crash, the allocator stays usable
        gpumem_free(p, 1000, 0, s); // double free
        gpumem_free(0xdead_0000 as *mut c_void, 8, 0, s); // unknown pointer
        assert_eq!(stat("gpumem.bad_frees") - before("gpumem.bad_frees"), 2);
        assert!(gpumem_alloc(-5, 0, s).is_null());
        assert_eq!(
            stat("gpumem.negative_sizes") - before("gpumem.negative_sizes"),
            1
        );
        assert!(gpumem_alloc(0, 0, s).is_null());
        assert_eq!(stat("gpumem.zero_sizes") - before("gpumem.zero_sizes"), 1);
        assert!(gpumem_alloc(64, 7, s).is_null()); // a device that does not exist
        assert!(gpumem_alloc(64, -1, s).is_null());
        gpumem_free(p, 64, 7, s);
        assert_eq!(stat("gpumem.bad_devices") - before("gpumem.bad_devices"), 3);
        assert_eq!(gpumem_set_memory_fraction(2.0, 0), -1);
        assert_eq!(gpumem_record_stream(0x1234 as *mut c_void, 0, s), -1);
        // an allocation past the budget fails with null after the cache was emptied
        let big = gpumem_alloc(1 << 20, 0, s);
        gpumem_free(big, 1 << 20, 0, s);
        assert_eq!(gpumem_set_memory_fraction(1e-9, 0), 0);
        assert!(gpumem_alloc(1 << 30, 0, s).is_null());
        assert_eq!(
            stat("gpumem.failed_allocs") - before("gpumem.failed_allocs"),
            1
        );
        assert_eq!(stat("num_ooms") - before("num_ooms"), 1);
        assert_eq!(gpumem_set_memory_fraction(1.0, 0), 0);
        let ok = gpumem_alloc(4096, 0, s);
        assert!(!ok.is_null());
        gpumem_free(ok, 4096, 0, s);
        gpumem_reset_peak(0);
        assert_eq!(stat("allocated_bytes.all.peak"), 0);
        gpumem_reset_accumulated(0);
        assert_eq!(stat("allocation.all.allocated"), 0);
        // the native torch allocator's calls: an explained out-of-memory, frees by pointer
        // alone, statistics by name, the largest free block
        let mut err = [0 as c_char; 256];
        let mut oom: c_int = -1;
        assert_eq!(gpumem_set_memory_fraction(1e-9, 0), 0);
        // SAFETY: `err` holds 256 bytes, `oom` is writable.
        let p = unsafe { gpumem_alloc_checked(1 << 30, 0, s, err.as_mut_ptr(), 256, &mut oom) };
        assert!(p.is_null());
        assert_eq!(oom, 1);
        // SAFETY: the function wrote a NUL-terminated string into `err`.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        assert!(msg.contains("out of memory"), "{msg}");
        assert_eq!(gpumem_set_memory_fraction(1.0, 0), 0);
        // SAFETY: as above.
        let bad = unsafe { gpumem_alloc_checked(-1, 0, s, err.as_mut_ptr(), 256, &mut oom) };
        assert!(bad.is_null());
        assert_eq!(oom, 0);
        // SAFETY: null buffers are allowed.
        let p = unsafe {
            gpumem_alloc_checked(5000, 0, s, std::ptr::null_mut(), 0, std::ptr::null_mut())
        };
        assert!(!p.is_null());
        let keys = [
            c"allocated_bytes.all.current".as_ptr(),
            c"no.such.key".as_ptr(),
        ];
        let mut out = [-1i64; 2];
        // SAFETY: two keys, two values.
        assert_eq!(
            unsafe { gpumem_stats_values(0, keys.as_ptr(), out.as_mut_ptr(), 2) },
            0
        );
        assert_eq!(out, [5120, 0]);
        // SAFETY: as above; device 7 does not exist.
        assert_eq!(
            unsafe { gpumem_stats_values(7, keys.as_ptr(), out.as_mut_ptr(), 2) },
            -1
        );
        assert_eq!(gpumem_free_ptr(p), 0);
        assert_eq!(gpumem_free_ptr(p), -1, "a double free is refused");
        assert_eq!(gpumem_free_ptr(std::ptr::null_mut()), 0);
        assert!(gpumem_largest_free_block(0) >= 5120);
        // cacheInfo as PyTorch's own allocator answers it: the device's free memory within
        // the budget, or a larger cached block
        let cached = gpumem_largest_free_block(0);
        assert!(gpumem_largest_available_block(0) > cached);
        assert_eq!(gpumem_set_memory_fraction(1e-9, 0), 0);
        assert_eq!(gpumem_largest_available_block(0), cached);
        assert_eq!(gpumem_set_memory_fraction(1.0, 0), 0);
        assert_eq!(gpumem_largest_available_block(7), 0);
        let q = gpumem_alloc(3000, 0, s);
        // SAFETY: a null buffer asks for the size only; then `flat` holds `n` values.
        let n = unsafe { gpumem_segments_flat(0, std::ptr::null_mut(), 0) };
        let mut flat = vec![0u64; n];
        assert_eq!(unsafe { gpumem_segments_flat(0, flat.as_mut_ptr(), n) }, n);
        // one segment of the small pool holding the 3000-byte block (rounded to 3072)
        assert!(n >= 6 + 4, "{flat:?}");
        let blocks = flat[5] as usize;
        assert_eq!(n, 6 + 4 * blocks, "{flat:?}");
        assert!(flat[6..]
            .chunks(4)
            .any(|b| b[0] == 3072 && b[1] == 3000 && b[2] == 1 && b[3] == 1));
        gpumem_free(q, 3000, 0, s);
        // history, as torch.cuda.memory._record_memory_history and _snapshot read it
        gpumem_record_history(1, 0, 0);
        assert_eq!(gpumem_history_enabled(), 1);
        // the allocation's events carry the thread's tag (a stack trace, in PyTorch)
        assert_eq!(gpumem_history_set_tag(42), 0);
        let q = gpumem_alloc(700, 0, s);
        assert_eq!(gpumem_history_set_tag(0), 42);
        gpumem_free(q, 700, 0, s);
        // SAFETY: as for the segments above.
        let n = unsafe { gpumem_history_flat(0, std::ptr::null_mut(), 0) };
        let mut flat = vec![0u64; n];
        assert_eq!(unsafe { gpumem_history_flat(0, flat.as_mut_ptr(), n) }, n);
        let actions: Vec<u64> = flat.chunks(6).map(|e| e[0]).collect();
        assert_eq!(actions, [0, 1, 2], "{flat:?}");
        let tags: Vec<u64> = flat.chunks(6).map(|e| e[5]).collect();
        assert_eq!(tags, [42, 0, 0], "{flat:?}");
        assert_eq!((flat[1], flat[2]), (q as u64, 700));
        // kept: a second read gives the same events
        assert_eq!(
            unsafe { gpumem_history_flat(0, std::ptr::null_mut(), 0) },
            n
        );
        // turned on again: what was recorded stays (unless cleared)
        gpumem_record_history(1, 0, 0);
        assert_eq!(
            unsafe { gpumem_history_flat(0, std::ptr::null_mut(), 0) },
            n
        );
        gpumem_record_history(0, 0, 0);
        assert_eq!(gpumem_history_enabled(), 0);
        assert_eq!(
            unsafe { gpumem_history_flat(0, std::ptr::null_mut(), 0) },
            0
        );
        gpumem_empty_cache();
        assert_eq!(stat("reserved_bytes.all.current"), 0);
    }
}
