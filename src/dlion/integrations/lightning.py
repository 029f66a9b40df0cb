"""Distributed Lion under Lightning: ``Trainer(strategy="dlion")``.

:class:`DLionStrategy` is Lightning's ``DDPStrategy`` (same launchers, process
group, samplers, ``reduce``/``broadcast`` for metrics) except that

* it does not wrap the model in DistributedDataParallel (``configure_ddp`` keeps the
  LightningModule as it is and broadcasts rank 0's buffers; DistributedLion
  broadcasts the parameters when it is built): gradients stay on their rank and
  the optimizer's vote is the only gradient communication;
* every optimizer must be a :class:`dlion.DistributedLion` (checked after
  ``configure_optimizers``; any other optimizer would let the replicas drift);
* ``block_backward_sync`` (what Lightning enters for every micro-batch but the last
  with ``accumulate_grad_batches``) enters the optimizers' ``no_sync``;
* checkpoints hold *every* rank's optimizer state: ``save_checkpoint`` gathers
  each rank's optimizer states to rank 0 (``checkpoint["dlion"]``), which writes
  the one file as usual; ``load_optimizer_state_dict`` gives rank r rank r's
  state. The usual ``optimizer_states`` entry stays (rank 0's), so the file also
  loads under the stock DDP strategy;
* with ``DistributedLion(delay=1)``, the step in flight is applied (``flush()``) when
  validation starts and when training ends, so that what is validated and what ``fit``
  leaves in the model has every step applied. Checkpoints written between two steps hold
  the parameters without the pending Δ and the optimizer state with it, so a resume
  loses nothing;
* :meth:`comm_figures` returns the communication figures of the optimizer steps
  since its previous call, a dict for ``self.log_dict`` (:class:`CommLogger`
  does that after every optimizer step).

Importing this module registers the strategy as ``"dlion"`` (and
``"dlion_spawn"``, ``"dlion_fork"``)::

    import dlion
    import dlion.integrations.lightning  # noqa: F401  registers strategy="dlion"

    class Model(L.LightningModule):
        def configure_optimizers(self):
            return dlion.DistributedLion(self.named_parameters(), lr=3e-4, weight_decay=0.1)

    trainer = L.Trainer(strategy="dlion", devices=4, accumulate_grad_batches=2,
                        callbacks=[dlion.integrations.lightning.CommLogger()])

Gradient clipping (``gradient_clip_val``) clips each rank's own gradient before its
vote (see the usage documentation); it is refused with
``DistributedLion(overlap=True)``, whose communication thread reads the gradients
during backward, before Lightning would clip them. ``manual_optimization`` works
too: call ``opt.step()`` on every rank, and wrap all micro-batches but the last in
``with self.trainer.strategy.block_backward_sync():`` (or ``opt.no_sync()``) when
accumulating with ``overlap=True``.

Buffers (BatchNorm statistics) are broadcast from rank 0 once at setup; unlike
DDP (``broadcast_buffers=True``) they are not re-broadcast every forward, so each
rank's running statistics follow its own data.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..distributed import DistributedLion
from ._common import CommMeter, anchored, to_cpu, broadcast_buffers, check_version, require_dlion, require_method

__all__ = ["DLionStrategy", "CommLogger", "OVERRIDDEN", "register"]

#: The DDPStrategy methods the strategy overrides, with the parameters it expects.
OVERRIDDEN = {
    "setup": ["self", "trainer"],
    "configure_ddp": ["self"],
    "block_backward_sync": ["self"],
    "save_checkpoint": ["self", "checkpoint", "filepath", "storage_options"],
    "load_optimizer_state_dict": ["self", "checkpoint"],
    "on_validation_start": ["self"],
    "on_validation_end": ["self"],
    "on_train_end": ["self"],
}

check_version("lightning")
for _name, _params in OVERRIDDEN.items():
    require_method(DDPStrategy, _name, _params)

CHECKPOINT_KEY = "dlion"


class DLionStrategy(DDPStrategy):
    """DDPStrategy without the DDP wrapper, for :class:`dlion.DistributedLion` (module docs)."""

    strategy_name = "dlion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(key) is not None:
                raise ValueError(f"DLionStrategy has no DDP wrapper; {key} does not apply.")
        super().__init__(*args, **kwargs)
        self._meters: list = []

    # -- setup ------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped (no gradient all-reduce, no DDP comm hooks)."""
        assert isinstance(self.model, LightningModule)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        opts = self.dlion_optimizers()
        if not opts:
            raise ValueError("DLionStrategy: configure_optimizers() returned no optimizer.")
        if trainer.gradient_clip_val and any(o.overlap for o in opts):
            raise ValueError(
                f"DLionStrategy: DistributedLion(overlap=True) sends each bucket's signs from gradient hooks during "
                f"backward, before Lightning clips the gradients (gradient_clip_val={trainer.gradient_clip_val}); "
                "the clipping would race with the communication thread. Drop gradient_clip_val or use overlap=False.")
        broadcast_buffers(self.model, opts[0])
        self._meters = [CommMeter(o) for o in opts]

    def dlion_optimizers(self) -> list[DistributedLion]:
        """The :class:`DistributedLion` optimizers (raises if any optimizer is another kind)."""
        return [require_dlion(o, "DLionStrategy") for o in self.optimizers]

    # -- delay=1: apply the step in flight before validating and at the end ----------
    def _flush(self) -> None:
        for o in self.dlion_optimizers():  # collective; Lightning runs these hooks on every rank at once
            o.flush()

    def on_validation_start(self) -> None:
        self._flush()
        # LocalDistributedLion: validate the anchor the ranks agree on, not each rank's local copy
        self._anchor_stack = anchored(*self.dlion_optimizers())
        self._anchor_stack.__enter__()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        stack, self._anchor_stack = getattr(self, "_anchor_stack", None), None
        if stack is not None:
            stack.close()
        super().on_validation_end()

    def on_train_end(self) -> None:
        self._flush()
        super().on_train_end()

    # -- gradient accumulation ------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self):
        """Enter every optimizer's ``no_sync`` (gradients accumulate without communication)."""
        with contextlib.ExitStack() as stack:
            for o in self.optimizers:
                inner = require_dlion(o, "DLionStrategy")
                stack.enter_context(inner.no_sync())
            yield None

    # -- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Collective (Lightning calls it on every rank): gather every rank's optimizer states
        into ``checkpoint["dlion"]`` on rank 0, which writes the file."""
        if "optimizer_states" in checkpoint and dist.is_available() and dist.is_initialized() \
                and self.world_size > 1:
            mine = to_cpu(checkpoint["optimizer_states"])
            everyone = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(mine, everyone, dst=0)
            if self.is_global_zero:
                checkpoint = dict(checkpoint)
                # Rank 0's entry is the very object in "optimizer_states": torch.save stores its tensors once.
                everyone[0] = checkpoint["optimizer_states"] = mine
                checkpoint[CHECKPOINT_KEY] = {"world_size": self.world_size, "optimizer_states": everyone}
        with anchored(*self.optimizers):  # the model as the anchor (its tensors share the parameters' storage)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Rank r loads the optimizer states that rank r saved."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            if self.world_size > 1:
                import warnings

                warnings.warn("DLionStrategy: the checkpoint holds one rank's optimizer state (not written by "
                              "DLionStrategy?); every rank loads it, so all ranks start from the same momenta.",
                              stacklevel=2)
            with contextlib.ExitStack() as stack:  # deliberately: one rank's state on every rank
                for o in self.optimizers:
                    stack.enter_context(require_dlion(o, "DLionStrategy").accepting_any_rank())
                return super().load_optimizer_state_dict(checkpoint)
        if saved["world_size"] != self.world_size:
            raise ValueError(f"DLionStrategy: the checkpoint was written by {saved['world_size']} processes; this "
                             f"job has {self.world_size}. Resume with the same number of processes.")
        super().load_optimizer_state_dict({"optimizer_states": saved["optimizer_states"][self.global_rank]})
        for m in self._meters:
            m.reset()

    # -- logging ------------------------------------------------------------------------
    def comm_figures(self) -> dict:
        """Communication figures of the optimizer steps since the previous call (first
        optimizer; with several, keys get the optimizer's index), for ``self.log_dict``."""
        out: dict = {}
        for i, m in enumerate(self._meters):
            figs = m.read()
            out.update(figs if i == 0 else {f"{k}_{i}": v for k, v in figs.items()})
        return out

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("dlion", "popen"), ("dlion_spawn", "spawn"), ("dlion_fork", "fork")):
            if name in strategy_registry and strategy_registry[name]["strategy"] is cls:
                continue
            strategy_registry.register(name, cls, description=f"Distributed Lion without DDP (start_method "
                                                              f"'{start_method}')",
                                       start_method=start_method, override=True)


class CommLogger(Callback):
    """Logs :meth:`DLionStrategy.comm_figures` after every optimizer step (``on_step``,
    rank 0's figures go to the logger)."""

    def __init__(self, prog_bar: bool = False):
        self.prog_bar = prog_bar
        self._steps = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, DLionStrategy) or trainer.global_step == self._steps:
            return
        self._steps = trainer.global_step
        figures = strategy.comm_figures()
        if len(figures) > 1:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=self.prog_bar, rank_zero_only=True)


def register() -> None:
    """Register ``"dlion"`` (done at import; again after a registry reset)."""
    DLionStrategy.register_strategies(StrategyRegistry)


register()
