# tests/train/lora-lib.sh - what the LoRA end-to-end tests share (sourced by test-lora.sh,
# test-lora-dropout.sh, test-lora-moe.sh, test-lora-head.sh, test-lora-glm.sh and test-lora-oss.sh): the test
# environment, a work directory $work (kept when AM_LORA_KEEP is set), the counts of passed and
# failed checks (ok, bad), the instruction dataset, the runs and their steps compared with
# test-parity.sh's measures, the saved adapters read back; for the MoE scripts (test-lora-moe.sh,
# test-lora-glm.sh, test-lora-oss.sh), one rank's run, the layouts, the bf16 runs and a resume
# against it (lora_ref, lora_layouts, lora_bf16, lora_resume), every rank's allocation against
# am-plan's (lora_memory) and am-ckpt merge's weights against W + s B A (merge_error); golden_dist
# on a golden at tp x pp (lora_golden: also for test-lora-golden.sh and test-golden-dist.sh).

: "${AM_SRCDIR:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
AM_BUILDDIR=$(cd "$AM_BUILDDIR" && pwd)
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models} OMP_NUM_THREADS=1
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap '[ -n "${AM_LORA_KEEP:-}" ] || rm -rf "$work"' EXIT
fails=0 passes=0
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

# lora_dataset ROWS LICENSE...: $work/ds (and its loss mask) by am-data build --instruction from
# the first ROWS instruction rows of Debian's license texts (a line as the prompt, the next as the
# response), the script ended when it fails
lora_dataset() {
    local rows=$1 f texts=()
    shift
    for f; do texts+=("/usr/share/common-licenses/$f"); done
    awk 'NF { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, " "); if (p != "") printf "{\"prompt\": \"%s\", \"response\": \"%s\"}\n", p, $0; p = $0 }' \
        "${texts[@]}" | head -"$rows" >"$work/rows.jsonl"
    "$AM_BUILDDIR/am-data" build --tokenizer "$AM_SRCDIR/tests/data/tokenizer/gpt2.json" --instruction \
        --eos '<|endoftext|>' --out "$work/ds" "$work/rows.jsonl" >/dev/null || { bad "am-data build --instruction"; exit 1; }
}

train() { # NAME NPROC RECIPE [VAR=VALUE...]: am-launch in $work, logs in logs-NAME, output in out-NAME
    local name=$1 n=$2 recipe=$3
    shift 3
    (cd "$work" && env "$@" AM_LOG_DIR="$work/logs-$name" timeout 600 "$AM_BUILDDIR/am-launch" --nproc "$n" \
        "$recipe" >"$work/out-$name" 2>&1)
}
steps_of() { # LOGDIR: "step loss grad_norm" of rank 0
    grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"step":([0-9]+),"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2 \3/'
}
memory() { # LOGDIR RANK KEY
    grep -h '"type":"memory"' "$1"/*/rank-"$2".jsonl | sed -E "s/.*\"$3\":([0-9a-z]*).*/\1/"
}
# compare A B [LOSS_TOL NORM_TOL]: rank 0's steps of B (steps-B) against A's: $steps steps, the
# losses within LOSS_TOL and the grad norms within NORM_TOL relative ($loss_tol, $norm_tol) (0),
# else 1; what it measured in cmp-B
compare() {
    paste "$work/steps-$1" "$work/steps-$2" | awk -v steps="$steps" -v lt="${3:-$loss_tol}" -v nt="${4:-$norm_tol}" '
        { d = $2 - $5; if (d < 0) d = -d; if (d > w) w = d; g = ($3 - $6) / $3; if (g < 0) g = -g; if (g > gw) gw = g; n++ }
        END { printf "%d steps, loss %.2g (tolerance %.2g), grad norm %.2g relative (%.2g)", n, w, lt, gw, nt
              exit !(n == steps && w <= lt && gw <= nt) }' >"$work/cmp-$2"
}
# bf16_tol FP32 BF16: "LOSS_TOL NORM_TOL" for bf16 layouts, twice one rank's bf16 run's (steps-BF16)
# distance from its fp32 run (steps-FP32): the loss's, the grad norm's relative
bf16_tol() {
    paste "$work/steps-$1" "$work/steps-$2" | awk '
        { d = $2 - $5; if (d < 0) d = -d; if (d > l) l = d; g = ($3 - $6) / $3; if (g < 0) g = -g; if (g > n) n = g }
        END { printf "%.3g %.3g", 2 * l, 2 * n }'
}
total_of() { # LOGDIR RANK: the bytes the rank allocated (with ep, the received rows' buffers at the start)
    local t=0 key v
    for key in weights_bytes grads_bytes optimizer_bytes gathered_bytes grad_buffers_bytes act_bytes pipe_bytes \
        expert_rows_bytes; do
        v=$(memory "$1" "$2" $key)
        t=$((t + ${v:-0}))
    done
    echo "$t"
}
plan_of() { # RECIPE NPROC SETS...: am-plan's total of each pp rank, less the CUDA kernels' scratch
    # (kernel_scratch: the CPU's kernels allocate none)
    local y=$1 n=$2
    shift 2
    "$AM_BUILDDIR/am-plan" "$y" --gpus-per-node "$n" --json "$@" | sed -E 's/.*"memory_per_pp_rank"://' |
        grep -oE '"kernel_scratch":[0-9.e+]+,"pipeline_buffers":[0-9.e+]+,"alltoall_buffers":[0-9.e+]+,"pp_rank":[0-9]+,"total":[0-9.e+]+' |
        sed -E 's/"kernel_scratch":([0-9.e+]+),.*"total":([0-9.e+]+)/\1 \2/' | awk '{ printf "%.0f\n", $2 - $1 }'
}

# lora_resume [-x TARGETS] WHAT FROM NPROC EP [VAR=VALUE...]: the run FROM (steps-FROM, the
# script's recipe on NPROC ranks with the variables) stopped after step 2 (its checkpoint) and
# restored gives steps 3 and 4 to the last bit
lora_resume() {
    local targets= what from n ep cut
    while [ "${1#-}" != "$1" ]; do case $1 in -x) targets=$2 ;; esac; shift 2; done
    what=$1 from=$2 n=$3 ep=$4 cut=cut-$2
    shift 4
    recipe "$cut" "$ep" ${targets:+"$targets"} && sed -i -e 's/max_steps: .*/max_steps: 2/' "$work/$cut.yaml" &&
        train "$cut" "$n" "$work/$cut.yaml" "$@" && sed -i 's/max_steps: .*/max_steps: 4/' "$work/$cut.yaml" &&
        rm -rf "$work/logs-$cut" && train "$cut" "$n" "$work/$cut.yaml" "$@" && steps_of "$work/logs-$cut" >"$work/steps-$cut"
    if [ -f "$work/steps-$cut" ] && [ "$(tail -2 "$work/steps-$from")" = "$(cat "$work/steps-$cut")" ]; then
        ok "$what $from: restored after step 2, steps 3-4 are the uninterrupted run's to the last bit"
    else
        bad "$what $from resume: $(tail -2 "$work/steps-$from" | tr '\n' ' ') against $(tr '\n' ' ' <"$work/steps-$cut" 2>/dev/null)"
    fi
}

# lora_memory WHAT RUN...: each RUN "NAME NPROC [AM_TP=N|AM_PP=N...]" already trained: every rank's
# allocation is am-plan's estimate for its pipeline rank, to the byte
lora_memory() {
    local what=$1 run name n v r pp got w equal detail sets want
    shift
    for run in "$@"; do
        set -- $run
        name=$1 n=$2
        shift 2
        sets=()
        for v in "$@"; do
            case $v in AM_TP=*) sets+=(--set "distributed.tp_size=${v#*=}") ;; AM_PP=*) sets+=(--set "distributed.pp_size=${v#*=}") ;; esac
        done
        want=($(plan_of "$work/$name.yaml" "$n" "${sets[@]}"))
        equal=0 detail=
        for r in $(seq 0 $((n - 1))); do
            pp=$(grep -h '"coords":{"pp":' "$work/logs-$name"/*/rank-"$r".jsonl | sed -E 's/.*"coords":\{"pp":([0-9]+).*/\1/')
            got=$(total_of "$work/logs-$name" "$r")
            w=$(awk -v a="${want[$pp]:-0}" 'BEGIN { printf "%d", a }')
            if [ "$got" = "$w" ] && [ "$got" -gt 0 ]; then
                equal=$((equal + 1))
            else
                detail="$detail rank $r (pp $pp): allocated $got bytes, am-plan $w;"
            fi
        done
        if [ "$equal" = "$n" ]; then
            ok "$what $name: every rank's allocation is am-plan's estimate, to the byte"
        else
            bad "$what $name: allocation off am-plan's estimate:$detail"
        fi
    done
}

# the saved adapters (a safetensors file of fp32 tensors), read from its header
tensors() { # FILE: "name rows cols" of each tensor, sorted
    local n
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    head -c $((8 + n)) "$1" | tail -c "$n" | grep -oE '"[^"]+":\{"dtype":"[A-Z0-9]+","shape":\[[0-9]+,[0-9]+\]' |
        sed -E 's/"([^"]+)".*\[([0-9]+),([0-9]+)\]/\1 \2 \3/' | sort
}
floats() { # FILE: every value of the data, in the header's order (names sorted by the writer)
    local n
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    od -An -v -t f4 -j $((8 + n)) "$1" | tr -s ' ' '\n' | grep .
}
values() { # FILE NAME: the tensor's values, one a line
    local n off
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    off=$(head -c $((8 + n)) "$1" | tail -c "$n" | grep -oE "\"$2\":\\{[^}]*\\}" | grep -oE 'data_offsets":\[[0-9]+,[0-9]+' |
        grep -oE '[0-9]+,[0-9]+')
    od -An -v -t f4 -j $((8 + n + ${off%,*})) -N $((${off#*,} - ${off%,*})) "$1" | tr -s ' ' '\n' | grep .
}

# lora_ref WHAT: one rank's run ref (the script's `recipe ref 1`, $steps steps): its steps in
# steps-ref, the loss falling, the gradients the adapters' alone; the script ended when it does not
# train
lora_ref() {
    recipe ref 1
    train ref 1 "$work/ref.yaml" || { sed 's/^/    /' "$work/out-ref"; bad "$1 did not train on one rank"; exit 1; }
    steps_of "$work/logs-ref" >"$work/steps-ref"
    if [ "$(wc -l <"$work/steps-ref")" = "$steps" ] &&
        awk 'NR == 1 { a = $2 } END { exit !($2 < a) }' "$work/steps-ref" &&
        [ "$(memory "$work/logs-ref" 0 grads_bytes)" = "$(($(memory "$work/logs-ref" 0 adapter_params) * 4))" ]; then
        ok "$1, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-ref"); gradients of the $(memory "$work/logs-ref" 0 adapter_params) adapter parameters only"
    else
        bad "$1, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-ref"), grads_bytes $(memory "$work/logs-ref" 0 grads_bytes) for $(memory "$work/logs-ref" 0 adapter_params) adapter parameters"
    fi
}

# lora_golden [-s SCHEDULE] [-q] [-n SEQ] [-p] GOLDEN TARGETS TP PP: golden_dist on the golden
# GOLDEN (tests/golden/models) at tp TP x pp PP, one golden row a micro-batch: 5 AdamW steps (lr
# 1e-2), the losses and grad norms within golden_dist's tolerances. TARGETS: the target_modules of
# a peft golden (the base model in GOLDEN/base), its final adapters within golden_dist's tolerance
# too; '' for a golden of the model alone (no peft section), trained again from a fresh load with
# the grad norm clipped to 1.0, its 20 checks (5 losses and grad norms of each series). Options:
# -s the pipeline schedule (1f1b), -q sequence parallelism, -n the tokens of a golden row (16);
# -p the test of the test: lr 1.1e-2 instead of 1e-2 must fail, from step 2's loss on.
lora_golden_recipe() { # GOLDEN TARGETS TP PP, with lora_golden's sched, sp, seq, lr and clip
    cat <<EOF
model:
  pretrained_model_name_or_path: $AM_SRCDIR/tests/golden/models/$1${2:+/base}
distributed:
  strategy: fsdp2
  tp_size: $3
  pp_size: $4
  sequence_parallel: $sp
  mp_policy:
    param_dtype: float32
  pipeline:
    pp_schedule: $sched
    pp_microbatch_size: 1
step_scheduler:
  global_batch_size: 2
  local_batch_size: 2
  max_steps: 5
dataset:
  seq_length: $seq
  paths: golden-rows
optimizer:
  _target_: torch.optim.AdamW
  lr: $lr
  betas: [0.9, 0.95]
  eps: 1.0e-8
  weight_decay: 0.1
lr_scheduler:
  lr_decay_style: constant
  lr_warmup_steps: 0
clip_grad_norm:
  max_norm: $clip
dist_env:
  timeout_minutes: 1
EOF
    [ -z "$2" ] || cat <<EOF
peft:
  _target_: nemo_automodel.components._peft.lora.PeftConfig
  target_modules: $2
  dim: 4
  alpha: 8
  dropout: 0.0
  lora_A_init: kaiming
EOF
}
lora_golden() {
    local sched=1f1b sp=false seq=16 lr=1.0e-2 clip=null perturbed= name out what checks='[0-9]*' launched=0
    while [ "${1#-}" != "$1" ]; do
        case $1 in -s) sched=$2; shift ;; -q) sp=true ;; -n) seq=$2; shift ;; -p) perturbed=-perturbed lr=1.1e-2 ;; esac
        shift
    done
    [ -n "$2" ] || checks=20 clip=1.0
    name=golden-tp$3-pp$4-$1-$sched-sp$sp$perturbed
    out="$work/out-$name"
    what="$1 against $([ -n "$2" ] && echo peft || echo transformers) at tp $3 x pp $4"
    [ "$sched" = 1f1b ] || what+=", $sched"
    [ "$sp" = false ] || what+=", sequence parallel"
    lora_golden_recipe "$@" >"$work/$name.yaml"
    (cd "$work" && AM_LOG_DIR="$work/logs-$name" timeout 300 "$AM_BUILDDIR/am-launch" --nproc $(($3 * $4)) \
        "$work/$name.yaml" -- "$AM_BUILDDIR/tests/train/golden_dist" "$1" >"$out" 2>&1) && launched=1
    if [ -n "$perturbed" ]; then # a learning rate 10% off moves the losses from step 2 on
        if [ $launched = 1 ]; then
            bad "$what: lr 1.1e-2 instead of 1e-2 went unnoticed"; sed 's/^/    /' "$out"
        elif grep -q '^adamw step 2: loss .*MISMATCH' "$out" && grep -q "^golden tp$3 pp$4 $1: .* checks FAILED" "$out"; then
            ok "$what: lr 1.1e-2 instead of 1e-2 is caught: $(grep '^adamw step 2: loss' "$out")"
        else
            bad "$what: the perturbed run failed for another reason"; sed 's/^/    /' "$out"
        fi
    elif [ $launched = 1 ] && grep -q "^golden tp$3 pp$4 $1: $checks checks passed" "$out" &&
        [ "$(grep -c '^adamw step [1-5]: loss ' "$out")" = 5 ] && { [ -z "$2" ] || grep -q '^final adapters: ' "$out"; }; then
        ok "$what: $(grep '^golden .*checks passed' "$out" | sed 's/.*passed (//; s/)$//')${2:+; $(grep '^final adapters' "$out")}"
    else
        bad "$what"; sed 's/^/    /' "$out"
    fi
}

# The layouts, bf16 and resume checks compare against one rank's run ref, its adapters within
# 1e-5, each run's recipe `recipe NAME EP`; their options change that: -r REF another run of one
# rank, -t TOL another tolerance for the adapters, -x TARGETS `recipe NAME EP TARGETS`.

# lora_layouts [-r REF] [-t TOL] [-x TARGETS] WHAT LAYOUT...: each LAYOUT "NAME NPROC EP
# [VAR=VALUE...]" (the script's recipe on NPROC ranks with the variables) against REF: its steps
# (compare), and its saved adapters REF's (names-REF's names and shapes, values within TOL)
lora_layouts() {
    local ref=ref tol=1e-5 targets= what layout name n ep vars f ad
    while [ "${1#-}" != "$1" ]; do case $1 in -r) ref=$2 ;; -t) tol=$2 ;; -x) targets=$2 ;; esac; shift 2; done
    what=$1 ad="$work/ckpt-$ref/step-$steps/peft/adapter_model.safetensors"
    shift
    for layout in "$@"; do
        read -r name n ep vars <<<"$layout"
        recipe "$name" "$ep" ${targets:+"$targets"}
        if ! train "$name" "$n" "$work/$name.yaml" $vars; then
            bad "$name did not train"; sed 's/^/    /' "$work/out-$name"; continue
        fi
        steps_of "$work/logs-$name" >"$work/steps-$name"
        if compare "$ref" "$name"; then
            ok "$what $name matches one rank: $(cat "$work/cmp-$name")"
        else
            bad "$what $name: $(cat "$work/cmp-$name")"; paste "$work/steps-$ref" "$work/steps-$name" | sed 's/^/    /'
        fi
        f="$work/ckpt-$name/step-$steps/peft/adapter_model.safetensors"
        if [ -f "$f" ] && [ "$(tensors "$f")" = "$(cat "$work/names-$ref")" ] && awk -v tol="$tol" '
                NR == FNR { a[FNR] = $0; n = FNR; next } { d = a[FNR] - $0; if (d < 0) d = -d; if (d > w) w = d }
                END { printf "%.2g", w; exit !(FNR == n && w <= tol) }' <(floats "$ad") <(floats "$f") >"$work/ad-$name"; then
            ok "$what $name saves one rank's adapters (names, shapes; values within $(cat "$work/ad-$name"))"
        else
            bad "$what $name: its saved adapters differ from one rank's ($(cat "$work/ad-$name" 2>/dev/null))"
        fi
    done
}

# lora_bf16 [-r REF] [-s] RUN...: REF in bf16 (REF-bf16; with -s bf16 storage too, model.torch_dtype
# bfloat16: REF-s16), then each RUN "NAME NPROC FROM [VAR=VALUE...]", FROM's recipe so on NPROC
# ranks with the variables (its checkpoints in ckpt-NAME), their steps in steps-NAME; sets $tol to
# bf16_tol of REF and REF-bf16 (REF-s16), a failed check when that is not different from REF
lora_bf16() {
    local ref=ref sfx=bf16 store=() run name n from vars
    while [ "${1#-}" != "$1" ]; do
        case $1 in
        -r) ref=$2; shift 2 ;;
        -s) sfx=s16 store=(-e 's/torch_dtype: float32/torch_dtype: bfloat16/'); shift ;;
        esac
    done
    for run in "$ref-$sfx 1 $ref" "$@"; do
        read -r name n from vars <<<"$run"
        sed -e 's/param_dtype: float32/param_dtype: bfloat16/' "${store[@]}" -e "s|ckpt-$from|ckpt-$name|" "$work/$from.yaml" >"$work/$name.yaml"
        train "$name" "$n" "$work/$name.yaml" $vars && steps_of "$work/logs-$name" >"$work/steps-$name" || { bad "$name did not train"; sed 's/^/    /' "$work/out-$name"; }
    done
    tol=$(bf16_tol "$ref" "$ref-$sfx")
    if ! awk -v t="${tol%% *}" 'BEGIN { exit !(t > 1e-5) }'; then
        bad "one rank's $sfx run is not different from fp32 ($tol): is bf16 used?"
    fi
}

# merge_error S R ROWS COLS B A W MERGED: the files of a merged weight's values (one a line: an
# adapter's B [ROWS, R] and A [R, COLS], the base's W and am-ckpt merge's result, [ROWS, COLS]):
# prints the largest |MERGED - (W + S B A)| on a line; 1 when it is 1e-6 or more, or a count is off
merge_error() {
    awk -v s="$1" -v r="$2" -v rows="$3" -v cols="$4" '
        FNR == 1 { f++ } f == 1 { B[FNR - 1] = $1 } f == 2 { A[FNR - 1] = $1 } f == 3 { W[FNR - 1] = $1 }
        f == 4 { i = FNR - 1; o = int(i / cols); c = i % cols; d = 0
                 for (k = 0; k < r; k++) d += B[o * r + k] * A[k * cols + c]
                 e = $1 - W[i] - s * d; if (e < 0) e = -e; if (e > worst) worst = e; n++ }
        END { printf "%.2g\n", worst; exit !(n == rows * cols && worst < 1e-6) }' "$5" "$6" "$7" "$8"
}
