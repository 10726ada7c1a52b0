#!/bin/bash
# automodel_examples.sh - am-plan over NeMo AutoModel's public LLM example recipes.
#
#   bench/automodel_examples.sh AUTOMODEL_CHECKOUT [AM_PLAN] [OUT_DIR]
#
# Runs `am-plan RECIPE --nodes N --gpus-per-node 8 --gpu-mem 80G --json` for every recipe under
# examples/{llm_finetune,llm_pretrain,llm_benchmark,llm_kd,llm_seq_cls,convergence,
# long_context_validation} and N in 1, 2, 4, 8, and counts the outcomes by the first error's
# kind: planned, or refused because of a missing config.json, an architecture am does not
# build, a model or recipe that is not a causal LM, an optimizer am does not run, a feature am
# does not run (LoRA, distillation, fp8, quantization, ...), the layout or batch rules, memory
# over 80 GiB, a combination am-train does not run yet ("run"), or anything else ("other": to be
# read). A dataset am-train does not read (AutoModel's Hugging Face datasets: every example) is
# set aside: a run refused for it alone is "plan-dataset" (planned; am-train needs dataset.paths). OUT_DIR (default a temporary
# directory) keeps one line per run: "RECIPE N KIND first error".
set -u
src=${1:?usage: automodel_examples.sh AUTOMODEL_CHECKOUT [AM_PLAN] [OUT_DIR]}
plan=${2:-$(dirname "$0")/../am-plan}
out=${3:-$(mktemp -d)}
mkdir -p "$out"
: >"$out/runs"
# planning needs no weights: the configs shipped with am, and an empty Hugging Face cache
export AM_MODELS_DIR=${AM_MODELS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/runtime/recipe/models}
export HF_HUB_CACHE=${HF_HUB_CACHE:-$out/empty-hub-cache}
kind() { # RC FIRST_ERROR -> a kind (read in the message, not in its position: a recipe's name may
    # say peft.)
    [ "$1" = 0 ] && { echo plan; return; }
    local msg=$2 re='^[^ ]*\.ya?ml(:[0-9]+:[0-9]+)?: (.*)$' # "FILE: message", "FILE:LINE:COL: key: message"
    [[ $msg =~ $re ]] && msg=${BASH_REMATCH[2]}
    case $msg in
    *"not found; looked in"*) echo no-config ;;
    *"model_type: '"*"is not supported"*|*"is not an architecture am builds"*) echo architecture ;;
    *"is not a causal language model"*|*"recipe: "*" trains a"*) echo not-causal-lm ;;
    *"is not an optimizer am runs"*) echo optimizer ;;
    *"peft: "*|*"peft."*) echo lora ;;
    *"knowledge distillation"*) echo distillation ;;
    *"fp8.enabled"*|*"te_fp8"*|*"MXFP8"*|*"quantiz"*|*"freezing"*|*"NEFTune"*) echo feature ;;
    *"so far, and the compute dtype"*|*"not run yet"*|*"does not do yet"*|*"does not compute"*|*"needs loss scaling"*|*"is not run by am-train"*|\
        *"not built yet"*|*"not exchanged between stages"*|*"experts are replicated over"*) echo run ;;
    *"estimated memory per GPU"*) echo memory ;;
    *"distributed."*|*"step_scheduler."*) echo layout ;;
    *) echo other ;;
    esac
}
n=0
for dir in llm_finetune llm_pretrain llm_benchmark llm_kd llm_seq_cls convergence long_context_validation; do
    [ -d "$src/examples/$dir" ] || continue
    while IFS= read -r f; do
        n=$((n + 1))
        for nodes in 1 2 4 8; do
            line=$("$plan" "$f" --nodes "$nodes" --gpus-per-node 8 --gpu-mem 80G --json 2>&1)
            status=$?
            line=$(tail -1 <<<"$line")
            if [ "$status" -gt 1 ]; then # a crash, or a command line am-plan refused
                echo "${f#"$src"/} $nodes crash exit status $status" >>"$out/runs"
                continue
            fi
            # the first error but the dataset's (every example names a dataset am-train does not
            # read: counted apart, so that the other outcomes still show)
            read -r has_dataset first < <(python3 -c '
import json, sys
errs = json.loads(sys.argv[1]).get("errors", [])
rest = [e for e in errs if "is not a dataset am reads" not in e and "dataset.paths: missing" not in e]
print(int(len(rest) < len(errs)), rest[0] if rest else "")' "$line" 2>/dev/null || echo "0 unreadable")
            [ -z "$first" ] && rc=0 || rc=1
            k=$(kind "$rc" "$first")
            [ "$k" = plan ] && [ "$has_dataset" = 1 ] && k=plan-dataset
            echo "${f#"$src"/} $nodes $k $first" >>"$out/runs"
        done
    done < <(find "$src/examples/$dir" -name '*.yaml' -o -name '*.yml' | sort)
done
echo "recipes: $n, runs: $((n * 4)) (nodes 1, 2, 4, 8 x 8 GPUs of 80 GiB)"
awk '{print $3}' "$out/runs" | sort | uniq -c | sort -rn
echo "recipes planned on at least one node count: $(awk '$3 ~ /^plan/ {print $1}' "$out/runs" | sort -u | wc -l) (plan-dataset: planned, and refused by am-train for its dataset alone)"
echo "runs: $out/runs"
