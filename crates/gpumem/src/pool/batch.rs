//! Batch allocation (Genesis `allocate_batch`): several sizes on one stream in one call. The
//! sizes are placed as neighbouring blocks of one free block (or one new segment, or one run of
//! newly mapped pages): one lookup and at most one driver call for the whole batch. Where the
//! pool cannot give them one block (nothing that large is free and the device cannot grow by
//! that much) each is allocated on its own, still under the one lock.

use super::*;

impl CachingPool {
    /// Allocate `sizes` (bytes each, none zero) on `stream`, aligned to `align`; the blocks are
    /// handed out as `handout` says and come back one by one. All or nothing: on an error no
    /// block of the batch stays allocated.
    pub fn allocate_batch(
        &mut self,
        stream: Stream,
        sizes: &[usize],
        align: usize,
        handout: Handout,
    ) -> Result<Vec<PoolAlloc>> {
        if sizes.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(&bad) = sizes.iter().find(|&&s| s == 0 || s as u64 > MAX_REQUEST) {
            return Err(if bad == 0 {
                Error::ZeroSize
            } else {
                Error::SizeTooLarge {
                    requested: bad as u64,
                    max: MAX_REQUEST,
                }
            });
        }
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(Error::InvalidAlignment {
                align,
                max: MAX_ALIGN,
            });
        }
        let rounded: Vec<u64> = sizes
            .iter()
            .map(|&s| round_size(s as u64, &self.policy.divisions))
            .collect();
        let total: u64 = rounded.iter().sum();
        if sizes.len() == 1 || total > MAX_REQUEST {
            return self.allocate_each(stream, sizes, align, handout);
        }
        if !self.pending.is_empty() {
            self.process_events();
        }
        let id = match self.find_or_grow(stream, total) {
            Ok(id) => id,
            Err(e) if e.is_out_of_memory() => {
                return self.allocate_each(stream, sizes, align, handout)
            }
            Err(e) => return Err(e),
        };
        // carve the block into the batch's blocks, in order; the last keeps what remains
        let mut out = Vec::with_capacity(sizes.len());
        let mut id = id;
        for (i, (&req, &size)) in sizes.iter().zip(&rounded).enumerate() {
            if i + 1 < sizes.len() {
                self.split_exact(id, size);
            }
            let next = self.blocks[id as usize].next;
            out.push(self.hand_out(id, req as u64, size, stream, handout));
            id = next;
        }
        Ok(out)
    }

    /// The batch one by one (under the caller's one lock); all or nothing.
    fn allocate_each(
        &mut self,
        stream: Stream,
        sizes: &[usize],
        align: usize,
        handout: Handout,
    ) -> Result<Vec<PoolAlloc>> {
        let mut out = Vec::with_capacity(sizes.len());
        for &s in sizes {
            match self.allocate_inner(stream, s, align, true, handout) {
                Ok(a) => out.push(a),
                Err(e) => {
                    for a in out {
                        let _ = self.free_block_id(a.id, a.addr);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::resource::sim::SimulatedDevice;
    use crate::{CachingAllocator, Config, Error, Stream};
    use std::sync::Arc;

    const MIB: usize = 1 << 20;

    fn pair(vmm: bool, capacity: u64) -> (CachingAllocator, Arc<SimulatedDevice>) {
        let mut sim = SimulatedDevice::new(capacity);
        if !vmm {
            sim = sim.without_vmm();
        }
        let sim = Arc::new(sim);
        let config = Config {
            shards: Some(1),
            ..Config::default()
        };
        (CachingAllocator::new(sim.clone(), config).unwrap(), sim)
    }

    #[test]
    fn a_batch_is_neighbouring_blocks_from_one_driver_call() {
        for vmm in [false, true] {
            let (a, sim) = pair(vmm, 1 << 34);
            let sizes = [3 * MIB, 700 << 10, 5 * MIB, 512, 2 * MIB + 1];
            let s = Stream(3);
            let before = sim.counters();
            let blocks = a.allocate_batch(s, &sizes, 256).unwrap();
            let after = sim.counters();
            let calls = (after.allocs - before.allocs) + (after.maps - before.maps);
            assert_eq!(calls, 1, "one map for the batch (vmm {vmm})");
            for w in blocks.windows(2) {
                let rounded = crate::pool::size::round_size(
                    w[0].size() as u64,
                    &Config::default().pool.roundup_power2_divisions,
                );
                assert_eq!(w[0].ptr() + rounded, w[1].ptr(), "neighbours (vmm {vmm})");
            }
            let want: u64 = sizes.iter().map(|&s| s as u64).sum();
            assert_eq!(a.stats().requested_bytes.all.current, want);
            assert_eq!(a.stats().allocation.all.current, sizes.len() as u64);
            a.check_invariants().unwrap();
            for b in blocks.into_iter().rev() {
                a.deallocate(b).unwrap();
            }
            assert_eq!(a.stats().allocated_bytes.all.current, 0);
            a.check_invariants().unwrap();
            // the same batch again comes from the cache: no driver call
            let before = sim.counters();
            let again = a.allocate_batch(s, &sizes, 256).unwrap();
            let after = sim.counters();
            assert_eq!(after.allocs + after.maps, before.allocs + before.maps);
            for b in again {
                a.deallocate(b).unwrap();
            }
        }
    }

    #[test]
    fn a_bad_batch_is_refused_whole() {
        let (a, _) = pair(true, 64 * MIB as u64);
        let s = Stream(1);
        assert!(matches!(
            a.allocate_batch(s, &[MIB, 0, MIB], 256),
            Err(Error::ZeroSize)
        ));
        assert!(a.allocate_batch(s, &[MIB], 4096).is_err(), "alignment");
        assert!(a.allocate_batch(s, &[], 256).unwrap().is_empty());
        // more than the device holds: out of memory, and nothing of the batch stays allocated
        let e = a.allocate_batch(s, &[40 * MIB, 40 * MIB], 256).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(a.stats().allocated_bytes.all.current, 0);
        a.check_invariants().unwrap();
        // the allocator stays usable
        let ok = a.allocate_batch(s, &[10 * MIB, 10 * MIB], 256).unwrap();
        assert_eq!(ok.len(), 2);
        for b in ok {
            a.deallocate(b).unwrap();
        }
    }

    #[test]
    fn a_batch_that_fits_no_single_block_is_allocated_block_by_block() {
        // 52 MiB device, classic segments: one 20 MiB segment holds 2 MiB live and 18 MiB
        // free, another 20 MiB is live; a batch of 12 + 11 MiB fits no free block and the
        // device cannot grow by 24 MiB more, but 12 MiB fits the hole and 11 MiB a new segment
        let (a, sim) = pair(false, 52 * MIB as u64);
        let s = Stream(1);
        let x = a.allocate(s, 20 * MIB, 256).unwrap();
        a.deallocate(x).unwrap();
        let w = a.allocate(s, 2 * MIB, 256).unwrap();
        let y = a.allocate(s, 20 * MIB, 256).unwrap();
        let segments = sim.counters().allocs;
        let r = a.allocate_batch(s, &[12 * MIB, 11 * MIB], 256).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            sim.counters().allocs,
            segments + 1,
            "one new segment, for the 11 MiB"
        );
        a.check_invariants().unwrap();
        for b in r {
            a.deallocate(b).unwrap();
        }
        a.deallocate(w).unwrap();
        a.deallocate(y).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn typed_buffers_in_one_call() {
        let dev = crate::Device::host(Config::default()).unwrap();
        let s = Stream(2);
        let mut bufs = crate::DeviceBuffer::<f32>::alloc_batch(&dev, s, &[10, 0, 1000, 3]).unwrap();
        assert_eq!(
            bufs.iter().map(|b| b.len()).collect::<Vec<_>>(),
            [10, 0, 1000, 3]
        );
        assert_eq!(
            dev.stats().allocation.all.current,
            3,
            "an empty buffer holds no block"
        );
        for (i, b) in bufs.iter_mut().enumerate() {
            let data: Vec<f32> = (0..b.len()).map(|k| (i * 10_000 + k) as f32).collect();
            b.copy_from_host(&data).unwrap();
        }
        for (i, b) in bufs.iter().enumerate() {
            let v = b.to_vec().unwrap();
            assert!(v
                .iter()
                .enumerate()
                .all(|(k, &x)| x == (i * 10_000 + k) as f32));
        }
        drop(bufs);
        assert_eq!(dev.stats().allocation.all.current, 0);
        assert!(crate::DeviceBuffer::<f32>::alloc_batch(&dev, s, &[usize::MAX]).is_err());
    }
}
