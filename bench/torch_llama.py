"""The PyTorch peer for bench/train_small.sh: the bench-small Llama written plainly in
torch (the same architecture am trains: RMSNorm, rotate-half RoPE, grouped-query causal
attention, SwiGLU, untied head, cross-entropy, AdamW with clipping), trained on random
tokens in fp32. Prints one line: tokens/s (median over the timed steps)."""
import argparse, math, statistics, sys, time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--warmup", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(1)
V, C, L, H, KV, I, T, B = 8192, 512, 4, 8, 4, 1408, 256, 4
D = C // H


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(C)), torch.nn.Parameter(torch.ones(C))
        self.q, self.k = torch.nn.Linear(C, H * D, bias=False), torch.nn.Linear(C, KV * D, bias=False)
        self.v, self.o = torch.nn.Linear(C, KV * D, bias=False), torch.nn.Linear(H * D, C, bias=False)
        self.g, self.u = torch.nn.Linear(C, I, bias=False), torch.nn.Linear(C, I, bias=False)
        self.d = torch.nn.Linear(I, C, bias=False)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def rope(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, C)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(L))
        self.norm = torch.nn.Parameter(torch.ones(C))
        self.head = torch.nn.Linear(C, V, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        f = torch.outer(torch.arange(T).float(), inv)
        f = torch.cat((f, f), -1)
        self.register_buffer("cos", f.cos()[None, None])
        self.register_buffer("sin", f.sin()[None, None])
        self.register_buffer("mask", torch.full((T, T), float("-inf")).triu(1))

    def forward(self, ids, targets):
        x = self.emb(ids)
        for b in self.blocks:
            h = rms(x, b.n1)
            q = b.q(h).view(B, T, H, D).transpose(1, 2)
            k = b.k(h).view(B, T, KV, D).transpose(1, 2)
            v = b.v(h).view(B, T, KV, D).transpose(1, 2)
            q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
            k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + self.mask, -1) @ v
            x = x + b.o(att.transpose(1, 2).reshape(B, T, C))
            h = rms(x, b.n2)
            x = x + b.d(F.silu(b.g(h)) * b.u(h))
        logits = self.head(rms(x, self.norm))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


model = Llama()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
times = []
for step in range(a.steps):
    ids = torch.randint(0, V, (B, T + 1))
    t0 = time.perf_counter()
    loss = model(ids[:, :-1], ids[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
print(f"{B * T / statistics.median(times[a.warmup:]):.1f}")
