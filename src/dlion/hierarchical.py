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
    across nodes (slow):     Δ     = rule(δ_1 … δ_n)           the vote of :mod:`dlion.wire` on slice j,
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
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook

from .base import BucketState, DistributedBase, momentum_sync_due
from .buckets import Bucket, Contributed, RankBuffers, Scratch, apply_scaled_delta, contribute, layout_buckets, \
    read_flags, rebind_groups, update_momentum
from .collectives import CommStats, GroupTransport
from .pipeline import Flight, Pipeline
from .replicas import average_momenta
from .vote import coin_key
from .wire import BAD, NONFINITE, Contribution, Outcome

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


@dataclass
class NodeBucket(BucketState):
    """A bucket of :class:`HierarchicalDistributedLion`: the shared record (``buffers`` and the
    algorithm are this rank's slice's), plus the slice, the whole padded bucket (this rank's
    gradients, then η·Δ) and the reduce-scatter's input (L rows of [slice of the gradients | header])."""

    slice: "_Slice" = None
    full: Tensor = None
    send: Tensor = None


class _Done:
    """A finished no-op collective (groups of one rank)."""

    @staticmethod
    def wait() -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


class HierarchicalDistributedLion(DistributedBase):
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
        if ties == "previous":
            raise ValueError("ties='previous' is implemented in DistributedLion (and SimulatedDistributedLion) only; "
                             "HierarchicalDistributedLion supports ties='zero' and 'random'.")
        super().__init__(params, lr, betas, weight_decay, vote=vote, ties=ties, comm=comm, aggregate=aggregate,
                         quant_norm=quant_norm, quant_bits=quant_bits, momentum_sync=momentum_sync,
                         bucket_cap_mb=bucket_cap_mb, seed=seed, check_every=check_every, nonfinite=nonfinite,
                         sign_hook=None, maximize=maximize, foreach=foreach, momentum_dtype=momentum_dtype,
                         fused=fused)
        self.fused = bool(fused)
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
        self._groups = [self._node_group, self._local_group]
        self.local_stats = CommStats()
        self._start(voters=self.num_nodes)
        if self.world_size > 1:
            L = self.local_world_size
            self.buckets = layout_buckets(self._params, [g for g in self.param_groups for _ in g["params"]],
                                          self.world_size, bucket_cap_mb)
            self._scratch = Scratch()
            for b in self.buckets:
                sl = _Slice(b, self.local_rank, L)
                algorithm = self._make_algorithm(sl.padded, len(b.params))
                self._slots.append(NodeBucket(
                    b, RankBuffers(sl, momentum_dtype), algorithm, self._new_wire(algorithm), slice=sl,
                    full=torch.zeros(b.padded, dtype=b.dtype, device=b.device),
                    send=torch.zeros(L, b.padded // L + self._header_len(b), dtype=b.dtype, device=b.device)))
                for p in b.params:
                    self.state[p]["step"] = torch.tensor(0.0)
            self._inter = GroupTransport(self._node_group, self.comm_stats)
            self._local = GroupTransport(self._local_group, self.local_stats)
        self._laid_out()

    @staticmethod
    def _header_len(b: Bucket) -> int:
        """Per slice of the reduce-scatter: has-gradient per parameter, bad-gradient count, digest bits."""
        return len(b.params) + 1 + _DIGEST_BITS

    @property
    def momentum_numel(self) -> int:
        """Momentum values held by this rank (its slices of its node's momentum)."""
        if self.world_size == 1:
            return sum(st["exp_avg"].numel() for st in self.state.values() if "exp_avg" in st)
        return sum(s.buffers.momentum.numel() for s in self._slots)

    _STATE_KIND = "hierarchical"

    def _accepts_kind(self, kind: str) -> bool:
        return kind == "hierarchical" or self.world_size == 1

    def _all_gather_rows(self, row: Tensor) -> Tensor:
        """Inside the node, then the node's rows across nodes (mesh order is rank order)."""
        work, node = self._local.issue("all_gather", row, "check") if self.local_world_size > 1 else (_Done, row)
        work.wait()
        work, everyone = self._inter.issue("all_gather", node, "check") if self.num_nodes > 1 else (_Done, node)
        work.wait()
        return everyone

    # -- the step ---------------------------------------------------------------
    _step_supports_amp_scaling = True

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
        scatters, own_heads = [], []
        for k, b in enumerate(self.buckets):
            error, head = self._fill_send(k)
            errors.append(error)
            own_heads.append(head)
            if L == 1:
                scatters.append((_Done, self._slots[k].send.view(-1)))
            else:
                scatters.append(self._local.issue("reduce_scatter", self._slots[k].send.view(-1), "grad_reduce_scatter"))
        # 2. the node's Lion direction on my slice of each bucket, then the vote's first collective. On the
        # CPU bucket by bucket, as each reduce-scatter arrives; off it, every reduce-scatter is waited for and
        # their headers are read in one copy, then every slice's finiteness flag and zero count in another
        flights, presents = [], []
        device = next((b.device for b in self.buckets if b.device.type != "cpu"), None)
        if device is None:
            for k, (work, recv) in enumerate(scatters):
                work.wait()
                local = self._contribute(k, recv, recv[self._slots[k].slice.padded:].tolist(), errors[k] is not None)
                presents.append(self._start_vote(k, local, step_no, flights))
        else:
            for work, _ in scatters:
                work.wait()
            recvs = [recv for _, recv in scatters]
            # (one rank per node: the reduced headers are this rank's own, known on the host)
            heads = own_heads if L == 1 else _read_together([recv[self._slots[k].slice.padded:]
                                                             for k, recv in enumerate(recvs)])
            locals_ = [self._contribute(k, recv, head, errors[k] is not None, defer=True)
                       for k, (recv, head) in enumerate(zip(recvs, heads))]
            read_flags([local.made for local in locals_ if local.made is not None])
            for k, local in enumerate(locals_):
                presents.append(self._start_vote(k, local, step_no, flights))
        # 3. across nodes: the later collectives of each vote, in slot order (dlion.pipeline); off the CPU the
        # headers of every bucket's vote are read in one copy per round (dlion.wire.read_heads)
        pipeline = Pipeline(len(flights), self._inter, self._inter, device=device)
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

    def _fill_send(self, k: int) -> tuple[Optional[Exception], list]:
        """This rank's reduce-scatter input for bucket k: per slice, its gradients (0 where it has
        none) followed by the header (has-gradient per parameter, bad-gradient flag, digest bits). Returns
        this rank's invalid gradient (or None) and the header's values, written from pinned memory off the CPU."""
        b, send = self.buckets[k], self._slots[k].send
        L, S = self.local_world_size, b.padded // self.local_world_size
        error = self._grad_error(b)
        G = self._slots[k].full
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
        digest = self._digest(b.group)
        values = [int(ok) for ok in present] + [int(error is not None)] + \
            [(digest >> i) & 1 for i in range(_DIGEST_BITS)]
        host = torch.tensor(values, dtype=head.dtype)
        if head.device.type != "cpu":  # from pinned memory, asynchronously (from pageable memory it would wait)
            head.copy_(host.pin_memory(), non_blocking=True)
        else:
            head.copy_(host)
        send[1:, S:] = head
        return error, values

    def _contribute(self, k: int, recv: Tensor, head: list, own_error: bool, defer: bool = False) -> "_NodeSlice":
        """The node's Lion direction on this rank's slice of bucket k, from the reduced slice ``recv`` and its
        header ``head`` read on the host. ``defer``: off the CPU, the finiteness flag and the zero count stay
        on the device for :func:`dlion.buckets.read_flags` (then :meth:`_start_vote`)."""
        b, s, sbuf = self.buckets[k], self._slots[k].slice, self._slots[k].buffers
        L, S, kp = self.local_world_size, s.padded, len(b.params)
        node_has = [h > 0 for h in head[:kp]]
        status = BAD if (head[kp] > 0 or own_error) else 0
        bits = head[kp + 1:]
        if all(x == 0 or x == L for x in bits):
            digest = sum(1 << i for i, x in enumerate(bits) if x == L) & 0x7FFFFFFE
        else:  # the ranks of this node disagree: a value no agreeing node can send, distinct per node
            digest = 2 * self.node + 1
        group = b.group
        present = [node_has[i] for i in s.owner]
        made = None
        if status & BAD:
            sbuf.values.zero_()
            present = [False] * len(present)
        else:
            mean = recv[:S]
            if L > 1:
                mean.div_(L)
            quant = (self.quant_levels, self.quant_norm) if self.aggregate == "quantized" else None
            grads = [v if ok else None for v, ok in zip(s.views(mean), present)]
            made = contribute(s, sbuf, grads, self._scratch, beta1=group["betas"][0], maximize=group["maximize"],
                              quant=quant, fused=self.fused, defer=defer)  # (the reduced slice: nothing borrowed)
            present = made.present
        return _NodeSlice(node_has, status, digest, present, made)

    def _start_vote(self, k: int, local: "_NodeSlice", step_no: int, flights: list) -> list[bool]:
        """Bucket k's vote across nodes from :meth:`_contribute`'s slice (its flags read): its first collective
        issued (a :class:`Flight` appended to ``flights``); which of the slice's pieces had a gradient."""
        status, made, packed, zeros = local.status, local.made, None, None
        if made is not None:
            packed, zeros = made.packed, made.zeros
            if not made.finite:
                status |= NONFINITE
        contrib = Contribution(self._slots[k].buffers.values, self._slots[k].slice.numel,
                               torch.tensor(local.node_has, dtype=torch.bool), status, local.digest,
                               packed=packed, zeros=zeros)
        gen = self._slots[k].algorithm.run(self._slots[k].wire, contrib, self.node,
                                           coin_key(self.seed, step_no, k * self.local_world_size + self.local_rank))
        flights.append(Flight(gen, self._inter))
        return local.present

    def _pack(self, k: int, o: Outcome) -> Tensor:
        """This slice's codes (int8; int16 beyond 127 nodes) and the vote's flags, for the all-gather."""
        S = self._slots[k].slice.padded
        dtype = torch.int8 if self.num_nodes <= 127 else torch.int16
        flags = _outcome_flags(o)
        out = torch.zeros(S + 1, dtype=dtype, device=self.buckets[k].device)
        if o.codes is not None:
            out[:S] = o.codes[:S]
        out[S] = flags
        return out

    def _count_step(self) -> None:
        super()._count_step()
        self.local_stats.steps += 1

    def _finish(self, step_no: int, flights: list, rows: list, presents: list, errors: list) -> None:
        self.comm_stats.wait_s += sum(f.waited for f in flights)
        # the votes this rank decided (its chunk of its slice, for 1bit)
        self.comm_stats.add_tallies([f.outcome.tally for f in flights if f.outcome.tally is not None])
        flags = 0
        if self.local_world_size == 1:  # (the rows are this rank's own: their flags are the outcomes')
            for f in flights:
                flags |= _outcome_flags(f.outcome)
        else:  # every slice's flags, every bucket's read in one copy
            for col in _read_together([r[:, -1] for r in rows]):
                for v in col:
                    flags |= int(v)
        if self._skips(step_no, own_error=next((e for e in errors if e is not None), None),
                       bad=bool(flags & _FLAG_BAD), digests_agree=not flags & _FLAG_DIGEST,
                       nonfinite=bool(flags & _FLAG_NONFINITE)):
            return
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
            update = self._slots[k].full[:b.numel]
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
            update_momentum(self._slots[k].slice, self._slots[k].buffers, present, group["betas"][1], self._scratch,
                            fused=self.fused)

    # -- Lion Cub extras ---------------------------------------------------------
    @torch.no_grad()
    def synchronize_momenta(self) -> None:
        """Average the node momenta across nodes in fp32: each rank all-reduces its slice over
        the nodes (L all-reduces in parallel, one per local rank)."""
        if self.world_size == 1 or self.num_nodes == 1:
            return
        average_momenta([s.buffers for s in self._slots], self._inter, self.num_nodes)

    # -- uneven inputs: torch.distributed.algorithms.Join ---------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of data, once per step of the ranks still
        training: a step without gradients (:meth:`_shadow_step`). Needs a mesh of every rank of the job."""
        if self.mesh is not None and self.mesh.size() != dist.get_world_size():
            raise NotImplementedError(
                f"HierarchicalDistributedLion: torch.distributed.algorithms.Join needs a mesh of every rank of the job "
                f"(its own all-reduces run on the world group); this mesh has {self.mesh.size()} of "
                f"{dist.get_world_size()} ranks.")
        return super().join_hook(**kwargs)

    @property
    def join_process_group(self):
        return dist.group.WORLD

    # -- checkpointing ----------------------------------------------------------
    def _record(self) -> dict:
        return {**super()._record(), "local_stats": self.local_stats.state_dict(),
                "hierarchical": {
                    "nodes": self.num_nodes, "local_world_size": self.local_world_size, "node": self.node,
                    "local_rank": self.local_rank, "padded": [b.padded for b in self.buckets],
                    # this rank's slice of its node's momentum, per bucket
                    "momentum": [s.buffers.momentum.clone() for s in self._slots]}}

    def _check_position(self, extra: dict, from_rank: str) -> None:
        """The state of this very position of the mesh, on the same mesh and layout (``from_rank`` does not
        apply: momentum shards cannot be re-cut or moved between positions)."""
        if self.world_size == 1:
            return
        hier = extra["hierarchical"]
        mine = (self.num_nodes, self.local_world_size, self.node, self.local_rank)
        theirs = (hier["nodes"], hier["local_world_size"], hier["node"], hier["local_rank"])
        if mine != theirs or list(hier["padded"]) != [b.padded for b in self.buckets]:
            raise ValueError(
                f"HierarchicalDistributedLion: this state was saved on a {theirs[0]} × {theirs[1]} mesh by rank "
                f"(node {theirs[2]}, local {theirs[3]}); this rank is (node {mine[2]}, local {mine[3]}) of a "
                f"{mine[0]} × {mine[1]} mesh with {'the same' if mine[:2] == theirs[:2] else 'another'} layout. "
                "Momentum shards cannot be re-cut: resume on the same mesh, each rank loading its own state.")

    def load_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        self.check_state_dict(state_dict, from_rank=from_rank)
        extra = state_dict.get("dlion")
        hier = (extra or {}).get("hierarchical")
        sd = dict(state_dict)
        sd.pop("dlion", None)
        super().load_state_dict(sd)
        rebind_groups([*self.buckets, *(s.slice for s in self._slots)], self.param_groups)
        for b in self.buckets:
            for p in b.params:
                st = self.state[p]
                st["step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).clone()
        if hier is not None:
            for s, m in zip(self._slots, hier["momentum"]):
                s.buffers.momentum.copy_(m)
        if extra is not None:
            self._load_record(extra)
            if "local_stats" in extra:
                self.local_stats.load_state_dict(extra["local_stats"])


@dataclass
class _NodeSlice:
    """What :meth:`HierarchicalDistributedLion._contribute` made of one bucket's reduced slice: per parameter
    of the bucket, had any rank of the node a gradient; the status and digest for the vote; per piece of
    the slice, does it take part; and the contribution (None when the node rejected its gradients)."""

    node_has: list
    status: int
    digest: int
    present: list
    made: Optional[Contributed]


def _outcome_flags(o: Outcome) -> int:
    return (_FLAG_BAD if o.bad else 0) | (_FLAG_NONFINITE if o.nonfinite else 0) | \
        (0 if o.digests_agree else _FLAG_DIGEST)


def _read_together(parts: list) -> list[list]:
    """Small 1-D tensors (headers, flags) as lists of numbers on the host, read with one copy per device
    (one host synchronisation each, not one per tensor). Their values are integers (flags, sums of a few
    ranks' 0/1), read as such."""
    out: list = [None] * len(parts)
    by_device: dict = {}
    for i, t in enumerate(parts):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([parts[i].reshape(-1).to(torch.int64) for i in idx]).tolist()
        at = 0
        for i in idx:
            n = parts[i].numel()
            out[i], at = flat[at:at + n], at + n
    return out
