//! Memory registered by range, from the pools' segment events: what a user such as NCCL (its
//! user-buffer registration, driven by PyTorch's allocator trace trackers) should register and
//! deregister, so that nothing it holds is ever unmapped or freed under it.
//!
//! Such a user registers a range by its start and size and deregisters it by its start alone.
//! So the ranges it is told of are the ones a snapshot lists, which is also what PyTorch
//! registers when a communicator starts: each classic segment, and each maximal run of mapped
//! pages of an expandable segment. A map next to mapped pages joins runs: the old runs are
//! deregistered and the joined one registered. An unmap cuts a run: the run is deregistered
//! before the pages go, and what is left on either side registered again.
//!
//! [`translate`] is that rule (it needs no state: each event carries its run); [`Registry`]
//! keeps what was registered and checks every change against it (the invariant: a range is
//! never unmapped or freed while registered).

use crate::pool::{SegmentChange, SegmentEvent};
use crate::resource::{DevPtr, Stream};
use std::collections::BTreeMap;

/// Register or deregister.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeChange {
    /// the range may be registered now (its memory exists)
    Register,
    /// the range must be deregistered now (its memory, or part of it, goes next)
    Deregister,
}

/// One change for a registering user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeEvent {
    /// register or deregister
    pub change: RangeChange,
    /// the range's start (a deregistration names only this)...
    pub addr: DevPtr,
    /// ...and its bytes
    pub bytes: u64,
    /// the segment's stream
    pub stream: Stream,
    /// the private pool ((0, 0): the shared pool)
    pub pool: (u64, u64),
}

/// What a registering user does on `e`, in order.
pub fn translate(e: &SegmentEvent) -> Vec<RangeEvent> {
    let ev = |change, addr, bytes| RangeEvent {
        change,
        addr,
        bytes,
        stream: e.stream,
        pool: e.pool,
    };
    let (run0, run1) = (e.run.0, e.run.0 + e.run.1);
    let (a0, a1) = (e.addr, e.addr + e.bytes);
    let mut out = Vec::with_capacity(3);
    match e.change {
        SegmentChange::Alloc => out.push(ev(RangeChange::Register, e.addr, e.bytes)),
        SegmentChange::Free => out.push(ev(RangeChange::Deregister, e.addr, e.bytes)),
        // after the map: the runs on either side were registered apart
        SegmentChange::Map => {
            if run0 < a0 {
                out.push(ev(RangeChange::Deregister, run0, a0 - run0));
            }
            if a1 < run1 {
                out.push(ev(RangeChange::Deregister, a1, run1 - a1));
            }
            out.push(ev(RangeChange::Register, run0, e.run.1));
        }
        // before the unmap: the whole run goes, what is left on either side comes back
        SegmentChange::Unmap => {
            out.push(ev(RangeChange::Deregister, run0, e.run.1));
            if run0 < a0 {
                out.push(ev(RangeChange::Register, run0, a0 - run0));
            }
            if a1 < run1 {
                out.push(ev(RangeChange::Register, a1, run1 - a1));
            }
        }
    }
    out
}

/// The ranges registered, checked change by change.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    ranges: BTreeMap<DevPtr, u64>,
}

impl Registry {
    /// A registry that holds `ranges` already (what a snapshot lists when a user starts).
    pub fn with(ranges: impl IntoIterator<Item = (DevPtr, u64)>) -> Self {
        Self {
            ranges: ranges.into_iter().collect(),
        }
    }

    /// The ranges registered now, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (DevPtr, u64)> + '_ {
        self.ranges.iter().map(|(&a, &b)| (a, b))
    }

    /// The registered range that overlaps `[addr, addr + bytes)`, if any.
    pub fn overlapping(&self, addr: DevPtr, bytes: u64) -> Option<(DevPtr, u64)> {
        let end = addr.saturating_add(bytes);
        self.ranges
            .range(..end)
            .next_back()
            .filter(|(&a, &b)| a + b > addr)
            .map(|(&a, &b)| (a, b))
    }

    /// Apply `e`: a registration must not overlap a registered range, a deregistration must
    /// name one exactly (as NCCL requires).
    pub fn apply(&mut self, e: &RangeEvent) -> Result<(), String> {
        match e.change {
            RangeChange::Register => {
                if let Some((a, b)) = self.overlapping(e.addr, e.bytes) {
                    return Err(format!(
                        "registering [{:#x}, +{}) over the registered [{a:#x}, +{b})",
                        e.addr, e.bytes
                    ));
                }
                self.ranges.insert(e.addr, e.bytes);
            }
            RangeChange::Deregister => match self.ranges.remove(&e.addr) {
                Some(b) if b == e.bytes => {}
                Some(b) => {
                    return Err(format!(
                        "deregistering [{:#x}, +{}), registered with {b} bytes",
                        e.addr, e.bytes
                    ))
                }
                None => return Err(format!("deregistering {:#x}: not registered", e.addr)),
            },
        }
        Ok(())
    }

    /// Apply what [`translate`] makes of `e`, then check the invariant: memory about to be
    /// unmapped or freed is registered nowhere.
    pub fn follow(&mut self, e: &SegmentEvent) -> Result<Vec<RangeEvent>, String> {
        let out = translate(e);
        for r in &out {
            self.apply(r)?;
        }
        if matches!(e.change, SegmentChange::Unmap | SegmentChange::Free) {
            if let Some((a, b)) = self.overlapping(e.addr, e.bytes) {
                return Err(format!(
                    "[{:#x}, +{}) goes while [{a:#x}, +{b}) is registered",
                    e.addr, e.bytes
                ));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 2 << 20;

    fn ev(change: SegmentChange, addr: u64, bytes: u64, run: (u64, u64)) -> SegmentEvent {
        SegmentEvent {
            change,
            addr,
            bytes,
            stream: Stream(0),
            run,
            pool: (0, 0),
        }
    }

    #[test]
    fn maps_join_runs_and_unmaps_cut_them_with_the_old_run_deregistered_first() {
        let mut r = Registry::default();
        // pages 0-1 mapped, then 4, then 2-3 (joining both), then 1-2 unmapped
        r.follow(&ev(SegmentChange::Map, 0, 2 * P, (0, 2 * P)))
            .unwrap();
        r.follow(&ev(SegmentChange::Map, 4 * P, P, (4 * P, P)))
            .unwrap();
        let joined = r
            .follow(&ev(SegmentChange::Map, 2 * P, 2 * P, (0, 5 * P)))
            .unwrap();
        let kinds: Vec<_> = joined.iter().map(|e| (e.change, e.addr, e.bytes)).collect();
        assert_eq!(
            kinds,
            [
                (RangeChange::Deregister, 0, 2 * P),
                (RangeChange::Deregister, 4 * P, P),
                (RangeChange::Register, 0, 5 * P)
            ]
        );
        let cut = r
            .follow(&ev(SegmentChange::Unmap, P, 2 * P, (0, 5 * P)))
            .unwrap();
        assert_eq!(cut[0].change, RangeChange::Deregister);
        assert_eq!(r.ranges().collect::<Vec<_>>(), [(0, P), (3 * P, 2 * P)]);
        // a classic segment comes and goes whole
        r.follow(&ev(
            SegmentChange::Alloc,
            100 * P,
            10 * P,
            (100 * P, 10 * P),
        ))
        .unwrap();
        r.follow(&ev(SegmentChange::Free, 100 * P, 10 * P, (100 * P, 10 * P)))
            .unwrap();
        assert_eq!(r.ranges().count(), 2);
    }

    /// A pool that maps, moves, unmaps and releases memory at random, followed by a registry:
    /// no range ever goes while registered, and nothing stays registered once the pool is gone.
    #[test]
    fn a_pool_never_takes_registered_memory_away() {
        use crate::config::Config;
        use crate::pool::{CachingPool, SharedCounters};
        use crate::resource::sim::SimulatedDevice;
        use std::sync::{Arc, Mutex};
        for conf in ["expandable_segments:True", "expandable_segments:False"] {
            let shared = Arc::new(SharedCounters::default());
            let reg = Arc::new(Mutex::new((Registry::default(), 0usize)));
            let r = reg.clone();
            shared.add_segment_hook(Arc::new(move |e: &SegmentEvent| {
                let mut r = r.lock().unwrap();
                r.1 += 1;
                if let Err(why) = r.0.follow(e) {
                    panic!("{conf}: {e:?}: {why}");
                }
            }));
            let dev = Arc::new(SimulatedDevice::new(1 << 30));
            let mut p = CachingPool::new(dev, &Config::parse(conf).unwrap(), shared);
            let (mut live, mut x) = (Vec::new(), 99u64);
            for i in 0..4000 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = x >> 33;
                if live.len() > 40 || (v % 3 == 0 && !live.is_empty()) {
                    let k = (v as usize / 3) % live.len();
                    p.free(live.swap_remove(k)).unwrap();
                } else {
                    let stream = Stream(1 + v % 2);
                    if let Ok(a) = p.allocate(stream, (512 + v % (48 << 20)) as usize, 256) {
                        live.push(a.addr);
                    }
                }
                if i % 997 == 0 {
                    p.release_cached();
                }
            }
            drop(p);
            let r = reg.lock().unwrap();
            assert!(r.1 > 200, "{conf}: {} events", r.1);
            assert_eq!(r.0.ranges().count(), 0, "{conf}: left registered");
        }
    }

    #[test]
    fn the_registry_refuses_what_nccl_would_refuse() {
        let mut r = Registry::with([(0, 4 * P)]);
        let reg = |addr, bytes, change| RangeEvent {
            change,
            addr,
            bytes,
            stream: Stream(0),
            pool: (0, 0),
        };
        assert!(r.apply(&reg(2 * P, P, RangeChange::Register)).is_err());
        assert!(r.apply(&reg(P, P, RangeChange::Deregister)).is_err());
        assert!(r.apply(&reg(0, P, RangeChange::Deregister)).is_err());
        // an unmap told without its run's deregistration would leave memory registered
        let mut r = Registry::with([(0, 4 * P)]);
        let lying = SegmentEvent {
            run: (0, P),
            ..ev(SegmentChange::Unmap, 0, P, (0, P))
        };
        assert!(r.follow(&lying).is_err());
    }
}
