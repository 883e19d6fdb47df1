//! Allocator statistics, with PyTorch's `memory_stats()` vocabulary.

use serde::{Deserialize, Serialize};

/// One counter: current value, peak since the last reset, and cumulative increments/decrements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// current value
    pub current: u64,
    /// highest `current` since creation or [`Stats::reset_peak`]
    pub peak: u64,
    /// sum of all increments
    pub allocated: u64,
    /// sum of all decrements
    pub freed: u64,
}

impl Stat {
    #[inline]
    pub(crate) fn inc(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    pub(crate) fn dec(&mut self, n: u64) {
        debug_assert!(self.current >= n, "stat underflow");
        self.current -= n;
        self.freed += n;
    }

    fn merge(&mut self, o: &Stat) {
        self.current += o.current;
        self.peak += o.peak;
        self.allocated += o.allocated;
        self.freed += o.freed;
    }
}

/// Which pool a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum PoolKind {
    /// blocks of at most 1 MiB, in 2 MiB segments
    Small,
    /// everything larger
    Large,
}

/// A stat for all blocks and for each pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatArray {
    /// both pools
    pub all: Stat,
    /// the small pool
    pub small_pool: Stat,
    /// the large pool
    pub large_pool: Stat,
}

impl StatArray {
    #[inline]
    pub(crate) fn inc(&mut self, pool: PoolKind, n: u64) {
        self.all.inc(n);
        match pool {
            PoolKind::Small => self.small_pool.inc(n),
            PoolKind::Large => self.large_pool.inc(n),
        }
    }

    #[inline]
    pub(crate) fn dec(&mut self, pool: PoolKind, n: u64) {
        self.all.dec(n);
        match pool {
            PoolKind::Small => self.small_pool.dec(n),
            PoolKind::Large => self.large_pool.dec(n),
        }
    }

    fn merge(&mut self, o: &StatArray) {
        self.all.merge(&o.all);
        self.small_pool.merge(&o.small_pool);
        self.large_pool.merge(&o.large_pool);
    }

    fn reset_peak(&mut self) {
        for s in [&mut self.all, &mut self.small_pool, &mut self.large_pool] {
            s.peak = s.current;
        }
    }
}

/// Everything the allocator counts. Serialisable; key names follow `torch.cuda.memory_stats()`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// number of blocks handed out
    pub allocation: StatArray,
    /// number of segments obtained from the device
    pub segment: StatArray,
    /// number of blocks allocated or waiting on stream events
    pub active: StatArray,
    /// number of free blocks that are part of a split segment
    pub inactive_split: StatArray,
    /// bytes handed out (rounded block sizes)
    pub allocated_bytes: StatArray,
    /// bytes obtained from the device
    pub reserved_bytes: StatArray,
    /// bytes allocated or waiting on stream events
    pub active_bytes: StatArray,
    /// bytes in free blocks of split segments (fragmentation)
    pub inactive_split_bytes: StatArray,
    /// bytes callers asked for (before rounding)
    pub requested_bytes: StatArray,
    /// allocations that had to free cached memory and retry
    pub num_alloc_retries: u64,
    /// allocations that failed with out-of-memory
    pub num_ooms: u64,
    /// segments obtained from the device
    pub num_device_alloc: u64,
    /// segments returned to the device
    pub num_device_free: u64,
    /// times the allocator waited on the host for pending stream work
    pub num_sync_all_streams: u64,
    /// allocations served from cached memory
    pub cache_hits: u64,
    /// allocations that needed a new segment
    pub cache_misses: u64,
    /// wholly free segments moved from one stream to another (event-ordered)
    pub num_cross_stream_reuses: u64,
    /// blocks freed with other streams recorded, whose reuse waited on events
    pub num_deferred_frees: u64,
}

impl Stats {
    /// Set every peak to its current value.
    pub fn reset_peak(&mut self) {
        for a in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            a.reset_peak();
        }
    }

    /// Add another shard's stats to these. Currents and cumulative counts add exactly; peaks add
    /// to an upper bound of the combined peak (exact when one shard did all the work).
    pub fn merge(&mut self, o: &Stats) {
        self.allocation.merge(&o.allocation);
        self.segment.merge(&o.segment);
        self.active.merge(&o.active);
        self.inactive_split.merge(&o.inactive_split);
        self.allocated_bytes.merge(&o.allocated_bytes);
        self.reserved_bytes.merge(&o.reserved_bytes);
        self.active_bytes.merge(&o.active_bytes);
        self.inactive_split_bytes.merge(&o.inactive_split_bytes);
        self.requested_bytes.merge(&o.requested_bytes);
        self.num_alloc_retries += o.num_alloc_retries;
        self.num_ooms += o.num_ooms;
        self.num_device_alloc += o.num_device_alloc;
        self.num_device_free += o.num_device_free;
        self.num_sync_all_streams += o.num_sync_all_streams;
        self.cache_hits += o.cache_hits;
        self.cache_misses += o.cache_misses;
        self.num_cross_stream_reuses += o.num_cross_stream_reuses;
        self.num_deferred_frees += o.num_deferred_frees;
    }

    /// Flat `"allocated_bytes.all.current" → value` map, like `torch.cuda.memory_stats()`.
    pub fn to_flat_map(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        let v = serde_json::to_value(self).unwrap_or_default();
        fn walk(
            prefix: &str,
            v: &serde_json::Value,
            m: &mut std::collections::BTreeMap<String, u64>,
        ) {
            match v {
                serde_json::Value::Object(o) => {
                    for (k, v) in o {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        walk(&key, v, m);
                    }
                }
                serde_json::Value::Number(n) => {
                    m.insert(prefix.to_string(), n.as_u64().unwrap_or(0));
                }
                _ => {}
            }
        }
        walk("", &v, &mut m);
        m
    }
}
