//! Typed RAII buffers over a [`crate::Device`], and the ring bridge beside them.
//!
//! [`DeviceBuffer<T>`] holds `len` elements of a plain-old-data `T` in pool memory, returns its
//! block to the pool on drop (ordered on its stream), and checks every index and range. With
//! the `cuda` feature, `&DeviceBuffer<T>`, `&mut DeviceBuffer<T>` and their slices are cudarc
//! kernel arguments (`stream.launch_builder(&f).arg(&buf)`): launch on the buffer's stream, or
//! call [`DeviceBuffer::record_stream`] for another stream.

pub mod pinned;
pub mod ring;
pub mod unified;

use crate::allocator::Allocation;
use crate::buffer::pinned::{pinned_copy, PinnedHost};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pool::MAX_ALIGN;
use crate::resource::{stream_after, CopyKind, DevPtr, Resource, Stream, StreamOps};
use crate::transfer::Transfer;
use bytemuck::Pod;
use std::marker::PhantomData;
use std::ops::{Bound, Range, RangeBounds};

/// A typed buffer in pool memory.
pub struct DeviceBuffer<T: Pod> {
    alloc: Device,
    block: Option<Allocation>,
    /// Device address; kernel arguments point at this field.
    ptr: DevPtr,
    len: usize,
    stream: Stream,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream)
            .finish()
    }
}

/// A read-only view of part of a [`DeviceBuffer`].
#[derive(Debug)]
pub struct DeviceSlice<'a, T: Pod> {
    buf: &'a DeviceBuffer<T>,
    ptr: DevPtr,
    len: usize,
}

/// A writable view of part of a [`DeviceBuffer`].
#[derive(Debug)]
pub struct DeviceSliceMut<'a, T: Pod> {
    buf: &'a mut DeviceBuffer<T>,
    ptr: DevPtr,
    len: usize,
}

/// Bytes of `len` elements of `T`; an overflow is a request larger than `max`.
pub(crate) fn bytes_of<T>(len: usize, max: u64) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or(Error::SizeTooLarge {
            requested: u64::MAX,
            max,
        })
}

fn resolve(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        (s, e) => Err(Error::OutOfBounds {
            what: format!("range {s:?}..{e:?}"),
            len,
        }),
    }
}

/// Device → host copy of `dst.len()` elements at `src` through the allocator's transfer
/// engine; returns once `dst` holds them.
fn read_into<T: Pod>(
    alloc: &Device,
    stream: Stream,
    src: DevPtr,
    dst: &mut [T],
    how: Transfer,
) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
    // SAFETY: `src` addresses at least `bytes.len()` bytes of a live block (callers check
    // bounds) that the caller's borrow keeps from being written meanwhile.
    unsafe {
        alloc
            .transfer_engine()?
            .device_to_host(bytes, src, stream, how)
    }
}

/// Host → device copy of `src` to `dst` through the allocator's transfer engine.
fn write_from<T: Pod>(
    alloc: &Device,
    stream: Stream,
    dst: DevPtr,
    src: &[T],
    how: Transfer,
) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` addresses at least `size_of_val(src)` bytes of a live block the caller
    // borrows mutably; the block stays allocated in stream order after the copy.
    unsafe {
        alloc
            .transfer_engine()?
            .host_to_device(dst, bytemuck::cast_slice(src), stream, how)
    }
}

/// Check `range` against `len` and return it as (start, len).
fn span(range: Range<usize>, len: usize) -> Result<(usize, usize)> {
    let (s, e) = resolve(range, len)?;
    Ok((s, e - s))
}

/// Device → device copy of `bytes` from `src_ptr` (in `src`) to `dst_ptr` (in `dst`), on
/// `dst`'s stream and ordered after `src`'s. Buffers of two devices (two allocators on
/// different devices) copy peer to peer through unified addressing; `src`'s stream then waits
/// for the copy, so `src` is not reused under it.
fn device_copy<T: Pod>(
    dst: &DeviceBuffer<T>,
    dst_ptr: DevPtr,
    src: &DeviceBuffer<T>,
    src_ptr: DevPtr,
    bytes: usize,
) -> Result<()> {
    let (dops, sops) = (dst.ops(), src.ops());
    let peer = dst.alloc.location() != src.alloc.location();
    if peer && dst.alloc.peer_access().and_then(|p| p.can_access(src_ptr)) == Some(false) {
        return Err(Error::Unsupported {
            backend: dst.alloc.backend().name().to_string(),
            what: format!(
                "a peer copy from {:?} memory to {:?}: the destination device has no access to \
                 the source (enable it: DeviceSet::enable_peer_access(destination, source))",
                src.alloc.location(),
                dst.alloc.location()
            ),
        });
    }
    if src.stream != dst.stream || peer {
        stream_after(sops, src.stream, dops, dst.stream)?;
        if !peer {
            src.record_stream(dst.stream)?;
        }
    }
    let kind = if peer {
        CopyKind::Unified
    } else {
        CopyKind::DeviceToDevice
    };
    // SAFETY: both ranges are bounds-checked parts of live blocks; `dst` is borrowed mutably
    // by the caller and `src` shared, so they are distinct blocks and do not overlap.
    unsafe { dops.copy(dst_ptr, src_ptr, bytes, kind, dst.stream)? };
    if peer {
        // `src` is not reused under the copy: its stream waits for it
        stream_after(dops, dst.stream, sops, src.stream)?;
    }
    Ok(())
}

fn check_len(expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::LengthMismatch { expected, got });
    }
    Ok(())
}

impl<T: Pod> DeviceBuffer<T> {
    /// `len` elements from `alloc` on `stream`. The contents are whatever the block last held
    /// (zeros for fresh host memory); use [`DeviceBuffer::zeroed`] for defined contents.
    pub fn alloc(alloc: &Device, stream: Stream, len: usize) -> Result<Self> {
        let bytes = bytes_of::<T>(len, crate::pool::size::MAX_REQUEST)?;
        let block = if bytes == 0 {
            None
        } else {
            Some(alloc.allocate(stream, bytes, MAX_ALIGN)?)
        };
        Ok(Self {
            alloc: alloc.clone(),
            ptr: block.as_ref().map_or(0, |b| b.ptr()),
            block,
            len,
            stream,
            _t: PhantomData,
        })
    }

    /// Buffers of `lens` elements each from `alloc` on `stream`, allocated in one call
    /// ([`crate::CachingAllocator::allocate_batch`]: neighbouring blocks, at most one driver
    /// call). Contents as with [`DeviceBuffer::alloc`].
    pub fn alloc_batch(alloc: &Device, stream: Stream, lens: &[usize]) -> Result<Vec<Self>> {
        let bytes = lens
            .iter()
            .map(|&l| bytes_of::<T>(l, crate::pool::size::MAX_REQUEST))
            .collect::<Result<Vec<_>>>()?;
        // empty buffers hold no block
        let sized: Vec<usize> = bytes.iter().copied().filter(|&b| b > 0).collect();
        let mut blocks = alloc.allocate_batch(stream, &sized, MAX_ALIGN)?.into_iter();
        Ok(lens
            .iter()
            .zip(&bytes)
            .map(|(&len, &b)| {
                let block = if b == 0 { None } else { blocks.next() };
                Self {
                    alloc: alloc.clone(),
                    ptr: block.as_ref().map_or(0, |b| b.ptr()),
                    block,
                    len,
                    stream,
                    _t: PhantomData,
                }
            })
            .collect())
    }

    /// `len` zeroed elements.
    pub fn zeroed(alloc: &Device, stream: Stream, len: usize) -> Result<Self> {
        let b = Self::alloc(alloc, stream, len)?;
        if b.len > 0 {
            // SAFETY: the block is ours and holds `num_bytes` bytes.
            unsafe { b.ops().memset(b.ptr, 0, b.num_bytes(), stream)? };
        }
        Ok(b)
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(alloc: &Device, stream: Stream, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(alloc, stream, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    fn ops(&self) -> &dyn StreamOps {
        &self.alloc
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The stream the buffer is ordered on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The raw device address (0 for an empty buffer).
    pub fn device_ptr(&self) -> DevPtr {
        self.ptr
    }

    /// The allocator the buffer came from.
    pub fn allocator(&self) -> &Device {
        &self.alloc
    }

    /// Copy `src` (same length) in and wait for the copy ([`Transfer::Auto`]: large copies
    /// are staged through pinned memory).
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.copy_from_host_with(src, Transfer::Auto)
    }

    /// Copy the contents out to `dst` (same length) and wait for the copy
    /// ([`Transfer::Auto`]).
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_with(dst, Transfer::Auto)
    }

    /// Copy `src` (same length, ordinary host memory) in the way `how` names. Every strategy
    /// returns once `src` is no longer needed; [`Transfer::Async`] does not wait for the
    /// device (later work on the buffer's stream sees the data).
    pub fn copy_from_host_with(&mut self, src: &[T], how: Transfer) -> Result<()> {
        check_len(self.len, src.len())?;
        write_from(&self.alloc, self.stream, self.ptr, src, how)
    }

    /// Copy the contents out to `dst` (same length) the way `how` names; returns once `dst`
    /// holds them.
    pub fn copy_to_host_with(&self, dst: &mut [T], how: Transfer) -> Result<()> {
        check_len(self.len, dst.len())?;
        read_into(&self.alloc, self.stream, self.ptr, dst, how)
    }

    /// Queue a copy of pinned `src` (same length) in on the buffer's stream; returns at once.
    /// `src` remembers the copy: writing it waits until the copy has read it.
    pub fn copy_from_pinned<P: PinnedHost<T>>(&mut self, src: &P) -> Result<()> {
        check_len(self.len, src.len())?;
        self.copy_range_from_pinned(0, src, 0..src.len())
    }

    /// Queue a copy of the contents out to pinned `dst` (same length) on the buffer's stream;
    /// returns at once. Reading `dst` waits until the copy has landed.
    pub fn copy_to_pinned<P: PinnedHost<T>>(&self, dst: &mut P) -> Result<()> {
        check_len(self.len, dst.len())?;
        self.copy_range_to_pinned(0..self.len, dst, 0)
    }

    /// Queue a copy of `src[src_range]` to this buffer from element `dst_start` on.
    pub fn copy_range_from_pinned<P: PinnedHost<T>>(
        &mut self,
        dst_start: usize,
        src: &P,
        src_range: Range<usize>,
    ) -> Result<()> {
        let (s, n) = span(src_range, src.len())?;
        let (d, _) = span(dst_start..dst_start.saturating_add(n), self.len)?;
        if n == 0 {
            return Ok(());
        }
        let size = std::mem::size_of::<T>();
        // SAFETY: both ranges are bounds-checked; the device range is ours (`&mut self`).
        unsafe {
            pinned_copy(
                self.ops(),
                src,
                s * size,
                self.ptr + (d * size) as u64,
                n * size,
                false,
                CopyKind::HostToDevice,
                self.stream,
            )
        }
    }

    /// Queue a copy of this buffer's `src_range` to `dst` from element `dst_start` on.
    pub fn copy_range_to_pinned<P: PinnedHost<T>>(
        &self,
        src_range: Range<usize>,
        dst: &mut P,
        dst_start: usize,
    ) -> Result<()> {
        let (s, n) = span(src_range, self.len)?;
        let (d, _) = span(dst_start..dst_start.saturating_add(n), dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let size = std::mem::size_of::<T>();
        // SAFETY: both ranges are bounds-checked; the device range is a live block of ours.
        unsafe {
            pinned_copy(
                self.ops(),
                dst,
                d * size,
                self.ptr + (s * size) as u64,
                n * size,
                true,
                CopyKind::DeviceToHost,
                self.stream,
            )
        }
    }

    /// Queue a copy of `src` in on the buffer's stream and return at once.
    ///
    /// # Safety
    /// `src` must stay alive and unmodified until the stream has executed the copy (for
    /// example until [`DeviceBuffer::synchronize`]).
    pub unsafe fn copy_from_host_async(&mut self, src: &[T]) -> Result<()> {
        check_len(self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the block holds `num_bytes`; `src`'s lifetime is the caller's promise.
        unsafe {
            self.ops().copy(
                self.ptr,
                src.as_ptr() as DevPtr,
                self.num_bytes(),
                CopyKind::HostToDevice,
                self.stream,
            )
        }
    }

    /// Queue a copy of the contents out to `dst` on the buffer's stream and return at once.
    ///
    /// # Safety
    /// `dst` must stay alive and must not be read or written until the stream has executed
    /// the copy (for example until [`DeviceBuffer::synchronize`]).
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T]) -> Result<()> {
        check_len(self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the block holds `num_bytes`; `dst`'s lifetime is the caller's promise.
        unsafe {
            self.ops().copy(
                dst.as_mut_ptr() as DevPtr,
                self.ptr,
                self.num_bytes(),
                CopyKind::DeviceToHost,
                self.stream,
            )
        }
    }

    /// Copy another buffer of the same length in (device to device, on this buffer's
    /// stream, ordered after `src`'s stream; peer to peer where `src` is on another device).
    pub fn copy_from_device(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len(self.len, src.len)?;
        if self.len == 0 {
            return Ok(());
        }
        device_copy(self, self.ptr, src, src.ptr, self.num_bytes())
    }

    /// The contents as a `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Element `i` (a device round trip; for checks, not loops).
    pub fn get(&self, i: usize) -> Result<T> {
        self.slice(i..i.saturating_add(1))
            .map_err(|_| Error::OutOfBounds {
                what: format!("index {i}"),
                len: self.len,
            })?
            .to_vec()
            .map(|v| v[0])
    }

    /// Set element `i`.
    pub fn set(&mut self, i: usize, value: T) -> Result<()> {
        let len = self.len;
        self.slice_mut(i..i.saturating_add(1))
            .map_err(|_| Error::OutOfBounds {
                what: format!("index {i}"),
                len,
            })?
            .copy_from_host(&[value])
    }

    /// A read-only view of `range`.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(DeviceSlice {
            ptr: self.ptr + (s * std::mem::size_of::<T>()) as u64,
            len: e - s,
            buf: self,
        })
    }

    /// A writable view of `range`.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(DeviceSliceMut {
            ptr: self.ptr + (s * std::mem::size_of::<T>()) as u64,
            len: e - s,
            buf: self,
        })
    }

    /// Declare that `stream` uses this buffer too: when dropped, its block is reused only
    /// after the work queued on `stream` by then has completed.
    pub fn record_stream(&self, stream: Stream) -> Result<()> {
        match &self.block {
            Some(b) => self.alloc.record_stream(b, stream),
            None => Ok(()),
        }
    }

    /// Wait until all work queued on the buffer's stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.ops().synchronize(self.stream)
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            if let Err(e) = self.alloc.deallocate(b) {
                tracing::error!("gpumem: DeviceBuffer drop failed to return its block: {e}");
            }
        }
    }
}

impl<T: Pod> DeviceSlice<'_, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device address of the first element.
    pub fn device_ptr(&self) -> DevPtr {
        self.ptr
    }
    /// Copy out to `dst` (same length) and wait.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_with(dst, Transfer::Auto)
    }
    /// Copy out to `dst` (same length) the way `how` names; returns once `dst` holds them.
    pub fn copy_to_host_with(&self, dst: &mut [T], how: Transfer) -> Result<()> {
        check_len(self.len, dst.len())?;
        read_into(&self.buf.alloc, self.buf.stream, self.ptr, dst, how)
    }
    /// The contents as a `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}

impl<T: Pod> DeviceSliceMut<'_, T> {
    /// A read-only view of the same elements.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice {
            buf: self.buf,
            ptr: self.ptr,
            len: self.len,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device address of the first element.
    pub fn device_ptr(&self) -> DevPtr {
        self.ptr
    }
    /// Copy `src` (same length) in and wait.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        check_len(self.len, src.len())?;
        write_from(
            &self.buf.alloc,
            self.buf.stream,
            self.ptr,
            src,
            Transfer::Auto,
        )
    }
    /// Copy out to `dst` (same length) and wait.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.as_slice().copy_to_host(dst)
    }
    /// Copy `src` (same length) in the way `how` names.
    pub fn copy_from_host_with(&mut self, src: &[T], how: Transfer) -> Result<()> {
        check_len(self.len, src.len())?;
        write_from(&self.buf.alloc, self.buf.stream, self.ptr, src, how)
    }
    /// Copy another buffer's elements (same length) in, device to device, on this buffer's
    /// stream, ordered after `src`'s stream (peer to peer where `src` is on another device).
    pub fn copy_from_device(&mut self, src: &DeviceSlice<'_, T>) -> Result<()> {
        check_len(self.len, src.len)?;
        if self.len == 0 {
            return Ok(());
        }
        device_copy(
            self.buf,
            self.ptr,
            src.buf,
            src.ptr,
            self.len * std::mem::size_of::<T>(),
        )
    }
    /// Copy out to `dst` (same length) the way `how` names; returns once `dst` holds them.
    pub fn copy_to_host_with(&self, dst: &mut [T], how: Transfer) -> Result<()> {
        self.as_slice().copy_to_host_with(dst, how)
    }
    /// The contents as a `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.as_slice().to_vec()
    }
}

#[cfg(feature = "cuda")]
pub use cudarc_interop::{CudarcView, CudarcViewMut};

#[cfg(feature = "cuda")]
mod cudarc_interop {
    //! cudarc's `DevicePtr`/`DevicePtrMut`, so that cudarc's copies (and libraries built on
    //! those traits) take gpumem buffers: `stream.memcpy_htod(&src, &mut buf.cudarc_mut(&s))`.
    use super::{DeviceBuffer, Stream};
    use crate::resource::{DevPtr, StreamOps};
    use bytemuck::Pod;
    use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
    use std::sync::Arc;

    /// A buffer seen through cudarc's traits, bound to a cudarc stream.
    #[derive(Debug)]
    pub struct CudarcView<'a, T: Pod> {
        buf: &'a DeviceBuffer<T>,
        stream: Arc<CudaStream>,
    }

    /// A writable buffer seen through cudarc's traits, bound to a cudarc stream.
    #[derive(Debug)]
    pub struct CudarcViewMut<'a, T: Pod> {
        buf: &'a mut DeviceBuffer<T>,
        stream: Arc<CudaStream>,
    }

    impl<T: Pod> DeviceBuffer<T> {
        /// This buffer as a cudarc `DevicePtr` for work on `stream`.
        pub fn cudarc(&self, stream: &Arc<CudaStream>) -> CudarcView<'_, T> {
            CudarcView {
                buf: self,
                stream: stream.clone(),
            }
        }

        /// This buffer as a cudarc `DevicePtrMut` for work on `stream`.
        pub fn cudarc_mut(&mut self, stream: &Arc<CudaStream>) -> CudarcViewMut<'_, T> {
            CudarcViewMut {
                buf: self,
                stream: stream.clone(),
            }
        }
    }

    /// Order work on `stream` after the buffer's stream; returns what to do once that work is
    /// queued: nothing on the buffer's own stream, otherwise wait for `stream` (so the buffer's
    /// stream and the pool see the work finished; a correct, simple rule for occasional use).
    fn order<'a, T: Pod>(
        buf: &DeviceBuffer<T>,
        stream: &'a CudaStream,
    ) -> (DevPtr, SyncOnDrop<'a>) {
        let s = Stream::from(stream);
        if s == buf.stream {
            return (buf.ptr, SyncOnDrop::Record(None));
        }
        let ops: &dyn StreamOps = &buf.alloc;
        // without an event to wait for, wait on the host: correctness over speed
        if crate::resource::stream_after(ops, buf.stream, ops, s).is_err() {
            let _ = ops.synchronize(buf.stream);
        }
        (buf.ptr, SyncOnDrop::sync_stream(stream))
    }

    impl<T: Pod> DeviceSlice<T> for CudarcView<'_, T> {
        fn len(&self) -> usize {
            self.buf.len
        }
        fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }
    }

    impl<T: Pod> DeviceSlice<T> for CudarcViewMut<'_, T> {
        fn len(&self) -> usize {
            self.buf.len
        }
        fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }
    }

    impl<T: Pod> DevicePtr<T> for CudarcView<'_, T> {
        fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            order(self.buf, stream)
        }
    }

    impl<T: Pod> DevicePtr<T> for CudarcViewMut<'_, T> {
        fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            order(self.buf, stream)
        }
    }

    impl<T: Pod> DevicePtrMut<T> for CudarcViewMut<'_, T> {
        fn device_ptr_mut<'a>(
            &'a mut self,
            stream: &'a CudaStream,
        ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            order(self.buf, stream)
        }
    }
}

#[cfg(feature = "cuda")]
mod kernel_args {
    //! cudarc kernel arguments: a launch takes the address stored in the buffer or view.
    use super::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
    use bytemuck::Pod;
    use cudarc::driver::{LaunchArgs, PushKernelArg};

    // SAFETY (all four): we push a reference to a `u64` device address (CUdeviceptr) that
    // lives in the buffer or view for `'b`, which outlives the launch arguments (`'b: 'a`).
    unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
            self.arg(&arg.ptr)
        }
    }

    unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b mut DeviceBuffer<T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, arg: &'b mut DeviceBuffer<T>) -> &mut Self {
            self.arg(&arg.ptr)
        }
    }

    unsafe impl<'a, 'b: 'a, 'c: 'b, T: Pod> PushKernelArg<&'b DeviceSlice<'c, T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, arg: &'b DeviceSlice<'c, T>) -> &mut Self {
            self.arg(&arg.ptr)
        }
    }

    unsafe impl<'a, 'b: 'a, 'c: 'b, T: Pod> PushKernelArg<&'b mut DeviceSliceMut<'c, T>>
        for LaunchArgs<'a>
    {
        #[inline(always)]
        fn arg(&mut self, arg: &'b mut DeviceSliceMut<'c, T>) -> &mut Self {
            self.arg(&arg.ptr)
        }
    }
}
