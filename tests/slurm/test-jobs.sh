#!/usr/bin/env bash
# tests/slurm/test-jobs.sh: jobs as a user submits them, on the local Slurm cluster
# (tests/slurm/cluster, 4 nodes) with the SPANK plugin:
#   - README's Slurm example, its lines read from README.md (so they cannot drift) and run
#     as written, but for the install prefix: this tree is not installed, so the installed
#     paths (/usr/local/share/am/...) are mapped to the source tree's, and the plugin's
#     recipe_path names the source tree's recipes (the default, PREFIX/share/am/recipes, is
#     checked by test_spank_config). The job must train to its last step;
#   - the shipped template with --ntasks-per-node=1 (tp 2 cannot be placed on one rank per
#     node): the ranks' placement error is printed and is rank 0's cause record; am-diag
#     names rank 0, its host and that message;
#   - a handed-over recipe path with a newline, seen in slurmstepd (srun run with a
#     configuration without the plugin, so that it hands the variable over as set): the
#     step fails with a message that says so; and sbatch refusing a relative recipe from a
#     current directory whose name has a newline.
# Fails, never skips, when the cluster cannot start. Alone:
#   AM_BUILDDIR=$PWD AM_SRCDIR=$PWD tests/slurm/test-jobs.sh
# With AM_INSTALLED_DATADIR=PREFIX/share/am (tests/slurm/test-installed.sh: the Debian
# packages) README's paths, the templates and the plugin's recipe_path are the installed ones.
set -uo pipefail

SRCDIR=${AM_SRCDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILDDIR=${AM_BUILDDIR:-$SRCDIR}
PLUGIN=${AM_SPANK_PLUGIN_SO:-$BUILDDIR/.libs/spank_am.so}
CLUSTER=$SRCDIR/tests/slurm/cluster
export AM_CLUSTER_DIR=/tmp/am-jobs-test.$$
if [[ -n ${AM_INSTALLED_DATADIR:-} ]]; then
  TEMPLATES=$AM_INSTALLED_DATADIR/sbatch-templates RECIPES=$AM_INSTALLED_DATADIR/recipes
else
  TEMPLATES=$SRCDIR/sbatch-templates RECIPES=$SRCDIR/sbatch-templates/recipes
fi
export -n AM_INSTALLED_DATADIR 2>/dev/null # the jobs must not see the harness's variables
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT AM_TOPOLOGY_FILE SLURM_JOB_ID SLURM_JOBID \
  PMIX_NAMESPACE PMIX_RANK SLURM_STEP_ID SLURM_PROCID
for v in $(compgen -e | grep -E '^(SLURM_SPANK_|SPANK_)' || true); do unset "$v"; done
export PATH=$BUILDDIR:$PATH # am-launch and am-diag of this build, as `make install` would put them in PATH
ulimit -c 0

FAILED=0
say() { printf 'test-jobs: %s\n' "$*"; }
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILED=1; }
show() { sed 's/^/    /' "$@" | head -n 40; }

WORK=$(mktemp -d /tmp/am-jobs-work.XXXXXX) || exit 1
chmod 755 "$WORK"
cleanup() {
  "$CLUSTER" down --purge >/dev/null 2>&1
  [[ $FAILED == 0 ]] && rm -rf "$WORK" || say "work directory kept: $WORK"
}
trap cleanup EXIT

[[ -f $PLUGIN ]] || { say "FAIL: no plugin at $PLUGIN (build first: make)"; exit 1; }
if ! AM_SPANK_PLUGIN=$PLUGIN AM_SPANK_ARGS="recipe_path=$RECIPES" "$CLUSTER" up \
  >"$WORK/cluster.log" 2>&1; then
  say "FAIL: the local Slurm cluster did not start; nothing was tested"
  show "$WORK/cluster.log"
  exit 1
fi
eval "$("$CLUSTER" env)"

# README's "Try it" dataset, in each job's directory
demo_data() {
  mkdir -p "$1" && (cd "$1" && am-data build --bytes --out am-demo/corpus_text_document /usr/share/common-licenses/* \
    >/dev/null) || { fail "cannot build the demo dataset in $1"; return 1; }
}

# ---- README's Slurm example, as written ---------------------------------------------------
# The indented lines of the paragraph that starts "On a Slurm cluster", up to the next heading.
awk '/^On a Slurm cluster/ { on = 1 } on && /^#/ { exit } on && /^    [^ ]/ { sub(/^    /, ""); print }' \
  "$SRCDIR/README.md" >"$WORK/readme.lines"
if [[ $(grep -c '^sbatch ' "$WORK/readme.lines") == 1 ]]; then
  pass "README's Slurm example: $(tr '\n' ';' <"$WORK/readme.lines")"
else
  fail "README's Slurm paragraph has no single sbatch line"; show "$WORK/readme.lines"
fi
sed -e "s|/usr/local/share/am/sbatch-templates/|$TEMPLATES/|g" \
  -e "s|/usr/local/share/am/recipes/|$RECIPES/|g" "$WORK/readme.lines" >"$WORK/readme.sh"
demo_data "$WORK/readme" &&
  (cd "$WORK/readme" && timeout 600 bash -e "$WORK/readme.sh") >"$WORK/readme.out" 2>"$WORK/readme.err"
rc=$?
[[ $rc == 0 ]] && pass "README's Slurm lines exit 0" || { fail "README's Slurm lines exited $rc"; show "$WORK/readme.err" "$WORK/readme.out"; }
grep -qE '^Submitted batch job [0-9]+$' "$WORK/readme.out" && pass "README: the job was submitted" || fail "README: no 'Submitted batch job'"
last=$(grep -E '^step +[0-9]+/300 \|' "$WORK/readme.out" | tail -n 1)
if [[ $last =~ ^step\ +300/300\ \|\ loss\ ([0-9.]+) ]] && awk -v l="${BASH_REMATCH[1]}" 'BEGIN { exit !(l < 2.5) }'; then
  pass "README: the job trained to step 300 ($last)"
else
  fail "README: no last step with a loss below 2.5 in the output"; show "$WORK/readme.out"
fi

# ---- the template with one task per node: the placement error is the cause record ----------
demo_data "$WORK/placement"
(cd "$WORK/placement" && timeout 300 sbatch --wait --ntasks-per-node=1 "$TEMPLATES/tiny.sbatch") \
  >"$WORK/placement.sbatch" 2>&1
rc=$?
# (the job's status is srun's: the template's --kill-on-bad-exit=1 kills the failed rank's task
# while it waits for the others' records, so it is 137 or 1, depending on which task ends first)
[[ $rc == 1 || $rc == 137 ]] && pass "tiny.sbatch --ntasks-per-node=1: the job fails ($rc)" || { fail "tiny.sbatch --ntasks-per-node=1: sbatch --wait exited $rc, want 1 or 137"; show "$WORK/placement.sbatch"; }
job=$(sed -nE 's/^Submitted batch job ([0-9]+)$/\1/p' "$WORK/placement.sbatch")
out=$WORK/placement/am-tiny-$job.out
msg=$(sed -nE 's/^am-train: error: (placement: .*)$/\1/p' "$out")
if [[ $msg == "placement: tp_size 2 cannot be placed: NVLink domain "* ]] && [[ $(grep -c '^am-train: error: placement' "$out") == 1 ]]; then
  pass "the placement error printed once: $msg"
else
  fail "no single placement error in the job's output"; show "$out"
fi
dir=$WORK/placement/am-logs/$job.0
host0=$(head -n 1 "$dir/rank-0.jsonl" | jq -r 'select(.type == "start") | .host')
[[ $host0 =~ ^n[1-4]$ ]] && pass "rank 0's log starts with its start record (host $host0)" || { fail "rank 0's first record is not a start record with its node"; show "$dir/rank-0.jsonl"; }
[[ $(head -n 1 "$dir/rank-0.jsonl" | jq -r .job) == "$job.0" ]] && pass "the start record names the job $job.0" || fail "the start record lacks the job $job.0"
if jq -se --arg m "$msg" 'any(.[]; .type == "cause" and .cause == "error" and .stage == "setup" and .rank == 0 and .message == $m)' \
  "$dir/rank-0.jsonl" >/dev/null; then
  pass "rank 0's cause record is the error it printed"
else
  fail "rank 0's log lacks the cause record"; show "$dir/rank-0.jsonl"
fi
am-diag "$dir" >"$WORK/placement.diag"
drc=$?
[[ $drc == 1 ]] && pass "am-diag finds the failure (1)" || fail "am-diag exited $drc, want 1"
want=("am-diag: job $job.0 ($dir): 2 ranks, FAILED" "first failure: rank 0 on $host0 (local rank 0), ")
grep -qxF "${want[0]}" "$WORK/placement.diag" && pass "am-diag: '${want[0]}'" || { fail "am-diag lacks '${want[0]}'"; show "$WORK/placement.diag"; }
grep -qF "${want[1]}" "$WORK/placement.diag" && pass "am-diag: '${want[1]}...'" || { fail "am-diag lacks '${want[1]}'"; show "$WORK/placement.diag"; }
grep -qxF "  cause: error: $msg" "$WORK/placement.diag" &&
  pass "am-diag gives the cause: the placement error" ||
  { fail "am-diag lacks '  cause: error: $msg'"; show "$WORK/placement.diag"; }
json=$(am-diag "$dir" --json)
want="\"first_failure\":{\"rank\":0,\"host\":\"$host0\",\"cause\":\"error\",\"signal\":null,\"step\":null,\"status\":1,\"local_rank\":0,"
[[ $json == *"$want"* ]] && pass "am-diag --json: $want" || { fail "am-diag --json lacks $want"; echo "$json" | cut -c1-600; }
grep -qE "job \?|unknown host|without a cause record|no start record" "$WORK/placement.diag" &&
  { fail "am-diag misses a start or cause record"; show "$WORK/placement.diag"; } || pass "am-diag has every rank's start record"

# ---- a handed-over path with a newline ------------------------------------------------------
# srun with a configuration whose plugstack.conf is empty hands SLURM_SPANK_AM_RECIPE over as
# it is; slurmstepd's plugin (the cluster's configuration) checks it.
mkdir -p "$WORK/noplugin"
sed "s|^PlugStackConfig=.*|PlugStackConfig=$WORK/noplugin/plugstack.conf|" "$AM_CLUSTER_DIR/etc/slurm.conf" >"$WORK/noplugin/slurm.conf"
: >"$WORK/noplugin/plugstack.conf"
(cd "$WORK" && SLURM_CONF=$WORK/noplugin/slurm.conf SLURM_SPANK_AM_RECIPE=$'/tmp/am\nrecipe.yaml' timeout 60 \
  srun -N 1 -n 1 -w n1 touch "$WORK/ran") >"$WORK/newline.out" 2>"$WORK/newline.err"
rc=$?
[[ $rc == 1 ]] && pass "a handed-over recipe path with a newline: the step fails (1)" || fail "newline step exited $rc, want 1"
[[ ! -e $WORK/ran ]] && pass "the command was not run" || fail "the step's command ran"
line="slurmstepd-n1: error: am: the step's SLURM_SPANK_AM_RECIPE='/tmp/am\\x0arecipe.yaml' contains a newline: the am plugin hands over only absolute paths of printable characters (rename the file or directory that has it; the variable is set by the am plugin in sbatch and srun, do not set it yourself)"
grep -qxF "$line" "$WORK/newline.err" && pass "slurmstepd says the path contains a newline" || { fail "no line: $line"; show "$WORK/newline.err"; }
grep -qxF "slurmstepd-n1: error: am: the command was not run" "$WORK/newline.err" && pass "and that the command was not run" || fail "no 'the command was not run'"

# sbatch refuses a relative recipe when the current directory's name has a newline
nl=$WORK/$'new\nline'
mkdir -p "$nl" && cp "$RECIPES/tiny.yaml" "$nl/mine.yaml"
(cd "$nl" && timeout 60 sbatch --am-recipe=mine.yaml --wrap true) >"$WORK/cwd.out" 2>"$WORK/cwd.err"
rc=$?
[[ $rc != 0 ]] && pass "sbatch refuses (exit $rc)" || fail "sbatch accepted a recipe under a directory with a newline"
line="sbatch: error: am: --am-recipe=mine.yaml: the current directory, $WORK/new?line, contains a newline, which no path handed to the tasks may have (rename it, or give the path from a directory without one)"
grep -qxF "$line" "$WORK/cwd.err" && pass "sbatch says the current directory contains a newline" || { fail "no line: $line"; show "$WORK/cwd.err"; }

# ---- a LoRA fine-tune on instruction data (tiny_lora.yaml) through the shipped template -------
# JSONL prompt/response rows tokenized with a tokenizer.json and the loss mask (am-data build
# --instruction), the bundled LoRA recipe given on sbatch's command line (it wins over the
# template's #SBATCH --am-recipe), tp 2 x dp 2 on 2 nodes: the job trains to its last step and
# its checkpoint holds the adapters as the peft library saves them.
mkdir -p "$WORK/lora/am-demo"
awk 'NF { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, " "); if (p != "") printf "{\"prompt\": \"%s\", \"response\": \"%s\"}\n", p, $0; p = $0 }' \
  /usr/share/common-licenses/GPL-3 | head -n 300 >"$WORK/lora/rows.jsonl"
if (cd "$WORK/lora" && am-data build --tokenizer "$SRCDIR/tests/data/tokenizer/gpt2.json" --instruction \
  --eos '<|endoftext|>' --out am-demo/instructions rows.jsonl >/dev/null); then
  (cd "$WORK/lora" && timeout 600 sbatch --wait --am-recipe=tiny_lora.yaml "$TEMPLATES/tiny.sbatch") \
    >"$WORK/lora.sbatch" 2>&1
  rc=$?
  job=$(sed -nE 's/^Submitted batch job ([0-9]+)$/\1/p' "$WORK/lora.sbatch")
  out=$WORK/lora/am-tiny-$job.out
  [[ $rc == 0 ]] && pass "tiny_lora.yaml under sbatch: the job succeeds" || { fail "tiny_lora.yaml under sbatch: sbatch --wait exited $rc"; show "$WORK/lora.sbatch" "$out"; }
  first=$(grep -E '^step +1/40 \|' "$out" | sed -nE 's/.*loss ([0-9.]+).*/\1/p')
  last=$(grep -E '^step +40/40 \|' "$out" | sed -nE 's/.*loss ([0-9.]+).*/\1/p')
  if [[ -n $first && -n $last ]] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
    pass "tiny_lora.yaml under sbatch trained 40 steps: loss $first -> $last"
  else
    fail "tiny_lora.yaml under sbatch: no falling loss from step 1 to 40 ($first -> $last)"; show "$out"
  fi
  ad=$WORK/lora/checkpoints/tiny_lora/step-40/peft
  if [[ -s $ad/adapter_model.safetensors ]] && jq -e '.peft_type == "LORA" and .r == 8 and .lora_alpha == 32' \
    "$ad/adapter_config.json" >/dev/null; then
    pass "the job's checkpoint holds the adapters as peft saves them (step-40/peft)"
  else
    fail "no peft adapters in $ad"; ls -la "$WORK/lora/checkpoints/tiny_lora/step-40" 2>&1 | show /dev/stdin
  fi
else
  fail "am-data build --instruction in the LoRA job's directory"
fi

if [[ $FAILED == 0 ]]; then say "all checks passed"; exit 0; fi
say "some checks FAILED"
exit 1
