//! `gpumem replay`: the demand of traces through gpumem's policies, on the simulator and
//! optionally a real device, beside what each trace's own allocator reserved.

use crate::output::{config_from, emit, Result};
use gpumem::units::human;
use gpumem::Config;
use serde::Serialize;

#[derive(Serialize)]
struct ReplayOut {
    trace: String,
    events: usize,
    policies: Vec<gpumem::trace::PolicyReport>,
}

pub fn run(
    traces: &[std::path::PathBuf],
    confs: &[String],
    json: bool,
    device: Option<usize>,
    gpu_lag: Option<u64>,
    driver_cost: f64,
) -> Result<()> {
    let cost = gpumem::trace::CostModel::default().scaled(driver_cost);
    // the gpumem rows follow GPUMEM_CONF where it is set (an invalid one is an error)
    let base = config_from(None)?;
    let from_env = std::env::var(gpumem::config::ENV_VAR).is_ok();
    let mut no_vmm = base.clone();
    no_vmm.pool.expandable_segments = false;
    let mut policies = vec![
        (
            if from_env {
                "gpumem (GPUMEM_CONF)"
            } else {
                "gpumem"
            }
            .to_string(),
            base,
        ),
        ("gpumem (no VMM)".to_string(), no_vmm),
    ];
    for c in confs {
        if c.trim().is_empty() {
            return Err(
                "--conf \"\": an empty configuration string names no policy (the \
                        `gpumem` row is the default policy)"
                    .into(),
            );
        }
        policies.push((c.clone(), Config::parse(c)?));
    }
    for path in traces {
        let events = gpumem::trace::read_trace(path)?;
        if !events
            .iter()
            .any(|e| e.action == gpumem::trace::Action::Alloc)
        {
            let what = if events.is_empty() {
                "empty"
            } else {
                "without allocations"
            };
            if json {
                emit(
                    true,
                    &ReplayOut {
                        trace: path.display().to_string(),
                        events: events.len(),
                        policies: vec![],
                    },
                    |_| {},
                )?;
            } else {
                println!(
                    "{} ({} events): the trace is {what}: nothing to replay",
                    path.display(),
                    events.len()
                );
            }
            continue;
        }
        let mut out = ReplayOut {
            trace: path.display().to_string(),
            events: events.len(),
            policies: vec![gpumem::trace::recorded(&events)],
        };
        let err = |e: gpumem::Error| format!("{}: {e}", path.display());
        for (name, config) in &policies {
            out.policies.push(
                gpumem::trace::replay_simulated_at(
                    name,
                    &events,
                    config,
                    gpumem::trace::SIM_CAPACITY,
                    gpu_lag,
                    cost,
                )
                .map_err(err)?
                .report,
            );
        }
        if let Some(ordinal) = device {
            for (name, config) in &policies {
                out.policies
                    .push(replay_on_device(name, &events, config, ordinal).map_err(err)?);
            }
        }
        emit(json, &out, print)?;
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

/// One trace's table.
fn print(out: &ReplayOut) {
    println!("{} ({} events)", out.trace, out.events);
    println!(
        "  (ratio: peak reserved / peak live; planned: bytes of the reserved peak in planned \
         layouts, the rest the dynamic pool's; segs and largest free: at the reserved peak; \
         calls: driver allocations, frees, page maps and unmaps; syncs: host waits before \
         unmapping; driver ms: modelled driver time on the allocating thread, and its share \
         of the trace's own wall time)"
    );
    println!(
        "  {:<28} {:<10} {:>10} {:>13} {:>10} {:>6} {:>5} {:>12} {:>8} {:>6} {:>5} {:>10} {:>7}",
        "policy",
        "backend",
        "peak live",
        "peak reserved",
        "planned",
        "ratio",
        "segs",
        "largest free",
        "ns/event",
        "calls",
        "syncs",
        "driver ms",
        "of wall"
    );
    for p in &out.policies {
        if p.backend == "trace" && p.device_calls == 0 {
            // a trace with no segment events (a synthetic one) says nothing of an allocator
            println!(
                "  {:<28} {:<10} {:>10} {:>13} {:>10} {:>6}  (the trace records no segments)",
                p.name,
                p.backend,
                human(p.peak_live_bytes),
                "n/a",
                "n/a",
                "n/a"
            );
            continue;
        }
        println!(
            "  {:<28} {:<10} {:>10} {:>13} {:>10} {:>6.3} {:>5} {:>12} {:>8.1} {:>6} {:>5} {:>10.2} {:>7}",
            p.name,
            p.backend,
            human(p.peak_live_bytes),
            human(p.peak_reserved_bytes),
            if p.backend == "trace" {
                "n/a".to_string()
            } else {
                human(p.planned_bytes_at_peak)
            },
            p.ratio,
            p.segments_at_peak,
            human(p.largest_free_block_at_peak),
            p.ns_per_event,
            p.device_calls,
            p.unmap_syncs,
            p.critical_path_us / 1e3,
            p.critical_path_share
                .map_or("n/a".to_string(), |s| format!("{:.2}%", s * 100.0))
        );
    }
    // (when the peak came, and the pages: the free memory a move could take at the peak,
    // and what it could not)
    for p in &out.policies {
        let when = p.peak_reserved_at.map_or(String::new(), |t| {
            format!(" ({:.0}% of the way through the trace's events)", t * 100.0)
        });
        if p.movable_at_peak + p.stranded_at_peak > 0 {
            println!(
                "  {}: at the reserved peak{when}, {} free in mapped whole pages, {} of them in \
                 physical handles that blocks in use also cover (no move can take those: an \
                 unmap covers whole handles)",
                p.name,
                human(p.movable_at_peak + p.stranded_at_peak),
                human(p.stranded_at_peak)
            );
        } else if !when.is_empty() && p.backend != "trace" {
            println!("  {}: reserved peaked{when}", p.name);
        }
        if let Some(w) = p.worst_window_share {
            println!(
                "  {}: page work on the allocating thread, the worst second after the warm-up: {:.2}% of it",
                p.name,
                w * 100.0
            );
        }
    }
}
