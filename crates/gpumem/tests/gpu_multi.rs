//! Two-GPU tests: per-device pools, peer copies, peer access to virtual-memory pages, one
//! thread per device. They need two CUDA GPUs and are ignored by default:
//! `cargo test -p gpumem --test gpu_multi -- --ignored` (gpu-bundle/run-multi).
#![cfg(feature = "cuda")]

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpumem::resource::cuda::pointer_device;
use gpumem::{Config, DeviceBuffer, DeviceSet, Stream};
use rand::{Rng, SeedableRng};

fn two() -> DeviceSet {
    let n = gpumem::device::device_count();
    assert!(n >= 2, "these tests need two CUDA GPUs (found {n})");
    DeviceSet::new(Config::default())
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(9) as u8 ^ salt)
        .collect()
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn each_device_gets_memory_only_from_its_own_pool() {
    let set = two();
    let info = gpumem::device::devices().unwrap();
    println!(
        "peer matrix: {:?}",
        info.iter()
            .map(|d| (d.ordinal, d.peer_access.clone()))
            .collect::<Vec<_>>()
    );
    for d in 0..2 {
        let a = set.device(d).unwrap();
        let blocks: Vec<_> = [1usize, 4096, 1 << 20, 3 << 20, 100 << 20]
            .iter()
            .map(|&b| a.allocate(Stream::DEFAULT, b, 256).unwrap())
            .collect();
        for b in &blocks {
            assert_eq!(pointer_device(b.ptr()).unwrap(), d, "block of device {d}");
        }
        for b in blocks {
            a.deallocate(b).unwrap();
        }
        a.check_invariants().unwrap();
    }
    assert!(set.allocator(2).is_err() || gpumem::device::device_count() > 2);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn peer_copies_keep_data_at_odd_sizes() {
    let set = two();
    let c0 = gpumem::resource::cuda::primary_context(0).unwrap();
    let c1 = gpumem::resource::cuda::primary_context(1).unwrap();
    let (s0, s1) = (c0.new_stream().unwrap(), c1.new_stream().unwrap());
    let (a0, a1) = (set.device(0).unwrap(), set.device(1).unwrap());
    // before peer access: a clear error, not a driver failure
    {
        let src = DeviceBuffer::from_slice(a0, Stream::from(&*s0), &pattern(4097, 1)).unwrap();
        let mut dst = DeviceBuffer::<u8>::zeroed(a1, Stream::from(&*s1), 4097).unwrap();
        match dst.copy_from_device(&src) {
            Err(e) => assert!(e.to_string().contains("enable_peer_access"), "{e}"),
            Ok(()) => {
                // legacy memory may still be copied through the host; then it must be right
                assert!(dst.to_vec().unwrap() == pattern(4097, 1));
            }
        }
    }
    set.enable_peer_access(0, 1).unwrap();
    set.enable_peer_access(1, 0).unwrap();
    for len in [1usize, 4095, 4097, (1 << 20) + 3, (64 << 20) + 5] {
        for (from, to) in [(0usize, 1usize), (1, 0)] {
            let (af, at) = (set.device(from).unwrap(), set.device(to).unwrap());
            let (sf, st) = if from == 0 { (&s0, &s1) } else { (&s1, &s0) };
            let want = pattern(len, from as u8 + 7);
            let src = DeviceBuffer::from_slice(af, Stream::from(&**sf), &want).unwrap();
            // at an odd offset on the destination
            let mut dst = DeviceBuffer::<u8>::zeroed(at, Stream::from(&**st), len + 3).unwrap();
            dst.slice_mut(3..)
                .unwrap()
                .copy_from_device(&src.slice(..).unwrap())
                .unwrap();
            assert!(
                dst.slice(3..).unwrap().to_vec().unwrap() == want,
                "{len} bytes {from}->{to}"
            );
            assert_eq!(dst.get(2).unwrap(), 0);
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_kernel_on_one_device_reads_the_others_virtual_memory_pages() {
    let set = two();
    let a0 = set.device(0).unwrap();
    assert!(
        a0.expandable(),
        "device 0 should use virtual-memory segments"
    );
    let c0 = gpumem::resource::cuda::primary_context(0).unwrap();
    let c1 = gpumem::resource::cuda::primary_context(1).unwrap();
    let (s0, s1) = (c0.new_stream().unwrap(), c1.new_stream().unwrap());
    let n = 3 << 20;
    let x: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(7)).collect();
    // allocated before peer access: its pages get the peer's access when it is enabled
    let src = DeviceBuffer::from_slice(a0, Stream::from(&*s0), &x).unwrap();
    set.enable_peer_access(1, 0).unwrap();
    let late = DeviceBuffer::from_slice(a0, Stream::from(&*s0), &x).unwrap(); // mapped after
    let f = c1
        .load_module(
            cudarc::nvrtc::compile_ptx(
                r#"extern "C" __global__ void copy(unsigned int* d, const unsigned int* s,
                   unsigned long long n) {
                   unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
                   if (i < n) d[i] = s[i] + 1; }"#,
            )
            .unwrap(),
        )
        .unwrap()
        .load_function("copy")
        .unwrap();
    let a1 = set.device(1).unwrap();
    for buf in [&src, &late] {
        let mut out = DeviceBuffer::<u32>::zeroed(a1, Stream::from(&*s1), n).unwrap();
        let (p, nn) = (buf.device_ptr(), n as u64);
        let mut l = s1.launch_builder(&f);
        l.arg(&mut out).arg(&p).arg(&nn);
        // SAFETY: `out` holds n u32s on device 1; `p` addresses n u32s on device 0 that
        // device 1 may access (peer access and page access granted).
        unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
        let got = out.to_vec().unwrap();
        assert!(got.iter().zip(&x).all(|(g, w)| *g == w + 1));
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn one_thread_per_device_stress() {
    let set = two();
    set.enable_peer_access(0, 1).unwrap();
    set.enable_peer_access(1, 0).unwrap();
    std::thread::scope(|s| {
        for d in 0..2usize {
            let set = &set;
            s.spawn(move || {
                let ctx = gpumem::resource::cuda::primary_context(d).unwrap();
                let st = ctx.new_stream().unwrap();
                let stream = Stream::from(&*st);
                // the other device's buffers are ordered on a stream of the other device
                let octx = gpumem::resource::cuda::primary_context(1 - d).unwrap();
                let ost = octx.new_stream().unwrap();
                let ostream = Stream::from(&*ost);
                let a = set.device(d).unwrap();
                let other = set.device(1 - d).unwrap();
                let mut rng = rand::rngs::SmallRng::seed_from_u64(d as u64);
                let mut live: Vec<DeviceBuffer<u8>> = Vec::new();
                for i in 0..3000 {
                    if live.len() < 64 && rng.random_bool(0.6) {
                        let len = 1 << rng.random_range(8..24);
                        let b =
                            DeviceBuffer::from_slice(a, stream, &vec![d as u8 + 1; len]).unwrap();
                        live.push(b);
                    } else if !live.is_empty() {
                        let b = live.swap_remove(rng.random_range(0..live.len()));
                        if i % 50 == 0 {
                            // a peer copy to the other device, checked
                            let mut o =
                                DeviceBuffer::<u8>::zeroed(other, ostream, b.len()).unwrap();
                            o.copy_from_device(&b).unwrap();
                            assert!(o.to_vec().unwrap().iter().all(|&v| v == d as u8 + 1));
                        }
                    }
                }
                drop(live);
                a.check_invariants().unwrap();
            });
        }
    });
}
