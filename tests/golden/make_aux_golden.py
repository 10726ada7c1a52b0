"""AutoModel's own load-balancing loss (MoEConfig.aux_loss_coeff; docs/training.md), as goldens for
test_golden's *_aux_loss cases: transformers' DeepseekV3ForCausalLM and GptOssForCausalLM from the
committed deepseek_v3_tiny and gpt_oss_tiny directories, trained as make_golden.py's clipped AdamW
steps on their golden batch, each router's output passed through AutoModel's Gate code
(nemo_automodel/components/moe/layers.py, Gate.forward and _compute_aux_loss) by a forward hook:

    load_e  = top-k slots of the micro-batch's T tokens that chose e (all valid: no padding)
    q       = the full softmax of the router's logits (gpt_oss: score_func softmax, its
              original_scores), or the sigmoid scores divided by their sum + 1e-20
              (deepseek_v3: sigmoid with norm_topk_prob and top-k > 1)
    aux     = sum_e (load_e E / (k T)) (sum_t q_te / T)            per MoE layer, in fp32
    weights = MoEAuxLossAutoScaler.apply(weights, coeff * aux)     (the backward adds
              coeff * d aux * main_loss_backward_scale, 1 here: one rank, one micro-batch)

The loss trained and reported is the cross entropy alone (AutoModel adds nothing to it; gpt_oss's
transformers' loss with output_router_logits is not AutoModel's own model's). Writes
tests/golden/models/<case>/aux_loss.safetensors: losses and grad norms before clipping [5], each
step's aux summed over the MoE layers [5], coeff, and every router weight (and bias) after the 5
steps (final.<name>); and the same with the batch as two micro-batches of one sequence (mb2.*:
the aux's backward scale 1 / 2, the cross entropy over the step's targets, aux the last
micro-batch's). Refuses to write when a routing choice is within MARGIN of a tie at any step,
and prints how far the losses moved against the same steps without the aux loss.

And on make_bias_golden's packed batch (documents back to back, then pads), one micro-batch:
the pads are no tokens of AutoModel's token_mask (its THD batch's padding_mask), so load, the
score sums and T count the rows that are no pad only, and the pads' scores get no gradient;
gpt_oss's sliding layers see their window within each document. Writes aux_loss_packed.safetensors
(losses, grad_norms, aux, coeff, final.*, and the batch: input_ids, targets, starts, fill).

    /work/venv-golden/bin/python tests/golden/make_aux_golden.py
"""
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_bias_golden as mb  # noqa: E402
import make_golden as mg  # noqa: E402

CASES = {"deepseek_v3_tiny": 0.5, "gpt_oss_tiny": 0.5}  # coeff: large enough to move 5 steps visibly
MARGIN = 1e-4


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """AutoModel's (components/moe/megatron/moe_utils.py); main_loss_backward_scale as its train
    recipe sets it (base_recipe.py, _set_moe_aux_loss_backward_scale): cp / micro-batches."""

    main_loss_backward_scale = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss.float())
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * MoEAuxLossAutoScaler.main_loss_backward_scale


def routers(model):
    out = []
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp.gate, "e_score_correction_bias"):
            out.append(mlp.gate)
        elif hasattr(mlp, "router"):
            out.append(mlp.router)
    return out


def original_scores(router, logits):
    """AutoModel's Gate._route_scores' original_scores for the model's score_func."""
    logits = logits.float()
    if hasattr(router, "e_score_correction_bias"):  # deepseek_v3: sigmoid
        s = logits.sigmoid()
        if router.norm_topk_prob and router.top_k > 1:
            s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
        return s
    return logits.softmax(dim=-1, dtype=torch.float32)  # gpt_oss: softmax after top-k, full softmax for aux


def aux_of(router, logits, indices, mask=None):
    """Gate._compute_expert_load and _compute_aux_loss (token_mask: mask, or all true; no cp)."""
    E, k = logits.shape[-1], indices.shape[-1]
    scores = original_scores(router, logits)
    if mask is None:
        mask = torch.ones(scores.shape[0], dtype=torch.bool)
    one = mask[:, None].expand(indices.shape).to(indices.dtype)
    load = indices.new_zeros((indices.shape[0], E)).scatter_(1, indices, one).sum(0).float()
    T = torch.clamp(mask.sum(), min=1)
    f = load * E / (k * T)
    P = (scores * mask.unsqueeze(-1)).sum(0) / T
    return torch.sum(f * P)


def margin(router, logits):
    if hasattr(router, "e_score_correction_bias"):
        return None  # measured on the hidden state by make_bias_golden's margin_of
    p = logits.detach().float()
    s = p.sort(dim=-1, descending=True)[0]
    return float((s[:, router.top_k - 1] - s[:, router.top_k]).min())


def pack_inputs(model, pack):
    """The pack's forward arguments: position_ids and the block-diagonal causal masks, as 4-d
    additive masks; gpt_oss's sliding layers' within their window too (a dict by layer type)."""
    dtype = model.dtype
    mask = pack["mask"]

    def add(m):
        return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)[:, None]

    window = getattr(model.config, "sliding_window", None)
    am = add(mask)
    if window and "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        j = torch.arange(mask.shape[-1])
        near = (j[None, :, None] - j[None, None, :]) < window  # row t sees key j when t - j < window
        am = {"full_attention": add(mask), "sliding_attention": add(mask & near)}
    extra = {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
    return dict(input_ids=pack["input_ids"], position_ids=pack["position_ids"], attention_mask=am, **extra)


def run(case, coeff, micro=1, packed=False):
    """micro > 1: each step's batch as that many micro-batches (gradient accumulation), the cross
    entropy of each summed and divided by the step's targets (train_ft's num_label_tokens), the aux
    loss per micro-batch, its backward scale 1 / micro (cp 1); aux: the last micro-batch's."""
    outdir = os.path.join(mg.HERE, "models", case)
    model = mg.load(outdir, case)
    ids = load_file(os.path.join(outdir, "golden.safetensors"))["input_ids"].long()
    mask = pack = None
    if packed:
        pack, mask, _ = mb.make_pack(model.config.vocab_size)
    rs = routers(model)
    step_aux, margins = [], []

    def hook(mod, inp, out):
        logits, weights, indices = out
        if hasattr(mod, "e_score_correction_bias"):
            margins.append(mb.margin_of(mod, inp[0]))
        else:
            margins.append(margin(mod, logits))
        aux = aux_of(mod, logits, indices, mask)
        step_aux[-1] += float(aux.detach())
        if coeff > 0:
            weights = MoEAuxLossAutoScaler.apply(weights, coeff * aux)
        return logits, weights, indices

    for r in rs:
        r.register_forward_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **mg.ADAMW)
    losses, norms = [], []
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / micro)
    labels = ids.shape[0] * (ids.shape[1] - 1)
    for _ in range(mg.ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        if packed:  # one micro-batch: the mean cross entropy over the pack's targets
            step_aux.append(0.0)
            logits = model(**pack_inputs(model, pack)).logits
            tg = pack["targets"].reshape(-1)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tg, ignore_index=-100, reduction="sum")
            loss = loss / int((tg >= 0).sum())
            loss.backward()
            total = float(loss.detach())
        for part in ([] if packed else ids.chunk(micro, dim=0)):
            step_aux.append(0.0)
            logits = model(input_ids=part).logits
            vocab = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, vocab), part[:, 1:].reshape(-1), reduction="sum") / labels
            loss.backward()
            total += float(loss.detach())
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, mg.CLIP_MAX_NORM)))
        losses.append(total)
        opt.step()
    step_aux = step_aux[micro - 1::micro]  # each step's last micro-batch's
    return model, rs, losses, norms, step_aux, min(margins)


def main():
    mg.setup_torch()
    for case, coeff in CASES.items():
        model, rs, losses, norms, aux, m = run(case, coeff)
        _, _, losses0, _, _, _ = run(case, 0.0)
        moved = max(abs(a - b) for a, b in zip(losses, losses0))
        print(f"{case}: losses {losses}\n  without the aux loss {losses0} (moved {moved:.3g})\n  aux {aux}\n"
              f"  smallest routing margin {m:.3g}")
        if m < MARGIN:
            sys.exit(f"{case}: a routing choice is within {m:.3g} of a tie (want {MARGIN}): not written")
        if moved < 1e-4:
            sys.exit(f"{case}: the aux loss moved the losses by {moved:.3g} only: not written")
        out = {"losses": torch.tensor(losses, dtype=torch.float32), "grad_norms": torch.tensor(norms, dtype=torch.float32),
               "aux": torch.tensor(aux, dtype=torch.float32), "coeff": torch.tensor([coeff], dtype=torch.float32)}
        for name, p in model.named_parameters():
            if ".gate.weight" in name or ".router." in name:
                out[f"final.{name}"] = p.detach().clone().contiguous()
        # two micro-batches of one sequence each: the aux loss's backward scale 1 / 2
        model2, _, losses2, norms2, aux2, m2 = run(case, coeff, micro=2)
        print(f"  2 micro-batches: losses {losses2}\n  aux {aux2}\n  smallest routing margin {m2:.3g}")
        if m2 < MARGIN:
            sys.exit(f"{case}: a routing choice is within {m2:.3g} of a tie (want {MARGIN}): not written")
        out.update({"mb2.losses": torch.tensor(losses2, dtype=torch.float32),
                    "mb2.grad_norms": torch.tensor(norms2, dtype=torch.float32),
                    "mb2.aux": torch.tensor(aux2, dtype=torch.float32)})
        for name, p in model2.named_parameters():
            if ".gate.weight" in name or ".router." in name:
                out[f"mb2.final.{name}"] = p.detach().clone().contiguous()
        path = os.path.join(mg.HERE, "models", case, "aux_loss.safetensors")
        save_file(out, path, metadata={"format": "pt"})
        print("wrote", path)
        write_summary(case, path)
        write_packed(case, coeff)


def write_packed(case, coeff):
    """The packed batch's golden (aux_loss_packed.safetensors)."""
    mg.setup_torch()
    model, rs, losses, norms, aux, m = run(case, coeff, packed=True)
    _, _, losses0, _, _, _ = run(case, 0.0, packed=True)
    moved = max(abs(a - b) for a, b in zip(losses, losses0))
    print(f"{case} packed: losses {losses}\n  without the aux loss {losses0} (moved {moved:.3g})\n  aux {aux}\n"
          f"  smallest routing margin {m:.3g}")
    if m < MARGIN:
        sys.exit(f"{case} packed: a routing choice is within {m:.3g} of a tie (want {MARGIN}): not written")
    if moved < 1e-4:
        sys.exit(f"{case} packed: the aux loss moved the losses by {moved:.3g} only: not written")
    pack, _, fill = mb.make_pack(model.config.vocab_size)
    out = {"losses": torch.tensor(losses, dtype=torch.float32), "grad_norms": torch.tensor(norms, dtype=torch.float32),
           "aux": torch.tensor(aux, dtype=torch.float32), "coeff": torch.tensor([coeff], dtype=torch.float32),
           "fill": fill.to(torch.int32)}
    out.update({k: pack[k].to(torch.int32).contiguous() for k in ("input_ids", "targets", "starts")})
    for name, p in model.named_parameters():
        if ".gate.weight" in name or ".router." in name:
            out[f"final.{name}"] = p.detach().clone().contiguous()
    path = os.path.join(mg.HERE, "models", case, "aux_loss_packed.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    print("wrote", path)
    write_summary(case, path)


def write_summary(case, path):
    """summary.json lists every committed file with its hash (make_bf16_golden.py's way)."""
    import json

    os.chmod(path, 0o644)
    summary_path = os.path.join(mg.HERE, "summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    summary["files"][f"models/{case}/{os.path.basename(path)}"] = dict(bytes=os.path.getsize(path), sha256=mg.sha256(path))
    summary["files"] = {k: summary["files"][k] for k in sorted(summary["files"])}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
