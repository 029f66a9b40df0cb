"""Distributed Lion under the Hugging Face ``Trainer``.

:class:`DLionTrainer` is a ``transformers.Trainer`` that

* builds a :class:`dlion.DistributedLion` on every rank inside ``train()`` (from
  ``optimizer_cls_and_kwargs=(DistributedLion, {...})``; without it, from
  ``args.learning_rate``). As for any Trainer optimizer, the weight decay comes
  from ``args.weight_decay`` (the Trainer's parameter groups: weights decay,
  biases and norms do not); a ``weight_decay`` in the kwargs is overridden (warned);
* prepares the model through Accelerate *without* the DistributedDataParallel
  wrapper (``prepare_model(model, evaluation_mode=True)``, which also marks it
  prepared, so the Trainer's own ``accelerator.prepare`` leaves it alone): no fp32
  gradient all-reduce, the optimizer's vote is the only gradient communication;
* plugs ``model.no_sync = optimizer.no_sync``, which is what the Trainer's
  gradient-accumulation loop calls for every micro-batch but the last;
* saves *every* rank's optimizer state in each checkpoint
  (``checkpoint-N/optimizer_rank{r}.pt``, written by rank r) and loads rank r's
  file on rank r in ``train(resume_from_checkpoint=...)``. The stock Trainer writes
  ``optimizer.pt`` from the main process only and loads it on every rank, which
  would replace every rank's momentum by rank 0's;
* adds the communication figures of the steps since the previous log to each
  training log (``comm/bytes_sent_per_step``, ``comm/bits_per_param_per_step``, ...);
* with ``DistributedLion(delay=1)``, applies the step in flight (``flush()``) at the end
  of every step after which the Trainer evaluates, saves or stops, so that what it
  evaluates, saves and returns has every step applied (:class:`ApplyDelayedStep`).

Usage — the only change from a plain Trainer script is the class and the optimizer::

    trainer = DLionTrainer(model=model, args=args, train_dataset=ds,
                           optimizer_cls_and_kwargs=(dlion.DistributedLion, {"lr": 3e-4}))
    trainer.train()          # torchrun / accelerate launch, as with DDP

Gradient clipping: ``args.max_grad_norm`` (1.0 by default) clips *each rank's own*
gradient before its vote, not the averaged gradient as under DDP. Scaling a
gradient does not change its sign, but it does change this rank's
c = β1·m + (1 − β1)·g (a clipped g weighs less against the momentum) and the
momentum it feeds. Set ``max_grad_norm=0`` to vote on unclipped gradients; it
must be 0 with ``DistributedLion(overlap=True)``, which reads the gradients from a
communication thread during backward, before the Trainer would clip them (checked).

Not supported: DeepSpeed, FSDP, tensor parallelism and models loaded already
sharded (``is_distributed_loading_by_transformers``; that path registers gradient
all-reduce hooks), and ``fp16`` (the GradScaler can skip ``step()`` on one rank
only; use ``bf16`` or fp32).

This module overrides private Trainer methods (``_wrap_model``,
``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``); it was
tested with the versions in :data:`dlion.integrations.TESTED_VERSIONS` and checks
at import that those methods still exist with the expected parameters.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode

from ..base import order_warning_silenced
from ..distributed import DistributedLion
from ._common import (CommMeter, anchored, check_version, load_rank_state, rank_state_exists_everywhere, require_dlion,
                      require_method, save_rank_state)

__all__ = ["DLionTrainer", "ApplyDelayedStep", "OVERRIDDEN"]

#: The Trainer methods the adapter overrides, with the parameters it expects.
OVERRIDDEN = {
    "create_optimizer": ["self", "model"],
    "_wrap_model": ["self", "model", "training", "dataloader"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "log": ["self", "logs", "start_time"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "evaluate": ["self", "eval_dataset", "ignore_keys", "metric_key_prefix"],
}

check_version("transformers")
check_version("accelerate")
for _name, _params in OVERRIDDEN.items():
    require_method(Trainer, _name, _params)

SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_NAME = "optimizer.pt"


class ApplyDelayedStep(TrainerCallback):
    """``delay=1``: apply the Δ in flight before the Trainer evaluates, saves or stops.

    Added by :class:`DLionTrainer` after every other callback, so the control flags
    it reads are final for the step. ``flush()`` is collective; the flags are the
    same on every rank (they follow the step count, and an early stop follows
    metrics that the Trainer has gathered). The next ``step()`` then has nothing to
    apply: the run's trajectory is the delayed rule with the pending Δ applied at
    those steps, the same on every rank and after a resume."""

    def __init__(self, trainer: "DLionTrainer"):
        self.trainer = trainer

    def _flush(self) -> None:
        if self.trainer.optimizer is not None:
            self.trainer.dlion_optimizer.flush()  # nothing to do without delay or with nothing in flight

    def _maybe_flush(self, state, control) -> None:
        if (control.should_evaluate or control.should_save or control.should_training_stop
                or (state.max_steps > 0 and state.global_step >= state.max_steps)):
            self._flush()

    def on_step_end(self, args, state, control, **kwargs):
        self._maybe_flush(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._maybe_flush(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()  # (already done at the last step; kept for a stop the flags did not show)


class DLionTrainer(Trainer):
    """A ``transformers.Trainer`` for :class:`dlion.DistributedLion` without DDP (module docs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            raise ValueError("DLionTrainer does not support DeepSpeed or FSDP: they shard or reduce gradients "
                             "themselves. Launch plain data parallel (torchrun / accelerate launch).")
        if self.is_distributed_loading_by_transformers:
            raise ValueError("DLionTrainer does not support models loaded already sharded (tp_plan / device_mesh): "
                             "that path registers gradient all-reduce hooks.")
        if self.args.fp16:
            raise ValueError("DLionTrainer: fp16's GradScaler can skip step() on one rank only while the others wait "
                             "for its vote; use bf16=True or fp32 (DistributedLion(nonfinite='skip') skips "
                             "non-finite steps on every rank together).")
        if self.optimizer_cls_and_kwargs is None and self.optimizer is None:
            self.optimizer_cls_and_kwargs = (DistributedLion, {"lr": self.args.learning_rate})
        self.comm_meter: Optional[CommMeter] = None
        self.add_callback(ApplyDelayedStep(self))

    @property
    def dlion_optimizer(self) -> DistributedLion:
        """The :class:`DistributedLion` inside the Trainer's (Accelerate-wrapped) optimizer."""
        return require_dlion(self.optimizer, "DLionTrainer")

    def create_optimizer(self, model=None):
        kwargs = (self.optimizer_cls_and_kwargs or (None, {}))[1]
        if self.optimizer is None and "weight_decay" in kwargs and kwargs["weight_decay"] != self.args.weight_decay:
            warnings.warn(f"DLionTrainer: weight_decay={kwargs['weight_decay']} in optimizer_cls_and_kwargs is "
                          f"overridden by the Trainer's parameter groups (args.weight_decay={self.args.weight_decay} "
                          "for weights, 0 for biases and norms); set TrainingArguments(weight_decay=...).",
                          stacklevel=2)
        with order_warning_silenced():  # (the Trainer's groups come without names, in named_parameters() order)
            opt = super().create_optimizer(model)
        inner = require_dlion(opt, "DLionTrainer")
        if inner.overlap and self.args.max_grad_norm and self.args.max_grad_norm > 0:
            raise ValueError(
                f"DLionTrainer: DistributedLion(overlap=True) sends each bucket's signs from gradient hooks during "
                f"backward, before the Trainer clips the gradients (max_grad_norm={self.args.max_grad_norm}); the "
                "clipping would race with the communication thread. Set max_grad_norm=0 or overlap=False.")
        if inner.overlap and self.args.include_num_input_tokens_seen not in ("no", False):
            raise ValueError(
                "DLionTrainer: include_num_input_tokens_seen gathers token counts right after each backward, while "
                "DistributedLion(overlap=True) is still communicating from its own thread on the same process group; "
                "the collectives could interleave differently on different ranks. Use one or the other.")
        self.comm_meter = CommMeter(inner)
        return opt

    def _wrap_model(self, model, training=True, dataloader=None):
        model = super()._wrap_model(model, training, dataloader)
        if training and self.args.parallel_mode == ParallelMode.DISTRIBUTED and self.optimizer is not None:
            # Device placement, autocast and compile as usual, no DDP wrapper; marks the model
            # prepared, so the Trainer's accelerator.prepare(model, optimizer) keeps it as it is.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            model.no_sync = self.dlion_optimizer.no_sync
        return model

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        """Saves the parameters the ranks agree on (with :class:`dlion.LocalDistributedLion`, the
        anchor: between syncs every rank trains its own copy, kept in its optimizer state)."""
        with anchored(self.optimizer):
            return super().save_model(output_dir, _internal_call)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Evaluates the parameters the ranks agree on (the anchor of a LocalDistributedLion)."""
        with anchored(self.optimizer):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_rank_state(output_dir, self.dlion_optimizer)  # every rank, its own file (collective)
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the scheduler's "save the optimizer too" note
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        opt = self.dlion_optimizer
        if not rank_state_exists_everywhere(checkpoint, opt):
            if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
                warnings.warn(f"DLionTrainer: {checkpoint!r} has no per-rank optimizer files (a stock Trainer "
                              "checkpoint?); every rank loads the one optimizer.pt, so all ranks start from the "
                              "same momenta.", stacklevel=2)
                with opt.accepting_any_rank():  # deliberately: rank 0's state on every rank
                    super()._load_optimizer_and_scheduler(checkpoint)
                return
        load_rank_state(checkpoint, opt)  # raises on every rank if any rank lacks its file
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
        if self.comm_meter is not None:
            self.comm_meter.reset()

    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        if self.comm_meter is not None and "loss" in logs:
            logs = {**logs, **self.comm_meter.read()}
        super().log(logs, start_time)
