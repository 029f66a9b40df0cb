"""dlion: communication-efficient distributed training with the Lion optimizer."""

__version__ = "0.1.0"

from .lion import Lion
from .distributed import DistributedLion

__all__ = ["Lion", "DistributedLion", "__version__"]
