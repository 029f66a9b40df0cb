"""The benchmarks' DiLoCo (:mod:`dlion.lab.diloco`): against torchft's ``DiLoCo`` on the same
pseudo-gradients (when torchft is installed), and against a literal reference on real Gloo ranks."""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dlion
from dlion.lab import diloco as ld
from dlion.lab.float_wire import roundtrip
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


# -- Streaming DiLoCo: fragments, the overlap τ, the mixing α -----------------------------------

def _two_layers() -> nn.Module:
    """Two 48-element weights: split_fragments(·, 2) cuts between them, as torchft's two module fragments."""
    with _SEED_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 6, bias=False))


class _CommittingManager(_StubManager):
    """The stub, with Manager.current_step() counting the commits (it picks the fragment in turn)."""

    commits = 0

    def current_step(self) -> int:
        return self.commits

    def should_commit(self, *args, **kwargs) -> bool:
        self.commits += 1
        return True


@pytest.mark.parametrize("fragments,delay,alpha", [(2, 1, 0.0), (2, 1, 0.5), (2, 0, 0.0), (1, 3, 0.5), (1, 0, 0.0)])
def test_streaming_matches_torchft_with_fragments_delay_and_mixing(fragments, delay, alpha):
    """torchft's DiLoCo(model_fragments, fragment_sync_delay, fragment_update_alpha), one outer SGD per
    fragment, and the lab's DiLoCo(fragments, sync_delay, update_alpha), on 3 simulated ranks for 3
    rounds of H = 4: bitwise equal after every step."""
    pytest.importorskip("torchft")
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    n, h, steps = 3, 4, 12

    def batches(rank):
        g = torch.Generator().manual_seed(100 + rank)
        return [torch.randn(4, 6, generator=g) for _ in range(steps)]

    def torchft_rank(rank, rv, out):
        m = _two_layers()
        opt = _inner("adamw", m)
        parts = [m[0], m[2]] if fragments == 2 else [m]
        outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
        seen = []
        with TorchftDiLoCo(_CommittingManager(rv, rank), parts, opt, outer, sync_every=h,
                           fragment_sync_delay=delay, fragment_update_alpha=alpha):
            for x in batches(rank):
                _inner_step(m, opt, x)
                seen.append([p.detach().clone() for p in m.parameters()])
        out[rank] = seen

    def lab_rank(rank, rv, out):
        m = _two_layers()
        calls = [0]

        def reduce(flat):
            rv.sum_(rank, calls[0], flat)
            calls[0] += 1

        lab = ld.DiLoCo(m.parameters(), _inner("adamw", m), sync_every=h, outer_lr=0.7, fragments=fragments,
                        sync_delay=delay, update_alpha=alpha, reduce=reduce, world=n)
        assert [len(f.params) for f in lab.fragments] == [1] * fragments if fragments == 2 else [2]
        seen = []
        for x in batches(rank):
            _inner_step(m, lab, x)
            seen.append([p.detach().clone() for p in m.parameters()])
        assert calls[0] == steps // h * fragments  # each fragment once per H steps
        out[rank] = seen

    ref, got = _threads(torchft_rank, n), _threads(lab_rank, n)
    initial = list(_two_layers().parameters())
    for r in range(n):
        for step, (a_step, b_step) in enumerate(zip(ref[r], got[r])):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b), (r, step)
        assert not any(torch.equal(a, p0) for a, p0 in zip(got[r][-1], initial))  # (it moved)


def _streaming_literal_worker(rank, world, wire, delay, alpha, quant=None):
    """The lab's Streaming DiLoCo on real Gloo ranks (2 fragments, H = 4: one fragment's round ends every
    2 steps, its exchange started τ steps before), and the algorithm written out here: the parameters
    after every step, both ways; θ after the run; the bytes the lab counted."""
    h, p_frag, steps = 4, 2, 12
    m_lab, m_ref = _two_layers(), _two_layers()
    lab = ld.DiLoCo(m_lab.parameters(), _inner("lion", m_lab), sync_every=h, outer_lr=0.7, wire_dtype=wire,
                    fragments=p_frag, sync_delay=delay, update_alpha=alpha, quantize=quant)
    opt_ref = _inner("lion", m_ref)
    params = list(m_ref.parameters())  # fragment f = parameter f here
    theta = [p.detach().clone() for p in params]
    bufs = [None, None]
    sent = {}  # fragment -> the summed Δ in flight
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(1, steps + 1):
        x = torch.randn(4, 6, generator=g)
        _inner_step(m_lab, lab, x)
        _inner_step(m_ref, opt_ref, x)
        within, f = (step - 1) % (h // p_frag) + 1, ((step - 1) // (h // p_frag)) % p_frag
        with torch.no_grad():
            if within == h // p_frag - delay and quant:  # start it, quantised: Q((Q(d_0) + … + Q(d_N-1)) / N)
                every = [torch.empty_like(params[f]) for _ in range(world)]  # (Q row by row: the weight's rows)
                dist.all_gather(every, (theta[f] - params[f]).contiguous())
                acc = roundtrip(every[0], quant)
                for d in every[1:]:
                    acc = acc + roundtrip(d, quant)
                sent[f] = roundtrip(acc / world, quant).reshape(-1) * world  # (÷ world below: exact, world = 4)
            elif within == h // p_frag - delay:  # start fragment f's exchange
                d = (theta[f] - params[f]).reshape(-1).to(wire)
                dist.all_reduce(d)
                sent[f] = d
            if within == h // p_frag:  # end fragment f's round
                avg = sent.pop(f).to(torch.float32) / world
                bufs[f] = avg.clone() if bufs[f] is None else bufs[f].mul_(0.9).add_(avg)
                new = theta[f].reshape(-1).add(avg.add(bufs[f], alpha=0.9), alpha=-0.7)  # Nesterov, as above
                local = params[f].detach().clone()
                theta[f].copy_(new.view_as(theta[f]))
                params[f].copy_(theta[f].lerp(local, alpha))  # (1 − α)·θ + α·x: torchft's lerp_
        out.append(([q.detach().clone() for q in m_lab.parameters()], [q.detach().clone() for q in params]))
    lab.check_replicas()
    with lab.anchored():
        anchored = [q.detach().clone() for q in m_lab.parameters()]
    return out, anchored, theta, lab.comm_stats.bytes_sent, sum(q.numel() for q in params)


@pytest.mark.parametrize("wire,delay,alpha", [(torch.float32, 1, 0.0), (torch.bfloat16, 1, 0.5),
                                              (torch.float32, 0, 0.0)])
def test_streaming_matches_a_literal_reference_on_three_ranks(wire, delay, alpha):
    world = 3
    results = spawn(_streaming_literal_worker, world, wire, delay, alpha)
    for rank, (out, anchored, theta, sent, n) in enumerate(results):
        for step, (lab, ref) in enumerate(out):
            for a, b in zip(lab, ref):
                assert torch.equal(a, b), (rank, step)
        for a, t, t0 in zip(anchored, theta, results[0][2]):
            assert torch.equal(a, t) and torch.equal(t, t0)  # θ, bitwise the same on every rank
        # 12 steps of H = 4: each fragment 3 times, so 3 ring all-reduces of the whole model, 2(N−1)/N
        # × 4 bytes (fp32) or 2 (bf16) per parameter each
        assert sent == pytest.approx(3 * 2 * (world - 1) / world * n * (4 if wire == torch.float32 else 2), abs=4)
    if alpha:  # the mixing kept part of each rank's own progress: the ranks' x differ, θ does not
        assert not all(torch.equal(a, b) for a, b in zip(results[0][0][-1][0], results[1][0][-1][0]))


@pytest.mark.parametrize("quant,delay", [("fp4", 1), ("fp8", 0), ("fp4", 0)])
def test_quantised_streaming_matches_a_literal_reference_on_four_ranks(quant, delay):
    # Streaming DiLoCo's fp4 (and torchft's fp8) wire: the quantised all-reduce in a thread beside the inner steps
    world = 4
    results = spawn(_streaming_literal_worker, world, torch.float32, delay, 0.0, quant)
    for rank, (out, anchored, theta, sent, n) in enumerate(results):
        for step, (lab, ref) in enumerate(out):
            for a, b in zip(lab, ref):
                assert torch.equal(a, b), (rank, step)
        for a, t, t0 in zip(anchored, theta, results[0][2]):
            assert torch.equal(a, t) and torch.equal(t, t0)
    # bytes, summed over the ranks: each fragment's weight (48 values; 8 rows of 6, then 6 of 8) exchanged 3 times,
    # each time 2(N − 1) copies of 48 / 2 (fp4; each rank's group padded to a byte: up to N more) or 48 (fp8)
    # bytes plus 4 per row
    values = 24 if quant == "fp4" else 48
    one = (values + 4 * 8) + (values + 4 * 6)
    total = sum(r[3] for r in results)
    assert 3 * 2 * (world - 1) * one <= total <= 3 * 2 * (world - 1) * (one + (2 * world if quant == "fp4" else 0))


def test_streaming_checks_its_arguments():
    m = _two_layers()
    inner = _inner("adamw", m)
    for kwargs, msg in (({"fragments": 0}, "fragments must be"),
                        ({"fragments": 3, "sync_every": 3}, "fragments must be an int from 1"),
                        ({"sync_every": 5, "fragments": 2}, "multiple of fragments"),
                        ({"sync_delay": 2, "fragments": 2}, "sync_delay"), ({"sync_delay": -1}, "sync_delay"),
                        ({"update_alpha": 1.5}, "update_alpha")):
        with pytest.raises(ValueError, match=msg):
            ld.DiLoCo(m.parameters(), inner, **{"sync_every": 4, **kwargs})
    sizes = [torch.zeros(10), torch.zeros(1), torch.zeros(1), torch.zeros(10)]
    assert [len(f) for f in ld.split_fragments(sizes, 2)] == [2, 2]
    assert [len(f) for f in ld.split_fragments([torch.zeros(10), torch.zeros(1), torch.zeros(1)], 3)] == [1, 1, 1]
