"""Native CPU kernels: the elementwise passes of a Lion step (``fused=True``) and the bit
codec's inner loops, each one loop over memory for many tensors per call.

The literal rule rounds every product on its own (no fused multiply-add), which in
eager PyTorch costs one pass over memory per operation, and one kernel launch per
tensor: c = β1·m + (1 − β1)·g followed by its sign and a finiteness check is five to
six passes, the momentum update three. ``kernels.c`` does each in one loop, and takes
arrays of tensor pointers, so a bucket or parameter group of many tensors is one call.
It is compiled with ``-ffp-contract=off`` and without ``-ffast-math``: every product and
sum is still rounded once, in the same order, so the values are those of the eager ops
(the tests compare them value for value on inputs with infinities, NaN, subnormals and
zeros of both signs, whose signs they check too).

Hyperparameters are passed in the work dtype, rounded from the Python floats to nearest,
exactly as eager PyTorch rounds a scalar operand: a learning-rate schedule changes inputs,
not code.

The library is compiled by the system C compiler (``$CC``, else ``cc``) on first use,
in well under a second, into a per-user cache (``$DLION_CACHE_DIR``, else
``~/.cache/dlion``) keyed by the source, the compiler and the CPU, and loaded with
:mod:`ctypes`. ``fused=True`` needs it and says so when it cannot be built. The codec
helpers (:func:`pack_positive`, :func:`unpack_signs`, :func:`count_zeros`) use it when it
is there and numpy otherwise (the same bits); ``DLION_NATIVE=0`` turns it off for them.

CPU only. On CUDA the same passes are a small part of a step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["supported", "available", "sign_and_pack", "momentum_update_", "lion_update_", "apply_codes_",
           "apply_signs_", "pack_positive", "pack_positive_counting", "unpack_signs", "count_zeros", "majority",
           "NONFINITE"]

_DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}
_SOURCE = Path(__file__).with_name("kernels.c")

#: What the sign loop writes where c is inf or NaN (never a sign), before :func:`sign_and_pack` clamps it.
NONFINITE = 2

Tensors = Union[Tensor, Sequence[Tensor]]


def supported(*tensors: Tensor) -> bool:
    """Whether the fused kernels apply: CPU tensors of one dtype, fp32 or fp64."""
    t0 = tensors[0]
    return t0.device.type == "cpu" and t0.dtype in _DTYPES and all(
        t.device == t0.device and t.dtype == t0.dtype for t in tensors)


# -- building and loading ----------------------------------------------------------------------
def _cache_dir() -> Path:
    base = os.environ.get("DLION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dlion")
    path = Path(base)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:  # (a read-only home): a private temporary directory instead
        path = Path(tempfile.gettempdir()) / f"dlion-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        path.mkdir(parents=True, exist_ok=True)
        return path


def _cpu_identity() -> str:
    """What -march=native depends on: a library built on one CPU must not be loaded on another
    (a shared home directory on a mixed cluster)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise OSError("no C compiler found (set $CC, or install gcc or clang)")
    return cc


_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC"]
_OPTIONAL_FLAGS = [["-march=native", "-fopenmp"], ["-march=native"], []]


def _build() -> ctypes.CDLL:
    cc = _compiler()
    source = _SOURCE.read_bytes()
    errors = []
    for extra in _OPTIONAL_FLAGS:
        flags = _BASE_FLAGS + extra
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), platform.machine().encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        target = _cache_dir() / f"kernels-{key}.so"
        if not target.exists():
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            proc = subprocess.run([cc, *flags, str(_SOURCE), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-400:]}")
                tmp.unlink(missing_ok=True)
                continue
            os.replace(tmp, target)  # atomic: ranks that build at once each load a whole file
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as e:  # (e.g. built with OpenMP whose runtime is not there)
            errors.append(f"{' '.join(flags)}: {e}")
            continue
        lib.dl_init()
        _declare(lib)
        return lib
    raise OSError(f"compiling {_SOURCE.name} with {cc} failed:\n" + "\n".join(errors))


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix, T in _DTYPES.values():
        getattr(lib, f"dl_lion_{suffix}").argtypes = [INT, P, P, P, P, T, T, T, T, T, T, INT]
        getattr(lib, f"dl_sign_pack_{suffix}").argtypes = [INT, P, P, P, P, T, T, P, I64, I64, P, P]
        getattr(lib, f"dl_sign_pack_{suffix}").restype = INT
        getattr(lib, f"dl_momentum_{suffix}").argtypes = [INT, P, P, P, T, T, INT]
        getattr(lib, f"dl_apply_codes_{suffix}").argtypes = [INT, P, P, P, T, T, INT]
        getattr(lib, f"dl_apply_signs_{suffix}").argtypes = [INT, P, P, P, P, T, T, INT]
    lib.dl_pack_positive.argtypes = [P, I64, P]
    lib.dl_pack_positive_count_zeros.argtypes = [P, I64, P, I64]
    lib.dl_pack_positive_count_zeros.restype = I64
    lib.dl_count_zeros.argtypes = [P, I64]
    lib.dl_count_zeros.restype = I64
    lib.dl_unpack_signs.argtypes = [P, I64, P]
    lib.dl_majority.argtypes = [INT, P, I64, I64, P, P, P]


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[ctypes.CDLL], Optional[BaseException]]:
    try:
        return _build(), None
    except (OSError, subprocess.SubprocessError) as e:
        return None, e


def _lib() -> ctypes.CDLL:
    """The library, for ``fused=True``: a clear error when it cannot be built."""
    lib, error = _load()
    if lib is None:
        raise RuntimeError(
            f"fused=True: building dlion's native kernels failed ({type(error).__name__}: {error}). They need a "
            "C compiler (e.g. gcc); install one, or use fused=False (the same results, more passes over "
            "memory).") from error
    return lib


def available() -> bool:
    """Whether the native library is there for the codec helpers (``DLION_NATIVE=0``: never)."""
    return os.environ.get("DLION_NATIVE", "1") != "0" and _load()[0] is not None


# -- calls --------------------------------------------------------------------------------------
def _segments(xs: Tensors) -> list[Tensor]:
    return [xs] if isinstance(xs, Tensor) else list(xs)


def _pointers(xs: list[Tensor]):
    for x in xs:
        if not x.is_contiguous():
            raise ValueError("dlion.kernels: every tensor must be contiguous")
    return (ctypes.c_void_p * len(xs))(*[x.data_ptr() for x in xs])


def _lengths(xs: list[Tensor]):
    return (ctypes.c_int64 * len(xs))(*[x.numel() for x in xs])


def _written(xs: list[Tensor]) -> None:
    """Tell autograd that ``xs`` changed in place, as a torch op would: a graph that saved one of
    them then fails in backward instead of silently using the new values."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None and xs:
        bump(xs)


def _same_sizes(*groups: list[Tensor]) -> None:
    first = groups[0]
    for g in groups[1:]:
        if len(g) != len(first) or any(a.numel() != b.numel() for a, b in zip(first, g)):
            raise ValueError("dlion.kernels: segment lists of different lengths or sizes")


def _kind(x: Tensor):
    try:
        return _DTYPES[x.dtype]
    except KeyError:
        raise ValueError(f"dlion.kernels: fp32 or fp64 only, got {x.dtype}") from None


def sign_and_pack(m: Sequence[Tensor], g: Sequence[Tensor], offsets: Sequence[int], beta1: float, scale: float,
                  values: Tensor, numel: int) -> tuple[bool, Tensor, int]:
    """The signs of a whole bucket's c and its 1-bit payload in one pass over memory:
    ``values`` (int8, the padded bucket) ← sign(β1·m + scale·g) of each segment at its offset, 0
    between and after them; returns (every c finite, the packed bits of values > 0, how many of
    values[:numel] are 0). Segments in increasing offset order, inside ``values``, not overlapping.
    Where some c is not finite, ``values`` holds no meaningful signs (the step is rejected on every
    rank), but only values in {−1, 0, 1}. ``scale`` is 1 − β1, or −(1 − β1) for ``maximize``."""
    ms, gs = list(m), list(g)
    _same_sizes(ms, gs)
    if len(offsets) != len(ms) or values.dtype != torch.int8 or not values.is_contiguous() or values.numel() % 8:
        raise ValueError("dlion.kernels: one offset per segment, and int8 values of a length that is a multiple of 8")
    ends = [o + x.numel() for o, x in zip(offsets, ms)]
    if any(o < 0 for o in offsets) or any(e > values.numel() for e in ends) or any(
            b < a for a, b in zip(ends, list(offsets)[1:])):
        raise ValueError("dlion.kernels: segments must lie in values, in order, without overlapping")
    packed = torch.empty(values.numel() // 8, dtype=torch.uint8)
    zeros = ctypes.c_int64(0)
    suffix, T = _kind(ms[0]) if ms else ("f32", ctypes.c_float)
    ok = getattr(_lib(), f"dl_sign_pack_{suffix}")(
        len(ms), _pointers(ms), _pointers(gs), (ctypes.c_int64 * len(ms))(*offsets), _lengths(ms), T(beta1), T(scale),
        values.data_ptr(), values.numel(), max(0, min(numel, values.numel())), packed.data_ptr(), ctypes.byref(zeros))
    if not ok:
        values.clamp_(-1, 1)  # (the codecs expect signs; 2 > 0 and 1 > 0: the packed bits stand)
    return bool(ok), packed, int(zeros.value)


def momentum_update_(m: Tensors, g: Tensors, beta2: float, scale: float) -> None:
    """m ← β2·m + scale·g in place, segment by segment, in one pass (``scale`` = ±(1 − β2))."""
    ms, gs = _segments(m), _segments(g)
    _same_sizes(ms, gs)
    if ms:
        suffix, T = _kind(ms[0])
        getattr(_lib(), f"dl_momentum_{suffix}")(len(ms), _pointers(ms), _pointers(gs), _lengths(ms), T(beta2),
                                                 T(scale), torch.get_num_threads())
        _written(ms)


def lion_update_(p: Tensors, m: Tensors, g: Tensors, lr: float, weight_decay: float, beta1: float, beta2: float,
                 scale: float = 1.0) -> None:
    """The whole Lion rule of :mod:`dlion.lion` for each tensor, in one pass:
    p ← p·(1 − η·λ) − η·sign(β1·m + (1 − β1)·g'); m ← β2·m + (1 − β2)·g', with g' = scale·g
    (``scale`` = −1 for ``maximize``; negation is exact). η·sign(c) is exact, so p's update is
    rounded twice, as in the literal rule; with λ = 0 the factor 1 is exact too."""
    ps, ms, gs = _segments(p), _segments(m), _segments(g)
    _same_sizes(ps, ms, gs)
    if ps:
        suffix, T = _kind(ps[0])
        getattr(_lib(), f"dl_lion_{suffix}")(
            len(ps), _pointers(ps), _pointers(ms), _pointers(gs), _lengths(ps), T(1.0 - lr * weight_decay), T(lr),
            T(beta1), T(scale * (1.0 - beta1)), T(beta2), T(scale * (1.0 - beta2)), torch.get_num_threads())
        _written(ps + ms)


def apply_codes_(p: Tensors, codes: Tensors, lr: float, weight_decay: float) -> None:
    """p ← p·(1 − η·λ) − η·code per segment, codes int8 in {−1, 0, 1} (η·code is exact, so
    this is x·(1 − η·λ) rounded, then x − η·Δ rounded: the two roundings of the eager update)."""
    ps, cs = _segments(p), _segments(codes)
    _same_sizes(ps, cs)
    if ps:
        suffix, T = _kind(ps[0])
        getattr(_lib(), f"dl_apply_codes_{suffix}")(len(ps), _pointers(ps), _pointers(cs), _lengths(ps),
                                                    T(1.0 - lr * weight_decay), T(lr), torch.get_num_threads())
        _written(ps)


def apply_signs_(p: Tensors, starts: Sequence[int], bits: Tensor, lr: float, weight_decay: float) -> None:
    """p ← p·(1 − η·λ) − η·s per segment, s = +1 where bit (start + i) of the packed ``bits``
    (uint8, little-endian bit order) is set, else −1: :func:`apply_codes_` of 1-bit codes without
    decoding them first (the same values)."""
    ps = _segments(p)
    if len(starts) != len(ps):
        raise ValueError("dlion.kernels: one start per segment")
    b = bits.contiguous()
    if b.dtype != torch.uint8 or b.device.type != "cpu":
        raise ValueError("dlion.kernels: bits must be a CPU uint8 tensor")
    if any(st < 0 or st + x.numel() > 8 * b.numel() for st, x in zip(starts, ps)):
        raise ValueError("dlion.kernels: a segment reaches past the packed bits")
    if ps:
        suffix, T = _kind(ps[0])
        getattr(_lib(), f"dl_apply_signs_{suffix}")(len(ps), _pointers(ps), (ctypes.c_int64 * len(ps))(*starts),
                                                    _lengths(ps), b.data_ptr(), T(1.0 - lr * weight_decay), T(lr),
                                                    torch.get_num_threads())
        _written(ps)


# -- the bit codec's loops (numpy where the library is not there) ---------------------------------
def pack_positive(values: Tensor) -> Tensor:
    """Packed bits (little-endian bit order) of ``values > 0`` for int8 ``values`` (CPU, length a
    multiple of 8)."""
    v = values.contiguous()
    if v.numel() % 8:
        raise ValueError(f"pack_positive needs a length that is a multiple of 8, got {v.numel()}")
    if available():
        out = torch.empty(v.numel() // 8, dtype=torch.uint8)
        _load()[0].dl_pack_positive(v.data_ptr(), v.numel(), out.data_ptr())
        return out
    return torch.from_numpy(np.packbits(v.numpy() > 0, bitorder="little"))


def pack_positive_counting(values: Tensor, count: int) -> tuple[Tensor, int]:
    """(:func:`pack_positive` of ``values``, how many of values[:count] are 0) in one pass."""
    v = values.contiguous()
    if v.numel() % 8:
        raise ValueError(f"pack_positive needs a length that is a multiple of 8, got {v.numel()}")
    if available():
        out = torch.empty(v.numel() // 8, dtype=torch.uint8)
        zeros = _load()[0].dl_pack_positive_count_zeros(v.data_ptr(), v.numel(), out.data_ptr(),
                                                        max(0, min(count, v.numel())))
        return out, int(zeros)
    return pack_positive(v), count_zeros(v[:max(0, count)])


def unpack_signs(packed: Tensor, n: int) -> Tensor:
    """±1 (int8) for the first ``n`` bits of ``packed`` (1 = +1), CPU."""
    p = packed.contiguous()
    if n > 8 * p.numel():
        raise ValueError(f"unpack_signs: {n} bits asked of {p.numel()} bytes")
    if available():
        out = torch.empty(n, dtype=torch.int8)
        _load()[0].dl_unpack_signs(p.data_ptr(), n, out.data_ptr())
        return out
    bits = np.unpackbits(p.numpy(), count=n, bitorder="little").view(np.int8)
    return torch.from_numpy(bits * np.int8(2) - np.int8(1))


def count_zeros(values: Tensor) -> int:
    """How many of the int8 ``values`` (CPU) are 0."""
    v = values.contiguous()
    if available():
        return int(_load()[0].dl_count_zeros(v.data_ptr(), v.numel()))
    return v.numel() - int(np.count_nonzero(v.numpy()))


def majority(rows: np.ndarray, real: int) -> Optional[tuple[np.ndarray, np.ndarray, int, int]]:
    """The bit-sliced majority vote of :mod:`dlion.bitvote` in one native pass: ``rows`` (uint8,
    N × w, one packed row of bits per voter, N ≤ 255) → (count > ⌊N/2⌋, count == ⌊N/2⌋ as packed
    masks, how many of the first ``real`` columns are unanimous (count 0 or N), how many tie
    (count = N/2, even N)); None where the library is not there."""
    if not available() or rows.ndim != 2 or rows.dtype != np.uint8 or not 1 <= rows.shape[0] <= 255:
        return None
    n, w = rows.shape
    if rows.strides[1] != 1:
        rows = np.ascontiguousarray(rows)
    base, stride = rows.ctypes.data, rows.strides[0]
    pointers = (ctypes.c_void_p * n)(*[base + r * stride for r in range(n)])
    gt, eq = np.empty(w, dtype=np.uint8), np.empty(w, dtype=np.uint8)
    counts = (ctypes.c_int64 * 2)()
    _load()[0].dl_majority(n, pointers, w, max(0, min(real, 8 * w)), gt.ctypes.data, eq.ctypes.data, counts)
    return gt, eq, int(counts[0]), int(counts[1])
