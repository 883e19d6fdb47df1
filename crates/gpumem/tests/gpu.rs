//! GPU tests. They need a CUDA GPU and are ignored by default:
//! `cargo test -p gpumem --test gpu -- --ignored` (or the gpu-bundle's `run`).
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::{CachingAllocator, Config, DeviceBuffer, Error, Stream};
use std::sync::Arc;

const KERNELS: &str = r#"
extern "C" __global__ void fill(unsigned int* out, unsigned int value, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = value ^ (unsigned int)i;
}
// Wait `cycles` clock ticks, then copy `src` to `dst`: a long reader of `src`.
extern "C" __global__ void slow_copy(unsigned int* dst, const unsigned int* src,
                                     unsigned long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

struct Gpu {
    ctx: Arc<CudaContext>,
    fill: CudaFunction,
    slow_copy: CudaFunction,
    saxpy: CudaFunction,
}

fn gpu() -> Gpu {
    assert!(
        gpumem::device::cuda_available(),
        "these tests need a CUDA GPU (run them on the GPU machine)"
    );
    let ctx = gpumem::resource::cuda::primary_context(0).unwrap();
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let m = ctx.load_module(ptx).unwrap();
    Gpu {
        fill: m.load_function("fill").unwrap(),
        slow_copy: m.load_function("slow_copy").unwrap(),
        saxpy: m.load_function("saxpy").unwrap(),
        ctx,
    }
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

fn fill(g: &Gpu, s: &Arc<CudaStream>, buf: &mut DeviceBuffer<u32>, value: u32) {
    let n = buf.len() as u64;
    let mut b = s.launch_builder(&g.fill);
    b.arg(buf).arg(&value).arg(&n);
    // SAFETY: the kernel writes `n` u32s into `buf`, which holds `n`.
    unsafe { b.launch(cfg(n as usize)) }.unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_info_is_sane() {
    let d = &gpumem::device::devices().unwrap()[0];
    assert!(!d.name.is_empty());
    assert!(d.total_memory > 1 << 30 && d.free_memory <= d.total_memory);
    assert!(d.compute_capability.0 >= 6);
    assert!(d.unified_addressing && d.managed_memory && d.memory_pools);
    println!("{d:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trips_keep_data_intact() {
    let _g = gpu();
    for conf in ["", "backend:cudaMallocAsync", "quick_cache:0,shards:1"] {
        let a = CachingAllocator::cuda(0, Config::parse(conf).unwrap()).unwrap();
        let s = Stream::DEFAULT;
        for n in [
            1usize,
            7,
            255,
            256,
            257,
            4095,
            1 << 20,
            (3 << 20) + 5,
            50 << 20,
        ] {
            let data: Vec<u8> = (0..n).map(|i| (i * 31 + n) as u8).collect();
            let b = DeviceBuffer::from_slice(&a, s, &data).unwrap();
            assert_eq!(b.to_vec().unwrap(), data, "{conf}: {n} bytes");
            let mut c = DeviceBuffer::<u8>::zeroed(&a, s, n).unwrap();
            assert!(c.to_vec().unwrap().iter().all(|&x| x == 0));
            c.copy_from_device(&b).unwrap();
            assert_eq!(c.to_vec().unwrap(), data);
            if n > 10 {
                assert_eq!(b.slice(3..10).unwrap().to_vec().unwrap(), &data[3..10]);
                assert_eq!(b.get(n - 1).unwrap(), data[n - 1]);
            }
        }
        let mut f = DeviceBuffer::<f64>::from_slice(&a, s, &[1.5; 1000]).unwrap();
        f.set(999, -2.0).unwrap();
        assert_eq!(f.get(999).unwrap(), -2.0);
        assert!(matches!(f.get(1000), Err(Error::OutOfBounds { .. })));
        drop((f,));
        assert_eq!(a.stats().allocation.all.current, 0);
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_take_gpumem_buffers() {
    let g = gpu();
    let stream = g.ctx.new_stream().unwrap();
    let a = CachingAllocator::cuda(0, Config::default()).unwrap();
    let s = Stream::from(&*stream);
    let n = 1_000_003usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let y0: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let xb = DeviceBuffer::from_slice(&a, s, &x).unwrap();
    let mut yb = DeviceBuffer::from_slice(&a, s, &y0).unwrap();
    let (alpha, nn) = (3.0f32, n as u64);
    let mut l = stream.launch_builder(&g.saxpy);
    l.arg(&mut yb).arg(&xb).arg(&alpha).arg(&nn);
    // SAFETY: both buffers hold n floats.
    unsafe { l.launch(cfg(n)) }.unwrap();
    let y = yb.to_vec().unwrap();
    for i in (0..n).step_by(997) {
        assert_eq!(y[i], 3.0 * x[i] + y0[i]);
    }
    // a sub-slice as an argument
    let mut tail = yb.slice_mut(n - 10..).unwrap();
    let (zero, ten) = (0.0f32, 10u64);
    let mut l = stream.launch_builder(&g.saxpy);
    l.arg(&mut tail).arg(&xb).arg(&zero).arg(&ten);
    // SAFETY: the view holds 10 floats, x more.
    unsafe { l.launch(cfg(10)) }.unwrap();
    assert_eq!(tail.to_vec().unwrap(), y[n - 10..].to_vec());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cudarc_copies_take_gpumem_buffers() {
    let g = gpu();
    let (own, other) = (g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap());
    let a = CachingAllocator::cuda(0, Config::default()).unwrap();
    let data: Vec<u32> = (0..100_003).map(|i| i * 7 + 1).collect();
    let mut b = DeviceBuffer::<u32>::zeroed(&a, Stream::from(&*own), data.len()).unwrap();
    // on the buffer's own stream, then on another one (ordered after the buffer's stream)
    own.memcpy_htod(&data, &mut b.cudarc_mut(&own)).unwrap();
    assert_eq!(own.clone_dtoh(&b.cudarc(&own)).unwrap(), data);
    let back = other.clone_dtoh(&b.cudarc(&other)).unwrap();
    assert_eq!(back, data);
    let twice: Vec<u32> = data.iter().map(|x| x * 2).collect();
    other
        .memcpy_htod(&twice, &mut b.cudarc_mut(&other))
        .unwrap();
    assert_eq!(
        b.to_vec().unwrap(),
        twice,
        "the buffer's stream sees the other stream's write"
    );
}

/// A block freed on stream A while a long kernel on stream B still reads it must not be handed
/// out before B's work completes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn block_in_use_by_another_stream_is_not_reused_early() {
    let g = gpu();
    let (sa, sb) = (g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap());
    let (a_, b_) = (Stream::from(&*sa), Stream::from(&*sb));
    let n = 1 << 20;
    let cycles: i64 = 200_000_000; // ~100 ms at H100 clocks
    let alloc =
        CachingAllocator::cuda(0, Config::parse("cross_stream_reuse:false").unwrap()).unwrap();
    for record in [true, false] {
        let mut x = DeviceBuffer::<u32>::alloc(&alloc, a_, n).unwrap();
        fill(&g, &sa, &mut x, 0x1111_1111);
        sa.synchronize().unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(&alloc, b_, n).unwrap();
        let (nn, c) = (n as u64, cycles);
        let mut l = sb.launch_builder(&g.slow_copy);
        l.arg(&mut out).arg(&x).arg(&nn).arg(&c);
        // SAFETY: both buffers hold n u32s.
        unsafe { l.launch(cfg(n)) }.unwrap();
        if record {
            x.record_stream(b_).unwrap();
        }
        let old = x.device_ptr();
        drop(x); // freed on A while B's kernel still has to read it
        let mut z = DeviceBuffer::<u32>::alloc(&alloc, a_, n).unwrap();
        fill(&g, &sa, &mut z, 0x2222_2222); // runs on A at once, concurrently with B
        sb.synchronize().unwrap();
        sa.synchronize().unwrap();
        let got = out.to_vec().unwrap();
        let bad = got
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v != 0x1111_1111 ^ i as u32)
            .count();
        if record {
            assert_ne!(
                z.device_ptr(),
                old,
                "the recorded block must not be reused yet"
            );
            assert_eq!(bad, 0, "B read {bad} corrupted words");
            assert_eq!(alloc.stats().num_deferred_frees, 1);
        } else {
            // control: without record_stream the block is reused at once, and B may read
            // A's new data: this shows the test can see corruption
            assert_eq!(z.device_ptr(), old);
            println!("control without record_stream: {bad} of {n} words corrupted");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn oom_under_a_memory_fraction_recovers() {
    let _g = gpu();
    let a = CachingAllocator::cuda(0, Config::parse("memory_fraction:0.05").unwrap()).unwrap();
    let limit = a.backend().limit().unwrap();
    let chunk = 256usize << 20;
    let mut held = Vec::new();
    let err = loop {
        match a.allocate(Stream::DEFAULT, chunk, 256) {
            Ok(x) => held.push(x),
            Err(e) => break e,
        }
        assert!(held.len() < 1000, "the budget never bit");
    };
    let Error::OutOfMemory(r) = &err else {
        panic!("expected OOM, got {err}")
    };
    assert_eq!(r.limit, Some(limit));
    assert!(r.reserved <= limit && r.reserved + chunk as u64 > limit);
    println!("{err}");
    assert_eq!(a.stats().num_ooms, 1);
    // free half, and the same request succeeds: the pool is still usable
    for x in held.drain(..held.len() / 2) {
        a.deallocate(x).unwrap();
    }
    let y = a.allocate(Stream::DEFAULT, chunk, 256).unwrap();
    a.deallocate(y).unwrap();
    for x in held {
        a.deallocate(x).unwrap();
    }
    print!("{}", a.memory_summary());
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_with_their_own_streams() {
    let g = gpu();
    let a = CachingAllocator::cuda(0, Config::default()).unwrap();
    std::thread::scope(|sc| {
        for t in 0..8u32 {
            let (a, g) = (&a, &g);
            sc.spawn(move || {
                let stream = g.ctx.new_stream().unwrap();
                let s = Stream::from(&*stream);
                for i in 0..200u32 {
                    let n = 1 + ((t as usize * 7919 + i as usize * 104_729) % 300_000);
                    let mut b = DeviceBuffer::<u32>::alloc(a, s, n).unwrap();
                    fill(g, &stream, &mut b, t << 16 | i);
                    let v = b.to_vec().unwrap();
                    assert!(v
                        .iter()
                        .enumerate()
                        .all(|(k, &x)| x == (t << 16 | i) ^ k as u32));
                }
            });
        }
    });
    assert_eq!(a.stats().allocation.all.current, 0);
}
