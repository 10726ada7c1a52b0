#!/bin/bash
# test-peft-merge.sh - `am-ckpt merge BASE PEFT OUT` (runtime/ckpt/peft_merge.h): LoRA adapters
# merged into their base as a Hugging Face directory.
#   - For each golden LoRA case (tests/golden/models/llama_lora_qv, llama_lora_all, llama_lora_head), the
#     golden's trained adapters (B not zero) merged into the base, in F32 and in a BF16 copy of
#     it; tests/ckpt/peft_merge check: every untouched tensor bit-identical, every adapted
#     weight equal to W + (lora_alpha / r) * B @ A computed there in double precision within one
#     unit in the last place of its dtype; the same with the golden's initial adapters.
#   - Refusals, with their exact messages: OUT not empty, OUT a file, missing files, DoRA,
#     rsLoRA, fan_in_fan_out, a module the base lacks, lm_head's adapter on a base that ties
#     the head to the embedding, a shape that does not fit, an A without
#     its B, a tensor that is not a LoRA matrix; a refused merge leaves no OUT and no temporary
#     directory.
#   - Where peft is installed ($AM_GOLDENV, default /tmp/goldenv), peft's merge_and_unload()
#     on the same base and adapters gives the same tensors within 1e-6, and transformers loads
#     OUT with the same loss as the unmerged PeftModel (within 1e-5); skipped, and said so,
#     without it.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
: "${AM_GOLDENV:=/tmp/goldenv}"
ckpt=$AM_BUILDDIR/am-ckpt
tool=$AM_BUILDDIR/tests/ckpt/peft_merge
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for case in llama_lora_qv llama_lora_all llama_lora_head; do
    g=$AM_SRCDIR/tests/golden/models/$case
    mkdir -p "$T/$case/trained" "$T/$case/base16" "$T/$case/sharded"
    "$tool" shard "$g/base" "$T/$case/sharded" || fail "$case: the sharded base"
    "$tool" trained "$g" "$g/adapter_init" "$T/$case/trained" || fail "$case: the trained adapters"
    "$tool" bf16 "$g/base" "$T/$case/base16" || fail "$case: the bf16 base"
    for run in "base trained" "base16 trained" "sharded trained" "base adapter_init"; do
        set -- $run
        b=$g/base; [ "$1" != base ] && b=$T/$case/$1
        a=$g/adapter_init; [ "$2" = trained ] && a=$T/$case/trained
        out=$T/$case/out-$1-$2
        if ! "$ckpt" merge "$b" "$a" "$out" > "$T/log" 2>&1; then
            fail "$case: am-ckpt merge $1 $2: $(cat "$T/log")"
            continue
        fi
        if "$tool" check "$b" "$a" "$out"; then
            echo "ok: $case: $1 + $2 merged"
        else
            fail "$case: $1 + $2: the merged model"
        fi
        cmp -s "$b/config.json" "$out/config.json" || fail "$case: config.json not copied as it was"
        if [ "$1" = sharded ]; then
            cmp -s "$b/model.safetensors.index.json" "$out/model.safetensors.index.json" &&
                [ "$(ls "$out")" = "$(ls "$b")" ] || fail "$case: the shards or the index not kept"
        fi
    done
done

# the progress line: --progress draws it (ending at 100.0% of the bytes written, then a
# newline), --quiet and a stderr that is not a terminal draw nothing, a terminal does
g=$AM_SRCDIR/tests/golden/models/llama_lora_qv
A=$T/llama_lora_qv/trained
bytes=$(du -b "$g/base/model.safetensors" | cut -f1)
"$ckpt" merge --progress "$g/base" "$A" "$T/p1" >/dev/null 2>"$T/p1.err"
if tr '\r' '\n' <"$T/p1.err" | grep -qE '^am-ckpt merge: 100\.0%  .* of .*B  .*B/s $' && [ "$(tail -c 1 "$T/p1.err" | od -An -c | tr -d ' ')" = '\n' ]; then
    echo "ok: merge --progress: $(tr '\r' '\n' <"$T/p1.err" | grep -c 'am-ckpt merge') progress line(s), the last at 100.0% (the base holds $bytes bytes)"
else
    fail "merge --progress: no line ending at 100.0%: $(cat -A "$T/p1.err")"
fi
"$ckpt" merge --quiet "$g/base" "$A" "$T/p2" >/dev/null 2>"$T/p2.err"
[ -d "$T/p2" ] && [ ! -s "$T/p2.err" ] && echo "ok: merge --quiet: nothing on stderr" || fail "merge --quiet: $(cat "$T/p2.err")"
"$ckpt" merge "$g/base" "$A" "$T/p3" >/dev/null 2>"$T/p3.err"
[ ! -s "$T/p3.err" ] && echo "ok: merge with stderr not a terminal: nothing on stderr" || fail "merge, not a terminal: $(cat "$T/p3.err")"
if command -v script >/dev/null; then
    script -qec "'$ckpt' merge '$g/base' '$A' '$T/p4' >/dev/null" /dev/null >"$T/p4.tty" </dev/null
    grep -q 'am-ckpt merge: 100\.0%' "$T/p4.tty" && echo "ok: merge on a terminal: the progress line by default" ||
        fail "merge on a terminal: no progress line: $(cat -A "$T/p4.tty")"
fi

# refusals: exact messages
A=$T/llama_lora_qv/trained
refuse() { # NAME EXPECTED-MESSAGE BASE PEFT OUT
    local name=$1 want=$2
    shift 2
    "$ckpt" merge "$@" > "$T/out.txt" 2> "$T/err.txt"
    local rc=$?
    if [ $rc != 1 ]; then
        fail "refusal $name: exit status $rc, not 1"
    elif [ "$(cat "$T/err.txt")" != "$want" ]; then
        fail "refusal $name: got: $(cat "$T/err.txt")"
        echo "   want: $want"
    elif ls -d "$3".tmp-* > /dev/null 2>&1; then
        fail "refusal $name: a temporary directory was left"
    else
        echo "ok: refusal $name"
    fi
}
mkdir -p "$T/full" && echo x > "$T/full/keep"
refuse "OUT not empty" "am-ckpt: $T/full: exists and is not empty: am-ckpt merge writes a new directory and never overwrites one: name a directory that does not exist (or is empty)" "$g/base" "$A" "$T/full"
[ "$(cat "$T/full/keep")" = x ] && [ "$(ls "$T/full")" = keep ] || fail "OUT not empty: its contents changed"
refuse "OUT a file" "am-ckpt: $T/full/keep: exists and is not a directory: am-ckpt merge writes a new directory and never overwrites one: name a directory that does not exist (or is empty)" "$g/base" "$A" "$T/full/keep"
mkdir -p "$T/nobase"
refuse "no config.json" "am-ckpt: $T/nobase/config.json: missing: the base is a Hugging Face model directory (config.json and model.safetensors, or its index and shards): name the directory of the model the adapters were trained on" "$T/nobase" "$A" "$T/o1"
refuse "no adapter_config.json" "am-ckpt: $T/nobase/adapter_config.json: missing: an adapter directory holds adapter_config.json and adapter_model.safetensors, as peft saves them: name a step-N/peft directory or one PeftModel.save_pretrained wrote" "$g/base" "$T/nobase" "$T/o1"
mkdir -p "$T/noweights" && cp "$A/adapter_config.json" "$T/noweights/"
refuse "no adapter_model.safetensors" "am-ckpt: $T/noweights/adapter_model.safetensors: missing: an adapter directory holds adapter_config.json and adapter_model.safetensors, as peft saves them: name a step-N/peft directory or one PeftModel.save_pretrained wrote" "$g/base" "$T/noweights" "$T/o1"
for key in use_dora use_rslora fan_in_fan_out; do
    mkdir -p "$T/$key" && cp "$A/adapter_model.safetensors" "$T/$key/"
    sed "s/\"$key\": false/\"$key\": true/" "$A/adapter_config.json" > "$T/$key/adapter_config.json"
done
refuse "DoRA" "am-ckpt: $T/use_dora/adapter_config.json: use_dora is true: DoRA's merge (a magnitude vector over the column norms) is not done here: merge them with peft's merge_and_unload()" "$g/base" "$T/use_dora" "$T/o1"
refuse "rsLoRA" "am-ckpt: $T/use_rslora/adapter_config.json: use_rslora is true: rsLoRA scales by lora_alpha / sqrt(r), not the lora_alpha / r merged here: merge them with peft's merge_and_unload()" "$g/base" "$T/use_rslora" "$T/o1"
refuse "fan_in_fan_out" "am-ckpt: $T/fan_in_fan_out/adapter_config.json: fan_in_fan_out is true: the adapters are for Conv1D layers (GPT-2's), whose weights are transposed: merge them with peft's merge_and_unload()" "$g/base" "$T/fan_in_fan_out" "$T/o1"
for kind in no-B foreign shape extra; do
    mkdir -p "$T/$kind" && "$tool" edit "$A" "$T/$kind" "$kind" || fail "edit $kind"
done
refuse "module the base lacks" "am-ckpt: $T/foreign/adapter_model.safetensors: module model.layers.9.self_attn.q_proj is adapted, but the base model $g/base has no tensor model.layers.9.self_attn.q_proj.weight: the adapters were trained on another model: merge them into the base they were trained on" "$g/base" "$T/foreign" "$T/o1"
refuse "shape" "am-ckpt: $T/shape/adapter_model.safetensors: module model.layers.0.self_attn.q_proj: lora_A is [3, 64] and lora_B [64, 4], but with r 4 the base weight model.layers.0.self_attn.q_proj.weight [64, 64] needs lora_A [4, 64] and lora_B [64, 4]: the adapters were trained on another model (or adapter_config.json's r is not theirs): merge them into the base they were trained on" "$g/base" "$T/shape" "$T/o1"
refuse "A without B" "am-ckpt: $T/no-B/adapter_model.safetensors: module model.layers.0.self_attn.q_proj has lora_A.weight but no lora_B.weight: the file is incomplete: save the adapters again" "$g/base" "$T/no-B" "$T/o1"
refuse "not a LoRA matrix" "am-ckpt: $T/extra/adapter_model.safetensors: tensor base_model.model.model.norm.weight is not a LoRA matrix (base_model.model.MODULE.lora_A.weight or .lora_B.weight): am-ckpt merge merges plain LoRA adapters of linear layers only: merge them with peft's merge_and_unload()" "$g/base" "$T/extra" "$T/o1"
# lm_head's adapter on a base that ties the head to the embedding (the llama_lora_head golden's
# base with lm_head.weight left out, tie_word_embeddings true)
mkdir -p "$T/tied" && "$tool" tie "$AM_SRCDIR/tests/golden/models/llama_lora_head/base" "$T/tied" || fail "the tied base"
refuse "lm_head tied to the embedding" "am-ckpt: $AM_SRCDIR/tests/golden/models/llama_lora_head/adapter_init/adapter_model.safetensors: module lm_head is adapted, but the base model $T/tied ties it to the embedding (no tensor lm_head.weight, tie_word_embeddings): merged, the head's adapter would change model.embed_tokens.weight, the input embedding, too: keep the adapters apart (PeftModel.from_pretrained) or merge them with peft's merge_and_unload()" "$T/tied" "$AM_SRCDIR/tests/golden/models/llama_lora_head/adapter_init" "$T/o1"
[ -e "$T/o1" ] && fail "a refused merge left $T/o1"

# an empty OUT is used
mkdir -p "$T/empty"
"$ckpt" merge "$g/base" "$A" "$T/empty" > /dev/null && [ -f "$T/empty/model.safetensors" ] || fail "merge into an empty directory"

py=$AM_GOLDENV/bin/python
if [ -x "$py" ] && "$py" -c 'import peft, transformers' 2>/dev/null; then
    for case in llama_lora_qv llama_lora_all llama_lora_head; do
        g=$AM_SRCDIR/tests/golden/models/$case
        if "$py" - "$g/base" "$T/$case/trained" "$T/$case/out-base-trained" "$g/golden.safetensors" <<'PY'
import sys
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
base, adapter, out, golden = sys.argv[1:5]
torch.set_num_threads(1)
ids = load_file(golden)["input_ids"].long()
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
model.eval()
with torch.no_grad():
    want_loss = float(model(input_ids=ids, labels=ids).loss)
ref = model.merge_and_unload().state_dict()
ours = load_file(out + "/model.safetensors")
worst = max(float((ref[k].float() - ours[k].float()).abs().max()) for k in ours)
assert set(ref) >= set(ours), "names differ"
loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
loaded.eval()
with torch.no_grad():
    loss = float(loaded(input_ids=ids, labels=ids).loss)
print(f"peft merge_and_unload vs am-ckpt merge: max |diff| {worst:.3g}; transformers loads OUT: loss {loss:.7f}, "
      f"PeftModel {want_loss:.7f}")
sys.exit(0 if worst <= 1e-6 and abs(loss - want_loss) <= 1e-5 else 1)
PY
        then
            echo "ok: $case: peft's merge_and_unload agrees, transformers loads OUT"
        else
            fail "$case: against peft's merge_and_unload"
        fi
    done
else
    echo "skipped: peft is not installed in $AM_GOLDENV (merge_and_unload and transformers' load not checked)"
fi
[ $fails = 0 ]
