"""Uneven inputs: ``torch.distributed.algorithms.Join`` around the training loop, on real Gloo ranks.

Rank 2 has two batches fewer than ranks 0 and 1. Inside ``Join([opt])`` the rank that runs out
answers the others' remaining steps as an abstainer (no gradient on any parameter); every rank
finishes with bitwise-equal parameters, equal to a run without Join in which rank 2's missing
steps are steps with every gradient None. Without Join every rank would wait in the next
collective until the process-group timeout (the workers' is 60 to 120 s: a hang fails the test).
The same for the DDP communication hook (``Join([ddp, opt])``), HierarchicalDistributedLion and
LocalDistributedLion below.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.join import JoinHook, Joinable

import dlion
from dlion.integrations.ddp import ApplyDelta, DLionHookState, dlion_hook
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, WD, grads_for, init_params

BATCHES = 5     # ranks 0 and 1; rank 2 has BATCHES - SHORT
SHORT = 2
CONFIGS = [dict(vote="mavo", comm="1bit", check_every=1),
           dict(vote="avg", comm="allgather", momentum_sync=2),
           dict(vote="mavo", comm="pbit", ties="random")]


def build(rank, cfg):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, seed=5, **cfg)
    return params, opt


def batches(rank):
    return BATCHES - SHORT if rank == 2 else BATCHES


def join_worker(rank, world, joined):
    """Each config: with ``joined``, the uneven loop inside Join; otherwise every rank runs BATCHES
    steps, rank 2's last SHORT ones with every gradient None (the same abstention, spelled out)."""
    out = []
    for cfg in CONFIGS:
        params, opt = build(rank, cfg)
        assert isinstance(opt, Joinable)
        if joined:
            with Join([opt]):
                for t in range(batches(rank)):
                    for p, g in zip(params, grads_for(rank, t, False)):
                        p.grad = g
                    opt.step()
        else:
            for t in range(BATCHES):
                grads = grads_for(rank, t, False) if t < batches(rank) else [None] * len(params)
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
        opt.check_replicas()
        out.append(dict(params=[p.detach().clone() for p in params], steps=opt.step_count,
                        momenta=[opt.state[p]["exp_avg"].clone() for p in params if "exp_avg" in opt.state[p]],
                        grads=[None if p.grad is None else p.grad.clone() for p in params]))
    return out


def test_join_lets_a_rank_with_fewer_batches_abstain_until_every_rank_is_done():
    joined = spawn(join_worker, 3, True, timeout_s=120)
    plain = spawn(join_worker, 3, False, timeout_s=120)
    for c in range(len(CONFIGS)):
        ref = joined[0][c]
        assert ref["steps"] == BATCHES
        for rank in range(3):
            got, want = joined[rank][c], plain[rank][c]
            assert got["steps"] == BATCHES
            assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))   # replicas equal
            assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))  # = abstention run
            assert all(torch.equal(a, b) for a, b in zip(got["momenta"], want["momenta"]))
        # the shadow steps put the joined rank's own gradients back (its last batch's)
        last = grads_for(2, BATCHES - SHORT - 1, False)
        assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(joined[2][c]["grads"], last))


def unsupported_worker(rank, world):
    errors = []
    group = dist.new_group([0, 1])  # every rank, as an explicit group
    for make in (lambda ps: dlion.DistributedLion(ps, lr=LR, overlap=True),
                 lambda ps: dlion.DistributedLion(ps, lr=LR, delay=1),
                 lambda ps: dlion.LocalDistributedLion(ps, lr=LR, sync_every=2, streaming=True, process_group=group)):
        opt = make([p.requires_grad_() for p in init_params(rank)])
        with pytest.raises(NotImplementedError) as e:
            Join([opt])
        errors.append(str(e.value))
    return errors


def test_join_is_refused_where_a_step_cannot_be_shadowed():
    """overlap=True, delay=1 and LocalDistributedLion(streaming=True) on an explicit process group:
    Join([opt]) raises NotImplementedError on every rank, before any collective (nothing hangs)."""
    for errors in spawn(unsupported_worker, 2, timeout_s=60):
        assert "needs overlap=False and delay=0" in errors[0] and "needs overlap=False and delay=0" in errors[1]
        assert "LocalDistributedLion(streaming=True): torch.distributed.algorithms.Join needs process_group=None" \
            in errors[2]


def schedule_worker(rank, world):
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    opt = dlion.DistributedLion(model.named_parameters(), lr=0.1)
    try:
        with Join([opt]):
            for _ in range(4 - 2 * rank):  # rank 1: two batches fewer
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                for group in opt.param_groups:  # a per-step schedule: not stepped once a rank has joined
                    group["lr"] *= 0.5
    except ValueError as e:
        return str(e)
    return None


def test_a_per_step_schedule_not_stepped_on_the_joined_rank_raises_on_every_rank():
    """The finished rank's shadow steps use its own lr: once it differs from the others', the step's
    hyperparameter digest disagrees and every rank raises (nothing changed), instead of applying
    Δ with two different lrs."""
    for err in spawn(schedule_worker, 2, timeout_s=60):
        assert err is not None and "ranks disagree on lr, betas, weight_decay or maximize at step 3" in err


def _snapshot(params):
    return [p.detach().clone() for p in params]


class Snapshots(Joinable):
    """Listed last in ``Join``: on a finished rank, the parameters (or what ``snap()`` returns) after
    each step it shadowed (after every other joinable's hook has run), to compare step by step."""

    def __init__(self, params, snap=None):
        super().__init__()
        self.params, self.seen = list(params), []
        self.snap = snap or (lambda: _snapshot(self.params))

    def join_hook(self, **kwargs):
        outer = self

        class Record(JoinHook):
            def main_hook(self):
                outer.seen.append(outer.snap())

        return Record()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


# -- the DDP communication hook ---------------------------------------------------------------
DDP_BATCHES = (5, 3, 4)  # rank 1 runs out first, then rank 2
DDP_CONFIGS = [dict(vote="mavo", comm="1bit"), dict(vote="avg", comm="allgather"), dict(vote="mavo", comm="pbit")]


from test_nonfinite import _batch as _ddp_batch, _model as _ddp_model  # noqa: E402  (the hook tests' model)


def ddp_join_worker(rank, world, with_opt):
    """Each config: DDP with the hook inside ``Join([ddp, opt])`` (``with_opt``) or ``Join([ddp])``,
    this rank's DDP_BATCHES[rank] batches; then the reference, DistributedLion on the bare model for
    max(DDP_BATCHES) steps, the missing ones without any gradient (this rank abstains)."""
    out = []
    total = max(DDP_BATCHES)
    for cfg in DDP_CONFIGS:
        model = _ddp_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)  # two buckets after the rebuild
        state = DLionHookState(model, betas=BETAS, bucket_cap_mb=0.5, **cfg)
        ddp.register_comm_hook(state, dlion_hook)
        opt = ApplyDelta(ddp.parameters(), lr=LR, weight_decay=WD)
        probe = Snapshots(model.parameters())
        after = []
        with Join([ddp, opt, probe] if with_opt else [ddp, probe]):
            for t in range(DDP_BATCHES[rank]):
                opt.zero_grad()
                x, y = _ddp_batch(rank, t)
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                after.append(_snapshot(model.parameters()))
        after += probe.seen
        final = _snapshot(model.parameters())
        momenta = state.state_dict()["momenta"]
        ref = _ddp_model()
        ropt = dlion.DistributedLion(ref.named_parameters(), lr=LR, betas=BETAS, weight_decay=WD, vote=cfg["vote"],
                                     comm="1bit")
        ref_after = []
        for t in range(total):
            ropt.zero_grad()
            if t < DDP_BATCHES[rank]:
                x, y = _ddp_batch(rank, t)
                nn.functional.cross_entropy(ref(x), y).backward()
            ropt.step()
            ref_after.append(_snapshot(ref.parameters()))
        out.append(dict(after=after, final=final, ref=ref_after, steps=state.steps,
                        momenta=[momenta[i] for i in range(len(final))],
                        ref_momenta=[ropt.state[p]["exp_avg"].clone() for p in ref.parameters()]))
    return out


def _equal(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys))


def test_ddp_hook_join_abstains_for_the_finished_ranks_and_applies_the_same_delta():
    """``Join([ddp, opt])``, 3 ranks with 5/3/4 batches: after every step (the finished ranks' too,
    recorded after their shadow) every rank's parameters equal those of DistributedLion in which
    the missing steps have no gradient, bitwise; the finished ranks' momenta do not change. Before:
    ``ApplyDelta`` was not a Joinable (``Join`` raised); with the hook run on DDP's zero buckets as
    a real backward, the finished rank votes sign(β1·m) and decays its momentum (the vote and the
    parameters differ from the reference), and without ApplyDelta's join hook its parameters stay
    behind until DDP's final broadcast."""
    results = spawn(ddp_join_worker, 3, True, timeout_s=120)
    total = max(DDP_BATCHES)
    for c in range(len(DDP_CONFIGS)):
        for rank in range(3):
            got = results[rank][c]
            assert got["steps"] == total and len(got["after"]) == total
            for t in range(total):
                assert _equal(got["after"][t], got["ref"][t]), (DDP_CONFIGS[c], rank, t)
                assert _equal(got["after"][t], results[0][c]["after"][t]), (DDP_CONFIGS[c], rank, t)
            assert _equal(got["final"], got["ref"][-1])
            assert _equal(got["momenta"], got["ref_momenta"])


def test_ddp_hook_join_without_apply_delta_is_equal_at_the_end():
    """``Join([ddp])`` alone: the finished ranks abstain in the vote (the others' parameters equal
    the reference at every step) and DDP's final broadcast brings theirs level at the end."""
    results = spawn(ddp_join_worker, 3, False, timeout_s=120)
    total = max(DDP_BATCHES)
    for c in range(len(DDP_CONFIGS)):
        for rank in range(3):
            got = results[rank][c]
            assert _equal(got["final"], got["ref"][-1]), (DDP_CONFIGS[c], rank)
            assert _equal(got["momenta"], got["ref_momenta"])
        assert all(_equal(results[0][c]["after"][t], results[0][c]["ref"][t]) for t in range(total))


def ddp_misuse_worker(rank, world):
    model = _ddp_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = DLionHookState(model, comm="allgather")
    ddp.register_comm_hook(state, dlion_hook)
    opt = ApplyDelta(ddp.parameters(), lr=LR)
    stray = ApplyDelta([torch.zeros(3, requires_grad=True)], lr=LR)  # parameters no hook state votes on
    errors = []
    for joinables in ([opt, ddp], [opt], [ddp, stray]):
        with pytest.raises(ValueError) as e:
            Join(joinables)
        errors.append(str(e.value))
    # nothing was issued: the ranks still train together
    x, y = _ddp_batch(rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    return errors, _snapshot(model.parameters())


def test_ddp_hook_join_in_the_wrong_order_or_without_the_hook_raises_on_every_rank():
    """ApplyDelta listed before the DDP model (or alone) would announce each iteration after the
    hook's collectives: ``ValueError`` on every rank when ``Join`` is built, before any collective."""
    results = spawn(ddp_misuse_worker, 2, timeout_s=60)
    for errors, params in results:
        assert "must come after the DistributedDataParallel model" in errors[0]
        assert "must come after the DistributedDataParallel model" in errors[1]
        assert "only together with the DistributedDataParallel model whose communication hook is dlion_hook" \
            in errors[2]
        assert _equal(params, results[0][1])


# -- HierarchicalDistributedLion ------------------------------------------------------------
HIER_BATCHES = (5, 3, 2, 4)  # a 2 × 2 mesh: node 0 = ranks 0, 1; node 1 = ranks 2, 3 (finishes before node 0)
HIER_CONFIGS = [dict(vote="mavo", comm="1bit", check_every=1), dict(vote="avg", comm="allgather", momentum_sync=2),
                dict(vote="mavo", comm="pbit", ties="random")]


def hier_join_worker(rank, world, joined):
    """Each config: with ``joined``, this rank's HIER_BATCHES[rank] steps inside ``Join([opt])``; otherwise
    max(HIER_BATCHES) steps, the missing ones with every gradient None. The parameters after each step
    (a finished rank's: after each step it shadowed) and the momentum slices at the end."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    out = []
    total = max(HIER_BATCHES)
    for cfg in HIER_CONFIGS:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = dlion.HierarchicalDistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, mesh=mesh, seed=5, **cfg)
        after = []
        if joined:
            probe = Snapshots(params)
            with Join([opt, probe]):
                for t in range(HIER_BATCHES[rank]):
                    for p, g in zip(params, grads_for(rank, t, False)):
                        p.grad = g
                    opt.step()
                    after.append(_snapshot(params))
            after += probe.seen
        else:
            for t in range(total):
                grads = grads_for(rank, t, False) if t < HIER_BATCHES[rank] else [None] * len(params)
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
                after.append(_snapshot(params))
        opt.check_replicas()
        momenta = opt.state_dict()["dlion"]["hierarchical"]["momentum"]  # this rank's slices of its node's
        out.append(dict(after=after, steps=opt.step_count, momenta=momenta,
                        grads=[None if p.grad is None else p.grad.clone() for p in params]))
    return out


def test_hierarchical_join_lets_ranks_and_whole_nodes_that_run_out_abstain():
    """4 ranks on a 2 × 2 mesh with 5/3/2/4 batches (node 1 runs out before node 0; rank 1 before its
    node-mate): inside ``Join([opt])`` every rank's parameters after every step (a finished rank's after
    each step it shadowed) equal, bitwise, those of the run in which the missing steps have every gradient
    None (a zero in the node's mean; a node with no gradient abstains), and so do the momentum slices;
    the finished ranks' ``.grad`` are their last batch's. Before: the optimizer was not a Joinable
    (``Join([opt])`` raised), and without Join every rank waited in the next collective until the timeout."""
    joined = spawn(hier_join_worker, 4, True, timeout_s=120)
    plain = spawn(hier_join_worker, 4, False, timeout_s=120)
    total = max(HIER_BATCHES)
    for c in range(len(HIER_CONFIGS)):
        for rank in range(4):
            got, want = joined[rank][c], plain[rank][c]
            assert got["steps"] == total and len(got["after"]) == total
            for t in range(total):
                assert _equal(got["after"][t], want["after"][t]), (HIER_CONFIGS[c], rank, t)
                assert _equal(got["after"][t], joined[0][c]["after"][t]), (HIER_CONFIGS[c], rank, t)
            assert _equal(got["momenta"], want["momenta"])
            last = grads_for(rank, HIER_BATCHES[rank] - 1, False)
            assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got["grads"], last))


# -- LocalDistributedLion ---------------------------------------------------------------------
LOCAL_CASES = [dict(H=3, batches=(6, 4, 5)),                 # ranks 1 and 2 run out in the middle of round 2
               dict(H=3, batches=(7, 2, 5), vote="avg"),     # rank 1 in round 1 (abstains in all of round 2); 7:
               dict(H=2, batches=(5, 3, 4), streaming=True),  # a round unfinished at the end
               dict(H=4, batches=(9, 5, 7), streaming=True, P=2)]  # two fragments, rounds ending on even steps


def local_join_worker(rank, world):
    """Each case: this rank's batches[rank] steps inside ``Join([opt])``; after every step (a finished
    rank's: every step it shadowed) the step count, the anchor and this rank's local parameters."""
    out = []
    for case in LOCAL_CASES:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = dlion.LocalDistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, sync_every=case["H"],
                                         vote=case.get("vote", "mavo"), streaming=case.get("streaming", False),
                                         fragments=case.get("P", 1), bucket_cap_mb=0.01 if case.get("P") else 25.0,
                                         outer_scale=1.0, reset_momentum=False, comm="1bit", seed=3, check_every=1)

        def snap():
            local = _snapshot(params)
            with opt.anchored():
                return opt.step_count, _snapshot(params), local, [opt.fragment_of(p) for p in params]

        probe = Snapshots(params, snap)
        after = []
        with Join([opt, probe]):
            for t in range(case["batches"][rank]):
                for p, g in zip(params, grads_for(rank, t, False)):
                    p.grad = g
                opt.step()
                after.append(snap())
        out.append(after + probe.seen)
    return out


def test_local_join_lets_ranks_that_run_out_mid_round_abstain():
    """3 ranks, H = 3 with 6/4/5 batches (two ranks run out in the middle of round 2), H = 3 with 7/2/5 and
    Avg (one rank runs out in round 1 and abstains in the whole of round 2; the third round is unfinished at
    the end), streaming with H = 2 and with H = 4 in two fragments (9/5/7 batches): inside ``Join([opt])`` every rank runs max(batches) steps; after every
    step the anchor is bitwise equal on every rank, after every sync it equals the literal reference in which
    each rank's missing steps have no gradient (it votes on the progress it made before it ran out and
    abstains on the rest), and each rank's local parameters at the end equal that reference's. Before: Join
    raised NotImplementedError for LocalDistributedLion. Mutations checked: a finished rank that votes as if
    present in the rounds after it ran out (the sign of its residual) changes the anchor; one whose shadow
    steps leave their lr out of S makes every rank raise on the digest (α·S differs)."""
    from test_local import reference, reference_streaming

    results = spawn(local_join_worker, 3, timeout_s=120)
    for c, case in enumerate(LOCAL_CASES):
        total, H = max(case["batches"]), case["H"]
        P = case.get("P", 1)
        if case.get("streaming"):
            frag = results[0][c][0][3]  # (each parameter's fragment, as the optimizer laid them out)
            anchors, xs = reference_streaming(3, total, H, batches=case["batches"], frag=frag, P=P)
        else:
            anchors, xs = reference(3, total, H, vote=case.get("vote", "mavo"), batches=case["batches"])
        assert sorted(anchors) == [t for t in range(1, total + 1) if t % (H // P) == 0]
        for rank in range(3):
            trace = results[rank][c]
            assert [n for n, *_ in trace] == list(range(1, total + 1)), (case, rank)
            for t, (n, anchor, local, _) in enumerate(trace):
                assert _equal(anchor, results[0][c][t][1]), (case, rank, n)
                if n in anchors:
                    assert _equal(anchor, anchors[n]), (case, rank, n)
            assert _equal(trace[-1][2], xs[rank]), (case, rank)
