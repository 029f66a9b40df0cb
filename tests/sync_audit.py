"""A CPU emulation of a CUDA device, to count the host synchronisations of a step without a GPU.

:class:`EmulatedDevice` is a ``TorchFunctionMode``. Inside it, tensors are *tagged* as living on
the device when they are made there: a factory call with ``device="cuda"`` (or any CUDA device),
``.to("cuda")`` / ``.cuda()`` of a host tensor, or any operation on a tagged tensor. A tagged
tensor reports ``device == cuda:0`` and ``is_cuda``, so the library's own checks
(``x.device.type == "cpu"``, ``kernels.supported``, ``_torch_vote``) take the branches CUDA
tensors take — no switch in the library. Every operation still runs on the CPU (the device
argument is rewritten to ``"cpu"``); the results are the same values.

What counts as a host synchronisation (on a GPU each of these waits for the device):

* reading a device tensor on the host: ``item``, ``tolist``, ``bool()``, ``int()``, ``float()``,
  ``__index__``, ``.cpu()``, ``.to("cpu")``, ``copy_`` into a host tensor (unless ``non_blocking``);
* copying host memory to the device without ``non_blocking=True`` from pinned memory:
  ``.to("cuda")``, ``.cuda()``, ``copy_`` from a host tensor, ``torch.tensor(data, device="cuda")``,
  a host index tensor or a host value in ``x[...]`` / ``x[...] = v``;
* operations whose output size or value the host must know: ``nonzero``, ``argwhere``,
  ``masked_select``, ``unique``, ``unique_consecutive``, ``bincount``, ``histc``, ``equal``,
  ``allclose``, one-argument ``where``, ``repeat_interleave`` without ``output_size``, boolean-mask
  indexing.

What CUDA would refuse is raised here too (and recorded in ``errors``): ``numpy()`` of a device
tensor, and an operation mixing device tensors with host tensors of more than 0 dimensions.

Each synchronisation is attributed to the innermost line of ``dlion`` on the stack
(``dlion/buckets.py:235 contribute``), else to the innermost line outside torch and this file.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cuda", 0)
HOST = torch.device("cpu")

_T = torch.Tensor
_READS = {_T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__}
_REFUSED = {_T.numpy, _T.__array__}
#: operations that read a result on the host, and how many times (CUDA's bincount checks the minimum
#: and reads the maximum of its input: two reads)
_SIZED = {torch.nonzero: 1, _T.nonzero: 1, torch.argwhere: 1, _T.argwhere: 1, torch.masked_select: 1,
          _T.masked_select: 1, torch.unique: 1, _T.unique: 1, torch.unique_consecutive: 1,
          _T.unique_consecutive: 1, torch.bincount: 2, _T.bincount: 2, torch.histc: 1, _T.histc: 1,
          torch.equal: 1, _T.equal: 1, torch.allclose: 1, _T.allclose: 1}
#: tensors made on the (emulated) device, and host tensors in pinned memory: module-wide, since
#: the library caches device tensors (lookup tables) across optimizers
_TAGS = WeakIdKeyDictionary()
_PINNED = WeakIdKeyDictionary()
_THIS = os.path.abspath(__file__)


def _is_device(d) -> bool:
    if d is None:
        return False
    if isinstance(d, int):  # (an ordinal: a CUDA device)
        return True
    return torch.device(d).type == "cuda"


def _is_host(d) -> bool:
    return d is not None and not isinstance(d, int) and torch.device(d).type == "cpu"


def _getter_name(func) -> Optional[str]:
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor" and getattr(func, "__name__", "") == "__get__":
        return owner.__name__
    return None


class EmulatedDevice(TorchFunctionMode):
    """Run a CUDA code path on the CPU and count what would make the host wait for the device.

    ``syncs``: Counter of ``"dlion/file.py:line (what)"`` while ``counting`` is True;
    ``errors``: what CUDA would have refused (also raised)."""

    def __init__(self):
        super().__init__()
        self.tags, self.pinned = _TAGS, _PINNED
        self.counting = False
        self.syncs: collections.Counter = collections.Counter()
        self.errors: list[str] = []

    # -- bookkeeping ---------------------------------------------------------------------
    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.tags

    def _tag(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tags[t] = True
        return out

    @staticmethod
    def site() -> str:
        """The innermost dlion line on the stack, else the innermost line outside torch and this file."""
        f = sys._getframe(2)
        fallback = None
        while f is not None:
            path = os.path.abspath(f.f_code.co_filename)
            norm = path.replace("\\", "/")
            if "/dlion/" in norm and "/tests/" not in norm:
                return f"dlion/{norm.rsplit('/dlion/', 1)[1]}:{f.f_lineno} {f.f_code.co_name}"
            if fallback is None and path != _THIS and "/torch/" not in norm:
                fallback = f"{os.path.basename(path)}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return fallback or "? ?"

    def _sync(self, what: str, times: int = 1) -> None:
        if self.counting:
            self.syncs[f"{self.site()} ({what})"] += times

    def _refuse(self, msg: str, exc=RuntimeError):
        msg = f"{self.site()}: {msg}"
        self.errors.append(msg)
        raise exc(f"(emulated CUDA) {msg}")

    def count(self) -> int:
        return sum(self.syncs.values())

    def by_site(self) -> dict:
        """Counts per source line, ``"dlion/buckets.py:235"`` (as the GPU's sync debug mode reports them)."""
        out: collections.Counter = collections.Counter()
        for key, n in self.syncs.items():
            out[key.split(" ")[0]] += n
        return dict(out.most_common())

    def by_function(self) -> dict:
        """Counts per file and function, ``"dlion/buckets.py contribute"`` (what budgets are keyed by:
        unlike line numbers, they survive edits elsewhere in the file)."""
        out: collections.Counter = collections.Counter()
        for key, n in self.syncs.items():
            where, func = key.split(" (")[0].split(" ")[:2] if " (" in key else (key, "?")
            out[f"{where.rsplit(':', 1)[0]} {func}"] += n
        return dict(out.most_common())

    # -- the mode ------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _getter_name(func)
        if name is not None:
            t = args[0]
            if self.on_device(t):
                if name == "device":
                    return DEVICE
                if name == "is_cuda":
                    return True
                if name == "is_cpu":
                    return False
            out = func(*args, **kwargs)
            if name in ("data", "T", "mT", "H", "mH", "real", "imag") and self.on_device(t):
                self._tag(out)
            return out

        first = args[0] if args else None
        if func in _READS and self.on_device(first):
            self._sync(func.__name__)
            return func(*args, **kwargs)
        if func in _REFUSED and self.on_device(first):
            self._refuse("numpy() of a device tensor", TypeError)
        if func in (_T.to, _T.cuda, _T.cpu):
            return self._to(func, args, kwargs)
        if func is _T.copy_:
            return self._copy(func, args, kwargs)
        if func is _T.pin_memory:
            out = first.clone()
            self.pinned[out] = True
            return out
        if func is _T.is_pinned:
            return first in self.pinned
        if func is _T.get_device:
            return 0 if self.on_device(first) else -1
        if func in (_T.__getitem__, _T.__setitem__):
            return self._index(func, args, kwargs)

        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        dev = [x for x in flat if self.on_device(x)]
        explicit = kwargs.get("device")
        if explicit is not None:
            kwargs["device"] = HOST if _is_device(explicit) else explicit
        if dev and explicit is None:
            host = [x for x in flat if not self.on_device(x) and x.dim() > 0]
            if host:
                self._refuse(f"{getattr(func, '__name__', func)} mixes device tensors with host tensors "
                             f"(shapes {[tuple(x.shape) for x in host]})")
        if dev and (func in _SIZED or (func in (torch.where, _T.where) and len(args) + len(kwargs) == 1)
                    or (func in (torch.repeat_interleave, _T.repeat_interleave)
                        and kwargs.get("output_size") is None)):
            self._sync(func.__name__, _SIZED.get(func, 1))
        if (func in (torch.tensor, torch.as_tensor) and _is_device(explicit)) or (
                func is _T.new_tensor and (_is_device(explicit) or (dev and explicit is None))):
            self._sync(f"{func.__name__}(data) to the device")  # pageable host memory to the device
        out = func(*args, **kwargs)
        if _is_device(explicit) or (dev and not _is_host(explicit)):
            self._tag(out)
        return out

    def _to(self, func, args, kwargs):
        t = args[0]
        if func is _T.cuda:
            target, non_blocking = DEVICE, bool(kwargs.get("non_blocking", len(args) > 2 and args[2]))
            rest_args, rest_kwargs = (), {}
        elif func is _T.cpu:
            target, non_blocking, rest_args, rest_kwargs = HOST, False, (), {}
        else:  # to(device, dtype, non_blocking, copy), to(dtype, ...), to(other, ...), keywords
            target, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
            non_blocking, copy = bool(kwargs.pop("non_blocking", False)), bool(kwargs.pop("copy", False))
            flags = []
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    target, dtype = (DEVICE if self.on_device(a) else HOST), a.dtype
                elif isinstance(a, bool):
                    flags.append(a)
                elif isinstance(a, torch.dtype):
                    dtype = a
                elif isinstance(a, (str, torch.device, int)):
                    target = a
            if flags:
                non_blocking, copy = flags[0], (len(flags) > 1 and flags[1])
            rest_args = (dtype,) if dtype is not None else ()
            rest_kwargs = dict(kwargs, copy=True) if copy else kwargs
        src_dev = self.on_device(t)
        dst_dev = src_dev if target is None else _is_device(target)
        out = torch.Tensor.to(t, *rest_args, **rest_kwargs) if rest_args or rest_kwargs else t
        if src_dev == dst_dev:
            if out is not t and src_dev:
                self._tag(out)
            return out
        if t.numel() == 0:  # (CUDA copies nothing and does not wait)
            pass
        elif dst_dev:  # host -> device
            if not (non_blocking and t in self.pinned):
                self._sync("to(device) from pageable memory" if not non_blocking else "to(device) unpinned")
        elif not non_blocking:  # device -> host (non_blocking: into pinned memory, read later)
            self._sync(f"{func.__name__}() to host")
        out = out.clone() if out is t else out
        if dst_dev:
            self._tag(out)
        return out

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1]
        non_blocking = bool(kwargs.get("non_blocking", len(args) > 2 and args[2]))
        d, s = self.on_device(dst), self.on_device(src)
        if dst.numel() == 0:
            pass
        elif d and not s and isinstance(src, torch.Tensor) and not (non_blocking and src in self.pinned):
            self._sync("copy_ host to device")
        elif s and not d and not (non_blocking and dst in self.pinned):
            self._sync("copy_ device to host")
        return func(*args, **kwargs)

    def _index(self, func, args, kwargs):
        t, idx = args[0], args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        tensors = [x for x in tree_flatten(parts)[0] if isinstance(x, torch.Tensor)]
        if self.on_device(t):
            masks = [x for x in tensors if x.dtype in (torch.bool, torch.uint8)]
            scalar_fill = func is _T.__setitem__ and not isinstance(args[2], torch.Tensor) and len(parts) == 1
            if masks and not scalar_fill:  # (x[mask] = scalar is a masked_fill_)
                self._sync("boolean-mask indexing")
            if any(not self.on_device(x) and x.dim() > 0 for x in tensors):
                self._sync("host index tensor copied to the device")
            if func is _T.__setitem__ and isinstance(args[2], torch.Tensor) and not self.on_device(args[2]):
                self._sync("x[...] = host tensor")
        elif func is _T.__setitem__ and self.on_device(args[2]):
            self._sync("host[...] = device tensor")
        elif any(self.on_device(x) for x in tensors):
            self._refuse("a host tensor indexed with device indices")
        out = func(*args, **kwargs)
        if func is _T.__getitem__ and self.on_device(t):
            self._tag(out)
        return out


def to_device(x):
    """``x`` (a tensor or a nested structure of them) as device tensors, inside an active EmulatedDevice."""
    return tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t, x)
