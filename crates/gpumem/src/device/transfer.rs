//! The transfer engine: host↔device copies at the link's speed from any host memory.
//!
//! Copies from ordinary (pageable) memory run at 8–14 GB/s on the H100 machine against 55 GB/s
//! from pinned memory: the driver stages them through a small pinned buffer with one CPU
//! thread, and one core copies memory at only 7–9 GB/s there. The engine stages them itself on
//! several *lanes*: each lane is a thread with its own copy stream and two pinned chunks from
//! the [`PinnedPool`]; it takes the next chunk of the copy, fills one buffer while the other is
//! on the link, and hands its buffers back with the events of their copies, so a host→device
//! copy need not wait for its last chunk to land before returning.
//!
//! [`Transfer`] names the strategies a user picks between; typed buffers take it
//! ([`crate::DeviceBuffer::copy_from_host_with`]).

use crate::error::Result;
use crate::pool::pinned::{PinnedBlock, PinnedPool};
use crate::resource::{Backend, CopyKind, DevPtr, Event, Stream};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Smallest chunk an adaptive split goes down to.
const MIN_CHUNK: usize = 256 << 10;

/// A raw pointer that may cross into a lane thread (the lanes write disjoint ranges).
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: lanes write distinct chunks of a slice the caller borrows for the whole call (the
// lane scope joins every lane before the borrow ends).
unsafe impl Send for SendPtr {}
// SAFETY: as above: lanes share the base address only to derive their distinct chunks.
unsafe impl Sync for SendPtr {}

/// How a copy between ordinary host memory and the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transfer {
    /// One blocking driver copy straight from or to the caller's memory (what `cudaMemcpy`
    /// does; from pageable memory the driver stages it, at 8–14 GB/s).
    Sync,
    /// Stream-ordered: returns as soon as the caller's memory is no longer needed. Host→device
    /// data is staged into pinned chunks and the call returns without waiting for the device;
    /// later work on the buffer's stream sees the data. Device→host must wait (the data lands
    /// in the caller's memory), so it runs as [`Transfer::Staged`].
    Async,
    /// Staged through pinned chunks on several lanes, and waited for.
    Staged,
    /// One driver copy whose direction comes from unified addressing (`cudaMemcpyDefault`):
    /// for memory whose kind the caller does not know (managed, registered, pinned or
    /// pageable); waited for.
    Unified,
    /// [`Transfer::Staged`] from the engine's `min_staged_bytes` up, [`Transfer::Sync`] below.
    #[default]
    Auto,
}

/// Staging parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// largest pinned chunk (smaller copies use smaller chunks, so that several overlap)
    pub chunk_bytes: usize,
    /// lanes: threads, each with its own copy stream and two pinned chunks
    pub threads: usize,
    /// smallest copy [`Transfer::Auto`] stages
    pub min_staged_bytes: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        Self::from_config(&crate::Config::default())
    }
}

impl StagingConfig {
    /// The staging keys of an allocator configuration.
    pub fn from_config(c: &crate::Config) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            chunk_bytes: c.staging.chunk_bytes as usize,
            threads: c.staging.threads.unwrap_or(cores.clamp(1, 16)),
            min_staged_bytes: c.staging.min_bytes as usize,
        }
    }
}

/// Moves bytes between host memory and one device's memory.
pub struct TransferEngine {
    /// the device side (copies and events)
    ops: Arc<dyn Backend>,
    pinned: PinnedPool,
    config: StagingConfig,
    /// idle lane streams
    streams: Mutex<Vec<Stream>>,
    /// the lanes' threads, made on first staged copy (`None` where none could be made: the
    /// caller's thread runs the lanes one after another)
    threads: OnceLock<Option<rayon::ThreadPool>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("device", &self.ops.name())
            .field("config", &self.config)
            .finish()
    }
}

impl TransferEngine {
    /// An engine copying with `ops` (the device's backend) through slots of `pinned`.
    pub fn new(ops: Arc<dyn Backend>, pinned: PinnedPool, config: StagingConfig) -> Self {
        Self {
            ops,
            pinned,
            config: StagingConfig {
                chunk_bytes: config.chunk_bytes.max(4096),
                threads: config.threads.max(1),
                ..config
            },
            streams: Mutex::new(Vec::new()),
            threads: OnceLock::new(),
        }
    }

    /// The pinned pool the engine stages through.
    pub fn pinned_pool(&self) -> &PinnedPool {
        &self.pinned
    }

    /// The staging parameters.
    pub fn config(&self) -> StagingConfig {
        self.config
    }

    fn resolve(&self, how: Transfer, bytes: usize) -> Transfer {
        match how {
            Transfer::Auto if bytes >= self.config.min_staged_bytes => Transfer::Staged,
            Transfer::Auto => Transfer::Sync,
            h => h,
        }
    }

    /// The chunk size for a copy of `len` bytes over `lanes` lanes: the configured size, or
    /// smaller (down to 256 KiB) so that each lane gets at least four chunks to overlap.
    fn chunk_for(&self, len: usize, lanes: usize) -> usize {
        let even = len.div_ceil(lanes * 4).next_multiple_of(4096);
        even.clamp(
            MIN_CHUNK.min(self.config.chunk_bytes),
            self.config.chunk_bytes,
        )
    }

    /// The lane threads (made on first use; `None` where threads cannot be made, and then
    /// lanes run one after another on the caller's thread).
    fn threads(&self) -> Option<&rayon::ThreadPool> {
        self.threads
            .get_or_init(|| {
                if self.config.threads < 2 {
                    return None;
                }
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.config.threads)
                    .thread_name(|i| format!("gpumem-lane-{i}"))
                    .build()
                    .map_err(|e| tracing::warn!("gpumem: no transfer lane threads: {e}"))
                    .ok()
            })
            .as_ref()
    }

    /// Copy `src` to device address `dst`, ordered on `stream` (after the work queued there).
    ///
    /// # Safety
    /// `dst` must be device memory valid for `src.len()` bytes until the copy has completed in
    /// `stream` order, and nothing else may use it meanwhile.
    pub unsafe fn host_to_device(
        &self,
        dst: DevPtr,
        src: &[u8],
        stream: Stream,
        how: Transfer,
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        match self.resolve(how, src.len()) {
            h @ (Transfer::Sync | Transfer::Unified) => {
                let kind = if h == Transfer::Sync {
                    CopyKind::HostToDevice
                } else {
                    CopyKind::Unified
                };
                // SAFETY: `src` is borrowed until we have synchronised; `dst` per contract.
                unsafe {
                    self.ops
                        .copy(dst, src.as_ptr() as DevPtr, src.len(), kind, stream)?
                };
                self.ops.synchronize(stream)
            }
            h => {
                let done = self.staged(stream, src.len(), |lane, next, chunk| {
                    // SAFETY: per contract; lanes take distinct chunks of `dst`.
                    unsafe { self.lane_h2d(lane, dst, src, next, chunk) }
                })?;
                self.finish(stream, done, h == Transfer::Staged)
            }
        }
    }

    /// Copy `dst.len()` bytes from device address `src` into `dst`, after the work queued on
    /// `stream`; returns once `dst` holds them.
    ///
    /// # Safety
    /// `src` must be device memory valid for `dst.len()` bytes, not written meanwhile.
    pub unsafe fn device_to_host(
        &self,
        dst: &mut [u8],
        src: DevPtr,
        stream: Stream,
        how: Transfer,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let len = dst.len();
        match self.resolve(how, len) {
            h @ (Transfer::Sync | Transfer::Unified) => {
                let kind = if h == Transfer::Sync {
                    CopyKind::DeviceToHost
                } else {
                    CopyKind::Unified
                };
                // SAFETY: `dst` is borrowed until we have synchronised; `src` per contract.
                unsafe {
                    self.ops
                        .copy(dst.as_mut_ptr() as DevPtr, src, len, kind, stream)?
                };
                self.ops.synchronize(stream)
            }
            _ => {
                let base = SendPtr(dst.as_mut_ptr());
                let done = self.staged(stream, len, move |lane, next, chunk| {
                    let base = base;
                    // SAFETY: per contract; lanes take distinct chunks of `dst`, which the
                    // caller borrows mutably until every lane has returned.
                    unsafe { self.lane_d2h(lane, base, len, src, next, chunk) }
                })?;
                // the data is in `dst` once every lane returned; the events are spent
                for ev in done {
                    self.ops.destroy_event(ev);
                }
                Ok(())
            }
        }
    }

    /// Run a staged copy of `len` bytes: order the lane streams after `stream`, let each lane
    /// take chunks (`next` hands out chunk indices) on the engine's threads, and return each
    /// lane's final event.
    fn staged<F>(&self, stream: Stream, len: usize, lane: F) -> Result<Vec<Event>>
    where
        F: Fn(Stream, &AtomicUsize, usize) -> Result<Event> + Sync,
    {
        let lanes = self.config.threads.min(len.div_ceil(MIN_CHUNK)).max(1);
        let chunk = self.chunk_for(len, lanes);
        let lanes = lanes.min(len.div_ceil(chunk));
        let streams = self.take_streams(lanes)?;
        let start = self.ops.record_event(stream)?;
        let mut first_err = None;
        for &s in &streams {
            if let Err(e) = self.ops.wait_event(s, start) {
                first_err.get_or_insert(e);
            }
        }
        self.ops.destroy_event(start);
        let next = AtomicUsize::new(0);
        let results: Vec<Result<Event>> = match first_err {
            Some(e) => vec![Err(e)],
            None => {
                let (lane, next) = (&lane, &next);
                let out = Mutex::new(Vec::with_capacity(lanes));
                let out_ref = &out;
                let run = move |s: Stream| {
                    let r = lane(s, next, chunk);
                    out_ref.lock().push(r);
                };
                match self.threads() {
                    Some(pool) if lanes > 1 => pool.scope(|scope| {
                        for &s in &streams {
                            scope.spawn(move |_| run(s));
                        }
                    }),
                    _ => streams.iter().for_each(|&s| run(s)),
                }
                out.into_inner()
            }
        };
        self.streams.lock().extend(streams);
        let mut events = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(ev) => events.push(ev),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            None => Ok(events),
            Some(e) => {
                // the lanes that did run may still be copying: wait before reporting
                for ev in events {
                    let _ = self.ops.sync_event(ev);
                    self.ops.destroy_event(ev);
                }
                Err(e)
            }
        }
    }

    /// Order `stream` after the lanes' final events, and wait for them if asked.
    fn finish(&self, stream: Stream, done: Vec<Event>, wait: bool) -> Result<()> {
        let mut first_err = None;
        for ev in done {
            let r = if wait {
                self.ops.sync_event(ev)
            } else {
                self.ops.wait_event(stream, ev)
            };
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
            self.ops.destroy_event(ev);
        }
        first_err.map_or(Ok(()), Err)
    }

    fn take_streams(&self, n: usize) -> Result<Vec<Stream>> {
        let mut out: Vec<Stream> = {
            let mut idle = self.streams.lock();
            let keep = idle.len().saturating_sub(n);
            idle.split_off(keep)
        };
        while out.len() < n {
            match self.ops.create_stream() {
                Ok(s) => out.push(s),
                Err(e) => {
                    self.streams.lock().extend(out);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Return a lane's buffers to the pool with the events of their last copies.
    fn give_back(&self, bufs: [Option<PinnedBlock>; 2], evs: [Option<Event>; 2]) {
        for (buf, ev) in bufs.into_iter().zip(evs) {
            match buf {
                Some(buf) => {
                    if let Err(e) = self.pinned.free(buf, ev.into_iter().collect()) {
                        tracing::error!("gpumem: staging buffer not returned: {e}");
                    }
                }
                None => {
                    if let Some(ev) = ev {
                        self.ops.destroy_event(ev);
                    }
                }
            }
        }
    }

    /// Wait for a buffer's last copy (if any) so that it can be refilled.
    fn settle(&self, ev: &mut Option<Event>) -> Result<()> {
        if let Some(e) = ev.take() {
            let r = self.ops.sync_event(e);
            self.ops.destroy_event(e);
            r?;
        }
        Ok(())
    }

    /// One lane of a host→device copy: take a chunk, fill a pinned buffer with it, queue its
    /// copy, and fill the other buffer with the next chunk meanwhile.
    ///
    /// # Safety
    /// `dst` must be device memory valid for `src.len()` bytes.
    unsafe fn lane_h2d(
        &self,
        stream: Stream,
        dst: DevPtr,
        src: &[u8],
        next: &AtomicUsize,
        chunk: usize,
    ) -> Result<Event> {
        let ops = &*self.ops;
        let mut bufs: [Option<PinnedBlock>; 2] = [None, None];
        let mut evs: [Option<Event>; 2] = [None, None];
        let r = (|| -> Result<()> {
            let mut j = 0;
            loop {
                let off = next.fetch_add(1, Ordering::Relaxed) * chunk;
                if off >= src.len() {
                    return Ok(());
                }
                let piece = &src[off..(off + chunk).min(src.len())];
                let b = j & 1;
                j += 1;
                if bufs[b].is_none() {
                    bufs[b] = Some(self.pinned.allocate(chunk)?);
                }
                self.settle(&mut evs[b])?;
                let buf = bufs[b].as_ref().map_or(0, |x| x.ptr());
                // SAFETY: the buffer is ours and idle (its last copy completed: settled above)
                // and holds `chunk >= piece.len()` bytes.
                let staging =
                    unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, piece.len()) };
                staging.copy_from_slice(piece);
                // SAFETY: `buf` holds the piece until the event recorded next completes (the
                // pool keeps the buffer until then); `dst` per contract.
                unsafe {
                    ops.copy(
                        dst + off as u64,
                        buf,
                        piece.len(),
                        CopyKind::HostToDevice,
                        stream,
                    )?
                };
                evs[b] = Some(ops.record_event(stream)?);
            }
        })();
        let done = r.and_then(|()| ops.record_event(stream));
        self.give_back(bufs, evs);
        done
    }

    /// One lane of a device→host copy: two chunks in flight; the older is emptied into `dst`
    /// while the newer is on the link.
    ///
    /// # Safety
    /// `src` must be device memory valid for `len` bytes; `dst` must be valid for `len` bytes
    /// and written by no one else but the lanes, which take distinct chunks.
    unsafe fn lane_d2h(
        &self,
        stream: Stream,
        dst: SendPtr,
        len: usize,
        src: DevPtr,
        next: &AtomicUsize,
        chunk: usize,
    ) -> Result<Event> {
        let ops = &*self.ops;
        let mut bufs: [Option<PinnedBlock>; 2] = [None, None];
        let mut evs: [Option<Event>; 2] = [None, None];
        // the chunk (offset, length) each buffer holds
        let mut held: [Option<(usize, usize)>; 2] = [None, None];
        let take = || {
            let off = next.fetch_add(1, Ordering::Relaxed) * chunk;
            (off < len).then(|| (off, chunk.min(len - off)))
        };
        // SAFETY (closure): the chunk lies in `src` (contract) and lands in a buffer of ours
        // that nothing else uses until its event completes.
        let enqueue = |(off, m): (usize, usize), buf: &PinnedBlock| -> Result<Event> {
            unsafe {
                ops.copy(
                    buf.ptr(),
                    src + off as u64,
                    m,
                    CopyKind::DeviceToHost,
                    stream,
                )?
            };
            ops.record_event(stream)
        };
        let r = (|| -> Result<()> {
            for b in 0..2 {
                if let Some(piece) = take() {
                    let buf = self.pinned.allocate(chunk)?;
                    evs[b] = Some(enqueue(piece, &buf)?);
                    bufs[b] = Some(buf);
                    held[b] = Some(piece);
                }
            }
            let mut b = 0;
            while let Some((off, m)) = held[b].take() {
                self.settle(&mut evs[b])?;
                let buf = bufs[b].as_ref().map_or(0, |x| x.ptr());
                // SAFETY: the buffer's copy completed (settled above) and it holds `m` bytes;
                // `[off, off + m)` is this lane's chunk of `dst` (contract).
                unsafe {
                    let (s, d) = (
                        std::slice::from_raw_parts(buf as *const u8, m),
                        std::slice::from_raw_parts_mut(dst.0.add(off), m),
                    );
                    d.copy_from_slice(s);
                }
                if let (Some(piece), Some(bb)) = (take(), &bufs[b]) {
                    evs[b] = Some(enqueue(piece, bb)?);
                    held[b] = Some(piece);
                }
                b ^= 1;
                if held[b].is_none() {
                    b ^= 1;
                }
            }
            Ok(())
        })();
        // on error a buffer may still be filling: its event goes back with it
        self.give_back(bufs, evs);
        r?;
        ops.record_event(stream)
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        for s in self.streams.get_mut().drain(..) {
            self.ops.destroy_stream(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::host::HostResource;
    use crate::resource::Resource;

    fn engine(chunk: usize, threads: usize) -> TransferEngine {
        TransferEngine::new(
            Arc::new(HostResource::new()),
            PinnedPool::new(Arc::new(HostResource::new())),
            StagingConfig {
                chunk_bytes: chunk,
                threads,
                min_staged_bytes: 1,
            },
        )
    }

    #[test]
    fn staged_round_trip_at_odd_sizes() {
        let dev = HostResource::new();
        for (chunk, threads) in [(4096, 1), (4096, 3), (1 << 20, 4)] {
            let e = engine(chunk, threads);
            for len in [
                1usize,
                4095,
                4096,
                4097,
                3 * 4096 + 5,
                100_003,
                (3 << 20) + 7,
            ] {
                let src: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
                let d = dev.allocate(Stream::DEFAULT, len, 256).unwrap();
                for how in [
                    Transfer::Sync,
                    Transfer::Async,
                    Transfer::Staged,
                    Transfer::Unified,
                    Transfer::Auto,
                ] {
                    let mut back = vec![0u8; len];
                    // SAFETY: `d` is a live host-backend block of `len` bytes.
                    unsafe {
                        e.host_to_device(d, &src, Stream::DEFAULT, how).unwrap();
                        e.device_to_host(&mut back, d, Stream::DEFAULT, how)
                            .unwrap();
                    }
                    assert_eq!(
                        back, src,
                        "len {len} chunk {chunk} threads {threads} {how:?}"
                    );
                }
                dev.deallocate(d, len, Stream::DEFAULT).unwrap();
                e.pinned_pool().check_invariants().unwrap();
                assert_eq!(e.pinned_pool().stats().allocated_bytes, 0);
            }
        }
    }
}
