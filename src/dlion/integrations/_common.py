"""What the framework adapters share: unwrapping optimizers, per-step communication
figures, per-rank optimizer files, and checks that the private framework APIs the
adapters override are still there."""

from __future__ import annotations

import contextlib

import inspect
import os
import tempfile
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..distributed import DistributedLion

__all__ = ["TESTED_VERSIONS", "SUPPORTED_VERSIONS", "CommMeter", "comm_figures", "unwrap_optimizer", "rank_state_path",
           "save_rank_state", "load_rank_state", "rank_state_exists_everywhere", "to_cpu"]

#: The framework versions the adapters were written against and tested with
#: (``scripts/setup_env.sh`` installs exactly these for the test suite).
TESTED_VERSIONS = {"transformers": "5.23.0", "accelerate": "1.15.0", "lightning": "2.6.6"}

#: The versions the ``hf`` and ``lightning`` extras accept, ``[lowest, first excluded)``. The
#: lower bounds are the first releases with every private method the adapters override (and
#: the calls to it they rely on) as in the tested versions: transformers 5.3.0
#: (``Trainer.create_optimizer(model)``, ``_prepare_for_training``, ``_run_epoch``),
#: accelerate 1.14.0 (``prepare_model`` marks a model prepared and leaves a prepared one
#: alone), lightning 2.1.0 (``Trainer.save_checkpoint`` calls ``strategy.save_checkpoint``).
#: The upper bounds are the next major versions.
SUPPORTED_VERSIONS = {"transformers": ("5.3.0", "6"), "accelerate": ("1.14.0", "2"), "lightning": ("2.1.0", "3")}

RANK_FILE = "optimizer_rank{rank}.pt"
RANK_FORMAT = "dlion-rank-optimizer"
RANK_FORMAT_VERSION = 1

_warned: set = set()


def _release(v: str) -> tuple:
    """The numeric release part of a version string: "5.23.0.dev0" -> (5, 23, 0)."""
    import re

    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _pad(t: tuple, n: int = 4) -> tuple:
    return t + (0,) * (n - len(t))


def in_supported_range(package: str, have: str) -> bool:
    """Whether version ``have`` of ``package`` is in :data:`SUPPORTED_VERSIONS`' range."""
    low, high = SUPPORTED_VERSIONS[package]
    got = _pad(_release(have))
    return _pad(_release(low)) <= got < _pad(_release(high))


def check_version(package: str) -> None:
    """Warn (once) when ``package`` is outside the range the adapters support (and the
    ``hf`` / ``lightning`` extras accept), naming the versions they were tested with."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version(package)
    except PackageNotFoundError:  # e.g. a source checkout; nothing to compare
        return
    if in_supported_range(package, have) or package in _warned:
        return
    _warned.add(package)
    low, high = SUPPORTED_VERSIONS[package]
    warnings.warn(f"dlion.integrations supports {package}>={low},<{high} and was tested with {_tested()}; you have "
                  f"{package} {have}. The adapters override private {package} methods: their parameters are checked "
                  f"at import, but what the methods do may have changed, so check that checkpoints still hold "
                  f"every rank's optimizer state, or install a supported version (pip install 'dlion[hf]' or "
                  f"'dlion[lightning]').", stacklevel=3)


def _tested() -> str:
    return ", ".join(f"{k}=={v}" for k, v in TESTED_VERSIONS.items())


def _installed(cls: type) -> str:
    """"<package> <version>" of the framework that defines ``cls``, as far as it is known."""
    from importlib.metadata import PackageNotFoundError, version

    package = cls.__module__.split(".")[0]
    try:
        return f"{package} {version(package)}"
    except (PackageNotFoundError, ValueError):
        return f"{package} (version unknown)"


def require_method(cls: type, name: str, params: list[str]) -> None:
    """Raise a clear error when ``cls.name`` is gone or its parameters changed: an adapter
    that overrides a method the framework no longer calls would silently do nothing."""
    fn = getattr(cls, name, None)
    if fn is None or not callable(fn):
        raise RuntimeError(f"dlion.integrations: {cls.__module__}.{cls.__qualname__}.{name} no longer exists in "
                           f"{_installed(cls)}; this adapter overrides it (tested versions: {_tested()}).")
    got = list(inspect.signature(fn).parameters)
    if got != params:
        raise RuntimeError(f"dlion.integrations: {cls.__qualname__}.{name} has parameters {got} in {_installed(cls)}, "
                           f"the adapter that overrides it expects {params} (tested versions: {_tested()}).")


def unwrap_optimizer(opt: Any) -> Any:
    """The optimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``)."""
    seen = 0
    while not isinstance(opt, DistributedLion) and seen < 8:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            inner = getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt, seen = inner, seen + 1
    return opt


def anchored(*optimizers: Any):
    """Within the block, the parameters of every :class:`dlion.LocalDistributedLion` among
    ``optimizers`` hold the anchor the ranks agree on (its ranks train local copies between
    syncs); a no-op for every other optimizer. For evaluating and saving the model."""
    stack = contextlib.ExitStack()
    for opt in optimizers:
        inner = unwrap_optimizer(opt)
        if hasattr(inner, "anchored") and getattr(inner, "world_size", 1) > 1:
            stack.enter_context(inner.anchored())
    return stack


def require_dlion(opt: Any, where: str) -> DistributedLion:
    inner = unwrap_optimizer(opt)
    if not isinstance(inner, DistributedLion):
        raise TypeError(
            f"{where} trains without DistributedDataParallel, so the optimizer must be a dlion.DistributedLion "
            f"(it aggregates the ranks' updates itself); got {type(inner).__name__}. Any other optimizer would let "
            "the replicas drift apart.")
    return inner


# ---------------------------------------------------------------------------
# communication figures
# ---------------------------------------------------------------------------


def comm_figures(now: dict, before: Optional[dict], num_params: int, prefix: str = "comm/") -> dict:
    """Per-step communication figures between two ``CommStats.state_dict()`` snapshots
    (``before=None``: since the start): bytes sent and received per optimizer step,
    bits per parameter per step (sent + received, as
    ``CommStats.bits_per_param_per_step``), milliseconds per step that ``step()`` spent
    blocked on collectives, the fractions of the coordinates this rank decided the vote of
    where the vote was unanimous (|s| = N) or tied (s = 0) — when there were votes — and
    the total number of optimizer steps. Without a step in between, only the step count
    is returned."""
    before = before or {"bytes_sent": 0, "bytes_received": 0, "steps": 0}
    steps = now["steps"] - before["steps"]
    out = {f"{prefix}steps": float(now["steps"])}
    if steps <= 0:
        return out
    sent = now["bytes_sent"] - before["bytes_sent"]
    received = now["bytes_received"] - before["bytes_received"]
    out[f"{prefix}bytes_sent_per_step"] = sent / steps
    out[f"{prefix}bytes_received_per_step"] = received / steps
    out[f"{prefix}bits_per_param_per_step"] = 8.0 * (sent + received) / (num_params * steps) if num_params else 0.0
    out[f"{prefix}wait_ms_per_step"] = 1e3 * (now.get("wait_s", 0.0) - before.get("wait_s", 0.0)) / steps
    voted = now.get("voted", 0) - before.get("voted", 0)
    if voted > 0:
        out[f"{prefix}vote_unanimous_fraction"] = (now["unanimous"] - before.get("unanimous", 0)) / voted
        out[f"{prefix}vote_tied_fraction"] = (now["tied"] - before.get("tied", 0)) / voted
    return out


class CommMeter:
    """Reads ``opt.comm_stats`` and returns the figures of the optimizer steps since the
    previous :meth:`read` (a dict of floats, ready for ``self.log_dict``,
    ``accelerator.log`` or ``Trainer.log``)."""

    def __init__(self, optimizer: Any, prefix: str = "comm/"):
        self.optimizer = require_dlion(optimizer, "CommMeter")
        self.prefix = prefix
        self._last = self.optimizer.comm_stats.state_dict()

    def read(self) -> dict:
        now = self.optimizer.comm_stats.state_dict()
        out = comm_figures(now, self._last, self.optimizer.num_params, self.prefix)
        self._last = now
        return out

    def reset(self) -> None:
        """Start the next window here (e.g. after loading a checkpoint)."""
        self._last = self.optimizer.comm_stats.state_dict()


# ---------------------------------------------------------------------------
# per-rank optimizer files
# ---------------------------------------------------------------------------


def _world(opt: DistributedLion) -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized() and opt.world_size > 1:
        return True, opt.rank, opt.world_size
    return False, 0, 1


def _device(opt: DistributedLion) -> torch.device:
    ps = [p for g in opt.param_groups for p in g["params"]]
    return ps[0].device if ps else torch.device("cpu")


def _agree(opt: DistributedLion, error: Optional[BaseException], what: str) -> None:
    """Every rank raises if any rank failed (one tiny all-reduce), so no rank waits forever
    in a later collective for a rank that gave up."""
    distributed, rank, world = _world(opt)
    if not distributed:
        if error is not None:
            raise error
        return
    flags = torch.zeros(world, dtype=torch.int32, device=_device(opt))
    flags[rank] = 0 if error is None else 1
    dist.all_reduce(flags, group=opt.process_group)
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failed:
        raise RuntimeError(f"dlion: {what} failed on rank(s) {failed} (their errors say why); every rank stops.")


def rank_state_path(directory: str, rank: int) -> str:
    return os.path.join(os.fspath(directory), RANK_FILE.format(rank=rank))


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_rank_state(directory: str, optimizer: Any) -> str:
    """Collective: every rank writes its own optimizer state (its momenta, step counts and
    communication counters) to ``directory/optimizer_rank{r}.pt``, atomically (temporary
    file + rename). Raises on every rank if any rank fails. Returns this rank's path."""
    opt = require_dlion(optimizer, "save_rank_state")
    _, rank, world = _world(opt)
    path = rank_state_path(directory, rank)
    error = None
    try:
        os.makedirs(os.fspath(directory), exist_ok=True)
        payload = {"format": RANK_FORMAT, "version": RANK_FORMAT_VERSION, "rank": rank, "world_size": world,
                   "optimizer": to_cpu(opt.state_dict())}
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(path)))
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        error = e
    _agree(opt, error, f"saving the optimizer state to {os.fspath(directory)!r}")
    return path


def rank_state_exists_everywhere(directory: str, optimizer: Any) -> bool:
    """Collective: whether every rank finds its ``optimizer_rank{r}.pt`` in ``directory``."""
    opt = require_dlion(optimizer, "rank_state_exists_everywhere")
    distributed, rank, world = _world(opt)
    mine = os.path.isfile(rank_state_path(directory, rank))
    if not distributed:
        return mine
    t = torch.tensor([0 if mine else 1], dtype=torch.int32, device=_device(opt))
    dist.all_reduce(t, group=opt.process_group)
    return int(t.item()) == 0


def load_rank_state(directory: str, optimizer: Any) -> dict:
    """Collective: rank r loads ``directory/optimizer_rank{r}.pt`` into its optimizer.
    The checkpoint must come from a job with the same world size (checked: every rank
    raises otherwise, before any rank changes anything). Returns the file's payload."""
    opt = require_dlion(optimizer, "load_rank_state")
    _, rank, world = _world(opt)
    path = rank_state_path(directory, rank)
    error, payload = None, None
    try:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dlion: {path!r} does not exist; the checkpoint has no optimizer state for "
                                    f"rank {rank} (was it written by a dlion integration?).")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != RANK_FORMAT:
            raise ValueError(f"dlion: {path!r} is not a dlion per-rank optimizer file.")
        if payload["world_size"] != world or payload["rank"] != rank:
            raise ValueError(
                f"dlion: {path!r} was written by rank {payload['rank']} of {payload['world_size']}; this is rank "
                f"{rank} of {world}. Resume with the same number of processes (or convert the checkpoint with "
                "dlion.checkpoint, which can resize).")
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        error = e
    _agree(opt, error, f"loading the optimizer state from {os.fspath(directory)!r}")
    error = None
    try:
        opt.load_state_dict(payload["optimizer"])
    except Exception as e:  # noqa: BLE001
        error = e
    _agree(opt, error, "applying the loaded optimizer state")
    return payload


@torch.no_grad()
def broadcast_buffers(module: torch.nn.Module, optimizer: Any) -> None:
    """Start every rank from rank 0's buffers (BatchNorm statistics, ...). DistributedLion
    broadcasts the parameters at construction; DDP would also have broadcast the buffers."""
    opt = require_dlion(optimizer, "broadcast_buffers")
    distributed, _, _ = _world(opt)
    if not distributed:
        return
    src = dist.get_global_rank(opt.process_group, 0) if opt.process_group is not None else 0
    for b in module.buffers():
        if b.dtype == torch.bool:  # not every backend broadcasts bool
            u = b.to(torch.uint8)
            dist.broadcast(u, src=src, group=opt.process_group)
            b.copy_(u.bool())
        else:
            dist.broadcast(b, src=src, group=opt.process_group)
