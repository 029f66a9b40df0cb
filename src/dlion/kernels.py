"""Fused CPU kernels for the elementwise passes of a Lion step (``fused=True``).

The literal rule rounds every product on its own (no fused multiply-add), which in
eager PyTorch costs one pass over memory per operation: c = β1·m + (1 − β1)·g
followed by its sign and a finiteness check is five to six passes, the momentum
update three. Here each is one loop, generated and compiled by ``torch.compile``
(TorchInductor's C++ backend), which compiles with ``-ffp-contract=off``: every
product and sum is still rounded once, in the same order, so the values are those
of the eager ops (the tests compare them value for value on inputs with infinities,
NaN, subnormals and zeros of both signs, whose signs they check too).

Hyperparameters enter as 0-d tensors of the work dtype, built from the Python floats
exactly as eager PyTorch rounds a scalar operand (to the tensor's dtype, to nearest):
a learning-rate schedule then changes inputs, not code, and never recompiles.

CPU only. On CUDA the same passes are a small part of a step, and Triton contracts
``a·b + c`` into a fused multiply-add, which would change the roundings. The first
call compiles (a few seconds; a C++ compiler is needed); later processes reuse
Inductor's on-disk cache.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["supported", "sign_contribution", "momentum_update_", "lion_update_", "NONFINITE"]

_DTYPES = (torch.float32, torch.float64)


def supported(*tensors: Tensor) -> bool:
    """Whether the fused kernels apply: CPU tensors of one dtype, fp32 or fp64."""
    t0 = tensors[0]
    return t0.device.type == "cpu" and t0.dtype in _DTYPES and all(
        t.device == t0.device and t.dtype == t0.dtype for t in tensors)


def _scalar(x: float, like: Tensor) -> Tensor:
    return torch.tensor(x, dtype=like.dtype, device=like.device)


#: What :func:`sign_contribution` writes where c is inf or NaN (never a sign): one loop over m and g
#: then does it all, where returning min/max of c as well made Inductor read them in a second loop.
NONFINITE = 2


def _sign_contribution(m: Tensor, g: Tensor, b1: Tensor, omb1: Tensor, out: Tensor) -> None:
    c = m * b1 + g * omb1
    out.copy_(torch.where(torch.isfinite(c), torch.sign(c), NONFINITE))


def _momentum_update(m: Tensor, g: Tensor, b2: Tensor, omb2: Tensor) -> None:
    m.copy_(m * b2 + g * omb2)


def _lion_update(p: Tensor, m: Tensor, g: Tensor, decay: Tensor, lr: Tensor, b1: Tensor, omb1: Tensor,
                 b2: Tensor, omb2: Tensor) -> None:
    c = m * b1 + g * omb1
    p.copy_(p * decay - torch.sign(c) * lr)
    m.copy_(m * b2 + g * omb2)


def _exact_options() -> dict:
    """Inductor's defaults already keep every rounding; pin them against environment overrides
    (``TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG`` and the like)."""
    from torch._inductor import config

    wanted = {"enable_floating_point_contract_flag": "off", "enable_unsafe_math_opt_flag": False}
    return {f"cpp.{k}": v for k, v in wanted.items() if hasattr(config.cpp, k)}


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"sign": _sign_contribution, "momentum": _momentum_update, "lion": _lion_update}[name]
    # (not fullgraph: past dynamo's recompile limit a call then runs these same ops eagerly, the same values)
    compiled = torch.compile(fn, dynamic=True, options=_exact_options())
    first = [True]

    def call(*args):
        if not first[0]:
            return compiled(*args)
        try:  # the first call compiles: say what failed, and what to do, in terms of the option
            out = compiled(*args)
        except Exception as e:
            raise RuntimeError(
                f"fused=True: compiling the fused kernel '{name}' with torch.compile failed ({type(e).__name__}). "
                "It needs a working C++ compiler (e.g. g++) and TorchInductor; install one, or use fused=False "
                "(the same results, more passes over memory).") from e
        first[0] = False
        return out

    return call


def sign_contribution(m: Tensor, g: Tensor, beta1: float, scale: float, out: Tensor) -> bool:
    """``out`` ← sign(β1·m + scale·g) (int8; sign(0) = 0) in one pass over m and g; True when
    every c is finite (checked on ``out``, a byte per value). Where some c is not finite ``out``
    holds no meaningful signs (the step is rejected on every rank), but only values in {−1, 0, 1}.
    ``scale`` is 1 − β1 (or −(1 − β1) for ``maximize``); m and g are flat and untouched."""
    if not m.numel():
        return True
    _compiled("sign")(m, g, _scalar(beta1, m), _scalar(scale, m), out)
    if int(out.max()) < NONFINITE:
        return True
    out.clamp_(-1, 1)  # (the codecs expect signs)
    return False


def momentum_update_(m: Tensor, g: Tensor, beta2: float, scale: float) -> None:
    """m ← β2·m + scale·g in place, in one pass (``scale`` = ±(1 − β2))."""
    if m.numel():
        _compiled("momentum")(m, g, _scalar(beta2, m), _scalar(scale, m))


def lion_update_(p: Tensor, m: Tensor, g: Tensor, lr: float, weight_decay: float, beta1: float, beta2: float,
                 scale: float = 1.0) -> None:
    """The whole Lion rule of :mod:`dlion.lion` for one tensor, in one pass:
    p ← p·(1 − η·λ) − η·sign(β1·m + (1 − β1)·g'); m ← β2·m + (1 − β2)·g', with g' = scale·g
    (``scale`` = −1 for ``maximize``; negation is exact). η·sign(c) is exact, so p's update is
    rounded twice, as in the literal rule; with λ = 0 the factor 1 is exact too."""
    if p.numel():
        s = lambda x: _scalar(x, p)  # noqa: E731
        _compiled("lion")(p, m, g, s(1.0 - lr * weight_decay), s(lr), s(beta1), s(scale * (1.0 - beta1)),
                          s(beta2), s(scale * (1.0 - beta2)))
