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


def test_plain_loop_example_logs_the_comm_figures_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run(torchrun("train_torchrun.py", "--epochs", "2", "--tensorboard", "tb"), tmp_path)
    assert "test accuracy" in out, out[-2000:]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "comm/bits_per_param_per_step", "comm/wait_ms_per_step", "comm/vote_unanimous_fraction",
            "comm/vote_tied_fraction", "comm/steps"} <= tags
    assert [e.step for e in acc.Scalars("comm/steps")] == [1, 2]
    bits = [e.value for e in acc.Scalars("comm/bits_per_param_per_step")]
    assert all(0 < b < 6 for b in bits)  # about 2 bits sent + received at N = 2, far below fp32's 64
    assert all(0 <= e.value <= 1 for e in acc.Scalars("comm/vote_unanimous_fraction"))
