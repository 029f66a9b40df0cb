"""What both checkpoint formats share: errors, the load report, the process-group helpers, the
replica and model checks, the momentum policies of a resize and the optimizer state's checks and
application."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

FORMAT_VERSION = 1


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
    config = {k: d[k] for k in ("vote", "ties", "seed", "aggregate", "world_size") if k in d}
    config.update(d.get("options") or {})  # every setting of the rule (recorded since 0.3)
    return config


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


def _compare_replicas(everyone: list) -> None:
    from ..replicas import DesyncError

    ref = everyone[0]["digests"]
    for r, e in enumerate(everyone[1:], start=1):
        for (name, a), (_, b) in zip(ref, e["digests"]):
            if a != b:
                raise DesyncError(f"refusing to save: parameter {name!r} differs between rank 0 and rank {r}; "
                                  "replicas have diverged.")


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
    state (a rank without the entry counts as zero; one that every rank holds bitwise alike is kept
    as it is, not rounded through a mean); everything else from ``src``."""
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
                if len(vals) == n and all(torch.equal(v, vals[0]) for v in vals[1:]):
                    entry[name] = vals[0].clone()  # (what every rank holds, e.g. the local-step anchor: exact)
                    continue
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
    from ..distributed import DistributedLion

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
    optimizer._options_reported = True  # (its changed settings are this module's config_changes: not warned twice)
    try:
        optimizer.load_state_dict(sd, **_rank_option(optimizer, any_rank))
    finally:
        optimizer._options_reported = False
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
        # (its settings as its record would hold them, without building a whole state_dict to read them)
        current = dict(optimizer._options()) if hasattr(optimizer, "rule") else {}
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



#: Upper bound on the bytes one DCP read brings into memory while loading a sharded checkpoint
#: (tensors are read in groups of at most this size; one larger tensor is read alone).


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
