"""GPU check: NCCL user-buffer registration of gpumem memory through PyTorch's allocator trace
trackers, on one GPU with one rank (several GPUs: see the README).

With TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, ProcessGroupNCCL attaches two trackers
to the allocator: it registers every segment the snapshot lists when its communicator starts,
then every range told as SEGMENT_ALLOC, and deregisters a range told as SEGMENT_FREE. The check
runs all-reduces on gpumem memory made before and after the communicator, frees it and empties
the cache (pages unmapped, segments released), and reads gpumem's counts: ranges told to
register and to deregister, and violations (a range going while registered: must be 0). NCCL's
own log (NCCL_DEBUG_SUBSYS=REG) shows what it registered. Then a MemPool over NCCL's allocator
(ncclMemAlloc), registered with the process group, with gpumem installed.

    python nccl_check.py            # every case, each in a fresh process
    python nccl_check.py CASE       # one case: pages | classic
"""
import os
import re
import socket
import subprocess
import sys

CASES = {"pages": "", "classic": "expandable_segments:False"}
MIB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(case):
    import gpumem_torch

    gpumem_torch.install(native=True)
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    before = torch.full((32 * MIB // 4,), 1.0, device=dev)  # there when the communicator starts
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    stats = gpumem_torch.memory_stats
    ok = True

    def check(name, cond, detail=""):
        nonlocal ok
        ok &= bool(cond)
        print(("PASS " if cond else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)

    dist.all_reduce(before)
    torch.cuda.synchronize()
    check("all-reduce on memory from before the communicator", bool((before == 1).all()))
    live = []
    for mb in (64, 256, 1024):
        t = torch.full((mb * MIB // 4,), 2.0, device=dev)
        dist.all_reduce(t)
        live.append(t)
    torch.cuda.synchronize()
    check("all-reduce on 64 MiB - 1 GiB of memory mapped since", all(bool((t == 2).all()) for t in live))
    s = stats()
    regs = s.get("gpumem.tracker_registers", 0)
    check("ranges told to register", regs > 0, f"{regs}")
    deregs_before = s.get("gpumem.tracker_deregisters", 0)
    del live, before, t
    torch.cuda.synchronize()
    released = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    s = stats()
    deregs = s.get("gpumem.tracker_deregisters", 0) - deregs_before
    check("deregistered before the memory went", deregs > 0,
          f"{deregs} deregistrations, reserved {released >> 20} -> {torch.cuda.memory_reserved() >> 20} MiB")
    check("no range went while registered", s.get("gpumem.tracker_violations", -1) == 0,
          f"violations {s.get('gpumem.tracker_violations')}")
    # after it all, the allocator goes on (new memory, registered again)
    t = torch.full((128 * MIB // 4,), 3.0, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    check("all-reduce after emptying the cache", bool((t == 3).all()))
    del t

    # a MemPool over NCCL's own allocator (ncclMemAlloc), registered with the process group
    pg = dist.distributed_c10d._get_default_group()._get_backend(dev)
    try:
        alloc = pg.mem_allocator
    except (AttributeError, RuntimeError) as e:
        alloc = None
        print(f"SKIP MemPool over NCCL's allocator: {e}")
    if alloc is None:
        pass
    else:
        pool = torch.cuda.MemPool(alloc)
        with torch.cuda.use_mem_pool(pool):
            u = torch.full((64 * MIB // 4,), 4.0, device=dev)
        pg.register_mem_pool(pool)
        dist.all_reduce(u)
        v = torch.full((64 * MIB // 4,), 5.0, device=dev)  # gpumem's own memory meanwhile
        dist.all_reduce(v)
        torch.cuda.synchronize()
        check("MemPool over NCCL's allocator, registered: all-reduce", bool((u == 4).all()) and bool((v == 5).all()))
        pg.deregister_mem_pool(pool)
        del u, v
        del pool
        w = torch.ones(1024, device=dev)
        check("the allocator goes on after the pool", float(w.sum()) == 1024.0)
    dist.destroy_process_group()
    s = stats()
    print(f"gpumem: {s.get('gpumem.tracker_registers')} registrations, "
          f"{s.get('gpumem.tracker_deregisters')} deregistrations told, "
          f"{s.get('gpumem.tracker_violations')} violations", flush=True)
    return ok


def main():
    if len(sys.argv) > 1:
        return 0 if run(sys.argv[1]) else 1
    status = 0
    for case, conf in CASES.items():
        env = dict(os.environ, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1",
                   NCCL_NVLS_ENABLE="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="REG")
        if conf:
            env["GPUMEM_CONF"] = conf
        r = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=env,
                           capture_output=True, text=True, timeout=600)
        print(f"== {case}")
        nccl = 0
        for line in r.stdout.splitlines():
            if "NCCL INFO" in line and re.search(r"[Rr]egist", line):
                nccl += 1
                line = "NCCL: " + line[line.index("NCCL INFO") + 10:]
            print("  " + line)
        print(f"  {'PASS' if nccl else 'FAIL'} NCCL's log shows {nccl} registrations of gpumem memory")
        if not nccl:
            status = 1
        if r.returncode != 0:
            status = 1
            print("  exit", r.returncode)
            print("\n".join("    " + l for l in r.stderr.splitlines()[-25:]))
    print("nccl_check: " + ("pass" if status == 0 else "FAIL"))
    return status


if __name__ == "__main__":
    sys.exit(main())
