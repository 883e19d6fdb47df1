"""Do kernels run as fast on the allocator's memory as on PyTorch's own?

gpumem's large blocks live in virtual-memory pages: 2 MiB pages backed by physical handles of
up to 64 MiB, mapped where the blocks need them, where PyTorch's allocator hands out pieces of
cudaMalloc segments. This times bandwidth- and TLB-bound kernels on tensors from the current
allocator, after some churn (so that the pages are not one fresh run): a 1 GiB copy, an add
over 4 GiB, random row gathers from an 8 GiB table (4 KiB and 256 B rows: a kernel that
touches thousands of pages), and a bf16 matmul. Takes about 28 GiB; runs where 30 GiB are free (else says it skipped).

`python mem_speed.py native|gpumem|expandable` (gpumem installs itself first; run
`expandable` with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Prints ms per kernel, the
median of 50 (CUDA events).
"""
import sys

if sys.argv[-1] == "gpumem":
    import gpumem_torch

    gpumem_torch.install(native=True)
import torch


def median_ms(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[n // 2]


who = sys.argv[-1]
free, _ = torch.cuda.mem_get_info()
if free < 30 << 30:
    sys.exit(f"{who}: skipped, {free >> 30} GiB free (needs 30)")
torch.manual_seed(0)
churn = [torch.empty(int(s) << 20, dtype=torch.uint8, device="cuda") for s in torch.randint(2, 300, (60,))]
del churn[::2]
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
print(f"{who}: copy 1 GiB: {median_ms(lambda: b.copy_(a)):.3f} ms")
del a, b
x = torch.randn(1 << 30, device="cuda")
y = torch.randn(1 << 30, device="cuda")
print(f"{who}: add over 4 GiB fp32: {median_ms(lambda: torch.add(x, y, out=x)):.3f} ms")
del x, y
table = torch.randn(2 << 20, 1024, device="cuda")
rows = torch.randint(0, 2 << 20, (1 << 16,), device="cuda")
print(f"{who}: gather 65,536 random 4 KiB rows of 8 GiB: {median_ms(lambda: table.index_select(0, rows)):.3f} ms")
narrow = table.view(-1, 64)
rows = torch.randint(0, narrow.shape[0], (1 << 22,), device="cuda")
print(f"{who}: gather 4M random 256 B rows of 8 GiB: {median_ms(lambda: narrow.index_select(0, rows)):.3f} ms")
del table, narrow, rows
m1 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
m2 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print(f"{who}: matmul 8192^3 bf16: {median_ms(lambda: m1 @ m2):.3f} ms")
