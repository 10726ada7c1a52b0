#!/usr/bin/env python3
"""Makes an FP8 checkpoint, as DeepSeek-V3 and Kimi ship them, of a Hugging Face model
directory, and the same weights dequantised (for tests/train/test-fp8-load.sh):

    make_fp8_checkpoint.py SRC OUT B0 B1

OUT/fp8: config.json with quantization_config {quant_method fp8, fmt e4m3, weight_block_size
[B0, B1], activation_scheme dynamic, modules_to_not_convert}; every projection weight
(`*_proj.weight`, experts' included) but those listed there stored as F8_E4M3 beside
`<name>_scale_inv` (F32, one per B0 x B1 block, the edge blocks partial), quantised as
DeepSeek's quantiser does: per block scale = amax / 448, the weight divided by it and cast to
e4m3 (round to nearest even). The other tensors as SRC has them.
OUT/deq: the same model with those weights dequantised in fp32 (the e4m3 value times its
block's scale, as transformers' FP8 dequantisation and DeepSeek's weight_dequant compute),
stored as F32, and config.json without quantization_config.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

src, out, b0, b1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keep = ["model.layers.0.self_attn.o_proj", "lm_head"]  # stored unquantised, as the config says
w = load_file(os.path.join(src, "model.safetensors"))
cfg = json.load(open(os.path.join(src, "config.json")))
fp8, deq = {}, {}
for name, x in w.items():
    if not name.endswith("_proj.weight") or x.dim() != 2 or name[: -len(".weight")] in keep:
        fp8[name] = deq[name] = x
        continue
    R, C = x.shape
    sr, sc = -(-R // b0), -(-C // b1)
    x = x.float()
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    s = torch.empty(sr, sc)
    for i in range(sr):
        for j in range(sc):
            blk = x[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            s[i, j] = blk.abs().max() / 448.0
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    fp8[name], fp8[name + "_scale_inv"] = q, s
    deq[name] = q.float() * s.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
for kind, tensors, quant in (("fp8", fp8, True), ("deq", deq, False)):
    d = os.path.join(out, kind)
    os.makedirs(d, exist_ok=True)
    c = dict(cfg)
    if quant:
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [b0, b1], "modules_to_not_convert": keep}
    json.dump(c, open(os.path.join(d, "config.json"), "w"), indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
