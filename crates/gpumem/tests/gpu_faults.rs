//! Kernels over automatically prefetched unified buffers take no GPU page faults, counted by
//! CUPTI (libcupti must be on LD_LIBRARY_PATH). Its own test binary, because CUPTI's
//! unified-memory counters start before the CUDA context. Ignored without a GPU:
//! `cargo test -p gpumem --test gpu_faults -- --ignored`.
#![cfg(all(feature = "cuda", feature = "cupti"))]

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gpumem::profile::UmCounter;
use gpumem::resource::cuda::CudaManaged;
use gpumem::Device;
use gpumem::{Config, Placement, Resource, Stream, StreamOps, UnifiedBuffer, UnifiedMemory};

const AXPY: &str = r#"
extern "C" __global__ void axpy(float* y, const float* x, float a, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}"#;

#[test]
#[ignore = "needs a CUDA GPU and libcupti"]
fn kernels_over_prefetched_unified_buffers_take_no_page_faults() {
    assert!(gpumem::device::cuda_available(), "needs a CUDA GPU");
    let counter = UmCounter::start(0).expect("CUPTI unified-memory counters");
    let ctx = gpumem::resource::cuda::primary_context(0).unwrap();
    let st = ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let f = ctx
        .load_module(cudarc::nvrtc::compile_ptx(AXPY).unwrap())
        .unwrap()
        .load_function("axpy")
        .unwrap();
    let n: usize = 16 << 20; // 64 MiB per array
    let launch = |y: u64, x: u64| {
        let (a, nn) = (2.0f32, n as u64);
        let mut l = st.launch_builder(&f);
        l.arg(&y).arg(&x).arg(&a).arg(&nn);
        // SAFETY: both addresses hold n floats.
        unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
        st.synchronize().unwrap();
    };

    // control: raw managed memory written on the host faults when a kernel touches it
    let m = CudaManaged::new(0).unwrap();
    let (mx, my) = (
        m.allocate(s, n * 4, 4096).unwrap(),
        m.allocate(s, n * 4, 4096).unwrap(),
    );
    // SAFETY: fresh managed blocks of n floats; no kernel runs meanwhile.
    unsafe {
        std::slice::from_raw_parts_mut(mx as *mut f32, n).fill(1.0);
        std::slice::from_raw_parts_mut(my as *mut f32, n).fill(0.0);
    }
    let before = counter.read_settled().unwrap();
    launch(my, mx);
    let raw = counter.read_settled().unwrap() - before;
    println!("raw managed, left on the host: {raw:?}");
    // the control: pages migrate on demand while the kernel runs (CUPTI does not always
    // deliver the fault-group records; the migrations they cause are always counted)
    assert!(
        raw.gpu_page_faults > 0 || raw.bytes_htod > 0,
        "the control kernel should fault: {raw:?}"
    );
    m.deallocate(mx, n * 4, s).unwrap();
    m.deallocate(my, n * 4, s).unwrap();

    // gpumem's unified buffers, both placements, prefetched by the views
    let alloc = Device::cuda(0, Config::default()).unwrap();
    for p in [Placement::Managed, Placement::Mirrored] {
        let mem = UnifiedMemory::new(&alloc, p).unwrap();
        for len in [1000usize, n] {
            // small buffers migrate pages; large ones copy through a pinned shadow
            let mut x = UnifiedBuffer::from_slice(&mem, s, &vec![1.0f32; len]).unwrap();
            let mut y = UnifiedBuffer::<f32>::zeroed(&mem, s, len).unwrap();
            y.host_mut().unwrap().fill(3.0);
            let (yp, xp) = {
                let (xv, yv) = (x.device(s).unwrap(), y.device_mut(s).unwrap());
                (yv.device_ptr(), xv.device_ptr())
            };
            alloc.synchronize(s).unwrap(); // the prefetch has landed
            let before = counter.read_settled().unwrap();
            let (a, nn) = (2.0f32, len as u64);
            let mut l = st.launch_builder(&f);
            l.arg(&yp).arg(&xp).arg(&a).arg(&nn);
            // SAFETY: both buffers hold `len` floats.
            unsafe { l.launch(LaunchConfig::for_num_elems(len as u32)) }.unwrap();
            st.synchronize().unwrap();
            let during = counter.read_settled().unwrap() - before;
            println!("{p:?}, {len} floats, kernel: {during:?}");
            assert_eq!(during.gpu_page_faults, 0, "{p:?} {len}: {during:?}");
            assert_eq!(
                during.bytes_htod, 0,
                "{p:?} {len}: migrated during the kernel"
            );
            assert_eq!(y.host().unwrap()[len - 1], 5.0);
        }
    }
    let total = counter.stop().unwrap();
    println!("whole test: {total:?}");
}
