"""Where and when the native kernels are built (:mod:`dlion.kernels`): nothing for ``fused=False``,
a clear error at construction for ``fused=True`` (the same on every rank), portable flags, a
private cache, and a cached library used with no compiler installed.

"No compiler" is ``$CC`` naming a script that only records being called (or a path that does not
exist) and ``PATH`` an empty directory; the cache is a fresh directory. The loader reads the
environment when it runs, so each test (and each rank of the distributed one) sets its own."""

import os
import shutil
import stat

import pytest
import torch

import dlion
from dlion import kernels


def _recording_cc(tmp_path, then: str = "exit 1"):
    """A "compiler" that appends its arguments to a log, then runs ``then``."""
    log = tmp_path / "cc.log"
    script = tmp_path / "cc-recorder"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{then}\n')
    script.chmod(0o755)
    return script, log


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has loaded no library yet, its cache ``tmp_path/cache`` (not created)."""
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_library_path", None)
    monkeypatch.setattr(kernels, "_scratch", None)
    monkeypatch.delenv("DLION_NATIVE_TUNE", raising=False)
    monkeypatch.delenv("DLION_NATIVE", raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DLION_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def no_compiler(monkeypatch, tmp_path, fresh):
    """``fresh``, with no compiler: $CC a recorder that fails, PATH an empty directory. Returns
    (the cache, the recorder's log)."""
    script, log = _recording_cc(tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("PATH", str(empty))
    return fresh, log


def _params():
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(40, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def test_fused_false_compiles_nothing(no_compiler):
    """Catches: the codec helpers (pack, count zeros, decode, the packed vote) building the library
    on the first step of a fused=False optimizer."""
    cache, log = no_compiler
    from dlion.codec import SignCodec

    for opt in (dlion.Lion(_params(), lr=0.1), dlion.DistributedLion(_params(), lr=0.1),
                dlion.LocalDistributedLion(_params(), lr=0.1, sync_every=2),
                dlion.HierarchicalDistributedLion(_params(), lr=0.1)):
        for _ in range(2):
            opt.step()
    v = torch.tensor([1, -1, 0, 1, 1, 0, -1, 1], dtype=torch.int8)
    assert kernels.pack_positive(v).tolist() == [0b10011001] and kernels.count_zeros(v) == 2
    assert SignCodec().decode(SignCodec().encode(v), 8).tolist() == [1, -1, -1, 1, 1, -1, -1, 1]
    import numpy as np

    assert kernels.majority(np.zeros((3, 4), dtype=np.uint8), 32) is None  # (the caller counts in numpy)
    assert not kernels.available() and kernels.loaded_path() is None
    assert not log.exists()  # no compiler was started
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("make", [
    lambda ps: dlion.Lion(ps, fused=True),
    lambda ps: dlion.DistributedLion(ps, fused=True),
    lambda ps: dlion.LocalDistributedLion(ps, fused=True, sync_every=2),
    lambda ps: dlion.HierarchicalDistributedLion(ps, fused=True),
    lambda ps: dlion.Lion([{"params": ps[:1]}, {"params": ps[1:], "fused": True}]),
], ids=["Lion", "DistributedLion", "LocalDistributedLion", "Hierarchical", "a fused group"])
def test_fused_true_without_a_compiler_fails_at_construction_saying_what_to_do(no_compiler, monkeypatch, make):
    """Catches: fused=True failing only at the first step, with no hint of the way out."""
    cache, log = no_compiler
    monkeypatch.setenv("CC", str(cache.parent / "no-such-compiler"))
    with pytest.raises(RuntimeError) as info:
        make(_params())
    text = str(info.value)
    for words in ("fused=True", "C compiler", "fused=False", "same values", "no-such-compiler"):
        assert words in text
    assert kernels.loaded_path() is None and not list(cache.glob("*.so"))


def test_the_cache_is_created_private_and_the_build_is_portable(fresh, monkeypatch, tmp_path):
    """Catches: -march=native / -fopenmp in the default flags, and a cache directory or library
    that others could write."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler here")
    script, log = _recording_cc(tmp_path, then=f'exec "{cc}" "$@"')
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("DLION_CACHE_DIR", str(fresh / "a" / "b"))
    opt = dlion.Lion(_params(), lr=0.1, fused=True)
    opt.step()
    where = fresh / "a" / "b"
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert kernels.loaded_path().parent == where
    assert not stat.S_IMODE(kernels.loaded_path().stat().st_mode) & 0o022
    args = log.read_text().split()
    assert "-ffp-contract=off" in args and "-O3" in args
    assert not any(a.startswith("-march") or "openmp" in a for a in args)
    assert not list(where.glob("*.tmp"))
    # $XDG_CACHE_HOME/dlion where $DLION_CACHE_DIR is not set
    monkeypatch.delenv("DLION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels._cache_dir() == tmp_path / "xdg" / "dlion"


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o757])
def test_a_cache_directory_others_can_write_is_refused(no_compiler, mode):
    """Catches: loading a shared library from a directory another user can write into."""
    cache, log = no_compiler
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(RuntimeError, match="writable by") as info:
        kernels.load()
    assert isinstance(info.value.__cause__, kernels.UnsafeCacheError)
    assert "DLION_CACHE_DIR" in str(info.value) and not log.exists()  # refused before any compiler


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to hand a directory to another uid")
def test_a_cache_directory_of_another_user_is_refused(no_compiler):
    cache, log = no_compiler
    cache.mkdir(mode=0o700)
    os.chown(cache, 54321, -1)
    with pytest.raises(RuntimeError, match="owned by uid 54321"):
        kernels.load()


def test_a_cached_library_is_used_with_no_compiler_installed(fresh, monkeypatch, tmp_path):
    """Catches: looking for a compiler before looking in the cache (a machine whose compiler was
    removed, or one given a cache built elsewhere with ``dlion kernels``)."""
    if shutil.which("cc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler here")
    assert kernels.main([]) == 0  # dlion kernels: build it into the cache now
    built = kernels.loaded_path()
    stamp = built.stat().st_mtime_ns
    # a later process, on a machine without a compiler
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_library_path", None)
    script, log = _recording_cc(tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("PATH", str(empty))
    ps = _params()
    ref = [p.detach().clone() for p in ps]
    opt = dlion.Lion(ps, lr=0.1, fused=True)
    opt.step()
    assert kernels.loaded_path() == built and built.stat().st_mtime_ns == stamp and not log.exists()
    assert not torch.equal(ps[0].detach(), ref[0])
    # a library in the cache that others could write is not loaded: with no compiler, an error that says so
    monkeypatch.setattr(kernels, "_library", None)
    built.chmod(0o775)
    with pytest.raises(RuntimeError, match="writable by its group"):
        kernels.load()


def test_a_read_only_cache_falls_back_to_a_fresh_private_directory(fresh, monkeypatch, tmp_path):
    """Catches: the fixed name dlion-<uid> in the shared temporary directory, which another user
    can create first."""
    if shutil.which("cc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler here")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("DLION_CACHE_DIR", str(blocker / "dlion"))  # cannot be created (as under a read-only home)
    kernels.load()
    where = kernels.loaded_path().parent
    assert where.name.startswith("dlion-") and where.name != f"dlion-{os.getuid()}"
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert kernels.available()


def test_only_a_tuned_build_is_keyed_by_the_cpu(fresh, monkeypatch):
    """Catches: a portable library rebuilt for every CPU type of a cluster sharing a home."""
    names = {}
    for cpu in ("flags : sse2", "flags : sse2 avx512f"):
        monkeypatch.setattr(kernels, "_cpu_identity", lambda cpu=cpu: cpu)
        monkeypatch.delenv("DLION_NATIVE_TUNE", raising=False)
        (flags, portable), = kernels._variants()
        assert "-march=native" not in flags
        monkeypatch.setenv("DLION_NATIVE_TUNE", "1")
        (tflags, tuned), (_, fallback) = kernels._variants()
        assert "-march=native" in tflags and fallback == portable
        names[cpu] = portable, tuned
    (p1, t1), (p2, t2) = names.values()
    assert p1 == p2 and t1 != t2


# -- every rank raises the same error where one rank cannot build the kernels -----------------------
def _one_rank_without_a_compiler(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    from dlion.integrations.ddp import DLionHookState

    # (forked from the test process: start like a fresh one, then this rank's own environment)
    kernels._library = kernels._library_path = kernels._scratch = None
    os.environ.pop("DLION_NATIVE_TUNE", None)
    cache = os.path.join(tmp, f"cache-{rank}")
    os.environ["DLION_CACHE_DIR"] = cache
    log = os.path.join(tmp, "cc.log")  # (rank 1's $CC writes it if it is ever started)
    if rank == 1:
        os.makedirs(os.path.join(tmp, "empty-bin"), exist_ok=True)
        os.environ["PATH"] = os.path.join(tmp, "empty-bin")
        os.environ["CC"] = os.path.join(tmp, "cc-recorder")
    else:
        os.environ.pop("CC", None)
    # fused=False: steps on every rank, nothing compiled anywhere
    opt = dlion.DistributedLion(_params(), lr=0.1, comm="1bit")
    for _ in range(2):
        opt.step()
    compiled_nothing = not os.path.exists(cache) and not os.path.exists(log) and not kernels.available()
    # every rank has looked before rank 1 starts its $CC below (it writes the shared log): without this a
    # loaded machine let rank 1 get there first and another rank see the log ("compiled" on fused=False)
    torch.distributed.barrier()
    errors = []
    for make in (lambda: dlion.DistributedLion(_params(), lr=0.1, fused=True),
                 lambda: dlion.HierarchicalDistributedLion(_params(), lr=0.1, fused=True,
                                                           mesh=init_device_mesh("cpu", (1, world),
                                                                                 mesh_dim_names=("node", "local"))),
                 lambda: DLionHookState(torch.nn.Linear(3, 2), comm="allgather", fused=True)):
        try:
            make()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return compiled_nothing, errors


def test_every_rank_raises_the_same_error_where_one_rank_has_no_compiler(tmp_path):
    """Catches: the ranks with a compiler failing later with Gloo's "connection closed by peer"
    while the one without raises alone."""
    from dlion.lab.spawn import spawn

    _recording_cc(tmp_path)  # (rank 1's $CC: records being called, compiles nothing)
    results = spawn(_one_rank_without_a_compiler, 3, str(tmp_path), timeout_s=90)
    assert [nothing for nothing, _ in results] == [True] * 3
    errors = [e for _, e in results]
    for per_rank in zip(*errors):  # each construction: one error, the same on every rank
        assert per_rank[0] is not None and len(set(per_rank)) == 1
        assert "on rank 1" in per_rank[0] and "C compiler" in per_rank[0] and "fused=False" in per_rank[0]
