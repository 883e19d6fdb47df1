//! Pinned host buffers: [`PinnedBuffer<T>`] (a block of the pinned pool) and
//! [`PinnedRegistration`] (existing host memory page-locked for as long as it is borrowed).
//!
//! Both remember the copies queued on them (one event per stream). Host access waits for
//! the copies that could still change what it sees: [`PinnedBuffer::as_slice`] waits for
//! device→host copies into the buffer, [`PinnedBuffer::as_mut_slice`] for every copy. A
//! dropped buffer hands its copies' events to the pool, which reuses the block only after
//! they complete.

use crate::error::{Error, Result};
use crate::pool::pinned::{PinnedBlock, PinnedPool};
use crate::resource::{unsupported, Backend, CopyKind, DevPtr, Event, Stream, StreamOps};
use bytemuck::Pod;
use parking_lot::Mutex;
use std::marker::PhantomData;

/// One queued copy on a host region: the last event recorded on `stream`, and whether a
/// copy into the region (device → host) is among those it captures.
#[derive(Debug, Clone, Copy)]
struct Use {
    stream: Stream,
    event: Event,
    writes: bool,
}

/// The copies in flight on a host region (one event per stream).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Uses(Mutex<Vec<Use>>);

impl Uses {
    /// Remember that a copy was just queued on `stream` (`writes`: into the region).
    pub(crate) fn record(&self, ops: &dyn StreamOps, stream: Stream, writes: bool) -> Result<()> {
        let event = ops.record_event(stream)?;
        let mut uses = self.0.lock();
        // a later event on a stream captures everything an earlier one did
        if let Some(u) = uses.iter_mut().find(|u| u.stream == stream) {
            ops.destroy_event(u.event);
            u.event = event;
            u.writes |= writes;
        } else {
            uses.push(Use {
                stream,
                event,
                writes,
            });
        }
        Ok(())
    }

    /// Wait for the copies that write into the region (`all`: for every copy).
    pub(crate) fn wait(&self, ops: &dyn StreamOps, all: bool) -> Result<()> {
        let mut uses = self.0.lock();
        let mut first_err = None;
        uses.retain(|u| {
            if !all && !u.writes {
                return true;
            }
            match ops.sync_event(u.event) {
                Ok(()) => {
                    ops.destroy_event(u.event);
                    false
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    true
                }
            }
        });
        first_err.map_or(Ok(()), Err)
    }

    /// Make future work on `stream` wait for every copy in flight (no host blocking).
    pub(crate) fn order_before(&self, ops: &dyn StreamOps, stream: Stream) -> Result<()> {
        for u in self.0.lock().iter().filter(|u| u.stream != stream) {
            ops.wait_event(stream, u.event)?;
        }
        Ok(())
    }

    fn take(&mut self) -> Vec<Event> {
        self.0.get_mut().drain(..).map(|u| u.event).collect()
    }
}

/// Queue a copy of `bytes` bytes between pinned `host` (from byte `host_off`) and device
/// address `dev` on `stream` (`into_host`: device → host; `kind`: the driver's copy kind),
/// ordered after the copies other streams have queued on `host`, and remembered by `host`:
/// host access waits for it, and a freed block is not reused before it completes.
///
/// # Safety
/// `[host_off, host_off + bytes)` must lie in `host`, and `dev` must be device (or managed)
/// memory valid for `bytes` bytes that nothing else touches until the copy completes in
/// `stream` order.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pinned_copy<T: Pod, P: PinnedHost<T> + ?Sized>(
    ops: &dyn StreamOps,
    host: &P,
    host_off: usize,
    dev: DevPtr,
    bytes: usize,
    into_host: bool,
    kind: CopyKind,
    stream: Stream,
) -> Result<()> {
    // copies on other streams that write `host` (or, for a copy into it, read it) first
    host.uses().order_before(host.host_ops(), stream)?;
    let h = host.host_ptr() + host_off as u64;
    let (dst, src) = if into_host { (h, dev) } else { (dev, h) };
    // SAFETY: the caller guarantees both ranges; `host` stays allocated and unwritten until
    // the event recorded next completes (its host access and its pool wait for it).
    unsafe { ops.copy(dst, src, bytes, kind, stream)? };
    host.uses().record(host.host_ops(), stream, into_host)
}

/// Host memory that copies can run from and to at pinned speed.
pub trait PinnedHost<T: Pod> {
    /// Host address of the first element.
    fn host_ptr(&self) -> DevPtr;
    /// Number of elements.
    fn len(&self) -> usize;
    /// True if there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[doc(hidden)]
    fn uses(&self) -> &Uses;
    /// The backend whose events guard this memory (the pinned pool's).
    #[doc(hidden)]
    fn host_ops(&self) -> &dyn Backend;
}

/// A typed buffer of page-locked host memory from a [`PinnedPool`].
pub struct PinnedBuffer<T: Pod> {
    pool: PinnedPool,
    block: Option<PinnedBlock>,
    ptr: DevPtr,
    len: usize,
    uses: Uses,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Pod> PinnedBuffer<T> {
    /// `len` zeroed elements from `pool`.
    pub fn zeroed(pool: &PinnedPool, len: usize) -> Result<Self> {
        let mut b = Self::uninit(pool, len)?;
        if let Some(block) = &b.block {
            // SAFETY: the block is ours, idle (fresh from the pool) and holds `size` bytes.
            unsafe { std::ptr::write_bytes(block.ptr() as *mut u8, 0, block.size()) };
        }
        b.len = len;
        Ok(b)
    }

    /// A pinned copy of `data`.
    pub fn from_slice(pool: &PinnedPool, data: &[T]) -> Result<Self> {
        let mut b = Self::uninit(pool, data.len())?;
        if !data.is_empty() {
            // SAFETY: the block is ours, idle, holds `size_of_val(data)` bytes and is distinct
            // from `data` (a fresh pool block).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr() as *const u8,
                    b.ptr as *mut u8,
                    std::mem::size_of_val(data),
                )
            };
        }
        b.len = data.len();
        Ok(b)
    }

    /// A buffer with `len` set to 0 until the caller has initialised the block.
    fn uninit(pool: &PinnedPool, len: usize) -> Result<Self> {
        let bytes = super::bytes_of::<T>(len, crate::pool::pinned::PINNED_MAX_REQUEST as u64)?;
        if std::mem::align_of::<T>() > crate::pool::pinned::PINNED_ALIGN {
            return Err(Error::InvalidAlignment {
                align: std::mem::align_of::<T>(),
                max: crate::pool::pinned::PINNED_ALIGN,
            });
        }
        let block = if bytes == 0 {
            None
        } else {
            Some(pool.allocate(bytes)?)
        };
        Ok(Self {
            pool: pool.clone(),
            ptr: block.as_ref().map_or(0, |b| b.ptr()),
            block,
            len: 0,
            uses: Uses::default(),
            _t: PhantomData,
        })
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

    /// The pool the buffer came from.
    pub fn pool(&self) -> &PinnedPool {
        &self.pool
    }

    fn ops(&self) -> &dyn Backend {
        &**self.pool.backend()
    }

    /// The elements, once device→host copies into the buffer have completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.uses.wait(self.ops(), false)?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the block holds `len` initialised elements (zeroed or copied in), is aligned
        // for `T` (page-aligned, `T`'s alignment checked), and no copy writes into it now.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) })
    }

    /// The elements for writing, once every copy from or to the buffer has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.uses.wait(self.ops(), true)?;
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`, and no copy reads the block now; `&mut self` is unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) })
    }

    /// Wait for every copy queued on the buffer.
    pub fn synchronize(&self) -> Result<()> {
        self.uses.wait(self.ops(), true)
    }
}

impl<T: Pod> PinnedHost<T> for PinnedBuffer<T> {
    fn host_ptr(&self) -> DevPtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn uses(&self) -> &Uses {
        &self.uses
    }
    fn host_ops(&self) -> &dyn Backend {
        self.ops()
    }
}

impl<T: Pod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            let events = self.uses.take();
            if let Err(e) = self.pool.free(b, events) {
                tracing::error!("gpumem: PinnedBuffer drop failed to return its block: {e}");
            }
        }
    }
}

/// Existing host memory page-locked (cuMemHostRegister) for as long as this guard borrows it.
/// Dropping the guard waits for the copies queued on it, then unregisters the memory.
pub struct PinnedRegistration<'a, T: Pod> {
    data: &'a mut [T],
    backend: std::sync::Arc<dyn Backend>,
    uses: Uses,
}

impl<T: Pod> std::fmt::Debug for PinnedRegistration<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRegistration")
            .field("ptr", &self.data.as_ptr())
            .field("len", &self.data.len())
            .finish()
    }
}

impl<'a, T: Pod> PinnedRegistration<'a, T> {
    /// Page-lock `data` through `pool`'s backend. Registration costs about as much as a pinned
    /// allocation of the same size: worth it for memory that is copied many times.
    pub fn new(pool: &PinnedPool, data: &'a mut [T]) -> Result<Self> {
        let backend = pool.backend().clone();
        if !data.is_empty() {
            backend
                .host_registration()
                .ok_or_else(|| unsupported(backend.name(), "host-memory registration"))?
                .register_host(data.as_mut_ptr() as DevPtr, std::mem::size_of_val(data))?;
        }
        Ok(Self {
            data,
            backend,
            uses: Uses::default(),
        })
    }

    /// The elements, once device→host copies into them have completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.uses.wait(&*self.backend, false)?;
        Ok(self.data)
    }

    /// The elements for writing, once every copy from or to them has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.uses.wait(&*self.backend, true)?;
        Ok(self.data)
    }

    /// Wait for every copy queued on the memory.
    pub fn synchronize(&self) -> Result<()> {
        self.uses.wait(&*self.backend, true)
    }
}

impl<T: Pod> PinnedHost<T> for PinnedRegistration<'_, T> {
    fn host_ptr(&self) -> DevPtr {
        self.data.as_ptr() as DevPtr
    }
    fn len(&self) -> usize {
        self.data.len()
    }
    fn uses(&self) -> &Uses {
        &self.uses
    }
    fn host_ops(&self) -> &dyn Backend {
        &*self.backend
    }
}

impl<T: Pod> Drop for PinnedRegistration<'_, T> {
    fn drop(&mut self) {
        // the borrow ends here: no copy may touch the memory afterwards
        if let Err(e) = self.uses.wait(&*self.backend, true) {
            tracing::error!("gpumem: waiting for copies on registered memory failed: {e}");
        }
        if !self.data.is_empty() {
            let unregistered = match self.backend.host_registration() {
                Some(r) => r.unregister_host(self.data.as_ptr() as DevPtr),
                None => Err(unsupported(self.backend.name(), "host-memory registration")),
            };
            if let Err(e) = unregistered {
                tracing::error!("gpumem: cuMemHostUnregister failed: {e}");
            }
        }
    }
}
