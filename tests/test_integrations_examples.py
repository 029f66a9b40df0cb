"""The framework examples run (2 processes, a few steps), write every rank's optimizer state
and report the vote's traffic. One launch each (starting the processes and importing the
frameworks dominates); resuming is covered by the adapters' own tests."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


from integrations_support import need

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, tmp_path, timeout=150):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def torchrun(script, *args):
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    return [exe, "--standalone", "--nproc_per_node", "2", str(ROOT / "examples" / script), *args]


def test_hf_trainer_example(tmp_path):
    need("transformers")
    out = run(torchrun("hf_trainer.py", "--out", "out", "--steps", "20"), tmp_path)
    assert {"optimizer_rank0.pt", "optimizer_rank1.pt"} <= set(os.listdir(tmp_path / "out" / "checkpoint-20"))
    bits = float(re.search(r"step 20: loss [\d.]+ .*, ([\d.]+) bits per parameter", out).group(1))
    assert 0 < bits < 4


def test_accelerate_loop_example(tmp_path):
    need("accelerate")
    out = run(torchrun("accelerate_loop.py", "--out", "out", "--steps", "20"), tmp_path)
    assert re.search(r"step 20: loss [\d.]+, [\d.]+ bits/param/step", out), out[-2000:]
    assert {"optimizer_rank0.pt", "optimizer_rank1.pt"} <= set(os.listdir(tmp_path / "out" / "state"))


def test_lightning_example(tmp_path):
    """One run (importing Lightning takes seconds in each process); resuming is covered by
    test_integrations_lightning.py."""
    need("lightning")
    import torch

    cmd = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--devices", "2", "--out", "out"]
    out = run(cmd + ["--steps", "10"], tmp_path)
    assert "'comm/steps': 10.0" in out, out[-2000:]
    saved = torch.load(tmp_path / "out" / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 10 and len(saved["dlion"]["optimizer_states"]) == 2
