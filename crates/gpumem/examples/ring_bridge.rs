//! The ring-buffer bridge: cache-line messages cross host → device in batches, a kernel echoes
//! them, and they come back device → host in order. On a machine without a GPU the "device"
//! is gpumem's host backend and the echo is done by copies.
//! `cargo run --release -p gpumem --example ring_bridge`

use gpumem::buffer::ring::RingBridge;
use gpumem::Device;
use gpumem::{Config, Stream};
use std::time::Instant;

#[path = "../tests/common/msg.rs"]
mod msg;
use msg::Msg;

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
        let module = ctx.load_module(cudarc::nvrtc::compile_ptx(msg::ECHO_KERNEL)?)?;
        Some((stream, module.load_function("echo")?))
    } else {
        None
    };
    #[cfg(feature = "cuda")]
    let (alloc, stream) = match &cuda {
        Some((st, _)) => (Device::cuda(0, Config::from_env()?)?, Stream::from(&**st)),
        None => (Device::host(Config::from_env()?)?, Stream::DEFAULT),
    };
    #[cfg(not(feature = "cuda"))]
    let (alloc, stream) = (Device::host(Config::from_env()?)?, Stream::DEFAULT);

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
            let outbox = ring.outbox_device()?.device_ptr();
            let mut b = st.launch_builder(f);
            b.arg(ring.inbox_device_mut()?)
                .arg(&outbox)
                .arg(&c)
                .arg(&in0)
                .arg(&out0)
                .arg(&n);
            // SAFETY: both rings hold `cap` messages; the kernel indexes them modulo `cap`.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        }
        if !gpu {
            let all = ring.outbox_device()?.to_vec()?;
            for (i, o) in flushed.zip(out) {
                ring.inbox_device_mut()?
                    .set((o % cap as u64) as usize, all[(i % cap as u64) as usize])?;
            }
        }
        ring.publish(n)?;
        for m in ring.receive()? {
            if !m.intact() || m != Msg::new(got) {
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
