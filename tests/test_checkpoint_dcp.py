"""Sharded checkpoints (``dlion.checkpoint.save(..., sharded=True)``): a torch.distributed.checkpoint
directory in which every rank writes its own momenta; bitwise resume, resizing, failures."""

import os
import re
import warnings

import pytest
import torch
from torch import nn

from dlion import checkpoint
from dlion.checkpoint import CheckpointError, CheckpointWarning
from dlion import DesyncError
from dlion.lab.spawn import spawn

from test_checkpoint import assert_same, make_model, make_opt, snapshot, train

K = 5  # not a multiple of the momentum sync period (4): the ranks' momenta differ at the checkpoint
WORLD = 4


def run_and_save(rank, world, path, k):
    torch.manual_seed(100 + rank)
    model = make_model()
    opt = make_opt(model, overlap=True)  # overlap builds a second process group: the checkpoint must not mind
    train(model, opt, k, rank)
    checkpoint.save(path, model, opt, step=k, extra={"world": world}, sharded=True)
    mid = snapshot(model, opt)
    train(model, opt, k, rank)
    return mid, snapshot(model, opt)


def spy_reads(monkeypatch_target):
    """Record the keys that the loader reads from the checkpoint."""
    seen = []
    real = monkeypatch_target._read

    def _read(self, targets):
        seen.extend(targets)
        return real(self, targets)

    monkeypatch_target._read = _read
    return seen


def resume(rank, world, path, k):
    seen = spy_reads(checkpoint._ShardedSource)
    torch.manual_seed(12345)  # wrong on purpose: load restores each rank's RNG
    model = make_model()
    for p in model.parameters():
        p.data.normal_()
    opt = make_opt(model, overlap=True)
    info = checkpoint.load(path, model, opt)
    assert info.step == k and info.extra == {"world": world} and info.policy == "exact" and info.rng_restored
    mid = snapshot(model, opt)
    train(model, opt, k, rank)
    return mid, snapshot(model, opt), seen


def resized(rank, world, path):
    model = make_model()
    out = {}
    for policy in ("mean", "modulo"):
        seen = spy_reads(checkpoint._ShardedSource)
        opt = make_opt(model)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            info = checkpoint.load(path, model, opt, momenta=policy)
        # the momenta are views into the optimizer's flat bucket buffers, and stay so
        views = all(opt.state[p]["exp_avg"].untyped_storage().data_ptr() ==
                    buf.momentum.untyped_storage().data_ptr()
                    for b, buf in ((s.bucket, s.buffers) for s in opt._slots) for p in b.params)
        out[policy] = dict(info=(info.policy, info.source_ranks, info.rng_restored),
                           warned=[str(x.message) for x in w if issubclass(x.category, CheckpointWarning)],
                           momenta={k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()},
                           steps=opt.comm_stats.steps, dlion=opt.state_dict()["dlion"], views=views,
                           read=sorted({m.group(1) for key in seen if (m := re.match(r"optimizer\.rank(\d+)\.", key))}))
        train(model, opt, 2, rank)  # and it trains on from there
        opt.check_replicas()
    return out


def test_sharded_checkpoint_4_ranks_layout_bitwise_resume_and_resize(tmp_path):
    path = str(tmp_path / "ckpt")
    straight = spawn(run_and_save, WORLD, path, K, timeout_s=120)
    saved = [mid["momenta"] for mid, _ in straight]  # each rank's momenta at the checkpoint
    assert any(not torch.equal(saved[0][i], saved[1][i]) for i in saved[0])  # they really differ per rank

    # -- layout: one DCP file per rank; each holds that rank's momenta and no other rank's -----------
    import torch.distributed.checkpoint as dcp

    files = sorted(os.listdir(path))
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)]
    md = dcp.FileSystemReader(path).read_metadata()
    where: dict = {}
    for idx, info in md.storage_data.items():
        where.setdefault(idx.fqn, []).append(info)
    model = make_model()
    n_momentum_bytes = sum(p.numel() * 4 for p in model.parameters())
    for r in range(WORLD):
        fname = f"__{r}_0.distcp"
        mine = [k for k in where if k.startswith(f"optimizer.rank{r}.")]
        assert len(mine) == len(list(model.parameters()))  # one momentum per parameter
        for k in where:
            m = re.match(r"(optimizer\.|dlion\.)rank(\d+)", k)
            if m:  # every per-rank entry lives in its own rank's file, and only there
                assert [i.relative_path for i in where[k]] == [f"__{m.group(2)}_0.distcp"], k
        momentum_bytes = sum(i.length for k in mine for i in where[k])
        # torch.save framing adds a fixed overhead per tensor (under 2 KiB); the payload is the fp32 momenta
        assert n_momentum_bytes < momentum_bytes < n_momentum_bytes + 2048 * len(mine)
        in_file = [i for infos in where.values() for i in infos if i.relative_path == fname]
        assert os.path.getsize(os.path.join(path, fname)) == sum(i.length for i in in_file)
    for name in model.state_dict():  # the model is written once
        assert len(where["model." + name]) == 1
    header = checkpoint.read(path)
    assert header["layout"] == "sharded" and header["world_size"] == WORLD and header["step"] == K

    # -- same world size: bitwise, and each rank reads only its own momenta ---------------------------
    resumed = spawn(resume, WORLD, path, K, timeout_s=120)
    for r, ((mid_a, end_a), (mid_b, end_b, seen)) in enumerate(zip(straight, resumed)):
        assert_same(mid_a, mid_b)
        assert_same(end_a, end_b)
        ranks_read = {m.group(1) for k in seen if (m := re.match(r"(?:optimizer\.|dlion\.)rank(\d+)", k))}
        assert ranks_read == {str(r)}

    # -- 3 and 6 ranks: mean of the 4 saved momenta, or saved rank r mod 4's ---------------------------
    for world in (3, 6):
        res = spawn(resized, world, path, timeout_s=180)
        for r, out in enumerate(res):
            mean, modulo = out["mean"], out["modulo"]
            assert mean["info"] == ("mean", list(range(WORLD)), False)
            assert modulo["info"] == ("modulo", [r % WORLD], False)
            assert mean["read"] == [str(j) for j in range(WORLD)] and modulo["read"] == [str(r % WORLD)]
            assert any(f"resized {WORLD} -> {world} ranks: momenta = mean of all saved ranks" in m
                       for m in mean["warned"])
            for i, m in mean["momenta"].items():
                literal = (saved[0][i].double() + saved[1][i].double() + saved[2][i].double()
                           + saved[3][i].double()) / 4
                assert torch.equal(m, literal.float())
                assert torch.equal(modulo["momenta"][i], saved[r % WORLD][i])
            assert mean["views"] and modulo["views"]
            assert mean["steps"] == K and mean["dlion"]["world_size"] == world and mean["dlion"]["rank"] == r


def test_sharded_single_process_roundtrip_and_bad_paths(tmp_path, monkeypatch):
    torch.manual_seed(5)
    model = make_model()
    opt = make_opt(model)  # no process group: plain Lion
    train(model, opt, 3)
    path = tmp_path / "ck"
    checkpoint.save(path, model, opt, step=3, sharded=True)
    checkpoint.save(path, model, opt, step=3, sharded=True)  # replaces its own earlier checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary or old directory left behind
    train(model, opt, 3)
    expected = [p.detach().clone() for p in model.parameters()]
    model2 = make_model()
    opt2 = make_opt(model2, lr=0.5)
    info = checkpoint.load(path, model2, opt2)
    assert info.policy == "exact" and info.step == 3 and opt2.param_groups[0]["lr"] == 0.01
    train(model2, opt2, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, model2.parameters()))

    # a save that fails after writing its files leaves the old checkpoint and no temporary directory
    import torch.distributed.checkpoint as dcp
    real_save = dcp.save

    def fails_at_the_end(*a, **kw):
        real_save(*a, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", fails_at_the_end)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, model2, opt2, step=99, sharded=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"] and checkpoint.read(path)["step"] == 3

    with pytest.raises(IsADirectoryError, match="without a '.metadata' file"):
        checkpoint.load(tmp_path, model)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing to replace .* 'notes.txt'"):
        checkpoint.save(tmp_path, model, sharded=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(NotADirectoryError, match="it is a file"):
        checkpoint.save(tmp_path / "notes.txt", model, sharded=True)
    with pytest.raises(CheckpointError, match="another model: '0.weight' has shape \\(16, 8\\) in the checkpoint "
                                              "and \\(32, 8\\)"):
        checkpoint.load(path, make_model(hidden=32))


def bn_and_failures(rank, world, tmp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt = make_opt(model)
    torch.manual_seed(rank)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4) + rank).square().mean().backward()
        opt.step()
    out = {}
    good = os.path.join(tmp, "good")
    checkpoint.save(good, model, opt, step=2, sharded=True)  # BatchNorm buffers differ per rank: rank 0's saved
    rank0_stats = [t.clone() for t in (model[1].running_mean, model[1].running_var)]
    # replicas that differ are refused on every rank; the old checkpoint stays
    if rank == 1:
        with torch.no_grad():
            model[2].bias[0] += 1.0
    try:
        checkpoint.save(good, model, opt, step=3, sharded=True)
    except DesyncError as e:
        out["desync"] = str(e)
    if rank == 1:
        with torch.no_grad():
            model[2].bias[0] -= 1.0
    # one rank does not see the checkpoint: every rank refuses, nothing changes
    try:
        checkpoint.load(good if rank == 0 else os.path.join(tmp, "absent"), model, opt)
    except Exception as e:
        out["absent"] = f"{type(e).__name__}: {e}"
    info = checkpoint.load(good, model, opt)
    out["step"] = info.step
    out["stats"] = [model[1].running_mean.clone(), model[1].running_var.clone()]
    out["rank0_stats"] = rank0_stats
    return out


def test_sharded_checkpoint_batchnorm_desync_and_missing_directory(tmp_path):
    res = spawn(bn_and_failures, 2, str(tmp_path), timeout_s=120)
    for r, out in enumerate(res):
        assert "'2.bias' differs between rank 0 and rank 1" in out["desync"]
        assert "does not exist" in out["absent"]
        assert out["step"] == 2
        # after loading, every rank has the buffers rank 0 saved
        for a, b in zip(out["stats"], res[0]["rank0_stats"]):
            assert torch.equal(a, b)
    assert not torch.equal(res[0]["rank0_stats"][0], res[1]["rank0_stats"][0])  # they did differ per rank
    assert "rank 1 cannot read the checkpoint" in res[0]["absent"]
    assert sorted(os.listdir(tmp_path)) == ["good"]
