"""D-Lion as a ``DistributedDataParallel`` communication hook, for code that must keep DDP.

DDP hands the hook each bucket of gradients as soon as backward has produced it
(and overlaps the hook's communication with the rest of backward). The hook
replaces the gradient all-reduce with Distributed Lion's vote::

    c = β1·m + (1 − β1)·g,   δ = sign(c)        # this rank's momentum, kept in the hook state
    m ← β2·m + (1 − β2)·g
    Δ = vote(δ_1 … δ_N)                          # the library's algorithm objects, no second implementation
    bucket ← Δ                                   # DDP writes it into every parameter's .grad

and :class:`ApplyDelta` then applies x ← x·(1 − η·λ) − η·Δ (with the same two
roundings as :class:`dlion.DistributedLion`). Usage::

    ddp = DistributedDataParallel(model)
    state = DLionHookState(ddp.module, betas=(0.9, 0.99), vote="mavo")
    ddp.register_comm_hook(state, dlion_hook)
    opt = ApplyDelta(ddp.parameters(), lr=3e-4, weight_decay=0.1)

What differs from :class:`dlion.DistributedLion` (all consequences of DDP's hook contract):

* **Collectives from callbacks.** Gloo pairs collectives by the order in which they
  are issued, and a hook's completion callbacks run at times that differ between
  ranks, so a second collective issued from a callback (like ``1bit``'s all-gather,
  or PowerSGD's Q) could be paired with another bucket's on a shared process group.
  ``comm="1bit"`` (the default: all-to-all of the signs, each rank votes on its chunk,
  all-gather of the codes; ~2·(N−1)/N bits per parameter each way) therefore gives
  every DDP bucket a process group of its own, created with the state (pass DDP's
  ``bucket_cap_mb`` so that there are enough; a few TCP connections each on Gloo).
  The one-collective algorithms use the default group: ``comm="allgather"`` (every
  rank's signs as base-3 digits, (N−1)·1.6 bits per parameter each way) or
  ``comm="pbit"`` (packed counters in one SUM all-reduce). The result is the same vote.
* **Unused parameters get zero gradients, not None**: they do not abstain; with
  g = 0 they vote sign(β1·m) (``find_unused_parameters`` does not change that).
* **GradScaler**: the hook sees *scaled* gradients; sign(c) mixes m with a scaled g.
  Not supported: use bf16 autocast without a scaler.
* **Non-finite gradients** are agreed per bucket, not per step: a bucket with inf/NaN
  on some rank gets Δ = 0 on every rank (other buckets still move) and no rank updates
  its momentum for it (the momentum update waits for the vote's outcome), so the next
  finite batch trains normally; ``state.skipped_buckets`` counts such buckets and
  ``state.skipped_steps`` the steps with at least one. ``nonfinite="raise"`` makes every
  rank's backward raise instead (``FloatingPointError`` inside DDP's error), with no
  momentum changed; after ``state.warn_after_skips`` (10) skipping steps in a row a
  ``RuntimeWarning`` names the rank(s), as :class:`dlion.DistributedLion` does.
  :class:`ApplyDelta` leaves a skipped bucket's parameters unchanged, weight decay
  included (the hook state tells it which were skipped), as a skipped step of
  :class:`dlion.DistributedLion` does.
* **Uneven inputs**: ``with Join([ddp, opt]):`` (``torch.distributed.algorithms.Join``,
  the DDP model first, then :class:`ApplyDelta`). DDP's own join hook shadows a finished
  rank's backward by running the registered hook on zero buckets
  (``DistributedDataParallel._match_all_reduce_for_bwd_pass``); :func:`dlion_hook` tells
  that call from a real backward (it runs outside autograd's backward) and makes the rank
  *abstain* there (it sends no vote, its momentum does not change; zeros would have voted
  sign(β1·m)), and keeps the agreed Δ, which :class:`ApplyDelta`'s own join hook then
  applies: every rank's parameters stay bitwise equal after every step, equal to
  :class:`dlion.DistributedLion`'s in which the finished rank's missing steps have no
  gradient. ``Join([ddp])`` alone leaves the finished rank's parameters behind until DDP's
  final broadcast (equal again at the end); ``Join([opt, ddp])`` and ``Join([opt])``
  raise ``ValueError`` on every rank when the context manager is built. One exception to
  "after every step": with ``find_unused_parameters=True``, a parameter that *no* rank used
  in a step keeps ``.grad`` None on the ranks still training (DDP does not write it), so
  they leave it, while the finished rank cannot tell and applies that step's Δ to it; DDP's
  final broadcast makes it equal again when the context manager exits.
* The momenta live in the hook state: save them per rank with
  ``state.state_dict()`` / ``load_state_dict`` next to the optimizer's.
"""

import itertools
import threading
import warnings
import weakref
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook, Joinable

from .. import kernels
from ..buckets import all_finite, finite_flag
from ..codec import SignCodec
from ..vote import VoteRule, coin_key
from ..wire import Contribution, WireState, make_algorithm, padded_length
from ..collectives import CommStats, GroupTransport
from ..base import NONFINITE_POLICIES
from ..lion import check_hyperparameters, check_momentum_dtype, lion_momentum_update, lion_presign

__all__ = ["DLionHookState", "dlion_hook", "ApplyDelta", "per_bucket_groups"]

_HOOK_COMMS = ("1bit", "allgather", "pbit")
_SIGN = SignCodec()

#: every live DLionHookState (ApplyDelta finds the states that vote on its parameters here)
_STATES: "weakref.WeakSet" = weakref.WeakSet()


def _states_of(params: Iterable) -> list:
    """The live :class:`DLionHookState` objects that vote on any of ``params``."""
    ids = {id(p) for p in params}
    return [s for s in list(_STATES) if not ids.isdisjoint(s._param_ids)]


def per_bucket_groups(model: torch.nn.Module, bucket_cap_mb: Optional[float] = None, process_group=None) -> list:
    """A new process group (of ``process_group``'s ranks) for every bucket DDP can make of
    ``model`` with ``bucket_cap_mb`` (DDP's default 25 if None): a hook whose later collectives
    are issued from completion callbacks puts bucket k's on group k, so that each group sees the
    same sequence on every rank. Every rank of the default group must call it (``new_group``).
    DDP's buckets close once they reach the cap, and its default first bucket is smaller
    (1 MiB): at most two more buckets than the bytes need."""
    cap = bucket_cap_mb or 25.0
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return [dist.new_group(ranks) for _ in range(int(nbytes // (cap * 2**20)) + 3)]


class DLionHookState:
    """Per-rank state of :func:`dlion_hook`: each parameter's momentum (keyed by its
    position in ``model.parameters()``, so DDP's bucket rebuild after the first
    iteration changes nothing), the vote rule, the algorithm and a step counter.

    ``fused=True`` (fp32 CPU buckets): the local math (c, its sign, the 1-bit payload,
    the momentum update) in the native loops of :mod:`dlion.kernels`, the same values.
    The library is loaded at construction on every rank (one small all-gather, so pass
    the same ``fused`` on every rank, as every other option); where any rank cannot load
    it, every rank raises the same error."""

    def __init__(self, model: torch.nn.Module, betas: tuple[float, float] = (0.9, 0.99), *, vote: str = "mavo",
                 ties: str = "zero", comm: str = "1bit", seed: int = 0, process_group=None,
                 momentum_dtype: Optional[torch.dtype] = None, bucket_cap_mb: Optional[float] = None,
                 fused: bool = False, nonfinite: str = "skip"):
        check_hyperparameters(1.0, betas, 0.0)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Unknown nonfinite {nonfinite!r}; choose one of {', '.join(map(repr, NONFINITE_POLICIES))}.")
        self.nonfinite = nonfinite
        check_momentum_dtype(momentum_dtype)
        self.momentum_dtype = momentum_dtype
        if comm not in _HOOK_COMMS:
            raise ValueError(f"comm must be one of {', '.join(map(repr, _HOOK_COMMS))} for the DDP hook "
                             f"(see dlion.integrations.ddp), got {comm!r}")
        if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be > 0 (DDP's), got {bucket_cap_mb!r}")
        if ties == "previous":
            raise ValueError("ties='previous' is implemented in DistributedLion (and SimulatedDistributedLion) only; "
                             "the DDP communication hook supports ties='zero' and 'random'.")
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.betas = tuple(betas)
        self.rule = VoteRule(vote, self.world, ties=ties, seed=seed)
        self.algorithm = make_algorithm(comm, self.rule)
        self.comm, self.seed = comm, seed
        self.index = {p: i for i, p in enumerate(model.parameters())}
        self.params = list(self.index)
        self._param_ids = {id(p) for p in self.params}
        _STATES.add(self)  # (ApplyDelta asks it which of its parameters' buckets were skipped)
        #: step -> indices of the parameters of the buckets skipped in that step (non-finite somewhere)
        self._skipped: dict = {}
        #: Join: id(parameter) -> Δ of the step this rank shadowed last (abstaining), for ApplyDelta
        self._shadow: dict = {}
        self.momenta: dict = {}
        self.steps = 0
        self.skipped_buckets = 0
        self.skipped_steps = 0  # steps in which at least one bucket was skipped
        self.warn_after_skips = 10
        self._skips_in_a_row = 0
        self._open: dict = {}  # step -> [buckets decided, buckets in the step (once known), ranks with inf/NaN]
        self._lock = threading.Lock()  # decide() runs on the process groups' threads
        self.comm_stats = CommStats()
        self.transport = GroupTransport(process_group, self.comm_stats)
        self.transports: list[GroupTransport] = []  # comm="1bit": one process group per DDP bucket
        self.wires: dict = {}  # per bucket index: the wire formats every rank agreed on
        if comm == "1bit":
            self.transports = [GroupTransport(g, self.comm_stats)
                               for g in per_bucket_groups(model, bucket_cap_mb, process_group)]
        self.fused = bool(fused)
        if self.fused:  # the kernels loaded on every rank, or the same error on all of them
            error = kernels.load_error()
            if self.world > 1:
                everyone: list = [None] * self.world
                dist.all_gather_object(everyone, error, group=process_group)
                failed = {r: e for r, e in enumerate(everyone) if e is not None}
            else:
                failed = {} if error is None else {None: error}
            if failed:
                raise RuntimeError(kernels.fused_error(failed))

    def _transport(self, index: int) -> GroupTransport:
        if not self.transports:
            return self.transport
        if index >= len(self.transports):
            raise RuntimeError(
                f"dlion_hook: DDP made bucket {index} but the state has process groups for {len(self.transports)}; "
                "pass DLionHookState(..., bucket_cap_mb=) the bucket_cap_mb you gave DistributedDataParallel")
        return self.transports[index]

    def _momentum(self, p: Tensor) -> Tensor:
        i = self.index[p]
        m = self.momenta.get(i)
        if m is None:
            m = self.momenta[i] = torch.zeros(p.shape, dtype=self.momentum_dtype or torch.float32, device=p.device)
        return m

    def _bucket_count(self, step: int, buckets: int) -> None:
        with self._lock:
            self._open.setdefault(step, [0, None, []])[1] = buckets
            self._close_if_done(step)

    def _decided(self, step: int, ranks_nonfinite: list, params: Optional[list] = None) -> None:
        """One bucket of ``step`` decided (skipped when ``ranks_nonfinite`` is not empty: its
        ``params`` are recorded for :class:`ApplyDelta`); once every bucket of the step is, the
        step counts as skipped or not (the same on every rank)."""
        with self._lock:
            entry = self._open.setdefault(step, [0, None, []])
            entry[0] += 1
            if ranks_nonfinite:
                self.skipped_buckets += 1
                entry[2].extend(ranks_nonfinite)
                self._skipped.setdefault(step, set()).update(self.index[p] for p in params or [])
            self._close_if_done(step)

    def _keep_shadow(self, params: list, delta: Tensor) -> None:
        """A shadowed bucket's Δ (the flat bucket, in the order of ``params``), for :class:`ApplyDelta`."""
        with self._lock:
            for p, d in zip(params, torch.split(delta, [p.numel() for p in params])):
                self._shadow[id(p)] = d.view(p.shape)

    def _take_shadow(self) -> dict:
        """id(parameter) -> Δ of the buckets shadowed since the last call (Join, a finished rank)."""
        with self._lock:
            out, self._shadow = self._shadow, {}
        return out

    def _take_skipped(self) -> set:
        """The parameters (as objects' ids) of the buckets skipped in the last step; forgotten once taken."""
        with self._lock:
            last = self._skipped.pop(self.steps - 1, set())
            self._skipped.clear()
        return {id(self.params[i]) for i in last}

    def _close_if_done(self, step: int) -> None:
        done, buckets, ranks = self._open[step]
        if buckets is None or done < buckets:
            return
        del self._open[step]
        if not ranks:
            self._skips_in_a_row = 0
            return
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        if self._skips_in_a_row == self.warn_after_skips:
            named = sorted({r for r in ranks if r is not None})
            who = f"rank(s) {', '.join(map(str, named))}" if named else "some rank (this comm does not say which)"
            warnings.warn(f"dlion_hook: {self._skips_in_a_row} steps in a row skipped (in some bucket) because {who} "
                          "had inf/NaN gradients; training is not progressing (check that rank's data and loss "
                          "scale, or use nonfinite='raise').", RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict:
        return {"momenta": {i: m.clone() for i, m in self.momenta.items()}, "steps": self.steps,
                "skipped_buckets": self.skipped_buckets, "skipped_steps": self.skipped_steps, "comm_stats": self.comm_stats.state_dict(),
                "vote": self.rule.vote, "ties": self.rule.ties, "comm": self.comm, "world_size": self.world,
                "rank": self.rank}

    def load_state_dict(self, sd: dict) -> None:
        self.momenta = {int(i): m.to(self.momentum_dtype or torch.float32, copy=True) for i, m in sd["momenta"].items()}
        self.steps = int(sd["steps"])
        self.skipped_buckets = int(sd.get("skipped_buckets", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.comm_stats.load_state_dict(sd["comm_stats"])


def _eager_contribution(state: DLionHookState, grad: Tensor, params: list, n: int) -> Contribution:
    """sign(β1·m + (1 − β1)·g) of the bucket, in torch ops. The momentum is not touched here:
    :func:`_update_momenta` runs once the vote has shown that every rank's bucket was finite.

    Off the CPU nothing is read on the host (this runs inside backward): the finiteness flag and the
    number of zero signs stay on the device (:attr:`dlion.wire.Contribution.finite`), where the algorithm
    completes the header that the first collective carries (:func:`dlion.wire._device_headers`, with c's zero
    runs listed there as the host lists them on the CPU), and the 1-bit payload is packed there,
    as :func:`dlion.buckets.contribute` does."""
    beta1 = state.betas[0]
    with torch.no_grad():
        g = grad.float()
        m = torch.cat([state._momentum(p).reshape(-1) for p in params]).float() if params else g.new_zeros(0)
        c = lion_presign([m], [g], beta1, foreach=False)[0]  # (the Lion rule's own pre-sign, same roundings)
        values = torch.zeros(padded_length(n, state.world), dtype=torch.int8, device=grad.device)
        values[:n].copy_(torch.sign(c))
        if n and grad.device.type != "cpu":
            zeros = n - torch.count_nonzero(values[:n])  # (0-d int64 tensors on the device, not read)
            return Contribution(values, n, torch.ones(len(params), dtype=torch.bool), 0, 0,
                                packed=_SIGN.encode(values), zeros=zeros, finite=finite_flag(c))
        finite = all_finite(c)  # (True when n = 0)
    return Contribution(values, n, torch.ones(len(params), dtype=torch.bool), 0 if finite else 2, 0)


def _native_applies(state: DLionHookState, grad: Tensor, sizes: list, n: int) -> bool:
    return bool(state.fused and n and sum(sizes) == n and grad.dtype == torch.float32
                and state.momentum_dtype in (None, torch.float32) and kernels.supported(grad))


def _update_momenta(state: DLionHookState, grad: Tensor, params: list, n: int) -> None:
    """m ← β2·m + (1 − β2)·g for the bucket's parameters (native loops where
    :func:`_native_contribution` applies, else torch ops in fp32: the same roundings as before)."""
    beta2 = state.betas[1]
    sizes = [p.numel() for p in params]
    with torch.no_grad():
        if _native_applies(state, grad, sizes, n):
            kernels.momentum_update_([state._momentum(p).view(-1) for p in params], list(torch.split(grad, sizes)),
                                     beta2, 1.0 - beta2)
            return
        if not params:
            return
        g = grad.float()
        m = torch.cat([state._momentum(p).reshape(-1) for p in params]).float()
        lion_momentum_update([m], [g], beta2, foreach=False)
        off = 0
        for p in params:  # the new momenta back into their per-parameter homes
            k = p.numel()
            state._momentum(p).copy_(m[off:off + k].view(p.shape))
            off += k


def _native_contribution(state: DLionHookState, grad: Tensor, params: list, n: int) -> Optional[Contribution]:
    """The same from the native loops (:mod:`dlion.kernels`, the same roundings; ``fused=True``):
    c's signs and the 1-bit payload straight from DDP's flat bucket and the
    per-parameter momenta, one pass and no copy (the momentum update: :func:`_update_momenta`). None where they do not apply (``fused=False``,
    bf16 momenta, not fp32 CPU)."""
    sizes = [p.numel() for p in params]
    if not _native_applies(state, grad, sizes, n):
        return None
    beta1 = state.betas[0]
    ms = [state._momentum(p).view(-1) for p in params]
    gs = list(torch.split(grad, sizes))  # views of the bucket, in the order of bucket.parameters()
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    values = torch.empty(padded_length(n, state.world), dtype=torch.int8)
    with torch.no_grad():
        finite, packed, zeros = kernels.sign_and_pack(ms, gs, offsets, beta1, 1.0 - beta1, values, n)
    return Contribution(values, n, torch.ones(len(params), dtype=torch.bool), 0 if finite else 2, 0,
                        packed=packed, zeros=zeros)


def _in_backward() -> bool:
    """Whether this runs inside autograd's backward. DDP runs the comm hook there for this rank's
    gradients; it runs it outside backward only from its Join hook, on zero buckets, for a rank that
    has run out of data (``DistributedDataParallel._match_all_reduce_for_bwd_pass``)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is None or current() != -1


def _abstention(state: DLionHookState, grad: Tensor, params: list, n: int) -> Contribution:
    """A finished rank's part in a bucket (Join): no vote on any parameter (has_grad False), as a
    :class:`dlion.DistributedLion` step without gradients; its momentum is not read or changed."""
    values = torch.zeros(padded_length(n, state.world), dtype=torch.int8, device=grad.device)
    return Contribution(values, n, torch.zeros(len(params), dtype=torch.bool), 0, 0)


def dlion_hook(state: DLionHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: this rank's Lion signs of the bucket in, the vote Δ out. Called
    outside backward (DDP's Join shadow of a finished rank), it abstains and keeps Δ for
    :class:`ApplyDelta`."""
    grad = bucket.buffer()
    params = bucket.parameters()
    n = grad.numel()
    shadow = not _in_backward()
    if shadow:
        contrib = _abstention(state, grad, params, n)
    else:
        contrib = _native_contribution(state, grad, params, n) or _eager_contribution(state, grad, params, n)
    if state.comm == "1bit":  # this bucket's own group: its later collectives may be issued from the callback
        wire = state.wires.setdefault(bucket.index(), WireState())
    else:  # a fresh wire state each call: the base-3 / wide formats never need a second collective
        wire = WireState(up="ternary" if state.comm == "allgather" else "wide")
    transport = state._transport(bucket.index())
    gen = state.algorithm.run(wire, contrib, state.rank, coin_key(state.seed, state.steps, bucket.index()))
    kind, send, label = next(gen)
    work, out = transport.issue(kind, send, label)
    step_no = state.steps
    if bucket.is_last():
        state.steps += 1
        state._bucket_count(step_no, bucket.index() + 1)

    def decide(fut) -> Tensor:
        received = out
        try:
            while True:
                kind, send, label = gen.send(received)
                if transport is state.transport:
                    raise RuntimeError("dlion_hook: the algorithm asked for a second collective on the shared group")
                later, received = transport.issue(kind, send, label)
                later.wait()
        except StopIteration as stop:
            outcome = stop.value
        if outcome.codes is None:  # inf/NaN on some rank: this bucket does not move anywhere, no momentum changes
            state._decided(step_no, outcome.ranks_nonfinite or [None], params)
            if state.nonfinite == "raise":
                raise FloatingPointError(f"dlion_hook: a rank has inf/NaN gradients in bucket {bucket.index()} at "
                                         f"step {step_no}; no rank changed this bucket's momentum.")
            grad.zero_()
            return grad
        if not shadow:
            _update_momenta(state, grad, params, n)  # (grad still holds this rank's gradient)
        state._decided(step_no, [])
        grad.copy_(state.rule.delta(outcome.codes[:n], torch.float32))
        if shadow:  # DDP drops the result on a finished rank: ApplyDelta's join hook applies it
            state._keep_shadow(params, grad)
        return grad

    return work.get_future().then(decide)


class _ApplyShadow(JoinHook):
    """Join: after DDP's join hook has shadowed the other ranks' backward (the comm hook abstaining),
    apply the agreed Δ on the finished rank too, so that its parameters stay equal to the others'."""

    def __init__(self, opt: "ApplyDelta"):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt._shadow_step()


class ApplyDelta(torch.optim.Optimizer, Joinable):
    """x ← x·(1 − η·λ) − η·Δ with Δ = the parameter's ``.grad`` as :func:`dlion_hook` left it
    (the update :class:`dlion.DistributedLion` applies, with the same roundings). The parameters
    of a bucket the hook skipped in the last step (inf/NaN on some rank) are left unchanged, weight
    decay included, on every rank.

    A ``Joinable`` for uneven inputs: ``with Join([ddp, opt]):`` (the DDP model first). On a rank
    that has run out of data it applies the Δ that the hook agreed while abstaining for it (module
    docstring), so the parameters stay bitwise equal on every rank after every step."""

    def __init__(self, params: Iterable, lr: float = 1e-4, weight_decay: float = 0.0):
        check_hyperparameters(lr, (0.0, 0.0), weight_decay)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        Joinable.__init__(self)  # a disabled join config until a Join context manager sets one

    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    @staticmethod
    def _apply(group: dict, ps: list, deltas: list) -> None:
        if not ps:
            return
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0.0:
            torch._foreach_mul_(ps, 1.0 - lr * wd)
        torch._foreach_sub_(ps, [torch.mul(d, lr) for d in deltas])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped: set = set()
        for state in _states_of(self._all_params()):
            skipped |= state._take_skipped()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None and id(p) not in skipped]
            self._apply(group, ps, [p.grad for p in ps])
        return loss

    @torch.no_grad()
    def _shadow_step(self) -> None:
        """Join, on a finished rank: the Δ the hook agreed while abstaining (none where DDP skipped
        the gradient synchronisation, e.g. the others' ``no_sync`` micro-batches, or a bucket was skipped)."""
        shadow: dict = {}
        for state in _states_of(self._all_params()):
            state._take_skipped()
            shadow.update(state._take_shadow())
        for group in self.param_groups:
            ps = [p for p in group["params"] if id(p) in shadow]
            self._apply(group, ps, [shadow[id(p)] for p in ps])

    # -- uneven inputs: torch.distributed.algorithms.Join ---------------------------
    def _state(self) -> DLionHookState:
        states = _states_of(self._all_params())
        if not states:
            raise ValueError("ApplyDelta joins torch.distributed.algorithms.Join only together with the "
                             "DistributedDataParallel model whose communication hook is dlion_hook (its "
                             "DLionHookState votes on these parameters): Join([ddp, opt]).")
        return states[0]

    def join_hook(self, **kwargs) -> JoinHook:
        self._state()
        if getattr(torch._C, "_current_graph_task_id", None) is None:
            raise NotImplementedError("ApplyDelta: this torch cannot tell DDP's Join shadow from a backward "
                                      "(no torch._C._current_graph_task_id); Join is not supported with the hook.")
        return _ApplyShadow(self)

    @property
    def join_device(self) -> torch.device:
        ps = self._all_params()
        return ps[0].device if ps else torch.device("cpu")

    @property
    def join_process_group(self):
        config = self._join_config
        if config.enable and config.is_first_joinable:
            # (Join reads this after configuring its joinables, before any collective, on every rank)
            raise ValueError(
                "ApplyDelta must come after the DistributedDataParallel model in Join: Join([ddp, opt]). "
                "The first joinable announces each iteration; DDP must do so in forward, before the "
                "hook's collectives in backward.")
        group = self._state().process_group
        return group if group is not None else dist.group.WORLD
