//! Batch cosine similarity on unified buffers: 1000 query vectors of 768 dimensions against a
//! target set, with an NVRTC kernel, no explicit memcpy in the hot loop (the buffers move their
//! data before each access), checked against a CPU result.
//! `cargo run --release -p gpumem --example cosine_unified [-- mirrored|managed|auto]`

use gpumem::Device;
use gpumem::{Config, Placement, Stream, UnifiedBuffer, UnifiedMemory};
use std::time::Instant;

const DIM: usize = 768;
const QUERIES: usize = 1000;
const TARGETS: usize = 8192;
const BATCHES: usize = 5;

const KERNEL: &str = r#"
// scores[q * nt + t] = cos(queries[q], targets[t]); one block per (query, 128 targets).
extern "C" __global__ void cosine(float* scores, const float* queries, const float* targets,
                                  const float* target_norms, unsigned int nq, unsigned int nt) {
    unsigned int q = blockIdx.y;
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    __shared__ float qv[768];
    for (unsigned int d = threadIdx.x; d < 768; d += blockDim.x) qv[d] = queries[q * 768 + d];
    __syncthreads();
    if (q >= nq || t >= nt) return;
    float dot = 0.f, qq = 0.f;
    const float* tv = targets + (unsigned long long)t * 768;
    for (unsigned int d = 0; d < 768; ++d) { dot += qv[d] * tv[d]; qq += qv[d] * qv[d]; }
    scores[(unsigned long long)q * nt + t] = dot / (sqrtf(qq) * target_norms[t] + 1e-12f);
}"#;

/// A deterministic pseudo-random vector.
fn vector(seed: u64) -> [f32; DIM] {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut v = [0f32; DIM];
    for e in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *e = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
    }
    v
}

fn cosine_cpu(a: &[f32; DIM], b: &[f32; DIM]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb + 1e-12)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let placement = match std::env::args().nth(1).as_deref() {
        Some("mirrored") => Placement::Mirrored,
        Some("managed") => Placement::Managed,
        _ => Placement::Auto,
    };
    if gpumem::device::cuda_available() {
        return run_gpu(placement);
    }
    println!("no CUDA GPU here: this example runs its kernel on a GPU");
    Ok(())
}

fn run_gpu(placement: Placement) -> Result<(), Box<dyn std::error::Error>> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let ctx = gpumem::resource::cuda::primary_context(0)?;
    let st = ctx.new_stream()?;
    let s = Stream::from(&*st);
    let alloc = Device::cuda(0, Config::from_env()?)?;
    let mem = UnifiedMemory::new(&alloc, placement)?;
    let f = ctx
        .load_module(cudarc::nvrtc::compile_ptx(KERNEL)?)?
        .load_function("cosine")?;

    let targets_host: Vec<[f32; DIM]> = (0..TARGETS as u64).map(|i| vector(i + 1)).collect();
    let mut targets = UnifiedBuffer::from_slice(&mem, s, &targets_host)?;
    let norms: Vec<f32> = targets_host
        .iter()
        .map(|v| v.iter().map(|x| x * x).sum::<f32>().sqrt())
        .collect();
    let mut target_norms = UnifiedBuffer::from_slice(&mem, s, &norms)?;
    let mut queries = UnifiedBuffer::<[f32; DIM]>::zeroed(&mem, s, QUERIES)?;
    let mut scores = UnifiedBuffer::<f32>::zeroed(&mem, s, QUERIES * TARGETS)?;

    let t0 = Instant::now();
    let mut checked = 0;
    for batch in 0..BATCHES {
        // the hot loop: write queries on the host, run the kernel, read scores on the host
        let seed = |q: usize| 1_000_000 + (batch * QUERIES + q) as u64;
        for (q, v) in queries.host_mut_discard()?.iter_mut().enumerate() {
            *v = vector(seed(q));
        }
        {
            let (out, qv) = (scores.device_mut(s)?, queries.device(s)?);
            let (tv, nv) = (targets.device(s)?, target_norms.device(s)?);
            let (nq, nt) = (QUERIES as u32, TARGETS as u32);
            let mut l = st.launch_builder(&f);
            l.arg(&out).arg(&qv).arg(&tv).arg(&nv).arg(&nq).arg(&nt);
            let cfg = LaunchConfig {
                grid_dim: (TARGETS.div_ceil(128) as u32, QUERIES as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the views hold QUERIES x TARGETS scores, QUERIES and TARGETS vectors of
            // 768 floats and TARGETS norms; the kernel stays inside them.
            unsafe { l.launch(cfg) }?;
        }
        let sc = scores.host()?;
        // check a sample of queries against the CPU
        for q in (0..QUERIES).step_by(97) {
            let qv = vector(seed(q));
            for t in (0..TARGETS).step_by(331) {
                let want = cosine_cpu(&qv, &targets_host[t]);
                let got = sc[q * TARGETS + t];
                if (want - got).abs() > 1e-4 {
                    return Err(format!("query {q} target {t}: gpu {got} cpu {want}").into());
                }
                checked += 1;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "cosine similarity, {:?} placement: {BATCHES} batches of {QUERIES} queries x {TARGETS} \
         targets x {DIM} dims in {:.1} ms ({checked} scores checked against the CPU); \
         targets read-mostly: {}",
        mem.placement(),
        secs * 1e3,
        targets.access_pattern().read_mostly
    );
    Ok(())
}
