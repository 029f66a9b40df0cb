"""Hierarchical Distributed Lion: nodes of several ranks joined by a slow network.

A job of ``n`` nodes × ``L`` ranks per node, described by a 2-D
``torch.distributed.device_mesh.DeviceMesh`` with dims ("node", "local"). Inside a
node the links are fast (NVLink, PCIe, shared memory): gradients travel in full
precision there. Between nodes the links are slow: only the 1-bit vote of Distributed
Lion (Liu et al. 2024, arXiv 2404.00438) with Lion Cub's communication (Ishikawa et
al. 2024, arXiv 2411.16462) crosses them. The *voters are the nodes*: ``n`` voters,
each voting with the sign of a Lion update computed from its node's mean gradient
and its node's momentum.

Every bucket (:mod:`dlion.buckets`, padded to a multiple of 40·n·L) is cut into ``L``
equal slices; local rank j owns slice j. Per step, per bucket::

    inside the node (fast):  G_a   = (1/L)·Σ_{ranks r of node a} g_r        reduce-scatter: rank j gets slice j
    on rank (a, j):          c     = β1·m_a + (1 − β1)·G_a     on slice j   m_a: node a's momentum, slice j only
                             δ_a   = sign(c)                   (or q = quantize(c) for aggregate="quantized")
    across nodes (slow):     Δ     = rule(δ_1 … δ_n)           the vote of :mod:`dlion.algorithms` on slice j,
                                                               over the group {(1, j), …, (n, j)}: L votes in parallel
    inside the node (fast):  all-gather of the codes of the L slices (int8)
    every rank:              x     ← x·(1 − η·λ) − η·Δ
    on rank (a, j):          m_a   ← β2·m_a + (1 − β2)·G_a     on slice j

A rank whose ``.grad`` is ``None`` counts as a zero gradient in its node's mean (as
DDP does); the node abstains on a parameter for which none of its ranks had a
gradient. With ``L = 1`` this is exactly :class:`dlion.DistributedLion` (every rank a
node); with one node it is Lion on the mean gradient.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, JoinHook, Joinable

from . import kernels
from .aggregation import VoteRule, coin_key
from .algorithms import BAD, NONFINITE, Contribution, Outcome, WireState, choose_algorithm, make_algorithm
from .buckets import (Bucket, RankBuffers, Scratch, apply_scaled_delta, contribute, layout_buckets, rebind_groups,
                      update_momentum)
from .collectives import CommStats, GroupTransport
from .pipeline import Flight, Pipeline
from .distributed import (DesyncError, _ShadowSteps, average_momenta, check_options, checksum_table,
                          momentum_sync_due, raise_if_diverged, reject_unsupported)
from .lion import Lion, check_grad
from .quantize import levels

__all__ = ["HierarchicalDistributedLion", "node_mesh"]

_DIGEST_BITS = 31
_FLAG_BAD, _FLAG_NONFINITE, _FLAG_DIGEST = 1, 2, 4


def node_mesh(device_type: str = "cpu", local_world_size: Optional[int] = None):
    """The 2-D mesh ("node", "local") of a torchrun job: ``LOCAL_WORLD_SIZE`` ranks per node
    (torchrun numbers the ranks of a node consecutively). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    if local_world_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("HierarchicalDistributedLion: no mesh given and LOCAL_WORLD_SIZE is not set (it is set by "
                             "torchrun); pass mesh=init_device_mesh(..., (nodes, per_node), "
                             "mesh_dim_names=('node', 'local')).")
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    world = dist.get_world_size()
    if local_world_size < 1 or world % local_world_size:
        raise ValueError(f"HierarchicalDistributedLion: {world} ranks cannot be split into nodes of "
                         f"{local_world_size} ranks.")
    return init_device_mesh(device_type, (world // local_world_size, local_world_size),
                            mesh_dim_names=("node", "local"))


class _Slice(Bucket):
    """Slice j of a bucket's padded coordinates, [j·S, (j+1)·S) with S = padded/L, seen as a
    bucket of its own (so :func:`dlion.buckets.contribute` and ``update_momentum`` run on it):
    its "parameters" are the flat pieces of the bucket's parameters inside the slice."""

    def __init__(self, b: Bucket, j: int, local_world: int):
        S = b.padded // local_world
        lo, hi = j * S, (j + 1) * S
        self.index, self.group, self.indices = b.index, b.group, b.indices
        self.device, self.dtype, self.low_precision = b.device, b.dtype, b.low_precision
        self.lo, self.padded = lo, S
        self.owner: list[int] = []  # for each piece, the index of its parameter within the bucket
        self.offsets, self.sizes = [], []
        for i, (o, n) in enumerate(zip(b.offsets, b.sizes)):
            a, z = max(o, lo), min(o + n, hi)
            if a < z:
                self.owner.append(i)
                self.offsets.append(a - lo)
                self.sizes.append(z - a)
        self.numel = sum(self.sizes)  # the pieces are contiguous from the slice's start
        self.params = [None] * len(self.sizes)

    def views(self, flat: Tensor) -> list[Tensor]:
        return [flat[o:o + n] for o, n in zip(self.offsets, self.sizes)]


class _Done:
    """A finished no-op collective (groups of one rank)."""

    @staticmethod
    def wait() -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


class HierarchicalDistributedLion(Lion, Joinable):
    """Distributed Lion on a two-level mesh: full-precision gradients inside a node,
    the 1-bit vote between nodes, one momentum per node sharded across its ranks.

    Args:
        mesh: a 2-D ``DeviceMesh`` with dims ("node", "local") (dim 0 = nodes, dim 1 =
            ranks of a node, if unnamed). ``None``: built from torchrun's
            ``LOCAL_WORLD_SIZE`` (:func:`node_mesh`).
        vote, ties, comm, aggregate, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
        seed, check_every, nonfinite, maximize, foreach, momentum_dtype, fused: as for :class:`dlion.DistributedLion`,
            with the *nodes* as the voters (N = number of nodes): ``momentum_sync``
            averages the node momenta across nodes; quantised aggregation scales each
            parameter's piece of a slice on its own.

    ``comm_stats`` counts the bytes this rank moves between nodes (the vote, momentum
    sync); ``local_stats`` those it moves inside its node (reduce-scatter of the
    gradients, all-gather of the codes, checks). ``momentum_numel`` is the number of
    momentum values this rank holds (≈ 1/L of the trainable parameters).
    Not supported (raise): ``overlap``, ``sign_hook``, ``torch.amp.GradScaler``,
    ``add_param_group`` after construction.

    Uneven inputs: ``with torch.distributed.algorithms.Join([opt]):`` around the loop; a rank that
    has run out of batches answers every later step with a step without gradients (a zero in its
    node's mean, as a ``.grad`` of None always is; a node whose ranks have all finished abstains),
    so nothing hangs and the replicas stay identical (:meth:`join_hook`).
    """

    _shadowing = False  # a Join shadow step is running (_shadow_step)

    def __init__(
        self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
        *,
        mesh=None,
        vote: str = "mavo",
        ties: str = "zero",
        comm: str = "auto",
        aggregate: str = "sign",
        quant_norm: str = "l1",
        quant_bits: int = 8,
        momentum_sync: Union[str, int] = "none",
        bucket_cap_mb: Union[float, Sequence[float]] = 25.0,
        seed: int = 0,
        check_every: int = 0,
        nonfinite: str = "skip",
        maximize: bool = False,
        foreach: Optional[bool] = None,
        momentum_dtype: Optional[torch.dtype] = None,
        fused: bool = False,
    ):
        check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                      check_every, nonfinite, None)
        if ties == "previous":
            raise ValueError("ties='previous' is implemented in DistributedLion (and SimulatedDistributedLion) only; "
                             "HierarchicalDistributedLion supports ties='zero' and 'random'.")
        params = reject_unsupported(params)
        self._agree_on_kernels = True  # (fused=True: below, on every rank at once)
        super().__init__(params, lr, betas, weight_decay, maximize=maximize, foreach=foreach,
                         momentum_dtype=momentum_dtype, fused=fused)
        Joinable.__init__(self)  # a disabled join config until a Join context manager sets one
        self.fused = bool(fused)
        kernels_error = kernels.load_error() if any(g.get("fused") for g in self.param_groups) else None
        self._params = [p for g in self.param_groups for p in g["params"]]
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and mesh is None and dist.get_world_size() > 1:
            dev = self._params[0].device.type if self._params else "cpu"
            mesh = node_mesh(dev)
        if mesh is not None:
            if mesh.ndim != 2:
                raise ValueError(f"HierarchicalDistributedLion needs a 2-D mesh ('node', 'local'), got {mesh.ndim} "
                                 "dimension(s).")
            names = tuple(mesh.mesh_dim_names or ())
            dims = ("node", "local") if set(names) == {"node", "local"} else (0, 1)
            self._node_group, self._local_group = mesh.get_group(dims[0]), mesh.get_group(dims[1])
            self.num_nodes, self.local_world_size = (dist.get_world_size(self._node_group),
                                                     dist.get_world_size(self._local_group))
            self.node, self.local_rank = dist.get_rank(self._node_group), dist.get_rank(self._local_group)
        else:
            self._node_group = self._local_group = None
            self.num_nodes, self.local_world_size, self.node, self.local_rank = 1, 1, 0, 0
        self.mesh = mesh
        self.world_size = self.num_nodes * self.local_world_size
        self.rank = self.node * self.local_world_size + self.local_rank
        self.rule = VoteRule(vote, self.num_nodes, ties=ties, seed=seed)
        self.comm, self.aggregate = comm, aggregate
        self.quant_norm, self.quant_bits = quant_norm, quant_bits
        self.quant_levels = levels(quant_bits, self.num_nodes) if aggregate == "quantized" else 0
        self.momentum_sync, self.seed = momentum_sync, seed
        self.bucket_cap_mb = list(bucket_cap_mb) if isinstance(bucket_cap_mb, (list, tuple)) else bucket_cap_mb
        self.check_every, self.nonfinite = check_every, nonfinite
        self.comm_stats = CommStats()
        self.local_stats = CommStats()
        #: completed ``step()`` calls, skipped ones included: keys the tie coins and the momentum-sync schedule
        self.step_count = 0
        self.skipped_steps = 0
        self.warn_after_skips = 10
        self._skips_in_a_row = 0
        self.num_params = sum(p.numel() for p in self._params if p.requires_grad)
        self.buckets: list[Bucket] = []
        self._slices: list[_Slice] = []
        self._algorithms: list = []
        self._wire: list[WireState] = []
        if kernels_error is not None and self.world_size == 1:
            raise RuntimeError(kernels.fused_error({None: kernels_error}))
        if self.world_size > 1:
            self._check_same_model(kernels_error)
            self._broadcast_parameters()
            L = self.local_world_size
            self.buckets = layout_buckets(self._params, [g for g in self.param_groups for _ in g["params"]],
                                          self.world_size, bucket_cap_mb)
            self._slices = [_Slice(b, self.local_rank, L) for b in self.buckets]
            self._sbufs = [RankBuffers(s, momentum_dtype) for s in self._slices]   # this rank's slice: momentum, grad, c, δ
            # whole bucket, padded: this rank's gradients, then η·Δ
            self._full = [torch.zeros(b.padded, dtype=b.dtype, device=b.device) for b in self.buckets]
            # the reduce-scatter's input: L rows of [slice of the gradients | header]
            self._sends = [torch.zeros(L, b.padded // L + self._header_len(b), dtype=b.dtype, device=b.device)
                           for b in self.buckets]
            self._scratch = Scratch()
            self._algorithms = [self._algorithm_for(s) for s in self._slices]
            self._wire = [WireState(up="narrow" if a.name == "pbit" else "runs") for a in self._algorithms]
            self._trainable = {id(p) for b in self.buckets for p in b.params}
            self._frozen = [p for p in self._params if not p.requires_grad]
            for b in self.buckets:
                for p in b.params:
                    self.state[p]["step"] = torch.tensor(0.0)
            self._inter = GroupTransport(self._node_group, self.comm_stats)
            self._local = GroupTransport(self._local_group, self.local_stats)
        self._ready = True

    @staticmethod
    def _header_len(b: Bucket) -> int:
        """Per slice of the reduce-scatter: has-gradient per parameter, bad-gradient count, digest bits."""
        return len(b.params) + 1 + _DIGEST_BITS

    @property
    def momentum_numel(self) -> int:
        """Momentum values held by this rank (its slices of its node's momentum)."""
        if self.world_size == 1:
            return sum(st["exp_avg"].numel() for st in self.state.values() if "exp_avg" in st)
        return sum(buf.momentum.numel() for buf in self._sbufs)

    def _algorithm_for(self, s: _Slice):
        if self.aggregate == "quantized":
            return make_algorithm("quantized", self.rule, self.quant_levels)
        k = len(self.buckets[s.index].params)
        name = choose_algorithm(s.padded, k, self.rule) if self.comm == "auto" else self.comm
        return make_algorithm(name, self.rule)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise RuntimeError("HierarchicalDistributedLion lays out its communication buffers at construction; "
                               "pass every parameter group to the constructor instead of add_param_group().")
        super().add_param_group(param_group)

    # -- construction ---------------------------------------------------------
    def _config(self) -> tuple:
        return (self.rule.vote, self.rule.ties, self.seed, self.comm, self.aggregate, self.quant_norm,
                self.quant_bits, str(self.momentum_sync), self.bucket_cap_mb, self.check_every, self.nonfinite,
                str(self.momentum_dtype))

    def _gather_everyone(self, obj) -> list:
        """``obj`` of every rank, in mesh order (node-major), identical on every rank: gathered
        inside the node, then the node's list across nodes (two small object all-gathers)."""
        node: list = [None] * self.local_world_size
        dist.all_gather_object(node, obj, group=self._local_group)
        nodes: list = [None] * self.num_nodes
        dist.all_gather_object(nodes, node, group=self._node_group)
        return [x for n in nodes for x in n]

    def _check_same_model(self, kernels_error: Optional[str] = None) -> None:
        """The model and the options, the same on every rank; with ``fused=True``, the native
        kernels loaded on every rank (``kernels_error``: why not here), or the same error on all."""
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad)) for p in self._params]
        everyone = self._gather_everyone((mine, self._config(), kernels_error))
        failed = {r: e for r, (_, _, e) in enumerate(everyone) if e is not None}
        if failed:
            raise RuntimeError(kernels.fused_error(failed))
        everyone = [(m, cfg) for m, cfg, _ in everyone]
        ref, ref_cfg = everyone[0]
        for r, (theirs, cfg) in enumerate(everyone[1:], start=1):
            if theirs != ref:
                i = next((i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b), min(len(ref), len(theirs)))
                raise ValueError(
                    f"HierarchicalDistributedLion: ranks disagree on the model at parameter {i}: rank {r} has "
                    f"{theirs[i] if i < len(theirs) else 'nothing'}, rank 0 has {ref[i] if i < len(ref) else 'nothing'} "
                    "(shape, dtype, requires_grad).")
            if cfg != ref_cfg:
                names = ("vote", "ties", "seed", "comm", "aggregate", "quant_norm", "quant_bits", "momentum_sync",
                         "bucket_cap_mb", "check_every", "nonfinite", "momentum_dtype")
                diff = [f"{n}={x!r} on rank {r}, {y!r} on rank 0" for n, x, y in zip(names, cfg, ref_cfg) if x != y]
                raise ValueError("HierarchicalDistributedLion: ranks disagree on the optimizer's options: "
                                 + "; ".join(diff))

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Every rank starts from rank (node 0, local 0)'s parameters: across nodes, then inside the node."""
        groups: dict = {}
        for p in self._params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        for ps in groups.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            for g in (self._node_group, self._local_group):
                if dist.get_world_size(g) > 1:
                    dist.broadcast(flat, src=dist.get_global_rank(g, 0), group=g)
            off = 0
            for p in ps:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def bucket_layout(self) -> list[Optional[tuple[int, int, int]]]:
        """(bucket index, offset, padded bucket length) of every parameter (None for frozen ones).
        Local rank j owns coordinates [j·S, (j+1)·S) of a bucket, S = padded/L; the tie coin of
        coordinate x is ``tie_coins(coin_key(seed, step, bucket·L + x // S), x % S)``."""
        where: dict = {}
        for b in self.buckets:
            for i, off in zip(b.indices, b.offsets):
                where[i] = (b.index, off, b.padded)
        return [where.get(i) for i in range(len(self._params))]

    @property
    def algorithm_names(self) -> list[str]:
        """The collective algorithm of each bucket slice among the nodes; empty with a single node."""
        return [a.name for a in self._algorithms]

    # -- the step ---------------------------------------------------------------
    _step_supports_amp_scaling = True

    @staticmethod
    def _digest(group: dict) -> int:
        b1, b2 = group["betas"]
        raw = struct.pack("<dddd?", float(group["lr"]), float(b1), float(b2), float(group["weight_decay"]),
                          bool(group["maximize"]))
        return zlib.crc32(raw) & 0x7FFFFFFF

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        if grad_scaler is not None:
            raise RuntimeError("HierarchicalDistributedLion does not support torch.amp.GradScaler; train in bf16 "
                               "autocast (no scaler) or use dlion.DistributedLion.")
        if self.world_size == 1:
            return self._local_step(closure)
        joined = self._announce()  # (Join: "still training", before this step's collectives)
        loss = self._evaluate(closure)
        self._check_frozen()
        step_no = self.step_count
        L = self.local_world_size
        # 1. inside the node: reduce-scatter of the gradients (+ headers), every bucket issued at once
        errors: list = []
        scatters = []
        for k, b in enumerate(self.buckets):
            error = self._fill_send(k)
            errors.append(error)
            if L == 1:
                scatters.append((_Done, self._sends[k].view(-1)))
            else:
                scatters.append(self._local.issue("reduce_scatter", self._sends[k].view(-1), "grad_reduce_scatter"))
        # 2. per bucket in order: the node's Lion direction on my slice, then the vote's first collective
        flights, presents = [], []
        for k, (work, recv) in enumerate(scatters):
            work.wait()
            contrib, present = self._contribute(k, recv, step_no, errors[k] is not None)
            presents.append(present)
            gen = self._algorithms[k].run(self._wire[k], contrib, self.node,
                                          coin_key(self.seed, step_no, k * L + self.local_rank))
            flights.append(Flight(gen, self._inter))
        # 3. across nodes: the later collectives of each vote, in slot order (dlion.pipeline)
        pipeline = Pipeline(len(flights), self._inter, self._inter)
        for f in flights:
            pipeline.add(f)
        pipeline.finish()
        # 4. inside the node: all-gather of every slice's codes and flags
        gathers = []
        for k, f in enumerate(flights):
            block = self._pack(k, f.outcome)
            gathers.append((_Done, block) if L == 1 else self._local.issue("all_gather", block, "codes_all_gather"))
        rows = []
        for k, (work, got) in enumerate(gathers):
            work.wait()
            rows.append(got.view(L, -1))
        self._finish(step_no, flights, rows, presents, errors)
        if joined is not None:
            joined.wait()
        return loss

    def _fill_send(self, k: int) -> Optional[Exception]:
        """This rank's reduce-scatter input for bucket k: per slice, its gradients (0 where it has
        none) followed by the header (has-gradient per parameter, bad-gradient flag, digest bits)."""
        b, send = self.buckets[k], self._sends[k]
        L, S = self.local_world_size, b.padded // self.local_world_size
        error = None
        for i, p in zip(b.indices, b.params):
            try:
                check_grad(i, p)
            except ValueError as e:
                error = error or e
        G = self._full[k]
        present = [p.grad is not None and error is None for p in b.params]
        views = b.views(G)
        if all(present):
            torch._foreach_copy_(views, [p.grad for p in b.params])
        else:
            for v, p, ok in zip(views, b.params, present):
                if ok:
                    v.copy_(p.grad)
                else:
                    v.zero_()
        send[:, :S].copy_(G.view(L, S))
        head = send[0, S:]
        kp = len(b.params)
        head[:kp] = torch.tensor(present, dtype=head.dtype)
        head[kp] = float(error is not None)
        digest = self._digest(b.group)
        head[kp + 1:] = torch.tensor([(digest >> i) & 1 for i in range(_DIGEST_BITS)], dtype=head.dtype)
        send[1:, S:] = head
        return error

    def _contribute(self, k: int, recv: Tensor, step: int, own_error: bool) -> tuple[Contribution, list[bool]]:
        """The node's Lion direction on this rank's slice of bucket k, from the reduced slice ``recv``."""
        b, s, sbuf = self.buckets[k], self._slices[k], self._sbufs[k]
        L, S, kp = self.local_world_size, s.padded, len(b.params)
        head = recv[S:].tolist()
        node_has = [h > 0 for h in head[:kp]]
        status = BAD if (head[kp] > 0 or own_error) else 0
        bits = head[kp + 1:]
        if all(x == 0 or x == L for x in bits):
            digest = sum(1 << i for i, x in enumerate(bits) if x == L) & 0x7FFFFFFE
        else:  # the ranks of this node disagree: a value no agreeing node can send, distinct per node
            digest = 2 * self.node + 1
        group = b.group
        present = [node_has[i] for i in s.owner]
        if status & BAD:
            sbuf.values.zero_()
            sbuf.packed = sbuf.zeros = None  # (no stale payload of an earlier step)
            present = [False] * len(present)
        else:
            mean = recv[:S]
            if L > 1:
                mean.div_(L)
            quant = (self.quant_levels, self.quant_norm) if self.aggregate == "quantized" else None
            grads = [v if ok else None for v, ok in zip(s.views(mean), present)]
            _, present, finite = contribute(s, sbuf, grads, self._scratch, beta1=group["betas"][0],
                                            maximize=group["maximize"], quant=quant, fused=self.fused)
            if not finite:
                status |= NONFINITE
        return Contribution(sbuf.values, s.numel, torch.tensor(node_has, dtype=torch.bool), status, digest,
                            packed=sbuf.packed, zeros=sbuf.zeros), present

    def _pack(self, k: int, o: Outcome) -> Tensor:
        """This slice's codes (int8; int16 beyond 127 nodes) and the vote's flags, for the all-gather."""
        S = self._slices[k].padded
        dtype = torch.int8 if self.num_nodes <= 127 else torch.int16
        flags = (_FLAG_BAD if o.bad else 0) | (_FLAG_NONFINITE if o.nonfinite else 0) | \
            (0 if o.digests_agree else _FLAG_DIGEST)
        out = torch.zeros(S + 1, dtype=dtype, device=self.buckets[k].device)
        if o.codes is not None:
            out[:S] = o.codes[:S]
        out[S] = flags
        return out

    def _count_step(self) -> None:
        self.step_count += 1
        self.comm_stats.steps += 1
        self.local_stats.steps += 1

    def _local_step(self, closure):
        """World size 1: exactly :class:`dlion.Lion`'s step, counted."""
        loss = Lion.step(self, closure)
        self._count_step()
        return loss

    def _finish(self, step_no: int, flights: list, rows: list, presents: list, errors: list) -> None:
        self.comm_stats.wait_s += sum(f.waited for f in flights)
        # the votes this rank decided (its chunk of its slice, for 1bit)
        self.comm_stats.add_tallies([f.outcome.tally for f in flights if f.outcome.tally is not None])
        flags = 0
        for r in rows:
            flags |= _or_all(r[:, -1])
        own = next((e for e in errors if e is not None), None)
        if own is not None:
            raise own
        if flags & _FLAG_BAD:
            raise RuntimeError("HierarchicalDistributedLion: another rank rejected its gradients (its error says "
                               "why); no rank changed any parameter or momentum.")
        if flags & _FLAG_DIGEST:
            raise ValueError(
                f"HierarchicalDistributedLion: ranks disagree on lr, betas, weight_decay or maximize at step "
                f"{step_no} (e.g. an LR scheduler stepped on one rank only); no rank changed anything.")
        if flags & _FLAG_NONFINITE:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"HierarchicalDistributedLion: a node has inf/NaN gradients at step "
                                         f"{step_no}; no rank changed anything.")
            self.skipped_steps += 1
            self._count_step()
            self._skips_in_a_row += 1
            if self._skips_in_a_row == self.warn_after_skips:
                warnings.warn(f"HierarchicalDistributedLion: {self._skips_in_a_row} steps in a row skipped because "
                              "some rank had inf/NaN gradients; training is not progressing.", RuntimeWarning,
                              stacklevel=3)
            return
        self._skips_in_a_row = 0
        for k, (b, f, r) in enumerate(zip(self.buckets, flights, rows)):
            self._apply(k, b, f.outcome, r, presents[k])
        self._count_step()
        if momentum_sync_due(self.momentum_sync, self.step_count):
            self.synchronize_momenta()
        if self.check_every and self.step_count % self.check_every == 0:
            self.check_replicas()

    def _apply(self, k: int, b: Bucket, o: Outcome, rows: Tensor, present: list[bool]) -> None:
        group = b.group
        active = o.has_grad.tolist()
        if any(active):
            update = self._full[k][:b.numel]
            update.copy_(rows[:, :-1].reshape(-1)[:b.numel])
            if self.rule.vote == "avg":
                update.div_(self.num_nodes)
            update.mul_(group["lr"])  # η·Δ, rounded once like torch.mul(Δ, η)
            views = b.views(update)
            ps = [p for p, a in zip(b.params, active) if a]
            us = [u for u, a in zip(views, active) if a]
            apply_scaled_delta(ps, us, group["lr"], group["weight_decay"])
            for p, a in zip(b.params, active):
                if a:
                    self.state[p]["step"] += 1
        if any(present):
            update_momentum(self._slices[k], self._sbufs[k], present, group["betas"][1], self._scratch,
                            fused=self.fused)

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.grad is not None and id(p) not in self._trainable:
                raise RuntimeError(
                    f"HierarchicalDistributedLion: a parameter of shape {tuple(p.shape)} has a gradient but had "
                    "requires_grad=False when the optimizer was built; build the optimizer after unfreezing it.")

    # -- Lion Cub extras ---------------------------------------------------------
    @torch.no_grad()
    def synchronize_momenta(self) -> None:
        """Average the node momenta across nodes in fp32: each rank all-reduces its slice over
        the nodes (L all-reduces in parallel, one per local rank)."""
        if self.world_size == 1 or self.num_nodes == 1:
            return
        average_momenta(self._sbufs, self._inter, self.num_nodes)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`dlion.DesyncError` unless every parameter is bitwise identical on all ranks."""
        if self.world_size == 1:
            return
        mine = checksum_table(self._params)
        work, node = self._local.issue("all_gather", mine, "check") if self.local_world_size > 1 else (_Done, mine)
        work.wait()
        work, everyone = self._inter.issue("all_gather", node, "check") if self.num_nodes > 1 else (_Done, node)
        work.wait()
        raise_if_diverged(everyone, self._params, self.world_size, "HierarchicalDistributedLion", self.step_count)

    # -- uneven inputs: torch.distributed.algorithms.Join ---------------------------
    def _announce(self):
        """Inside ``Join``: tell the context manager that this rank is still training (one all-reduce on
        the world group, issued before the step's collectives); None outside a Join context and in a
        shadow step."""
        return None if self._shadowing else Join.notify_join_context(self)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of data, once per step of the ranks still
        training: a step without gradients (:meth:`_shadow_step`). Needs a mesh of every rank of the job."""
        if self.mesh is not None and self.mesh.size() != dist.get_world_size():
            raise NotImplementedError(
                f"HierarchicalDistributedLion: torch.distributed.algorithms.Join needs a mesh of every rank of the job "
                f"(its own all-reduces run on the world group); this mesh has {self.mesh.size()} of "
                f"{dist.get_world_size()} ranks.")
        return _ShadowSteps(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD

    @torch.no_grad()
    def _shadow_step(self) -> None:
        """A step with no gradient on this rank: the same collectives as the other ranks' step, a zero
        in its node's mean (its node abstains where all of its ranks have finished), then the agreed Δ
        and this rank's slice of its node's momentum, as every step. Its own ``.grad`` are put back."""
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        self._shadowing = True
        try:
            self.step()
        finally:
            self._shadowing = False
            for p, g in zip(self._params, saved):
                p.grad = g

    # -- checkpointing ----------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["dlion"] = {"step_count": self.step_count, "comm_stats": self.comm_stats.state_dict(), "local_stats": self.local_stats.state_dict(),
                       "world_size": self.world_size, "rank": self.rank, "vote": self.rule.vote,
                       "ties": self.rule.ties, "seed": self.seed, "aggregate": self.aggregate,
                       "skipped_steps": self.skipped_steps, "wire": [(w.up, w.down) for w in self._wire],
                       "hierarchical": {
                           "nodes": self.num_nodes, "local_world_size": self.local_world_size, "node": self.node,
                           "local_rank": self.local_rank, "padded": [b.padded for b in self.buckets],
                           # this rank's slice of its node's momentum, per bucket
                           "momentum": [buf.momentum.clone() for buf in getattr(self, "_sbufs", [])]}}
        return sd

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ``ValueError`` if this rank cannot load ``state_dict`` (saved by a flat optimizer, or
        on another mesh or by another rank of it); :func:`dlion.checkpoint.load` calls this before it
        changes anything."""
        hier = (state_dict.get("dlion") or {}).get("hierarchical")
        if self.world_size > 1:
            if hier is None:
                raise ValueError(
                    "HierarchicalDistributedLion cannot load this state: it was saved by a flat optimizer "
                    "(dlion.DistributedLion or dlion.Lion), which keeps one momentum per rank; the hierarchical "
                    "optimizer keeps one momentum per node, sharded across the node's ranks. Resume with the "
                    "optimizer that saved it, or start the hierarchical optimizer's momenta afresh.")
            mine = (self.num_nodes, self.local_world_size, self.node, self.local_rank)
            theirs = (hier["nodes"], hier["local_world_size"], hier["node"], hier["local_rank"])
            if mine != theirs or list(hier["padded"]) != [b.padded for b in self.buckets]:
                raise ValueError(
                    f"HierarchicalDistributedLion: this state was saved on a {theirs[0]} × {theirs[1]} mesh by rank "
                    f"(node {theirs[2]}, local {theirs[3]}); this rank is (node {mine[2]}, local {mine[3]}) of a "
                    f"{mine[0]} × {mine[1]} mesh with {'the same' if mine[:2] == theirs[:2] else 'another'} layout. "
                    "Momentum shards cannot be re-cut: resume on the same mesh, each rank loading its own state.")

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_state_dict(state_dict)
        extra = state_dict.get("dlion")
        hier = (extra or {}).get("hierarchical")
        sd = dict(state_dict)
        sd.pop("dlion", None)
        super().load_state_dict(sd)
        rebind_groups([*self.buckets, *self._slices], self.param_groups)
        for b in self.buckets:
            for p in b.params:
                st = self.state[p]
                st["step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).clone()
        if hier is not None:
            for buf, m in zip(getattr(self, "_sbufs", []), hier["momentum"]):
                buf.momentum.copy_(m)
        if extra is not None:
            self.comm_stats.load_state_dict(extra["comm_stats"])
            self.step_count = int(extra.get("step_count", self.comm_stats.steps))
            if "local_stats" in extra:
                self.local_stats.load_state_dict(extra["local_stats"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            wire = extra.get("wire") or []
            if len(wire) == len(self._wire):
                for w, (up, down) in zip(self._wire, wire):
                    w.up, w.down = up, down


def _or_all(t: Tensor) -> int:
    out = 0
    for v in t.tolist():
        out |= int(v)
    return out
