//! A cache that gives memory back when other processes need it (Genesis' adaptive memory
//! management). Every 256 allocations of a thread, and at most every `pressure_interval_ms`,
//! one thread reads the device's free memory (every process counted). When it is below
//! `pressure_release` of the total and other processes' use has grown since the last look, the
//! cached segments and idle pages of every shard (and of private pools no one uses) go back to
//! the device, before anyone runs out. The process's own growth never counts as pressure: a
//! job that fills the GPU by itself keeps its cache (and meets its own out-of-memory retry).
//! Device memory only (CUDA, the simulator), not plain host memory.

use super::CachingAllocator;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// What the watch remembers between looks.
#[derive(Debug)]
pub(super) struct Pressure {
    epoch: Instant,
    /// ns since `epoch` of the last look (0: none yet)
    last_ns: AtomicU64,
    /// other processes' use at the last look, bytes
    external: AtomicU64,
    /// releases made
    pub(super) releases: AtomicU64,
}

impl Default for Pressure {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            last_ns: AtomicU64::new(0),
            external: AtomicU64::new(0),
            releases: AtomicU64::new(0),
        }
    }
}

/// Allocations between looks at the clock, per thread.
const EVERY: u32 = 256;

thread_local! {
    static CALLS: Cell<u32> = const { Cell::new(0) };
}

impl CachingAllocator {
    /// Count one allocation; now and then, look at the device's free memory.
    #[inline]
    pub(super) fn watch_pressure(&self) {
        if self.inner.config.pool.pressure_release <= 0.0 {
            return;
        }
        let n = CALLS.with(|c| {
            let n = c.get().wrapping_add(1);
            c.set(n);
            n
        });
        if n % EVERY == 0 {
            self.check_pressure();
        }
    }

    /// Look at the device's free memory now (if the interval has passed); true if the cache
    /// was released.
    #[cold]
    pub fn check_pressure(&self) -> bool {
        let cfg = &self.inner.config.pool;
        if cfg.pressure_release <= 0.0 || !self.inner.backend.location().is_device_memory() {
            return false;
        }
        let p = &self.inner.pressure;
        let now = (p.epoch.elapsed().as_nanos() as u64).max(1);
        let last = p.last_ns.load(Ordering::Relaxed);
        if last != 0 && now < last.saturating_add(cfg.pressure_interval_ms * 1_000_000) {
            return false;
        }
        // one thread looks
        if p.last_ns
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let info = self.inner.backend.device_mem_info();
        let Ok(info) = info else {
            return false;
        };
        // ours: what the pools reserve, and the physical pages the page engine keeps spare
        let spare = self
            .inner
            .backend
            .virtual_memory()
            .map_or(0, |v| v.calls().spare_bytes);
        let ours = self.inner.shared.reserved.load(Ordering::Relaxed) + spare;
        let external = info.total.saturating_sub(info.free).saturating_sub(ours);
        let before = p.external.swap(external, Ordering::Relaxed);
        let short = (info.free as f64) < cfg.pressure_release * info.total as f64;
        if !short || external <= before {
            return false;
        }
        let released = (0..self.inner.shards.len())
            .map(|j| self.shard(j).release_cached())
            .sum::<u64>()
            + self.private_empty_cache();
        p.releases.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            "gpumem: device short of memory ({} of {} bytes free, other processes use {}): \
             released {released} cached bytes",
            info.free,
            info.total,
            external
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::resource::sim::SimulatedDevice;
    use crate::{CachingAllocator, Config, Stream};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn cached_600_mib(conf: &str) -> (CachingAllocator, Arc<SimulatedDevice>) {
        let sim = Arc::new(SimulatedDevice::new(1024 * MIB));
        let a = CachingAllocator::new(sim.clone(), Config::parse(conf).unwrap()).unwrap();
        let blocks: Vec<_> = (0..6)
            .map(|_| a.allocate(Stream(1), 100 * MIB as usize, 512).unwrap())
            .collect();
        for b in blocks {
            a.deallocate(b).unwrap();
        }
        assert!(a.stats().reserved_bytes.all.current >= 600 * MIB);
        (a, sim)
    }

    #[test]
    fn another_process_taking_memory_gets_the_cache_back() {
        for conf in [
            "shards:1,pressure_release:0.25,pressure_interval_ms:0",
            "shards:1,pressure_release:0.25,pressure_interval_ms:0,expandable_segments:False",
        ] {
            let (a, sim) = cached_600_mib(conf);
            assert!(!a.check_pressure(), "{conf}: plenty free, the cache stays");
            sim.set_external_usage(300 * MIB); // 124 MiB free: under a quarter
                                               // the allocations themselves look now and then (every 256 of a thread)
            for _ in 0..600 {
                let b = a.allocate(Stream(1), 4096, 512).unwrap();
                a.deallocate(b).unwrap();
            }
            let s = a.stats();
            assert_eq!(s.num_pressure_releases, 1, "{conf}");
            assert!(
                s.reserved_bytes.all.current < 10 * MIB,
                "{conf}: cache given back"
            );
            // the other process can now take what gpumem held
            assert!(sim.mem_info_free() >= 700 * MIB);
            // the process's own use is not pressure: it fills the device, nobody else grew,
            // and its cache stays
            let mine: Vec<_> = (0..13)
                .map(|_| a.allocate(Stream(1), 50 * MIB as usize, 512).unwrap())
                .collect();
            for b in mine {
                a.deallocate(b).unwrap();
            }
            assert!(
                sim.mem_info_free() < 256 * MIB,
                "short again, by this process alone"
            );
            assert!(!a.check_pressure(), "{conf}");
            assert_eq!(a.stats().num_pressure_releases, 1, "{conf}");
            a.check_invariants().unwrap();
        }
    }

    #[test]
    fn without_pressure_release_the_cache_stays() {
        let (a, sim) = cached_600_mib("shards:1,pressure_release:0");
        sim.set_external_usage(400 * MIB);
        for _ in 0..600 {
            let b = a.allocate(Stream(1), 4096, 512).unwrap();
            a.deallocate(b).unwrap();
        }
        assert!(!a.check_pressure());
        assert_eq!(a.stats().num_pressure_releases, 0);
        // (the small pool's page may come from a page move, which unmaps whole handles of the
        // large blocks' pages, the smallest that serve: tens of MiB, not the cache)
        assert!(a.stats().reserved_bytes.all.current >= 500 * MIB);
    }

    #[test]
    fn the_interval_limits_the_looks() {
        let (a, sim) = cached_600_mib("shards:1,pressure_release:0.25,pressure_interval_ms:60000");
        assert!(!a.check_pressure()); // the first look: nothing short
        sim.set_external_usage(300 * MIB);
        assert!(!a.check_pressure(), "a minute has not passed");
        assert_eq!(a.stats().num_pressure_releases, 0);
    }
}
