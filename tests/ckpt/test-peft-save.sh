#!/bin/bash
# test-peft-save.sh - LoRA adapters written by am (runtime/ckpt/peft.h) as the peft library
# writes them: for each golden LoRA case, tests/ckpt/peft_save rewrites the adapters peft saved
# (names, shapes, bits, adapter_config.json checked); then, where the peft library is installed
# ($AM_GOLDENV, default /tmp/goldenv: tests/golden/README.md), peft loads am's directory onto the
# case's base model and must give the golden's loss (within 1e-6). Without peft that second
# check is skipped and said so.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
: "${AM_GOLDENV:=/tmp/goldenv}"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
py=$AM_GOLDENV/bin/python
have_peft=0
[ -x "$py" ] && "$py" -c 'import peft, transformers' 2>/dev/null && have_peft=1
for case in llama_lora_qv llama_lora_all gpt_oss_lora; do
    g=$AM_SRCDIR/tests/golden/models/$case
    if ! "$AM_BUILDDIR/tests/ckpt/peft_save" "$g/adapter_init" "$T/$case"; then
        echo "FAIL: $case: peft_save"
        fails=$((fails + 1))
        continue
    fi
    if [ $have_peft = 0 ]; then
        echo "skipped: $case: peft is not installed in $AM_GOLDENV (the load by peft is not checked)"
        continue
    fi
    if "$py" - "$g" "$T/$case" <<'PY'
import sys
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
g, out = sys.argv[1], sys.argv[2]
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
gold = load_file(g + "/golden.safetensors")
base = AutoModelForCausalLM.from_pretrained(g + "/base", dtype=torch.float32, attn_implementation="eager")
model = PeftModel.from_pretrained(base, out)
model.eval()
ids = gold["input_ids"].long()
with torch.no_grad():
    loss = float(model(input_ids=ids, labels=ids).loss)
want = float(gold["loss"][0])
print(f"peft loads am's adapters: loss {loss:.7f}, golden {want:.7f}")
sys.exit(0 if abs(loss - want) <= 1e-6 else 1)
PY
    then
        echo "ok: $case: peft loads am's adapter directory"
    else
        echo "FAIL: $case: peft's load of am's adapter directory"
        fails=$((fails + 1))
    fi
done
[ $fails = 0 ]
