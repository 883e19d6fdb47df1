//! Pinned memory, the transfer engine and the ring bridge on the host backend (CI); the same
//! paths run on a GPU in tests/gpu.rs.

use gpumem::buffer::ring::{ctrl, RingBridge, RingMode};
use gpumem::pool::pinned::{size_class, PinnedPool};
use gpumem::resource::sim::SimulatedDevice;
use gpumem::resource::StreamOps;
use gpumem::Device;
use gpumem::{Config, DeviceBuffer, PinnedBuffer, PinnedRegistration, Stream};
use gpumem::{Error, Transfer};
use proptest::prelude::*;
use std::sync::Arc;

#[path = "common/msg.rs"]
mod msg;
use msg::Msg;

fn host() -> Device {
    Device::host(Config::default()).unwrap()
}

#[test]
fn message_is_one_cache_line_pair() {
    assert_eq!(std::mem::size_of::<Msg>(), 128);
    assert_eq!(std::mem::align_of::<Msg>(), 128);
}

#[test]
fn every_strategy_round_trips_at_odd_sizes_and_offsets() {
    let alloc = host();
    let page = 4096;
    for len in [1usize, page - 1, page + 1, (4 << 20) + 3, (9 << 20) + 17] {
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        for how in [
            Transfer::Sync,
            Transfer::Async,
            Transfer::Staged,
            Transfer::Unified,
            Transfer::Auto,
        ] {
            let mut d = DeviceBuffer::<u8>::alloc(&alloc, Stream::DEFAULT, len + 3).unwrap();
            // odd offset inside the device buffer
            d.slice_mut(3..).unwrap().copy_from_host(&src).unwrap();
            let mut whole = DeviceBuffer::<u8>::zeroed(&alloc, Stream::DEFAULT, len).unwrap();
            whole.copy_from_host_with(&src, how).unwrap();
            let mut back = vec![0u8; len];
            whole.copy_to_host_with(&mut back, how).unwrap();
            assert_eq!(back, src, "{len} bytes, {how:?}");
            assert_eq!(d.slice(3..).unwrap().to_vec().unwrap(), src);
        }
    }
    let pool = alloc.pinned_pool().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(
        pool.stats().allocated_bytes,
        0,
        "staging chunks all returned"
    );
}

#[test]
fn length_mismatch_is_an_error() {
    let alloc = host();
    let mut d = DeviceBuffer::<u32>::zeroed(&alloc, Stream::DEFAULT, 10).unwrap();
    assert!(matches!(
        d.copy_from_host_with(&[1, 2, 3], Transfer::Staged),
        Err(Error::LengthMismatch { .. })
    ));
    let p = PinnedBuffer::<u32>::zeroed(alloc.pinned_pool().unwrap(), 4).unwrap();
    assert!(matches!(
        d.copy_from_pinned(&p),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        d.copy_range_from_pinned(8, &p, 0..4),
        Err(Error::OutOfBounds { .. })
    ));
    d.copy_range_from_pinned(6, &p, 0..4).unwrap();
}

#[test]
fn pinned_buffers_round_trip_through_the_device() {
    let alloc = host();
    let pool = alloc.pinned_pool().unwrap();
    for len in [1usize, 1023, 1025, 100_000] {
        let data: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
        let src = PinnedBuffer::from_slice(pool, &data).unwrap();
        let mut d = DeviceBuffer::<f32>::alloc(&alloc, Stream::DEFAULT, len).unwrap();
        d.copy_from_pinned(&src).unwrap();
        let mut dst = PinnedBuffer::<f32>::zeroed(pool, len).unwrap();
        d.copy_to_pinned(&mut dst).unwrap();
        assert_eq!(dst.as_slice().unwrap(), &data[..]);
        dst.as_mut_slice().unwrap()[0] = 7.0;
        assert_eq!(dst.as_slice().unwrap()[0], 7.0);
    }
    let empty = PinnedBuffer::<u64>::zeroed(pool, 0).unwrap();
    assert!(empty.as_slice().unwrap().is_empty());
}

#[test]
fn registered_memory_is_a_copy_source_and_destination() {
    let alloc = host();
    let pool = alloc.pinned_pool().unwrap();
    let mut v: Vec<u16> = (0..5000).map(|i| i as u16).collect();
    let mut d = DeviceBuffer::<u16>::zeroed(&alloc, Stream::DEFAULT, 5000).unwrap();
    {
        let reg = PinnedRegistration::new(pool, &mut v).unwrap();
        d.copy_from_pinned(&reg).unwrap();
    }
    let mut out = vec![0u16; 5000];
    {
        let mut reg = PinnedRegistration::new(pool, &mut out).unwrap();
        d.copy_to_pinned(&mut reg).unwrap();
        assert_eq!(reg.as_slice().unwrap()[4999], 4999);
    }
    assert_eq!(out, v);
}

#[test]
fn pinned_pool_caches_by_size_class() {
    let pool = PinnedPool::new(std::sync::Arc::new(
        gpumem::resource::host::HostResource::new(),
    ));
    let a = PinnedBuffer::<u8>::zeroed(&pool, 5000).unwrap();
    drop(a);
    let b = PinnedBuffer::<u8>::zeroed(&pool, 6000).unwrap(); // same 8 KiB class
    let s = pool.stats();
    assert_eq!(s.num_host_alloc, 1);
    assert_eq!(s.num_cache_hits, 1);
    assert_eq!(s.allocated_bytes, size_class(6000) as u64);
    drop(b);
    assert_eq!(pool.empty_cache(), 8192);
}

#[test]
fn a_buffer_dropped_with_a_copy_in_flight_is_not_handed_out_early() {
    // the simulated device keeps events pending until told: a copy that is still running
    let dev = Arc::new(SimulatedDevice::new(1 << 30));
    dev.set_auto_complete(false);
    let pool = PinnedPool::new(dev.clone());
    let block = pool.allocate(1 << 16).unwrap();
    let addr = block.ptr();
    let ev = dev.record_event(Stream(3)).unwrap();
    pool.free(block, vec![ev]).unwrap();
    for _ in 0..10 {
        let b = pool.allocate(1 << 16).unwrap();
        assert_ne!(b.ptr(), addr);
        pool.free(b, vec![]).unwrap();
    }
    dev.complete_events();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().pending_bytes, 0);
    pool.check_invariants().unwrap();
}

#[test]
fn ring_bridge_keeps_order_and_integrity() {
    let alloc = host();
    let mut ring = RingBridge::<Msg>::new(&alloc, Stream::DEFAULT, 64).unwrap();
    let mut next_expected = 0u64;
    let mut seq = 0u64;
    // uneven batches, wrapping the ring many times
    for batch in (0..200).map(|i| 1 + (i * 37) % 64) {
        for _ in 0..batch {
            ring.send(Msg::new(seq)).unwrap();
            seq += 1;
        }
        let flushed = ring.flush_to_device().unwrap();
        // "device": echo the flushed messages into the inbox ring, in slot order
        let cap = ring.capacity() as u64;
        let out = ring.outbox_device().unwrap().to_vec().unwrap();
        let msgs: Vec<Msg> = flushed.clone().map(|s| out[(s % cap) as usize]).collect();
        let seqs = ring.next_device_seqs(msgs.len() as u64);
        for (s, m) in seqs.zip(&msgs) {
            ring.inbox_device_mut()
                .unwrap()
                .set((s % cap) as usize, *m)
                .unwrap();
        }
        ring.publish(msgs.len() as u64).unwrap();
        for m in ring.receive().unwrap() {
            assert!(m.intact(), "corrupted message {}", m.seq);
            assert_eq!(m.seq, next_expected, "out of order");
            next_expected += 1;
        }
    }
    assert_eq!(next_expected, seq);
    let c = ring.counters();
    assert_eq!(c.messages_to_device, seq);
    assert_eq!(c.messages_to_host, seq);
    assert_eq!(c.bytes_to_device, seq * 128);
    assert!(
        c.copies > c.flushes_to_device + c.flushes_to_host,
        "wraps need two copies"
    );
    assert!(ring.publish(65).is_err(), "more than the ring holds");
}

#[test]
fn ring_send_past_capacity_flushes_itself() {
    let alloc = host();
    let mut ring = RingBridge::<Msg>::new(&alloc, Stream::DEFAULT, 8).unwrap();
    for s in 0..20 {
        ring.send(Msg::new(s)).unwrap();
    }
    assert_eq!(ring.counters().messages_to_device, 16);
    assert_eq!(ring.flush_to_device().unwrap(), 16..20);
    assert!(RingBridge::<Msg>::new(&alloc, Stream::DEFAULT, 0).is_err());
}

fn polled(alloc: &Device, cap: usize) -> RingBridge<Msg> {
    let mode = RingMode::Polled {
        poll: std::time::Duration::ZERO,
    };
    RingBridge::<Msg>::with_mode(alloc, Stream::DEFAULT, cap, mode).unwrap()
}

#[test]
fn polled_ring_round_trips_through_a_polling_device_without_copies() {
    let alloc = host();
    let cap = 16usize;
    let mut ring = polled(&alloc, cap);
    assert!(matches!(ring.mode(), RingMode::Polled { .. }));
    let args = ring.polled_args().unwrap();
    assert_eq!((args.capacity, args.message_bytes), (16, 128));
    let device = std::thread::spawn(move || {
        // SAFETY: a host-backend bridge's rings; the test waits for the echo to attach (or
        // drains through it) before the bridge goes
        unsafe { gpumem::buffer::ring::echo_on_host(args) }
    });
    ring.wait_attached().unwrap();
    // bursts of up to twice the ring (sends wait for the device to free slots), and single
    // round trips
    let sent = msg::echo_bursts(&mut ring, 400, |round| 1 + (round * 13) % (2 * cap as u64));
    assert_eq!(
        ring.flush_to_device().unwrap().end,
        sent,
        "no copy, just the range"
    );
    ring.close().unwrap();
    assert_eq!(device.join().unwrap(), sent);
    assert!(!ring.device_attached());
    let c = ring.counters();
    assert_eq!(c.copies, 0, "polled mode issues no copies");
    assert_eq!((c.messages_to_device, c.messages_to_host), (sent, sent));
    assert_eq!(c.bytes_to_host, sent * 128);
}

#[test]
fn polled_ring_without_a_device_times_out_and_stays_usable() {
    let alloc = host();
    let mut ring = polled(&alloc, 4);
    ring.set_timeout(std::time::Duration::from_millis(30));
    for s in 0..4 {
        ring.send(Msg::new(s)).unwrap();
    }
    // full, and nobody consumes: a timeout, not a hang
    let e = ring.send(Msg::new(4)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    let e = ring.receive_at_least(1).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(ring.receive().unwrap().is_empty());
    assert!(ring.counters().empty_polls > 0);
    // what copy mode has and polled mode does not: clear errors
    assert!(ring.publish(1).is_err());
    assert!(ring.outbox_device().is_err());
    assert!(ring.inbox_device_mut().is_err());
    // a device attaches late and drains the ring: the blocked send goes through
    let args = ring.polled_args().unwrap();
    let device = std::thread::spawn(move || {
        // SAFETY: a host-backend bridge's rings; the test waits for the echo to attach (or
        // drains through it) before the bridge goes
        unsafe { gpumem::buffer::ring::echo_on_host(args) }
    });
    ring.set_timeout(std::time::Duration::from_secs(10));
    ring.send(Msg::new(4)).unwrap();
    let mut got = Vec::new();
    while got.len() < 5 {
        got.extend(ring.receive_at_least(1).unwrap());
    }
    assert_eq!(got, (0..5).map(Msg::new).collect::<Vec<_>>());
    drop(ring); // closes: the device returns
    assert_eq!(device.join().unwrap(), 5);
}

#[test]
fn a_polled_ring_dropped_under_a_kernel_that_never_returns_does_not_hang() {
    let alloc = host();
    let mut ring = polled(&alloc, 4);
    ring.set_timeout(std::time::Duration::from_millis(20));
    let args = ring.polled_args().unwrap();
    // a "kernel" that attached and then hung
    // SAFETY: the control block holds ctrl::WORDS words; the ring's memory is leaked by the
    // drop below (a kernel is attached), so the store is never to freed memory.
    unsafe {
        (*(args.ctrl as *const std::sync::atomic::AtomicU64).add(ctrl::DEVICE_STATE))
            .store(1, std::sync::atomic::Ordering::Release)
    };
    assert!(ring.device_attached());
    assert!(matches!(ring.close(), Err(Error::Timeout { .. })));
    drop(ring); // logs, leaks the rings, returns
    let again = polled(&alloc, 4); // the allocator is still usable
    assert!(!again.device_attached());
}

#[test]
fn ring_modes_follow_the_devices_visibility() {
    let alloc = host();
    // the host backend models a device with memory of its own: Auto copies
    let r = RingBridge::<Msg>::with_mode(&alloc, Stream::DEFAULT, 8, RingMode::Auto).unwrap();
    assert_eq!(r.mode(), RingMode::Copies);
    assert!(r.polled_args().is_none());
    let p = RingMode::Polled {
        poll: std::time::Duration::from_micros(5),
    };
    let spin = RingMode::Polled {
        poll: gpumem::buffer::ring::DEFAULT_POLL,
    };
    assert_eq!(RingMode::Auto.resolve(true), Ok(spin));
    assert_eq!(RingMode::Auto.resolve(false), Ok(RingMode::Copies));
    assert_eq!(p.resolve(true), Ok(p));
    let e = p.resolve(false).unwrap_err();
    assert!(e.contains("kernel boundaries"), "{e}");
    // on a GPU platform that settles only at kernel boundaries (WSL2), Auto copies
    use gpumem::resource::visibility::{MemoryVisibility, Platform, VisibilityCaps};
    let caps = VisibilityCaps {
        managed_memory: true,
        concurrent_managed_access: true,
        can_map_host_memory: true,
        ..VisibilityCaps::default()
    };
    for (platform, want) in [
        (Platform::Linux, spin),
        (Platform::Wsl2, RingMode::Copies),
        (Platform::Windows, RingMode::Copies),
    ] {
        let v = MemoryVisibility::classify(caps, platform);
        assert_eq!(
            RingMode::Auto.resolve(v.polled_host_memory()),
            Ok(want),
            "{platform:?}"
        );
    }
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Free(usize, bool),
    Complete,
    Empty,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn pinned_pool_invariants_hold(ops in prop::collection::vec(prop_oneof![
        (1usize..300_000).prop_map(Op::Alloc),
        (0usize..16, any::<bool>()).prop_map(|(i, b)| Op::Free(i, b)),
        Just(Op::Complete),
        Just(Op::Empty),
    ], 1..120)) {
        let dev = Arc::new(SimulatedDevice::new(64 << 20));
        dev.set_auto_complete(false);
        let pool = PinnedPool::new(dev.clone());
        let mut live = Vec::new();
        let mut in_flight = std::collections::HashSet::new();
        for op in ops {
            match op {
                Op::Alloc(n) => if let Ok(b) = pool.allocate(n) {
                    prop_assert!(!in_flight.contains(&b.ptr()), "reused a block with a copy in flight");
                    prop_assert!(b.capacity() >= n);
                    live.push(b);
                },
                Op::Free(i, with_copy) => if !live.is_empty() {
                    let b = live.swap_remove(i % live.len());
                    let evs = if with_copy {
                        in_flight.insert(b.ptr());
                        vec![dev.record_event(Stream(1)).unwrap()]
                    } else { vec![] };
                    pool.free(b, evs).unwrap();
                },
                Op::Complete => { dev.complete_events(); in_flight.clear(); },
                Op::Empty => { pool.empty_cache(); },
            }
            prop_assert_eq!(pool.check_invariants(), Ok(()));
        }
        for b in live { pool.free(b, vec![]).unwrap(); }
        dev.complete_events();
        pool.empty_cache();
        prop_assert_eq!(pool.stats().reserved_bytes, 0);
    }
}
