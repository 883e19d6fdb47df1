//! A device: the one place where what one GPU (or the host backend) offers is composed from
//! the layers below. A [`Device`] owns its caching allocator (with the budget adaptor the
//! configuration asks for) and, made on first use, its transfer engine with the pinned host
//! pool; the [`DeviceSet`] holds one `Device` per GPU with peer access between them. Front
//! ends (typed buffers, the CLI, the PyTorch library) build devices here rather than
//! resources themselves.
//!
//! The capability queries live with the resources ([`crate::resource::info`]); they are
//! re-exported here, where front ends look for them.

mod set;
pub mod transfer;

pub use crate::resource::info::{
    cuda_available, current_device, device_count, devices, DeviceInfo,
};
pub use set::DeviceSet;

use crate::allocator::CachingAllocator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::pool::pinned::PinnedPool;
use crate::resource::host::HostResource;
use crate::resource::sim::SimulatedDevice;
use crate::resource::{Backend, Location};
use std::sync::{Arc, OnceLock};
use transfer::{StagingConfig, TransferEngine};

struct Inner {
    allocator: CachingAllocator,
    /// made on first use: staging for copies from and to ordinary host memory
    transfer: OnceLock<TransferEngine>,
}

/// One device's allocator and transfer engine. Cheap to clone (one reference count); derefs to
/// its [`CachingAllocator`], so every allocator call works on a `Device` too.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("allocator", &self.inner.allocator)
            .finish()
    }
}

impl std::ops::Deref for Device {
    type Target = CachingAllocator;
    fn deref(&self) -> &CachingAllocator {
        &self.inner.allocator
    }
}

impl From<CachingAllocator> for Device {
    fn from(allocator: CachingAllocator) -> Self {
        Self {
            inner: Arc::new(Inner {
                allocator,
                transfer: OnceLock::new(),
            }),
        }
    }
}

impl Device {
    /// A device over `backend` with `config` (a `memory_fraction` or `memory_limit_mb` wraps
    /// the backend in a budget).
    pub fn new(backend: Arc<dyn Backend>, config: Config) -> Result<Self> {
        Ok(CachingAllocator::new(backend, config)?.into())
    }

    /// Plain host memory (the backend of machines without a GPU).
    pub fn host(config: Config) -> Result<Self> {
        Self::new(Arc::new(HostResource::new()), config)
    }

    /// A simulated device of `capacity` bytes; also returns the device for inspection.
    pub fn simulated(capacity: u64, config: Config) -> Result<(Self, Arc<SimulatedDevice>)> {
        let dev = Arc::new(SimulatedDevice::new(capacity).with_page(config.backend.page_bytes));
        Ok((Self::new(dev.clone(), config)?, dev))
    }

    /// CUDA device `ordinal` (primary context), with `backend:` from the configuration
    /// choosing cuMemAlloc and virtual-memory pages or a cudaMallocAsync pool.
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize, config: Config) -> Result<Self> {
        Self::new(cuda_backend(ordinal, &config)?, config)
    }

    /// CUDA device 0 where a GPU is usable, else the host backend; configured from
    /// `GPUMEM_CONF`.
    pub fn from_env() -> Result<Self> {
        let config = Config::from_env()?;
        #[cfg(feature = "cuda")]
        if cuda_available() {
            return Self::cuda(0, config);
        }
        Self::host(config)
    }

    /// Whether the host and this device see each other's writes (explicit copies only on the
    /// host and simulated backends, which model a device with memory of its own).
    pub fn visibility(&self) -> crate::resource::visibility::MemoryVisibility {
        match self.backend().location() {
            Location::Cuda(ordinal) => crate::resource::info::visibility(ordinal),
            _ => crate::resource::visibility::MemoryVisibility::ExplicitCopies,
        }
    }

    /// The caching allocator.
    pub fn allocator(&self) -> &CachingAllocator {
        &self.inner.allocator
    }

    /// The transfer engine (made on first use, with a pinned pool of cuMemHostAlloc memory on
    /// a GPU, plain host memory on the host backend).
    pub fn transfer_engine(&self) -> Result<&TransferEngine> {
        if let Some(e) = self.inner.transfer.get() {
            return Ok(e);
        }
        let backend = self.backend();
        let pinned = match backend.location() {
            Location::Host => PinnedPool::new(Arc::new(HostResource::new())),
            #[cfg(feature = "cuda")]
            Location::Cuda(ordinal) => PinnedPool::new(Arc::new(
                crate::resource::cuda::CudaPinnedHost::new(ordinal)?,
            )),
            other => {
                return Err(Error::Unsupported {
                    backend: backend.name().to_string(),
                    what: format!("host copies ({other:?} memory)"),
                })
            }
        };
        let engine = TransferEngine::new(
            backend.clone(),
            pinned,
            StagingConfig::from_config(self.config()),
        );
        // a racing thread may have set one first: either is fine, ours is then dropped
        Ok(self.inner.transfer.get_or_init(|| engine))
    }

    /// A caching pool of managed (unified) memory on this device, with the VRAM guard of
    /// `options` (one shard, classic segments: managed memory has no virtual-memory pages).
    pub fn managed_pool(&self, options: ManagedOptions) -> Result<ManagedPool> {
        match self.backend().location() {
            #[cfg(feature = "cuda")]
            Location::Cuda(ordinal) => {
                let mut res = crate::resource::cuda::CudaManaged::new(ordinal)?
                    .with_guard(options.guard_fraction)?;
                if options.allow_oversubscription {
                    res = res.allow_oversubscription();
                }
                let res = Arc::new(res);
                let mut config = Config {
                    shards: Some(1),
                    ..Config::default()
                };
                config.pool.expandable_segments = false;
                Ok(ManagedPool {
                    memory: res.clone(),
                    allocator: CachingAllocator::new(res, config)?,
                })
            }
            other => {
                let _ = options;
                Err(Error::Unsupported {
                    backend: self.backend().name().to_string(),
                    what: format!("managed memory ({other:?} memory)"),
                })
            }
        }
    }

    /// The pinned host pool of the transfer engine.
    pub fn pinned_pool(&self) -> Result<&PinnedPool> {
        Ok(self.transfer_engine()?.pinned_pool())
    }
}

crate::resource::forward_stream_ops!(Device, |s| s.inner.allocator);

/// Options of the managed pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ManagedOptions {
    /// managed memory may hold at most this fraction of (free + managed) device memory
    pub guard_fraction: f64,
    /// allow managed memory past the guard (pages then evict to the host as the device fills);
    /// it can stall the whole GPU, so only by explicit choice and never on shared machines
    pub allow_oversubscription: bool,
}

impl Default for ManagedOptions {
    fn default() -> Self {
        Self {
            guard_fraction: 0.8,
            allow_oversubscription: false,
        }
    }
}

/// A caching pool of managed memory and the resource's prefetch and advice.
#[derive(Debug)]
pub struct ManagedPool {
    /// prefetch and advice on the pool's memory
    pub memory: Arc<dyn crate::resource::ManagedMemory>,
    /// the caching pool over the managed resource
    pub allocator: CachingAllocator,
}

/// The CUDA resource `config` asks for on device `ordinal`: cuMemAlloc and virtual-memory pages
/// (`backend:native`, the default) or a stream-ordered pool (`backend:cudaMallocAsync`).
#[cfg(feature = "cuda")]
pub fn cuda_backend(ordinal: usize, config: &Config) -> Result<Arc<dyn Backend>> {
    use crate::config::BackendKind;
    use crate::resource::cuda::{CudaAsyncPool, CudaDevice};
    Ok(match config.backend.kind {
        BackendKind::Native => Arc::new(CudaDevice::with_page_bytes(
            ordinal,
            config.backend.page_bytes,
        )?),
        BackendKind::CudaMallocAsync => Arc::new(CudaAsyncPool::new(
            ordinal,
            config.backend.release_threshold,
        )?),
    })
}
