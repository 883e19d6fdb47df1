//! # gpumem — a GPU memory manager
//!
//! Layers, from the bottom (each module imports only those below it):
//! 1. [`resource`]: where bytes come from (CUDA device memory and virtual-memory pages,
//!    cudaMallocAsync pools, pinned host, managed, plain host memory, a simulated device) behind
//!    one stream-first trait; all CUDA FFI lives in `resource::cuda`;
//! 2. [`pool`]: the caching policy, pure Rust with no CUDA calls;
//! 3. [`adaptor`]: budgets and leak tracking that wrap any resource;
//! 4. [`allocator`]: the [`CachingAllocator`], one pool shard per thread;
//! 5. [`device`]: the composition root: a [`Device`] owns its allocator, budget, transfer
//!    engine and pinned pool; [`DeviceSet`] holds one per GPU;
//! 6. [`buffer`]: typed RAII buffers ([`DeviceBuffer`], [`PinnedBuffer`], [`UnifiedBuffer`]) and
//!    the ring bridge;
//! 7. [`trace`]: reading, writing and replaying allocation traces, synthetic workloads; front
//!    ends (the `gpumem` CLI, the PyTorch library) sit on top.
//!
//! [`config`], [`error`], [`units`] and [`workload`] (seeded random sizes) are used by all.
//!
//! ```
//! use gpumem::{Config, Device, Stream};
//! let dev = Device::host(Config::default())?;
//! let a = dev.allocate(Stream::DEFAULT, 1000, 256)?;
//! dev.deallocate(a)?;
//! let b = dev.allocate(Stream::DEFAULT, 1000, 256)?; // served from the cache
//! assert_eq!(dev.stats().num_device_alloc, 1);
//! dev.deallocate(b)?;
//! # Ok::<(), gpumem::Error>(())
//! ```

#![warn(missing_docs)]

pub mod adaptor;
pub mod allocator;
pub mod buffer;
pub mod config;
pub mod device;
pub mod error;
pub mod pool;
pub mod resource;
pub mod trace;
pub mod units;
pub mod workload;

/// The transfer engine (part of a device: see [`device`]).
pub use device::transfer;
/// Unified-memory fault counters through CUPTI.
#[cfg(feature = "cuda")]
pub use resource::cuda::cupti as profile;

pub use allocator::{Allocation, CachingAllocator, PoolId};
pub use buffer::pinned::{PinnedBuffer, PinnedHost, PinnedRegistration};
pub use buffer::unified::{ManagedOptions, Placement, UnifiedBuffer, UnifiedMemory};
#[cfg(feature = "cuda")]
pub use buffer::{CudarcView, CudarcViewMut};
pub use buffer::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
pub use config::Config;
pub use device::transfer::{StagingConfig, Transfer, TransferEngine};
pub use device::Device;
pub use device::DeviceSet;
pub use error::{Error, OomReport, Result};
pub use pool::pinned::{PinnedPool, PinnedStats};
pub use pool::stats::Stats;
pub use resource::info::DeviceInfo;
pub use resource::visibility::{MemoryVisibility, Platform};
pub use resource::{Advice, Backend, DevPtr, Location, MemPlace, Resource, Stream, StreamOps};
