"""zero.ops: the optimizer kernels DeepSpeed builds as C++ extensions, here on torch's own."""

from zero.ops.cpu_adam import CPUAdam, DeepSpeedCPUAdam, adam_update

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "adam_update"]
