"""Autoregressive decoding with a KV cache grown by concatenation (torch.cat per token).

A 16-layer decoder (d=1024, 16 heads, bf16); each request: a prompt of random length, then
new tokens one at a time, each layer's K and V caches replaced by one-token-longer tensors.
"""
import sys
import torch

torch.manual_seed(0)
L, D, H = 16, 1024, 16
dev = "cuda"
w = [
    {
        "qkv": torch.randn(D, 3 * D, device=dev, dtype=torch.bfloat16) * 0.02,
        "o": torch.randn(D, D, device=dev, dtype=torch.bfloat16) * 0.02,
        "up": torch.randn(D, 4 * D, device=dev, dtype=torch.bfloat16) * 0.02,
        "down": torch.randn(4 * D, D, device=dev, dtype=torch.bfloat16) * 0.02,
    }
    for _ in range(L)
]
emb = torch.randn(32000, D, device=dev, dtype=torch.bfloat16) * 0.02
requests = int(sys.argv[1]) if len(sys.argv) > 1 else 4
g = torch.Generator().manual_seed(1)


def layer(p, x, cache):
    b, t, _ = x.shape
    q, k, v = (x @ p["qkv"]).split(D, dim=-1)
    k = k.view(b, t, H, D // H).transpose(1, 2)
    v = v.view(b, t, H, D // H).transpose(1, 2)
    q = q.view(b, t, H, D // H).transpose(1, 2)
    if cache is not None:
        k = torch.cat([cache[0], k], dim=2)
        v = torch.cat([cache[1], v], dim=2)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
    x = x + a.transpose(1, 2).reshape(b, t, D) @ p["o"]
    x = x + torch.nn.functional.gelu(x @ p["up"]) @ p["down"]
    return x, (k, v)


with torch.no_grad():
    for r in range(requests):
        batch = int(torch.randint(4, 9, (1,), generator=g))
        prompt = int(torch.randint(128, 896, (1,), generator=g))
        new = int(torch.randint(96, 256, (1,), generator=g))
        tok = torch.randint(0, 32000, (batch, prompt), device=dev)
        x = emb[tok]
        caches = []
        for p in w:
            x, c = layer(p, x, None)
            caches.append(c)
        nxt = (x[:, -1] @ emb.T).argmax(-1)
        for _ in range(new):
            x = emb[nxt][:, None]
            for i, p in enumerate(w):
                x, caches[i] = layer(p, x, caches[i])
            nxt = (x[:, -1] @ emb.T).float().argmax(-1)
        del caches, x
torch.cuda.synchronize()
print("decoded", requests, "requests")
