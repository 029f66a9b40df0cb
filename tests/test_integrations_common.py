"""dlion.integrations without a framework: lazy imports, the comm figures, per-rank files."""

import subprocess
import sys

import pytest
import torch

import dlion
from dlion.integrations import CommMeter, comm_figures, unwrap_optimizer
from dlion.integrations._common import load_rank_state, rank_state_path, save_rank_state


def test_import_dlion_imports_no_framework():
    code = ("import sys, dlion, dlion.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_comm_figures_are_per_step_deltas():
    before = {"bytes_sent": 1000, "bytes_received": 600, "steps": 4, "wait_s": 1.0, "voted": 50, "unanimous": 10,
              "tied": 5}
    now = {"bytes_sent": 1000 + 3 * 250, "bytes_received": 600 + 3 * 150, "steps": 7, "wait_s": 1.3,
           "voted": 50 + 200, "unanimous": 10 + 150, "tied": 5 + 20}
    f = comm_figures(now, before, num_params=100)
    assert f == pytest.approx({"comm/steps": 7.0, "comm/bytes_sent_per_step": 250.0,
                               "comm/bytes_received_per_step": 150.0, "comm/bits_per_param_per_step": 8.0 * 400 / 100,
                               "comm/wait_ms_per_step": 100.0, "comm/vote_unanimous_fraction": 0.75,
                               "comm/vote_tied_fraction": 0.1})
    assert comm_figures(now, now, num_params=100) == {"comm/steps": 7.0}  # no step in between


def test_comm_meter_reads_windows():
    model = torch.nn.Linear(4, 2)
    opt = dlion.DistributedLion(model.parameters(), lr=0.1)  # no process group: plain Lion, no traffic
    meter = CommMeter(opt)
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    opt.comm_stats.add("test", 300, 120)  # as if the three steps had moved 300 / 120 bytes
    assert meter.read() == {"comm/steps": 3.0, "comm/bytes_sent_per_step": 100.0,
                            "comm/bytes_received_per_step": 40.0,
                            "comm/bits_per_param_per_step": 8.0 * 420 / (3 * 10), "comm/wait_ms_per_step": 0.0}
    assert meter.read() == {"comm/steps": 3.0}
    with pytest.raises(TypeError, match="must be a dlion.DistributedLion"):
        CommMeter(torch.optim.SGD(model.parameters(), lr=0.1))


def test_rank_files_round_trip_and_reject_foreign_files(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = dlion.DistributedLion(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()

    class Wrapper:  # like Accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert unwrap_optimizer(Wrapper(opt)) is opt
    path = save_rank_state(tmp_path, Wrapper(opt))
    assert path == rank_state_path(tmp_path, 0) and [p.name for p in tmp_path.iterdir()] == ["optimizer_rank0.pt"]
    fresh = dlion.DistributedLion(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    load_rank_state(tmp_path, fresh)
    a, b = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a) and fresh.comm_stats.steps == 1
    payload = torch.load(path, weights_only=True)
    payload["world_size"] = 4
    torch.save(payload, path)
    with pytest.raises(ValueError, match="rank 0 of 4; this is rank 0 of 1"):
        load_rank_state(tmp_path, fresh)
    torch.save({"something": "else"}, path)
    with pytest.raises(ValueError, match="not a dlion per-rank optimizer file"):
        load_rank_state(tmp_path, fresh)
    with pytest.raises(FileNotFoundError, match="no optimizer state for rank 0"):
        load_rank_state(tmp_path / "missing", fresh)
