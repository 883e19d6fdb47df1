//! Memory registered by range, from the pools' segment events: what a user such as NCCL (its
//! user-buffer registration, driven by PyTorch's allocator trace trackers) should register and
//! deregister, so that nothing it holds is ever unmapped or freed under it.
//!
//! Such a user registers a range by its start and size and deregisters it by its start alone.
//! A classic segment is registered whole. Pages of an expandable segment are registered as they
//! are mapped, each map's range on its own, as PyTorch's expandable segments do: a map next to
//! registered pages never deregisters them, for a collective may be using them (joining the
//! runs meant deregistering memory in use, which crashed FSDP2 on two GPUs). A range is
//! deregistered before any of its memory is unmapped (what stays mapped of it is registered
//! again). When a user starts, what it may hold already is what a snapshot lists (each classic
//! segment and each maximal run of mapped pages: what PyTorch registers when a communicator
//! starts).
//!
//! [`Registry`] keeps what was registered, says what each segment event asks of the user, and
//! checks every change against it (the invariant: a range is never unmapped or freed while
//! registered).

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

    /// What a registering user does on `e`, in order: register what comes; before memory goes,
    /// deregister every range that holds any of it, then register again what stays of those.
    pub fn changes(&self, e: &SegmentEvent) -> Vec<RangeEvent> {
        let ev = |change, addr, bytes| RangeEvent {
            change,
            addr,
            bytes,
            stream: e.stream,
            pool: e.pool,
        };
        match e.change {
            SegmentChange::Alloc | SegmentChange::Map => {
                vec![ev(RangeChange::Register, e.addr, e.bytes)]
            }
            SegmentChange::Free | SegmentChange::Unmap => {
                let (a0, a1) = (e.addr, e.addr.saturating_add(e.bytes));
                let held: Vec<(DevPtr, u64)> = self
                    .ranges
                    .range(..a1)
                    .rev()
                    .take_while(|(&a, &b)| a + b > a0)
                    .map(|(&a, &b)| (a, b))
                    .collect();
                let mut out: Vec<RangeEvent> = held
                    .iter()
                    .map(|&(a, b)| ev(RangeChange::Deregister, a, b))
                    .collect();
                for &(a, b) in held.iter().rev() {
                    if a < a0 {
                        out.push(ev(RangeChange::Register, a, a0 - a));
                    }
                    if a + b > a1 {
                        out.push(ev(RangeChange::Register, a1, a + b - a1));
                    }
                }
                out
            }
        }
    }

    /// Apply what [`Registry::changes`] makes of `e`, then check the invariant: memory about to
    /// be unmapped or freed is registered nowhere. Returns the changes.
    pub fn follow(&mut self, e: &SegmentEvent) -> Result<Vec<RangeEvent>, String> {
        let out = self.changes(e);
        self.apply_all(e, &out)?;
        Ok(out)
    }

    /// Apply `changes` (what [`Registry::changes`] made of `e`), then check the invariant, as
    /// [`Registry::follow`] does: for a user that hands the changes on even where one breaks
    /// the rule.
    pub fn apply_all(&mut self, e: &SegmentEvent, changes: &[RangeEvent]) -> Result<(), String> {
        for r in changes {
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 2 << 20;

    fn ev(change: SegmentChange, addr: u64, bytes: u64) -> SegmentEvent {
        SegmentEvent {
            change,
            addr,
            bytes,
            stream: Stream(0),
            pool: (0, 0),
        }
    }

    fn kinds(v: &[RangeEvent]) -> Vec<(RangeChange, u64, u64)> {
        v.iter().map(|e| (e.change, e.addr, e.bytes)).collect()
    }

    #[test]
    fn maps_register_apart_and_unmaps_deregister_first() {
        use RangeChange::{Deregister, Register};
        let mut r = Registry::default();
        // pages 0-1 mapped, then 4, then 2-3: each map registered on its own, nothing that is
        // registered (and may be in use) is deregistered for it
        r.follow(&ev(SegmentChange::Map, 0, 2 * P)).unwrap();
        r.follow(&ev(SegmentChange::Map, 4 * P, P)).unwrap();
        let between = r.follow(&ev(SegmentChange::Map, 2 * P, 2 * P)).unwrap();
        assert_eq!(kinds(&between), [(Register, 2 * P, 2 * P)]);
        // pages 1-2 unmapped: both ranges holding them deregistered first, what stays of them
        // (page 0, page 3) registered again
        let cut = r.follow(&ev(SegmentChange::Unmap, P, 2 * P)).unwrap();
        assert_eq!(
            kinds(&cut),
            [
                (Deregister, 2 * P, 2 * P),
                (Deregister, 0, 2 * P),
                (Register, 0, P),
                (Register, 3 * P, P)
            ]
        );
        assert_eq!(
            r.ranges().collect::<Vec<_>>(),
            [(0, P), (3 * P, P), (4 * P, P)]
        );
        // a classic segment comes and goes whole
        r.follow(&ev(SegmentChange::Alloc, 100 * P, 10 * P))
            .unwrap();
        let gone = r.follow(&ev(SegmentChange::Free, 100 * P, 10 * P)).unwrap();
        assert_eq!(kinds(&gone), [(Deregister, 100 * P, 10 * P)]);
        assert_eq!(r.ranges().count(), 3);
        // a run registered whole when the user started (a snapshot's) loses only what goes
        let mut r = Registry::with([(0, 8 * P)]);
        let cut = r.follow(&ev(SegmentChange::Unmap, 0, 2 * P)).unwrap();
        assert_eq!(
            kinds(&cut),
            [(Deregister, 0, 8 * P), (Register, 2 * P, 6 * P)]
        );
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
        // a map over memory registered already (told twice) is refused
        let mut r = Registry::with([(0, 4 * P)]);
        assert!(r.follow(&ev(SegmentChange::Map, P, P)).is_err());
    }
}
