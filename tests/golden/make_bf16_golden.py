#!/usr/bin/env python3
"""bf16 mixed-precision goldens: the golden models trained as FSDP2's
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) trains them, on one rank.

For each case (a model directory written by make_golden.py), from the saved initial weights:
  * fp32 master weights and fp32 AdamW state (the golden's AdamW but at lr 1e-3: betas
    (0.9, 0.95), eps 1e-8, weight decay 0.1, foreach=False), clipping at 1.0. The golden's lr
    1e-2 makes these tiny models' trajectories chaotic (its losses rise again after step 2 in
    some cases): there two bf16 implementations, rounding in different places, drift apart
    more than either drifts from fp32, and no tolerance would tell a bug from chance;
  * every step, the masters are cast to a bf16 copy of the model (parameters only: buffers
    such as the rotary inv_freq stay fp32, as FSDP2 casts parameters only); forward and
    backward run in bf16 with transformers' eager attention (its loss upcasts the logits to
    fp32); the bf16 gradients are cast to fp32 (the reduce dtype) onto the masters, clipped,
    and AdamW steps the masters.
The same 5 steps in fp32 (the golden's own "clip" series, re-run here) give the reference that
the C test's tolerances are derived from: an implementation of the same bf16 policy must be
as close to this one as this one is to fp32 (tests/golden/README.md, "bf16").

bf16 storage (the cases of STORE): model.torch_dtype bfloat16 with torch.optim.AdamW under FSDP2,
as NeMo AutoModel trains it (its guide docs/guides/mixed-precision-training.mdx, "Risky Pattern:
torch AdamW with bf16 Model Storage"). The initial weights are loaded as bf16 parameters (every
parameter: transformers' from_pretrained would keep the DeepSeekMoE routers' gate.weight fp32,
AutoModel's own Gate holds it in the model's dtype, as am holds every parameter in one; buffers
as transformers keeps them, fp32); forward and backward in bf16 with eager attention, the loss
on logits upcast to fp32; the bf16 gradients (FSDP2 reduces in fp32 and casts back to bf16: on
one rank the same bf16 values) clipped as AutoModel's clip_grad_norm does it (clip_automodel:
its _clip_grad_norm_impl for one rank); torch.optim.AdamW(foreach=False) steps the bf16
parameters, its exp_avg and exp_avg_sq bf16 (torch makes the state in the parameter's dtype).

Packed sequences (llama_packed): the same policy on the pack of golden.safetensors, given to the
model as make_golden.py gives it (position_ids restarting in each document, the block-diagonal
causal mask as a 4-d additive mask, 0 or the bf16 minimum), the loss the mean cross-entropy over
the pack's targets with the logits upcast to fp32 first, as transformers' own loss does.

Writes models/<case>/bf16.safetensors:
  losses_bf16 [5], grad_norms_bf16 [5]   the bf16 run (norms before clipping, of fp32 grads)
  losses_fp32 [5], grad_norms_fp32 [5]   the same in fp32
  final_bf16.<name>, final_fp32.<name>   every parameter after 5 steps (checkpoint names; gpt-oss's
                                         fused experts under am's per-expert names, as make_golden.py)
and for the cases of STORE, the bf16-storage run:
  losses_bf16store [5], grad_norms_bf16store [5]  (the norms before clipping, clip_automodel's)
  final_bf16store.<name>                 every parameter after 5 steps, BF16 (its stored values)
and for the DeepSeekMoE cases (SECOND) the bf16 run again with transformers' default sdpa
attention and grouped_mm experts:
  losses_bf16_sdpa [5], grad_norms_bf16_sdpa [5]
  final_bf16_sdpa_distance [1]           the L2 distance of its final weights to the bf16 run's
Deterministic (byte-identical from run to run); run with the venv of tests/golden/README.md:
  /tmp/goldenv/bin/python tests/golden/make_bf16_golden.py [--case NAME ...]
"""

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as G  # noqa: E402

# every case but mixtral_tiny: am's bf16 loss there lands 1.53e-4 from PyTorch's at the first
# step, 0.99 of test_golden's tolerance (twice PyTorch's own bf16-to-fp32 distance, 2.8e-5 by
# chance on that batch, plus 1e-4), too close to tell a change from chance; its MoE arithmetic
# is covered in bf16 by qwen3_moe_tiny; but deepseek_v3_qproj: in bf16 a token of layer 1 sits
# within bf16's rounding of a routing tie (PyTorch's sdpa run and am send it to another expert
# than PyTorch's eager run at the first step) and the trajectories part as chaotically as lr 1e-2's
# in fp32 (PyTorch's own bf16 losses 3.5e-3 from fp32's by step 5, grad norms 7.5%), so no
# tolerance would tell a bug from chance; its q_proj is one plain linear layer, and MLA and
# DeepSeekMoE are covered in bf16 by deepseek_v3_tiny and deepseek_v3_yarn; and but Gemma's,
# which have fp32 goldens only
DENSE = [c for c in G.CASES
         if c not in ("mixtral_tiny", "deepseek_v3_qproj") and G.CASES[c]["arch"] not in G.GEMMA_ARCHS]
# The DeepSeekMoE cases (glm4_moe, deepseek_v3) also carry PyTorch's second bf16 implementation
# of the same policy: transformers' defaults, sdpa attention and grouped_mm experts (make_golden's
# fast=True), from the same weights. How far it lands from the eager run measures directly how
# far two implementations of one bf16 policy land apart (tests/golden/README.md, "bf16"): a
# token near a routing tie may go to another expert in one of them (glm4_moe_tiny's layer 2 in
# the sdpa run), which one run's |bf16 - fp32| does not show.
SECOND = [c for c in DENSE if G.CASES[c]["arch"] in G.GLM_ARCHS]
# The cases with the bf16-storage run (model.torch_dtype bfloat16, bf16 AdamW state; the
# docstring): the basic Llama, a Qwen3 MoE, DeepSeek-V3 (MLA, DeepSeekMoE) and gpt-oss. The
# others' files were written before it and are kept as they are (README.md, "Regenerating").
STORE = ["llama_gqa", "qwen3_moe_tiny", "deepseek_v3_tiny", "gpt_oss_tiny"]


ADAMW = dict(G.ADAMW, lr=1e-3)


def loss_of(model, ids):
    """The training loss: transformers' own (labels = input ids, shifted inside), or for a pack
    (a dict from make_golden.make_pack) the mean over its targets of the cross-entropy of the
    logits upcast to fp32, as transformers' loss upcasts them."""
    if not isinstance(ids, dict):
        return model(input_ids=ids, labels=ids).loss
    logits = model(**G.model_inputs(ids, model.dtype)).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids["targets"].reshape(-1), ignore_index=-100)


def train(master, ids, bf16):
    """5 clipped AdamW steps of `master` (fp32); bf16: forward/backward in a bf16 copy."""
    opt = torch.optim.AdamW(master.parameters(), foreach=False, **ADAMW)
    work = copy.deepcopy(master) if bf16 else master
    if bf16:
        with torch.no_grad():
            for p in work.parameters():
                p.data = p.data.to(torch.bfloat16)
    losses, norms = [], []
    for _ in range(G.ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        work.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for pw, pm in zip(work.parameters(), master.parameters()):
                    pw.copy_(pm)  # round to nearest even
        loss = loss_of(work, ids)
        loss.backward()
        if bf16:
            for pw, pm in zip(work.parameters(), master.parameters()):
                pm.grad = pw.grad.float()
        params = [p for p in master.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, G.CLIP_MAX_NORM)))
        losses.append(float(loss.detach().float()))
        opt.step()
    return losses, norms


@torch.no_grad()
def clip_automodel(params, max_norm):
    """AutoModel's clip_grad_norm (nemo_automodel/components/training/utils.py, _clip_grad_norm_impl
    with norm_type 2) for one rank, where every parameter is in one sharding group: the largest
    |g| in float64 as the scale; each gradient's |g| / scale in the gradient's dtype (bf16: a bf16
    tensor divided by a 0-d float64 tensor stays bf16), squared in that dtype, summed in float64;
    the norm scale * sqrt(sum), then _combine_norms over the one group (max * sqrt(sum of
    (n / max)^2)); then torch.nn.utils.clip_grads_with_norm_ (coefficient max_norm / (norm + 1e-6),
    clamped at 1, multiplied into each bf16 gradient). AutoModel passes foreach=True, which on a
    GPU multiplies by the same coefficient with _foreach_mul_; the CPU has no foreach kernels
    (foreach=True raises there), so foreach=False. Returns the norm (float64, before clipping)."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    local_max = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local_max = torch.maximum(local_max, g.detach().abs().max().to(dtype=torch.float64))
    scale = torch.where(torch.isfinite(local_max) & local_max.ne(0), local_max, torch.ones_like(local_max))
    local_val = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local_val = local_val + g.detach().abs().div(scale).square().sum(dtype=torch.float64)
    group = local_max * local_val.pow(1.0 / 2.0)
    stack = torch.stack([group.to(dtype=torch.float64)])  # _combine_norms
    top = stack.abs().max()
    top_scale = torch.where(torch.isfinite(top) & top.ne(0), top, torch.ones_like(top))
    total = top * stack.div(top_scale).pow(2.0).sum().pow(1.0 / 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return float(total)


def train_store(model, ids):
    """5 clipped AdamW steps of `model` with its parameters stored in bf16 (the docstring)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)  # round to nearest even, as from_pretrained(dtype=bfloat16)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW)
    losses, norms = [], []
    for _ in range(G.ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(clip_automodel(params, G.CLIP_MAX_NORM))
        losses.append(float(loss.detach().float()))
        opt.step()
    for st in opt.state.values():  # the state torch made in the parameters' dtype
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    return losses, norms


def generate(case):
    outdir = os.path.join(G.MODELS, case)
    ids = G.make_batch(case)
    runs = {}
    series = (("fp32", False), ("bf16", True)) + ((("bf16_sdpa", True),) if case in SECOND else ())
    for name, bf16 in series + ((("bf16store", True),) if case in STORE else ()):
        model = G.load(outdir, case, fast=name == "bf16_sdpa")
        model.train(False)
        losses, norms = train_store(model, ids) if name == "bf16store" else train(model, ids, bf16)
        finals = G.to_checkpoint_names(model, {n: p.detach().clone() for n, p in model.named_parameters()})
        if G.CASES[case]["arch"] == "gpt_oss":  # its fused experts under am's per-expert names
            finals = G.am_expert_names(finals)
        runs[name] = (losses, norms, finals)
    tensors = {}
    for name, (losses, norms, finals) in runs.items():
        tensors[f"losses_{name}"] = torch.tensor(losses, dtype=torch.float32)
        tensors[f"grad_norms_{name}"] = torch.tensor(norms, dtype=torch.float32)
        if name == "bf16_sdpa":  # its final weights as one number: their L2 distance to the eager run's
            eager = runs["bf16"][2]
            d2 = sum(float(((v.double() - eager[k].double()) ** 2).sum()) for k, v in finals.items())
            tensors["final_bf16_sdpa_distance"] = torch.tensor([d2 ** 0.5], dtype=torch.float32)
            continue
        for k, v in finals.items():  # bf16store's as stored (exact), the others' fp32
            tensors[f"final_{name}.{k}"] = (v if name == "bf16store" else v.float()).contiguous()
    path = os.path.join(outdir, "bf16.safetensors")
    policy = ("param_dtype=bfloat16 reduce_dtype=float32, clip 1.0, 5 AdamW steps at lr 1e-3"
              + ("; bf16store: bf16 parameters and AdamW state, AutoModel's clip" if case in STORE else "")
              + "; see tests/golden/make_bf16_golden.py")
    save_file(tensors, path, metadata={"policy": policy})
    l32, lbf = runs["fp32"][0], runs["bf16"][0]
    G.log(f"  [{case}] losses fp32 {['%.5f' % x for x in l32]}  bf16 {['%.5f' % x for x in lbf]}  "
          f"max |bf16 - fp32| {max(abs(a - b) for a, b in zip(l32, lbf)):.2e}")
    if "bf16store" in runs:
        lst, nst = runs["bf16store"][0], runs["bf16store"][1]
        n32, nbf = runs["fp32"][1], runs["bf16"][1]
        G.log(f"  [{case}] bf16store {['%.5f' % x for x in lst]}  |bf16store - fp32| "
              f"{['%.2e' % abs(a - b) for a, b in zip(lst, l32)]}  |bf16store - bf16| "
              f"{['%.2e' % abs(a - b) for a, b in zip(lst, lbf)]}")
        G.log(f"  [{case}] bf16store grad norms {['%.5f' % x for x in nst]}  relative to fp32 "
              f"{['%.2e' % (abs(a - b) / b) for a, b in zip(nst, n32)]}  to bf16 "
              f"{['%.2e' % (abs(a - b) / b) for a, b in zip(nst, nbf)]}")
        w32, wbf, wst = runs["fp32"][2], runs["bf16"][2], runs["bf16store"][2]
        d32 = sum(float(((v.double() - w32[k].double()) ** 2).sum()) for k, v in wst.items()) ** 0.5
        dbf = sum(float(((v.double() - wbf[k].double()) ** 2).sum()) for k, v in wst.items()) ** 0.5
        dbf32 = sum(float(((v.double() - w32[k].double()) ** 2).sum()) for k, v in wbf.items()) ** 0.5
        G.log(f"  [{case}] final weights: bf16store {d32:.3e} from fp32, {dbf:.3e} from bf16 (bf16 {dbf32:.3e} from fp32)")
    if "bf16_sdpa" in runs:
        lsd = runs["bf16_sdpa"][0]
        G.log(f"  [{case}] bf16 sdpa {['%.5f' % x for x in lsd]}  max |sdpa - eager| "
              f"{max(abs(a - b) for a, b in zip(lsd, lbf)):.2e}, final weights "
              f"{float(tensors['final_bf16_sdpa_distance'][0]):.3e} apart")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=DENSE, help="case(s) to generate (default: all dense)")
    args = ap.parse_args()
    G.setup_torch()
    for case in args.case or DENSE:
        G.log(f"bf16 golden {case}")
        generate(case)
    # summary.json lists every committed file with its hash
    summary_path = os.path.join(G.HERE, "summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    for case in DENSE:
        p = os.path.join(G.MODELS, case, "bf16.safetensors")
        if os.path.exists(p):
            os.chmod(p, 0o644)
            summary["files"][f"models/{case}/bf16.safetensors"] = dict(bytes=os.path.getsize(p), sha256=G.sha256(p))
    summary["files"] = {k: summary["files"][k] for k in sorted(summary["files"])}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
