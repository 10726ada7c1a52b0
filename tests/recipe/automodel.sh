#!/bin/bash
# Recipes in AutoModel's layout, each with its exact am-plan outcome written in its header:
#   # args: --nodes 1 --gpus-per-node 8          am-plan's options (default: --gpus-per-node 8)
#   # env: NAME=VALUE                            set for this recipe only (repeatable)
#   # rc: 1                                      am-plan's exit status
#   # want: TEXT                                 a line of the output (stdout and stderr), exactly
#   # want-json: TEXT                            a fixed string in the --json output
#   # lacks: TEXT                                a fixed string that must not appear
# Planning uses the configs shipped with am and an empty Hugging Face cache, so the outcome
# does not depend on the machine.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=$AM_SRCDIR/runtime/recipe/models
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
export HF_HUB_CACHE=$cache
unset HF_HOME
fails=0 passes=0
cd "$AM_SRCDIR/tests/recipe" || exit 1
for f in automodel/*.yaml; do
    header=$(grep '^# [a-z-]*: ' "$f")
    args=$(sed -n 's/^# args: //p' <<<"$header")
    [ -n "$args" ] || args="--gpus-per-node 8"
    mapfile -t envs < <(sed -n 's/^# env: //p' <<<"$header")
    want_rc=$(sed -n 's/^# rc: //p' <<<"$header")
    # shellcheck disable=SC2086
    out=$(env "${envs[@]}" "$AM_BUILDDIR/am-plan" "$f" $args 2>&1)
    rc=$?
    # shellcheck disable=SC2086
    json=$(env "${envs[@]}" "$AM_BUILDDIR/am-plan" "$f" $args --json 2>&1)
    bad=""
    [ "$rc" = "${want_rc:-0}" ] || bad="exit $rc, want ${want_rc:-0}"
    while IFS= read -r w; do
        [ -z "$w" ] || grep -qxF -- "$w" <<<"$out" || bad="$bad; missing line: $w"
    done < <(sed -n 's/^# want: //p' <<<"$header")
    while IFS= read -r w; do
        [ -z "$w" ] || grep -qF -- "$w" <<<"$json" || bad="$bad; missing in --json: $w"
    done < <(sed -n 's/^# want-json: //p' <<<"$header")
    while IFS= read -r w; do
        [ -z "$w" ] || ! grep -qF -- "$w" <<<"$out$json" || bad="$bad; unwanted: $w"
    done < <(sed -n 's/^# lacks: //p' <<<"$header")
    if [ -n "$bad" ]; then
        echo "FAIL: $f: ${bad#; }"
        sed 's/^/    /' <<<"$out"
        fails=$((fails + 1))
    else
        echo "ok: $f"
        passes=$((passes + 1))
    fi
done
echo "automodel recipes: $passes passed, $fails failed"
[ "$fails" = 0 ] && [ "$passes" -gt 0 ]
