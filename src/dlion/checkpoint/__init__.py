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
  that differ (:class:`dlion.DesyncError` on every rank, naming
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
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .common import (FORMAT_VERSION, MOMENTA_POLICIES, CheckpointError, CheckpointWarning, LoadInfo,
    _apply_optimizer_state, _group_info, _prepare)
from .sharded import READ_CHUNK_BYTES, _save_sharded, _ShardedSource
from .single import _TRAILER_LEN, MAGIC, _FileSource, _save_file, read_file

__all__ = ["save", "load", "read", "LoadInfo", "CheckpointError", "CheckpointWarning", "FORMAT_VERSION", "MAGIC",
           "READ_CHUNK_BYTES"]


def save(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: Any = None,
         extra: Any = None, verify_replicas: bool = True, sharded: bool = False, group=None) -> None:
    """Write a checkpoint of ``model`` (once) and every rank's ``optimizer`` state to ``path``.

    Collective: every rank of ``group`` (default: the world) must call it. Rank 0
    writes the file atomically; every rank returns normally only if the file was
    written, and raises the same error otherwise. ``step`` and ``extra`` (tensors,
    numbers, strings, lists/dicts of them) are stored as given and returned by
    :func:`load`. With ``verify_replicas`` rank 0 refuses to save parameters that
    differ between ranks (:class:`dlion.DesyncError`).

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
    return read_file(path)
