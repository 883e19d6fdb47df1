#!/usr/bin/env python3
"""Two GPUs, PyTorch, gpumem in every rank beside native: NCCL all-reduce bus bandwidth on
registered buffers, FSDP2 training, and a memcheck of a registered all-reduce.

    python scripts/multi_gpu_check.py [--json OUT] [--memcheck]

Each setting runs in fresh processes (`torch.distributed.run`, 2 ranks, one GPU each) with
TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 (PyTorch registers the allocator's segments
with NCCL through its trace trackers) and NCCL_NVLS_ENABLE=0 (no NVLink multicast).

- allreduce: 64 MiB, 256 MiB and 1 GiB float32 tensors, 5 warm-up and 20 timed all-reduces
  each; bus bandwidth = 2 (n - 1) / n x bytes / time (NCCL's own definition). gpumem's counts
  of ranges told to register and deregister and of violations (a range going while
  registered) come with it.
- fsdp: a 12-layer transformer (d 1024, 16 heads, batch 8 x 1024 tokens, bf16 autocast,
  AdamW) with `fully_shard` on every layer and on the model, 20 steps; the median step after
  the third, and peak reserved / peak allocated on each rank.
- --memcheck: the gpumem all-reduce (small sizes, few iterations) under compute-sanitizer's
  memcheck, every process of the run.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SETTINGS = {"native": "", "expandable": "expandable_segments:True", "gpumem": ""}
# (gpumem-noreg: gpumem without PyTorch's NCCL registration hook; gpumem-classic: gpumem's
# classic segments, no pages)
MIB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats_fn(setting):
    import torch

    if setting.startswith("gpumem"):
        import gpumem_torch

        return gpumem_torch.memory_stats
    return torch.cuda.memory_stats


def allreduce(setting, sizes, iters):
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    out = {"setting": setting, "mode": "allreduce", "rows": []}
    for mb in sizes:
        t = torch.full((mb * MIB // 4,), float(rank + 1), device=dev)
        for _ in range(5):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(t)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
        busbw = 2 * (world - 1) / world * mb * MIB / (ms / 1e3) / 1e9
        out["rows"].append({"mib": mb, "ms": round(ms, 4), "busbw_gbs": round(busbw, 1)})
        del t
    s = stats_fn(setting)()
    for k in ("gpumem.tracker_registers", "gpumem.tracker_deregisters", "gpumem.tracker_violations"):
        if k in s:
            out[k] = s[k]
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def fsdp(setting, steps):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    L, D, H, V, B, T = 12, 1024, 16, 32000, 8, 1024

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(D, H, 4 * D, batch_first=True, norm_first=True)
                for _ in range(L)
            )
            self.head = nn.Linear(D, V)

        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    model = Model().to(dev)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, V, (B, T), device=dev)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().view(-1, V), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    s = stats_fn(setting)()
    mine = {
        "rank": rank,
        "step_ms": statistics.median(times[3:]),
        "peak_allocated": s.get("allocated_bytes.all.peak", 0),
        "peak_reserved": s.get("reserved_bytes.all.peak", 0),
        "loss": float(loss),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps({"setting": setting, "mode": "fsdp", "ranks": every}), flush=True)


def worker(mode, setting, small):
    if setting.startswith("gpumem"):
        import gpumem_torch

        gpumem_torch.install()
    if mode == "allreduce":
        allreduce(setting, [4] if small else [64, 256, 1024], 3 if small else 20)
    else:
        fsdp(setting, 20)


def launch(mode, setting, small=False, memcheck=False, timeout=300):
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "0" if setting.endswith("noreg") else "1"
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if setting.endswith("classic"):
        env["GPUMEM_CONF"] = "expandable_segments:False"
    if SETTINGS.get(setting):
        env["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[setting]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", mode, setting]
    if small:
        cmd.append("--small")
    if memcheck:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--target-processes", "all",
               "--error-exitcode", "99"] + cmd
    t = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    res = json.loads(line[-1][7:]) if line else {"setting": setting, "mode": mode}
    res["rc"] = r.returncode
    if os.environ.get("OUT"):
        name = f"{mode}-{setting}{'-memcheck' if memcheck else ''}.log"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(r.stdout + r.stderr)
    res["wall_s"] = round(time.time() - t, 1)
    if r.returncode != 0 or not line:
        res["tail"] = (r.stdout + r.stderr)[-3000:]
    if memcheck:
        res["sanitizer"] = [l for l in (r.stdout + r.stderr).splitlines() if "ERROR SUMMARY" in l][-4:]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2)
    p.add_argument("--small", action="store_true")
    p.add_argument("--json")
    p.add_argument("--memcheck", action="store_true")
    p.add_argument("--modes", default="allreduce,fsdp")
    p.add_argument("--settings", help="settings to run (default: native and gpumem for allreduce, all for fsdp)")
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], a.small)
        return 0
    results = []
    for mode in a.modes.split(","):
        chosen = a.settings.split(",") if a.settings else (
            ["native", "gpumem"] if mode == "allreduce" else list(SETTINGS))
        for setting in chosen:
            res = launch(mode, setting)
            results.append(res)
            print(json.dumps(res), flush=True)
    if a.memcheck:
        res = launch("allreduce", "gpumem", small=True, memcheck=True, timeout=240)
        results.append(res)
        print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
