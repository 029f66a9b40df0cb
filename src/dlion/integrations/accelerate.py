"""Distributed Lion in an Accelerate training loop.

``accelerator.prepare(model, ...)`` wraps the model in DistributedDataParallel on
every multi-process setup (``MULTI_CPU`` included), and DDP all-reduces fp32
gradients during backward. :func:`prepare` prepares the model *without* that
wrapper (``prepare_model(model, evaluation_mode=True)``: device placement, mixed
precision and ``torch.compile`` still apply, and the model is marked prepared so a
later ``accelerator.prepare`` leaves it alone), builds the optimizer on the
prepared parameters, plugs ``model.no_sync = optimizer.no_sync`` (what
``accelerator.accumulate`` and ``accelerator.no_sync`` call), and makes
``accelerator.save_state`` / ``load_state`` save and load *every* rank's optimizer
state (``optimizer_rank{r}.pt`` in the checkpoint folder, one per rank)::

    from accelerate import Accelerator
    import dlion
    from dlion.integrations import accelerate as dlion_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, opt, loader = dlion_accelerate.prepare(
        accelerator, model, lambda params: dlion.DistributedLion(params, lr=3e-4), loader)
    meter = dlion_accelerate.CommMeter(opt)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            accelerator.log(meter.read())
    accelerator.save_state("ckpt")          # model once, every rank's momenta
    accelerator.load_state("ckpt")          # rank r gets rank r's optimizer state

Accelerate's own ``optimizer.bin`` in the folder holds rank 0's state only (Accelerate
writes it from the main process); the per-rank files are what :func:`prepare`'s
hook loads, after Accelerate has loaded ``optimizer.bin``.

With ``DistributedLion(delay=1)``, call ``optimizer_of(opt).flush()`` on every rank after the
last step and before evaluating: a hand-written loop has no point where the adapter could
apply the pending Δ for you (checkpoints carry it either way).

Not supported: DeepSpeed, FSDP, Megatron-LM (they own the gradients), and fp16
with a ``GradScaler`` (the scaler skips ``step()`` on a rank whose gradients
overflowed while the other ranks wait for its vote; use bf16, or fp32, and
``DistributedLion(nonfinite="skip")``, which skips a step on every rank together).
``accelerator.clip_grad_norm_`` clips each rank's own gradient; see the usage
documentation for what that does to the vote. Do not clip (or otherwise change
gradients after backward) with ``DistributedLion(overlap=True)``: its
communication thread reads the gradients during backward, so the clipping would
race with it (the Trainer and Lightning adapters refuse that combination; a
hand-written loop cannot be checked).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Union

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..base import order_warning_silenced
from ..distributed import DistributedLion
from ._common import (CommMeter, check_version, load_rank_state, require_dlion, require_method, save_rank_state,
                      unwrap_optimizer)

__all__ = ["prepare", "optimizer_of", "CommMeter", "RankOptimizerState"]

check_version("accelerate")
# Public methods, but the adapter relies on their exact behaviour (tests pin it).
require_method(Accelerator, "prepare_model", ["self", "model", "device_placement", "evaluation_mode"])
require_method(Accelerator, "register_save_state_pre_hook", ["self", "hook"])
require_method(Accelerator, "register_load_state_pre_hook", ["self", "hook"])
require_method(Accelerator, "register_for_checkpointing", ["self", "objects"])

_UNSUPPORTED = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
                DistributedType.MEGATRON_LM: "Megatron-LM"}


class RankOptimizerState:
    """Registered with ``accelerator.register_for_checkpointing`` by :func:`prepare`.

    ``save_state`` calls a save pre-hook on every rank with the checkpoint folder:
    each rank writes ``optimizer_rank{r}.pt`` there. The object's own ``state_dict``
    (written by the main process as ``custom_checkpoint_{i}.pkl``) is a small
    manifest. ``load_state`` calls a load pre-hook with the folder (remembered),
    loads Accelerate's ``optimizer.bin`` (rank 0's state) into every rank, then this
    object's ``load_state_dict``, which replaces it by the rank's own file."""

    def __init__(self, accelerator: Accelerator, optimizer: Any):
        self.optimizer = require_dlion(optimizer, "dlion.integrations.accelerate")
        self._input_dir = None
        self._handles = [accelerator.register_save_state_pre_hook(self._before_save),
                         accelerator.register_load_state_pre_hook(self._before_load)]

    def _before_save(self, models, weights, output_dir) -> None:
        save_rank_state(output_dir, self.optimizer)

    def _before_load(self, models, input_dir) -> None:
        self._input_dir = input_dir
        # Accelerate then loads its one optimizer.bin (rank 0's state) into every rank, deliberately:
        # our load_state_dict below replaces it by the rank's own file (and ends this allowance).
        self._end_any_rank()
        self._any_rank = contextlib.ExitStack()
        self._any_rank.enter_context(self.optimizer.accepting_any_rank())

    def _end_any_rank(self) -> None:
        stack, self._any_rank = getattr(self, "_any_rank", None), None
        if stack is not None:
            stack.close()

    def state_dict(self) -> dict:
        return {"format": "dlion-accelerate", "world_size": self.optimizer.world_size,
                "steps": self.optimizer.comm_stats.steps}

    def load_state_dict(self, state: dict) -> None:
        self._end_any_rank()
        if self._input_dir is None:
            raise RuntimeError("RankOptimizerState is loaded by accelerator.load_state(), which tells it the folder.")
        if state.get("world_size") != self.optimizer.world_size:
            raise ValueError(f"this Accelerate checkpoint was written by {state.get('world_size')} processes; "
                             f"this job has {self.optimizer.world_size}. Resume with the same number of processes.")
        directory, self._input_dir = self._input_dir, None
        load_rank_state(directory, self.optimizer)


def prepare(accelerator: Accelerator, model, optimizer: Union[DistributedLion, Callable[..., Any], Any], *args,
            device_placement=None):
    """Prepare ``model`` without DDP, the optimizer and any other objects (data loaders,
    schedulers) for an Accelerate loop; returns ``(model, optimizer, *args)`` prepared.

    ``optimizer`` is a :class:`dlion.DistributedLion`, or a factory called with the
    prepared model's parameters (``lambda params: DistributedLion(params, ...)``):
    use the factory on GPUs, where preparing moves the parameters to the device and
    DistributedLion lays out its buffers on the parameters' device at construction.
    ``device_placement`` (one entry per element of ``(model, optimizer, *args)``) is
    passed on to Accelerate.
    """
    kind = accelerator.distributed_type
    if kind in _UNSUPPORTED:
        raise ValueError(f"dlion.integrations.accelerate does not support {_UNSUPPORTED[kind]}: it shards or "
                         "reduces gradients itself. Use a plain multi-process launch.")
    if accelerator.scaler is not None:
        raise ValueError("dlion.integrations.accelerate: fp16 with a GradScaler can skip step() on one rank only "
                         "(the others would wait for its vote). Use mixed_precision='bf16' or 'no'.")
    places = list(device_placement) if device_placement is not None else [None] * (2 + len(args))
    if len(places) != 2 + len(args):
        raise ValueError(f"device_placement needs {2 + len(args)} entries (model, optimizer, *args).")
    model = accelerator.prepare_model(model, device_placement=places[0], evaluation_mode=True)
    if not isinstance(optimizer, torch.optim.Optimizer):
        with order_warning_silenced():  # (the factory gets the parameters without names, in the model's order)
            optimizer = optimizer(model.parameters())
    inner = require_dlion(optimizer, "dlion.integrations.accelerate.prepare")
    model.no_sync = inner.no_sync  # accelerator.accumulate()/no_sync() look it up with getattr(model, "no_sync")
    if args:
        prepared = accelerator.prepare(optimizer, *args, device_placement=places[1:])
    else:
        prepared = (accelerator.prepare(optimizer, device_placement=places[1:]),)
    accelerator.register_for_checkpointing(RankOptimizerState(accelerator, prepared[0]))
    return (model, *prepared)


def optimizer_of(prepared_optimizer) -> DistributedLion:
    """The :class:`DistributedLion` inside Accelerate's ``AcceleratedOptimizer``."""
    return unwrap_optimizer(prepared_optimizer)
