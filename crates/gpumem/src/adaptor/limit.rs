//! A byte budget (VRAM limit) enforced before the wrapped resource is asked.

use crate::error::{Error, Result};
use crate::resource::forward_stream_ops;
use crate::resource::{
    unsupported, Backend, DevPtr, Location, MemInfo, Resource, Stream, VirtualMemory, VmmCalls,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Refuses allocations that would take the bytes obtained through it past `limit`.
#[derive(Debug)]
pub struct Limit {
    inner: Arc<dyn Backend>,
    /// the budget and what is charged to it, shared by the limits made with [`Limit::sharing`]
    counts: Arc<Counts>,
}

#[derive(Debug)]
struct Counts {
    limit: AtomicU64,
    used: AtomicU64,
}

impl Limit {
    /// Budget `limit` bytes over `inner`.
    pub fn new(inner: Arc<dyn Backend>, limit: u64) -> Self {
        Self {
            inner,
            counts: Arc::new(Counts {
                limit: AtomicU64::new(limit),
                used: AtomicU64::new(0),
            }),
        }
    }

    /// The same budget over another resource (memory from another allocator, which counts
    /// against the process's limit as the device's own does).
    pub fn sharing(&self, inner: Arc<dyn Backend>) -> Self {
        Self {
            inner,
            counts: self.counts.clone(),
        }
    }

    /// Change the budget (what is already obtained stays; later requests see the new one).
    pub fn set_limit(&self, limit: u64) {
        self.counts.limit.store(limit, Ordering::Relaxed);
    }

    /// Count `b` bytes against the budget, or refuse them.
    fn charge(&self, b: u64) -> Result<()> {
        let before = self.counts.used.fetch_add(b, Ordering::Relaxed);
        let limit = self.counts.limit.load(Ordering::Relaxed);
        if before.saturating_add(b) > limit {
            self.refund(b);
            return Err(Error::ResourceExhausted {
                resource: format!("{} (budget of {limit} bytes)", self.inner.name()),
                bytes: b,
            });
        }
        Ok(())
    }

    /// Take `b` bytes off the budget's count (returned, or a charge whose request failed).
    fn refund(&self, b: u64) {
        self.counts.used.fetch_sub(b, Ordering::Relaxed);
    }

    /// Bytes obtained through this adaptor and not yet returned.
    pub fn used(&self) -> u64 {
        self.counts.used.load(Ordering::Relaxed)
    }
}

impl Resource for Limit {
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        let b = bytes as u64;
        self.charge(b)?;
        self.inner
            .allocate(stream, bytes, align)
            .inspect_err(|_| self.refund(b))
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: Stream) -> Result<()> {
        self.inner.deallocate(ptr, bytes, stream)?;
        self.refund(bytes as u64);
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let m = self.inner.mem_info()?;
        Ok(MemInfo {
            free: m.free.min(
                self.counts
                    .limit
                    .load(Ordering::Relaxed)
                    .saturating_sub(self.used()),
            ),
            total: m.total,
        })
    }

    fn device_mem_info(&self) -> Result<MemInfo> {
        self.inner.device_mem_info()
    }

    fn limit(&self) -> Option<u64> {
        Some(self.counts.limit.load(Ordering::Relaxed))
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn location(&self) -> Location {
        self.inner.location()
    }

    crate::resource::forward_resource_passthrough!(inner);

    /// The wrapped resource's pages, with mapped bytes charged to the budget.
    fn virtual_memory(&self) -> Option<&dyn VirtualMemory> {
        self.inner
            .virtual_memory()
            .map(|_| self as &dyn VirtualMemory)
    }
}

impl Limit {
    fn inner_vmm(&self) -> Result<&dyn VirtualMemory> {
        self.inner
            .virtual_memory()
            .ok_or_else(|| unsupported(self.name(), "virtual-memory segments"))
    }
}

impl VirtualMemory for Limit {
    fn page_size(&self) -> u64 {
        self.inner_vmm().map_or(0, |v| v.page_size())
    }

    fn reserve_address(&self, bytes: u64) -> Result<DevPtr> {
        self.inner_vmm()?.reserve_address(bytes)
    }

    fn release_address(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.inner_vmm()?.release_address(addr, bytes)
    }

    fn map(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        let vmm = self.inner_vmm()?;
        self.charge(bytes)?;
        vmm.map(addr, bytes).inspect_err(|_| self.refund(bytes))
    }

    fn unit_at(&self, addr: DevPtr) -> Option<(DevPtr, u64)> {
        self.inner_vmm().ok()?.unit_at(addr)
    }

    fn unmap(&self, addr: DevPtr, bytes: u64) -> Result<()> {
        self.inner_vmm()?.unmap(addr, bytes)?;
        self.refund(bytes);
        Ok(())
    }

    fn map_on(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let vmm = self.inner_vmm()?;
        self.charge(bytes)?;
        vmm.map_on(addr, bytes, stream)
            .inspect_err(|_| self.refund(bytes))
    }

    fn map_ahead(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        let vmm = self.inner_vmm()?;
        self.charge(bytes)?;
        vmm.map_ahead(addr, bytes, stream)
            .inspect_err(|_| self.refund(bytes))
    }

    fn wait_mapped(&self, addr: DevPtr, bytes: u64, stream: Stream) -> Result<()> {
        // (charged when it was made ahead; a range that could not be mapped after all is not
        // the caller's)
        self.inner_vmm()?
            .wait_mapped(addr, bytes, stream)
            .inspect_err(|_| self.refund(bytes))
    }

    fn unmap_after(&self, addr: DevPtr, bytes: u64, stream: Stream, busy: bool) -> Result<()> {
        // the memory is the stream's to map again at once: the budget counts it free now
        self.inner_vmm()?.unmap_after(addr, bytes, stream, busy)?;
        self.refund(bytes);
        Ok(())
    }

    fn finish_move(&self, stream: Stream) {
        if let Ok(v) = self.inner_vmm() {
            v.finish_move(stream);
        }
    }

    fn trim(&self) {
        if let Ok(v) = self.inner_vmm() {
            v.trim();
        }
    }

    fn calls(&self) -> VmmCalls {
        self.inner_vmm().map(|v| v.calls()).unwrap_or_default()
    }

    fn now_ns(&self) -> u64 {
        self.inner_vmm()
            .map_or_else(|_| crate::resource::monotonic_ns(), |v| v.now_ns())
    }
}

forward_stream_ops!(Limit, |s| s.inner);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::sim::{SimulatedDevice, SIM_GRANULARITY as P};

    #[test]
    fn a_budget_passes_page_moves_through() {
        let sim: Arc<dyn Backend> = Arc::new(SimulatedDevice::new(1 << 30));
        let l = Limit::new(sim.clone(), 1 << 30);
        let v: &dyn VirtualMemory = &l;
        let a = v.reserve_address(8 * P).unwrap();
        // two handles of a page each
        v.map_on(a, P, Stream(1)).unwrap();
        v.map_on(a + P, P, Stream(1)).unwrap();
        // two pages move: their memory is stream 1's to map again
        v.unmap_after(a, 2 * P, Stream(1), false).unwrap();
        v.map_on(a + 4 * P, P, Stream(1)).unwrap();
        // the move is over: the page no map took is anyone's, so stream 2 creates none
        v.finish_move(Stream(1));
        let created = v.calls().creates;
        v.map_on(a + 6 * P, P, Stream(2)).unwrap();
        assert_eq!(v.calls().creates, created);
    }
}
