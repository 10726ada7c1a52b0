#!/usr/bin/env bash
# test-diag-html.sh - am-diag --html in a real browser. Three injected faults with
# `am-launch --nproc 4` (dp 4, the tiny recipe, AM_FAULT: docs/diagnostics.md): a segfault, a
# hang inside a collective (caught by the watchdog), a device allocation that fails (the oom
# cause record). Each job's page is rendered by headless Chromium:
#   - --dump-dom (the DOM after the page's script ran): the script ran (data-am="ready"), the
#     verdict names the first failing rank, its host and its cause in the text report's own
#     sentences (its "first failure:" and "  cause:" lines), and the timeline has a lane per rank;
#   - --screenshot (1400x900): kept with the page, for a human look, as
#     test-diag-html-CASE.png and .html in $AM_SCREENSHOT_DIR (default: tests/diag/ under the
#     build directory, next to the test's log).
# Skips (77) only when no Chromium is installed (Debian's `chromium`; AM_CHROMIUM names another).
set -uo pipefail
source "$(dirname "$0")/../train/fault-lib.sh"

CHROMIUM=${AM_CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [[ -z $CHROMIUM ]]; then
  echo "SKIP: no chromium (apt-get install chromium, or AM_CHROMIUM=/path/to/chromium)"
  exit 77
fi
for tool in "$LAUNCH" "$DIAG" "$AM_BUILDDIR/am-data" "$AM_BUILDDIR/am-train"; do
  [[ -x $tool ]] || { echo "FAIL: $tool is not built (make am-launch am-train am-data am-diag)"; exit 1; }
done
SHOTS=${AM_SCREENSHOT_DIR:-$AM_BUILDDIR/tests/diag}
mkdir -p "$SHOTS" || { echo "FAIL: cannot make $SHOTS"; exit 1; }

T=$(mktemp -d /tmp/am-diag-html.XXXXXX)
trap 'rm -rf "$T"' EXIT
HOST=$(hostname)
make_recipe "$T" || { echo "FAIL: cannot build the corpus"; exit 1; }

# chromium MODE-ARGS... URL: headless, its own profile, bounded
chromium() {
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir="$T/profile" \
    --hide-scrollbars "$@" 2>>"$T/chromium.err"
}

# HTML's escaping of a text node, as --dump-dom writes it
as_dom() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g'; }

# case NAME KIND RANK STEP CAUSE-PREFIX: the job, its page, the page in the browser
case_() {
  local name=$1 kind=$2 rank=$3 step=$4 cause=$5 logs=$T/$1/logs dir rc text dom ff cl lanes
  CASES=$((CASES + 1))
  mkdir -p "$T/$name"
  (cd "$T" && exec env AM_FAULT="rank=$rank,step=$step,kind=$kind" AM_WATCHDOG_S=$WATCHDOG_S \
    timeout 60 "$LAUNCH" --nproc 4 --log-dir "$logs" "$T/tiny.yaml") >"$T/$name/out" 2>"$T/$name/err"
  dir=$(find "$logs" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  [[ -n $dir ]] || { fail "$name: the job left no log directory"; sed 's/^/    /' "$T/$name/err" | head; return; }
  "$DIAG" "$dir" --html "$T/$name/page.html" >"$T/$name/report.txt"
  rc=$?
  [[ $rc == 1 ]] || { fail "$name: am-diag --html exited $rc, want 1 (a failure found)"; return; }
  # the report's own sentences: its first-failure and cause lines
  ff=$(grep -m1 '^first failure: ' "$T/$name/report.txt")
  cl=$(grep -m1 '^  cause: ' "$T/$name/report.txt")
  [[ $ff == "first failure: rank $rank on $HOST "* ]] ||
    { fail "$name: the report's first failure is not rank $rank on $HOST: $ff"; return; }
  [[ $cl == "  cause: $cause"* ]] || { fail "$name: the report's cause is not '$cause...': $cl"; return; }
  chromium --dump-dom "file://$T/$name/page.html" >"$T/$name/dom.html"
  dom=$(cat "$T/$name/dom.html")
  local ok=1
  [[ $dom == *'data-am="ready"'* ]] || { fail "$name: the page's script did not run in Chromium"; ok=0; }
  [[ $dom == *"<div class=\"ff\">$(as_dom <<<"$ff")</div>"* ]] ||
    { fail "$name: the DOM lacks the first failure's sentence: $ff"; ok=0; }
  [[ $dom == *"<div class=\"cause\">$(as_dom <<<"$cl")</div>"* ]] ||
    { fail "$name: the DOM lacks the cause's sentence: $cl"; ok=0; }
  lanes=$(grep -o '<g data-r="[0-9]*"><title>rank [0-9]* on ' "$T/$name/dom.html" | sort -u | wc -l)
  [[ $lanes == 4 ]] || { fail "$name: $lanes rank lanes in the timeline, want 4"; ok=0; }
  [[ $dom == *"<g data-r=\"$rank\"><title>rank $rank on $HOST: first_failure: "* ]] ||
    { fail "$name: rank $rank's lane does not say it failed first"; ok=0; }
  rm -f "$SHOTS/test-diag-html-$name.png"
  chromium --screenshot="$SHOTS/test-diag-html-$name.png" --window-size=1400,900 "file://$T/$name/page.html" >/dev/null
  [[ -s $SHOTS/test-diag-html-$name.png && $(head -c 4 "$SHOTS/test-diag-html-$name.png" | od -An -c | tr -d ' ') == '211PNG' ]] ||
    { fail "$name: no screenshot from Chromium ($SHOTS/test-diag-html-$name.png)"; ok=0; }
  cp "$T/$name/page.html" "$SHOTS/test-diag-html-$name.html"
  if [[ $ok == 1 ]]; then
    pass "$name: Chromium shows '$ff' / '${cl#  }' (page $(wc -c <"$T/$name/page.html") bytes; $SHOTS/test-diag-html-$name.png)"
  else
    sed 's/^/    chromium: /' "$T/chromium.err" | tail -n 5
  fi
}

case_ segv segv 1 2 "signal: SIGSEGV (SEGV_MAPERR) at address 0x10"
case_ hang-in-collective hang-in-collective 2 3 "hang: "
case_ device-oom device-oom 3 2 "oom: rank 3 ran out of host (CPU device) memory in the backward of layer 2"
finish
