//! Synthetic allocation traces of the workload kinds that fragment caching allocators, built
//! deterministically from a seed with the tensor sizes real models allocate:
//!
//! - [`Kind::VariableSeqLen`]: transformer training whose sequence length changes every step
//!   (dynamic padding), so activation sizes never repeat;
//! - [`Kind::KvCacheDecode`]: autoregressive decoding whose per-layer K and V caches grow by
//!   concatenation (a new, one-token-larger tensor every step, the old one freed);
//! - [`Kind::MixedTinyHuge`]: many short-lived tiny tensors next to a few huge, long-lived ones;
//! - [`Kind::MultiStream`]: three streams each running its own training loop, interleaved;
//! - [`Kind::ConvTraining`]: convnet training with fixed shapes (a ResNet-like ladder of sizes).
//!
//! Every trace is JSON Lines compatible ([`TraceEvent`]): `alloc` / `free_completed` with unique
//! addresses, no `segment_*` events (there is no recording allocator).

use super::{Action, TraceEvent};
use crate::workload::SplitMix;
use rustc_hash::FxHashMap;

/// The synthetic workload kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// transformer training, sequence length drawn per step
    VariableSeqLen,
    /// decoding with KV caches grown by concatenation
    KvCacheDecode,
    /// tiny short-lived tensors next to huge long-lived ones
    MixedTinyHuge,
    /// three streams, each its own training loop
    MultiStream,
    /// convnet training with fixed shapes
    ConvTraining,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 5] = [
        Kind::VariableSeqLen,
        Kind::KvCacheDecode,
        Kind::MixedTinyHuge,
        Kind::MultiStream,
        Kind::ConvTraining,
    ];

    /// The kind's name (as `gpumem synth` takes it).
    pub fn name(self) -> &'static str {
        match self {
            Kind::VariableSeqLen => "variable_seq_len",
            Kind::KvCacheDecode => "kv_cache_decode",
            Kind::MixedTinyHuge => "mixed_tiny_huge",
            Kind::MultiStream => "multi_stream",
            Kind::ConvTraining => "conv_training",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// A trace of this kind; `scale` multiplies the number of steps (1 = a few seconds of
    /// a real run, tens of thousands of events).
    pub fn generate(self, seed: u64, scale: usize) -> Vec<TraceEvent> {
        let mut t = Builder::new(seed);
        let scale = scale.max(1);
        match self {
            Kind::VariableSeqLen => {
                let w = t.weights(12, 1024, 0);
                for _ in 0..6 * scale {
                    let seq = 64 * (2 + t.rng.below(31)); // 128 .. 2048 tokens
                    t.transformer_step(12, 1024, 16, 8, seq, 0);
                }
                t.free_all(w);
            }
            Kind::KvCacheDecode => {
                let w = t.weights(24, 1024, 0);
                for _ in 0..3 * scale {
                    let prompt = 128 + t.rng.below(768);
                    let new = 96 + t.rng.below(160);
                    let batch = 4 + t.rng.below(5);
                    t.decode(24, 1024, 16, batch, prompt, new);
                }
                t.free_all(w);
            }
            Kind::MixedTinyHuge => t.mixed(12_000 * scale),
            Kind::MultiStream => {
                let w = t.weights(6, 768, 0);
                for _ in 0..4 * scale {
                    // the three loops' events interleave in chunks, as streams' host threads do
                    let mut parts: Vec<Vec<TraceEvent>> = Vec::new();
                    for s in 1..=3u64 {
                        let mut sub = Builder::with_addr(t.rng.next_u64(), t.next_addr);
                        let seq = 64 * (4 + sub.rng.below(12));
                        sub.transformer_step(6, 768, 12, 4, seq, s);
                        t.next_addr = sub.next_addr;
                        parts.push(sub.events);
                    }
                    t.interleave(parts);
                }
                t.free_all(w);
            }
            Kind::ConvTraining => {
                for _ in 0..5 * scale {
                    t.conv_step(32);
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
        self.time += 1;
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
        self.time += 1;
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
        // a few small bookkeeping tensors
        for _ in 0..8 {
            let size = 4 << self.rng.below(12);
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

    /// A ResNet-like step: a ladder of activation sizes saved through the forward pass and
    /// freed in reverse, with workspace temporaries.
    fn conv_step(&mut self, batch: u64) {
        let mut saved = Vec::new();
        let stages = [
            (64u64, 112u64, 1),
            (256, 56, 3),
            (512, 28, 4),
            (1024, 14, 6),
            (2048, 7, 3),
        ];
        for &(c, hw, blocks) in &stages {
            for _ in 0..blocks {
                for k in [c / 4, c / 4, c] {
                    let ws = self.alloc(8 << 20, 0); // convolution workspace
                    saved.push(self.alloc(batch * k * hw * hw * BF16, 0));
                    saved.push(self.alloc(batch * k * hw * hw * BF16, 0)); // batch norm
                    self.free(ws);
                }
            }
        }
        let mut grads = Vec::new();
        for a in saved.into_iter().rev() {
            let size = self.live[&a].0;
            let g = self.alloc(size, 0);
            if grads.len() < 160 && self.rng.below(2) == 0 {
                grads.push(self.alloc((size / batch).max(512), 0));
            }
            self.free(g);
            self.free(a);
        }
        self.free_all(grads);
    }

    /// Append the events of `parts` interleaved in chunks of a few events.
    fn interleave(&mut self, parts: Vec<Vec<TraceEvent>>) {
        let mut cursors = vec![0usize; parts.len()];
        loop {
            let mut progressed = false;
            for (p, part) in parts.iter().enumerate() {
                let take = 1 + self.rng.below(8) as usize;
                let end = (cursors[p] + take).min(part.len());
                for e in &part[cursors[p]..end] {
                    self.time += 1;
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
