//! The `gpumem` command line.

mod bench;
mod transfer_bench;
#[cfg(feature = "cuda")]
mod unified_bench;
mod viz;

use bench::{Plan, Row};
use clap::{Parser, Subcommand};
use gpumem::units::human;
use gpumem::{Config, DeviceInfo};
use serde::Serialize;
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
        /// Multiplies the number of steps.
        #[arg(long, default_value_t = 1)]
        scale: usize,
    },
    /// Draw a trace: memory timeline and segment map at the peak, as one self-contained HTML
    /// file.
    Viz {
        /// Trace file.
        trace: std::path::PathBuf,
        /// Output HTML file.
        #[arg(short, long, default_value = "memory.html")]
        output: std::path::PathBuf,
        /// Policy whose replay is drawn (configuration string; default: gpumem's default).
        #[arg(long, default_value = "")]
        conf: String,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Allocation latency: gpumem's cached pool vs cuMemAlloc vs a cuMemAllocAsync pool on a
    /// GPU; gpumem on the host backend vs the system allocator without one.
    Alloc {
        /// Print `{"device": ..., "rows": [...]}` instead of a table.
        #[arg(long)]
        json: bool,
        /// Timed alloc+free pairs in `same_size`.
        #[arg(long, default_value_t = 1_000_000)]
        pairs: usize,
        /// Timed operations per thread in the `random_256_live` scenarios.
        #[arg(long, default_value_t = 262_144)]
        ops: usize,
        /// Threads of the multi-threaded scenario.
        #[arg(long, default_value_t = 8)]
        threads: usize,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Force the host backend even where a GPU is present.
        #[arg(long)]
        host: bool,
        /// gpumem configuration (as GPUMEM_CONF); defaults to GPUMEM_CONF or the defaults.
        #[arg(long)]
        conf: Option<String>,
    },
    /// Copy bandwidth of every host↔device path (pageable raw, pageable staged, pinned,
    /// device↔device, managed prefetch) for sizes 64 KiB … 1 GiB, and pinned alloc+free cost.
    Transfer {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Largest size in MiB (sizes are 64 KiB, 1, 16, 64, 256, 1024 MiB up to this).
        #[arg(long, default_value_t = 1024)]
        max_mib: usize,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Force the host backend even where a GPU is present.
        #[arg(long)]
        host: bool,
        /// gpumem configuration (staging_threads, staging_chunk_kb, ...); defaults to
        /// GPUMEM_CONF or the defaults.
        #[arg(long)]
        conf: Option<String>,
        /// Peer copies between devices 0 and 1 instead (needs two GPUs).
        #[arg(long)]
        peer: bool,
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
        /// Repetitions per figure (medians).
        #[arg(long, default_value_t = 10)]
        reps: usize,
    },
}

#[derive(Serialize)]
struct InfoOut {
    backend: &'static str,
    devices: Vec<DeviceInfo>,
    host_memory: gpumem::resource::MemInfo,
    /// every configuration key with its value in force, in the configuration string's units
    config: serde_json::Map<String, serde_json::Value>,
    /// the same as one configuration string (it parses back to the same configuration)
    config_string: String,
}

fn info(json: bool) -> Result<(), String> {
    let devices = gpumem::device::devices().map_err(|e| e.to_string())?;
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let out = InfoOut {
        backend: if devices.is_empty() { "host" } else { "cuda" },
        host_memory: gpumem::resource::host::host_mem_info(),
        config: config
            .entries()
            .into_iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
            .collect(),
        config_string: config.to_string(),
        devices,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!("gpumem {}", env!("CARGO_PKG_VERSION"));
    if out.devices.is_empty() {
        println!("No CUDA GPU found (no driver library, or no device): using the host backend.");
        println!(
            "host memory: {} free of {}",
            human(out.host_memory.free),
            human(out.host_memory.total)
        );
    }
    for d in &out.devices {
        let yn = |b: bool| if b { "yes" } else { "no" };
        println!(
            "device {}: {} (compute {}.{}, {} SMs, driver {}.{})",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.multiprocessors,
            d.driver_version / 1000,
            (d.driver_version % 1000) / 10
        );
        println!(
            "  memory                      {} free of {}",
            human(d.free_memory),
            human(d.total_memory)
        );
        println!("  managed memory              {}", yn(d.managed_memory));
        println!(
            "  concurrent managed access   {}",
            yn(d.concurrent_managed_access)
        );
        println!(
            "  pageable memory access      {}",
            yn(d.pageable_memory_access)
        );
        println!(
            "  virtual memory management   {}",
            yn(d.virtual_memory_management)
        );
        println!("  memory pools                {}", yn(d.memory_pools));
        println!("  unified addressing          {}", yn(d.unified_addressing));
        let peers: Vec<String> = d.peer_access.iter().map(|p| p.to_string()).collect();
        println!(
            "  peer access to              {}",
            if peers.is_empty() {
                "none".to_string()
            } else {
                peers.join(", ")
            }
        );
    }
    let set = std::env::var(gpumem::config::ENV_VAR).is_ok();
    println!(
        "configuration ({}; `*` marks values that differ from the default):",
        if set {
            "from GPUMEM_CONF"
        } else {
            "GPUMEM_CONF unset: the defaults"
        }
    );
    for k in gpumem::config::keys::KEYS {
        let v = k.show(&config);
        let mark = if v == k.default_value() { ' ' } else { '*' };
        println!("  {mark} {}:{v}", k.name);
    }
    Ok(())
}

/// "NAME (device N)" for the benchmarks' headers, or an error naming the missing device.
#[cfg(feature = "cuda")]
fn device_name(ordinal: usize) -> Result<String, String> {
    gpumem::device::devices()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|d| d.ordinal == ordinal)
        .map(|d| format!("{} (device {})", d.name, d.ordinal))
        .ok_or_else(|| format!("no CUDA device {ordinal}"))
}

#[derive(Serialize)]
struct BenchOut {
    device: String,
    rows: Vec<Row>,
}

struct AllocArgs {
    json: bool,
    plan: Plan,
    device: usize,
    host: bool,
    conf: Option<String>,
}

fn bench_alloc(a: AllocArgs) -> Result<(), String> {
    let config = match &a.conf {
        Some(s) => Config::parse(s),
        None => Config::from_env(),
    }
    .map_err(|e| e.to_string())?;
    let gpu = !a.host && gpumem::device::cuda_available();
    let (device, rows) = if gpu {
        bench_gpu(&a, config)?
    } else {
        let g = bench::host_gpumem(config).map_err(|e| e.to_string())?;
        let total = bench::units(&g, &a.plan) + bench::units(&bench::System, &a.plan);
        let pb = bench::progress(total, a.json);
        let mut rows = bench::run_all(&g, &a.plan, &pb);
        rows.extend(bench::run_all(&bench::System, &a.plan, &pb));
        pb.finish_and_clear();
        ("host (no GPU)".to_string(), rows)
    };
    if a.json {
        let out = BenchOut { device, rows };
        println!(
            "{}",
            serde_json::to_string(&out).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!("allocation latency on {device} (one op = one alloc + one free)");
    println!(
        "{:<18} {:<32} {:>7} {:>14} {:>12}",
        "allocator", "scenario", "threads", "median ns/op", "mean ns/op"
    );
    for r in &rows {
        println!(
            "{:<18} {:<32} {:>7} {:>14.1} {:>12.1}",
            r.allocator, r.scenario, r.threads, r.ns_per_op, r.mean_ns_per_op
        );
    }
    let mut names: Vec<&str> = rows.iter().map(|r| r.allocator.as_str()).collect();
    names.dedup();
    for alloc in names {
        let one = rows
            .iter()
            .find(|r| r.allocator == alloc && r.scenario == "random_256_live");
        let many = rows.iter().find(|r| r.allocator == alloc && r.threads > 1);
        if let (Some(one), Some(many)) = (one, many) {
            println!(
                "{alloc}: {} threads give {:.1}x the single-thread throughput ({:.1} vs {:.1} ns/op, wall time / ops)",
                many.threads,
                one.mean_ns_per_op / many.mean_ns_per_op,
                many.mean_ns_per_op,
                one.mean_ns_per_op
            );
        }
    }
    Ok(())
}

fn bench_transfer(
    json: bool,
    max_mib: usize,
    device: usize,
    host: bool,
    conf: Option<String>,
) -> Result<(), String> {
    let config = match &conf {
        Some(s) => Config::parse(s),
        None => Config::from_env(),
    }
    .map_err(|e| e.to_string())?;
    let sizes: Vec<usize> = [
        64usize << 10,
        1 << 20,
        16 << 20,
        64 << 20,
        256 << 20,
        1 << 30,
    ]
    .into_iter()
    .filter(|&s| s <= (max_mib << 20).max(64 << 10))
    .collect();
    let gpu = !host && gpumem::device::cuda_available();
    let (alloc, name) = if gpu {
        #[cfg(feature = "cuda")]
        {
            let name = device_name(device)?;
            (
                gpumem::Device::cuda(device, config).map_err(|e| e.to_string())?,
                name,
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            return Err("built without the cuda feature".into());
        }
    } else {
        (
            gpumem::Device::host(config).map_err(|e| e.to_string())?,
            "host (no GPU: copies are memcpy)".to_string(),
        )
    };
    let out = transfer_bench::run(&alloc, name, &sizes, json)?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&out).map_err(|e| e.to_string())?
        );
    } else {
        transfer_bench::print(&out);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn bench_peer(json: bool, max_mib: usize) -> Result<(), String> {
    let n = gpumem::device::device_count();
    if n < 2 {
        return Err(format!(
            "bench transfer --peer needs two CUDA GPUs (found {n})"
        ));
    }
    let out = transfer_bench::peer(max_mib)?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&out).map_err(|e| e.to_string())?
        );
    } else {
        transfer_bench::print(&out);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench_peer(_: bool, _: usize) -> Result<(), String> {
    Err("built without the cuda feature".into())
}

#[cfg(feature = "cuda")]
fn bench_unified(json: bool, device: usize, reps: usize) -> Result<(), String> {
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
    let out = unified_bench::run(device, name, reps, counter.as_ref())?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&out).map_err(|e| e.to_string())?
        );
    } else {
        unified_bench::print(&out);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench_unified(_: bool, _: usize, _: usize) -> Result<(), String> {
    Err("built without the cuda feature".into())
}

#[cfg(feature = "cuda")]
fn bench_gpu(a: &AllocArgs, config: Config) -> Result<(String, Vec<Row>), String> {
    use gpumem::resource::cuda::{CudaAsyncPool, CudaDevice};
    use std::sync::Arc;
    let e = |e: gpumem::Error| e.to_string();
    let name = device_name(a.device)?;
    let g = bench::Gpumem(
        gpumem::Device::cuda(a.device, config)
            .map_err(e)?
            .allocator()
            .clone(),
    );
    let raw = bench::Raw {
        resource: Arc::new(CudaDevice::new(a.device).map_err(e)?),
        slow: true,
    };
    let pool = bench::Raw {
        resource: Arc::new(CudaAsyncPool::new(a.device, u64::MAX).map_err(e)?),
        slow: false,
    };
    let total =
        bench::units(&g, &a.plan) + bench::units(&raw, &a.plan) + bench::units(&pool, &a.plan);
    let pb = bench::progress(total, a.json);
    let mut rows = bench::run_all(&g, &a.plan, &pb);
    drop(g); // give its cached segments back before the others run
    rows.extend(bench::run_all(&pool, &a.plan, &pb));
    drop(pool);
    rows.extend(bench::run_all(&raw, &a.plan, &pb));
    pb.finish_and_clear();
    Ok((name, rows))
}

#[cfg(not(feature = "cuda"))]
fn bench_gpu(_: &AllocArgs, _: Config) -> Result<(String, Vec<Row>), String> {
    Err("built without the cuda feature".into())
}

#[derive(Serialize)]
struct ReplayOut {
    trace: String,
    events: usize,
    policies: Vec<gpumem::trace::PolicyReport>,
}

fn replay(
    traces: &[std::path::PathBuf],
    confs: &[String],
    json: bool,
    device: Option<usize>,
) -> Result<(), String> {
    let mut policies = vec![
        ("gpumem".to_string(), Config::default()),
        (
            "gpumem (no VMM)".to_string(),
            Config::parse("expandable_segments:False").map_err(|e| e.to_string())?,
        ),
    ];
    for c in confs {
        policies.push((c.clone(), Config::parse(c).map_err(|e| e.to_string())?));
    }
    for path in traces {
        let events = gpumem::trace::read_trace(path).map_err(|e| e.to_string())?;
        let mut out = ReplayOut {
            trace: path.display().to_string(),
            events: events.len(),
            policies: vec![gpumem::trace::recorded(&events)],
        };
        let err = |e: gpumem::Error| format!("{}: {e}", path.display());
        for (name, config) in &policies {
            out.policies
                .push(gpumem::trace::replay(name, &events, config, 1 << 50).map_err(err)?);
        }
        if let Some(ordinal) = device {
            for (name, config) in &policies {
                out.policies
                    .push(replay_on_device(name, &events, config, ordinal).map_err(err)?);
            }
        }
        if json {
            println!(
                "{}",
                serde_json::to_string(&out).map_err(|e| e.to_string())?
            );
            continue;
        }
        println!("{} ({} events)", out.trace, out.events);
        println!(
            "  {:<28} {:<10} {:>10} {:>13} {:>6} {:>5} {:>12} {:>8} {:>6} {:>5}",
            "policy",
            "backend",
            "peak live",
            "peak reserved",
            "ratio",
            "segs",
            "largest free",
            "ns/event",
            "calls",
            "syncs"
        );
        for p in &out.policies {
            println!(
                "  {:<28} {:<10} {:>10} {:>13} {:>6.3} {:>5} {:>12} {:>8.1} {:>6} {:>5}",
                p.name,
                p.backend,
                human(p.peak_live_bytes),
                human(p.peak_reserved_bytes),
                p.ratio,
                p.segments_at_peak,
                human(p.largest_free_block_at_peak),
                p.ns_per_event,
                p.device_calls,
                p.unmap_syncs
            );
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn replay_on_device(
    name: &str,
    events: &[gpumem::trace::TraceEvent],
    config: &Config,
    ordinal: usize,
) -> gpumem::Result<gpumem::trace::PolicyReport> {
    if !gpumem::device::cuda_available() {
        return Err(gpumem::Error::NoGpu(
            "replay --device needs a CUDA GPU".into(),
        ));
    }
    let make = || gpumem::device::cuda_backend(ordinal, config);
    // a CUDA stream of our own for every stream id of the trace but 0 (the default stream)
    let ctx = gpumem::resource::cuda::primary_context(ordinal)?;
    let mut streams = std::collections::HashMap::new();
    for e in events {
        if e.stream != 0 && !streams.contains_key(&e.stream) {
            let s = ctx
                .new_stream()
                .map_err(|err| gpumem::resource::cuda::cuda_err("cuStreamCreate", err))?;
            streams.insert(e.stream, s);
        }
    }
    let map = |id: u64| {
        streams
            .get(&id)
            .map_or(gpumem::Stream::DEFAULT, |s| gpumem::Stream::from(&**s))
    };
    Ok(gpumem::trace::replay_detailed(name, events, config, &make, &map)?.report)
}

#[cfg(not(feature = "cuda"))]
fn replay_on_device(
    _: &str,
    _: &[gpumem::trace::TraceEvent],
    _: &Config,
    _: usize,
) -> gpumem::Result<gpumem::trace::PolicyReport> {
    Err(gpumem::Error::NoGpu(
        "built without the cuda feature".into(),
    ))
}

fn synth(kind: &str, output: &std::path::Path, seed: u64, scale: usize) -> Result<(), String> {
    use gpumem::trace::synthetic::Kind;
    let k = Kind::from_name(kind).ok_or_else(|| {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        format!("unknown workload `{kind}` (known: {})", names.join(", "))
    })?;
    let events = k.generate(seed, scale);
    gpumem::trace::write_trace(output, &events).map_err(|e| e.to_string())?;
    eprintln!("wrote {} ({} events)", output.display(), events.len());
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Info { json } => info(json),
        Command::Replay {
            traces,
            conf,
            json,
            device,
        } => replay(&traces, &conf, json, device),
        Command::Synth {
            kind,
            output,
            seed,
            scale,
        } => synth(&kind, &output, seed, scale),
        Command::Viz {
            trace,
            output,
            conf,
        } => viz::write(&trace, &output, &conf),
        Command::Bench {
            what:
                BenchWhat::Alloc {
                    json,
                    pairs,
                    ops,
                    threads,
                    device,
                    host,
                    conf,
                },
        } => bench_alloc(AllocArgs {
            json,
            plan: Plan {
                pairs,
                ops,
                threads: threads.max(1),
            },
            device,
            host,
            conf,
        }),
        Command::Bench {
            what:
                BenchWhat::Transfer {
                    json,
                    max_mib,
                    device,
                    host,
                    conf,
                    peer,
                },
        } => {
            if peer {
                bench_peer(json, max_mib)
            } else {
                bench_transfer(json, max_mib, device, host, conf)
            }
        }
        Command::Bench {
            what: BenchWhat::Unified { json, device, reps },
        } => bench_unified(json, device, reps.max(1)),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::FAILURE
        }
    }
}
