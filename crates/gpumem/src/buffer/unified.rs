//! Unified memory: one buffer that the host and kernels both use, with the data moved to where
//! it is about to be used *before* the access, so that kernels do not fault and the host never
//! reads stale data.
//!
//! Two placements behind one API:
//! - **managed** (cuMemAllocManaged, from a caching pool with a VRAM guard): a device view
//!   prefetches to the device on the view's stream, host access prefetches back and waits;
//!   buffers of [`SHADOW_MIN`] or more keep their pages on the device and give the host a
//!   pinned shadow instead, copied each way (migrating pages to the host is 3–5x slower);
//! - **mirrored**: a device block and a pinned host mirror with dirty tracking and explicit
//!   copies: for devices without (concurrent) managed memory, and on the host backend in CI.
//!
//! Rust's borrows carry the coherence rules: host guards and device views borrow the buffer
//! mutably, so no host access is possible while a device view is alive; each access settles
//! where the valid copy is. Coherence holds at kernel boundaries (a view's stream is ordered
//! after the previous access's stream, and host access waits for it).

use crate::allocator::{Allocation, CachingAllocator};
use crate::buffer::pinned::{pinned_copy, PinnedBuffer};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
pub use crate::device::ManagedOptions;
use crate::error::{Error, Result};
use crate::resource::visibility::MemoryVisibility;
use crate::resource::{
    stream_after, Advice, CopyKind, DevPtr, ManagedMemory, MemPlace, Stream, StreamOps,
};
use bytemuck::Pod;
use serde::Serialize;
use std::marker::PhantomData;
use std::sync::Arc;

/// Where a unified buffer's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Placement {
    /// managed where the device has concurrent managed access, mirrored otherwise
    Auto,
    /// cuMemAllocManaged memory, prefetched before each access
    Managed,
    /// a device block plus a pinned host mirror, copied before each access
    Mirrored,
}

/// Managed buffers this large keep their pages on the device and serve host access from a
/// pinned shadow copy: migrating pages to the host runs at 11–16 GB/s on the H100 machine
/// (chunked over 8 streams no faster), a copy to pinned memory at 55 GB/s; host→device
/// prefetch reaches only 41 GB/s at 16 MiB against 53 for a copy. Smaller buffers migrate.
pub const SHADOW_MIN: usize = 1 << 20;

/// Managed buffers are rounded to this, so that advice and prefetches of one buffer never
/// touch another's pages (the GPU migrates managed memory in 64 KiB blocks).
const MANAGED_GRANULE: usize = 64 << 10;

struct Managed {
    ops: Arc<dyn ManagedMemory>,
    pool: CachingAllocator,
}

struct UInner {
    device: Device,
    managed: Option<Managed>,
    placement: Placement,
}

/// The source of unified buffers on one device: the device allocator (mirrored placement and
/// copies), and where managed memory is used, a caching pool of it with a VRAM guard (0.8 of
/// free memory). Cheap to clone.
#[derive(Clone)]
pub struct UnifiedMemory {
    inner: Arc<UInner>,
}

impl std::fmt::Debug for UnifiedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnifiedMemory")
            .field("placement", &self.inner.placement)
            .finish()
    }
}

impl Placement {
    /// The placement this one means on a device with `visibility`: `Auto` is managed memory
    /// where host and device share it while kernels run, mirrored elsewhere; `Managed` where
    /// managed memory settles only at kernel boundaries (Windows, WSL2, older GPUs) or is
    /// missing is refused with the reason.
    pub fn resolve(self, visibility: MemoryVisibility) -> std::result::Result<Placement, String> {
        match self {
            Placement::Auto if visibility.concurrent_managed() => Ok(Placement::Managed),
            Placement::Auto => Ok(Placement::Mirrored),
            Placement::Managed if !visibility.concurrent_managed() => Err(format!(
                "managed memory with concurrent access (this device's memory is visible {}; \
                 use Placement::Mirrored)",
                match visibility {
                    MemoryVisibility::KernelBoundary => "only at kernel boundaries",
                    _ => "only through copies",
                }
            )),
            p => Ok(p),
        }
    }
}

impl UnifiedMemory {
    /// Unified memory on `device`'s device. `Placement::Auto` picks managed memory where the
    /// device has concurrent managed access (Pascal and later on Linux) and the mirrored
    /// placement elsewhere (and on the host backend); `Managed` where it is missing is an
    /// error.
    pub fn new(device: &Device, placement: Placement) -> Result<Self> {
        Self::with_options(device, placement, ManagedOptions::default())
    }

    /// As [`UnifiedMemory::new`], with the managed pool's guard options.
    pub fn with_options(
        device: &Device,
        placement: Placement,
        options: ManagedOptions,
    ) -> Result<Self> {
        let resolved =
            placement
                .resolve(device.visibility())
                .map_err(|what| Error::Unsupported {
                    backend: device.backend().name().to_string(),
                    what,
                })?;
        let managed = match resolved {
            Placement::Managed => {
                let p = device.managed_pool(options)?;
                Some(Managed {
                    ops: p.memory,
                    pool: p.allocator,
                })
            }
            _ => None,
        };
        Ok(Self {
            inner: Arc::new(UInner {
                device: device.clone(),
                managed,
                placement: resolved,
            }),
        })
    }

    /// The placement buffers get (never `Auto`).
    pub fn placement(&self) -> Placement {
        self.inner.placement
    }

    /// The device (its allocator serves the mirrored placement and copies).
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The managed pool (statistics, `empty_cache`), where the placement is managed.
    pub fn managed_pool(&self) -> Option<&CachingAllocator> {
        self.inner.managed.as_ref().map(|m| &m.pool)
    }
}

enum Store<T: Pod> {
    Managed {
        block: Option<Allocation>,
        ptr: DevPtr,
        /// bytes reserved (rounded to the granule)
        bytes: usize,
        /// large buffers: the host side lives in a pinned shadow (see `SHADOW_MIN`)
        shadow: Option<PinnedBuffer<T>>,
    },
    Mirrored {
        device: DeviceBuffer<T>,
        mirror: PinnedBuffer<T>,
    },
}

/// How a buffer has been used so far, and the advice in force.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AccessPattern {
    /// host write accesses
    pub host_writes: u32,
    /// read-only device views
    pub device_reads: u32,
    /// writable device views
    pub device_writes: u32,
    /// read-mostly is in force
    pub read_mostly: bool,
    /// the user gave advice (automatic advice is off from then on)
    pub user_advice: bool,
}

/// A typed buffer of unified memory (see the module documentation).
pub struct UnifiedBuffer<T: Pod> {
    mem: UnifiedMemory,
    store: Store<T>,
    len: usize,
    host_valid: bool,
    device_valid: bool,
    /// stream of the last device access or prefetch
    last_stream: Stream,
    /// work may be queued on `last_stream` that touches the buffer
    device_pending: bool,
    pattern: AccessPattern,
    /// streams the managed block was used on (for its safe reuse)
    streams: Vec<Stream>,
    /// other devices given access (accessed-by advice in force)
    shared_with: Vec<usize>,
    /// streams of other devices with work that may still touch the buffer (waited for on
    /// the host before the next access from anywhere else, and before the block goes back)
    peer_pending: Vec<Stream>,
}

impl<T: Pod> std::fmt::Debug for UnifiedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnifiedBuffer")
            .field("placement", &self.mem.placement())
            .field("len", &self.len)
            .field("host_valid", &self.host_valid)
            .field("device_valid", &self.device_valid)
            .finish()
    }
}

/// Host read access (derefs to `[T]`).
#[derive(Debug)]
pub struct HostRef<'a, T: Pod> {
    data: &'a [T],
}

/// Host write access (derefs to `[T]` mutably).
#[derive(Debug)]
pub struct HostMut<'a, T: Pod> {
    data: &'a mut [T],
}

impl<T: Pod> std::ops::Deref for HostRef<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T: Pod> std::ops::Deref for HostMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T: Pod> std::ops::DerefMut for HostMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.data
    }
}

/// A device view bound to a stream: a kernel argument (`&view` pushes the device address)
/// for work on that stream. While it lives, the buffer cannot be touched from the host.
#[derive(Debug)]
pub struct DeviceView<'a, T: Pod> {
    ptr: DevPtr,
    len: usize,
    stream: Stream,
    _buf: PhantomData<&'a mut UnifiedBuffer<T>>,
}

impl<T: Pod> DeviceView<'_, T> {
    /// Device address of the first element.
    pub fn device_ptr(&self) -> DevPtr {
        self.ptr
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The stream the view is for.
    pub fn stream(&self) -> Stream {
        self.stream
    }
}

impl<T: Pod> UnifiedBuffer<T> {
    /// `len` zeroed elements, first used on `stream`.
    pub fn zeroed(mem: &UnifiedMemory, stream: Stream, len: usize) -> Result<Self> {
        let bytes = super::bytes_of::<T>(len, crate::pool::size::MAX_REQUEST)?;
        if len == 0 || bytes == 0 {
            return Err(Error::ZeroSize);
        }
        let (store, host_valid, device_valid) = match &mem.inner.managed {
            Some(m) => {
                let rounded = bytes.next_multiple_of(MANAGED_GRANULE);
                let block = m.pool.allocate(stream, rounded, 512)?;
                let ptr = block.ptr();
                // zeroed on the device: the pages start there
                // SAFETY: the block is ours and holds `rounded` bytes.
                unsafe { m.pool.memset(ptr, 0, rounded, stream)? };
                let shadow = if bytes >= SHADOW_MIN {
                    // pages stay on the device; the host works on the shadow
                    // SAFETY: the range is the block just allocated from the managed pool.
                    unsafe {
                        m.ops.advise(
                            ptr,
                            rounded,
                            Advice::PreferredLocation(Some(MemPlace::Device(m.ops.ordinal()))),
                        )?
                    };
                    Some(PinnedBuffer::zeroed(mem.inner.device.pinned_pool()?, len)?)
                } else {
                    None
                };
                let host_valid = shadow.is_some();
                let store = Store::Managed {
                    block: Some(block),
                    ptr,
                    bytes: rounded,
                    shadow,
                };
                (store, host_valid, true)
            }
            None => {
                let device = DeviceBuffer::zeroed(&mem.inner.device, stream, len)?;
                let mirror = PinnedBuffer::zeroed(mem.inner.device.pinned_pool()?, len)?;
                (Store::Mirrored { device, mirror }, true, true)
            }
        };
        Ok(Self {
            mem: mem.clone(),
            store,
            len,
            host_valid,
            device_valid,
            last_stream: stream,
            device_pending: true,
            pattern: AccessPattern::default(),
            streams: vec![stream],
            shared_with: Vec::new(),
            peer_pending: Vec::new(),
        })
    }

    /// A buffer holding a copy of `data`, written from the host.
    pub fn from_slice(mem: &UnifiedMemory, stream: Stream, data: &[T]) -> Result<Self> {
        let mut b = Self::zeroed(mem, stream, data.len())?;
        b.host_mut_discard()?.copy_from_slice(data);
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if there are no elements (never: a unified buffer holds at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The placement of this buffer.
    pub fn placement(&self) -> Placement {
        self.mem.placement()
    }

    /// How the buffer has been used, and the advice in force.
    pub fn access_pattern(&self) -> AccessPattern {
        self.pattern
    }

    /// True where the host copy is current (no movement needed before host reads).
    pub fn is_host_valid(&self) -> bool {
        self.host_valid
    }

    /// True where the device copy is current (no movement needed before kernels read).
    pub fn is_device_valid(&self) -> bool {
        self.device_valid
    }

    fn ops(&self) -> &dyn StreamOps {
        &self.mem.inner.device
    }

    fn managed(&self) -> Option<&Managed> {
        self.mem.inner.managed.as_ref()
    }

    /// Wait for work of other devices' views (their streams' events cannot be recorded in
    /// this device's context, so the host waits).
    fn settle_peers(&mut self) -> Result<()> {
        for s in std::mem::take(&mut self.peer_pending) {
            self.ops().synchronize(s)?;
        }
        Ok(())
    }

    /// Make future work on `stream` wait for the last access's stream.
    fn order_after_last(&mut self, stream: Stream) -> Result<()> {
        self.settle_peers()?;
        if stream != self.last_stream && self.device_pending {
            let ops = self.ops();
            stream_after(ops, self.last_stream, ops, stream)?;
        }
        if !self.streams.contains(&stream) {
            self.streams.push(stream);
            match &self.store {
                Store::Managed { block: Some(b), .. } => {
                    if let Some(m) = self.managed() {
                        m.pool.record_stream(b, stream)?;
                    }
                }
                Store::Mirrored { device, .. } => device.record_stream(stream)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Wait for device work that may still touch the buffer.
    fn settle_device(&mut self) -> Result<()> {
        self.settle_peers()?;
        if self.device_pending {
            self.ops().synchronize(self.last_stream)?;
            self.device_pending = false;
        }
        Ok(())
    }

    /// Bring the data to the host (if it is not there) and wait for it.
    fn ensure_host(&mut self) -> Result<()> {
        self.settle_peers()?;
        if self.host_valid {
            return Ok(());
        }
        let stream = self.last_stream;
        let ops: &dyn StreamOps = &self.mem.inner.device;
        match &mut self.store {
            Store::Managed {
                ptr,
                shadow: Some(sh),
                ..
            } => {
                // device → shadow at copy speed, after the last access's work
                // SAFETY: the shadow holds `len` elements and the managed block at least as
                // many; the block is ours and `&mut self` keeps other users away.
                unsafe {
                    pinned_copy(
                        ops,
                        &*sh,
                        0,
                        *ptr,
                        sh.num_bytes(),
                        true,
                        CopyKind::Unified,
                        stream,
                    )?
                };
            }
            Store::Managed { ptr, bytes, .. } => {
                if let Some(m) = self.mem.inner.managed.as_ref() {
                    // SAFETY: the range is this buffer's managed block.
                    unsafe { m.ops.prefetch(*ptr, *bytes, MemPlace::Host, stream)? };
                }
            }
            Store::Mirrored { device, mirror } => {
                // the device buffer's own stream, ordered after the last access
                if device.stream() != stream {
                    let ops = device.allocator();
                    stream_after(ops, stream, ops, device.stream())?;
                }
                device.copy_to_pinned(mirror)?;
            }
        }
        self.host_valid = true;
        if !self.pattern.read_mostly && !self.copies() {
            // managed pages moved (a copy leaves the device side valid)
            self.device_valid = false;
        }
        Ok(())
    }

    /// True where host and device sides are two copies (mirrored, or a managed shadow);
    /// false where managed pages migrate.
    fn copies(&self) -> bool {
        match &self.store {
            Store::Managed { shadow, .. } => shadow.is_some(),
            Store::Mirrored { .. } => true,
        }
    }

    /// Read access from the host: moves the data here first and waits for device work.
    pub fn host(&mut self) -> Result<HostRef<'_, T>> {
        self.ensure_host()?;
        self.settle_device()?;
        let len = self.len;
        let data = match &self.store {
            Store::Managed {
                shadow: Some(sh), ..
            } => sh.as_slice()?,
            // SAFETY: the managed block holds `len` elements, is resident (or coherently
            // accessible) on the host, no device work touches it (settled), and `&mut self`
            // keeps device views away while the guard lives.
            Store::Managed { ptr, .. } => unsafe {
                std::slice::from_raw_parts(*ptr as *const T, len)
            },
            Store::Mirrored { mirror, .. } => mirror.as_slice()?,
        };
        Ok(HostRef { data })
    }

    /// Write access from the host, to the current data: moves the data here first.
    pub fn host_mut(&mut self) -> Result<HostMut<'_, T>> {
        self.ensure_host()?;
        self.host_write_access()
    }

    /// Write access from the host for a caller that overwrites everything it reads: where
    /// the placement allows, the current data is not brought over first (mirrored).
    pub fn host_mut_discard(&mut self) -> Result<HostMut<'_, T>> {
        if self.copies() {
            self.settle_device()?;
            self.host_valid = true;
        } else {
            self.ensure_host()?;
        }
        self.host_write_access()
    }

    fn host_write_access(&mut self) -> Result<HostMut<'_, T>> {
        self.settle_device()?;
        self.device_valid = false;
        self.pattern.host_writes = self.pattern.host_writes.saturating_add(1);
        let len = self.len;
        let data = match &mut self.store {
            Store::Managed {
                shadow: Some(sh), ..
            } => sh.as_mut_slice()?,
            // SAFETY: as in `host`; `&mut self` makes the access unique.
            Store::Managed { ptr, .. } => unsafe {
                std::slice::from_raw_parts_mut(*ptr as *mut T, len)
            },
            Store::Mirrored { mirror, .. } => mirror.as_mut_slice()?,
        };
        Ok(HostMut { data })
    }

    /// Move the data to the device on `stream` (no host wait); later work on `stream` finds it
    /// there.
    pub fn prefetch_to_device(&mut self, stream: Stream) -> Result<()> {
        self.order_after_last(stream)?;
        if !self.device_valid {
            let ops: &dyn StreamOps = &self.mem.inner.device;
            match &mut self.store {
                Store::Managed {
                    ptr,
                    shadow: Some(sh),
                    ..
                } => {
                    // shadow → device-resident pages at copy speed
                    // SAFETY: the managed block holds at least the shadow's bytes and is ours;
                    // `&mut self` keeps other users away.
                    unsafe {
                        pinned_copy(
                            ops,
                            &*sh,
                            0,
                            *ptr,
                            sh.num_bytes(),
                            false,
                            CopyKind::Unified,
                            stream,
                        )?
                    };
                }
                Store::Managed { ptr, bytes, .. } => {
                    if let Some(m) = self.mem.inner.managed.as_ref() {
                        let to = MemPlace::Device(m.ops.ordinal());
                        // SAFETY: the range is this buffer's managed block.
                        unsafe { m.ops.prefetch(*ptr, *bytes, to, stream)? };
                    }
                }
                Store::Mirrored { device, mirror } => {
                    device.copy_from_pinned(mirror)?;
                    if device.stream() != stream {
                        let ops = device.allocator();
                        stream_after(ops, device.stream(), ops, stream)?;
                    }
                }
            }
            self.device_valid = true;
            if !self.pattern.read_mostly && !self.copies() {
                self.host_valid = false;
            }
        }
        self.last_stream = stream;
        self.device_pending = true;
        Ok(())
    }

    /// Move the data to the host, queued on `stream` (host access then waits for it).
    pub fn prefetch_to_host(&mut self, stream: Stream) -> Result<()> {
        self.order_after_last(stream)?;
        self.last_stream = stream;
        self.ensure_host()
    }

    /// A read-only device view for work on `stream` (data moved there first, on `stream`).
    pub fn device(&mut self, stream: Stream) -> Result<DeviceView<'_, T>> {
        self.prefetch_to_device(stream)?;
        self.pattern.device_reads = self.pattern.device_reads.saturating_add(1);
        self.auto_advice()?;
        Ok(self.view(stream))
    }

    /// A writable device view for work on `stream`: the host copy is stale afterwards.
    pub fn device_mut(&mut self, stream: Stream) -> Result<DeviceView<'_, T>> {
        self.prefetch_to_device(stream)?;
        self.note_device_write()?;
        Ok(self.view(stream))
    }

    /// A writable view is handed out: count it, drop gpumem's own read-mostly advice (written
    /// by kernels after all, it no longer fits), and the host copy is stale.
    fn note_device_write(&mut self) -> Result<()> {
        self.pattern.device_writes = self.pattern.device_writes.saturating_add(1);
        if self.pattern.read_mostly && !self.pattern.user_advice {
            self.apply_advice(Advice::ReadMostly(false))?;
            self.pattern.read_mostly = false;
        }
        self.host_valid = false;
        Ok(())
    }

    /// A read-only view for work on `stream`, a stream of device `ordinal` (another GPU than
    /// the buffer's): the pages stay on the buffer's device and `ordinal` is given
    /// accessed-by advice, so its kernels read them in place (over NVLink or PCIe) without
    /// page faults; a read-mostly buffer (advice, or gpumem's own for buffers the host writes
    /// and kernels only read) is prefetched to `ordinal` on `stream` as a read-only copy.
    /// `stream` waits for the buffer's earlier work; the next access from anywhere else (and
    /// the buffer's drop) waits on the host for the view's work. Managed placement only: a
    /// mirrored buffer lives in one device's memory.
    pub fn device_on(&mut self, ordinal: usize, stream: Stream) -> Result<DeviceView<'_, T>> {
        if self.home() == Some(ordinal) {
            return self.device(stream);
        }
        self.peer_access(ordinal, stream)?;
        self.pattern.device_reads = self.pattern.device_reads.saturating_add(1);
        Ok(self.view(stream))
    }

    /// A writable view for work on `stream` of device `ordinal` (as [`Self::device_on`]):
    /// the host copy is stale afterwards.
    pub fn device_on_mut(&mut self, ordinal: usize, stream: Stream) -> Result<DeviceView<'_, T>> {
        if self.home() == Some(ordinal) {
            return self.device_mut(stream);
        }
        self.peer_access(ordinal, stream)?;
        self.note_device_write()?;
        Ok(self.view(stream))
    }

    /// Devices given access to the buffer by [`Self::device_on`] (or advice).
    pub fn shared_with(&self) -> &[usize] {
        &self.shared_with
    }

    /// The ordinal of the buffer's device (none on the host backend).
    fn home(&self) -> Option<usize> {
        match self.mem.inner.device.backend().location() {
            crate::resource::Location::Cuda(o) => Some(o),
            _ => None,
        }
    }

    fn peer_access(&mut self, ordinal: usize, stream: Stream) -> Result<()> {
        if self.managed().is_none() {
            return Err(Error::Unsupported {
                backend: self.mem.inner.device.backend().name().to_string(),
                what: "a view for another device of a mirrored unified buffer (its data \
                       lives in one device's memory; use the managed placement)"
                    .into(),
            });
        }
        let count = crate::device::device_count();
        if ordinal >= count {
            return Err(Error::InvalidDevice { ordinal, count });
        }
        if !self.shared_with.contains(&ordinal) {
            self.apply_advice(Advice::AccessedBy(ordinal, true))?;
            self.shared_with.push(ordinal);
        }
        // the data on the buffer's device, on the last access's stream
        let last = self.last_stream;
        self.prefetch_to_device(last)?;
        // the peer's stream waits for that (a cross-device wait on this device's event)
        let ops = self.ops();
        stream_after(ops, last, ops, stream)?;
        if self.pattern.read_mostly {
            // read-mostly pages are duplicated where they are read: give the peer its
            // read-only copy now, on its stream, rather than on its kernel's first touch
            if let (Store::Managed { ptr, bytes, .. }, Some(m)) = (&self.store, self.managed()) {
                // SAFETY: the range is this buffer's managed block.
                unsafe {
                    m.ops
                        .prefetch(*ptr, *bytes, MemPlace::Device(ordinal), stream)?
                };
            }
        }
        if !self.peer_pending.contains(&stream) {
            self.peer_pending.push(stream);
        }
        Ok(())
    }

    fn view(&self, stream: Stream) -> DeviceView<'_, T> {
        let ptr = match &self.store {
            Store::Managed { ptr, .. } => *ptr,
            Store::Mirrored { device, .. } => device.device_ptr(),
        };
        DeviceView {
            ptr,
            len: self.len,
            stream,
            _buf: PhantomData,
        }
    }

    /// Automatic advice: a buffer the host wrote and kernels only read (twice or more)
    /// becomes read-mostly, so that host reads no longer move it off the device.
    fn auto_advice(&mut self) -> Result<()> {
        let p = self.pattern;
        if !p.user_advice
            && !p.read_mostly
            && p.host_writes >= 1
            && p.device_writes == 0
            && p.device_reads >= 2
        {
            self.apply_advice(Advice::ReadMostly(true))?;
            self.pattern.read_mostly = true;
        }
        Ok(())
    }

    fn apply_advice(&self, advice: Advice) -> Result<()> {
        if let (Store::Managed { ptr, bytes, .. }, Some(m)) = (&self.store, self.managed()) {
            // SAFETY: the range is this buffer's managed block.
            unsafe { m.ops.advise(*ptr, *bytes, advice)? };
        }
        Ok(())
    }

    /// Give advice (read-mostly, preferred location, accessed-by; each set or unset). From
    /// then on gpumem gives none of its own. On the mirrored placement advice is recorded
    /// but changes nothing (both copies are kept anyway).
    pub fn advise(&mut self, advice: Advice) -> Result<()> {
        if let Advice::AccessedBy(d, _) | Advice::PreferredLocation(Some(MemPlace::Device(d))) =
            advice
        {
            let count = crate::device::device_count().max(1);
            if matches!(self.store, Store::Managed { .. }) && d >= count {
                return Err(Error::InvalidDevice { ordinal: d, count });
            }
        }
        self.apply_advice(advice)?;
        if let Advice::AccessedBy(d, on) = advice {
            self.shared_with.retain(|&x| x != d);
            if on {
                self.shared_with.push(d);
            }
        }
        self.pattern.user_advice = true;
        if let Advice::ReadMostly(on) = advice {
            self.pattern.read_mostly = on;
        }
        Ok(())
    }
}

impl<T: Pod> Drop for UnifiedBuffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.settle_peers() {
            tracing::error!(
                "gpumem: UnifiedBuffer drop could not wait for another device's work: {e}"
            );
        }
        if let Store::Managed { block, .. } = &mut self.store {
            if let (Some(b), Some(m)) = (block.take(), self.mem.inner.managed.as_ref()) {
                if let Err(e) = m.pool.deallocate(b) {
                    tracing::error!("gpumem: UnifiedBuffer drop failed to return its block: {e}");
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
mod kernel_args {
    use super::DeviceView;
    use bytemuck::Pod;
    use cudarc::driver::{LaunchArgs, PushKernelArg};

    // SAFETY: we push a reference to the view's `u64` device address, which lives in the view
    // for `'b`, longer than the launch arguments (`'b: 'a`).
    unsafe impl<'a, 'b: 'a, 'c, T: Pod> PushKernelArg<&'b DeviceView<'c, T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, arg: &'b DeviceView<'c, T>) -> &mut Self {
            self.arg(&arg.ptr)
        }
    }
}
