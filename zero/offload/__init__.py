"""ZeRO-Offload / ZeRO-Infinity: optimizer state on the host or in NVMe swap files."""

from zero.offload.aio import AsyncTensorIO
from zero.offload.optimizer import OffloadZeroOptimizer, OptimizerOffload
from zero.offload.state_store import NvmeStateStore, ResidentStateStore, SubGroup
