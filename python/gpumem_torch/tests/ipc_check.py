"""GPU check: CUDA tensors from gpumem memory shared between processes with
torch.multiprocessing. The parent installs gpumem, allocates a tensor, sends it to a spawned
child; the child checks the values, writes into the tensor (the parent's memory) and exits;
the parent sees the write, and the block stays allocated until the child let it go.

    python ipc_check.py            # every case, each parent in a fresh process
    python ipc_check.py CASE       # one case: pages | classic | classic-to-native

pages: gpumem's default virtual-memory pages (exported page descriptors; the child runs
gpumem). classic: classic segments (the driver's IPC handle). classic-to-native: the child runs
PyTorch's own allocator and opens gpumem's handle."""
import os
import subprocess
import sys
import time

CASES = {
    "pages": ("", True),
    "classic": ("expandable_segments:False", True),
    "classic-to-native": ("expandable_segments:False", False),
}


def child(q, results, install):
    if install:
        import gpumem_torch

        gpumem_torch.install(native=True)
    import torch

    t = q.get(timeout=120)
    ok = bool((t == 3).all().item())
    t.add_(1)
    torch.cuda.synchronize()
    backend = torch.cuda.memory.get_allocator_backend()
    del t
    results.put((ok, backend))


def parent(case):
    conf, child_installs = CASES[case]
    if conf:
        os.environ["GPUMEM_CONF"] = conf
    import gpumem_torch

    gpumem_torch.install(native=True)
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    t = torch.full((3 << 20,), 3.0, device="cuda")  # 12 MiB
    before = torch.cuda.memory_allocated()
    p = ctx.Process(target=child, args=(q, results, child_installs))
    p.start()
    q.put(t)
    ok, backend = results.get(timeout=180)
    p.join(timeout=60)
    torch.cuda.synchronize()
    seen = bool((t == 4).all().item())
    assert ok, "the child read wrong values"
    assert seen, "the child's write did not reach the parent's memory"
    assert p.exitcode == 0, p.exitcode
    del t
    torch.cuda.ipc_collect()
    after = torch.cuda.memory_allocated()
    print(f"{case}: child ({backend}) read and wrote the parent's tensor; "
          f"allocated {before >> 20} -> {after >> 20} MiB after release")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        parent(sys.argv[1])
        sys.exit(0)
    failed = 0
    for case in CASES:
        t0 = time.time()
        r = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True,
                           timeout=400)
        status = "PASS" if r.returncode == 0 else "FAIL"
        failed += r.returncode != 0
        tail = (r.stdout.strip().splitlines() or [""])[-1]
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["?"])[-3:]
        print(f"{status} ipc {case} ({time.time() - t0:.0f} s): {tail}", flush=True)
    sys.exit(1 if failed else 0)
