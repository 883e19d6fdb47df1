#!/usr/bin/env python3
"""Where a slow step's time goes: host or GPU (a probe for the two levels of step time seen on
the H100/H200 machines, README "Step times side by side").

    python scripts/probes/step_levels.py WORKLOAD native|gpumem [--steps N]

Runs one `scripts/bench_torch.py` workload in this process and prints, per step: the wall
time (launch to synchronised), the host's enqueue time (until the step's Python code has
queued its last kernel and returned its loss), the tail (enqueue done to synchronised: the
GPU still busy), the GPU's span between events recorded at the step's start and end, the
process's CPU time in the step, the CPU the main thread was on at its end, and with gpumem
the time its allocate and free took on the host (`host_alloc_ns` + `host_free_ns`: run with
`GPUMEM_CONF=time_calls:True`, else 0). A step whose
enqueue time grows while the tail shrinks is host-bound and slow on the host; one whose tail
and GPU span grow is slow on the GPU (where the allocator's memory could matter: pages,
placement)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def cpu_now():
    """The CPU the calling thread last ran on (/proc/thread-self/stat, field 39)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("setting", choices=["native", "gpumem"])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    if a.setting == "gpumem":
        import gpumem_torch

        gpumem_torch.install()
    import torch
    import bench_torch

    bench_torch.job_settings(torch)
    gen = bench_torch.workload_steps(torch, a.workload, a.steps)
    rows = []
    stats = (lambda: 0) if a.setting != "gpumem" else (
        lambda: sum(gpumem_torch.memory_stats().get(k, 0) for k in ("host_alloc_ns", "host_free_ns")))
    torch.cuda.synchronize()
    for k in range(a.steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = stats()
        c0, t0 = time.process_time(), time.perf_counter()
        e0.record()
        try:
            loss = next(gen)
        except StopIteration:
            break
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        c1 = time.process_time()
        float(loss.detach())
        rows.append((k + 1, (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                     e0.elapsed_time(e1), (c1 - c0) * 1e3, cpu_now(), (stats() - h0) / 1e6))
    conf = os.environ.get("GPUMEM_CONF", "") if a.setting == "gpumem" else ""
    who = f"{a.workload} {a.setting}" + (f" ({conf})" if conf else "")
    print(f"{who}: step wall_ms enqueue_ms tail_ms gpu_ms cpu_ms cpu alloc_ms")
    for r in rows:
        print(f"STEP {r[0]:3d} {r[1]:8.2f} {r[2]:8.2f} {r[3]:8.2f} {r[4]:8.2f} {r[5]:8.2f} {r[6]:3d} "
              f"{r[7]:6.2f}")
    late = rows[3:]
    med = lambda i: statistics.median(r[i] for r in late)
    print(f"MEDIAN {who}: wall {med(1):.2f} enqueue {med(2):.2f} tail {med(3):.2f} "
          f"gpu {med(4):.2f} cpu {med(5):.2f} alloc {med(7):.2f} (steps 4-{len(rows)})")


if __name__ == "__main__":
    main()
