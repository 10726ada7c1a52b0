#!/bin/bash
# am's tokenizer and am-data build --tokenizer against the Hugging Face `tokenizers` library
# and AutoModel's instruction format, live (tests/data/tokenizer/compare.py). Needs the Python
# venv of tests/golden (tokenizers, transformers); without it the test is skipped with the
# reason. test_tokenizer checks the same encoder on committed ids without Python.
set -euo pipefail
PY=${AM_GOLDEN_PYTHON:-/tmp/goldenv/bin/python}
src=${AM_SRCDIR:-.}
build=${AM_BUILDDIR:-.}
if [[ ! -x $PY ]]; then
  echo "SKIP: no Python venv at $PY (tests/golden/README.md says how to make it; AM_GOLDEN_PYTHON names another)"
  exit 77
fi
if ! "$PY" -c 'import tokenizers, transformers' 2>/dev/null; then
  echo "SKIP: $PY cannot import tokenizers and transformers (pip install -r tests/golden/requirements.txt)"
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/am-tok-golden-XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PY" "$src/tests/data/tokenizer/compare.py" "$build/am-data" "$work"
