#!/usr/bin/env python3
"""Real PyTorch workloads under PyTorch's allocator settings and under gpumem.

    python scripts/bench_torch.py [--workloads gpt,varlen,resnet,kv,mixed]
                                  [--settings native,expandable,async,gpumem] [--json out.json]
    python scripts/bench_torch.py --lockstep --workloads gptfix --settings native,gpumem [--groups 20]
    python scripts/bench_torch.py --capacity [gptfix,varlen,lora] --cap-gb 16 --steps 10

Each (workload, setting) runs in a fresh process: `native` is PyTorch's caching allocator,
`expandable` is PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, `async` is
backend:cudaMallocAsync, `gpumem` is gpumem_torch.install() (GPUMEM_CONF applies), and
`gpumem_classic` is gpumem with classic segments (expandable_segments:False);
`gpumem/KEY:VALUE+KEY:VALUE` is gpumem with that GPUMEM_CONF. The table
gives the median step time after warm-up, the process's host speed (`host ms`: a fixed piece
of CPU work, timed before and after the steps; a slow host moment makes a host-bound job's
steps slow whichever allocator runs), peak reserved / peak allocated bytes (the allocator's
own memory_stats), and whether the losses are identical to native's.

With --lockstep, a workload's settings run side by side, each in a fresh process, one step
each in turn (the order reversed every other step; kv and serve, timed as whole runs, run one
after another as usual): whatever slows the machine for a while slows every setting alike,
and `vs native` is the median of the step-by-step ratios (`host ms` is rougher there: its
timings run while the other processes start and finish). What stays is each process's own
speed, which on the H100 machines differs by up to 20% between two processes of the same
allocator run this way (README, "Step times side by side"). With --groups N the settings run
in N such groups, their order rotated from group to group, and each workload ends with the
pooled ratios: every group's steps after the first --skip, median, 10th percentile (the fast
level) and mean over native's, and step by step (the geometric mean of each step's time over
native's same step in its group: the figure for a job whose steps differ in shape), with 95%
intervals from resampling whole groups. With --pin CPU every worker runs on that one CPU
(and one OpenMP thread): in lockstep the processes take their turns on the same core. On an
H200 machine (stop 86) that took the spread between two processes of one setting from up to
20% to 0.2-7.3% (a median of about 2%), and steps that moved between levels 25-45% apart
(LoRA 92-135 ms) to one level (80-83 ms); enqueue, the time until a step's code returned its
loss, is printed beside each step time (close to it: the job is bound by the host).

Workloads (seeded; bf16 autocast where training):
  gpt     12-layer d=1024 decoder (nn.TransformerEncoder), batch 8 x 1024 tokens, AdamW
  gptfix  the fixed-shape GPT of shared/traces/gpt_train written out by hand as users write
          it (nanoGPT-style blocks with scaled_dot_product_attention, GELU MLP, tied
          embedding): 12 layers, d 1024, batch 8 x 1024, AdamW, bf16 autocast
  vit     ViT-B/16 (torchvision) training, batch 32 at 224 x 224, AdamW
  varlen  the same with a sequence length drawn per step (128..1024)
  resnet  torchvision ResNet-50, batch 64, SGD (a ResNet-like stack if torchvision is missing)
  kv      autoregressive decoding, 16 layers, KV caches grown with torch.cat (time: whole run)
  mixed   many tiny tensors next to a few huge ones (a data-processing style loop)
  moe     mixture-of-experts training: 4 layers of 8 experts, top-2 routing, so the tokens
          each expert gets vary every step; AdamW
  resres  ResNet-50 training at an image size drawn per step (128..288), batch 32
  serve   a serving loop: requests arrive and finish at random, each with its own KV cache
          grown by torch.cat, up to 8 in flight (time: whole run)
  streams two decoders (d=1024 x 6 layers, d=768 x 8) trained side by side on two streams,
          sequence length drawn per step (256..1024), AdamW
  accum   gradient accumulation: an 8-layer d=768 decoder, 4 micro-batches of 8 x 512 tokens
          an optimizer step, fp16 autocast with a GradScaler, gradient clipping, AdamW
  unet    a diffusion UNet (channels 128/256/512/512, attention at the two lowest
          resolutions) predicting noise on batch 32 of 4 x 64 x 64 latents, bf16, AdamW
  lora    LoRA fine-tuning with gradient checkpointing (the capacity job below), batch 8 x
          1024 tokens
  prefill long-context prefill of a 16-layer d=2048 Llama-style decoder, bf16, no gradients,
          one prompt a step at a length drawn per step (512..16,384 tokens), its keys and
          values kept and every position's logits computed
  phases  the gpt job at 512 then 1,024 tokens in runs of 6 steps, each length coming back,
          an evaluation pass (forward only) after each run
  traineval the gpt job at 1,024 tokens with an evaluation pass (forward only, twice the
          batch) every 4 steps
  buckets the gpt job at a length drawn per step from 256, 512, 768 and 1,024, in no order
  detect  Faster R-CNN (torchvision, ResNet-50 FPN) on 4 images a step whose sizes are drawn
          per image, 1-8 random boxes each, SGD: shapes that change every step (its first
          step took about 80 s in every process on an H200, whichever allocator ran)
  effnet  EfficientNet-B0 (torchvision), batch 96 at 224, AdamW: many small tensors
  emptycache gptfix with torch.cuda.empty_cache() after every step

Capacity (--capacity): the largest batch each setting runs for --steps steps four times over
(each pass after the first repeats its steps) with --cap-gb of the device free (the rest taken
with cuMemAlloc outside every allocator before the job), each try a fresh process, on gptfix
(batch x 1024 tokens), varlen (the gpt job at batch B with a length drawn per step, the same
lengths at every batch) and lora (LoRA fine-tuning of a frozen 0.6B-parameter Llama-style
decoder, rank-16 adapters on q and v, every block checkpointed, batch x 1024 tokens). Each
setting's throughput at its own largest batch (tokens a second over the three passes after
the first, where no shape is new) is given against native's at its own largest.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "gpumem": {},
    # classic segments (PyTorch's native policy, in gpumem): no page moves at all
    "gpumem_classic": {"GPUMEM_CONF": "expandable_segments:False"},
}


def setting_env(s):
    """The environment of setting `s`: a name above, or `gpumem/KEY:VALUE+KEY:VALUE` (gpumem
    with that configuration, e.g. gpumem/planned_layout:False)."""
    if s.startswith("gpumem/"):
        return {"GPUMEM_CONF": s[len("gpumem/"):].replace("+", ",")}
    return SETTINGS[s]


# the allocating thread's time, in ns: page work (all, then the CUDA engine's phases), then
# the whole of allocations and frees (counted with the time_calls setting)
TIME_KEYS = ("page_map_ns", "vmm_wait_ns", "vmm_unmap_ns", "vmm_map_ns", "vmm_access_ns",
             "host_alloc_ns", "host_free_ns")
WORKLOADS = ["gpt", "gptfix", "vit", "varlen", "resnet", "kv", "mixed", "moe", "resres", "serve", "streams",
             "accum", "unet", "lora", "prefill", "phases", "traineval", "buckets", "detect", "effnet",
             "emptycache", "points", "bertamp", "offload", "lstm", "sample", "compiled"]
# workloads timed as a whole run (no steps)
WHOLE_RUN = ("kv", "serve")


# ----------------------------------------------------------------------------- workloads


def decoder(torch, d=1024, layers=12, vocab=32000):
    layer = torch.nn.TransformerEncoderLayer(
        d, 16, 4 * d, dropout=0.0, batch_first=True, norm_first=True
    )
    return torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, d),
            "body": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "head": torch.nn.Linear(d, vocab),
        }
    ).cuda()


def lm_step(torch, m, opt, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device="cuda")
        h = m["body"](m["emb"](x), mask=mask, is_causal=True)
        logits = m["head"](h)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)
        )
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run_gpt(torch, steps, varlen, batch=8, tokens=None, cycle=None):
    """`tokens`: a list that gets each step's tokens (batch x length) before its step runs;
    `cycle`: the lengths of the first `cycle` steps come back in the same order after them."""
    m = decoder(torch)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    # the lengths from a generator of their own: the same lengths whatever the batch (so that
    # a capacity search compares batches on the same steps)
    g, lengths = torch.Generator().manual_seed(3), torch.Generator().manual_seed(2)
    drawn = []
    for i in range(steps):
        if cycle and i >= cycle:
            seq = drawn[i % cycle]
        else:
            seq = 64 * int(torch.randint(2, 17, (1,), generator=lengths)) if varlen else 1024
            drawn.append(seq)
        x = torch.randint(0, 32000, (batch, seq), generator=g).cuda()
        if tokens is not None:
            tokens.append(batch * seq)
        yield lm_step(torch, m, opt, x)


def run_phases(torch, steps, batch=8, lengths=(512, 1024), run=6):
    """Training in phases (the synthetic `phases` family's shape): runs of `run` steps at one
    sequence length, the lengths in turn (length buckets, each coming back), and after each
    run an evaluation pass (forward only, no gradients) at the first length, timed as part of
    the run's last step."""
    m = decoder(torch)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(4)
    for i in range(steps):
        seq = lengths[(i // run) % len(lengths)]
        x = torch.randint(0, 32000, (batch, seq), generator=g).cuda()
        loss = lm_step(torch, m, opt, x)
        if (i + 1) % run == 0:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(2):
                    e = torch.randint(0, 32000, (batch, lengths[0]), generator=g).cuda()
                    mask = torch.nn.Transformer.generate_square_subsequent_mask(
                        lengths[0], device="cuda")
                    m["head"](m["body"](m["emb"](e), mask=mask, is_causal=True)).float().mean()
        yield loss


def run_traineval(torch, steps, batch=8, seq=1024, every=4):
    """Training with an evaluation pass every `every` steps (forward only, no gradients, at
    twice the batch), at one sequence length: train/eval alternation."""
    m = decoder(torch)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(5)
    for i in range(steps):
        x = torch.randint(0, 32000, (batch, seq), generator=g).cuda()
        loss = lm_step(torch, m, opt, x)
        if (i + 1) % every == 0:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                e = torch.randint(0, 32000, (2 * batch, seq), generator=g).cuda()
                mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device="cuda")
                m["head"](m["body"](m["emb"](e), mask=mask, is_causal=True)).float().mean()
        yield loss


def run_buckets(torch, steps, batch=8, lengths=(256, 512, 768, 1024)):
    """Training with a bucketing sampler: each step's sequence length drawn from a few
    buckets, in no order."""
    m = decoder(torch)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g, pick = torch.Generator().manual_seed(6), torch.Generator().manual_seed(7)
    for _ in range(steps):
        seq = lengths[int(torch.randint(0, len(lengths), (1,), generator=pick))]
        x = torch.randint(0, 32000, (batch, seq), generator=g).cuda()
        yield lm_step(torch, m, opt, x)


def run_gptfix(torch, steps, L=12, D=1024, H=16, V=32000, B=8, T=1024):
    F = torch.nn.functional

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
            self.up, self.down = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
            q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Gpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(V, D), torch.nn.Embedding(T, D)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(L))
            self.ln = torch.nn.LayerNorm(D)
            self.head = torch.nn.Linear(D, V, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, x):
            h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    m = Gpt().cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x = torch.randint(0, V, (B, T + 1), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(x[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_lora(torch, steps, B=8, T=1024, L=12, D=2048, H=16, FF=5632, V=32000, R=16):
    """LoRA fine-tuning with gradient checkpointing: a Llama-style decoder (RMSNorm, SwiGLU,
    causal attention) with frozen bf16 weights, rank-R adapters on the query and value
    projections (the only trained parameters, AdamW), every block recomputed in backward."""
    F = torch.nn.functional
    from torch.utils.checkpoint import checkpoint

    gw = torch.Generator().manual_seed(11)

    def frozen(*shape):
        return (torch.randn(*shape, generator=gw) * 0.02).to("cuda", torch.bfloat16)

    def lora_pair():
        a = torch.nn.Parameter((torch.randn(D, R, generator=gw) * 0.01).cuda())
        return a, torch.nn.Parameter(torch.zeros(R, D, device="cuda"))

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    blocks = [dict(q=frozen(D, D), k=frozen(D, D), v=frozen(D, D), o=frozen(D, D),
                   gate=frozen(D, FF), up=frozen(D, FF), down=frozen(FF, D),
                   lq=lora_pair(), lv=lora_pair()) for _ in range(L)]
    emb, head = frozen(V, D), frozen(D, V)
    params = [p for b in blocks for k in ("lq", "lv") for p in b[k]]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def block(x, p):
        b, t, _ = x.shape
        h = rms(x)
        q = h @ p["q"] + (h @ p["lq"][0]) @ p["lq"][1]
        k = h @ p["k"]
        v = h @ p["v"] + (h @ p["lv"][0]) @ p["lv"][1]
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, t, D) @ p["o"]
        h = rms(x)
        return x + (F.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

    g = torch.Generator().manual_seed(12)
    for _ in range(steps):
        x = torch.randint(0, V, (B, T + 1), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = emb[x[:, :-1]]
            for p in blocks:
                h = checkpoint(block, h, p, use_reentrant=False)
            logits = rms(h) @ head
            loss = F.cross_entropy(logits.float().view(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_prefill(torch, steps, L=16, D=2048, H=16, FF=5632, V=32000):
    """Long-context prefill: a Llama-style decoder (RMSNorm, SwiGLU, causal attention) with
    bf16 weights, no gradients, one prompt a step at a length drawn per step (512..16,384
    tokens, log-uniform, a multiple of 256): every layer's keys and values are kept as the
    step's cache, the logits of every position computed and the last one's taken in fp32, as
    a generation library's first forward does."""
    F = torch.nn.functional
    gw = torch.Generator().manual_seed(13)

    def w(*shape):
        return (torch.randn(*shape, generator=gw) * 0.02).to("cuda", torch.bfloat16)

    blocks = [dict(q=w(D, D), k=w(D, D), v=w(D, D), o=w(D, D), gate=w(D, FF), up=w(D, FF),
                   down=w(FF, D)) for _ in range(L)]
    emb, head = w(V, D), w(D, V)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    g = torch.Generator().manual_seed(14)
    for _ in range(steps):
        t = 256 * max(2, round(2 ** (9 + 5 * float(torch.rand(1, generator=g))) / 256))
        x = torch.randint(0, V, (1, t), generator=g).cuda()
        cache = []
        with torch.inference_mode():
            h = emb[x]
            for p in blocks:
                z = rms(h)
                q, k, v = ((z @ p[n]).view(1, t, H, D // H).transpose(1, 2) for n in "qkv")
                cache.append((k, v))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                h = h + a.transpose(1, 2).reshape(1, t, D) @ p["o"]
                z = rms(h)
                h = h + (F.silu(z @ p["gate"]) * (z @ p["up"])) @ p["down"]
            logits = rms(h) @ head
            last = logits[:, -1].float()
        yield last.sum()


def image_step(torch, m, opt, g, batch, hw):
    """One training step of image classifier `m` on a random batch of `hw` x `hw` images."""
    x = torch.randn(batch, 3, hw, hw, generator=g).cuda()
    y = torch.randint(0, 1000, (batch,), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(m(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train_classifier(torch, steps, m, batch, seed):
    """`steps` training steps of image classifier `m` (on the GPU) with AdamW, on random
    batches of `batch` images at 224 x 224 drawn from a generator seeded with `seed`."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield image_step(torch, m, opt, g, batch, 224)


def run_vit(torch, steps, batch=32):
    import torchvision

    yield from train_classifier(torch, steps, torchvision.models.vit_b_16().cuda(), batch, 10)


def run_streams(torch, steps):
    # two decoders trained side by side, each on its own stream (a step of one is queued while
    # the other's still runs), with a sequence length drawn per step: each stream frees pages
    # the other may want while the GPU is still behind
    shapes = [(1024, 6), (768, 8)]
    models = [decoder(torch, d=d, layers=n) for d, n in shapes]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    streams = [torch.cuda.Stream() for _ in models]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    g = torch.Generator().manual_seed(8)
    for _ in range(steps):
        losses = []
        for m, opt, s in zip(models, opts, streams):
            seq = 64 * int(torch.randint(4, 17, (1,), generator=g))
            x = torch.randint(0, 32000, (8, seq), generator=g)
            with torch.cuda.stream(s):
                losses.append(lm_step(torch, m, opt, x.cuda(non_blocking=False)))
        for s, loss in zip(streams, losses):
            torch.cuda.current_stream().wait_stream(s)
            loss.record_stream(torch.cuda.current_stream())
        yield sum(loss.detach() for loss in losses)


def run_resnet(torch, steps, sizes=None, batch=64):
    try:
        import torchvision

        m = torchvision.models.resnet50().cuda()
    except ImportError:
        m = torch.nn.Sequential(
            *[
                torch.nn.Sequential(
                    torch.nn.Conv2d(3 if i == 0 else 256, 256, 3, padding=1),
                    torch.nn.BatchNorm2d(256),
                    torch.nn.ReLU(),
                )
                for i in range(12)
            ],
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(256, 1000),
        ).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        hw = 224 if sizes is None else sizes[int(torch.randint(0, len(sizes), (1,), generator=g))]
        yield image_step(torch, m, opt, g, batch, hw)


def lm_weights(torch, L, D, seed=0):
    gw = torch.Generator().manual_seed(seed)
    w = [
        {
            k: (torch.randn(*s, generator=gw) * 0.02).to("cuda", torch.bfloat16)
            for k, s in (("qkv", (D, 3 * D)), ("o", (D, D)), ("up", (D, 4 * D)), ("down", (4 * D, D)))
        }
        for _ in range(L)
    ]
    emb = (torch.randn(32000, D, generator=gw) * 0.02).to("cuda", torch.bfloat16)
    return w, emb


def kv_layer(torch, p, x, cache, D, H):
    b, t, _ = x.shape
    q, k, v = (x @ p["qkv"]).split(D, dim=-1)
    q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
    if cache is not None:
        k = torch.cat([cache[0], k], dim=2)
        v = torch.cat([cache[1], v], dim=2)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
    x = x + a.transpose(1, 2).reshape(b, t, D) @ p["o"]
    x = x + torch.nn.functional.gelu(x @ p["up"]) @ p["down"]
    return x, (k, v)


def run_kv(torch, requests):
    L, D, H = 16, 1024, 16
    w, emb = lm_weights(torch, L, D)
    g = torch.Generator().manual_seed(1)

    def layer(p, x, cache):
        return kv_layer(torch, p, x, cache, D, H)

    with torch.no_grad():
        for _ in range(requests):
            batch = int(torch.randint(4, 9, (1,), generator=g))
            prompt = int(torch.randint(128, 896, (1,), generator=g))
            new = int(torch.randint(96, 256, (1,), generator=g))
            x = emb[torch.randint(0, 32000, (batch, prompt), generator=g).cuda()]
            caches = []
            for p in w:
                x, c = layer(p, x, None)
                caches.append(c)
            nxt = (x[:, -1] @ emb.T).argmax(-1)
            total = torch.zeros((), device="cuda")
            for _ in range(new):
                x = emb[nxt][:, None]
                for i, p in enumerate(w):
                    x, caches[i] = layer(p, x, caches[i])
                logits = (x[:, -1] @ emb.T).float()
                nxt = logits.argmax(-1)
                total += logits.max(-1).values.sum()
            del caches, x
            yield total


def run_mixed(torch, steps):
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        n = 4096 + 512 * int(torch.randint(0, 8, (1,), generator=g))
        big = torch.randn(n, n, generator=g).cuda()  # 64-128 MiB
        acc = torch.zeros((), device="cuda")
        for i in range(400):
            t = torch.randn(1 + (i % 97) * 13, device="cuda")
            acc += (t * t).sum()
        prod = big @ big.T  # a huge temporary
        acc += prod.diagonal().sum() * 1e-9
        del big, prod
        yield acc


def run_moe(torch, steps):
    D, E, F, L = 1024, 8, 4096, 4

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(D, E, bias=False)
            self.up = torch.nn.Parameter(torch.randn(E, D, F) * 0.02)
            self.down = torch.nn.Parameter(torch.randn(E, F, D) * 0.02)
            self.norm = torch.nn.LayerNorm(D)

        def forward(self, x):
            h = self.norm(x)
            w, idx = torch.softmax(self.gate(h), -1).topk(2, dim=-1)
            out = torch.zeros_like(h)
            for e in range(E):
                rows, slot = (idx == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                y = torch.nn.functional.gelu(h[rows] @ self.up[e]) @ self.down[e]
                out = out.index_add(0, rows, (y * w[rows, slot, None]).to(out.dtype))
            return x + out

    m = torch.nn.Sequential(*[Moe() for _ in range(L)]).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        tokens = 512 * int(torch.randint(4, 13, (1,), generator=g))
        # inputs whose mean moves each step: the router's choice, hence the tokens per
        # expert, changes from step to step
        shift = torch.randn(1, D, generator=g) * 2
        x = (torch.randn(tokens, D, generator=g) + shift).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_accum(torch, steps, micro=4, batch=8, seq=512):
    """GPT training with gradient accumulation (`micro` micro-batches per optimizer step) in
    fp16 with a GradScaler, as a Trainer's defaults give: the scaler's overflow check reads a
    flag back every step."""
    m = decoder(torch, d=768, layers=8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator().manual_seed(11)
    F = torch.nn.functional
    for _ in range(steps):
        total = 0.0
        for _ in range(micro):
            x = torch.randint(0, 32000, (batch, seq + 1), generator=g).cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device="cuda")
                h = m["body"](m["emb"](x[:, :-1]), mask=mask, is_causal=True)
                logits = m["head"](h)
                loss = F.cross_entropy(logits.float().view(-1, 32000), x[:, 1:].reshape(-1)) / micro
            scaler.scale(loss).backward()
            total = total + loss.detach()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield total


def run_unet(torch, steps, batch=32, hw=64):
    """A diffusion UNet trained to predict noise on 4-channel latents (convolutional residual
    blocks with GroupNorm and a timestep embedding, self-attention at the two lowest
    resolutions), bf16 autocast, AdamW."""
    nn, F = torch.nn, torch.nn.functional

    class Res(nn.Module):
        def __init__(self, cin, cout, temb):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(temb, cout)
            self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            return self.skip(x) + self.c2(F.silu(self.n2(h)))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.qkv, self.o = nn.GroupNorm(32, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

        def forward(self, x):
            b, c, hh, ww = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(b, 3, 8, c // 8, hh * ww).transpose(-1, -2).unbind(1)
            a = F.scaled_dot_product_attention(q, k, v)
            return x + self.o(a.transpose(-1, -2).reshape(b, c, hh, ww))

    class Unet(nn.Module):
        def __init__(self, ch=(128, 256, 512, 512), temb=512):
            super().__init__()
            self.temb = nn.Sequential(nn.Linear(128, temb), nn.SiLU(), nn.Linear(temb, temb))
            self.inp = nn.Conv2d(4, ch[0], 3, padding=1)
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            c, skips = ch[0], [ch[0]]
            for i, co in enumerate(ch):
                for _ in range(2):
                    self.down.append(nn.ModuleList([Res(c, co, temb), Attn(co) if i >= 2 else nn.Identity()]))
                    c = co
                    skips.append(c)
                if i < len(ch) - 1:
                    self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                    skips.append(c)
            self.mid = nn.ModuleList([Res(c, c, temb), Attn(c), Res(c, c, temb)])
            for i, co in reversed(list(enumerate(ch))):
                for _ in range(3):
                    self.up.append(nn.ModuleList([Res(c + skips.pop(), co, temb), Attn(co) if i >= 2 else nn.Identity()]))
                    c = co
                if i > 0:
                    self.up.append(nn.Upsample(scale_factor=2))
            self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 4, 3, padding=1))

        def forward(self, x, t):
            half = torch.exp(-torch.arange(64, device=x.device) * (9.21 / 64))
            e = t[:, None].float() * half[None]
            t = self.temb(torch.cat([e.sin(), e.cos()], -1))
            h = self.inp(x)
            hs = [h]
            for blk in self.down:
                h = blk(h) if isinstance(blk, nn.Conv2d) else blk[1](blk[0](h, t))
                hs.append(h)
            h = self.mid[2](self.mid[1](self.mid[0](h, t)), t)
            for blk in self.up:
                if isinstance(blk, nn.Upsample):
                    h = blk(h)
                else:
                    h = blk[1](blk[0](torch.cat([h, hs.pop()], 1), t))
            return self.out(h)

    m = Unet().cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(12)
    for _ in range(steps):
        x0 = torch.randn(batch, 4, hw, hw, generator=g).cuda()
        noise = torch.randn(batch, 4, hw, hw, generator=g).cuda()
        t = torch.randint(0, 1000, (batch,), generator=g).cuda()
        a = (1 - t.float() / 1000)[:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(m(a.sqrt() * x0 + (1 - a).sqrt() * noise, t).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_detect(torch, steps, batch=4):
    """Faster R-CNN (torchvision, ResNet-50 FPN, no pretrained weights) trained on `batch`
    images a step, each of a size drawn per image and with 1-8 random boxes, bf16 autocast,
    SGD. The model resizes the images and pads them into one batch, so the batch, the region
    proposals and the sampled boxes change size every step."""
    import torchvision

    m = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, min_size=512, max_size=896
    ).cuda()
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(13)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    for _ in range(steps):
        images, targets = [], []
        for _ in range(batch):
            h, w = 32 * rnd(12, 25), 32 * rnd(12, 25)
            images.append(torch.rand(3, h, w, generator=g).cuda())
            n = rnd(1, 9)
            xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.6, h * 0.6])
            wh = 16 + torch.rand(n, 2, generator=g) * torch.tensor([w * 0.35, h * 0.35])
            targets.append({"boxes": torch.cat([xy, xy + wh], 1).cuda(),
                            "labels": torch.randint(1, 91, (n,), generator=g).cuda()})
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses = m(images, targets)
            loss = sum(v.float() for v in losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_effnet(torch, steps, batch=96):
    """EfficientNet-B0 (torchvision) trained at a fixed shape: many small tensors (depthwise
    convolutions, squeeze-and-excitation), bf16 autocast, AdamW."""
    import torchvision

    yield from train_classifier(torch, steps, torchvision.models.efficientnet_b0().cuda(), batch, 14)


def run_emptycache(torch, steps):
    """gptfix with `torch.cuda.empty_cache()` after every step, as some training and
    evaluation loops call it: the cache is given back each step and taken again."""
    for loss in run_gptfix(torch, steps):
        loss = loss.detach()
        torch.cuda.empty_cache()
        yield loss


def run_serve(torch, iterations):
    L, D, H = 8, 1024, 16
    w, emb = lm_weights(torch, L, D, seed=6)
    g = torch.Generator().manual_seed(7)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    active = []  # [caches, next token, tokens left]
    total = torch.zeros((), device="cuda")
    with torch.no_grad():
        for it in range(iterations):
            # arrivals: up to 8 in flight, a new request with probability 1/3 per iteration
            if len(active) < 8 and (not active or rnd(0, 3) == 0):
                prompt = rnd(64, 1024)
                x = emb[torch.randint(0, 32000, (1, prompt), generator=g).cuda()]
                caches = []
                for p in w:
                    x, c = kv_layer(torch, p, x, None, D, H)
                    caches.append(c)
                active.append([caches, (x[:, -1] @ emb.T).argmax(-1), rnd(16, 384)])
            # one decode step for every request in flight, each on its own caches
            for r in active:
                x = emb[r[1]][:, None]
                for i, p in enumerate(w):
                    x, r[0][i] = kv_layer(torch, p, x, r[0][i], D, H)
                logits = (x[:, -1] @ emb.T).float()
                r[1] = logits.argmax(-1)
                total += logits.max(-1).values.sum()
                r[2] -= 1
            # departures free their caches
            active = [r for r in active if r[2] > 0]
            if it % 100 == 99:
                yield total
        active.clear()
        yield total


# ----------------------------------------------------------------------------- held-out jobs
# Five jobs added in stop 92 to try the policy on allocation patterns none of the jobs above
# has (kept since, as a family to test against): shapes new every step with a scatter, fp16
# with a loss scaler and padding per batch, activations saved to pinned host memory, a cuDNN
# LSTM, and inference-only sampling loops at a batch drawn per request.


def run_points(torch, steps, B=16):
    """Point-cloud classification: a batch of `B` clouds of 2,048-30,000 points each (a new
    total every step), a shared per-point MLP, mean pooling per cloud by `index_add`, bf16
    autocast, AdamW."""
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(3, 64), nn.GELU(), nn.Linear(64, 256), nn.GELU(),
                        nn.Linear(256, 1024)).cuda()
    head = nn.Sequential(nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 40)).cuda()
    opt = torch.optim.AdamW(list(mlp.parameters()) + list(head.parameters()), lr=1e-4)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        counts = torch.randint(2048, 30001, (B,), generator=g)
        pts = torch.randn(int(counts.sum()), 3, generator=g).cuda()
        seg = torch.repeat_interleave(torch.arange(B), counts).cuda()
        y = torch.randint(0, 40, (B,), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            f = mlp(pts).float()
            pooled = torch.zeros(B, f.shape[1], device="cuda").index_add(0, seg, f)
            pooled = pooled / counts.cuda()[:, None]
            loss = torch.nn.functional.cross_entropy(head(pooled).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_bertamp(torch, steps, batch=32, D=768, L=8):
    """BERT-base-like encoder fine-tuning for classification: fp16 autocast with a
    `GradScaler`, the batch padded to its longest sequence (64-512 tokens, drawn per step)."""
    layer = torch.nn.TransformerEncoderLayer(D, 12, 4 * D, batch_first=True, norm_first=True)
    body = torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
    m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(30522, D), "body": body,
                             "head": torch.nn.Linear(D, 2)}).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-5)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator().manual_seed(12)
    for _ in range(steps):
        T = 64 * int(torch.randint(1, 9, (1,), generator=g))
        x = torch.randint(0, 30522, (batch, T), generator=g).cuda()
        y = torch.randint(0, 2, (batch,), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            h = m["body"](m["emb"](x))
            loss = torch.nn.functional.cross_entropy(m["head"](h[:, 0]).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_offload(torch, steps):
    """GPT training (4 layers, d 1024, batch 4 x 1024) with the activations autograd saves
    kept in pinned host memory (`torch.autograd.graph.save_on_cpu`): copies out in the forward
    pass and back in the backward pass (host-bound: about 1 s a step at 8 layers and batch 8
    on an H200's host, whichever allocator)."""
    m = decoder(torch, layers=4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(13)
    for _ in range(steps):
        x = torch.randint(0, 32000, (4, 1024), generator=g).cuda()
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = lm_step(torch, m, opt, x)
        yield loss


def run_lstm(torch, steps, B=64, T=256, H=1024, V=10000):
    """A two-layer cuDNN LSTM language model (hidden 1024, batch 64 x 256 tokens, fp32),
    AdamW: cuDNN's workspace and reserve beside the activations."""
    nn = torch.nn
    m = nn.ModuleDict({"emb": nn.Embedding(V, H), "rnn": nn.LSTM(H, H, 2, batch_first=True),
                       "head": nn.Linear(H, V)}).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(14)
    for _ in range(steps):
        x = torch.randint(0, V, (B, T + 1), generator=g).cuda()
        h, _ = m["rnn"](m["emb"](x[:, :-1]))
        loss = nn.functional.cross_entropy(m["head"](h).reshape(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss


def run_sample(torch, steps, iters=10):
    """Inference only: a convolutional denoiser (an encoder-decoder of residual blocks, 64 x
    64 latents, bf16) run `iters` times a request under `torch.no_grad`, each request's batch
    drawn from 8-32 (a step is one request)."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.c1, self.c2 = nn.GroupNorm(32, c), nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return x + self.c2(F.silu(self.c1(F.silu(self.n(x)))))

    chans = [128, 256, 512]
    down, up = nn.ModuleList(), nn.ModuleList()
    for i, c in enumerate(chans):
        down.append(nn.Sequential(nn.Conv2d(4 if i == 0 else chans[i - 1], c, 3, stride=1 if i == 0 else 2, padding=1), Block(c), Block(c)))
    for i, c in reversed(list(enumerate(chans))):
        up.append(nn.Sequential(Block(c), nn.ConvTranspose2d(c, chans[i - 1] if i else 4, 4 if i else 3, stride=2 if i else 1, padding=1)))
    m = nn.ModuleDict({"down": down, "up": up}).cuda().eval()
    g = torch.Generator().manual_seed(15)
    for _ in range(steps):
        b = 8 * int(torch.randint(1, 5, (1,), generator=g))
        x = torch.randn(b, 4, 64, 64, generator=g).cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(iters):
                h, skips = x, []
                for d in m["down"]:
                    h = d(h)
                    skips.append(h)
                for u in m["up"]:
                    h = u(h + skips.pop())
                x = x - 0.1 * h.float()
        yield x.sum()


def run_compiled(torch, steps, B=8, T=512):
    """GPT training (6 layers, d 768, batch 8 x 512 tokens, bf16 autocast) with the loss under
    `torch.compile(mode="reduce-overhead")`: CUDA graphs, replayed from a private pool of the
    allocator's, each step after the first few; AdamW outside the graphs."""
    m = decoder(torch, d=768, layers=6)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(T, device="cuda")

    def loss_of(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = m["body"](m["emb"](x), mask=mask, is_causal=True)
            logits = m["head"](h)
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)
            )

    f = torch.compile(loss_of, mode="reduce-overhead")
    g = torch.Generator().manual_seed(16)
    for _ in range(steps):
        x = torch.randint(0, 32000, (B, T), generator=g).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        loss = f(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.detach()


def workload_steps(torch, workload, steps):
    """The steps of `workload` (a generator: each step yields its loss, or a total)."""
    return {
        "gpt": lambda: run_gpt(torch, steps, False),
        "gptfix": lambda: run_gptfix(torch, steps),
        "vit": lambda: run_vit(torch, steps),
        "varlen": lambda: run_gpt(torch, steps, True),
        "phases": lambda: run_phases(torch, steps),
        "traineval": lambda: run_traineval(torch, steps),
        "buckets": lambda: run_buckets(torch, steps),
        "resnet": lambda: run_resnet(torch, steps),
        "kv": lambda: run_kv(torch, 3),
        "mixed": lambda: run_mixed(torch, steps),
        "moe": lambda: run_moe(torch, steps),
        "resres": lambda: run_resnet(torch, steps, sizes=[128, 160, 192, 224, 256, 288], batch=32),
        "serve": lambda: run_serve(torch, 100 * steps),
        "streams": lambda: run_streams(torch, steps),
        "accum": lambda: run_accum(torch, steps),
        "unet": lambda: run_unet(torch, steps),
        "lora": lambda: run_lora(torch, steps),
        "prefill": lambda: run_prefill(torch, steps),
        "detect": lambda: run_detect(torch, steps),
        "effnet": lambda: run_effnet(torch, steps),
        "emptycache": lambda: run_emptycache(torch, steps),
        "points": lambda: run_points(torch, steps),
        "bertamp": lambda: run_bertamp(torch, steps),
        "offload": lambda: run_offload(torch, steps),
        "lstm": lambda: run_lstm(torch, steps),
        "sample": lambda: run_sample(torch, steps),
        "compiled": lambda: run_compiled(torch, steps),
    }[workload]()


def host_ms(torch):
    """ms for a fixed piece of CPU work (4M random numbers on a CPU generator, median of 5):
    how fast this process's host runs. Jobs whose steps are bound by the host (launches,
    autograd: unet, vit) move with it from process to process, whichever allocator runs
    (README, "Per call on a real step"), so the table shows it beside each step time."""
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        torch.randn(1 << 22, generator=g)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def job_settings(torch):
    """The settings every workload runs under: seeded, cuDNN's benchmark off, deterministic
    algorithms (warnings only)."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def worker(workload, setting, steps, lockstep=False):
    """Run `workload` under `setting` and print its RESULT line. With `lockstep`, each step
    waits for a line on stdin and its time is printed (`STEPTIME ms`) as soon as it ends: the
    parent runs the settings' processes in turns (see `lockstep_run`)."""
    if setting.startswith("gpumem"):
        import gpumem_torch

        gpumem_torch.install()
    import torch

    job_settings(torch)
    host_before = host_ms(torch)
    gen = workload_steps(torch, workload, steps)
    times, losses = [], []
    warm = 3
    calls_at_warm = None
    # the last 10 steps apart: a planned layout's first steps (issue 33) map its region once
    late = max(warm, steps - 10)
    calls_at_late = None
    before_late = {}
    torch.cuda.synchronize()
    turns = LockstepSteps(gen) if lockstep else None
    # per step, beside its time: the host's time until the step's code returned its loss (all
    # its work queued) and the process's CPU time in the step. A step whose enqueue time is
    # close to its time is bound by the host; one whose enqueue time is well below it waited
    # on the GPU, so a slower step with the same enqueue time is slower on the GPU.
    enqueue, cpu = [], []
    start = time.perf_counter()
    t = start
    c = time.process_time()
    for loss in turns or gen:
        queued = time.perf_counter()
        losses.append(float(loss))
        torch.cuda.synchronize()
        now = time.perf_counter()
        began = turns.started if turns else t
        # in lockstep, a step's time starts when its turn comes, not while the others run
        times.append((now - began) * 1e3)
        enqueue.append((queued - began) * 1e3)
        cpu.append((time.process_time() - (turns.cpu if turns else c)) * 1e3)
        t = now
        if lockstep:
            print(f"STEPTIME {times[-1]:.4f}", flush=True)
        if len(times) == warm and setting.startswith("gpumem"):
            import gpumem_torch

            calls_at_warm = gpumem_torch.memory_stats()
        if len(times) == late:
            # the whole run's peaks so far, then peaks over the last steps alone (a planned
            # layout gives back what its region does not use once it has served a cycle)
            before_late = torch.cuda.memory_stats()
            torch.cuda.reset_peak_memory_stats()
            if setting.startswith("gpumem"):
                import gpumem_torch

                calls_at_late = gpumem_torch.memory_stats()
        if os.environ.get("BENCH_STEP_STATS") and setting.startswith("gpumem"):
            # one line per step: what the pool did so far (for following a run's policy)
            import gpumem_torch

            s = gpumem_torch.memory_stats()
            print("STEP", len(times), f"{times[-1]:.1f}ms", *(f"{k}={s.get(k, 0)}" for k in (
                "num_move_stops", "vmm_calls_foreground", "vmm_calls_background",
                "allocated_bytes.all.peak", "reserved_bytes.all.peak", "num_page_moves", "num_pressure_moves", "page_move_ns",
                "num_plans", "num_plans_declined", "num_plan_allocs", "num_plan_misses", "plan_reserved_bytes",
                "num_plan_placements", "num_plan_placements_ahead", "num_plan_repairs", *TIME_KEYS)), file=sys.stderr, flush=True)
        # the next step's time starts here: reading the statistics is not the job's time
        t = time.perf_counter()
        c = time.process_time()
    total = (time.perf_counter() - start) * 1e3
    host = (host_before + host_ms(torch)) / 2
    if setting.startswith("gpumem"):
        import gpumem_torch

        stats = gpumem_torch.memory_stats()
    else:
        stats = torch.cuda.memory_stats()
    warm = min(warm, len(times) - 1)
    late_peaks = (stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0))
    whole_peak = lambda k: max(stats.get(k, 0), before_late.get(k, 0))
    out = {
        "workload": workload,
        "setting": setting,
        "step_ms": statistics.median(times[warm:]) if workload not in WHOLE_RUN else total,
        "total_ms": total,
        "steps": len(times),
        "times_ms": [round(x, 2) for x in times],
        "enqueue_ms": [round(x, 2) for x in enqueue],
        "cpu_ms": [round(x, 2) for x in cpu],
        "peak_allocated": whole_peak("allocated_bytes.all.peak"),
        "peak_reserved": whole_peak("reserved_bytes.all.peak"),
        # peak reserved / peak allocated over the last steps (from `late` on)
        "settled_ratio": late_peaks[1] / late_peaks[0] if before_late and late_peaks[0] else None,
        "losses": losses,
        "host_ms": host,
    }
    if setting.startswith("gpumem"):
        out["gpumem"] = {
            k: stats.get(k, 0)
            for k in ("num_device_alloc", "num_device_free", "num_unmap_syncs", "num_ooms",
                      "mapped_bytes", "unmapped_bytes", "vmm_calls_foreground",
                      "vmm_calls_background", "vmm_spare_bytes", "vmm_waits", "vmm_aliased",
                      "num_ordered_unmaps", "num_cross_stream_moves", "num_cross_stream_blocks",
                      "num_checkpoints",
                      "num_move_stops", "num_pressure_moves", "page_move_ns", "page_map_ns",
                      "num_plans", "num_plans_declined", "num_plan_allocs", "num_plan_misses", "plan_reserved_bytes",
                      "num_plan_placements", "num_plan_placements_ahead", "num_plan_repairs")
        }
        # driver calls per step after warm-up (steady state: 0 for a periodic job)
        if calls_at_warm is not None and len(times) > warm:
            steady = len(times) - warm
            for k in ("vmm_calls_foreground", "vmm_calls_background", "vmm_waits",
                      *TIME_KEYS, "vmm_creates", "vmm_maps", "vmm_set_access", "vmm_unmaps",
                      "vmm_releases", "vmm_records", "num_page_moves", "page_move_ns"):
                out["gpumem"][k + "_per_step"] = (stats.get(k, 0) - calls_at_warm.get(k, 0)) / steady
        if calls_at_late is not None and len(times) > late:
            out["gpumem"]["vmm_calls_foreground_per_late_step"] = (
                stats.get("vmm_calls_foreground", 0) - calls_at_late.get("vmm_calls_foreground", 0)
            ) / (len(times) - late)
    print("RESULT " + json.dumps(out), flush=True)


class LockstepSteps:
    """`gen`'s steps, each started only when a line arrives on stdin (the parent's turn);
    `started` is when the step last yielded began (after its turn came)."""

    def __init__(self, gen):
        self.it = iter(gen)
        self.started = time.perf_counter()
        self.cpu = time.process_time()

    def __iter__(self):
        while sys.stdin.readline():
            self.started = time.perf_counter()
            self.cpu = time.process_time()
            try:
                loss = next(self.it)
            except StopIteration:
                return
            yield loss


def lockstep_run(workload, settings, steps, here):
    """Run `workload` under every setting at once, each in a fresh process, taking turns one
    step at a time (the order reversed every other step), so that whatever slows the machine
    for a while slows every setting alike. Returns each setting's result, with the step
    times measured in the same turns."""
    procs, errs = [], []
    for s in settings:
        cmd = worker_cmd(workload, s, steps, lockstep=True)
        # stderr to a file: a pipe nobody reads while the turns go on would fill and block
        errs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(cmd, env=child_env(s, here), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=errs[-1], text=True,
                                      preexec_fn=pinned()))
    failed = set()
    # each process's stdout lines read during the turns (a finished one's RESULT among them)
    seen = [[] for _ in procs]
    for i in range(steps):
        order = range(len(procs)) if i % 2 == 0 else reversed(range(len(procs)))
        for j in order:
            if j in failed:
                continue
            p = procs[j]
            try:
                p.stdin.write("go\n")
                p.stdin.flush()
            except BrokenPipeError:
                failed.add(j)
                continue
            # wait for this step's time (other lines, such as warnings, are skipped)
            while True:
                line = p.stdout.readline()
                if not line:
                    failed.add(j)  # it ended (finished early, or crashed: its exit tells)
                    break
                if line.startswith("STEPTIME "):
                    break
                seen[j].append(line)
    results = []
    for s, p, e, before in zip(settings, procs, errs, seen):
        try:
            p.stdin.close()
        except BrokenPipeError:
            pass
        out = "".join(before) + p.stdout.read()
        p.wait(timeout=900)
        e.seek(0)
        err = e.read()
        e.close()
        results.append(worker_result(workload, s, p.returncode, out, err))
    return results


def worker_cmd(workload, setting, steps, lockstep=False):
    """The command line of a fresh worker process running `workload` under `setting`."""
    return ([sys.executable, os.path.abspath(__file__), "--worker", workload, setting,
             "--steps", str(steps)] + (["--lockstep"] if lockstep else []))


def fmt_ratio(x):
    """A ratio to 3 places, or `-` where there is none."""
    return "-" if x is None else f"{x:.3f}"


def progress(res, tail):
    """One finished worker's line on stderr: step time, peak reserved / allocated over the
    run and over its last 10 steps."""
    late = lambda k: statistics.median(res[k][3:]) if len(res.get(k, [])) > 3 else float("nan")
    print(f"  {res['workload']:<7} {res['setting']:<11} step {res['step_ms']:9.2f} ms (enqueue "
          f"{late('enqueue_ms'):.2f}, cpu {late('cpu_ms'):.2f})  ratio "
          f"{res['peak_reserved'] / max(res['peak_allocated'], 1):6.3f} last-10 "
          f"{fmt_ratio(res.get('settled_ratio'))}  {tail}",
          file=sys.stderr, flush=True)


def worker_result(workload, setting, returncode, out, err):
    """A worker process's result from its exit code, stdout and stderr: its RESULT line with
    the per-step lines of BENCH_STEP_STATS=1 kept beside it, or an error entry (reported)."""
    line = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if returncode != 0 or not line:
        print(f"{workload}/{setting} failed (exit {returncode}):\n{err[-3000:]}", file=sys.stderr)
        return {"workload": workload, "setting": setting, "error": err[-2000:]}
    res = json.loads(line[-1][len("RESULT "):])
    res["step_stats"] = [l for l in err.splitlines() if l.startswith("STEP ")]
    return res


def pooled_ratios(groups, skip, draws=2000, seed=1):
    """Lockstep groups (each a dict setting -> its processes' step times in ms, one list per
    process: a setting may run twice in a group) pooled: for every setting but native, its
    steps after the first `skip` of every group together, over native's: the ratio of the
    medians, of the 10th percentiles (the machine's fast level: on the H100 machines a
    process's steps move between levels some 30% apart for stretches of steps, whatever the
    allocator), and of the means, the first two with a 95% interval from resampling whole
    groups (a process's own speed is what varies most, so the group, not the step, is the
    unit). Returns {setting: {"median": (ratio, low, high), "p10": (...), "mean": ratio,
    "groups": n}}, and under "control", for each setting run twice in every group, its second
    process over its first step by step with its interval: the spread this run cannot resolve
    (--settings native,gpumem,native,gpumem gives both)."""
    import random

    def p10(xs):
        xs = sorted(xs)
        return xs[len(xs) // 10]

    def ratio(sample, s, f):
        a = [t for g in sample for run in g[s] for t in run[skip:]]
        b = [t for g in sample for run in g["native"] for t in run[skip:]]
        return f(a) / f(b) if a and b else float("nan")

    rng = random.Random(seed)
    out = {}
    # every setting any group has (a group whose process of it failed lacks it)
    settings = list(dict.fromkeys(s for g in groups for s in g if s != "native"))
    for s in settings:
        have = [g for g in groups if s in g and "native" in g]
        if not have:
            continue
        res = {"mean": ratio(have, s, statistics.mean), "groups": len(have)}
        for name, f in (("median", statistics.median), ("p10", p10)):
            boot = sorted(ratio([rng.choice(have) for _ in have], s, f) for _ in range(draws))
            res[name] = (ratio(have, s, f), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1])
        boot = sorted(paired(rng.choices(have, k=len(have)), s, skip) for _ in range(draws))
        res["paired"] = (paired(have, s, skip), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1])
        out[s] = res
    # the control: a setting run twice in every group, its second process over its first step
    # by step (what two processes of one allocator differ by in this run: the noise floor)
    for s in dict.fromkeys(name for g in groups for name in g):
        twice = [g for g in groups if len(g.get(s, [])) >= 2]
        if len(twice) < len(groups) or not twice:
            continue
        ctl = lambda gs: paired([{"native": [g[s][0]], "second": [g[s][1]]} for g in gs],
                                "second", skip)
        boot = sorted(ctl(rng.choices(twice, k=len(twice))) for _ in range(draws))
        out.setdefault("control", {})[s] = (ctl(twice), boot[int(0.025 * draws)],
                                            boot[int(0.975 * draws) - 1])
    return out


def paired(groups, s, skip):
    """The geometric mean, over every group's steps after the first `skip`, of setting `s`'s
    step time over native's same step in the same group (its k-th process against native's
    k-th, or native's first). Where a job's steps differ in shape (a length drawn per step:
    streams, varlen, moe), its step times fall in levels far apart (streams on an H200,
    2026-11-28: 50-80 ms and 150-400 ms), and a median of all steps lands on either level by
    a step or two; step by step, both processes ran the same shapes in turns."""
    logs = []
    for g in groups:
        for k, run in enumerate(g[s]):
            base = g["native"][k] if k < len(g["native"]) else g["native"][0]
            logs += [math.log(x / y) for x, y in list(zip(run, base))[skip:] if x > 0 and y > 0]
    return math.exp(statistics.mean(logs)) if logs else float("nan")


def paired_ratio(r, base, warm=3):
    """Median over the steps after warm-up of `r`'s step time / `base`'s same step (lockstep
    runs: the two ran in turns), or None."""
    a, b = r.get("times_ms", []), base.get("times_ms", [])
    pairs = [x / y for x, y in list(zip(a, b))[warm:] if y > 0]
    return statistics.median(pairs) if pairs else None


# ----------------------------------------------------------------------------- capacity

def counted(steps, tokens, per_step):
    """`steps` (a step generator), each step's `per_step` tokens appended to `tokens`."""
    for step in steps:
        tokens.append(per_step)
        yield step


# Passes over a capacity job's steps: the first, then the measured ones, which repeat it (a
# single measured pass of 10 steps moved a setting's tokens a second by 5-10% with one slow
# step: gptfix at batch 14, native 236,209 then 200,464 with a step of 126.9 ms among ~64,
# H100, 2026-11-27)
PASSES = 4

# capacity jobs: name -> (make the step generator for a batch: `steps` steps, then the same
# steps again in the measured passes, appending each step's tokens to a list; first batch tried)
CAPACITY_JOBS = {
    # the fixed-shape GPT of gpt_train (gptfix) at batch B x 1024 tokens
    "gptfix": (lambda torch, steps, b, t: counted(run_gptfix(torch, PASSES * steps, B=b), t, b * 1024), 16),
    # nn.TransformerEncoder GPT, sequence length drawn per step (128..1024, the same lengths at
    # every batch), batch B; every pass has the first's lengths in the same order
    "varlen": (lambda torch, steps, b, t: run_gpt(torch, PASSES * steps, True, batch=b, tokens=t, cycle=steps), 16),
    # LoRA fine-tuning of a frozen 0.6B-parameter decoder with gradient checkpointing, B x 1024
    "lora": (lambda torch, steps, b, t: counted(run_lora(torch, PASSES * steps, B=b), t, b * 1024), 16),
}


def ballast(torch, cap):
    """Leave `cap` bytes of the device free for the job: the rest is taken with cuMemAlloc
    outside every allocator under test (the same physical cap for all of them, as a smaller
    GPU or one shared with another process would give). Returns the bytes taken."""
    import ctypes

    free, _ = torch.cuda.mem_get_info()  # makes the primary context current
    take = free - cap
    if take <= 0:
        return 0
    cuda = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64(0)
    take = take // (2 << 20) * (2 << 20)
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(take))
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc of the ballast ({take} bytes) failed: {rc}")
    return take


def probe(job, setting, batch, steps, cap):
    """Run capacity job `job` at `batch` for `steps` steps with `cap` bytes of the device free;
    prints PROBE {...}: ok (no out-of-memory error), step time, peak memory."""
    if setting.startswith("gpumem"):
        import gpumem_torch

        gpumem_torch.install()
    import torch

    torch.manual_seed(0)
    taken = ballast(torch, cap)
    out = {"job": job, "setting": setting, "batch": batch, "ballast": taken}
    times, tokens = [], []
    stats_of = (gpumem_torch if setting.startswith("gpumem") else torch.cuda).memory_stats
    first_pass = {}
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in CAPACITY_JOBS[job][0](torch, steps, batch, tokens):
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append((now - t) * 1e3)
            if len(times) == steps:
                first_pass = stats_of()
            t = now
        out["ok"] = True
    except torch.OutOfMemoryError as e:
        out["ok"] = False
        out["oom"] = str(e).split("\n")[0][:300]
        out["oom_message"] = str(e)[:1500]
    # where the device's memory is: free now, and what the allocator holds
    free, total = torch.cuda.mem_get_info()
    out["device_free_at_end"] = free
    out["steps"] = len(times)
    if len(times) > steps:
        # the measured passes (after the first): their median step, and tokens a second. The
        # first pass pays what a shape costs the first time it is seen (on varlen, a step at a
        # new length took 160-330 ms and the same step at a length seen before 64-94 ms, H100,
        # every setting alike), which a job of many steps pays once.
        out["step_ms"] = statistics.median(times[steps:])
        out["tokens_per_s"] = sum(tokens[steps : len(times)]) / (sum(times[steps:]) / 1e3)
        out["times_ms"] = [round(x, 2) for x in times]
    stats = stats_of()
    # what the measured passes alone cost the allocator (gpumem's page work and moves)
    for k in ("page_map_ns", "num_page_moves", "num_pressure_moves", "num_alloc_retries",
              "num_device_alloc", "num_device_free"):
        if k in stats and k in first_pass:
            out[k + "_measured"] = stats[k] - first_pass[k]
    for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "num_pressure_moves",
              "num_move_stops", "page_map_ns", "num_ooms", "reserved_bytes.all.current",
              "allocated_bytes.all.current", "vmm_spare_bytes", "plan_reserved_bytes"):
        if k in stats:
            out[k] = stats[k]
    print("PROBE " + json.dumps(out), flush=True)


# --pin: the one CPU every worker runs on (None: wherever the scheduler puts it)
PIN = None


def pinned():
    """What a worker process runs before it starts (`preexec_fn`): with --pin, its CPU."""
    if PIN is None:
        return None
    return lambda: os.sched_setaffinity(0, {PIN})


def child_env(setting, here):
    """The environment of a fresh process running `setting` (`here`: this script's folder)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if PIN is not None:
        # one CPU: one OpenMP thread (more would only take turns with the main thread)
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
    env.update(setting_env(setting))
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if setting.startswith("gpumem"):
        pkg = os.path.join(here, "..", "python", "gpumem_torch")
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_probe(job, setting, batch, steps, cap, here):
    env = child_env(setting, here)
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", job, setting, str(batch),
           "--steps", str(steps), "--cap-gb", str(cap / 2**30)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = [l for l in r.stdout.splitlines() if l.startswith("PROBE ")]
    if not line:
        # a crash is not a capacity: report it as failed, with its error
        return {"job": job, "setting": setting, "batch": batch, "ok": False,
                "error": r.stderr[-1500:]}
    return json.loads(line[-1][len("PROBE "):])


def capacity(jobs, settings, steps, cap, out_json, first=None):
    """For each job and setting, the largest batch that runs `steps` steps `PASSES` times
    without an out-of-memory error with `cap` bytes of the device free, each try a fresh process. Native
    is searched first (up by a quarter until it fails, then by bisection); every other setting
    starts at native's largest batch (or `first`, where native is not run) and searches up or
    down from there by steps of 1, 2, 4, ... until one fails, then by bisection."""
    here = os.path.dirname(os.path.abspath(__file__))
    results = []
    table = []
    for job in jobs:
        native_best = None
        for s in settings:
            tried = {}

            def ok(b):
                if b not in tried:
                    r = run_probe(job, s, b, steps, cap, here)
                    results.append(r)
                    tried[b] = r
                    print(f"  {job:<7} {s:<11} batch {b:4d} "
                          + (f"ok   {r.get('step_ms', 0):8.1f} ms" if r["ok"] else
                             "OOM" if "oom" in r else "error: " + r.get("error", "")[-300:])
                          + (f"  pressure moves {r['num_pressure_moves']}, page work "
                             f"{r.get('page_map_ns', 0) / 1e6:.0f} ms in all"
                             if "num_pressure_moves" in r else ""),
                          file=sys.stderr, flush=True)
                return tried[b]["ok"]

            known = native_best or first
            start = known or CAPACITY_JOBS[job][1]
            lo, hi = 0, None  # largest passing, smallest failing
            b = start
            if ok(b):
                lo = b
                step = 1 if known else max(1, b // 4)
                while hi is None and b < 4096:
                    b = lo + step
                    if ok(b):
                        lo = b
                        step = 2 * step if known else max(1, b // 4)
                    else:
                        hi = b
            else:
                hi = b
                step = 1 if known else max(1, b // 4)
                while lo == 0 and b > 1:
                    b = max(1, hi - step)
                    if ok(b):
                        lo = b
                    else:
                        hi = b
                        step = 2 * step if known else max(1, b // 4)
            while hi is not None and hi - lo > 1:
                mid = (lo + hi) // 2
                if ok(mid):
                    lo = mid
                else:
                    hi = mid
            if s == "native":
                native_best = lo or None
            at_native = tried.get(native_best) if native_best else None
            best = tried.get(lo)
            table.append({
                "job": job, "setting": s, "largest_batch": lo,
                "step_ms": best.get("step_ms") if best else None,
                "ratio": (best["reserved_bytes.all.peak"] / best["allocated_bytes.all.peak"])
                if best and best.get("allocated_bytes.all.peak") else None,
                "step_ms_at_native_batch": at_native.get("step_ms") if at_native and at_native["ok"] else None,
                "native_batch": native_best, "probes": len(tried),
                "pressure_moves": best.get("num_pressure_moves") if best else None,
                "tokens_per_s": best.get("tokens_per_s") if best else None,
            })
    print(f"capacity: largest batch running {steps} steps {PASSES} times over with {cap / 2**30:.1f} GiB free")
    print(f"{'job':<8} {'setting':<11} {'largest':>7} {'step ms':>8} {'tokens/s':>9} {'vs native':>9} "
          f"{'ratio':>6} {'native batch':>12} {'step ms there':>13} {'vs native':>9}  probes")
    print("(tokens/s: at the setting's own largest batch, over the passes after the first; vs native: "
          "against native's at its own largest)")
    for job in jobs:
        nat = next((t for t in table if t["job"] == job and t["setting"] == "native"), None)
        for t in (t for t in table if t["job"] == job):
            there = t["step_ms_at_native_batch"]
            rel = there / nat["step_ms_at_native_batch"] if there and nat and nat["step_ms_at_native_batch"] else None
            tps = t["tokens_per_s"]
            tps_rel = tps / nat["tokens_per_s"] if tps and nat and nat["tokens_per_s"] else None
            fmt = lambda v, f: "-" if v is None else format(v, f)
            print(f"{job:<8} {t['setting']:<11} {t['largest_batch']:7d} {fmt(t['step_ms'], '8.1f')} "
                  f"{fmt(tps, '9.0f')} {fmt(tps_rel, '9.3f')} "
                  f"{fmt(t['ratio'], '6.3f')} {fmt(t['native_batch'], '12d')} {fmt(there, '13.1f')} "
                  f"{fmt(rel, '9.3f')}  {t['probes']}")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"cap": cap, "steps": steps, "table": table, "probes": results}, f, indent=1)


# ------------------------------------------------------------------------------- driver


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--groups", type=int, default=1,
                   help="lockstep: run this many groups of the settings per workload, the "
                        "order rotated from group to group, and report the pooled ratios")
    p.add_argument("--first-group", type=int, default=0,
                   help="lockstep: number the groups from this one (the settings' order "
                        "rotates with the number: runs of one group each pass 0, 1, 2, ... "
                        "so that no setting's process is always started first)")
    p.add_argument("--skip", type=int, default=6,
                   help="lockstep groups: steps left out of the pooled ratios at each start")
    p.add_argument("--pin", type=int, metavar="CPU",
                   help="run every worker process on this one CPU, with one OpenMP thread")
    p.add_argument("--lockstep", action="store_true",
                   help="run a workload's settings side by side, one step each in turn "
                   "(timings paired step by step; kv and serve, timed whole, run one by one)")
    p.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "SETTING"), help=argparse.SUPPRESS)
    p.add_argument("--capacity", metavar="JOBS", nargs="?", const=",".join(CAPACITY_JOBS),
                   help="capacity benchmark instead: the largest batch each setting runs with "
                   "--cap-gb of the device free (jobs: " + ",".join(CAPACITY_JOBS) + ")")
    p.add_argument("--cap-gb", type=float, default=16.0, help="device memory left free (GiB)")
    p.add_argument("--first", type=int, help="capacity: the first batch tried where native is not run")
    p.add_argument("--probe", nargs=3, metavar=("JOB", "SETTING", "BATCH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    global PIN
    PIN = a.pin
    here = os.path.dirname(os.path.abspath(__file__))
    if a.worker or a.probe:
        # a run started by hand gets the environment its setting is measured in (the parent
        # gives it to its children; without it a probe ran with cuBLAS's default workspace, and
        # `expandable` as native: varlen at batch 18 under a 16 GiB cap failed 4 of 4 that way
        # for gpumem and expandable alike, and passed 4 of 4 for both from the parent). Set
        # before torch is imported, so PyTorch reads it.
        setting = (a.worker or a.probe)[1]
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.update({k: v for k, v in child_env(setting, here).items() if k != "PYTHONPATH"})
    if a.worker:
        worker(a.worker[0], a.worker[1], a.steps, a.lockstep)
        return 0
    if a.probe:
        probe(a.probe[0], a.probe[1], int(a.probe[2]), a.steps, int(a.cap_gb * 2**30))
        return 0
    if a.capacity:
        capacity(a.capacity.split(","), a.settings.split(","), a.steps, int(a.cap_gb * 2**30), a.json, a.first)
        return 0
    results = []
    pooled = {}
    for w in a.workloads.split(","):
        if a.lockstep and w not in WHOLE_RUN:
            settings = a.settings.split(",")
            groups = []
            for g in range(a.first_group, a.first_group + max(a.groups, 1)):
                order = settings[g % len(settings):] + settings[:g % len(settings)]
                times = {}
                for res in lockstep_run(w, order, a.steps, here):
                    res["group"] = g
                    results.append(res)
                    if "error" not in res:
                        times.setdefault(res["setting"], []).append(res["times_ms"])
                        progress(res, f"(lockstep, group {g})")
                groups.append(times)
            # (one group pools too where it runs a setting twice: its control)
            if a.groups > 1 or len(set(settings)) < len(settings):
                pooled[w] = pooled_ratios(groups, a.skip)
            continue
        for s in a.settings.split(","):
            env = child_env(s, here)
            cmd = worker_cmd(w, s, a.steps)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                               preexec_fn=pinned())
            res = worker_result(w, s, r.returncode, r.stdout, r.stderr)
            results.append(res)
            if "error" in res:
                continue
            progress(res, f"host {res.get('host_ms', 0):.1f} ms")
    print(f"{'workload':<8} {'setting':<11} {'step ms':>10} {'vs native':>9} {'host ms':>8} "
          f"{'peak alloc':>12} {'peak reserved':>14} {'ratio':>6} {'last-10':>7}  losses"
          + ("  (lockstep: vs native is the median of step-by-step ratios)" if a.lockstep else ""))
    for w in a.workloads.split(","):
        first = next((r for r in results if r["workload"] == w and r["setting"] == "native" and "error" not in r), None)
        for r in (r for r in results if r["workload"] == w):
            # a lockstep group's rows are compared with that group's native process
            base = next((b for b in results if b["workload"] == w and b["setting"] == "native"
                         and "error" not in b and b.get("group") == r.get("group")), first)
            if "error" in r:
                print(f"{w:<8} {r['setting']:<11} failed")
                continue
            rel = r["step_ms"] / base["step_ms"] if base else float("nan")
            if a.lockstep and base and w not in WHOLE_RUN:
                rel = paired_ratio(r, base) or float("nan")
            same = "identical" if base and r["losses"] == base["losses"] else (
                "n/a" if not base else
                f"max rel diff {max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(r['losses'], base['losses'])):.1e}")
            calls = ""
            if "gpumem" in r and "vmm_calls_foreground_per_step" in r["gpumem"]:
                g = r["gpumem"]
                # (event records, cuEventRecord, are the allocating thread's calls that are no
                # page call: the rest of fg are maps, unmaps, creates and access settings)
                calls = (f"  calls/step fg {g['vmm_calls_foreground_per_step']:.1f} "
                         f"(records {g.get('vmm_records_per_step', 0):.1f}) "
                         f"bg {g['vmm_calls_background_per_step']:.1f} "
                         f"waits {g.get('vmm_waits_per_step', 0):.1f} syncs {g['num_unmap_syncs']} "
                         f"stops {g.get('num_move_stops', 0)} "
                         f"last-10 fg {g.get('vmm_calls_foreground_per_late_step', 0):.1f} "
                         f"plans {g.get('num_plans', 0)} "
                         f"(declined {g.get('num_plans_declined', 0)})")
            print(f"{w:<8} {r['setting']:<11} {r['step_ms']:10.2f} {rel:9.3f} {r.get('host_ms', 0):8.1f} "
                  f"{r['peak_allocated'] / 2**30:10.2f} GiB {r['peak_reserved'] / 2**30:11.2f} GiB "
                  f"{r['peak_reserved'] / max(r['peak_allocated'], 1):6.3f} "
                  f"{fmt_ratio(r.get('settled_ratio')):>7}  {same}{calls}")
    for w, by in pooled.items():
        for st, r in by.items():
            if st == "control":
                for c, (x, lo, hi) in r.items():
                    print(f"{w:<8} {c:<11} control: its second process over its first, step by "
                          f"step {x:.4f} (95% {lo:.4f}-{hi:.4f})")
                continue
            (med, lo, hi), (fast, flo, fhi) = r["median"], r["p10"]
            print(f"{w:<8} {st:<11} pooled over {r['groups']} groups (steps after {a.skip}), over "
                  f"native's: median {med:.4f} (95% {lo:.4f}-{hi:.4f}), 10th percentile {fast:.4f} "
                  f"(95% {flo:.4f}-{fhi:.4f}), mean {r['mean']:.4f}; step by step "
                  f"{r['paired'][0]:.4f} (95% {r['paired'][1]:.4f}-{r['paired'][2]:.4f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
