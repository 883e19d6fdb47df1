//! A unified buffer read by kernels on two GPUs without page faults (accessed-by advice for
//! the second device), counted by CUPTI on both devices. Its own test binary, because CUPTI's
//! unified-memory counters start before the CUDA contexts. Needs two CUDA GPUs and libcupti:
//! `cargo test -p gpumem --test gpu_multi_unified -- --ignored` (gpu-bundle/run-multi).
#![cfg(all(feature = "cuda", feature = "cupti"))]

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::profile::UmCounter;
use gpumem::resource::cuda::CudaManaged;
use gpumem::resource::ManagedMemory;
use gpumem::Advice;
use gpumem::{
    Config, DeviceBuffer, DeviceSet, MemPlace, Placement, Resource, Stream, UnifiedBuffer,
    UnifiedMemory,
};
use std::sync::Arc;

/// y[i] = a * x[i]: reads the shared buffer, writes the device's own memory.
const SCALE: &str = r#"
extern "C" __global__ void scale(float* y, const float* x, float a, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = a * x[i];
}"#;

struct Dev {
    st: Arc<CudaStream>,
    f: CudaFunction,
}

impl Dev {
    fn new(ordinal: usize) -> Dev {
        let ctx = gpumem::resource::cuda::primary_context(ordinal).unwrap();
        let f = ctx
            .load_module(cudarc::nvrtc::compile_ptx(SCALE).unwrap())
            .unwrap()
            .load_function("scale")
            .unwrap();
        Dev {
            st: ctx.new_stream().unwrap(),
            f,
        }
    }
    fn stream(&self) -> Stream {
        Stream::from(&*self.st)
    }
    /// y = a * x over n floats, waited for.
    fn scale(&self, y: u64, x: u64, a: f32, n: usize) {
        let nn = n as u64;
        let mut l = self.st.launch_builder(&self.f);
        l.arg(&y).arg(&x).arg(&a).arg(&nn);
        let cfg = LaunchConfig {
            grid_dim: (528, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `y` and `x` address at least `n` floats the device can reach (its own
        // memory; managed memory it has a mapping of).
        unsafe { l.launch(cfg) }.unwrap();
        self.st.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and libcupti"]
fn a_unified_buffer_is_read_by_kernels_on_two_devices_without_faults() {
    let count = gpumem::device::device_count();
    assert!(count >= 2, "this test needs two CUDA GPUs (found {count})");
    let counter = UmCounter::start_devices(&[0, 1]).expect("CUPTI unified-memory counters");
    let (d0, d1) = (Dev::new(0), Dev::new(1));
    let set = DeviceSet::new(Config::default());
    let n: usize = 8 << 20; // 32 MiB of floats
    let want: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();

    // control: raw managed memory resident on device 0, no advice: device 1's kernel faults
    // (its pages migrate, or are mapped, on demand)
    let m = CudaManaged::new(0).unwrap();
    let raw = m.allocate(d0.stream(), n * 4, 4096).unwrap();
    // SAFETY: a fresh managed block of n floats; no kernel runs yet.
    unsafe { std::slice::from_raw_parts_mut(raw as *mut f32, n) }.copy_from_slice(&want);
    // SAFETY: the range is the block just allocated.
    unsafe { m.prefetch(raw, n * 4, MemPlace::Device(0), d0.stream()) }.unwrap();
    d0.st.synchronize().unwrap();
    let y1 = DeviceBuffer::<f32>::zeroed(set.device(1).unwrap(), d1.stream(), n).unwrap();
    let before = counter.read_settled().unwrap();
    d1.scale(y1.device_ptr(), raw, 1.0, n);
    let control = counter.read_settled().unwrap() - before;
    println!("control, raw managed on device 0 read by device 1: {control:?}");
    assert!(
        control.gpu_page_faults > 0 || control.bytes_dtod > 0 || control.bytes_htod > 0,
        "the control kernel should fault: {control:?}"
    );
    assert!(y1.to_vec().unwrap() == want);
    m.deallocate(raw, n * 4, d0.stream()).unwrap();

    // gpumem: a managed unified buffer of device 0, written on the host, read by a kernel on
    // each device
    let mem = UnifiedMemory::new(set.device(0).unwrap(), Placement::Managed).unwrap();
    // small buffers migrate pages; large ones keep them on device 0 behind a shadow; with
    // gpumem's own advice, read by kernels only, they become read-mostly after two reads (the
    // peer then gets a read-only copy); with the user's advice (not read-mostly) the peer
    // keeps reading device 0's pages in place, also after they went to the host and back
    for (len, user_advice) in [(1000usize, false), (1000, true), (n, false), (n, true)] {
        let mut x = UnifiedBuffer::from_slice(&mem, d0.stream(), &want[..len]).unwrap();
        if user_advice {
            x.advise(Advice::ReadMostly(false)).unwrap();
        }
        let y0 = DeviceBuffer::<f32>::zeroed(set.device(0).unwrap(), d0.stream(), len).unwrap();
        let y1 = DeviceBuffer::<f32>::zeroed(set.device(1).unwrap(), d1.stream(), len).unwrap();
        for round in 0..3 {
            let xp0 = x.device(d0.stream()).unwrap().device_ptr();
            d0.st.synchronize().unwrap(); // the prefetch has landed
            let before = counter.read_settled().unwrap();
            d0.scale(y0.device_ptr(), xp0, 2.0, len);
            let on0 = counter.read_settled().unwrap() - before;
            let before = counter.read_settled().unwrap();
            let xp1 = x.device_on(1, d1.stream()).unwrap().device_ptr();
            assert_eq!(xp0, xp1, "one buffer, one address");
            d1.st.synchronize().unwrap();
            let view = counter.read_settled().unwrap() - before;
            let before = counter.read_settled().unwrap();
            d1.scale(y1.device_ptr(), xp1, 3.0, len);
            let on1 = counter.read_settled().unwrap() - before;
            println!(
                "{len} floats, user advice {user_advice}, round {round}: read-mostly {}; \
                 device 0 kernel {on0:?}; device 1 view (prefetch) {view:?}; device 1 kernel \
                 {on1:?}",
                x.access_pattern().read_mostly
            );
            assert_eq!(on0.gpu_page_faults, 0, "device 0 faulted: {on0:?}");
            assert_eq!(on1.gpu_page_faults, 0, "device 1 faulted: {on1:?}");
            assert_eq!(
                on1.bytes_htod + on1.bytes_dtoh + on1.bytes_dtod,
                0,
                "pages moved while device 1 read: {on1:?}"
            );
            let (g0, g1) = (y0.to_vec().unwrap(), y1.to_vec().unwrap());
            assert!(g0.iter().zip(&want).all(|(g, w)| *g == 2.0 * w), "device 0");
            assert!(g1.iter().zip(&want).all(|(g, w)| *g == 3.0 * w), "device 1");
            // the host can still write it between rounds; the next views move it back
            x.host_mut().unwrap()[0] = want[0];
        }
        assert_eq!(x.shared_with(), &[1]);
        assert_eq!(x.host().unwrap()[len - 1], want[len - 1]);
    }
    // a device view for a device that does not exist is an error, not a driver failure
    let mut x = UnifiedBuffer::<f32>::zeroed(&mem, d0.stream(), 16).unwrap();
    assert!(x.device_on(count + 3, d1.stream()).is_err());
    x.advise(Advice::AccessedBy(1, false)).unwrap();
    assert!(x.shared_with().is_empty());
    let total = counter.stop().unwrap();
    println!("whole test: {total:?}");
}
