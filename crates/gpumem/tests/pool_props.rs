//! Property tests: random sequences of alloc / free / record_stream / empty_cache / OOM over
//! the simulated device, checking the invariants after every step.

use gpumem::resource::sim::SimulatedDevice;
use gpumem::{Allocation, CachingAllocator, Config, Error, Stream};
use proptest::prelude::*;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 512 * MIB;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        stream: u8,
        size: u64,
        align_log2: u8,
    },
    Free(usize),
    RecordStream(usize, u8),
    EmptyCache,
    CompleteEvents,
    Huge,
    ResetPeak,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=4096,
        3 => 4097u64..=(MIB + 1),
        2 => (MIB + 1)..=(12 * MIB),
        1 => (12 * MIB)..=(96 * MIB),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..3, size(), 0u8..=9).prop_map(|(stream, size, align_log2)| Op::Alloc { stream, size, align_log2 }),
        6 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 0u8..3).prop_map(|(i, s)| Op::RecordStream(i, s)),
        1 => Just(Op::EmptyCache),
        2 => Just(Op::CompleteEvents),
        1 => Just(Op::Huge),
        1 => Just(Op::ResetPeak),
    ]
}

fn config() -> impl Strategy<Value = String> {
    prop_oneof![
        // expandable (virtual-memory) segments, the default on the simulated device
        Just(String::new()),
        Just("quick_cache:0".to_string()),
        Just("memory_limit_mb:256".to_string()),
        // classic segments
        Just("expandable_segments:False".to_string()),
        Just("expandable_segments:False,quick_cache:0".to_string()),
        Just("expandable_segments:False,max_split_size_mb:32".to_string()),
        Just(
            "expandable_segments:False,roundup_power2_divisions:4,cross_stream_reuse:false"
                .to_string()
        ),
        Just(
            "expandable_segments:False,garbage_collection_threshold:0.5,quick_cache:4".to_string()
        ),
        Just("expandable_segments:False,memory_limit_mb:256".to_string()),
    ]
}

struct Live {
    a: Allocation,
    align: u64,
    recorded: bool,
}

fn check(alloc: &CachingAllocator, live: &[Live]) -> Result<(), TestCaseError> {
    alloc
        .check_invariants()
        .map_err(|e| TestCaseError::fail(format!("invariant: {e}")))?;
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .map(|l| (l.a.ptr(), l.a.size() as u64))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "live blocks overlap: {:?}", w);
    }
    for l in live {
        prop_assert_eq!(l.a.ptr() % l.align, 0, "misaligned");
    }
    let s = alloc.stats();
    prop_assert_eq!(s.allocation.all.current, live.len() as u64);
    prop_assert_eq!(
        s.requested_bytes.all.current,
        live.iter().map(|l| l.a.size() as u64).sum::<u64>()
    );
    prop_assert!(s.allocated_bytes.all.current <= s.reserved_bytes.all.current);
    Ok(())
}

/// The statistics whose peak must be exactly the highest current seen since the last reset
/// (they grow only when a block is handed out, so a check after every step sees each peak).
const EXACT_PEAKS: [&str; 5] = [
    "allocation",
    "allocated_bytes",
    "requested_bytes",
    "active",
    "active_bytes",
];

/// A model of the peaks: the highest current of every statistic seen since the last reset.
#[derive(Default)]
struct Peaks(std::collections::BTreeMap<String, u64>);

impl Peaks {
    fn reset(&mut self, alloc: &CachingAllocator) {
        self.0.clear();
        self.observe(alloc);
    }

    fn observe(&mut self, alloc: &CachingAllocator) {
        for (k, v) in alloc.stats().to_flat_map() {
            if let Some(name) = k.strip_suffix(".current") {
                let m = self.0.entry(name.to_string()).or_default();
                *m = (*m).max(v);
            }
        }
    }

    /// Every peak is at least its current and the model's maximum; the exact ones equal it.
    fn check(&self, alloc: &CachingAllocator) -> Result<(), TestCaseError> {
        let flat = alloc.stats().to_flat_map();
        for (name, &max) in &self.0 {
            let (Some(&peak), Some(&cur)) = (
                flat.get(&format!("{name}.peak")),
                flat.get(&format!("{name}.current")),
            ) else {
                continue;
            };
            prop_assert!(peak >= cur, "{name}: peak {peak} below current {cur}");
            let stat = name.split('.').next().unwrap_or_default();
            if EXACT_PEAKS.contains(&stat) {
                prop_assert_eq!(peak, max, "{}: peak is not the highest current seen", name);
            } else {
                prop_assert!(
                    peak >= max,
                    "{name}: peak {peak} below a current seen ({max})"
                );
            }
        }
        Ok(())
    }
}

fn run(conf: &str, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dev = Arc::new(SimulatedDevice::new(CAPACITY));
    dev.set_auto_complete(false);
    let alloc = CachingAllocator::new(
        dev.clone(),
        Config::parse(&format!("shards:1,{conf}")).unwrap(),
    )
    .unwrap();
    let mut live: Vec<Live> = Vec::new();
    // blocks freed while another stream was recorded, whose events have not completed
    let mut pending: Vec<(u64, u64)> = Vec::new();
    let mut syncs = 0;
    let mut peaks = Peaks::default();
    for op in ops {
        match op {
            Op::Alloc {
                stream,
                size,
                align_log2,
            } => {
                let align = 1usize << align_log2;
                let r = alloc.allocate(Stream(stream as u64), size as usize, align);
                let now = alloc.stats().num_sync_all_streams;
                if now != syncs {
                    syncs = now; // the pool waited for every pending event
                    pending.clear();
                }
                match r {
                    Ok(a) => {
                        let (p, n) = (a.ptr(), a.size() as u64);
                        for &(q, m) in &pending {
                            prop_assert!(
                                p + n <= q || q + m <= p,
                                "reused a block other streams may still use"
                            );
                        }
                        live.push(Live {
                            a,
                            align: align as u64,
                            recorded: false,
                        })
                    }
                    Err(Error::OutOfMemory(r)) => {
                        prop_assert!(r.reserved <= CAPACITY);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                if l.recorded {
                    pending.push((l.a.ptr(), l.a.size() as u64));
                }
                alloc
                    .deallocate(l.a)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::RecordStream(i, s) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                alloc
                    .record_stream(&l.a, Stream(s as u64))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                l.recorded |= Stream(s as u64) != l.a.stream();
            }
            Op::EmptyCache => {
                alloc.empty_cache();
            }
            Op::CompleteEvents => {
                dev.complete_events();
                pending.clear();
            }
            Op::Huge => {
                let r = alloc.allocate(Stream(0), (CAPACITY + MIB) as usize, 256);
                prop_assert!(
                    matches!(r, Err(Error::OutOfMemory(_))),
                    "a request above capacity must be OOM"
                );
            }
            Op::ResetPeak => {
                alloc.reset_peak();
                peaks.reset(&alloc);
            }
            _ => {}
        }
        check(&alloc, &live)?;
        peaks.observe(&alloc);
        peaks.check(&alloc)?;
    }
    for l in live.drain(..) {
        alloc
            .deallocate(l.a)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    dev.complete_events();
    alloc.empty_cache();
    check(&alloc, &live)?;
    let s = alloc.stats();
    prop_assert_eq!(
        s.reserved_bytes.all.current,
        0,
        "after freeing everything and empty_cache"
    );
    prop_assert_eq!(s.active_bytes.all.current, 0);
    prop_assert_eq!(dev.counters().used, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_after_every_step(conf in config(), ops in prop::collection::vec(op(), 1..300)) {
        run(&conf, ops)?;
    }
}
