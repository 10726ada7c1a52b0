#!/usr/bin/env bash
# test-fp8-load.sh - an FP8 checkpoint (DeepSeek-V3's form: F8_E4M3 projection weights with one
# fp32 weight_scale_inv per block, quantization_config quant_method fp8) trains from the same
# weights as its dequantisation saved in fp32: am-train's first loss is the same number, on one
# rank, at tp 2 (each rank dequantising its rows or columns only, the slices cutting through
# blocks), at dp 2 (fsdp2, the tiny recipe's strategy) and in bf16 (the fp32 product rounded once); for a dense model (the llama_tp golden,
# blocks of 16 x 24, edge blocks partial, one projection left unquantised by
# modules_to_not_convert) and a mixture of experts (qwen3_moe_tiny's experts, ep 2). The
# checkpoints are made by tests/ckpt/fp8_quantize (C, its e4m3 coder apart from the loader's);
# where the golden venv has torch (AM_GOLDEN_PYTHON, tests/golden/README.md), they must equal
# byte for byte those of tests/ckpt/make_fp8_checkpoint.py, made with torch's float8_e4m3fn.
# Then: a scale of
# the wrong shape and a missing one are refused naming the tensor; the progress line shows
# during the FP8 load on a terminal; am-ckpt export of the trained model writes no
# quantization_config, in fp32 or (--dtype bfloat16) bf16, and refuses to re-quantise.
set -u
source "$(dirname "$0")/load-lib.sh"

for g in llama_tp:16:24 qwen3_moe_tiny:32:40; do
    IFS=: read -r name b0 b1 <<<"$g"
    "$AM_BUILDDIR/tests/ckpt/fp8_quantize" "$AM_SRCDIR/tests/golden/models/$name" "$T/$name" "$b0" "$b1" ||
        { bad "could not make the FP8 checkpoint of $name"; continue; }
    if "$PY" -c 'import torch, safetensors' 2>/dev/null; then
        "$PY" "$AM_SRCDIR/tests/ckpt/make_fp8_checkpoint.py" "$AM_SRCDIR/tests/golden/models/$name" "$T/py-$name" "$b0" "$b1" &&
            cmp -s "$T/$name/fp8/model.safetensors" "$T/py-$name/fp8/model.safetensors" &&
            cmp -s "$T/$name/deq/model.safetensors" "$T/py-$name/deq/model.safetensors" &&
            ok "$name: fp8_quantize's FP8 and dequantised files equal torch's byte for byte" ||
            bad "$name: fp8_quantize's files differ from make_fp8_checkpoint.py's (torch)"
    else
        echo "note: no torch at $PY: fp8_quantize's bytes not compared with torch's"
    fi
done

for c in "llama_tp 1 - -" "llama_tp 2 AM_TP=2 -" "llama_tp 2 - -" "llama_tp 1 - bf16" "qwen3_moe_tiny 1 - -" "qwen3_moe_tiny 2 AM_EP=2 -"; do
    read -r name n var bf <<<"$c"
    [ -d "$T/$name/fp8" ] || continue
    [ "$bf" = - ] && bf=
    [ "$var" = - ] && var=
    recipe "$T/$name/fp8" "fp8-$name$bf" "$bf"
    recipe "$T/$name/deq" "deq-$name$bf" "$bf"
    a=$(first "fp8-$name-$n$bf" "$n" "fp8-$name$bf" $var)
    b=$(first "deq-$name-$n$bf" "$n" "deq-$name$bf" $var)
    layout=${var:-dp $n, fsdp2}
    [ "$n" = 1 ] && layout=
    what="$name on $n rank(s)${layout:+ ($layout)}${bf:+ in bf16}"
    if [ "$a" != did-not-train ] && [ -n "$a" ] && [ "$a" = "$b" ]; then
        ok "$what: the FP8 checkpoint's first loss $a equals its dequantised weights' (fp32 on disk)"
    else
        bad "$what: FP8 first loss '$a', dequantised '$b'"
        sed 's/^/    /' "$T/fp8-$name-$n$bf.err" | tail -5
    fi
done

# am-plan says what it will load
if (cd "$T" && "$AM_BUILDDIR/am-plan" --nodes 1 --gpus-per-node 1 fp8-llama_tp.yaml 2>&1) |
    grep -qx '             an FP8 checkpoint (e4m3, one scale per 16 x 24 block): dequantised at load'; then
    ok "am-plan names the FP8 checkpoint and its blocks"
else
    bad "am-plan does not name the FP8 checkpoint:"; (cd "$T" && "$AM_BUILDDIR/am-plan" --nodes 1 --gpus-per-node 1 fp8-llama_tp.yaml 2>&1 | head -5)
fi

# not vacuous: the golden's own weights (unquantised) give another first loss
recipe "$AM_SRCDIR/tests/golden/models/llama_tp" orig
o=$(first orig 1 orig)
a=$(first fp8-llama_tp-1 1 fp8-llama_tp)
if [ -n "$o" ] && [ "$o" != did-not-train ] && [ "$o" != "$a" ]; then
    ok "the unquantised golden's first loss $o differs from the FP8 checkpoint's $a (the quantisation is seen)"
else
    bad "the unquantised golden's first loss '$o' against the FP8 checkpoint's '$a'"
fi

# am-ckpt export of the model trained from the FP8 checkpoint: no quantization_config
recipe "$T/llama_tp/fp8" save "" save
first save 1 save >/dev/null
hf=$(ls -d "$T"/ckpt-save/step-*/hf 2>/dev/null | head -1)
if [ -n "$hf" ] && [ -f "$hf/config.json" ] && ! grep -q quantization_config "$hf/config.json" &&
    ! grep -q F8_E4M3 "$hf/model.safetensors"; then
    ok "the job's consolidated save (step-N/hf) is unquantised, with no quantization_config"
else
    bad "the job's consolidated save: '$hf' missing, quantised or with a quantization_config"
fi
if "$AM_BUILDDIR/am-ckpt" export --quiet "$T/ckpt-save" "$T/export" >"$T/export.out" 2>&1; then
    if grep -q quantization_config "$T/export/config.json"; then
        bad "am-ckpt export wrote a quantization_config"
    else
        ok "am-ckpt export of the trained model writes plain weights and no quantization_config"
    fi
else
    bad "am-ckpt export failed"; cat "$T/export.out" 2>/dev/null | head -5
fi
# --dtype bfloat16: every tensor BF16, each the fp32 export's rounded once; torch_dtype bfloat16
# (torch's rounding, where the golden venv has torch)
if ! "$PY" -c 'import torch, safetensors' 2>/dev/null; then
    echo "note: no torch at $PY: am-ckpt export --dtype bfloat16 not compared with torch's rounding"
elif "$AM_BUILDDIR/am-ckpt" export --quiet --dtype bfloat16 "$T/ckpt-save" "$T/export16" >"$T/export16.out" 2>&1 &&
    "$PY" - "$T/export" "$T/export16" <<'PYEOF' >"$T/export16.check" 2>&1; then
import json, sys, torch
from safetensors.torch import load_file
a, b = (load_file(d + "/model.safetensors") for d in sys.argv[1:3])
assert a.keys() == b.keys(), "other tensors"
for k in a:
    assert b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)), k
c = json.load(open(sys.argv[2] + "/config.json"))
assert c["torch_dtype"] == "bfloat16" and "quantization_config" not in c, c.get("torch_dtype")
PYEOF
    ok "am-ckpt export --dtype bfloat16: every tensor the fp32 export's rounded to bf16 (torch's), torch_dtype bfloat16"
else
    bad "am-ckpt export --dtype bfloat16:"; cat "$T/export16.out" "$T/export16.check" 2>/dev/null | head -8
fi
want="am-ckpt: --dtype fp8: am does not re-quantise: the trained weights would be rounded to a few bits per block scale (e4m3 keeps 3 mantissa bits), losing the fine-tuning's small updates, and no such rounding is checked against the tools that serve the model; export float32 or bfloat16 and quantise with the serving stack's own tool"
"$AM_BUILDDIR/am-ckpt" export --dtype fp8 "$T/ckpt-save" "$T/export8" >"$T/export8.out" 2>&1
rc=$?
if [ $rc = 1 ] && [ "$(cat "$T/export8.out")" = "$want" ] && [ ! -e "$T/export8" ]; then
    ok "am-ckpt export --dtype fp8 is refused: $want"
else
    bad "am-ckpt export --dtype fp8: exit $rc:"; cat "$T/export8.out"
fi

# the errors: a scale of the wrong shape, a missing one (llama_tp's checkpoint, edited)
w=model.layers.1.mlp.up_proj.weight
"$AM_BUILDDIR/tests/ckpt/fp8_quantize" "$AM_SRCDIR/tests/golden/models/llama_tp" "$T/bad-q" 16 24 --narrow-scale $w &&
    "$AM_BUILDDIR/tests/ckpt/fp8_quantize" "$AM_SRCDIR/tests/golden/models/llama_tp" "$T/lost-q" 16 24 --drop-scale $w &&
    mv "$T/bad-q/fp8" "$T/bad" && mv "$T/lost-q/fp8" "$T/lost" || bad "could not make the broken checkpoints"
# expect NAME MESSAGE: training from $T/NAME fails with MESSAGE on stderr
expect() {
    recipe "$T/$1" "$1"
    (cd "$T" && "$AM_BUILDDIR/am-launch" --nproc 1 --log-dir "$T/logs-$1" "$1.yaml" >"$T/$1.out" 2>"$T/$1.err")
    if grep -qF -- "$2" "$T/$1.err"; then
        ok "$1: refused: $2"
    else
        bad "$1: want '$2', got:"; sed 's/^/    /' "$T/$1.err" | head -8
    fi
}
expect bad "$T/bad/model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight_scale_inv' is F32 [8, 2], but the FP8 weight 'model.layers.1.mlp.up_proj.weight' of [128, 64] in blocks of 16 x 24 (quantization_config.weight_block_size) needs F32 [8, 3], one scale per block (does weight_block_size match the checkpoint?)"
expect lost "$T/lost/model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' is F8_E4M3 but 'model.layers.1.mlp.up_proj.weight_scale_inv' is missing: an FP8 checkpoint holds one fp32 scale per 16 x 24 block beside each weight, here [8, 3] (an incomplete download, or a checkpoint quantised another way)"

# the progress line during the FP8 load, on a terminal (script(1)'s pseudo-terminal)
if command -v script >/dev/null; then
    recipe "$T/llama_tp/fp8" tty
    (cd "$T" && script -qec "'$AM_BUILDDIR/am-launch' --nproc 1 --log-dir '$T/logs-tty' tty.yaml" /dev/null </dev/null >"$T/tty.out")
    if tr '\r' '\n' <"$T/tty.out" | grep -qE '^am-train: loading the weights: 100\.0%  [0-9]+ kB of [0-9]+ kB  '; then
        ok "on a terminal, the FP8 load shows its progress to 100.0%"
    else
        bad "no progress line during the FP8 load on a terminal:"; cat -A "$T/tty.out" | head -5
    fi
fi
echo "$passes passed, $fails failed"
[ $fails = 0 ]
