#!/bin/bash
# LoRA with an adapter on lm_head (docs/training.md, "LoRA"), end to end with am-train on CPU:
# sbatch-templates/recipes/tiny_lora.yaml (its inline base) with match_all_linear: true, as
# AutoModel's recipes select every linear layer, lm_head included:
#   parity: tp 2 (B split with the vocabulary, A's gradient summed over tp), pp 2 (the adapter
#     on the last stage), tp 2 x pp 2 and tp 2 x dp 2 with sequence parallelism against one
#     rank: losses within 1e-5, grad norms 1e-5 relative (test-parity.sh's tolerances); with
#     tied embeddings (the adapter on the head's output, the embedding untouched) pp 2 and tp 2
#     against one tied rank; in bf16, tp 2 against one rank's bf16 run within twice its
#     distance from fp32;
#   the adapter trains: the run with lm_head differs from the run without it;
#   resume: stopped after step 3 and restored, steps 4-6 equal the uninterrupted run's to the
#     last bit, at one rank and at tp 2 x pp 2;
#   saved as peft saves it: step-N/peft/adapter_model.safetensors holds
#     base_model.model.lm_head.lora_A.weight [dim, hidden] and lora_B [vocab, dim], gathered
#     over tp, adapter_config.json's target_modules lists lm_head;
#   memory: every rank's allocation equals am-plan's estimate for its pipeline rank (less the
#     CUDA kernels' scratch) to the byte, at every layout.
set -u
steps=6 loss_tol=1e-5 norm_tol=1e-5
source "$(dirname "$0")/lora-lib.sh"

lora_dataset 300 GPL-3


# tiny_lora.yaml, short, every linear layer adapted (lm_head included)
sed -e "s|paths: .*|paths: $work/ds|" -e "s/max_steps: .*/max_steps: $steps/" \
    -e 's/ckpt_every_steps: .*/ckpt_every_steps: 1000/' \
    -e 's/target_modules: .*/match_all_linear: true/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny_lora.yaml" >"$work/lora.yaml"
recipe() { # NAME MODS: lora.yaml with changes, its checkpoints under ckpt-NAME
    local name=$1 mods=$2 m
    local args=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$name|")
    for m in ${mods//,/ }; do
        case $m in
        sp) args+=(-e 's/sequence_parallel: false/sequence_parallel: true/') ;;
        tied) args+=(-e 's/tie_word_embeddings: false/tie_word_embeddings: true/') ;;
        bf16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16/') ;;
        nohead) args+=(-e "s/match_all_linear: true/target_modules: ['*_proj']/") ;;
        every3) args+=(-e 's/ckpt_every_steps: .*/ckpt_every_steps: 3/') ;;
        stop3) args+=(-e 's/max_steps: .*/max_steps: 3/') ;;
        ckpt=*) args+=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-${m#ckpt=}|") ;;
        -) ;;
        esac
    done
    sed "${args[@]}" "$work/lora.yaml" >"$work/$name.yaml"
}
run() { # NAME NPROC MODS [VAR=VALUE...]: trains, rank 0's steps in steps-NAME
    local name=$1 n=$2 mods=$3
    shift 3
    recipe "$name" "$mods"
    if ! train "$name" "$n" "$work/$name.yaml" "$@"; then
        bad "$name did not train"; sed 's/^/    /' "$work/out-$name" | tail -n 20; return 1
    fi
    steps_of "$work/logs-$name" >"$work/steps-$name"
}

run ref 1 - || exit 1
ok "one rank with an adapter on lm_head: losses $(awk '{ printf "%s ", $2 }' "$work/steps-ref")"
if run nohead 1 nohead; then
    if ! cmp -s "$work/steps-ref" "$work/steps-nohead"; then
        ok "the adapter on lm_head changes the training (losses without it: $(awk '{ printf "%s ", $2 }' "$work/steps-nohead"))"
    else
        bad "the run with an adapter on lm_head gives the losses of the run without it"
    fi
fi

# parity: NAME NPROC MODS REF [VAR=VALUE...]
run ref-tied 1 tied
for layout in "tp2 2 - ref AM_TP=2" "pp2 2 - ref AM_PP=2" "tp2-pp2 4 - ref AM_TP=2 AM_PP=2" \
    "tp2-dp2-sp 4 sp ref AM_TP=2" "tied-pp2 2 tied ref-tied AM_PP=2" "tied-tp2 2 tied ref-tied AM_TP=2"; do
    set -- $layout
    name=$1 n=$2 mods=$3 ref=$4
    shift 4
    run "$name" "$n" "$mods" "$@" || continue
    if compare "$ref" "$name"; then
        ok "LoRA on lm_head, $name matches $ref: $(cat "$work/cmp-$name")"
    else
        bad "LoRA on lm_head, $name against $ref: $(cat "$work/cmp-$name")"; paste "$work/steps-$ref" "$work/steps-$name" | sed 's/^/    /'
    fi
done

# bf16: tp 2 against one rank's bf16 run, within twice one rank's bf16-vs-fp32 distance
if run ref-bf16 1 bf16 && run bf16-tp2 2 bf16 AM_TP=2; then
    tol=$(bf16_tol ref ref-bf16)
    if ! awk -v t="${tol%% *}" 'BEGIN { exit !(t > 1e-5) }'; then
        bad "one rank's bf16 run is not different from fp32 ($tol): is bf16 used?"
    elif compare ref-bf16 bf16-tp2 "${tol%% *}" "${tol##* }"; then
        ok "LoRA on lm_head in bf16, tp 2 matches one rank's bf16 run: $(cat "$work/cmp-bf16-tp2")"
    else
        bad "LoRA on lm_head in bf16, tp 2 against one rank: $(cat "$work/cmp-bf16-tp2")"
    fi
fi

# resume: stopped after step 3 and restored from its checkpoint, steps 4-6 are the uninterrupted
# run's to the last bit (the head's adapter and its AdamW moments in the sharded state)
for layout in "r1 1 ref" "r-tp2-pp2 4 tp2-pp2 AM_TP=2 AM_PP=2"; do
    set -- $layout
    name=$1 n=$2 ref=$3
    shift 3
    run "$name-stop" "$n" "every3,stop3,ckpt=$name" "$@" || continue
    run "$name-cont" "$n" "every3,ckpt=$name" "$@" || continue
    if [ -s "$work/steps-$ref" ] && [ "$(tail -n 3 "$work/steps-$ref")" = "$(cat "$work/steps-$name-cont")" ]; then
        ok "$name: restored after step 3, steps 4-6 are $ref's to the last bit"
    else
        bad "$name: the resumed steps differ from $ref's"
        paste <(tail -n 3 "$work/steps-$ref") "$work/steps-$name-cont" | sed 's/^/    /'
    fi
done

# the saved adapters, as peft saves them, gathered over tp
st="$work/ckpt-tp2/step-$steps/peft"
if python3 - "$st/adapter_model.safetensors" "$st/adapter_config.json" >"$work/out-saved" 2>&1 <<'PY'
import json, struct, sys
f = open(sys.argv[1], "rb")
n = struct.unpack("<Q", f.read(8))[0]
h = json.loads(f.read(n))
a, b = h["base_model.model.lm_head.lora_A.weight"], h["base_model.model.lm_head.lora_B.weight"]
assert a["shape"] == [8, 64] and b["shape"] == [1024, 8], (a["shape"], b["shape"])
assert "lm_head" in json.load(open(sys.argv[2]))["target_modules"]
print(f"lm_head.lora_A {a['shape']}, lora_B {b['shape']}, {len(h) - 1} tensors, target_modules lists lm_head")
PY
then
    ok "tp 2 saves the head's adapter whole: $(cat "$work/out-saved")"
else
    bad "the saved adapters of tp 2"; sed 's/^/    /' "$work/out-saved"
fi

# every rank's whole allocation equals am-plan's estimate for its pipeline rank (less the CUDA
# kernels' scratch) to the byte (NAME NPROC SETS...)
for run in "ref 1" "tp2 2 distributed.tp_size=2" "pp2 2 distributed.pp_size=2" \
    "tp2-pp2 4 distributed.tp_size=2 distributed.pp_size=2" "tp2-dp2-sp 4 distributed.tp_size=2" \
    "tied-pp2 2 distributed.pp_size=2" "bf16-tp2 2 distributed.tp_size=2"; do
    set -- $run
    name=$1 n=$2
    shift 2
    [ -s "$work/steps-$name" ] || continue
    sets=()
    for v in "$@"; do sets+=(--set "$v"); done
    wants=($("$AM_BUILDDIR/am-plan" "$work/$name.yaml" --gpus-per-node "$n" --json "${sets[@]}" |
        sed -E 's/.*"memory_per_pp_rank"://' |
        grep -oE '"kernel_scratch":[0-9.e+]+,"pipeline_buffers":[0-9.e+]+,"alltoall_buffers":[0-9.e+]+,"pp_rank":[0-9]+,"total":[0-9.e+]+' |
        sed -E 's/"kernel_scratch":([0-9.e+]+),.*"total":([0-9.e+]+)/\1 \2/' | awk '{ printf "%.0f\n", $2 - $1 }'))
    equal=0 detail=
    for r in $(seq 0 $((n - 1))); do
        t=0
        for key in weights_bytes grads_bytes optimizer_bytes gathered_bytes grad_buffers_bytes act_bytes pipe_bytes; do
            t=$((t + $(memory "$work/logs-$name" "$r" $key)))
        done
        pp=$(grep -h '"coords":{"pp":' "$work/logs-$name"/*/rank-"$r".jsonl | sed -E 's/.*"coords":\{"pp":([0-9]+).*/\1/')
        want=${wants[$pp]:-0}
        if [ "$(awk -v g="$t" -v w="$want" 'BEGIN { print (g == w) }')" = 1 ]; then
            equal=$((equal + 1))
        else
            detail="$detail rank $r (pp $pp) allocated $t bytes, am-plan estimates $want;"
        fi
    done
    if [ "$equal" = "$n" ]; then
        ok "LoRA on lm_head, $name: every rank's allocation is its pp rank's estimate to the byte"
    else
        bad "LoRA on lm_head, $name: $detail"
    fi
done
echo "lora head: $passes passed, $fails failed"
[ "$fails" = 0 ]
