//! Counting unified-memory traffic: GPU page faults and migrated bytes, through CUPTI's
//! unified-memory counters (cudarc's `cupti` feature; libcupti is found at run time, so put its
//! folder on `LD_LIBRARY_PATH`). Used by tests to show that kernels over unified buffers do not
//! fault.
//!
//! ```ignore
//! let counter = gpumem::profile::UmCounter::start(0)?;   // after cuInit, before the context
//! // ... work ...
//! let before = counter.read()?;
//! // ... a kernel ...
//! let during = counter.read()? - before;
//! assert_eq!(during.gpu_page_faults, 0);
//! ```

use crate::error::{Error, Result};
use serde::Serialize;

/// Unified-memory counts (totals since the counter started, or a difference of two reads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UmCounts {
    /// GPU page-fault groups (each may cover several pages)
    pub gpu_page_faults: u64,
    /// bytes migrated host → device
    pub bytes_htod: u64,
    /// bytes migrated device → host
    pub bytes_dtoh: u64,
    /// bytes migrated between devices (counted only when counting on several devices)
    pub bytes_dtod: u64,
}

impl std::ops::Sub for UmCounts {
    type Output = UmCounts;
    fn sub(self, o: UmCounts) -> UmCounts {
        UmCounts {
            gpu_page_faults: self.gpu_page_faults.saturating_sub(o.gpu_page_faults),
            bytes_htod: self.bytes_htod.saturating_sub(o.bytes_htod),
            bytes_dtoh: self.bytes_dtoh.saturating_sub(o.bytes_dtoh),
            bytes_dtod: self.bytes_dtod.saturating_sub(o.bytes_dtod),
        }
    }
}

#[cfg(feature = "cupti")]
mod imp {
    use super::*;
    use cudarc::cupti::sys;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    static ACTIVE: AtomicBool = AtomicBool::new(false);
    static GPU_FAULTS: AtomicU64 = AtomicU64::new(0);
    static HTOD: AtomicU64 = AtomicU64::new(0);
    static DTOH: AtomicU64 = AtomicU64::new(0);
    static DTOD: AtomicU64 = AtomicU64::new(0);

    const BUF: usize = 1 << 20;
    const ALIGN: usize = 8;

    fn check(call: &'static str, r: sys::CUptiResult) -> Result<()> {
        if r == sys::CUptiResult::CUPTI_SUCCESS {
            Ok(())
        } else {
            Err(Error::Cuda {
                call,
                code: r as i32,
                name: format!("{r:?}"),
            })
        }
    }

    unsafe extern "C" fn requested(buffer: *mut *mut u8, size: *mut usize, max: *mut usize) {
        let layout = std::alloc::Layout::from_size_align(BUF, ALIGN).expect("constant layout");
        // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in `completed`.
        unsafe {
            *buffer = std::alloc::alloc(layout);
            *size = if (*buffer).is_null() { 0 } else { BUF };
            *max = 0;
        }
    }

    unsafe extern "C" fn completed(
        _ctx: cudarc::driver::sys::CUcontext,
        _stream: u32,
        buffer: *mut u8,
        _size: usize,
        valid: usize,
    ) {
        if buffer.is_null() {
            return;
        }
        let mut rec: *mut sys::CUpti_Activity = std::ptr::null_mut();
        loop {
            // SAFETY: `buffer` holds `valid` bytes of records written by CUPTI; `rec` walks them.
            let r = unsafe { sys::cuptiActivityGetNextRecord(buffer, valid, &mut rec) };
            if r != sys::CUptiResult::CUPTI_SUCCESS || rec.is_null() {
                break;
            }
            // SAFETY: every record starts with its kind.
            let kind = unsafe { (*rec).kind };
            if kind == sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER {
                // SAFETY: records of this kind are unified-memory counter records; versions 2
                // and 3 share the fields read here.
                let (ck, value) = unsafe {
                    let um = rec as *const sys::CUpti_ActivityUnifiedMemoryCounter2;
                    (
                        std::ptr::read_unaligned(std::ptr::addr_of!((*um).counterKind)),
                        std::ptr::read_unaligned(std::ptr::addr_of!((*um).value)),
                    )
                };
                use sys::CUpti_ActivityUnifiedMemoryCounterKind as K;
                let slot = match ck {
                    K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT => &GPU_FAULTS,
                    K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD => &HTOD,
                    K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH => &DTOH,
                    K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOD => &DTOD,
                    _ => continue,
                };
                slot.fetch_add(value, Ordering::Relaxed);
            }
        }
        let layout = std::alloc::Layout::from_size_align(BUF, ALIGN).expect("constant layout");
        // SAFETY: the buffer came from `requested` with this layout.
        unsafe { std::alloc::dealloc(buffer, layout) };
    }

    pub(super) fn present() -> bool {
        // SAFETY: only tries to load the library.
        unsafe { sys::is_culib_present() }
    }

    pub(super) fn start(ordinals: &[usize]) -> Result<()> {
        if ACTIVE.swap(true, Ordering::AcqRel) {
            return Err(Error::InvalidState(
                "a unified-memory counter is already running in this process".into(),
            ));
        }
        let r = (|| {
            use sys::CUpti_ActivityUnifiedMemoryCounterKind as K;
            let mut kinds = vec![
                K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT,
                K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD,
                K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH,
            ];
            if ordinals.len() > 1 {
                kinds.push(K::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOD);
            }
            let mut config: Vec<sys::CUpti_ActivityUnifiedMemoryCounterConfig> = ordinals
                .iter()
                .flat_map(|&ordinal| {
                    kinds.clone().into_iter().map(move |kind| sys::CUpti_ActivityUnifiedMemoryCounterConfig {
                        scope: sys::CUpti_ActivityUnifiedMemoryCounterScope::CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_SCOPE_PROCESS_SINGLE_DEVICE,
                        kind,
                        deviceId: ordinal as u32,
                        enable: 1,
                    })
                })
                .collect();
            for c in [&GPU_FAULTS, &HTOD, &DTOH, &DTOD] {
                c.store(0, Ordering::Relaxed);
            }
            // SAFETY: the config array is valid for its length; the callbacks are ours.
            unsafe {
                check(
                    "cuptiActivityConfigureUnifiedMemoryCounter",
                    sys::cuptiActivityConfigureUnifiedMemoryCounter(
                        config.as_mut_ptr(),
                        config.len() as u32,
                    ),
                )?;
                check(
                    "cuptiActivityRegisterCallbacks",
                    sys::cuptiActivityRegisterCallbacks(Some(requested), Some(completed)),
                )?;
                check(
                    "cuptiActivityEnable",
                    sys::cuptiActivityEnable(
                        sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER,
                    ),
                )
            }
        })();
        if r.is_err() {
            ACTIVE.store(false, Ordering::Release);
        }
        r
    }

    pub(super) fn read() -> Result<UmCounts> {
        // SAFETY: flushing hands completed buffers to `completed`.
        check("cuptiActivityFlushAll", unsafe {
            sys::cuptiActivityFlushAll(1)
        })?;
        Ok(UmCounts {
            gpu_page_faults: GPU_FAULTS.load(Ordering::Relaxed),
            bytes_htod: HTOD.load(Ordering::Relaxed),
            bytes_dtoh: DTOH.load(Ordering::Relaxed),
            bytes_dtod: DTOD.load(Ordering::Relaxed),
        })
    }

    pub(super) fn stop() -> Result<UmCounts> {
        let counts = read();
        // SAFETY: disabling an enabled activity kind.
        let r = unsafe {
            sys::cuptiActivityDisable(
                sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER,
            )
        };
        ACTIVE.store(false, Ordering::Release);
        check("cuptiActivityDisable", r)?;
        counts
    }
}

/// A running unified-memory counter (one per process at a time). Start it after CUDA is
/// initialised (CUPTI refuses before cuInit) and before the device's context is created
/// (CUPTI's unified-memory counting wants that).
#[derive(Debug)]
pub struct UmCounter {
    running: bool,
}

impl UmCounter {
    /// Start counting on device `ordinal`. Errors where CUPTI is missing (libcupti not on the
    /// loader path), another counter runs, or the device cannot profile unified memory.
    pub fn start(ordinal: usize) -> Result<Self> {
        Self::start_devices(&[ordinal])
    }

    /// Start counting on every device of `ordinals` (the counts are their sums).
    pub fn start_devices(ordinals: &[usize]) -> Result<Self> {
        #[cfg(feature = "cupti")]
        {
            if !imp::present() {
                return Err(Error::Unsupported {
                    backend: "cupti".into(),
                    what: "unified-memory counters (libcupti not found: add its folder to \
                           LD_LIBRARY_PATH)"
                        .into(),
                });
            }
            imp::start(ordinals)?;
            Ok(Self { running: true })
        }
        #[cfg(not(feature = "cupti"))]
        {
            let _ = ordinals;
            Err(Error::Unsupported {
                backend: "gpumem".into(),
                what: "unified-memory counters (built without the cupti feature)".into(),
            })
        }
    }

    /// Totals so far (flushes CUPTI's buffers first).
    pub fn read(&self) -> Result<UmCounts> {
        #[cfg(feature = "cupti")]
        {
            imp::read()
        }
        #[cfg(not(feature = "cupti"))]
        Ok(UmCounts::default())
    }

    /// Totals once CUPTI has delivered everything: the unified-memory driver reports fault
    /// groups and migrations a little after they happen, so this reads until two reads 20 ms
    /// apart agree (at most about a second). Call it after synchronising the work of interest.
    pub fn read_settled(&self) -> Result<UmCounts> {
        let mut last = self.read()?;
        for _ in 0..50 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let now = self.read()?;
            if now == last {
                return Ok(now);
            }
            last = now;
        }
        Ok(last)
    }

    /// Stop and return the totals.
    pub fn stop(mut self) -> Result<UmCounts> {
        self.running = false;
        #[cfg(feature = "cupti")]
        {
            imp::stop()
        }
        #[cfg(not(feature = "cupti"))]
        Ok(UmCounts::default())
    }
}

impl Drop for UmCounter {
    fn drop(&mut self) {
        if self.running {
            #[cfg(feature = "cupti")]
            let _ = imp::stop();
        }
    }
}
