"""GPU check of the native torch allocator (gpumem_torch.install(native=True)): every torch API
the pluggable path fails on, one after the other, with what happened printed. Run on a GPU
machine: python native_check.py (GPUMEM_TORCH_LIB pointing at libgpumem_torch.so)."""
import sys
import time

import gpumem_torch

t = time.time()
gpumem_torch.install(native=True)
print(f"built and installed in {time.time() - t:.1f} s")
import torch  # noqa: E402

results = []


def check(name, fn):
    print(f"... {name}", flush=True)
    try:
        out = fn()
        results.append((name, "PASS", out))
    except Exception as e:  # noqa: BLE001
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
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        torch.empty(60 << 30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("fraction not enforced")
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
sys.exit(0)
