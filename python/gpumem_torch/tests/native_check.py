"""GPU check of the native torch allocator (gpumem_torch.install(native=True)): every torch API
the pluggable path fails on, one after the other, with what happened printed. Run on a GPU
machine: python native_check.py (GPUMEM_TORCH_LIB pointing at libgpumem_torch.so)."""
import os
import sys
import time

import gpumem_torch

t = time.time()
if os.environ.get("NATIVE_CHECK_BASELINE"):
    print("baseline: PyTorch's own allocator (gpumem not installed)")
else:
    gpumem_torch.install(native=True)
    from gpumem_torch import native

    print(f"installed in {time.time() - t:.1f} s (extension: {native.source})")
import torch  # noqa: E402

results = []


ONLY = os.environ.get("NATIVE_CHECK_ONLY")


def check(name, fn):
    if ONLY and ONLY not in name:
        return
    print(f"... {name}", flush=True)
    try:
        out = fn()
        results.append((name, "PASS", out))
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        results.append((name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"{results[-1][1]} {name}: {results[-1][2]}", flush=True)


x = torch.empty(1 << 20, device="cuda")
check("allocator name", lambda: torch.cuda.memory.get_allocator_backend())
check("memory_allocated", lambda: torch.cuda.memory_allocated())
check("max_memory_allocated", lambda: torch.cuda.max_memory_allocated())
check("memory_reserved", lambda: torch.cuda.memory_reserved())
check("memory_stats keys", lambda: len(torch.cuda.memory_stats()))


def reset_peak():
    y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del y
    before = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    after = torch.cuda.max_memory_allocated()
    assert after < before, (before, after)
    return (before, after)


check("reset_peak_memory_stats", reset_peak)


def reset_accumulated():
    y = torch.empty(1 << 20, device="cuda")
    del y
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.reset_accumulated_memory_stats()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert before > 0 and after == 0, (before, after)
    return (before, after)


check("reset_accumulated_memory_stats", reset_accumulated)
seen = []


def oom():
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    try:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        msg = str(e)
    else:
        raise AssertionError("no OutOfMemoryError")
    z = torch.ones(1000, device="cuda")
    assert z.sum().item() == 1000, "usable after OOM"
    return f"observers {len(seen)}; {msg[:200]}"


check("OOM raises torch.OutOfMemoryError, then usable", oom)


def record_stream():
    s = torch.cuda.Stream()
    a = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        b = a * 2
    a.record_stream(s)
    del a
    c = torch.zeros(1 << 20, device="cuda")  # must not land on a's block while s reads it
    torch.cuda.synchronize()
    assert b.sum().item() == 2 * (1 << 20), "record_stream honoured"
    return "ok"


check("record_stream", record_stream)
check("empty_cache", lambda: torch.cuda.empty_cache())
check("memory_summary", lambda: len(torch.cuda.memory_summary()))


def fraction():
    # (more than half of the device, whatever its size: 60 GiB was, on an 80 GB H100, and is
    # not on a 141 GB H200)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("fraction not enforced")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return "ok"


check("set_per_process_memory_fraction", fraction)


def graph():
    g = torch.cuda.CUDAGraph()
    a = torch.ones(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            b = a * 2
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        b = a * 2
    g.replay()
    torch.cuda.synchronize()
    assert b.sum().item() == 2048
    return "ok"


check("torch.cuda.graph", graph)
def snapshot():
    keep = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory._snapshot()
    segs = snap["segments"]
    total = sum(s["total_size"] for s in segs)
    allocated = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    assert segs and total == torch.cuda.memory_reserved(), (total, torch.cuda.memory_reserved())
    assert allocated == torch.cuda.memory_allocated(), (allocated, torch.cuda.memory_allocated())
    import os
    import pickle
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    from torch.cuda import _memory_viz
    with open(path, "rb") as f:
        text = _memory_viz.segsum(pickle.load(f))
    del keep
    return f"{len(segs)} segments, {total >> 20} MiB; memory_viz drew {len(text)} chars"


check("_snapshot and _dump_snapshot (memory_viz reads it)", snapshot)


def history():
    torch.cuda.memory._record_memory_history(max_entries=100000)
    a = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
    del a, b
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    actions = [e["action"] for e in trace]
    sizes = [e["size"] for e in trace if e["action"] == "alloc"]
    assert actions.count("alloc") >= 2 and actions.count("free_completed") >= 2, actions
    assert (3 << 20) in sizes and (5 << 20) in sizes, sizes
    import os
    import subprocess
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "history.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    cli = os.path.join(os.path.dirname(os.environ.get("GPUMEM_TORCH_LIB", "")), "gpumem")
    replay = ""
    if os.path.exists(cli):
        r = subprocess.run([cli, "replay", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        replay = r.stdout.strip().splitlines()[-1]
    return f"{len(trace)} events ({actions.count('alloc')} allocs); gpumem replay: {replay[:160]}"


check("_record_memory_history, then _snapshot traces and gpumem replay of the dump", history)


def graph_private_pool():
    # memory a capture frees stays the graph's: tensors allocated after capture never get it,
    # so replays (which write it again) cannot corrupt them
    x = torch.ones(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            (x * 3 + 1).sum()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = x * 3
        tmp_ptr = tmp.data_ptr()
        out = tmp + 1
        del tmp
    pool = g.pool()
    others = [torch.empty(1 << 20, device="cuda") for _ in range(16)]
    assert all(o.data_ptr() != tmp_ptr for o in others), "capture memory handed out"
    for o in others:
        o.fill_(7)
    g.replay()
    torch.cuda.synchronize()
    assert all(bool((o == 7).all()) for o in others), "a replay wrote over live tensors"
    assert bool((out == 4).all())
    live = torch._C._cuda_checkPoolLiveAllocations(0, pool, {out.untyped_storage().data_ptr()})
    assert live, "checkPoolLiveAllocations"
    reserved = torch.cuda.memory_reserved()
    del g, out
    torch.cuda.empty_cache()
    return f"pool {pool}; reserved {reserved >> 20} -> {torch.cuda.memory_reserved() >> 20} MiB"


check("graph private pool: capture memory is not reused while the graph lives", graph_private_pool)


def graphed_callables():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).cuda()
    ref = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).cuda()
    ref.load_state_dict(model.state_dict())
    inp = torch.randn(64, 256, device="cuda")
    graphed = torch.cuda.make_graphed_callables(model, (inp,))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        graphed(inp).square().sum().backward()
    ref.zero_grad(set_to_none=True)
    ref(inp).square().sum().backward()
    torch.cuda.synchronize()
    err = (model[0].weight.grad - ref[0].weight.grad).abs().max().item()
    assert err < 1e-3, err
    return f"max grad difference {err:.2e}"


check("torch.cuda.make_graphed_callables (forward + backward)", graphed_callables)


def compile_reduce_overhead():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)
    ).cuda()
    opt = torch.compile(model, mode="reduce-overhead")
    outs = []
    # two shapes: two graphs in the tree (the second recorded from a checkpoint of the pool)
    with torch.no_grad():
        for shape in [(32, 128), (32, 128), (32, 128), (48, 128), (48, 128), (48, 128), (32, 128)]:
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(*shape, device="cuda")
            y = opt(x).clone()
            outs.append((y - model(x)).abs().max().item())
    # training: forward and backward graphs
    train = torch.compile(torch.nn.Linear(128, 64).cuda(), mode="reduce-overhead")
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        train.zero_grad(set_to_none=True)  # grads live in the graphs' pool
        x = torch.randn(32, 128, device="cuda", requires_grad=True)
        train(x).sum().backward()
        grad = train.weight.grad.clone()
    assert bool(torch.isfinite(grad).all())
    torch.cuda.synchronize()
    assert max(outs) < 1e-2, outs
    return f"max difference {max(outs):.2e} over {len(outs)} calls; training steps ran"


check("torch.compile(mode='reduce-overhead')", compile_reduce_overhead)


def mem_pool():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    pa = a.data_ptr()
    count = pool.use_count()
    del a
    b = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    assert b.data_ptr() != pa, "the shared pool took the MemPool's memory"
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    assert c.data_ptr() == pa, "the MemPool did not reuse its own memory"
    segs = pool.snapshot()
    assert segs and all(s["total_size"] > 0 for s in segs), segs
    assert torch.cuda.memory_allocated() >= 8 << 20
    del c, b
    del pool
    return f"use_count {count}, {len(segs)} segment(s) in the pool's snapshot"


check("torch.cuda.MemPool / use_mem_pool", mem_pool)


def mem_pool_over_another_allocator():
    import ctypes
    import subprocess
    import tempfile

    from torch.utils.cpp_extension import CUDA_HOME

    # a CUDAPluggableAllocator of its own, built with g++ over cudart (no torch headers)
    src = r"""
    #include <cuda_runtime_api.h>
    #include <cstddef>
    extern "C" {
    int other_allocs = 0, other_frees = 0;
    void* other_alloc(size_t size, int, void*) {
      void* p = nullptr;
      if (cudaMalloc(&p, size) != cudaSuccess) return nullptr;
      ++other_allocs;
      return p;
    }
    void other_free(void* p, size_t, int, void*) {
      cudaFree(p);
      ++other_frees;
    }
    }
    """
    d = tempfile.mkdtemp()
    cpp, so = os.path.join(d, "other.cpp"), os.path.join(d, "other.so")
    with open(cpp, "w") as f:
        f.write(src)
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", so, cpp, f"-I{CUDA_HOME}/include",
                    f"-L{CUDA_HOME}/lib64", "-lcudart"], check=True)
    lib = ctypes.CDLL(so)
    allocs = ctypes.c_int.in_dll(lib, "other_allocs")
    frees = ctypes.c_int.in_dll(lib, "other_frees")
    other = torch.cuda.memory.CUDAPluggableAllocator(so, "other_alloc", "other_free")
    pool = torch.cuda.MemPool(other.allocator())
    reserved = torch.cuda.memory_reserved()
    with torch.cuda.use_mem_pool(pool):
        a = torch.full((4 << 20,), 7, dtype=torch.uint8, device="cuda")
    assert allocs.value == 1, f"the pool's allocator was called {allocs.value} times"
    assert torch.cuda.memory_reserved() >= reserved + (4 << 20), "its segment is not reserved"
    segs = pool.snapshot()
    assert len(segs) == 1 and segs[0]["address"] <= a.data_ptr() < segs[0]["address"] + \
        segs[0]["total_size"], segs
    assert not segs[0]["is_expandable"], segs
    b = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    assert allocs.value == 1, "the shared pool took memory from the MemPool's allocator"
    pa = a.data_ptr()
    del a
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    assert c.data_ptr() == pa and allocs.value == 1, "the pool did not cache its memory"
    del c, b, pool
    torch.cuda.empty_cache()
    assert frees.value == 1, f"the pool's memory went back {frees.value} times, not once"
    return "segments from the pool's own allocator, cached, reserved, and given back once"


check("torch.cuda.MemPool over another allocator (CUDAPluggableAllocator)",
      mem_pool_over_another_allocator)


def checkpoint():
    dev = torch.cuda.current_device()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        value = torch.full((4 << 20,), 5, dtype=torch.uint8, device="cuda")
    vp = value.data_ptr()
    state = torch._C._cuda_getCheckpointState(dev, pool.id)
    for size in (12 << 20, 8 << 20):
        with torch.cuda.use_mem_pool(pool):
            stale = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch._C._cuda_setCheckpointPoolState(dev, state, [stale.untyped_storage()._cdata], [])
        assert value.data_ptr() == vp and bool((value == 5).all())
        assert torch._C._cuda_checkPoolLiveAllocations(dev, pool.id, {vp})
        del stale
    del value, pool
    return "restored twice; the checkpoint's tensor kept its address and data"


check("allocator checkpoints (getCheckpointState / setCheckpointPoolState)", checkpoint)


def cache_info():
    # cuDNN's convolutions size their workspace by cacheInfo: PyTorch's allocator answers with
    # the device's free memory, or a larger cached block (the cache alone would hold them to
    # slower algorithms)
    from torch.utils.cpp_extension import load_inline

    src = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
int64_t largest() {
  size_t largest = 0;
  c10::cuda::CUDACachingAllocator::cacheInfo(c10::cuda::current_device(), &largest);
  return static_cast<int64_t>(largest);
}
"""
    m = load_inline("gpumem_cache_info", cpp_sources=src, functions=["largest"], with_cuda=True)
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del held
    got = m.largest()
    free, _ = torch.cuda.mem_get_info()
    assert got >= 0.95 * free and got >= 256 << 20, (got, free)
    return f"{got >> 20} MiB (device free {free >> 20} MiB)"


check("cacheInfo: free memory or the largest cached block, as native", cache_info)


def overhead():
    n = 20000
    for _ in range(100):
        torch.empty(4096, device="cuda")
    t = time.perf_counter()
    for _ in range(n):
        y = torch.empty(4096, device="cuda")
        del y
    return f"{(time.perf_counter() - t) / n * 1e9:.0f} ns per torch.empty + del"


check("alloc overhead", overhead)
print(f"{sum(r[1] == 'PASS' for r in results)} of {len(results)} pass")
sys.exit(0 if all(r[1] == "PASS" for r in results) else 1)
