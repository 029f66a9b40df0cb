"""Tasks of the convergence sweeps: data, model, per-worker gradients, evaluation.

``mnist1d``      MNIST-1D (4000 train / 1000 test) with :class:`dlion.lab.models.CNN1D`,
                 local batch 32; metric: test accuracy.
``digits``       scikit-learn digits (1437 / 360) with :class:`dlion.lab.models.DigitsCNN`,
                 local batch 32; metric: test accuracy.
``shakespeare``  character-level :class:`dlion.lab.models.CharGPT` (2 layers, 4 heads,
                 width 32, context 32) on the Shakespeare corpus, local batch 4
                 windows of 32 characters; metric: validation loss (nats/char).
``charlm``       the same corpus and sharding with a model that learns: CharGPT with
                 4 layers, 4 heads, width 160, context 64 (1.26 M parameters), local
                 batch 8 windows of 64 characters, 2000 steps with linear warm-up
                 over the first 5 % and cosine decay to 10 % of the peak lr for
                 every method; validation on 512 fixed windows (32,768 characters).

The budget is a fixed number of optimizer steps for every N (the global batch
grows with N: N·32 samples per step), so every N gets the same number of
updates and larger N sees more data; curves of the image tasks are plotted
against epochs (samples seen / training-set size). The compute available for
these sweeps (two shared CPU cores) could not pay for the papers' fixed-epoch
protocol at N = 32 with a useful number of steps.

Data parallelism: worker i of N gets its own disjoint shard. For the image
tasks it is :func:`dlion.lab.data.shard` of a per-epoch seeded permutation (like
``DistributedSampler``), cut into local batches; for Shakespeare the training
stream is cut into chunks of 4096 characters and chunk j belongs to worker
j mod N (every worker sees every play, no two workers share text), from which
each worker draws random windows with its own generator.

``tune=True`` holds out part of the *training* data as a validation set (the
last 500 training samples, or the last 5 % of the training stream) and trains
on the rest, so hyperparameters are never chosen on the test/validation data
that the sweep reports.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..data import char_batches, load_digits_split, load_mnist1d, load_shakespeare, shard
from ..models import CNN1D, CharGPT, DigitsCNN

__all__ = ["TASKS", "Task", "ImageTask", "ShakespeareTask", "make_task"]


@dataclass
class Task:
    name: str = ""
    tune: bool = False        # held-out part of the training data instead of the test/validation set
    metric: str = ""          # the reported metric
    higher_is_better: bool = True
    budget_unit: str = "steps"
    local_batch: int = 32
    num_evals: int = 10
    schedule: str = "constant"   # or "cosine": linear warm-up, then cosine decay (see lr_factor)
    warmup_frac: float = 0.05
    final_lr_frac: float = 0.1
    data: tuple = field(default=None, repr=False)

    def lr_factor(self, step: int, budget: int) -> float:
        """Multiplier of the peak lr for optimizer step ``step`` (0-based) of ``budget``.

        ``constant``: 1. ``cosine``: (step + 1)/W for the first W = ⌈warmup_frac·budget⌉
        steps, then f + (1 − f)·½(1 + cos(π·t)) with t = (step − W)/(budget − W) going
        from 0 to 1 and f = ``final_lr_frac``."""
        if self.schedule == "constant":
            return 1.0
        warm = max(1, math.ceil(self.warmup_frac * budget))
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, budget - warm)
        f = self.final_lr_frac
        return f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    def make_model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def batches(self, world_size: int, seed: int, budget: int) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Yield (x, y, progress) with x, y stacked per worker (N, B, ...); progress
        in budget units (epochs or steps) after this step."""
        raise NotImplementedError

    def eval_points(self, budget: int, world_size: int) -> list[float]:
        """``num_evals`` evenly spaced steps, the last one included."""
        every = max(1, budget // self.num_evals)
        pts = list(range(every, budget + 1, every))
        if pts[-1] != budget:
            pts.append(budget)
        return [float(p) for p in pts]

    def per_worker_grads(self, model: nn.Module, x: Tensor, y: Tensor,
                         stacked: Optional[list[Tensor]] = None) -> tuple[list[Tensor], float]:
        """Stacked gradients [(N, *p.shape) per parameter] and the mean training loss.
        ``stacked``: every worker's own parameters, (N, *p.shape) per parameter in the order of
        ``model.parameters()`` — worker i's gradient is taken at its own copy (the methods that
        talk every H steps); None: at the model's parameters, shared by all workers."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> float:
        raise NotImplementedError


def _causal_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("only the causal, dropout-free attention of CharGPT is supported here")
    T, S = q.shape[-2], k.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~keep, float("-inf"))
    return att.softmax(-1) @ v


@contextlib.contextmanager
def plain_attention():
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _causal_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _params(model: nn.Module, stacked: Optional[list[Tensor]] = None) -> tuple[dict[str, Tensor], Optional[int]]:
    """The parameters by name and vmap's in_dim for them: the model's own (None: shared by
    the workers) or the workers' stacked copies (0)."""
    if stacked is None:
        return {n: p.detach() for n, p in model.named_parameters()}, None
    names = [n for n, _ in model.named_parameters()]
    if len(names) != len(stacked):
        raise ValueError(f"expected {len(names)} stacked parameters, got {len(stacked)}")
    return dict(zip(names, stacked)), 0


@dataclass
class ImageTask(Task):
    name: str = "mnist1d"
    metric: str = "test_accuracy"
    num_evals: int = 12

    def __post_init__(self):
        if self.name == "mnist1d":
            xtr, ytr, xte, yte = load_mnist1d()
        elif self.name == "digits":
            xtr, ytr, xte, yte = load_digits_split()
        else:
            raise ValueError(self.name)
        if self.tune:
            xtr, ytr, xte, yte = xtr[:-500 if self.name == "mnist1d" else -300], \
                ytr[:-500 if self.name == "mnist1d" else -300], \
                xtr[-500 if self.name == "mnist1d" else -300:], ytr[-500 if self.name == "mnist1d" else -300:]
            self.metric = "val_accuracy"
        self.data = (xtr, ytr, xte, yte)

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return CNN1D() if self.name == "mnist1d" else DigitsCNN()

    def steps_per_epoch(self, world_size: int) -> int:
        n = self.data[0].shape[0]
        return max(1, (n // world_size) // self.local_batch)

    def batches(self, world_size, seed, budget):
        """``budget`` steps; progress is reported in steps, ``epoch_of`` converts."""
        xtr, ytr = self.data[0], self.data[1]
        spe = self.steps_per_epoch(world_size)
        B = self.local_batch
        step, epoch = 0, 0
        while True:
            idx = torch.stack([shard(xtr.shape[0], r, world_size, seed=seed, epoch=epoch) for r in range(world_size)])
            for s in range(spe):
                sel = idx[:, s * B:(s + 1) * B]
                step += 1
                yield xtr[sel], ytr[sel], float(step)
                if step >= budget:
                    return
            epoch += 1

    def epoch_of(self, step: float, world_size: int) -> float:
        """Samples seen after ``step`` steps, in training-set passes."""
        return step * world_size * self.local_batch / self.data[0].shape[0]

    def per_worker_grads(self, model, x, y, stacked=None):
        params, pdim = _params(model, stacked)

        def loss_fn(p, xb, yb):
            loss = F.cross_entropy(functional_call(model, p, (xb,)), yb)
            return loss, loss

        grads, losses = vmap(grad(loss_fn, has_aux=True), in_dims=(pdim, 0, 0))(params, x, y)
        return [grads[n] for n in params], float(losses.mean())

    @torch.no_grad()
    def evaluate(self, model):
        xte, yte = self.data[2], self.data[3]
        return float((model(xte).argmax(1) == yte).float().mean())


@dataclass
class ShakespeareTask(Task):
    name: str = "shakespeare"
    metric: str = "val_loss"
    higher_is_better: bool = False
    local_batch: int = 4
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    chunk: int = 4096
    eval_windows: int = 128

    def __post_init__(self):
        train, val, vocab = load_shakespeare()
        if self.tune:
            cut = int(len(train) * 0.95)
            train, val = train[:cut], train[cut:]
            self.metric = "tune_val_loss"
        self.vocab = vocab
        self.data = (train, val)
        g = torch.Generator().manual_seed(1234)
        self.val_x, self.val_y = char_batches(val, self.block_size, self.eval_windows, generator=g)

    def make_model(self, seed):
        torch.manual_seed(seed)
        return CharGPT(len(self.vocab), self.block_size, self.n_layer, self.n_head, self.n_embd)

    def worker_stream(self, rank: int, world_size: int) -> Tensor:
        train = self.data[0]
        n_chunks = train.numel() // self.chunk
        chunks = train[: n_chunks * self.chunk].view(n_chunks, self.chunk)
        return chunks[rank::world_size].reshape(-1)

    def batches(self, world_size, seed, budget):
        streams = [self.worker_stream(r, world_size) for r in range(world_size)]
        gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(world_size)]
        for step in range(budget):
            xs, ys = zip(*(char_batches(s, self.block_size, self.local_batch, generator=g)
                           for s, g in zip(streams, gens)))
            yield torch.stack(xs), torch.stack(ys), float(step + 1)

    def epoch_of(self, step: float, world_size: int) -> float:
        return step

    def per_worker_grads(self, model, x, y, stacked=None):
        # One vmap over the workers (and over their parameter copies, when ``stacked``
        # is given). scaled_dot_product_attention has no batching
        # rule on CPU (vmap would fall back to a slow per-sample loop), so inside
        # this call it is replaced by the textbook causal attention
        # softmax(QKᵀ/√d + causal mask)·V, equal to it within float rounding.
        params, pdim = _params(model, stacked)

        def loss_fn(p, xb, yb):
            loss = functional_call(model, p, (xb, yb))[1]
            return loss, loss

        with plain_attention():
            grads, losses = vmap(grad(loss_fn, has_aux=True), in_dims=(pdim, 0, 0))(params, x, y)
        return [grads[n] for n in params], float(losses.mean())

    @torch.no_grad()
    def evaluate(self, model):
        losses = [float(model(self.val_x[i:i + 64], self.val_y[i:i + 64])[1])
                  for i in range(0, self.val_x.shape[0], 64)]
        return sum(losses) / len(losses)


TASKS = ("mnist1d", "digits", "shakespeare", "charlm")

_CACHE: dict = {}


def make_task(name: str, tune: bool = False) -> Task:
    key = (name, tune)
    if key not in _CACHE:
        if name in ("mnist1d", "digits"):
            _CACHE[key] = ImageTask(name=name, tune=tune)
        elif name == "shakespeare":
            _CACHE[key] = ShakespeareTask(tune=tune)
        elif name == "charlm":
            _CACHE[key] = ShakespeareTask(name="charlm", tune=tune, local_batch=8, block_size=64, n_layer=4,
                                          n_head=4, n_embd=160, eval_windows=512, num_evals=20,
                                          schedule="cosine")
        else:
            raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return _CACHE[key]
