//! The thread-safe allocator, adaptors and typed buffers on the host backend and the simulator.

use gpumem::adaptor::Tracking;
use gpumem::resource::host::HostResource;
use gpumem::Device;
use gpumem::{Backend, Config, DeviceBuffer, Error, Resource, Stats, Stream};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S: Stream = Stream::DEFAULT;

fn host() -> Device {
    Device::host(Config::default()).unwrap()
}

#[test]
fn address_api_rejects_unknown_pointers_and_double_frees() {
    let a = host();
    let p = a.allocate_ptr(S, 1000, 256).unwrap();
    a.deallocate_ptr(p).unwrap();
    assert!(matches!(a.deallocate_ptr(p), Err(Error::DoubleFree { .. })));
    assert!(matches!(
        a.deallocate_ptr(12345),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        a.record_stream_ptr(p, Stream(3)),
        Err(Error::UnknownPointer { .. })
    ));
    let q = a.allocate_ptr(S, 1000, 256).unwrap();
    a.record_stream_ptr(q, Stream(3)).unwrap();
    a.deallocate_ptr(q).unwrap();
    // a block of the handle API is not freed by address, and an interior address is unknown
    let h = a.allocate(S, 4096, 256).unwrap();
    assert!(matches!(
        a.deallocate_ptr(h.ptr()),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        a.deallocate_ptr(h.ptr() + 512),
        Err(Error::UnknownPointer { .. })
    ));
    a.deallocate(h).unwrap();
    assert_eq!(a.stats().allocation.all.current, 0);
}

/// `time_calls`: the time spent in allocations and frees (each way in: handle, address,
/// token) is counted, and only when asked for.
#[test]
fn time_calls_counts_the_time_spent_in_calls_only_when_asked() {
    for (conf, timed) in [("", false), ("time_calls:True", true)] {
        let a = Device::host(Config::parse(conf).unwrap()).unwrap();
        for _ in 0..100 {
            let h = a.allocate(S, 4096, 256).unwrap();
            a.deallocate(h).unwrap();
            let p = a.allocate_ptr(S, 1 << 20, 256).unwrap();
            a.deallocate_ptr(p).unwrap();
            let (_, t) = a.allocate_token(S, 100, 256).unwrap();
            a.deallocate_token(t).unwrap();
        }
        let s = a.stats();
        assert_eq!(s.host_alloc_ns > 0, timed, "{conf}: {s:?}");
        assert_eq!(s.host_free_ns > 0, timed, "{conf}: {s:?}");
    }
}

#[test]
fn bad_requests_leave_the_allocator_usable() {
    let a = host();
    assert!(matches!(a.allocate(S, 0, 256), Err(Error::ZeroSize)));
    assert!(matches!(
        a.allocate(S, usize::MAX, 256),
        Err(Error::SizeTooLarge { .. })
    ));
    assert!(matches!(
        a.allocate(S, 64, 1000),
        Err(Error::InvalidAlignment { .. })
    ));
    let x = a.allocate(S, 64, 256).unwrap();
    a.deallocate(x).unwrap();
}

#[test]
fn memory_limit_gives_oom_then_recovers() {
    let (a, dev) =
        Device::simulated(1 << 40, Config::parse("memory_limit_mb:100").unwrap()).unwrap();
    assert_eq!(a.backend().limit(), Some(100 * MIB));
    let x = a.allocate(S, (60 * MIB) as usize, 256).unwrap();
    let e = a.allocate(S, (60 * MIB) as usize, 256).unwrap_err();
    let Error::OutOfMemory(r) = &e else {
        panic!("expected OOM, got {e}")
    };
    assert_eq!(r.limit, Some(100 * MIB));
    assert_eq!(r.reserved, 60 * MIB);
    assert!(e.to_string().contains("budget"), "{e}");
    assert_eq!(a.stats().num_ooms, 1);
    a.deallocate(x).unwrap();
    let y = a.allocate(S, (90 * MIB) as usize, 256).unwrap();
    a.deallocate(y).unwrap();
    assert!(dev.counters().used <= 100 * MIB);
}

/// What PyTorch's `cacheInfo` gets (its own allocator: free memory, or a larger cached block;
/// cuDNN sizes its convolutions' workspaces by it): the device's free memory within the
/// budget, or the largest free block where that is more.
#[test]
fn the_largest_available_block_is_free_memory_within_the_budget() {
    let (a, _) = Device::simulated(1000 * MIB, Config::default()).unwrap();
    assert_eq!(a.largest_available_block(), 1000 * MIB);
    let (a, _) =
        Device::simulated(1000 * MIB, Config::parse("memory_limit_mb:100").unwrap()).unwrap();
    assert_eq!(a.largest_available_block(), 100 * MIB);
    let x = a.allocate(S, (60 * MIB) as usize, 256).unwrap();
    let reserved = a.stats().reserved_bytes.all.current;
    assert_eq!(a.largest_available_block(), 100 * MIB - reserved);
    a.deallocate(x).unwrap();
    assert_eq!(a.largest_free_block(), reserved);
    assert_eq!(
        a.largest_available_block(),
        reserved.max(100 * MIB - reserved)
    );
}

#[test]
fn memory_fraction_is_a_budget() {
    let (a, _) =
        Device::simulated(1000 * MIB, Config::parse("memory_fraction:0.25").unwrap()).unwrap();
    assert_eq!(a.backend().limit(), Some(250 * MIB));
    assert!(a.allocate(S, (300 * MIB) as usize, 256).is_err());
}

#[test]
fn shards_reclaim_each_others_cache_before_oom() {
    let (a, _) = Device::simulated(100 * MIB, Config::parse("shards:2").unwrap()).unwrap();
    // another thread (another shard) caches 60 MiB
    let b = a.clone();
    std::thread::spawn(move || {
        let x = b.allocate(S, (60 * MIB) as usize, 256).unwrap();
        b.deallocate(x).unwrap();
    })
    .join()
    .unwrap();
    // this thread needs 80 MiB: only possible once the other shard lets go
    let y = a.allocate(S, (80 * MIB) as usize, 256).unwrap();
    assert_eq!(a.stats().num_ooms, 0, "a reclaimed retry is not an OOM");
    a.deallocate(y).unwrap();
}

#[test]
fn freeing_from_another_thread_returns_to_the_owning_shard() {
    let a = Device::host(Config::parse("shards:4").unwrap()).unwrap();
    let x = a.allocate(S, 4096, 256).unwrap();
    let b = a.clone();
    std::thread::spawn(move || b.deallocate(x).unwrap())
        .join()
        .unwrap();
    assert_eq!(a.stats().allocation.all.current, 0);
    a.check_invariants().unwrap();
}

#[test]
fn stats_serialise_and_summary_prints() {
    let a = host();
    let x = a.allocate(S, 3 * MIB as usize, 256).unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes.large_pool.current, 3 * MIB);
    assert_eq!(s.reserved_bytes.all.current, 20 * MIB);
    let json = serde_json::to_string(&s).unwrap();
    let back: Stats = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    let flat = s.to_flat_map();
    assert_eq!(flat["allocated_bytes.all.current"], 3 * MIB);
    let text = a.memory_summary();
    for row in [
        "Allocated memory",
        "GPU reserved memory",
        "Non-releasable memory",
        "from large pool",
    ] {
        assert!(text.contains(row), "summary lacks {row}:\n{text}");
    }
    // torch.cuda.reset_accumulated_memory_stats: totals start over, currents stay
    a.reset_accumulated();
    let r = a.stats();
    assert_eq!(r.allocated_bytes.all.current, 3 * MIB);
    assert_eq!(
        (r.allocated_bytes.all.allocated, r.allocated_bytes.all.freed),
        (0, 0)
    );
    assert_eq!((r.allocation.all.allocated, r.num_device_alloc), (0, 0));
    let y = a.allocate(S, 1000, 256).unwrap();
    a.deallocate(y).unwrap();
    let r = a.stats();
    assert_eq!((r.allocation.all.allocated, r.allocation.all.freed), (1, 1));
    a.deallocate(x).unwrap();
    a.reset_peak();
    assert_eq!(a.stats().allocated_bytes.all.peak, 0);
    assert_eq!(a.empty_cache(), 20 * MIB + 2 * MIB); // and y's small-pool segment
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
}

#[test]
fn reserve_warms_the_cache() {
    let (a, dev) = Device::simulated(1 << 40, Config::default()).unwrap();
    a.reserve(S, &[1 << 20, 50 << 20]).unwrap();
    let before = dev.counters().allocs;
    let x = a.allocate(S, 1 << 20, 256).unwrap();
    let y = a.allocate(S, 50 << 20, 256).unwrap();
    assert_eq!(dev.counters().allocs, before);
    a.deallocate(x).unwrap();
    a.deallocate(y).unwrap();
}

#[test]
fn tracking_reports_leaks_through_the_allocator() {
    let alloc: Arc<dyn Backend> = Arc::new(host().allocator().clone());
    let t = Tracking::new(alloc, true);
    let p = t.allocate(S, 100, 256).unwrap();
    let q = t.allocate(S, 200, 256).unwrap();
    t.deallocate(p, 100, S).unwrap();
    let leaks = t.leaks();
    assert_eq!(leaks.len(), 1);
    assert_eq!((leaks[0].ptr, leaks[0].bytes), (q, 200));
    assert!(leaks[0].backtrace.is_some());
    assert!(matches!(
        t.deallocate(p, 100, S),
        Err(Error::UnknownPointer { .. })
    ));
    t.deallocate(q, 200, S).unwrap();
    assert!(t.leaks().is_empty());
}

#[test]
fn host_resource_validates_frees() {
    let h = HostResource::new();
    let p = h.allocate(S, 8192, 256).unwrap();
    assert!(h.deallocate(p + 8, 8192, S).is_err());
    assert!(h.deallocate(p, 4096, S).is_err());
    h.deallocate(p, 8192, S).unwrap();
    assert!(h.deallocate(p, 8192, S).is_err());
}

#[test]
fn config_from_env_is_checked() {
    // GPUMEM_CONF is process-wide; this test only reads it through a clean parse
    assert!(Config::parse("max_split_size_mb:200,shards:1").is_ok());
    let e = Config::parse("max_split_size_mb:200,nonsense:1").unwrap_err();
    assert!(e.to_string().contains("nonsense"));
}

#[test]
fn device_buffer_round_trips_on_the_host_backend() {
    let a = host();
    let data: Vec<u32> = (0..10_000).collect();
    let mut b = DeviceBuffer::from_slice(&a, S, &data).unwrap();
    assert_eq!(b.len(), 10_000);
    assert_eq!(b.to_vec().unwrap(), data);
    assert_eq!(b.get(1234).unwrap(), 1234);
    b.set(1234, 7).unwrap();
    assert_eq!(b.get(1234).unwrap(), 7);
    assert!(matches!(b.get(10_000), Err(Error::OutOfBounds { .. })));
    assert!(matches!(
        b.set(usize::MAX, 1),
        Err(Error::OutOfBounds { .. })
    ));
    let s = b.slice(10..20).unwrap();
    assert_eq!(s.to_vec().unwrap(), (10..20).collect::<Vec<u32>>());
    assert!(b.slice(5..10_001).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = b.slice(20..10);
    assert!(reversed.is_err());
    {
        let mut m = b.slice_mut(..3).unwrap();
        m.copy_from_host(&[9, 9, 9]).unwrap();
        assert!(matches!(
            m.copy_from_host(&[1]),
            Err(Error::LengthMismatch { .. })
        ));
    }
    assert_eq!(&b.to_vec().unwrap()[..4], &[9, 9, 9, 3]);
    let z = DeviceBuffer::<f64>::zeroed(&a, S, 513).unwrap();
    assert!(z.to_vec().unwrap().iter().all(|&v| v == 0.0));
    let mut c = DeviceBuffer::<u32>::alloc(&a, S, 10_000).unwrap();
    c.copy_from_device(&b).unwrap();
    assert_eq!(c.to_vec().unwrap(), b.to_vec().unwrap());
    let empty = DeviceBuffer::<u8>::from_slice(&a, S, &[]).unwrap();
    assert!(empty.is_empty() && empty.to_vec().unwrap().is_empty());
    drop((b, c, z, empty));
    assert_eq!(
        a.stats().allocation.all.current,
        0,
        "buffers return their blocks on drop"
    );
}

#[test]
fn device_buffer_of_arrays() {
    let a = host();
    let v: Vec<[f32; 768]> = (0..4).map(|i| [i as f32; 768]).collect();
    let b = DeviceBuffer::from_slice(&a, S, &v).unwrap();
    assert_eq!(b.num_bytes(), 4 * 768 * 4);
    assert_eq!(b.get(3).unwrap()[767], 3.0);
}

#[test]
fn active_stats_include_blocks_waiting_on_events() {
    let (a, dev) = Device::simulated(1 << 40, Config::default()).unwrap();
    dev.set_auto_complete(false);
    let x = a.allocate(S, 4096, 256).unwrap();
    let y = a.allocate(S, 8192, 256).unwrap();
    a.record_stream(&x, Stream(9)).unwrap();
    a.deallocate(x).unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.all.current, 1);
    assert_eq!(
        s.active.all.current, 2,
        "the freed block still waits on stream 9"
    );
    assert_eq!(s.active_bytes.all.current, 4096 + 8192);
    assert_eq!(s.active.all.peak, 2);
    assert_eq!(s.num_deferred_frees, 1);
    dev.complete_events();
    a.deallocate(y).unwrap();
    let z = a.allocate(S, 512, 256).unwrap(); // processes the completed event
    let s = a.stats();
    assert_eq!(s.active.all.current, 1);
    assert_eq!(s.active.all.peak, 2);
    assert_eq!(s.active.all.allocated, 3);
    assert_eq!(s.active.all.freed, 2);
    for st in [
        s.allocation,
        s.active,
        s.allocated_bytes,
        s.active_bytes,
        s.reserved_bytes,
    ] {
        assert!(st.all.peak >= st.all.current);
        assert_eq!(st.all.allocated - st.all.freed, st.all.current);
        assert_eq!(
            st.all.current,
            st.small_pool.current + st.large_pool.current
        );
    }
    a.deallocate(z).unwrap();
}

#[test]
fn raw_resources_refuse_absurd_sizes_without_panicking() {
    use gpumem::resource::sim::SimulatedDevice;
    let sim = SimulatedDevice::new(1 << 30);
    assert!(sim.allocate(S, usize::MAX, 256).is_err());
    assert!(sim.allocate(S, 0, 256).is_err());
    assert!(sim.allocate(S, 4096, 3).is_err());
    let h = HostResource::new();
    assert!(h.allocate(S, usize::MAX, 256).is_err());
    assert!(h.allocate(S, 64, usize::MAX).is_err());
}

/// Active peaks follow their currents before any block has waited on events (they read 0 once).
#[test]
fn active_peaks_follow_current_without_deferred_frees() {
    let a = host();
    let x = a.allocate(S, 1 << 20, 256).unwrap();
    let s = a.stats();
    assert_eq!(s.active_bytes.all.current, 1 << 20);
    assert_eq!(s.active_bytes.all.peak, 1 << 20);
    assert_eq!(s.active.all.peak, 1);
    assert!(
        !a.memory_summary().contains("Peak 0 B"),
        "{}",
        a.memory_summary()
    );
    a.deallocate(x).unwrap();
}

/// A job whose layout drifts every step (sizes drawn per step, 4 ms a step): moving pages
/// would be needed on every step, and costs more than 1% of a step. Moves take at most 1% of
/// the elapsed time plus what growth took, by construction; here all page work on the
/// allocating thread, growth and moves, on the device's clock (the simulator's: what their
/// calls would cost on an H100) stays within 1% of the elapsed time plus one move, and the
/// job maps and keeps: no driver call in its last steps.
#[test]
fn page_moves_stay_within_the_time_budget_then_stop() {
    use gpumem::workload::SplitMix;
    let (a, dev) = Device::simulated(1 << 40, Config::default()).unwrap();
    let calls = |d: &gpumem::resource::sim::SimulatedDevice| {
        use gpumem::resource::VirtualMemory;
        d.calls().foreground
    };
    let mut r = SplitMix::new(11);
    let (steps, step_us) = (1000u64, 4_000u64);
    let mut last_calls = 0;
    for step in 0..steps {
        dev.set_time_us(step * step_us);
        let before = calls(&dev);
        // activations of drawn sizes; every other one freed, then a large temporary, then
        // the rest
        let live: Vec<_> = (0..24)
            .map(|_| {
                let mib = 4 + r.below(60);
                a.allocate(S, (mib * MIB) as usize, 256).unwrap()
            })
            .collect();
        let (odd, even): (Vec<_>, Vec<_>) =
            live.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
        for (_, x) in odd {
            a.deallocate(x).unwrap();
        }
        let t = a
            .allocate(S, ((100 + r.below(200)) * MIB) as usize, 256)
            .unwrap();
        a.deallocate(t).unwrap();
        for (_, x) in even {
            a.deallocate(x).unwrap();
        }
        if step >= steps - 20 {
            last_calls += calls(&dev) - before;
        }
    }
    let s = a.stats();
    let elapsed_ns = (steps * step_us * 1000) as f64;
    assert!(s.num_page_moves > 0, "the job moved pages at first");
    // (no move here was made under memory pressure, which the budget does not limit)
    assert_eq!(s.num_pressure_moves, 0);
    let one_move_ns = 300.0 * 90_000.0 / 2.0; // 300 MiB of 2 MiB pages at 90 µs each
    assert!(
        (s.page_map_ns as f64) <= 0.01 * elapsed_ns + one_move_ns,
        "page work took {} ms (moves {} ms) of {} ms",
        s.page_map_ns as f64 / 1e6,
        s.page_move_ns as f64 / 1e6,
        elapsed_ns / 1e6
    );
    assert_eq!(last_calls, 0, "driver calls in the last 20 steps");
    assert_eq!(s.allocated_bytes.all.current, 0);
}

/// Memory pressure flips the trade: with moves stopped by the time budget, an allocation
/// that growing would push past the memory budget moves free pages instead (whatever the time
/// costs), and does not fail.
#[test]
fn memory_pressure_moves_pages_whatever_the_time_budget() {
    let (a, _dev) =
        Device::simulated(1 << 40, Config::parse("memory_limit_mb:70000").unwrap()).unwrap();
    // the clock moves only by the modelled calls: the time budget earns 1% of growing x and
    // y, and z's move (taking x's 20000 MiB of pages) overdraws it: moves stop
    let x = a.allocate(S, (20000 * MIB) as usize, 256).unwrap();
    let y = a.allocate(S, (15000 * MIB) as usize, 256).unwrap();
    a.deallocate(x).unwrap();
    let z = a.allocate(S, (25000 * MIB) as usize, 256).unwrap();
    let s = a.stats();
    assert_eq!((s.num_page_moves, s.num_move_stops), (1, 1), "{s:?}");
    assert_eq!(s.num_pressure_moves, 0);
    assert!(s.reserved_bytes.all.current < 60000 * MIB);
    // y's pages are free and mapped; 40000 MiB fit in no free block: growing would pass
    // the budget, so pages move although moves are stopped
    a.deallocate(y).unwrap();
    let w = a.allocate(S, (40000 * MIB) as usize, 256).unwrap();
    let s = a.stats();
    assert!(s.num_pressure_moves >= 1, "{s:?}");
    assert_eq!(s.num_ooms, 0);
    assert!(s.reserved_bytes.all.peak <= 70000 * MIB);
    a.deallocate(z).unwrap();
    a.deallocate(w).unwrap();
}

/// The device's headroom is memory pressure too: where growing would leave the device less
/// than its headroom free (no memory budget set), free pages move instead, whatever the time
/// budget; and where nothing is free to move, the pool still grows into the headroom rather
/// than fail.
#[test]
fn growth_into_the_devices_headroom_moves_pages_and_never_fails() {
    // the same job on a device with room to spare, and on one where y's free pages must move
    // for the device to keep its headroom (256 MiB: a 64th of 80 GB is more); a memory budget
    // 100 MiB above the job's growth is the budget's own check, not the device's headroom
    for (capacity, conf, moves) in [
        (1u64 << 40, "", false),
        (1u64 << 40, "memory_limit_mb:80100", false),
        (80_100 * MIB, "", true),
    ] {
        let (a, dev) = Device::simulated(capacity, Config::parse(conf).unwrap()).unwrap();
        let x = a.allocate(S, (20000 * MIB) as usize, 256).unwrap();
        let y = a.allocate(S, (15000 * MIB) as usize, 256).unwrap();
        a.deallocate(x).unwrap();
        // z takes x's pages; its move overdraws the time budget and moves stop
        let z = a.allocate(S, (25000 * MIB) as usize, 256).unwrap();
        assert_eq!(a.stats().num_move_stops, 1);
        a.deallocate(y).unwrap();
        // growing by 40000 MiB would leave 100 MiB of the smaller device free
        let w = a.allocate(S, (40000 * MIB) as usize, 256).unwrap();
        let s = a.stats();
        assert_eq!(s.num_ooms, 0);
        assert_eq!(
            s.num_pressure_moves >= 1,
            moves,
            "capacity {capacity}: {s:?}"
        );
        if moves {
            assert!(
                dev.mem_info_free() >= 256 * MIB,
                "{} free",
                dev.mem_info_free()
            );
            assert!(
                s.reserved_bytes.all.current <= 65000 * MIB + 256 * MIB,
                "{s:?}"
            );
        } else {
            assert!(s.reserved_bytes.all.current >= 80000 * MIB, "{s:?}");
        }
        // nothing free to move: the pool grows into the headroom and does not fail
        if moves {
            let free = dev.mem_info_free();
            let v = a.allocate(S, (free - 8 * MIB) as usize, 256).unwrap();
            assert_eq!(a.stats().num_ooms, 0);
            assert!(dev.mem_info_free() < 256 * MIB);
            a.deallocate(v).unwrap();
        }
        a.deallocate(z).unwrap();
        a.deallocate(w).unwrap();
    }
}

/// PyTorch's `_set_allocator_settings` at run time: the string's rounding applies to later
/// requests, a later string without it puts the default back, and a bad string is an error
/// that changes nothing.
#[test]
fn runtime_settings_change_rounding_and_a_bad_string_changes_nothing() {
    let a = host();
    let size = |a: &Device, bytes: u64| {
        let before = a.stats().allocated_bytes.all.current;
        let p = a.allocate_ptr(S, bytes as usize, 256).unwrap();
        let got = a.stats().allocated_bytes.all.current - before;
        a.deallocate_ptr(p).unwrap();
        got
    };
    let n = 84 * MIB; // between 64 and 128 MiB: four divisions round it to 96 MiB
    assert_eq!(size(&a, n), n);
    let set = |s: &str| Config::parse(s).map(|c| a.set_runtime_settings(&c));
    set("roundup_power2_divisions:4").unwrap();
    assert_eq!(size(&a, n), 96 * MIB);
    assert!(set("roundup_power2_divisions:3").is_err());
    assert!(set("no_such_key:1").is_err());
    assert_eq!(size(&a, n), 96 * MIB, "unchanged by bad strings");
    set("garbage_collection_threshold:0.5,max_split_size_mb:40").unwrap();
    assert_eq!(size(&a, n), n, "rounding back to its default");
}
