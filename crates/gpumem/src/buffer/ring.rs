//! A ring-buffer bridge between host and device for fixed-size messages, in two modes
//! ([`RingMode`]):
//!
//! **Copies.** Two rings of `capacity` slots, each a pinned host ring mirrored by a device ring
//! (slot `seq % capacity` on both sides):
//! - host → device: [`RingBridge::send`] writes the next slot of the pinned ring;
//!   [`RingBridge::flush_to_device`] copies every unflushed message to the device ring in one
//!   or two copies (two when the range wraps), on the bridge's stream, without waiting;
//! - device → host: device code writes messages into [`RingBridge::inbox_device_mut`] (slot
//!   `seq % capacity`) and announces them with [`RingBridge::publish`];
//!   [`RingBridge::receive`] copies them back in one or two copies and returns them in order.
//!
//! **Polled** (RingKernel's DMA polling): both rings and their counters live in mapped pinned
//! memory that a running kernel reads and writes in place; no copy is ever issued. The host
//! publishes each message by bumping a counter the kernel polls, and polls the counter the
//! kernel bumps when it has written replies. Device code gets the addresses from
//! [`RingBridge::polled_args`] and the protocol from [`POLLED_RING_CUDA`]. It needs memory
//! the host and a running kernel both see ([`crate::MemoryVisibility::SystemWide`]);
//! [`RingMode::Auto`] picks it where the device has that, copies elsewhere.
//!
//! Messages are any plain-old-data type; cache-line-aligned ones (`#[repr(C, align(128))]`)
//! keep each slot on its own lines.

use crate::buffer::pinned::PinnedBuffer;
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::resource::{Location, Resource, Stream};
use bytemuck::Pod;
use serde::Serialize;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How messages cross the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RingMode {
    /// polled where the device's memory visibility lets a running kernel see host writes
    /// (with [`DEFAULT_POLL`]), copies elsewhere
    Auto,
    /// device rings, filled and drained by copies on the bridge's stream
    Copies,
    /// rings in mapped pinned memory, read and written in place by a running kernel; `poll`
    /// is how long a waiting side pauses between looks: zero spins; on the host, intervals
    /// under 50 us yield the thread (a sleep lasts at least the timer slack), longer ones sleep;
    /// device code gets it for `__nanosleep`
    Polled {
        /// pause between two looks at the other side's counter
        poll: Duration,
    },
}

/// The poll interval [`RingMode::Auto`] uses: spin (latency first; a waiting host thread
/// keeps one core busy, as RingKernel's DMA polling does).
pub const DEFAULT_POLL: Duration = Duration::ZERO;

/// How long a polled send waits for the device to free a slot, and `receive_at_least` for
/// replies, unless [`RingBridge::set_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl RingMode {
    /// The mode this one means where polling `polled_ok` is possible: `Auto` picks; an
    /// explicit `Polled` where it is not possible is refused with the reason.
    pub fn resolve(self, polled_ok: bool) -> std::result::Result<RingMode, String> {
        match self {
            RingMode::Auto if polled_ok => Ok(RingMode::Polled { poll: DEFAULT_POLL }),
            RingMode::Auto => Ok(RingMode::Copies),
            RingMode::Polled { .. } if !polled_ok => Err(
                "a polled ring: this device's memory is not visible to running kernels (it \
                 settles only at kernel boundaries or through copies); use RingMode::Copies"
                    .into(),
            ),
            m => Ok(m),
        }
    }
}

/// What crossed the bridge.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RingCounters {
    /// messages copied host → device
    pub messages_to_device: u64,
    /// messages copied device → host
    pub messages_to_host: u64,
    /// bytes copied host → device
    pub bytes_to_device: u64,
    /// bytes copied device → host
    pub bytes_to_host: u64,
    /// flushes that copied something host → device
    pub flushes_to_device: u64,
    /// receives that copied something device → host
    pub flushes_to_host: u64,
    /// copy calls queued (one or two per flush; never in polled mode)
    pub copies: u64,
    /// polled mode: looks at the device's counter that found nothing new
    pub empty_polls: u64,
}

/// Word indices of the polled ring's counters (`u64`s, each on its own 128-byte line).
pub mod ctrl {
    /// messages the host has written (host writes, device reads)
    pub const TO_DEVICE_HEAD: usize = 0;
    /// messages the device has consumed (device writes)
    pub const TO_DEVICE_TAIL: usize = 16;
    /// messages the device has written (device writes)
    pub const TO_HOST_HEAD: usize = 32;
    /// messages the host has received (host writes)
    pub const TO_HOST_TAIL: usize = 48;
    /// nonzero once the host closes the bridge: a polling kernel returns (messages it has not
    /// consumed are dropped)
    pub const CLOSED: usize = 64;
    /// 1 while a kernel is attached, 2 once it has returned (device writes)
    pub const DEVICE_STATE: usize = 80;
    /// words in the control block
    pub const WORDS: usize = 96;
}

/// Device code of the polled protocol (CUDA C, prepend to a kernel's source): volatile
/// loads and stores with system-scope fences on the control words of [`ctrl`].
pub const POLLED_RING_CUDA: &str = r#"
#define GM_TO_DEVICE_HEAD 0
#define GM_TO_DEVICE_TAIL 16
#define GM_TO_HOST_HEAD 32
#define GM_TO_HOST_TAIL 48
#define GM_CLOSED 64
#define GM_DEVICE_STATE 80
/* load a control word; later loads of this thread are ordered after it (acquire, system scope) */
__device__ __forceinline__ unsigned long long gm_ring_load(unsigned long long* ctrl, int w) {
    unsigned long long v;
#if __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(ctrl + w) : "memory");
#else
    v = *(volatile unsigned long long*)(ctrl + w);
    __threadfence_system();
#endif
    return v;
}
/* store a control word after every earlier write of this thread (release, system scope); for
   writes of other threads of the block: __syncthreads(), then __threadfence_system() first */
__device__ __forceinline__ void gm_ring_store(unsigned long long* ctrl, int w,
                                              unsigned long long v) {
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(ctrl + w), "l"(v) : "memory");
#else
    __threadfence_system();
    *(volatile unsigned long long*)(ctrl + w) = v;
#endif
}
__device__ __forceinline__ void gm_ring_pause(unsigned int poll_ns) {
#if __CUDA_ARCH__ >= 700
    if (poll_ns) __nanosleep(poll_ns);
#endif
}
"#;

/// A complete polling kernel, `echo_polled(ctrl, to_device, to_host, capacity, message_bytes,
/// poll_ns)` (the fields of [`PolledArgs`]; prepend [`POLLED_RING_CUDA`]; launch one block, of
/// up to 1024 threads): thread 0 polls the host → device ring's head (the return ring's tail
/// only when it looks full, the closed flag every 64 empty polls) and the block echoes every
/// message that arrived into the device → host ring at once, then publishes them with one
/// fence. Returns at the first poll after the host closes the bridge. The template for a
/// kernel of your own, and what the GPU tests and `gpumem bench ring` run. Messages are
/// copied as 16-byte words where their size allows, else 4-byte ones (uncached loads,
/// write-through stores).
pub const POLLED_ECHO_CUDA: &str = r#"
extern "C" __global__ void echo_polled(unsigned long long* ctrl, const unsigned int* in,
                                       unsigned int* out, unsigned long long cap,
                                       unsigned long long msg_bytes, unsigned long long poll_ns) {
    __shared__ unsigned long long s_head;
    __shared__ int s_stop;
    unsigned long long words = msg_bytes / 4, done = 0, tail = 0;
    if (threadIdx.x == 0) gm_ring_store(ctrl, GM_DEVICE_STATE, 1);
    for (;;) {
        if (threadIdx.x == 0) {
            unsigned long long head = done;
            unsigned int idle = 0;
            int stop = 0;
            for (;;) {
                head = gm_ring_load(ctrl, GM_TO_DEVICE_HEAD);
                if (head > done) {
                    unsigned long long room = cap - (done - tail);
                    if (room < head - done) {
                        tail = gm_ring_load(ctrl, GM_TO_HOST_TAIL);
                        room = cap - (done - tail);
                    }
                    if (room > 0) {
                        if (head - done > room) head = done + room;
                        break;
                    }
                }
                if ((++idle & 63) == 0 && gm_ring_load(ctrl, GM_CLOSED)) { stop = 1; break; }
                gm_ring_pause((unsigned int)poll_ns);
            }
            s_head = head;
            s_stop = stop;
        }
        __syncthreads();
        if (s_stop) break;
        unsigned long long head = s_head;
        if (msg_bytes % 16 == 0) {
            /* 16-byte words: four times the bytes in flight per load */
            unsigned long long v = msg_bytes / 16, total = (head - done) * v;
            for (unsigned long long i = threadIdx.x; i < total; i += blockDim.x) {
                unsigned long long off = ((done + i / v) % cap) * v + i % v;
                __stwt((uint4*)out + off, __ldcv((const uint4*)in + off));
            }
        } else {
            unsigned long long total = (head - done) * words;
            for (unsigned long long i = threadIdx.x; i < total; i += blockDim.x) {
                unsigned long long off = ((done + i / words) % cap) * words + i % words;
                __stwt(out + off, __ldcv(in + off));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            gm_ring_store(ctrl, GM_TO_DEVICE_TAIL, head);
            gm_ring_store(ctrl, GM_TO_HOST_HEAD, head);
        }
        done = head;
    }
    if (threadIdx.x == 0) gm_ring_store(ctrl, GM_DEVICE_STATE, 2);
}
"#;

/// What a kernel needs to use a polled ring (push the fields as kernel arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PolledArgs {
    /// the control block: [`ctrl::WORDS`] `u64`s
    pub ctrl: u64,
    /// host → device ring: `capacity` messages
    pub to_device: u64,
    /// device → host ring: `capacity` messages
    pub to_host: u64,
    /// slots per ring
    pub capacity: u64,
    /// bytes per message
    pub message_bytes: u64,
    /// the poll interval in nanoseconds (for `__nanosleep`)
    pub poll_ns: u64,
}

enum Rings<T: Pod> {
    Copies {
        outbox_host: PinnedBuffer<T>,
        outbox_device: DeviceBuffer<T>,
        inbox_device: DeviceBuffer<T>,
        inbox_host: PinnedBuffer<T>,
    },
    /// dropped by hand: kept (leaked) where a kernel may still poll them
    Polled {
        ctrl: ManuallyDrop<PinnedBuffer<u64>>,
        outbox: ManuallyDrop<PinnedBuffer<T>>,
        inbox: ManuallyDrop<PinnedBuffer<T>>,
        poll: Duration,
    },
}

/// A pair of host↔device message rings.
pub struct RingBridge<T: Pod> {
    capacity: usize,
    rings: Rings<T>,
    /// messages written by the host
    sent: u64,
    /// of which copied to the device (polled: published to it)
    flushed: u64,
    /// messages the device announced
    published: u64,
    /// of which copied back and handed out
    received: u64,
    counters: RingCounters,
    timeout: Duration,
}

impl<T: Pod> std::fmt::Debug for RingBridge<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingBridge")
            .field("mode", &self.mode())
            .field("capacity", &self.capacity)
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish()
    }
}

/// The slot runs of `seqs` in a ring of `cap` slots: one, or two when it wraps.
fn runs(seqs: Range<u64>, cap: usize) -> impl Iterator<Item = Range<usize>> {
    let n = (seqs.end - seqs.start) as usize;
    let first = (seqs.start % cap as u64) as usize;
    let a = n.min(cap - first);
    [first..first + a, 0..n - a]
        .into_iter()
        .filter(|r| !r.is_empty())
}

/// Poll intervals below this yield the thread between looks instead of sleeping.
const SHORTEST_SLEEP: Duration = Duration::from_micros(50);

/// Waits for a condition, looking every `poll` (spinning when zero) until `timeout`.
fn wait_until(
    poll: Duration,
    timeout: Duration,
    what: impl Fn() -> String,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        if poll.is_zero() {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins % 4096 != 0 {
                continue;
            }
        } else if poll < SHORTEST_SLEEP {
            // a sleep this short would last the timer slack (~50 us): give the core away
            // instead and look again
            std::thread::yield_now();
        } else {
            std::thread::sleep(poll);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(Error::Timeout {
                what: what(),
                waited,
            });
        }
    }
    Ok(())
}

impl<T: Pod> RingBridge<T> {
    /// Rings of `capacity` messages each in copy mode, with device rings from `alloc` on
    /// `stream` and host rings from its pinned pool.
    pub fn new(alloc: &Device, stream: Stream, capacity: usize) -> Result<Self> {
        Self::with_mode(alloc, stream, capacity, RingMode::Copies)
    }

    /// Rings of `capacity` messages each in `mode` (see [`RingMode`]). Polled rings come from
    /// the device's pinned pool; on the host backend the "device" is host code (a thread),
    /// which sees them too, so an explicit `Polled` works there (`Auto` copies, as the
    /// backend models a device with memory of its own).
    pub fn with_mode(
        alloc: &Device,
        stream: Stream,
        capacity: usize,
        mode: RingMode,
    ) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let host_backend = alloc.location() == Location::Host;
        let polled_ok = alloc.visibility().polled_host_memory();
        let mode = match mode {
            RingMode::Polled { .. } if host_backend => mode,
            m => m.resolve(polled_ok).map_err(|what| Error::Unsupported {
                backend: alloc.backend().name().to_string(),
                what,
            })?,
        };
        let pool = alloc.pinned_pool()?;
        let rings = match mode {
            RingMode::Polled { poll } => {
                // all three made before any is wrapped, so that a failure frees the others
                let (c, o, i) = (
                    PinnedBuffer::zeroed(pool, ctrl::WORDS)?,
                    PinnedBuffer::zeroed(pool, capacity)?,
                    PinnedBuffer::zeroed(pool, capacity)?,
                );
                Rings::Polled {
                    ctrl: ManuallyDrop::new(c),
                    outbox: ManuallyDrop::new(o),
                    inbox: ManuallyDrop::new(i),
                    poll,
                }
            }
            _ => Rings::Copies {
                outbox_host: PinnedBuffer::zeroed(pool, capacity)?,
                outbox_device: DeviceBuffer::zeroed(alloc, stream, capacity)?,
                inbox_device: DeviceBuffer::zeroed(alloc, stream, capacity)?,
                inbox_host: PinnedBuffer::zeroed(pool, capacity)?,
            },
        };
        Ok(Self {
            capacity,
            rings,
            sent: 0,
            flushed: 0,
            published: 0,
            received: 0,
            counters: RingCounters::default(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The mode in force (never `Auto`).
    pub fn mode(&self) -> RingMode {
        match &self.rings {
            Rings::Copies { .. } => RingMode::Copies,
            Rings::Polled { poll, .. } => RingMode::Polled { poll: *poll },
        }
    }

    /// Slots per ring.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counters so far.
    pub fn counters(&self) -> RingCounters {
        self.counters
    }

    /// How long polled waits last before they fail with [`Error::Timeout`].
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The polled ring's addresses for device code (`None` in copy mode). On a GPU they are
    /// device addresses of mapped pinned memory (unified addressing: the same as the host's).
    pub fn polled_args(&self) -> Option<PolledArgs> {
        match &self.rings {
            Rings::Polled {
                ctrl,
                outbox,
                inbox,
                poll,
            } => Some(PolledArgs {
                ctrl: ctrl_ptr(ctrl) as u64,
                to_device: outbox_ptr(outbox) as u64,
                to_host: outbox_ptr(inbox) as u64,
                capacity: self.capacity as u64,
                message_bytes: std::mem::size_of::<T>() as u64,
                poll_ns: poll.as_nanos().min(u32::MAX as u128) as u64,
            }),
            Rings::Copies { .. } => None,
        }
    }

    /// Write the next message. Copy mode: to the host ring; a full ring is flushed to the
    /// device first (device code must have consumed the slots it overwrites: work queued on
    /// the bridge's stream before the flush runs first). Polled mode: straight into the
    /// shared ring and published to the polling kernel at once; a full ring waits (up to the
    /// timeout) for the kernel to consume a slot.
    pub fn send(&mut self, msg: T) -> Result<()> {
        let (cap, sent, timeout) = (self.capacity as u64, self.sent, self.timeout);
        match &mut self.rings {
            Rings::Copies { outbox_host, .. } => {
                if self.sent - self.flushed == cap {
                    self.flush_to_device()?;
                    return self.send(msg);
                }
                let slot = (sent % cap) as usize;
                // waits for a flush still reading the ring
                outbox_host.as_mut_slice()?[slot] = msg;
            }
            Rings::Polled {
                ctrl, outbox, poll, ..
            } => {
                let c = ctrl_ptr(ctrl);
                if sent - load(c, ctrl::TO_DEVICE_TAIL) >= cap {
                    wait_until(
                        *poll,
                        timeout,
                        || format!("the device to consume message {}", sent + 1 - cap),
                        || sent - load(c, ctrl::TO_DEVICE_TAIL) < cap,
                    )?;
                }
                let slot = outbox_ptr(outbox).wrapping_add((sent % cap) as usize);
                // SAFETY: `slot` is inside the outbox ring (slot < capacity), which lives as
                // long as `self`; the device reads this slot only after the head store below
                // (release) and has consumed its previous message (tail checked above).
                unsafe { std::ptr::write_volatile(slot, msg) };
                store(c, ctrl::TO_DEVICE_HEAD, sent + 1);
                self.counters.messages_to_device += 1;
                self.counters.bytes_to_device += std::mem::size_of::<T>() as u64;
            }
        }
        self.sent += 1;
        Ok(())
    }

    /// Copy every message sent since the last flush to the device ring (queued on the
    /// bridge's stream, no wait); returns their sequence numbers (slot = seq % capacity).
    /// Polled mode: sends are already visible; returns the sequence numbers sent since the
    /// last call, with no copy.
    pub fn flush_to_device(&mut self) -> Result<Range<u64>> {
        let seqs = self.flushed..self.sent;
        if let Rings::Copies {
            outbox_host,
            outbox_device,
            ..
        } = &mut self.rings
        {
            for r in runs(seqs.clone(), self.capacity) {
                outbox_device.copy_range_from_pinned(r.start, outbox_host, r)?;
                self.counters.copies += 1;
            }
            let n = seqs.end - seqs.start;
            if n > 0 {
                self.counters.flushes_to_device += 1;
                self.counters.messages_to_device += n;
                self.counters.bytes_to_device += n * std::mem::size_of::<T>() as u64;
            }
        }
        self.flushed = self.sent;
        Ok(seqs)
    }

    /// Copy mode: the device ring host messages arrive in (for kernels that consume them).
    pub fn outbox_device(&self) -> Result<&DeviceBuffer<T>> {
        match &self.rings {
            Rings::Copies { outbox_device, .. } => Ok(outbox_device),
            Rings::Polled { .. } => Err(polled_has_no("device rings (use polled_args)")),
        }
    }

    /// Copy mode: the device ring device code writes messages to (slot = seq % capacity).
    pub fn inbox_device_mut(&mut self) -> Result<&mut DeviceBuffer<T>> {
        match &mut self.rings {
            Rings::Copies { inbox_device, .. } => Ok(inbox_device),
            Rings::Polled { .. } => Err(polled_has_no("device rings (use polled_args)")),
        }
    }

    /// Sequence numbers the next `count` device messages must use.
    pub fn next_device_seqs(&self, count: u64) -> Range<u64> {
        self.published..self.published + count
    }

    /// Copy mode: announce that device work queued on the bridge's stream writes the next
    /// `count` messages into the inbox ring. More than the ring holds unreceived is an error.
    /// (Polled mode: the device announces its messages itself, by its counter.)
    pub fn publish(&mut self, count: u64) -> Result<()> {
        if let Rings::Polled { .. } = self.rings {
            return Err(polled_has_no(
                "host-side publishing (the device bumps its counter)",
            ));
        }
        let unreceived = self.published - self.received + count;
        if unreceived > self.capacity as u64 {
            return Err(Error::OutOfBounds {
                what: format!("{unreceived} unreceived device messages"),
                len: self.capacity,
            });
        }
        self.published += count;
        Ok(())
    }

    /// Every message the device has produced and the host not yet received, in order. Copy
    /// mode: copied back (one or two copies) and waited for; polled mode: read in place, and
    /// the slots given back to the device; empty when there is nothing new (no wait).
    pub fn receive(&mut self) -> Result<Vec<T>> {
        let cap = self.capacity;
        let out = match &mut self.rings {
            Rings::Copies {
                inbox_device,
                inbox_host,
                ..
            } => {
                let seqs = self.received..self.published;
                for r in runs(seqs.clone(), cap) {
                    inbox_device.copy_range_to_pinned(r.clone(), inbox_host, r.start)?;
                    self.counters.copies += 1;
                }
                let host = inbox_host.as_slice()?; // waits for the copies
                let out: Vec<T> = runs(seqs, cap)
                    .flat_map(|r| host[r].iter().copied())
                    .collect();
                if !out.is_empty() {
                    self.counters.flushes_to_host += 1;
                }
                out
            }
            Rings::Polled { ctrl, inbox, .. } => {
                let c = ctrl_ptr(ctrl);
                let head = load(c, ctrl::TO_HOST_HEAD);
                if head > self.received + cap as u64 || head < self.received {
                    return Err(Error::InvalidState(format!(
                        "the device announced message {head} with {} received and {cap} slots",
                        self.received
                    )));
                }
                self.published = head;
                let base = outbox_ptr(inbox);
                let out: Vec<T> = (self.received..head)
                    // SAFETY: each slot is inside the inbox ring; the device wrote it before
                    // its head store (loaded with acquire above) and leaves it alone until
                    // the tail store below gives it back.
                    .map(|s| unsafe {
                        std::ptr::read_volatile(base.add((s % cap as u64) as usize))
                    })
                    .collect();
                if out.is_empty() {
                    self.counters.empty_polls += 1;
                } else {
                    store(c, ctrl::TO_HOST_TAIL, head);
                }
                out
            }
        };
        let n = out.len() as u64;
        self.counters.messages_to_host += n;
        self.counters.bytes_to_host += n * std::mem::size_of::<T>() as u64;
        self.received += n;
        self.published = self.published.max(self.received);
        Ok(out)
    }

    /// Polled mode: wait (polling, up to the timeout) until the device has produced at least
    /// `count` messages not yet received, then receive everything there is. Copy mode: the
    /// same as [`RingBridge::receive`] once `count` messages are published (an error if
    /// fewer are, as nothing could make more arrive).
    pub fn receive_at_least(&mut self, count: u64) -> Result<Vec<T>> {
        match &self.rings {
            Rings::Polled { ctrl, poll, .. } => {
                let (c, want, poll) = (ctrl_ptr(ctrl), self.received + count, *poll);
                let empty = std::cell::Cell::new(0u64);
                let r = wait_until(
                    poll,
                    self.timeout,
                    || format!("device message {want}"),
                    || {
                        let ok = load(c, ctrl::TO_HOST_HEAD) >= want;
                        if !ok {
                            empty.set(empty.get() + 1);
                        }
                        ok
                    },
                );
                self.counters.empty_polls += empty.get();
                r?;
            }
            Rings::Copies { .. } => {
                if self.published - self.received < count {
                    return Err(Error::InvalidArgument(format!(
                        "{count} messages wanted, {} published",
                        self.published - self.received
                    )));
                }
            }
        }
        self.receive()
    }

    /// Polled mode: tell a polling kernel to return (what it has not consumed is dropped) and
    /// wait (up to the timeout) until it has, if one is attached. Dropping the bridge does
    /// the same.
    pub fn close(&mut self) -> Result<()> {
        if let Rings::Polled { ctrl, poll, .. } = &self.rings {
            let (c, poll) = (ctrl_ptr(ctrl), *poll);
            store(c, ctrl::CLOSED, 1);
            if load(c, ctrl::DEVICE_STATE) == 1 {
                wait_until(
                    poll.min(Duration::from_millis(1)),
                    self.timeout,
                    || "the polling kernel to return".into(),
                    || load(c, ctrl::DEVICE_STATE) != 1,
                )?;
            }
        }
        Ok(())
    }

    /// Polled mode: wait (up to the timeout) until a polling kernel (or host thread) has
    /// attached, which it must before the bridge may be dropped.
    pub fn wait_attached(&self) -> Result<()> {
        match &self.rings {
            Rings::Polled { ctrl, poll, .. } => {
                let c = ctrl_ptr(ctrl);
                wait_until(
                    *poll,
                    self.timeout,
                    || "the polling kernel to attach".into(),
                    || load(c, ctrl::DEVICE_STATE) != 0,
                )
            }
            Rings::Copies { .. } => Err(Error::InvalidState(
                "a copy-mode ring has no polling kernel to attach".into(),
            )),
        }
    }

    /// Polled mode: launch `kernel` as one block of `threads` on `stream` to serve this
    /// bridge, with the fields of [`Self::polled_args`] as its six arguments in their order
    /// (the signature of [`POLLED_ECHO_CUDA`]'s `echo_polled`), and wait for it to attach.
    ///
    /// # Safety
    /// `kernel` must take exactly those six arguments and touch the rings only within their
    /// capacity, as the polled protocol says.
    #[cfg(feature = "cuda")]
    pub unsafe fn launch_polled(
        &self,
        stream: &cudarc::driver::CudaStream,
        kernel: &cudarc::driver::CudaFunction,
        threads: u32,
    ) -> Result<()> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let p = self.polled_args().ok_or_else(|| {
            Error::InvalidState("a copy-mode ring has no polling kernel to launch".into())
        })?;
        let mut b = stream.launch_builder(kernel);
        b.arg(&p.ctrl)
            .arg(&p.to_device)
            .arg(&p.to_host)
            .arg(&p.capacity)
            .arg(&p.message_bytes)
            .arg(&p.poll_ns);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel's signature and bounds are the caller's contract; the rings live
        // in mapped pinned memory that outlives it (close and drop wait for it to return).
        unsafe { b.launch(one_block) }
            .map_err(|e| crate::resource::cuda::cuda_err("cuLaunchKernel", e))?;
        self.wait_attached()
    }

    /// Polled mode: true once a kernel has attached and not yet returned.
    pub fn device_attached(&self) -> bool {
        match &self.rings {
            Rings::Polled { ctrl, .. } => load(ctrl_ptr(ctrl), ctrl::DEVICE_STATE) == 1,
            Rings::Copies { .. } => false,
        }
    }
}

impl<T: Pod> Drop for RingBridge<T> {
    fn drop(&mut self) {
        let closed = self.close();
        if let Err(e) = &closed {
            tracing::error!(
                "gpumem: ring bridge dropped while a kernel polls it ({e}); its pinned memory \
                 is leaked rather than freed under the kernel"
            );
        }
        if let (
            Rings::Polled {
                ctrl,
                outbox,
                inbox,
                ..
            },
            Ok(()),
        ) = (&mut self.rings, closed)
        {
            // SAFETY: each buffer is dropped once, here, and the bridge is never used again;
            // no kernel is attached any more (close waited for it to return).
            unsafe {
                ManuallyDrop::drop(ctrl);
                ManuallyDrop::drop(outbox);
                ManuallyDrop::drop(inbox);
            }
        }
    }
}

/// The polled protocol's device side run by a host thread, echoing each message back: the
/// host backend's stand-in for a polling kernel (tests, `gpumem bench ring`). Returns once the
/// host closes the bridge, with the number of messages echoed. Start it before the bridge
/// can be dropped (wait for [`RingBridge::device_attached`]): a bridge dropped before its
/// device attaches frees the rings.
///
/// # Safety
/// `a` must come from [`RingBridge::polled_args`] of a polled bridge on the host backend (its
/// addresses are host memory), and that bridge must not be dropped before this function has
/// attached (wait for [`RingBridge::device_attached`]); its close then waits for the return.
pub unsafe fn echo_on_host(a: PolledArgs) -> u64 {
    let c = a.ctrl as *const AtomicU64;
    let (cap, bytes) = (a.capacity, a.message_bytes as usize);
    store(c, ctrl::DEVICE_STATE, 1);
    let mut done = 0u64;
    loop {
        let room = cap - (done - load(c, ctrl::TO_HOST_TAIL));
        if load(c, ctrl::CLOSED) != 0 {
            break;
        }
        let head = load(c, ctrl::TO_DEVICE_HEAD).min(done + room);
        if head == done {
            std::hint::spin_loop();
            continue;
        }
        for m in done..head {
            let off = (m % cap) as usize * bytes;
            // SAFETY: both rings hold `cap` messages of `bytes`, alive while we are attached
            // (the host's close waits for DEVICE_STATE 2); the host wrote slot `m` before its
            // head store and leaves the output slot alone until our head store.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (a.to_device as *const u8).add(off),
                    (a.to_host as *mut u8).add(off),
                    bytes,
                )
            };
        }
        store(c, ctrl::TO_DEVICE_TAIL, head);
        store(c, ctrl::TO_HOST_HEAD, head);
        done = head;
    }
    store(c, ctrl::DEVICE_STATE, 2);
    done
}

fn polled_has_no(what: &str) -> Error {
    Error::Unsupported {
        backend: "polled ring".into(),
        what: what.into(),
    }
}

/// The first element of a pinned buffer, as a raw pointer (no wait: polled rings have no
/// copies to wait for).
fn outbox_ptr<T: Pod>(b: &PinnedBuffer<T>) -> *mut T {
    use crate::buffer::pinned::PinnedHost;
    b.host_ptr() as *mut T
}

fn ctrl_ptr(b: &PinnedBuffer<u64>) -> *const AtomicU64 {
    outbox_ptr(b) as *const AtomicU64
}

/// Load control word `w` (acquire: the other side's writes before its store are visible).
fn load(c: *const AtomicU64, w: usize) -> u64 {
    // SAFETY: `c` points to the control block of `ctrl::WORDS` aligned u64s in pinned memory
    // owned by the bridge; `w < WORDS`. The device touches these words only with volatile
    // 64-bit accesses, which are single-copy atomic.
    unsafe { (*c.add(w)).load(Ordering::Acquire) }
}

/// Store control word `w` (release: this thread's earlier writes are visible first).
fn store(c: *const AtomicU64, w: usize, v: u64) {
    // SAFETY: as in `load`.
    unsafe { (*c.add(w)).store(v, Ordering::Release) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_the_wrap() {
        let r: Vec<_> = runs(6..11, 8).collect();
        assert_eq!(r, vec![6..8, 0..3]);
        let r: Vec<_> = runs(8..16, 8).collect();
        assert_eq!(r, vec![0..8]);
        assert_eq!(runs(3..3, 8).count(), 0);
    }
}
