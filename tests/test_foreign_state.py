"""DistributedLion.load_state_dict refuses state it should not take silently: another optimizer
type's (a plain dlion.Lion's, Adam's) and another rank's unless asked (``from_rank="any"`` or
``with opt.accepting_any_rank():``)."""

import copy

import torch

import dlion
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, WD, grads_for, init_params


def _train(opt, params, rank, steps=3):
    for t in range(steps):
        for p, g in zip(params, grads_for(rank, t, True)):
            p.grad = g
        opt.step()


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params], [g["lr"] for g in opt.param_groups],
            [tuple(g["betas"]) for g in opt.param_groups],
            [opt.state[p]["exp_avg"].clone() for p in params])


def _same(a, b):
    return all(torch.equal(x, y) if torch.is_tensor(x) else x == y for u, v in zip(a, b) for x, y in zip(u, v))


def foreign_worker(rank, world):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD)
    _train(opt, params, rank)
    mine = copy.deepcopy(opt.state_dict())  # (state_dict() holds the live momentum tensors)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    other = everyone[1 - rank]
    # foreign optimizers, trained on copies of the same parameters
    copies = [p.detach().clone().requires_grad_() for p in params]
    lion = dlion.Lion(copies, lr=0.5, betas=(0.5, 0.5))
    adam = torch.optim.Adam(copies, lr=0.5, betas=(0.5, 0.5))
    for o in (lion, adam):
        for p, g in zip(copies, grads_for(rank, 0, True)):
            p.grad = g
        o.step()
    before = _snapshot(opt, params)
    errors = {}
    for name, sd, kw in [("lion", lion.state_dict(), {}), ("adam", adam.state_dict(), {}),
                         ("adam_any", adam.state_dict(), {"from_rank": "any"}), ("other_rank", other, {}),
                         ("bad_option", mine, {"from_rank": "rank0"})]:
        try:
            opt.load_state_dict(sd, **kw)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    unchanged = _same(before, _snapshot(opt, params))
    # asked for explicitly: this rank starts from the other rank's momenta (hyperparameters as torch.optim loads them)
    other_momenta = [other["state"][i]["exp_avg"] for i in range(len(params))]
    opt.load_state_dict(other, from_rank="any")
    took_any = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, other_momenta))
    opt.load_state_dict(mine)  # its own: as ever
    own_back = _same(before, _snapshot(opt, params))
    with opt.accepting_any_rank():
        opt.load_state_dict(other)
    took_in_block = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, other_momenta))
    try:
        opt.load_state_dict(other)  # the block has ended
        after_block = None
    except ValueError as e:
        after_block = str(e)
    # hyperparameters: loaded as torch.optim loads them
    sd = dict(mine, param_groups=[dict(g, lr=0.123) for g in mine["param_groups"]])
    opt.load_state_dict(sd)
    lr_loaded = [g["lr"] for g in opt.param_groups]
    return errors, unchanged, took_any, own_back, took_in_block, after_block, lr_loaded


def test_foreign_and_other_rank_state_is_refused_unless_asked():
    """Until 2026-11-26 every one of these loaded silently: a plain Lion's state, Adam's state
    (whose lr and betas then became the optimizer's) and the other rank's momenta."""
    for rank, (errors, unchanged, took_any, own_back, took_in_block, after_block, lr_loaded) in enumerate(
            spawn(foreign_worker, 2, timeout_s=60)):
        assert "no 'dlion' record" in errors["lion"] and "dlion.Lion" in errors["lion"], errors["lion"]
        assert "no 'dlion' record" in errors["adam"] and "Adam-style" in errors["adam"], errors["adam"]
        assert "Adam-style" in errors["adam_any"]  # from_rank="any" does not admit other optimizer types
        assert f"saved by rank {1 - rank} (of 2); this is rank {rank} (of 2)" in errors["other_rank"]
        assert "from_rank='any'" in errors["other_rank"]
        assert "from_rank must be one of 'own', 'any'" in errors["bad_option"]
        assert unchanged  # nothing refused changed any parameter, momentum or hyperparameter
        assert took_any and own_back and took_in_block
        assert after_block is not None and f"saved by rank {1 - rank}" in after_block
        assert lr_loaded == [0.123]
