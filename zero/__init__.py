"""zero: a self-contained, DeepSpeed-compatible training engine (torch and numpy only).

`zero.initialize(...)` gives what `deepspeed.initialize(...)` gives; DeepSpeed JSON configs
and the `--deepspeed`/`--deepspeed_config` flags work unchanged. zero never imports megatron.
"""

import sys

from zero.config.arguments import add_config_arguments, resolve_config_from_args
from zero.config.deepspeed_config import DeepSpeedConfig
from zero.errors import CheckpointError, ConfigError, ZeroError
from zero.optim.loss_scaler import DynamicLossScaler, StaticLossScaler, build_loss_scaler
from zero.optim.lr_schedules import (LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                               build_lr_scheduler)
from zero.optim.optimizers import build_optimizer
from zero.tiling import TiledLinear, TiledLinearReturnBias
from zero.stages.partition_parameters import (GatheredParameters, Init, register_external_parameter,
                                       unregister_external_parameter)
from zero import activation_checkpointing as checkpointing  # deepspeed.checkpointing's name

from zero.engine import initialize
from zero.checkpoint.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                               get_fp32_state_dict_from_zero_checkpoint,
                               load_state_dict_from_zero_checkpoint)

sys.modules[__name__ + ".checkpointing"] = checkpointing  # `import zero.checkpointing`
