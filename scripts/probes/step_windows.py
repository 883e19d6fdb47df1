#!/usr/bin/env python3
"""The time budget's windows in a real run: from `bench_torch.py --json` with
BENCH_STEP_STATS=1 (gpumem settings), the largest share of any run of consecutive steps
lasting at least a second that page work on the allocating thread took (`page_map_ns`, what
the pool measures), over the steps after the warm-up (a second past the last step whose peak
of allocated bytes grew by 1% or more, as `pool/budget.rs` counts it). A step's time is its
wall time as the STEP line gives it; the statistics are read between steps.

    python3 scripts/probes/step_windows.py run.json [more.json ...]
"""
import json
import sys


def steps(entry):
    out = []
    for line in entry.get("step_stats", []):
        parts = line.split()
        kv = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
        out.append((float(parts[2].rstrip("ms")), int(kv.get("page_map_ns", 0)),
                    int(kv.get("allocated_bytes.all.peak", 0))))
    return out


def worst(entry, window_ms=1000.0):
    s = steps(entry)
    if not s:
        return None
    # warm-up: until a second after the last step whose peak grew by 1% over the last such
    # step's (bench_torch resets torch's peaks at its late steps; the pool's own peak, which
    # the budget follows, is not reset, so a peak below the level changes nothing)
    level, warm_end, t = 0, 0.0, 0.0
    ends = []
    for ms, _, peak in s:
        t += ms
        ends.append(t)
        if peak > 0 and peak * 100 >= level * 101:
            warm_end = t + window_ms
            level = peak
    best = (0.0, None)
    for i in range(len(s)):
        start = ends[i] - s[i][0]
        if start < warm_end:
            continue
        for j in range(i, len(s)):
            span = ends[j] - start
            if span >= window_ms:
                work = (s[j][1] - (s[i - 1][1] if i else 0)) / 1e6
                share = work / span
                if share > best[0]:
                    best = (share, (i + 1, j + 1, span, work))
                break
    return best, warm_end, t


for path in sys.argv[1:]:
    data = json.load(open(path))
    for e in data if isinstance(data, list) else [data]:
        r = worst(e)
        if r is None:
            continue
        (share, where), warm_end, total = r
        w = f"steps {where[0]}-{where[1]} ({where[2]:.0f} ms, {where[3]:.2f} ms of page work)" if where else "none"
        print(f"{e.get('workload')} {e.get('setting')}: warm-up until {warm_end:.0f} of {total:.0f} ms; "
              f"worst second after it {100 * share:.2f}% ({w})")
