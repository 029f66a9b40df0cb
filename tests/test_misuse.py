"""What real training scripts get wrong, on real Gloo ranks: each ends in a clear error on
every rank (nothing changed) or a consistent, correct result; a hang fails by timeout."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dlion
from dlion import checkpoint
from dlion.lab.spawn import spawn


def test_meta_parameters_are_rejected_at_construction():
    with pytest.raises(ValueError, match="parameter 0 \\(shape \\(3, 2\\)\\) is on the meta device"):
        dlion.DistributedLion([torch.empty(3, 2, device="meta", requires_grad=True)])


def dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    try:
        dlion.DistributedLion([p], lr=0.1)
    except ValueError as e:
        return str(e)
    return None


def test_dtensor_parameters_are_rejected_at_construction():
    for err in spawn(dtensor_worker, 2, timeout_s=30):
        assert err is not None and "is a DTensor (FSDP2 fully_shard or tensor parallel)" in err


def built_too_early_worker(rank, world):
    # (spawn initialises the group first; destroy it, build, and re-initialise, as a script would)
    store = os.environ.get("DLION_TEST_STORE")
    p = torch.ones(3, requires_grad=True)
    dist.destroy_process_group()
    opt = dlion.DistributedLion([p], lr=0.1)   # no process group yet: plain Lion
    dist.init_process_group("gloo", init_method=f"file://{store}.2", rank=rank, world_size=world)
    p.grad = torch.ones(3)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e), torch.equal(p.detach(), torch.ones(3))
    return None, False


def test_optimizer_built_before_init_process_group_raises_at_step(tmp_path):
    os.environ["DLION_TEST_STORE"] = str(tmp_path / "store")
    for err, unchanged in spawn(built_too_early_worker, 3, timeout_s=30):
        assert err is not None and "built before torch.distributed.init_process_group()" in err and unchanged


def nan_worker(rank, world):
    p = torch.ones(4, requires_grad=True)
    opt = dlion.DistributedLion([p], lr=0.1, comm="1bit")
    opt.warn_after_skips = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            p.grad = torch.full((4,), float("nan")) if rank == 1 else torch.ones(4)
            opt.step()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], opt.skipped_steps


def test_a_rank_with_nan_every_step_is_named_after_k_skipped_steps():
    for msgs, skipped in spawn(nan_worker, 3, timeout_s=30):
        assert skipped == 4
        assert len(msgs) == 1 and "3 steps in a row skipped because rank(s) 1 had inf/NaN gradients" in msgs[0]


def ddp_wrapped_worker(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    net = nn.parallel.DistributedDataParallel(model)
    opt = dlion.DistributedLion(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(x).sum().backward()
        opt.step()
    return [str(w.message) for w in caught if "identical on every rank" in str(w.message)]


def test_a_model_wrapped_in_ddp_gets_a_warning():
    for msgs in spawn(ddp_wrapped_worker, 2, timeout_s=60):
        assert len(msgs) == 1 and "DistributedDataParallel" in msgs[0]


def batchnorm_worker(rank, world, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = dlion.DistributedLion(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 5, generator=g)).pow(2).mean().backward()
        opt.step()
    checkpoint.save(path, model, opt)  # running statistics differ per rank: saved from rank 0, not compared
    fresh = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt2 = dlion.DistributedLion(fresh.parameters(), lr=0.01)
    checkpoint.load(path, fresh, opt2)
    return ([p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in fresh.parameters()],
            model[1].running_mean.clone(), fresh[1].running_mean.clone())


def test_checkpoints_save_models_with_batchnorm(tmp_path):
    results = spawn(batchnorm_worker, 2, str(tmp_path / "ck.pt"), timeout_s=60)
    assert not torch.equal(results[0][2], results[1][2])  # the running means are rank-local
    for params, loaded, _, loaded_mean in results:
        for a, b in zip(params, loaded):
            assert torch.equal(a, b)
        assert torch.equal(loaded_mean, results[0][2])  # every rank resumes with rank 0's buffers


def scaler_worker(rank, world, dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)  # bf16: torch.amp-style params
    opt = dlion.DistributedLion(model.parameters(), lr=0.01, comm="1bit")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(rank)
    scales, skipped = [], []
    for t in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
            loss = model(torch.randn(4, 6, generator=g).to(dtype)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if rank == 1 and t == 2:
            model[0].weight.grad[0, 0] = float("inf")  # an overflow on one rank only
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        skipped.append(opt.skipped_steps)
    return [p.detach().clone() for p in model.parameters()], scales, skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradscaler_with_an_inf_gradient_on_one_rank_skips_on_every_rank(dtype):
    # The private GradScaler record that DistributedLion writes its global decision into (pinned here).
    record = torch.amp.GradScaler("cpu")._per_optimizer_states[0]
    assert {"stage", "found_inf_per_device"} <= set(record) and record["stage"].name == "READY"
    results = spawn(scaler_worker, 3, dtype, timeout_s=60)
    params0, scales0, skipped0 = results[0]
    assert skipped0 == [0, 0, 1, 1, 1, 1]          # the overflow step is skipped on every rank
    assert scales0[2] == scales0[1] / 2             # and every scaler backs off once
    assert all(p.dtype == dtype for p in params0)
    for params, scales, skipped in results[1:]:
        assert scales == scales0 and skipped == skipped0
        for a, b in zip(params, params0):
            assert torch.equal(a, b)


def named_order_worker(rank, world, named):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))  # two layers of the same shapes
    params = list(model.named_parameters()) if named else list(model.parameters())
    if rank == 2:  # this rank lists the layers the other way round
        params = params[2:] + params[:2]
    try:
        dlion.DistributedLion(params, lr=0.1)
    except ValueError as e:
        return str(e)
    return None


def order_warning_worker(rank, world):
    """The warnings DistributedLion's construction gives for three models, and check_replicas()
    with and without one rank's names changed afterwards."""
    out = {}
    for case in ("ambiguous", "named", "distinct"):
        torch.manual_seed(0)
        if case == "distinct":
            model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        else:
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = dlion.DistributedLion(model.named_parameters() if case == "named" else model.parameters(), lr=0.1)
        out[case] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                     and "named_parameters" in str(w.message)]
    opt.check_replicas()  # (the "distinct" model, unnamed): equal replicas, the same structure
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    opt = dlion.DistributedLion(model.named_parameters(), lr=0.1)
    opt.check_replicas()
    if rank == 1:  # the same weights under another name on one rank: the structure differs
        opt.param_groups[0]["param_names"][0] = "other.weight"
    try:
        opt.check_replicas()
    except dlion.DesyncError as e:
        out["desync"] = str(e)
    return out


def test_unnamed_parameters_of_one_shape_warn_and_check_replicas_compares_the_structure():
    """Without names, same-shape parameters in another order on one rank go unnoticed (the replicas
    stay equal position by position): construction warns on every rank, naming the remedy; not
    with names (a swapped order then raises: test_parameters_in_another_order_on_one_rank_raise_when_named)
    nor when no two trainable parameters share a shape and dtype. check_replicas() also compares a
    fingerprint of the structure (names, shapes, dtypes in order): a name changed on one rank raises
    on every rank."""
    for out in spawn(order_warning_worker, 2, timeout_s=60):
        assert len(out["ambiguous"]) == 1 and "Pass model.named_parameters() so the order is checked" in \
            out["ambiguous"][0]
        assert out["named"] == [] and out["distinct"] == []
        assert "the model's structure (parameter names where given, shapes and dtypes, in order) differs " \
            "between rank 0 and rank 1" in out["desync"]


def named_train_worker(rank, world, named):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    opt = dlion.DistributedLion(model.named_parameters() if named else model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.param_groups[0].get("param_names")


def test_parameters_in_another_order_on_one_rank_raise_when_named():
    """With model.named_parameters() the names are compared at construction: every rank raises, naming
    the parameter and the ranks. Without names the same mistake is not detectable (the user's contract)."""
    for err in spawn(named_order_worker, 3, True, timeout_s=30):
        assert err is not None and ("ranks disagree on the model at parameter 0: it is '2.weight' on rank 2 and "
                                    "'0.weight' on rank 0") in err
    assert spawn(named_order_worker, 3, False, timeout_s=30) == [None] * 3
    named = spawn(named_train_worker, 2, True, timeout_s=30)
    plain = spawn(named_train_worker, 2, False, timeout_s=30)
    for (pa, names), (pb, _) in zip(named, plain):  # names change nothing else
        assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))
