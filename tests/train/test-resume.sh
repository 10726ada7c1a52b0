#!/bin/bash
# Sharded checkpoints (ckpt/shard_ckpt.h, train/resume.h) on CPU, with the tiny recipe made short
# (6 steps of 8 sequences of 32 tokens, a checkpoint every 2 steps, the last 2 kept):
#   resume: a run killed at a step (AM_FAULT kind=kill) and started again with
#     checkpoint.restore_from: latest gives the uninterrupted run's losses to the last bit and
#     its final state files byte for byte, at 1 rank, dp 2 (fsdp2), tp 2 x pp 2, cp 2 x dp 2
#     (fsdp2 over dp x cp), and a mixture of experts (Mixtral's layers, 4 experts) at tp 2 x dp 2
#     (fsdp2: the experts' own groups) and at ep 2 x dp 4 (the experts sharded over the ranks
#     holding the same ones), and deepseek_v3 with AutoModel's selection-bias update at ep 2 x pp 2
#     (the updated biases saved per stage and restored); with bf16 storage (model.torch_dtype
#     bfloat16) at dp 2 and the deepseek_v3 layout, whose bf16 save_consolidated export
#     am-ckpt export reproduces byte for byte by default;
#   kills: a seeded random set of trials across layouts kills one rank at a random step or at a
#     random phase inside a save (kind=kill-in-save:PHASE), then resumes: after every kill
#     `latest` names a complete checkpoint (or none, before the first), the resumed job
#     finishes, and every step's loss and the final state equal the uninterrupted run's bits;
#   re-sharding: a checkpoint saved at one layout and strategy restores into another, AdamW's
#     moments included, and the losses of the steps after it and the final weights (the
#     Hugging Face export of checkpoint.save_consolidated) match the one-rank run within the
#     parity tolerances (losses 1e-5, weights 5e-5: test-parity.sh); mixtures of experts too
#     (ep 2 x dp 4 to 1 rank, to dp 2 and to tp 2; tp 2 x dp 2 to ep 2 x dp 2; 1 rank to
#     megatron_fsdp ZeRO 3 at dp 4; ep 2 x HSDP at dp 4, its experts sharded across the
#     replicas, to 1 rank and back);
#   am-plan: its bytes of a checkpoint (the largest shard file, the most one node of 4 ranks
#     writes) are those of the files the 8-rank job wrote, and with --logs it takes the save
#     and step times the job's ranks recorded;
#   am-ckpt: show prints the layout and state of a checkpoint; export writes the Hugging Face
#     directory offline, the same bytes as save_consolidated's (gpt_oss's too, its experts fused as
#     transformers reads them, from ep 2 x pp 2 and tp 2; transformers loads it), and refuses a
#     damaged shard;
#   Slurm's warning: SIGUSR1 to am-launch after step 2 makes both ranks save the same step and
#     exit with status 85 (AM_EXIT_REQUEUE); the job started again finishes bit-exact;
#   am-diag: after a kill inside a save, it names the last complete checkpoint and the save
#     that did not complete;
#   refusals: a truncated shard, a bad checksum, a damaged manifest, a checkpoint of another
#     model and one of another global batch are refused with their message, and leave the
#     checkpoint as it was.
# AM_RESUME_TRIALS (default 20) and AM_RESUME_SEED (default 18) set the kill trials.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap '[ -n "${AM_RESUME_KEEP:-}" ] || rm -rf "$work"' EXIT
fails=0 passes=0
steps=6 loss_tol=1e-5 weight_tol=5e-5
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
sed -e "s|paths: .*|paths: $work/corpus|" -e "s/max_steps: .*/max_steps: $steps/" \
    -e 's/seq_length: .*/seq_length: 32/' -e 's/global_batch_size: .*/global_batch_size: 8/' \
    -e 's/local_batch_size: .*/local_batch_size: 2/' \
    -e 's/ckpt_every_steps: .*/ckpt_every_steps: 2/' \
    -e 's/enabled: false/enabled: true\n  max_recent_checkpoints: 2\n  save_consolidated: false/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/base.yaml"

recipe() { # NAME MODS: base.yaml with comma-separated changes, its checkpoints under ckpt-NAME
    local name=$1 mods=$2 m
    local args=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$name|")
    for m in ${mods//,/ }; do
        case $m in
        ddp) args+=(-e 's/strategy: fsdp2/strategy: ddp/') ;;
        il) args+=(-e 's/pp_schedule: .*/pp_schedule: interleaved1f1b/') ;;
        hsdp) args+=(-e 's/  dp_size: none.*/  dp_size: none\n  dp_replicate_size: 2/') ;;
        mz[123]) args+=(-e "s/strategy: fsdp2/strategy: megatron_fsdp\n  zero_dp_strategy: ${m#mz}/") ;;
        hf) args+=(-e 's/save_consolidated: false/save_consolidated: true/') ;;
        final) args+=(-e 's/save_consolidated: false/save_consolidated: final/') ;;
        every3) args+=(-e 's/ckpt_every_steps: .*/ckpt_every_steps: 3/') ;;
        from=*) args+=(-e "s|restore_from: .*|restore_from: ${m#from=}|") ;;
        wide) args+=(-e 's/hidden_size: 64/hidden_size: 128/') ;;
        gb4) args+=(-e 's/global_batch_size: .*/global_batch_size: 4/') ;;
        moe) args+=(-e 's/model_type: llama/model_type: mixtral\n  num_local_experts: 4\n  num_experts_per_tok: 2/') ;;
        dsv3bu) args+=(-e 's/num_key_value_heads: 2/num_key_value_heads: 4/' -e 's/model_type: llama/model_type: deepseek_v3\n  q_lora_rank: 24\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n  v_head_dim: 12\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n  first_k_dense_replace: 1\n  norm_topk_prob: true\n  moe_overrides:\n    gate_bias_update_factor: 0.01/') ;;
        oss) args+=(-e 's/model_type: llama/model_type: gpt_oss\n  num_local_experts: 4\n  num_experts_per_tok: 2\n  head_dim: 16\n  sliding_window: 24/') ;;
        s16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16/' -e 's/torch_dtype: float32/torch_dtype: bfloat16/') ;;
        -) ;;
        *) echo "test-resume.sh: unknown change $m" >&2; exit 2 ;;
        esac
    done
    sed "${args[@]}" "$work/base.yaml" >"$work/$name.yaml"
}

# launch NAME LOGS N [VAR=VALUE...]: one job of recipe NAME; output in out-LOGS, logs in logs-LOGS
launch() {
    local name=$1 logs=$2 n=$3
    shift 3
    (cd "$work" && env "$@" AM_LOG_DIR="$work/logs-$logs" timeout 120 "$AM_BUILDDIR/am-launch" --nproc "$n" \
        "$work/$name.yaml" >"$work/out-$logs" 2>&1)
}

steps_of() { # LOGS: "step loss grad_norm" of rank 0, as written (the exact decimal of each double)
    cat "$work/logs-$1"/*/rank-0.jsonl 2>/dev/null | grep '"type":"step"' |
        sed -E 's/.*"step":([0-9]+),.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2 \3/;s/.*"step":([0-9]+),.*/&/' |
        awk '{print $1, $2, $3}'
}

# same_state DIR_A DIR_B: the rank files and the tensor map of two checkpoints are the same bytes
# (and the experts' selection biases where training updates them)
same_state() {
    local f
    [ -f "$1/manifest.json" ] && [ -f "$2/manifest.json" ] || return 1
    for f in "$1"/rank-*.bin; do cmp -s "$f" "$2/$(basename "$f")" || return 1; done
    [ "$(ls "$1/selection_bias" 2>/dev/null)" = "$(ls "$2/selection_bias" 2>/dev/null)" ] || return 1
    for f in "$1"/selection_bias/*.safetensors; do [ ! -e "$f" ] || cmp -s "$f" "$2/selection_bias/$(basename "$f")" || return 1; done
    [ "$(ls "$1" | grep -c 'rank-.*\.bin')" = "$(ls "$2" | grep -c 'rank-.*\.bin')" ]
}

# ---- references: the uninterrupted runs --------------------------------------------------------
# NAME RANKS MODS [OVERRIDES]
refs=("r1 1 -" "r-dp2 2 -" "r-tp2pp2 4 - AM_TP=2 AM_PP=2" "r-ddp2 2 ddp" "r-pp2dp2 4 - AM_PP=2"
    "r-moe-tp2dp2 4 moe AM_TP=2" "r-cp2dp2 4 - AM_CP=2" "r-moe-ep2dp4 4 moe AM_EP=2"
    "r-dsv3bu-ep2pp2 4 dsv3bu,hf AM_EP=2 AM_PP=2" "r-oss-ep2pp2 4 oss,hf AM_EP=2 AM_PP=2" "r-oss-tp2 2 oss,hf AM_TP=2")
for ref in "${refs[@]}"; do
    set -- $ref
    name=$1 n=$2 mods=$3
    shift 3
    recipe "$name" "$mods"
    launch "$name" "$name" "$n" "$@" || { bad "reference $name did not train"; sed 's/^/    /' "$work/out-$name"; exit 1; }
    steps_of "$name" >"$work/losses-$name"
    [ "$(wc -l <"$work/losses-$name")" = "$steps" ] || { bad "reference $name logged $(wc -l <"$work/losses-$name") steps"; exit 1; }
done
# keep_last 2: step-4 and step-6 remain, `latest` names step-6, no temporary directory left
got=$(cd "$work/ckpt-r1" && ls | tr '\n' ' ')
[ "$got" = "latest step-4 step-6 " ] && [ "$(cat "$work/ckpt-r1/latest")" = step-6 ] &&
    ok "max_recent_checkpoints 2 keeps step-4 and step-6, latest names step-6" ||
    bad "checkpoint_dir holds '$got' (want 'latest step-4 step-6 '), latest: $(cat "$work/ckpt-r1/latest")"
# a second run of the finished job resumes at step 6 and trains nothing
launch r1 r1-again 1 && grep -q '"type":"restore".*"step":6' "$work"/logs-r1-again/*/rank-0.jsonl &&
    [ -z "$(steps_of r1-again)" ] && ! grep -q '"type":"checkpoint"' "$work"/logs-r1-again/*/rank-0.jsonl &&
    ok "a finished job started again resumes after step 6, trains no step and saves nothing" ||
    bad "a finished job started again: $(tail -3 "$work/out-r1-again")"

# save_consolidated: final (AutoModel's mode): the Hugging Face directory with the last checkpoint only
recipe r1-final final
launch r1-final r1-final 1 &&
    [ ! -e "$work/ckpt-r1-final/step-4/hf" ] && [ -f "$work/ckpt-r1-final/step-6/hf/config.json" ] &&
    ls "$work/ckpt-r1-final/step-6/hf/"*.safetensors >/dev/null 2>&1 &&
    ok "save_consolidated: final: step-6/hf written, step-4 without one" ||
    bad "save_consolidated: final: $(cd "$work/ckpt-r1-final" && ls -d step-*/hf 2>&1 | tr '\n' ' ')"

# ---- resume after a kill between steps: bit-exact ---------------------------------------------------
# trial NAME REF N KIND RANK STEP [OVERRIDES]: run REF's recipe with AM_FAULT, resume, compare
trial() {
    local name=$1 ref=$2 n=$3 kind=$4 rank=$5 step=$6
    shift 6
    local mods
    mods=$(grep -m1 "^$ref " <(printf '%s\n' "${refs[@]}") | awk '{print $3}')
    recipe "$name" "$mods"
    launch "$name" "$name-1" "$n" "$@" AM_FAULT="rank=$rank,step=$step,kind=$kind"
    local rc1=$? latest="" resumed=0
    if [ -f "$work/ckpt-$name/latest" ]; then
        latest=$(cat "$work/ckpt-$name/latest")
        if [ ! -f "$work/ckpt-$name/$latest/manifest.json" ]; then
            bad "$name: after the kill, latest names $latest, which has no manifest"; return
        fi
        resumed=${latest#step-}
    fi
    if ! launch "$name" "$name-2" "$n" "$@"; then
        bad "$name ($kind rank $rank step $step; first run rc $rc1): the resumed job failed"; sed 's/^/    /' "$work/out-$name-2"
        return
    fi
    if [ -n "$latest" ] && ! grep -q "\"type\":\"restore\".*\"step\":$resumed" "$work"/logs-"$name-2"/*/rank-0.jsonl; then
        bad "$name: the resumed job did not restore $latest"; return
    fi
    # every step either run logged equals the reference's, and the second run logged the rest
    { steps_of "$name-1"; steps_of "$name-2"; } | sort -n -k1,1 -s >"$work/all-$name"
    local diff
    diff=$(join -j1 <(sort -k1,1 "$work/all-$name") <(sort -k1,1 "$work/losses-$ref") | awk '$2 != $4 || $3 != $5')
    local second
    second=$(steps_of "$name-2" | awk '{print $1}' | tr '\n' ' ')
    local want
    want=$(seq $((resumed + 1)) "$steps" | tr '\n' ' ')
    if [ -n "$diff" ] || [ "$second" != "$want" ]; then
        bad "$name ($kind rank $rank step $step): resumed from ${latest:-the start}; steps of the second run '$second' (want '$want'); differing: $diff"
        return
    fi
    if ! same_state "$work/ckpt-$ref/step-$steps" "$work/ckpt-$name/step-$steps"; then
        bad "$name: the final state differs from $ref's"; return
    fi
    ok "$name ($kind on rank $rank at step $step, first run rc $rc1): resumed from ${latest:-the start}, losses and final state bit-exact"
}

trial kill-r1 r1 1 kill 0 4
# AutoModel's selection-bias update (deepseek_v3, gate_bias_update_factor 0.01): the biases of
# step 2's checkpoint restored (one file per stage, selection_bias/), steps 3 to 6 bit-exact
trial kill-dsv3bu r-dsv3bu-ep2pp2 4 kill 2 3 AM_EP=2 AM_PP=2
[ "$(ls "$work/ckpt-r-dsv3bu-ep2pp2/step-6/selection_bias" 2>/dev/null | wc -l)" = 2 ] &&
    ok "r-dsv3bu-ep2pp2: step-6/selection_bias holds one file per pipeline stage" ||
    bad "r-dsv3bu-ep2pp2: step-6/selection_bias holds '$(ls "$work/ckpt-r-dsv3bu-ep2pp2/step-6/selection_bias" 2>&1)'"
# am-ckpt export takes the updated biases from selection_bias/: the same tensors as save_consolidated's
if "$AM_BUILDDIR/am-ckpt" export "$work/ckpt-r-dsv3bu-ep2pp2/step-6" "$work/export-dsv3bu" >/dev/null 2>&1 &&
    "$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-r-dsv3bu-ep2pp2/step-6/hf" "$work/export-dsv3bu" 0 \
        >"$work/wdiff-export-dsv3bu" 2>&1; then
    ok "am-ckpt export of r-dsv3bu-ep2pp2's step 6 (the updated biases with it) equals its save_consolidated export"
else
    bad "am-ckpt export of r-dsv3bu-ep2pp2's step 6: $(cat "$work/wdiff-export-dsv3bu" 2>/dev/null)"
fi
# gpt_oss: the shards hold each expert's matrices and biases apart; am-ckpt export fuses them as the
# consolidated save does (gate_up_proj, gate at the even columns and up at the odd, down_proj, their
# biases): the same bytes, from ep 2 x pp 2 and from tp 2 (the attention's sinks and biases split)
for name in r-oss-ep2pp2 r-oss-tp2; do
    if "$AM_BUILDDIR/am-ckpt" export "$work/ckpt-$name/step-6" "$work/export-$name" >/dev/null 2>&1 &&
        cmp -s "$work/ckpt-$name/step-6/hf/model.safetensors" "$work/export-$name/model.safetensors" &&
        cmp -s "$work/ckpt-$name/step-6/hf/config.json" "$work/export-$name/config.json"; then
        ok "am-ckpt export of $name's step 6 (gpt_oss's experts fused) is its save_consolidated export byte for byte"
    else
        bad "am-ckpt export of $name's step 6 differs from its save_consolidated export (or failed)"
    fi
done
# transformers' GptOssForCausalLM loads the export, every tensor used and equal to the file's (where
# the golden venv has torch: AM_GOLDEN_PYTHON, tests/golden/README.md)
PY=${AM_GOLDEN_PYTHON:-/tmp/goldenv/bin/python}
if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
    echo "note: no torch at $PY: the gpt_oss export not loaded by transformers"
elif "$PY" - "$work/export-r-oss-ep2pp2" <<'PYEOF' >"$work/oss-load.check" 2>&1; then
import sys, torch
from safetensors.torch import load_file
from transformers import GptOssForCausalLM
m, info = GptOssForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True, dtype=torch.float32)
assert not any(info.values()), info
sd, msd = load_file(sys.argv[1] + "/model.safetensors"), m.state_dict()
assert set(sd) == set(msd), set(sd) ^ set(msd)
for k in sd:
    assert torch.equal(sd[k], msd[k]), k
ids = torch.arange(32).unsqueeze(0)
assert torch.isfinite(m(input_ids=ids, labels=ids).loss)
PYEOF
    ok "transformers' GptOssForCausalLM loads the gpt_oss export: no key missing, unexpected or misshapen, every tensor the file's"
else
    bad "transformers on the gpt_oss export:"; sed 's/^/    /' "$work/oss-load.check" | tail -5
fi
trial kill-dp2 r-dp2 2 kill 1 5
trial kill-tp2pp2 r-tp2pp2 4 kill 3 4 AM_TP=2 AM_PP=2
trial kill-moe r-moe-tp2dp2 4 kill-in-save:shard 3 4 AM_TP=2
trial kill-latest r-pp2dp2 4 kill-in-save:latest 0 4 AM_PP=2
trial kill-cp2dp2 r-cp2dp2 4 kill 2 5 AM_CP=2
trial kill-ep2dp4 r-moe-ep2dp4 4 kill-in-save:written 1 4 AM_EP=2

# am-diag after a kill inside a save: the last complete checkpoint, and the save that did not end
trial kill-save-dp2 r-dp2 2 kill-in-save:written 1 4
"$AM_BUILDDIR/am-diag" "$work/logs-kill-save-dp2-1" >"$work/diag-kill-save" 2>&1
if grep -q "^last checkpoint: step 2, .*, $work/ckpt-kill-save-dp2/step-2\$" "$work/diag-kill-save" &&
    grep -qx "  the save of step 4 did not complete (rank 0 began it): a restore takes the checkpoint above" \
        "$work/diag-kill-save"; then
    ok "am-diag names the last complete checkpoint (step 2) and the save of step 4 that did not complete"
else
    bad "am-diag after a kill inside the save of step 4:"; sed 's/^/    /' "$work/diag-kill-save"
fi

# ---- kills at random places, inside saves too: seeded ---------------------------------------------
RANDOM=${AM_RESUME_SEED:-18}
phases=(shard written manifest commit latest)
for ((i = 1; i <= ${AM_RESUME_TRIALS:-20}; i++)); do
    ref=${refs[$((RANDOM % ${#refs[@]}))]}
    set -- $ref
    rname=$1 n=$2
    shift 3
    rank=$((RANDOM % n))
    if ((RANDOM % 3 == 0)); then
        kind=kill step=$((RANDOM % steps + 1))
    else
        step=$((2 * (RANDOM % 2 + 1)))
        # every phase in turn (the rank's own ones on other ranks), at a random rank and save
        if [ "$rank" = 0 ]; then phase=${phases[$((i % 5))]}; else phase=${phases[$((i % 2))]}; fi
        kind=kill-in-save:$phase
    fi
    trial "t$i-$rname" "$rname" "$n" "$kind" "$rank" "$step" "$@"
done

# ---- bf16 storage (model.torch_dtype bfloat16: bf16 masters and AdamW moments) ------------------------
# the shards hold the bf16 masters and moments widened to fp32, exactly: a run killed at dp 2 and
# at ep 2 x pp 2 (deepseek_v3 with the selection-bias update) resumes bit-exact; the Hugging Face
# save is bf16, and am-ckpt export writes the same bf16 file by default (the manifest's
# model_dtype)
refs+=("r-s16-dp2 2 s16,hf" "r-s16-dsv3bu-ep2pp2 4 dsv3bu,s16,hf AM_EP=2 AM_PP=2")
for ref in "${refs[@]: -2}"; do
    set -- $ref
    name=$1 n=$2 mods=$3
    shift 3
    recipe "$name" "$mods"
    launch "$name" "$name" "$n" "$@" || { bad "reference $name did not train"; sed 's/^/    /' "$work/out-$name"; continue; }
    steps_of "$name" >"$work/losses-$name"
done
trial kill-s16-dp2 r-s16-dp2 2 kill 1 4
trial kill-s16-dsv3bu r-s16-dsv3bu-ep2pp2 4 kill-in-save:written 3 4 AM_EP=2 AM_PP=2
for name in r-s16-dp2 r-s16-dsv3bu-ep2pp2; do
    dir=$work/ckpt-$name/step-6
    kept=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["meta"]; print(m["optimizer"]["dtype"], m["model_dtype"])' "$dir/manifest.json" 2>&1)
    if [ "$kept" = "bfloat16 bfloat16" ] && "$AM_BUILDDIR/am-ckpt" export "$dir" "$work/export-$name" >/dev/null 2>&1 &&
        cmp -s "$dir/hf/model.safetensors" "$work/export-$name/model.safetensors" &&
        cmp -s "$dir/hf/config.json" "$work/export-$name/config.json" &&
        head -c 8192 "$dir/hf/model.safetensors" | tr -d '\0' | grep -q '"dtype":"BF16"'; then
        ok "$name: manifest optimizer.dtype and model_dtype bfloat16; its bf16 save_consolidated export and am-ckpt export's are the same bytes"
    else
        bad "$name: manifest optimizer.dtype and model_dtype '$kept'; am-ckpt export and save_consolidated differ (or the save is not bf16)"
    fi
done

# ---- Slurm's warning (SIGUSR1 to am-launch, forwarded to the ranks): save, exit 85, resume ----------
# rank 0 sleeps 3 s at the start of step 3 (kind=slow), the warning comes once step 2 is logged:
# both ranks agree on the same step K (2 or 3, as the signal falls before or after step 2's
# agreement), save it and stop with status 85; the job started again finishes bit-exact
recipe warned -
(cd "$work" && exec env AM_FAULT=rank=0,step=3,kind=slow:3 AM_LOG_DIR="$work/logs-warned-1" \
    "$AM_BUILDDIR/am-launch" --nproc 2 "$work/warned.yaml" >"$work/out-warned-1" 2>&1) &
launcher=$! # am-launch itself (exec), which forwards the signal to its ranks
for _ in $(seq 600); do
    grep -qs '"type":"step","step":2,' "$work"/logs-warned-1/*/rank-0.jsonl && break
    sleep 0.1
done
kill -USR1 "$launcher" 2>/dev/null
wait "$launcher"
rc=$?
agreed=$(cat "$work"/logs-warned-1/*/rank-*.jsonl 2>/dev/null | grep '"type":"preempted"' |
    sed -E 's/.*"step":([0-9]+).*/\1/' | sort | uniq -c | awk '{print $1 ":" $2}' | tr '\n' ' ')
k=${agreed#2:}
k=${k% }
if [ "$rc" = 85 ] && [ "$agreed" = "2:$k " ] && [ "$(cat "$work/ckpt-warned/latest" 2>/dev/null)" = "step-$k" ] &&
    launch warned warned-2 2 && grep -q "\"type\":\"restore\".*\"step\":$k" "$work"/logs-warned-2/*/rank-0.jsonl &&
    [ "$(steps_of warned-2 | awk '{print $1}' | tr '\n' ' ')" = "$(seq $((k + 1)) "$steps" | tr '\n' ' ')" ] &&
    [ -z "$(join -j1 <(steps_of warned-2 | sort -k1,1) <(sort -k1,1 "$work/losses-r-dp2") | awk '$2 != $4 || $3 != $5')" ] &&
    same_state "$work/ckpt-r-dp2/step-$steps" "$work/ckpt-warned/step-$steps"; then
    ok "SIGUSR1 after step 2: both ranks saved step $k and exited 85; the job started again resumed after step $k, bit-exact"
else
    bad "SIGUSR1: status $rc (want 85), preempted records (count:step) '$agreed' (want 2 at one step), latest $(cat "$work/ckpt-warned/latest" 2>/dev/null)"
    tail -5 "$work/out-warned-1" "$work/out-warned-2" 2>/dev/null | sed 's/^/    /'
fi

# ---- re-sharding --------------------------------------------------------------------------------------
# the one-rank reference with its Hugging Face export, a checkpoint at step 3
recipe ref1 hf,every3
launch ref1 ref1 1 || { bad "ref1 did not train"; exit 1; }
steps_of ref1 >"$work/losses-ref1"
[ "$(wc -l <"$work/losses-ref1")" = "$steps" ] || { bad "ref1 logged $(wc -l <"$work/losses-ref1") steps"; exit 1; }
# source NAME N MODS [OVERRIDES]: trains 6 steps saving at 3 and 6
source_run() {
    local name=$1 n=$2 mods=$3
    shift 3
    recipe "$name" "$mods,every3"
    launch "$name" "$name" "$n" "$@" || { bad "source $name did not train"; sed 's/^/    /' "$work/out-$name"; return 1; }
}
# reshard SRC NAME N MODS [OVERRIDES]: restores SRC's step 3 at another layout, trains steps 4-6,
# compared with the one-rank run $reshard_ref (ref1; ref1-moe for the mixtures of experts)
reshard_ref=ref1
reshard() {
    local src=$1 name=$2 n=$3 mods=$4
    shift 4
    recipe "$name" "$mods,hf,every3,from=$work/ckpt-$src/step-3"
    if ! launch "$name" "$name" "$n" "$@"; then
        bad "$src -> $name: did not train"; sed 's/^/    /' "$work/out-$name"; return
    fi
    local got cmp
    got=$(steps_of "$name" | awk '{print $1}' | tr '\n' ' ')
    cmp=$(join -j1 <(steps_of "$name" | sort -k1,1) <(sort -k1,1 "$work/losses-$reshard_ref") | awk -v lt="$loss_tol" '
        { d = $2 - $4; if (d < 0) d = -d; if (d > w) w = d; n++ } END { printf "%.2g", w; exit !(n == 3 && w <= lt) }')
    local rc=$?
    if [ "$got" != "4 5 6 " ] || [ $rc != 0 ]; then
        bad "$src -> $name: steps '$got' (want '4 5 6 '), largest loss difference $cmp (tolerance $loss_tol)"; return
    fi
    if ! "$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-$reshard_ref/step-$steps/hf" "$work/ckpt-$name/step-$steps/hf" \
        "$weight_tol" >"$work/wdiff-$name" 2>&1; then
        bad "$src -> $name: final weights differ from one rank's: $(cat "$work/wdiff-$name")"; return
    fi
    ok "$src -> $name: losses of steps 4-6 within $cmp of one rank's (tolerance $loss_tol); weights: $(cat "$work/wdiff-$name")"
}
source_run s-tp2pp2dp2 8 hf AM_TP=2 AM_PP=2 && {
    reshard s-tp2pp2dp2 to-1 1 -
    reshard s-tp2pp2dp2 to-tp4dp2 8 - AM_TP=4
}
# am-plan's checkpoint bytes against the files of that job (2 nodes of 4 ranks: ranks 0-3, 4-7),
# and its lead from the job's logs: the longest save and the slowest rank's median step
plan=$("$AM_BUILDDIR/am-plan" "$work/s-tp2pp2dp2.yaml" --nodes 2 --gpus-per-node 4 --set distributed.tp_size=2 \
    --set distributed.pp_size=2 --logs "$work/logs-s-tp2pp2dp2" --json 2>&1)
field() { sed -nE "s/.*\"checkpoint\":\{[^}]*\"$1\":([^,}]*).*/\1/p" <<<"$plan"; }
files=$work/ckpt-s-tp2pp2dp2/step-6
big=$(stat -c %s "$files"/rank-*.bin | sort -n | tail -1)
node0=$(stat -c %s "$files"/rank-0000[0-3].bin | awk '{ s += $1 } END { print s }')
node1=$(stat -c %s "$files"/rank-0000[4-7].bin | awk '{ s += $1 } END { print s }')
save=$(cat "$work"/logs-s-tp2pp2dp2/*/rank-*.jsonl | grep '"type":"checkpoint"' | sed -E 's/.*"seconds":([^,}]*).*/\1/' |
    sort -g | tail -1)
step=$(for f in "$work"/logs-s-tp2pp2dp2/*/rank-*.jsonl; do
    grep '"type":"step"' "$f" | sed -E 's/.*"step_s":([^,}]*).*/\1/' | sort -g |
        awk '{ v[NR] = $1 } END { printf "%.17g\n", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
done | sort -g | tail -1)
if awk -v a="$(field shard_bytes_max)" -v b="$big" -v n="$(field node_bytes_max)" -v n0="$node0" -v n1="$node1" \
    -v s="$(field save_s)" -v S="$save" -v t="$(field step_s)" -v T="$step" -v l="$(field lead_s)" 'BEGIN {
        m = n0 > n1 ? n0 : n1; ls = int(1.5 * (S + T)); if (ls < 1.5 * (S + T)) ls++; if (ls < 60) ls = 60
        exit !(a == b && n == m && (s - S) ^ 2 <= (1e-6 * S) ^ 2 && (t - T) ^ 2 <= (1e-6 * T) ^ 2 && (l - ls) ^ 2 <= 1) }' &&
    grep -q '"save_from":"logs","step_s":[0-9.e-]*,"step_from":"logs"' <<<"$plan"; then
    ok "am-plan: the largest shard $big bytes and the busiest node's $((node0 > node1 ? node0 : node1)) are the job's files; save $save s and step $step s from its logs"
else
    bad "am-plan against the 8-rank job: largest shard $big, nodes $node0 and $node1, save $save s, median step $step s:"
    echo "$plan" | sed 's/^/    /'
fi
# am-ckpt: what the 8-rank checkpoint holds, and its export offline: the same bytes as the
# Hugging Face directory the job wrote (save_consolidated), a damaged shard refused
src8=$work/ckpt-s-tp2pp2dp2/step-6
if "$AM_BUILDDIR/am-ckpt" show "$src8" >"$work/show" 2>&1 &&
    grep -qx "layout        world 8: tp 2, pp 2, dp 2 (replicate 1 x shard 2), cp 1, ep 1; fsdp2, ZeRO 3" "$work/show" &&
    grep -qx "optimizer     AdamW, 6 steps taken" "$work/show" &&
    grep -qx "data          48 samples consumed (global batch 8 of 32 tokens), dataset seed 1234" "$work/show"; then
    ok "am-ckpt show: the layout, strategy, optimizer step and data position of the 8-rank checkpoint"
else
    bad "am-ckpt show:"; sed 's/^/    /' "$work/show"
fi
if "$AM_BUILDDIR/am-ckpt" export "$src8" "$work/export8" >/dev/null 2>&1 &&
    "$AM_BUILDDIR/tests/train/ckpt_diff" "$src8/hf" "$work/export8" 0 >"$work/wdiff-export" 2>&1; then
    ok "am-ckpt export of the 8-rank checkpoint equals its save_consolidated export: $(cat "$work/wdiff-export")"
else
    bad "am-ckpt export: $(cat "$work/wdiff-export" 2>/dev/null)"
fi
cp -r "$src8" "$work/damaged8"
printf '\x7f' | dd of="$work/damaged8/rank-00005.bin" bs=1 seek=64 conv=notrunc status=none
if ! "$AM_BUILDDIR/am-ckpt" export "$work/damaged8" "$work/export-bad" >"$work/export-bad.out" 2>&1 &&
    grep -q "shard rank-00005.bin: crc32c" "$work/export-bad.out" && [ ! -e "$work/export-bad" ]; then
    ok "am-ckpt export refuses a damaged shard and writes nothing"
else
    bad "am-ckpt export of a damaged checkpoint:"; sed 's/^/    /' "$work/export-bad.out"
fi
source_run s-dp4 4 - && reshard s-dp4 to-ddp2 2 ddp
source_run s-1 1 - && reshard s-1 to-tp2pp2 4 - AM_TP=2 AM_PP=2
source_run s-mz1-tp2dp2 4 mz1 AM_TP=2 && reshard s-mz1-tp2dp2 to-hsdp4 4 hsdp
source_run s-pp2il 2 il AM_PP=2 && reshard s-pp2il to-dp2-z2 2 mz2
source_run s-cp2dp2 4 - AM_CP=2 && reshard s-cp2dp2 to-tp2cp2 4 - AM_TP=2 AM_CP=2
# mixtures of experts (Mixtral's layers, 4 experts): the experts' state saved at expert-parallel
# and tensor-parallel layouts restored at others, against the one-rank run
recipe ref1-moe moe,hf,every3
if launch ref1-moe ref1-moe 1 && steps_of ref1-moe >"$work/losses-ref1-moe" &&
    [ "$(wc -l <"$work/losses-ref1-moe")" = "$steps" ]; then
    reshard_ref=ref1-moe
    source_run s-moe-ep2dp4 4 moe AM_EP=2 && {
        reshard s-moe-ep2dp4 to-moe-1 1 moe
        reshard s-moe-ep2dp4 to-moe-dp2 2 moe
        reshard s-moe-ep2dp4 to-moe-tp2 2 moe AM_TP=2
    }
    source_run s-moe-tp2dp2 4 moe AM_TP=2 && reshard s-moe-tp2dp2 to-moe-ep2dp2 2 moe AM_EP=2
    source_run s-moe-1 1 moe && reshard s-moe-1 to-moe-mz3dp4 4 moe,mz3
    # ep 2 with HSDP (2 replicas of 2): every replica writes its own shards of the experts
    source_run s-moe-ep2hsdp 4 moe,hsdp AM_EP=2 && reshard s-moe-ep2hsdp to-moe-1-from-hsdp 1 moe
    reshard s-moe-1 to-moe-ep2hsdp 4 moe,hsdp AM_EP=2
    reshard_ref=ref1
else
    bad "ref1-moe did not train"; sed 's/^/    /' "$work/out-ref1-moe"
fi

# ---- refusals -------------------------------------------------------------------------------------------
# refuse NAME N MODS MESSAGE [SETUP...]: a copy of ref1's step-3 damaged by SETUP (run in it)
refuse() {
    local name=$1 n=$2 mods=$3 want=$4
    shift 4
    rm -rf "$work/bad-$name"
    cp -r "$work/ckpt-ref1/step-3" "$work/bad-$name"
    (cd "$work/bad-$name" && eval "$*")
    local before
    before=$(cd "$work/bad-$name" && find . -type f | sort | xargs sha256sum | sha256sum)
    recipe "$name" "$mods,from=$work/bad-$name"
    if launch "$name" "$name" "$n"; then
        bad "refusal $name: the job ran"; return
    fi
    if ! grep -qF -- "$want" "$work/out-$name"; then
        bad "refusal $name: no '$want' in:"; sed 's/^/    /' "$work/out-$name" | tail -5; return
    fi
    [ "$(cd "$work/bad-$name" && find . -type f | sort | xargs sha256sum | sha256sum)" = "$before" ] && [ ! -e "$work/ckpt-$name/latest" ] ||
        { bad "refusal $name: the checkpoint or checkpoint_dir changed"; return; }
    ok "refusal $name: \"$want\""
}
size=$(stat -c %s "$work/ckpt-ref1/step-3/rank-00000.bin")
refuse truncated 1 - "shard rank-00000.bin is $((size - 4)) bytes, the manifest says $size (truncated or damaged: restore from another checkpoint)" \
    "truncate -s -4 rank-00000.bin"
refuse checksum 1 - "shard rank-00000.bin: crc32c" \
    "printf '\\x7f' | dd of=rank-00000.bin bs=1 seek=100 conv=notrunc status=none"
refuse manifest 1 - "manifest.json: cannot be read" "truncate -s 50 manifest.json"
refuse other-model 1 wide "was saved from another model" ":"
refuse other-batch 1 gb4 "was saved with a global batch of 8 sequences of 32 tokens, this job runs 4 of 32" ":"
refuse missing-shard 2 - "shard rank-00000.bin: No such file or directory (the checkpoint is incomplete" "rm rank-00000.bin"

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
