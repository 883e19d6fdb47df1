"""Per-call cost of the allocator on a real job's repeating step, beside PyTorch's own.

The step's allocations and frees (sizes and order from a trace recorded from PyTorch, e.g.
crates/gpumem/tests/data/torch_vit_train.jsonl.gz) are replayed through torch's allocator
interface (`allocate` + DataPtr release, what every tensor does) by a C++ loop, STEPS times,
each call timed alone. A real step runs kernel launches and autograd between allocator calls,
which evict the allocator's data from the CPU caches; with POLLUTE=n the loop touches n
random cache lines of a 64 MiB buffer between calls (outside the timing) to do the same
(POLLUTE is a comma-separated list; default 0,2000).

`python trace_loop.py TRACE native|gpumem` (gpumem installs itself first); prints ns per call,
the median over the second half of the steps, with its spread and the first steps.
"""
import gzip
import json
import os
import sys

if sys.argv[-1] == "gpumem":
    import gpumem_torch

    gpumem_torch.install(native=True)
import torch
from torch.utils.cpp_extension import load_inline

events = [json.loads(line) for line in gzip.open(sys.argv[1], "rt")]
events = [e for e in events if e["action"] in ("alloc", "free_completed")]


def key(e):
    return (e["action"], e["size"])


# the repeating step: the shortest period that the middle of the trace repeats with
n = len(events)
mid = n // 2
period = next(
    (p for p in range(50, n // 3) if all(key(events[mid + k]) == key(events[mid + k + p]) for k in range(p))),
    None,
)
if period is None:
    sys.exit(f"{sys.argv[1]}: no repeating step found")
step = events[mid : mid + period]

# Slots: an allocation takes a slot and its free gives it back. A block still held at the end
# of the step is freed in the next one, by a free of a block from before the step: it keeps a
# slot of its own, and those frees are paired with such slots by size, in order.
seen, freed_in_step = set(), set()
for e in step:
    if e["action"] == "alloc":
        seen.add(e["addr"])
    elif e["addr"] in seen:
        freed_in_step.add(e["addr"])
held_over = {}
nslots = 0
for e in step:
    if e["action"] == "alloc" and e["addr"] not in freed_in_step:
        held_over.setdefault(e["size"], []).append(nslots)
        nslots += 1
take, give = held_over, {s: list(v) for s, v in held_over.items()}
slot_of, free_slots, ops = {}, [], []
for e in step:
    a = e["addr"]
    if e["action"] == "alloc":
        if a in freed_in_step:
            if free_slots:
                slot = free_slots.pop()
            else:
                slot, nslots = nslots, nslots + 1
            slot_of[a] = slot
        else:
            slot = take[e["size"]].pop(0)
        ops.append((0, e["size"], slot))
    elif a in slot_of:
        slot = slot_of.pop(a)
        free_slots.append(slot)
        ops.append((1, 0, slot))
    else:
        pool = give.get(e["size"], [])
        ops.append((1, 0, pool.pop(0) if pool else -1))

src = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
#include <vector>
// ns per call for each of `steps` replays of the step (kind 0: allocate `size` into `slot`;
// 1: release `slot`)
std::vector<double> run(std::vector<int64_t> kind, std::vector<int64_t> size,
                        std::vector<int64_t> slot, int64_t nslots, int64_t steps,
                        int64_t pollute) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  // a block whose next copy is allocated before it is freed waits in `early` until then
  std::vector<c10::DataPtr> held(nslots + 1), early(nslots + 1);
  const size_t lines = size_t(8) << 20;
  std::vector<uint64_t> junk(lines, 1);
  uint64_t x = 88172645463325252ull;
  std::vector<double> per_step;
  for (int64_t s = 0; s < steps; ++s) {
    double ns = 0;
    int64_t calls = 0;
    for (size_t i = 0; i < kind.size(); ++i) {
      for (int64_t p = 0; p < pollute; ++p) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        junk[x & (lines - 1)] += 1;
      }
      int64_t k = slot[i];
      if (k < 0) continue;
      if (kind[i] == 0 && held[k]) early[k] = std::move(held[k]);
      auto t = std::chrono::steady_clock::now();
      if (kind[i] == 0) {
        held[k] = a->allocate(size[i]);
      } else if (early[k]) {
        early[k].clear();
      } else {
        held[k].clear();
      }
      ns += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
      ++calls;
    }
    per_step.push_back(ns / double(calls));
  }
  for (auto& d : early) d.clear();
  for (auto& d : held) d.clear();
  return per_step;
}
"""
mod = load_inline("gpumem_trace_loop", cpp_sources=src, functions=["run"], with_cuda=True, extra_cflags=["-O2"])
torch.empty(1, device="cuda")
who = sys.argv[-1]
name = os.path.basename(sys.argv[1]).split(".")[0]
steps = int(os.environ.get("STEPS", "16"))
kinds, sizes, slots = ([o[i] for o in ops] for i in range(3))
for pollute in [int(p) for p in os.environ.get("POLLUTE", "0,2000").split(",")]:
    per = mod.run(kinds, sizes, slots, nslots, steps, pollute)
    tail = sorted(per[steps // 2 :])
    print(
        f"{who} {name}: a step of {len(ops)} calls, {pollute} cache lines touched between calls: "
        f"{tail[len(tail) // 2]:.0f} ns/call median (min {tail[0]:.0f}, max {tail[-1]:.0f}; "
        f"steps 1-3: {', '.join('%.0f' % v for v in per[:3])})"
    )
