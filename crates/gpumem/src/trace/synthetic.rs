//! Synthetic allocation traces of the workload kinds that fragment caching allocators, built
//! deterministically from a seed with the tensor sizes real models allocate. Each kind is a
//! family: the seed draws the model (layers, width, batch, experts, ...) as well as the
//! per-step shapes, so replaying many seeds tests a policy on workloads it was not tuned on.
//!
//! - [`Kind::FixedShape`]: transformer training with one shape every step (periodic);
//! - [`Kind::VariableSeqLen`]: transformer training whose sequence length changes every step
//!   (dynamic padding), so activation sizes never repeat;
//! - [`Kind::Moe`]: mixture-of-experts training, the tokens each expert gets drawn every step;
//! - [`Kind::KvCacheDecode`]: autoregressive decoding over several rounds of varied batch and
//!   prompt, whose per-layer K and V caches grow by concatenation (a new, one-token-larger
//!   tensor every step, the old one freed);
//! - [`Kind::Serving`]: a serving loop: requests arrive and finish at random, each with its own
//!   per-layer caches grown by concatenation;
//! - [`Kind::MixedTinyHuge`]: many short-lived tiny tensors next to a few huge, long-lived ones;
//! - [`Kind::MultiStream`]: two to four streams each running its own training loop, their
//!   events interleaved (host threads of their own) or each stream's step queued in turn (one
//!   host thread that waits for all streams after each round);
//! - [`Kind::ConvTraining`]: convnet training with fixed shapes (a ResNet-like ladder of sizes);
//! - [`Kind::ConvVariableResolution`]: the same at an image size drawn per step.
//!
//! Every trace is JSON Lines compatible ([`TraceEvent`]): `alloc` / `free_completed` with unique
//! addresses, no `segment_*` events (there is no recording allocator).

use super::{Action, TraceEvent};
use crate::workload::SplitMix;
use rustc_hash::FxHashMap;

/// The synthetic workload kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// transformer training, one shape every step
    FixedShape,
    /// transformer training, sequence length drawn per step
    VariableSeqLen,
    /// mixture-of-experts training, tokens per expert drawn per step
    Moe,
    /// a serving loop with arrivals, departures and per-request caches
    Serving,
    /// convnet training at an image size drawn per step
    ConvVariableResolution,
    /// decoding with KV caches grown by concatenation
    KvCacheDecode,
    /// tiny short-lived tensors next to huge long-lived ones
    MixedTinyHuge,
    /// three streams, each its own training loop
    MultiStream,
    /// convnet training with fixed shapes
    ConvTraining,
    /// transformer training in phases: runs of steps at one of a few sequence lengths (length
    /// buckets), an evaluation pass (forward only) after each run
    Phases,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 10] = [
        Kind::FixedShape,
        Kind::VariableSeqLen,
        Kind::Moe,
        Kind::KvCacheDecode,
        Kind::Serving,
        Kind::MixedTinyHuge,
        Kind::MultiStream,
        Kind::ConvTraining,
        Kind::ConvVariableResolution,
        Kind::Phases,
    ];

    /// The kinds whose steps repeat exactly (after the first), where a pool should reach a
    /// steady state with no driver calls.
    pub const PERIODIC: [Kind; 2] = [Kind::FixedShape, Kind::ConvTraining];

    /// The kind's name (as `gpumem synth` takes it).
    pub fn name(self) -> &'static str {
        match self {
            Kind::FixedShape => "fixed_shape",
            Kind::VariableSeqLen => "variable_seq_len",
            Kind::Moe => "moe",
            Kind::Serving => "serving",
            Kind::ConvVariableResolution => "conv_variable_resolution",
            Kind::KvCacheDecode => "kv_cache_decode",
            Kind::MixedTinyHuge => "mixed_tiny_huge",
            Kind::MultiStream => "multi_stream",
            Kind::ConvTraining => "conv_training",
            Kind::Phases => "phases",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// A trace of this kind; `scale` multiplies the number of steps (1 = a few seconds of
    /// a real run, tens of thousands of events). The seed draws the model and the shapes.
    pub fn generate(self, seed: u64, scale: usize) -> Vec<TraceEvent> {
        self.generate_steps(seed, scale.max(1) * self.default_steps())
    }

    /// Steps (rounds, for decoding and serving) at scale 1.
    fn default_steps(self) -> usize {
        match self {
            Kind::FixedShape | Kind::VariableSeqLen => 6,
            Kind::Moe => 6,
            Kind::KvCacheDecode => 3,
            Kind::Serving => 1,
            Kind::MixedTinyHuge => 12_000,
            Kind::MultiStream => 4,
            Kind::ConvTraining | Kind::ConvVariableResolution => 5,
            // 4-5 runs of 6-8 steps over 2-3 buckets: the first bucket's run comes back
            Kind::Phases => 32,
        }
    }

    /// A trace of this kind with `steps` steps: for the periodic kinds, the first `n` steps of
    /// the same seed are the same whatever `steps` is (a steady-state test compares `n` and
    /// `n + 1`).
    pub fn generate_steps(self, seed: u64, steps: usize) -> Vec<TraceEvent> {
        let mut t = Builder::new(seed);
        match self {
            Kind::FixedShape | Kind::VariableSeqLen => {
                let (layers, d, batch) = t.transformer_shape();
                let heads = d / 64;
                let w = t.weights(layers, d, 0);
                let fixed = 128 * (2 + t.rng.below(15)); // 256 .. 2048 tokens
                for _ in 0..steps {
                    let seq = if self == Kind::FixedShape {
                        fixed
                    } else {
                        64 * (2 + t.rng.below(31)) // 128 .. 2048 tokens
                    };
                    t.transformer_step(layers, d, heads, batch, seq, 0);
                }
                t.free_all(w);
            }
            Kind::Moe => {
                let layers = 2 + t.rng.below(5);
                let d = [512, 768, 1024, 2048][t.rng.below(4) as usize];
                let experts = [4, 8, 16][t.rng.below(3) as usize];
                let w = t.moe_weights(layers, d, experts);
                for _ in 0..steps {
                    let tokens = 512 * (1 + t.rng.below(16));
                    t.moe_step(layers, d, experts, tokens);
                }
                t.free_all(w);
            }
            Kind::KvCacheDecode => {
                let layers = 4 + t.rng.below(21);
                let d = [512, 1024, 2048, 4096][t.rng.below(4) as usize];
                let w = t.weights(layers, d, 0);
                for _ in 0..steps {
                    let prompt = 64 + t.rng.below(1024);
                    let new = 32 + t.rng.below(128);
                    let batch = 1 + t.rng.below(16);
                    t.decode(layers, d, d / 64, batch, prompt, new);
                }
                t.free_all(w);
            }
            Kind::Serving => {
                let layers = 4 + t.rng.below(9);
                let d = [512, 1024, 2048][t.rng.below(3) as usize];
                let in_flight = 4 + t.rng.below(9);
                let w = t.weights(layers, d, 0);
                let iterations = steps * (120 + t.rng.below(120) as usize);
                t.serve(layers, d, in_flight, iterations);
                t.free_all(w);
            }
            Kind::Phases => {
                let (layers, d, batch) = t.transformer_shape();
                let heads = d / 64;
                let w = t.weights(layers, d, 0);
                let buckets: Vec<u64> = (0..2 + t.rng.below(2))
                    .map(|_| 128 * (2 + t.rng.below(15)))
                    .collect();
                let run = 6 + t.rng.below(3) as usize;
                for step in 0..steps {
                    let seq = buckets[(step / run) % buckets.len()];
                    t.transformer_step(layers, d, heads, batch, seq, 0);
                    if (step + 1) % run == 0 {
                        t.evaluation(layers, d, heads, batch, buckets[0], 0);
                    }
                }
                t.free_all(w);
            }
            Kind::MixedTinyHuge => t.mixed(steps),
            Kind::MultiStream => {
                let streams = 2 + t.rng.below(3);
                let in_turn = t.rng.below(2) == 0;
                let shapes: Vec<(u64, u64, u64)> = (0..streams)
                    .map(|_| {
                        let d = [512, 768, 1024][t.rng.below(3) as usize];
                        (2 + t.rng.below(7), d, 1 + t.rng.below(4))
                    })
                    .collect();
                let w: Vec<u64> = shapes
                    .iter()
                    .flat_map(|&(layers, d, _)| t.weights(layers, d, 0))
                    .collect();
                for _ in 0..steps {
                    // the loops' events interleave in chunks, as streams' host threads do, or
                    // one thread queues each stream's step in turn
                    let mut parts: Vec<Vec<TraceEvent>> = Vec::new();
                    for (s, &(layers, d, batch)) in shapes.iter().enumerate() {
                        let mut sub = Builder::with_addr(t.rng.next_u64(), t.next_addr);
                        let seq = 64 * (4 + sub.rng.below(12));
                        sub.transformer_step(layers, d, d / 64, batch, seq, s as u64 + 1);
                        t.next_addr = sub.next_addr;
                        parts.push(sub.events);
                    }
                    if in_turn {
                        t.in_turn(parts);
                    } else {
                        t.interleave(parts);
                    }
                }
                t.free_all(w);
            }
            Kind::ConvTraining | Kind::ConvVariableResolution => {
                let batch = [8, 16, 32, 64][t.rng.below(4) as usize];
                let width = [1, 2][t.rng.below(2) as usize];
                let fixed = 32 * (4 + t.rng.below(6)); // 128 .. 288 pixels
                for _ in 0..steps {
                    let hw = if self == Kind::ConvTraining {
                        fixed
                    } else {
                        32 * (4 + t.rng.below(6))
                    };
                    t.conv_step(batch, hw, width);
                }
            }
        }
        t.events
    }
}

struct Builder {
    rng: SplitMix,
    events: Vec<TraceEvent>,
    live: FxHashMap<u64, (u64, u64)>,
    next_addr: u64,
    time: u64,
}

/// Microseconds between two events of a synthetic trace: what the host spends between
/// allocator calls in the real traces lies between 35 µs (MoE) and 280 µs (GPT); the time
/// budget of page moves runs on this clock in replays.
const US_PER_EVENT: u64 = 50;

const BF16: u64 = 2;
const F32: u64 = 4;

impl Builder {
    fn new(seed: u64) -> Self {
        Self::with_addr(seed, 0x7000_0000_0000)
    }

    fn with_addr(seed: u64, addr: u64) -> Self {
        Self {
            rng: SplitMix::new(seed),
            events: Vec::new(),
            live: FxHashMap::default(),
            next_addr: addr,
            time: 0,
        }
    }

    fn alloc(&mut self, size: u64, stream: u64) -> u64 {
        let addr = self.next_addr;
        self.next_addr += size.div_ceil(512) * 512 + 512;
        self.time += US_PER_EVENT;
        self.live.insert(addr, (size, stream));
        self.events.push(TraceEvent::new(
            Action::Alloc,
            addr,
            size,
            stream,
            self.time,
        ));
        addr
    }

    fn free(&mut self, addr: u64) {
        let (size, stream) = self.live.remove(&addr).expect("live");
        self.time += US_PER_EVENT;
        self.events.push(TraceEvent::new(
            Action::FreeCompleted,
            addr,
            size,
            stream,
            self.time,
        ));
    }

    fn free_all(&mut self, addrs: Vec<u64>) {
        for a in addrs {
            self.free(a);
        }
    }

    /// Weights in bf16 plus fp32 master weights and two AdamW moments: per layer the
    /// attention (4 d²) and MLP (8 d²) matrices, biases and norms.
    fn weights(&mut self, layers: u64, d: u64, stream: u64) -> Vec<u64> {
        let mut w = Vec::new();
        for _ in 0..layers {
            for n in [3 * d * d, d * d, 4 * d * d, 4 * d * d] {
                w.push(self.alloc(n * BF16, stream)); // weight
                w.push(self.alloc(n * F32, stream)); // fp32 master copy
                w.push(self.alloc(n * F32, stream)); // AdamW first moment
                w.push(self.alloc(n * F32, stream)); // AdamW second moment
                w.push(self.alloc(4 * d * BF16, stream)); // bias
            }
            w.push(self.alloc(2 * d * F32, stream)); // norms
        }
        w
    }

    /// A forward pass without gradients (evaluation): each layer's tensors are freed once the
    /// next layer has its input.
    fn evaluation(&mut self, layers: u64, d: u64, heads: u64, b: u64, s: u64, st: u64) {
        let tok = b * s;
        let mut x = self.alloc(tok * d * BF16, st);
        for _ in 0..layers {
            let norm = self.alloc(tok * d * BF16, st);
            let qkv = self.alloc(3 * tok * d * BF16, st);
            let scores = self.alloc(b * heads * s * s * BF16, st);
            let probs = self.alloc(b * heads * s * s * BF16, st);
            self.free(scores);
            let attn = self.alloc(tok * d * BF16, st);
            self.free(probs);
            self.free(qkv);
            let up = self.alloc(4 * tok * d * BF16, st);
            let act = self.alloc(4 * tok * d * BF16, st);
            self.free(up);
            let out = self.alloc(tok * d * BF16, st);
            self.free(act);
            self.free(attn);
            self.free(norm);
            self.free(x);
            x = out;
        }
        let logits = self.alloc(tok * 32_000 * BF16, st);
        let loss = self.alloc(512, st);
        self.free(logits);
        self.free(loss);
        self.free(x);
    }

    /// One training step: forward saves activations per layer, backward frees them in reverse
    /// with gradient temporaries, then an optimizer step with per-tensor temporaries.
    fn transformer_step(&mut self, layers: u64, d: u64, heads: u64, b: u64, s: u64, st: u64) {
        let tok = b * s;
        let mut saved: Vec<Vec<u64>> = Vec::new();
        let x = self.alloc(tok * d * BF16, st);
        for _ in 0..layers {
            let mut keep = Vec::new();
            keep.push(self.alloc(tok * d * BF16, st)); // norm out
            keep.push(self.alloc(3 * tok * d * BF16, st)); // qkv
            let scores = self.alloc(b * heads * s * s * BF16, st);
            keep.push(self.alloc(b * heads * s * s * BF16, st)); // softmax
            self.free(scores);
            keep.push(self.alloc(tok * d * BF16, st)); // attention out
            keep.push(self.alloc(4 * tok * d * BF16, st)); // mlp up
            keep.push(self.alloc(4 * tok * d * BF16, st)); // gelu
            let tmp = self.alloc(tok * d * F32, st); // residual in fp32
            keep.push(self.alloc(tok * d * BF16, st));
            self.free(tmp);
            saved.push(keep);
        }
        let logits = self.alloc(tok * 32_000 * BF16, st);
        let loss = self.alloc(512, st);
        let dlogits = self.alloc(tok * 32_000 * BF16, st);
        self.free(logits);
        let mut grads = Vec::new();
        for keep in saved.into_iter().rev() {
            let g1 = self.alloc(4 * tok * d * BF16, st);
            let g2 = self.alloc(tok * d * BF16, st);
            grads.push(self.alloc(4 * d * d * F32, st));
            grads.push(self.alloc(3 * d * d * F32, st));
            self.free(g1);
            let g3 = self.alloc(b * heads * s * s * BF16, st);
            self.free(g3);
            self.free(g2);
            for a in keep.into_iter().rev() {
                self.free(a);
            }
        }
        self.free(dlogits);
        self.free(loss);
        self.free(x);
        // optimizer: a temporary per gradient, then gradients are set to None
        for &g in &grads {
            let size = self.live[&g].0;
            let t = self.alloc(size, st);
            self.free(t);
        }
        self.free_all(grads);
        // a few small bookkeeping tensors (the same every step of one shape)
        for i in 0..8 {
            let size = 4 << ((i * 7 + s) % 12);
            let small = self.alloc(size, st);
            self.free(small);
        }
    }

    /// Prefill then `new` decode steps: every step each layer's K and V caches are replaced by
    /// one-token-longer copies (torch.cat), with small temporaries around.
    fn decode(&mut self, layers: u64, d: u64, heads: u64, b: u64, prompt: u64, new: u64) {
        let per_token = b * d * BF16; // one token of K (or V) for the batch, all heads
        let mut caches: Vec<u64> = Vec::new();
        for _ in 0..2 * layers {
            caches.push(self.alloc(prompt * per_token, 0));
        }
        let prefill = self.alloc(b * heads * prompt * prompt * BF16, 0);
        self.free(prefill);
        for step in 0..new {
            let n = prompt + step + 1;
            let mut x = self.alloc(b * d * BF16, 0);
            // per layer, as torch.cat does it: both new caches exist before the old ones go
            for l in 0..layers as usize {
                let qkv = self.alloc(3 * b * d * BF16, 0);
                let k = self.alloc(n * per_token, 0);
                let v = self.alloc(n * per_token, 0);
                let scores = self.alloc(b * heads * n * F32, 0);
                let attn = self.alloc(b * d * BF16, 0);
                self.free(scores);
                self.free(qkv);
                let mlp = self.alloc(4 * b * d * BF16, 0);
                let out = self.alloc(b * d * BF16, 0);
                self.free(mlp);
                self.free(attn);
                self.free(x);
                x = out;
                let (old_k, old_v) = (caches[2 * l], caches[2 * l + 1]);
                self.free(old_k);
                self.free(old_v);
                caches[2 * l] = k;
                caches[2 * l + 1] = v;
            }
            let logits = self.alloc(b * 32_000 * F32, 0);
            let next = self.alloc(b * 8, 0);
            self.free(logits);
            self.free(next);
            self.free(x);
        }
        self.free_all(caches);
    }

    /// Tiny tensors (16 B – 64 KiB) living a few events, and now and then a huge one
    /// (256 MiB – 2 GiB) living thousands of events; at most six huge ones at a time.
    fn mixed(&mut self, steps: usize) {
        let mut tiny: Vec<(u64, usize)> = Vec::new();
        let mut huge: Vec<(u64, usize)> = Vec::new();
        for i in 0..steps {
            let size = 16u64 << self.rng.below(13);
            let life = i + 1 + self.rng.below(60) as usize;
            let size = size + self.rng.below(size);
            let a = self.alloc(size, 0);
            tiny.push((a, life));
            if self.rng.below(400) == 0 && huge.len() < 6 {
                let size = (256 << 20) + self.rng.below(7 << 28);
                let a = self.alloc(size, 0);
                huge.push((a, i + 500 + self.rng.below(3000) as usize));
            }
            for list in [&mut tiny, &mut huge] {
                let (done, keep): (Vec<_>, Vec<_>) = list.drain(..).partition(|&(_, end)| end <= i);
                *list = keep;
                for (a, _) in done {
                    self.free(a);
                }
            }
        }
        for (a, _) in tiny.into_iter().chain(huge) {
            self.free(a);
        }
    }

    /// A ResNet-like step at `hw` pixels (224 is ResNet-50's ladder) with channels times
    /// `width`: activation sizes saved through the forward pass and freed in reverse, with
    /// workspace temporaries. Gradients of the weights are kept by a fixed pattern, so that
    /// steps of one shape repeat exactly.
    fn conv_step(&mut self, batch: u64, hw: u64, width: u64) {
        let mut saved = Vec::new();
        let stages = [
            (64u64, hw / 2, 1),
            (256, hw / 4, 3),
            (512, hw / 8, 4),
            (1024, hw / 16, 6),
            (2048, hw / 32, 3),
        ];
        for &(c, side, blocks) in &stages {
            let (c, side) = (c * width, side.max(1));
            for _ in 0..blocks {
                for k in [c / 4, c / 4, c] {
                    let ws = self.alloc(8 << 20, 0); // convolution workspace
                    saved.push(self.alloc(batch * k * side * side * BF16, 0));
                    saved.push(self.alloc(batch * k * side * side * BF16, 0)); // batch norm
                    self.free(ws);
                }
            }
        }
        let mut grads = Vec::new();
        for (i, a) in saved.into_iter().rev().enumerate() {
            let size = self.live[&a].0;
            let g = self.alloc(size, 0);
            if grads.len() < 160 && i % 2 == 0 {
                grads.push(self.alloc((size / batch).max(512), 0));
            }
            self.free(g);
            self.free(a);
        }
        self.free_all(grads);
    }

    /// A transformer drawn from the seed: (layers, width, batch).
    fn transformer_shape(&mut self) -> (u64, u64, u64) {
        let layers = 2 + self.rng.below(15);
        let d = [512, 768, 1024, 1536, 2048][self.rng.below(5) as usize];
        let batch = 1 + self.rng.below(8);
        (layers, d, batch)
    }

    /// Mixture-of-experts weights: per layer a router and `experts` MLPs (4 d wide), bf16 with
    /// fp32 master copies and AdamW moments.
    fn moe_weights(&mut self, layers: u64, d: u64, experts: u64) -> Vec<u64> {
        let mut w = Vec::new();
        for _ in 0..layers {
            w.push(self.alloc(d * experts * F32, 0)); // router
            for _ in 0..experts {
                for n in [4 * d * d, 4 * d * d] {
                    w.push(self.alloc(n * BF16, 0));
                    w.push(self.alloc(n * F32, 0));
                    w.push(self.alloc(n * F32, 0));
                    w.push(self.alloc(n * F32, 0));
                }
            }
            w.push(self.alloc(2 * d * F32, 0)); // norm
        }
        w
    }

    /// One MoE training step over `tokens` tokens, top-2 routing: each expert gets a share
    /// drawn this step; forward saves per-expert activations, backward frees them in reverse
    /// with gradient temporaries and per-expert weight gradients, then an optimizer step.
    fn moe_step(&mut self, layers: u64, d: u64, experts: u64, tokens: u64) {
        let x = self.alloc(tokens * d * BF16, 0);
        let mut saved: Vec<Vec<u64>> = Vec::new();
        for _ in 0..layers {
            let mut keep = Vec::new();
            keep.push(self.alloc(tokens * d * BF16, 0)); // norm out
            let logits = self.alloc(tokens * experts * F32, 0);
            keep.push(self.alloc(tokens * 2 * 8, 0)); // top-2 indices
            keep.push(self.alloc(tokens * 2 * F32, 0)); // top-2 weights
            self.free(logits);
            // the router's choice this step: skewed shares of 2 * tokens
            let shares: Vec<u64> = (0..experts).map(|_| 1 + self.rng.below(100)).collect();
            let total: u64 = shares.iter().sum();
            let out = self.alloc(tokens * d * BF16, 0);
            for &sh in &shares {
                let n = (2 * tokens * sh / total).max(1);
                keep.push(self.alloc(n * 8, 0)); // row indices
                keep.push(self.alloc(n * d * BF16, 0)); // gathered input
                keep.push(self.alloc(4 * n * d * BF16, 0)); // up
                keep.push(self.alloc(4 * n * d * BF16, 0)); // gelu
                let y = self.alloc(n * d * BF16, 0);
                let weighted = self.alloc(n * d * BF16, 0);
                self.free(y);
                self.free(weighted);
            }
            keep.push(out);
            saved.push(keep);
        }
        let loss = self.alloc(512, 0);
        let mut grads = Vec::new();
        for keep in saved.into_iter().rev() {
            let gx = self.alloc(tokens * d * BF16, 0);
            for _ in 0..experts {
                grads.push(self.alloc(4 * d * d * F32, 0));
                grads.push(self.alloc(4 * d * d * F32, 0));
            }
            for a in keep.into_iter().rev() {
                let size = self.live[&a].0;
                let g = self.alloc(size, 0);
                self.free(g);
                self.free(a);
            }
            self.free(gx);
        }
        self.free(loss);
        self.free(x);
        for &g in &grads {
            let size = self.live[&g].0;
            let t = self.alloc(size, 0);
            self.free(t);
        }
        self.free_all(grads);
    }

    /// A serving loop of `iterations`: a request arrives with probability 1/3 per iteration
    /// while fewer than `in_flight` run (prefill: per-layer K and V caches of its prompt);
    /// every iteration each request decodes one token (each cache replaced by a one-token
    /// longer copy, with temporaries); a request leaves after its drawn length, freeing its
    /// caches.
    fn serve(&mut self, layers: u64, d: u64, in_flight: u64, iterations: usize) {
        let per_token = d * BF16;
        struct Req {
            caches: Vec<u64>,
            len: u64,
            left: u64,
        }
        let mut active: Vec<Req> = Vec::new();
        for _ in 0..iterations {
            if (active.len() as u64) < in_flight && (active.is_empty() || self.rng.below(3) == 0) {
                let prompt = 32 + self.rng.below(1024);
                let caches = (0..2 * layers)
                    .map(|_| self.alloc(prompt * per_token, 0))
                    .collect();
                let scores = self.alloc((d / 64) * prompt * prompt * BF16, 0);
                self.free(scores);
                active.push(Req {
                    caches,
                    len: prompt,
                    left: 8 + self.rng.below(256),
                });
            }
            for r in active.iter_mut() {
                r.len += 1;
                let mut x = self.alloc(d * BF16, 0);
                for l in 0..layers as usize {
                    let qkv = self.alloc(3 * d * BF16, 0);
                    let k = self.alloc(r.len * per_token, 0);
                    let v = self.alloc(r.len * per_token, 0);
                    let attn = self.alloc(d * BF16, 0);
                    self.free(qkv);
                    let mlp = self.alloc(4 * d * BF16, 0);
                    let out = self.alloc(d * BF16, 0);
                    self.free(mlp);
                    self.free(attn);
                    self.free(x);
                    x = out;
                    let (old_k, old_v) = (r.caches[2 * l], r.caches[2 * l + 1]);
                    self.free(old_k);
                    self.free(old_v);
                    r.caches[2 * l] = k;
                    r.caches[2 * l + 1] = v;
                }
                let logits = self.alloc(32_000 * F32, 0);
                self.free(logits);
                self.free(x);
                r.left -= 1;
            }
            let (done, still): (Vec<Req>, Vec<Req>) = active.drain(..).partition(|r| r.left == 0);
            active = still;
            for r in done {
                self.free_all(r.caches);
            }
        }
        for r in active {
            self.free_all(r.caches);
        }
    }

    /// Append the events of `parts` interleaved in chunks of a few events.
    /// Append `parts` one after the other.
    fn in_turn(&mut self, parts: Vec<Vec<TraceEvent>>) {
        for e in parts.iter().flatten() {
            self.time += US_PER_EVENT;
            self.events.push(TraceEvent {
                time_us: self.time,
                ..*e
            });
        }
    }

    fn interleave(&mut self, parts: Vec<Vec<TraceEvent>>) {
        let mut cursors = vec![0usize; parts.len()];
        loop {
            let mut progressed = false;
            for (p, part) in parts.iter().enumerate() {
                let take = 1 + self.rng.below(8) as usize;
                let end = (cursors[p] + take).min(part.len());
                for e in &part[cursors[p]..end] {
                    self.time += US_PER_EVENT;
                    self.events.push(TraceEvent {
                        time_us: self.time,
                        ..*e
                    });
                }
                progressed |= end > cursors[p];
                cursors[p] = end;
            }
            if !progressed {
                break;
            }
        }
    }
}
