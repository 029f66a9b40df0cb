"""Shared pieces of the framework-adapter tests (tests/test_integrations_*.py).

Traffic is counted independently of dlion: ``/proc/self/io``'s ``wchar`` is every byte a
process hands to write()/writev() — Gloo's TCP transport sends through writev(), so it
includes every collective, also those issued from C++ (DDP's reducer never goes through
the Python ``torch.distributed`` functions, and dlion binds some of them at import time,
so wrapping those functions would miss traffic). Windows are placed around the training
steps only (no checkpoint or log writes inside), and every test checks the counter on a
DDP run too, where it must see the fp32 all-reduce.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch

try:  # the spawn helper may move with the rest of the tooling
    from dlion.lab.spawn import spawn  # type: ignore  # noqa: F401
except ImportError:
    from dlion.spawn import spawn  # noqa: F401

def need(module: str):
    """Import ``module`` or skip the test module — except when DLION_REQUIRE_INTEGRATIONS=1
    (scripts/test.sh sets it; its environment installs the pinned frameworks), where a
    missing framework is an error rather than a silent skip."""
    import importlib

    import pytest

    if os.environ.get("DLION_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def require_proc_io():
    """Skip where /proc/self/io is missing (not Linux) — an error under DLION_REQUIRE_INTEGRATIONS=1."""
    import pytest

    if proc_io_available():
        return
    if os.environ.get("DLION_REQUIRE_INTEGRATIONS") == "1":
        raise RuntimeError("the integration tests count bytes through /proc/self/io (Linux)")
    pytest.skip("needs Linux /proc/self/io to count bytes")


WORLD = 2
WORKER_TIMEOUT_S = 90  # a worker that is still running after this dumps its stacks and exits (a hang fails)
PG_TIMEOUT_S = 60.0


def proc_io_available() -> bool:
    return os.path.exists("/proc/self/io")


def wchar() -> int:
    """Bytes this process (all its threads) has passed to write-like system calls."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


class Window:
    """Sums wchar over explicitly opened and closed windows."""

    def __init__(self):
        self.total = 0
        self.windows = 0
        self._start = None

    def open(self) -> None:
        assert self._start is None, "window already open"
        self._start = wchar()

    def close(self) -> None:
        assert self._start is not None, "window not open"
        self.total += wchar() - self._start
        self._start = None
        self.windows += 1


def start_worker(rank: int, world: int, port: int = 29531) -> None:
    """Environment a launcher (torchrun, accelerate launch) would have set, and a watchdog."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True, file=sys.stderr)


def stop_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()


def tiny_gpt2(seed: int):
    """A one-layer GPT-2 built from a config (no download), dropout off, ~76k parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Fixed synthetic token sequences: a noisy repeating pattern a model can learn a little of."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, vocab, (n, 1), generator=g)
        steps = torch.randint(1, 7, (n, 1), generator=g)
        seq = (base + steps * torch.arange(length)) % vocab
        noise = torch.rand(n, length, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, vocab, (n, length), generator=g), seq)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def snapshot(model, opt) -> dict:
    """Parameters (by name, tied ones once) and this rank's optimizer state, on the CPU."""
    from dlion.integrations import unwrap_optimizer

    inner = unwrap_optimizer(opt)
    sd = inner.state_dict()
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "momenta": {k: v["exp_avg"].detach().cpu().clone() for k, v in sd["state"].items()},
            "steps": {k: float(v["step"]) for k, v in sd["state"].items()},
            "comm_steps": inner.comm_stats.steps,
            "num_params": inner.num_params}


def _pad4(nbytes: int) -> int:
    return nbytes + (-nbytes) % 4


def onebit_bytes_sent(buckets, world: int, up: str = "runs", down: str = "ternary") -> int:
    """Bytes one rank sends in one optimizer step of ``comm="1bit"`` (Lion Cub's 1-bit
    all-reduce), counted here from its wire format, not by dlion. Per bucket of padded length
    n with k parameters (``buckets``: (n, k) pairs) on N ranks, each rank owns a chunk of
    c = n/N coordinates and a block carries cap = max(4, c // 3200) zero-run slots:

    * way up, an all_to_all: to each of the N − 1 others, a header of 3 + ⌈k/16⌉ int32 words
      (status, digest, run count, has-gradient bitmap) plus 2·cap words of run slots, and the
      signs of that rank's chunk, 1 bit each (``up="runs"``); or the same header without slots
      and base-3 digits, 5 per byte (``up="ternary"``);
    * way back, an all_gather: this rank's chunk of vote results to each of the N − 1 others,
      base-3 digits (``down="ternary"``: an even N with ties='zero' has ties, three values) or
      1 bit each after a header of 1 + 2·cap words (``down="runs"``).

    Payloads are padded to 4 bytes."""
    total = 0
    for n, k in buckets:
        c = n // world
        cap = max(4, c // 3200)
        if up == "runs":
            up_block = 4 * (3 + -(-k // 16) + 2 * cap) + _pad4(c // 8)
        else:
            up_block = 4 * (3 + -(-k // 16)) + _pad4(c // 5)
        down_block = _pad4(c // 5) if down == "ternary" else 4 * (1 + 2 * cap) + _pad4(c // 8)
        total += (world - 1) * (up_block + down_block)
    return total


def assert_bitwise_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_replicas_and_momenta(snaps: list) -> None:
    """Parameters bitwise equal on every rank; momenta present for every parameter and
    different between ranks (each rank keeps its own)."""
    for r in range(1, len(snaps)):
        assert_bitwise_equal(snaps[0]["params"], snaps[r]["params"], f"parameters of rank 0 vs rank {r}")
    n = len(snaps[0]["params"])
    for r, s in enumerate(snaps):
        assert len(s["momenta"]) == n, f"rank {r} has momenta for {len(s['momenta'])} of {n} parameters"
        assert all(bool(m.abs().sum() > 0) for m in s["momenta"].values()), f"rank {r} has an all-zero momentum"
    differ = sum(not torch.equal(snaps[0]["momenta"][k], snaps[1]["momenta"][k]) for k in snaps[0]["momenta"])
    assert differ == n, f"only {differ} of {n} momenta differ between rank 0 and rank 1"


def replay_delayed(opt, params, steps, flush_after: set) -> tuple:
    """Replay a recorded run through a bare ``DistributedLion(delay=1)`` ``opt`` over ``params``:
    ``steps`` is a list of (gradients, lrs before the step or None, lrs at the step's end or None);
    ``flush()`` after the steps in ``flush_after``, with the end-of-step lrs (a Δ is applied at
    the lr its group holds then). Returns ([(step, parameters after its flush)], final parameters)."""
    def set_lrs(lrs):
        for group, lr in zip(opt.param_groups, lrs or []):
            group["lr"] = lr

    flushed = []
    for step, (grads, lrs, end_lrs) in enumerate(steps, start=1):
        for p, g in zip(params, grads):
            p.grad = g
        set_lrs(lrs)
        opt.step()
        if step in flush_after:
            set_lrs(end_lrs)
            opt.flush()
            flushed.append((step, [p.detach().clone() for p in params]))
    return flushed, [p.detach().clone() for p in params]
