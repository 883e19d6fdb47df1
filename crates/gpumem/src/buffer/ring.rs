//! A ring-buffer bridge between host and device for fixed-size messages.
//!
//! Two rings of `capacity` slots, each a pinned host ring mirrored by a device ring (slot
//! `seq % capacity` on both sides):
//! - host → device: [`RingBridge::send`] writes the next slot of the pinned ring;
//!   [`RingBridge::flush_to_device`] copies every unflushed message to the device ring in one
//!   or two copies (two when the range wraps), on the bridge's stream, without waiting;
//! - device → host: device code writes messages into [`RingBridge::inbox_device_mut`] (slot
//!   `seq % capacity`) and announces them with [`RingBridge::publish`];
//!   [`RingBridge::receive`] copies them back in one or two copies and returns them in order.
//!
//! Messages are any plain-old-data type; cache-line-aligned ones (`#[repr(C, align(128))]`)
//! keep each slot on its own lines.

use crate::buffer::pinned::PinnedBuffer;
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::resource::Stream;
use bytemuck::Pod;
use serde::Serialize;
use std::ops::Range;

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
    /// copy calls queued (one or two per flush)
    pub copies: u64,
}

/// A pair of host↔device message rings.
#[derive(Debug)]
pub struct RingBridge<T: Pod> {
    capacity: usize,
    outbox_host: PinnedBuffer<T>,
    outbox_device: DeviceBuffer<T>,
    inbox_device: DeviceBuffer<T>,
    inbox_host: PinnedBuffer<T>,
    /// messages written by the host
    sent: u64,
    /// of which copied to the device
    flushed: u64,
    /// messages the device announced
    published: u64,
    /// of which copied back and handed out
    received: u64,
    counters: RingCounters,
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

impl<T: Pod> RingBridge<T> {
    /// Rings of `capacity` messages each, with device rings from `alloc` on `stream` and host
    /// rings from its pinned pool.
    pub fn new(alloc: &Device, stream: Stream, capacity: usize) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let pool = alloc.pinned_pool()?;
        Ok(Self {
            capacity,
            outbox_host: PinnedBuffer::zeroed(pool, capacity)?,
            outbox_device: DeviceBuffer::zeroed(alloc, stream, capacity)?,
            inbox_device: DeviceBuffer::zeroed(alloc, stream, capacity)?,
            inbox_host: PinnedBuffer::zeroed(pool, capacity)?,
            sent: 0,
            flushed: 0,
            published: 0,
            received: 0,
            counters: RingCounters::default(),
        })
    }

    /// Slots per ring.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counters so far.
    pub fn counters(&self) -> RingCounters {
        self.counters
    }

    /// Write the next message to the host ring. A full ring is flushed to the device first
    /// (device code must have consumed the slots it overwrites: work queued on the bridge's
    /// stream before the flush runs first).
    pub fn send(&mut self, msg: T) -> Result<()> {
        if self.sent - self.flushed == self.capacity as u64 {
            self.flush_to_device()?;
        }
        let slot = (self.sent % self.capacity as u64) as usize;
        // waits for a flush still reading the ring
        self.outbox_host.as_mut_slice()?[slot] = msg;
        self.sent += 1;
        Ok(())
    }

    /// Copy every message sent since the last flush to the device ring (queued on the
    /// bridge's stream, no wait); returns their sequence numbers (slot = seq % capacity).
    pub fn flush_to_device(&mut self) -> Result<Range<u64>> {
        let seqs = self.flushed..self.sent;
        for r in runs(seqs.clone(), self.capacity) {
            self.outbox_device
                .copy_range_from_pinned(r.start, &self.outbox_host, r)?;
            self.counters.copies += 1;
        }
        let n = seqs.end - seqs.start;
        if n > 0 {
            self.counters.flushes_to_device += 1;
            self.counters.messages_to_device += n;
            self.counters.bytes_to_device += n * std::mem::size_of::<T>() as u64;
        }
        self.flushed = self.sent;
        Ok(seqs)
    }

    /// The device ring host messages arrive in (for kernels that consume them).
    pub fn outbox_device(&self) -> &DeviceBuffer<T> {
        &self.outbox_device
    }

    /// The device ring device code writes messages to (slot = seq % capacity).
    pub fn inbox_device_mut(&mut self) -> &mut DeviceBuffer<T> {
        &mut self.inbox_device
    }

    /// Sequence numbers the next `count` device messages must use.
    pub fn next_device_seqs(&self, count: u64) -> Range<u64> {
        self.published..self.published + count
    }

    /// Announce that device work queued on the bridge's stream writes the next `count`
    /// messages into the inbox ring. More than the ring holds unreceived is an error.
    pub fn publish(&mut self, count: u64) -> Result<()> {
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

    /// Copy every published message back and return them in order.
    pub fn receive(&mut self) -> Result<Vec<T>> {
        let seqs = self.received..self.published;
        for r in runs(seqs.clone(), self.capacity) {
            self.inbox_device
                .copy_range_to_pinned(r.clone(), &mut self.inbox_host, r.start)?;
            self.counters.copies += 1;
        }
        let n = seqs.end - seqs.start;
        let host = self.inbox_host.as_slice()?; // waits for the copies
        let out: Vec<T> = runs(seqs, self.capacity)
            .flat_map(|r| host[r].iter().copied())
            .collect();
        if n > 0 {
            self.counters.flushes_to_host += 1;
            self.counters.messages_to_host += n;
            self.counters.bytes_to_host += n * std::mem::size_of::<T>() as u64;
        }
        self.received = self.published;
        Ok(out)
    }
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
