"""dlion.checkpoint: every rank's optimizer state, bitwise resume, resizing, atomic writes, bad inputs."""

import io
import os
import warnings

import pytest
import torch
from torch import nn

import dlion
from dlion import checkpoint
from dlion.checkpoint import CheckpointError, CheckpointWarning
from dlion import DesyncError
from dlion.lab.spawn import spawn

K = 5  # steps before the checkpoint; the runs go to 2K


def make_model(hidden=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Dropout(0.2), nn.Linear(hidden, 3))


DATA_X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
DATA_Y = torch.randint(0, 3, (256,), generator=torch.Generator().manual_seed(2))


def train(model, opt, steps, rank=0):
    """Batches drawn from the global RNG (and dropout): resuming must restore the RNG too."""
    for _ in range(steps):
        idx = torch.randint(0, 256, (16,))
        x = DATA_X[idx] + 0.1 * rank
        loss = nn.functional.cross_entropy(model(x), DATA_Y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def make_opt(model, **kw):
    cfg = dict(lr=0.01, weight_decay=0.1, vote="mavo", ties="random", comm="1bit", momentum_sync=4, seed=3)
    cfg.update(kw)
    return dlion.DistributedLion(model.parameters(), **cfg)


def snapshot(model, opt):
    sd = opt.state_dict()
    return dict(params=[p.detach().clone() for p in model.parameters()],
                momenta={k: v["exp_avg"].clone() for k, v in sd["state"].items()},
                steps={k: v["step"].clone() for k, v in sd["state"].items()},
                stats=counters(opt.comm_stats.state_dict()), rng=torch.get_rng_state())


def counters(stats: dict) -> dict:
    """The communication counters without ``wait_s``: a wall-clock time, never bitwise reproducible."""
    return {k: v for k, v in stats.items() if k != "wait_s"}


def assert_same(a, b):
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    assert a["momenta"].keys() == b["momenta"].keys()
    for k in a["momenta"]:
        assert torch.equal(a["momenta"][k], b["momenta"][k])
        assert torch.equal(a["steps"][k], b["steps"][k])
    assert a["stats"] == b["stats"]
    assert torch.equal(a["rng"], b["rng"])


# ---------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------


def test_single_process_roundtrip_is_bitwise(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(10)
    model = make_model()
    opt = dlion.Lion(model.parameters(), lr=0.01, weight_decay=0.1)
    train(model, opt, K)
    checkpoint.save(path, model, opt, step=K, extra={"note": "hello", "losses": torch.arange(3.0)})
    train(model, opt, K)
    expected = [p.detach().clone() for p in model.parameters()]

    model2 = make_model(); model2[0].weight.data.fill_(7.0)
    opt2 = dlion.Lion(model2.parameters(), lr=0.5)
    torch.manual_seed(999)  # the RNG is restored by load
    info = checkpoint.load(path, model2, opt2)
    assert info.step == K and info.extra["note"] == "hello" and torch.equal(info.extra["losses"], torch.arange(3.0))
    assert info.policy == "exact" and info.rng_restored and info.saved_world_size == 1
    assert opt2.param_groups[0]["lr"] == 0.01
    train(model2, opt2, K)
    for a, b in zip(expected, model2.parameters()):
        assert torch.equal(a, b)


def test_low_precision_momenta_keep_their_dtype(tmp_path):
    """torch.optim's load_state_dict casts state to the parameter dtype; Lion's fp32 momenta
    of bf16 parameters must come back as fp32, bit for bit."""
    p = nn.Parameter(torch.randn(10).to(torch.bfloat16))
    model = nn.Module(); model.p = p
    opt = dlion.Lion([p], lr=1e-3)
    p.grad = torch.randn(10).to(torch.bfloat16)
    opt.step()
    m = opt.state[p]["exp_avg"].clone()
    assert m.dtype == torch.float32
    checkpoint.save(tmp_path / "c.pt", model, opt)
    q = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    model2 = nn.Module(); model2.p = q
    opt2 = dlion.Lion([q], lr=1e-3)
    checkpoint.load(tmp_path / "c.pt", model2, opt2)
    assert opt2.state[q]["exp_avg"].dtype == torch.float32 and torch.equal(opt2.state[q]["exp_avg"], m)


def test_file_layout_and_metadata(tmp_path):
    model = make_model()
    opt = make_opt(model)  # no process group: plain Lion, world size 1
    train(model, opt, 2)
    checkpoint.save(tmp_path / "c.pt", model, opt, step=2)
    raw = (tmp_path / "c.pt").read_bytes()
    assert raw.startswith(checkpoint.MAGIC) and b"DLION-SHA256 " in raw[-100:]
    obj = checkpoint.read(tmp_path / "c.pt")
    assert obj["version"] == checkpoint.FORMAT_VERSION and obj["world_size"] == 1 and obj["step"] == 2
    # make_opt's settings and the other constructor defaults (every one recorded since 0.3)
    assert obj["optimizer_config"] == {"vote": "mavo", "ties": "random", "seed": 3, "aggregate": "sign",
                                       "world_size": 1, "comm": "1bit", "quant_norm": "l1", "quant_bits": 8,
                                       "momentum_sync": "4", "bucket_cap_mb": 25.0, "check_every": 0,
                                       "nonfinite": "skip", "momentum_dtype": "None", "overlap": False, "delay": 0}
    assert len(obj["optimizer"]) == 1 and len(obj["rng"]) == 1
    assert os.listdir(tmp_path) == ["c.pt"]  # no temporary files left behind
    umask = os.umask(0); os.umask(umask)
    assert os.stat(tmp_path / "c.pt").st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


# ---------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = make_model()
    opt = make_opt(model)
    train(model, opt, 2)
    path = tmp_path / "good.pt"
    checkpoint.save(path, model, opt, step=2)
    return path


def test_missing_path_and_directories(tmp_path, saved):
    model = make_model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load(tmp_path / "nope.pt", model)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        checkpoint.load(tmp_path, model)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        checkpoint.save(tmp_path, model)
    with pytest.raises(FileNotFoundError, match="directory .* does not exist"):
        checkpoint.save(tmp_path / "no" / "such" / "dir" / "c.pt", model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        checkpoint.save(tmp_path / "c.pt", {"not": "a model"})


def test_checkpoint_of_another_model(saved):
    with pytest.raises(CheckpointError, match=r"another model: '0.weight' has shape \(16, 8\) in the checkpoint "
                                              r"and \(32, 8\) in the model"):
        checkpoint.load(saved, make_model(hidden=32))
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))  # keys 0.*, 2.* vs 0.*, 3.*
    with pytest.raises(CheckpointError, match="another model .*missing in the checkpoint: '2.weight'"):
        checkpoint.load(saved, other)
    half = make_model().half()
    with pytest.raises(CheckpointError, match="dtype torch.float32 in the checkpoint"):
        checkpoint.load(saved, half)


def test_nothing_changes_when_a_load_is_rejected(saved):
    model = make_model(hidden=16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="holds DistributedLion state; the optimizer is a SGD"):
        checkpoint.load(saved, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_corrupted_truncated_and_foreign_files(tmp_path, saved):
    raw = saved.read_bytes()
    model = make_model()
    bad = tmp_path / "bad.pt"
    flipped = bytearray(raw); flipped[len(raw) // 2] ^= 0x01
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted: SHA-256"):
        checkpoint.load(bad, model)
    for cut in (len(raw) - 1, len(raw) - 80, len(raw) // 2, 40):
        bad.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            checkpoint.load(bad, model)
    bad.write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a dlion checkpoint"):
        checkpoint.load(bad, model)
    torch.save(model.state_dict(), bad)  # a plain torch checkpoint
    with pytest.raises(CheckpointError, match="not a dlion checkpoint"):
        checkpoint.load(bad, model)
    before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_optimizer_state_missing_or_mismatched(tmp_path, saved):
    model = make_model()
    checkpoint.save(tmp_path / "model_only.pt", model)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        checkpoint.load(tmp_path / "model_only.pt", model, make_opt(model))
    info = checkpoint.load(tmp_path / "model_only.pt", model)
    assert info.policy == "none"
    # same shapes, but the optimizer was built over a subset of the parameters
    opt = make_opt(nn.Sequential(*list(model)[:1]))
    with pytest.raises(CheckpointError, match="parameter groups of sizes \\[4\\], the optimizer has \\[2\\]"):
        checkpoint.load(saved, model, opt)


def test_config_change_warns_or_raises_when_strict(saved):
    model = make_model()
    with pytest.raises(CheckpointError, match="another optimizer config \\(vote: 'mavo' -> 'avg'\\); strict"):
        checkpoint.load(saved, model, make_opt(model, vote="avg"), strict=True)
    with pytest.warns(CheckpointWarning, match="optimizer config changed \\(vote: 'mavo' -> 'avg'\\)"):
        info = checkpoint.load(saved, model, make_opt(model, vote="avg"))
    assert info.config_changes == {"vote": ("mavo", "avg")}


def test_bad_arguments(tmp_path, saved):
    model = make_model()
    with pytest.raises(ValueError, match="momenta must be one of 'mean', 'modulo'"):
        checkpoint.load(saved, model, momenta="first")

    class Thing:
        pass

    with pytest.raises(CheckpointError, match="extra cannot be stored: .*weights_only=True"):
        checkpoint.save(tmp_path / "x.pt", model, extra={"obj": Thing()})
    assert not (tmp_path / "x.pt").exists()


def test_failed_save_keeps_the_old_checkpoint(tmp_path, saved, monkeypatch):
    old = saved.read_bytes()
    real_save = torch.save

    def dies_halfway(obj, f, *a, **kw):
        if isinstance(f, io.BytesIO):
            return real_save(obj, f, *a, **kw)
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])  # some bytes reach the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_halfway)
    model = make_model(); model[0].weight.data.fill_(3.0)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(saved, model, step=99)
    monkeypatch.undo()
    assert saved.read_bytes() == old
    assert sorted(os.listdir(saved.parent)) == ["good.pt"]  # the temporary file was removed
    assert checkpoint.read(saved)["step"] == 2


# ---------------------------------------------------------------------------
# several processes (Gloo)
# ---------------------------------------------------------------------------


def run_and_save(rank, world, path, k, ties="random"):
    torch.manual_seed(100 + rank)  # every rank samples its own batches
    model = make_model()
    opt = make_opt(model, ties=ties)
    train(model, opt, k, rank)
    checkpoint.save(path, model, opt, step=k, extra={"world": world})
    mid = snapshot(model, opt)
    train(model, opt, k, rank)
    return mid, snapshot(model, opt)


def resume(rank, world, path, k, ties="random"):
    torch.manual_seed(12345)  # wrong on purpose: load restores each rank's RNG
    model = make_model(hidden=16)
    for p in model.parameters():
        p.data.normal_()
    opt = make_opt(model, ties=ties)
    info = checkpoint.load(path, model, opt)
    assert info.step == k and info.extra == {"world": world} and info.policy == "exact" and info.rng_restored
    mid = snapshot(model, opt)
    train(model, opt, k, rank)
    return mid, snapshot(model, opt)


@pytest.mark.parametrize("ties", ["random", "previous"])
def test_resume_in_new_processes_is_bitwise_identical(tmp_path, ties):
    """Train K steps, save, new processes load and continue to 2K: identical to never stopping —
    parameters, every rank's momenta, step counts, communication counters and RNG (and, with
    ties="previous", the last vote the next ties repeat: two ranks tie wherever they disagree)."""
    path = str(tmp_path / "ckpt.pt")
    straight = spawn(run_and_save, 2, path, K, ties)
    resumed = spawn(resume, 2, path, K, ties)
    for (mid_a, end_a), (mid_b, end_b) in zip(straight, resumed):
        assert_same(mid_a, mid_b)
        assert_same(end_a, end_b)
    # the ranks' momenta really differ: a rank-0-only checkpoint would have lost rank 1's
    assert any(not torch.equal(straight[0][0]["momenta"][k], straight[1][0]["momenta"][k])
               for k in straight[0][0]["momenta"])
    obj = checkpoint.read(path)
    assert obj["world_size"] == 2 and [sd["dlion"]["rank"] for sd in obj["optimizer"]] == [0, 1]


def resized(rank, world, path):
    model = make_model()
    out = {}
    for policy in ("mean", "modulo"):
        opt = make_opt(model)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            info = checkpoint.load(path, model, opt, momenta=policy)
        out[policy] = dict(info=(info.policy, info.source_ranks, info.rng_restored, info.message),
                           warned=[str(x.message) for x in w if issubclass(x.category, CheckpointWarning)],
                           momenta={k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()},
                           steps=opt.comm_stats.steps, dlion=opt.state_dict()["dlion"])
        train(model, opt, 2, rank)  # and it trains on from there
    try:
        checkpoint.load(path, model, make_opt(model), strict=True)
    except CheckpointError as e:
        out["strict"] = str(e)
    return out


def save_failures(rank, world, tmp):
    model = make_model()
    opt = make_opt(model)
    train(model, opt, 1, rank)
    out = {}
    good = os.path.join(tmp, "good.pt")
    checkpoint.save(good, model, opt, step=1)
    # rank 0 cannot write: every rank raises, the old file stays
    target = os.path.join(tmp, "missing-dir", "c.pt") if rank == 0 else os.path.join(tmp, "c.pt")
    try:
        checkpoint.save(target, model, opt)
    except Exception as e:
        out["bad_dir"] = f"{type(e).__name__}: {e}"
    # replicas that differ are not saved
    if rank == 1:
        with torch.no_grad():
            model[3].bias[0] += 1.0
    try:
        checkpoint.save(good, model, opt, step=2)
    except DesyncError as e:
        out["desync"] = str(e)
    if rank == 1:
        with torch.no_grad():
            model[3].bias[0] -= 1.0
    # one rank does not see the file: every rank refuses to load
    try:
        checkpoint.load(good if rank == 0 else os.path.join(tmp, "absent.pt"), model, opt)
    except Exception as e:
        out["absent"] = f"{type(e).__name__}: {e}"
    out["step"] = checkpoint.read(good)["step"]
    return out


def test_resize_and_collective_failures(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    spawn(run_and_save, 2, path, K)
    saved = checkpoint.read(path)["optimizer"]
    res = spawn(resized, 3, path)
    for r, out in enumerate(res):
        mean, modulo = out["mean"], out["modulo"]
        assert mean["info"][:3] == ("mean", [0, 1], False)
        assert modulo["info"][:3] == ("modulo", [r % 2], False)
        assert any("resized 2 -> 3 ranks: momenta = mean of all saved ranks" in m for m in mean["warned"])
        assert any(f"saved rank {r % 2}'s" in m for m in modulo["warned"])
        for k, m in mean["momenta"].items():
            expected = ((saved[0]["state"][k]["exp_avg"].double() + saved[1]["state"][k]["exp_avg"].double()) / 2)
            assert torch.equal(m, expected.float())
            assert torch.equal(modulo["momenta"][k], saved[r % 2]["state"][k]["exp_avg"])
        assert mean["steps"] == K and mean["dlion"]["world_size"] == 3 and mean["dlion"]["rank"] == r
        assert "written by 2 ranks; this job has 3" in out["strict"]
    # one process loading the 2-rank checkpoint
    model = make_model()
    opt = make_opt(model)
    with pytest.warns(CheckpointWarning, match="resized 2 -> 1"):
        info = checkpoint.load(path, model, opt)
    assert info.policy == "mean" and info.world_size == 1

    fails = spawn(save_failures, 2, str(tmp_path))
    for r, out in enumerate(fails):
        assert "does not exist" in out["bad_dir"]
        assert "'3.bias' differs between rank 0 and rank 1" in out["desync"]
        assert out["step"] == 1  # neither failed save touched the good file
        assert "does not exist" in out["absent"]
    assert "rank 1 cannot read the checkpoint" in fails[0]["absent"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "good.pt"]
