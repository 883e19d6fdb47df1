"""GPU tests of gpumem_torch (plain asserts; run `python tests/test_gpumem_torch.py`, or pytest).

Each test runs in a fresh interpreter: an allocator is chosen once per process.
"""
import os
import subprocess
import sys
import textwrap

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code, env=None):
    e = dict(os.environ)
    e["PYTHONPATH"] = PKG + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def test_tensors_stats_summary_empty_cache():
    rc, out, err = run("""
        import gpumem_torch, torch
        gpumem_torch.install()
        torch.zeros(1, device="cuda")  # CUDA and cuBLAS state PyTorch keeps
        base = gpumem_torch.memory_stats()["allocated_bytes.all.current"]
        x = torch.randn(1000, 1000, device="cuda")
        y = (x @ x).sum()
        s = gpumem_torch.memory_stats()
        assert s["allocated_bytes.all.current"] >= 4_000_000, s
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
        for k in ("allocation.all.peak", "segment.all.current", "num_alloc_retries", "num_ooms",
                  "active_bytes.all.current", "inactive_split_bytes.all.current", "gpumem.bad_frees"):
            assert k in s, k
        assert "Allocated memory" in gpumem_torch.memory_summary()
        leaks = gpumem_torch.leak_report()
        assert leaks["count"] >= 1
        del x, y
        torch.cuda.synchronize()
        gpumem_torch.empty_cache()
        now = gpumem_torch.memory_stats()["allocated_bytes.all.current"]
        assert now <= base + (32 << 20), (base, now)  # at most a cuBLAS workspace stays
        gpumem_torch.reset_peak_memory_stats()
        print("ok")
    """)
    assert rc == 0 and "ok" in out, err


def test_install_after_cuda_is_a_clear_error():
    rc, out, err = run("""
        import gpumem_torch, torch
        torch.zeros(1, device="cuda")
        try:
            gpumem_torch.install()
        except RuntimeError as e:
            assert "before CUDA is used" in str(e)
            print("ok")
    """)
    assert rc == 0 and "ok" in out, err


def test_out_of_memory_is_pytorchs_error_after_a_flush():
    rc, out, err = run("""
        import gpumem_torch, torch
        gpumem_torch.install()
        gpumem_torch.set_per_process_memory_fraction(0.05)
        keep = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
        try:
            t = torch.empty(40 << 30, dtype=torch.uint8, device="cuda")
            print("no exception: data_ptr", t.data_ptr())
        except torch.OutOfMemoryError as e:
            # (the whole message: PyTorch's sentences, then gpumem's account)
            print("oom raised:", type(e).__name__, str(e).replace("\\n", " "))
        s = gpumem_torch.memory_stats()
        assert s["num_ooms"] >= 1 and s["num_alloc_retries"] >= 1, s
        del keep
        z = torch.ones(1 << 20, device="cuda")  # still usable
        assert float(z.sum()) == float(1 << 20)
        print("ok")
    """)
    assert rc == 0 and "oom raised: OutOfMemoryError" in out and "ok" in out, out + err
    assert "CUDA out of memory. Tried to allocate 40.00 GiB." in out, out
    assert "tried to allocate" in out and "reserved" in out and "budget" in out, out


def test_native_allocator_answers_torch_memory_apis():
    here = os.path.dirname(os.path.abspath(__file__))
    e = dict(os.environ, PYTHONPATH=PKG + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(here, "native_check.py")], env=e,
                       capture_output=True, text=True)
    print(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and " pass" in r.stdout, r.stdout


def test_results_match_native():
    code = """
        import sys, torch
        if sys.argv[-1] == "gpumem":
            import gpumem_torch; gpumem_torch.install()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)).cuda()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(5):
            x = torch.randn(256, 512, device="cuda"); y = torch.randint(0, 10, (256,), device="cuda")
            loss = torch.nn.functional.cross_entropy(m(x), y); loss.backward(); opt.step(); opt.zero_grad()
        print(repr(float(loss)))
    """
    outs = []
    for which in ("native", "gpumem"):
        e = dict(os.environ, PYTHONPATH=PKG)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), which], env=e, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1], outs


def test_cupy_allocator():
    rc, out, err = run("""
        try:
            import cupy
        except ImportError:
            print("skip: no cupy"); raise SystemExit(0)
        import gpumem_torch
        cupy.cuda.set_allocator(gpumem_torch.cupy_allocator())
        a = cupy.arange(1_000_000, dtype=cupy.int64)
        assert int(a.sum()) == sum(range(1_000_000))
        s = gpumem_torch.memory_stats(0)
        assert s["allocated_bytes.all.current"] >= 4_000_000, s
        del a
        import gc; gc.collect()
        assert gpumem_torch.memory_stats(0)["allocated_bytes.all.current"] == 0
        print("ok")
    """)
    assert rc == 0 and ("ok" in out or "skip" in out), err
    print(out.strip())


def _gpu():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU"


if __name__ == "__main__":
    why = _gpu()
    if why:
        print(f"skip: every test here needs a GPU ({why})")
        sys.exit(0)
    failed = 0
    for name, f in list(globals().items()):
        if name.startswith("test_"):
            try:
                f()
                print("PASS", name)
            except AssertionError as e:
                failed += 1
                print("FAIL", name, str(e)[:2000])
    sys.exit(1 if failed else 0)
