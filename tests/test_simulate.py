"""The one-process simulation of N workers against real Gloo ranks: identical parameters."""

import pytest
import torch

from dlion.simulate import SimulatedDistributedLion
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, STEPS, WD, configs_worker, grads_for, init_params

CASES = [
    dict(vote="mavo"),
    dict(vote="avg"),
    dict(vote="mavo", ties="random"),
    dict(vote="mavo", ties="previous"),
    dict(vote="mavo", ties="previous", comm="pbit", dense=True),
    dict(vote="mavo", comm="pbit", dense=True),
    dict(vote="mavo", aggregate="quantized", quant_norm="l1"),
    dict(vote="mavo", aggregate="quantized", quant_norm="linf", quant_bits=4, dense=True),
    dict(vote="avg", bucket_cap_mb=40 * 4 / 2**20),
]


def run_simulation(world, cfg):
    params = init_params(0)
    sim = SimulatedDistributedLion(params, world, lr=LR, betas=BETAS, weight_decay=WD, vote=cfg["vote"],
                                   ties=cfg.get("ties", "zero"), comm=cfg.get("comm", "1bit"),
                                   aggregate=cfg.get("aggregate", "sign"), quant_norm=cfg.get("quant_norm", "l1"),
                                   quant_bits=cfg.get("quant_bits", 8), bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0),
                                   seed=5)
    for t in range(STEPS):
        sim.step([grads_for(i, t, cfg.get("dense", False)) for i in range(world)])
    return params, sim


@pytest.mark.parametrize("world", [3, 4])
def test_simulated_workers_equal_real_ranks_bitwise(world):
    results = spawn(configs_worker, world, CASES)
    for c, cfg in enumerate(CASES):
        params, sim = run_simulation(world, cfg)
        for k, (got, want) in enumerate(zip(results[0][c]["params"], params)):
            assert torch.equal(got, want), f"{cfg}: parameter {k} differs between simulation and Gloo"
        real = results[0][c]["stats"]
        assert sim.comm_stats.bytes_sent == real["bytes_sent"], cfg  # counted formats = measured formats
        assert sim.comm_stats.by_kind == {k: v for k, v in real["by_kind"].items()}, cfg


def test_simulation_rejects_bad_input():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        SimulatedDistributedLion(p, 0)
    with pytest.raises(ValueError, match="Unknown vote"):
        SimulatedDistributedLion(p, 2, vote="x")
    sim = SimulatedDistributedLion(p, 2, lr=0.1)
    with pytest.raises(ValueError, match="needs grads\\[worker\\]\\[param\\] for 2 workers"):
        sim.step([[torch.zeros(3)]])
    with pytest.raises(ValueError, match="gradient for parameter 0 has shape \\(4,\\), expected \\(3,\\)"):
        sim.step([[torch.zeros(4)], [torch.zeros(3)]])


def test_one_worker_whose_codes_come_back_by_voters():
    """world_size=1 with a parameter without gradient: the codes come back by voters (dlion.wire._ByVoters)
    in one block whose length is not a multiple of 4, whose header is still read (a RuntimeError of
    view(int32) before); the parameters are dlion.Lion's."""
    import dlion
    from dlion import wire
    g = torch.Generator().manual_seed(3)
    shapes = [(2000,), (7,)]
    params0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(shapes[0], generator=g) for _ in range(2)]
    blocks = []
    decode = wire._ByVoters.decode

    def spy(self, gathered):
        blocks.append(self.block)
        return decode(self, gathered)

    wire._ByVoters.decode = spy
    try:
        sim = SimulatedDistributedLion([p.clone() for p in params0], 1, lr=0.01, comm="1bit", bucket_cap_mb=1.0)
        for gr in grads:
            sim.step([[gr, None]])
    finally:
        wire._ByVoters.decode = decode
    assert blocks and all(b % 4 for b in blocks)
    ref = [p.clone().requires_grad_() for p in params0]
    opt = dlion.Lion(ref, lr=0.01)
    for gr in grads:
        ref[0].grad = gr.clone()
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(sim.params, ref))
