"""The framework examples run (2 processes, a few steps), write every rank's optimizer state
and report the vote's traffic. One launch each (starting the processes and importing the
frameworks dominates); resuming is covered by the adapters' own tests."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from integrations_support import need

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, tmp_path, timeout=600):
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
    # comm="auto" picks the all-gather of 1-bit signs at N = 2 (fewer bytes than 1bit's 1 + 1.6
    # bits): 1 bit to the one other rank and 1 bit from it, plus headers and padding (< 4 %)
    assert 2.0 <= bits <= 2.08, bits


def test_accelerate_loop_example(tmp_path):
    need("accelerate")
    out = run(torchrun("accelerate_loop.py", "--out", "out", "--steps", "20"), tmp_path)
    got = {int(m[0]): (float(m[1]), float(m[2]))
           for m in re.findall(r"step (\d+): loss ([\d.]+), ([\d.]+) bits/param/step", out)}
    assert sorted(got) == [10, 20], out[-2000:]
    # It learns: from ln 256 = 5.55 at the start, 3.88 after 20 steps (measured); a run that
    # does not move the parameters (lr = 1e-12) still has 5.71 there.
    assert got[20][0] < 4.5, got
    # comm="auto" picks the all-gather of 1-bit signs at N = 2: 1 bit to the other rank and 1 bit
    # from it (the embedding rows of absent tokens, zeros of c, fit the header's run slots),
    # plus headers and padding (< 4 %)
    assert all(2.0 <= bits <= 2.08 for _, bits in got.values()), got
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
    # It learns: 91.9 % after 2 epochs (measured); 8.1 % with lr = 1e-12 (the parameters do not move)
    accuracy = float(re.search(r"test accuracy ([\d.]+) %", out).group(1))
    assert accuracy >= 75.0, out[-2000:]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "comm/bits_per_param_per_step", "comm/wait_ms_per_step", "comm/vote_unanimous_fraction",
            "comm/vote_tied_fraction", "comm/steps"} <= tags
    assert [e.step for e in acc.Scalars("comm/steps")] == [1, 2]
    # The traffic from the wire format: comm="auto" picks the all-gather at N = 2, one bucket of
    # the CNN's P = 58,314 values in k = 8 parameters, padded to n = 58,320 (a multiple of 40·N).
    # The ReLUs leave exact zeros in c (abstentions) in more runs than the header's
    # max(4, n // 3200) = 18 slots hold: the first step sends the 1-bit format, every rank sees
    # the overflow and re-sends in base 3 (5 digits a byte), which every later step uses. Each
    # step: that block to the N − 1 = 1 other rank and one back.
    from dlion.lab.data import load_digits_split
    from dlion.lab.models import DigitsCNN

    P = sum(p.numel() for p in DigitsCNN().parameters())
    n, cap = 58_320, 18
    assert P == 58_314 and -(-P // 80) * 80 == n and max(4, n // 3200) == cap
    one_bit = 4 * (3 + 1 + 2 * cap) + n // 8 + (-(n // 8)) % 4  # header with run slots + signs
    base3 = 4 * (3 + 1) + n // 5                               # header without slots + digits
    steps = len(load_digits_split(seed=0)[0]) // 2 // 32        # per epoch, per rank
    expected = [16 * (one_bit + steps * base3) / (P * steps), 16 * base3 / P]  # sent + received, bits
    bits = [e.value for e in acc.Scalars("comm/bits_per_param_per_step")]
    assert bits == pytest.approx(expected, rel=0.01), (bits, expected)  # 3.30, 3.20: far below fp32's 64
    assert all(0 <= e.value <= 1 for e in acc.Scalars("comm/vote_unanimous_fraction"))


def test_plain_loop_example_with_local_steps(tmp_path):
    out = run(torchrun("train_torchrun.py", "--epochs", "2", "--sync-every", "4"), tmp_path)
    assert "vote=avg, a sync every 4 steps" in out, out[-2000:]
    # It learns, evaluated on the anchor: 87.2 % after 2 epochs (measured; every step: 91.9 %)
    accuracy = float(re.search(r"test accuracy ([\d.]+) %", out).group(1))
    assert accuracy >= 75.0, out[-2000:]
    # one exchange per 4 steps: 0.51 bits sent + received per parameter per step (measured), against the
    # every-step vote's 2.0 or more at N = 2 (the test above)
    bits = float(re.search(r"sent \+ received ([\d.]+) bits", out).group(1))
    assert 0.3 <= bits <= 0.6, out[-2000:]
