"""Where a step's time goes, under the current allocator: a workload of scripts/bench_torch.py
(its settings: deterministic algorithms, cuDNN benchmark off) runs WARM steps, then PROFILED
steps under torch.profiler. Prints per step: wall time, GPU kernel time and kernels, the CPU
self time of all ops, the ops with the most CPU time (ns per call beside), and the allocating
ops (aten::empty, aten::empty_strided), where the allocator's own time is paid.

`python prof_step.py WORKLOAD native|gpumem` (from the repository root, or with scripts/ on
the path). Compare processes by their per-op figures as well as by wall time: a process on a
slower moment of the host shows every op slower, the CPU's random numbers and
cudaLaunchKernel included, which no allocator touches.
"""
import os
import sys
import time

if sys.argv[-1] == "gpumem":
    import gpumem_torch

    gpumem_torch.install()
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
import bench_torch  # noqa: E402

workload, who = sys.argv[-2], sys.argv[-1]
warm = int(os.environ.get("WARM", "6"))
profiled = int(os.environ.get("PROFILED", "4"))
bench_torch.job_settings(torch)
steps = bench_torch.workload_steps(torch, workload, warm + profiled)
for _ in range(warm):
    next(steps)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    for _ in range(profiled):
        next(steps)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / profiled * 1e3
events = prof.key_averages()
gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
gpu_ms = sum(e.self_device_time_total for e in gpu) / profiled / 1e3
kernels = sum(e.count for e in gpu) / profiled
cpu_ms = sum(e.self_cpu_time_total for e in cpu) / profiled / 1e3
print(
    f"{who} {workload}: wall {wall:.1f} ms a step; GPU kernels {gpu_ms:.1f} ms ({kernels:.0f}); "
    f"CPU self time of ops {cpu_ms:.1f} ms"
)
for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:12]:
    print(
        f"  {who} {e.self_cpu_time_total / profiled / 1e3:7.2f} ms, {e.count // profiled:5d} calls, "
        f"{e.self_cpu_time_total / max(e.count, 1) * 1e3:8.0f} ns each: {e.key[:80]}"
    )
for e in cpu:
    if e.key in ("aten::empty", "aten::empty_strided"):
        print(
            f"  {who} allocating op {e.key}: {e.count // profiled} calls a step, "
            f"{e.self_cpu_time_total / max(e.count, 1) * 1e3:.0f} ns each"
        )
