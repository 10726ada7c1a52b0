#!/usr/bin/env bash
# test-am-data-cli.sh - am-data build's options as a user types them: --key=value beside
# --key value, the exact message of a value given to a switch or out of range (exit 2), and the
# progress line: --progress draws it to 100.0%, --quiet draws nothing.
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
T=$(mktemp -d /tmp/am-data-cli-XXXXXX)
trap 'rm -rf "$T"' EXIT
DATA=$AM_BUILDDIR/am-data TOK=$AM_SRCDIR/tests/data/tokenizer/gpt2.json
fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fails=1; }
refused() { # NAME MESSAGE ARGS...: exit 2 with MESSAGE as stderr's first line
    local name=$1 msg=$2
    shift 2
    "$DATA" "$@" >/dev/null 2>"$T/err"
    local rc=$?
    [ $rc = 2 ] && [ "$(head -n 1 "$T/err")" = "$msg" ] && ok "$name" || { bad "$name: exit $rc, got: $(head -n 1 "$T/err")"; }
}
printf 'one document\n\nanother document\n' >"$T/in.txt"
"$DATA" build --tokenizer="$TOK" --out="$T/a" --threads=2 --quiet "$T/in.txt" >/dev/null 2>"$T/err" &&
    "$DATA" build --tokenizer "$TOK" --out "$T/b" --threads 2 --quiet "$T/in.txt" >/dev/null &&
    cmp -s "$T/a.bin" "$T/b.bin" && cmp -s "$T/a.idx" "$T/b.idx" && [ ! -s "$T/err" ] &&
    ok "--key=value builds what --key value does, --quiet prints nothing" || bad "--key=value: $(cat "$T/err")"
refused "a value to a switch" "am-data build: --resume takes no value" build --tokenizer "$TOK" --resume=1 --out "$T/c" "$T/in.txt"
refused "--threads out of range" "am-data build: --threads 0: expected 1 to 256" build --tokenizer "$TOK" --threads=0 --out "$T/c" "$T/in.txt"
refused "--out without its value" "am-data build: --out needs a value" build --tokenizer "$TOK" "$T/in.txt" --out
"$DATA" build --bytes --progress --out "$T/d" "$T/in.txt" >/dev/null 2>"$T/err"
tr '\r' '\n' <"$T/err" | grep -qE '^am-data build: 100\.0%  [0-9]+ kB of [0-9]+ kB  ' &&
    ok "--bytes --progress: the line ends at 100.0%" || bad "--bytes --progress: $(cat -A "$T/err")"
"$DATA" build --bytes --quiet --out "$T/e" "$T/in.txt" >/dev/null 2>"$T/err"
[ ! -s "$T/err" ] && ok "--bytes --quiet: nothing on stderr" || bad "--bytes --quiet: $(cat "$T/err")"
[ $fails = 0 ]
