//! GPU tests of pinned memory, the transfer engine and the ring bridge. They need a CUDA GPU
//! and are ignored by default: `cargo test -p gpumem --test gpu_transfer -- --ignored`.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpumem::buffer::ring::{RingBridge, RingMode, POLLED_ECHO_CUDA, POLLED_RING_CUDA};
use gpumem::Device;
use gpumem::{
    Config, DeviceBuffer, PinnedBuffer, PinnedHost, PinnedRegistration, Stream, Transfer,
};
use std::sync::Arc;

#[path = "common/msg.rs"]
mod msg;
use msg::Msg;

const KERNELS: &str = r#"
// Spin for `cycles`, then write value ^ i: a late writer of `out`.
extern "C" __global__ void slow_fill(unsigned int* out, unsigned int value, unsigned long long n,
                                     long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = value ^ (unsigned int)i;
}
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"#;

const SPIN: i64 = 400_000_000; // ~0.2 s at H100 clocks

struct Gpu {
    ctx: Arc<CudaContext>,
    slow_fill: CudaFunction,
    spin: CudaFunction,
    echo: CudaFunction,
    echo_polled: CudaFunction,
}

fn gpu() -> Gpu {
    assert!(
        gpumem::device::cuda_available(),
        "these tests need a CUDA GPU (run them on the GPU machine)"
    );
    let ctx = gpumem::resource::cuda::primary_context(0).unwrap();
    let m = ctx
        .load_module(
            cudarc::nvrtc::compile_ptx(format!(
                "{KERNELS}{}{POLLED_RING_CUDA}{POLLED_ECHO_CUDA}",
                msg::ECHO_KERNEL
            ))
            .unwrap(),
        )
        .unwrap();
    Gpu {
        slow_fill: m.load_function("slow_fill").unwrap(),
        spin: m.load_function("spin").unwrap(),
        echo: m.load_function("echo").unwrap(),
        echo_polled: m.load_function("echo_polled").unwrap(),
        ctx,
    }
}

fn spin(g: &Gpu, s: &Arc<CudaStream>) {
    let mut b = s.launch_builder(&g.spin);
    b.arg(&SPIN);
    // SAFETY: the kernel touches no memory.
    unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
}

fn alloc() -> Device {
    Device::cuda(0, Config::default()).unwrap()
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(7) as u8 ^ salt)
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_copy_path_keeps_data_at_odd_sizes_and_offsets() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    let chunk = a.transfer_engine().unwrap().config().chunk_bytes;
    let page = 4096;
    let sizes = [
        1,
        page - 1,
        page + 1,
        chunk - 1,
        chunk + 1,
        3 * chunk + 5,
        (37 << 20) + 3,
    ];
    let pool = a.pinned_pool().unwrap();
    for &len in &sizes {
        let src = pattern(len, 0x5a);
        for how in [
            Transfer::Sync,
            Transfer::Async,
            Transfer::Staged,
            Transfer::Unified,
            Transfer::Auto,
        ] {
            // at an odd offset inside a larger device buffer
            let mut d = DeviceBuffer::<u8>::zeroed(&a, s, len + 7).unwrap();
            d.slice_mut(7..)
                .unwrap()
                .copy_from_host_with(&src, how)
                .unwrap();
            let mut back = vec![0u8; len];
            d.slice(7..)
                .unwrap()
                .copy_to_host_with(&mut back, how)
                .unwrap();
            assert!(back == src, "{len} bytes via {how:?}");
            assert_eq!(d.get(6).unwrap(), 0, "wrote before the offset ({how:?})");
        }
        // pinned, at odd element offsets on both sides
        let p = PinnedBuffer::from_slice(pool, &src).unwrap();
        let mut d = DeviceBuffer::<u8>::zeroed(&a, s, len + 3).unwrap();
        d.copy_range_from_pinned(3, &p, 0..len).unwrap();
        let mut q = PinnedBuffer::<u8>::zeroed(pool, len + 5).unwrap();
        d.copy_range_to_pinned(3..len + 3, &mut q, 5).unwrap();
        assert!(q.as_slice().unwrap()[5..] == src[..], "{len} bytes pinned");
        // device to device, between odd offsets
        let mut e = DeviceBuffer::<u8>::zeroed(&a, s, len + 1).unwrap();
        e.slice_mut(1..)
            .unwrap()
            .copy_from_device(&d.slice(3..).unwrap())
            .unwrap();
        assert!(
            e.slice(1..).unwrap().to_vec().unwrap() == src,
            "{len} bytes d2d"
        );
        // registered pageable memory
        let mut v = src.clone();
        let mut f = DeviceBuffer::<u8>::zeroed(&a, s, len).unwrap();
        {
            let reg = PinnedRegistration::new(pool, &mut v).unwrap();
            f.copy_from_pinned(&reg).unwrap();
        }
        assert!(f.to_vec().unwrap() == src, "{len} bytes registered");
    }
    pool.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_block_freed_with_its_copy_in_flight_is_not_handed_out_early() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    let pool = a.pinned_pool().unwrap();
    let n = 8 << 20;
    let src = pattern(n, 1);
    let mut d = DeviceBuffer::<u8>::zeroed(&a, s, n).unwrap();
    let p = PinnedBuffer::from_slice(pool, &src).unwrap();
    let addr = p.host_ptr();
    spin(&g, &st); // the copy below waits behind this kernel
    d.copy_from_pinned(&p).unwrap();
    drop(p); // freed while its copy has not even started
    assert!(
        pool.stats().pending_bytes > 0,
        "the block waits for its copy"
    );
    let mut q = PinnedBuffer::<u8>::zeroed(pool, n).unwrap();
    assert_ne!(q.host_ptr(), addr, "handed out while a copy still reads it");
    q.as_mut_slice().unwrap().fill(0xee); // scribble: must not reach the device copy
    assert!(
        d.to_vec().unwrap() == src,
        "the in-flight copy read scribbled data"
    );
    drop(q);
    pool.synchronize().unwrap();
    let r = PinnedBuffer::<u8>::zeroed(pool, n).unwrap();
    let s2 = pool.stats();
    assert_eq!(s2.pending_bytes, 0);
    assert!(s2.num_deferred_frees >= 1);
    assert!(
        r.host_ptr() == addr || s2.num_cache_hits >= 1,
        "reused once complete"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_reads_of_pinned_memory_wait_for_device_writes() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    let n = 1 << 20;
    let mut d = DeviceBuffer::<u32>::zeroed(&a, s, n).unwrap();
    let mut h = PinnedBuffer::<u32>::zeroed(a.pinned_pool().unwrap(), n).unwrap();
    let (v, nn) = (0xabcd_0000u32, n as u64);
    let mut b = st.launch_builder(&g.slow_fill);
    b.arg(&mut d).arg(&v).arg(&nn).arg(&SPIN);
    // SAFETY: `d` holds n u32s.
    unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    d.copy_to_pinned(&mut h).unwrap(); // returns at once, the kernel still spins
    let got = h.as_slice().unwrap(); // must wait for kernel + copy
    assert!(got.iter().enumerate().all(|(i, &x)| x == v ^ i as u32));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn async_upload_consumes_the_source_before_returning() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    let n = 48 << 20;
    let mut src = pattern(n, 9);
    let want = src.clone();
    let mut d = DeviceBuffer::<u8>::zeroed(&a, s, n).unwrap();
    spin(&g, &st); // the device side cannot have run when the call returns
    d.copy_from_host_with(&src, Transfer::Async).unwrap();
    src.fill(0); // allowed: the borrow has ended
    assert!(d.to_vec().unwrap() == want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_bridge_round_trips_through_a_kernel_in_order() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    let cap = 256usize;
    let mut ring = RingBridge::<Msg>::new(&a, s, cap).unwrap();
    let (mut sent, mut got) = (0u64, 0u64);
    for round in 0..300u64 {
        let batch = 1 + (round * 97) % cap as u64;
        for _ in 0..batch {
            ring.send(Msg::new(sent)).unwrap();
            sent += 1;
        }
        let flushed = ring.flush_to_device().unwrap();
        let out = ring.next_device_seqs(flushed.end - flushed.start);
        let (c, in0, out0, n) = (
            cap as u64,
            flushed.start,
            out.start,
            flushed.end - flushed.start,
        );
        let outbox = ring.outbox_device().unwrap().device_ptr();
        let inbox = ring.inbox_device_mut().unwrap();
        let mut b = st.launch_builder(&g.echo);
        b.arg(inbox)
            .arg(&outbox)
            .arg(&c)
            .arg(&in0)
            .arg(&out0)
            .arg(&n);
        // SAFETY: both rings hold `cap` messages; the kernel indexes them modulo `cap`.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
        ring.publish(n).unwrap();
        for m in ring.receive().unwrap() {
            assert!(m.intact(), "message {got} corrupted");
            assert_eq!(m, Msg::new(got), "message {got}");
            got += 1;
        }
    }
    assert_eq!(got, sent);
    let c = ring.counters();
    assert_eq!((c.messages_to_device, c.messages_to_host), (sent, sent));
    println!("ring bridge: {c:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn polled_ring_round_trips_through_a_running_kernel_without_copies() {
    let g = gpu();
    let st = g.ctx.new_stream().unwrap();
    let s = Stream::from(&*st);
    let a = alloc();
    assert!(
        a.visibility().polled_host_memory(),
        "this machine's GPU should let kernels poll host memory: {:?}",
        a.visibility()
    );
    let cap = 64usize;
    // Auto picks the polled mode on this platform
    let mut ring = RingBridge::<Msg>::with_mode(&a, s, cap, RingMode::Auto).unwrap();
    assert!(
        matches!(ring.mode(), RingMode::Polled { .. }),
        "{:?}",
        ring.mode()
    );
    // SAFETY: `echo_polled` has the six-argument signature and stays within the rings.
    unsafe { ring.launch_polled(&st, &g.echo_polled, 256) }.unwrap();
    let sent = msg::echo_bursts(&mut ring, 2000, |round| 1 + (round * 29) % cap as u64);
    ring.close().unwrap();
    st.synchronize().unwrap();
    let c = ring.counters();
    assert_eq!(c.copies, 0, "no copies in polled mode");
    assert_eq!((c.messages_to_device, c.messages_to_host), (sent, sent));
    println!("polled ring: {sent} messages through a running kernel; {c:?}");
}
