#!/bin/bash
# Transformer Engine's FusedAdam as AutoModel's Pattern A trains with it (docs/training.md):
# bf16 parameters (model.torch_dtype: bfloat16, bf16 compute), fp32 master weights
# (master_weights: true, store_param_remainders: true) and fp32 moments, TE's update
# (kernels.h, am_adamw_tensor.te). The tiny recipe, 8 steps, on the CPU:
#   - one rank, and fsdp2 at dp 2 against it;
#   - each rank's weights, gradients, optimizer, gathered and gradient buffer bytes equal to
#     am-plan's to the byte (with store_param_remainders the bf16 parameters 2 B and their
#     remainders 2 B beside fp32 moments 8 B a parameter; without, fp32 masters 4 B and their
#     bf16 compute copy 2 B);
#   - with store_param_remainders against without it: the same fp32 masters, the parameters
#     rounded from them with ties away from zero instead of to even (within a tenth of the
#     tolerances below);
#   - against torch's AdamW with fp32 masters and moments and the same bf16 compute
#     (model.torch_dtype: float32): the two update rules differ in fp32 rounding only (TE
#     divides m and v by the bias corrections, torch scales the step), but TE's gradient is
#     the bf16 parameters' (rounded to bf16, as FSDP2 casts it) where torch's fp32 masters keep
#     it fp32, and TE's masters begin as the bf16 parameters where torch's are the fp32 draw:
#     differences of bf16's order, so the tolerance is the bf16 layouts' (twice one
#     rank's bf16-vs-fp32 distance on this recipe: loss, grad norm relative, weights);
#   - bf16 moments at dp 2: within the same tolerances
#     of fp32 moments, its memory am-plan's (2 + 2 B of moments a parameter);
#   - the Hugging Face save in the parameters' dtype (bf16, config.json torch_dtype bfloat16),
#     not the masters'.
# The checkpoints are saved at the last step (checkpoint.enabled true).
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap '[ -n "${AM_TE_KEEP:-}" ] || rm -rf "$work"' EXIT
fails=0 passes=0 steps=8
ok() { echo "ok: $1"; passes=$((passes + 1)); }
bad() { echo "FAIL: $1"; fails=$((fails + 1)); }

"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
sed -e "s|paths: .*|paths: $work/corpus|" -e "s/max_steps: .*/max_steps: $steps/" \
    -e 's/enabled: false/enabled: true/' "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/base.yaml"
te='_target_: transformer_engine.pytorch.optimizers.fused_adam.FusedAdam\n  adam_w_mode: true\n  bias_correction: true\n  master_weights: true\n  store_param_remainders: true\n  exp_avg_dtype: torch.float32\n  exp_avg_sq_dtype: torch.float32'
recipe() { # NAME MODS
    local name=$1 args=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$1|") m
    for m in ${2//,/ }; do
        case $m in
        bf16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16/') ;;
        p16) args+=(-e 's/torch_dtype: float32/torch_dtype: bfloat16/') ;;
        te) args+=(-e "s/_target_: torch.optim.AdamW/$te/") ;;
        full) args+=(-e 's/store_param_remainders: true/store_param_remainders: false/') ;;
        m16) args+=(-e 's/exp_avg_dtype: torch.float32/exp_avg_dtype: torch.bfloat16/'
                    -e 's/exp_avg_sq_dtype: torch.float32/exp_avg_sq_dtype: torch.bfloat16/') ;;
        -) ;;
        esac
    done
    sed "${args[@]}" "$work/base.yaml" >"$work/$name.yaml"
}
run() { # NAME N MODS
    recipe "$1" "$3"
    (cd "$work" && AM_LOG_DIR="$work/logs-$1" "$AM_BUILDDIR/am-launch" --nproc "$2" "$work/$1.yaml" >"$work/out-$1" 2>&1) ||
        { echo "FAIL: $1 ($2 ranks) did not train"; cat "$work/out-$1"; exit 1; }
    grep -h '"type":"step"' "$work/logs-$1"/*/rank-0.jsonl |
        sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/' >"$work/$1"
    [ "$(wc -l <"$work/$1")" = "$steps" ] || { echo "FAIL: $1 logged $(wc -l <"$work/$1") steps"; exit 1; }
}
memory() { grep -h '"type":"memory"' "$1"/*/rank-"$2".jsonl | sed -E "s/.*\"$3\":([0-9a-z]*).*/\1/"; }
dist() { # A B: "loss grad_norm(relative) weights" largest differences
    local w
    w=$("$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-$1/step-$steps/hf" "$work/ckpt-$2/step-$steps/hf" 1e9 2>&1 |
        sed -nE 's/.*largest difference ([^ ]*) .*/\1/p')
    paste "$work/$1" "$work/$2" | awk -v w="$w" '
        { d = $1 - $3; if (d < 0) d = -d; if (d > l) l = d; g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > n) n = g }
        END { printf "%.3g %.3g %.3g", l, n, w }'
}
within() { # WHAT DIST TOLS
    local d=($2) t=($3)
    if awk -v a="${d[0]}" -v b="${d[1]}" -v c="${d[2]}" -v x="${t[0]}" -v y="${t[1]}" -v z="${t[2]}" \
        'BEGIN { exit !(a <= x && b <= y && c <= z) }'; then
        ok "$1: loss $(echo "$2" | cut -d' ' -f1), grad norm $(echo "$2" | cut -d' ' -f2) relative, weights $(echo "$2" | cut -d' ' -f3) (tolerances $3)"
    else
        bad "$1: loss, grad norm, weights $2 beyond $3"
        paste "$work/$4" "$work/$5" | sed 's/^/    /'
    fi
}

run ref 1 -              # fp32 throughout, torch's AdamW
run mp 1 bf16            # torch's AdamW: fp32 masters and moments, bf16 compute
run te 1 p16,bf16,te     # FusedAdam, Pattern A
run te-dp2 2 p16,bf16,te # the same at fsdp2 dp 2
run te16-dp2 2 p16,bf16,te,m16 # bf16 moments (AutoModel's MoE convergence recipes)
run te-full 1 p16,bf16,te,full # fp32 masters kept whole (store_param_remainders false)

read -r l n w <<<"$(dist ref mp)"
# FusedAdam's saves are bf16 (the parameters'): a weight's two roundings may part by one bf16
# ulp more (2^-7 for the tiny model's weights, all below 2 in magnitude)
tol=$(awk -v l="$l" -v n="$n" -v w="$w" 'BEGIN { printf "%.3g %.3g %.3g", 2 * l, 2 * n, 2 * w + 2 ^ -7 }')
awk -v t="$l" 'BEGIN { exit !(t > 1e-4) }' && ok "bf16 compute differs from fp32 on one rank (loss by $l): tolerances $tol" ||
    bad "bf16 compute does not differ from fp32 (loss $l): is bf16 used?"
within "FusedAdam (bf16 parameters, fp32 masters and moments) against torch's AdamW with fp32 masters" "$(dist mp te-full)" "$tol" mp te-full
within "FusedAdam at fsdp2 dp 2 against one rank" "$(dist te te-dp2)" "$tol" te te-dp2
# the same masters but where a split rounds a tie apart (one value in 65536 of a step): a tenth of
# the tolerances above, and one bf16 ulp of the weights
tol_ties=$(awk -v l="$l" -v n="$n" 'BEGIN { printf "%.3g %.3g %.3g", 0.2 * l, 0.2 * n, 2 ^ -7 }')
within "FusedAdam's masters as parameters and remainders against whole fp32 masters" "$(dist te-full te)" "$tol_ties" te-full te
within "FusedAdam with bf16 moments at dp 2 against fp32 moments on one rank" "$(dist te te16-dp2)" "$tol" te te16-dp2
d=$(dist mp te)
[ "${d%% *}" != 0 ] && ok "FusedAdam's run is not torch's (loss differs by ${d%% *})" || bad "FusedAdam's losses are torch's exactly: is its update used?"

# memory: every rank's record is am-plan's
for layout in "te 1" "te-dp2 2" "mp 1" "te16-dp2 2" "te-full 1"; do
    set -- $layout
    want=$("$AM_BUILDDIR/am-plan" "$work/$1.yaml" --gpus-per-node "$2" --json |
        sed -nE 's/.*"memory_breakdown":\{"weights":([0-9.]+),"grads":([0-9.]+),"optimizer":([0-9.]+),"gathered_params":([0-9.]+),"grad_buffers":([0-9.]+).*/\1 \2 \3 \4 \5/p' |
        awk '{ printf "%d %d %d %d %d", $1, $2, $3, $4, $5 }')
    good=1
    for r in $(seq 0 $(($2 - 1))); do
        got="$(memory "$work/logs-$1" "$r" weights_bytes) $(memory "$work/logs-$1" "$r" grads_bytes) $(memory "$work/logs-$1" "$r" optimizer_bytes) $(memory "$work/logs-$1" "$r" gathered_bytes) $(memory "$work/logs-$1" "$r" grad_buffers_bytes)"
        [ "$got" = "$want" ] || { bad "$1 rank $r: weights, gradients, optimizer, gathered, gradient buffer bytes ($got) are not am-plan's ($want)"; good=0; }
    done
    [ "$good" = 1 ] && ok "$1: every rank's weights, gradients, optimizer, gathered, gradient buffer bytes are am-plan's ($want)"
done
# whole fp32 masters (4 B) + bf16 copy (2 B) a parameter, as torch's fp32 masters under bf16
# compute; with remainders the bf16 parameters (2 B) and, beside the moments (8 B), their
# remainders (2 B)
[ "$(memory "$work/logs-te-full" 0 weights_bytes) $(memory "$work/logs-te-full" 0 optimizer_bytes)" = \
  "$(memory "$work/logs-mp" 0 weights_bytes) $(memory "$work/logs-mp" 0 optimizer_bytes)" ] &&
    ok "FusedAdam's masters, copy and moments take torch's fp32-master bytes" || bad "FusedAdam's weight or optimizer bytes differ from torch's fp32 masters'"
read -r wf of <<<"$(memory "$work/logs-te-full" 0 weights_bytes) $(memory "$work/logs-te-full" 0 optimizer_bytes)"
read -r wr or <<<"$(memory "$work/logs-te" 0 weights_bytes) $(memory "$work/logs-te" 0 optimizer_bytes)"
[ $((wr * 3)) = "$wf" ] && [ $((or * 4)) = $((of * 5)) ] &&
    ok "store_param_remainders: weights $wr B (a third of $wf), optimizer $or B (5/4 of $of): 4 B a parameter less" ||
    bad "store_param_remainders: weights $wr and optimizer $or bytes, against $wf and $of without it"

# resume: te-dp2 killed at step 5 (checkpoints every 2 steps) and started again continues from
# step 4 to te-dp2's losses and gradient norms to the last bit (fp32 masters and moments on disk,
# rebuilt from the parameters and their remainders, split again at the restore)
recipe te-res p16,bf16,te
sed -i -e 's/ckpt_every_steps: .*/ckpt_every_steps: 2/' "$work/te-res.yaml"
(cd "$work" && AM_FAULT="rank=1,step=5,kind=kill" AM_LOG_DIR="$work/logs-te-res-1" "$AM_BUILDDIR/am-launch" --nproc 2 \
    "$work/te-res.yaml" >"$work/out-te-res-1" 2>&1)
(cd "$work" && AM_LOG_DIR="$work/logs-te-res-2" "$AM_BUILDDIR/am-launch" --nproc 2 "$work/te-res.yaml" >"$work/out-te-res-2" 2>&1)
steps_of() { grep -h '"type":"step"' "$work/logs-$1"/*/rank-0.jsonl | sed -E 's/.*"step":([0-9]*),.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2 \3/'; }
got=$(steps_of te-res-2 | awk '{ print $2, $3 }')
if grep -q '"type":"restore".*"step":4' "$work"/logs-te-res-2/*/rank-0.jsonl && [ -n "$got" ] &&
    [ "$got" = "$(tail -n 4 "$work/te-dp2")" ]; then
    ok "FusedAdam killed at step 5 resumes from step 4 to the uninterrupted run's steps 5-8, bit for bit"
else
    bad "FusedAdam's resume: steps 5-8 '$got' are not the uninterrupted run's"; tail -5 "$work/out-te-res-2"
fi

# the Hugging Face save: bf16, as the parameters
hf=$work/ckpt-te/step-$steps/hf
if grep -q '"torch_dtype": *"bfloat16"' "$hf/config.json" && head -c 20000 "$hf"/*.safetensors | grep -q '"dtype":"BF16"' &&
    ! head -c 20000 "$hf"/*.safetensors | grep -q '"dtype":"F32"'; then
    ok "FusedAdam's Hugging Face save is bf16 (the parameters' dtype), its config torch_dtype bfloat16"
else
    bad "FusedAdam's Hugging Face save is not bf16: $(grep torch_dtype "$hf/config.json")"
fi
# am-ckpt export writes the run's own save's dtype (the manifest's model_dtype, bf16), not the
# fp32 masters' the shards hold, rounded as the run split them (optimizer.param_remainders):
# the same bytes as the save
if "$AM_BUILDDIR/am-ckpt" export "$work/ckpt-te/step-$steps" "$work/export-te" >/dev/null 2>&1 &&
    cmp -s "$hf/model.safetensors" "$work/export-te/model.safetensors" && cmp -s "$hf/config.json" "$work/export-te/config.json"; then
    ok "am-ckpt export of FusedAdam's checkpoint (fp32 masters in the shards) is its bf16 save, byte for byte"
else
    bad "am-ckpt export of FusedAdam's checkpoint differs from its bf16 save (or failed)"
fi

echo "te-adam: $passes passed, $fails failed"
[ "$fails" = 0 ]
