"""Allocation cost while blocks freed after `record_stream` wait on a busy stream.

`torch.cuda._sleep` keeps a side stream busy; N tensors of 1 KiB are allocated, marked used
there (`Tensor.record_stream`) and deleted, so they wait for that stream's events; then 1,000
`torch.empty(65536)` + `del` are timed on the default stream. An allocator that asks every
waiting block's events on each allocation slows down with N; one that asks each busy stream's
oldest event only (PyTorch's, gpumem's) does not.

    python record_stream_loop.py native|gpumem

Prints ns per allocation and free for N = 0, 100 and 1,000."""
import sys
import time

who = sys.argv[-1]
if who == "gpumem":
    import gpumem_torch

    gpumem_torch.install()
import torch

dev = torch.device("cuda")
side = torch.cuda.Stream()
torch.empty(1024, device=dev)
for n in (0, 100, 1000):
    with torch.cuda.stream(side):
        torch.cuda._sleep(3_000_000_000)  # about 1.5 s: the side stream's events stay pending
    for _ in range(n):
        t = torch.empty(256, device=dev)
        t.record_stream(side)
        del t
    reps = 1000
    t0 = time.perf_counter()
    for _ in range(reps):
        a = torch.empty(1 << 16, device=dev)
        del a
    ns = (time.perf_counter() - t0) / reps * 1e9
    print(f"{who}: {n} blocks waiting on a busy stream: {ns:.0f} ns per torch.empty + del", flush=True)
    torch.cuda.synchronize()
