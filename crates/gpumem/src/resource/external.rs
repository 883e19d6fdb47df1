//! Memory from another allocator: a resource whose allocate and deallocate are someone else's
//! (a `torch.cuda.MemPool` built over a `CUDAPluggableAllocator` or NCCL's allocator), with the
//! device's stream operations beside them.
//!
//! A pool over an [`External`] caches what that allocator hands out, as PyTorch's MemPool does:
//! segments come from the allocator's `alloc` and go back through its `free` when the pool
//! releases them.

use super::{forward_stream_ops, Backend, DevPtr, Location, MemInfo, Resource, Stream};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Another allocator's two calls. `alloc` returns `None` when it has nothing to give
/// (the pool treats that as out of memory).
pub trait ExternalSource: Send + Sync {
    /// `bytes` bytes, ordered on `stream`.
    fn alloc(&self, bytes: usize, stream: Stream) -> Option<DevPtr>;
    /// Give back `ptr`, obtained from [`ExternalSource::alloc`] with the same `bytes`.
    fn free(&self, ptr: DevPtr, bytes: usize, stream: Stream);
    /// Name for reports.
    fn name(&self) -> &str;
}

/// A resource whose bytes come from an [`ExternalSource`], with `device`'s stream operations,
/// memory information and location.
pub struct External {
    device: Arc<dyn Backend>,
    source: Box<dyn ExternalSource>,
}

impl External {
    /// `source`'s memory on `device`.
    pub fn new(device: Arc<dyn Backend>, source: Box<dyn ExternalSource>) -> Self {
        Self { device, source }
    }
}

impl std::fmt::Debug for External {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("External")
            .field("source", &self.source.name())
            .field("device", &self.device.name())
            .finish()
    }
}

impl Resource for External {
    fn allocate(&self, stream: Stream, bytes: usize, align: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("size 0".into()));
        }
        let exhausted = || Error::ResourceExhausted {
            resource: self.source.name().to_string(),
            bytes: bytes as u64,
        };
        let ptr = self.source.alloc(bytes, stream).ok_or_else(exhausted)?;
        if ptr == 0 {
            return Err(exhausted());
        }
        if align > 1 && ptr % align as u64 != 0 {
            self.source.free(ptr, bytes, stream);
            return Err(Error::InvalidArgument(format!(
                "{} returned {ptr:#x}, not aligned to {align} bytes",
                self.source.name()
            )));
        }
        Ok(ptr)
    }

    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: Stream) -> Result<()> {
        self.source.free(ptr, bytes, stream);
        Ok(())
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.device.mem_info()
    }

    fn name(&self) -> &str {
        self.source.name()
    }

    fn location(&self) -> Location {
        self.device.location()
    }
}

forward_stream_ops!(External, |s| s.device);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::host::HostResource;
    use std::sync::Mutex;

    /// Hands out addresses from a counter and remembers what is out.
    #[derive(Default)]
    struct Counter {
        out: Mutex<Vec<(DevPtr, usize)>>,
        refuse: bool,
    }

    impl ExternalSource for Arc<Counter> {
        fn alloc(&self, bytes: usize, _: Stream) -> Option<DevPtr> {
            if self.refuse {
                return None;
            }
            let mut out = self.out.lock().unwrap();
            let ptr = (out.len() as u64 + 1) << 30;
            out.push((ptr, bytes));
            Some(ptr)
        }
        fn free(&self, ptr: DevPtr, bytes: usize, _: Stream) {
            let mut out = self.out.lock().unwrap();
            let i = out.iter().position(|&o| o == (ptr, bytes)).unwrap();
            out.swap_remove(i);
        }
        fn name(&self) -> &str {
            "counter"
        }
    }

    #[test]
    fn allocations_go_to_the_source_and_back() {
        let c = Arc::new(Counter::default());
        let r = External::new(Arc::new(HostResource::new()), Box::new(c.clone()));
        let p = r.allocate(Stream::DEFAULT, 4096, 512).unwrap();
        assert_eq!(c.out.lock().unwrap().as_slice(), &[(p, 4096)]);
        r.deallocate(p, 4096, Stream::DEFAULT).unwrap();
        assert!(c.out.lock().unwrap().is_empty());
        assert_eq!(r.name(), "counter");
        assert!(r.allocate(Stream::DEFAULT, 0, 512).is_err());
    }

    #[test]
    fn a_source_with_nothing_to_give_is_out_of_memory() {
        let c = Arc::new(Counter {
            refuse: true,
            ..Default::default()
        });
        let r = External::new(Arc::new(HostResource::new()), Box::new(c));
        let e = r.allocate(Stream::DEFAULT, 4096, 512).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
    }
}
