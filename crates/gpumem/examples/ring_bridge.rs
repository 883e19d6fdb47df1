//! The ring-buffer bridge: cache-line messages cross host → device in batches, a kernel echoes
//! them, and they come back device → host in order. On a machine without a GPU the "device"
//! is gpumem's host backend and the echo is done by copies.
//! `cargo run --release -p gpumem --example ring_bridge`

use bytemuck::{Pod, Zeroable};
use gpumem::transfer::ring::RingBridge;
use gpumem::{CachingAllocator, Config, Stream};
use std::time::Instant;

/// One message: 128 bytes, aligned so that no two messages share a cache line.
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Msg {
    seq: u64,
    check: u64,
    payload: [u32; 28],
}

impl Msg {
    fn new(seq: u64) -> Self {
        let mut payload = [0u32; 28];
        for (i, p) in payload.iter_mut().enumerate() {
            *p = (seq as u32).wrapping_mul(2654435761) ^ i as u32;
        }
        let check = payload
            .iter()
            .fold(seq, |a, &p| a.rotate_left(5) ^ p as u64);
        Msg {
            seq,
            check,
            payload,
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const ECHO: &str = r#"
struct __align__(128) Msg { unsigned long long seq, check; unsigned int payload[28]; };
extern "C" __global__ void echo(Msg* inbox, const Msg* outbox, unsigned long long cap,
                                unsigned long long in0, unsigned long long out0,
                                unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) inbox[(out0 + i) % cap] = outbox[(in0 + i) % cap];
}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cap = 1024usize;
    let batches = 2000u64;
    let batch = 600u64;
    #[cfg(feature = "cuda")]
    let gpu = gpumem::device::cuda_available();
    #[cfg(not(feature = "cuda"))]
    let gpu = false;

    #[cfg(feature = "cuda")]
    let cuda = if gpu {
        let ctx = gpumem::resource::cuda::primary_context(0)?;
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(cudarc::nvrtc::compile_ptx(ECHO)?)?;
        Some((stream, module.load_function("echo")?))
    } else {
        None
    };
    #[cfg(feature = "cuda")]
    let (alloc, stream) = match &cuda {
        Some((st, _)) => (
            CachingAllocator::cuda(0, Config::from_env()?)?,
            Stream::from(&**st),
        ),
        None => (
            CachingAllocator::host(Config::from_env()?)?,
            Stream::DEFAULT,
        ),
    };
    #[cfg(not(feature = "cuda"))]
    let (alloc, stream) = (
        CachingAllocator::host(Config::from_env()?)?,
        Stream::DEFAULT,
    );

    let mut ring = RingBridge::<Msg>::new(&alloc, stream, cap)?;
    let (mut sent, mut got) = (0u64, 0u64);
    let t = Instant::now();
    for _ in 0..batches {
        for _ in 0..batch {
            ring.send(Msg::new(sent))?;
            sent += 1;
        }
        let flushed = ring.flush_to_device()?;
        let n = flushed.end - flushed.start;
        let out = ring.next_device_seqs(n);
        #[cfg(feature = "cuda")]
        if let Some((st, f)) = &cuda {
            use cudarc::driver::{LaunchConfig, PushKernelArg};
            let (c, in0, out0) = (cap as u64, flushed.start, out.start);
            let outbox = ring.outbox_device().device_ptr();
            let mut b = st.launch_builder(f);
            b.arg(ring.inbox_device_mut())
                .arg(&outbox)
                .arg(&c)
                .arg(&in0)
                .arg(&out0)
                .arg(&n);
            // SAFETY: both rings hold `cap` messages; the kernel indexes them modulo `cap`.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        }
        if !gpu {
            let all = ring.outbox_device().to_vec()?;
            for (i, o) in flushed.zip(out) {
                ring.inbox_device_mut()
                    .set((o % cap as u64) as usize, all[(i % cap as u64) as usize])?;
            }
        }
        ring.publish(n)?;
        for m in ring.receive()? {
            if m != Msg::new(got) {
                return Err(format!("message {got} came back as {}", m.seq).into());
            }
            got += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let c = ring.counters();
    println!(
        "ring bridge on {}: {got} messages of {} B there and back in order, intact; \
         {:.2} M msgs/s round trip; {} copies for {} flushes",
        if gpu { "the GPU" } else { "the host backend" },
        std::mem::size_of::<Msg>(),
        got as f64 / secs / 1e6,
        c.copies,
        c.flushes_to_device + c.flushes_to_host
    );
    println!("{c:?}");
    Ok(())
}
