"""The Lion update rule (Chen et al. 2023) and a ``torch.optim`` optimizer for it.

Per parameter tensor, with gradient g, momentum m (starts at 0), lr η, weight decay λ::

    p ← p · (1 − η·λ)              # decoupled weight decay
    c ← β1·m + (1 − β1)·g          # the "pre-sign" interpolation
    p ← p − η · sign(c)            # sign(0) = 0
    m ← β2·m + (1 − β2)·g

Every product above is rounded separately (no fused multiply-add), so the
per-tensor and the multi-tensor (``foreach``) paths give bitwise identical
results, and so does a literal transcription of the four lines.

Low precision: for bf16/fp16 parameters the momentum is kept in fp32 and
``c``, the decay and the step are computed in fp32; the new parameter value is
then rounded to the parameter's dtype (round to nearest). A step η smaller than
half a unit in the last place of a bf16 value is therefore lost, exactly as it
would be for any optimizer writing bf16 weights; keep fp32 master weights
(e.g. train in fp32 under ``torch.autocast``) when that matters.

Fused (``fused=True``, CPU): fp32/fp64 parameters whose momentum has their dtype
take the whole rule in one native loop (:mod:`dlion.kernels`), one call for all
the group's tensors of a dtype, the same roundings in the same order, instead of
about ten passes over memory and a launch per tensor; other
parameters (bf16/fp16, a narrower ``momentum_dtype``) keep the multi-tensor path.

Momentum storage: ``momentum_dtype=torch.bfloat16`` stores the momentum (Lion's
only state tensor) in bf16 — half the optimizer memory of fp32 state. Only the
storage narrows: each step widens m to the work dtype (fp32 for bf16/fp16/fp32
parameters), computes ``c`` and the new momentum there, and rounds the new
momentum once, to nearest, back to bf16.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from . import kernels

__all__ = ["Lion", "lion_presign", "lion_momentum_update", "apply_update", "check_hyperparameters",
           "check_momentum_dtype", "param_tensors"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_hyperparameters(lr: float, betas, weight_decay: float) -> None:
    """Raise ``ValueError`` with a clear message for invalid Lion hyperparameters."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0.0:
        raise ValueError(f"Invalid learning rate: lr={lr!r}; it must be a number > 0.")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2).") from None
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid {name}: {b!r}; betas must lie in [0, 1).")
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay: {weight_decay!r}; it must be >= 0.")


def check_params(params: list[Tensor]) -> None:
    """Parameters must be dense floating-point tensors, each listed once."""
    seen: set[int] = set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"Parameter {i} is a {type(p).__name__}, not a torch.Tensor.")
        if p.is_sparse:
            raise ValueError(f"Parameter {i} (shape {tuple(p.shape)}) is sparse; Lion supports dense parameters only.")
        if not p.is_floating_point():
            raise ValueError(f"Parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; Lion needs floating-point parameters.")
        if id(p) in seen:
            raise ValueError(f"Parameter {i} (shape {tuple(p.shape)}) appears more than once in the optimizer's parameters.")
        seen.add(id(p))


def check_grad(index: int, p: Tensor) -> None:
    g = p.grad
    if g is None:
        return
    if g.is_sparse:
        raise ValueError(f"Parameter {index} (shape {tuple(p.shape)}) has a sparse gradient; Lion supports dense gradients only.")
    if not g.is_floating_point():
        raise ValueError(f"Parameter {index} (shape {tuple(p.shape)}) has a gradient of dtype {g.dtype}; expected floating point.")


def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in _LOW_PRECISION else p.dtype


def check_momentum_dtype(dtype) -> None:
    """``None`` (the work dtype) or a floating-point ``torch.dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"momentum_dtype must be None or a floating-point torch.dtype (e.g. torch.bfloat16), "
                         f"got {dtype!r}")


def lion_presign(ms: list[Tensor], gs: list[Tensor], beta1: float, *, foreach: bool) -> list[Tensor]:
    """c = β1·m + (1 − β1)·g for every tensor (new tensors, m and g untouched)."""
    if foreach:
        a = torch._foreach_mul(ms, beta1)
        b = torch._foreach_mul(gs, 1.0 - beta1)
        torch._foreach_add_(a, b)
        return a
    return [torch.mul(m, beta1).add_(torch.mul(g, 1.0 - beta1)) for m, g in zip(ms, gs)]


def lion_momentum_update(ms: list[Tensor], gs: list[Tensor], beta2: float, *, foreach: bool) -> None:
    """m ← β2·m + (1 − β2)·g in place."""
    if foreach:
        torch._foreach_mul_(ms, beta2)
        torch._foreach_add_(ms, torch._foreach_mul(gs, 1.0 - beta2))
        return
    for m, g in zip(ms, gs):
        m.mul_(beta2).add_(torch.mul(g, 1.0 - beta2))


def apply_update(params: list[Tensor], updates: list[Tensor], lr: float, weight_decay: float, *, foreach: bool) -> None:
    """p ← p·(1 − η·λ); p ← p − η·u, computed in fp32 for low-precision parameters."""
    if not params:
        return
    low = [p.dtype in _LOW_PRECISION for p in params]
    work = [p.float() if lo else p for p, lo in zip(params, low)]
    ups = [u.to(w.dtype) if u.dtype != w.dtype else u for u, w in zip(updates, work)]
    if foreach:
        if weight_decay != 0.0:
            torch._foreach_mul_(work, 1.0 - lr * weight_decay)
        torch._foreach_add_(work, torch._foreach_mul(ups, lr), alpha=-1.0)
    else:
        for w, u in zip(work, ups):
            if weight_decay != 0.0:
                w.mul_(1.0 - lr * weight_decay)
            w.sub_(torch.mul(u, lr))
    for p, w, lo in zip(params, work, low):
        if lo:
            p.copy_(w)


class Lion(torch.optim.Optimizer):
    """Lion, exactly the four-line rule above. ``foreach=None`` picks the
    multi-tensor path when all parameters are on CUDA or CPU (both paths give
    identical results). ``fused=True`` (CPU parameters only) runs the rule as one
    native loop over all the tensors, with the same results (module docstring); it
    loads the library at construction (:func:`dlion.kernels.load`, building it on
    first use), so a machine without a C compiler fails there, saying what to do.
    ``momentum_dtype`` narrows the momentum's storage (see the module docstring)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        momentum_dtype: Optional[torch.dtype] = None,
        fused: bool = False,
    ):
        check_hyperparameters(lr, betas, weight_decay)
        check_momentum_dtype(momentum_dtype)
        self.momentum_dtype = momentum_dtype
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize, foreach=foreach,
                        fused=bool(fused))
        params = list(params)
        check_params(param_tensors(params))  # before torch.optim's own (warning-only) duplicate check
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
        check_params([p for grp in self.param_groups for p in grp["params"]])
        if g.get("fused"):
            check_fusable(g["params"])
            if not getattr(self, "_agree_on_kernels", False):  # (the distributed optimizers check on every rank)
                kernels.load()  # here, not at the first step: a clear error if they cannot be built

    def _momentum_dtype(self, p: Tensor) -> torch.dtype:
        return getattr(self, "momentum_dtype", None) or _state_dtype(p)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim casts loaded state to each parameter's dtype; Lion keeps the momentum in
        # its own dtype (fp32 for bf16/fp16 parameters, or momentum_dtype), so put it back in that.
        saved = {}
        for group, saved_group in zip(self.param_groups, state_dict.get("param_groups", [])):
            for p, pid in zip(group["params"], saved_group["params"]):
                m = state_dict.get("state", {}).get(pid, {}).get("exp_avg")
                if self._momentum_dtype(p) != p.dtype and isinstance(m, Tensor):
                    saved[p] = m
        super().load_state_dict(state_dict)
        for p, m in saved.items():
            self.state[p]["exp_avg"] = m.to(dtype=self._momentum_dtype(p), device=p.device)

    def _collect(self, group: dict):
        """Parameters with gradients, their gradients (negated if maximize) and momenta."""
        ps, gs, ms = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            if g.dtype in _LOW_PRECISION or p.dtype in _LOW_PRECISION:
                g = g.float()
            if group["maximize"]:
                g = torch.neg(g)
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, dtype=self._momentum_dtype(p),
                                                    memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0)
            ps.append(p)
            gs.append(g)
            ms.append(state["exp_avg"])
        return ps, gs, ms

    @staticmethod
    def _evaluate(closure: Optional[Callable[[], float]]):
        """The closure's loss, computed with gradients enabled (``step`` runs under no_grad); None without one."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._evaluate(closure)
        # Validate every gradient before touching anything: a bad one changes nothing.
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            check_grad(i, p)
        for group in self.param_groups:
            ps, gs, ms = self._collect(group)
            if not ps:
                continue
            beta1, beta2 = group["betas"]
            if group.get("fused"):
                ps, gs, ms = self._fused_step(group, ps, gs, ms)
                if not ps:
                    continue
            foreach = _use_foreach(group["foreach"], ps)
            wide = [m if m.dtype == g.dtype else m.to(g.dtype) for m, g in zip(ms, gs)]  # (momentum_dtype)
            c = lion_presign(wide, gs, beta1, foreach=foreach)
            signs = torch._foreach_sign(c) if foreach else [torch.sign(x) for x in c]
            apply_update(ps, signs, group["lr"], group["weight_decay"], foreach=foreach)
            lion_momentum_update(wide, gs, beta2, foreach=foreach)
            for m, w in zip(ms, wide):
                if w is not m:
                    m.copy_(w)  # rounded once, to nearest
            for p in ps:
                self.state[p]["step"] += 1
        return loss

    def _fused_step(self, group: dict, ps: list, gs: list, ms: list) -> tuple[list, list, list]:
        """The rule for the fusable parameters of ``group`` (gradients already negated for
        ``maximize``); returns the others, for the multi-tensor path."""
        check_fusable(ps)
        beta1, beta2 = group["betas"]
        rest: tuple[list, list, list] = ([], [], [])
        fusable: dict = {}  # dtype -> (ps, ms, gs): one native call per dtype, whatever the number of tensors
        for p, g, m in zip(ps, gs, ms):
            if kernels.supported(p, g, m) and p.is_contiguous() and g.is_contiguous() and m.is_contiguous():
                for lst, x in zip(fusable.setdefault(p.dtype, ([], [], [])), (p, m, g)):
                    lst.append(x)
                self.state[p]["step"] += 1
            else:
                for lst, x in zip(rest, (p, g, m)):
                    lst.append(x)
        for fp, fm, fg in fusable.values():
            kernels.lion_update_(fp, fm, fg, group["lr"], group["weight_decay"], beta1, beta2)
        return rest


def check_fusable(params: list[Tensor]) -> None:
    """``fused=True`` runs on CPU parameters only: raise a clear error for others."""
    for i, p in enumerate(params):
        if p.device.type != "cpu":
            raise ValueError(f"fused=True runs on CPU parameters only; parameter {i} (shape {tuple(p.shape)}) is "
                             f"on {p.device}. On GPUs the elementwise passes are cheap: use fused=False there.")


def param_tensors(params: list) -> list:
    """The tensors of a params argument: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``,
    which ``torch.optim`` keeps as ``param_groups[i]["param_names"]``), or dicts with a "params" entry
    of either."""
    out = []
    for item in params:
        if isinstance(item, dict):
            ps = item.get("params", [])
            if not isinstance(ps, Tensor):
                ps = item["params"] = list(ps)  # a generator can be read only once
            out.extend([ps] if isinstance(ps, Tensor) else ps)
        else:
            out.append(item)
    return [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in out]


def _use_foreach(flag: Optional[bool], params: list[Tensor]) -> bool:
    if flag is not None:
        return bool(flag)
    return all(p.device.type in ("cpu", "cuda") for p in params)
