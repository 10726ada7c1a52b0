# tests/train/load-lib.sh - what the quantised checkpoints' load tests share (sourced by
# test-fp8-load.sh and test-mxfp4-load.sh): the test environment, a work directory $T (kept when
# AM_KEEP is set), the counts of passed and failed checks (ok, bad), the golden venv's python
# $PY, a byte-level corpus $T/corpus, and the tiny recipe's one-step runs (recipe, first).

: "${AM_SRCDIR:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT 2>/dev/null || true
PY=${AM_GOLDEN_PYTHON:-/tmp/goldenv/bin/python}
T=$(mktemp -d "/tmp/am-$(basename "$0" .sh)-XXXXXX")
trap '[ -n "${AM_KEEP:-}" ] || rm -rf "$T"' EXIT
fails=0 passes=0
ok() { echo "ok: $*"; passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" /usr/share/common-licenses/* >/dev/null || exit 1

# recipe DIR NAME [bf16 [save]]: $T/NAME.yaml, the tiny recipe on the model in DIR, one step of
# 32 tokens of the corpus (bf16: in bf16; save: a checkpoint, consolidated, in ckpt-NAME)
recipe() {
    awk -v base="$1" -v data="$T/corpus" -v bf="${3:-}" -v save="${4:-}" -v name="$2" '
        /^model:/ { print "model:\n  pretrained_model_name_or_path: " base "\n"; skip = 1; next }
        skip && /^[a-z]/ { skip = 0 }
        skip { next }
        bf && /param_dtype:/ { sub(/param_dtype: .*/, "param_dtype: bfloat16") }
        { sub(/paths: .*/, "paths: " data); sub(/max_steps: .*/, "max_steps: 1"); sub(/seq_length: .*/, "seq_length: 32");
          sub(/ckpt_every_steps: .*/, "ckpt_every_steps: 1"); sub(/checkpoint_dir: .*/, "checkpoint_dir: ckpt-" name);
          if (save) sub(/enabled: false/, "enabled: true\n  save_consolidated: true"); print }' \
        "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$T/$2.yaml"
}

# first NAME NPROC RECIPE [VAR=VALUE...]: trains one step; prints rank 0's first loss
first() {
    local name=$1 n=$2 r=$3
    shift 3
    (cd "$T" && env ${1+"$@"} "$AM_BUILDDIR/am-launch" --nproc "$n" --log-dir "$T/logs-$name" "$r.yaml" \
        >"$T/$name.out" 2>"$T/$name.err") || { echo "did-not-train"; return; }
    grep -h '"type":"step"' "$T/logs-$name"/*/rank-0.jsonl | head -1 | sed -E 's/.*"loss":([^,]*),.*/\1/'
}
