"""Transformer training with a different sequence length every step (dynamic padding)."""
import sys
import torch

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, norm_first=True)
model = torch.nn.Sequential(
    torch.nn.Embedding(32000, 1024),
    torch.nn.TransformerEncoder(layer, 8),
    torch.nn.Linear(1024, 32000),
).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(2)
for step in range(steps):
    seq = 64 * int(torch.randint(2, 17, (1,), generator=g))
    x = torch.randint(0, 32000, (8, seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 32000).float(), x.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print("loss", float(loss))
