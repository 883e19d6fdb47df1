//! The `gpumem` command line.

mod cmd;
mod output;

use clap::{Parser, Subcommand};
use cmd::bench_alloc::{AllocArgs, Plan};
use output::Target;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpumem",
    version,
    about = "GPU memory manager: device info and allocator benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Devices and their memory capabilities (or the host backend where no GPU is present).
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Replay allocation traces (JSON Lines, gzip or plain, or PyTorch snapshot pickles)
    /// through gpumem's policies on a simulated device and compare what each reserves with what
    /// the trace recorded: gpumem's default, gpumem without virtual-memory segments, and any
    /// `--conf` policies.
    Replay {
        /// Trace files.
        #[arg(required = true)]
        traces: Vec<std::path::PathBuf>,
        /// Extra policies to compare, as configuration strings (repeatable).
        #[arg(long)]
        conf: Vec<String>,
        /// One JSON object per trace instead of a table.
        #[arg(long)]
        json: bool,
        /// Also replay on CUDA device N with real allocations (no kernels), to check the
        /// simulation against the GPU.
        #[arg(long)]
        device: Option<usize>,
        /// Simulate a GPU that runs behind the host by N allocator calls (0 = kernels take no
        /// time, the default; `never` = no event completes until the pool synchronises).
        #[arg(long, value_parser = parse_lag)]
        gpu_lag: Option<u64>,
        /// Multiply the modelled cost of every driver call by F in the simulated rows (0.1 to
        /// 100; 1, the H100's measured figures, by default), to see whether a policy's outcome
        /// holds on a host whose driver calls are slower; `--device` rows keep the defaults.
        #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = parse_cost)]
        driver_cost: f64,
    },
    /// Advice from a trace: replay a grid of configurations, print the one that reserves
    /// least (its modelled driver time within 1% of the trace's wall time) with what it saves,
    /// and the warm-up sizes that would turn the first step's misses into hits.
    Advise {
        /// Trace file (JSON Lines, gzip or plain, or a PyTorch snapshot pickle).
        trace: std::path::PathBuf,
        /// Extra configurations to try, as configuration strings (repeatable).
        #[arg(long)]
        conf: Vec<String>,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic trace of one workload kind (variable_seq_len, kv_cache_decode,
    /// mixed_tiny_huge, multi_stream, conv_training) as JSON Lines (gzip if the name ends in .gz).
    Synth {
        /// Workload kind.
        kind: String,
        /// Output file.
        #[arg(short, long)]
        output: std::path::PathBuf,
        /// Seed.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Multiplies the number of steps (1 to 100).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
        scale: u64,
    },
    /// Draw a trace: memory timeline and segment map at the peak, as one self-contained HTML
    /// file.
    Viz {
        /// Trace file.
        trace: std::path::PathBuf,
        /// Output HTML file.
        #[arg(short, long, default_value = "memory.html")]
        output: std::path::PathBuf,
        /// Policy whose replay is drawn (configuration string; default: GPUMEM_CONF, else
        /// gpumem's default).
        #[arg(long)]
        conf: Option<String>,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Allocation latency: gpumem's cached pool (and the same with classic segments, where its
    /// configuration has expandable ones) vs cuMemAlloc vs a cuMemAllocAsync pool on a GPU;
    /// gpumem on the host backend vs the system allocator without one.
    Alloc {
        /// Print `{"device": ..., "rows": [...]}` instead of a table.
        #[arg(long)]
        json: bool,
        /// Timed alloc+free pairs in `same_size` (1 to 100,000,000).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        pairs: u64,
        /// Timed operations per thread in the `random_256_live` scenarios (1 to 100,000,000).
        #[arg(long, default_value_t = 262_144, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        ops: u64,
        /// Threads of the multi-threaded scenario (1 to 256).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
        threads: u64,
        /// Rounds of gpumem's allocators, fresh ones each round, the configured policy's and
        /// classic segments' single-thread scenarios batch by batch in turn; each figure is
        /// the median over rounds (1 to 20).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
        rounds: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Copy bandwidth of every host↔device path (pageable raw, pageable staged, pinned,
    /// device↔device, managed prefetch) for sizes 64 KiB … 1 GiB, and pinned alloc+free cost
    /// (`--conf` takes staging_threads, staging_chunk_kb, ...).
    Transfer {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Largest size in MiB, 1 to 1024 (sizes are 64 KiB, 1, 16, 64, 256, 1024 MiB up to
        /// this).
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1024))]
        max_mib: u64,
        #[command(flatten)]
        target: Target,
        /// Peer copies between devices 0 and 1 instead (needs two GPUs).
        #[arg(long)]
        peer: bool,
    },
    /// The ring bridge's modes side by side: message round-trip latency and streaming
    /// throughput, polled (a kernel polls rings in mapped pinned memory) against copies
    /// (flush, kernel launch, copy back). Host backend: a host thread plays the device.
    Ring {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Round trips timed one by one (1 to 10,000,000).
        #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
        round_trips: u64,
        /// Messages streamed (1 to 1,000,000,000).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
        messages: u64,
        /// Slots per ring (1 to 1,048,576).
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        capacity: u64,
        /// Poll interval in microseconds (0: spin), 0 to 100,000.
        #[arg(long, default_value_t = 0.0)]
        poll_us: f64,
        #[command(flatten)]
        target: Target,
    },
    /// Unified memory on the GPU: a kernel over automatically prefetched unified buffers
    /// (managed and mirrored) against device memory and raw managed memory, and the speed of
    /// moving their data each way against pinned memcpy.
    Unified {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Repetitions per figure (medians), 1 to 1000.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1000))]
        reps: u64,
    },
}

fn main() -> ExitCode {
    // Output piped into a reader that stops early (`gpumem replay ... | head`) ends the process
    // quietly, as other command-line tools do, instead of a panic on the failed write.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Info { json } => cmd::info::run(json),
        Command::Replay {
            traces,
            conf,
            json,
            device,
            gpu_lag,
            driver_cost,
        } => cmd::replay::run(
            &traces,
            &conf,
            json,
            device,
            gpu_lag.filter(|&n| n > 0),
            driver_cost,
        ),
        Command::Advise { trace, conf, json } => cmd::advise::run(&trace, &conf, json),
        Command::Synth {
            kind,
            output,
            seed,
            scale,
        } => cmd::synth::run(&kind, &output, seed, scale as usize),
        Command::Viz {
            trace,
            output,
            conf,
        } => cmd::viz::write(&trace, &output, conf.as_deref()),
        Command::Bench {
            what:
                BenchWhat::Alloc {
                    json,
                    pairs,
                    ops,
                    threads,
                    rounds,
                    target,
                },
        } => cmd::bench_alloc::run(AllocArgs {
            json,
            plan: Plan {
                pairs: pairs as usize,
                ops: ops as usize,
                threads: threads as usize,
                rounds: rounds as usize,
            },
            target,
        }),
        Command::Bench {
            what:
                BenchWhat::Transfer {
                    json,
                    max_mib,
                    target,
                    peer,
                },
        } => {
            if peer {
                cmd::bench_transfer::run_peer(json, max_mib as usize)
            } else {
                cmd::bench_transfer::run(json, max_mib as usize, &target)
            }
        }
        Command::Bench {
            what:
                BenchWhat::Ring {
                    json,
                    round_trips,
                    messages,
                    capacity,
                    poll_us,
                    target,
                },
        } => {
            if !(0.0..=100_000.0).contains(&poll_us) {
                Err(format!("--poll-us {poll_us}: expected 0 to 100000 microseconds").into())
            } else {
                cmd::bench_ring::run(cmd::bench_ring::RingArgs {
                    json,
                    round_trips,
                    messages,
                    capacity: capacity as usize,
                    poll_us,
                    target,
                })
            }
        }
        Command::Bench {
            what: BenchWhat::Unified { json, device, reps },
        } => cmd::bench_unified::run(json, device, reps as usize),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--driver-cost`: a factor from 0.1 to 100.
fn parse_cost(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.1..=100.0).contains(&f) => Ok(f),
        _ => Err(format!("`{s}`: expected a factor from 0.1 to 100")),
    }
}

/// `--gpu-lag`: a number of allocator calls up to 10^12, or `never`.
fn parse_lag(s: &str) -> std::result::Result<u64, String> {
    if s == "never" {
        return Ok(u64::MAX);
    }
    match s.parse::<u64>() {
        Ok(n) if n <= 1_000_000_000_000 => Ok(n),
        _ => Err(format!(
            "`{s}`: expected a number of allocator calls (0 to 10^12) or `never`"
        )),
    }
}
