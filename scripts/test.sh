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

source "$ROOT/scripts/setup_env.sh"

export DLION_REQUIRE_INTEGRATIONS=1  # the framework adapters' tests must run, not skip
status=0
"$PY" -m pytest "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "scripts/test.sh: pytest collected no tests; counting that as a failure" >&2
    exit 1
fi
exit $status
