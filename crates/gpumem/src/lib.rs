//! # gpumem — a GPU memory manager
//!
//! Layers, from the bottom:
//! 1. [`resource`]: raw resources (CUDA device memory, cudaMallocAsync pools, host memory, a
//!    simulated device) behind one stream-first trait;
//! 2. [`pool`]: the caching policy, pure Rust with no CUDA calls;
//! 3. [`adaptor`]: budgets and leak tracking that wrap any resource;
//! 4. [`buffer`]: typed RAII buffers ([`DeviceBuffer`], [`PinnedBuffer`], [`UnifiedBuffer`]) and the
//!    [`transfer`] engine that moves their bytes;
//! 5. front ends: the [`CachingAllocator`] here, the `gpumem` CLI.
//!
//! ```
//! use gpumem::{CachingAllocator, Config, Stream};
//! let alloc = CachingAllocator::host(Config::default())?;
//! let a = alloc.allocate(Stream::DEFAULT, 1000, 256)?;
//! alloc.deallocate(a)?;
//! let b = alloc.allocate(Stream::DEFAULT, 1000, 256)?; // served from the cache
//! assert_eq!(alloc.stats().num_device_alloc, 1);
//! alloc.deallocate(b)?;
//! # Ok::<(), gpumem::Error>(())
//! ```

#![warn(missing_docs)]

pub mod adaptor;
pub mod allocator;
pub mod buffer;
pub mod config;
pub mod device;
pub mod error;
pub mod multi;
pub mod pool;
pub mod profile;
pub mod resource;
pub mod trace;
pub mod transfer;
pub mod workload;

pub use allocator::{Allocation, CachingAllocator};
pub use buffer::pinned::{PinnedBuffer, PinnedHost, PinnedRegistration};
pub use buffer::unified::{ManagedOptions, Placement, UnifiedBuffer, UnifiedMemory};
#[cfg(feature = "cuda")]
pub use buffer::{CudarcView, CudarcViewMut};
pub use buffer::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
pub use config::Config;
pub use device::DeviceInfo;
pub use error::{Error, OomReport, Result};
pub use multi::DeviceSet;
pub use pool::pinned::{PinnedPool, PinnedStats};
pub use pool::stats::Stats;
pub use resource::{Advice, Backend, DevPtr, Location, MemPlace, Resource, Stream, StreamOps};
pub use transfer::{StagingConfig, Transfer, TransferEngine};
