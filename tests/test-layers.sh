#!/bin/sh
# test-layers.sh - the layering of the source folders (docs/architecture.md), enforced.
#
#   tests/test-layers.sh [ROOT]
#
# Reads every `#include "..."` (C sources and headers, CUDA's .cu and .cuh) in runtime/*/,
# kernels/, launcher/ and spank/ under ROOT (default: $AM_SRCDIR, else the tree this script
# is in), maps the header to the folder that holds it (header names are unique across these
# folders: two headers with one name fail too), and fails on an include of a header from a folder that is not the includer's own nor one
# below it in the table:
#
#   FILE:LINE: includes HEADER (FOLDER), which is above FOLDER in the layering (allowed: ...)
#
# The table names, for each folder, the folders it builds on directly; a folder may include
# headers from itself and from every folder it reaches through the table (the transitive
# closure). The table must be a DAG: a cycle fails. AM_LAYERS replaces the table (the
# self-check uses it). tests/ and bench/ may include anything and are not read.
#
# Without ROOT, after checking the tree, a self-check runs the checker on small temporary
# trees and asserts that it fails, with the exact message, on an upward include, on two
# headers with one name, on a header that is nowhere, and on a table with a cycle.
# POSIX sh and awk only.

LC_ALL=C
export LC_ALL

# folder: the folders it builds on directly (lowest layer first)
DEFAULT_LAYERS='
base:
diag:     base
recipe:   base diag
rank:     recipe
comm:     rank
kernels:  base
ckpt:     recipe
data:     recipe
model:    comm kernels ckpt
train:    model data
doctor:   comm
launcher: rank
spank:    recipe
'
LAYERS=${AM_LAYERS:-$DEFAULT_LAYERS}

here=$(cd "$(dirname "$0")/.." && pwd)

# check ROOT: prints one line per violation, exits 1 if any
check() {
    root=$1
    (
        cd "$root" || exit 2
        # every source file of the checked folders, one path a line
        find runtime kernels launcher spank -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort
    ) | awk -v root="$root" -v layers="$LAYERS" '
    function folder_of(path,   n, p) {
        n = split(path, p, "/")
        if (p[1] == "runtime") return (n >= 3 ? p[2] : "")
        return p[1]
    }
    BEGIN {
        nl = split(layers, lines, "\n")
        norder = 0
        for (i = 1; i <= nl; i++) {
            line = lines[i]
            sub(/#.*/, "", line)
            if (line !~ /:/) continue
            name = line; sub(/:.*/, "", name); gsub(/[ \t]/, "", name)
            deps = line; sub(/^[^:]*:/, "", deps)
            order[++norder] = name
            known[name] = 1
            nd = split(deps, d, /[ \t]+/)
            for (j = 1; j <= nd; j++) if (d[j] != "") direct[name, d[j]] = 1
        }
        # the transitive closure: below[a, b] when a reaches b (Warshall)
        for (i = 1; i <= norder; i++) for (j = 1; j <= norder; j++)
            if ((order[i], order[j]) in direct) below[order[i], order[j]] = 1
        for (k = 1; k <= norder; k++) for (i = 1; i <= norder; i++) for (j = 1; j <= norder; j++)
            if (((order[i], order[k]) in below) && ((order[k], order[j]) in below))
                below[order[i], order[j]] = 1
        for (i = 1; i <= norder; i++) {
            a = order[i]
            for (j = 1; j <= norder; j++) {
                b = order[j]
                if ((a, b) in direct && !(b in known)) {
                    printf "layering table: %s builds on %s, which is not in the table\n", a, b
                    bad = 1
                }
            }
            if ((a, a) in below) {
                printf "layering table: %s reaches itself (a cycle), the table must be a DAG\n", a
                bad = 1
            }
        }
        for (i = 1; i <= norder; i++) {
            a = order[i]; s = ""
            for (j = 1; j <= norder; j++) {
                b = order[j]
                if (a == b || (a, b) in below) s = s (s == "" ? "" : ", ") b
            }
            allowed[a] = s
        }
        if (bad) exit 1
    }
    { files[++nf] = $0 }
    END {
        if (bad) exit 1
        # where each header lives
        for (i = 1; i <= nf; i++) {
            f = files[i]
            if (f !~ /\.(h|cuh)$/) continue
            n = split(f, p, "/"); h = p[n]
            if (h in home) {
                printf "%s: a second header named %s (the first: %s); header names must be unique\n", f, h, home[h]
                bad = 1; dup[h] = 1
                continue
            }
            home[h] = f; hfolder[h] = folder_of(f)
        }
        for (i = 1; i <= nf; i++) {
            f = files[i]
            me = folder_of(f)
            if (!(me in known)) {
                printf "%s: folder %s is not in the layering table\n", f, me
                bad = 1
                continue
            }
            ln = 0
            path = root "/" f
            while ((getline line < path) > 0) {
                ln++
                if (line !~ /^[ \t]*#[ \t]*include[ \t]*"/) continue
                h = line; sub(/^[^"]*"/, "", h); sub(/".*/, "", h)
                n = split(h, p, "/"); base = p[n]
                if (!(base in home)) {
                    printf "%s:%d: includes %s, which is in no folder of the layering\n", f, ln, h
                    bad = 1
                    continue
                }
                if (base in dup) continue   # reported above
                to = hfolder[base]
                if (to == me || (me, to) in below) continue
                printf "%s:%d: includes %s (%s), which is above %s in the layering (allowed: %s)\n", \
                    f, ln, h, to, me, allowed[me]
                bad = 1
            }
            close(path)
        }
        exit bad ? 1 : 0
    }'
}

# expect NAME WANT_RC WANT_OUTPUT ROOT: run the checker on ROOT, compare status and output
fails=0
expect() {
    out=$(check "$4" 2>&1)
    rc=$?
    if [ "$rc" != "$2" ] || [ "$out" != "$3" ]; then
        echo "FAIL: self-check $1: exit $rc (want $2)"
        echo "  got:"; echo "$out" | sed 's/^/    /'
        echo "  want:"; echo "$3" | sed 's/^/    /'
        fails=$((fails + 1))
    else
        echo "ok: self-check $1"
    fi
}

if [ $# -gt 0 ]; then
    check "$1"
    exit $?
fi

root=${AM_SRCDIR:-$here}
if check "$root"; then
    echo "ok: every include in runtime/, kernels/, launcher/, spank/ of $root follows the layering"
else
    echo "FAIL: includes against the layering above (the table: tests/test-layers.sh, docs/architecture.md)"
    fails=$((fails + 1))
fi

T=$(mktemp -d /tmp/am-test-layers.XXXXXX) || exit 1
trap 'rm -rf "$T"' EXIT
mk() { mkdir -p "$(dirname "$T/$1")" && printf '%s\n' "$2" > "$T/$1"; }

# a good tree: train on base, a header beside its source
mk good/runtime/base/a.h '/* a.h */'
mk good/runtime/base/a.c '#include "a.h"'
mk good/runtime/train/t.h '#include "a.h"'
mk good/runtime/train/t.c '#include <stdio.h>
#include "t.h"'
mk good/kernels/cpu/k.c '#include "a.h"'
expect good 0 '' "$T/good"

# base includes a train header
cp -R "$T/good" "$T/up"
mk up/runtime/base/a.c '#include "a.h"
 # include "t.h" /* upward */'
expect upward 1 'runtime/base/a.c:2: includes t.h (train), which is above base in the layering (allowed: base)' "$T/up"

# kernels (its cpu/ too) may not include diag
cp -R "$T/good" "$T/side"
mk side/runtime/diag/d.h '/* d.h */'
mk side/kernels/cpu/k.c '#include "a.h"
#include "d.h"'
expect sideways 1 'kernels/cpu/k.c:2: includes d.h (diag), which is above kernels in the layering (allowed: base, kernels)' "$T/side"

# two headers named a.h
cp -R "$T/good" "$T/dup"
mk dup/launcher/a.h '/* another a.h */'
expect duplicate 1 'runtime/base/a.h: a second header named a.h (the first: launcher/a.h); header names must be unique' "$T/dup"

# a header that is nowhere
cp -R "$T/good" "$T/none"
mk none/spank/s.c '#include "nowhere.h"'
expect missing 1 'spank/s.c:1: includes nowhere.h, which is in no folder of the layering' "$T/none"

# a table with a cycle
AM_LAYERS='base: kernels
kernels: base
recipe: base
rank: recipe
comm: rank
ckpt: recipe
data: recipe
model: comm kernels ckpt
train: model data
diag: base
launcher: rank
spank: recipe'
LAYERS=$AM_LAYERS
expect cycle 1 'layering table: base reaches itself (a cycle), the table must be a DAG
layering table: kernels reaches itself (a cycle), the table must be a DAG' "$T/good"

[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
exit 0
