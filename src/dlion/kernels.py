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

**When it is built.** Never at import, and never for ``fused=False``: a ``fused=True``
optimizer (:class:`dlion.Lion`, :class:`dlion.DistributedLion` and its subclasses,
:class:`dlion.HierarchicalDistributedLion`, the DDP hook's ``DLionHookState(fused=True)``)
calls :func:`load` at construction, so a machine that cannot build it fails there, with an
error that says what to do; the distributed ones agree on it first (one small collective they
make anyway), so every rank raises the same error when any rank cannot. ``dlion kernels``
loads it ahead of time. The codec helpers (:func:`pack_positive`, :func:`unpack_signs`,
:func:`count_zeros`, :func:`majority`) use it only where it is already loaded and numpy/torch
otherwise (the same bits); ``DLION_NATIVE=0`` turns it off for them. The environment is read
when :func:`load` runs, not at import.

**How.** :func:`load` looks the library up in the cache first and uses it if it is there,
with or without a compiler; otherwise it compiles ``kernels.c`` with the system C compiler
(``$CC``, else cc, gcc or clang; under a second) and flags that run on any CPU of the
architecture: ``-O3 -ffp-contract=off -fno-trapping-math -shared -fPIC``. No
``-march=native`` (a library built on one machine of a shared home serves all of them) and no
``-fopenmp`` (a second OpenMP runtime beside torch's; the loops run on the calling thread,
which suits one rank per core). ``DLION_NATIVE_TUNE=1`` adds ``-march=native`` (falling back
to the portable build if that fails); only then is the CPU part of the file's key, which is
otherwise the source, the flags and the platform (not the compiler: any compiler given these
flags computes the same values).

**Where.** ``$DLION_CACHE_DIR``, else ``$XDG_CACHE_HOME/dlion``, else ``~/.cache/dlion``,
created with mode 0o700. A shared library is code: it is not loaded from a directory (or a
file) owned by another user (root excepted) or writable by group or others
(:class:`UnsafeCacheError`, which says so). Where the cache cannot be created or written (a
read-only home), the library is built into a fresh ``tempfile.mkdtemp(prefix="dlion-")``
directory of this process (mode 0o700, a name no one can guess or create first), removed at
exit: each process then compiles again.

**Not in the wheel.** The wheel stays pure Python (``py3-none-any``), installable anywhere
torch is. Shipping the compiled library would make it one wheel per OS and architecture
(manylinux, macOS, aarch64 builds in CI), for a file that takes under a second to build,
only ``fused=True`` needs, and whose absence costs speed, not results. Where compute nodes
have no compiler, run ``dlion kernels`` once where there is one, into the cache they read.

CPU only. On CUDA the same passes are a small part of a step.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["load", "load_error", "loaded_path", "fused_error", "UnsafeCacheError", "tuned", "supported", "available",
           "sign_and_pack", "momentum_update_", "lion_update_", "apply_codes_",
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
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC"]
_TUNE_FLAGS = ["-march=native"]

#: What ``fused=False`` costs instead, for the error messages.
FALLBACK_COST = ("the same values, but the elementwise work runs as separate tensor operations (one pass over "
                 "memory per operation, one call per tensor): on one CPU thread a Lion step takes several times as "
                 "long")

_lock = threading.RLock()
_library: Optional[ctypes.CDLL] = None  # set once, by load()
_library_path: Optional[Path] = None
_scratch: Optional[Path] = None  # this process's private build directory where the cache is read-only


class UnsafeCacheError(OSError):
    """The cache directory (or a library in it) could be written by another user: dlion does not
    load native code from there."""


def _cache_dir() -> Path:
    """``$DLION_CACHE_DIR``, else ``$XDG_CACHE_HOME/dlion``, else ``~/.cache/dlion`` (read now, not
    at import)."""
    base = os.environ.get("DLION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dlion")
    return Path(base)


def _check_private(path: Path, what: str = "directory") -> None:
    """Refuse a directory or library that another user could have written: owned by someone other
    than this user (or root), or writable by group or others."""
    st = path.stat()
    problems = []
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        problems.append(f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    who = [w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if who:
        problems.append(f"it is writable by {' and '.join(who)} (mode {stat.S_IMODE(st.st_mode):o})")
    if problems:
        raise UnsafeCacheError(
            f"dlion.kernels will not load native code from the {what} {path}: {'; '.join(problems)}, so another "
            "user could replace the library it loads. Use a directory only you can write: `chmod go-w` it, or set "
            "$DLION_CACHE_DIR to one (it is created with mode 700)")


def _writable_cache() -> Optional[Path]:
    """The cache directory, created (mode 0o700) if need be and checked; None where it cannot be
    created or written (a read-only home). An unsafe directory raises :class:`UnsafeCacheError`."""
    path = _cache_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    _check_private(path)
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _scratch_dir() -> Path:
    """A fresh private directory for this process (``tempfile.mkdtemp``: mode 0o700, a name no one
    can guess), removed at exit: where the library is built when the cache cannot be written."""
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="dlion-"))
        atexit.register(shutil.rmtree, str(_scratch), True)
    return _scratch


def tuned() -> bool:
    """``DLION_NATIVE_TUNE=1``: build for this CPU (``-march=native``), the portable build otherwise."""
    return os.environ.get("DLION_NATIVE_TUNE", "0") not in ("", "0")


def _cpu_identity() -> str:
    """What -march=native depends on: a library tuned for one CPU must not be loaded on another
    (a shared home directory on a mixed cluster)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _variants() -> list[tuple[list[str], str]]:
    """(flags, library file name) to try, best first. The name is keyed by the source, the flags
    and the platform, and by the CPU only for a tuned build (so one portable library serves every
    x86-64, or every aarch64, machine that shares the cache). Not by the compiler: any compiler
    given these flags computes the same values."""
    source = _SOURCE.read_bytes()
    out = []
    for flags in ([_BASE_FLAGS + _TUNE_FLAGS] if tuned() else []) + [_BASE_FLAGS]:
        parts = [source, " ".join(flags).encode(), platform.system().encode(), platform.machine().encode()]
        if flags is not _BASE_FLAGS:
            parts.append(_cpu_identity().encode())
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
        out.append((flags, f"kernels-{key}.so"))
    return out


def _compiler() -> list[str]:
    """``$CC`` (split like a shell word list: ``ccache gcc`` works), else cc, gcc or clang on PATH."""
    cc = shlex.split(os.environ.get("CC", ""))
    if cc:
        found = shutil.which(cc[0])
        if not found:
            raise FileNotFoundError(f"$CC is {os.environ['CC']!r}, and {cc[0]!r} is not an executable")
        return [found, *cc[1:]]
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        raise FileNotFoundError("no C compiler found (no cc, gcc or clang on PATH, and $CC is not set)")
    return [found]


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.dl_init()
    _declare(lib)
    return lib


def _find_or_build() -> tuple[ctypes.CDLL, Path]:
    """For each variant (:func:`_variants`): the library in the cache (or in this process's scratch
    directory) if it is there, else built with the C compiler. The cache is looked in before any
    compiler is looked for, so a library built earlier is used where none is installed."""
    cache = _cache_dir()
    writable = _writable_cache()  # (creates it; UnsafeCacheError for one that others can write)
    dirs = []
    if cache.is_dir():
        _check_private(cache)
        dirs.append(cache)
    if _scratch is not None:
        dirs.append(_scratch)
    notes: list[str] = []
    cc: Optional[list[str]] = None
    no_cc: Optional[OSError] = None
    for flags, name in _variants():
        for where in dirs:
            path = where / name
            if path.is_file():
                try:
                    _check_private(path, "file")
                    return _open(path), path
                except (OSError, AttributeError) as e:  # (someone else's, or built against another C library)
                    notes.append(f"{path}: {e}")
        if cc is None and no_cc is None:
            try:
                cc = _compiler()
            except OSError as e:
                no_cc = e
        if cc is None:
            continue
        target = (writable or _scratch_dir()) / name
        tmp = target.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            proc = subprocess.run([*cc, *flags, str(_SOURCE), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                notes.append(f"{' '.join(cc + flags)}: {proc.stderr.strip()[-400:]}")
                continue
            os.chmod(tmp, 0o755)  # (whatever the umask: no one else may write what is loaded)
            os.replace(tmp, target)  # atomic: ranks that build at once each load a whole file
        finally:
            tmp.unlink(missing_ok=True)
        try:
            return _open(target), target
        except (OSError, AttributeError) as e:
            notes.append(f"{target}: {e}")
    if no_cc is not None:
        looked = ", ".join(str(d) for d in dirs) or f"{cache} (not there)"
        raise FileNotFoundError(f"{no_cc}, and no library built for this version of {_SOURCE.name} in {looked}"
                                + "".join(f"\n{n}" for n in notes))
    raise OSError(f"building {_SOURCE.name} failed:\n" + "\n".join(notes))


def load() -> ctypes.CDLL:
    """Load the native library, building it first if it is not in the cache; what ``fused=True``
    calls at construction. Raises :class:`RuntimeError` saying what to do where it cannot."""
    global _library, _library_path
    lib = _library
    if lib is not None:
        return lib
    with _lock:
        if _library is None:
            try:
                _library, _library_path = _find_or_build()
            except (OSError, subprocess.SubprocessError) as e:
                raise RuntimeError(fused_error({None: f"{type(e).__name__}: {e}"})) from e
        return _library


def load_error() -> Optional[str]:
    """:func:`load`, but the reason it failed as a string (None where it loaded): what ranks
    exchange at construction so that every one raises the same :func:`fused_error`."""
    try:
        load()
        return None
    except RuntimeError as e:
        cause = e.__cause__
        return f"{type(cause).__name__}: {cause}" if cause is not None else str(e)


def fused_error(reasons: dict) -> str:
    """The message of ``fused=True`` where the library cannot be loaded: ``reasons`` maps a rank
    (None: this process) to why."""
    ranks = [r for r in reasons if r is not None]
    where = "; ".join(reason if len(reasons) == 1 else f"rank {rank}: {reason}" for rank, reason in reasons.items())
    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    unsafe = "UnsafeCacheError" in where
    todo = ("give it a cache directory only its user can write ($DLION_CACHE_DIR)" if unsafe else
            "install a C compiler (gcc or clang; or set $CC to one) on every machine, or build the library once "
            "where there is one (`dlion kernels`) into a cache directory the others read ($DLION_CACHE_DIR)")
    return (f"fused=True: dlion's native kernels cannot be loaded{on} ({where}). To use them, {todo}. Or use "
            f"fused=False: {FALLBACK_COST}.")


def loaded_path() -> Optional[Path]:
    """The file the library was loaded from (None until :func:`load`)."""
    return _library_path


def _lib() -> ctypes.CDLL:
    """The library, for the fused kernels (loaded at construction by ``fused=True``)."""
    lib = _library
    return lib if lib is not None else load()


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


def available() -> bool:
    """Whether the codec helpers use the native library: only where it is already loaded (by a
    ``fused=True`` optimizer, or :func:`load`); this never builds anything. ``DLION_NATIVE=0``: never."""
    return _library is not None and os.environ.get("DLION_NATIVE", "1") != "0"


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
        _library.dl_pack_positive(v.data_ptr(), v.numel(), out.data_ptr())
        return out
    return torch.from_numpy(np.packbits(v.numpy() > 0, bitorder="little"))


def pack_positive_counting(values: Tensor, count: int) -> tuple[Tensor, int]:
    """(:func:`pack_positive` of ``values``, how many of values[:count] are 0) in one pass."""
    v = values.contiguous()
    if v.numel() % 8:
        raise ValueError(f"pack_positive needs a length that is a multiple of 8, got {v.numel()}")
    if available():
        out = torch.empty(v.numel() // 8, dtype=torch.uint8)
        zeros = _library.dl_pack_positive_count_zeros(v.data_ptr(), v.numel(), out.data_ptr(),
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
        _library.dl_unpack_signs(p.data_ptr(), n, out.data_ptr())
        return out
    bits = np.unpackbits(p.numpy(), count=n, bitorder="little").view(np.int8)
    return torch.from_numpy(bits * np.int8(2) - np.int8(1))


def count_zeros(values: Tensor) -> int:
    """How many of the int8 ``values`` (CPU) are 0."""
    v = values.contiguous()
    if available():
        return int(_library.dl_count_zeros(v.data_ptr(), v.numel()))
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
    _library.dl_majority(n, pointers, w, max(0, min(real, 8 * w)), gt.ctypes.data, eq.ctypes.data, counts)
    return gt, eq, int(counts[0]), int(counts[1])


def main(argv: Sequence[str] = ()) -> int:
    """``dlion kernels``: find or build the library now (e.g. in an image that has a compiler, for
    machines that will not) and print the file it was loaded from."""
    import argparse

    ap = argparse.ArgumentParser(prog="dlion kernels", description=main.__doc__.split(": ", 1)[1])
    ap.parse_args(list(argv))
    try:
        load()
    except RuntimeError as e:
        print(f"dlion kernels: {e}", file=sys.stderr)
        return 1
    print(loaded_path())
    return 0
