//! GPU tests of unified buffers, on both placements: coherence patterns through real kernels,
//! equal results between placements, and the managed-memory guard. Ignored without a GPU:
//! `cargo test -p gpumem --test gpu_unified -- --ignored`.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::buffer::unified::DeviceView;
use gpumem::Device;
use gpumem::{Config, Error, Placement, Resource, Stream, UnifiedBuffer, UnifiedMemory};
use std::sync::Arc;

const KERNELS: &str = r#"
extern "C" __global__ void scale_add(unsigned int* out, const unsigned int* in, unsigned int a,
                                     unsigned int b, unsigned long long lo, unsigned long long hi) {
    unsigned long long i = lo + blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < hi) out[i] = a * in[i] + b;
}
"#;

struct Gpu {
    ctx: Arc<CudaContext>,
    scale_add: CudaFunction,
}

fn gpu() -> Gpu {
    assert!(
        gpumem::device::cuda_available(),
        "these tests need a CUDA GPU"
    );
    let ctx = gpumem::resource::cuda::primary_context(0).unwrap();
    let m = ctx
        .load_module(cudarc::nvrtc::compile_ptx(KERNELS).unwrap())
        .unwrap();
    Gpu {
        scale_add: m.load_function("scale_add").unwrap(),
        ctx,
    }
}

/// out[lo..hi] = a * in[lo..hi] + b on `st`.
#[allow(clippy::too_many_arguments)]
fn scale_add(
    g: &Gpu,
    st: &Arc<CudaStream>,
    out: &DeviceView<'_, u32>,
    input: &DeviceView<'_, u32>,
    a: u32,
    b: u32,
    lo: usize,
    hi: usize,
) {
    let (lo64, hi64) = (lo as u64, hi as u64);
    let mut l = st.launch_builder(&g.scale_add);
    l.arg(out).arg(input).arg(&a).arg(&b).arg(&lo64).arg(&hi64);
    // SAFETY: both views hold at least `hi` u32s.
    unsafe { l.launch(LaunchConfig::for_num_elems((hi - lo) as u32)) }.unwrap();
}

fn placements() -> Vec<Placement> {
    vec![Placement::Managed, Placement::Mirrored]
}

fn mem(p: Placement) -> UnifiedMemory {
    let alloc = Device::cuda(0, Config::default()).unwrap();
    UnifiedMemory::new(&alloc, p).unwrap()
}

/// One pipeline on one placement: CPU write -> kernel read+write -> CPU read -> CPU write ->
/// kernel (second stream, other half) -> CPU read. Returns the final host contents.
fn pipeline(g: &Gpu, p: Placement, n: usize) -> Vec<u32> {
    let m = mem(p);
    assert_eq!(m.placement(), p);
    let (sa, sb) = (g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap());
    let (a, b) = (Stream::from(&*sa), Stream::from(&*sb));
    let mut x = UnifiedBuffer::<u32>::zeroed(&m, a, n).unwrap();
    let mut y = UnifiedBuffer::<u32>::zeroed(&m, a, n).unwrap();
    // CPU write -> GPU read
    x.host_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = i as u32);
    {
        let (xv, yv) = (x.device(a).unwrap(), y.device_mut(a).unwrap());
        scale_add(g, &sa, &yv, &xv, 3, 1, 0, n);
    }
    // GPU write -> CPU read
    {
        let h = y.host().unwrap();
        assert!(
            h.iter().enumerate().all(|(i, &v)| v == 3 * i as u32 + 1),
            "{p:?}"
        );
    }
    // CPU write -> GPU write (two streams, disjoint halves) -> CPU read
    y.host_mut().unwrap()[0] = 1_000_000;
    {
        let (xv, yv) = (x.device(a).unwrap(), y.device_mut(a).unwrap());
        scale_add(g, &sa, &yv, &xv, 5, 0, n / 2, n);
    }
    {
        let (xv, yv) = (x.device(b).unwrap(), y.device_mut(b).unwrap());
        scale_add(g, &sb, &yv, &xv, 7, 0, 1, n / 2);
    }
    let out = y.host().unwrap().to_vec();
    assert_eq!(out[0], 1_000_000, "{p:?}: the host write was lost");
    assert!(
        x.access_pattern().read_mostly,
        "{p:?}: x is host-written, kernel-read"
    );
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn coherence_patterns_hold_and_placements_agree() {
    let g = gpu();
    let n = (3 << 20) + 5;
    let results: Vec<Vec<u32>> = placements()
        .into_iter()
        .map(|p| pipeline(&g, p, n))
        .collect();
    let want: Vec<u32> = (0..n)
        .map(|i| match i {
            0 => 1_000_000,
            i if i < n / 2 => 7 * i as u32,
            i => 5 * i as u32,
        })
        .collect();
    for r in &results {
        assert!(*r == want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn explicit_prefetches_keep_data() {
    let g = gpu();
    for p in placements() {
        let m = mem(p);
        let st = g.ctx.new_stream().unwrap();
        let s = Stream::from(&*st);
        let data: Vec<[f32; 768]> = (0..100).map(|r| [r as f32 * 0.5; 768]).collect();
        let mut b = UnifiedBuffer::from_slice(&m, s, &data).unwrap();
        b.prefetch_to_device(s).unwrap();
        assert!(b.is_device_valid());
        b.prefetch_to_host(s).unwrap();
        assert_eq!(b.host().unwrap()[99][767], 49.5, "{p:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn managed_guard_refuses_oversubscription_without_allocating() {
    let _g = gpu();
    let m = mem(Placement::Managed);
    let free = m.device().mem_info().unwrap().free;
    let too_much = (free as f64 * 0.9) as usize;
    match UnifiedBuffer::<u8>::zeroed(&m, Stream::DEFAULT, too_much) {
        Err(e) => assert!(
            matches!(e, Error::ManagedGuard { .. })
                || e.to_string().contains("managed-memory guard"),
            "{e}"
        ),
        Ok(_) => panic!("the guard let {too_much} bytes of managed memory through"),
    }
    // still usable
    let mut b = UnifiedBuffer::<u8>::zeroed(&m, Stream::DEFAULT, 1 << 20).unwrap();
    b.host_mut().unwrap()[5] = 9;
    assert_eq!(b.host().unwrap()[5], 9);
}
