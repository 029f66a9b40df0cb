"""Adapters for the training frameworks most users train with.

Hugging Face ``Trainer`` (:mod:`dlion.integrations.hf`), Accelerate loops
(:mod:`dlion.integrations.accelerate`) and Lightning
(:mod:`dlion.integrations.lightning`) all wrap the model in
``DistributedDataParallel``, which all-reduces fp32 gradients during backward;
with :class:`dlion.DistributedLion` on top, the 1-bit vote would then save
nothing. Each adapter keeps the model unwrapped, routes the framework's
gradient-accumulation switch to :meth:`DistributedLion.no_sync`, saves and
loads *every* rank's optimizer state (each rank has its own momentum) with the
framework's own checkpoints, and reports per-step communication figures.

Importing this package imports no framework; each submodule imports its own
framework when it is imported. The framework versions the adapters were
tested with are in :data:`TESTED_VERSIONS`, the ranges they support (what
``pip install "dlion[hf]"`` / ``"dlion[lightning]"`` accepts) in
:data:`SUPPORTED_VERSIONS`; importing an adapter warns outside those ranges and
raises where a private method it overrides has other parameters.
"""

from ._common import SUPPORTED_VERSIONS, TESTED_VERSIONS, CommMeter, comm_figures, unwrap_optimizer

__all__ = ["TESTED_VERSIONS", "SUPPORTED_VERSIONS", "CommMeter", "comm_figures", "unwrap_optimizer"]
