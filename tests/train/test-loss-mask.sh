#!/bin/bash
# The trainer honours instruction data's loss mask (PREFIX.mask, docs/data.md): a masked label
# adds nothing to the loss or the gradients, and the loss is the mean over the labels counted
# in the global batch (AutoModel's normalisation by its num_label_tokens). On the tiny recipe,
# one step from the same initial weights:
#   - a mask of all ones trains exactly as no mask (the same loss, bit for bit);
#   - with mask M and its complement 1 - M: loss_M * n_M + loss_(1-M) * n_(1-M) = loss * N
#     (N = every label of the batch), to 1e-5 relative: the masked labels contribute nothing
#     to either sum, and each is normalised by its own count (label_tokens in the step record);
#   - dp 2 (each rank half of the batch), pp 2 and cp 2 give one rank's losses over 3 steps to
#     1e-5: the count is the whole global batch's on every rank, the masked targets reach the
#     last stage and each cp rank's rows;
#   - packed (packed_sequence_size 64: the rows packed whole, docs/data.md): the masked targets
#     are dropped from the packs' count too (fewer than the packs' targets without the mask),
#     and cp 2 gives one rank's losses.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
AM_BUILDDIR=$(cd "$AM_BUILDDIR" && pwd)
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# instruction rows from Debian's license texts: a line as the prompt, the next as the response
awk 'NF { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, " "); if (p != "") printf "{\"prompt\": \"%s\", \"response\": \"%s\"}\n", p, $0; p = $0 }' \
    /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 | head -400 >"$work/rows.jsonl"
mkdir -p "$work/M" "$work/ones" "$work/comp" "$work/none"
"$AM_BUILDDIR/am-data" build --tokenizer "$AM_SRCDIR/tests/data/tokenizer/gpt2.json" --instruction \
    --eos '<|endoftext|>' --out "$work/M/ds" "$work/rows.jsonl" >/dev/null || fail "am-data build --instruction"
for d in ones comp none; do cp "$work/M/ds.bin" "$work/M/ds.idx" "$work/$d/"; done
# the other masks, as token-id files: one document per line, the lengths of ds.idx
S=$(od -An -t u8 -j 18 -N 8 "$work/M/ds.idx" | tr -d ' ')
od -An -v -t d4 -j 34 -N $((4 * S)) "$work/M/ds.idx" | tr -s ' ' '\n' | grep . >"$work/lengths"
od -An -v -t u1 "$work/M/ds.mask.bin" | tr -s ' ' '\n' | grep . >"$work/values"
for kind in ones comp; do
    awk -v kind=$kind 'NR == FNR { len[++n] = $1; next } { v[++m] = $1 }
        END { k = 0; for (d = 1; d <= n; d++) { line = ""; for (i = 0; i < len[d]; i++) { x = v[++k];
              line = line (i ? " " : "") (kind == "ones" ? 1 : 1 - x) } print line } }' \
        "$work/lengths" "$work/values" >"$work/$kind.txt"
    "$AM_BUILDDIR/am-data" build --out "$work/$kind/ds.mask" "$work/$kind.txt" >/dev/null || fail "mask $kind"
done

vocab=$(sed -nE 's/.*dtype ([a-z0-9]+).*token ids 0 to ([0-9]+).*/\2/p' < <("$AM_BUILDDIR/am-data" info "$work/M/ds"))
[ "${vocab:-0}" -lt 1024 ] || fail "ids up to $vocab do not fit the recipe's vocabulary"
sed -e "s|paths: .*|paths: ds|" -e "s/max_steps: .*/max_steps: 3/" -e "s/vocab_size: .*/vocab_size: 1024/" \
    -e "s/lr_warmup_steps: .*/lr_warmup_steps: 1/" "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/tiny.yaml"
train() { # DIR NPROC [VAR=VALUE...]
    local dir=$1 n=$2
    shift 2
    (cd "$work/$dir" && env "$@" AM_LOG_DIR="$work/logs-$dir-$n$*" "$AM_BUILDDIR/am-launch" --nproc "$n" \
        "$work/tiny.yaml" >"$work/out-$dir-$n" 2>&1) || { cat "$work/out-$dir-$n"; fail "training on $dir at nproc $n $*"; }
}
field() { # LOGDIR STEP KEY
    grep -h '"type":"step"' "$1"/*/rank-0.jsonl | grep "\"step\":$2," | sed -nE "s/.*\"$3\":([^,}]*).*/\1/p"
}
for d in M ones comp none; do train $d 1; done
train M 2
train M 2 AM_PP=2
train M 2 AM_CP=2

lo=$(field "$work/logs-ones-1" 1 loss) ln=$(field "$work/logs-none-1" 1 loss)
[ -n "$ln" ] && [ "$lo" = "$ln" ] || fail "a mask of ones: loss $lo, without a mask $ln (must be equal)"
[ "$(field "$work/logs-ones-1" 1 label_tokens)" = 1024 ] || fail "a mask of ones counts $(field "$work/logs-ones-1" 1 label_tokens) labels, not 1024"
[ -z "$(field "$work/logs-none-1" 1 label_tokens)" ] || fail "label_tokens logged without a mask"
lm=$(field "$work/logs-M-1" 1 loss) nm=$(field "$work/logs-M-1" 1 label_tokens)
lc=$(field "$work/logs-comp-1" 1 loss) nc=$(field "$work/logs-comp-1" 1 label_tokens)
[ $((nm + nc)) = 1024 ] && [ "$nm" -gt 0 ] && [ "$nc" -gt 0 ] || fail "label counts $nm + $nc (expected a split of 1024)"
awk -v lm="$lm" -v nm="$nm" -v lc="$lc" -v nc="$nc" -v l="$ln" 'BEGIN { s = lm * nm + lc * nc; r = (s - l * 1024) / (l * 1024);
    if (r < 0) r = -r; printf "masked %.6f x %d + complement %.6f x %d = %.6f, unmasked %.6f x 1024 = %.6f: relative %.2g\n",
    lm, nm, lc, nc, s, l, l * 1024, r; exit !(r < 1e-5) }' || fail "the masked labels add to the loss"
for s in 1 2 3; do
    a=$(field "$work/logs-M-1" $s loss) b=$(field "$work/logs-M-2" $s loss) c=$(field "$work/logs-M-2AM_PP=2" $s loss)
    e=$(field "$work/logs-M-2AM_CP=2" $s loss)
    awk -v a="$a" -v b="$b" -v c="$c" -v e="$e" 'BEGIN { d = a - b; f = a - c; g = a - e; if (d < 0) d = -d; if (f < 0) f = -f
        if (g < 0) g = -g; exit !(a != "" && b != "" && c != "" && e != "" && d < 1e-5 * a && f < 1e-5 * a && g < 1e-5 * a) }' ||
        fail "step $s: one rank's loss $a, dp 2 $b, pp 2 $c, cp 2 $e"
done
# packed: the same rows (prompt and response of a row one document) packed whole
sed -i 's/^dataset:/packed_sequence:\n  packed_sequence_size: 64\ndataset:/' "$work/tiny.yaml"
train M 1 PACKED=1
train none 1 PACKED=1
train M 2 PACKED=1 AM_CP=2
pm=$(field "$work/logs-M-1PACKED=1" 1 label_tokens) pn=$(field "$work/logs-none-1PACKED=1" 1 label_tokens)
[ -n "$pm" ] && [ -n "$pn" ] && [ "$pm" -gt 0 ] && [ "$pm" -lt "$pn" ] && [ "$pn" -le 1024 ] ||
    fail "packed: $pm targets counted with the mask, $pn without (want 0 < masked < unmasked <= 1024)"
for s in 1 2 3; do
    a=$(field "$work/logs-M-1PACKED=1" $s loss) e=$(field "$work/logs-M-2PACKED=1 AM_CP=2" $s loss)
    awk -v a="$a" -v e="$e" 'BEGIN { g = a - e; if (g < 0) g = -g; exit !(a != "" && e != "" && g < 1e-5 * a) }' ||
        fail "packed, step $s: one rank's loss $a, cp 2 $e"
done
echo "PASS: mask of ones = no mask; masked + complement = unmasked; dp 2, pp 2 and cp 2 = one rank over 3 steps;" \
    "packed: $pm of $pn targets counted, cp 2 = one rank"
