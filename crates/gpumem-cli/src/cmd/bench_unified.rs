//! `gpumem bench unified`: a kernel over unified buffers against the same kernel over device
//! memory, and how fast data moves each way: raw managed memory, gpumem's managed and mirrored
//! placements, device memory and pinned memcpy.

use crate::output::{device_name, emit, median, msg, Result};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::buffer::unified::DeviceView;
use gpumem::profile::{UmCounter, UmCounts};
use gpumem::resource::cuda::CudaManaged;
use gpumem::Device;
use gpumem::{
    Config, DeviceBuffer, PinnedBuffer, Placement, Resource, Stream, StreamOps, UnifiedBuffer,
    UnifiedMemory,
};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

const AXPY: &str = r#"
extern "C" __global__ void axpy(float* y, const float* x, float a, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = a * x[i] + y[i];
}"#;

#[derive(Debug, Serialize)]
pub struct KernelRow {
    pub memory: String,
    pub ms: f64,
    /// against the same kernel on device memory
    pub ratio: f64,
    /// what CUPTI counted during all the timed kernels (None: no CUPTI)
    pub during_kernels: Option<UmCounts>,
}

#[derive(Debug, Serialize)]
pub struct MoveRow {
    pub path: String,
    pub direction: String,
    pub bytes: u64,
    pub gb_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct Out {
    pub device: String,
    pub kernel_bytes: u64,
    pub kernel: Vec<KernelRow>,
    pub moves: Vec<MoveRow>,
}

struct K {
    f: CudaFunction,
    st: Arc<CudaStream>,
}

impl K {
    fn launch(&self, y: u64, x: u64, n: usize) -> Result<()> {
        let (a, nn) = (2.0f32, n as u64);
        let mut l = self.st.launch_builder(&self.f);
        l.arg(&y).arg(&x).arg(&a).arg(&nn);
        let cfg = LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `y` and `x` address at least `n` floats of live memory (callers' buffers).
        unsafe { l.launch(cfg) }.map_err(msg)?;
        Ok(())
    }
    /// Launch and wait; the kernel's seconds between two timing events around it.
    fn timed(&self, y: u64, x: u64, n: usize) -> Result<f64> {
        let ctx = self.st.context();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (a, b) = (
            ctx.new_event(flags).map_err(msg)?,
            ctx.new_event(flags).map_err(msg)?,
        );
        a.record(&self.st).map_err(msg)?;
        self.launch(y, x, n)?;
        b.record(&self.st).map_err(msg)?;
        Ok(a.elapsed_ms(&b).map_err(msg)? as f64 / 1e3)
    }
}

fn ptrs(x: &DeviceView<'_, f32>, y: &DeviceView<'_, f32>) -> (u64, u64) {
    (y.device_ptr(), x.device_ptr())
}

/// Unified-memory counts while `f` runs (None where the counter is not running).
fn faults<R>(
    c: Option<&UmCounter>,
    f: impl FnOnce() -> Result<R>,
) -> Result<(R, Option<UmCounts>)> {
    let before = c.map(|c| c.read_settled()).transpose().map_err(msg)?;
    let r = f()?;
    let after = c.map(|c| c.read_settled()).transpose().map_err(msg)?;
    Ok((r, before.zip(after).map(|(b, a)| a - b)))
}

fn add(a: Option<UmCounts>, b: Option<UmCounts>) -> Option<UmCounts> {
    a.zip(b).map(|(a, b)| UmCounts {
        gpu_page_faults: a.gpu_page_faults + b.gpu_page_faults,
        bytes_htod: a.bytes_htod + b.bytes_htod,
        bytes_dtoh: a.bytes_dtoh + b.bytes_dtoh,
        bytes_dtod: a.bytes_dtod + b.bytes_dtod,
    })
}

pub fn measure(
    ordinal: usize,
    device: String,
    reps: usize,
    counter: Option<&UmCounter>,
) -> Result<Out> {
    let ctx = gpumem::resource::cuda::primary_context(ordinal).map_err(msg)?;
    let st = ctx.new_stream().map_err(msg)?;
    let s = Stream::from(&*st);
    let module = ctx
        .load_module(cudarc::nvrtc::compile_ptx(AXPY).map_err(msg)?)
        .map_err(msg)?;
    let k = K {
        f: module.load_function("axpy").map_err(msg)?,
        st: st.clone(),
    };
    let alloc = Device::cuda(ordinal, Config::default()).map_err(msg)?;
    let n: usize = 64 << 20; // floats: two 256 MiB arrays
    let bytes = n * 4;
    let host_x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut kernel = Vec::new();

    // device memory: the anchor
    let x = DeviceBuffer::from_slice(&alloc, s, &host_x).map_err(msg)?;
    let mut y = DeviceBuffer::<f32>::zeroed(&alloc, s, n).map_err(msg)?;
    let mut scratch = vec![0f32; n];
    k.timed(y.device_ptr(), x.device_ptr(), n)?;
    let mut times = Vec::new();
    let mut faulted = Some(UmCounts::default());
    for _ in 0..reps {
        // the same host work and copy-in between kernels as the unified rows below have
        scratch.fill(0.0);
        y.copy_from_host(&scratch).map_err(msg)?;
        let (t, f) = faults(counter, || k.timed(y.device_ptr(), x.device_ptr(), n))?;
        times.push(t);
        faulted = add(faulted, f);
    }
    let dev = median(times);
    drop(scratch);
    kernel.push((
        "device memory".to_string(),
        dev,
        faulted.filter(|_| counter.is_some()),
    ));
    drop((x, y));

    // raw managed memory written on the host and left there: the kernel faults
    let m = CudaManaged::new(ordinal).map_err(msg)?;
    let mx = m.allocate(s, bytes, 4096).map_err(msg)?;
    let my = m.allocate(s, bytes, 4096).map_err(msg)?;
    let mut raw = Vec::new();
    let mut faulted = Some(UmCounts::default());
    for _ in 0..reps.min(3) {
        // SAFETY: both are fresh managed blocks of `bytes` bytes; no kernel runs meanwhile.
        unsafe {
            std::slice::from_raw_parts_mut(mx as *mut f32, n).copy_from_slice(&host_x);
            std::ptr::write_bytes(my as *mut u8, 0, bytes);
        }
        let (t, f) = faults(counter, || k.timed(my, mx, n))?;
        raw.push(t);
        faulted = add(faulted, f);
    }
    kernel.push((
        "raw managed, left on the host".into(),
        median(raw),
        faulted.filter(|_| counter.is_some()),
    ));

    let mut moves = Vec::new();
    // raw prefetch each way, at three sizes
    for size in [16usize << 20, 64 << 20, 256 << 20] {
        let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
        for _ in 0..reps.min(5) {
            // SAFETY: [mx, mx + size) is managed memory of `m`.
            unsafe { std::ptr::write_bytes(mx as *mut u8, 1, size) };
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { m.prefetch_to_device(mx, size, s) }.map_err(msg)?;
            m.synchronize(s).map_err(msg)?;
            h2d.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { m.prefetch_to_host(mx, size, s) }.map_err(msg)?;
            m.synchronize(s).map_err(msg)?;
            d2h.push(t.elapsed().as_secs_f64());
        }
        moves.push(mv("raw managed prefetch", "h2d", size, median(h2d)));
        moves.push(mv("raw managed prefetch", "d2h", size, median(d2h)));
        // the same in 8 pieces on 8 streams
        let streams: Vec<Arc<CudaStream>> = (0..8)
            .map(|_| ctx.new_stream())
            .collect::<Result<_, _>>()
            .map_err(msg)?;
        let piece = size / 8;
        let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
        for _ in 0..reps.min(5) {
            // SAFETY: [mx, mx + size) is managed memory of `m`.
            unsafe { std::ptr::write_bytes(mx as *mut u8, 1, size) };
            for (to_host, acc) in [(false, &mut h2d), (true, &mut d2h)] {
                let t = Instant::now();
                for (i, st) in streams.iter().enumerate() {
                    let p = mx + (i * piece) as u64;
                    // SAFETY: each piece lies in the managed block.
                    unsafe {
                        if to_host {
                            m.prefetch_to_host(p, piece, Stream::from(&**st))
                        } else {
                            m.prefetch_to_device(p, piece, Stream::from(&**st))
                        }
                    }
                    .map_err(msg)?;
                }
                for st in &streams {
                    st.synchronize().map_err(msg)?;
                }
                acc.push(t.elapsed().as_secs_f64());
            }
        }
        moves.push(mv("raw prefetch, 8 streams", "h2d", size, median(h2d)));
        moves.push(mv("raw prefetch, 8 streams", "d2h", size, median(d2h)));
    }
    m.deallocate(mx, bytes, s).map_err(msg)?;
    m.deallocate(my, bytes, s).map_err(msg)?;
    drop(m);

    // gpumem's placements: the kernel after automatic prefetch, and the moves
    for p in [Placement::Managed, Placement::Mirrored] {
        let um = UnifiedMemory::new(&alloc, p).map_err(msg)?;
        let name = format!(
            "gpumem {}",
            if p == Placement::Managed {
                "managed"
            } else {
                "mirrored"
            }
        );
        let mut x = UnifiedBuffer::from_slice(&um, s, &host_x).map_err(msg)?;
        let mut y = UnifiedBuffer::<f32>::zeroed(&um, s, n).map_err(msg)?;
        let mut times = Vec::new();
        let mut faulted = Some(UmCounts::default());
        for _ in 0..reps {
            y.host_mut().map_err(msg)?.fill(0.0); // host writes: the data must move again
            let (yp, xp) = {
                let (xv, yv) = (x.device(s).map_err(msg)?, y.device_mut(s).map_err(msg)?);
                ptrs(&xv, &yv)
            };
            st.synchronize().map_err(msg)?; // the prefetch is not the kernel's time
            let (t, f) = faults(counter, || k.timed(yp, xp, n))?;
            times.push(t);
            faulted = add(faulted, f);
        }
        kernel.push((
            format!("{name}, prefetched automatically"),
            median(times),
            faulted.filter(|_| counter.is_some()),
        ));
        let check = y.host().map_err(msg)?[12345];
        if check != 2.0 * host_x[12345] {
            return Err(format!("{name}: axpy result {check} is wrong").into());
        }
        for size in [16usize << 20, 64 << 20, 256 << 20] {
            let len = size / 4;
            let mut b = UnifiedBuffer::<f32>::zeroed(&um, s, len).map_err(msg)?;
            let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
            for _ in 0..reps.min(5) {
                b.host_mut().map_err(msg)?.fill(1.0);
                let t = Instant::now();
                b.prefetch_to_device(s).map_err(msg)?;
                st.synchronize().map_err(msg)?;
                h2d.push(t.elapsed().as_secs_f64());
                b.device_mut(s).map_err(msg)?; // as if a kernel wrote it: host copy stale
                st.synchronize().map_err(msg)?;
                let t = Instant::now();
                let v = b.host().map_err(msg)?[len - 1];
                d2h.push(t.elapsed().as_secs_f64());
                if v != 1.0 {
                    return Err(format!("{name}: moved data is wrong").into());
                }
            }
            moves.push(mv(&name, "h2d", size, median(h2d)));
            moves.push(mv(&name, "d2h", size, median(d2h)));
        }
    }

    // pinned memcpy: the bandwidth anchor
    let pool = alloc.pinned_pool().map_err(msg)?;
    for size in [16usize << 20, 64 << 20, 256 << 20] {
        let len = size / 4;
        let mut hp = PinnedBuffer::<f32>::zeroed(pool, len).map_err(msg)?;
        let mut d = DeviceBuffer::<f32>::zeroed(&alloc, s, len).map_err(msg)?;
        let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
        for _ in 0..reps.min(5) {
            hp.as_mut_slice().map_err(msg)?.fill(1.0); // freshly written, as the rows above
            let t = Instant::now();
            d.copy_from_pinned(&hp).map_err(msg)?;
            d.synchronize().map_err(msg)?;
            h2d.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            d.copy_to_pinned(&mut hp).map_err(msg)?;
            hp.synchronize().map_err(msg)?;
            d2h.push(t.elapsed().as_secs_f64());
        }
        moves.push(mv("pinned memcpy", "h2d", size, median(h2d)));
        moves.push(mv("pinned memcpy", "d2h", size, median(d2h)));
    }
    Ok(Out {
        device,
        kernel_bytes: 2 * bytes as u64,
        kernel: kernel
            .into_iter()
            .map(|(memory, t, during_kernels)| KernelRow {
                memory,
                ms: t * 1e3,
                ratio: t / dev,
                during_kernels,
            })
            .collect(),
        moves,
    })
}

fn mv(path: &str, dir: &str, bytes: usize, secs: f64) -> MoveRow {
    MoveRow {
        path: path.into(),
        direction: dir.into(),
        bytes: bytes as u64,
        gb_per_s: bytes as f64 / secs / 1e9,
    }
}

pub fn print(out: &Out) {
    println!(
        "axpy over 2 x {} MiB on {} (median kernel time; ratio to device memory; what \
         CUPTI counted during all timed kernels)",
        out.kernel_bytes >> 21,
        out.device
    );
    for r in &out.kernel {
        let f = r.during_kernels.map_or("(no CUPTI)".to_string(), |c| {
            format!(
                "{} fault groups, {} MiB migrated",
                c.gpu_page_faults,
                (c.bytes_htod + c.bytes_dtoh) >> 20
            )
        });
        println!("  {:<42} {:>9.3} ms {:>8.2}x  {f}", r.memory, r.ms, r.ratio);
    }
    println!("moving a buffer's data (GB/s, median)");
    let mut sizes: Vec<u64> = out.moves.iter().map(|r| r.bytes).collect();
    sizes.sort();
    sizes.dedup();
    print!("  {:<24} {:<4}", "path", "dir");
    for s in &sizes {
        print!(" {:>8} MiB", s >> 20);
    }
    println!();
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in &out.moves {
        let k = (r.path.clone(), r.direction.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.sort_by(|a, b| a.1.cmp(&b.1).reverse().then(std::cmp::Ordering::Equal));
    for (p, d) in keys {
        print!("  {p:<24} {d:<4}");
        for s in &sizes {
            match out
                .moves
                .iter()
                .find(|r| r.path == p && r.direction == d && r.bytes == *s)
            {
                Some(r) => print!(" {:>12.2}", r.gb_per_s),
                None => print!(" {:>12}", "-"),
            }
        }
        println!();
    }
}

#[cfg(feature = "cuda")]
pub fn run(json: bool, device: usize, reps: usize) -> Result<()> {
    if !gpumem::device::cuda_available() {
        return Err("bench unified needs a CUDA GPU (unified memory is a device feature)".into());
    }
    // CUPTI's unified-memory counters: after CUDA is initialised (cuInit), before the
    // device's context exists
    let counter = match gpumem::profile::UmCounter::start(device) {
        Ok(c) => Some(c),
        Err(err) => {
            eprintln!("gpumem: no fault counts: {err}");
            None
        }
    };
    let name = device_name(device)?;
    let out = measure(device, name, reps, counter.as_ref())?;
    emit(json, &out, print)
}
