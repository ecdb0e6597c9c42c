"""The training configuration: flags (`flags.py`) -> what `--load`'s checkpoint supplies
(`from_checkpoint.py`) -> validation and derived values (`resolve.py`, with the engine's
DeepSpeed config in `engine.py` and activation checkpointing in `activation.py`) -> one
frozen `TrainConfig` of per-concern sections (`sections.py`)."""

from megatron.config.resolve import resolve_config  # noqa: F401
from megatron.config.sections import TrainConfig  # noqa: F401
