"""Buckets: trainable parameters laid end to end in flat buffers, and the Lion math on them.

A bucket is a run of parameters of one parameter group, device and dtype, in
reverse registration order (gradients arrive roughly that way, like DDP). Its
layout is fixed at construction. Per rank it owns flat buffers: the momentum
(the optimizer's ``exp_avg`` state tensors are views into it), a gradient
buffer, the int8 contribution and the update Δ, so the Lion math of a step is a
handful of tensor operations per bucket whatever the number of parameters.

Frozen parameters (``requires_grad=False``) are in no bucket: they never travel,
have no momentum and do not count in ``num_params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import kernels
from .codec import SignCodec, padded_length
from .quantize import quantize

_SIGN = SignCodec()

__all__ = ["Bucket", "LeftOut", "layout_buckets", "work_dtype"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Momentum and update dtype: fp32 for bf16/fp16 parameters, else the parameter's."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


class Bucket:
    """Parameters ``params`` (global indices ``indices``) of one group laid end to end,
    padded to a multiple of ALIGN·N so that every rank's chunk encodes on its own."""

    def __init__(self, index: int, params: list[Tensor], indices: list[int], group: dict, world: int):
        self.index = index
        self.params = params
        self.indices = indices
        self.group = group
        self.sizes = [p.numel() for p in params]
        self.offsets, off = [], 0
        for n in self.sizes:
            self.offsets.append(off)
            off += n
        self.numel = off
        self.padded = padded_length(off, world)
        self.device = params[0].device
        self.dtype = work_dtype(params[0].dtype)
        self.low_precision = params[0].dtype in _LOW_PRECISION

    def flat(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        return torch.zeros(self.numel, dtype=dtype or self.dtype, device=self.device)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views (parameter shapes) of a flat buffer of this bucket."""
        return [flat[o:o + n].view(p.shape) for p, o, n in zip(self.params, self.offsets, self.sizes)]

    def ranges(self, mask: list[bool]) -> list[tuple[int, int]]:
        """Contiguous [start, end) coordinate ranges of the parameters where ``mask`` is True."""
        out: list[tuple[int, int]] = []
        for j, keep in enumerate(mask):
            if not keep:
                continue
            lo, hi = self.offsets[j], self.offsets[j] + self.sizes[j]
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        return out


class LeftOut:
    """The parameters of a bucket that the next step leaves out of the payload: those no rank
    had a gradient for in the last step (identical on every rank, since it follows the agreed
    has-gradient bitmaps), and the coordinate ranges of the others, for
    :func:`dlion.wire.run_compacted`."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.skip = torch.zeros(len(bucket.params), dtype=torch.bool)
        self.kept = [(0, bucket.numel)]

    def update(self, has_grad: Tensor) -> None:
        """After a step: ``has_grad`` says which parameters some rank had a gradient for."""
        if not torch.equal(~has_grad, self.skip):
            self.skip, self.kept = ~has_grad, self.bucket.ranges(has_grad.tolist())


def bucket_caps(cap_mb) -> list:
    """``bucket_cap_mb`` as a list of caps: a number is a list of one."""
    return list(cap_mb) if isinstance(cap_mb, (list, tuple)) else [cap_mb]


def layout_buckets(params: list[Tensor], groups: list[dict], world: int, cap_mb, *,
                   trainable_only: bool = True) -> list[Bucket]:
    """Buckets of the ``params`` (``groups[i]`` is param i's group; only those with
    ``requires_grad`` unless ``trainable_only=False``), in reverse order, split by
    (group, device, dtype); ``cap_mb`` counts fp32 coordinates like DDP. A sequence of caps
    (like DDP's ``bucket_cap_mb_list``) gives the caps of the first, second, … bucket of each
    (group, device, dtype), its last entry repeating: ``[1, 6]`` is a small first bucket, so that
    the first collective leaves early in backward (DDP's ``first_bucket_bytes_cap``)."""
    caps = [max(1, int(c * 2**20 / 4)) for c in bucket_caps(cap_mb)]
    buckets: list[Bucket] = []
    pending: dict = {}
    closed: dict = {}
    for i in reversed(range(len(params))):
        p = params[i]
        if trainable_only and not p.requires_grad:
            continue
        key = (id(groups[i]), p.device, p.dtype)
        ps, idx = pending.setdefault(key, ([], []))
        cap = caps[min(closed.get(key, 0), len(caps) - 1)]
        if ps and sum(q.numel() for q in ps) + p.numel() > cap:
            buckets.append(Bucket(len(buckets), ps, idx, groups[i], world))
            closed[key] = closed.get(key, 0) + 1
            ps, idx = pending[key] = ([], [])
        ps.append(p)
        idx.append(i)
    for (gid, _, _), (ps, idx) in pending.items():
        if ps:
            buckets.append(Bucket(len(buckets), ps, idx, groups[idx[0]], world))
    return buckets


def rebind_groups(buckets, param_groups: list) -> None:
    """Point every bucket (or slice of one) at the dict of ``param_groups`` that now holds its
    parameters. ``load_state_dict`` replaces every group dict; without this, lr or weight decay
    set afterwards (by a scheduler) would never be read."""
    groups = [g for g in param_groups for _ in g["params"]]
    for b in buckets:
        b.group = groups[b.indices[0]]


class RankBuffers:
    """One rank's flat buffers for one bucket (the simulator keeps N of these): momentum,
    gradient, the int8 contribution and ``work`` (c while contributing, Δ while applying)."""

    def __init__(self, b: Bucket, momentum_dtype: Optional[torch.dtype] = None):
        self.momentum = b.flat(momentum_dtype)  # (a narrower dtype is only storage: the math runs in b.dtype)
        self.grad = b.flat()
        self.work = b.flat()
        self.values = torch.zeros(b.padded, dtype=torch.int8, device=b.device)
        self.grad_views = b.views(self.grad)
        self.momentum_views = b.views(self.momentum)
        self.work_views = b.views(self.work)
        #: ``ties="previous"``: the codes of the last applied step (int8, the padded bucket), else None
        self.last_vote: Optional[Tensor] = None
        self.last_vote_views: list[Tensor] = []

    def keep_last_vote(self, b: Bucket) -> None:
        self.last_vote = torch.zeros(b.padded, dtype=torch.int8, device=b.device)
        self.last_vote_views = b.views(self.last_vote)


@dataclass
class Contributed:
    """What :func:`contribute` produced for one bucket on this rank."""

    #: the int8 values (``buf.values``: δ, or Lion Cub's q), 0 for parameters without a gradient
    values: Tensor
    #: per parameter: had this rank a gradient for it
    present: list
    #: were all of c's values finite (off the CPU with ``defer=True``: a 0-d bool tensor there until
    #: :func:`read_flags`)
    finite: bool
    #: ``fused=True`` (or signs off the CPU): the 1-bit payload (packed bits of values > 0) and how many
    #: values are 0 (off the CPU with ``defer=True``: a 0-d tensor there until :func:`read_flags`),
    #: computed in the same pass as the signs; None otherwise
    packed: Optional[Tensor] = None
    zeros: Optional[int] = None
    #: ``borrow=True``: the gradients read in place and the sign given them, for :func:`update_momentum`
    #: (hold it only until then: it keeps the gradients alive); None when they were copied into ``buf.grad``
    borrowed: Optional[tuple] = None


class Scratch:
    """Temporaries shared by every bucket (one per device and dtype, as long as the largest
    bucket): the step's elementwise products are written here instead of new allocations."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = self._bufs[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buf[:like.numel()].view_as(like)


def contribute(b: Bucket, buf: RankBuffers, grads: list[Optional[Tensor]], scratch: Scratch, *, beta1: float,
               maximize: bool, quant: Optional[tuple[int, str]] = None,
               borrow: bool = False, fused: bool = False, defer: bool = False) -> Contributed:
    """This rank's int8 contribution for bucket ``b`` from its gradients (None = no gradient):
    c = β1·m + (1 − β1)·g per coordinate; δ = sign(c) (or q = quantize(c) per parameter with
    ``quant = (levels, norm)``); coordinates of parameters without a gradient abstain (0).
    Returns a :class:`Contributed`. Momentum is left untouched.

    ``borrow=True`` promises that ``grads`` stay as they are until :func:`update_momentum`:
    (1 − β1)·g is then written straight from them (``Contributed.borrowed`` hands them to
    :func:`update_momentum`), one pass over the bucket fewer than copying them into ``buf.grad`` first (the same roundings: a product rounded once either way, and
    negation for ``maximize`` is exact). Low-precision gradients (cast to fp32 on the copy) and
    buckets of many tiny parameters (a per-parameter operation would cost more) copy anyway.

    ``fused=True`` (:func:`fused_applies`): c, its sign and the finiteness check are one native
    loop over the whole bucket (:mod:`dlion.kernels`), the same roundings, reading the
    gradients where they are under the same ``borrow`` rules (copied into ``buf.grad`` first
    otherwise), and the 1-bit payload is packed in the same pass (``packed``, ``zeros``).

    Off the CPU the finiteness flag and the zero count are computed on the device; they are read
    on the host here (one synchronisation), or with ``defer=True`` left there for
    :func:`read_flags` to read those of many contributions at once."""
    present = [g is not None for g in grads]
    values = buf.values
    packed = zeros = borrowed = None
    if not any(present):
        values.zero_()
        return Contributed(values, present, True)
    partial = not all(present)
    out = values[:b.numel]
    if fused and quant is None and fused_applies(buf):
        if borrow and _borrowable(b, grads) and all(g is None or g.is_contiguous() for g in grads):
            js = [j for j, ok in enumerate(present) if ok]
            sign = -1.0 if maximize else 1.0  # (negating the product instead of g: exact either way)
            ms, gs, offs = [buf.momentum_views[j] for j in js], [grads[j] for j in js], [b.offsets[j] for j in js]
            borrowed = (grads, sign)
        else:
            _copy_grads(buf, grads, present)
            if maximize:
                buf.grad.neg_()  # exact; what update_momentum reads, as on the eager path
            sign, spans = 1.0, b.ranges(present)
            ms, gs, offs = [buf.momentum[lo:hi] for lo, hi in spans], [buf.grad[lo:hi] for lo, hi in spans], \
                [lo for lo, _ in spans]
        # the signs, 0 for parameters without a gradient and the padding, and the 1-bit payload
        finite, packed, zeros = kernels.sign_and_pack(ms, gs, offs, beta1, sign * (1.0 - beta1), values, b.numel)
    else:
        finite, borrowed = _eager_contribution(b, buf, grads, present, scratch, beta1, maximize, quant, borrow, out)
    if partial:
        for j, ok in enumerate(present):
            if not ok:
                out[b.offsets[j]:b.offsets[j] + b.sizes[j]].zero_()
    if isinstance(finite, Tensor):  # (off the CPU) the flag, and with signs the payload and the zero count, which
        # the 1-bit header needs (OneBit.run takes it with the payload instead of its own check for zeros)
        if quant is None:
            packed, zeros = _SIGN.encode(values), b.numel - torch.count_nonzero(out)
        made = Contributed(values, present, finite, packed, zeros, borrowed)
        if not defer:
            read_flags([made])
        return made
    return Contributed(values, present, bool(finite), packed, zeros, borrowed)


def read_flags(made: list) -> None:
    """The finiteness flags and zero counts that :func:`contribute` left on a device (``defer=True``),
    read on the host for all of ``made`` together: one synchronisation per device, not one per bucket."""
    by_device: dict = {}
    for m in made:
        if isinstance(m.finite, Tensor):
            by_device.setdefault(m.finite.device, []).append(m)
    for ms in by_device.values():
        parts = []
        for m in ms:
            parts.append(m.finite.to(torch.int64).view(1))
            if isinstance(m.zeros, Tensor):
                parts.append(m.zeros.to(torch.int64).view(1))
        read = iter(torch.cat(parts).tolist())
        for m in ms:
            m.finite = bool(next(read))
            if isinstance(m.zeros, Tensor):
                m.zeros = next(read)


def _eager_contribution(b: Bucket, buf: RankBuffers, grads: list[Optional[Tensor]], present: list[bool],
                        scratch: Scratch, beta1: float, maximize: bool, quant: Optional[tuple[int, str]],
                        borrow: bool, out: Tensor) -> tuple:
    """:func:`contribute`'s c and its sign (or quantisation) into ``out`` as tensor operations;
    (whether every c is finite, the borrowed gradients and their sign or None)."""
    borrowed = None
    sign = -1.0 if maximize else 1.0
    # c = β1·m + (1 − β1)·g, each product rounded on its own (the literal rule), without allocations
    if buf.momentum.dtype == buf.work.dtype:
        c = torch.mul(buf.momentum, beta1, out=buf.work)
    else:  # momentum stored narrower (momentum_dtype): widen it first, so the math is the fp32 rule
        c = buf.work.copy_(buf.momentum).mul_(beta1)
    scaled = scratch.get(c)
    if borrow and _borrowable(b, grads):
        _scaled_grads(b, grads, sign * (1.0 - beta1), scaled)
        borrowed = (grads, sign)
    else:
        _copy_grads(buf, grads, present)
        if maximize:
            buf.grad.neg_()
        torch.mul(buf.grad, 1.0 - beta1, out=scaled)
    c.add_(scaled)
    # off the CPU: the flag stays on the device, for contribute (or read_flags) to read with the zero count
    finite = finite_flag(c) if c.device.type != "cpu" else all_finite(c)
    if quant is None:
        out.copy_(torch.sign(c, out=scaled))  # sign(0) = 0: an abstention
    else:
        levels, norm = quant
        for j, (o, n) in enumerate(zip(b.offsets, b.sizes)):
            if present[j]:
                out[o:o + n].copy_(quantize(c[o:o + n], levels, norm))
    return finite, borrowed


def fused_applies(buf: RankBuffers) -> bool:
    """Whether ``fused=True`` takes the native path for this bucket: CPU, fp32/fp64, the
    momentum stored in the work dtype."""
    return kernels.supported(buf.momentum, buf.grad)


def _copy_grads(buf: RankBuffers, grads: list[Optional[Tensor]], present: list[bool]) -> None:
    """``buf.grad`` ← the gradients (0 where None), cast to the work dtype."""
    dst = [v for v, ok in zip(buf.grad_views, present) if ok]
    torch._foreach_copy_(dst, [g for g in grads if g is not None])  # casts bf16/fp16 gradients to fp32
    if not all(present):
        for j, ok in enumerate(present):
            if not ok:
                buf.grad_views[j].zero_()


def _borrowable(b: Bucket, grads: list[Optional[Tensor]]) -> bool:
    return b.numel >= 256 * len(grads) and all(g is None or g.dtype == b.dtype for g in grads)


def _scaled_grads(b: Bucket, grads: list[Optional[Tensor]], factor: float, out: Tensor) -> None:
    """out ← factor·g per parameter, read from the gradients where they are (0 where None)."""
    for g, o, n in zip(grads, b.offsets, b.sizes):
        dst = out[o:o + n]
        if g is None:
            dst.zero_()
        else:
            torch.mul(g, factor, out=dst.view(g.shape))


def update_momentum(b: Bucket, buf: RankBuffers, present: list[bool], beta2: float, scratch: Scratch, *,
                    fused: bool = False, borrowed: Optional[tuple] = None) -> None:
    """m ← β2·m + (1 − β2)·g on the coordinates of parameters this rank had gradients for, g as the
    last :func:`contribute` read it (``borrowed``: its ``Contributed.borrowed``; else ``buf.grad``). A momentum stored narrower than the work
    dtype is updated in the work dtype (in ``buf.work``, free once Δ is applied) and rounded once,
    to nearest, on the way back. ``fused=True``: one native loop over the bucket (the same roundings)."""
    spans = [(0, b.numel)] if all(present) else b.ranges(present)
    if fused and fused_applies(buf):
        if borrowed is not None:
            grads, sign = borrowed
            js = [j for j, ok in enumerate(present) if ok and grads[j] is not None]
            kernels.momentum_update_([buf.momentum_views[j] for j in js], [grads[j] for j in js], beta2,
                                     sign * (1.0 - beta2))
        else:
            kernels.momentum_update_([buf.momentum[lo:hi] for lo, hi in spans], [buf.grad[lo:hi] for lo, hi in spans],
                                     beta2, 1.0 - beta2)
        return
    narrow = buf.momentum.dtype != buf.work.dtype
    scaled = scratch.get(buf.work)
    if borrowed is not None:
        grads, sign = borrowed
        _scaled_grads(b, grads, sign * (1.0 - beta2), scaled)
    else:
        for lo, hi in spans:
            torch.mul(buf.grad[lo:hi], 1.0 - beta2, out=scaled[lo:hi])
    for lo, hi in spans:
        m = buf.momentum[lo:hi]
        w = buf.work[lo:hi].copy_(m) if narrow else m
        w.mul_(beta2).add_(scaled[lo:hi])
        if narrow:
            m.copy_(w)


def scale_codes(codes: Tensor, out: Tensor, lr: float, divisor: int = 1) -> Tensor:
    """η·Δ into ``out`` from the vote's integer codes: Δ = codes (MaVo) or codes / N (Avg,
    ``divisor`` = N), each step rounded once like ``torch.mul(Δ, η)``; the codes widen inside
    the op, with no copy to the work dtype first (where the op computes in ``out``'s dtype: integer
    codes and a Python float promote to the default dtype, so e.g. fp64 copies first)."""
    if torch.result_type(codes, lr) != out.dtype:
        out.copy_(codes)
        return (out.div_(divisor) if divisor != 1 else out).mul_(lr)
    if divisor != 1:
        return torch.div(codes, divisor, out=out).mul_(lr)
    return torch.mul(codes, lr, out=out)


def apply_scaled_delta(params: list[Tensor], scaled: list[Tensor], lr: float, weight_decay: float) -> None:
    """x ← x·(1 − η·λ); x ← x − (η·Δ) for parameters kept as separate tensors (their storage is
    the user's: checkpoints and safetensors see ordinary parameters), given η·Δ per parameter:
    two multi-tensor operations, the same two roundings as :func:`dlion.lion.apply_update`."""
    low = [p for p in params if p.dtype in _LOW_PRECISION]
    if low:  # in fp32, rounded once to the parameter's dtype
        for p, u in zip(params, scaled):
            w = p.float() if p.dtype in _LOW_PRECISION else p
            if weight_decay != 0.0:
                w.mul_(1.0 - lr * weight_decay)
            w.sub_(u)
            if w is not p:
                p.copy_(w)
        return
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_sub_(params, scaled)


def apply_codes(b: Bucket, codes: Tensor, active: list[bool], work: Tensor, work_views: list[Tensor], lr: float,
                weight_decay: float, divisor: int = 1, fused: bool = False) -> None:
    """x ← x·(1 − η·λ) − η·Δ for the parameters of ``b`` marked ``active``, Δ = codes / ``divisor``.

    MaVo codes are −1, 0 or +1, so η·Δ is exact in any float dtype and x − η·Δ is rounded once
    whether η·Δ is written out first or not: fp32/fp64 parameters are then updated straight from
    the integer codes (``_foreach_add_`` with alpha = −η), one pass over the bucket fewer than
    through ``work``. Averages (``divisor`` > 1) and bf16/fp16 parameters go through ``work``
    (:func:`scale_codes`, :func:`apply_scaled_delta`): the same roundings either way. Buckets of
    many tiny parameters keep the ``work`` path too (per-step views would cost more than the pass).
    ``fused=True`` (CPU, fp32/fp64, contiguous parameters): both roundings in one native loop over the
    bucket (:func:`dlion.kernels.apply_codes_`)."""
    codes = codes[:b.numel]
    every = all(active)
    if divisor == 1 and not b.low_precision and not codes.is_floating_point() and b.numel >= 256 * len(b.params):
        ps = b.params if every else [p for p, a in zip(b.params, active) if a]
        us = [codes[o:o + n].view(p.shape) for p, o, n, a in zip(b.params, b.offsets, b.sizes, active) if a]
        if (fused and ps and codes.dtype == torch.int8 and kernels.supported(*ps)
                and all(p.is_contiguous() for p in ps)):
            kernels.apply_codes_([p.detach() for p in ps], us, lr, weight_decay)
            return
        if weight_decay != 0.0:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
        torch._foreach_add_(ps, us, alpha=-lr)
        return
    scale_codes(codes, work, lr, divisor)
    if every:
        ps, us = b.params, work_views
    else:
        ps = [p for p, a in zip(b.params, active) if a]
        us = [u for u, a in zip(work_views, active) if a]
    apply_scaled_delta(ps, us, lr, weight_decay)


def apply_signs(b: Bucket, signs: Tensor, active: list[bool], lr: float, weight_decay: float) -> bool:
    """:func:`apply_codes` (``fused=True``) of 1-bit codes straight from their packed bits (1 = +1),
    without decoding them: x ← x·(1 − η·λ) − η·Δ for the ``active`` parameters, the same values.
    False (nothing done) where the native path does not apply (low precision, strided or non-CPU
    parameters, a library that cannot be built): the caller then decodes and applies the codes."""
    ps = [p for p, a in zip(b.params, active) if a]
    if (not ps or b.low_precision or not kernels.supported(*ps) or not all(p.is_contiguous() for p in ps)
            or not kernels.available()):
        return False
    kernels.apply_signs_([p.detach() for p in ps], [o for o, a in zip(b.offsets, active) if a], signs, lr,
                         weight_decay)
    return True


def all_finite(c: Tensor) -> bool:
    """One min/max reduction (NaN propagates, ±inf shows at an end): much cheaper than isfinite().all()."""
    return bool(finite_flag(c))


def finite_flag(c: Tensor) -> Tensor:
    """:func:`all_finite` as a 0-d bool tensor on ``c``'s device (no host synchronisation)."""
    if not c.numel():
        return torch.ones((), dtype=torch.bool, device=c.device)
    return torch.isfinite(torch.stack(torch.aminmax(c.reshape(-1)))).all()


__all__ += ["RankBuffers", "Contributed", "Scratch", "contribute", "read_flags", "fused_applies", "update_momentum",
            "scale_codes", "finite_flag", "all_finite", "apply_scaled_delta", "apply_codes", "apply_signs"]
