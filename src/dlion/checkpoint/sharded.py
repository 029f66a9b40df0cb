"""The sharded checkpoint format (``save(..., sharded=True)``): a ``torch.distributed.checkpoint``
directory that every rank writes its own part of, read back in bounded chunks."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .common import (FORMAT_VERSION, CheckpointError, _broadcast_from_root, _checked_save_args, _compare_replicas,
    _fsync_dir, _group_info, _optimizer_config, _rng_state, _tensor_digest)

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
        rank at a time (memory: this rank's result plus one fp64 accumulator group, and the first
        rank's copy of it to keep what every rank holds alike exact)."""
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
            totals, dtypes, firsts, alike = {}, {}, {}, {}
            for r in range(n):
                mine = [k for k in keys if r in owners[k]]
                got = self._read_chunked([_momentum_key(r, *k) for k in mine])
                for k in mine:
                    v = got[_momentum_key(r, *k)]
                    if k not in totals:
                        totals[k] = torch.zeros(v.shape, dtype=torch.float64)
                        dtypes[k], firsts[k], alike[k] = v.dtype, v, True
                    elif alike[k]:
                        alike[k] = torch.equal(v, firsts[k])
                    if r == src:
                        dtypes[k] = v.dtype
                    totals[k] += v.to(torch.float64)
            for (pid, name), total in totals.items():
                if alike[(pid, name)] and len(owners[(pid, name)]) == n:  # (every rank's alike: kept exact)
                    state[pid][name] = firsts[(pid, name)].clone()
                else:
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
