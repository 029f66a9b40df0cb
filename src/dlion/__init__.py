"""dlion: communication-efficient distributed training with the Lion optimizer.

Distributed Lion (Liu et al. 2024, arXiv 2404.00438) with Lion Cub's communication
(Ishikawa et al. 2024, arXiv 2411.16462), on plain ``torch.distributed``.
"""

__version__ = "0.3.0"

from .lion import Lion
from .distributed import DistributedLion
from .replicas import DesyncError
from .hierarchical import HierarchicalDistributedLion
from .local import LocalDistributedLion
from .simulate import SimulatedDistributedLion

__all__ = ["Lion", "DistributedLion", "DesyncError", "SimulatedDistributedLion", "HierarchicalDistributedLion",
           "LocalDistributedLion", "__version__"]
