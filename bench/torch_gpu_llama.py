"""The PyTorch peer for bench/gpu_llama.sh: transformers' LlamaForCausalLM in the shape of
Llama 3.2 1B or Llama 3.1 8B (fewer layers when asked), on one GPU, trained on random tokens
under the mixed precision am runs (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32) on one rank: fp32 master weights and AdamW state, a bf16 copy of the
model for forward and backward, the bf16 gradients cast to fp32 onto the masters, clipping to
norm 1, AdamW (fused)), SDPA attention, eager or torch.compile. Prints one line: tokens/s (the
median over the timed steps, each step timed with the device synchronised).
  python torch_gpu_llama.py --shape 1b --layers 16 --seq 2048 --batch 4 [--compile]"""
import argparse
import copy
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {  # Hugging Face config.json of meta-llama/Llama-3.2-1B and meta-llama/Llama-3.1-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)),
}

p = argparse.ArgumentParser()
p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
p.add_argument("--layers", type=int, default=0)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--compile", action="store_true")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
a = p.parse_args()
torch.manual_seed(1)
transformers.logging.set_verbosity_error()
V, T, B = 128256, a.seq, a.batch
shape = dict(SHAPES[a.shape])
if a.layers:
    shape["num_hidden_layers"] = a.layers
cfg = LlamaConfig(vocab_size=V, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                  attn_implementation="sdpa", **shape)
dev = torch.device("cuda")
master = LlamaForCausalLM(cfg).to(dev)
work = copy.deepcopy(master)
for q in work.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32, as in FSDP2
    q.data = q.data.to(torch.bfloat16)
fwd = torch.compile(work) if a.compile else work
opt = torch.optim.AdamW(master.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
mp, wp = list(master.parameters()), list(work.parameters())
times = []
for step in range(a.steps):
    ids = torch.randint(0, V, (B, T), device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        torch._foreach_copy_(wp, mp)
    loss = fwd(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    work.zero_grad(set_to_none=True)
    loss.backward()
    for w, m in zip(wp, mp):
        m.grad = w.grad.float()
    torch.nn.utils.clip_grad_norm_(mp, 1.0, foreach=True)
    opt.step()
    torch.cuda.synchronize()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
print(f"{B * T / statistics.median(times):.1f}")
