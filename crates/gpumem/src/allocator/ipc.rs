//! Sharing live blocks with other processes (what `torch.multiprocessing` does with CUDA
//! tensors): the allocator says where a block lies, the backend exports it
//! ([`crate::resource::Ipc`]). The block stays the sender's: it must stay allocated until every
//! receiver has let it go (PyTorch counts receivers for that).

use super::CachingAllocator;
use crate::error::{Error, Result};
use crate::resource::{unsupported, DevPtr};
use std::os::fd::OwnedFd;

/// What another process needs to map a live block ([`CachingAllocator::ipc_export`]).
#[derive(Debug)]
pub enum IpcExport {
    /// The block lies in a classic segment: the driver's IPC handle of the segment, and the
    /// block's offset in it.
    Segment {
        /// `cuIpcGetMemHandle` of the segment's base
        handle: [u8; 64],
        /// block address minus segment base
        offset: u64,
    },
    /// The block lies in virtual-memory pages: one descriptor per physical handle under it
    /// (keep them open until the receiver has imported them), and the block's offset from
    /// the first handle's address.
    Pages {
        /// the handles, in address order, each with its pages
        fds: Vec<(OwnedFd, u64)>,
        /// page size
        page: u64,
        /// block address minus the first handle's address
        offset: u64,
    },
}

impl CachingAllocator {
    /// Export the live block at `ptr` (allocated through the address API) for another process.
    pub fn ipc_export(&self, ptr: DevPtr) -> Result<IpcExport> {
        let (addr, size, seg, _seg_size, expandable) = self
            .block_extent(ptr)
            .ok_or(Error::UnknownPointer { ptr })?;
        let ipc = self.inner.backend.ipc().ok_or_else(|| {
            unsupported(
                self.inner.backend.name(),
                "sharing memory between processes",
            )
        })?;
        if !expandable {
            return Ok(IpcExport::Segment {
                handle: ipc.segment_handle(seg)?,
                offset: ptr - seg,
            });
        }
        let page = ipc.page_size();
        if page == 0 {
            return Err(unsupported(self.inner.backend.name(), "exporting pages"));
        }
        let start = addr / page * page;
        let end = (addr + size).div_ceil(page) * page;
        let (base, fds) = ipc.export_pages(start, end - start)?;
        Ok(IpcExport::Pages {
            fds,
            page,
            offset: ptr - base,
        })
    }

    /// Where the live block at `ptr` lies (shards, then private pools): `(block address,
    /// block size, segment address, segment size, expandable)`.
    pub fn block_extent(&self, ptr: DevPtr) -> Option<(u64, u64, u64, u64, bool)> {
        (0..self.inner.shards.len())
            .find_map(|j| self.shard(j).extent_of(ptr))
            .or_else(|| self.private_extent_of(ptr))
    }
}
