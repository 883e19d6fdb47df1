//! GPU tests. They need a CUDA GPU and are ignored by default:
//! `cargo test -p gpumem --test gpu -- --ignored` (or the gpu-bundle's `run`).
#![cfg(feature = "cuda")]

#[path = "common/data.rs"]
mod common_data;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::resource::{StreamOps, VmmCalls};
use gpumem::Device;
use gpumem::{Config, DeviceBuffer, Error, Stream};
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

impl Gpu {
    /// The device's free and total memory (every process counted), bytes.
    fn mem_info(&self) -> (u64, u64) {
        self.ctx.bind_to_thread().unwrap();
        let (free, total) = cudarc::driver::result::mem_get_info().unwrap();
        (free as u64, total as u64)
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

/// Words of `buf` that are not `value ^ index` (the pattern `fill` writes).
fn wrong_words(buf: &DeviceBuffer<u32>, value: u32) -> usize {
    let v = buf.to_vec().unwrap();
    v.iter()
        .enumerate()
        .filter(|&(i, &w)| w != value ^ i as u32)
        .count()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_info_is_sane() {
    let d = &gpumem::device::devices().unwrap()[0];
    assert!(!d.name.is_empty());
    assert!(d.total_memory > 1 << 30 && d.free_memory <= d.total_memory);
    assert!(d.compute_capability.0 >= 6);
    assert!(d.unified_addressing && d.caps.managed_memory && d.memory_pools);
    println!("{d:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trips_keep_data_intact() {
    let _g = gpu();
    for conf in [
        "",
        "expandable_segments:False",
        "backend:cudaMallocAsync",
        "quick_cache:0,shards:1",
    ] {
        let a = Device::cuda(0, Config::parse(conf).unwrap()).unwrap();
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
    let a = Device::cuda(0, Config::default()).unwrap();
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
    let a = Device::cuda(0, Config::default()).unwrap();
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
    let alloc = Device::cuda(0, Config::parse("cross_stream_reuse:false").unwrap()).unwrap();
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
    let a = Device::cuda(0, Config::parse("memory_fraction:0.05").unwrap()).unwrap();
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
    let a = Device::cuda(0, Config::default()).unwrap();
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

const MIB: usize = 1 << 20;

fn pattern(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) ^ salt)
        .collect()
}

/// Virtual-memory segments: one address range grows in place as blocks are added, data already
/// there stays intact, and empty_cache gives the physical memory back to the device.
#[test]
#[ignore = "needs a CUDA GPU"]
fn expandable_segments_grow_in_place_keep_data_and_shrink() {
    let _g = gpu();
    let a = Device::cuda(0, Config::parse("shards:1,quick_cache:0").unwrap()).unwrap();
    assert!(a.expandable(), "the H100 has virtual-memory management");
    let s = Stream::DEFAULT;
    let first_data = pattern(5 * MIB / 4 + 3, 0xabcd);
    let first = DeviceBuffer::from_slice(&a, s, &first_data).unwrap();
    let base = first.device_ptr();
    let free_before = a.backend().mem_info().unwrap().free;
    let mut grown = Vec::new();
    for k in 0..24 {
        let data = pattern(37 * MIB / 4 + k, k as u32);
        grown.push((DeviceBuffer::from_slice(&a, s, &data).unwrap(), data));
    }
    let large: Vec<_> = a.segments().into_iter().filter(|g| g.expandable).collect();
    assert_eq!(large.len(), 1, "all in one address range: {large:?}");
    let seg = &large[0];
    for (b, _) in &grown {
        assert!(b.device_ptr() > base && b.device_ptr() < seg.addr + seg.size);
    }
    assert_eq!(
        first.to_vec().unwrap(),
        first_data,
        "data intact across growth"
    );
    for (b, data) in &grown {
        assert_eq!(&b.to_vec().unwrap(), data);
    }
    let reserved = a.stats().reserved_bytes.all.current;
    assert!(reserved >= 24 * 37 * MIB as u64);
    let free_grown = a.backend().mem_info().unwrap().free;
    assert!(free_before - free_grown >= 24 * 37 * MIB as u64);
    drop(grown);
    a.empty_cache();
    let after = a.stats().reserved_bytes.all.current;
    assert!(
        after <= 8 * MIB as u64,
        "only first's pages stay mapped: {after}"
    );
    let free_after = a.backend().mem_info().unwrap().free;
    assert!(
        free_after >= free_before - 8 * MIB as u64,
        "pages went back to the device"
    );
    assert_eq!(
        first.to_vec().unwrap(),
        first_data,
        "data intact after shrinking"
    );
    println!(
        "grew to {} MiB reserved, {} MiB after empty_cache; device free {} -> {} -> {} MiB",
        reserved >> 20,
        after >> 20,
        free_before >> 20,
        free_grown >> 20,
        free_after >> 20
    );
}

/// The device's headroom: with 1,500 MiB of the device left free (the rest taken outside
/// gpumem) and page moves off but for memory pressure, a block that growing would fit with
/// only ~100 MiB to spare takes a free block's pages instead, leaving the device more than the
/// headroom (256 MiB); then a block that nothing free can serve grows into the headroom and
/// does not fail. The moved-into block keeps its data.
#[test]
#[ignore = "needs a CUDA GPU"]
fn growth_into_the_devices_headroom_moves_pages_first() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    // page moves only under memory pressure (no time-budget moves: a field, not a key)
    let mut config = Config::parse("shards:1,quick_cache:0,pressure_release:0").unwrap();
    config.pool.page_moves = false;
    let a = Device::cuda(0, config).unwrap();
    assert!(a.expandable(), "the H100 has virtual-memory management");
    let keep = 1500 * MIB as u64;
    let take = g.mem_info().0.saturating_sub(keep);
    // SAFETY: a plain device allocation, freed below; never touched.
    let ballast = unsafe { cudarc::driver::result::malloc_sync(take as usize) }.unwrap();
    // x, then a small block after it (so that y cannot take x's hole and grow past it)
    let x = DeviceBuffer::<u32>::alloc(&a, s, 600 * MIB / 4).unwrap();
    let k = DeviceBuffer::<u32>::alloc(&a, s, 2 * MIB / 4).unwrap();
    drop(x);
    let before = a.stats();
    // growing by 800 MiB would leave about 100 MiB of the device free
    let mut y = DeviceBuffer::<u32>::alloc(&a, s, 800 * MIB / 4).unwrap();
    fill(&g, &st, &mut y, 0x7777_7777);
    let after = a.stats();
    let left = g.mem_info().0;
    assert!(
        after.num_pressure_moves > before.num_pressure_moves,
        "{after:?}"
    );
    assert!(left >= 256 * MIB as u64, "{} MiB left", left >> 20);
    assert!(
        after.reserved_bytes.all.current <= 900 * MIB as u64,
        "{after:?}"
    );
    // nothing free to move: growth takes the headroom, and does not fail
    let v = DeviceBuffer::<u32>::alloc(&a, s, ((left - 64 * MIB as u64) / 4) as usize).unwrap();
    assert_eq!(a.stats().num_ooms, 0);
    let last = g.mem_info().0;
    assert!(last < 256 * MIB as u64, "{} MiB left", last >> 20);
    st.synchronize().unwrap();
    assert_eq!(wrong_words(&y, 0x7777_7777), 0, "y holds its data");
    println!(
        "headroom: {} MiB left after y ({} pressure moves), {} MiB after v",
        left >> 20,
        after.num_pressure_moves,
        last >> 20
    );
    drop((v, y, k));
    // SAFETY: allocated above, freed once.
    unsafe { cudarc::driver::result::free_sync(ballast) }.unwrap();
}

/// What [`pages_move_under_a_running_kernel`] saw.
struct MoveUnderKernel {
    stats: gpumem::Stats,
    /// the page engine's calls before the block was freed, after the allocation, at the end
    before: VmmCalls,
    after: VmmCalls,
    end: VmmCalls,
    /// how long the allocation took
    took: std::time::Duration,
}

/// A 64 MiB block on stream `sa` is read by a ~200 ms kernel and freed while the kernel runs;
/// then 100 MiB, which do not fit in its hole, are allocated on `sb` (`sa` itself, or another
/// stream) and filled there. Asserts what both cases share: the block's memory backs the new
/// one (moved, not waited for), the kernel read the old data and the new block holds its own.
/// A 200 MiB memory budget makes the pages move (growing by 100 MiB would pass it): a job
/// this young has no time budget for moves yet (`pool/budget.rs`), and would grow instead.
fn pages_move_under_a_running_kernel(
    g: &Gpu,
    sa: &Arc<CudaStream>,
    sb: &Arc<CudaStream>,
) -> MoveUnderKernel {
    let (a_s, b_s) = (Stream::from(&**sa), Stream::from(&**sb));
    let a = Device::cuda(
        0,
        Config::parse("shards:1,quick_cache:0,memory_limit_mb:200").unwrap(),
    )
    .unwrap();
    let n = 64 * MIB / 4;
    // another stream is made known to the pool first
    let z = (a_s != b_s).then(|| DeviceBuffer::<u32>::zeroed(&a, b_s, 1024).unwrap());
    let mut x = DeviceBuffer::<u32>::alloc(&a, a_s, n).unwrap();
    fill(g, sa, &mut x, 0x3333_3333);
    let mut out = DeviceBuffer::<u32>::zeroed(&a, a_s, n).unwrap();
    let (nn, cycles) = (n as u64, 400_000_000i64); // ~200 ms
    let mut l = sa.launch_builder(&g.slow_copy);
    l.arg(&mut out).arg(&x).arg(&nn).arg(&cycles);
    // SAFETY: both buffers hold n u32s.
    unsafe { l.launch(cfg(n)) }.unwrap();
    let vmm = a.backend().virtual_memory().expect("pages");
    let before = vmm.calls();
    drop(x); // freed on its stream while the kernel has still to read it
    let t = std::time::Instant::now();
    let mut y = DeviceBuffer::<u32>::alloc(&a, b_s, 100 * MIB / 4).unwrap();
    let took = t.elapsed();
    fill(g, sb, &mut y, 0x5555_5555); // runs after the kernel
    let (stats, after) = (a.stats(), vmm.calls());
    assert!(stats.unmapped_bytes >= 60 * MIB as u64, "{stats:?}");
    assert_eq!(stats.num_unmap_syncs, 0, "the allocation did not wait");
    assert!(stats.num_pressure_moves >= 1, "{stats:?}");
    // (mappings made with kept handles: x's 32 pages are one or two handles)
    assert!(
        after.aliased - before.aliased >= 1,
        "x's memory backs y: {after:?}"
    );
    assert!(
        took < std::time::Duration::from_millis(100),
        "the allocation waited for the kernel: {took:?}"
    );
    sa.synchronize().unwrap();
    sb.synchronize().unwrap();
    for (buf, value, what) in [
        (&out, 0x3333_3333, "the kernel read"),
        (&y, 0x5555_5555, "the new block holds"),
    ] {
        let bad = wrong_words(buf, value);
        assert_eq!(bad, 0, "{what} {bad} wrong words");
    }
    let end = vmm.calls();
    drop((y, out, z));
    a.empty_cache();
    MoveUnderKernel {
        stats,
        before,
        after,
        end,
        took,
    }
}

/// A block freed while a kernel still reads it, on the kernel's stream: its pages move in
/// stream order. The next allocation on that stream gets their memory at once (mapped at its
/// own addresses; the stream runs the kernel first), without waiting for the kernel, and the
/// old addresses are not unmapped under it (that would fault it: they keep the memory mapped,
/// as the page engine leaves every unmapped page until its address is needed). The kernel
/// reads what it should, and the new block, written after it, holds its own.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pages_move_in_stream_order_under_a_running_kernel() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let m = pages_move_under_a_running_kernel(&g, &st, &st);
    assert!(m.stats.num_ordered_unmaps >= 1, "{:?}", m.stats);
    // nothing was unmapped under the kernel: x's addresses keep their memory mapped (it is
    // y's now; nothing uses those addresses) until a map needs them for other memory
    assert_eq!(m.end.unmaps, m.before.unmaps, "{:?}", m.end);
    println!(
        "moved in stream order: {} pages aliased, allocation took {:?}",
        m.after.aliased - m.before.aliased,
        m.took
    );
}

/// A block freed on one stream while a kernel there still reads it; another stream then needs
/// pages: it takes the block's memory after waiting (on the GPU) for the first stream's
/// checkpoint, so its own work, which overwrites that memory, runs after the kernel. The kernel
/// reads what it should, the new block holds its own, and the allocation did not wait.
#[test]
#[ignore = "needs a CUDA GPU"]
fn another_streams_pages_move_after_its_running_kernel() {
    let g = gpu();
    let (sa, sb) = (g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap());
    let m = pages_move_under_a_running_kernel(&g, &sa, &sb);
    assert!(m.stats.num_cross_stream_moves >= 1, "{:?}", m.stats);
    println!(
        "moved across streams: {} pages aliased, allocation took {:?}",
        m.after.aliased - m.before.aliased,
        m.took
    );
}

/// Two streams taking turns. A block freed on stream A while a kernel there still reads it is
/// lent to stream B, which would otherwise have to move pages: B's allocation takes the
/// block's memory with no driver call and no host wait, and B's writes run after A's kernel
/// (B waits for A's checkpoint on the GPU). Given back while a kernel on B still reads it, the
/// block serves A again, and A's writes run after B's kernel. Every kernel reads what it
/// should.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_free_block_is_lent_to_another_stream_after_its_running_kernel() {
    let g = gpu();
    let (sa, sb) = (g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap());
    let (a_s, b_s) = (Stream::from(&*sa), Stream::from(&*sb));
    let a = Device::cuda(0, Config::parse("shards:1,quick_cache:0").unwrap()).unwrap();
    let (n, m) = (64 * MIB / 4, 48 * MIB / 4);
    let cycles = 400_000_000i64; // ~200 ms
    let mut out_b = DeviceBuffer::<u32>::zeroed(&a, b_s, m).unwrap();
    let mut x = DeviceBuffer::<u32>::alloc(&a, a_s, n).unwrap();
    fill(&g, &sa, &mut x, 0x3333_3333);
    let mut out_a = DeviceBuffer::<u32>::zeroed(&a, a_s, n).unwrap();
    let nn = n as u64;
    let mut l = sa.launch_builder(&g.slow_copy);
    l.arg(&mut out_a).arg(&x).arg(&nn).arg(&cycles);
    // SAFETY: both buffers hold n u32s.
    unsafe { l.launch(cfg(n)) }.unwrap();
    let vmm = a.backend().virtual_memory().expect("pages");
    let (x_addr, before) = (x.device_ptr(), vmm.calls());
    drop(x); // freed on A while A's kernel has still to read it
    let t = std::time::Instant::now();
    let mut y = DeviceBuffer::<u32>::alloc(&a, b_s, m).unwrap();
    let took = t.elapsed();
    let after = vmm.calls();
    fill(&g, &sb, &mut y, 0x5555_5555); // runs after A's kernel
    let stats = a.stats();
    assert_eq!(y.device_ptr(), x_addr, "x's block is lent to B: {stats:?}");
    assert_eq!(stats.num_cross_stream_blocks, 1, "{stats:?}");
    assert_eq!((after.maps, after.unmaps), (before.maps, before.unmaps));
    assert_eq!(stats.num_unmap_syncs, 0, "the allocation did not wait");
    assert!(
        took < std::time::Duration::from_millis(100),
        "the allocation waited for the kernel: {took:?}"
    );
    // B's kernel reads y; y goes back while it runs, and A takes the block again
    let mm = m as u64;
    let mut l = sb.launch_builder(&g.slow_copy);
    l.arg(&mut out_b).arg(&y).arg(&mm).arg(&cycles);
    // SAFETY: both buffers hold m u32s.
    unsafe { l.launch(cfg(m)) }.unwrap();
    drop(y);
    let t = std::time::Instant::now();
    let mut w = DeviceBuffer::<u32>::alloc(&a, a_s, m).unwrap();
    let took_back = t.elapsed();
    assert_eq!(w.device_ptr(), x_addr, "the owner reuses its block");
    fill(&g, &sa, &mut w, 0x7777_7777); // runs after B's kernel
    assert!(
        took_back < std::time::Duration::from_millis(100),
        "{took_back:?}"
    );
    sa.synchronize().unwrap();
    sb.synchronize().unwrap();
    assert_eq!(wrong_words(&out_a, 0x3333_3333), 0, "A's kernel read x");
    assert_eq!(wrong_words(&out_b, 0x5555_5555), 0, "B's kernel read y");
    assert_eq!(wrong_words(&w, 0x7777_7777), 0, "w holds its own");
    assert_eq!(a.stats().num_unmap_syncs, 0);
    println!(
        "lent across streams: allocations took {took:?} and {took_back:?}, {} stream waits",
        a.stats().num_cross_stream_moves
    );
    drop((w, out_a, out_b));
    a.empty_cache();
}

/// Replaying a trace with real CUDA allocations reserves what the simulation says, within 1%.
#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_on_the_gpu_agrees_with_the_simulation() {
    let _g = gpu();
    let path = common_data::data("resnet50_train.jsonl.gz");
    let events = gpumem::trace::read_trace(&path).unwrap();
    for conf in ["", "expandable_segments:False"] {
        let config = Config::parse(conf).unwrap();
        let sim = gpumem::trace::replay("sim", &events, &config, 1 << 50).unwrap();
        let make = || gpumem::device::cuda_backend(0, &config);
        let gpu = gpumem::trace::replay_detailed("gpu", &events, &config, &make, &Stream)
            .unwrap()
            .report;
        let diff = (gpu.peak_reserved_bytes as f64 / sim.peak_reserved_bytes as f64 - 1.0).abs();
        println!(
            "{conf:?}: simulated {} B, GPU {} B ({:.4}%), ratio {:.4} vs {:.4}",
            sim.peak_reserved_bytes,
            gpu.peak_reserved_bytes,
            diff * 100.0,
            sim.ratio,
            gpu.ratio
        );
        assert!(diff <= 0.01, "{conf:?}: {diff}");
    }
}

/// Waits (up to 2 s) until `threads_named(prefix)` is `n`, and returns the last count: a new
/// thread names itself once it runs, so a count taken at once may miss it.
fn threads_named_settled(prefix: &str, n: usize) -> usize {
    let start = std::time::Instant::now();
    loop {
        let c = threads_named(prefix);
        if c == n || start.elapsed() > std::time::Duration::from_secs(2) {
            return c;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("comm"))
                        .is_ok_and(|n| n.trim_end().starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Dropping a device with pages moved in stream order, kept handles and queued unmaps stops the
/// page engine's thread and gives every page back: no thread and no device memory left.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_the_device_stops_the_page_worker_and_frees_every_page() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let free_before = g.mem_info().0;
    let workers_before = threads_named("gpumem-pages");
    {
        let a = Device::cuda(0, Config::parse("shards:1").unwrap()).unwrap();
        assert!(a.expandable());
        assert_eq!(
            threads_named_settled("gpumem-pages", workers_before + 1),
            workers_before + 1
        );
        let mut live = Vec::new();
        for k in 0..40usize {
            let mut b = DeviceBuffer::<u32>::alloc(&a, s, (8 + (k * 7) % 40) * MIB / 4).unwrap();
            fill(&g, &st, &mut b, k as u32);
            live.push(b);
            if k % 3 == 2 {
                live.remove(k % live.len()); // freed while the fills may still run
            }
        }
        let stats = a.stats();
        println!(
            "before drop: reserved {} MiB, ordered moves {}, spare {} MiB",
            stats.reserved_bytes.all.current >> 20,
            stats.num_ordered_unmaps,
            stats.vmm_spare_bytes >> 20
        );
        drop(live);
    }
    st.synchronize().unwrap();
    // the worker has gone and the device has its memory back (other processes aside)
    assert_eq!(
        threads_named_settled("gpumem-pages", workers_before),
        workers_before
    );
    let free_after = g.mem_info().0;
    assert!(
        free_after + 64 * MIB as u64 >= free_before,
        "device free {} MiB before, {} MiB after",
        free_before >> 20,
        free_after >> 20
    );
}

/// Pages mapped ahead (a planned region's split: `VirtualMemory::map_ahead`) are made on the
/// page engine's thread: its calls count as that thread's, a call over the range meanwhile
/// waits for them, and once `wait_mapped` has returned the memory is there (written and read
/// back).
#[test]
#[ignore = "needs a CUDA GPU"]
fn pages_mapped_ahead_are_made_on_the_engines_thread() {
    use gpumem::Resource;
    let g = gpu();
    let dev = gpumem::resource::cuda::CudaDevice::new(0).unwrap();
    let v = dev.virtual_memory().expect("virtual memory");
    let page = v.page_size();
    let base = v.reserve_address(64 * page).unwrap();
    // a handle of 8 pages split as a plan's give-back splits one: unmapped whole, then 3 of
    // its pages mapped again, ahead
    v.map(base, 8 * page).unwrap();
    v.unmap(base, 8 * page).unwrap();
    let before = v.calls();
    let (a, bytes) = (base + 2 * page, 3 * page);
    v.map_ahead(a, bytes, Stream::DEFAULT).unwrap();
    v.wait_mapped(a, bytes, Stream::DEFAULT).unwrap();
    let c = v.calls();
    println!("before {before:?}\nafter {c:?}");
    assert_eq!(c.foreground, before.foreground, "calls on this thread");
    assert!(c.creates_background > before.creates_background);
    assert!(c.maps_background > before.maps_background);
    assert!(c.set_access_background > before.set_access_background);
    g.ctx.bind_to_thread().unwrap();
    let words = (bytes / 4) as usize;
    let mut host = vec![0u32; words];
    // SAFETY: `[a, a + bytes)` is mapped with read-write access (waited for above).
    unsafe {
        cudarc::driver::result::memset_d8_sync(a, 0x5a, bytes as usize).unwrap();
        cudarc::driver::result::memcpy_dtoh_sync(&mut host, a).unwrap();
    }
    assert!(host.iter().all(|&w| w == 0x5a5a_5a5a));
    // a map made ahead and unmapped at once: the unmap waits for it
    v.map_ahead(base + 10 * page, 4 * page, Stream::DEFAULT)
        .unwrap();
    v.unmap(base + 10 * page, 4 * page).unwrap();
    v.unmap(a, bytes).unwrap();
    v.trim();
    v.release_address(base, 64 * page).unwrap();
}

/// Set in the child process of the next test: take this many MiB of device memory, say so,
/// and hold it until stdin closes.
const HOG_ENV: &str = "GPUMEM_TEST_HOG_MIB";

fn hog(mib: u64) {
    let ctx = gpumem::resource::cuda::primary_context(0).unwrap();
    ctx.bind_to_thread().unwrap();
    // SAFETY: a plain device allocation, freed below; never touched.
    let p = unsafe { cudarc::driver::result::malloc_sync((mib << 20) as usize) }.unwrap();
    println!("hog ready");
    use std::io::Read;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    // SAFETY: allocated above, freed once.
    unsafe { cudarc::driver::result::free_sync(p) }.unwrap();
}

/// Another process takes most of the device's free memory: gpumem notices at its next
/// allocations (`pressure_release`) and gives its cached segments and idle pages back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn another_process_taking_memory_gets_the_cache_back() {
    if let Ok(mib) = std::env::var(HOG_ENV) {
        hog(mib.parse().unwrap());
        return;
    }
    let g = gpu();
    let a = Device::cuda(
        0,
        Config::parse("shards:1,pressure_release:0.2,pressure_interval_ms:0").unwrap(),
    )
    .unwrap();
    let s = Stream::DEFAULT;
    // 8 GiB cached
    let blocks: Vec<_> = (0..8)
        .map(|_| a.allocate(s, 1 << 30, 512).unwrap())
        .collect();
    for b in blocks {
        a.deallocate(b).unwrap();
    }
    a.synchronize_device().unwrap();
    let cached = a.stats().reserved_bytes.all.current;
    assert!(cached >= 8 << 30);
    let (free, total) = g.mem_info();
    // the other process leaves a tenth of the device free
    let take = (free - total / 10) >> 20;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "another_process_taking_memory_gets_the_cache_back",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOG_ENV, take.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    // kept open to the end: the child's test harness still writes its summary
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = out
        .by_ref()
        .map_while(|l| l.ok())
        .any(|l| l.contains("hog ready"));
    assert!(ready, "the other process could not take its memory");
    let (free_now, _) = g.mem_info();
    for _ in 0..600 {
        let b = a.allocate(s, 4096, 512).unwrap();
        a.deallocate(b).unwrap();
    }
    let st = a.stats();
    let (free_after, _) = g.mem_info();
    println!(
        "cached {} MiB; another process took {take} MiB (free {} -> {} MiB); after gpumem's \
         next allocations: {} release(s), reserved {} MiB, free {} MiB",
        cached >> 20,
        free >> 20,
        free_now >> 20,
        st.num_pressure_releases,
        st.reserved_bytes.all.current >> 20,
        free_after >> 20
    );
    drop(child.stdin.take()); // the other process lets go
    out.for_each(drop);
    assert!(child.wait().unwrap().success());
    assert_eq!(st.num_pressure_releases, 1);
    assert!(
        st.reserved_bytes.all.current < 64 << 20,
        "the cache went back"
    );
    assert!(free_after >= free_now + (7 << 30), "the device got it");
}
