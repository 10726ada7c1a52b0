"""The selection-bias update of AutoModel's deepseek_v3 (docs/training.md), as a golden for
test_golden's deepseek_v3_tiny_bias_update: transformers' DeepseekV3ForCausalLM from the committed
deepseek_v3_tiny directory, trained as make_golden.py's clipped AdamW steps on its golden batch,
with AutoModel's Gate.update_bias after each optimizer step (nemo_automodel/components/moe/
layers.py; the train loop's update_moe_gate_bias after opt.step()):

    load_e   = tokens of the step routed to expert e (each token's top-k choices, counted once)
    bias    += factor * sign(mean(load) - load)        (fp32: the loads as fp32, their fp32 mean)

Writes tests/golden/models/deepseek_v3_tiny/bias_update.safetensors: the losses before each step
and the grad norms before clipping [5], the loads of each step and MoE layer [5, layers, E] (i32),
and each layer's bias after the 5 steps (final.<name>). Refuses to write when a routing choice
is within MARGIN of a tie at any step (a rounding difference could flip it), and reports how
many choices the update changed against the same steps without it (the test must see some).

And the same on a packed batch (PACK: each sequence's documents back to back, then pads, as
make_golden.py's packs and am's): the pads are no tokens of AutoModel's token_mask (its THD
batch's padding_mask, thd_utils._thd_padding_mask: the slots past a pack's real tokens), so the
loads count the rows that are no pad only; writes bias_update_packed.safetensors with the same
keys and the batch (input_ids, targets, starts, fill: each sequence's rows before its pads).

    /work/venv-golden/bin/python tests/golden/make_bias_golden.py
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402

CASE = "deepseek_v3_tiny"
FACTOR = 1e-2  # AutoModel's default is 1e-3; larger so that 5 steps change some choices
MARGIN = 1e-4
# the packed batch: documents of these rows in each of the 2 sequences of 16, then pads
PACK = dict(seq=16, packed=dict(rows=[[5, 7], [4, 6, 3]], masked=[(1, 1, 2)]))
PACK_SEED = 2113


def make_pack(vocab):
    """make_golden's pack of PACK, and its token_mask [B * T] (True: no pad) and fill [B]."""
    g = torch.Generator().manual_seed(PACK_SEED)
    pack = mg.make_pack(PACK, g, vocab)
    fill = torch.tensor([sum(r) for r in PACK["packed"]["rows"]], dtype=torch.int64)
    mask = (torch.arange(PACK["seq"])[None, :] < fill[:, None]).reshape(-1)
    return pack, mask, fill


def margin_of(gate, h):
    """The smallest gap, over the tokens, between the chosen and the best unchosen biased score
    within the chosen groups, and between the chosen and the best unchosen group."""
    with torch.no_grad():
        h = h.reshape(-1, gate.weight.shape[1]).float()
        s = torch.sigmoid(h @ gate.weight.float().t()) + gate.e_score_correction_bias
        n, E, G = s.shape[0], s.shape[1], gate.num_group
        gs = s.view(n, G, E // G).topk(2, dim=-1)[0].sum(-1)
        gsort = gs.sort(dim=-1, descending=True)[0]
        m = float((gsort[:, gate.topk_group - 1] - gsort[:, gate.topk_group]).min())
        gidx = gs.topk(gate.topk_group, dim=-1)[1]
        mask = torch.zeros(n, G).scatter_(1, gidx, 1).bool()
        sc = s.masked_fill(~mask.repeat_interleave(E // G, dim=1), float("-inf"))
        ss = sc.sort(dim=-1, descending=True)[0]
        return min(m, float((ss[:, gate.top_k - 1] - ss[:, gate.top_k]).min()))


def run(update, packed=False):
    outdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", CASE)
    model = mg.load(outdir, CASE)
    ids = load_file(os.path.join(outdir, "golden.safetensors"))["input_ids"].long()
    mask = None
    if packed:  # AutoModel's token_mask: the pads' choices are no load
        ids, mask, _ = make_pack(model.config.vocab_size)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    step_idx, margins = [], []

    def hook(mod, inp, out):
        step_idx[-1].append(out[2].detach().clone())
        margins.append(margin_of(mod, inp[0]))

    for g in gates:
        g.register_forward_hook(hook)
    master = [g.e_score_correction_bias.detach().clone().float() for g in gates]
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **mg.ADAMW)
    losses, norms, loads, choices = [], [], [], []
    for _ in range(mg.ADAMW_STEPS):
        step_idx.append([])
        opt.zero_grad(set_to_none=True)
        res = mg.forward(model, ids)
        res["loss"].backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, mg.CLIP_MAX_NORM)))
        losses.append(float(res["loss"].detach()))
        opt.step()
        E = gates[0].num_experts
        step_loads = []
        for li, (g, idx) in enumerate(zip(gates, step_idx[-1])):
            one = torch.ones(idx.shape, dtype=torch.int64) if mask is None else mask[:, None].expand(idx.shape).long()
            load = torch.zeros(idx.shape[0], E, dtype=torch.int64).scatter_(1, idx, one).sum(0)  # _compute_expert_load
            step_loads.append(load)
            if update:  # Gate.update_bias
                lf = load.float()
                master[li] += torch.sign(lf.mean() - lf) * FACTOR
                with torch.no_grad():
                    g.e_score_correction_bias.copy_(master[li])
        loads.append(torch.stack(step_loads))
        choices.append(torch.stack([i.sort(dim=-1)[0] for i in step_idx[-1]]))
    return model, gates, losses, norms, torch.stack(loads), torch.stack(choices), min(margins)


def main():
    for packed in (False, True):
        write(packed)


def write(packed):
    mg.setup_torch()
    model, gates, losses, norms, loads, choices, margin = run(True, packed)
    _, _, losses0, _, _, choices0, _ = run(False, packed)
    changed = int((choices != choices0).any(dim=-1).sum())
    print(f"losses {losses}\nwithout the update {losses0}\nsmallest routing margin {margin:.3g}; "
          f"choices changed by the update: {changed} token-layer-steps")
    if margin < MARGIN:
        sys.exit(f"a routing choice is within {margin:.3g} of a tie (want {MARGIN}): not written")
    if changed == 0:
        sys.exit("the update changed no routing choice: not written")
    out = {"losses": torch.tensor(losses, dtype=torch.float32), "grad_norms": torch.tensor(norms, dtype=torch.float32),
           "loads": loads.to(torch.int32), "factor": torch.tensor([FACTOR], dtype=torch.float32)}
    for li, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            out[f"final.model.layers.{li}.mlp.gate.e_score_correction_bias"] = (
                layer.mlp.gate.e_score_correction_bias.detach().clone().contiguous())
    name = "bias_update_packed.safetensors" if packed else "bias_update.safetensors"
    if packed:
        pack, _, fill = make_pack(model.config.vocab_size)
        out.update({k: pack[k].to(torch.int32).contiguous() for k in ("input_ids", "targets", "starts")})
        out["fill"] = fill.to(torch.int32)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", CASE, name)
    save_file(out, path, metadata={"format": "pt"})
    print("wrote", path)
    write_summary(path)


def write_summary(path):
    """summary.json lists every committed file with its hash (make_bf16_golden.py's way)."""
    import json

    os.chmod(path, 0o644)
    summary_path = os.path.join(mg.HERE, "summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    summary["files"][f"models/{CASE}/{os.path.basename(path)}"] = dict(bytes=os.path.getsize(path),
                                                                       sha256=mg.sha256(path))
    summary["files"] = {k: summary["files"][k] for k in sorted(summary["files"])}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
