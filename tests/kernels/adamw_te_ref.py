#!/usr/bin/env python3
"""adamw_te_ref.py - reference steps of Transformer Engine's FusedAdam for test_adamw.

A numpy float32 transcription of TransformerEngine's transformer_engine/common/multi_tensor/
adam.cu (read at TransformerEngine d0067d0; AdamFunctor / AdamFunctorMaster: MATH_T float, one rounding per op in the source's
order) and of multi_tensor_adam_cuda's bias corrections (1 - std::pow(beta, step), in double,
rounded to float). TE itself needs a GPU; this runs its arithmetic on the CPU, without the fma
contraction nvcc may add (--fmad=true is TE's default build, its choices the compiler's).

Each record (little endian), for tests/kernels/test_adamw.c's test_adamw_te_ref:
  int64 n, step, te (kernels.h's AM_TE_* bits), dtypes (1: param bf16, 2: m bf16, 4: v bf16)
  float32 lr, beta1, beta2, eps, weight_decay, gs (the clipping factor, 1: none)
  float32 grad[n], then param, m, v before the step and after it (bf16 values widened)

  python3 tests/kernels/adamw_te_ref.py /tmp/adamw_te.bin     (numpy: the golden venv)
  AM_ADAMW_TE_REF=/tmp/adamw_te.bin tests/kernels/test_adamw
"""
import math
import struct
import sys

import numpy as np

TE_ADAM, TE_L2, TE_NO_BIAS_CORR, TE_GRAD_BF16 = 1, 2, 4, 8
f32 = np.float32


def bf16(x):
    """x (float32 array) rounded to bf16, nearest even (static_cast<bf16>, torch's copy_), widened"""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    r = np.where(nan, (u | 0x400000) & 0xFFFF0000, r)
    return r.astype(np.uint32).view(np.float32)


def te_step(p, g, m, v, lr, beta1, beta2, eps, decay, step, te, gs):
    """one FusedAdam step in float32, as adam.cu's functor computes it"""
    lr, beta1, beta2, eps, decay, gs = (f32(x) for x in (lr, beta1, beta2, eps, decay, gs))
    if te & TE_NO_BIAS_CORR:
        bc1 = bc2 = f32(1.0)
    else:  # std::pow(float, int) is pow(double, double)
        bc1 = f32(1.0 - math.pow(float(beta1), step))
        bc2 = f32(1.0 - math.pow(float(beta2), step))
    g = g.astype(np.float32)
    g = bf16(bf16(g) * gs) if te & TE_GRAD_BF16 else g * gs  # the model's gradient, clipped
    if te & TE_L2:
        g = g + (decay * p)
    m = beta1 * m + (f32(1) - beta1) * g
    v = beta2 * v + (f32(1) - beta2) * g * g
    m_hat = m / bc1
    v_hat = v / bc2
    denom = np.sqrt(v_hat) + eps
    update = m_hat / denom if te & TE_L2 else (m_hat / denom) + (decay * p)
    p = p - (lr * update)
    return p, m, v


def main():
    rng = np.random.default_rng(1234)
    out = open(sys.argv[1], "wb")
    hps = [  # lr, beta1, beta2, eps, weight_decay
        (1e-5, 0.9, 0.999, 1e-8, 0.0),
        (2e-4, 0.9, 0.95, 1e-8, 0.1),
        (6e-4, 0.9, 0.95, 1e-6, 0.01),
        (1e-3, 0.5, 0.99, 1e-3, 0.3),
    ]
    recs = 0
    for dt in range(8):
        for hi, (lr, b1, b2, eps, wd) in enumerate(hps):
            for te in (TE_ADAM, TE_ADAM | TE_L2, TE_ADAM | TE_NO_BIAS_CORR, TE_ADAM | TE_GRAD_BF16,
                       TE_ADAM | TE_L2 | TE_GRAD_BF16):
                for gs in (1.0, 0.37):
                    n = int(rng.choice([37, 1000, 16385]))
                    step = int(rng.choice([1, 2, 7, 150, 2000]))
                    scale = 10.0 ** rng.uniform(-7, 0, n)
                    p = rng.standard_normal(n).astype(np.float32) * f32(0.05)
                    g = (rng.standard_normal(n) * scale).astype(np.float32)
                    m = (rng.standard_normal(n) * scale * 0.3).astype(np.float32)
                    v = (np.abs(rng.standard_normal(n)) * scale * scale).astype(np.float32)
                    if dt & 1:
                        p = bf16(p)
                    if dt & 2:
                        m = bf16(m)
                    if dt & 4:
                        v = bf16(v)
                    p1, m1, v1 = te_step(p, g, m, v, lr, b1, b2, eps, wd, step, te, f32(gs))
                    p1 = bf16(p1) if dt & 1 else p1
                    m1 = bf16(m1) if dt & 2 else m1
                    v1 = bf16(v1) if dt & 4 else v1
                    out.write(struct.pack("<4q", n, step, te, dt))
                    out.write(np.array([lr, b1, b2, eps, wd, gs], dtype=np.float32).tobytes())
                    for a in (g, p, m, v, p1, m1, v1):
                        out.write(np.ascontiguousarray(a, dtype=np.float32).tobytes())
                    recs += 1
    out.close()
    print(f"{recs} records")


if __name__ == "__main__":
    main()
