//! Unified buffers on the host backend: the mirrored placement (a "device" block and a host
//! mirror, here both host memory) with the same coherence rules as on a GPU. Device views are
//! "run" by touching the view's address, as a kernel would.

use gpumem::Device;
use gpumem::{Advice, Config, Placement, Stream, StreamOps, UnifiedBuffer, UnifiedMemory};
use proptest::prelude::*;

fn mem() -> UnifiedMemory {
    let alloc = Device::host(Config::default()).unwrap();
    UnifiedMemory::new(&alloc, Placement::Auto).unwrap()
}

/// A "kernel" on the host backend: reads the view's memory.
fn kernel_read(view: &gpumem::buffer::unified::DeviceView<'_, u32>) -> Vec<u32> {
    // SAFETY: on the host backend the device address is host memory of `len` u32s, alive for
    // the view.
    unsafe { std::slice::from_raw_parts(view.device_ptr() as *const u32, view.len()) }.to_vec()
}

/// A "kernel" that writes `f(i)` into element i of `range`.
fn kernel_write(
    view: &gpumem::buffer::unified::DeviceView<'_, u32>,
    range: std::ops::Range<usize>,
    f: impl Fn(usize) -> u32,
) {
    // SAFETY: as in `kernel_read`; the view is the only access to the buffer while it lives.
    let d = unsafe { std::slice::from_raw_parts_mut(view.device_ptr() as *mut u32, view.len()) };
    for i in range {
        d[i] = f(i);
    }
}

#[test]
fn host_backend_picks_the_mirrored_placement() {
    let m = mem();
    assert_eq!(m.placement(), Placement::Mirrored);
    let alloc = Device::host(Config::default()).unwrap();
    assert!(UnifiedMemory::new(&alloc, Placement::Managed).is_err());
}

#[test]
fn auto_placement_follows_each_platforms_visibility() {
    use gpumem::resource::visibility::{MemoryVisibility, Platform, VisibilityCaps};
    // an H100-like discrete GPU, on each platform
    let caps = VisibilityCaps {
        managed_memory: true,
        concurrent_managed_access: true,
        can_map_host_memory: true,
        ..VisibilityCaps::default()
    };
    let on = |p| MemoryVisibility::classify(caps, p);
    assert_eq!(
        Placement::Auto.resolve(on(Platform::Linux)),
        Ok(Placement::Managed)
    );
    for p in [Platform::Wsl2, Platform::Windows] {
        assert_eq!(Placement::Auto.resolve(on(p)), Ok(Placement::Mirrored));
        let e = Placement::Managed.resolve(on(p)).unwrap_err();
        assert!(e.contains("kernel boundaries"), "{e}");
        assert_eq!(Placement::Mirrored.resolve(on(p)), Ok(Placement::Mirrored));
    }
    let none = MemoryVisibility::classify(VisibilityCaps::default(), Platform::Linux);
    assert_eq!(Placement::Auto.resolve(none), Ok(Placement::Mirrored));
    assert!(Placement::Managed
        .resolve(none)
        .unwrap_err()
        .contains("only through copies"));
    // the host backend models a device with memory of its own
    let alloc = Device::host(Config::default()).unwrap();
    assert_eq!(alloc.visibility(), MemoryVisibility::ExplicitCopies);
}

#[test]
fn views_for_another_device_need_the_managed_placement() {
    let m = mem();
    let mut b = UnifiedBuffer::from_slice(&m, Stream::DEFAULT, &[1u32, 2, 3]).unwrap();
    for d in [0, 1] {
        let e = b.device_on(d, Stream::DEFAULT).unwrap_err();
        assert!(e.to_string().contains("mirrored"), "{e}");
    }
    assert!(b.shared_with().is_empty());
    // the buffer is still usable
    assert_eq!(&*b.host().unwrap(), &[1, 2, 3]);
}

#[test]
fn cpu_write_then_device_read() {
    let m = mem();
    let s = Stream::DEFAULT;
    let mut b = UnifiedBuffer::<u32>::zeroed(&m, s, 1000).unwrap();
    b.host_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = i as u32 * 3);
    assert!(!b.is_device_valid());
    let v = b.device(s).unwrap();
    assert_eq!(
        kernel_read(&v),
        (0..1000).map(|i| i * 3).collect::<Vec<_>>()
    );
}

#[test]
fn device_write_then_cpu_read() {
    let m = mem();
    let s = Stream::DEFAULT;
    let mut b = UnifiedBuffer::<u32>::zeroed(&m, s, 513).unwrap();
    let v = b.device_mut(s).unwrap();
    kernel_write(&v, 0..513, |i| i as u32 + 7);
    assert!(!b.is_host_valid());
    assert_eq!(b.host().unwrap()[512], 519);
    assert!(b.is_host_valid() && b.is_device_valid());
}

#[test]
fn cpu_write_device_write_cpu_read() {
    let m = mem();
    let s = Stream::DEFAULT;
    let mut b = UnifiedBuffer::from_slice(&m, s, &[1u32; 64]).unwrap();
    let v = b.device_mut(s).unwrap();
    let seen = kernel_read(&v);
    assert!(seen.iter().all(|&x| x == 1), "device saw stale data");
    kernel_write(&v, 0..64, |i| seen[i] + i as u32);
    let h = b.host().unwrap();
    assert_eq!(h[0], 1);
    assert_eq!(h[63], 64);
}

#[test]
fn two_streams_on_disjoint_halves() {
    let alloc = Device::host(Config::default()).unwrap();
    let m = UnifiedMemory::new(&alloc, Placement::Mirrored).unwrap();
    let (a, bstream) = (
        alloc.create_stream().unwrap(),
        alloc.create_stream().unwrap(),
    );
    let mut b = UnifiedBuffer::<u32>::zeroed(&m, a, 200).unwrap();
    {
        let v = b.device_mut(a).unwrap();
        kernel_write(&v, 0..100, |i| i as u32);
    }
    {
        let v = b.device_mut(bstream).unwrap();
        kernel_write(&v, 100..200, |i| 1000 + i as u32);
    }
    let h = b.host().unwrap();
    assert_eq!(h[99], 99);
    assert_eq!(h[100], 1100);
    assert_eq!(h[199], 1199);
}

#[test]
fn arrays_of_floats_are_elements() {
    let m = mem();
    let rows: Vec<[f32; 768]> = (0..10).map(|r| [r as f32; 768]).collect();
    let mut b = UnifiedBuffer::from_slice(&m, Stream::DEFAULT, &rows).unwrap();
    assert_eq!(b.len(), 10);
    assert_eq!(b.host().unwrap()[7][767], 7.0);
}

#[test]
fn read_mostly_is_advised_automatically_and_the_user_overrides_it() {
    let m = mem();
    let s = Stream::DEFAULT;
    let mut b = UnifiedBuffer::from_slice(&m, s, &[5u32; 10]).unwrap();
    b.device(s).unwrap();
    assert!(!b.access_pattern().read_mostly);
    b.device(s).unwrap();
    assert!(b.access_pattern().read_mostly, "host-written, kernel-read");
    b.device_mut(s).unwrap();
    assert!(
        !b.access_pattern().read_mostly,
        "kernels write it after all"
    );
    b.advise(Advice::ReadMostly(true)).unwrap();
    b.device_mut(s).unwrap();
    assert!(b.access_pattern().read_mostly, "user advice stands");
    assert!(b.access_pattern().user_advice);
}

#[test]
fn bad_sizes_are_errors() {
    let m = mem();
    assert!(UnifiedBuffer::<u32>::zeroed(&m, Stream::DEFAULT, 0).is_err());
    assert!(UnifiedBuffer::<u64>::zeroed(&m, Stream::DEFAULT, usize::MAX / 4).is_err());
    UnifiedBuffer::<u8>::zeroed(&m, Stream::DEFAULT, 1).unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    HostWrite(usize, u32),
    HostRead(usize),
    DeviceWrite(bool, usize, u32),
    DeviceRead(bool, usize),
    PrefetchDevice(bool),
    PrefetchHost(bool),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_access_sequences_stay_coherent(ops in prop::collection::vec(prop_oneof![
        (0usize..300, any::<u32>()).prop_map(|(i, v)| Op::HostWrite(i, v)),
        (0usize..300).prop_map(Op::HostRead),
        (any::<bool>(), 0usize..300, any::<u32>()).prop_map(|(s, i, v)| Op::DeviceWrite(s, i, v)),
        (any::<bool>(), 0usize..300).prop_map(|(s, i)| Op::DeviceRead(s, i)),
        any::<bool>().prop_map(Op::PrefetchDevice),
        any::<bool>().prop_map(Op::PrefetchHost),
    ], 1..60)) {
        let alloc = Device::host(Config::default()).unwrap();
        let m = UnifiedMemory::new(&alloc, Placement::Mirrored).unwrap();
        let streams = [alloc.create_stream().unwrap(), alloc.create_stream().unwrap()];
        let st = |s: bool| streams[s as usize];
        let mut b = UnifiedBuffer::<u32>::zeroed(&m, streams[0], 300).unwrap();
        let mut model = vec![0u32; 300];
        for op in ops {
            match op {
                Op::HostWrite(i, v) => { b.host_mut().unwrap()[i] = v; model[i] = v; }
                Op::HostRead(i) => prop_assert_eq!(b.host().unwrap()[i], model[i]),
                Op::DeviceWrite(s, i, v) => {
                    let view = b.device_mut(st(s)).unwrap();
                    kernel_write(&view, i..i + 1, |_| v);
                    model[i] = v;
                }
                Op::DeviceRead(s, i) => {
                    let view = b.device(st(s)).unwrap();
                    prop_assert_eq!(kernel_read(&view)[i], model[i]);
                }
                Op::PrefetchDevice(s) => b.prefetch_to_device(st(s)).unwrap(),
                Op::PrefetchHost(s) => b.prefetch_to_host(st(s)).unwrap(),
            }
        }
        prop_assert_eq!(&*b.host().unwrap(), &model[..]);
    }
}
