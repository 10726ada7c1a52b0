#!/usr/bin/env bash
# test-mxfp4-load.sh - an MXFP4 checkpoint (gpt-oss's form: the experts' gate_up_proj and down_proj
# stored as `*_blocks`, e2m1 pairs, and `*_scales`, e8m0 per 32 values; quantization_config
# quant_method mxfp4) trains from the same weights as its dequantisation saved in fp32: am-train's
# first loss is the same number on one rank and at ep 2 (each rank dequantising its own experts
# only), for the gpt_oss_tiny golden's weights. The checkpoints are made by
# tests/ckpt/mxfp4_quantize (C, its e2m1 coder apart from the loader's). Not vacuous: the golden's
# own weights give another first loss. The job's consolidated save is unquantised, without
# quantization_config, and transformers' fused names.
set -u
source "$(dirname "$0")/load-lib.sh"
G=$AM_SRCDIR/tests/golden/models/gpt_oss_tiny

"$AM_BUILDDIR/tests/ckpt/mxfp4_quantize" "$G" "$T/q" || { echo "FAIL: mxfp4_quantize"; exit 1; }
"$AM_BUILDDIR/tests/ckpt/mxfp4_quantize" "$G" "$T/q2" && cmp -s "$T/q/mxfp4/model.safetensors" "$T/q2/mxfp4/model.safetensors" &&
    ok "mxfp4_quantize is deterministic" || bad "mxfp4_quantize gave other bytes the second time"

# where the golden venv has torch (AM_GOLDEN_PYTHON): transformers' own MXFP4 conversion of the
# blocks and scales gives the dequantised file's tensors exactly
if "$PY" -c 'import torch, transformers.integrations.mxfp4' 2>/dev/null; then
    "$PY" - "$T/q" <<'PYEOF' >"$T/torch.check" 2>&1 && ok "transformers' convert_moe_packed_tensors of mxfp4_quantize's blocks and scales equals its dequantised tensors" || { bad "transformers' conversion differs:"; cat "$T/torch.check"; }
import sys, torch
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
q, d = load_file(sys.argv[1] + "/mxfp4/model.safetensors"), load_file(sys.argv[1] + "/deq/model.safetensors")
names = [k[: -len("_blocks")] for k in q if k.endswith("_blocks")]
assert names, "no MXFP4 tensors"
for n in names:
    assert torch.equal(convert_moe_packed_tensors(q[n + "_blocks"], q[n + "_scales"], dtype=torch.float32), d[n]), n
PYEOF
else
    echo "note: no torch at $PY: mxfp4_quantize's layout not compared with transformers' conversion"
fi

recipe "$T/q/mxfp4" mx
recipe "$T/q/deq" deq
for c in "1 -" "2 AM_EP=2"; do
    read -r n var <<<"$c"
    [ "$var" = - ] && var=
    a=$(first "mx-$n" "$n" mx $var)
    b=$(first "deq-$n" "$n" deq $var)
    what="gpt_oss_tiny on $n rank(s)${var:+ ($var)}"
    if [ "$a" != did-not-train ] && [ -n "$a" ] && [ "$a" = "$b" ]; then
        ok "$what: the MXFP4 checkpoint's first loss $a equals its dequantised weights' (fp32 on disk)"
    else
        bad "$what: MXFP4 first loss '$a', dequantised '$b'"
        sed 's/^/    /' "$T/mx-$n.err" | tail -5
    fi
done

# am-plan says what it will load
if (cd "$T" && "$AM_BUILDDIR/am-plan" --nodes 1 --gpus-per-node 1 mx.yaml 2>&1) |
    grep -qx '             an MXFP4 checkpoint (the experts. e2m1 blocks, one e8m0 scale per 32 values): dequantised at load'; then
    ok "am-plan names the MXFP4 checkpoint"
else
    bad "am-plan does not name the MXFP4 checkpoint:"; (cd "$T" && "$AM_BUILDDIR/am-plan" --nodes 1 --gpus-per-node 1 mx.yaml 2>&1 | head -5)
fi

recipe "$G" orig
o=$(first orig 1 orig)
a=$(first mx-1b 1 mx)
if [ -n "$o" ] && [ "$o" != did-not-train ] && [ "$o" != "$a" ]; then
    ok "the unquantised golden's first loss $o differs from the MXFP4 checkpoint's $a (the quantisation is seen)"
else
    bad "the unquantised golden's first loss '$o' against the MXFP4 checkpoint's '$a'"
fi

recipe "$T/q/mxfp4" save "" save
first save 1 save >/dev/null
hf=$(ls -d "$T"/ckpt-save/step-*/hf 2>/dev/null | head -1)
if [ -n "$hf" ] && [ -f "$hf/config.json" ] && ! grep -q quantization_config "$hf/config.json" &&
    grep -q 'mlp.experts.gate_up_proj"' "$hf/model.safetensors" && ! grep -q '_blocks"' "$hf/model.safetensors"; then
    ok "the job's consolidated save (step-N/hf) is unquantised, fused as transformers names it, with no quantization_config"
else
    bad "the job's consolidated save: '$hf' missing, quantised or with a quantization_config"
fi
echo "$passes passed, $fails failed"
[ $fails = 0 ]
