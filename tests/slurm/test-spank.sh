#!/usr/bin/env bash
# tests/slurm/test-spank.sh: the SPANK plugin (spank_am.so) on a real local Slurm cluster.
#
# Builds nothing: takes the built plugin ($AM_BUILDDIR/.libs/spank_am.so, or
# AM_SPANK_PLUGIN_SO), starts tests/slurm/cluster with it (4 nodes x 4 fake GPUs), drives
# sbatch, srun and salloc through every case of issue 3, asserts the exact lines users
# see, and stops the cluster on exit. It fails (never skips) when the cluster cannot
# start, for example when not run as root. `make check` runs it; alone:
#   AM_BUILDDIR=$PWD AM_SRCDIR=$PWD AM_MODELS_DIR=$PWD/runtime/recipe/models tests/slurm/test-spank.sh
# Set AM_TEST_KEEP=1 to keep the work directory and the cluster's logs after a run.
set -uo pipefail

SRCDIR=${AM_SRCDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILDDIR=${AM_BUILDDIR:-$SRCDIR}
PLUGIN=${AM_SPANK_PLUGIN_SO:-$BUILDDIR/.libs/spank_am.so}
CLUSTER=$SRCDIR/tests/slurm/cluster
AM_PLAN=$BUILDDIR/am-plan
export AM_MODELS_DIR=${AM_MODELS_DIR:-$SRCDIR/runtime/recipe/models}
AM_CLUSTER_DIR=/tmp/am-spank-test.$$
KEEP=${AM_TEST_KEEP:-0}
export -n AM_BUILDDIR AM_SRCDIR AM_CLUSTER_DIR AM_TEST_KEEP AM_SPANK_PLUGIN_SO 2>/dev/null # the jobs must not see the harness's variables
cluster() { AM_CLUSTER_DIR=$AM_CLUSTER_DIR "$CLUSTER" "$@"; }
export COLUMNS=80 # Slurm wraps --help at $COLUMNS
# The caller's own settings must not leak into the jobs under test.
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR SLURM_JOB_ID SLURM_JOBID UCX_TLS NCCL_IB_HCA \
  CUDA_DEVICE_MAX_CONNECTIONS
for v in $(compgen -e | grep -E '^(SLURM_SPANK_|SPANK_)' || true); do unset "$v"; done

FAILED=0
PASSED=0
say() { printf 'test-spank: %s\n' "$*"; }
fail() { say "FAIL: $*"; FAILED=$((FAILED + 1)); }
pass() { PASSED=$((PASSED + 1)); }

WORK=$(mktemp -d /tmp/am-spank-work.XXXXXX) || { say "cannot create a work directory"; exit 1; }
cleanup() {
  local rc=$?
  cluster down >/dev/null 2>&1 || say "warning: cluster down failed"
  if [[ $KEEP == 1 || $FAILED -ne 0 || $rc -ne 0 ]]; then
    say "work directory kept: $WORK; cluster logs: $AM_CLUSTER_DIR/log"
  else
    cluster down --purge >/dev/null 2>&1
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

# ---- setup -----------------------------------------------------------------------------
[[ -f $PLUGIN ]] || { say "FAIL: no plugin at $PLUGIN (build first: make)"; exit 1; }
[[ -x $AM_PLAN ]] || { say "FAIL: no am-plan at $AM_PLAN (build first: make)"; exit 1; }

# Only slurm_spank_* and the SPANK_PLUGIN variables are exported.
exports=$(nm -D --defined-only "$PLUGIN" | awk '{print $3}' | sort | tr '\n' ' ')
expected_exports="plugin_name plugin_type plugin_version slurm_spank_exit slurm_spank_init "
expected_exports+="slurm_spank_init_post_opt slurm_spank_local_user_init slurm_spank_task_init "
expected_exports+="slurm_spank_user_init spank_plugin_version "
if [[ $exports == "$expected_exports" ]]; then pass; else fail "exported symbols: $exports"; fi

# Everything the jobs touch is readable by the unprivileged user 'nobody' too.
chmod 0755 "$WORK"
mkdir -p "$WORK/site" "$WORK/sub" "$WORK/logs" "$WORK/sub/adir"
chmod 0755 "$WORK/site" "$WORK/sub"
chmod 1777 "$WORK/logs"
cp "$SRCDIR"/sbatch-templates/recipes/{tiny,tiny_moe,tiny_lora,llama70b}.yaml "$WORK/site/"
cp "$SRCDIR/tests/slurm/recipes/wide.yaml" "$WORK/site/"
cp "$SRCDIR/sbatch-templates/recipes/tiny.yaml" "$WORK/sub/mine.yaml"
printf 'password: hunter2-SECRET\napi_key: sk-SECRET\n' >"$WORK/sub/notrecipe.yaml"
printf 'model: {hidden_size: 64}\n' >"$WORK/sub/rootonly.yaml"
chmod 0600 "$WORK/sub/rootonly.yaml" # root's: nobody may not read it
cp "$SRCDIR/sbatch-templates/recipes/tiny.yaml" "$WORK/sub/noread.yaml"
chown nobody "$WORK/sub/noread.yaml" 2>/dev/null
chmod 0000 "$WORK/sub/noread.yaml"
head -c 4096 /dev/urandom | tr -d '\n' >"$WORK/sub/binary.yaml"
SITE=$WORK/site
ARGS="gpus_per_node=4 nvlink_domain=4 gpu_mem=16G recipe_path=/nonexistent:$SITE log_root=$WORK/logs"
ARGS+=" env=NCCL_IB_HCA=mlx5_0,mlx5_1 env=UCX_TLS=rc,sm"

say "starting the cluster ($AM_CLUSTER_DIR) with $PLUGIN"
if ! AM_SPANK_PLUGIN=$PLUGIN AM_SPANK_ARGS=$ARGS cluster up; then
  say "FAIL: the local Slurm cluster did not start (see above); nothing was tested"
  exit 1
fi
eval "$(cluster env)"
export -n AM_CLUSTER_DIR
cd "$WORK/sub" || exit 1

# The job scripts. `env` stands in for am-launch: these tests check what the tasks see.
cat >show.sh <<'EOF'
#!/bin/bash
#SBATCH -o out.%j
echo "== batch"
env | grep -E '^(AM_[A-Z_]+|SLURM_SPANK_AM_[A-Z_]+|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_IB_HCA|UCX_TLS)=' |
  grep -v '^AM_MODELS_DIR=' | sort
cd / # the recipe must not depend on the directory
echo "== srun"
srun -l --mpi=pmix /usr/bin/env | grep -E '^[0-9]+: (AM_[A-Z_]+|SLURM_SPANK_AM_[A-Z_]+|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_IB_HCA|UCX_TLS)=' |
  grep -v ': AM_MODELS_DIR=' | sort
echo "== end"
EOF
cat >directives.sh <<'EOF'
#!/bin/bash
#SBATCH -o out.%j
#SBATCH --am-recipe=tiny.yaml
#SBATCH --am-tp=2
env | grep -E '^AM_(RECIPE|TP)=' | sort
EOF
cat >bad-directive.sh <<'EOF'
#!/bin/bash
#SBATCH --am-recipe=tiny.yaml
#SBATCH --am-tp=3
true
EOF
# One job: a srun the plugin stops, a dry run, then a good srun: the stopped steps must
# not hold the job's resources.
cat >sequence.sh <<'EOF'
#!/bin/bash
#SBATCH -N 1 -n 2 -o out.%j
#SBATCH --am-recipe=tiny.yaml --am-tp=2
srun --am-tp=4 touch marker.bad; echo "bad rc=$?"
srun --am-dry-run touch marker.dry; echo "dry rc=$?"
srun -l printenv AM_RECIPE | sort; echo "good rc=$?"
srun -n 1 true 2>/dev/null; echo "helper rc=$?" # 1 rank cannot hold tp 2
srun -n 1 --am-off true; echo "off rc=$?"      # a helper step: not checked
ls marker.bad marker.dry 2>/dev/null; echo "== end"
EOF
# The committed template, with a stand-in for am-launch that shows the tasks' environment.
sed 's|^srun --mpi=pmix --kill-on-bad-exit=1 am-launch\( &\)\{0,1\}$|srun --mpi=pmix --kill-on-bad-exit=1 -l /usr/bin/env\1|' \
  "$SRCDIR/sbatch-templates/tiny.sbatch" >tiny-template.sh
grep -q '/usr/bin/env\( &\)\{0,1\}$' tiny-template.sh || fail "sbatch-templates/tiny.sbatch does not run srun ... am-launch"
chmod +x ./*.sh

# run NAME CMD...: runs CMD with stdout in NAME.out, stderr in NAME.err, status in NAME.rc
run() {
  local name=$1
  shift
  "$@" >"$name.out" 2>"$name.err"
  echo $? >"$name.rc"
}
# has FILE LINE: FILE holds exactly this line.
has() {
  if grep -qxF -- "$2" "$1" 2>/dev/null; then pass; else
    fail "$1 lacks the line: $2"
    sed 's/^/    | /' "$1" 2>/dev/null | head -20 | cut -c1-300
  fi
}
lacks() {
  if grep -qE -- "$2" "$1" 2>/dev/null; then
    fail "$1 has a line matching /$2/:"
    grep -E -- "$2" "$1" | head -5 | sed 's/^/    | /' | cut -c1-300
  else pass; fi
}
rc_is() {
  local got
  got=$(cat "$1.rc")
  if [[ $got == "$2" ]]; then pass; else fail "$1: exit status $got, expected $2"; fi
}
# empty FILE: nothing in FILE but Slurm's notes about waiting for nodes (other jobs of
# this test may be running).
empty() {
  if ! grep -vqE '^(srun|salloc): job [0-9]+ (queued and waiting for resources|has been allocated resources)$' "$1"; then
    pass
  else
    fail "$1 is not empty:"
    head -5 "$1" | sed 's/^/    | /'
  fi
}

# submit NAME SBATCH-ARGS...: sbatch --parsable; the job id in NAME.id
submit() {
  local name=$1
  shift
  run "$name" sbatch --parsable "$@"
  rc_is "$name" 0
  tr -d '\n' <"$name.out" >"$name.id"
}
jobout() { echo "out.$(cat "$1.id")"; }

# ---- sbatch --help -------------------------------------------------------------------------
run help sbatch --help
rc_is help 0
has help.out "      --am-recipe=FILE        am: train with this recipe (YAML). A relative FILE"
has help.out "      --am-tp=N               am: tensor-parallel size (sets distributed.tp_size"
has help.out "      --am-pp=N               am: pipeline-parallel size (sets"
has help.out "      --am-ep=N               am: expert-parallel size (sets"
has help.out "      --am-cp=N               am: context-parallel size (sets"
has help.out "      --am-log-dir=DIR        am: directory for the per-rank logs (default: the"
has help.out "      --am-dry-run            am: check the recipe and print the plan, run"
has help.out "      --am-off                am: not an am step: no checks, no AM_* settings,"

# ---- jobs that run (submitted together, checked once they are done) -------------------------
submit valid -N 2 --ntasks-per-node=2 --am-recipe=tiny.yaml --am-tp=2 show.sh
UCX_TLS=tcp submit local-recipe -N 1 -n 2 --am-recipe=./mine.yaml --am-log-dir=logs show.sh
submit directives -N 1 -n 1 directives.sh
submit directives-cli -N 1 -n 1 --am-tp=4 directives.sh
AM_RECIPE=tiny.yaml AM_TP=2 submit envform -N 1 -n 2 show.sh
AM_RECIPE=tiny.yaml AM_TP=4 AM_PP=2 submit envform-cli -N 1 -n 4 --am-tp=2 show.sh
submit plain -N 1 -n 2 show.sh
AM_TP=2 submit plain-amtp -N 1 -n 2 show.sh
submit export-none --export=NONE -N 1 -n 2 --am-recipe=tiny.yaml --am-tp=2 show.sh
submit sequence sequence.sh
submit template tiny-template.sh
empty plain.err

# ---- sbatch: rejected before submission ------------------------------------------------------
# reject NAME ARGS...: sbatch fails, submits nothing, prints Slurm's last line.
reject() {
  local name=$1
  shift
  run "$name" sbatch "$@"
  rc_is "$name" 1
  lacks "$name.out" "Submitted"
  has "$name.err" "sbatch: error: Plugin stack post-option processing failed"
}
E="sbatch: error: am:"
reject tp3 --am-recipe=tiny.yaml --am-tp=3 show.sh
has tp3.err "$E --am-tp=3: distributed.tp_size: 3 does not divide num_attention_heads = 4 (use 1, 2 or 4)"
has tp3.err "$E --am-tp=3: distributed.tp_size: 3 does not divide vocab_size = 256 (the vocabulary is split across tp ranks; use 1, 2, 4, 8, 16, 32 or 64)"
has tp3.err "$E job not submitted: fix the 3 problems above (am-plan $SITE/tiny.yaml --set distributed.tp_size=3 checks a recipe offline)"

# LoRA: what am-train does not run yet is refused at submission (tiny_lora.yaml adapts v_proj:
# at tp 4 each of the 2 kv heads would be shared by two ranks)
reject lora-kv --am-recipe=tiny_lora.yaml --am-tp=4 show.sh
has lora-kv.err "$E $SITE/tiny_lora.yaml:29:3: peft: adapters on k_proj or v_proj with tp_size 4 above the 2 kv heads (each kv head shared by several tp ranks) are not run by am-train yet: use tp_size 2 or less, or leave k_proj and v_proj out of the targets"

# One validation: what am-train refuses of a recipe, sbatch refuses before the job queues, with
# the line am-plan and am-train print (tests/recipe/refusals.tsv; test-refusals.sh checks those
# two and that every rule has a row)
i=0
while IFS=$'\t' read -r rule base edits message; do
  case $rule in '#'* | '') continue ;; esac
  i=$((i + 1))
  sed -e "$edits" "$SITE/$base.yaml" >"$SITE/refusal-$i.yaml"
  reject "refusal-$i" --am-recipe="$SITE/refusal-$i.yaml" show.sh
  plan=$("$AM_PLAN" "$SITE/refusal-$i.yaml" --nodes 1 --gpus-per-node 8 2>&1 | sed -n 's/^error: //p' |
    grep -F -- ": $message")
  if [[ -n $plan ]]; then has "refusal-$i.err" "$E $plan"; else fail "refusal $rule (row $i): am-plan did not print: $message"; fi
done <"$SRCDIR/tests/recipe/refusals.tsv"
[[ $i -gt 0 ]] || fail "no rows in tests/recipe/refusals.tsv"

reject directive-tp3 bad-directive.sh
has directive-tp3.err "$E --am-tp=3: distributed.tp_size: 3 does not divide num_attention_heads = 4 (use 1, 2 or 4)"

reject missing --am-recipe=nope.yaml show.sh
has missing.err "$E --am-recipe=nope.yaml: no such file in the current directory ($WORK/sub) nor in the site's recipe directories (/nonexistent:$SITE); give the path of an existing recipe file"
has missing.err "$E job not submitted: fix the problem above"
reject missing-abs --am-recipe=/nonexistent/x.yaml show.sh
has missing-abs.err "$E --am-recipe=/nonexistent/x.yaml: no such file (give the path of an existing recipe file)"

reject logdir-file --am-recipe=tiny.yaml --am-log-dir=mine.yaml show.sh
has logdir-file.err "$E --am-log-dir=mine.yaml: exists and is not a directory (give a directory, or a path that does not exist yet: am-launch creates it)"

reject directory --am-recipe=adir show.sh
has directory.err "$E --am-recipe=adir: $WORK/sub/adir is a directory, not a recipe file (give the recipe file in it, for example --am-recipe=adir/NAME.yaml)"

# as an unprivileged user: a root-only file, and a file with mode 000
nobody() { runuser -u nobody -- env SLURM_CONF="$SLURM_CONF" COLUMNS=80 sbatch "$@"; }
run rootonly nobody --am-recipe=rootonly.yaml show.sh
rc_is rootonly 1
has rootonly.err "$E $WORK/sub/rootonly.yaml: cannot open: Permission denied"
has rootonly.err "$E job not submitted: --am-recipe=rootonly.yaml could not be read as a recipe (give the path of a YAML recipe file you can read)"
lacks rootonly.err "hidden_size"
run noread nobody --am-recipe=noread.yaml show.sh
rc_is noread 1
has noread.err "$E $WORK/sub/noread.yaml: cannot open: Permission denied"

# files that are not recipes: their content is never echoed
reject notrecipe --am-recipe=notrecipe.yaml show.sh
has notrecipe.err "$E $WORK/sub/notrecipe.yaml: model: missing (give pretrained_model_name_or_path, or the architecture with config.json keys such as hidden_size)"
lacks notrecipe.err "SECRET|hunter2|password|api_key"
reject binary --am-recipe=binary.yaml show.sh
lacks binary.err "[^[:print:]]"
if [[ $(wc -l <binary.err) -le 5 ]]; then pass; else fail "binary.err has $(wc -l <binary.err) lines"; fi
reject passwd --am-recipe=/etc/passwd show.sh
has passwd.err "$E /etc/passwd:1:1: a recipe is a YAML mapping of sections (model:, distributed:, ...); this file is not"
lacks passwd.err "root:|/bin/"

# garbage values
EXPECT_TP="the tensor-parallel size must be a whole number from 1 to 1048576 (for example --am-tp=8)"
reject tp-abc --am-recipe=tiny.yaml --am-tp=abc show.sh
has tp-abc.err "$E --am-tp=abc: $EXPECT_TP"
has tp-abc.err "$E job not submitted: fix the problem above"
reject tp-neg --am-recipe=tiny.yaml --am-tp=-1 show.sh
has tp-neg.err "$E --am-tp=-1: $EXPECT_TP"
reject tp-empty --am-recipe=tiny.yaml --am-tp= show.sh
has tp-empty.err "$E --am-tp=: $EXPECT_TP"
reject tp-huge --am-recipe=tiny.yaml --am-tp=99999999999999999999999 show.sh
has tp-huge.err "$E --am-tp=99999999999999999999999: $EXPECT_TP"
reject pp-zero --am-recipe=tiny.yaml --am-pp=0 --am-cp=x show.sh
has pp-zero.err "$E --am-pp=0: the pipeline-parallel size must be a whole number from 1 to 1048576 (for example --am-pp=2)"
has pp-zero.err "$E --am-cp=x: the context-parallel size must be a whole number from 1 to 1048576 (for example --am-cp=2)"
has pp-zero.err "$E job not submitted: fix the 2 problems above"
big=$(head -c 102400 /dev/zero | tr '\0' 7)
reject tp-100k --am-recipe=tiny.yaml "--am-tp=$big" show.sh
has tp-100k.err "$E --am-tp=7777777777777777777777777777777777777777...(102400 bytes): $EXPECT_TP"
if [[ $(wc -c <tp-100k.err) -lt 2000 ]]; then pass; else fail "tp-100k.err is $(wc -c <tp-100k.err) bytes"; fi
reject recipe-100k "--am-recipe=${big//7/a}" show.sh
has recipe-100k.err "$E --am-recipe=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...(102400 bytes): the recipe path is longer than the 4095 bytes a path may have (give a shorter path)"
reject recipe-empty --am-recipe= show.sh
has recipe-empty.err "$E --am-recipe=: the recipe path is empty (give a path, for example --am-recipe=llama70b.yaml)"
reject binary-value --am-recipe=tiny.yaml $'--am-tp=\xff\xfe\x1b[31m' show.sh
has binary-value.err "$E --am-tp=\\xff\\xfe\\x1b[31m: $EXPECT_TP"
reject control-path $'--am-recipe=a\nb.yaml' show.sh
has control-path.err "$E --am-recipe=a\\x0ab.yaml: the recipe path contains a control character such as a newline or a tab (rename the file, or give a path without one)"
reject no-recipe --am-tp=2 show.sh
has no-recipe.err "$E --am-tp=2 needs a recipe: add --am-recipe=FILE (or set AM_RECIPE=FILE)"
AM_RECIPE=tiny.yaml AM_TP=abc reject env-abc show.sh
has env-abc.err "$E AM_TP=abc: the tensor-parallel size must be a whole number from 1 to 1048576 (for example AM_TP=8)"

# --am-dry-run in sbatch: checks, prints, submits nothing, exits 0
run submit-dry sbatch --am-recipe=tiny.yaml --am-tp=2 --am-dry-run show.sh
rc_is submit-dry 0
has submit-dry.out "am: dry run: $SITE/tiny.yaml passes every check that needs no allocation"
has submit-dry.out "am:   model llama, 4 layers, hidden 64, 4 heads (2 kv); tp 2, pp 1, cp 1, ep 1; fsdp2"
has submit-dry.out "am: dry run: the job was not submitted"
lacks submit-dry.out "Submitted"

# ---- srun: the checks that need the step's size -------------------------------------------------
S="srun: error: am:"
rm -f marker
run wide-tp8 srun -N 4 -n 16 --am-recipe=wide.yaml --am-tp=8 touch marker
rc_is wide-tp8 1
has wide-tp8.err "$S --am-tp=8: distributed.tp_size: 8 does not fit in one NVLink domain of 4 GPUs (use 1, 2 or 4)"
has wide-tp8.err "$S step not run: fix the problem above (am-plan $SITE/wide.yaml --nodes 4 --gpus-per-node 4 --nvlink-domain 4 --gpu-mem 16G --set distributed.tp_size=8 shows the plan); its tasks end with exit code 1 without running the command"
# where the tasks really run is checked on each node by slurmstepd, before the command
run wide-spread srun -N 2 --ntasks-per-node=2 -w n1,n2 --am-recipe=wide.yaml --am-tp=4 touch marker
rc_is wide-spread 1
for n in n1 n2; do
  has wide-spread.err "slurmstepd-$n: error: am: ranks 0-3 form a tensor-parallel group (tp 4), but this node runs only some of them: a tensor-parallel group must stay inside one node's NVLink domain (give each node a multiple of 4 tasks, e.g. --ntasks-per-node=4, and keep the default block distribution)"
  has wide-spread.err "slurmstepd-$n: error: am: the command was not run"
done
run wide-spread-dry srun -N 2 --ntasks-per-node=2 -w n1,n2 --am-recipe=wide.yaml --am-tp=4 --am-dry-run touch marker
rc_is wide-spread-dry 1
has wide-spread-dry.out "layout       tp 4 x pp 1 x cp 1 x dp 1 (replicate 1 x shard 1); ep 1 (ep_shard 1); fsdp2"
has wide-spread-dry.err "slurmstepd-n1: error: am: the command was not run"
run moe-ep srun -N 1 -n 2 --am-recipe=tiny_moe.yaml --am-ep=4 touch marker
rc_is moe-ep 1
has moe-ep.err "$S --am-ep=4: distributed.ep_size: 4 does not divide dp_size*cp_size = 2 (use 1 or 2)"
run per-node srun -N 1 -n 8 --overcommit -w n1 --am-recipe=wide.yaml touch marker
rc_is per-node 1
has per-node.err "slurmstepd-n1: error: am: this node runs 8 tasks of the step but has 4 GPUs, and am runs one rank per GPU (use --ntasks-per-node=4 or fewer)"
run memory srun -N 4 -n 16 --am-recipe=llama70b.yaml --am-tp=4 --am-pp=4 touch marker
rc_is memory 1
"$AM_PLAN" "$SITE/llama70b.yaml" --nodes 4 --gpus-per-node 4 --gpu-mem 16G --set distributed.tp_size=4 \
  --set distributed.pp_size=4 2>&1 >/dev/null | sed -n 's/^error: /srun: error: am: /p' >memory.expected
if [[ -s memory.expected ]]; then has memory.err "$(head -1 memory.expected)"; else fail "am-plan printed no memory error"; fi
if [[ ! -e marker ]]; then pass; else fail "a stopped step ran its command"; fi

run srun-missing srun -N 1 --am-recipe=nope.yaml touch marker
rc_is srun-missing 1
has srun-missing.err "$S --am-recipe=nope.yaml: no such file in the current directory ($WORK/sub) nor in the site's recipe directories (/nonexistent:$SITE); give the path of an existing recipe file"
has srun-missing.err "$S step not started: fix the problem above"

run srun-dry srun -N 2 --ntasks-per-node=2 --am-recipe=tiny.yaml --am-tp=2 --am-dry-run touch marker
rc_is srun-dry 0
has srun-dry.out "recipe       $SITE/tiny.yaml"
grep -qE '^am: dry run for step [0-9]+\.0: the command is not run$' srun-dry.out && pass || fail "srun-dry.out: no dry-run header"
has srun-dry.out "world        4 ranks on 2 nodes (2 per node), NVLink domains of 4 GPUs"
has srun-dry.out "layout       tp 2 x pp 1 x cp 1 x dp 2 (replicate 1 x shard 2); ep 1 (ep_shard 2); fsdp2"
has srun-dry.out "batch        global 16 = local 4 x dp 2 x 2 accumulation steps; sequence 64; 1024 tokens/step"
grep -qE '^memory/GPU   .* on pp rank 0 of 16\.0 GiB$' srun-dry.out && pass || fail "srun-dry.out: no memory line"
grep -q "does not shard yet" srun-dry.out && fail "srun-dry.out: fsdp2 says it does not shard" || pass
empty srun-dry.err
if [[ ! -e marker ]]; then pass; else fail "--am-dry-run ran the command"; fi

run srun-plain srun -N 1 -n 1 printenv
rc_is srun-plain 0
empty srun-plain.err
lacks srun-plain.out "^(AM_RECIPE|AM_TP|AM_LOG_DIR|SLURM_SPANK_AM_|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_IB_HCA|UCX_TLS)"

run salloc timeout 60 salloc -N 1 -n 2 --am-recipe=tiny.yaml --am-tp=2 \
  bash -c 'cd / && srun -l printenv AM_RECIPE AM_TP | sort'
rc_is salloc 0
has salloc.out "0: $SITE/tiny.yaml"
has salloc.out "1: 2"

# ---- the submitted jobs -----------------------------------------------------------------------
ids=$(cat ./*.id | tr '\n' ',')
for ((i = 0; i < 120; i++)); do
  [[ -z $(squeue -h -j "${ids%,}" 2>/dev/null) ]] && break
  sleep 0.5
done
[[ -z $(squeue -h -j "${ids%,}" 2>/dev/null) ]] || fail "jobs still running after 60 s: $(squeue -h -j "${ids%,}")"

o=$(jobout valid) j=$(cat valid.id)
for t in batch 0 1 2 3; do
  p=$([[ $t == batch ]] && echo "" || echo "$t: ")
  has "$o" "${p}AM_RECIPE=$SITE/tiny.yaml"
  has "$o" "${p}AM_TP=2"
  has "$o" "${p}AM_LOG_DIR=$WORK/logs/$j"
  has "$o" "${p}CUDA_DEVICE_MAX_CONNECTIONS=1"
  has "$o" "${p}NCCL_IB_HCA=mlx5_0,mlx5_1"
  has "$o" "${p}UCX_TLS=rc,sm"
done
has "$o" "== end"
lacks "$o" "SLURM_SPANK_AM_|AM_PP=|AM_EP=|AM_CP="

o=$(jobout local-recipe)
has "$o" "0: AM_RECIPE=$WORK/sub/mine.yaml"
has "$o" "1: AM_LOG_DIR=$WORK/sub/logs"
has "$o" "1: UCX_TLS=tcp" # the user's value wins over the site default
lacks "$o" "AM_TP=|CUDA_DEVICE_MAX_CONNECTIONS"

has "$(jobout directives)" "AM_TP=2"
has "$(jobout directives)" "AM_RECIPE=$SITE/tiny.yaml"
has "$(jobout directives-cli)" "AM_TP=4" # the command line wins over #SBATCH

o=$(jobout envform)
has "$o" "AM_RECIPE=$SITE/tiny.yaml"
has "$o" "1: AM_TP=2"
has "$o" "1: AM_RECIPE=$SITE/tiny.yaml"
o=$(jobout envform-cli)
has "$o" "3: AM_TP=2" # --am-tp wins over AM_TP
has "$o" "3: AM_PP=2"

o=$(jobout plain)
has "$o" "== end"
lacks "$o" "^([0-9]+: )?(AM_|SLURM_SPANK_AM_|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_IB_HCA|UCX_TLS)"
o=$(jobout plain-amtp) # AM_TP alone does not make an am job: it passes through untouched
has "$o" "1: AM_TP=2"
lacks "$o" "AM_RECIPE|AM_LOG_DIR|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_IB_HCA"

o=$(jobout export-none)
has "$o" "AM_RECIPE=$SITE/tiny.yaml"
has "$o" "1: AM_RECIPE=$SITE/tiny.yaml"
has "$o" "1: AM_TP=2"

o=$(jobout sequence)
has "$o" "srun: error: am: step not run: fix the problem above (am-plan $SITE/tiny.yaml --nodes 1 --gpus-per-node 2 --nvlink-domain 4 --gpu-mem 16G --set distributed.tp_size=4 shows the plan); its tasks end with exit code 1 without running the command"
has "$o" "bad rc=1"
has "$o" "dry rc=0"
has "$o" "0: $SITE/tiny.yaml"
has "$o" "good rc=0"
has "$o" "helper rc=1"
has "$o" "off rc=0"
has "$o" "== end"
lacks "$o" "^marker"

o=am-tiny-$(cat template.id).out
for t in 0 1 2 3; do
  has "$o" "$t: AM_RECIPE=$SITE/tiny.yaml"
  has "$o" "$t: AM_TP=2"
done

# no node was drained by any of this
bad_nodes=$(sinfo -h -N -o '%N %T' | grep -vE ' (idle|mixed|allocated|completing)$' || true)
if [[ -z $bad_nodes ]]; then pass; else fail "nodes not healthy: $bad_nodes"; fi

# ---- a compute node whose plugstack.conf line is wrong: am jobs fail, others run, no drain ---
run held-am sbatch --parsable -H -w n1 -N 1 -n 1 -o held.%j --am-recipe=tiny.yaml --wrap='echo AM RAN'
run held-plain sbatch --parsable -H -w n1 -N 1 -n 1 -o held.%j --wrap='echo PLAIN RAN'
sed -i 's/$/ bogus=1/' "$AM_CLUSTER_DIR/etc/plugstack.conf" # what slurmstepd reads from now on
held="$(cat held-am.out),$(cat held-plain.out)"
scontrol release "$held"
for ((i = 0; i < 60; i++)); do [[ -z $(squeue -h -j "$held" 2>/dev/null) ]] && break; sleep 0.5; done
has "held.$(cat held-am.out)" "slurmstepd-n1: error: am: this node's plugstack.conf is invalid: plugstack.conf argument 'bogus=1': unknown key 'bogus' (valid keys: gpus_per_node, nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch) (ask the cluster's admin; docs/admin.md lists the keys)"
lacks "held.$(cat held-am.out)" "AM RAN"
has "held.$(cat held-plain.out)" "PLAIN RAN"
bad_nodes=$(sinfo -h -N -o '%N %T' | grep -vE ' (idle|mixed|allocated|completing)$' || true)
if [[ -z $bad_nodes ]]; then pass; else fail "nodes not healthy: $bad_nodes"; fi

# ---- an invalid plugstack.conf argument stops every command, naming it ----------------------
cluster down >/dev/null 2>&1
if AM_SPANK_PLUGIN=$PLUGIN AM_SPANK_ARGS="gpus_per_node=4 bogus=1" cluster up >cluster-bad.log 2>&1; then
  run badconf sbatch --wrap=true
  rc_is badconf 1
  has badconf.err "sbatch: error: am: plugstack.conf argument 'bogus=1': unknown key 'bogus' (valid keys: gpus_per_node, nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch)"
  has badconf.err "sbatch: error: Failed to initialize plugin stack"
else
  fail "the cluster did not start with a bad plugstack.conf:"
  sed 's/^/    | /' cluster-bad.log
fi

# ---- sbatch=0: sbatch checks only the syntax; srun checks the recipe -------------------------
cluster down >/dev/null 2>&1
if AM_SPANK_PLUGIN=$PLUGIN AM_SPANK_ARGS="sbatch=0 recipe_path=$SITE" cluster up >cluster-nosbatch.log 2>&1; then
  reject nosbatch-syntax --am-recipe=tiny.yaml --am-tp=abc show.sh
  has nosbatch-syntax.err "$E --am-tp=abc: $EXPECT_TP"
  run nosbatch sbatch --parsable --wait -N 1 -n 1 --am-recipe=nope.yaml show.sh
  rc_is nosbatch 0
  o=out.$(head -1 nosbatch.out)
  lacks "$o" "^(AM_RECIPE|AM_LOG_DIR)=" # sbatch resolved nothing, so the batch script gets nothing
  has "$o" "srun: error: am: --am-recipe=nope.yaml: no such file in the current directory (/) nor in the site's recipe directories ($SITE); give the path of an existing recipe file"
else
  fail "the cluster did not start with sbatch=0:"
  sed 's/^/    | /' cluster-nosbatch.log
fi

say "$PASSED checks passed, $FAILED failed"
[[ $FAILED -eq 0 ]]
