"""The one-file checkpoint format: rank 0 writes every rank's optimizer state into one verified file
(magic line, ``torch.save`` payload, SHA-256 trailer), atomically."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile

import torch
import torch.distributed as dist

from .common import (FORMAT_VERSION, CheckpointError, _broadcast_from_root, _checked_save_args, _compare_replicas,
    _fsync_dir, _gather_to_root, _group_info, _mean_state, _optimizer_config, _rng_state, _tensor_digest)

MAGIC = b"DLION-CHECKPOINT\n"
_TRAILER_TAG = b"\nDLION-SHA256 "
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1 + 20 + 1  # tag, hex digest, space, 20-digit length, newline


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


def read_file(path: str) -> dict:
    """Read and verify a one-file checkpoint; return its payload (see :func:`dlion.checkpoint.read`)."""
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
            from ..replicas import DesyncError
            cls = DesyncError if msg[0] == "DesyncError" else CheckpointError
            raise cls(f"checkpoint save to {path!r} failed on rank 0 ({msg[0]}): {msg[1]}")
    if outcome is not None:
        raise outcome


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
