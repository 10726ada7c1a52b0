#!/bin/bash
# LoRA's adapter dropout (AutoModel's peft.dropout, dropout_position; lora.h) end to end with
# am-train, on CPU: the bundled tiny_lora recipe (its inline base) with adapters on every
# projection and dropout 0.1,
#   effect: "post" and "pre" each change the losses against no dropout (B starts at zero, so
#     step 1's loss is the same; the later ones are not), and differ from each other;
#   parity: the masks are functions of (seed, layer, projection, sequence, position, feature),
#     so every layout draws the same ones: "post" at tp 2, pp 2, dp 2 and cp 2, "pre" at tp 2
#     with sequence parallelism, dp 2 and with activation checkpointing (the forward drawn
#     again in backward) against one rank's run: losses within 1e-5, grad norms 1e-5 relative
#     (test-parity.sh's fp32 tolerances); in bf16, "post" at tp 2 against one rank's bf16 run
#     within twice its distance from fp32;
#   resume: stopped after step 2 and restored from its checkpoint, steps 3 and 4 are the
#     uninterrupted run's to the last bit.
# (test_lora checks the mask's rate and the adapter's formulas against references.)
set -u
steps=4 loss_tol=1e-5 norm_tol=1e-5
source "$(dirname "$0")/lora-lib.sh"

# instruction rows from Debian's license texts (as test-lora.sh)
lora_dataset 600 GPL-3 Apache-2.0

recipe() { # NAME DROPOUT POSITION [MODS]: tiny_lora.yaml, every projection adapted, no checkpoints (but ckpt=NAME)
    local args=(-e "s|paths: .*|paths: $work/ds|" -e "s/max_steps: .*/max_steps: $steps/"
        -e "s/target_modules: .*/target_modules: ['*_proj']/"
        -e "s/  dropout: .*/  dropout: $2\n  dropout_position: $3/")
    case ${4:-} in
    sp) args+=(-e 's/sequence_parallel: false/sequence_parallel: true/') ;;
    ac) args+=(-e 's/activation_checkpointing: false/activation_checkpointing: true/') ;;
    bf16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16/') ;;
    ckpt=*) args+=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-${4#ckpt=}|" -e 's/ckpt_every_steps: .*/ckpt_every_steps: 2/') ;;
    esac
    [[ ${4:-} == ckpt=* ]] || args+=(-e 's/  enabled: true/  enabled: false/') # no checkpoints to restore from
    sed "${args[@]}" "$AM_SRCDIR/sbatch-templates/recipes/tiny_lora.yaml" >"$work/$1.yaml"
}
run() { # NAME NPROC DROPOUT POSITION MODS [VAR=VALUE...]: trained, its steps in steps-NAME
    local name=$1 n=$2
    recipe "$name" "$3" "$4" "$5"
    shift 5
    if ! train "$name" "$n" "$work/$name.yaml" "$@"; then
        bad "$name did not train"; sed 's/^/    /' "$work/out-$name"; return 1
    fi
    steps_of "$work/logs-$name" >"$work/steps-$name"
}

run none 1 0.0 post - || exit 1
for pos in post pre; do
    run "ref-$pos" 1 0.1 "$pos" - || exit 1
    if compare none "ref-$pos"; then
        bad "dropout $pos changes nothing: $(cat "$work/cmp-ref-$pos")"
    elif [ "$(head -1 "$work/steps-none" | cut -d' ' -f2)" != "$(head -1 "$work/steps-ref-$pos" | cut -d' ' -f2)" ]; then
        bad "dropout $pos changed step 1's loss (B is zero then: the adapters add nothing)"
    else
        ok "dropout $pos changes the losses after step 1: $(awk '{ printf "%s ", $2 }' "$work/steps-ref-$pos")"
    fi
done
if compare ref-post ref-pre; then bad "dropout pre and post train the same"; else ok "dropout pre and post differ"; fi

for layout in "post-tp2 2 post - AM_TP=2" "post-pp2 2 post - AM_PP=2" "post-dp2 2 post -" "post-cp2 2 post - AM_CP=2" \
    "pre-tp2-sp 2 pre sp AM_TP=2" "pre-dp2 2 pre -" "pre-ac 1 pre ac"; do
    set -- $layout
    name=$1 n=$2 pos=$3 mods=$4
    shift 4
    run "$name" "$n" 0.1 "$pos" "$mods" "$@" || continue
    if compare "ref-$pos" "$name"; then
        ok "dropout $name matches one rank: $(cat "$work/cmp-$name")"
    else
        bad "dropout $name: $(cat "$work/cmp-$name")"; paste "$work/steps-ref-$pos" "$work/steps-$name" | sed 's/^/    /'
    fi
done

# bf16: "post" at tp 2 against one rank's bf16 run, within twice one rank's bf16-vs-fp32
# differences (loss; grad norm relative), as test-lora.sh tolerates bf16 layouts
if run ref-post-bf16 1 0.1 post bf16 && run post-bf16-tp2 2 0.1 post bf16 AM_TP=2; then
    tol=$(bf16_tol ref-post ref-post-bf16)
    if ! awk -v t="${tol%% *}" 'BEGIN { exit !(t > 1e-5) }'; then
        bad "one rank's bf16 run with dropout is not different from fp32 ($tol): is bf16 used?"
    elif compare ref-post-bf16 post-bf16-tp2 ${tol%% *} ${tol##* }; then
        ok "dropout post-bf16-tp2 matches one rank in bf16: $(cat "$work/cmp-post-bf16-tp2")"
    else
        bad "dropout post-bf16-tp2: $(cat "$work/cmp-post-bf16-tp2")"
        paste "$work/steps-ref-post-bf16" "$work/steps-post-bf16-tp2" | sed 's/^/    /'
    fi
fi

# resume: a run stopped after step 2 (its checkpoint) and restored gives the uninterrupted run's
# losses of steps 3 and 4 to the last bit (the masks are functions of the step's sequences)
run resume-full 1 0.1 post ckpt=full && run resume-cut 1 0.1 post ckpt=cut &&
    sed -i 's/max_steps: .*/max_steps: 2/' "$work/resume-cut.yaml" && rm -rf "$work/ckpt-cut" &&
    train resume-cut 1 "$work/resume-cut.yaml" && sed 's/max_steps: .*/max_steps: 4/' "$work/resume-cut.yaml" >"$work/resumed.yaml" &&
    train resumed 1 "$work/resumed.yaml" && steps_of "$work/logs-resumed" >"$work/steps-resumed"
if [ -f "$work/steps-resumed" ] && [ "$(tail -2 "$work/steps-resume-full")" = "$(cat "$work/steps-resumed")" ]; then
    ok "dropout: restored after step 2, steps 3-4 are the uninterrupted run's to the last bit"
else
    bad "dropout resume: $(tail -2 "$work/steps-resume-full" | tr '\n' ' ') against $(cat "$work/steps-resumed" 2>/dev/null | tr '\n' ' ')"
    sed 's/^/    /' "$work/out-resumed" 2>/dev/null | tail -5
fi

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
