#!/bin/bash
# LoRA on a mixture-of-experts model (docs/training.md, "LoRA") end to end with am-train, on CPU:
# the bundled tiny_moe recipe (Mixtral-style, 4 experts, top 2, ep 2) with a peft section on
# the attention projections (AutoModel's target_modules on q, k, v, o), adapter dropout 0.1, in
# fp32; the router and the experts frozen with the base (no gradients, no optimizer state),
#   parity: ep 2, tp 2 x ep 2 and pp 2 against one rank (ep 1): losses within 1e-5, grad norms
#     1e-5 relative (test-parity.sh's fp32 tolerances);
#   the adapters train: the loss falls from step 1 and the gradients are the adapters' alone (a
#     grads_bytes record of the adapter parameters);
#   memory: what LoRA changes of every rank's allocation (the base's gradients and moments gone,
#     the adapters' added) equals what it changes of am-plan's estimate for its pipeline rank, to
#     the byte;
#   checkpoint: step-N/peft holds the attention adapters as peft names them, no expert's.
# (test_recipe checks the refusals of adapters on the experts and on a dense layer's MLP.)
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
AM_BUILDDIR=$(cd "$AM_BUILDDIR" && pwd)
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models} OMP_NUM_THREADS=1
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap '[ -n "${AM_LORA_KEEP:-}" ] || rm -rf "$work"' EXIT
fails=0 passes=0
steps=4 loss_tol=1e-5 norm_tol=1e-5
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

awk 'NF { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, " "); if (p != "") printf "{\"prompt\": \"%s\", \"response\": \"%s\"}\n", p, $0; p = $0 }' \
    /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 | head -600 >"$work/rows.jsonl"
"$AM_BUILDDIR/am-data" build --tokenizer "$AM_SRCDIR/tests/data/tokenizer/gpt2.json" --instruction \
    --eos '<|endoftext|>' --out "$work/ds" "$work/rows.jsonl" >/dev/null || { bad "am-data build --instruction"; exit 1; }

train() { # NAME NPROC [VAR=VALUE...]
    local name=$1 n=$2
    shift 2
    (cd "$work" && env "$@" AM_LOG_DIR="$work/logs-$name" timeout 600 "$AM_BUILDDIR/am-launch" --nproc "$n" \
        "$work/$name.yaml" >"$work/out-$name" 2>&1)
}
steps_of() { # LOGDIR: "step loss grad_norm" of rank 0
    grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"step":([0-9]+),"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2 \3/'
}
memory() { # LOGDIR RANK KEY
    grep -h '"type":"memory"' "$1"/*/rank-"$2".jsonl | sed -E "s/.*\"$3\":([0-9a-z]*).*/\1/"
}
recipe() { # NAME EP: tiny_moe.yaml in fp32 on the instruction data, adapters on the attention
    sed -e "s|paths: .*|paths: $work/ds|" -e "s/vocab_size: .*/vocab_size: 1024/" -e "s/max_steps: .*/max_steps: $steps/" \
        -e "s/ep_size: .*/ep_size: $2/" -e 's/^  ep_size: \(.*\)/  ep_size: \1\n  mp_policy:\n    param_dtype: float32/' \
        "$AM_SRCDIR/sbatch-templates/recipes/tiny_moe.yaml" >"$work/$1.yaml"
    cat >>"$work/$1.yaml" <<YAML

peft:
  _target_: nemo_automodel.components._peft.lora.PeftConfig
  target_modules: ['*.q_proj', '*.k_proj', '*.v_proj', '*.o_proj']
  dim: 8
  alpha: 32
  dropout: 0.1

checkpoint:
  enabled: true
  checkpoint_dir: $work/ckpt-$1
YAML
}

recipe ref 1
train ref 1 || { sed 's/^/    /' "$work/out-ref"; bad "LoRA on tiny_moe did not train on one rank"; exit 1; }
steps_of "$work/logs-ref" >"$work/steps-ref"
if [ "$(wc -l <"$work/steps-ref")" = "$steps" ] &&
    awk 'NR == 1 { a = $2 } END { exit !($2 < a) }' "$work/steps-ref" &&
    [ "$(memory "$work/logs-ref" 0 grads_bytes)" = "$(($(memory "$work/logs-ref" 0 adapter_params) * 4))" ]; then
    ok "LoRA on tiny_moe, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-ref"); gradients of the $(memory "$work/logs-ref" 0 adapter_params) adapter parameters only"
else
    bad "LoRA on tiny_moe, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-ref"), grads_bytes $(memory "$work/logs-ref" 0 grads_bytes) for $(memory "$work/logs-ref" 0 adapter_params) adapter parameters"
fi
ad="$work/ckpt-ref/step-$steps/peft/adapter_model.safetensors"
if [ -f "$ad" ] && grep -q 'base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight' "$ad" &&
    ! grep -q 'experts' "$ad" && grep -q '"lora_dropout": 0.1' "$work/ckpt-ref/step-$steps/peft/adapter_config.json"; then
    ok "step-$steps/peft holds the attention adapters as peft names them (no expert's), lora_dropout 0.1"
else
    bad "step-$steps/peft: $(ls "$work/ckpt-ref/step-$steps/peft" 2>&1 | tr '\n' ' ')"
fi

for layout in "ep2 2 2" "tp2-ep2 4 2 AM_TP=2" "pp2 2 1 AM_PP=2"; do
    set -- $layout
    name=$1 n=$2 ep=$3
    shift 3
    recipe "$name" "$ep"
    if ! train "$name" "$n" "$@"; then
        bad "$name did not train"; sed 's/^/    /' "$work/out-$name"; continue
    fi
    steps_of "$work/logs-$name" >"$work/steps-$name"
    if paste "$work/steps-ref" "$work/steps-$name" | awk -v steps="$steps" -v lt="$loss_tol" -v nt="$norm_tol" '
        { d = $2 - $5; if (d < 0) d = -d; if (d > w) w = d; g = ($3 - $6) / $3; if (g < 0) g = -g; if (g > gw) gw = g; n++ }
        END { printf "%d steps, loss %.2g (tolerance %.2g), grad norm %.2g relative (%.2g)", n, w, lt, gw, nt
              exit !(n == steps && w <= lt && gw <= nt) }' >"$work/cmp-$name"; then
        ok "LoRA on tiny_moe $name matches one rank: $(cat "$work/cmp-$name")"
    else
        bad "LoRA on tiny_moe $name: $(cat "$work/cmp-$name")"; paste "$work/steps-ref" "$work/steps-$name" | sed 's/^/    /'
    fi
done

# memory: what LoRA changes of every rank's allocation (the adapters, their gradients, moments and
# scratch added; the frozen base's gradients and moments gone) equals what it changes of am-plan's
# estimate for its pipeline rank, to the byte:
# each layout run again without the peft section (one step) and both compared with am-plan's.
# (Compared as differences: the MoE model's own allocation was a few hundred bytes off
# am-plan's estimate, with or without LoRA, until am-plan counted each MoE layer's tokens per
# expert as the 64-byte buffer am-train carves; test-parity.sh checks the totals themselves.)
total_of() { # LOGDIR RANK: the bytes the rank allocated
    local t=0 key v
    for key in weights_bytes grads_bytes optimizer_bytes gathered_bytes grad_buffers_bytes act_bytes pipe_bytes; do
        v=$(memory "$1" "$2" $key)
        t=$((t + ${v:-0}))
    done
    echo "$t"
}
plan_of() { # RECIPE NPROC SETS...: am-plan's total of each pp rank
    local y=$1 n=$2
    shift 2
    "$AM_BUILDDIR/am-plan" "$y" --gpus-per-node "$n" --json "$@" | sed -E 's/.*"memory_per_pp_rank"://' |
        grep -oE '"pp_rank":[0-9]+,"total":[0-9.e+]+' | sed -E 's/.*"total":([0-9.e+]+)/\1/'
}
for run in "ref 1" "ep2 2" "tp2-ep2 4 AM_TP=2" "pp2 2 AM_PP=2"; do
    set -- $run
    name=$1 n=$2
    shift 2
    sets=()
    for v in "$@"; do
        case $v in AM_TP=*) sets+=(--set "distributed.tp_size=${v#*=}") ;; AM_PP=*) sets+=(--set "distributed.pp_size=${v#*=}") ;; esac
    done
    sed -e '/^peft:/,$d' -e 's/max_steps: .*/max_steps: 1/' "$work/$name.yaml" >"$work/$name-base.yaml"
    if ! train "$name-base" "$n" "$@"; then
        bad "$name without LoRA did not train"; sed 's/^/    /' "$work/out-$name-base"; continue
    fi
    wl=($(plan_of "$work/$name.yaml" "$n" "${sets[@]}")) wb=($(plan_of "$work/$name-base.yaml" "$n" "${sets[@]}"))
    equal=0 detail=
    for r in $(seq 0 $((n - 1))); do
        pp=$(grep -h '"coords":{"pp":' "$work/logs-$name"/*/rank-"$r".jsonl | sed -E 's/.*"coords":\{"pp":([0-9]+).*/\1/')
        got=$(($(total_of "$work/logs-$name" "$r") - $(total_of "$work/logs-$name-base" "$r")))
        want=$(awk -v a="${wl[$pp]:-0}" -v b="${wb[$pp]:-0}" 'BEGIN { printf "%d", a - b }')
        if [ "$got" = "$want" ]; then
            equal=$((equal + 1))
        else
            detail="$detail rank $r (pp $pp): LoRA changes the allocation by $got bytes, am-plan by $want;"
        fi
    done
    if [ "$equal" = "$n" ]; then
        ok "LoRA on tiny_moe $name: LoRA changes every rank's allocation by what it changes am-plan's estimate, to the byte"
    else
        bad "LoRA on tiny_moe $name: allocation off am-plan's estimate:$detail"
    fi
done

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
