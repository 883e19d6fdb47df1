"""Does a gpumem process run host work slower than a native one? Fresh processes one after
another: native; native with libgpumem_torch.so loaded (ctypes, RTLD_GLOBAL) but not
installed; gpumem installed; gpumem through the pluggable path. Each prints CPU-only
torch.randn on a CPU generator, a pure Python loop, in-place kernel launches, and the CPU
ticks each of its threads used while the main thread slept a second (a busy thread shows).
Usage (GPU machine): GPUMEM_TORCH_LIB=... PYTHONPATH=python/gpumem_torch python3
scripts/probes/host_speed.py ROUNDS. Stop 78 (H200): a fresh process's host speed varies
up to 2x whatever runs in it; no busy thread (docs/measured-log.md)."""
import json, os, statistics, subprocess, sys, time
def threads():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{t}/stat").read()
        except OSError:
            continue
        comm = st[st.index("(") + 1:st.rindex(")")]
        f = st.rsplit(")", 1)[1].split()
        out[t] = (comm, int(f[11]) + int(f[12]), int(f[36]))
    return out
if len(sys.argv) > 2 and sys.argv[1] == "child":
    v = sys.argv[2]
    if v == "gpumem":
        import gpumem_torch; gpumem_torch.install()
    elif v == "pluggable":
        import gpumem_torch; gpumem_torch.install(native=False)
    elif v == "loaded":
        import ctypes; ctypes.CDLL(os.environ["GPUMEM_TORCH_LIB"], mode=ctypes.RTLD_GLOBAL)
    import torch
    x = torch.empty(1 << 28, device="cuda"); a = torch.randn(1024, device="cuda"); torch.cuda.synchronize()
    g = torch.Generator().manual_seed(0)
    for _ in range(3): torch.randn(1 << 22, generator=g)
    hs = []
    for _ in range(7):
        t = time.perf_counter(); torch.randn(1 << 22, generator=g); hs.append((time.perf_counter() - t) * 1e3)
    ss = []
    for _ in range(7):
        t = time.perf_counter(); s = 0
        for i in range(200000): s += i
        ss.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    for _ in range(3000): a.mul_(1.0)
    torch.cuda.synchronize(); it = (time.perf_counter() - t) * 1e6 / 3000
    t0 = threads(); time.sleep(1.0); t1 = threads()
    busy = {t1[k][0] + ":" + k: t1[k][1] - t0[k][1] for k in t1 if k in t0 and t1[k][1] - t0[k][1] > 0}
    print("R " + json.dumps({"v": v, "randn_ms": statistics.median(hs), "pyloop_ms": statistics.median(ss), "inplace_us": it,
        "nthreads": len(t1), "busy_ticks_1s": busy, "torch_threads": torch.get_num_threads(),
        "affinity": len(os.sched_getaffinity(0)), "cpu": t1[str(os.getpid())][2],
        "names": sorted(set(c for c, _, _ in t1.values()))}), flush=True)
    sys.exit(0)
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for v in ("native", "loaded", "gpumem", "pluggable"):
        r = subprocess.run([sys.executable, __file__, "child", v], capture_output=True, text=True, timeout=120)
        line = [l for l in r.stdout.splitlines() if l.startswith("R ")]
        print(rnd, line[-1][2:] if line else ("FAILED " + r.stderr[-800:]), flush=True)
