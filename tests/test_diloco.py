"""The benchmarks' DiLoCo (:mod:`dlion.lab.diloco`): against torchft's ``DiLoCo`` on the same
pseudo-gradients (when torchft is installed), and against a literal reference on real Gloo ranks."""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dlion
from dlion.lab import diloco as ld
from dlion.lab.spawn import spawn

H, ROUNDS = 3, 2


_SEED_LOCK = threading.Lock()  # (the simulated ranks are threads: seeding the global RNG must not interleave)


def _model() -> nn.Module:
    with _SEED_LOCK:
        torch.manual_seed(0)  # identical on every rank
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _inner(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return dlion.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)


def _batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 6, generator=g) for _ in range(H * ROUNDS)]


def _inner_step(model, opt, x) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


# -- against torchft's DiLoCo, single process -------------------------------------------------

class _Rendezvous:
    """N threads, one per simulated rank: an in-place SUM of their tensors, in rank order."""

    def __init__(self, n: int):
        self.n, self.slots, self.barrier, self.lock = n, {}, threading.Barrier(n, timeout=60), threading.Lock()

    def sum_(self, rank: int, key, t: torch.Tensor) -> None:
        with self.lock:
            self.slots[(key, rank)] = t.clone()
        self.barrier.wait()
        total = self.slots[(key, 0)].clone()
        for r in range(1, self.n):
            total += self.slots[(key, r)]
        self.barrier.wait()
        t.copy_(total)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class _StubManager:
    """What torchft's DiLoCo asks of its Manager, with Manager.allreduce's arithmetic (SUM, then
    ``/= num_participants``) over the rendezvous instead of a process group."""

    _use_async_quorum = False

    def __init__(self, rv: _Rendezvous, rank: int):
        self.rv, self.rank, self.calls = rv, rank, 0

    def register_state_dict_fn(self, *args) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def start_quorum(self, *args, **kwargs) -> None:
        pass

    def current_step(self) -> int:
        return 0

    def should_commit(self, *args, **kwargs) -> bool:
        return True

    def allreduce(self, tensor, should_quantize=False, **kwargs):
        self.rv.sum_(self.rank, self.calls, tensor)
        self.calls += 1
        tensor /= self.rv.n
        return _Done()


def _threads(fn, n: int) -> dict:
    rv, out = _Rendezvous(n), {}
    ts = [threading.Thread(target=fn, args=(r, rv, out)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == n, "a simulated rank failed"
    return out


@pytest.mark.parametrize("inner", ["adamw", "lion"])
def test_matches_torchft_diloco_on_the_same_pseudo_gradients(inner):
    """torchft's DiLoCo (its optimizer hooks, _StreamingDiLoCoFragment's save/restore, outer SGD
    step and merge) and the lab's functions, on 3 simulated ranks for two rounds: bitwise equal."""
    pytest.importorskip("torchft")
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    n = 3

    def torchft_rank(rank, rv, out):
        m = _model()
        opt = _inner(inner, m)
        outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with TorchftDiLoCo(_StubManager(rv, rank), [m], opt, outer, sync_every=H):
            for x in _batches(rank):
                _inner_step(m, opt, x)
        out[rank] = [p.detach().clone() for p in m.parameters()]

    def lab_rank(rank, rv, out):
        m = _model()
        opt = _inner(inner, m)
        st = ld.make_state(m.parameters(), sync_every=H, outer_lr=0.7)
        calls = [0]

        def reduce(flat):
            rv.sum_(rank, calls[0], flat)
            calls[0] += 1

        for x in _batches(rank):
            _inner_step(m, opt, x)
            ld.after_inner_step(st, reduce, n)
        assert st.syncs == ROUNDS
        out[rank] = [p.detach().clone() for p in m.parameters()]

    ref, got = _threads(torchft_rank, n), _threads(lab_rank, n)
    initial = list(_model().parameters())
    for r in range(n):
        for a, b, p0 in zip(ref[r], got[r], initial):
            assert torch.equal(a, b)
            assert not torch.equal(a, p0)  # (it moved)
        for a, b in zip(ref[r], ref[0]):
            assert torch.equal(a, b)  # every rank holds θ after a sync


# -- against a literal reference, real Gloo ranks ---------------------------------------------

def _literal_worker(rank, world, inner, wire):
    """The lab's DiLoCo wrapper, and DiLoCo written out here (torch.optim.SGD's Nesterov arithmetic
    by hand), on the same batches: the parameters after each sync, both ways."""
    m_lab, m_ref = _model(), _model()
    lab = ld.DiLoCo(m_lab.parameters(), _inner(inner, m_lab), sync_every=H, outer_lr=0.7, wire_dtype=wire)
    opt_ref = _inner(inner, m_ref)
    params = list(m_ref.parameters())
    theta = [p.detach().clone() for p in params]
    buf = None
    out = []
    for step, x in enumerate(_batches(rank)):
        _inner_step(m_lab, lab, x)
        _inner_step(m_ref, opt_ref, x)
        if (step + 1) % H:
            continue
        with torch.no_grad():
            delta = torch.cat([(t - p).reshape(-1) for t, p in zip(theta, params)])  # θ − x
            summed = delta.to(wire)
            dist.all_reduce(summed)  # SUM
            g = summed.to(torch.float32) / world
            buf = g.clone() if buf is None else buf.mul_(0.9).add_(g)  # momentum 0.9
            step_ = g.add(buf, alpha=0.9)  # Nesterov
            flat = torch.cat([t.reshape(-1) for t in theta]).add_(step_, alpha=-0.7)
            for t, p, v in zip(theta, params, flat.split([t.numel() for t in theta])):
                t.copy_(v.view_as(t))
                p.copy_(t)
        out.append(([p.detach().clone() for p in m_lab.parameters()], [p.detach().clone() for p in params]))
    lab.check_replicas()
    with lab.anchored():  # θ, which x equals right after a sync
        anchored = [p.detach().clone() for p in m_lab.parameters()]
    return out, anchored, lab.comm_stats.bytes_sent, sum(p.numel() for p in params)


@pytest.mark.parametrize("inner,wire", [("adamw", torch.float32), ("lion", torch.float32),
                                        ("adamw", torch.bfloat16), ("lion", torch.bfloat16)])
def test_matches_a_literal_reference_on_three_ranks(inner, wire):
    world = 3
    results = spawn(_literal_worker, world, inner, wire)
    for rank, (out, anchored, sent, n) in enumerate(results):
        assert len(out) == ROUNDS
        for lab, ref in out:
            for a, b in zip(lab, ref):
                assert torch.equal(a, b)
        for a, b in zip(anchored, out[-1][0]):
            assert torch.equal(a, b)
        for a, b in zip(out[-1][0], results[0][0][-1][0]):
            assert torch.equal(a, b)  # identical on every rank
        # one ring all-reduce of the n parameters per sync: 2(N−1)/N × 4 bytes (fp32) or 2 (bf16) each
        assert sent == pytest.approx(ROUNDS * 2 * (world - 1) / world * n * (4 if wire == torch.float32 else 2), abs=2)


def test_state_checks_its_arguments():
    m = _model()
    with pytest.raises(ValueError, match="sync_every"):
        ld.make_state(m.parameters(), sync_every=0)
    with pytest.raises(ValueError, match="wire_dtype"):
        ld.make_state(m.parameters(), sync_every=2, wire_dtype=torch.float16)
    st = ld.make_state(m.parameters(), sync_every=2)
    assert st.outer.defaults["lr"] == ld.OUTER_LR == 0.7
    assert st.outer.defaults["momentum"] == 0.9 and st.outer.defaults["nesterov"]
