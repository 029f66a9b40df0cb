"""Checkpoints of a data-parallel job: the model once, and *every* rank's optimizer state.

Distributed Lion keeps one momentum per rank and never synchronises them
(Liu et al. 2024, arXiv 2404.00438), so rank 0's ``optimizer.state_dict()``
alone loses N − 1 of them and a resumed run would no longer follow the
run that never stopped. :func:`save` therefore gathers every rank's optimizer
state to rank 0 (``torch.distributed.gather_object``), and rank 0 writes one
file. :func:`load` gives rank r the state that rank r saved, so training
continues *bitwise* as if it had never stopped (same world size, same data
order, same hyperparameters).

Design choices
--------------
* **One file, written by rank 0.** Rank 0 holds N copies of the optimizer
  state while saving (N × the momenta, in CPU memory). That is simple and
  atomic; for a job whose N momenta should not pass through one process, use
  ``sharded=True`` (below).
* **Atomic.** Rank 0 writes to a temporary file in the same directory,
  ``fsync``\\ s it, and ``os.replace``\\ s it over ``path`` (then fsyncs the
  directory). A crash or an exception mid-save leaves the previous checkpoint
  untouched and removes the temporary file. Every rank learns whether the save
  worked: a failed save raises on *all* ranks.
* **Verified.** The file is ``MAGIC`` line, payload (a ``torch.save`` archive),
  trailer with the payload's length and SHA-256. :func:`load` rejects a file
  whose magic, length or checksum is wrong (truncated, corrupted, not a dlion
  checkpoint) with :class:`CheckpointError`, and reads the payload with
  ``torch.load(weights_only=True)`` (no arbitrary code runs).
* **Replicas checked while saving.** Each rank sends a digest of each of its
  parameters along with its optimizer state; rank 0 refuses to save replicas
  that differ (:class:`dlion.distributed.DesyncError` on every rank, naming
  the first parameter that differs). This adds no collective and does not
  touch the optimizer's communication counters.
* **RNG.** Every rank's torch CPU (and, if initialised, CUDA) RNG state is
  saved and restored when the world size is unchanged, so dropout and
  ``torch.randint`` batch sampling continue identically.

Resuming at another world size
------------------------------
A checkpoint written by N ranks can be loaded by M ≠ N ranks (unless
``strict=True``). Parameters are identical everywhere, so only the per-rank
optimizer state needs a policy (``momenta=``):

* ``"mean"`` (default): every rank starts from the element-wise mean of the N
  saved momenta (a never-created momentum counts as zero, which is what it
  would have been). This is what Lion Cub's momentum synchronisation would
  produce; each rank's momenta then diverge again with its own data.
* ``"modulo"``: rank r takes saved rank r mod N's state as it is.

Scalars (per-parameter step counts, which are equal on every rank) and the
communication counters come from saved rank r mod N. The RNG state is not
restored after a resize. :func:`load` emits a :class:`CheckpointWarning` and
returns a :class:`LoadInfo` that says what it did.

Sharded checkpoints (``save(..., sharded=True)``)
------------------------------------------------
For jobs whose N momenta should not pass through one process, :func:`save` with
``sharded=True`` writes a ``torch.distributed.checkpoint`` (DCP) directory with
``dcp.save``: one ``__<rank>_0.distcp`` file per rank plus DCP's ``.metadata``.
Rank r writes its own momenta under keys of its own,
``optimizer.rank<r>.state.<param id>.<name>`` (DCP's default planner keeps only
one copy of a tensor offered under the same key by several ranks, so per-rank
state needs per-rank keys), and ``dlion.rank<r>``: the rest of its
``optimizer.state_dict()`` (step counts, communication counters, wire formats,
``skipped_steps``) and its RNG state, as ``torch.save`` bytes. Every rank offers
the parameters as ``model.<name>`` and DCP writes each once, spread over the
ranks; buffers (rank-local, e.g. BatchNorm statistics) are rank 0's. Rank 0 adds
``dlion.header`` (format, version, world size, step, extra, optimizer config and
class, model keys, a random save id). The state is built here from
``optimizer.state_dict()``, not with ``get_optimizer_state_dict`` (which drops
``state_dict()["dlion"]`` and may run a step to create state). The directory is
written next to ``path`` and renamed over it by rank 0 once every rank has
written, so a failed save leaves the previous checkpoint; DCP's writer needs a
filesystem that every rank sees.

:func:`load` recognises a directory. Each rank reads only what it needs, with
``dcp.load(no_dist=True)`` (no collectives inside DCP) in groups of at most
:data:`READ_CHUNK_BYTES`: at the same world size, the model and rank r's own
entries; with ``"modulo"``, saved rank r mod N's; with ``"mean"``, all N saved
momenta, one group at a time into fp64 sums. Momenta go in through
``optimizer.load_state_dict``, so :class:`dlion.DistributedLion`'s state stays a
view of its flat bucket buffers.

Every call is collective when a process group is initialised: all ranks call
:func:`save` and :func:`load` together (like ``dist.barrier``). :func:`load`
applies nothing unless every rank has read and checked what it needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["save", "load", "read", "LoadInfo", "CheckpointError", "CheckpointWarning", "FORMAT_VERSION", "MAGIC",
           "READ_CHUNK_BYTES"]

FORMAT_VERSION = 1
MAGIC = b"DLION-CHECKPOINT\n"
_TRAILER_TAG = b"\nDLION-SHA256 "
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1 + 20 + 1  # tag, hex digest, space, 20-digit length, newline
MOMENTA_POLICIES = ("mean", "modulo")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or applied (the message says why)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was applied with an adaptation (another world size or optimizer config)."""


@dataclass
class LoadInfo:
    """What :func:`load` did on this rank."""

    path: str
    step: Any
    extra: Any
    saved_world_size: int
    world_size: int
    rank: int
    policy: str                  # "exact", "mean", "modulo" or "none" (no optimizer state applied)
    source_ranks: list = field(default_factory=list)  # saved ranks this rank's optimizer state came from
    rng_restored: bool = False
    config_changes: dict = field(default_factory=dict)  # key -> (saved, current)
    message: str = ""


# ---------------------------------------------------------------------------
# process group helpers
# ---------------------------------------------------------------------------


def _group_info(group) -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(group), dist.get_world_size(group)
    return False, 0, 1


def _gather_to_root(obj, group, world: int) -> Optional[list]:
    rank = dist.get_rank(group)
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, group=group, group_dst=0)
    return out


def _broadcast_from_root(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


# ---------------------------------------------------------------------------
# file format
# ---------------------------------------------------------------------------


class _HashingWriter(io.RawIOBase):
    """A write-only stream that forwards to ``f`` and hashes what passes through."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        self.f.write(b)
        self.sha.update(b)
        self.n += len(b)
        return len(b)


def _write_atomic(path: str, payload: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp makes 0600 files; use what open() would have made
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            w = _HashingWriter(f)
            torch.save(payload, w)
            f.write(_TRAILER_TAG + w.sha.hexdigest().encode() + b" " + b"%020d" % w.n + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)  # make the rename itself durable


def _file_mode(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777  # replacing a checkpoint keeps its permissions
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _check_save_path(path: str) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint path {path!r} is a directory; give a file path such as "
                                f"{os.path.join(path, 'checkpoint.pt')!r} (or pass sharded=True to write a "
                                "sharded checkpoint directory).")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: directory {directory!r} does not exist.")
    return path


def read(path) -> dict:
    """Read and verify a checkpoint file; return its payload (no process group needed).

    For a sharded checkpoint (a directory) this returns its header only: format,
    version, ``layout="sharded"``, world size, step, extra, optimizer config and
    class, the model's keys, ``save_id`` (the tensors stay on disk).

    Raises ``FileNotFoundError``, ``IsADirectoryError`` or :class:`CheckpointError`
    (not a dlion checkpoint, truncated, checksum mismatch, unsupported version)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _ShardedSource(path).header
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist.")
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path!r} is not a dlion checkpoint (its first bytes are not {MAGIC!r}).")
    trailer = data[-_TRAILER_LEN:]
    if len(data) < len(MAGIC) + _TRAILER_LEN or not trailer.startswith(_TRAILER_TAG) or not trailer.endswith(b"\n"):
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted: its checksum trailer is missing "
                              f"({len(data)} bytes).")
    try:
        digest = trailer[len(_TRAILER_TAG):len(_TRAILER_TAG) + 64].decode("ascii")
        length = int(trailer[len(_TRAILER_TAG) + 65:-1])
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"checkpoint {path!r} is corrupted: unreadable checksum trailer.") from None
    payload = memoryview(data)[len(MAGIC):len(data) - _TRAILER_LEN]
    if len(payload) != length:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted: payload has {len(payload)} bytes, "
                              f"the trailer says {length}.")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise CheckpointError(f"checkpoint {path!r} is corrupted: SHA-256 of the payload is {actual[:16]}…, "
                              f"the file records {digest[:16]}….")
    try:
        obj = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # checksum matched, so the writer put something unloadable in it
        raise CheckpointError(f"checkpoint {path!r} passed its checksum but cannot be loaded safely: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != "dlion-checkpoint":
        raise CheckpointError(f"checkpoint {path!r} has an unexpected payload.")
    if obj.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {obj.get('version')!r}; this dlion "
                              f"reads version {FORMAT_VERSION}.")
    return obj


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _optimizer_config(opt_sd: Optional[dict]) -> dict:
    if not opt_sd or "dlion" not in opt_sd:
        return {}
    d = opt_sd["dlion"]
    return {k: d[k] for k in ("vote", "ties", "seed", "aggregate", "world_size") if k in d}


def _check_loadable(obj, what: str) -> None:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{what} cannot be stored: checkpoints are read with torch.load(weights_only=True), "
                              f"which only accepts tensors, numbers, strings, bytes, None and "
                              f"lists/tuples/dicts of these ({e}).") from e


def save(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: Any = None,
         extra: Any = None, verify_replicas: bool = True, sharded: bool = False, group=None) -> None:
    """Write a checkpoint of ``model`` (once) and every rank's ``optimizer`` state to ``path``.

    Collective: every rank of ``group`` (default: the world) must call it. Rank 0
    writes the file atomically; every rank returns normally only if the file was
    written, and raises the same error otherwise. ``step`` and ``extra`` (tensors,
    numbers, strings, lists/dicts of them) are stored as given and returned by
    :func:`load`. With ``verify_replicas`` rank 0 refuses to save parameters that
    differ between ranks (:class:`dlion.distributed.DesyncError`).

    The file holds: format version, world size, the optimizer's dlion config
    (vote, ties, seed, aggregate), step, extra, the model's ``state_dict()``,
    the list of every rank's ``optimizer.state_dict()``, every rank's RNG state,
    and a SHA-256 of all that.

    ``sharded=True`` writes a ``torch.distributed.checkpoint`` directory at ``path``
    instead: every rank writes its own momenta (and its share of the model) in
    parallel, and no rank ever holds another rank's state (see the module docstring).
    """
    # An optimizer whose ranks hold local parameters between syncs (dlion.LocalDistributedLion) keeps
    # them in its state; the model is saved (and compared) as the anchor the ranks agree on.
    opt_sd = optimizer.state_dict() if optimizer is not None else None
    anchored = getattr(optimizer, "anchored", None)
    with anchored() if anchored is not None else contextlib.nullcontext():
        if sharded:
            return _save_sharded(path, model, optimizer, step, extra, verify_replicas, group, opt_sd)
        return _save_file(path, model, optimizer, step, extra, verify_replicas, group, opt_sd)


def _save_file(path, model, optimizer, step, extra, verify_replicas, group, opt_sd) -> None:
    distributed, rank, world = _group_info(group)
    path, error = _checked_save_args(model, path, extra, rank, _check_save_path)
    mine = None
    if error is None:
        mine = {
            "optimizer": opt_sd,
            "rng": _rng_state(),
            # Parameters must be identical on every rank; buffers (BatchNorm running statistics) are
            # rank-local, like DDP with broadcast_buffers=False, so they are not compared (rank 0's are saved).
            "digests": [(name, _tensor_digest(t.detach())) for name, t in model.named_parameters()]
                       if verify_replicas and distributed and world > 1 else None,
        }
    if distributed and world > 1:
        # Agree first on whether everyone can take part (a bad argument on one rank must not hang the others).
        oks: list = [None] * world
        dist.all_gather_object(oks, None if error is None else f"rank {rank}: {type(error).__name__}: {error}",
                               group=group)
        bad = [m for m in oks if m is not None]
        if bad:
            if error is not None:
                raise error
            raise CheckpointError(f"checkpoint save to {path!r} abandoned: {bad[0]}")
        everyone = _gather_to_root(mine, group, world)
    else:
        if error is not None:
            raise error
        everyone = [mine]
    outcome = None
    if rank == 0:
        try:
            if verify_replicas and world > 1:
                _compare_replicas(everyone)
            opt_states = [e["optimizer"] for e in everyone]
            payload = {
                "format": "dlion-checkpoint",
                "version": FORMAT_VERSION,
                "world_size": world,
                "step": step,
                "extra": extra,
                "optimizer_config": _optimizer_config(opt_states[0]),
                "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
                "model": model.state_dict(),
                "optimizer": opt_states if optimizer is not None else None,
                "rng": [e["rng"] for e in everyone],
                "torch_version": str(torch.__version__),
            }
            _write_atomic(path, payload)
        except Exception as e:
            outcome = e
    if distributed and world > 1:
        msg = None if outcome is None else (type(outcome).__name__, str(outcome))
        msg = _broadcast_from_root(msg, group)
        if rank != 0 and msg is not None:
            from .distributed import DesyncError
            cls = DesyncError if msg[0] == "DesyncError" else CheckpointError
            raise cls(f"checkpoint save to {path!r} failed on rank 0 ({msg[0]}): {msg[1]}")
    if outcome is not None:
        raise outcome


def _compare_replicas(everyone: list) -> None:
    from .distributed import DesyncError

    ref = everyone[0]["digests"]
    for r, e in enumerate(everyone[1:], start=1):
        for (name, a), (_, b) in zip(ref, e["digests"]):
            if a != b:
                raise DesyncError(f"refusing to save: parameter {name!r} differs between rank 0 and rank {r}; "
                                  "replicas have diverged.")


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def _check_model(path: str, saved: dict, model: nn.Module) -> None:
    current = model.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {', '.join(map(repr, missing[:5]))}"
                         + (" …" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"not in the model: {', '.join(map(repr, unexpected[:5]))}"
                         + (" …" if len(unexpected) > 5 else ""))
        raise CheckpointError(f"checkpoint {path!r} is for another model ({'; '.join(parts)}).")
    for k, v in current.items():
        s = saved[k]
        if tuple(s.shape) != tuple(v.shape):
            raise CheckpointError(f"checkpoint {path!r} is for another model: {k!r} has shape {tuple(s.shape)} "
                                  f"in the checkpoint and {tuple(v.shape)} in the model.")
        if s.dtype != v.dtype:
            raise CheckpointError(f"checkpoint {path!r} is for another model: {k!r} has dtype {s.dtype} in the "
                                  f"checkpoint and {v.dtype} in the model.")


def _mean_state(states: list[dict], src: dict) -> dict:
    """Element-wise mean over ranks of every floating tensor of ndim ≥ 1 in the per-parameter
    state (a rank without the entry counts as zero); everything else from ``src``."""
    n = len(states)
    out = {"state": {}, "param_groups": src["param_groups"]}
    if "dlion" in src:
        out["dlion"] = src["dlion"]
    keys = sorted({k for s in states for k in s["state"]}, key=lambda k: (str(type(k)), k))
    for pid in keys:
        per = [s["state"].get(pid, {}) for s in states]
        base = src["state"].get(pid) or next(p for p in per if p)
        entry = {}
        for name in {k for p in per for k in p}:
            vals = [p[name] for p in per if name in p]
            ref = base.get(name, vals[0])
            if isinstance(ref, torch.Tensor) and ref.is_floating_point() and ref.dim() >= 1:
                total = torch.zeros(ref.shape, dtype=torch.float64)
                for v in vals:
                    total += v.to(torch.float64)
                entry[name] = (total / n).to(ref.dtype)
            else:
                entry[name] = ref.clone() if isinstance(ref, torch.Tensor) else ref
        out["state"][pid] = entry
    return out


def _rank_option(optimizer: torch.optim.Optimizer, any_rank: bool) -> dict:
    """``from_rank="any"`` for a DistributedLion that deliberately takes another rank's state
    (a resized checkpoint: saved rank r mod N's, or the mean's record from it)."""
    from .distributed import DistributedLion

    return {"from_rank": "any"} if any_rank and isinstance(optimizer, DistributedLion) else {}


def _check_optimizer_state(path: str, sd: dict, optimizer: torch.optim.Optimizer, any_rank: bool = False) -> None:
    check = getattr(optimizer, "check_state_dict", None)  # an optimizer's own conditions (the hierarchical mesh)
    if check is not None:
        try:
            check(sd, **_rank_option(optimizer, any_rank))
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path!r}: {e}") from e
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = sd.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups) or \
            [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"checkpoint {path!r} has optimizer state for parameter groups of sizes "
            f"{[len(g['params']) for g in groups]}, the optimizer has {[len(g['params']) for g in optimizer.param_groups]}.")
    ids = [i for g in groups for i in g["params"]]
    where = {pid: k for k, pid in enumerate(ids)}
    for pid, st in sd["state"].items():
        p = params[where[pid]]
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and tuple(v.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"checkpoint {path!r}: optimizer state {name!r} of parameter {where[pid]} has shape "
                    f"{tuple(v.shape)}, the parameter has shape {tuple(p.shape)}.")


def _apply_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict, any_rank: bool = False) -> None:
    optimizer.load_state_dict(sd, **_rank_option(optimizer, any_rank))
    # torch.optim casts floating state to the parameter's dtype; Lion keeps fp32
    # momenta for bf16/fp16 parameters, so put the saved dtype back.
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    for k, pid in enumerate(ids):
        saved = sd["state"].get(pid)
        if not saved:
            continue
        state = optimizer.state[params[k]]
        for name, v in saved.items():
            if isinstance(v, torch.Tensor) and isinstance(state.get(name), torch.Tensor) and state[name].dtype != v.dtype:
                state[name] = v.to(device=state[name].device).clone()


class _FileSource:
    """A single-file checkpoint, read and verified by :func:`read` (every rank holds all of it)."""

    def __init__(self, obj: dict):
        self.obj = obj
        self.world_size = int(obj["world_size"])
        self.has_optimizer = obj.get("optimizer") is not None

    def model_entries(self) -> dict:
        return self.obj["model"]

    def model_state(self) -> dict:
        return self.obj["model"]

    def rank_state(self, r: int) -> dict:
        return self.obj["optimizer"][r]

    def mean_state(self, src: int) -> dict:
        states = self.obj["optimizer"]
        return _mean_state(states, states[src])

    def rng(self, r: int):
        rng = self.obj.get("rng")
        return rng[r] if rng else None


def _prepare(path, source, head, model, optimizer, info: LoadInfo, notes: list, momenta: str, strict: bool):
    """Check the checkpoint against the model and optimizer; return (this rank's optimizer state, model state)."""
    saved_world, world, rank = source.world_size, info.world_size, info.rank
    _check_model(path, source.model_entries(), model)
    opt_sd = None
    if optimizer is not None:
        if not source.has_optimizer:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state (it was saved with optimizer=None).")
        if head.get("optimizer_class") and head["optimizer_class"] != type(optimizer).__name__:
            raise CheckpointError(f"checkpoint {path!r} holds {head['optimizer_class']} state; the optimizer is a "
                                  f"{type(optimizer).__name__}.")
        current = _optimizer_config(optimizer.state_dict()) if hasattr(optimizer, "rule") else {}
        saved_cfg = dict(head.get("optimizer_config", {}))
        saved_cfg.pop("world_size", None)
        current.pop("world_size", None)
        info.config_changes = {k: (saved_cfg[k], current[k]) for k in saved_cfg
                               if k in current and saved_cfg[k] != current[k]}
        if info.config_changes:
            what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in info.config_changes.items())
            if strict:
                raise CheckpointError(f"checkpoint {path!r} was written with another optimizer config ({what}); "
                                      "strict=True.")
            notes.append(f"optimizer config changed ({what})")
        if saved_world == world:
            opt_sd = source.rank_state(rank)
            saved_rank = opt_sd.get("dlion", {}).get("rank", rank)
            if saved_rank != rank:
                raise CheckpointError(f"checkpoint {path!r}: entry {rank} holds rank {saved_rank}'s state.")
            info.policy, info.source_ranks = "exact", [rank]
        else:
            if strict:
                raise CheckpointError(f"checkpoint {path!r} was written by {saved_world} ranks; this job has "
                                      f"{world} (strict=True refuses to adapt the per-rank momenta).")
            if momenta == "mean":
                opt_sd = source.mean_state(rank % saved_world)
                info.source_ranks = list(range(saved_world))
            else:
                opt_sd = source.rank_state(rank % saved_world)
                info.source_ranks = [rank % saved_world]
            info.policy = momenta
            notes.append(f"resized {saved_world} -> {world} ranks: momenta = "
                         + ("mean of all saved ranks" if momenta == "mean" else f"saved rank {rank % saved_world}'s")
                         + f", counters from saved rank {rank % saved_world}")
        _check_optimizer_state(path, opt_sd, optimizer, any_rank=info.policy != "exact")
    elif saved_world != world and strict:
        raise CheckpointError(f"checkpoint {path!r} was written by {saved_world} ranks; this job has {world} "
                              "(strict=True).")
    model_sd = source.model_state()
    return opt_sd, model_sd


# ---------------------------------------------------------------------------
# sharded checkpoints: a torch.distributed.checkpoint (DCP) directory
# ---------------------------------------------------------------------------

#: Upper bound on the bytes one DCP read brings into memory while loading a sharded checkpoint
#: (tensors are read in groups of at most this size; one larger tensor is read alone).
READ_CHUNK_BYTES = 256 << 20
_HEADER_KEY = "dlion.header"
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp\Z")


def _rank_key(r: int) -> str:
    return f"dlion.rank{r}"


def _momentum_key(r: int, pid, name: str) -> str:
    return f"optimizer.rank{r}.state.{pid}.{name}"


def _to_bytes_tensor(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes_tensor(t: torch.Tensor, what: str):
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{what} cannot be loaded safely: {e}") from e


def _split_state(sd: dict) -> tuple[dict, list, dict]:
    """An optimizer ``state_dict()`` without its floating tensors of ndim ≥ 1 (the momenta, which are
    written as tensors of their own), the list of (param id, name) taken out, and those tensors."""
    rest_state, keys, tensors = {}, [], {}
    for pid, st in sd["state"].items():
        kept = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1:
                keys.append((pid, name))
                tensors[(pid, name)] = v.detach()
            else:
                kept[name] = v
        rest_state[pid] = kept
    return dict(sd, state=rest_state), keys, tensors


@contextlib.contextmanager
def _dcp_quiet():
    with warnings.catch_warnings():
        # no_dist=True is what we mean (each rank reads on its own), not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _ShardedSource:
    """A sharded checkpoint directory: metadata and header read at construction, tensors on demand
    (without collectives: each rank reads what it needs, in chunks of at most READ_CHUNK_BYTES)."""

    def __init__(self, path):
        import torch.distributed.checkpoint as dcp

        self._dcp = dcp
        self.path = os.fspath(path)
        if not os.path.exists(os.path.join(self.path, ".metadata")):
            raise IsADirectoryError(f"checkpoint path {self.path!r} is a directory without a '.metadata' file: not a "
                                    "sharded checkpoint (or an unfinished one).")
        try:
            self.meta = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.path!r}: cannot read its DCP metadata: {e}") from e
        if _HEADER_KEY not in self.meta:
            raise CheckpointError(f"{self.path!r} is a DCP checkpoint but not a dlion one (no {_HEADER_KEY!r}).")
        self.header = _from_bytes_tensor(self._read({_HEADER_KEY: self._empty(_HEADER_KEY)})[_HEADER_KEY],
                                         f"checkpoint {self.path!r}: header")
        h = self.header
        if not isinstance(h, dict) or h.get("format") != "dlion-checkpoint" or h.get("layout") != "sharded":
            raise CheckpointError(f"checkpoint {self.path!r} has an unexpected header.")
        if h.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {self.path!r} has format version {h.get('version')!r}; this dlion "
                                  f"reads version {FORMAT_VERSION}.")
        self.world_size = int(h["world_size"])
        self.has_optimizer = bool(h["has_optimizer"])
        self._ranks: dict = {}

    def _empty(self, key: str) -> torch.Tensor:
        m = self.meta.get(key)
        if m is None or not hasattr(m, "size"):
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {key!r}.")
        return torch.empty(tuple(m.size), dtype=m.properties.dtype)

    def _read(self, targets: dict) -> dict:
        try:
            with _dcp_quiet():
                self._dcp.load(targets, storage_reader=self._dcp.FileSystemReader(self.path), no_dist=True)
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.path!r}: reading {len(targets)} tensor(s) failed: {e}") from e
        return targets

    def _read_chunked(self, keys: list) -> dict:
        out, batch, size = {}, {}, 0
        for key in keys:
            t = self._empty(key)
            if batch and size + t.nbytes > READ_CHUNK_BYTES:
                out.update(self._read(batch))
                batch, size = {}, 0
            batch[key] = t
            size += t.nbytes
        if batch:
            out.update(self._read(batch))
        return out

    def model_entries(self) -> dict:
        """Stand-ins with the saved shapes and dtypes (for the checks; nothing is read)."""
        out = {}
        for k in self.header["model_keys"]:
            m = self.meta.get("model." + k)
            if m is None or not hasattr(m, "size"):
                raise CheckpointError(f"checkpoint {self.path!r} lists model entry {k!r} but does not hold it.")
            out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype, device="meta")
        return out

    def model_state(self) -> dict:
        keys = self.header["model_keys"]
        got = self._read_chunked(["model." + k for k in keys])
        return {k: got["model." + k] for k in keys}

    def _rank_entry(self, r: int) -> dict:
        if r not in self._ranks:
            key = _rank_key(r)
            self._ranks[r] = _from_bytes_tensor(self._read({key: self._empty(key)})[key],
                                                f"checkpoint {self.path!r}: rank {r}'s record")
        return self._ranks[r]

    def rank_state(self, r: int) -> dict:
        entry = self._rank_entry(r)
        sd = entry["optimizer"]
        keys = entry["tensors"]
        got = self._read_chunked([_momentum_key(r, pid, name) for pid, name in keys])
        state = {pid: dict(st) for pid, st in sd["state"].items()}
        for pid, name in keys:
            state[pid][name] = got[_momentum_key(r, pid, name)]
        return dict(sd, state=state)

    def mean_state(self, src: int) -> dict:
        """Like :func:`_mean_state` over the N saved ranks, reading one group of tensors of one
        rank at a time (memory: this rank's result plus one fp64 accumulator group)."""
        n = self.world_size
        entries = [self._rank_entry(r) for r in range(n)]
        base_sd = entries[src]["optimizer"]
        owners: dict = {}                     # (pid, name) -> saved ranks that have it, in rank order
        for r, e in enumerate(entries):
            for key in e["tensors"]:
                owners.setdefault(tuple(key), []).append(r)
        pids = sorted({pid for e in entries for pid in e["optimizer"]["state"]}
                      | {pid for pid, _ in owners}, key=lambda k: (str(type(k)), k))
        state = {}
        for pid in pids:
            base = base_sd["state"].get(pid)
            if base is None:
                base = next(e["optimizer"]["state"][pid] for e in entries if pid in e["optimizer"]["state"])
            state[pid] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
        # group the tensors so that one group's fp64 accumulators stay under READ_CHUNK_BYTES
        groups, cur, size = [], [], 0
        for key in owners:
            nb = self._empty(_momentum_key(owners[key][0], *key)).numel() * 8
            if cur and size + nb > READ_CHUNK_BYTES:
                groups.append(cur)
                cur, size = [], 0
            cur.append(key)
            size += nb
        if cur:
            groups.append(cur)
        for keys in groups:
            totals, dtypes = {}, {}
            for r in range(n):
                mine = [k for k in keys if r in owners[k]]
                got = self._read_chunked([_momentum_key(r, *k) for k in mine])
                for k in mine:
                    v = got[_momentum_key(r, *k)]
                    if k not in totals:
                        totals[k] = torch.zeros(v.shape, dtype=torch.float64)
                        dtypes[k] = v.dtype
                    if r == src:
                        dtypes[k] = v.dtype
                    totals[k] += v.to(torch.float64)
            for (pid, name), total in totals.items():
                state[pid][name] = (total / n).to(dtypes[(pid, name)])
        return dict(base_sd, state=state)

    def rng(self, r: int):
        return self._rank_entry(r).get("rng")


def _check_dir_path(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"cannot save a sharded checkpoint to {path!r}: it is a file (sharded=True writes "
                                 "a directory).")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: directory {parent!r} does not exist.")
    if os.path.isdir(path):
        other = [f for f in os.listdir(path) if f != ".metadata" and not _DCP_FILE.match(f)]
        if other:
            raise CheckpointError(f"refusing to replace {path!r}: it is a directory holding files that are not part "
                                  f"of a DCP checkpoint ({', '.join(map(repr, sorted(other)[:3]))}).")


def _checked_save_args(model, path, extra, rank: int, check_path: Callable[[str], Any]):
    """(the path as a string, None) after the checks a save makes before anything is written (the
    path and ``extra`` on rank 0 only: the others may not even see that directory), or (path, the
    error): every rank must learn of it before anyone raises."""
    try:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        path = os.fspath(path)
        if rank == 0:
            check_path(path)
            _check_loadable(extra, "extra")
    except Exception as e:
        return path, e
    return path, None


def _fsync_dir(directory: str) -> None:
    """fsync a directory (makes a rename in it durable); best effort where the OS refuses."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _save_sharded(path, model: nn.Module, optimizer, step, extra, verify_replicas: bool, group, opt_sd) -> None:
    import torch.distributed.checkpoint as dcp

    distributed, rank, world = _group_info(group)
    path, error = _checked_save_args(model, path, extra, rank, _check_dir_path)
    digests = None
    if error is None and verify_replicas and distributed and world > 1:
        digests = [(name, _tensor_digest(t.detach())) for name, t in model.named_parameters()]
    token = os.urandom(8).hex()
    if distributed and world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (None if error is None else f"rank {rank}: {type(error).__name__}: {error}",
                                          digests, token), group=group)
        bad = [m for m, _, _ in everyone if m is not None]
        if bad:
            if error is not None:
                raise error
            raise CheckpointError(f"checkpoint save to {path!r} abandoned: {bad[0]}")
        if verify_replicas:
            _compare_replicas([{"digests": d} for _, d, _ in everyone])  # the same verdict on every rank
        token = everyone[0][2]
    elif error is not None:
        raise error

    # What this rank writes. Parameters are identical everywhere: every rank offers them and DCP's planner
    # keeps one copy of each (written once, spread over the ranks). Buffers are rank-local: rank 0's.
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model_sd = model.state_dict()
    for k, v in model_sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"model state_dict entry {k!r} is a {type(v).__name__}, not a tensor; sharded "
                                  "checkpoints hold tensors only (use the single-file format).")
    sd = {"model." + k: v.detach() for k, v in model_sd.items() if k in params or rank == 0}
    record = {"optimizer": None, "tensors": [], "rng": _rng_state()}
    if optimizer is not None:
        rest, keys, tensors = _split_state(opt_sd)
        record.update(optimizer=rest, tensors=keys)
        for (pid, name), t in tensors.items():
            sd[_momentum_key(rank, pid, name)] = t   # this rank's momenta, under keys of its own
    sd[_rank_key(rank)] = _to_bytes_tensor(record)
    if rank == 0:
        sd[_HEADER_KEY] = _to_bytes_tensor({
            "format": "dlion-checkpoint", "version": FORMAT_VERSION, "layout": "sharded", "world_size": world,
            "step": step, "extra": extra, "save_id": token,
            "optimizer_config": _optimizer_config(record["optimizer"]),
            "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
            "has_optimizer": optimizer is not None, "model_keys": list(model_sd),
            "torch_version": str(torch.__version__)})

    # Written next to the target, then swapped in by rank 0: a failed save leaves the old checkpoint.
    parent, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    outcome = None
    try:
        with _dcp_quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), process_group=group,
                     no_dist=not (distributed and world > 1))
    except Exception as e:  # DCP reports a failed write on every rank
        outcome = e
    if rank == 0:
        try:
            if outcome is not None:
                raise outcome
            old = os.path.join(parent, f".{base}.old-{token}")
            if os.path.isdir(path):
                _check_dir_path(path)
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        except Exception as e:
            outcome = e
            shutil.rmtree(tmp, ignore_errors=True)
    if distributed and world > 1:
        msg = None if outcome is None else (type(outcome).__name__, str(outcome))
        msg = _broadcast_from_root(msg, group)
        if rank != 0 and msg is not None:
            raise CheckpointError(f"sharded checkpoint save to {path!r} failed ({msg[0]}): {msg[1]}")
    if outcome is not None:
        raise outcome


def load(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, momenta: str = "mean",
         strict: bool = False, restore_rng: bool = True, group=None) -> LoadInfo:
    """Load a checkpoint written by :func:`save` into ``model`` and (optionally) ``optimizer``.

    ``path`` is a checkpoint file, or a directory written with ``save(..., sharded=True)``
    (detected). Collective when a process group is initialised: every rank reads
    ``path`` and verifies it, and all ranks raise if any rank cannot (missing file on
    one host, a different file, a bad checksum). Nothing is modified until the
    checkpoint has been verified and checked against the model and optimizer.

    Same world size: rank r gets saved rank r's optimizer state and RNG state,
    so training continues bitwise. Another world size: ``momenta="mean"``
    (default) or ``"modulo"`` (see the module docstring); ``strict=True``
    raises instead, and also when the saved optimizer config (vote, ties, seed,
    aggregate) differs from ``optimizer``'s (otherwise that only warns).
    Returns a :class:`LoadInfo`.
    """
    if momenta not in MOMENTA_POLICIES:
        raise ValueError(f"momenta must be one of {', '.join(map(repr, MOMENTA_POLICIES))}, got {momenta!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    distributed, rank, world = _group_info(group)
    sharded = os.path.isdir(os.fspath(path))
    obj, error, ident = None, None, None
    try:
        if sharded:
            obj = _ShardedSource(path)
            ident = obj.header["save_id"]
        else:
            obj = read(path)
            with open(path, "rb") as f:
                f.seek(-_TRAILER_LEN, os.SEEK_END)
                ident = f.read()
    except Exception as e:
        error = e
    if distributed and world > 1:
        views: list = [None] * world
        dist.all_gather_object(views, (None if error is None else f"{type(error).__name__}: {error}", ident),
                               group=group)
        for r, (err, _) in enumerate(views):
            if err is not None:
                if error is not None:
                    raise error
                raise CheckpointError(f"rank {r} cannot read the checkpoint: {err}")
        if any(d != views[0][1] for _, d in views):
            raise CheckpointError(f"ranks read different checkpoints at {path!r} (their "
                                  f"{'save ids' if sharded else 'checksums'} differ); every rank must see the same "
                                  f"{'directory' if sharded else 'file'}.")
    elif error is not None:
        raise error
    path = os.fspath(path)
    head = obj.header if sharded else obj
    source = obj if sharded else _FileSource(obj)
    saved_world = source.world_size

    # -- check (and, for a sharded checkpoint, read) everything before changing anything ----------
    info = LoadInfo(path=path, step=head.get("step"), extra=head.get("extra"), saved_world_size=saved_world,
                    world_size=world, rank=rank, policy="none")
    notes: list = []
    try:
        opt_sd, model_sd = _prepare(path, source, head, model, optimizer, info, notes, momenta, strict)
        error = None
    except Exception as e:
        error = e
    if distributed and world > 1:  # apply only if every rank can (no half-loaded job)
        oks: list = [None] * world
        dist.all_gather_object(oks, None if error is None else f"{type(error).__name__}: {error}", group=group)
        for r, err in enumerate(oks):
            if err is not None:
                if error is not None:
                    raise error
                raise CheckpointError(f"rank {r} cannot load the checkpoint (nothing was changed): {err}")
    elif error is not None:
        raise error

    # -- apply ---------------------------------------------------------------
    with torch.no_grad():
        model.load_state_dict(model_sd, strict=True)
    if opt_sd is not None:
        _apply_optimizer_state(optimizer, opt_sd, any_rank=info.policy != "exact")
    rng = source.rng(rank) if restore_rng and saved_world == world else None
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        info.rng_restored = True
    elif restore_rng and saved_world != world:
        notes.append("RNG state not restored (world size changed)")
    info.message = f"loaded {path!r} (step {info.step}) on rank {rank}/{world}" + (
        ": " + "; ".join(notes) if notes else "")
    if notes:
        warnings.warn(info.message, CheckpointWarning, stacklevel=2)
    return info
