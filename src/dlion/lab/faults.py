"""Fault injection for :class:`dlion.DistributedLion`: Byzantine sign hooks.

Each factory returns a ``sign_hook(step, delta) -> delta`` for
``DistributedLion(..., sign_hook=...)``. The optimizer calls it on this rank's
local int8 signs δ ∈ {−1, 0, +1} of one bucket just before they are sent; what
it returns is what the other ranks see. Give a hook to the faulty ranks only::

    hook = faults.sign_flip() if rank in faulty else None
    opt = DistributedLion(model.named_parameters(), lr=1e-3, vote="mavo", sign_hook=hook)

* :func:`sign_flip` — sends −δ: the strongest non-colluding attack on a vote
  (signSGD with majority vote tolerates it while fewer than half the workers
  flip: "signSGD with Majority Vote is Communication Efficient and Fault
  Tolerant", Bernstein et al. 2019, arXiv 1810.05291).
* :func:`random_signs` — sends uniform random ±1 (a worker whose gradients are garbage).
* :func:`stuck_at_zero` — sends 0 everywhere: the worker abstains (a dead
  sensor, or a worker with no data); under the zero policy it simply does not vote.

``start`` delays the fault until that optimizer step (0-based). The faulty
rank's own parameters still follow the aggregated Δ, so replicas stay identical.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["sign_flip", "random_signs", "stuck_at_zero", "honest", "SignHook", "FAULTS", "make"]

SignHook = Callable[[int, Tensor], Tensor]


def _check_start(start: int) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")


def honest() -> SignHook:
    """The identity hook (sends δ unchanged); useful as a control."""
    return lambda step, delta: delta


def sign_flip(start: int = 0) -> SignHook:
    """Send −δ from optimizer step ``start`` on (abstentions stay 0)."""
    _check_start(start)

    def hook(step: int, delta: Tensor) -> Tensor:
        return delta if step < start else torch.neg(delta)

    return hook


def random_signs(seed: int = 0, start: int = 0) -> SignHook:
    """Send uniform random ±1 for every coordinate from step ``start`` on.

    The signs are a function of (``seed``, step, bucket call within the step), so a
    rerun injects the same faults; give each faulty rank its own seed."""
    _check_start(start)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    calls = {"step": None, "n": 0}

    def hook(step: int, delta: Tensor) -> Tensor:
        if step < start:
            return delta
        if calls["step"] != step:
            calls["step"], calls["n"] = step, 0
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + calls["n"])
        calls["n"] += 1
        bits = torch.randint(0, 2, delta.shape, generator=g, dtype=torch.int8)
        return bits.mul_(2).sub_(1).to(delta.device)

    return hook


def stuck_at_zero(start: int = 0) -> SignHook:
    """Send zeros (abstain on every coordinate) from step ``start`` on."""
    _check_start(start)

    def hook(step: int, delta: Tensor) -> Tensor:
        return delta if step < start else torch.zeros_like(delta)

    return hook


FAULTS = {"honest": honest, "sign_flip": sign_flip, "random_signs": random_signs, "stuck_at_zero": stuck_at_zero}


def make(name: str, **kwargs) -> SignHook:
    """A hook by name (``"sign_flip"``, ``"random_signs"``, ``"stuck_at_zero"``, ``"honest"``)."""
    if name not in FAULTS:
        raise ValueError(f"Unknown fault {name!r}; choose one of {', '.join(map(repr, FAULTS))}.")
    return FAULTS[name](**kwargs)
