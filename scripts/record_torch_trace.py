#!/usr/bin/env python3
"""Record the CUDA allocator trace of any PyTorch script, for `gpumem replay` and `gpumem viz`.

    python scripts/record_torch_trace.py -o trace.jsonl.gz [--pickle snapshot.pickle] \
        [--device 0] [--max-entries N] -- your_script.py [its arguments...]

The script runs unchanged (as `__main__`, with its own arguments) under
`torch.cuda.memory._record_memory_history(enabled="all", context=None)`. When it ends (or
fails), the device's allocator events are written as JSON Lines (gzip when the name ends in
.gz) with the fields gpumem reads: action, addr, size, stream, time_us. `--pickle` also keeps
PyTorch's own snapshot (what `torch.cuda.memory._dump_snapshot` writes), which gpumem reads
directly too. Run it under any PYTORCH_CUDA_ALLOC_CONF to record that allocator's segments.
"""
import argparse
import gzip
import json
import pickle
import runpy
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", required=True, help="trace file (.jsonl or .jsonl.gz)")
    p.add_argument("--pickle", help="also write PyTorch's snapshot pickle here")
    p.add_argument("--device", type=int, default=0, help="CUDA device whose events to keep")
    p.add_argument("--max-entries", type=int, default=10_000_000, help="events kept at most")
    p.add_argument("script", help="the PyTorch script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("record_torch_trace: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, max_entries=a.max_entries
    )
    sys.argv = [a.script] + [x for x in a.args if x != "--"]
    status = 0
    try:
        runpy.run_path(a.script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap.get("device_traces", [])
        events = traces[a.device] if a.device < len(traces) else []
        opener = gzip.open if a.output.endswith(".gz") else open
        with opener(a.output, "wt") as f:
            for e in events:
                f.write(
                    json.dumps(
                        {
                            "action": e["action"],
                            "addr": e["addr"],
                            "size": e["size"],
                            "stream": e.get("stream", 0),
                            "time_us": e.get("time_us", 0),
                        }
                    )
                    + "\n"
                )
        if a.pickle:
            with open(a.pickle, "wb") as f:
                pickle.dump(snap, f)
        stats = torch.cuda.memory_stats(a.device)
        live = stats.get("allocated_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        print(
            f"record_torch_trace: {len(events)} events -> {a.output}; torch peak allocated "
            f"{live} B, peak reserved {reserved} B ({reserved / max(live, 1):.3f})",
            file=sys.stderr,
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
