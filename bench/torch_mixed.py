"""The PyTorch peer for bench/mixed_small.sh: bench-small (DESIGN.md) as transformers'
LlamaForCausalLM, trained on random tokens in fp32, or with FSDP2's mixed-precision policy
as am runs it (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on one rank:
fp32 master weights and AdamW state, a bf16 copy of the model for forward and backward, the
bf16 gradients cast to fp32 onto the masters, clipping, AdamW). Prints one line: tokens/s
(median over the timed steps).
  python torch_mixed.py --threads 2 --policy bf16 [--attn sdpa|eager] [--compile] [--adamw default]"""
import argparse
import copy
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
p.add_argument("--policy", choices=["fp32", "bf16"], default="fp32")
p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
p.add_argument("--compile", action="store_true")
p.add_argument("--adamw", choices=["fused", "foreach", "default"], default="fused",
               help="torch.optim.AdamW's implementation: fused=True (its fastest on the CPU), "
               "foreach=True, or its own choice (one tensor at a time on the CPU)")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--warmup", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(1)
transformers.logging.set_verbosity_error()
V, T, B = 8192, 256, 4
cfg = LlamaConfig(vocab_size=V, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=T, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attn_implementation=a.attn)
master = LlamaForCausalLM(cfg)
work = master
if a.policy == "bf16":
    work = copy.deepcopy(master)
    for q in work.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32, as in FSDP2
        q.data = q.data.to(torch.bfloat16)
fwd = torch.compile(work) if a.compile else work
impl = {} if a.adamw == "default" else {a.adamw: True}
opt = torch.optim.AdamW(master.parameters(), lr=1e-4, weight_decay=0.01, **impl)
times = []
for step in range(a.steps):
    ids = torch.randint(0, V, (B, T))
    t0 = time.perf_counter()
    if work is not master:
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
    loss = fwd(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    work.zero_grad(set_to_none=True)
    loss.backward()
    if work is not master:
        for w, m in zip(work.parameters(), master.parameters()):
            m.grad = w.grad.float()
    torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
    opt.step()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
print(f"{B * T / statistics.median(times):.1f}")
