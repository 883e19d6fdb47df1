//! `gpumem bench ring`: the ring bridge's two modes side by side: message round-trip latency
//! (one 128-byte message there and back, one at a time) and throughput (a stream of messages
//! with the ring kept full). Polled: a kernel polls the rings in mapped pinned memory and
//! echoes; copies: each batch is flushed to the device, echoed by a kernel launch and copied
//! back. On the host backend the polled "device" is a host thread and the copy-mode echo is
//! done by copies: the protocol's figures, not a GPU's.

use crate::output::{emit, median, Result, Target};
use bytemuck::{Pod, Zeroable};
use gpumem::buffer::ring::{RingBridge, RingMode};
use gpumem::{Device, Stream};
use serde::Serialize;
use std::time::{Duration, Instant};

/// A 128-byte, cache-line-aligned message.
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Msg {
    words: [u64; 16],
}

impl Msg {
    fn new(seq: u64) -> Self {
        let mut words = [0u64; 16];
        for (i, w) in words.iter_mut().enumerate() {
            *w = seq
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(i as u32)
                ^ i as u64;
        }
        words[0] = seq;
        Msg { words }
    }
}

#[derive(Debug, Serialize)]
pub struct Row {
    pub mode: String,
    /// round trips measured
    pub round_trips: u64,
    pub latency_median_us: f64,
    pub latency_p99_us: f64,
    /// messages streamed there and back
    pub messages: u64,
    pub messages_per_s: f64,
    /// host → device payload bandwidth of the stream
    pub mb_per_s: f64,
    /// copy calls the stream needed
    pub copies: u64,
}

#[derive(Debug, Serialize)]
pub struct Out {
    pub device: String,
    pub message_bytes: usize,
    pub capacity: usize,
    pub poll_us: f64,
    pub rows: Vec<Row>,
}

/// The device side of both modes.
trait Echo {
    /// copy mode: echo `n` flushed messages (from seq `in0`) into the inbox (from `out0`)
    fn echo_copies(&self, ring: &mut RingBridge<Msg>, in0: u64, out0: u64, n: u64) -> Result<()>;
    /// polled mode: start the polling side on `ring`
    fn start_polled(&self, ring: &RingBridge<Msg>) -> Result<Option<std::thread::JoinHandle<u64>>>;
    /// polled mode: after the close, wait for the device side to finish
    fn finish_polled(&self, h: Option<std::thread::JoinHandle<u64>>) -> Result<()>;
}

struct HostEcho;

impl Echo for HostEcho {
    fn echo_copies(&self, ring: &mut RingBridge<Msg>, in0: u64, out0: u64, n: u64) -> Result<()> {
        let cap = ring.capacity() as u64;
        let all = ring.outbox_device()?.to_vec()?;
        let inbox = ring.inbox_device_mut()?;
        for k in 0..n {
            inbox.set(((out0 + k) % cap) as usize, all[((in0 + k) % cap) as usize])?;
        }
        Ok(())
    }
    fn start_polled(&self, ring: &RingBridge<Msg>) -> Result<Option<std::thread::JoinHandle<u64>>> {
        let a = ring.polled_args().ok_or("not a polled ring")?;
        Ok(Some(std::thread::spawn(move || {
            // SAFETY: the rings of a host-backend bridge, which `measure` keeps until the
            // echo has attached and its close has waited for the return
            unsafe { gpumem::buffer::ring::echo_on_host(a) }
        })))
    }
    fn finish_polled(&self, h: Option<std::thread::JoinHandle<u64>>) -> Result<()> {
        if let Some(h) = h {
            h.join().map_err(|_| "the host echo thread panicked")?;
        }
        Ok(())
    }
}

fn round_trip_latency(
    ring: &mut RingBridge<Msg>,
    echo: &dyn Echo,
    n: u64,
    seq: &mut u64,
) -> Result<Vec<f64>> {
    let polled = ring.polled_args().is_some();
    let mut lat = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let m = Msg::new(*seq);
        let t = Instant::now();
        ring.send(m)?;
        let back = if polled {
            ring.receive_at_least(1)?
        } else {
            let f = ring.flush_to_device()?;
            let out = ring.next_device_seqs(1);
            echo.echo_copies(ring, f.start, out.start, 1)?;
            ring.publish(1)?;
            ring.receive()?
        };
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        if back != [m] {
            return Err(format!("round trip {seq}: the message came back changed").into());
        }
        *seq += 1;
    }
    Ok(lat)
}

fn stream(
    ring: &mut RingBridge<Msg>,
    echo: &dyn Echo,
    total: u64,
    seq0: u64,
) -> Result<(f64, u64)> {
    let cap = ring.capacity() as u64;
    let polled = ring.polled_args().is_some();
    let (mut sent, mut got) = (0u64, 0u64);
    let check = |got: &mut u64, back: Vec<Msg>| -> Result<()> {
        for m in back {
            if m != Msg::new(seq0 + *got) {
                return Err(format!("message {} came back changed", seq0 + *got).into());
            }
            *got += 1;
        }
        Ok(())
    };
    let t = Instant::now();
    if polled {
        while got < total {
            while sent < total && sent - got < cap {
                ring.send(Msg::new(seq0 + sent))?;
                sent += 1;
            }
            let back = ring.receive()?;
            check(&mut got, back)?;
        }
    } else {
        while got < total {
            let batch = (total - sent).min(cap);
            for _ in 0..batch {
                ring.send(Msg::new(seq0 + sent))?;
                sent += 1;
            }
            let f = ring.flush_to_device()?;
            let out = ring.next_device_seqs(batch);
            echo.echo_copies(ring, f.start, out.start, batch)?;
            ring.publish(batch)?;
            let back = ring.receive()?;
            check(&mut got, back)?;
        }
    }
    Ok((t.elapsed().as_secs_f64(), ring.counters().copies))
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)]
}

#[allow(clippy::too_many_arguments)]
fn measure(
    alloc: &Device,
    stream_handle: Stream,
    echo: &dyn Echo,
    device: String,
    cap: usize,
    round_trips: u64,
    messages: u64,
    poll: Duration,
) -> Result<Out> {
    let mut rows = Vec::new();
    for mode in [RingMode::Polled { poll }, RingMode::Copies] {
        let mut ring = RingBridge::<Msg>::with_mode(alloc, stream_handle, cap, mode)?;
        let polled = ring.polled_args().is_some();
        let handle = if polled {
            let h = echo.start_polled(&ring)?;
            ring.wait_attached()?;
            h
        } else {
            None
        };
        let mut seq = 0u64;
        // warm-up, then the figures
        round_trip_latency(&mut ring, echo, 100.min(round_trips), &mut seq)?;
        let lat = round_trip_latency(&mut ring, echo, round_trips, &mut seq)?;
        let copies_before = ring.counters().copies;
        let (secs, copies) = stream(&mut ring, echo, messages, seq)?;
        ring.close()?;
        echo.finish_polled(handle)?;
        rows.push(Row {
            mode: if polled {
                format!("polled (poll {} us)", poll.as_secs_f64() * 1e6)
            } else {
                "copies".into()
            },
            round_trips,
            latency_median_us: median(lat.clone()),
            latency_p99_us: p99(lat),
            messages,
            messages_per_s: messages as f64 / secs,
            mb_per_s: messages as f64 * std::mem::size_of::<Msg>() as f64 / secs / 1e6,
            copies: copies - copies_before,
        });
    }
    Ok(Out {
        device,
        message_bytes: std::mem::size_of::<Msg>(),
        capacity: cap,
        poll_us: poll.as_secs_f64() * 1e6,
        rows,
    })
}

fn print(o: &Out) {
    println!(
        "ring bridge on {}: {} B messages, {} slots per ring",
        o.device, o.message_bytes, o.capacity
    );
    println!(
        "{:<22} {:>12} {:>12} {:>14} {:>10} {:>8}",
        "mode", "rt median", "rt p99", "stream msg/s", "MB/s", "copies"
    );
    for r in &o.rows {
        println!(
            "{:<22} {:>9.2} us {:>9.2} us {:>14.0} {:>10.1} {:>8}",
            r.mode, r.latency_median_us, r.latency_p99_us, r.messages_per_s, r.mb_per_s, r.copies
        );
    }
}

/// Arguments of `gpumem bench ring`.
pub struct RingArgs {
    pub json: bool,
    pub round_trips: u64,
    pub messages: u64,
    pub capacity: usize,
    pub poll_us: f64,
    pub target: Target,
}

pub fn run(a: RingArgs) -> Result<()> {
    let config = a.target.config()?;
    let poll = Duration::from_secs_f64(a.poll_us.max(0.0) / 1e6);
    let gpu = a.target.gpu();
    let out = if gpu {
        #[cfg(feature = "cuda")]
        {
            gpu::run(&a, config, poll)?
        }
        #[cfg(not(feature = "cuda"))]
        {
            return Err("built without the cuda feature".into());
        }
    } else {
        let alloc = Device::host(config)?;
        measure(
            &alloc,
            Stream::DEFAULT,
            &HostEcho,
            "host (no GPU: the polling device is a host thread, copies are host memcpys)".into(),
            a.capacity,
            a.round_trips,
            a.messages,
            poll,
        )?
    };
    emit(a.json, &out, print)
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::output::{device_name, msg};
    use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use gpumem::buffer::ring::{POLLED_ECHO_CUDA, POLLED_RING_CUDA};
    use std::sync::Arc;

    const ECHO: &str = r#"
extern "C" __global__ void echo_words(unsigned int* inbox, const unsigned int* outbox,
        unsigned long long cap, unsigned long long in0, unsigned long long out0,
        unsigned long long n, unsigned long long words) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= n * words) return;
    unsigned long long m = i / words, w = i % words;
    inbox[((out0 + m) % cap) * words + w] = outbox[((in0 + m) % cap) * words + w];
}
"#;

    struct GpuEcho {
        st: Arc<CudaStream>,
        echo: CudaFunction,
        polled: CudaFunction,
    }

    impl Echo for GpuEcho {
        fn echo_copies(
            &self,
            ring: &mut RingBridge<Msg>,
            in0: u64,
            out0: u64,
            n: u64,
        ) -> Result<()> {
            let (cap, words) = (
                ring.capacity() as u64,
                (std::mem::size_of::<Msg>() / 4) as u64,
            );
            let outbox = ring.outbox_device()?.device_ptr();
            let inbox = ring.inbox_device_mut()?.device_ptr();
            let mut b = self.st.launch_builder(&self.echo);
            b.arg(&inbox)
                .arg(&outbox)
                .arg(&cap)
                .arg(&in0)
                .arg(&out0)
                .arg(&n)
                .arg(&words);
            // SAFETY: both rings hold `cap` messages of `words` words; the kernel indexes
            // them modulo `cap`.
            unsafe { b.launch(LaunchConfig::for_num_elems((n * words) as u32)) }.map_err(msg)?;
            Ok(())
        }
        fn start_polled(
            &self,
            ring: &RingBridge<Msg>,
        ) -> Result<Option<std::thread::JoinHandle<u64>>> {
            // SAFETY: `echo_polled` (POLLED_ECHO_CUDA) has the six-argument signature and
            // stays within the rings.
            unsafe { ring.launch_polled(&self.st, &self.polled, 256) }?;
            Ok(None)
        }
        fn finish_polled(&self, _: Option<std::thread::JoinHandle<u64>>) -> Result<()> {
            self.st.synchronize().map_err(msg)?;
            Ok(())
        }
    }

    pub fn run(a: &RingArgs, config: gpumem::Config, poll: Duration) -> Result<Out> {
        let name = device_name(a.target.device)?;
        let alloc = Device::cuda(a.target.device, config)?;
        let ctx = gpumem::resource::cuda::primary_context(a.target.device)?;
        let st = ctx.new_stream().map_err(msg)?;
        let src = format!("{POLLED_RING_CUDA}{POLLED_ECHO_CUDA}{ECHO}");
        let m = ctx
            .load_module(cudarc::nvrtc::compile_ptx(src).map_err(msg)?)
            .map_err(msg)?;
        let echo = GpuEcho {
            echo: m.load_function("echo_words").map_err(msg)?,
            polled: m.load_function("echo_polled").map_err(msg)?,
            st: st.clone(),
        };
        measure(
            &alloc,
            Stream::from(&*st),
            &echo,
            format!("{name} ({:?})", alloc.visibility()),
            a.capacity,
            a.round_trips,
            a.messages,
            poll,
        )
    }
}
