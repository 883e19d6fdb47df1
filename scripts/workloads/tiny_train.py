"""A tiny MLP trained for three steps: a small, real PyTorch allocation trace."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(64 + 32 * step, 256, device="cuda")
    y = torch.randint(0, 10, (64 + 32 * step,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("loss", float(loss))
