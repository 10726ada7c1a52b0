"""The PyTorch peer for bench/deepseek_small.sh: the bench's small DeepSeek-V3-style model as
transformers' DeepseekV3ForCausalLM (its default implementations: sdpa attention and grouped_mm
experts), trained in fp32 with AdamW and clipping on the bench's tokens (ids.txt: one document
a line, cut into sequences in order). Prints one line: tokens/s by the wall clock and by the
process's CPU time (medians over the timed steps).
  python torch_deepseek.py --ids ids.txt --threads 1 [--steps 12 --warmup 2] [--experts eager]
      [--routed 64 --topk 6 --groups 8 --topk-group 4 --moe-width 128 --shared 2] [--adamw default]"""
import argparse
import statistics
import time

import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--ids", required=True)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--experts", default=None, help="transformers' experts_implementation (default: its own choice)")
# the MoE layers' experts (bench/deepseek_small.sh's EXPERTS); the defaults are its "fine" layout
p.add_argument("--routed", type=int, default=64)
p.add_argument("--topk", type=int, default=6)
p.add_argument("--groups", type=int, default=8)
p.add_argument("--topk-group", type=int, default=4)
p.add_argument("--moe-width", type=int, default=128)
p.add_argument("--shared", type=int, default=2)
p.add_argument("--adamw", choices=["fused", "foreach", "default"], default="fused",
               help="torch.optim.AdamW's implementation: fused=True (its fastest on the CPU), "
               "foreach=True, or its own choice (one tensor at a time on the CPU)")
p.add_argument("--describe", action="store_true", help="print the implementations chosen and exit")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(1)
transformers.logging.set_verbosity_error()
T, B = a.seq, a.batch
# the model of bench/deepseek_small.sh's recipe, key for key
cfg = DeepseekV3Config(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, rope_interleave=True,
                       n_routed_experts=a.routed, num_experts_per_tok=a.topk, n_group=a.groups,
                       topk_group=a.topk_group, moe_intermediate_size=a.moe_width,
                       n_shared_experts=a.shared, routed_scaling_factor=2.5,
                       first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=T,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)
kw = {} if a.experts is None else {"experts_implementation": a.experts}
model = DeepseekV3ForCausalLM._from_config(cfg, torch_dtype=torch.float32, **kw)
if a.describe:
    n = sum(q.numel() for q in model.parameters())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: attention "
          f"{model.config._attn_implementation}, experts {model.config._experts_implementation}, AdamW {a.adamw}, "
          f"{n} parameters")
    raise SystemExit
impl = {} if a.adamw == "default" else {a.adamw: True}
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **impl)
toks = [int(t) for line in open(a.ids) for t in line.split()]
per = T * B
times, cpu = [], []
for step in range(a.steps):
    off = (step * per) % (len(toks) - per)
    ids = torch.tensor(toks[off : off + per], dtype=torch.long).view(B, T)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
print(f"{B * T / statistics.median(times):.1f} {B * T / statistics.median(cpu):.1f}")
