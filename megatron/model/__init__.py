"""GPT-2 architecture (no optimizer, I/O or logging)."""

from megatron.model.gpt2_model import (MODEL_SIZES, GPT2Model, GPTConfig, flops_per_token,
                                       num_parameters)
from megatron.model.language_model import parallel_lm_logits
from megatron.model.utils import get_ltor_masks_and_position_ids, param_groups_for_weight_decay
