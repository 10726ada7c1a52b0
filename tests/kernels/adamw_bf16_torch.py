#!/usr/bin/env python3
"""adamw_bf16_torch.py - torch.optim.AdamW's own steps on bf16 parameters, for
tests/kernels/test_adamw.c's test_adamw_bf16_torch (which skips without the file):

    python3 tests/kernels/adamw_bf16_torch.py /tmp/adamw_bf16.bin   # torch 2.15 (tests/golden/requirements.txt)
    AM_ADAMW_TORCH_REF=/tmp/adamw_bf16.bin tests/kernels/test_adamw

What AutoModel runs with bf16 storage: the fp32-reduced gradient cast to bf16 (FSDP2), multiplied
by the clipping factor when clipping applies, then AdamW(foreach=False) on the CPU, whose moments
are bf16 like the parameter. Hyper-parameters are fp32 values (am's arguments), both lerp branches
(beta1 > 0.5 and <= 0.5), tensors of a few elements to several of the kernel's blocks, 1 and 2
threads; at step 3 the moments and the step count are set to random values (a long run's state).

Each record, little-endian: int64 n, int64 step, float32 lr, beta1, beta2, eps, weight_decay,
clipping factor; the fp32 gradient (n float32); then the bf16 bits (n uint16 each) of param,
exp_avg, exp_avg_sq before the step and after it.
"""
import struct
import sys

import numpy as np
import torch

CONFIGS = [  # lr, beta1, beta2, eps, weight_decay, clipping factor
    (1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0),
    (3e-4, 0.9, 0.95, 1e-8, 0.1, 0.37),
    (1e-2, 0.3, 0.99, 1e-6, 0.0, 1.0),
    (5e-3, 0.5, 0.98, 1e-5, 0.05, 0.8),
    (2e-5, 0.0, 0.9, 1e-8, 0.1, 1.0),
    (0.1, 0.95, 0.999, 1e-3, 0.3, 0.01),
]
SIZES = [37, 1000, 100003]


def bits(t):
    return t.contiguous().view(torch.int16).numpy().astype(np.uint16).tobytes()


def main(path):
    rng = np.random.default_rng(1)
    f32 = lambda x: float(np.float32(x))
    records = 0
    with open(path, "wb") as out:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for cfg in CONFIGS:
                lr, b1, b2, eps, wd, gs = map(f32, cfg)
                for n in SIZES:
                    p = torch.nn.Parameter(torch.tensor(rng.uniform(-1, 1, n), dtype=torch.float32).to(torch.bfloat16))
                    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False, fused=False)
                    for step in range(1, 6):
                        g32 = torch.tensor(rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 0, n), dtype=torch.float32)
                        st = opt.state.get(p)
                        if step == 3:
                            st["exp_avg"].copy_(torch.tensor(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, -1, n)))
                            st["exp_avg_sq"].copy_(torch.tensor(10.0 ** rng.uniform(-14, -2, n)))
                            st["step"].fill_(float(rng.integers(2, 2000)))
                        before = [p.detach().clone()] + (
                            [st["exp_avg"].clone(), st["exp_avg_sq"].clone()] if st else
                            [torch.zeros(n, dtype=torch.bfloat16)] * 2)
                        t = int(st["step"].item()) + 1 if st else 1
                        g = g32.to(torch.bfloat16)  # FSDP2's cast to the parameter's dtype
                        if gs != 1.0:
                            g.mul_(gs)  # the clipping: bf16 gradients times the factor
                        p.grad = g
                        opt.step()
                        st = opt.state[p]
                        assert int(st["step"].item()) == t and st["exp_avg"].dtype == torch.bfloat16
                        out.write(struct.pack("<qq6f", n, t, lr, b1, b2, eps, wd, gs))
                        out.write(g32.numpy().astype("<f4").tobytes())
                        for x in before + [p.detach(), st["exp_avg"], st["exp_avg_sq"]]:
                            out.write(bits(x))
                        records += 1
    print(f"{path}: {records} steps")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: adamw_bf16_torch.py OUT.bin")
    main(sys.argv[1])
